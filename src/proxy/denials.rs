//! Evidence flood control for proxy denials that never goes silent.
//!
//! Every allow is written one by one, before anything flows, and paid for
//! at its decision from its org's evidence budget ([`EvidenceBudget`],
//! [`Denials::pay_allow`]); an allow that finds it spent is refused
//! `limit_exceeded` instead. A denial lets nothing through; one source
//! address (an IPv6 /64) has up to `max_denial_records_per_second_per_client`
//! of them written one record each (a token bucket, burst of as many), its
//! org up to `max_denial_records_per_second_per_org`, and each one written
//! takes a record of the org's evidence budget. Beyond any of them its
//! denials are counted into one tally per (org, address), and
//! [`Denials::flush`] writes each tally as ONE signed, chained record, the
//! same shape as the DNS refusal summaries ([`crate::dns::refusals`]),
//! through the same engine ([`crate::limits::summary`]):
//!
//! ```json
//! {"kind": "tcp", "event": "decision", "decision": "deny",
//!  "reason": "no_matching_rule", "org": "acme", "client": "198.19.1.7:0",
//!  "count": 1234, "reasons": {"no_matching_rule": 1200, "sni_mismatch": 34},
//!  "hosts": {"a.test": 900, "b.test": 300, "other": 34},
//!  "window": ["T1", "T2"], "detail": "1234 denials summarised ...", ...}
//! ```
//!
//! Summaries are written only into a free place in the writer's queue,
//! never waiting: a flood of denials can neither grow the queue nor hold
//! up the writer for anyone else's records, so fail-closed is not reached
//! through one org's denials. Each summary is charged to its org's
//! evidence budget too; once that is spent, the org's tallies of a flush
//! are folded into one (`client: null` when they came from several
//! addresses), so an org adds at most one unpaid summary a flush, however
//! many addresses it floods from. Memory is bounded: at most
//! [`MAX_TALLIES_PER_ORG`] tallies per org and [`MAX_TALLIES`] in all
//! (beyond, an org's further addresses share one tally with `client:
//! null`; one org's flood fills only its own share), each with at most
//! [`TRACKED_HOSTS`](crate::limits::summary::TRACKED_HOSTS) host counters.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::evidence::{Event, Evidence, Record};
use crate::limits::summary::{Shape, Tallies, Tally};
use crate::limits::{client_key, EvidenceBudget, RateLimiter};

pub(crate) use crate::limits::summary::SUMMARY_INTERVAL;

/// Tallies kept at once.
pub(crate) const MAX_TALLIES: usize = 4096;
/// Tallies of one org kept at once (clients of no org: one group).
pub(crate) const MAX_TALLIES_PER_ORG: usize = 1024;
/// The `id` a summarised denial is answered with: its record is the
/// summary, written later.
pub(crate) const SUMMARISED: &str = "summarised";

/// The shape of a denial summary: one per (org, address), the address as
/// its `client`, the most frequent reason as its own, with the reasons and
/// hosts it counted.
#[derive(Debug)]
pub(crate) struct DenialSummary;

impl Shape for DenialSummary {
    type Key = Key;
    const MAX_TALLIES: usize = MAX_TALLIES;
    const MAX_TALLIES_PER_ORG: usize = MAX_TALLIES_PER_ORG;

    /// Beyond its share (or [`MAX_TALLIES`]), an org's further addresses
    /// share one tally.
    fn overflow((org, _): Key) -> Key {
        (org, None)
    }

    fn org((org, _): &Key) -> Option<Arc<str>> {
        org.clone()
    }

    fn finish((_, client): &Key, tally: &Tally, r: &mut Record) {
        r.client = client.map(|ip| SocketAddr::new(ip, 0));
        if let Some(reason) = tally.top_reason() {
            r.reason = reason;
        }
        r.reasons = Some(tally.reasons());
        r.hosts = Some(tally.top_hosts());
        let [first, last] = r.window.clone().unwrap_or_default();
        // The first summarised denial's own detail (a refusal's: why).
        let why = r
            .detail
            .take()
            .map_or_else(String::new, |d| format!("; the first: {d}"));
        r.detail = Some(format!(
            "{} denials summarised between {first} and {last}: over \
             max_denial_records_per_second_per_client, _per_org, the \
             org's evidence budget or its share of a full evidence store{why}",
            tally.count(),
        ));
    }
}

