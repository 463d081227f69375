//! The approvers' endpoints: `GET /v1/approvals`, `POST
//! /v1/approvals/{id}`, `GET /v1/grants`, `POST /v1/grants`, `DELETE
//! /v1/grants/{id}`, each with a bearer token of `[admin]
//! approver_tokens` (the web page of [`super::page`] uses the same
//! tokens and the same calls).
//!
//! A token answers for the orgs it lists: another org's approvals and
//! grants are not shown to it, and answering or revoking one is told
//! "unknown", as for an id that never was. Without a valid token the
//! answer is 401, saying nothing of what is pending.

use std::time::{Duration, SystemTime};

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{ApproverToken, TokenDigest};
use crate::jit::approvals::{AnswerError, Approval};
use crate::jit::grants::{check_requests, Grant, GrantError, Scope, Target};
use crate::jit::state::{JitError, Terms};
use crate::proto::target::{normalize_host, Host};
use crate::serve::http::{full, Body};

/// Largest request body an approver sends.
pub(crate) const MAX_BODY: usize = 4096;
/// Time a request body may take to arrive.
const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the approvers' endpoints and page answer from.
pub(crate) struct Approvers {
    pub(crate) jit: std::sync::Arc<crate::jit::Jit>,
    /// `[admin] approver_tokens`.
    pub(crate) tokens: Vec<ApproverToken>,
    pub(crate) served: crate::served::ServedHandle,
}

/// Whether `path` is one of these endpoints.
pub(crate) fn owns(path: &str) -> bool {
    path == "/v1/approvals"
        || path.starts_with("/v1/approvals/")
        || path == "/v1/grants"
        || path.starts_with("/v1/grants/")
}

/// The approver whose token `presented` is, every digest compared in
/// constant time.
pub(crate) fn approver<'a>(
    tokens: &'a [ApproverToken],
    presented: &str,
) -> Option<&'a ApproverToken> {
    let digest = TokenDigest::of(presented.trim().as_bytes());
    let mut found = None;
    for t in tokens {
        if t.digest.ct_eq(&digest) {
            found = Some(t);
        }
    }
    found
}

fn bearer<B>(req: &Request<B>) -> Option<&str> {
    req.headers()
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

pub(crate) fn json_status<T: Serialize>(code: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut resp = Response::new(full(body));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

fn error(code: StatusCode, message: impl std::fmt::Display) -> Response<Body> {
    json_status(code, &json!({ "error": message.to_string() }))
}

/// 401, with no hint of what is pending.
pub(crate) fn unauthorized() -> Response<Body> {
    let mut resp = Response::new(full("unauthorized\n"));
    *resp.status_mut() = StatusCode::UNAUTHORIZED;
    resp.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    resp
}

/// Read a body of at most [`MAX_BODY`] bytes within [`BODY_TIMEOUT`].
pub(crate) async fn read_body(body: hyper::body::Incoming) -> Result<bytes::Bytes, Response<Body>> {
    let limited = http_body_util::Limited::new(body, MAX_BODY);
    match tokio::time::timeout(BODY_TIMEOUT, limited.collect()).await {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body unreadable or over {MAX_BODY} bytes: {e}"),
        )),
        Err(_) => Err(error(StatusCode::REQUEST_TIMEOUT, "request body too slow")),
    }
}

/// An approval as listed.
#[derive(Debug, Serialize)]
pub(crate) struct Listed {
    pub(crate) id: String,
    pub(crate) org: String,
    pub(crate) host: String,
    pub(crate) port: Option<u16>,
    /// `host:port` as a client would write it.
    pub(crate) destination: String,
    pub(crate) first_client: std::net::IpAddr,
    pub(crate) last_client: std::net::IpAddr,
    pub(crate) first_seen: String,
    pub(crate) last_seen: String,
    pub(crate) count: u64,
    pub(crate) expires: String,
    /// The method and path of the request that missed, if Palisade saw one.
    pub(crate) method: Option<String>,
    pub(crate) path: Option<String>,
}

