//! Bypass attempts as evidence: every logged packet is counted into a
//! tally per (org, source address, destination address, protocol,
//! destination port), and each tally is written about once a second as ONE
//! `kind = "bypass"` record with its `count`, through the summary engine
//! the proxy's denials and the DNS shim's refusals use
//! ([`crate::limits::summary`]):
//!
//! ```json
//! {"kind": "bypass", "event": "decision", "mode": "transparent",
//!  "decision": "deny", "reason": "protocol_mismatch", "org": "acme",
//!  "client": "198.18.1.2:40000", "host": "198.18.2.10", "ip": "198.18.2.10",
//!  "port": 443, "proto": "udp", "count": 3, "window": [T1, T2],
//!  "detail": "3 packets rejected by the gateway ruleset between T1 and T2"}
//! ```
//!
//! `client` is the first packet's source; `reason` is `unknown_client` for
//! a source of no org, `port_not_allowed` for TCP (a connection to the
//! gateway itself, on a port it does not serve) and `protocol_mismatch`
//! for everything else (UDP, QUIC, ICMP: the gateway carries TCP and DNS
//! only).
//!
//! Within the org's evidence budget ([`EvidenceBudget`], shared with the
//! proxy and the shim): a new tally takes one record of it, paying for the
//! summary it becomes; when none is left, or the org already has
//! [`MAX_TALLIES_PER_ORG`] tallies waiting, the packet is counted into its
//! org's overflow tally for its protocol instead (no source, destination
//! or port), which is charged when written. So an org's bypass records in
//! a second are at most its budget plus one per protocol, whatever it
//! floods with. The bound is per org (clients of no org are one group):
//! one org's flood fills its own share and never pushes another org's
//! attempts into an overflow tally. At most [`MAX_TALLIES`] wait in all,
//! which takes [`MAX_TALLIES`] / [`MAX_TALLIES_PER_ORG`] orgs flooding in
//! the same second.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::packet::{Attempt, Proto};
use crate::evidence::{Evidence, Kind, Mode, Record};
use crate::limits::summary::{Shape, Tallies, Tally};
use crate::limits::EvidenceBudget;
use crate::metrics::{Metrics, UNKNOWN_ORG};
use crate::policy::{Policy, Reason, Verdict};

/// Tallies of one org kept at once; beyond, its new keys are counted under
/// its overflow tally.
pub(crate) const MAX_TALLIES_PER_ORG: usize = 1024;
/// Tallies of all orgs kept at once: 64 orgs' shares.
pub(crate) const MAX_TALLIES: usize = 64 * MAX_TALLIES_PER_ORG;

/// What a bypass tally is kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    org: Option<Arc<str>>,
    proto: Proto,
    /// `None` in the org's overflow tally.
    target: Option<(IpAddr, IpAddr, Option<u16>)>,
}

impl Key {
    fn overflow(&self) -> Key {
        Key {
            target: None,
            ..self.clone()
        }
    }
}

/// The shape of a bypass summary.
#[derive(Debug)]
pub(crate) struct BypassSummary;

impl Shape for BypassSummary {
    type Key = Key;
    const MAX_TALLIES: usize = MAX_TALLIES;
    const MAX_TALLIES_PER_ORG: usize = MAX_TALLIES_PER_ORG;
    const BREAKDOWN: bool = false;

    fn org(key: &Key) -> Option<Arc<str>> {
        key.org.clone()
    }

    fn overflow(key: Key) -> Key {
        key.overflow()
    }

    fn finish(key: &Key, tally: &Tally, r: &mut Record) {
        if let Some((_, dst, port)) = key.target {
            r.client = tally.first().client;
            r.host = Some(dst.to_string());
            r.ip = Some(dst);
            r.port = port;
        }
        r.proto = Some(key.proto.as_str().to_string());
        let [first, last] = r.window.clone().unwrap_or_default();
        let what = if key.target.is_some() {
            ""
        } else {
            " (over the org's evidence budget: sources and destinations not kept)"
        };
        r.detail = Some(format!(
            "{} packets rejected by the gateway ruleset between {first} and {last}{what}",
            tally.count()
        ));
    }
}

/// Counts logged packets and writes their summaries.
pub(crate) struct Bypasses {
    evidence: Arc<Evidence>,
    metrics: Arc<Metrics>,
    budget: Arc<EvidenceBudget>,
    tallies: Tallies<BypassSummary>,
}

