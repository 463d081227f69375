//! Answer TTLs that do not count down across orgs.
//!
//! The resolver's cache is shared by every org, and hands a cached answer
//! back with its TTLs counted down by the time since it was fetched. Passed
//! on as they are, they would tell org B that someone (org A) looked the
//! name up, and how long ago: B asking ten minutes after A would see TTLs
//! 600 s lower than the name's own.
//!
//! [`TtlMemo`] keeps, per (name, type), the TTLs of an answer as the shim
//! first saw it, until that answer expires (its first-seen time plus its
//! smallest TTL); every later sighting of the same answer (same records,
//! whatever their TTLs now) is given those TTLs again. So every org, at any
//! time, is answered with the same TTLs, and a client may keep an answer up
//! to one TTL past the cache's expiry (bounded by `max_ttl`; the binding it
//! got lasts as long).
//!
//! What remains: the first sighting carries whatever TTL the resolver gave
//! then, which a caching upstream server (or the proxy's own resolution
//! through the same cache) may already have counted down; and a memo
//! evicted under a flood of more than [`MEMO_CAPACITY`] distinct live
//! answers is started again from the next sighting. Pure: the caller
//! passes `now`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_server::proto::rr::{Record, RecordType};

use crate::limits::table::FairTable;

/// Answers remembered at most; the one that expires soonest goes first.
pub(crate) const MEMO_CAPACITY: usize = 16_384;

type Key = (String, RecordType);

#[derive(Debug)]
struct Memo {
    fingerprint: u64,
    ttls: Vec<u32>,
}

/// The TTLs of each answer as first seen: one table (one org, the memo
/// is shared by all), ordered by expiry.
#[derive(Debug)]
pub(crate) struct TtlMemo {
    memos: Mutex<FairTable<(), Key, Memo, Instant>>,
}

/// The answer's records without their TTLs.
fn fingerprint(records: &[Record]) -> u64 {
    let mut h = DefaultHasher::new();
    for r in records {
        r.name.hash(&mut h);
        r.record_type().hash(&mut h);
        r.data.hash(&mut h);
    }
    h.finish()
}

impl Default for TtlMemo {
    fn default() -> Self {
        TtlMemo::new(MEMO_CAPACITY)
    }
}

impl TtlMemo {
    pub(crate) fn new(capacity: usize) -> TtlMemo {
        TtlMemo {
            memos: Mutex::new(FairTable::new(capacity.max(1), capacity.max(1))),
        }
    }

    /// Give `records` (the answer for `name`/`qtype`, as the resolver
    /// returned it at `now`) the TTLs the same answer had when first seen.
    /// Returns until when those TTLs hold (`None`: no records).
    pub(crate) fn apply(
        &self,
        name: &str,
        qtype: RecordType,
        records: &mut [Record],
        now: Instant,
    ) -> Option<Instant> {
        if records.is_empty() {
            return None;
        }
        let fp = fingerprint(records);
        let key: Key = (name.to_string(), qtype);
        let mut memos = self.memos.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((until, m)) = memos.placed(&key) {
            if m.fingerprint == fp && *until > now && m.ttls.len() == records.len() {
                for (r, ttl) in records.iter_mut().zip(&m.ttls) {
                    r.ttl = *ttl;
                }
                return Some(*until);
            }
        }
        // A new answer (or the old one expired): it is the first sighting.
        // The expired memos go, then (full) the one expiring soonest.
        memos.remove(&key);
        let expired = |until: &Instant, _: &Memo| *until <= now;
        memos.sweep(None, usize::MAX, expired);
        let ttls: Vec<u32> = records.iter().map(|r| r.ttl).collect();
        let shortest = ttls.iter().copied().min().unwrap_or(0).max(1);
        let until = now + Duration::from_secs(u64::from(shortest));
        let memo = Memo {
            fingerprint: fp,
            ttls,
        };
        // One org: over the cap, its (the table's) soonest expiry goes.
        let _ = memos.insert((), key, memo, until, expired);
        Some(until)
    }

    /// Answers remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.memos.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_server::proto::rr::rdata::{A, CNAME};
    use hickory_server::proto::rr::{Name, RData};

    const SEC: Duration = Duration::from_secs(1);

    fn answer(ttl_cname: u32, ttl_a: u32, last: u8) -> Vec<Record> {
        let name = Name::from_ascii("www.shared.test.").unwrap();
        let target = Name::from_ascii("cdn.shared.test.").unwrap();
        vec![
            Record::from_rdata(name, ttl_cname, RData::CNAME(CNAME(target.clone()))),
            Record::from_rdata(target, ttl_a, RData::A(A::new(198, 18, 2, last))),
        ]
    }

    fn ttls(records: &[Record]) -> Vec<u32> {
        records.iter().map(|r| r.ttl).collect()
    }

    #[test]
    fn a_second_org_asking_later_sees_the_same_ttl_as_the_first() {
        let memo = TtlMemo::default();
        let t0 = Instant::now();
        // Org A's query: the resolver fetched it just now.
        let mut first = answer(600, 300, 10);
        let until = memo.apply("www.shared.test", RecordType::A, &mut first, t0);
        assert_eq!(ttls(&first), [600, 300]);
        // The TTLs hold until the shortest of them has run out.
        assert_eq!(until, Some(t0 + 300 * SEC));
        // Org B, 100 s later: the shared cache counted the TTLs down.
        let mut second = answer(500, 200, 10);
        let again = memo.apply(
            "www.shared.test",
            RecordType::A,
            &mut second,
            t0 + 100 * SEC,
        );
        assert_eq!(ttls(&second), ttls(&first));
        assert_eq!(again, until);
        assert_eq!(memo.apply("x.test", RecordType::A, &mut [], t0), None);
        // Another type of the same name is its own answer.
        let mut aaaa = answer(550, 250, 10);
        memo.apply(
            "www.shared.test",
            RecordType::AAAA,
            &mut aaaa,
            t0 + 100 * SEC,
        );
        assert_eq!(ttls(&aaaa), [550, 250]);
        // Different records are a different answer, seen for the first time.
        let mut changed = answer(500, 200, 11);
        memo.apply(
            "www.shared.test",
            RecordType::A,
            &mut changed,
            t0 + 100 * SEC,
        );
        assert_eq!(ttls(&changed), [500, 200]);
    }

    #[test]
    fn an_expired_answer_starts_again() {
        let memo = TtlMemo::default();
        let t0 = Instant::now();
        let mut first = answer(600, 300, 10);
        memo.apply("a.test", RecordType::A, &mut first, t0);
        // Past the shortest TTL the cache fetched it again.
        let mut refetched = answer(60, 30, 10);
        memo.apply("a.test", RecordType::A, &mut refetched, t0 + 300 * SEC);
        assert_eq!(ttls(&refetched), [60, 30]);
        assert_eq!(memo.len(), 1);
    }

    #[test]
    fn bounded_soonest_expiry_first() {
        let memo = TtlMemo::new(8);
        let t0 = Instant::now();
        let mut long = answer(3600, 3600, 1);
        memo.apply("long.test", RecordType::A, &mut long, t0);
        for i in 0..100u32 {
            let mut a = answer(60, 60, 2);
            memo.apply(&format!("n{i}.test"), RecordType::A, &mut a, t0);
        }
        assert_eq!(memo.len(), 8);
        let mut again = answer(3000, 3000, 1);
        memo.apply("long.test", RecordType::A, &mut again, t0 + 600 * SEC);
        assert_eq!(ttls(&again), [3600, 3600]);
    }
}
