//! Connection caps: one global, one per org, one per source address for
//! connections charged to no org. A permit moves into the connection's task
//! and frees its slots when dropped. Orgs are counted by name, so a policy
//! reload that reorders or adds orgs keeps every count.
//!
//! A connection is charged to the org it is finally decided for:
//!
//! | at accept, the address maps to | charged at accept to | later |
//! |---|---|---|
//! | an org (identity `address`) | that org's cap and rate | moved if credentials name another org |
//! | no org (strangers, token clients) | its address's cap and rate (pre-authentication) | moved to the org its credentials name (explicit: the request head; SOCKS5: the authentication) |
//!
//! Moving to an org takes that org's rate token and cap slot first and only
//! then releases the address's slot: the pre-authentication permit is not
//! kept for the connection's life, so a NAT gateway of many token clients
//! is bounded by their orgs, not by `max_connections_per_client`. A
//! connection that never names an org (a stranger) stays on its address's
//! budget until it closes: one address can exhaust only its own budget.
//! IPv6 addresses are counted by /64, the block one host usually holds.
//! The global cap is taken at accept and held throughout.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::config::{Limits, DETECT_MEMORY_CLIENT_SHARE};
use crate::policy::OrgRef;

/// Counters for the global cap, each org's cap and each source address's
/// cap, and the rates of new connections per org and per address.
#[derive(Debug)]
pub struct ConnLimits {
    global: Arc<Slot>,
    max_per_org: usize,
    per_org: Mutex<HashMap<Arc<str>, Arc<Slot>>>,
    new_per_org: RateLimiter<Arc<str>>,
    max_per_client: usize,
    /// Connections held per address key.
    per_client: Arc<Shares<IpAddr>>,
    new_per_client: RateLimiter<IpAddr>,
    /// `palisade_active_connections`, by org.
    active: prometheus::IntGaugeVec,
}

/// Which limit refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitHit {
    Global,
    Org,
    Rate,
    Client,
    ClientRate,
}

impl LimitHit {
    pub fn describe(self) -> &'static str {
        match self {
            LimitHit::Global => "max_connections reached",
            LimitHit::Org => "max_connections_per_org reached",
            LimitHit::Rate => "max_new_connections_per_second_per_org exceeded",
            LimitHit::Client => "max_connections_per_client reached",
            LimitHit::ClientRate => "max_new_connections_per_second_per_client exceeded",
        }
    }
}

