//! `palisade probe report`: verify the evidence chain, join each
//! observation to Palisade's records, classify, and render.
//!
//! Matching rules (a record belongs to a probe if any holds):
//!
//! 1. its `id` is the record id Palisade quoted back to the probe (the 403
//!    body, `Proxy-Status` `record=`, or the DNS Extended Error text);
//! 2. its `path` or `host` contains the probe's marker (HTTP paths and DNS
//!    labels the plan put `{marker}` in);
//! 3. its `client` is the local `ip:port` of a socket the probe opened and
//!    its `ts` lies within the probe's start and finish, widened by
//!    [`SLACK`] each side (CONNECT, TLS, TCP, transparent and DNS probes);
//! 4. its `conn` is the id of a record matched by 1-3 (a denial inside a
//!    tunnel points at the tunnel's allow record).
//!
//! In-tunnel probes (`second_host`, `silence`, `ech`) get no 403 to quote:
//! Palisade closes the tunnel. Their denial is a record matched by rule 3
//! or 4 whose `reason` is one of the in-tunnel reasons ([`TUNNEL_REASONS`])
//! and whose `host` or `sni` is a name the probe presented (the CONNECT
//! host, the SNI, the second request's Host). `request` probes on an
//! intercepted host get a 403 and are matched by rule 1.
//!
//! Ports are reused, so rule 3 needs the time window; probes run one at a
//! time, so windows do not overlap. A name lookup a direct probe made on
//! its own behalf counts only when it was denied (an allowed lookup says
//! nothing about the connection).
//!
//! Classification (expect / what the client saw / what Palisade recorded):
//!
//! | expect | client | Palisade's records | class |
//! |---|---|---|---|
//! | any | probe never got to try (proxy unreachable, name unresolvable, deadline) | none | `inconclusive` |
//! | deny | target answered | any | `unexpected_allow` |
//! | deny | did not answer | allow only, or a `resolution_failed` deny naming a rule | `unexpected_allow` |
//! | deny | did not answer | a policy denial | `enforced_deny` |
//! | deny, `second_host` | no second response, the upstream closed after the first | allow only | `inconclusive` (nothing could answer the second request) |
//! | deny | did not answer | none | `blocked_elsewhere` |
//! | allow | target answered | allow | `enforced_allow` |
//! | allow | target answered | none | `inconclusive` (a path around Palisade, or evidence missing) |
//! | allow | did not answer | a policy denial | `unexpected_deny` |
//! | allow | did not answer | `resolution_failed`, allow with a connect failure | `inconclusive` (upstream broken) |
//! | allow | did not answer | none | `blocked_elsewhere` |
//! | any | Palisade quoted a record id | that id not in the evidence | `inconclusive` |
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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime};

use ed25519_dalek::VerifyingKey;
use serde_json::{json, Map, Value};

use super::run::{Observation, Observations, Outcome};
use super::{Class, Expect, Layer, Via, REPORT_FORMAT};
use crate::evidence::{query, verify};

/// Widening of each probe's time window when matching by client address.
pub const SLACK: Duration = Duration::from_secs(2);

/// Inputs of a report.
pub struct Options<'a> {
    pub observations: &'a Path,
    pub evidence: &'a Path,
    pub key: Option<VerifyingKey>,
    pub allow_unsealed: bool,
}

/// A finished report and its exit status (0 all matched, 1 otherwise).
pub struct Report {
    pub json: Value,
    pub markdown: String,
    pub html: String,
    pub exit: u8,
}

/// Bad input (exit status 2).
#[derive(Debug)]
pub struct BadInput(pub String);

fn parse_ts(v: Option<&Value>) -> Option<SystemTime> {
    v.and_then(Value::as_str)
        .and_then(|s| humantime::parse_rfc3339_weak(s).ok())
}

