//! Revocation: a live unit is held to every policy served while it runs,
//! not only to the one it was decided under.
//!
//! A unit is a connection (a CONNECT or SOCKS5 tunnel, a transparent
//! connection, an intercepted connection) or a request (a forwarded
//! absolute-form request with its body and response, a request inside an
//! intercepted connection with its body and response, a WebSocket
//! handshake with the stream it became). When a reload swaps in a new
//! [`Served`] state, every live unit is decided again under it with what
//! it was decided on ([`revisit`], pure): its org found again from the
//! same identity (the address; a token org: the digest of the token it
//! presented), its name or address, port, the address dialled; for a
//! connection, what it carries (the tunnel kind it was verified as,
//! intercepted or not); for a request, what it asked ([`Asked`]: inside an
//! intercepted connection its rule must still intercept, a WebSocket's
//! must keep `websocket = true`, and the rule's method and path rules must
//! still let it through). Then ([`watch`]):
//!
//! | under the new policy | what happens |
//! |---|---|
//! | allowed, carrying what it was verified as, intercepted as before, its request still let through | nothing (an intercepted connection decides its next requests under the new policy anyway) |
//! | denied, or its rule now asks for another tunnel kind or interception, or refuses its request | a decision record `deny`, `policy_revoked` (`conn`: its decision record, `policy`: the new hash, `detail`: why), then it is closed and its close record written |
//! | denied, org in report mode | a decision record `allow`, `report_only`, `would_deny: policy_revoked`, once per change; it keeps running |
//!
//! A tunnel, a request and a WebSocket stream are closed as soon as their
//! revocation is queued (a request's bodies end with an error, never with
//! a clean end: [`Hold`]); an intercepted connection takes no further
//! request and its request in flight, if still allowed itself, has at most
//! `revoke_grace` to finish.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::debug;

use super::conn::{Asked, Conn, Plan};
use super::ctx::{Ctx, View};
use crate::config::Carry;
use crate::policy::request::RequestFacts;
use crate::policy::{Decision, OrgRef, Reason, Verdict};
use crate::proto::target::Host;
use crate::served::Served;

/// A live connection under a newer served state.
#[derive(Debug)]
pub(crate) enum Revisit {
    /// Still allowed as it runs: the new view, and the verdict under it.
    Kept(View, Verdict),
    /// Denied, but its org only reports: `detail` says why.
    Reported(View, String),
    /// Denied: `detail` says why (the new reason, or what changed).
    Revoked(View, String),
}

/// Decide the live connection `conn` again under `served` (pure).
pub(crate) fn revisit(served: &Arc<Served>, conn: &Conn) -> Revisit {
    let policy = &served.policy;
    let mut view = View {
        served: served.clone(),
        org: None,
        token: conn.view.token.clone(),
    };
    let Some(was) = &conn.view.org else {
        return Revisit::Revoked(view, "it has no org".into());
    };
    let Some(org) = policy.org_again(conn.client.ip(), was, conn.view.token.as_ref()) else {
        return Revisit::Revoked(view, format!("the client is no longer of org {}", was.name));
    };
    view.org = Some(org.clone());
    let verdict = match (policy.decide_for_org(&org, &conn.host, conn.port), conn.ip) {
        // A grant's connection stays a grant's on a miss: the grant's own
        // end closes it ([`watch`]), an explicit deny at once.
        (Decision::Final(v), ip) if v.reason == Reason::NoMatchingRule && by_grant(conn) => {
            match (&conn.host, ip) {
                (Host::Ip(_), _) => Verdict {
                    reason: Reason::RuleMatch,
                    rule: conn.verdict.rule.clone(),
                    ..v
                },
                (Host::Name(_), Some(ip)) => {
                    let pending = crate::policy::PendingName {
                        org: org.clone(),
                        rule: conn.verdict.rule.clone(),
                        port: conn.port,
                        would_deny: None,
                    };
                    policy.check_addresses(&pending, &[ip]).verdict
                }
                (Host::Name(_), None) => v,
            }
        }
        (Decision::Final(v), _) => v,
        (Decision::Resolve(pending), Some(ip)) => policy.check_addresses(&pending, &[ip]).verdict,
        (Decision::Resolve(_), None) => {
            return Revisit::Revoked(view, "no address was dialled".into());
        }
    };
    let report = view.is_report();
    if !verdict.is_allow() {
        let why = ended(policy, &org, conn).unwrap_or_else(|| format!("now {}", verdict.reason));
        // Report mode reports the allowlist's own denials, as at a
        // decision; the baseline's are enforced for every org.
        let own = policy.layer_of(&verdict) != Some(crate::policy::Layer::Baseline);
        return if report && own && verdict.reason.reportable() {
            Revisit::Reported(view, why)
        } else {
            Revisit::Revoked(view, why)
        };
    }
    let otherwise = match &conn.asked {
        None => carried_otherwise(conn, &view, &verdict),
        Some(asked) => asked_otherwise(conn, asked, &view, &verdict),
    };
    if let Some(why) = otherwise {
        return if report {
            Revisit::Reported(view, why)
        } else {
            Revisit::Revoked(view, why)
        };
    }
    match verdict.would_deny {
        Some(would) => Revisit::Reported(view, format!("would now be {would}")),
        None => Revisit::Kept(view, verdict),
    }
}