impl Bypasses {
    pub(crate) fn new(
        evidence: Arc<Evidence>,
        metrics: Arc<Metrics>,
        budget: Arc<EvidenceBudget>,
    ) -> Bypasses {
        Bypasses {
            evidence,
            metrics,
            budget,
            tallies: Tallies::default(),
        }
    }

    /// Count one logged packet, decided under `policy` (its org by source
    /// address), at `now`.
    pub(crate) fn count(&self, attempt: &Attempt, policy: &Policy, now: Instant, wall: SystemTime) {
        let org = policy.org_for(attempt.src);
        let reason = match (&org, attempt.proto) {
            (None, _) => Reason::UnknownClient,
            (Some(_), Proto::Tcp) => Reason::PortNotAllowed,
            (Some(_), _) => Reason::ProtocolMismatch,
        };
        let verdict = Verdict {
            org,
            reason,
            rule: None,
            would_deny: None,
        };
        let client = SocketAddr::new(attempt.src, attempt.src_port.unwrap_or(0));
        let record = Record::decided(Kind::Bypass, Mode::Transparent, client, &verdict, policy);
        let org = record.org.clone();
        self.metrics
            .bypass_attempts_total
            .with_label_values(&[
                org.as_deref().unwrap_or(UNKNOWN_ORG),
                attempt.proto.as_str(),
            ])
            .inc();
        let key = Key {
            org,
            proto: attempt.proto,
            target: Some((attempt.src, attempt.dst, attempt.dst_port)),
        };
        // A new tally pays for its summary now; without a record left, or
        // without room in the org's share, the packet is counted into the
        // org's overflow tally.
        let key = if self.tallies.contains(&key)
            || (self.tallies.admits(&key) && self.budget.take(&key.org, now))
        {
            key
        } else {
            key.overflow()
        };
        self.tallies.add(key, &record, wall);
    }

    /// Write each tally as one record, waiting at most `wait` in all for
    /// room in the writer's queue; what finds none is kept for the next
    /// flush (as everything is while the writer is unhealthy).
    pub(crate) async fn flush(&self, wait: Duration) {
        if !self.evidence.is_healthy() {
            return;
        }
        let taken = self.tallies.drain();
        for (key, _) in self.tallies.write(&self.evidence, taken, wait).await {
            if key.target.is_none() {
                // An overflow summary was not paid for: charged now.
                self.budget.charge(&key.org, Instant::now());
            }
        }
    }