/// The key a source address is counted under: IPv4 (and IPv4-mapped IPv6)
/// as is, other IPv6 by its /64.
pub fn client_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
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
        self.take(key, now, false)
    }

    /// Take one token for `key` at `now` even when none is left, for what
    /// cannot be refused: the bucket goes into debt, down to one second's
    /// worth (`-rate`) at most, which later refills pay back before
    /// [`RateLimiter::allow`] succeeds again. With the table full of
    /// active keys a new key is not charged.
    pub fn charge(&self, key: &K, now: Instant) {
        self.take(key, now, true);
    }

    fn take(&self, key: &K, now: Instant, force: bool) -> bool {
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
            if force {
                bucket.tokens = (bucket.tokens - 1.0).max(-rate);
            }
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

/// Detail of a `limit_exceeded` for an allow refused because its org's
/// evidence budget is spent.
pub const EVIDENCE_BUDGET_EXHAUSTED: &str =
    "evidence budget spent: over [evidence] max_records_per_second_per_org for this org";

/// The evidence budget: decision records each org may cause per second,
/// proxy and DNS together (`[evidence] max_records_per_second_per_org`), a
/// token bucket per org with a burst of one second's worth. Clients of no
/// org share one bucket of the same size, never an org's.
///
/// | record | charged | over the budget |
/// |---|---|---|
/// | an allow decision (connection, absolute-form or intercepted request, DNS answer) | at the decision, before anything flows ([`EvidenceBudget::take`]) | refused `limit_exceeded` (detail [`EVIDENCE_BUDGET_EXHAUSTED`]); the refusal is summarised |
/// | a denial, a DNS refusal | when written ([`EvidenceBudget::take`]) | counted into a summary instead of written one by one |
/// | a summary | when written ([`EvidenceBudget::charge`]) | written anyway (the bucket goes into debt); an org's proxy summaries fold into one |
/// | a close record | never | (at most one per allow) |
///
/// So an org's one-by-one decision records in any `T` seconds are at most
/// `rate * (T + 1)`, whatever it floods with. (A tunnel allowed and then
/// denied on its first bytes pays twice: its allow at the decision, its
/// denial when written. Records of report-mode violations inside a
/// tunnel, which cannot be refused, are not charged.)
#[derive(Debug)]
pub struct EvidenceBudget {
    rate: usize,
    buckets: RateLimiter<Option<Arc<str>>>,
}

impl EvidenceBudget {
    /// `per_second` decision records per org (and for clients of no org).
    pub fn new(per_second: usize) -> EvidenceBudget {
        EvidenceBudget {
            rate: per_second.max(1),
            // Orgs come from the config, plus one key for no org.
            buckets: RateLimiter::new(per_second, 65_536),
        }
    }

    /// Take one record of `org`'s budget at `now`, if one is left.
    pub fn take(&self, org: &Option<Arc<str>>, now: Instant) -> bool {
        self.buckets.allow(org, now)
    }

    /// Charge one record that is written whatever the budget (a summary).
    pub fn charge(&self, org: &Option<Arc<str>>, now: Instant) {
        self.buckets.charge(org, now)
    }

    /// Records per second per org.
    pub fn rate(&self) -> usize {
        self.rate
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

/// What a connection is charged to besides the global cap.
#[derive(Debug)]
enum Charge {
    Org(Arc<str>, Arc<Slot>),
    // Read by nobody: held for its `Drop`, which frees the address's slot.
    Client(#[allow(dead_code)] Share<IpAddr>),
}

/// Units held per key, each key bounded (the bound given at each take);
/// a key has an entry only while it holds something.
#[derive(Debug)]
pub struct Shares<K> {
    table: Mutex<HashMap<K, usize>>,
}

/// Units of one key held; given back when dropped.
#[derive(Debug)]
pub struct Share<K: Hash + Eq + Clone> {
    shares: Arc<Shares<K>>,
    key: K,
    max: usize,
    held: usize,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    pub fn new() -> Arc<Self> {
        Arc::new(Shares {
            table: Mutex::new(HashMap::new()),
        })
    }

    /// `n` units of `key`, if that keeps it within `max`.
    pub fn take(self: &Arc<Self>, key: K, n: usize, max: usize) -> Option<Share<K>> {
        let mut share = Share {
            shares: self.clone(),
            key,
            max,
            held: 0,
        };
        share.grow(n).then_some(share)
    }

    /// Units `key` holds now.
    pub fn held(&self, key: &K) -> usize {
        let table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        table.get(key).copied().unwrap_or(0)
    }

    /// Keys holding anything.
    pub fn keys(&self) -> usize {
        self.table.lock().map_or(0, |t| t.len())
    }
}

impl<K: Hash + Eq + Clone> Share<K> {
    /// Hold `n` more units, if the key stays within its bound.
    pub fn grow(&mut self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let mut table = self.shares.table.lock().unwrap_or_else(|p| p.into_inner());
        let used = table.entry(self.key.clone()).or_insert(0);
        if *used + n > self.max {
            if *used == 0 {
                table.remove(&self.key);
            }
            return false;
        }
        *used += n;
        self.held += n;
        true
    }

    /// Give back `n` units.
    pub fn shrink(&mut self, n: usize) {
        let n = n.min(self.held);
        let mut table = self.shares.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(used) = table.get_mut(&self.key) {
            *used -= n.min(*used);
            if *used == 0 {
                table.remove(&self.key);
            }
        }
        self.held -= n;
    }

    /// Units this share holds.
    pub fn held(&self) -> usize {
        self.held
    }
}

impl<K: Hash + Eq + Clone> Drop for Share<K> {
    fn drop(&mut self) {
        if self.held > 0 {
            self.shrink(self.held);
        }
    }
}

/// Held for the life of one client connection; counted in
/// `palisade_active_connections` under the org it is charged to
/// (`unknown` while none).
#[derive(Debug)]
pub struct Permit {
    global: Arc<Slot>,
    charge: Mutex<(Charge, prometheus::IntGauge)>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.global.give_back();
        let charge = self.charge.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Charge::Org(_, slot) = &charge.0 {
            slot.give_back();
        }
        charge.1.dec();
    }
}

impl Permit {
    /// The org this connection is charged to, if any.
    pub fn org(&self) -> Option<Arc<str>> {
        match &self.charge.lock().unwrap_or_else(|p| p.into_inner()).0 {
            Charge::Org(name, _) => Some(name.clone()),
            Charge::Client(_) => None,
        }
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
            max_connections_per_client: max_per_client,
            max_new_connections_per_second_per_client: new_per_second_per_client,
            ..
        } = *limits;
        ConnLimits {
            global: Arc::new(Slot {
                used: AtomicUsize::new(0),
                max: max_global,
            }),
            max_per_org,
            per_org: Mutex::new(HashMap::new()),
            // Orgs come from the config: a small, bounded set.
            new_per_org: RateLimiter::new(new_per_second_per_org, 65_536),
            max_per_client,
            per_client: Shares::new(),
            // Full of addresses active this second, a new one is refused.
            new_per_client: RateLimiter::new(new_per_second_per_client, 65_536),
            active,
        }
    }

    fn org_slot(&self, name: &Arc<str>) -> Arc<Slot> {
        let mut map = self.per_org.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(name.clone())
            .or_insert_with(|| {
                Arc::new(Slot {
                    used: AtomicUsize::new(0),
                    max: self.max_per_org,
                })
            })
            .clone()
    }

    /// Take `org`'s rate token and cap slot.
    fn take_org(&self, name: &Arc<str>) -> Result<Arc<Slot>, LimitHit> {
        if !self.new_per_org.allow(name, Instant::now()) {
            return Err(LimitHit::Rate);
        }
        self.org_slot(name).try_take().ok_or(LimitHit::Org)
    }

    /// Take a slot of `client`'s address key, with its rate token.
    fn take_client(&self, client: IpAddr) -> Result<Share<IpAddr>, LimitHit> {
        let key = client_key(client);
        if !self.new_per_client.allow(&key, Instant::now()) {
            return Err(LimitHit::ClientRate);
        }
        self.per_client
            .take(key, 1, self.max_per_client)
            .ok_or(LimitHit::Client)
    }

    /// A permit at accept, if no cap or rate is exceeded: charged to `org`
    /// when the address names one, otherwise to the address `client`.
    pub fn try_acquire(&self, client: IpAddr, org: Option<&OrgRef>) -> Result<Permit, LimitHit> {
        let charge = match org {
            Some(o) => Charge::Org(o.name.clone(), self.take_org(&o.name)?),
            None => Charge::Client(self.take_client(client)?),
        };
        let Some(global) = self.global.try_take() else {
            if let Charge::Org(_, slot) = &charge {
                slot.give_back();
            }
            return Err(LimitHit::Global);
        };
        let active = self
            .active
            .with_label_values(&[crate::metrics::org_label(org)]);
        active.inc();
        Ok(Permit {
            global,
            charge: Mutex::new((charge, active)),
        })
    }

    /// Charge `permit` to `org`, the org it is decided for, once known.
    /// Nothing changes when it is already charged to `org`, or when `org`
    /// is none (the connection stays on what it holds). Otherwise `org`'s
    /// rate and cap are taken first, then what the permit held is released;
    /// over them, the permit keeps what it held.
    pub fn charge(&self, permit: &Permit, org: Option<&OrgRef>) -> Result<(), LimitHit> {
        let Some(org) = org else { return Ok(()) };
        let mut charge = permit.charge.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(&charge.0, Charge::Org(name, _) if *name == org.name) {
            return Ok(());
        }
        let slot = self.take_org(&org.name)?;
        let active = self.active.with_label_values(&[&org.name]);
        active.inc();
        let (old, old_active) =
            std::mem::replace(&mut *charge, (Charge::Org(org.name.clone(), slot), active));
        if let Charge::Org(_, slot) = old {
            slot.give_back();
        }
        old_active.dec();
        Ok(())
    }

    /// Connections currently held, all orgs together.
    pub fn in_use(&self) -> usize {
        self.global.used.load(Ordering::Relaxed)
    }

    /// Connections held by `client`'s address key while charged to no org.
    pub fn held_by_client(&self, client: IpAddr) -> usize {
        self.per_client.held(&client_key(client))
    }
}

/// Whose share of detection memory bytes held before a decision count in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Holder {
    Org(Arc<str>),
    /// A client of no org, by its address key ([`client_key`]).
    Client(IpAddr),
}

/// Detection memory (first bytes read and held before a decision), in
/// units of [`crate::proxy::tunnel::MAX_DETECT_BYTES`]: a global pool, a
/// share per org (`max_detect_memory_bytes_per_org`) and a small share per
/// address of no org (a sixty-fourth of the global), so that neither one
/// org nor one stranger can take the whole pool.
#[derive(Debug)]
pub struct DetectMemory {
    global: Semaphore,
    shares: Arc<Shares<Holder>>,
    per_org: usize,
    per_client: usize,
}

impl DetectMemory {
    /// The pools of `limits`.
    pub fn new(limits: &Limits) -> DetectMemory {
        let unit = crate::proxy::tunnel::MAX_DETECT_BYTES;
        let units = |bytes: usize| (bytes / unit).max(1);
        DetectMemory::with_units(
            units(limits.max_detect_memory_bytes),
            units(limits.max_detect_memory_bytes_per_org),
            units(limits.max_detect_memory_bytes / DETECT_MEMORY_CLIENT_SHARE),
        )
    }

    pub fn with_units(global: usize, per_org: usize, per_client: usize) -> DetectMemory {
        DetectMemory {
            global: Semaphore::new(global),
            shares: Shares::new(),
            per_org,
            per_client,
        }
    }

    /// Where a connection of `org` (or of none) from `client` is charged.
    pub fn scope(&self, org: Option<&OrgRef>, client: IpAddr) -> DetectScope<'_> {
        let (holder, max) = match org {
            Some(o) => (Holder::Org(o.name.clone()), self.per_org),
            None => (Holder::Client(client_key(client)), self.per_client),
        };
        DetectScope {
            memory: self,
            holder,
            max,
        }
    }

    /// Units free in the global pool.
    pub fn available(&self) -> usize {
        self.global.available_permits()
    }

    /// Units `holder` holds now.
    pub fn held_by(&self, holder: &Holder) -> usize {
        self.shares.held(holder)
    }
}

