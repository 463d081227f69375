//! `/ui/approvals`: the approvers' web page on the admin listener.
//! Server-rendered HTML, no script, no external asset; every value
//! escaped (a hostile sandbox chooses the names it misses on).
//!
//! - `GET /ui/approvals` without a session: the login form, which `POST
//!   /ui/login` takes a token of `[admin] approver_tokens` from and
//!   answers with a session cookie (`HttpOnly`, `SameSite=Strict`, path
//!   `/ui/`, 8 hours).
//! - With a session: the pending approvals the token may see
//!   (destination, org, client, first and last seen, count), each with a
//!   form to allow it for a TTL (10 minutes, 1 hour, 8 hours) or deny it,
//!   and the grants held.
//! - `POST /ui/approvals/{id}` answers one; every form carries the
//!   session's own CSRF token, checked in constant time, besides the
//!   `SameSite=Strict` cookie.
//! - `POST /ui/logout` ends the session.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{Method, Request, Response, StatusCode};
use maud::{html, Markup, DOCTYPE};

use super::approvals::{self, Answer, Approvers};
use crate::config::ApproverToken;
use crate::serve::http::{full, Body};

/// Sessions held at once; past it, the oldest goes.
const MAX_SESSIONS: usize = 256;
/// How long a session lasts.
const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// The session cookie's name.
const COOKIE: &str = "palisade_approver";
/// The TTLs the page offers.
const TTLS: [(&str, &str); 3] = [("10m", "10 minutes"), ("1h", "1 hour"), ("8h", "8 hours")];

struct Session {
    approver: ApproverToken,
    csrf: String,
    until: Instant,
}

/// The page's sessions, bounded.
#[derive(Default)]
pub(crate) struct Sessions {
    held: Mutex<HashMap<String, Session>>,
}

fn random_hex(n: usize) -> Option<String> {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).ok()?;
    Some(data_encoding::HEXLOWER.encode(&b))
}

impl Sessions {
    fn open(&self, approver: ApproverToken) -> Option<String> {
        let id = random_hex(32)?;
        let csrf = random_hex(32)?;
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        held.retain(|_, s| s.until > now);
        if held.len() >= MAX_SESSIONS {
            if let Some(oldest) = held
                .iter()
                .min_by_key(|(_, s)| s.until)
                .map(|(k, _)| k.clone())
            {
                held.remove(&oldest);
            }
        }
        held.insert(
            id.clone(),
            Session {
                approver,
                csrf,
                until: now + SESSION_TTL,
            },
        );
        Some(id)
    }

    /// The approver and CSRF token of session `id`, if it is live.
    fn get(&self, id: &str) -> Option<(ApproverToken, String)> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let s = held.get(id)?;
        (s.until > Instant::now()).then(|| (s.approver.clone(), s.csrf.clone()))
    }

    fn close(&self, id: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

fn session_of<B>(req: &Request<B>) -> Option<String> {
    for value in req.headers().get_all(http::header::COOKIE) {
        let Ok(text) = value.to_str() else { continue };
        for part in text.split(';') {
            if let Some(v) = part
                .trim()
                .strip_prefix(COOKIE)
                .and_then(|r| r.strip_prefix('='))
            {
                return Some(v.to_string());
            }
        }
    }
    None
}

fn html_response(code: StatusCode, body: Markup) -> Response<Body> {
    let mut resp = Response::new(full(body.into_string()));
    *resp.status_mut() = code;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Nothing from elsewhere, no framing, no caching.
    h.insert(
        http::header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    h.insert(
        http::header::X_FRAME_OPTIONS,
        http::HeaderValue::from_static("DENY"),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    h.insert(
        http::header::REFERRER_POLICY,
        http::HeaderValue::from_static("no-referrer"),
    );
    resp
}

fn see_other(to: &'static str, cookie: Option<String>) -> Response<Body> {
    let mut resp = Response::new(full(""));
    *resp.status_mut() = StatusCode::SEE_OTHER;
    resp.headers_mut()
        .insert(http::header::LOCATION, http::HeaderValue::from_static(to));
    if let Some(c) = cookie.and_then(|c| http::HeaderValue::from_str(&c).ok()) {
        resp.headers_mut().insert(http::header::SET_COOKIE, c);
    }
    resp
}

fn frame(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) }
                style { "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #999;padding:.3em .6em;text-align:left}code{word-break:break-all}" }
            }
            body {
                h1 { (title) }
                (body)
            }
        }
    }
}

