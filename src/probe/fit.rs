//! Which of Palisade's verified records belong to a probe, decided by what
//! Palisade recorded, not by what the sandbox says (pure).
//!
//! Everything in `observations.json` is written by the party under
//! assessment. The report takes each probe's target, expectation and
//! options from the assessor's plan, and a record *fits* a probe only
//! when all of these hold:
//!
//! 1. **org**: its `org` is the plan's org (when the plan names one);
//! 2. **client**: its `client` address is one the run's sockets came from,
//!    or one no run of the report claims (a sandbox that lies about its
//!    address does not hide its records that way);
//! 3. **target**: its `host` (or `sni`, or dialled `ip`) is a name or
//!    address the probe presents (target host, SNI, `host_header`,
//!    `second_host`, `resolve`) and its `port` the target's port (a
//!    `tls://` probe's record with an SNI: the probe's SNI); a
//!    `dns:` probe's record is a DNS record of the probe's name; a lookup
//!    a direct probe made for its own name fits only when denied (an
//!    allowed lookup says nothing about the connection);
//! 4. **time**: its `ts` (a bypass record's: its first packet's, the
//!    start of its `window`) lies within the probe's start and finish,
//!    widened by [`SKEW`] each side, or it names the probe's marker (in its
//!    `host`, `sni` or `path`: the probe's own request, wherever the
//!    sandbox puts the window); and in any case not before the plan was `issued`
//!    (less [`SKEW`]): the window is the sandbox's word, the plan's time is
//!    the assessor's, so records of an earlier run never fit, wherever the
//!    sandbox puts its windows.
//!
//! The target compared is the plan's, with the plan's own markers (the
//! `run` nonce): a record naming an earlier plan's marker fits nothing.
//! Fitting says which records the report looks at for a probe; whether a
//! denial among them is of the probe's own request is the classifier's
//! question ([`super::classify::not_caused_by`]).
//!
//! A record that fits several probes goes to one: the probe whose marker
//! it names, else the probe whose
//! claimed sockets include its exact `client`, else the one whose
//! (unwidened) window holds it, else the nearest. A record whose `conn`
//! names a record given to a probe (a denial inside a tunnel names the
//! tunnel's decision record) goes with it.
//!
//! A record id, a reference or a marker the sandbox quotes only points:
//! [`quote_misfit`] says why a quoted record does not fit its probe, and
//! the report lists that as a mismatch.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime};

use super::plan::{parse_target, Target};
use super::run::Observation;
use super::Via;
use crate::evidence::{Kind, Record};

/// Widening of each probe's time window on either side: the clock skew
/// between the sandbox and Palisade that the report tolerates.
pub(crate) const SKEW: Duration = Duration::from_secs(2);

fn parse_ts(text: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(text).ok()
}

/// When a record's decision was made: its `ts`, but for a bypass record
/// (a summary written up to a second after its packets) the time of its
/// first packet, the start of its `window`.
fn record_time(r: &Record) -> Option<SystemTime> {
    match (&r.kind, &r.window) {
        (Kind::Bypass, Some([first, _])) => parse_ts(first),
        (Kind::Dns, Some([first, _])) if is_dns_summary(r) => parse_ts(first),
        _ => parse_ts(&r.ts),
    }
}

/// A DNS refusal summary: one record standing for `count` refusals of an
/// org (by reason, with no client and no name), written after them.
pub(crate) fn is_dns_summary(r: &Record) -> bool {
    r.kind == Kind::Dns && r.count.is_some() && r.client.is_none() && r.decision_str() == "deny"
}

/// A name or address as Palisade records it (IP spellings canonical,
/// lower-case, no trailing dot).
pub(crate) fn norm(h: &str) -> String {
    let h = h.trim_end_matches('.');
    crate::proto::target::normalize_host(h)
        .map(|h| h.to_string())
        .unwrap_or_else(|_| h.trim_matches(['[', ']']).to_ascii_lowercase())
}

/// One planned probe as the matcher sees it.
#[derive(Debug, Clone)]
pub(crate) struct Case {
    target: Option<Target>,
    via: Via,
    /// Names and addresses the probe presents, normalised.
    names: BTreeSet<String>,
    /// The connected host, normalised (a direct probe's own lookup).
    host: Option<String>,
    /// The window claimed, unwidened (none: nothing fits).
    window: Option<(SystemTime, SystemTime)>,
    sockets: Vec<SocketAddr>,
    org: Option<String>,
    /// The addresses the probe's run claims its sockets came from.
    run_ips: BTreeSet<IpAddr>,
    /// When the plan was issued: nothing earlier fits.
    issued: Option<SystemTime>,
    /// The probe's marker (the plan's: the report puts it into the
    /// observation), lower-case; none when empty.
    marker: Option<String>,
}

