//! Refusal records that take part in back-pressure without ever growing,
//! within each org's evidence budget.
//!
//! A refusal lets nothing through, so its record need not be written before
//! the answer; but queued without limit (as [`Evidence::submit`] does), a
//! query flood during an evidence writer stall piles up records in memory
//! and then drowns every other record. Here a refusal goes into the
//! writer's queue only into a free place, waiting at most as long as its
//! caller allows (the query timeout within the query budgets, nothing over
//! a limit). What finds no place, or meets an unhealthy writer, is counted
//! into one tally per (org, reason) instead, and [`Refusals::flush`] later
//! writes each tally as ONE record:
//!
//! ```json
//! {"kind": "dns", "event": "decision", "decision": "deny",
//!  "reason": "limit_exceeded", "org": "acme", "client": null, "count": 1234,
//!  "detail": "1234 refusals summarised (limit_exceeded) between T1 and T2", ...}
//! ```
//!
//! A refusal is written one by one only while its org's evidence budget
//! ([`EvidenceBudget`], shared with the proxy) has a record left; beyond,
//! it is tallied the same way. So is an answer the shim refuses because
//! its org's budget is spent ([`Refusals::pay`] says so before anything is
//! forwarded). Each summary written is charged to its org's budget too,
//! whatever is left (it cannot be refused).
//!
//! Memory is bounded by the number of (org, reason) pairs, whatever the
//! flood. The tallies are the proxy's denial summaries' engine
//! ([`crate::limits::summary`]), with the DNS shape ([`RefusalSummary`]).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::evidence::{Evidence, Record};
use crate::limits::summary::{Shape, Tallies, Tally};
use crate::limits::EvidenceBudget;
use crate::metrics::Metrics;
use crate::policy::Reason;

pub(crate) use crate::limits::summary::SUMMARY_INTERVAL;

/// How a refusal was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Queued as its own record, shown to the client as this reference.
    Record(String),
    /// Counted into its (org, reason) tally.
    Summarised,
}

impl Recorded {
    /// What the client is told in the EDE text after the reason.
    pub(crate) fn reference(&self) -> String {
        match self {
            Recorded::Record(id) => format!("record={id}"),
            Recorded::Summarised => "summarised".to_string(),
        }
    }
}

/// The shape of a refusal summary: one per (org, reason), no answers,
/// nothing upstream.
#[derive(Debug)]
pub(crate) struct RefusalSummary;

impl Shape for RefusalSummary {
    type Key = (Option<Arc<str>>, Reason);
    const BREAKDOWN: bool = false;

    fn finish(_: &Self::Key, tally: &Tally, r: &mut Record) {
        r.answers = Some(super::query::no_answers());
        r.upstream = Some(false);
        let [first, last] = r.window.clone().unwrap_or_default();
        r.detail = Some(format!(
            "{} refusals summarised ({}) between {first} and {last}",
            tally.count(),
            tally.reason(),
        ));
    }
}

/// Records refusals: one by one while the writer has room, in tallies when not.
pub(crate) struct Refusals {
    evidence: Arc<Evidence>,
    metrics: Arc<Metrics>,
    /// Decision records per org (shared with the proxy).
    budget: Arc<EvidenceBudget>,
    tallies: Tallies<RefusalSummary>,
}

impl Refusals {
    pub(crate) fn new(
        evidence: Arc<Evidence>,
        metrics: Arc<Metrics>,
        budget: Arc<EvidenceBudget>,
    ) -> Refusals {
        Refusals {
            evidence,
            metrics,
            budget,
            tallies: Tallies::default(),
        }
    }

    /// Use `budget` (the one the proxy shares) from now on.
    pub(crate) fn set_budget(&mut self, budget: Arc<EvidenceBudget>) {
        self.budget = budget;
    }