fn login(message: Option<&str>) -> Markup {
    frame(
        "Palisade approvals: sign in",
        html! {
            @if let Some(m) = message { p id="message" { (m) } }
            form method="post" action="/ui/login" {
                label for="token" { "Approver token " }
                input type="password" id="token" name="token" autocomplete="off";
                " "
                button type="submit" id="login" { "Sign in" }
            }
        },
    )
}

fn listing(health: &Approvers, who: &ApproverToken, csrf: &str, message: Option<&str>) -> Markup {
    let now = std::time::SystemTime::now();
    let pending: Vec<approvals::Listed> = health
        .jit
        .approvals(who, now)
        .iter()
        .map(approvals::Listed::from)
        .collect();
    let grants = health.jit.grants(who);
    frame(
        "Palisade approvals",
        html! {
            p { "Signed in as " strong { (who.name) } "." }
            form method="post" action="/ui/logout" {
                input type="hidden" name="csrf" value=(csrf);
                button type="submit" { "Sign out" }
            }
            @if let Some(m) = message { p id="message" { (m) } }
            h2 { "Pending" }
            @if pending.is_empty() {
                p id="none" { "Nothing is waiting for an answer." }
            } @else {
                table id="pending" {
                    tr { th { "Destination" } th { "Org" } th { "Client" } th { "First seen" } th { "Last seen" } th { "Count" } th { "Answer" } }
                    @for a in &pending {
                        tr class="approval" data-id=(a.id) {
                            td { code class="destination" { (a.destination) } }
                            td { (a.org) }
                            td { (a.last_client) }
                            td { (a.first_seen) }
                            td { (a.last_seen) }
                            td { (a.count) }
                            td {
                                form method="post" action={ "/ui/approvals/" (a.id) } {
                                    input type="hidden" name="csrf" value=(csrf);
                                    select name="ttl" {
                                        @for (value, label) in TTLS {
                                            option value=(value) { (label) }
                                        }
                                    }
                                    " "
                                    button type="submit" name="decision" value="allow" class="allow" { "Allow" }
                                    " "
                                    button type="submit" name="decision" value="deny" class="deny" { "Deny" }
                                }
                            }
                        }
                    }
                }
            }
            h2 { "Grants" }
            @if grants.is_empty() {
                p { "No grant is held." }
            } @else {
                table id="grants" {
                    tr { th { "Grant" } th { "Org" } th { "Target" } th { "Port" } th { "Requests" } th { "Ends" } th { "Uses" } th { "Approver" } }
                    @for g in &grants {
                        tr class="grant" {
                            td { code { (g.id) } }
                            td { (&*g.scope.org) }
                            td { code { (g.scope.target) } }
                            td { @if let Some(p) = g.scope.port { (p) } @else { "any" } }
                            td { @if let Some(r) = g.scope.requests() { code { (r) } } @else { "any (tunnels too)" } }
                            td { @if let Some(e) = g.expires { (humantime::format_rfc3339_seconds(e)) } @else { "after its uses" } }
                            td { (g.uses) @if let Some(m) = g.max_uses { " of " (m) } }
                            td { (g.approver) }
                        }
                    }
                }
            }
        },
    )
}