impl Case {
    /// A probe of the plan and its observation (target and options
    /// already the plan's, markers replaced), in a run whose sockets came
    /// from `run_ips`, of a plan issued at `issued`.
    pub(crate) fn new(
        o: &Observation,
        plan: &super::plan::Probe,
        org: Option<&str>,
        run_ips: BTreeSet<IpAddr>,
        issued: Option<SystemTime>,
    ) -> Case {
        let target = parse_target(&o.target).ok();
        let mut names = BTreeSet::new();
        let mut host = None;
        if let Some(t) = &target {
            if let Some((h, _)) = t.host_port() {
                host = Some(norm(h));
                names.insert(norm(h));
            }
            match t {
                Target::Tls { sni, .. } => {
                    names.insert(norm(sni));
                }
                Target::Dns { name, .. } => {
                    names.insert(norm(name));
                }
                Target::Udp { addr } => {
                    names.insert(addr.ip().to_string());
                }
                _ => {}
            }
        }
        for extra in [&plan.host_header, &plan.second_host].into_iter().flatten() {
            names.insert(norm(extra));
        }
        if let Some(ip) = plan.resolve {
            names.insert(ip.to_string());
        }
        let window = match (parse_ts(&o.started), parse_ts(&o.finished)) {
            (Some(a), Some(b)) if a <= b => Some((a, b)),
            _ => None,
        };
        Case {
            target,
            via: o.via,
            names,
            host,
            window,
            sockets: o
                .sockets
                .iter()
                .filter_map(|s| s.local.as_deref()?.parse().ok())
                .collect(),
            org: org.map(str::to_string),
            run_ips,
            issued,
            marker: (o.marker.len() >= 4).then(|| o.marker.to_ascii_lowercase()),
        }
    }

    /// Whether `r` names the probe's marker (in its host, SNI or path):
    /// then it is of this probe's request in this plan, whatever window
    /// the sandbox claims.
    fn carries_marker(&self, r: &Record) -> bool {
        carries(r, self.marker.as_deref())
    }

    /// Why a record at `t` is too old for the plan (none when it is not).
    fn before_issue(&self, t: SystemTime, ts: &str) -> Option<String> {
        let issued = self.issued?;
        (t + SKEW < issued).then(|| {
            format!(
                "its time {ts} is before the plan was issued ({}): a record of an earlier run",
                humantime::format_rfc3339_micros(issued)
            )
        })
    }

    fn claims(&self, client: SocketAddr) -> bool {
        self.sockets.iter().any(|local| {
            *local == client || local.ip().is_unspecified() && local.port() == client.port()
        })
    }

