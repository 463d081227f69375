//! What-if replay, the engine of `palisade replay`: re-decide every
//! recorded decision under a candidate policy and report which flows would
//! flip, so a change can be reviewed before it is applied.
//!
//! Deterministic by construction: no name is resolved again. A name's
//! recorded `ip` (the address that was dialled) stands in for its
//! resolution; a name denied before resolution has no address, and if the
//! candidate allows it by name the replay says "allowed by name, address
//! not known" (`unresolved`) instead of guessing. Records whose reason is
//! not a policy decision (limits, bad requests, evidence, resolution and
//! SNI/Host checks that depend on bytes not recorded) are counted as not
//! re-decidable.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use serde::Serialize;

use crate::evidence::{Event, Kind, Record};
use crate::policy::{Decision, Layer, Policy, Reason};
use crate::proto::target::normalize_host;

/// One flow whose decision changes.
#[derive(Debug, Clone, Serialize)]
pub struct Flip {
    pub id: String,
    pub org: Option<String>,
    pub client: String,
    pub kind: String,
    pub host: String,
    pub port: Option<u16>,
    pub before: String,
    pub before_reason: String,
    pub before_rule: Option<String>,
    /// The layer of the rule that decided, as recorded.
    pub before_layer: Option<Layer>,
    pub after: &'static str,
    pub after_reason: Reason,
    pub after_rule: Option<String>,
    /// The layer of the candidate's deciding rule (`baseline` or `org`).
    pub after_layer: Option<Layer>,
    /// Allowed by name under the candidate, but the address was never
    /// resolved (denied before resolution): the address checks still apply.
    pub unresolved: bool,
}

/// The replay's result.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub candidate_policy: String,
    /// SHA-256 of the candidate's baseline file, null without one.
    pub candidate_baseline: Option<String>,
    pub decisions: u64,
    pub replayed: u64,
    pub unchanged: u64,
    pub not_replayable: u64,
    pub flips: Vec<Flip>,
    /// (org, direction, rule) → count, direction `allow->deny` or `deny->allow`.
    pub by_org_rule: BTreeMap<String, u64>,
}

/// The candidate's verdict for one recorded decision, or None if the record
/// is not a policy decision that can be replayed.
fn redecide(policy: &Policy, r: &Record) -> Option<(crate::policy::Verdict, bool)> {
    // What the policy decides from the record's client, target and
    // address alone: its allows, and these denials.
    let denied_by_policy = [
        Reason::UnknownClient,
        Reason::NoMatchingRule,
        Reason::ExplicitDeny,
        Reason::PortNotAllowed,
        Reason::DeniedAddress,
    ];
    if !(r.reason.is_allow() || denied_by_policy.contains(&r.reason)) {
        return None;
    }
    let client: IpAddr = r.client?.ip();
    let host = r.host.as_deref()?;
    if r.kind == Kind::Dns {
        return Some((policy.decide_name_any_port(client, host), false));
    }
    let target = normalize_host(host).ok()?;
    match policy.decide(client, &target, r.port?) {
        Decision::Final(v) => Some((v, false)),
        Decision::Resolve(pending) => match r.ip {
            Some(ip) => Some((policy.check_addresses(&pending, &[ip]).verdict, false)),
            None => {
                // Allowed by name; the address was never resolved.
                let verdict = crate::policy::Verdict {
                    org: Some(pending.org.clone()),
                    reason: pending
                        .would_deny
                        .map_or(Reason::RuleMatch, |_| Reason::ReportOnly),
                    rule: pending.rule.clone(),
                    would_deny: pending.would_deny,
                };
                Some((verdict, true))
            }
        },
    }
}

/// Replay every decision record under `evidence` against `policy`.
pub fn replay(evidence: &Path, policy: &Policy) -> std::io::Result<Report> {
    let mut report = Report {
        candidate_policy: policy.hash().to_string(),
        candidate_baseline: policy.baseline_hash().map(|h| h.to_string()),
        ..Report::default()
    };
    for stored in crate::evidence::query::read_records(evidence) {
        let r = stored.map_err(std::io::Error::other)?.record;
        if r.event != Event::Decision {
            continue;
        }
        report.decisions += 1;
        let Some((verdict, unresolved)) = redecide(policy, &r) else {
            report.not_replayable += 1;
            continue;
        };
        report.replayed += 1;
        let before = r.reason.decision().to_string();
        let after = verdict.reason.decision();
        if before == after {
            report.unchanged += 1;
            continue;
        }
        let org = verdict
            .org
            .as_ref()
            .map(|o| o.name.to_string())
            .or_else(|| r.org.as_deref().map(str::to_string));
        let before_rule = r.rule.as_deref().map(str::to_string);
        let after_rule = verdict.rule.as_ref().map(|r| r.to_string());
        let rule = if after == "allow" {
            after_rule.clone()
        } else {
            after_rule.clone().or_else(|| before_rule.clone())
        };
        let key = format!(
            "{}\t{before}->{after}\t{}",
            org.as_deref().unwrap_or("unknown"),
            rule.as_deref().unwrap_or("-")
        );
        *report.by_org_rule.entry(key).or_default() += 1;
        report.flips.push(Flip {
            id: r.id.clone(),
            org,
            client: r.client.map(|c| c.to_string()).unwrap_or_default(),
            kind: r.kind.as_str().to_string(),
            host: r.host.clone().unwrap_or_default(),
            port: r.port,
            before,
            before_reason: r.reason.as_str().to_string(),
            before_rule,
            before_layer: r.layer,
            after,
            after_reason: verdict.reason,
            after_layer: policy.layer_of(&verdict),
            after_rule,
            unresolved,
        });
    }
    Ok(report)
}

/// `, baseline` after a reason the baseline decided; nothing for an org's.
fn layer_note(layer: Option<Layer>) -> &'static str {
    match layer {
        Some(Layer::Baseline) => ", baseline",
        _ => "",
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "replayed {} of {} decisions under policy {}: {} unchanged, {} would flip, {} not replayable",
            self.replayed,
            self.decisions,
            self.candidate_policy,
            self.unchanged,
            self.flips.len(),
            self.not_replayable
        )?;
        if !self.by_org_rule.is_empty() {
            writeln!(f, "\nflips by org and rule:\norg\tchange\trule\tcount")?;
            for (key, n) in &self.by_org_rule {
                writeln!(f, "{key}\t{n}")?;
            }
            writeln!(f, "\nflows:")?;
            for x in &self.flips {
                writeln!(
                    f,
                    "{} {} {} {}:{} {} ({}{}) -> {} ({}{}){}",
                    x.id,
                    x.org.as_deref().unwrap_or("unknown"),
                    x.kind,
                    x.host,
                    x.port.map_or("-".to_string(), |p| p.to_string()),
                    x.before,
                    x.before_reason,
                    layer_note(x.before_layer),
                    x.after,
                    x.after_reason,
                    layer_note(x.after_layer),
                    if x.unresolved {
                        " [address not known]"
                    } else {
                        ""
                    }
                )?;
            }
        }
        Ok(())
    }
}
