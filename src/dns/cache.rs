//! Answers to allowed names, kept per (org, name, type) so that a repeated
//! query skips the decision, the resolver and the answer filter.
//!
//! What is kept is what the full path produced for one org under one
//! served version: the verdict, the filtered answers with their TTLs (as
//! [`super::ttl`] fixed them), what evidence records about them and the
//! addresses to bind. A hit hands back exactly that, so the answer and the
//! record are those the full path would give; everything done per query
//! (budgets, the record written before the answer, bindings, metrics) is
//! still done per query by the caller.
//!
//! - **Version**: entries belong to one served version (the `Arc` the
//!   caller passes, compared by identity). A reload swaps it, and the first
//!   query that sees the new one empties the cache: a name the new policy
//!   denies is refused at once.
//! - **Orgs**: the org is part of the key; one org's entry is never
//!   another's answer (its first query goes the full path, its own TTLs and
//!   record).
//! - **Expiry**: an entry lives until its answer would have changed on the
//!   full path (the resolver's cache entry or the TTL memo expires,
//!   whichever is first), never past the caller's bound.
//! - **Bounds**: at most `per_org` entries per org (over it, that org's own
//!   soonest-expiring entry goes) and `capacity` in all (when full, an
//!   expired entry goes first, else the soonest-expiring entry of the org
//!   holding the most).
//!
//! Pure: no clock, the caller passes `now`.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hickory_server::proto::rr::RecordType;

use super::filter::Forwarded;
use super::wire::{Question, Wire};
use crate::limits::table::FairTable;
use crate::metrics::DnsSeries;

/// Entries kept at most, all orgs together.
pub(crate) const CACHE_CAPACITY: usize = 16_384;
/// Entries kept at most for one org.
pub(crate) const CACHE_PER_ORG: usize = 4_096;

/// Responses kept on the wire per entry: one per query shape and
/// transport seen, this many at most (a client asks in one or two shapes).
pub(crate) const WIRES_PER_ENTRY: usize = 2;
/// Longest response kept on the wire (the largest UDP answer we send).
pub(crate) const MAX_WIRE: usize = 1232;

/// One question of one org: the org's index in the served policy, the
/// query name in lower case on the wire, the query type.
#[derive(Debug, Clone)]
pub(crate) struct Key {
    pub org: usize,
    pub name: Box<[u8]>,
    pub qtype: RecordType,
}

/// A [`Key`] over a name that is not its own: what a hit is looked up
/// with, without copying the name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyRef<'a> {
    pub org: usize,
    pub name: &'a [u8],
    pub qtype: RecordType,
}

/// A key's parts, owned or borrowed: both hash and compare by them alone,
/// so either finds the same entry.
pub(crate) trait Parts {
    fn parts(&self) -> (usize, &[u8], RecordType);
}

impl Parts for Key {
    fn parts(&self) -> (usize, &[u8], RecordType) {
        (self.org, &self.name, self.qtype)
    }
}

impl Parts for KeyRef<'_> {
    fn parts(&self) -> (usize, &[u8], RecordType) {
        (self.org, self.name, self.qtype)
    }
}

impl Hash for dyn Parts + '_ {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.parts().hash(h);
    }
}

impl PartialEq for dyn Parts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn Parts + '_ {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self as &dyn Parts).hash(h);
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for Key {}

impl<'a> Borrow<dyn Parts + 'a> for Key {
    fn borrow(&self) -> &(dyn Parts + 'a) {
        self
    }
}

/// What the shim keeps per entry: what forwarding made of the query, when
/// (the answer's TTLs count down from then), and the responses encoded
/// from it so far ([`Wire`]), which go with the entry.
#[derive(Debug)]
pub(crate) struct Kept {
    pub fwd: Forwarded,
    pub since: Instant,
    wires: Mutex<Vec<Wire>>,
    /// When its addresses were last bound, in nanoseconds after `since`,
    /// plus one (0: never), and the bindings' epoch read just before: see
    /// [`Kept::bind_due`].
    bound: AtomicU64,
    bound_epoch: AtomicU64,
    /// Its queries' series of `palisade_dns_queries_total`, once counted.
    pub series: OnceLock<DnsSeries>,
}

/// How long the bindings made for a kept answer cover the answers given
/// after it without being made again: they are made for this much longer
/// than an answer's own binding lasts, and again once it has passed.
pub(crate) const BIND_REFRESH: Duration = Duration::from_secs(1);