    /// Why `r` (at `ts`) does not fit this probe; none when it fits.
    /// `claimed` says whether any run of the report claims an address.
    pub(crate) fn misfit(
        &self,
        r: &Record,
        ts: Option<SystemTime>,
        claimed: &dyn Fn(IpAddr) -> bool,
    ) -> Option<String> {
        if let Some(org) = &self.org {
            if r.org.as_deref() != Some(org.as_str()) {
                return Some(format!(
                    "its org is {}, the plan's {org}",
                    r.org.as_deref().unwrap_or("unknown")
                ));
            }
        }
        if let (Some(Target::DnsBurst { .. }), true) = (&self.target, is_dns_summary(r)) {
            return self.summary_misfit(r);
        }
        if let Some(why) = ts.and_then(|t| self.before_issue(t, &r.ts)) {
            return Some(why);
        }
        let Some(client) = r.client else {
            return Some("it names no client".into());
        };
        if !self.run_ips.contains(&client.ip()) && claimed(client.ip()) {
            return Some(format!("its client {client} is another sandbox's address"));
        }
        let in_window = match (self.window, ts) {
            (Some((a, b)), Some(t)) => t + SKEW >= a && t <= b + SKEW,
            _ => false,
        };
        if !in_window && !self.carries_marker(r) {
            return Some(match self.window {
                None => "the probe's time window is not readable".into(),
                Some(_) => format!(
                    "its time {} is outside the probe's window (± {} s), and it names not the probe's marker",
                    r.ts,
                    SKEW.as_secs()
                ),
            });
        }
        let Some(target) = &self.target else {
            return Some("the probe's target is not readable".into());
        };
        let host = r.host.as_deref().map(norm);
        let named = |h: &Option<String>| h.as_ref().is_some_and(|h| self.names.contains(h));
        if let Target::Dns { .. } = target {
            return (!(r.kind == Kind::Dns && named(&host)))
                .then(|| format!("it is not a DNS record of {}", self.list()));
        }
        if let Target::DnsBurst { template, .. } = target {
            let ours = r.kind == Kind::Dns
                && r.host
                    .as_deref()
                    .is_some_and(|h| super::plan::is_burst_name(template, h));
            return (!ours).then(|| format!("it is not a DNS record of a name of {template}"));
        }
        if r.kind == Kind::Dns {
            let own_lookup = self.via == Via::Direct
                && r.decision_str() == "deny"
                && host.is_some()
                && host == self.host;
            return (!own_lookup).then(|| {
                "it is a DNS record, and the probe's only lookup that counts is a denied one of its own name"
                    .to_string()
            });
        }
        let port = match target {
            Target::Udp { addr } => addr.port(),
            t => t.host_port().map_or(0, |(_, p)| p),
        };
        if r.port != Some(port) {
            return Some(format!(
                "its port {} is not the probe's {port}",
                r.port.map_or_else(|| "-".into(), |p| p.to_string())
            ));
        }
        let sni = r.sni.as_deref().map(norm);
        if let (Target::Tls { sni: want, .. }, Some(got)) = (target, &sni) {
            if *got != norm(want) {
                return Some(format!("its SNI {got} is not the probe's {want}"));
            }
        }
        let ip = r.ip.map(|ip| ip.to_string());
        if named(&host) || named(&sni) || named(&ip) {
            return None;
        }
        Some(format!(
            "its host {} is none of the probe's {}",
            r.host.as_deref().unwrap_or("-"),
            self.list()
        ))
    }

    /// Why a DNS refusal summary does not fit a burst probe (none when it
    /// does): the org's, and its window (first to last refusal) overlaps
    /// the probe's, widened by [`SKEW`]. It counts refusals, not names: the
    /// classifier counts it for the burst's names no record names.
    fn summary_misfit(&self, r: &Record) -> Option<String> {
        let (Some((a, b)), Some([first, last])) = (self.window, &r.window) else {
            return Some("the summary or the probe has no readable window".into());
        };
        match (parse_ts(first), parse_ts(last)) {
            (Some(f), _) if self.before_issue(f, first).is_some() => self.before_issue(f, first),
            (Some(f), Some(l)) if f <= b + SKEW && l + SKEW >= a => None,
            _ => Some(format!(
                "its window {first} to {last} is outside the probe's (± {} s)",
                SKEW.as_secs()
            )),
        }
    }

    fn list(&self) -> String {
        self.names.iter().cloned().collect::<Vec<_>>().join(", ")
    }

    /// How far `t` is from the unwidened window (zero inside it).
    fn distance(&self, t: SystemTime) -> Duration {
        match self.window {
            Some((a, _)) if t < a => a.duration_since(t).unwrap_or_default(),
            Some((_, b)) if t > b => t.duration_since(b).unwrap_or_default(),
            Some(_) => Duration::ZERO,
            None => Duration::MAX,
        }
    }
}

/// Whether `r` names `marker` in its host, SNI or path.
fn carries(r: &Record, marker: Option<&str>) -> bool {
    let Some(m) = marker else { return false };
    [r.host.as_deref(), r.sni.as_deref(), r.path.as_deref()]
        .into_iter()
        .flatten()
        .any(|v| v.to_ascii_lowercase().contains(m))
}

