//! What was denied, per org: the engine of `palisade evidence summary`.
//!
//! Each denied target (a name or an address) gets its counts by reason,
//! its ports, first and last seen, how many clients asked, and a one-line
//! hint: the allow rule that would let it through, or why no rule should
//! (an always-denied address, an explicit deny, a client that broke the
//! protocol). Report-mode orgs count their `would_deny` decisions, so the
//! report of a report run is the list of what enforcement would refuse.
//!
//! [`report`] is pure: records in, a [`DenialReport`] out, which renders
//! as a table or Markdown (or serialises as JSON); the CLI reads the
//! records and picks the format.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::Serialize;

use crate::evidence::select::Selection;
use crate::evidence::{Event, Record};
use crate::policy::{Reason, ALWAYS_DENIED};

/// What was denied, per org (by name; `unknown` for no org).
#[derive(Debug, Default, Serialize)]
pub struct DenialReport {
    pub orgs: BTreeMap<String, OrgDenials>,
}

/// One org's denials.
#[derive(Debug, Default, Serialize)]
pub struct OrgDenials {
    /// Denied decisions (report mode: decisions enforcement would deny).
    pub denied: u64,
    /// Of those, decisions a report-mode org let through.
    pub would_deny: u64,
    /// Per target, busiest first.
    pub targets: Vec<DeniedTarget>,
}

/// One denied target of an org.
#[derive(Debug, Clone, Serialize)]
pub struct DeniedTarget {
    /// The name, or an address's canonical text.
    pub target: String,
    pub ports: BTreeSet<u16>,
    pub count: u64,
    pub reasons: BTreeMap<String, u64>,
    pub first_seen: String,
    pub last_seen: String,
    /// Distinct client addresses (summary records name none).
    pub clients: usize,
    /// The rule that would allow it, or why none should.
    pub hint: String,
}

#[derive(Default)]
struct Tally {
    ports: BTreeSet<u16>,
    count: u64,
    reasons: BTreeMap<String, u64>,
    first: Option<String>,
    last: Option<String>,
    clients: BTreeSet<IpAddr>,
    /// An address a name was refused for (`denied_address`).
    denied_ip: Option<IpAddr>,
    rule: Option<String>,
}

impl Tally {
    fn seen(&mut self, ts: &str, n: u64, reason: Reason) {
        self.count += n;
        *self.reasons.entry(reason.as_str().to_string()).or_default() += n;
        // RFC 3339 UTC with the same precision: text order is time order.
        if self.first.as_deref().is_none_or(|f| ts < f) {
            self.first = Some(ts.to_string());
        }
        if self.last.as_deref().is_none_or(|l| ts > l) {
            self.last = Some(ts.to_string());
        }
    }
}

/// The reason a record counts as a denial with, if it does: a deny, or a
/// report-mode allow that enforcement would deny.
fn denial(r: &Record) -> Option<(Reason, bool)> {
    if r.event != Event::Decision {
        return None;
    }
    if let Some(w) = r.would_deny {
        return Some((w, true));
    }
    (!r.reason.is_allow()).then_some((r.reason, false))
}

/// The always-denied range `ip` lies in, if any (IPv4-mapped and other
/// embedded forms as their IPv4 address).
pub(crate) fn always_denied(ip: IpAddr) -> Option<&'static str> {
    let ip = crate::policy::canonical(ip);
    ALWAYS_DENIED.iter().find_map(|(net, what)| {
        let net: ipnet::IpNet = net.parse().ok()?;
        net.contains(&ip).then_some(*what)
    })
}