impl Kept {
    pub(crate) fn new(fwd: Forwarded, since: Instant) -> Kept {
        Kept {
            fwd,
            since,
            wires: Mutex::new(Vec::new()),
            bound: AtomicU64::new(0),
            bound_epoch: AtomicU64::new(0),
            series: OnceLock::new(),
        }
    }

    /// Whether this answer's addresses are to be bound (again) at `now`,
    /// the bindings' epoch ([`Bindings::epoch`]) being `epoch`: yes the
    /// first time, once [`BIND_REFRESH`] has passed since they last were,
    /// and whenever a binding left the table since (it may have been one
    /// of these); each binding is then made for `BIND_REFRESH` longer than
    /// an answer's own. No in between: the bindings made last are all
    /// held and last at least as long as this answer's own would. Callers
    /// that race past the refresh all bind (none answers before its own
    /// bindings are made); the one that moves the mark on keeps its epoch.
    ///
    /// [`Bindings::epoch`]: crate::handout::bindings::Bindings::epoch
    pub(crate) fn bind_due(&self, now: Instant, epoch: u64) -> bool {
        let at = u64::try_from(now.saturating_duration_since(self.since).as_nanos())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1);
        let last = self.bound.load(Ordering::Acquire);
        let refresh = u64::try_from(BIND_REFRESH.as_nanos()).unwrap_or(u64::MAX);
        if last != 0
            && at.saturating_sub(last) < refresh
            && self.bound_epoch.load(Ordering::Acquire) == epoch
        {
            return false;
        }
        if self
            .bound
            .compare_exchange(last, at, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.bound_epoch.store(epoch, Ordering::Release);
        }
        true
    }

    /// Whole seconds since it was kept, at `now`: what its TTLs count down by.
    pub(crate) fn age(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.since).as_secs()).unwrap_or(u32::MAX)
    }

    fn wires(&self) -> std::sync::MutexGuard<'_, Vec<Wire>> {
        self.wires.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The response to `q` from one kept for its shape and transport, its
    /// TTLs `age` seconds less.
    pub(crate) fn wire_answer(&self, q: &Question<'_>, tcp: bool, age: u32) -> Option<Vec<u8>> {
        let wires = self.wires();
        let wire = wires.iter().find(|w| w.shape == q.shape && w.tcp == tcp)?;
        wire.answer(q, age)
    }

    /// Keep `wire` for its shape and transport, within the bounds.
    pub(crate) fn keep_wire(&self, wire: Wire) {
        let mut wires = self.wires();
        if wire.size() <= MAX_WIRE
            && wires.len() < WIRES_PER_ENTRY
            && !wires
                .iter()
                .any(|w| w.shape == wire.shape && w.tcp == wire.tcp)
        {
            wires.push(wire);
        }
    }
}

#[derive(Debug)]
struct Inner<V, A> {
    version: Option<Arc<V>>,
    /// The entries by expiry: the first expires soonest.
    table: FairTable<usize, Key, Arc<A>, Instant>,
}

/// The answer cache: `V` is the served version, `A` what is kept.
#[derive(Debug)]
pub(crate) struct AnswerCache<V, A> {
    inner: Mutex<Inner<V, A>>,
    capacity: usize,
    hits: AtomicU64,
}

impl<V, A> Default for AnswerCache<V, A> {
    fn default() -> Self {
        AnswerCache::new(CACHE_CAPACITY, CACHE_PER_ORG)
    }
}