fn s(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// Build the report.
pub fn build(opts: &Options) -> Result<Report, BadInput> {
    let text = std::fs::read_to_string(opts.observations)
        .map_err(|e| BadInput(format!("{}: {e}", opts.observations.display())))?;
    let obs: Observations = serde_json::from_str(&text).map_err(|e| {
        BadInput(format!(
            "{}: not an observations file: {e}",
            opts.observations.display()
        ))
    })?;
    if obs.format != super::OBSERVATIONS_FORMAT {
        return Err(BadInput(format!(
            "unknown observations format {:?}",
            obs.format
        )));
    }
    if !opts.evidence.exists() {
        return Err(BadInput(format!(
            "{}: no such evidence path",
            opts.evidence.display()
        )));
    }
    let vopts = verify::Options {
        key: opts.key,
        allow_unsealed: opts.allow_unsealed,
    };
    let mut scope = Map::new();
    scope.insert("org".into(), json!(obs.plan.org));
    scope.insert("plan_policy".into(), json!(obs.plan.policy));
    scope.insert("probe_run".into(), json!(obs.run));
    scope.insert("plan_sha256".into(), json!(obs.plan_sha256));
    scope.insert("probe_palisade_version".into(), json!(obs.palisade_version));
    scope.insert(
        "report_palisade_version".into(),
        json!(env!("CARGO_PKG_VERSION")),
    );
    scope.insert(
        "window".into(),
        json!({"start": obs.started, "end": obs.finished}),
    );
    scope.insert(
        "evidence_path".into(),
        json!(opts.evidence.display().to_string()),
    );
    let summary = match verify::verify_with(opts.evidence, &vopts) {
        Ok(s) => s,
        Err(e) => {
            let verification = json!({
                "ok": false,
                "error": e.to_string(),
                "file": e.file,
                "line": e.line,
                "message": e.message,
                "key_pinned": opts.key.is_some(),
                "allow_unsealed": opts.allow_unsealed,
            });
            let verdict = format!(
                "Not assessed: the evidence failed verification ({e}). No probe was classified: \
                 evidence that cannot be trusted cannot show what Palisade enforced."
            );
            let report = json!({
                "format": REPORT_FORMAT,
                "verification": verification,
                "scope": scope,
                "environment": obs.environment,
                "verdict": verdict,
                "exit_status": 1,
                "findings": [],
                "probes": [],
                "untested": [],
            });
            return Ok(render(report, 1));
        }
    };
    scope.insert("evidence_public_key".into(), json!(summary.key));
    scope.insert("evidence_key_pinned".into(), json!(summary.key_pinned));
    scope.insert("evidence_sealed".into(), json!(summary.sealed));
    scope.insert(
        "evidence_unsigned_tail".into(),
        json!(summary.unsigned_tail),
    );
    scope.insert(
        "evidence_span".into(),
        json!({"first": summary.first_ts, "last": summary.last_ts, "records": summary.records}),
    );
    let verification = json!({
        "ok": true,
        "summary": summary.to_string().trim_end(),
        "sealed": summary.sealed,
        "key_pinned": summary.key_pinned,
        "allow_unsealed": opts.allow_unsealed,
        "notes": summary.notes,
    });

    let mut records: Vec<Value> = Vec::new();
    query::for_each_record(opts.evidence, |m| {
        if matches!(m.get("event").and_then(Value::as_str), Some("decision")) {
            records.push(Value::Object(m.clone()));
        }
        Ok(())
    })
    .map_err(|e| BadInput(format!("{}: {e}", opts.evidence.display())))?;

    let mut rows = Vec::new();
    let mut policies = BTreeSet::new();
    let mut record_orgs = BTreeSet::new();
    for o in &obs.observations {
        let matched = match_records(o, &records);
        for r in &matched {
            policies.insert(s(r, "policy"));
            record_orgs.insert(s(r, "org"));
        }
        let (class, why) = classify(o, &matched);
        let matched_expectation = match class {
            Class::EnforcedAllow => o.expect == Expect::Allow,
            Class::EnforcedDeny => o.expect == Expect::Deny,
            Class::BlockedElsewhere => o.expect == Expect::Deny && o.layer == Layer::Any,
            _ => false,
        };
        rows.push(json!({
            "id": o.id,
            "target": o.target,
            "kind": o.kind,
            "via": o.via,
            "expect": o.expect,
            "layer": o.layer,
            "class": class.as_str(),
            "finding": class.is_finding(),
            "matched": matched_expectation,
            "why": why,
            "observed": observed_text(o),
            "outcome": o.outcome,
            "records": matched.iter().map(|r| json!({
                "id": r["id"], "ts": r["ts"], "kind": r["kind"], "mode": r["mode"], "client": r["client"],
                "host": r["host"], "port": r["port"], "sni": r["sni"], "ip": r["ip"],
                "decision": r["decision"], "reason": r["reason"], "rule": r["rule"], "detail": r.get("detail"),
                "conn": r.get("conn"),
            })).collect::<Vec<_>>(),
            "note": o.note,
            "marker": o.marker,
            "started": o.started,
            "elapsed_ms": o.elapsed_ms,
            "observation": serde_json::to_value(o).unwrap_or(Value::Null),
        }));
    }
    policies.remove("");
    let policy_matches = obs
        .plan
        .policy
        .as_ref()
        .map(|p| policies.len() == 1 && policies.contains(p));
    scope.insert("policy_matches_plan".into(), json!(policy_matches));
    scope.insert("policy_in_evidence".into(), json!(policies));
    scope.insert("orgs_in_evidence".into(), json!(record_orgs));

    let count = |c: &str| rows.iter().filter(|r| r["class"] == c).count();
    let total = rows.len();
    let findings: Vec<Value> = rows
        .iter()
        .filter(|r| r["finding"] == true)
        .cloned()
        .collect();
    let inconclusive = count("inconclusive");
    let unmatched = rows.iter().filter(|r| r["matched"] != true).count();
    let exit = if unmatched == 0 { 0 } else { 1 };
    let sources: BTreeSet<String> = obs
        .observations
        .iter()
        .flat_map(|o| o.sockets.iter())
        .filter_map(|s| s.local.as_deref())
        .filter_map(|l| {
            l.rsplit_once(':')
                .map(|(ip, _)| ip.trim_matches(['[', ']']).to_string())
        })
        .filter(|ip| ip != "0.0.0.0" && ip != "::")
        .collect();
    let sources_text = sources.iter().cloned().collect::<Vec<_>>().join(", ");
    let counts = json!({
        "probes": total,
        "enforced_allow": count("enforced_allow"),
        "enforced_deny": count("enforced_deny"),
        "blocked_elsewhere": count("blocked_elsewhere"),
        "unexpected_allow": count("unexpected_allow"),
        "unexpected_deny": count("unexpected_deny"),
        "inconclusive": inconclusive,
        "not_matching_expectation": unmatched,
    });
    let window = format!("{} .. {}", obs.started, obs.finished);
    let verdict = if !findings.is_empty() {
        format!(
            "FINDINGS: {} of {total} probes did not match the agreed paths ({} unexpected allow, {} unexpected deny); {inconclusive} inconclusive. \
             The environment does not have exactly the agreed network paths. Tested from {sources_text} during {window}.",
            findings.len(),
            count("unexpected_allow"),
            count("unexpected_deny"),
        )
    } else if unmatched > 0 {
        format!(
            "NOT DEMONSTRATED: no probe contradicted the plan, but {unmatched} of {total} probes did not show \
             enforcement ({inconclusive} inconclusive, {} blocked by another layer where the plan expected Palisade, \
             or allowed without an allow record). Re-run them once fixed. Tested from {sources_text} during {window}.",
            unmatched - inconclusive
        )
    } else {
        format!(
            "Within the {total} paths tested, from {sources_text} during {window}, the network paths matched the plan: \
             {} allowed with a Palisade allow record, {} denied with a Palisade deny record, {} stopped by another layer \
             where the plan accepted that. This covers the tested paths only: it does not show that no other path \
             exists (see the untested surfaces).",
            count("enforced_allow"),
            count("enforced_deny"),
            count("blocked_elsewhere"),
        )
    };
    let mut untested = untested(&obs, &sources_text);
    if policy_matches == Some(false) {
        untested.insert(
            0,
            "The policy that decided (policy hash in evidence) is not the one the plan names: the results describe the policy in the evidence.".into(),
        );
    }
    let report = json!({
        "format": REPORT_FORMAT,
        "verification": verification,
        "scope": scope,
        "environment": obs.environment,
        "counts": counts,
        "verdict": verdict,
        "exit_status": exit,
        "findings": findings,
        "probes": rows,
        "untested": untested,
    });
    Ok(render(report, exit))
}

/// Records that belong to an observation (see the module doc).
fn match_records<'a>(o: &Observation, records: &'a [Value]) -> Vec<&'a Value> {
    let start = humantime::parse_rfc3339_weak(&o.started)
        .ok()
        .map(|t| t - SLACK);
    let end = humantime::parse_rfc3339_weak(&o.finished)
        .ok()
        .map(|t| t + SLACK);
    let locals: Vec<(&str, &str)> = o
        .sockets
        .iter()
        .filter_map(|s| s.local.as_deref().map(|l| (l, s.purpose.as_str())))
        .collect();
    let mut out = Vec::new();
    for r in records {
        let id = s(r, "id");
        let by_id = o.palisade_record.as_deref() == Some(id.as_str());
        let by_marker = !o.marker.is_empty()
            && (s(r, "path").contains(&o.marker) || s(r, "host").contains(&o.marker));
        let client = s(r, "client");
        let by_socket = locals.iter().any(|(l, purpose)| {
            // Local addresses may be bound to 0.0.0.0 (UDP); compare ports then.
            let same = *l == client
                || (l.starts_with("0.0.0.0:") || l.starts_with("[::]:"))
                    && l.rsplit_once(':').map(|x| x.1) == client.rsplit_once(':').map(|x| x.1);
            same && (*purpose != "resolve" || r["decision"] == "deny")
        }) && match (parse_ts(r.get("ts")), start, end) {
            (Some(t), Some(a), Some(b)) => t >= a && t <= b,
            _ => false,
        };
        if by_id || by_marker || by_socket {
            out.push(r);
        }
    }
    // Rule 4: records pointing at a matched one (in-tunnel denials).
    let ids: BTreeSet<String> = out.iter().map(|r| s(r, "id")).collect();
    for r in records {
        let conn = s(r, "conn");
        if !conn.is_empty() && ids.contains(&conn) && !ids.contains(&s(r, "id")) {
            out.push(r);
        }
    }
    out
}