/// The one-line hint for a denied target.
fn hint(target: &str, t: &Tally) -> String {
    let top = t
        .reasons
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(r, _)| r.as_str())
        .unwrap_or_default();
    let ports = t
        .ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let ip = target.parse::<IpAddr>().ok();
    if let Some(what) = ip.and_then(always_denied) {
        return format!(
            "always denied ({what}): no rule should allow it; only a cidr rule inside the range would (review)"
        );
    }
    if let (Some(ip), Some(what)) = (t.denied_ip, t.denied_ip.and_then(always_denied)) {
        return format!("resolves to {ip}, always denied ({what}): no rule should allow it");
    }
    match top {
        "denied_address" => "resolves to an always-denied address: no rule should allow it; only a cidr rule inside the range would (review)".to_string(),
        "explicit_deny" => format!(
            "denied on purpose by rule {}: a deny wins over any allow",
            t.rule.as_deref().unwrap_or("?")
        ),
        "unknown_client" => {
            "the client is in no org: add its address to an org's clients".to_string()
        }
        "no_matching_rule" | "port_not_allowed" | "report_only" => match ip {
            Some(ip) => {
                let bits = if ip.is_ipv4() { 32 } else { 128 };
                format!("allow with: cidr = \"{ip}/{bits}\", ports = [{ports}] (a single address: review)")
            }
            None => format!("allow with: host = \"{target}\", ports = [{ports}]"),
        },
        "" => String::new(),
        other => format!("{other}: the client's traffic, not a missing rule"),
    }
}

/// Aggregate the denials among `records` that `filter` selects.
pub(crate) fn report<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    selection: &Selection,
) -> DenialReport {
    let mut tallies: BTreeMap<String, (u64, u64, BTreeMap<String, Tally>)> = BTreeMap::new();
    for r in records {
        if !selection.matches(r) {
            continue;
        }
        let org = r.org.as_deref().unwrap_or("unknown").to_string();
        let entry = tallies.entry(org).or_default();
        let Some((reason, report)) = denial(r) else {
            continue;
        };
        let n = r.count.unwrap_or(1);
        entry.0 += n;
        if report {
            entry.1 += n;
        }
        let mut add = |target: String, n: u64| {
            let t = entry.2.entry(target).or_default();
            t.seen(&r.ts, n, reason);
            t.ports.extend(r.port);
            t.clients.extend(r.client.map(|c| c.ip()));
            if reason == Reason::DeniedAddress {
                t.denied_ip = t.denied_ip.or(r.ip);
            }
            if reason == Reason::ExplicitDeny && t.rule.is_none() {
                t.rule = r.rule.as_deref().map(str::to_string);
            }
        };
        match (&r.host, &r.hosts) {
            (Some(h), _) => add(h.clone(), n),
            // A summary record: its busiest hosts, the rest under `other`.
            (None, Some(hosts)) => {
                for (h, k) in hosts {
                    add(h.clone(), *k);
                }
            }
            (None, None) => add(r.ip.map_or_else(|| "-".to_string(), |ip| ip.to_string()), n),
        }
    }
    let mut out = DenialReport::default();
    for (org, (denied, would_deny, targets)) in tallies {
        let mut targets: Vec<DeniedTarget> = targets
            .into_iter()
            .map(|(target, t)| DeniedTarget {
                hint: hint(&target, &t),
                ports: t.ports,
                count: t.count,
                reasons: t.reasons,
                first_seen: t.first.unwrap_or_default(),
                last_seen: t.last.unwrap_or_default(),
                clients: t.clients.len(),
                target,
            })
            .collect();
        targets.sort_by(|a, b| b.count.cmp(&a.count).then(a.target.cmp(&b.target)));
        out.orgs.insert(
            org,
            OrgDenials {
                denied,
                would_deny,
                targets,
            },
        );
    }
    out
}