/// One holder's view of the detection memory.
#[derive(Debug, Clone)]
pub struct DetectScope<'a> {
    memory: &'a DetectMemory,
    holder: Holder,
    max: usize,
}

impl<'a> DetectScope<'a> {
    /// Nothing held yet; grow with [`DetectHold::cover`].
    pub fn hold(&self) -> DetectHold<'a> {
        DetectHold {
            scope: self.clone(),
            global: None,
            share: None,
        }
    }

    /// `units` held at once, or `None` over the global pool or the share.
    pub fn try_hold(&self, units: usize) -> Option<DetectHold<'a>> {
        let mut hold = self.hold();
        hold.cover(units).then_some(hold)
    }
}

/// Units held from the global pool and the holder's share; released on drop.
#[derive(Debug)]
pub struct DetectHold<'a> {
    scope: DetectScope<'a>,
    global: Option<SemaphorePermit<'a>>,
    share: Option<Share<Holder>>,
}

impl DetectHold<'_> {
    /// Hold `units` in all (more if needed); `false` if the global pool or
    /// the holder's share has no room (what was held stays held).
    pub fn cover(&mut self, units: usize) -> bool {
        let have = self.global.as_ref().map_or(0, |p| p.num_permits());
        if units <= have {
            return true;
        }
        let more = units - have;
        let share_ok =
            match &mut self.share {
                Some(share) => share.grow(more),
                None => match self.scope.memory.shares.take(
                    self.scope.holder.clone(),
                    more,
                    self.scope.max,
                ) {
                    Some(share) => {
                        self.share = Some(share);
                        true
                    }
                    None => false,
                },
            };
        if !share_ok {
            return false;
        }
        let Ok(taken) = self.scope.memory.global.try_acquire_many(more as u32) else {
            // Give the share back to what the global pool covers.
            if let Some(share) = &mut self.share {
                share.shrink(more);
            }
            return false;
        };
        match &mut self.global {
            Some(p) => p.merge(taken),
            None => self.global = Some(taken),
        }
        true
    }

    /// Give everything back.
    pub fn release(&mut self) {
        self.global = None;
        self.share = None;
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

    fn limits(l: Limits) -> (ConnLimits, prometheus::IntGaugeVec) {
        let active =
            prometheus::IntGaugeVec::new(prometheus::Opts::new("a", "a"), &["org"]).unwrap();
        (ConnLimits::new(&l, active.clone()), active)
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 2));
    const STRANGER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 9));

    #[test]
    fn caps_hold_and_release() {
        let (limits, active) = limits(Limits {
            max_connections: 3,
            max_connections_per_org: 2,
            max_new_connections_per_second_per_org: 1000,
            ..Limits::default()
        });
        let a = limits.try_acquire(A, Some(&org(0, "a"))).unwrap();
        let _b = limits.try_acquire(A, Some(&org(7, "a"))).unwrap();
        assert!(
            limits.try_acquire(A, Some(&org(0, "a"))).err() == Some(LimitHit::Org),
            "per-org cap, by name"
        );
        let _c = limits.try_acquire(B, Some(&org(0, "b"))).unwrap();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::Global),
            "global cap"
        );
        assert_eq!(limits.in_use(), 3);
        assert_eq!(active.with_label_values(&["a"]).get(), 2);
        assert_eq!(limits.held_by_client(STRANGER), 0, "refused: nothing held");
        drop(a);
        assert_eq!(active.with_label_values(&["a"]).get(), 1);
        assert!(limits.try_acquire(STRANGER, None).is_ok());
    }

    #[test]
    fn a_stranger_exhausts_only_its_own_address_budget() {
        let (limits, active) = limits(Limits {
            max_connections_per_client: 3,
            max_connections_per_org: 2,
            ..Limits::default()
        });
        let held: Vec<Permit> = (0..3)
            .map(|_| limits.try_acquire(STRANGER, None).unwrap())
            .collect();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::Client)
        );
        assert_eq!(limits.held_by_client(STRANGER), 3);
        assert_eq!(active.with_label_values(&["unknown"]).get(), 3);
        // A token client on another address: pre-auth on its own address,
        // then charged to its org, whose cap is untouched by the stranger.
        let token = org(1, "tok");
        let p = limits.try_acquire(A, None).unwrap();
        assert_eq!(limits.held_by_client(A), 1);
        limits.charge(&p, Some(&token)).unwrap();
        assert_eq!(limits.held_by_client(A), 0, "pre-auth slot released");
        assert_eq!(p.org().as_deref(), Some("tok"));
        assert_eq!(active.with_label_values(&["tok"]).get(), 1);
        assert_eq!(active.with_label_values(&["unknown"]).get(), 3);
        limits.charge(&p, Some(&token)).unwrap();
        let q = limits.try_acquire(A, None).unwrap();
        limits.charge(&q, Some(&token)).unwrap();
        // Over the org's cap: the connection keeps its pre-auth slot.
        let r = limits.try_acquire(A, None).unwrap();
        assert_eq!(limits.charge(&r, Some(&token)), Err(LimitHit::Org));
        assert_eq!(limits.held_by_client(A), 1);
        assert_eq!(r.org(), None);
        drop((p, q, r));
        assert_eq!(limits.held_by_client(A), 0);
        assert_eq!(active.with_label_values(&["tok"]).get(), 0);
        drop(held);
        assert_eq!(
            limits.held_by_client(STRANGER),
            0,
            "entries go with their slots"
        );
        assert_eq!(limits.per_client.keys(), 0);
        assert_eq!(limits.in_use(), 0);
    }

    #[test]
    fn a_stranger_spends_only_its_own_address_rate() {
        let (limits, _) = limits(Limits {
            max_new_connections_per_second_per_client: 2,
            ..Limits::default()
        });
        let _held: Vec<Permit> = (0..2)
            .map(|_| limits.try_acquire(STRANGER, None).unwrap())
            .collect();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::ClientRate)
        );
        assert!(limits.try_acquire(A, None).is_ok(), "another address");
    }

    #[test]
    fn ipv6_addresses_count_by_their_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_key(a), client_key(b));
        assert_ne!(client_key(a), client_key(c));
        let mapped: IpAddr = "::ffff:198.19.1.1".parse().unwrap();
        assert_eq!(client_key(mapped), A);
    }

    #[test]
    fn an_org_moves_its_connection_to_another_org() {
        let (limits, active) = limits(Limits::default());
        let p = limits.try_acquire(A, Some(&org(0, "addr"))).unwrap();
        limits.charge(&p, None).unwrap();
        assert_eq!(p.org().as_deref(), Some("addr"), "no org named: kept");
        limits.charge(&p, Some(&org(1, "tok"))).unwrap();
        assert_eq!(active.with_label_values(&["addr"]).get(), 0);
        assert_eq!(active.with_label_values(&["tok"]).get(), 1);
        drop(p);
        assert_eq!(active.with_label_values(&["tok"]).get(), 0);
        assert_eq!(limits.in_use(), 0);
    }

    #[test]
    fn detection_memory_is_shared_per_org_and_per_stranger_address() {
        let memory = DetectMemory::with_units(10, 4, 2);
        let (a, b) = (org(0, "a"), org(1, "b"));
        // One org takes its share, no more, and other orgs still get theirs.
        let mut hold_a = memory.scope(Some(&a), A).hold();
        assert!(hold_a.cover(4));
        assert!(!hold_a.cover(5), "org share");
        assert_eq!(memory.held_by(&Holder::Org("a".into())), 4, "kept");
        assert!(
            memory.scope(Some(&a), B).try_hold(1).is_none(),
            "share of the org, whatever the address"
        );
        let hold_b = memory.scope(Some(&b), B).try_hold(4).unwrap();
        // A stranger: its address's small share, never an org's.
        let s1 = memory.scope(None, STRANGER).try_hold(2).unwrap();
        assert!(memory.scope(None, STRANGER).try_hold(1).is_none());
        assert_eq!(memory.held_by(&Holder::Org("a".into())), 4);
        assert_eq!(memory.available(), 0);
        // The global pool bounds them all: nothing left for another address,
        // and a refusal by the pool leaves its share untouched.
        assert!(memory.scope(None, A).try_hold(1).is_none());
        assert_eq!(memory.held_by(&Holder::Client(A)), 0);
        drop((hold_b, s1));
        hold_a.release();
        assert_eq!(memory.available(), 10);
        assert_eq!(memory.shares.keys(), 0, "no entry outlives its holds");
    }

    #[test]
    fn charges_that_cannot_be_refused_go_into_bounded_debt() {
        let r = RateLimiter::new(4, 8);
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
    fn the_evidence_budget_bounds_each_org_on_its_own() {
        let budget = EvidenceBudget::new(100);
        let (acme, beta): (Option<Arc<str>>, Option<Arc<str>>) =
            (Some(Arc::from("acme")), Some(Arc::from("beta")));
        let t0 = Instant::now();
        // acme floods for ten seconds, ten attempts every 10 ms (a
        // thousand a second): it gets its burst plus its rate, no more.
        let mut taken = 0;
        for step in 0..1000u64 {
            let now = t0 + std::time::Duration::from_millis(step * 10);
            for _ in 0..10 {
                if budget.take(&acme, now) {
                    taken += 1;
                }
            }
        }
        let t_end = 9.99;
        assert!(taken as f64 <= 100.0 * (t_end + 1.0) + 1.0, "{taken}");
        assert!(taken >= 1000, "the rate is granted: {taken}");
        // beta and the clients of no org each have a budget of their own.
        let later = t0 + std::time::Duration::from_millis(9990);
        assert!(budget.take(&beta, later));
        assert!(budget.take(&None, later));
        assert!(!budget.take(&acme, later));
        // Summaries are charged: they push acme into debt, not beta.
        for _ in 0..50 {
            budget.charge(&acme, later);
        }
        assert!(!budget.take(&acme, later + std::time::Duration::from_millis(400)));
        assert!(budget.take(&beta, later));
        assert_eq!(budget.rate(), 100);
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