/// Which records (positions in `records`) each case gets; every record
/// goes to at most one case (see the module doc).
pub(crate) fn assign(cases: &[Option<Case>], records: &[Record]) -> Vec<Vec<usize>> {
    let all_ips: BTreeSet<IpAddr> = cases
        .iter()
        .flatten()
        .flat_map(|c| c.run_ips.iter().copied())
        .collect();
    let claimed = |ip: IpAddr| all_ips.contains(&ip);
    let bounds = cases.iter().flatten().filter_map(|c| c.window);
    let first = bounds.clone().map(|w| w.0).min();
    let last = bounds.map(|w| w.1).max();
    let mut out = vec![Vec::new(); cases.len()];
    let (Some(first), Some(last)) = (first, last) else {
        return out;
    };
    // The markers' common part, per plan (`pp-<run>-`): a record naming
    // one is looked at wherever its time is.
    let runs: BTreeSet<&str> = cases
        .iter()
        .flatten()
        .filter_map(|c| c.marker.as_deref()?.get(..12))
        .collect();
    let mut owner: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        let Some(t) = record_time(r) else { continue };
        let marked = || runs.iter().any(|run| carries(r, Some(run)));
        if (t + SKEW < first || t > last + SKEW) && !marked() {
            continue;
        }
        let fitting: Vec<(usize, &Case)> = cases
            .iter()
            .enumerate()
            .filter_map(|(n, c)| Some((n, c.as_ref()?)))
            .filter(|(_, c)| c.misfit(r, Some(t), &claimed).is_none())
            .collect();
        let best = fitting
            .iter()
            .find(|(_, c)| c.carries_marker(r))
            .or_else(|| {
                fitting
                    .iter()
                    .find(|(_, c)| r.client.is_some_and(|cl| c.claims(cl)))
            })
            .or_else(|| fitting.iter().min_by_key(|(_, c)| c.distance(t)));
        if let Some((n, _)) = best {
            out[*n].push(i);
            owner.insert(i, *n);
        }
    }
    // Records pointing at a record given to a case (in-tunnel denials).
    let by_id: BTreeMap<&str, usize> = owner
        .iter()
        .map(|(i, n)| (records[*i].id.as_str(), *n))
        .collect();
    for (i, r) in records.iter().enumerate() {
        if owner.contains_key(&i) {
            continue;
        }
        if let Some(n) = r.conn.as_deref().and_then(|c| by_id.get(c)) {
            out[*n].push(i);
        }
    }
    for v in &mut out {
        v.sort_unstable();
    }
    out
}

/// Why the record the sandbox quoted for case `n` does not belong to it
/// (none when it does): not in the evidence, given to another probe, or
/// the first condition it fails.
pub(crate) fn quote_misfit(
    quoted: &str,
    n: usize,
    cases: &[Option<Case>],
    records: &[Record],
    assigned: &[Vec<usize>],
    name_of: &dyn Fn(usize) -> String,
) -> Option<String> {
    let Some(i) = records.iter().position(|r| r.is_named(quoted)) else {
        return Some(format!(
            "the observation quotes record {quoted}, which is not in the evidence given"
        ));
    };
    if assigned[n].contains(&i) {
        return None;
    }
    let id = &records[i].id;
    if let Some(other) = assigned.iter().position(|v| v.contains(&i)) {
        return Some(format!(
            "the observation quotes record {id}, which belongs to probe {}",
            name_of(other)
        ));
    }
    let all_ips: BTreeSet<IpAddr> = cases
        .iter()
        .flatten()
        .flat_map(|c| c.run_ips.iter().copied())
        .collect();
    let why = cases[n]
        .as_ref()
        .and_then(|c| {
            c.misfit(&records[i], record_time(&records[i]), &|ip| {
                all_ips.contains(&ip)
            })
        })
        .unwrap_or_else(|| "it does not fit the probe".into());
    Some(format!(
        "the observation quotes record {id}, which does not fit the probe: {why}"
    ))
}