fn reasons_text(t: &DeniedTarget) -> String {
    t.reasons
        .iter()
        .map(|(r, n)| format!("{r}={n}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn ports_text(t: &DeniedTarget) -> String {
    if t.ports.is_empty() {
        return "-".into();
    }
    t.ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A short time: seconds, UTC (`2026-01-02T03:04:05Z`).
fn short_ts(ts: &str) -> &str {
    ts.get(..19).unwrap_or(ts)
}

impl DenialReport {
    /// One block per org, columns aligned.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for (org, o) in &self.orgs {
            out.push_str(&format!("org {org}: {}\n", o.headline()));
            if o.targets.is_empty() {
                continue;
            }
            let head = [
                "TARGET", "PORTS", "COUNT", "REASONS", "FIRST", "LAST", "CLIENTS", "HINT",
            ];
            let rows: Vec<[String; 8]> = o
                .targets
                .iter()
                .map(|t| {
                    [
                        t.target.clone(),
                        ports_text(t),
                        t.count.to_string(),
                        reasons_text(t),
                        short_ts(&t.first_seen).to_string(),
                        short_ts(&t.last_seen).to_string(),
                        t.clients.to_string(),
                        t.hint.clone(),
                    ]
                })
                .collect();
            let mut width = head.map(str::len);
            for row in &rows {
                for (w, cell) in width.iter_mut().zip(row) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            let line = |cells: &[&str]| {
                let mut s = String::from("  ");
                for (i, c) in cells.iter().enumerate() {
                    if i + 1 == cells.len() {
                        s.push_str(c);
                    } else {
                        s.push_str(&format!("{c:<w$}  ", w = width[i]));
                    }
                }
                s.push('\n');
                s
            };
            out.push_str(&line(&head));
            for row in &rows {
                let cells: Vec<&str> = row.iter().map(String::as_str).collect();
                out.push_str(&line(&cells));
            }
        }
        if self.orgs.is_empty() {
            out.push_str("no decisions in the evidence selected\n");
        }
        out
    }

    /// Markdown: a heading and a table per org, for a ticket or a CI job.
    pub fn markdown(&self) -> String {
        let cell = |s: &str| s.replace('|', "\\|");
        let mut out = String::from("## What Palisade denied\n");
        for (org, o) in &self.orgs {
            out.push_str(&format!("\n### Org `{org}`: {}\n", o.headline()));
            if o.targets.is_empty() {
                continue;
            }
            out.push_str(
                "\n| target | ports | count | reasons | first seen | last seen | clients | hint |\n",
            );
            out.push_str("|---|---|---:|---|---|---|---:|---|\n");
            for t in &o.targets {
                out.push_str(&format!(
                    "| `{}` | {} | {} | {} | {} | {} | {} | {} |\n",
                    cell(&t.target),
                    ports_text(t),
                    t.count,
                    cell(&reasons_text(t)),
                    short_ts(&t.first_seen),
                    short_ts(&t.last_seen),
                    t.clients,
                    cell(&t.hint)
                ));
            }
        }
        if self.orgs.is_empty() {
            out.push_str("\nNo decisions in the evidence selected.\n");
        }
        out
    }
}

impl OrgDenials {
    fn headline(&self) -> String {
        if self.denied == 0 {
            return "nothing denied".into();
        }
        let report = if self.would_deny > 0 {
            format!(" ({} would_deny in report mode)", self.would_deny)
        } else {
            String::new()
        };
        format!(
            "{} denied{report}, {} targets",
            self.denied,
            self.targets.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(json: &str) -> Record {
        crate::testing::record(&[json])
    }

    #[test]
    fn denials_are_counted_per_org_target_and_reason_with_first_last_and_clients() {
        let records = [
            rec(r#"{"host": "api.example.com", "ts": "2026-01-02T03:04:06.000000Z"}"#),
            rec(r#"{"host": "api.example.com", "client": "198.18.1.3:1", "port": 80}"#),
            rec(
                r#"{"host": "api.example.com", "reason": "port_not_allowed", "ts": "2026-01-02T03:05:00.000000Z"}"#,
            ),
            rec(r#"{"host": "ok.example.com", "reason": "rule_match", "decision": "allow"}"#),
            rec(r#"{"host": "x.test", "org": "beta"}"#),
        ];
        let s = report(&records, &Selection::default());
        let acme = &s.orgs["acme"];
        assert_eq!(
            (acme.denied, acme.would_deny, acme.targets.len()),
            (3, 0, 1)
        );
        let t = &acme.targets[0];
        assert_eq!(t.target, "api.example.com");
        assert_eq!(t.count, 3);
        assert_eq!(t.reasons["no_matching_rule"], 2);
        assert_eq!(t.reasons["port_not_allowed"], 1);
        assert_eq!(t.ports, BTreeSet::from([80, 443]));
        assert_eq!(t.clients, 2);
        assert_eq!(t.first_seen, "2026-01-02T03:04:05.000000Z");
        assert_eq!(t.last_seen, "2026-01-02T03:05:00.000000Z");
        assert_eq!(
            t.hint,
            "allow with: host = \"api.example.com\", ports = [80, 443]"
        );
        assert_eq!(s.orgs["beta"].targets[0].target, "x.test");
        let only = Selection {
            org: Some("beta".into()),
            ..Selection::default()
        };
        assert_eq!(report(&records, &only).orgs.len(), 1);
    }

    #[test]
    fn report_mode_counts_what_enforcement_would_deny() {
        let records = [rec(
            r#"{"host": "other.test", "decision": "allow", "reason": "report_only", "would_deny": "no_matching_rule"}"#,
        )];
        let s = report(&records, &Selection::default());
        let acme = &s.orgs["acme"];
        assert_eq!((acme.denied, acme.would_deny), (1, 1));
        assert_eq!(acme.targets[0].reasons["no_matching_rule"], 1);
        assert!(acme.targets[0].hint.starts_with("allow with: host"));
    }

    #[test]
    fn hints_say_why_no_rule_should_allow_an_always_denied_address() {
        let records = [
            rec(r#"{"host": "169.254.169.254", "port": 80, "reason": "denied_address"}"#),
            rec(
                r#"{"host": "meta.test", "port": 80, "ip": "169.254.169.254", "reason": "denied_address"}"#,
            ),
            rec(r#"{"host": "198.18.2.77", "port": 8080}"#),
            rec(
                r#"{"host": "blocked.wild.test", "reason": "explicit_deny", "rule": "acme/deny/0"}"#,
            ),
            rec(r#"{"host": "allowed.test", "reason": "sni_mismatch"}"#),
            rec(r#"{"host": "x.test", "org": null, "reason": "unknown_client"}"#),
        ];
        let s = report(&records, &Selection::default());
        let hint = |org: &str, target: &str| {
            s.orgs[org]
                .targets
                .iter()
                .find(|t| t.target == target)
                .unwrap()
                .hint
                .clone()
        };
        assert!(hint("acme", "169.254.169.254")
            .starts_with("always denied (link-local incl. cloud metadata)"));
        assert!(hint("acme", "meta.test").starts_with("resolves to 169.254.169.254, always denied"));
        assert_eq!(
            hint("acme", "198.18.2.77"),
            "allow with: cidr = \"198.18.2.77/32\", ports = [8080] (a single address: review)"
        );
        assert!(hint("acme", "blocked.wild.test").contains("rule acme/deny/0"));
        assert!(hint("acme", "allowed.test").starts_with("sni_mismatch:"));
        assert!(hint("unknown", "x.test").contains("in no org"));
    }

    #[test]
    fn a_summary_record_counts_its_hosts() {
        let records = [rec(
            r#"{"host": null, "client": null, "port": null, "count": 7, "hosts": {"a.test": 5, "other": 2}}"#,
        )];
        let s = report(&records, &Selection::default());
        let acme = &s.orgs["acme"];
        assert_eq!(acme.denied, 7);
        assert_eq!(acme.targets[0].target, "a.test");
        assert_eq!(acme.targets[0].count, 5);
        assert_eq!(acme.targets[0].clients, 0);
    }

    #[test]
    fn table_and_markdown_name_every_target_and_escape_pipes() {
        let records = [rec(r#"{"host": "api.example.com"}"#)];
        let s = report(&records, &Selection::default());
        let table = s.table();
        assert!(
            table.starts_with("org acme: 1 denied, 1 targets\n"),
            "{table}"
        );
        assert!(table.contains("api.example.com  443"), "{table}");
        let md = s.markdown();
        assert!(md.contains("### Org `acme`: 1 denied"), "{md}");
        assert!(
            md.contains("| `api.example.com` | 443 | 1 | no_matching_rule=1 |"),
            "{md}"
        );
        assert!(DenialReport::default().markdown().contains("No decisions"));
    }
}