fn ts(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

impl From<&Approval> for Listed {
    fn from(a: &Approval) -> Listed {
        Listed {
            id: a.id.clone(),
            org: a.asked.org.to_string(),
            host: a.asked.host.clone(),
            port: a.asked.port,
            destination: a.asked.to_string(),
            first_client: a.first_client,
            last_client: a.last_client,
            first_seen: ts(a.first_seen),
            last_seen: ts(a.last_seen),
            count: a.count,
            expires: ts(a.expires),
            method: a.asked.request.as_ref().map(|r| r.0.clone()),
            path: a.asked.request.as_ref().map(|r| r.1.clone()),
        }
    }
}

/// A grant as listed.
pub(crate) fn grant_json(g: &Grant) -> serde_json::Value {
    json!({
        "id": g.id,
        "org": &*g.scope.org,
        "target": g.scope.target.to_string(),
        "port": g.scope.port,
        "method": g.scope.method,
        "path": g.scope.path,
        "granted_at": ts(g.granted_at),
        "expires": g.expires.map(ts),
        "max_uses": g.max_uses,
        "uses": g.uses,
        "approver": g.approver,
        "reason": g.reason,
        "approval": g.approval,
    })
}

/// The body of `POST /v1/approvals/{id}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Answer {
    pub(crate) decision: String,
    #[serde(default)]
    pub(crate) ttl: Option<String>,
    #[serde(default)]
    pub(crate) max_uses: Option<u32>,
    #[serde(default)]
    pub(crate) reason: Option<String>,
    /// What the approver thinks it grants: refused unless it is exactly
    /// what the approval asked.
    #[serde(default)]
    pub(crate) host: Option<String>,
    #[serde(default)]
    pub(crate) port: Option<u16>,
    /// As `host`: present (even `null`), it must be the approval's.
    #[serde(default, deserialize_with = "present")]
    pub(crate) method: Option<serde_json::Value>,
    #[serde(default, deserialize_with = "present")]
    pub(crate) path: Option<serde_json::Value>,
}

/// A field that is present, `null` included (absent: `None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// The body of `POST /v1/grants`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Direct {
    pub(crate) org: String,
    /// A host name, an address, or a CIDR.
    pub(crate) target: String,
    pub(crate) port: u16,
    #[serde(default)]
    pub(crate) ttl: Option<String>,
    #[serde(default)]
    pub(crate) max_uses: Option<u32>,
    #[serde(default)]
    pub(crate) reason: Option<String>,
    /// Requests only, with this method (under interception).
    #[serde(default)]
    pub(crate) method: Option<String>,
    /// Requests only, whose path this pattern matches (a prefix, or a
    /// glob: `*` matches anything).
    #[serde(default)]
    pub(crate) path: Option<String>,
}

/// A grant's terms from what an approver sent.
pub(crate) fn terms(
    ttl: Option<&str>,
    max_uses: Option<u32>,
    reason: Option<String>,
) -> Result<Terms, String> {
    let ttl = match ttl {
        None => None,
        Some(t) => Some(
            humantime::parse_duration(t.trim())
                .map_err(|e| format!("ttl {t:?}: {e} (e.g. \"10m\", \"1h\")"))?,
        ),
    };
    let reason = reason.map(|r| r.chars().filter(|c| !c.is_control()).take(200).collect());
    Ok(Terms {
        ttl,
        max_uses,
        reason,
    })
}

/// The target of a direct grant: a normalised name, or a CIDR (an
/// address is its /32 or /128).
pub(crate) fn target(text: &str) -> Result<Target, String> {
    if let Ok(net) = text.trim().parse::<ipnet::IpNet>() {
        return Ok(Target::Cidr(net.trunc()));
    }
    match normalize_host(text.trim()) {
        Ok(Host::Name(n)) => Ok(Target::Name(n)),
        Ok(Host::Ip(ip)) => Ok(Target::Cidr(ipnet::IpNet::from(crate::policy::canonical(
            ip,
        )))),
        Err(e) => Err(format!("target {text:?}: {e}")),
    }
}

fn jit_error(e: &JitError) -> Response<Body> {
    let code = match e {
        JitError::Answer(AnswerError::Answered(_)) => StatusCode::CONFLICT,
        JitError::Answer(AnswerError::Unknown(_)) | JitError::Grant(GrantError::Unknown(_)) => {
            StatusCode::NOT_FOUND
        }
        JitError::Grant(GrantError::Full(_)) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::BAD_REQUEST,
    };
    error(code, e)
}

