//! One receive round of a UDP listener: the queries it took from the
//! socket together are recorded together.
//!
//! Under load a client (or many) keeps queries queued on the socket. The
//! receive loop ([`super::serve_udp`]) takes every datagram already queued,
//! up to [`MAX_ROUND`], and decides each; an answer's decision record is
//! not written by its query alone but [`Round::defer`]red to the round,
//! and the loop writes all of them as one batch ([`write()`]: one
//! `write(2)`, one wait, each record its own step of the chain) before it
//! lets any of those answers go. A batch that fails fails every query in
//! it, which then answers as a failed write does: SERVFAIL, unrecorded.
//! With one query in flight a round holds one query, recorded as before.
//!
//! Only while the loop gathers is the round open; a query that reaches its
//! record after the round closed (one that waited for its upstream) writes
//! its record alone, as before.

use std::sync::Mutex;

use tokio::sync::oneshot;

use crate::evidence::{Evidence, Record};

/// Most datagrams one round takes from the socket before it records and
/// answers them; also the most records one round writes.
pub(crate) const MAX_ROUND: usize = 32;

/// Rounds between two that look for more datagrams while none came
/// queued behind another.
pub(crate) const PROBE_EVERY: u32 = 64;

/// Whether a round looks for more datagrams than its first. Looking costs
/// a receive that finds the socket empty (and then a wait in `epoll`)
/// when nothing is queued, as with one query in flight: so a round looks
/// while the last one found more, and otherwise only every
/// [`PROBE_EVERY`]th round, which finds out when load begins.
#[derive(Debug, Default)]
pub(crate) struct Pace {
    /// The last round took more than one datagram.
    busy: bool,
    /// Rounds since one looked.
    quiet: u32,
}

impl Pace {
    /// Whether this round looks for more.
    pub(crate) fn more(&mut self) -> bool {
        if self.busy || self.quiet + 1 >= PROBE_EVERY {
            self.quiet = 0;
            true
        } else {
            self.quiet += 1;
            false
        }
    }

    /// The round took `taken` datagrams.
    pub(crate) fn took(&mut self, taken: usize) {
        self.busy = taken > 1;
    }
}

/// What a deferred record's query gets back: the record as written
/// (stamped), or why it was not.
pub(crate) type Outcome = Result<Record, String>;

/// Records deferred to the round being gathered.
#[derive(Debug, Default)]
pub(crate) struct Round {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    open: bool,
    waiting: Vec<Waiting>,
}

/// One deferred record and the query waiting for it.
#[derive(Debug)]
pub(crate) struct Waiting {
    record: Record,
    done: oneshot::Sender<Outcome>,
}

impl Round {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start gathering: records may be deferred until [`Round::close`].
    pub(crate) fn open(&self) {
        self.inner().open = true;
    }

    /// Leave `record` to the round's batch: the outcome comes once the
    /// batch was written. `Err` gives the record back when no round is
    /// being gathered (or it holds [`MAX_ROUND`] already): the caller
    /// writes it itself.
    pub(crate) fn defer(&self, record: Record) -> Result<oneshot::Receiver<Outcome>, Box<Record>> {
        let mut inner = self.inner();
        if !inner.open || inner.waiting.len() >= MAX_ROUND {
            return Err(Box::new(record));
        }
        let (done, outcome) = oneshot::channel();
        inner.waiting.push(Waiting { record, done });
        Ok(outcome)
    }

    /// Stop gathering; what was deferred, to be written by [`write()`].
    pub(crate) fn close(&self) -> Vec<Waiting> {
        let mut inner = self.inner();
        inner.open = false;
        std::mem::take(&mut inner.waiting)
    }
}

/// Write `waiting`'s records as one batch and tell each query the
/// outcome: all written, or none.
pub(crate) async fn write(evidence: &Evidence, waiting: Vec<Waiting>) {
    let (mut records, done): (Vec<Record>, Vec<_>) =
        waiting.into_iter().map(|w| (w.record, w.done)).unzip();
    let failed = evidence.write_all(&mut records).await.err();
    for (record, done) in records.into_iter().zip(done) {
        // A query gone (its backstop timed out) needs no outcome.
        let _ = done.send(match &failed {
            None => Ok(record),
            Some(e) => Err(e.to_string()),
        });
    }
}

