//! Token buckets per key: the rates of new connections, of queries, of
//! denial records, and the evidence budget's buckets.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::Mutex;
use std::time::Instant;

/// Token buckets per key (`rate` tokens a second, up to `rate` saved), for
/// at most `max_keys` keys. With the table full of recently active keys, a
/// new key is refused: the limiter fails closed rather than growing.
///
/// Memory follows use without ever scanning the whole table under the
/// lock: each new key first looks at the [`SWEEP_PER_INSERT`] keys that
/// have gone longest without a look, drops those whose bucket has refilled
/// (a full bucket carries no state) and sends the others to the back.
///
/// Not on [`FairTable`](super::table::FairTable), measured: the buckets
/// have no orgs (the key is the payer), never evict (a full table
/// refuses) and keep their order as a rotation, so the table's per-org
/// index, places and pins would be carried for nothing: on it, 3.4 times
/// the time per `allow` and a quarter more memory per key
/// (`cargo test --lib limits::measure -- --ignored`).
///
/// Keys are hashed with `S`: SipHash (the default) for keys a client
/// chooses (its address); a fast keyed hash ([`OrgLimiter`]) for keys the
/// configuration makes (org names).
#[derive(Debug)]
pub(crate) struct RateLimiter<K, S = RandomState> {
    rate: f64,
    max_keys: usize,
    table: Mutex<Table<K, S>>,
}

/// A [`RateLimiter`] keyed by what the configuration names (orgs).
pub(crate) type OrgLimiter<K> = RateLimiter<K, foldhash::fast::RandomState>;

/// Keys looked at (and dropped if refilled) before each new key goes in.
pub(crate) const SWEEP_PER_INSERT: usize = 4;

#[derive(Debug)]
struct Table<K, S> {
    buckets: HashMap<K, Bucket, S>,
    /// Every key of `buckets` once, least recently swept first.
    sweep: VecDeque<K>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// The tokens at `now`, refilled at `rate` a second up to `rate`.
    fn refilled(self, rate: f64, now: Instant) -> f64 {
        (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * rate).min(rate)
    }

    /// Refill to `now` and take one token: whether there was one. With
    /// `force` the bucket goes into debt instead, down to `-rate`.
    fn take(&mut self, rate: f64, now: Instant, force: bool) -> bool {
        self.tokens = self.refilled(rate, now);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            if force {
                self.tokens = (self.tokens - 1.0).max(-rate);
            }
            false
        }
    }
}

impl<K: Hash + Eq + Clone, S: BuildHasher + Default> RateLimiter<K, S> {
    pub(crate) fn new(rate_per_second: usize, max_keys: usize) -> Self {
        RateLimiter {
            rate: rate_per_second.max(1) as f64,
            max_keys,
            table: Mutex::new(Table {
                buckets: HashMap::with_hasher(S::default()),
                sweep: VecDeque::new(),
            }),
        }
    }

    /// Take one token for `key` at `now`.
    pub(crate) fn allow(&self, key: &K, now: Instant) -> bool {
        self.take(key, now, false)
    }

    /// Take one token for `key` at `now` even when none is left, for what
    /// cannot be refused: the bucket goes into debt, down to one second's
    /// worth (`-rate`) at most, which later refills pay back before
    /// [`RateLimiter::allow`] succeeds again. With the table full of
    /// active keys a new key is not charged.
    pub(crate) fn charge(&self, key: &K, now: Instant) {
        self.take(key, now, true);
    }

    fn take(&self, key: &K, now: Instant, force: bool) -> bool {
        let rate = self.rate;
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let Table { buckets, sweep } = &mut *table;
        // A key seen before: one lookup.
        if let Some(bucket) = buckets.get_mut(key) {
            return bucket.take(rate, now, force);
        }
        for _ in 0..SWEEP_PER_INSERT.min(sweep.len()) {
            let Some(k) = sweep.pop_front() else { break };
            match buckets.get(&k) {
                Some(b) if b.refilled(rate, now) < rate => sweep.push_back(k),
                _ => {
                    buckets.remove(&k);
                }
            }
        }
        if buckets.len() >= self.max_keys {
            return false;
        }
        let mut bucket = Bucket {
            tokens: rate,
            at: now,
        };
        let taken = bucket.take(rate, now, force);
        sweep.push_back(key.clone());
        buckets.insert(key.clone(), bucket);
        taken
    }

    /// Keys held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.lock().map_or(0, |t| t.buckets.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limiter_refills_and_stays_bounded() {
        let r: RateLimiter<i32> = RateLimiter::new(2, 2);
        let t0 = Instant::now();
        assert!(r.allow(&1, t0) && r.allow(&1, t0));
        assert!(!r.allow(&1, t0), "burst of two spent");
        assert!(
            r.allow(&1, t0 + std::time::Duration::from_millis(600)),
            "refilled"
        );
        assert!(r.allow(&2, t0));
        assert!(!r.allow(&3, t0), "table full of active keys: fail closed");
        assert!(
            r.allow(&3, t0 + std::time::Duration::from_secs(5)),
            "idle keys dropped"
        );
    }

    #[test]
    fn charges_that_cannot_be_refused_go_into_bounded_debt() {
        let r: RateLimiter<i32> = RateLimiter::new(4, 8);
        let t0 = Instant::now();
        for _ in 0..4 {
            assert!(r.allow(&1, t0));
        }
        // Empty: twenty more charges, of which only one second's worth count.
        for _ in 0..20 {
            r.charge(&1, t0);
        }
        let ms = std::time::Duration::from_millis;
        assert!(!r.allow(&1, t0 + ms(900)), "still paying back the debt");
        assert!(r.allow(&1, t0 + ms(1300)), "debt of one second, paid back");
        // A charge with tokens left is an ordinary take.
        let t2 = t0 + std::time::Duration::from_secs(5);
        r.charge(&2, t2);
        for _ in 0..3 {
            assert!(r.allow(&2, t2));
        }
        assert!(!r.allow(&2, t2));
    }

    #[test]
    fn rate_limiter_sweeps_a_few_keys_per_new_key_never_the_whole_table() {
        let r: RateLimiter<i32> = RateLimiter::new(1, 1000);
        let t0 = Instant::now();
        for k in 0..1000 {
            assert!(r.allow(&k, t0));
        }
        assert_eq!(r.len(), 1000);
        // Full of spent buckets: a new key is refused, nothing dropped.
        assert!(!r.allow(&1000, t0));
        assert_eq!(r.len(), 1000);
        // A second later every bucket has refilled: the next new key drops
        // only the few it looks at, and gets in.
        let t1 = t0 + std::time::Duration::from_secs(1);
        assert!(r.allow(&1001, t1));
        assert_eq!(r.len(), 1000 - SWEEP_PER_INSERT + 1);
        // Keys in use are kept: their buckets still count.
        assert!(!r.allow(&1001, t1), "one token a second");
        for k in 2000..2300 {
            assert!(r.allow(&k, t1));
        }
        assert!(!r.allow(&1001, t1), "not swept while spent");
        assert!(r.len() <= 1000);
    }
}