/// Reasons Palisade gives when it closes a tunnel for what it carried.
pub const TUNNEL_REASONS: [&str; 7] = [
    "protocol_mismatch",
    "sni_mismatch",
    "sni_missing",
    "ech_not_allowed",
    "host_mismatch",
    "upgrade_not_allowed",
    "bad_request",
];

/// Does the probe test what an open tunnel carries?
fn in_tunnel(o: &Observation) -> bool {
    o.second_host.is_some() || o.silence_ms.is_some() || o.ech
}

/// The names a probe presented (target host, SNI, second Host), lower-cased.
fn presented_names(o: &Observation) -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(t) = super::plan::parse_target(&o.target) {
        if let Some((h, _)) = t.host_port() {
            names.push(h.trim_start_matches('[').trim_end_matches(']').to_string());
        }
        if let super::plan::Target::Tls { sni, .. } = t {
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
fn tunnel_denials<'a>(o: &Observation, deny: &[&&'a Value]) -> Vec<&'a Value> {
    let names = presented_names(o);
    let named = |r: &Value, k: &str| {
        let v = s(r, k).trim_end_matches('.').to_ascii_lowercase();
        !v.is_empty() && names.contains(&v)
    };
    deny.iter()
        .map(|r| **r)
        .filter(|r| TUNNEL_REASONS.contains(&s(r, "reason").as_str()))
        .filter(|r| named(r, "host") || named(r, "sni"))
        .collect()
}

