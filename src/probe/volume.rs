//! Volume probes: does a budgeted allow rule (`max_bytes_up`,
//! `max_bytes_down`, on the rule or the org) stop what passes it?
//!
//! A volume probe moves the agreed budget plus [`super::plan::VOLUME_MARGIN`] through the
//! rule's target, one way: `up` sends it (a tunnel's raw bytes, or an
//! HTTP POST body), `down` reads it (what a `tcp://` target sends, or an
//! HTTP GET's body). The witness is Palisade's, not the client's: the
//! close record of the probe's connection (`conn` = its allow record)
//! says how many bytes were relayed that way (`bytes_up`, `bytes_down`),
//! and a `volume_exceeded` record linked to the same allow says Palisade
//! cut it. Classification ([`classify`]), first row that applies:
//!
//! | what the records show | class |
//! |---|---|
//! | the budget is over [`super::plan::MAX_VOLUME_BUDGET`]: not sent | `inconclusive` (listed as not run) |
//! | more relayed than the budget plus [`VOLUME_SLACK`] | `unexpected_allow` |
//! | refused `volume_exceeded` before anything was dialled (the budget was already spent) | `enforced_deny` |
//! | refused for another reason, or nothing on record | `inconclusive` |
//! | allowed, no close record of the connection | `inconclusive` (report once it closed) |
//! | a `volume_exceeded` cut linked to the allow, within the budget plus the slack | `enforced_deny` |
//! | report mode: `would_deny = "volume_exceeded"`, nothing cut | `unexpected_allow` |
//! | otherwise (the client moved too little to pass the budget, or nothing was cut) | `inconclusive` |

use serde::Serialize;

use super::plan::{volume_too_large, volume_total, Flow, VOLUME_SLACK};
use super::run::{Observation, ProbeOutcome};
use super::Class;
use crate::evidence::Record;
use crate::policy::Reason;

/// What a volume probe shows: the budget, what the client moved, and
/// what Palisade's records say was relayed and cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeCounts {
    pub direction: Flow,
    pub budget: u64,
    pub slack: u64,
    /// What the probe tried to move (budget plus margin).
    pub tried: u64,
    /// What the client counts it moved (its word).
    pub client_moved: u64,
    /// What the close records of the probe's connections say was relayed
    /// that way (None: no close record).
    pub relayed: Option<u64>,
    /// `volume_exceeded` records that cut the probe's connection.
    pub cut: Vec<String>,
    /// `volume_exceeded` refusals before anything was dialled.
    pub refused: Vec<String>,
    /// Report mode: records with `would_deny = "volume_exceeded"`.
    pub would_deny: Vec<String>,
}

/// The counts of a volume probe (None for other probes): `recs` are the
/// decision records that fit it, `closes` every close record read.
pub(crate) fn counts(
    o: &Observation,
    (direction, budget): (Flow, u64),
    recs: &[&Record],
    closes: &[Record],
) -> VolumeCounts {
    let allows: Vec<&Record> = recs
        .iter()
        .copied()
        .filter(|r| r.decision_str() == "allow" && r.conn.is_none())
        .collect();
    let linked = |r: &Record| {
        r.conn
            .as_deref()
            .is_some_and(|c| allows.iter().any(|a| a.id == c))
    };
    let ids = |keep: &dyn Fn(&Record) -> bool| -> Vec<String> {
        recs.iter()
            .filter(|r| keep(r))
            .map(|r| r.id.clone())
            .collect()
    };
    // A budget of this direction (a refusal for the other one, or for a
    // full table, shows nothing of this budget).
    let this_way = |r: &Record| {
        let named = format!(" bytes {} per ", direction.as_str());
        r.detail.as_deref().is_some_and(|d| d.contains(&named))
    };
    let exceeded = |r: &Record| {
        r.reason == Reason::VolumeExceeded && r.decision_str() == "deny" && this_way(r)
    };
    let relayed: Vec<u64> = closes
        .iter()
        .filter(|c| linked(c))
        .map(|c| match direction {
            Flow::Up => c.bytes_up.unwrap_or(0),
            Flow::Down => c.bytes_down.unwrap_or(0),
        })
        .collect();
    VolumeCounts {
        direction,
        budget,
        slack: VOLUME_SLACK,
        tried: volume_total(budget),
        client_moved: o.volume_moved.unwrap_or(0),
        relayed: (!relayed.is_empty()).then(|| relayed.iter().sum()),
        cut: ids(&|r| exceeded(r) && linked(r)),
        refused: ids(&|r| exceeded(r) && r.conn.is_none()),
        would_deny: ids(&|r| r.would_deny == Some(Reason::VolumeExceeded) && this_way(r)),
    }
}