/// The outcome of a deferred record: a round that ended without writing
/// it (dropped) counts as a failed write.
pub(crate) async fn outcome(deferred: oneshot::Receiver<Outcome>) -> Outcome {
    deferred
        .await
        .unwrap_or_else(|_| Err("the round ended without writing the record".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evidence::verify::{verify_with, Options};
    use crate::evidence::{Kind, Mode};
    use crate::policy::{Policy, Reason, Verdict};

    fn record() -> Record {
        let verdict = Verdict {
            org: None,
            reason: Reason::RuleMatch,
            rule: None,
            would_deny: None,
        };
        Record::decided(
            Kind::Dns,
            Mode::Dns,
            "198.18.0.2:5353".parse().unwrap(),
            &verdict,
            &Policy::compile(&[], Vec::new(), &[]),
        )
    }

    #[test]
    fn rounds_look_for_more_while_busy_and_probe_now_and_then_when_quiet() {
        let mut pace = Pace::default();
        // One query in flight: one round in PROBE_EVERY looks.
        let looked = (0..PROBE_EVERY * 4)
            .filter(|_| {
                let more = pace.more();
                pace.took(1);
                more
            })
            .count();
        assert_eq!(looked, 4);
        // A look that finds more keeps looking until a round takes one.
        while !pace.more() {
            pace.took(1);
        }
        pace.took(5);
        assert!(pace.more());
        pace.took(2);
        assert!(pace.more());
        pace.took(1);
        assert!(!pace.more());
    }

    #[test]
    fn records_are_deferred_only_while_the_round_gathers_and_within_its_bound() {
        let round = Round::default();
        assert!(round.defer(record()).is_err(), "closed: written alone");
        round.open();
        let deferred: Vec<_> = (0..MAX_ROUND)
            .map(|_| round.defer(record()).expect("room in the round"))
            .collect();
        assert!(round.defer(record()).is_err(), "full: written alone");
        assert_eq!(round.close().len(), MAX_ROUND);
        assert!(round.defer(record()).is_err(), "closed again");
        assert!(round.close().is_empty());
        drop(deferred);
    }

    #[tokio::test]
    async fn a_round_dropped_unwritten_fails_its_queries() {
        let round = Round::default();
        round.open();
        let deferred = round.defer(record()).expect("open");
        drop(round.close());
        assert!(outcome(deferred).await.is_err());
    }

    #[tokio::test]
    async fn a_round_is_written_as_one_batch_and_each_query_gets_its_record() {
        let dir = crate::testing::scratch("round").join("evidence");
        let evidence = Evidence::open(&dir).unwrap();
        let before = evidence.batches();
        let round = Round::default();
        round.open();
        let deferred: Vec<_> = (0..5).map(|_| round.defer(record()).unwrap()).collect();
        write(&evidence, round.close()).await;
        let mut ids = Vec::new();
        for d in deferred {
            let rec = outcome(d).await.expect("written");
            assert!(!rec.id.is_empty() && rec.reference.is_some());
            ids.push(rec.id);
        }
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 5);
        assert_eq!(evidence.batches() - before, 1, "one write for the round");
        assert!(evidence.seal().await);
        let found = verify_with(&dir, &Options::default()).expect("the chain verifies");
        assert!(found.sealed);
        assert_eq!(found.allow, 5);
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_query_in_it() {
        let dir = crate::testing::scratch("round").join("evidence");
        let evidence = Evidence::open(&dir).unwrap();
        evidence.fail_next_write();
        let round = Round::default();
        round.open();
        let deferred: Vec<_> = (0..3).map(|_| round.defer(record()).unwrap()).collect();
        write(&evidence, round.close()).await;
        for d in deferred {
            assert!(outcome(d).await.is_err());
        }
    }
}
