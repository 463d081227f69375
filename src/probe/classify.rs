//! Classification: what a probe's observation and the records that fit
//! it ([`super::fit`]) together show (one of the [`Class`]es, and why).
//! Pure: an observation and records in, a class out.
//!
//! In-tunnel probes (`second_host`, `silence`, `ech`) get no 403 to quote:
//! Palisade closes the tunnel. Their denial is a fitting record (or one
//! naming the tunnel's decision record in `conn`) whose `reason` is one of the in-tunnel reasons ([`TUNNEL_REASONS`])
//! and whose `host` or `sni` is a name the probe presented (the CONNECT
//! host, the SNI, the second request's Host). `request` probes on an
//! intercepted host get a 403.
//!
//! The observation only says what the client saw; a record id it quotes
//! is checked by the report, not here.
//!
//! Classification (expect / what the client saw / what Palisade recorded):
//!
//! | expect | client | Palisade's records | class |
//! |---|---|---|---|
//! | any | probe never got to try (proxy unreachable, name unresolvable, deadline) | none | `inconclusive` |
//! | deny | target answered | any | `unexpected_allow` |
//! | deny, not in-tunnel | any | an allow, whatever else | `unexpected_allow` |
//! | deny | did not answer | a `resolution_failed` deny naming a rule | `unexpected_allow` |
//! | deny | did not answer | a policy denial (in-tunnel: one that closed the tunnel, or the tunnel never allowed) | `enforced_deny` |
//! | deny, `second_host` | no second response, the upstream closed after the first | allow only | `inconclusive` (nothing could answer the second request) |
//! | deny | did not answer | none | `blocked_elsewhere` |
//! | allow | target answered | allow | `enforced_allow` |
//! | allow | target answered | none | `inconclusive` (a path around Palisade, or evidence missing; the report lists it as a finding) |
//! | allow | did not answer | a policy denial | `unexpected_deny` |
//! | allow | did not answer | `resolution_failed`, allow with a connect failure | `inconclusive` (upstream broken) |
//! | allow | did not answer | none | `blocked_elsewhere` |
//!
//! "Target answered" for in-tunnel probes means the part after the tunnel
//! opened: a response to the second request, a TLS reply to the late or
//! ECH ClientHello; a connection left open and silent after it, with only
//! the tunnel's allow recorded, is `unexpected_allow` too (Palisade
//! forwarded it). The `why` of an `enforced_deny` says whether the tunnel
//! was closed by an in-tunnel check or refused before it opened (then what
//! it carries was not exercised).
//!
//! A DNS allow probe counts as answered only with at least one answer.
//! `evidence_unavailable` and `limit_exceeded` denials are `inconclusive`.

use std::fmt::Write as _;

use super::plan::{parse_target, Target};
use super::run::{Observation, ProbeOutcome};
use super::{Class, Expect, Via};
use crate::evidence::Record;
use crate::policy::Reason;

/// Reasons Palisade gives when it closes a tunnel for what it carried.
pub(crate) const TUNNEL_REASONS: [Reason; 7] = [
    Reason::ProtocolMismatch,
    Reason::SniMismatch,
    Reason::SniMissing,
    Reason::EchNotAllowed,
    Reason::HostMismatch,
    Reason::UpgradeNotAllowed,
    Reason::BadRequest,
];

/// Does the probe test what an open tunnel carries?
pub(crate) fn in_tunnel(o: &Observation) -> bool {
    o.second_host.is_some() || o.silence_ms.is_some() || o.ech
}

/// The names a probe presented (target host, SNI, second Host), lower-cased.
fn presented_names(o: &Observation) -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(t) = parse_target(&o.target) {
        if let Some((h, _)) = t.host_port() {
            names.push(h.trim_start_matches('[').trim_end_matches(']').to_string());
        }
        if let Target::Tls { sni, .. } = t {
            names.push(sni);
        }
    }
    names.extend(o.second_host.iter().cloned());
    names
        .into_iter()
        .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
        .collect()
}

/// Denials that closed the probe's tunnel for what it carried: an in-tunnel
/// reason, naming a name the probe presented.
fn tunnel_denials<'a>(o: &Observation, deny: &[&'a Record]) -> Vec<&'a Record> {
    let names = presented_names(o);
    let named = |v: &Option<String>| {
        let v = v
            .as_deref()
            .unwrap_or_default()
            .trim_end_matches('.')
            .to_ascii_lowercase();
        !v.is_empty() && names.contains(&v)
    };
    deny.iter()
        .copied()
        .filter(|r| TUNNEL_REASONS.contains(&r.reason))
        .filter(|r| named(&r.host) || named(&r.sni))
        .collect()
}