/// One line on the counts.
pub(crate) fn counts_text(c: &VolumeCounts) -> String {
    let relayed = match c.relayed {
        Some(n) => format!("{n} bytes relayed {} (close records)", c.direction.as_str()),
        None => "no close record".into(),
    };
    format!(
        "budget {} bytes {} (slack {}); the client tried {} and moved {}; {relayed}",
        c.budget,
        c.direction.as_str(),
        c.slack,
        c.tried,
        c.client_moved
    )
}

/// The class of a volume probe from its counts (see the module's table).
pub(crate) fn classify(o: &Observation, recs: &[&Record], c: &VolumeCounts) -> (Class, String) {
    let text = counts_text(c);
    if let Some(why) = volume_too_large(c.budget) {
        return (Class::Inconclusive, format!("not run: {why}"));
    }
    let bound = c.budget.saturating_add(c.slack);
    if let Some(n) = c.relayed.filter(|n| *n > bound) {
        let how = if c.would_deny.is_empty() {
            String::new()
        } else {
            format!(" (report mode: would_deny in {})", c.would_deny.join(", "))
        };
        return (
            Class::UnexpectedAllow,
            format!(
                "{n} bytes passed {} under a budget of {} plus a slack of {}{how}: {text}",
                c.direction.as_str(),
                c.budget,
                c.slack
            ),
        );
    }
    let allowed = recs
        .iter()
        .any(|r| r.decision_str() == "allow" && r.conn.is_none());
    if !allowed {
        if !c.refused.is_empty() {
            return (
                Class::EnforcedDeny,
                format!(
                    "Palisade refused the connection before dialling, the budget already spent ({}): {text}",
                    c.refused.join(", ")
                ),
            );
        }
        let why = if recs.is_empty() {
            format!(
                "Palisade recorded nothing of it ({})",
                o.error.as_deref().unwrap_or(match o.outcome {
                    ProbeOutcome::SetupFailed => "setup failed",
                    _ => "no record",
                })
            )
        } else {
            "Palisade did not allow the connection, so no budget was spent".into()
        };
        return (Class::Inconclusive, format!("{why}: {text}"));
    }
    if c.relayed.is_none() {
        return (
            Class::Inconclusive,
            format!("the connection's close record is not in the evidence: report once it has closed ({text})"),
        );
    }
    if !c.cut.is_empty() {
        return (
            Class::EnforcedDeny,
            format!(
                "Palisade cut the connection at the budget ({}), within the budget plus the slack: {text}",
                c.cut.join(", ")
            ),
        );
    }
    if !c.would_deny.is_empty() {
        return (
            Class::UnexpectedAllow,
            format!(
                "report mode: Palisade let it pass the budget (would_deny in {}): {text}",
                c.would_deny.join(", ")
            ),
        );
    }
    (
        Class::Inconclusive,
        format!("nothing past the budget was shown relayed and nothing was cut: {text}"),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;

    const UP: &str = "volume budget spent: 262144 bytes up per 3600s under rule sink";

    fn obs(moved: u64) -> Observation {
        serde_json::from_value(json!({
            "id": "volume-0-up", "marker": "pp-00000000-0000",
            "target": "tcp://198.18.2.30:7001", "kind": "tcp", "via": "proxy",
            "expect": "deny", "proxy": "198.18.1.1:3128", "server": null, "note": null,
            "started": "2030-01-01T12:00:00Z", "finished": "2030-01-01T12:00:03Z",
            "elapsed_ms": 3000, "sockets": [], "resolved": [], "connected": true,
            "connect_status": 200, "http_status": null, "proxy_status": null,
            "palisade_record": null, "bytes_sent": moved, "bytes_received": 0,
            "tls": null, "dns_rcode": null, "dns_answers": [], "dns_ede": null,
            "error": null, "error_detail": null, "stage": "done", "outcome": "refused",
            "volume": "up", "budget": 262144, "volume_moved": moved
        }))
        .unwrap()
    }

    fn rec(id: &str, reason: &str, extra: Value) -> Record {
        let mut v = json!({
            "v": 1, "id": id, "ts": "2030-01-01T12:00:01Z", "event": "decision",
            "kind": "tcp", "mode": "explicit", "client": "198.18.1.2:40000",
            "org": "acme", "host": "198.18.2.30", "port": 7001,
            "decision": if reason == "rule_match" { "allow" } else { "deny" },
            "reason": reason, "rule": "sink", "policy": "p",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn close(conn: &str, up: u64) -> Record {
        let mut r = rec(
            "c1",
            "rule_match",
            json!({"conn": conn, "bytes_up": up, "bytes_down": 0}),
        );
        r.event = crate::evidence::Event::Close;
        r
    }

    fn class_of(o: &Observation, recs: &[Record], closes: &[Record]) -> (Class, VolumeCounts) {
        let refs: Vec<&Record> = recs.iter().collect();
        let c = counts(o, (Flow::Up, 262_144), &refs, closes);
        (classify(o, &refs, &c).0, c)
    }

    #[test]
    fn a_cut_within_the_slack_is_enforced_and_more_is_a_hole() {
        let allow = rec("a1", "rule_match", json!({}));
        let cut = rec("a2", "volume_exceeded", json!({"conn": "a1", "detail": UP}));
        let o = obs(400_000);
        let (class, c) = class_of(&o, &[allow.clone(), cut.clone()], &[close("a1", 377_448)]);
        assert_eq!(class, Class::EnforcedDeny, "{c:?}");
        assert_eq!(c.relayed, Some(377_448));
        assert_eq!(c.cut, ["a2"]);
        assert_eq!(c.tried, 262_144 + super::super::plan::VOLUME_MARGIN);
        // Past budget plus slack: a finding, cut record or not.
        let over = 262_144 + VOLUME_SLACK + 1;
        let (class, _) = class_of(&o, &[allow.clone(), cut], &[close("a1", over)]);
        assert_eq!(class, Class::UnexpectedAllow);
        // Report mode: relayed whole, would_deny on record.
        let would = rec(
            "a2",
            "rule_match",
            json!({"conn": "a1", "would_deny": "volume_exceeded", "detail": UP}),
        );
        let (class, c) = class_of(&o, &[allow.clone(), would.clone()], &[close("a1", 786_432)]);
        assert_eq!(class, Class::UnexpectedAllow);
        assert_eq!(c.would_deny, ["a2"]);
        // ... and a report-mode record alone, within the bound, is still a finding.
        let (class, _) = class_of(&o, &[allow, would], &[close("a1", 300_000)]);
        assert_eq!(class, Class::UnexpectedAllow);
    }

    #[test]
    fn what_shows_nothing_is_inconclusive_and_a_spent_budget_refusal_is_enforced() {
        let allow = rec("a1", "rule_match", json!({}));
        let o = obs(1000);
        // No close record yet.
        assert_eq!(
            class_of(&o, std::slice::from_ref(&allow), &[]).0,
            Class::Inconclusive
        );
        // The upstream stopped it early: nothing past the budget was tried.
        assert_eq!(
            class_of(&o, &[allow], &[close("a1", 1000)]).0,
            Class::Inconclusive
        );
        // Another connection's close is not the probe's.
        let other = rec("b1", "rule_match", json!({}));
        let (_, c) = class_of(&o, &[other], &[close("a1", 1_000_000)]);
        assert_eq!(c.relayed, None);
        // Refused 429 before dialling: the budget was already spent.
        let refused = rec("r1", "volume_exceeded", json!({"detail": UP}));
        assert_eq!(class_of(&o, &[refused], &[]).0, Class::EnforcedDeny);
        // ... of the other direction's budget, or a full table: not this budget.
        let down = UP.replace(" up ", " down ");
        let refused = rec("r1", "volume_exceeded", json!({"detail": down}));
        assert_eq!(class_of(&o, &[refused], &[]).0, Class::Inconclusive);
        let full = rec(
            "r1",
            "volume_exceeded",
            json!({"detail": "volume budgets: table full"}),
        );
        assert_eq!(class_of(&o, &[full], &[]).0, Class::Inconclusive);
        // Denied by the rule: nothing spent, nothing shown.
        let denied = rec("d1", "no_matching_rule", json!({}));
        assert_eq!(class_of(&o, &[denied], &[]).0, Class::Inconclusive);
        assert_eq!(class_of(&o, &[], &[]).0, Class::Inconclusive);
    }

    #[test]
    fn a_budget_over_the_cap_is_not_run() {
        let o = obs(0);
        let c = counts(
            &o,
            (Flow::Up, super::super::plan::MAX_VOLUME_BUDGET + 1),
            &[],
            &[],
        );
        let (class, why) = classify(&o, &[], &c);
        assert_eq!(class, Class::Inconclusive);
        assert!(why.starts_with("not run: "), "{why}");
        assert!(volume_too_large(super::super::plan::MAX_VOLUME_BUDGET).is_none());
    }
}