/// (org, address key); no address: the org's overflow tally.
type Key = (Option<Arc<str>>, Option<IpAddr>);

/// Decides which denials are written one by one and tallies the rest.
pub(crate) struct Denials {
    rate: RateLimiter<IpAddr>,
    /// The same per org (clients of no org share one bucket), so that an
    /// org flooding from many addresses is bounded too.
    org_rate: RateLimiter<Option<Arc<str>>>,
    /// Decision records per org, allows and denials together (shared with
    /// the DNS shim).
    budget: Arc<EvidenceBudget>,
    tallies: Tallies<DenialSummary>,
}

impl std::fmt::Debug for Denials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Denials").finish_non_exhaustive()
    }
}

/// The client a record is counted against when it is a denial (a
/// decision to deny, from a known client): only those may be summarised
/// ([`Denials::admit`]); every other record is written as it is.
pub(crate) fn counted(record: &Record) -> Option<std::net::SocketAddr> {
    let deny = record.event == Event::Decision && record.decision_str() == "deny";
    record.client.filter(|_| deny)
}

impl Denials {
    /// `per_client` denial records one by one per address, and `per_org`
    /// per org over all its addresses (bursts of as many), each within its
    /// org's evidence `budget`.
    pub(crate) fn new(per_client: usize, per_org: usize, budget: Arc<EvidenceBudget>) -> Denials {
        Denials {
            // Full of addresses denied this second, further ones are summarised.
            rate: RateLimiter::new(per_client, 65_536),
            org_rate: RateLimiter::new(per_org, 65_536),
            budget,
            tallies: Tallies::default(),
        }
    }

