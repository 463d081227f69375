//! Connection caps: one global, one per org. A permit moves into the
//! connection's task and frees its slots when dropped. Orgs are counted by
//! name, so a policy reload that reorders or adds orgs keeps every count.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::Limits;
use crate::policy::OrgRef;

/// Counters for the global cap and each org's cap (clients of no org share
/// the `unknown` one), and each org's rate of new connections.
#[derive(Debug)]
pub struct ConnLimits {
    global: Arc<Slot>,
    max_per_org: usize,
    per_org: Mutex<HashMap<Arc<str>, Arc<Slot>>>,
    new_per_org: RateLimiter<Arc<str>>,
    /// `palisade_active_connections`, by org.
    active: prometheus::IntGaugeVec,
}

/// Which limit refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitHit {
    Global,
    Org,
    Rate,
}

impl LimitHit {
    pub fn describe(self) -> &'static str {
        match self {
            LimitHit::Global => "max_connections reached",
            LimitHit::Org => "max_connections_per_org reached",
            LimitHit::Rate => "max_new_connections_per_second_per_org exceeded",
        }
    }
}

/// Token buckets per key (`rate` tokens a second, up to `rate` saved), for
/// at most `max_keys` keys. With the table full of recently active keys, a
/// new key is refused: the limiter fails closed rather than growing.
///
/// Memory follows use without ever scanning the whole table under the
/// lock: each new key first looks at the [`SWEEP_PER_INSERT`] keys that
/// have gone longest without a look, drops those whose bucket has refilled
/// (a full bucket carries no state) and sends the others to the back.
#[derive(Debug)]
pub struct RateLimiter<K> {
    rate: f64,
    max_keys: usize,
    table: Mutex<Table<K>>,
}

/// Keys looked at (and dropped if refilled) before each new key goes in.
pub const SWEEP_PER_INSERT: usize = 4;

#[derive(Debug)]
struct Table<K> {
    buckets: HashMap<K, Bucket>,
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
}

impl<K: Hash + Eq + Clone> RateLimiter<K> {
    pub fn new(rate_per_second: usize, max_keys: usize) -> Self {
        RateLimiter {
            rate: rate_per_second.max(1) as f64,
            max_keys,
            table: Mutex::new(Table {
                buckets: HashMap::new(),
                sweep: VecDeque::new(),
            }),
        }
    }

    /// Take one token for `key` at `now`.
    pub fn allow(&self, key: &K, now: Instant) -> bool {
        let rate = self.rate;
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let Table { buckets, sweep } = &mut *table;
        if !buckets.contains_key(key) {
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
            sweep.push_back(key.clone());
            buckets.insert(
                key.clone(),
                Bucket {
                    tokens: rate,
                    at: now,
                },
            );
        }
        let Some(bucket) = buckets.get_mut(key) else {
            return false;
        };
        bucket.tokens = bucket.refilled(rate, now);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.table.lock().map_or(0, |t| t.buckets.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug)]
struct Slot {
    used: AtomicUsize,
    max: usize,
}

impl Slot {
    fn try_take(self: &Arc<Self>) -> Option<Arc<Self>> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used >= self.max {
                return None;
            }
            match self.used.compare_exchange_weak(
                used,
                used + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.clone()),
                Err(now) => used = now,
            }
        }
    }

    fn give_back(&self) {
        self.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Held for the life of one client connection; counted in
/// `palisade_active_connections` while it lives.
#[derive(Debug)]
pub struct Permit {
    slots: [Arc<Slot>; 2],
    active: prometheus::IntGauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        for slot in &self.slots {
            slot.give_back();
        }
        self.active.dec();
    }
}

impl ConnLimits {
    /// The caps of `limits`; permits count in `active`
    /// (`palisade_active_connections`).
    pub fn new(limits: &Limits, active: prometheus::IntGaugeVec) -> ConnLimits {
        let Limits {
            max_connections: max_global,
            max_connections_per_org: max_per_org,
            max_new_connections_per_second_per_org: new_per_second_per_org,
            ..
        } = *limits;
        ConnLimits {
            global: Arc::new(Slot {
                used: AtomicUsize::new(0),
                max: max_global,
            }),
            max_per_org,
            per_org: Mutex::new(HashMap::new()),
            // Orgs come from the config (plus `unknown`): a small, bounded set.
            new_per_org: RateLimiter::new(new_per_second_per_org, 65_536),
            active,
        }
    }

    fn org_slot(&self, org: Option<&OrgRef>) -> Arc<Slot> {
        let name: Arc<str> = org.map_or_else(
            || Arc::from(crate::metrics::UNKNOWN_ORG),
            |o| o.name.clone(),
        );
        let mut map = self.per_org.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(name)
            .or_insert_with(|| {
                Arc::new(Slot {
                    used: AtomicUsize::new(0),
                    max: self.max_per_org,
                })
            })
            .clone()
    }

    /// A permit if no cap or rate is exceeded.
    pub fn try_acquire(&self, org: Option<&OrgRef>) -> Result<Permit, LimitHit> {
        let name: Arc<str> = org.map_or_else(
            || Arc::from(crate::metrics::UNKNOWN_ORG),
            |o| o.name.clone(),
        );
        if !self.new_per_org.allow(&name, Instant::now()) {
            return Err(LimitHit::Rate);
        }
        let org_slot = self.org_slot(org);
        let global = self.global.try_take().ok_or(LimitHit::Global)?;
        match org_slot.try_take() {
            Some(org_slot) => {
                let active = self
                    .active
                    .with_label_values(&[crate::metrics::org_label(org)]);
                active.inc();
                Ok(Permit {
                    slots: [global, org_slot],
                    active,
                })
            }
            None => {
                global.give_back();
                Err(LimitHit::Org)
            }
        }
    }

    /// Connections currently held, all orgs together.
    pub fn in_use(&self) -> usize {
        self.global.used.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn org(index: usize, name: &str) -> OrgRef {
        OrgRef {
            index,
            name: Arc::from(name),
        }
    }

    #[test]
    fn rate_limiter_refills_and_stays_bounded() {
        let r = RateLimiter::new(2, 2);
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
    fn caps_hold_and_release() {
        let active =
            prometheus::IntGaugeVec::new(prometheus::Opts::new("a", "a"), &["org"]).unwrap();
        let limits = ConnLimits::new(
            &Limits {
                max_connections: 3,
                max_connections_per_org: 2,
                max_new_connections_per_second_per_org: 1000,
                ..Limits::default()
            },
            active.clone(),
        );
        let a = limits.try_acquire(Some(&org(0, "a"))).unwrap();
        let _b = limits.try_acquire(Some(&org(7, "a"))).unwrap();
        assert!(
            limits.try_acquire(Some(&org(0, "a"))).err() == Some(LimitHit::Org),
            "per-org cap, by name"
        );
        let _c = limits.try_acquire(Some(&org(0, "b"))).unwrap();
        assert_eq!(
            limits.try_acquire(None).err(),
            Some(LimitHit::Global),
            "global cap"
        );
        assert_eq!(limits.in_use(), 3);
        assert_eq!(active.with_label_values(&["a"]).get(), 2);
        drop(a);
        assert_eq!(active.with_label_values(&["a"]).get(), 1);
        assert!(limits.try_acquire(None).is_ok());
    }

    #[test]
    fn rate_limiter_sweeps_a_few_keys_per_new_key_never_the_whole_table() {
        let r = RateLimiter::new(1, 1000);
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