/// The end of the time-bound rule `conn` was allowed by, when `policy`
/// decides past it: `rule R expired at T` (`crate::reload` serves the
/// policy again at that instant).
fn ended(policy: &crate::policy::Policy, org: &OrgRef, conn: &Conn) -> Option<String> {
    let rule = conn.verdict.rule.as_deref()?;
    let window = policy.window_of(org, rule)?;
    let now = policy.instant()?;
    let end = window.expires.filter(|_| window.ended(now))?;
    Some(format!(
        "rule {rule} expired at {}",
        crate::config::rfc3339(end)
    ))
}

/// Whether a grant allowed `conn` (its rule is `grant:ID`).
fn by_grant(conn: &Conn) -> bool {
    crate::jit::grant_of(conn.verdict.rule.as_deref()).is_some()
}

/// Why an allowed connection no longer runs as its new rule says: the
/// rule asks for a tunnel kind it was not verified as, or interception
/// where it is passed through (or the reverse).
fn carried_otherwise(conn: &Conn, view: &View, verdict: &Verdict) -> Option<String> {
    let org = view.org.as_ref()?;
    let rule = verdict.rule.as_deref();
    let now = view
        .policy
        .carry(org, rule, matches!(conn.host, Host::Name(_)), conn.port);
    let was = conn.tunnel.unwrap_or(Carry::Opaque);
    let covered = match now {
        Carry::Opaque => true,
        Carry::TlsOrHttp => was != Carry::Opaque,
        kind => was == kind,
    };
    if !covered {
        return Some(format!(
            "its rule now carries {}; it was verified as {}",
            now.as_str(),
            was.as_str()
        ));
    }
    let intercepts = rule.is_some_and(|r| view.policy.intercept_rules(org, r).is_some());
    match (intercepts, matches!(conn.plan, Plan::Intercept(_))) {
        (true, false) => Some("its rule now intercepts".into()),
        // A grant's intercepted connection: its grant decides each request.
        (false, true) if conn.grant_requests => None,
        (false, true) => Some("its rule no longer intercepts".into()),
        _ => None,
    }
}