fn form(body: &[u8]) -> HashMap<String, String> {
    form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn csrf_ok(expected: &str, got: Option<&String>) -> bool {
    use subtle::ConstantTimeEq;
    got.is_some_and(|g| {
        g.len() == expected.len() && bool::from(g.as_bytes().ct_eq(expected.as_bytes()))
    })
}

/// Serve one page request.
pub(crate) async fn respond(
    (health, sessions): (&Approvers, &Sessions),
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let session =
        session_of(&req).and_then(|id| sessions.get(&id).map(|(who, csrf)| (id, who, csrf)));
    match (req.method().clone(), path.as_str(), session) {
        (Method::GET, "/ui/approvals", None) => html_response(StatusCode::OK, login(None)),
        (Method::GET, "/ui/approvals", Some((_, who, csrf))) => {
            html_response(StatusCode::OK, listing(health, &who, &csrf, None))
        }
        (Method::POST, "/ui/login", _) => {
            let body = match approvals::read_body(req.into_body()).await {
                Ok(b) => b,
                Err(resp) => return resp,
            };
            let fields = form(&body);
            let token = fields.get("token").map(String::as_str).unwrap_or_default();
            let Some(who) = approvals::approver(&health.tokens, token) else {
                return html_response(
                    StatusCode::UNAUTHORIZED,
                    login(Some("That token is not an approver's.")),
                );
            };
            match sessions.open(who.clone()) {
                Some(id) => see_other(
                    "/ui/approvals",
                    Some(format!(
                        "{COOKIE}={id}; Path=/ui/; HttpOnly; SameSite=Strict; Max-Age={}",
                        SESSION_TTL.as_secs()
                    )),
                ),
                None => html_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    login(Some("No session could be opened.")),
                ),
            }
        }
        (Method::POST, "/ui/logout", Some((id, _, csrf))) => {
            let body = approvals::read_body(req.into_body())
                .await
                .unwrap_or_default();
            if csrf_ok(&csrf, form(&body).get("csrf")) {
                sessions.close(&id);
            }
            see_other(
                "/ui/approvals",
                Some(format!(
                    "{COOKIE}=; Path=/ui/; HttpOnly; SameSite=Strict; Max-Age=0"
                )),
            )
        }
        (Method::POST, p, Some((_, who, csrf))) if p.starts_with("/ui/approvals/") => {
            let id = p.trim_start_matches("/ui/approvals/").to_string();
            let body = match approvals::read_body(req.into_body()).await {
                Ok(b) => b,
                Err(resp) => return resp,
            };
            let fields = form(&body);
            if !csrf_ok(&csrf, fields.get("csrf")) {
                return html_response(
                    StatusCode::FORBIDDEN,
                    listing(
                        health,
                        &who,
                        &csrf,
                        Some("The form was stale: nothing was answered."),
                    ),
                );
            }
            let answer = Answer {
                decision: fields.get("decision").cloned().unwrap_or_default(),
                ttl: fields.get("ttl").cloned(),
                max_uses: None,
                reason: Some("answered on /ui/approvals".into()),
                host: None,
                port: None,
                method: None,
                path: None,
            };
            let resp = approvals::answer(health, &who, &id, answer).await;
            let message = if resp.status().is_success() {
                format!("Approval {id} answered.")
            } else {
                format!("Approval {id} was not answered ({}).", resp.status())
            };
            html_response(resp.status(), listing(health, &who, &csrf, Some(&message)))
        }
        (Method::POST, _, None) => {
            html_response(StatusCode::UNAUTHORIZED, login(Some("Sign in first.")))
        }
        _ => html_response(StatusCode::NOT_FOUND, login(None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_in_a_name_is_shown_inert() {
        let out = frame("t", html! { code { ("<script>alert(1)</script>\"'&") } }).into_string();
        assert!(
            out.contains("&lt;script&gt;alert(1)&lt;/script&gt;&quot;'&amp;"),
            "{out}"
        );
        assert!(!out.contains("<script>"));
    }

    #[test]
    fn csrf_tokens_must_match() {
        assert!(csrf_ok("abc", Some(&"abc".to_string())));
        assert!(!csrf_ok("abc", Some(&"abd".to_string())));
        assert!(!csrf_ok("abc", None));
    }
}