    /// Pay for the record of an allow decision of `org` (none: a client of
    /// no org) from its evidence budget, before anything flows. `Err`: the
    /// allow must be refused `limit_exceeded` with that detail (the budget
    /// is spent, [`crate::limits::evidence::EVIDENCE_BUDGET_EXHAUSTED`], or
    /// the org is over its share of a full store,
    /// [`crate::limits::evidence::EVIDENCE_STORE_FULL`]).
    pub(crate) fn pay_allow(&self, org: &Option<Arc<str>>) -> Result<(), &'static str> {
        self.budget.take_allow(org, Instant::now())
    }

    /// Whether `record` is written as its own record: every record but a
    /// denial decision (allows are paid for at their decision, with
    /// [`Denials::pay_allow`]), and a denial within its address's and its
    /// org's rates and its org's evidence budget. Otherwise it is counted
    /// into its tally (at `now`, `wall`) and `false`.
    pub(crate) fn admit(&self, record: &Record, now: Instant, wall: SystemTime) -> bool {
        let Some(client) = counted(record) else {
            return true;
        };
        let key = client_key(client.ip());
        if self.rate.allow(&key, now)
            && self.org_rate.allow(&record.org, now)
            && self.budget.take(&record.org, now)
        {
            return true;
        }
        self.tallies
            .add((record.org.clone(), Some(key)), record, wall);
        false
    }

    /// Write each tally as one record, into free places of the writer's
    /// queue only, never waiting; what finds none (or meets an unhealthy
    /// writer) is kept for the next flush. Returns the records written.
    pub(crate) async fn flush(&self, evidence: &Evidence) -> Vec<Record> {
        if !evidence.is_healthy() {
            return Vec::new();
        }
        let taken = self.pay_summaries(self.tallies.drain(), Instant::now());
        let written = self.tallies.write(evidence, taken, Duration::ZERO).await;
        written.into_iter().map(|(_, summary)| summary).collect()
    }

    /// Charge each tally's summary to its org's evidence budget. Those it
    /// cannot pay for are folded into one per org (keeping the address if
    /// they all came from one), charged whatever is left: an org adds at
    /// most one unpaid summary per flush.
    fn pay_summaries(&self, tallies: Vec<(Key, Tally)>, now: Instant) -> Vec<(Key, Tally)> {
        let mut paid = Vec::with_capacity(tallies.len());
        let mut unpaid: HashMap<Option<Arc<str>>, (Option<IpAddr>, Tally)> = HashMap::new();
        for ((org, client), tally) in tallies {
            if self.budget.take(&org, now) {
                paid.push(((org, client), tally));
                continue;
            }
            match unpaid.get_mut(&org) {
                Some((folded_client, folded)) => {
                    if *folded_client != client {
                        *folded_client = None;
                    }
                    folded.merge(tally);
                }
                None => {
                    unpaid.insert(org, (client, tally));
                }
            }
        }
        for (org, (client, tally)) in unpaid {
            self.budget.charge(&org, now);
            paid.push(((org, client), tally));
        }
        paid
    }

    /// Denials counted into the waiting tallies.
    pub(crate) fn pending_count(&self) -> u64 {
        self.tallies.pending_count()
    }

    /// Tallies waiting.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.tallies.pending()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evidence::{Kind, Mode};
    use crate::limits::summary::{TOP_HOSTS, TRACKED_HOSTS};
    use crate::policy::{OrgRef, Reason, Verdict};

    fn unlimited() -> Arc<EvidenceBudget> {
        Arc::new(EvidenceBudget::new(1_000_000_000))
    }

    fn denial(org: &str, client: &str, host: &str, reason: Reason) -> Record {
        let verdict = Verdict {
            org: Some(OrgRef {
                index: 0,
                name: Arc::from(org),
            }),
            reason,
            rule: None,
            would_deny: None,
        };
        let client: SocketAddr = client.parse().unwrap();
        let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &Arc::from("p"));
        r.host = Some(host.to_string());
        r.port = Some(443);
        r
    }

    #[test]
    fn a_flood_is_written_within_the_rate_then_tallied_in_bounded_memory() {
        let d = Denials::new(5, 1_000_000, unlimited());
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let mut one_by_one = 0;
        for i in 0..10_000 {
            let host = format!("h{}.flood.test", i % 500);
            let reason = if i % 4 == 0 {
                Reason::SniMismatch
            } else {
                Reason::NoMatchingRule
            };
            let r = denial("acme", "198.19.1.7:4000", &host, reason);
            if d.admit(&r, t0, wall) {
                one_by_one += 1;
            }
        }
        assert_eq!(one_by_one, 5, "the burst, one by one");
        assert_eq!(d.pending(), 1, "one tally per (org, address)");
        assert_eq!(d.pending_count(), 9_995);
        let drained = d.tallies.drain();
        let (key, tally) = &drained[0];
        assert!(tally.tracked_hosts() <= TRACKED_HOSTS);
        assert_eq!(key.1, Some("198.19.1.7".parse().unwrap()));
        let s = tally.summary::<DenialSummary>(key);
        assert_eq!(s.count, Some(9_995));
        assert_eq!(s.reason, Reason::NoMatchingRule, "the most frequent");
        let hosts = s.hosts.as_ref().unwrap();
        assert_eq!(hosts.len(), TOP_HOSTS + 1, "{hosts:?}");
        assert_eq!(hosts.values().sum::<u64>(), 9_995, "nothing lost");
        let reasons = s.reasons.as_ref().unwrap();
        assert_eq!(reasons.values().sum::<u64>(), 9_995);
        assert_eq!(s.client, Some("198.19.1.7:0".parse().unwrap()));
        assert_eq!(s.org.as_deref(), Some("acme"));
        assert!(s.window.is_some() && s.host.is_none());
    }

    #[test]
    fn an_org_flooding_from_many_addresses_is_bounded_by_its_own_rate() {
        let d = Denials::new(5, 20, unlimited());
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let mut acme = 0;
        for i in 0..200 {
            // 200 addresses, one denial each: every address within its rate.
            let client = format!("198.19.{}.{}:4000", i / 200, i % 200 + 1);
            if d.admit(
                &denial("acme", &client, "x.test", Reason::NoMatchingRule),
                t0,
                wall,
            ) {
                acme += 1;
            }
        }
        assert_eq!(acme, 20, "the org's burst, one by one; the rest tallied");
        assert_eq!(d.pending_count(), 180);
        // Another org's denials keep their own budget.
        let beta = denial("beta", "198.19.9.9:1", "x.test", Reason::NoMatchingRule);
        assert!(d.admit(&beta, t0, wall));
    }

    #[test]
    fn allows_and_other_addresses_are_never_summarised() {
        let d = Denials::new(1, 1_000_000, unlimited());
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let deny = denial("acme", "198.19.1.7:1", "a.test", Reason::NoMatchingRule);
        assert!(d.admit(&deny, t0, wall));
        assert!(!d.admit(&deny, t0, wall));
        let mut allow = deny.clone();
        allow.reason = Reason::RuleMatch;
        for _ in 0..100 {
            assert!(d.admit(&allow, t0, wall), "allows one by one");
        }
        let other = denial("beta", "198.19.2.9:1", "a.test", Reason::NoMatchingRule);
        assert!(
            d.admit(&other, t0, wall),
            "another address has its own rate"
        );
        let close = deny.close(1, 2, 3);
        assert!(d.admit(&close, t0, wall));
        assert!(
            d.admit(&deny, t0 + Duration::from_secs(1), wall),
            "refilled"
        );
    }

    #[test]
    fn allows_and_denials_share_the_orgs_evidence_budget() {
        let d = Denials::new(1000, 1000, Arc::new(EvidenceBudget::new(5)));
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let acme: Option<Arc<str>> = Some(Arc::from("acme"));
        assert!(
            d.pay_allow(&acme).is_ok() && d.pay_allow(&acme).is_ok(),
            "two allows paid"
        );
        let deny = denial("acme", "198.19.1.7:1", "a.test", Reason::NoMatchingRule);
        let one_by_one = (0..100).filter(|_| d.admit(&deny, t0, wall)).count();
        assert_eq!(one_by_one, 3, "the rest of the burst, then summarised");
        assert_eq!(d.pending_count(), 97);
        assert!(
            d.pay_allow(&acme).is_err(),
            "spent: the next allow is refused"
        );
        // Another org, and the clients of no org, pay from their own.
        assert!(d.pay_allow(&Some(Arc::from("beta"))).is_ok());
        assert!(d.pay_allow(&None).is_ok());
        let mut stranger = denial("x", "203.0.113.9:1", "a.test", Reason::UnknownClient);
        stranger.org = None;
        assert!(d.admit(&stranger, t0, wall));
    }

    #[test]
    fn an_orgs_unpaid_summaries_fold_into_one_whatever_its_addresses() {
        let d = Denials::new(1, 1_000_000, Arc::new(EvidenceBudget::new(5)));
        let (t0, wall) = (Instant::now(), SystemTime::now());
        for i in 0..20 {
            let client = format!("198.19.1.{}:4000", i + 1);
            for _ in 0..2 {
                d.admit(
                    &denial("acme", &client, "x.test", Reason::NoMatchingRule),
                    t0,
                    wall,
                );
            }
        }
        // One address of beta, whose budget is untouched.
        for _ in 0..3 {
            d.admit(
                &denial("beta", "198.19.9.9:1", "y.test", Reason::NoMatchingRule),
                t0,
                wall,
            );
        }
        assert_eq!(d.pending(), 21);
        let drained = d.tallies.drain();
        let paid = d.pay_summaries(drained, t0);
        let acme: Vec<&(Key, Tally)> = paid
            .iter()
            .filter(|((org, _), _)| org.as_deref() == Some("acme"))
            .collect();
        assert_eq!(acme.len(), 1, "acme's budget is spent: one summary");
        let ((_, client), tally) = acme[0];
        assert_eq!(*client, None, "from several addresses");
        assert_eq!(tally.count(), 40 - 5, "nothing lost in the fold");
        let beta: Vec<&(Key, Tally)> = paid
            .iter()
            .filter(|((org, _), _)| org.as_deref() == Some("beta"))
            .collect();
        assert_eq!(beta.len(), 1);
        assert_eq!(
            beta[0].0 .1,
            Some("198.19.9.9".parse().unwrap()),
            "paid for: its address kept"
        );
        // Unpaid again, a single address keeps its own.
        let r = denial("beta", "198.19.9.9:1", "y.test", Reason::NoMatchingRule);
        for _ in 0..10 {
            d.budget.charge(&r.org, t0);
        }
        d.admit(&r, t0, wall);
        let drained = d.tallies.drain();
        let paid = d.pay_summaries(drained, t0);
        assert_eq!(paid.len(), 1);
        assert_eq!(paid[0].0 .1, Some("198.19.9.9".parse().unwrap()));
    }

    #[tokio::test]
    async fn summaries_are_chained_signed_records_and_wait_for_room() {
        let dir = crate::testing::scratch("denials");
        let ev = Evidence::open(&dir.join("evidence")).unwrap();
        let d = Denials::new(2, 1_000_000, unlimited());
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let mut written = 0;
        for i in 0..500 {
            let org = if i % 2 == 0 { "acme" } else { "beta" };
            let client = if i % 2 == 0 {
                "198.19.1.7:1"
            } else {
                "198.19.2.7:1"
            };
            let mut r = denial(org, client, "x.test", Reason::NoMatchingRule);
            if d.admit(&r, t0, wall) {
                ev.write(&mut r).await.unwrap();
                written += 1;
            }
        }
        assert_eq!(written, 4);
        // A stalled writer: no room, nothing lost, nothing waited for.
        ev.pause_writer(true);
        let mut filler = denial("acme", "198.19.1.8:1", "y.test", Reason::NoMatchingRule);
        while ev.submit_within(&mut filler, Duration::ZERO).await {}
        assert!(d.flush(&ev).await.is_empty());
        assert_eq!(d.pending_count(), 496);
        ev.pause_writer(false);
        let summaries = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let s = d.flush(&ev).await;
                if !s.is_empty() {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(summaries.len(), 2);
        assert_eq!(d.pending(), 0);
        assert!(ev.seal().await);
        let summary = crate::evidence::verify::verify_path(&dir.join("evidence")).unwrap();
        assert!(format!("{summary:?}").contains("records"), "{summary:?}");
        let text: String = crate::evidence::segment::list(&dir.join("evidence"))
            .unwrap()
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap())
            .collect();
        let counted: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["count"].is_u64())
            .collect();
        assert_eq!(counted.len(), 2);
        for v in &counted {
            assert_eq!(v["count"], 248, "{v}");
            assert_eq!(v["hosts"]["x.test"], 248, "{v}");
            assert_eq!(v["reasons"]["no_matching_rule"], 248, "{v}");
            assert!(v["client"].as_str().unwrap().ends_with(":0"), "{v}");
            assert!(v["window"].is_array() && v["hash"].is_string(), "{v}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tallies_stay_bounded_whatever_the_number_of_addresses() {
        let d = Denials::new(1, 1_000_000, unlimited());
        let (t0, wall) = (Instant::now(), SystemTime::now());
        let flood = |org: &str, base: u32, n: u32| {
            for i in 0..n {
                let ip = std::net::Ipv4Addr::from(base + i);
                let r = denial(org, &format!("{ip}:1"), "a.test", Reason::NoMatchingRule);
                d.admit(&r, t0, wall);
                d.admit(&r, t0, wall);
            }
        };
        flood("acme", 0x0a00_0000, MAX_TALLIES as u32 + 100);
        assert_eq!(
            d.pending(),
            MAX_TALLIES_PER_ORG + 1,
            "its share plus the org's overflow tally"
        );
        assert_eq!(d.pending_count(), MAX_TALLIES as u64 + 100);
        // Acme's flood left beta its share: each address its own tally.
        flood("beta", 0x0b00_0000, 10);
        assert_eq!(d.pending(), MAX_TALLIES_PER_ORG + 1 + 10);
        // Everyone's bound holds too.
        for org in ["c", "d", "e", "f"] {
            flood(org, 0x0c00_0000, MAX_TALLIES_PER_ORG as u32);
        }
        assert!(d.pending() <= MAX_TALLIES + 6, "{}", d.pending());
    }
}