/// Why an allowed request no longer runs as its new rule says: it was
/// inside an intercepted connection and the rule no longer intercepts; a
/// WebSocket and the rule no longer has `websocket = true`; or the rule's
/// method and path rules now refuse it (the same
/// [`Policy::decide_request`](crate::policy::Policy::decide_request) that
/// decided it, a WebSocket handshake as the `GET` it is).
fn asked_otherwise(conn: &Conn, asked: &Asked, view: &View, verdict: &Verdict) -> Option<String> {
    let (org, rule) = (view.org.as_ref()?, verdict.rule.as_deref()?);
    let Some(rules) = view.policy.intercept_rules(org, rule) else {
        // A plain request under a rule without request rules, or one a
        // grant allowed: its target decides (and the grant's end).
        return (asked.intercepted && !by_grant(conn))
            .then(|| "its rule no longer intercepts".into());
    };
    if asked.websocket && !rules.websocket {
        return Some(format!("rule {rule} no longer has websocket = true"));
    }
    let host = conn.host.to_string();
    let req = RequestFacts {
        host: &host,
        method: if asked.websocket {
            "GET"
        } else {
            &asked.method
        },
        path: &asked.path,
    };
    let decision = view.policy.decide_request(org, rule, req, []);
    if decision.is_allow() {
        return None;
    }
    let reason = decision.verdict.reason;
    Some(match decision.detail {
        Some(d) => format!("now {reason}: {d}"),
        None => format!("now {reason}"),
    })
}

/// The record of a revisit that did not keep `conn` (recorded as `id`):
/// `policy_revoked` under the new view, or, reported, what enforcement
/// would have done. Linked to the decision record by `conn`.
fn record_of(conn: &Conn, id: &str, view: View, detail: String, reported: bool) -> Conn {
    let reason = if reported {
        Reason::ReportOnly
    } else {
        Reason::PolicyRevoked
    };
    closed_for(conn, id, (view, reason), detail, reported)
}

/// The record of `conn` (recorded as `id`) closed for `reason` under
/// `view`, linked to its decision record by `conn`.
fn closed_for(
    conn: &Conn,
    id: &str,
    (view, reason): (View, Reason),
    detail: String,
    reported: bool,
) -> Conn {
    let mut c = conn.clone();
    let org = view.org.clone().or_else(|| conn.view.org.clone());
    c.view = view;
    c.verdict = Verdict {
        org,
        reason,
        rule: None,
        would_deny: reported.then_some(Reason::PolicyRevoked),
    };
    c.within = Some(id.to_string());
    c.detail = Some(detail);
    c
}

/// What [`watch`] does when a live connection is revoked.
pub(crate) trait Cut: Sync {
    /// Stop it: at once, or within `grace`.
    fn cut(&self, grace: std::time::Duration) -> impl Future<Output = ()> + Send;
}

/// A tunnel: closed at once.
impl Cut for CancellationToken {
    async fn cut(&self, _grace: std::time::Duration) {
        self.cancel();
    }
}

/// Run `conn`'s connection (`run`, which ends when `cut` is cut) held to
/// every policy served after `conn` was decided and recorded as `id`.
pub(crate) fn held<'a, F: Future, C: Cut>(
    ctx: &'a Ctx,
    conn: &'a Conn,
    id: &'a str,
    cut: &'a C,
    run: F,
) -> Held<'a, F> {
    Held {
        run,
        watching: Box::pin(watch(ctx, conn, id, cut)),
    }
}

pin_project_lite::pin_project! {
    /// [`held`]: the connection's future and its watch, polled as one.
    /// Not an async fn: the connection's state (a tunnel's copy loops)
    /// is held once, in place, not also in a moved-from slot.
    pub(crate) struct Held<'a, F> {
        #[pin]
        run: F,
        // Boxed: the watch is idle nearly always, and what a revocation
        // records should not widen every tunnel task.
        watching: Pin<Box<dyn Future<Output = Infallible> + Send + 'a>>,
    }
}