/// Answer approval `id` as `who`: the outcome as a response.
pub(crate) async fn answer(
    health: &Approvers,
    who: &ApproverToken,
    id: &str,
    a: Answer,
) -> Response<Body> {
    let allow = match a.decision.as_str() {
        "allow" => true,
        "deny" => false,
        other => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("decision {other:?}: expected \"allow\" or \"deny\""),
            )
        }
    };
    let now = SystemTime::now();
    let named = [&a.method, &a.path].into_iter().any(Option::is_some);
    if a.host.is_some() || a.port.is_some() || named {
        let asked = health
            .jit
            .approvals(who, now)
            .into_iter()
            .find(|p| p.id == id);
        if let Some(p) = asked {
            let host_ok = a.host.as_deref().is_none_or(|h| {
                normalize_host(h).map(|h| h.to_string()).ok().as_deref() == Some(&p.asked.host)
            });
            let port_ok = a.port.is_none_or(|port| Some(port) == p.asked.port);
            // Dropping (`null`) or changing the request asked is wider.
            let asked = p.asked.request.as_ref();
            let same = |given: &Option<serde_json::Value>, want: Option<&String>| {
                given.as_ref().is_none_or(|v| {
                    v.as_str()
                        .is_some_and(|v| Some(v) == want.map(String::as_str))
                })
            };
            let request_ok =
                same(&a.method, asked.map(|r| &r.0)) && same(&a.path, asked.map(|r| &r.1));
            if !host_ok || !port_ok || !request_ok {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "approval {id} asked for {}: a grant answering it opens exactly that, nothing wider",
                        p.asked
                    ),
                );
            }
        }
    }
    let terms = match terms(a.ttl.as_deref(), a.max_uses, a.reason) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let served = health.served.load();
    match health
        .jit
        .answer(who, id, allow, terms, &served.policy, now)
        .await
    {
        Ok(Some(g)) => json_status(
            StatusCode::OK,
            &json!({ "decision": "allow", "grant": grant_json(&g) }),
        ),
        Ok(None) => json_status(
            StatusCode::OK,
            &json!({ "decision": "deny", "approval": id }),
        ),
        Err(e) => jit_error(&e),
    }
}

/// Grant directly as `who`.
pub(crate) async fn give(health: &Approvers, who: &ApproverToken, d: Direct) -> Response<Body> {
    let target = match target(&d.target) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let terms = match terms(d.ttl.as_deref(), d.max_uses, d.reason) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    if let Err(e) = check_requests(d.method.as_deref(), d.path.as_deref()) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    let scope = Scope {
        org: std::sync::Arc::from(d.org.as_str()),
        target,
        port: Some(d.port),
        method: d.method,
        path: d.path,
    };
    let served = health.served.load();
    match health
        .jit
        .give(who, scope, terms, None, &served.policy, SystemTime::now())
        .await
    {
        Ok(g) => json_status(StatusCode::CREATED, &grant_json(&g)),
        Err(e) => jit_error(&e),
    }
}

/// Serve one approver request.
pub(crate) async fn respond(
    health: &Approvers,
    req: Request<hyper::body::Incoming>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let Some(who) = bearer(&req).and_then(|t| approver(&health.tokens, t)) else {
        return unauthorized();
    };
    let who = who.clone();
    let method = req.method().clone();
    let now = SystemTime::now();
    match (method, path.as_str()) {
        (Method::GET, "/v1/approvals") => {
            let list: Vec<Listed> = health
                .jit
                .approvals(&who, now)
                .iter()
                .map(Listed::from)
                .collect();
            json_status(StatusCode::OK, &json!({ "approvals": list }))
        }
        (Method::GET, "/v1/grants") => {
            let list: Vec<_> = health.jit.grants(&who).iter().map(grant_json).collect();
            json_status(StatusCode::OK, &json!({ "grants": list }))
        }
        (Method::POST, "/v1/grants") => {
            let body = match read_body(req.into_body()).await {
                Ok(b) => b,
                Err(resp) => return resp,
            };
            match serde_json::from_slice::<Direct>(&body) {
                Ok(d) => give(health, &who, d).await,
                Err(e) => error(StatusCode::BAD_REQUEST, format!("grant body: {e}")),
            }
        }
        (Method::POST, p) if p.starts_with("/v1/approvals/") => {
            let id = p.trim_start_matches("/v1/approvals/").to_string();
            let body = match read_body(req.into_body()).await {
                Ok(b) => b,
                Err(resp) => return resp,
            };
            match serde_json::from_slice::<Answer>(&body) {
                Ok(a) => answer(health, &who, &id, a).await,
                Err(e) => error(StatusCode::BAD_REQUEST, format!("answer body: {e}")),
            }
        }
        (Method::DELETE, p) if p.starts_with("/v1/grants/") => {
            let id = p.trim_start_matches("/v1/grants/");
            let served = health.served.load();
            match health.jit.revoke(&who, id, &served.policy) {
                Ok(g) => json_status(StatusCode::OK, &json!({ "revoked": grant_json(&g) })),
                Err(e) => jit_error(&e),
            }
        }
        _ => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_names_or_networks() {
        assert_eq!(target("X.Test").unwrap(), Target::Name("x.test".into()));
        assert_eq!(
            target("198.18.7.9").unwrap(),
            Target::Cidr("198.18.7.9/32".parse().unwrap())
        );
        assert_eq!(
            target("198.18.7.9/24").unwrap(),
            Target::Cidr("198.18.7.0/24".parse().unwrap())
        );
        assert!(target("bad name!").is_err());
        assert!(terms(Some("forever"), None, None).is_err());
        assert_eq!(
            terms(Some("10m"), Some(1), None).unwrap().ttl,
            Some(Duration::from_secs(600))
        );
    }
}