    /// Take one record of `org`'s evidence budget (none: clients of no
    /// org) for an answer, before anything is forwarded. `Err`: spent (or
    /// the org is over its share of a full store), the answer must be
    /// refused `limit_exceeded` with that detail.
    pub(crate) fn pay(&self, org: &Option<Arc<str>>, now: Instant) -> Result<(), &'static str> {
        self.budget.take_allow(org, now)
    }

    /// Record a refusal (counted in the metrics either way): queued when
    /// its org's evidence budget has a record left and the writer is
    /// healthy and has room within `wait`, else tallied.
    pub(crate) async fn record(&self, rec: &mut Record, wait: Duration) -> Recorded {
        self.metrics.count_record(rec);
        if self.budget.take(&rec.org, Instant::now())
            && self.evidence.is_healthy()
            && self.evidence.submit_within(rec, wait).await
        {
            return Recorded::Record(rec.shown().to_string());
        }
        self.metrics
            .evidence_suppressed_total
            .with_label_values(&[rec.org.as_deref().unwrap_or(crate::metrics::UNKNOWN_ORG)])
            .inc();
        self.tallies
            .add((rec.org.clone(), rec.reason), rec, SystemTime::now());
        Recorded::Summarised
    }

    /// Write each tally as one record. Once one finds no room within
    /// `wait` the others are not tried: they are all kept for the next
    /// flush (as they are while the writer is unhealthy), so a flush waits
    /// at most `wait` in all.
    pub(crate) async fn flush(&self, wait: Duration) {
        if !self.evidence.is_healthy() {
            return;
        }
        let taken = self.tallies.drain();
        let written = self.tallies.write(&self.evidence, taken, wait).await;
        for ((org, _), _) in written {
            // Written: charged to the org, whatever is left.
            self.budget.charge(&org, Instant::now());
        }
    }

    /// Tallies waiting to be written.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.tallies.pending()
    }

    /// Refusals counted into the waiting tallies.
    pub(crate) fn pending_count(&self) -> u64 {
        self.tallies.pending_count()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::evidence::{Kind, Mode};
    use crate::policy::Verdict;

    fn refusal(org: &str, reason: Reason, i: usize) -> Record {
        let verdict = Verdict {
            org: None,
            reason,
            rule: None,
            would_deny: None,
        };
        let client: SocketAddr = format!("198.18.1.2:{}", 1024 + i % 60_000).parse().unwrap();
        let mut r = Record::decision(Kind::Dns, Mode::Dns, client, &verdict, &Arc::from("p"));
        r.org = Some(Arc::from(org));
        r.host = Some(format!("n{i}.flood.test"));
        r
    }

    #[tokio::test]
    async fn refusals_beyond_the_orgs_evidence_budget_are_summarised() {
        let dir = crate::testing::scratch("refusals");
        let ev = Arc::new(Evidence::open(&dir.join("evidence")).unwrap());
        let metrics = Arc::new(Metrics::new(ev.live().clone()));
        let refusals = Refusals::new(
            ev.clone(),
            metrics.clone(),
            Arc::new(EvidenceBudget::new(10)),
        );
        let mut one_by_one = 0u64;
        for i in 0..100 {
            let mut r = refusal("acme", Reason::NoMatchingRule, i);
            if let Recorded::Record(_) = refusals.record(&mut r, Duration::ZERO).await {
                one_by_one += 1;
            }
        }
        // The burst (plus what refilled meanwhile, 10 a second), no more.
        assert!((10..=12).contains(&one_by_one), "{one_by_one}");
        assert_eq!(refusals.pending_count(), 100 - one_by_one);
        assert_eq!(
            metrics
                .evidence_suppressed_total
                .with_label_values(&["acme"])
                .get(),
            100 - one_by_one
        );
        // beta's budget is its own.
        let mut r = refusal("beta", Reason::NoMatchingRule, 0);
        assert!(matches!(
            refusals.record(&mut r, Duration::ZERO).await,
            Recorded::Record(_)
        ));
        // Summaries are written whatever is left, and charged: acme's
        // next answer finds its budget spent.
        refusals.flush(Duration::from_secs(5)).await;
        assert_eq!(refusals.pending(), 0);
        assert!(refusals
            .pay(&Some(Arc::from("acme")), Instant::now())
            .is_err());
        assert!(ev.seal().await);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flood_with_the_writer_stalled_stays_bounded_and_is_summarised() {
        let dir = crate::testing::scratch("refusals");
        let ev = Arc::new(Evidence::open(&dir.join("evidence")).unwrap());
        let metrics = Arc::new(Metrics::new(ev.live().clone()));
        let refusals = Refusals::new(ev.clone(), metrics, Arc::new(EvidenceBudget::new(1 << 30)));
        ev.pause_writer(true);

        // Far more refusals than the queue holds, from many tasks; those
        // within a budget wait a little for room, the others not at all.
        const FLOOD: usize = 20_000;
        let refusals = Arc::new(refusals);
        let mut tasks = Vec::new();
        for t in 0..8 {
            let refusals = refusals.clone();
            tasks.push(tokio::spawn(async move {
                let mut summarised = 0u64;
                for i in (t..FLOOD).step_by(8) {
                    let reason = if i % 2 == 0 {
                        Reason::LimitExceeded
                    } else {
                        Reason::NoMatchingRule
                    };
                    let wait = if i % 16 == 1 {
                        Duration::from_millis(1)
                    } else {
                        Duration::ZERO
                    };
                    let org = if i % 3 == 0 { "acme" } else { "beta" };
                    let mut r = refusal(org, reason, i);
                    if refusals.record(&mut r, wait).await == Recorded::Summarised {
                        summarised += 1;
                    }
                }
                summarised
            }));
        }
        let mut summarised = 0;
        for t in tasks {
            summarised += t.await.unwrap();
        }
        let queued = ev.queued();
        assert!(queued <= 8192, "the queue grew to {queued}");
        assert_eq!(queued as u64 + summarised, FLOOD as u64);
        // Bounded by (org, reason), not by the flood.
        assert_eq!(refusals.pending(), 4);
        assert_eq!(refusals.pending_count(), summarised);

        // While the writer is stuck, flushing finds no room and keeps the tallies.
        refusals.flush(Duration::from_millis(10)).await;
        assert_eq!(refusals.pending_count(), summarised);

        ev.pause_writer(false);
        refusals.flush(Duration::from_secs(5)).await;
        assert_eq!(refusals.pending(), 0);
        assert!(ev.seal().await);

        let records: Vec<serde_json::Value> = crate::evidence::segment::list(&dir.join("evidence"))
            .unwrap()
            .iter()
            .flat_map(|p| {
                std::fs::read_to_string(p)
                    .unwrap()
                    .lines()
                    .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                    .collect::<Vec<_>>()
            })
            .collect();
        let summaries: Vec<&serde_json::Value> =
            records.iter().filter(|v| v["count"].is_u64()).collect();
        assert_eq!(summaries.len(), 4, "{summaries:?}");
        let mut total = 0;
        for s in &summaries {
            assert_eq!(s["event"], "decision", "{s}");
            assert_eq!(s["kind"], "dns", "{s}");
            assert_eq!(s["decision"], "deny", "{s}");
            assert!(s["client"].is_null() && s["host"].is_null(), "{s}");
            let n = s["count"].as_u64().unwrap();
            let detail = s["detail"].as_str().unwrap();
            let want = format!(
                "{n} refusals summarised ({}) between ",
                s["reason"].as_str().unwrap()
            );
            assert!(detail.starts_with(&want), "{detail}");
            total += n;
        }
        assert_eq!(total, summarised);
        let individual = records
            .iter()
            .filter(|v| v["kind"] == "dns" && v["count"].is_null())
            .count();
        assert_eq!(individual as u64 + total, FLOOD as u64);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