impl<F: Future> Future for Held<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.run.poll(cx) {
            return Poll::Ready(out);
        }
        // Never ready (Infallible): it cuts the connection through its
        // token, which wakes `run` to finish.
        match this.watching.as_mut().poll(cx) {
            Poll::Ready(never) => match never {},
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A unit with no future of its own to wrap (a forwarded request: its
/// body going up and its response coming down are polled by the HTTP
/// layer), held to every policy served by a task of its own for as long
/// as this lives. Revoked, [`Hold::stop`] is cancelled at once: the unit's
/// bodies then end with an error, never with a clean end.
pub(crate) struct Hold {
    stop: CancellationToken,
    _watching: DropGuard,
}

impl Hold {
    /// Cancelled when the unit is revoked.
    pub(crate) fn stop(&self) -> &CancellationToken {
        &self.stop
    }
}

/// Hold the unit `conn`, recorded as `id`, until the returned [`Hold`] is
/// dropped (with the unit's last body).
pub(crate) fn hold(ctx: &Arc<Ctx>, conn: &Conn, id: &str) -> Hold {
    let stop = CancellationToken::new();
    let ended = CancellationToken::new();
    let watching = ended.clone().drop_guard();
    let (ctx2, conn, id, cut) = (ctx.clone(), conn.clone(), id.to_string(), stop.clone());
    ctx.tasks.spawn(async move {
        tokio::select! {
            _ = ended.cancelled() => {}
            never = watch(&ctx2, &conn, &id, &cut) => match never {},
        }
    });
    Hold {
        stop,
        _watching: watching,
    }
}

/// Hold `conn`, decided and recorded as `id`, to every policy served
/// after it was decided, until the caller drops this future (with the
/// connection). A revoked connection is cut through `cut`, then this
/// waits for the caller. See the module doc.
async fn watch<C: Cut>(ctx: &Ctx, conn: &Conn, id: &str, cut: &C) -> Infallible {
    // Subscribed before the first look: a swap after that look is a change.
    let mut changes = ctx.policy_changed.subscribe();
    let mut seen = conn.view.served.clone();
    let mut reported = false;
    // A grant's connection ends with its grant (TTL, revoke, a denying
    // reload): `grant_expired`.
    let grant = crate::jit::grant_of(conn.verdict.rule.as_deref());
    let ended = grant.and_then(|g| ctx.jit.end_of(g));
    let grant_ended = async {
        match &ended {
            Some(end) => end.cancelled().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(grant_ended);
    loop {
        let now = ctx.served.load_full();
        if !Arc::ptr_eq(&now, &seen) {
            seen = now.clone();
            match revisit(&now, conn) {
                Revisit::Kept(..) => reported = false,
                Revisit::Reported(view, detail) => {
                    if !reported {
                        reported = true;
                        let mut r = record_of(conn, id, view, detail, true).record();
                        ctx.submit(&mut r);
                    }
                }
                Revisit::Revoked(view, detail) => {
                    revoked(ctx, record_of(conn, id, view, detail, false));
                    cut.cut(ctx.limits.revoke_grace.get()).await;
                    return std::future::pending().await;
                }
            }
        }
        tokio::select! {
            changed = changes.changed() => {
                if changed.is_err() {
                    // No more reloads: only the grant's end is left.
                    grant_ended.as_mut().await;
                }
            }
            () = grant_ended.as_mut() => {}
        }
        if ended.as_ref().is_some_and(|e| e.is_cancelled()) {
            let view = conn.view.clone();
            let detail = format!("grant {} ended", grant.unwrap_or_default());
            revoked(
                ctx,
                closed_for(conn, id, (view, Reason::GrantExpired), detail, false),
            );
            cut.cut(ctx.limits.revoke_grace.get()).await;
            return std::future::pending().await;
        }
    }
}

/// Queue the revocation record `c` (it lets nothing through, so nothing
/// waits on it; it is never dropped) and count it.
fn revoked(ctx: &Ctx, c: Conn) {
    let mut r = c.record();
    ctx.submit(&mut r);
    let org = r.org.as_deref().unwrap_or(crate::metrics::UNKNOWN_ORG);
    ctx.metrics
        .connections_revoked_total
        .with_label_values(&[org, c.mode.as_str()])
        .inc();
    debug!(record = %r.id, conn = ?c.within, detail = ?c.detail, "live connection revoked");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evidence::{Kind, Mode};
    use crate::policy::Policy;
    use crate::proxy::conn::Link;

    const CLIENT: &str = "198.18.1.2:5000";

    fn served(orgs: &str) -> Arc<Served> {
        // Intercepting rules: the org CAs in a scratch directory of their own.
        let text = if orgs.contains("intercept = true") {
            let dir = crate::testing::scratch("revoke-ca");
            format!(
                "[intercept]\nca_dir = {:?}\n{orgs}",
                dir.display().to_string()
            )
        } else {
            orgs.to_string()
        };
        let config = crate::config::from_str(&text, std::path::Path::new("t.toml")).unwrap();
        let policy = Arc::new(Policy::new(&config));
        let metrics = Arc::new(crate::metrics::Metrics::new(Arc::default()));
        Arc::new(Served::load(&config, policy, &metrics).unwrap())
    }

    const ACME: &str = "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n";

    /// A connection to `host:port` decided (allowed) under `served`, dialled at `ip`.
    fn decided(served: &Arc<Served>, host: &str, port: u16, ip: &str, carry: Carry) -> Conn {
        let client: std::net::SocketAddr = CLIENT.parse().unwrap();
        let org = served.policy.org_for(client.ip());
        let host = crate::proto::target::normalize_host(host).unwrap();
        let verdict = match served
            .policy
            .decide_for_org(org.as_ref().unwrap(), &host, port)
        {
            Decision::Final(v) => v,
            Decision::Resolve(p) => {
                served
                    .policy
                    .check_addresses(&p, &[ip.parse().unwrap()])
                    .verdict
            }
        };
        assert!(verdict.is_allow(), "{verdict:?}");
        let view = View {
            served: served.clone(),
            org,
            token: None,
        };
        let mut c = Link::new(view, Mode::Explicit, client).decided(host, port, verdict);
        c.ip = Some(ip.parse().unwrap());
        c.tunnel = Some(carry);
        c
    }

    fn rules(extra: &str) -> String {
        format!("{ACME}{extra}")
    }

    const A_TEST: &str = "[[org.allow]]\nhost = \"a.test\"\nports = [443]\n";
    const B_TEST: &str = "[[org.allow]]\nhost = \"b.test\"\nports = [443]\n";

    #[test]
    fn a_baseline_deny_revokes_even_in_report_mode() {
        let dir = crate::testing::scratch("revoke-baseline");
        let baseline = dir.join("b.toml");
        std::fs::write(&baseline, "[[deny]]\nid = \"no-a\"\nhost = \"a.test\"\n").unwrap();
        let report = ACME.replace("[[org]]\n", "[[org]]\nmode = \"report\"\n");
        let old = served(&format!("{report}{A_TEST}"));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let with = format!(
            "[policy]\nbaseline = {:?}\n{report}{A_TEST}",
            baseline.display().to_string()
        );
        let new = served(&with);
        match revisit(&new, &conn) {
            Revisit::Revoked(_, why) => assert_eq!(why, "now explicit_deny"),
            other => panic!("kept: {:?}", matches!(other, Revisit::Reported(..))),
        }
    }

    #[test]
    fn an_unrelated_change_keeps_the_connection() {
        let old = served(&rules(A_TEST));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let new = served(&rules(&format!("{A_TEST}{B_TEST}")));
        assert!(matches!(revisit(&new, &conn), Revisit::Kept(..)));
    }

    #[test]
    fn a_removed_rule_revokes_with_the_new_reason() {
        let old = served(&rules(&format!("{A_TEST}{B_TEST}")));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let new = served(&rules(B_TEST));
        match revisit(&new, &conn) {
            Revisit::Revoked(view, detail) => {
                assert_eq!(detail, "now no_matching_rule");
                assert_eq!(view.policy.hash(), new.policy.hash());
                let r = record_of(&conn, "d1", view, detail, false).record();
                assert_eq!(
                    (r.decision_str(), r.reason, r.conn.as_deref()),
                    ("deny", Reason::PolicyRevoked, Some("d1"))
                );
                assert_eq!(&*r.policy, new.policy.hash());
                assert_eq!(r.org.as_deref(), Some("acme"));
                assert_eq!(r.host.as_deref(), Some("a.test"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_port_dropped_or_an_explicit_deny_revokes() {
        let old = served(&rules(A_TEST));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let port = served(&rules("[[org.allow]]\nhost = \"a.test\"\nports = [8443]\n"));
        assert!(
            matches!(revisit(&port, &conn), Revisit::Revoked(_, d) if d == "now port_not_allowed")
        );
        let denied = served(&rules(&format!(
            "{A_TEST}[[org.deny]]\nhost = \"a.test\"\n"
        )));
        assert!(
            matches!(revisit(&denied, &conn), Revisit::Revoked(_, d) if d == "now explicit_deny")
        );
    }

    #[test]
    fn the_address_dialled_is_checked_again() {
        let wide = "[[org.allow]]\ncidr = \"198.18.2.0/24\"\nports = [443]\n";
        let old = served(&rules(wide));
        let conn = decided(&old, "198.18.2.10", 443, "198.18.2.10", Carry::Opaque);
        let narrow = served(&rules(
            "[[org.allow]]\ncidr = \"198.18.2.128/25\"\nports = [443]\n",
        ));
        assert!(matches!(revisit(&narrow, &conn), Revisit::Revoked(..)));
        assert!(matches!(revisit(&old, &conn), Revisit::Kept(..)));
    }

    #[test]
    fn report_mode_reports_and_enforce_revokes() {
        let report = |extra: &str| {
            served(&format!(
                "[[org]]\nname = \"acme\"\nmode = \"report\"\nclients = [\"198.18.1.0/24\"]\n{extra}"
            ))
        };
        let old = report(A_TEST);
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let narrowed = report(B_TEST);
        match revisit(&narrowed, &conn) {
            Revisit::Reported(view, detail) => {
                let r = record_of(&conn, "d1", view, detail, true).record();
                assert_eq!(
                    (r.decision_str(), r.reason, r.would_deny),
                    ("allow", Reason::ReportOnly, Some(Reason::PolicyRevoked))
                );
            }
            other => panic!("{other:?}"),
        }
        // The same org turned to enforce: revoked.
        let enforced = served(&rules(B_TEST));
        assert!(matches!(revisit(&enforced, &conn), Revisit::Revoked(..)));
    }

    #[test]
    fn a_client_moved_to_another_org_is_revoked() {
        let old = served(&rules(A_TEST));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Tls);
        let moved = served(&format!(
            "[[org]]\nname = \"beta\"\nclients = [\"198.18.1.0/24\"]\n{A_TEST}"
        ));
        assert!(
            matches!(revisit(&moved, &conn), Revisit::Revoked(_, d) if d.contains("no longer of org acme"))
        );
        let gone = served("[[org]]\nname = \"beta\"\nclients = [\"198.18.9.0/24\"]\n");
        assert!(matches!(revisit(&gone, &conn), Revisit::Revoked(..)));
    }

    #[test]
    fn a_stricter_tunnel_kind_revokes_an_opaque_tunnel() {
        let opaque = "[[org.allow]]\nhost = \"a.test\"\nports = [443]\ntunnel = \"opaque\"\n";
        let old = served(&rules(opaque));
        let conn = decided(&old, "a.test", 443, "198.18.2.10", Carry::Opaque);
        let tls = served(&rules(A_TEST));
        assert!(
            matches!(revisit(&tls, &conn), Revisit::Revoked(_, d) if d.contains("now carries tls"))
        );
        // A TLS tunnel under a rule that turns opaque is still covered.
        let tls_conn = decided(&tls, "a.test", 443, "198.18.2.10", Carry::Tls);
        assert!(matches!(revisit(&old, &tls_conn), Revisit::Kept(..)));
    }
    const REG: &str = "[[org.allow]]\nid = \"reg\"\nhost = \"a.test\"\nports = [443]\nintercept = true\nwebsocket = true\n";

    /// A request of `method` `path` (a WebSocket handshake or not) inside
    /// an intercepted connection to a.test:443, decided under `served`.
    fn request(served: &Arc<Served>, method: &str, path: &str, websocket: bool) -> Conn {
        let mut c = decided(served, "a.test", 443, "198.18.2.10", Carry::Tls);
        c.kind = Kind::Http;
        c.tunnel = None;
        c.asked = Some(Asked {
            method: method.into(),
            path: path.into(),
            websocket,
            intercepted: true,
        });
        c
    }

    #[test]
    fn a_request_inside_is_held_to_its_rules_request_rules() {
        let old = served(&rules(REG));
        let get = request(&old, "GET", "/api/keys", false);
        let ws = request(&old, "GET", "/ws", true);
        assert!(matches!(revisit(&old, &get), Revisit::Kept(..)));
        assert!(matches!(revisit(&old, &ws), Revisit::Kept(..)));
        // Its path denied: revoked; another path kept.
        let denied = served(&rules(&format!("{REG}deny_paths = [\"/API\"]\n")));
        assert!(
            matches!(revisit(&denied, &get), Revisit::Revoked(_, d) if d.starts_with("now path_not_allowed")),
        );
        assert!(matches!(revisit(&denied, &ws), Revisit::Kept(..)));
        // Its method no longer listed.
        let posts = served(&rules(&format!("{REG}methods = [\"POST\"]\n")));
        assert!(
            matches!(revisit(&posts, &get), Revisit::Revoked(_, d) if d.starts_with("now method_not_allowed")),
        );
        // A WebSocket handshake is decided as the GET it is.
        assert!(
            matches!(revisit(&posts, &ws), Revisit::Revoked(_, d) if d.starts_with("now method_not_allowed")),
        );
        // WebSocket turned off: the stream goes, a plain request stays.
        let off = served(&rules(&REG.replace("websocket = true\n", "")));
        assert!(
            matches!(revisit(&off, &ws), Revisit::Revoked(_, d) if d == "rule reg no longer has websocket = true"),
        );
        assert!(matches!(revisit(&off, &get), Revisit::Kept(..)));
        // No longer intercepted.
        let plain = served(&rules(A_TEST));
        assert!(
            matches!(revisit(&plain, &get), Revisit::Revoked(_, d) if d == "its rule no longer intercepts"),
        );
    }

    #[test]
    fn a_forwarded_request_is_held_to_its_target_and_any_request_rules() {
        let port80 = "[[org.allow]]\nid = \"web\"\nhost = \"a.test\"\nports = [80]\n";
        let old = served(&rules(port80));
        let mut get = decided(&old, "a.test", 80, "198.18.2.10", Carry::Http);
        get.kind = Kind::Http;
        get.tunnel = None;
        get.asked = Some(Asked {
            method: "GET".into(),
            path: "/x".into(),
            websocket: false,
            intercepted: false,
        });
        // No tunnel kind to hold it to: kept under the same rules.
        assert!(matches!(revisit(&old, &get), Revisit::Kept(..)));
        assert!(matches!(
            revisit(&served(&rules(B_TEST)), &get),
            Revisit::Revoked(_, d) if d == "now no_matching_rule"
        ));
        // A rule that now intercepts binds it by its request rules too.
        let intercepting = served(&rules(&format!(
            "{}intercept = true\ndeny_paths = [\"/x\"]\n",
            port80
        )));
        assert!(
            matches!(revisit(&intercepting, &get), Revisit::Revoked(_, d) if d.starts_with("now path_not_allowed")),
        );
    }
}