impl<V, A> AnswerCache<V, A> {
    /// A cache of at most `capacity` entries, `per_org` of one org. A
    /// capacity of 0 keeps nothing (every query takes the full path).
    pub(crate) fn new(capacity: usize, per_org: usize) -> AnswerCache<V, A> {
        AnswerCache {
            inner: Mutex::new(Inner {
                version: None,
                table: FairTable::new(capacity, per_org),
            }),
            capacity,
            hits: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<V, A>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adopt `version`: entries of any other version are dropped.
    fn adopt(inner: &mut Inner<V, A>, version: &Arc<V>) {
        if !inner
            .version
            .as_ref()
            .is_some_and(|v| Arc::ptr_eq(v, version))
        {
            inner.table.clear();
            inner.version = Some(version.clone());
        }
    }

    /// The answer kept for `key` under `version`, if it has not expired at `now`.
    pub(crate) fn get(&self, version: &Arc<V>, key: &dyn Parts, now: Instant) -> Option<Arc<A>> {
        if self.capacity == 0 {
            return None;
        }
        let mut inner = self.lock();
        Self::adopt(&mut inner, version);
        // One lookup for a hit; an expired entry costs a second (its removal).
        let (until, value) = inner.table.placed(key)?;
        if until <= &now {
            inner.table.remove(key);
            return None;
        }
        let value = value.clone();
        drop(inner);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(value)
    }

    /// Keep `value` for `key` under `version` until `until`.
    pub(crate) fn insert(
        &self,
        version: &Arc<V>,
        key: Key,
        value: Arc<A>,
        until: Instant,
        now: Instant,
    ) {
        if self.capacity == 0 || until <= now {
            return;
        }
        let mut inner = self.lock();
        Self::adopt(&mut inner, version);
        // This org's own entries first, then everyone's: an expired entry,
        // else the soonest-expiring of the org holding the most.
        let org = key.org;
        let _ = inner.table.insert(org, key, value, until, |u, _| *u <= now);
    }

    /// Entries kept (expired ones included until they are found or evicted).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().table.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries kept for `org`.
    #[cfg(test)]
    pub(crate) fn org_len(&self, org: usize) -> usize {
        self.lock().table.org_len(&org)
    }

    /// Answers handed out from the cache so far.
    #[cfg(test)]
    pub(crate) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_server::proto::rr::{LowerName, Name};
    use hickory_server::proto::serialize::binary::BinEncodable;
    use std::time::Duration;

    const SEC: Duration = Duration::from_secs(1);

    fn key(org: usize, name: &str, qtype: RecordType) -> Key {
        Key {
            org,
            name: LowerName::new(&Name::from_ascii(name).unwrap())
                .to_bytes()
                .unwrap()
                .into(),
            qtype,
        }
    }

    #[test]
    fn keyed_by_org_name_type_and_version() {
        let cache: AnswerCache<u32, &str> = AnswerCache::default();
        let (v1, v2) = (Arc::new(1), Arc::new(1));
        let t0 = Instant::now();
        let k = key(0, "allowed.test.", RecordType::A);
        cache.insert(&v1, k.clone(), Arc::new("a"), t0 + 60 * SEC, t0);
        assert_eq!(cache.get(&v1, &k, t0).as_deref(), Some(&"a"));
        // The name as received, any case, is the same question.
        let upper = key(0, "ALLOWED.Test.", RecordType::A);
        assert_eq!(cache.get(&v1, &upper, t0).as_deref(), Some(&"a"));
        // Another org, another type, another name: not this entry.
        assert!(cache
            .get(&v1, &key(1, "allowed.test.", RecordType::A), t0)
            .is_none());
        assert!(cache
            .get(&v1, &key(0, "allowed.test.", RecordType::AAAA), t0)
            .is_none());
        assert!(cache
            .get(&v1, &key(0, "x.allowed.test.", RecordType::A), t0)
            .is_none());
        assert_eq!(cache.hits(), 2);
        // Another served version (even an equal value): nothing kept.
        assert!(cache.get(&v2, &k, t0).is_none());
        assert!(cache.is_empty());
        assert!(cache.get(&v1, &k, t0).is_none());
    }

    /// A borrowed key finds the entry its owned twin made, and only that
    /// one; an expired entry found by it goes.
    #[test]
    fn a_borrowed_key_is_the_same_key() {
        let cache: AnswerCache<u32, &str> = AnswerCache::default();
        let v = Arc::new(1);
        let t0 = Instant::now();
        let k = key(2, "allowed.test.", RecordType::AAAA);
        cache.insert(&v, k.clone(), Arc::new("a"), t0 + SEC, t0);
        let at = |org, name: &'static [u8], qtype| KeyRef { org, name, qtype };
        let name: &[u8] = b"\x07allowed\x04test\x00";
        assert_eq!(&*k.name, name);
        assert_eq!(
            cache.get(&v, &at(2, name, RecordType::AAAA), t0).as_deref(),
            Some(&"a")
        );
        for other in [
            at(1, name, RecordType::AAAA),
            at(2, name, RecordType::A),
            at(2, b"\x07allowed\x04test", RecordType::AAAA),
            at(2, b"\x07allowee\x04test\x00", RecordType::AAAA),
        ] {
            assert!(cache.get(&v, &other, t0).is_none(), "{other:?}");
        }
        assert!(cache
            .get(&v, &at(2, name, RecordType::AAAA), t0 + SEC)
            .is_none());
        assert!(cache.is_empty());
    }

    #[test]
    fn expires() {
        let cache: AnswerCache<(), u8> = AnswerCache::default();
        let v = Arc::new(());
        let t0 = Instant::now();
        let k = key(0, "a.test.", RecordType::A);
        cache.insert(&v, k.clone(), Arc::new(1), t0 + 30 * SEC, t0);
        assert!(cache.get(&v, &k, t0 + 29 * SEC).is_some());
        assert!(cache.get(&v, &k, t0 + 30 * SEC).is_none());
        assert!(cache.is_empty());
        // Nothing is kept that has already expired.
        cache.insert(&v, k.clone(), Arc::new(1), t0, t0);
        assert!(cache.is_empty());
    }

    #[test]
    fn bounded_per_org_and_in_all() {
        let cache: AnswerCache<(), usize> = AnswerCache::new(8, 5);
        let v = Arc::new(());
        let t0 = Instant::now();
        // One org alone cannot take more than its share...
        for i in 0..100 {
            let k = key(0, &format!("n{i}.test."), RecordType::A);
            cache.insert(&v, k, Arc::new(i), t0 + SEC * (100 + i as u32), t0);
        }
        assert_eq!(cache.org_len(0), 5);
        // ...and what it keeps is what lives longest.
        let last = key(0, "n99.test.", RecordType::A);
        assert_eq!(cache.get(&v, &last, t0).as_deref(), Some(&99));
        assert!(cache
            .get(&v, &key(0, "n0.test.", RecordType::A), t0)
            .is_none());
        // Other orgs fill the rest; when full, the org holding the most pays.
        for org in 1..4 {
            let k = key(org, "shared.test.", RecordType::A);
            cache.insert(&v, k, Arc::new(org), t0 + 10 * SEC, t0);
        }
        assert_eq!(cache.len(), 8);
        let k = key(4, "shared.test.", RecordType::A);
        cache.insert(&v, k.clone(), Arc::new(4), t0 + 10 * SEC, t0);
        assert_eq!(cache.len(), 8);
        assert_eq!(cache.org_len(0), 4);
        assert!(cache.get(&v, &k, t0).is_some());
        // An expired entry goes before anyone's live one.
        let t1 = t0 + 20 * SEC;
        let k5 = key(5, "late.test.", RecordType::A);
        cache.insert(&v, k5.clone(), Arc::new(5), t1 + 10 * SEC, t1);
        assert_eq!(cache.org_len(0), 4);
        assert!(cache.get(&v, &k5, t1).is_some());
    }

    #[test]
    fn zero_capacity_keeps_nothing() {
        let cache: AnswerCache<(), u8> = AnswerCache::new(0, 0);
        let v = Arc::new(());
        let t0 = Instant::now();
        let k = key(0, "a.test.", RecordType::A);
        cache.insert(&v, k.clone(), Arc::new(1), t0 + SEC, t0);
        assert!(cache.get(&v, &k, t0).is_none());
    }

    #[test]
    fn a_kept_answer_binds_again_after_the_refresh_or_once_a_binding_left() {
        let fwd = crate::dns::filter::Forwarded::new(
            crate::policy::Verdict {
                org: None,
                reason: crate::policy::Reason::RuleMatch,
                rule: None,
                would_deny: None,
            },
            "a.test".into(),
            crate::dns::filter::Filtered::failed(
                hickory_server::proto::op::ResponseCode::NoError,
                None,
            ),
        );
        let t0 = Instant::now();
        let kept = Kept::new(fwd, t0);
        assert!(kept.bind_due(t0, 7), "the first answer binds");
        assert!(!kept.bind_due(t0, 7), "covered: no binding left");
        let almost = t0 + BIND_REFRESH - Duration::from_millis(1);
        assert!(!kept.bind_due(almost, 7));
        assert!(kept.bind_due(almost, 8), "a binding left: bind again");
        assert!(!kept.bind_due(almost, 8));
        let later = almost + BIND_REFRESH;
        assert!(kept.bind_due(later, 8), "the refresh is due");
        assert!(!kept.bind_due(later, 8));
    }
}