/// The records no probe got that are the sandbox's, during the run: from
/// an address a run claims, or of the plan's `org`, within the probes'
/// windows (widened by [`SKEW`]). What else the sandbox did while it was
/// probed, or traffic a misreported probe left behind.
pub(crate) fn unattributed(
    cases: &[Option<Case>],
    records: &[Record],
    assigned: &[Vec<usize>],
) -> Vec<usize> {
    let all_ips: BTreeSet<IpAddr> = cases
        .iter()
        .flatten()
        .flat_map(|c| c.run_ips.iter().copied())
        .collect();
    let orgs: BTreeSet<&str> = cases
        .iter()
        .flatten()
        .filter_map(|c| c.org.as_deref())
        .collect();
    let windows = cases.iter().flatten().filter_map(|c| c.window);
    let (Some(first), Some(last)) = (
        windows.clone().map(|w| w.0).min(),
        windows.map(|w| w.1).max(),
    ) else {
        return Vec::new();
    };
    let taken: BTreeSet<usize> = assigned.iter().flatten().copied().collect();
    records
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            !taken.contains(i)
                && record_time(r).is_some_and(|t| t + SKEW >= first && t <= last + SKEW)
                && (r.client.is_some_and(|c| all_ips.contains(&c.ip()))
                    || r.org.as_deref().is_some_and(|o| orgs.contains(o)))
        })
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::probe::plan::Probe;

    fn obs(id: &str, target: &str, port: u16, from: &str, to: &str) -> Observation {
        serde_json::from_value(json!({
            "id": id, "marker": "pp-1-0000", "target": target, "kind": "http",
            "via": "proxy", "expect": "deny",
            "started": format!("2030-01-01T12:00:{from}Z"), "finished": format!("2030-01-01T12:00:{to}Z"),
            "elapsed_ms": 1000,
            "sockets": [{"purpose": "proxy", "proto": "tcp", "local": format!("198.18.1.2:{port}"), "remote": "198.18.1.1:3128"}],
            "resolved": [], "connected": true, "bytes_sent": 0, "bytes_received": 0,
            "dns_answers": [], "stage": "done", "outcome": "refused",
        }))
        .unwrap()
    }

    fn rec(id: &str, client: &str, host: &str, ts: &str, extra: Value) -> Record {
        let mut v = json!({
            "id": id, "ts": format!("2030-01-01T12:00:{ts}Z"), "kind": "http", "event": "decision",
            "org": "acme", "client": client, "mode": "explicit", "decision": "allow",
            "reason": "rule_match", "host": host, "port": 80, "policy": "p0",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn case(o: &Observation, org: Option<&str>, ips: &[&str]) -> Option<Case> {
        let plan = Probe::new(&o.id, &o.target, o.via, o.expect);
        let ips = ips.iter().map(|i| i.parse().unwrap()).collect();
        Some(Case::new(o, &plan, org, ips, None))
    }

    #[test]
    fn records_fit_by_org_client_target_and_time() {
        let canary = obs("canary", "http://other.test/", 40001, "01", "02");
        let cases = [case(&canary, Some("acme"), &["198.18.1.2"])];
        let records = [
            // Fits although the sandbox claims another port.
            rec("r0", "198.18.1.2:50000", "other.test", "01.5", json!({})),
            rec(
                "r1",
                "198.18.1.2:40001",
                "other.test",
                "01.5",
                json!({"org": "beta"}),
            ),
            rec("r2", "198.18.1.2:40001", "allowed.test", "01.5", json!({})),
            rec(
                "r3",
                "198.18.1.2:40001",
                "other.test",
                "01.5",
                json!({"port": 443}),
            ),
            rec("r4", "198.18.1.2:40001", "other.test", "09", json!({})),
            // An address no run claims: a sandbox lying about its own.
            rec("r5", "198.18.9.9:1", "other.test", "01.5", json!({})),
        ];
        assert_eq!(assign(&cases, &records), [vec![0, 5]]);
        let c = cases[0].as_ref().unwrap();
        let why = |r: &Record| c.misfit(r, parse_ts(&r.ts), &|_| false).unwrap();
        assert!(why(&records[1]).contains("org is beta"));
        assert!(why(&records[2]).contains("host allowed.test"));
        assert!(why(&records[3]).contains("port 443"));
        assert!(why(&records[4]).contains("outside the probe's window"));
        // Records of an address another run claims are that run's.
        let other = obs("canary", "http://other.test/", 40001, "01", "02");
        let two = [
            cases[0].clone(),
            case(&other, Some("acme"), &["198.18.9.9"]),
        ];
        assert_eq!(assign(&two, &records), [vec![0], vec![5]]);
    }

    /// An earlier run's records, and the window the sandbox claims for
    /// them: nothing from before the plan was issued fits, whatever the
    /// window says.
    #[test]
    fn nothing_from_before_the_plan_was_issued_fits() {
        let canary = obs("canary", "http://other.test/", 40001, "01", "05");
        let plan = Probe::new(&canary.id, &canary.target, canary.via, canary.expect);
        let ips: BTreeSet<IpAddr> = ["198.18.1.2".parse().unwrap()].into();
        let issued = parse_ts("2030-01-01T12:00:04Z");
        let cases = [Some(Case::new(&canary, &plan, None, ips, issued))];
        let deny = json!({"decision": "deny", "reason": "no_matching_rule"});
        let records = [
            // Within the claimed window, but more than SKEW before the issue.
            rec("r0", "198.18.1.2:40001", "other.test", "01.5", deny.clone()),
            // Within SKEW of it: the clocks may differ that much.
            rec("r1", "198.18.1.2:40001", "other.test", "02.5", deny.clone()),
            rec("r2", "198.18.1.2:40001", "other.test", "04.5", deny),
        ];
        assert_eq!(assign(&cases, &records), [vec![1, 2]]);
        let c = cases[0].as_ref().unwrap();
        let why = c
            .misfit(&records[0], parse_ts(&records[0].ts), &|_| false)
            .unwrap();
        assert!(why.contains("before the plan was issued"), "{why}");
    }

    /// A record naming a probe's marker is of that probe's request, in
    /// this plan: it fits outside the window the sandbox claims (but not
    /// before the plan was issued), and goes to that probe.
    #[test]
    fn a_record_naming_the_marker_fits_wherever_the_window_is() {
        let mut canary = obs(
            "canary",
            "http://other.test/palisade-probe/pp-0a1b2c3d-0001",
            40001,
            "10",
            "11",
        );
        canary.marker = "pp-0a1b2c3d-0001".into();
        let mut other = obs("other", "http://other.test/", 40002, "01", "02");
        other.marker = "pp-0a1b2c3d-0002".into();
        let ips: BTreeSet<IpAddr> = ["198.18.1.2".parse().unwrap()].into();
        let issued = parse_ts("2030-01-01T11:59:00Z");
        let case = |o: &Observation| {
            let plan = Probe::new(&o.id, &o.target, o.via, o.expect);
            Some(Case::new(o, &plan, None, ips.clone(), issued))
        };
        let cases = [case(&canary), case(&other)];
        let path = json!({"path": "/palisade-probe/pp-0a1b2c3d-0001"});
        let records = [
            // The canary's own request, allowed, in the other probe's window.
            rec("r0", "198.18.1.2:40002", "other.test", "01.5", path.clone()),
            // Far from every window.
            rec("r1", "198.18.1.2:40009", "other.test", "30", path),
            // No marker, outside the canary's window: the other probe's.
            rec("r2", "198.18.1.2:40002", "other.test", "01.6", json!({})),
        ];
        assert_eq!(assign(&cases, &records), [vec![0, 1], vec![2]]);
        // Not before the plan was issued, marker or not.
        let late = [case(&canary).map(|mut c| {
            c.issued = parse_ts("2030-01-01T12:00:20Z");
            c
        })];
        assert_eq!(assign(&late, &records), [vec![1]]);
    }

    #[test]
    fn a_record_goes_to_the_probe_that_claims_its_socket_else_the_nearest() {
        let a = obs("a", "http://allowed.test/", 40001, "01", "02");
        let b = obs("b", "http://allowed.test/", 40002, "02.1", "03");
        let cases = [
            case(&a, None, &["198.18.1.2"]),
            case(&b, None, &["198.18.1.2"]),
        ];
        let records = [
            rec("r0", "198.18.1.2:40001", "allowed.test", "02.5", json!({})),
            rec("r1", "198.18.1.2:9", "allowed.test", "02.8", json!({})),
            rec("r2", "198.18.1.2:9", "allowed.test", "01.2", json!({})),
            // Inside the tunnel of r0, joined by conn.
            rec(
                "r3",
                "198.18.1.2:9",
                "elsewhere.test",
                "02.6",
                json!({"conn": "r0"}),
            ),
        ];
        assert_eq!(assign(&cases, &records), [vec![0, 2, 3], vec![1]]);
    }

    #[test]
    fn a_quoted_record_must_fit() {
        let canary = obs("canary", "http://other.test/", 40001, "01", "02");
        let blocked = obs("blocked", "http://blocked.test/", 40002, "02.1", "03");
        let cases = [
            case(&canary, None, &["198.18.1.2"]),
            case(&blocked, None, &["198.18.1.2"]),
        ];
        let records = [
            rec(
                "r0",
                "198.18.1.2:40002",
                "blocked.test",
                "02.5",
                json!({"reason": "explicit_deny"}),
            ),
            rec(
                "r1",
                "198.18.1.2:7",
                "far.test",
                "02.5",
                json!({"reason": "explicit_deny"}),
            ),
        ];
        let assigned = assign(&cases, &records);
        let name = |n: usize| ["canary", "blocked"][n].to_string();
        let misfit = |q: &str, n: usize| quote_misfit(q, n, &cases, &records, &assigned, &name);
        assert_eq!(misfit("r0", 1), None);
        assert!(misfit("r0", 0)
            .unwrap()
            .contains("belongs to probe blocked"));
        assert!(misfit("r1", 0).unwrap().contains("host far.test"));
        assert!(misfit("r9", 0).unwrap().contains("not in the evidence"));
        assert_eq!(unattributed(&cases, &records, &assigned), [1]);
    }
}