/// The allows that let the probe's traffic through: all of them but a
/// tunnel's whose request inside it (an intercepted connection's, from
/// the same client socket) Palisade denied.
fn carried_allow<'a>(allow: &[&'a Record], deny: &[&Record]) -> Vec<&'a Record> {
    allow
        .iter()
        .copied()
        .filter(|a| {
            !(a.kind == crate::evidence::Kind::Tcp
                && deny
                    .iter()
                    .any(|d| d.kind == crate::evidence::Kind::Http && d.client == a.client))
        })
        .collect()
}

/// Denials that say nothing about policy: Palisade could not decide.
const INFRA_REASONS: [Reason; 2] = [Reason::EvidenceUnavailable, Reason::LimitExceeded];

/// The ids of records, comma-separated.
fn ids(rs: &[&Record]) -> String {
    rs.iter()
        .map(|r| r.id.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `reason (id)` of records, comma-separated.
fn reasons(rs: &[&Record]) -> String {
    rs.iter()
        .map(|r| format!("{} ({})", r.reason, r.id))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The class of one observation given the records matched to it, and why.
pub(crate) fn classify(o: &Observation, recs: &[&Record]) -> (Class, String) {
    let only = |keep: &dyn Fn(&Record) -> bool| -> Vec<&Record> {
        recs.iter().copied().filter(|r| keep(r)).collect()
    };
    let deny = only(&|r| r.decision_str() == "deny");
    let allow = only(&|r| r.decision_str() == "allow");
    let policy_deny = only(&|r| {
        r.decision_str() == "deny"
            && r.reason != Reason::ResolutionFailed
            && !INFRA_REASONS.contains(&r.reason)
    });
    let unresolved = only(&|r| r.decision_str() == "deny" && r.reason == Reason::ResolutionFailed);
    let infra = only(&|r| r.decision_str() == "deny" && INFRA_REASONS.contains(&r.reason));
    let answered = match o.outcome {
        ProbeOutcome::Reached => {
            !(o.kind == "dns" && o.expect == Expect::Allow && o.dns_answers.is_empty())
        }
        _ => false,
    };
    if o.outcome == ProbeOutcome::SetupFailed && recs.is_empty() {
        return (
            Class::Inconclusive,
            format!(
                "the probe never reached its target or Palisade: {} ({})",
                o.error.as_deref().unwrap_or("setup failed"),
                o.error_detail.as_deref().unwrap_or("")
            ),
        );
    }
    match o.expect {
        Expect::Deny => {
            if o.outcome == ProbeOutcome::Reached {
                let cite = if allow.is_empty() {
                    "with no Palisade record".to_string()
                } else {
                    format!("Palisade allowed it: {}", ids(&allow))
                };
                return (
                    Class::UnexpectedAllow,
                    format!("the target answered ({}), {cite}", observed_text(o)),
                );
            }
            if in_tunnel(o) {
                let closed = tunnel_denials(o, &policy_deny);
                if !closed.is_empty() {
                    let tunnel = if allow.is_empty() {
                        String::new()
                    } else {
                        format!(" (the tunnel was allowed: {})", ids(&allow))
                    };
                    return (
                        Class::EnforcedDeny,
                        format!(
                            "Palisade closed the tunnel for what it carried: {}{tunnel}",
                            reasons(&closed)
                        ),
                    );
                }
                if allow.is_empty() && !policy_deny.is_empty() {
                    return (
                        Class::EnforcedDeny,
                        format!(
                            "Palisade refused the connection itself ({}): the tunnel never opened, so what it carries was not exercised",
                            reasons(&policy_deny)
                        ),
                    );
                }
            } else if !carried_allow(&allow, &policy_deny).is_empty() {
                return (
                    Class::UnexpectedAllow,
                    format!(
                        "Palisade allowed it ({}), whatever the client reported ({})",
                        ids(&carried_allow(&allow, &policy_deny)),
                        observed_text(o)
                    ),
                );
            } else if !policy_deny.is_empty() {
                return (
                    Class::EnforcedDeny,
                    format!("Palisade denied: {}", reasons(&policy_deny)),
                );
            }
            if !allow.is_empty() && o.second_host.is_some() && o.first_close {
                return (
                    Class::Inconclusive,
                    format!(
                        "the upstream closed the connection after the first response, so nothing could answer the second request, and Palisade recorded no refusal of it (allowed: {}): re-run against an upstream that keeps connections alive",
                        ids(&allow)
                    ),
                );
            }
            if !allow.is_empty() && in_tunnel(o) {
                return (
                    Class::UnexpectedAllow,
                    format!(
                        "Palisade allowed the tunnel ({}) and recorded no refusal of what it carried ({})",
                        ids(&allow),
                        observed_text(o)
                    ),
                );
            }
            if let Some((r, rule)) = unresolved
                .iter()
                .find_map(|r| Some((r, r.rule.as_deref().filter(|x| !x.is_empty())?)))
            {
                return (
                    Class::UnexpectedAllow,
                    format!("the policy allows it (rule {rule}, record {}); it failed only because the name did not resolve", r.id),
                );
            }
            if !infra.is_empty() || !unresolved.is_empty() {
                let all: Vec<&Record> = infra.iter().chain(&unresolved).copied().collect();
                return (
                    Class::Inconclusive,
                    format!("Palisade could not decide on policy: {}", reasons(&all)),
                );
            }
            (
                Class::BlockedElsewhere,
                format!(
                    "failed ({}) and Palisade recorded nothing: another layer stopped it; not evidence of Palisade's enforcement",
                    observed_text(o)
                ),
            )
        }
        Expect::Allow => {
            if answered {
                if !allow.is_empty() && policy_deny.is_empty() {
                    return (
                        Class::EnforcedAllow,
                        format!("Palisade allowed: {}", ids(&allow)),
                    );
                }
                if recs.is_empty() {
                    return (
                        Class::Inconclusive,
                        "the target answered but Palisade recorded nothing: this path goes around Palisade, or the evidence is incomplete".into(),
                    );
                }
                return (
                    Class::Inconclusive,
                    format!(
                        "the target answered despite Palisade's records: {}",
                        reasons(&deny)
                    ),
                );
            }
            if !policy_deny.is_empty() {
                return (
                    Class::UnexpectedDeny,
                    format!("Palisade denied: {}", reasons(&policy_deny)),
                );
            }
            if !unresolved.is_empty() || !infra.is_empty() {
                let all: Vec<&Record> = unresolved.iter().chain(&infra).copied().collect();
                return (
                    Class::Inconclusive,
                    format!("setup failed on Palisade's side: {}", reasons(&all)),
                );
            }
            if !allow.is_empty() {
                let detail: Vec<&str> = allow.iter().filter_map(|r| r.detail.as_deref()).collect();
                return (
                    Class::Inconclusive,
                    format!(
                        "Palisade allowed it ({}) but the target did not answer{}",
                        ids(&allow),
                        if detail.is_empty() {
                            String::new()
                        } else {
                            format!(": {}", detail.join("; "))
                        }
                    ),
                );
            }
            if o.outcome == ProbeOutcome::SetupFailed
                || (o.via == Via::Proxy && o.stage == "proxy_connect")
            {
                return (
                    Class::Inconclusive,
                    format!("never reached Palisade: {}", observed_text(o)),
                );
            }
            (
                Class::BlockedElsewhere,
                format!(
                    "failed ({}) and Palisade recorded nothing: another layer stopped it",
                    observed_text(o)
                ),
            )
        }
    }
}

/// One line on what the client saw.
pub(crate) fn observed_text(o: &Observation) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(c) = o.connect_status {
        parts.push(format!("CONNECT {c}"));
    }
    if let Some(h) = o.http_status {
        parts.push(format!("HTTP {h}"));
    }
    if let Some(ms) = o.silence_ms {
        match o.closed_in_silence_ms {
            Some(c) => parts.push(format!("silent {ms} ms: closed after {c} ms")),
            None => parts.push(format!("silent {ms} ms")),
        }
    }
    if o.ech {
        parts.push("ClientHello with ECH".into());
    }
    if let Some(t) = &o.tls {
        parts.push(format!("TLS {t}"));
    }
    if let Some(h) = &o.second_host {
        let what = match (o.second.as_deref(), o.second_status) {
            (Some("answered"), Some(st)) => format!("HTTP {st}"),
            (Some(w), _) => w.to_string(),
            (None, _) => "not sent".into(),
        };
        parts.push(format!("second request (Host {h}): {what}"));
        if o.first_close {
            parts.push("the first response closed the connection".into());
        }
    }
    if let Some(r) = &o.dns_rcode {
        let mut t = format!("DNS {r}");
        if !o.dns_answers.is_empty() {
            let _ = write!(t, " [{}]", o.dns_answers.join(", "));
        }
        parts.push(t);
    }
    if o.kind == "tcp" && o.connected && o.error.is_none() {
        parts.push(format!("connected, {} bytes received", o.bytes_received));
    }
    if o.kind == "udp" && o.outcome == ProbeOutcome::Reached {
        parts.push(format!("UDP reply, {} bytes", o.bytes_received));
    }
    if let Some(e) = &o.error {
        parts.push(format!("error {e}"));
    }
    if parts.is_empty() {
        parts.push(format!("{:?}", o.outcome).to_lowercase());
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::probe::fit::{assign, Case};

    const CLIENT: &str = "198.18.1.2:40000";

    /// An observation of a deny probe through the proxy, from socket CLIENT
    /// between 12:00:00 and 12:00:03, with `extra` fields on top.
    fn obs(target: &str, extra: Value) -> Observation {
        let mut v = json!({
            "id": "p", "marker": "pp-1-0000", "target": target, "kind": "tls",
            "via": "proxy", "expect": "deny",
            "started": "2030-01-01T12:00:00.000000Z", "finished": "2030-01-01T12:00:03.000000Z",
            "elapsed_ms": 3000,
            "sockets": [{"purpose": "proxy", "proto": "tcp", "local": CLIENT, "remote": "198.18.1.1:3128"}],
            "resolved": [], "connected": true, "connect_status": 200,
            "bytes_sent": 0, "bytes_received": 0, "dns_answers": [],
            "stage": "done", "outcome": "refused",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn rec(id: &str, decision: &str, reason: &str, extra: Value) -> Value {
        let mut v = json!({
            "id": id, "ts": "2030-01-01T12:00:01.000000Z", "kind": "tcp", "event": "decision",
            "client": CLIENT, "mode": "explicit", "decision": decision, "reason": reason,
            "host": "allowed.test", "port": 443, "sni": null, "policy": "p0",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// Records as the evidence reader gives them.
    fn typed(records: &[Value]) -> Vec<Record> {
        records
            .iter()
            .map(|v| serde_json::from_value(v.clone()).unwrap())
            .collect()
    }

    /// The records that fit `o` as the only probe of a plan with no org.
    fn match_records<'a>(o: &Observation, records: &'a [Record]) -> Vec<&'a Record> {
        let mut plan = crate::probe::plan::Probe::new(&o.id, &o.target, o.via, o.expect);
        plan.second_host = o.second_host.clone();
        let ips = o
            .sockets
            .iter()
            .filter_map(|s| s.local.as_deref()?.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip())
            .collect();
        let cases = [Some(Case::new(o, &plan, None, ips))];
        assign(&cases, records)[0]
            .iter()
            .map(|i| &records[*i])
            .collect()
    }

    fn class_of(o: &Observation, records: &[Value]) -> (Class, String) {
        classify(o, &match_records(o, &typed(records)))
    }

    fn allow_tunnel(sni: Option<&str>) -> Value {
        rec(
            "t-1",
            "allow",
            "rule_match",
            json!({"rule": "allow-0", "sni": sni}),
        )
    }

    #[test]
    fn silence_then_sni() {
        let closed = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "closed_in_silence_ms": 1003, "tls": "closed", "error": "closed"}),
        );
        let deny = rec(
            "t-2",
            "deny",
            "protocol_mismatch",
            json!({"detail": "no client bytes within detect_timeout (1s)"}),
        );
        let (c, why) = class_of(&closed, std::slice::from_ref(&deny));
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(
            why.contains("closed the tunnel") && why.contains("t-2"),
            "{why}"
        );
        // A record outside the probe's window is someone else's.
        let mut late = deny;
        late["ts"] = json!("2030-01-01T12:00:09.000000Z");
        assert_eq!(class_of(&closed, &[late]).0, Class::BlockedElsewhere);
        // The hole: the late ClientHello reached a server.
        let hole = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "tls": "server_hello", "outcome": "reached"}),
        );
        let (c, why) = class_of(&hole, &[allow_tunnel(Some("other.test"))]);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert!(why.contains("t-1"), "{why}");
        // Left open and silent after the hello, only the allow recorded:
        // Palisade forwarded it.
        let silent = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "tls": "no_reply", "outcome": "failed", "error": "timeout"}),
        );
        let (c, why) = class_of(&silent, &[allow_tunnel(None)]);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert!(why.contains("no refusal of what it carried"), "{why}");
    }

    #[test]
    fn ech_client_hello() {
        let o = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "tls": "closed", "error": "closed"}),
        );
        let deny = rec(
            "t-3",
            "deny",
            "ech_not_allowed",
            json!({"sni": "allowed.test", "host": "allowed.test"}),
        );
        let (c, why) = class_of(&o, &[deny]);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(why.contains("ech_not_allowed (t-3)"), "{why}");
        let hole = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "tls": "server_hello", "outcome": "reached"}),
        );
        let (c, _) = class_of(&hole, &[allow_tunnel(Some("allowed.test"))]);
        assert_eq!(c, Class::UnexpectedAllow);
        // Refused before the tunnel opened: a denial, but the ECH check was
        // not exercised, and the why says so.
        let refused = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "connect_status": 403, "connected": false}),
        );
        let (c, why) = class_of(
            &refused,
            &[rec("t-4", "deny", "no_matching_rule", json!({}))],
        );
        assert_eq!(c, Class::EnforcedDeny);
        assert!(why.contains("never opened"), "{why}");
    }

    #[test]
    fn second_request_other_host() {
        let target = "http://allowed.test/palisade-probe/pp-1-0000";
        let o = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "closed", "error": "closed", "first_close": true}),
        );
        let allow = rec("t-5", "allow", "rule_match", json!({"port": 80}));
        // The in-tunnel denial: joined through `conn` even without a client.
        let deny = rec(
            "t-6",
            "deny",
            "host_mismatch",
            json!({"host": "other.test", "port": 80, "conn": "t-5", "client": null}),
        );
        let both = typed(&[allow.clone(), deny]);
        let matched = match_records(&o, &both);
        assert_eq!(matched.len(), 2);
        let (c, why) = classify(&o, &matched);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(
            why.contains("host_mismatch (t-6)") && why.contains("allowed: t-5"),
            "{why}"
        );
        // The hole: the upstream answered the second request.
        let hole = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "answered", "second_status": 200, "outcome": "reached"}),
        );
        let (c, why) = class_of(&hole, std::slice::from_ref(&allow));
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        // Connection kept open, no response, only the allow: forwarded.
        let open = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "silent", "outcome": "failed", "error": "timeout"}),
        );
        assert_eq!(
            class_of(&open, std::slice::from_ref(&allow)).0,
            Class::UnexpectedAllow
        );
        // The upstream closed after the first response and Palisade
        // recorded nothing about the second: not established.
        let (c, why) = class_of(&o, &[allow]);
        assert_eq!(c, Class::Inconclusive, "{why}");
        assert!(why.contains("keeps connections alive"), "{why}");
    }

    #[test]
    fn encoded_path() {
        let target = "https://a.wild.test/api/%69nternal";
        let refused = obs(
            target,
            json!({"kind": "https", "tls": "handshake", "handshake": true, "http_status": 403,
                   "proxy_status": "palisade; error=http_request_denied; details=\"path_not_allowed; record=t-8\"",
                   "palisade_record": "t-8"}),
        );
        let deny = rec(
            "t-8",
            "deny",
            "path_not_allowed",
            json!({"kind": "http", "host": "a.wild.test", "path": "/api/%69nternal", "client": "198.18.1.2:1"}),
        );
        let (c, why) = class_of(&refused, &[deny]);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(why.contains("path_not_allowed (t-8)"), "{why}");
        let hole = obs(
            target,
            json!({"kind": "https", "tls": "handshake", "handshake": true, "http_status": 200,
                   "outcome": "reached"}),
        );
        let (c, _) = class_of(
            &hole,
            &[rec(
                "t-9",
                "allow",
                "rule_match",
                json!({"kind": "http", "host": "a.wild.test"}),
            )],
        );
        assert_eq!(c, Class::UnexpectedAllow);
        // With no record, the 403 alone shows nothing Palisade did (the
        // report also lists the quoted record missing from the evidence).
        assert_eq!(class_of(&refused, &[]).0, Class::BlockedElsewhere);
    }

    #[test]
    fn observed_text_tells_the_in_tunnel_part() {
        let o = obs(
            "http://allowed.test/",
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "closed", "first_close": true, "connect_status": null}),
        );
        assert_eq!(
            observed_text(&o),
            "HTTP 200, second request (Host other.test): closed, the first response closed the connection"
        );
        let o = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "closed_in_silence_ms": 1001, "tls": "closed", "ech": true}),
        );
        assert_eq!(
            observed_text(&o),
            "CONNECT 200, silent 1500 ms: closed after 1001 ms, ClientHello with ECH, TLS closed"
        );
    }
}