    /// Packets counted into the waiting tallies.
    pub(crate) fn pending_count(&self) -> u64 {
        self.tallies.pending_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn policy() -> Policy {
        let src = [("acme", "198.18.1.0/24"), ("beta", "198.18.4.0/24")]
            .map(|(org, net)| crate::testing::org_toml(org, &[net], &["allowed.test"]))
            .concat();
        let c = config::from_str(&src, std::path::Path::new("t.toml")).unwrap();
        Policy::new(&c)
    }

    fn udp(src: &str, dst: &str, dport: u16) -> Attempt {
        Attempt {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto: Proto::Udp,
            src_port: Some(40000),
            dst_port: Some(dport),
            prefix: None,
        }
    }

    /// A store in a scratch directory (`tag`) and the bypass records over
    /// it, with an evidence budget of `budget` records a second per org.
    fn bypasses(
        tag: &str,
        budget: usize,
    ) -> (std::path::PathBuf, Arc<Evidence>, Arc<Metrics>, Bypasses) {
        let dir = crate::testing::scratch(tag);
        let ev = Arc::new(Evidence::open(&dir.join("evidence")).unwrap());
        let metrics = Arc::new(Metrics::new(ev.live().clone()));
        let budget = Arc::new(EvidenceBudget::new(budget));
        let bypasses = Bypasses::new(ev.clone(), metrics.clone(), budget);
        (dir, ev, metrics, bypasses)
    }

    /// The bypass records of the store under `dir`.
    fn bypass_records(dir: &std::path::Path) -> Vec<Record> {
        crate::evidence::query::read_records(&dir.join("evidence"))
            .map(|r| r.unwrap().record)
            .filter(|r| r.kind == Kind::Bypass)
            .collect()
    }

    #[tokio::test]
    async fn a_flood_is_summarised_per_target_within_the_orgs_budget() {
        let (dir, ev, metrics, bypasses) = bypasses("bypass", 5);
        let policy = policy();
        let (now, wall) = (Instant::now(), SystemTime::now());
        // 1000 packets to one target, then one to each of 100 more.
        for _ in 0..1000 {
            bypasses.count(&udp("198.18.1.2", "198.18.2.10", 443), &policy, now, wall);
        }
        for i in 0..100 {
            bypasses.count(
                &udp("198.18.1.2", "198.18.2.10", 1000 + i),
                &policy,
                now,
                wall,
            );
        }
        bypasses.count(&udp("198.19.9.9", "198.18.2.10", 443), &policy, now, wall);
        assert_eq!(bypasses.pending_count(), 1101);
        bypasses.flush(Duration::from_secs(5)).await;
        assert_eq!(bypasses.pending_count(), 0);
        assert!(ev.seal().await);
        let records = bypass_records(&dir);
        // The budget's burst of targets, acme's overflow, the unknown source.
        assert_eq!(records.len(), 5 + 1 + 1, "{records:#?}");
        let first = records
            .iter()
            .find(|r| r.port == Some(443) && r.org.is_some())
            .unwrap();
        assert_eq!(first.count, Some(1000));
        assert_eq!(first.client, Some("198.18.1.2:40000".parse().unwrap()));
        assert_eq!(first.ip, Some("198.18.2.10".parse().unwrap()));
        assert_eq!(first.proto.as_deref(), Some("udp"));
        assert_eq!(first.reason, Reason::ProtocolMismatch);
        assert_eq!(first.mode, Mode::Transparent);
        let overflow = records.iter().find(|r| r.client.is_none()).unwrap();
        assert_eq!(overflow.org.as_deref(), Some("acme"));
        assert_eq!(overflow.count, Some(100 - 4));
        let total: u64 = records.iter().map(|r| r.count.unwrap()).sum();
        assert_eq!(total, 1101, "nothing is lost");
        let unknown = records.iter().find(|r| r.org.is_none()).unwrap();
        assert_eq!(unknown.reason, Reason::UnknownClient);
        let counted = metrics
            .bypass_attempts_total
            .with_label_values(&["acme", "udp"])
            .get();
        assert_eq!(counted, 1100);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn one_orgs_flood_never_pushes_anothers_attempts_out_of_their_tallies() {
        // A budget that is not the bound: the tallies are.
        let (dir, ev, _, bypasses) = bypasses("bypass-orgs", 1_000_000);
        let policy = policy();
        let (now, wall) = (Instant::now(), SystemTime::now());
        // Acme: 5,000 distinct targets, over every share there is; beta's
        // 25 attempts interleaved from the middle of it on.
        for i in 0..5000u32 {
            let dst = std::net::Ipv4Addr::from(0xC612_0000 + i).to_string();
            bypasses.count(&udp("198.18.1.2", &dst, 53), &policy, now, wall);
            if i >= 2000 && i % 100 == 0 && i < 4500 {
                let port = 7000 + u16::try_from(i / 100).unwrap();
                bypasses.count(&udp("198.18.4.2", "198.18.2.10", port), &policy, now, wall);
            }
        }
        assert_eq!(bypasses.pending_count(), 5025);
        bypasses.flush(Duration::from_secs(5)).await;
        assert!(ev.seal().await);
        let records = bypass_records(&dir);
        let of = |org: &'static str| {
            records
                .iter()
                .filter(move |r| r.org.as_deref() == Some(org))
        };
        let beta: Vec<&Record> = of("beta").collect();
        assert_eq!(beta.len(), 25, "{beta:#?}");
        for r in &beta {
            assert_eq!(r.count, Some(1), "{r:?}");
            assert_eq!(r.client, Some("198.18.4.2:40000".parse().unwrap()), "{r:?}");
            assert_eq!(r.ip, Some("198.18.2.10".parse().unwrap()), "{r:?}");
            assert!(r.port.is_some_and(|p| (7020..7045).contains(&p)), "{r:?}");
        }
        // Acme: its share, then its overflow tally; nothing lost.
        let acme_detailed = of("acme").filter(|r| r.client.is_some()).count();
        assert_eq!(acme_detailed, MAX_TALLIES_PER_ORG);
        let overflow: Vec<&Record> = of("acme").filter(|r| r.client.is_none()).collect();
        assert_eq!(overflow.len(), 1);
        assert_eq!(overflow[0].count, Some(5000 - MAX_TALLIES_PER_ORG as u64));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