const INFRA_REASONS: [&str; 2] = ["evidence_unavailable", "limit_exceeded"];

fn classify(o: &Observation, recs: &[&Value]) -> (Class, String) {
    let ids = |rs: &[&&Value]| rs.iter().map(|r| s(r, "id")).collect::<Vec<_>>().join(", ");
    let deny: Vec<&&Value> = recs.iter().filter(|r| r["decision"] == "deny").collect();
    let allow: Vec<&&Value> = recs.iter().filter(|r| r["decision"] == "allow").collect();
    let policy_deny: Vec<&&Value> = deny
        .iter()
        .copied()
        .filter(|r| {
            let reason = s(r, "reason");
            reason != "resolution_failed" && !INFRA_REASONS.contains(&reason.as_str())
        })
        .collect();
    let unresolved: Vec<&&Value> = deny
        .iter()
        .copied()
        .filter(|r| r["reason"] == "resolution_failed")
        .collect();
    let infra: Vec<&&Value> = deny
        .iter()
        .copied()
        .filter(|r| INFRA_REASONS.contains(&s(r, "reason").as_str()))
        .collect();
    let reasons = |rs: &[&&Value]| {
        rs.iter()
            .map(|r| format!("{} ({})", s(r, "reason"), s(r, "id")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(q) = &o.palisade_record {
        if !recs.iter().any(|r| s(r, "id") == *q) {
            return (
                Class::Inconclusive,
                format!("Palisade quoted record {q}, which is not in the evidence given: wrong evidence directory or an incomplete copy"),
            );
        }
    }
    let answered = match o.outcome {
        Outcome::Reached => {
            !(o.kind == "dns" && o.expect == Expect::Allow && o.dns_answers.is_empty())
        }
        _ => false,
    };
    if o.outcome == Outcome::SetupFailed && recs.is_empty() {
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
            if o.outcome == Outcome::Reached {
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
            if !policy_deny.is_empty() && in_tunnel(o) {
                let closed = tunnel_denials(o, &policy_deny);
                if closed.is_empty() {
                    return (
                        Class::EnforcedDeny,
                        format!(
                            "Palisade refused the connection itself ({}): the tunnel never opened, so what it carries was not exercised",
                            reasons(&policy_deny)
                        ),
                    );
                }
                let refs: Vec<&&Value> = closed.iter().collect();
                let tunnel = if allow.is_empty() {
                    String::new()
                } else {
                    format!(" (the tunnel was allowed: {})", ids(&allow))
                };
                return (
                    Class::EnforcedDeny,
                    format!(
                        "Palisade closed the tunnel for what it carried: {}{tunnel}",
                        reasons(&refs)
                    ),
                );
            }
            if !policy_deny.is_empty() {
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
            if !allow.is_empty() {
                return (
                    Class::UnexpectedAllow,
                    format!(
                        "Palisade allowed it ({}); only the target failed to answer",
                        ids(&allow)
                    ),
                );
            }
            if let Some(r) = unresolved.iter().find(|r| !s(r, "rule").is_empty()) {
                return (
                    Class::UnexpectedAllow,
                    format!("the policy allows it (rule {}, record {}); it failed only because the name did not resolve", s(r, "rule"), s(r, "id")),
                );
            }
            if !infra.is_empty() || !unresolved.is_empty() {
                let mut all = infra.clone();
                all.extend(unresolved.iter().copied());
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
                let mut all = unresolved.clone();
                all.extend(infra.iter().copied());
                return (
                    Class::Inconclusive,
                    format!("setup failed on Palisade's side: {}", reasons(&all)),
                );
            }
            if !allow.is_empty() {
                let detail: Vec<String> = allow
                    .iter()
                    .filter_map(|r| r.get("detail").and_then(Value::as_str))
                    .map(str::to_string)
                    .collect();
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
            if o.outcome == Outcome::SetupFailed
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
fn observed_text(o: &Observation) -> String {
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
    if o.kind == "udp" && o.outcome == Outcome::Reached {
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

/// What the plan did not cover, listed explicitly.
fn untested(obs: &Observations, sources: &str) -> Vec<String> {
    let os = &obs.observations;
    let mut out = Vec::new();
    let has = |f: &dyn Fn(&Observation) -> bool| os.iter().any(f);
    let ipv6 = |o: &Observation| {
        super::plan::parse_target(&o.target).is_ok_and(|t| t.is_ipv6())
            || o.server.as_deref().is_some_and(|s| s.starts_with('['))
    };
    if !has(&ipv6) {
        out.push("IPv6: not probed.".to_string());
    }
    let udp_ports: BTreeSet<String> = os
        .iter()
        .filter(|o| o.kind == "udp")
        .filter_map(|o| o.target.rsplit_once(':').map(|x| x.1.to_string()))
        .collect();
    if udp_ports.is_empty() {
        out.push("UDP other than DNS (QUIC, NTP, ...): not probed.".to_string());
    } else {
        out.push(format!(
            "UDP other than DNS: only port(s) {} probed.",
            udp_ports.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if !has(&|o| o.kind == "dns") {
        out.push("DNS: not probed.".into());
    }
    if !has(&|o| o.via == Via::Direct && o.kind != "dns") {
        out.push("Connections that skip the proxy (direct egress): not probed.".into());
    }
    if !has(&|o| o.kind == "https" || o.kind == "tls") {
        out.push("TLS: not probed.".into());
    }
    let not_run: Vec<&str> = os
        .iter()
        .filter(|o| o.error.as_deref() == Some("deadline"))
        .map(|o| o.id.as_str())
        .collect();
    if !not_run.is_empty() {
        out.push(format!(
            "Probes not run (deadline): {}.",
            not_run.join(", ")
        ));
    }
    out.push("ICMP and IP protocols other than TCP and UDP: not probed.".into());
    out.push("TCP and UDP ports and destinations not in the probe table: not probed.".into());
    out.push(format!(
        "Only the source address(es) the probes ran from ({sources}): other sandbox hosts, other orgs' addresses and spoofed sources not probed."
    ));
    out.push(
        "Wildcard and CIDR rules: probed with the names and addresses in the table only.".into(),
    );
    let tunnel: Vec<&str> = os
        .iter()
        .filter(|o| in_tunnel(o) || o.handshake)
        .map(|o| o.id.as_str())
        .collect();
    if tunnel.is_empty() {
        out.push("TLS probes stop at the server's first reply: data carried inside allowed connections (covert channels, timing) not assessed.".into());
    } else {
        out.push(format!(
            "Inside allowed connections only what the in-tunnel probes sent was tested ({}); other data carried inside them (covert channels, timing) not assessed.",
            tunnel.join(", ")
        ));
    }
    out
}

fn render(report: Value, exit: u8) -> Report {
    let markdown = markdown(&report);
    let html = html(&report);
    Report {
        json: report,
        markdown,
        html,
        exit,
    }
}

fn cell(v: &str) -> String {
    v.replace('|', "\\|").replace('\n', " ")
}

fn record_cite(row: &Value) -> String {
    row["records"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| format!("{} {} {}", s(r, "id"), s(r, "decision"), s(r, "reason")))
                .collect::<Vec<_>>()
                .join("; ")
        })
        .unwrap_or_default()
}

fn markdown(r: &Value) -> String {
    let mut m = String::new();
    let _ = writeln!(m, "# Palisade containment report\n");
    let _ = writeln!(m, "**Verdict:** {}\n", s(r, "verdict"));
    let v = &r["verification"];
    let _ = writeln!(m, "## Evidence verification\n");
    if v["ok"] == true {
        let _ = writeln!(
            m,
            "Verified before classification (`palisade evidence verify`):\n"
        );
        let _ = writeln!(m, "```\n{}\n```\n", s(v, "summary"));
        if v["sealed"] != true {
            let _ = writeln!(m, "The chain is **not sealed** (a live instance); accepted because `--allow-unsealed` was given: records after the last checkpoint are not signed yet.\n");
        }
        if v["key_pinned"] != true {
            let _ = writeln!(m, "No `--key` was given: the signatures prove the evidence is consistent, not that it came from the expected instance.\n");
        }
    } else {
        let _ = writeln!(
            m,
            "**FAILED:** {}\n\nNo probe was classified.\n",
            s(v, "error")
        );
    }
    let sc = &r["scope"];
    let _ = writeln!(m, "## Scope\n");
    let _ = writeln!(m, "| | |\n|---|---|");
    for (k, label) in [
        ("org", "org (plan)"),
        ("plan_policy", "policy hash (plan)"),
        ("policy_in_evidence", "policy hash (evidence)"),
        ("policy_matches_plan", "evidence policy = plan policy"),
        ("orgs_in_evidence", "orgs (evidence)"),
        ("probe_palisade_version", "Palisade version (probe)"),
        ("report_palisade_version", "Palisade version (report)"),
        ("window", "time window"),
        ("evidence_public_key", "evidence public key"),
        ("evidence_key_pinned", "key pinned with --key"),
        ("evidence_sealed", "evidence sealed"),
        ("evidence_path", "evidence"),
        ("probe_run", "probe run"),
        ("plan_sha256", "plan SHA-256"),
    ] {
        let val = match &sc[k] {
            Value::String(x) => x.clone(),
            Value::Null => "-".into(),
            Value::Object(o) if o.contains_key("start") => {
                format!("{} .. {}", s(&sc[k], "start"), s(&sc[k], "end"))
            }
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().unwrap_or("").to_string())
                .collect::<Vec<_>>()
                .join(", "),
            other => other.to_string(),
        };
        let _ = writeln!(m, "| {label} | {} |", cell(&val));
    }
    let _ = writeln!(m);
    if let Some(c) = r["counts"].as_object() {
        let _ = writeln!(m, "## Counts\n");
        let _ = writeln!(m, "| class | probes |\n|---|---|");
        for (k, n) in c {
            let _ = writeln!(m, "| {k} | {n} |");
        }
        let _ = writeln!(m);
    }
    let _ = writeln!(m, "## Findings\n");
    let findings = r["findings"].as_array().cloned().unwrap_or_default();
    if findings.is_empty() {
        let _ = writeln!(m, "None among the probes classified.\n");
    } else {
        let _ = writeln!(m, "| probe | target | via | expected | class | why | records |\n|---|---|---|---|---|---|---|");
        for f in &findings {
            let _ = writeln!(
                m,
                "| {} | `{}` | {} | {} | **{}** | {} | {} |",
                s(f, "id"),
                cell(&s(f, "target")),
                s(f, "via"),
                s(f, "expect"),
                s(f, "class"),
                cell(&s(f, "why")),
                cell(&record_cite(f))
            );
        }
        let _ = writeln!(m);
    }
    let _ = writeln!(m, "## Probes\n");
    let _ = writeln!(m, "| probe | target | via | expected | observed | class | matches plan | Palisade records |\n|---|---|---|---|---|---|---|---|");
    for p in r["probes"].as_array().into_iter().flatten() {
        let _ = writeln!(
            m,
            "| {} | `{}` | {} | {}{} | {} | {} | {} | {} |",
            s(p, "id"),
            cell(&s(p, "target")),
            s(p, "via"),
            s(p, "expect"),
            if p["layer"] == "any" {
                " (any layer)"
            } else {
                ""
            },
            cell(&s(p, "observed")),
            s(p, "class"),
            if p["matched"] == true {
                "yes"
            } else {
                "**no**"
            },
            cell(&record_cite(p))
        );
    }
    let _ = writeln!(m);
    let _ = writeln!(m, "## Untested surfaces\n");
    for u in r["untested"].as_array().into_iter().flatten() {
        let _ = writeln!(m, "- {}", u.as_str().unwrap_or(""));
    }
    let _ = writeln!(m);
    let _ = writeln!(m, "## Environment (collected by the probe)\n");
    let env = &r["environment"];
    for (k, v) in env.as_object().into_iter().flatten() {
        match v {
            Value::Array(a) => {
                let _ = writeln!(m, "- {k}:");
                for x in a {
                    let _ = writeln!(
                        m,
                        "  - `{}`",
                        x.as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| x.to_string())
                    );
                }
            }
            Value::String(x) => {
                let _ = writeln!(m, "- {k}: `{x}`");
            }
            other => {
                let _ = writeln!(m, "- {k}: `{other}`");
            }
        }
    }
    m
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '&' => o.push_str("&amp;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn html(r: &Value) -> String {
    let mut h = String::new();
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
        <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\
        <title>Palisade containment report</title><style>\
        body{font-family:system-ui,sans-serif;margin:2em;color:#111}table{border-collapse:collapse;margin:1em 0}\
        td,th{border:1px solid #999;padding:.25em .5em;text-align:left;vertical-align:top;font-size:.9em}\
        th{background:#eee}.finding{background:#fdd}.bad{color:#a00;font-weight:bold}.ok{color:#060}\
        code,pre{font-family:ui-monospace,monospace;font-size:.9em}.verdict{font-size:1.1em;padding:.5em;border:2px solid #333}\
        </style></head><body>\n<h1>Palisade containment report</h1>\n");
    let _ = writeln!(
        h,
        "<p class=\"verdict\" id=\"verdict\">{}</p>",
        esc(&s(r, "verdict"))
    );
    let v = &r["verification"];
    h.push_str("<h2>Evidence verification</h2>\n");
    if v["ok"] == true {
        let _ = writeln!(
            h,
            "<pre id=\"verification\">{}</pre>",
            esc(&s(v, "summary"))
        );
        if v["sealed"] != true {
            h.push_str("<p>The chain is <b>not sealed</b> (a live instance); accepted with <code>--allow-unsealed</code>.</p>\n");
        }
        if v["key_pinned"] != true {
            h.push_str(
                "<p>No <code>--key</code> was given: consistency, not origin, is proven.</p>\n",
            );
        }
    } else {
        let _ = writeln!(
            h,
            "<p class=\"bad\" id=\"verification-failed\">FAILED: {}</p><p>No probe was classified.</p>",
            esc(&s(v, "error"))
        );
    }
    h.push_str("<h2>Scope</h2>\n<table id=\"scope\">\n");
    for (k, val) in r["scope"].as_object().into_iter().flatten() {
        let text = match val {
            Value::String(x) => x.clone(),
            other => other.to_string(),
        };
        let _ = writeln!(
            h,
            "<tr><th>{}</th><td><code>{}</code></td></tr>",
            esc(k),
            esc(&text)
        );
    }
    h.push_str("</table>\n<h2>Findings</h2>\n<table id=\"findings\">\n<tr><th>probe</th><th>target</th><th>via</th><th>expected</th><th>class</th><th>why</th><th>records</th></tr>\n");
    let findings = r["findings"].as_array().cloned().unwrap_or_default();
    if findings.is_empty() {
        h.push_str("<tr><td colspan=\"7\">None among the probes classified.</td></tr>\n");
    }
    for f in &findings {
        let _ = writeln!(
            h,
            "<tr class=\"finding\" data-probe=\"{}\" data-class=\"{}\"><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td class=\"bad\">{}</td><td>{}</td><td>{}</td></tr>",
            esc(&s(f, "id")),
            esc(&s(f, "class")),
            esc(&s(f, "id")),
            esc(&s(f, "target")),
            esc(&s(f, "via")),
            esc(&s(f, "expect")),
            esc(&s(f, "class")),
            esc(&s(f, "why")),
            esc(&record_cite(f))
        );
    }
    h.push_str("</table>\n<h2>Probes</h2>\n<table id=\"probes\">\n<tr><th>probe</th><th>target</th><th>via</th><th>expected</th><th>observed</th><th>class</th><th>matches plan</th><th>why</th><th>Palisade records</th></tr>\n");
    for p in r["probes"].as_array().into_iter().flatten() {
        let matched = p["matched"] == true;
        let _ = writeln!(
            h,
            "<tr data-probe=\"{}\" data-class=\"{}\"{}><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td></tr>",
            esc(&s(p, "id")),
            esc(&s(p, "class")),
            if p["finding"] == true { " class=\"finding\"" } else { "" },
            esc(&s(p, "id")),
            esc(&s(p, "target")),
            esc(&s(p, "via")),
            esc(&s(p, "expect")),
            if p["layer"] == "any" { " (any layer)" } else { "" },
            esc(&s(p, "observed")),
            esc(&s(p, "class")),
            if matched { "ok" } else { "bad" },
            if matched { "yes" } else { "no" },
            esc(&s(p, "why")),
            esc(&record_cite(p))
        );
    }
    h.push_str("</table>\n<h2>Untested surfaces</h2>\n<ul id=\"untested\">\n");
    for u in r["untested"].as_array().into_iter().flatten() {
        let _ = writeln!(h, "<li>{}</li>", esc(u.as_str().unwrap_or("")));
    }
    h.push_str(
        "</ul>\n<h2>Environment (collected by the probe)</h2>\n<table id=\"environment\">\n",
    );
    for (k, val) in r["environment"].as_object().into_iter().flatten() {
        let text = match val {
            Value::Array(a) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| x.to_string())
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Value::String(x) => x.clone(),
            other => other.to_string(),
        };
        let _ = writeln!(
            h,
            "<tr><th>{}</th><td><pre>{}</pre></td></tr>",
            esc(k),
            esc(&text)
        );
    }
    h.push_str("</table>\n</body></html>\n");
    h
}

/// Count of probes by class, for tests and callers.
pub fn classes(report: &Value) -> BTreeMap<String, String> {
    report["probes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| (s(p, "id"), s(p, "class")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
            "host": "allowed.test", "port": 443, "sni": null,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    fn class_of(o: &Observation, records: &[Value]) -> (Class, String) {
        classify(o, &match_records(o, records))
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
        let both = [allow.clone(), deny];
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
        // The quoted record must be in the evidence given.
        assert_eq!(class_of(&refused, &[]).0, Class::Inconclusive);
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
