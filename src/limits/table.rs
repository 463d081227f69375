//! One fair bounded table: entries held by orgs, in an order, with caps
//! per org and overall, and one eviction rule written once. The DNS
//! answer cache ([`crate::dns::cache`]), the TTL memo
//! ([`crate::dns::ttl`]), the name bindings and the synthetic addresses
//! ([`crate::handout`]) are held in it. The token buckets
//! ([`super::rate`]) and the idle upstream pool ([`crate::proxy::pool`])
//! are not: their doc comments say why, with the measure.
//!
//! Each entry has a key, a value, the org holding it and a place in the
//! table's order (an expiry, a last use, or `()` for "when it last moved":
//! the first place goes first; ties go in the order entries were inserted
//! or moved). Inserting past a cap evicts:
//!
//! - over `per_org`: the org's own first entry;
//! - over `total`: the first entry of an org if the caller says it is
//!   spent (expired), else the first entry of the org holding the most
//!   (ties: the org whose first entry is older). An org holding no more
//!   than any other is never evicted for another's sake.
//!
//! So an org flooding the table as fast as it can only ever evicts its own
//! entries once it holds the most: every org holding no more than its
//! fair share (`total` over the orgs present) keeps everything it holds.
//!
//! A pinned entry (an address with a connection open on it) is never
//! evicted, only removed; pins count, the entry is free again when the
//! last goes. An insert that pinned entries leave no room for is refused
//! ([`Full`]) and changes nothing.
//!
//! What is evicted or removed is handed back to the caller, key and value,
//! so a table with indexes of its own (addresses, names) drops them there:
//! that is the per-key hook. Pure: places are values the caller gives, no
//! clock is read.
//!
//! The order is kept per org only (one ordered index per org, no second
//! one for all orgs): "the first overall" is the least of the orgs' firsts,
//! which the eviction looks at anyway to find the org holding the most, so
//! every entry is indexed once and a one-org table (the memo, the buckets)
//! costs one map and one ordered index.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Where an entry stands: its place, then the sequence number of its
/// insert or last move.
type At<P> = (P, u64);

#[derive(Debug)]
struct Slot<O, V, P> {
    org: O,
    value: V,
    at: At<P>,
    /// Pins held on it: evictable at 0 only.
    pins: u32,
}

/// One org's part: its unpinned entries by place, and how many it holds
/// (pinned ones included).
#[derive(Debug)]
struct Held<P, K> {
    by_place: BTreeMap<At<P>, K>,
    n: usize,
}

/// A bounded map from `K` to `V`, each entry held by an org `O`, ordered
/// by `P` (see the module doc).
#[derive(Debug)]
pub(crate) struct FairTable<O, K, V, P> {
    entries: HashMap<K, Slot<O, V, P>>,
    orgs: HashMap<O, Held<P, K>>,
    /// Entries pinned now, all orgs together.
    pinned: usize,
    next_seq: u64,
    total: usize,
    per_org: usize,
}

/// The insert did not fit: every entry that could make room is pinned
/// (or the table holds nothing). Nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl<O, K, V, P> FairTable<O, K, V, P>
where
    O: Hash + Eq + Clone,
    K: Hash + Eq + Clone,
    P: Ord + Clone,
{
    /// At most `total` entries, `per_org` of one org (at least one, at
    /// most `total`). A total of 0 holds nothing.
    pub(crate) fn new(total: usize, per_org: usize) -> Self {
        FairTable {
            entries: HashMap::new(),
            orgs: HashMap::new(),
            pinned: 0,
            next_seq: 0,
            total,
            per_org: per_org.clamp(1, total.max(1)),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries `org` holds, pinned ones included.
    pub(crate) fn org_len(&self, org: &O) -> usize {
        self.orgs.get(org).map_or(0, |h| h.n)
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|s| &s.value)
    }

    /// The value of `key`, to change in place (its place stays).
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|s| &mut s.value)
    }

    /// The place and the value of `key` (or of what it borrows as), in
    /// one lookup.
    pub(crate) fn placed<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<(&P, &V)>
    where
        K: Borrow<Q>,
    {
        self.entries.get(key).map(|s| (&s.at.0, &s.value))
    }

    /// The first unpinned entry in the order, all orgs together: key and
    /// place.
    pub(crate) fn first(&self) -> Option<(&K, &P)> {
        self.orgs
            .values()
            .filter_map(|h| h.by_place.first_key_value())
            .min_by(|a, b| a.0.cmp(b.0))
            .map(|((p, _), k)| (k, p))
    }

    /// Take `key` out, pinned or not.
    pub(crate) fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let slot = self.entries.remove(key)?;
        if slot.pins > 0 {
            self.pinned -= 1;
        }
        if let Some(held) = self.orgs.get_mut(&slot.org) {
            if slot.pins == 0 {
                held.by_place.remove(&slot.at);
            }
            held.n -= 1;
            if held.n == 0 {
                self.orgs.remove(&slot.org);
            }
        }
        Some(slot.value)
    }

    /// Move `key` to `place` (a new expiry, a new last use), behind the
    /// entries already there.
    pub(crate) fn reorder(&mut self, key: &K, place: P) {
        self.reorder_with(key, place, |_| ());
    }

    /// [`FairTable::reorder`], changing the value with `f` first (one
    /// lookup for both).
    pub(crate) fn reorder_with(&mut self, key: &K, place: P, f: impl FnOnce(&mut V)) {
        let seq = self.seq();
        let Some(slot) = self.entries.get_mut(key) else {
            return;
        };
        f(&mut slot.value);
        let old = std::mem::replace(&mut slot.at, (place, seq));
        if slot.pins > 0 {
            return;
        }
        if let Some(held) = self.orgs.get_mut(&slot.org) {
            held.by_place.remove(&old);
            held.by_place.insert(slot.at.clone(), key.clone());
        }
    }

    /// Pin `key` once more: never evicted while a pin is held.
    pub(crate) fn pin(&mut self, key: &K) {
        let Some(slot) = self.entries.get_mut(key) else {
            return;
        };
        slot.pins = slot.pins.saturating_add(1);
        if slot.pins == 1 {
            self.pinned += 1;
            if let Some(held) = self.orgs.get_mut(&slot.org) {
                held.by_place.remove(&slot.at);
            }
        }
    }

    /// Release one pin of `key` (none held, or `key` gone: nothing).
    pub(crate) fn unpin(&mut self, key: &K) {
        let Some(slot) = self.entries.get_mut(key) else {
            return;
        };
        if slot.pins == 0 {
            return;
        }
        slot.pins -= 1;
        if slot.pins == 0 {
            self.pinned -= 1;
            if let Some(held) = self.orgs.get_mut(&slot.org) {
                held.by_place.insert(slot.at.clone(), key.clone());
            }
        }
    }

    /// Keep `value` for `key`, held by `org`, at `place`; what it replaces
    /// (the same key) goes first. Evicts by the module's rule, with
    /// `spent` saying whether an entry (place, value) may go before any
    /// org's share is weighed (expired). Returns what went, or [`Full`]
    /// when pinned entries leave no room (then nothing changed).
    pub(crate) fn insert(
        &mut self,
        org: O,
        key: K,
        value: V,
        place: P,
        spent: impl Fn(&P, &V) -> bool,
    ) -> Result<Vec<(K, V)>, Full> {
        let (old_pinned, old_pinned_here) = match self.entries.get(&key) {
            Some(s) if s.pins > 0 => (1, usize::from(s.org == org)),
            _ => (0, 0),
        };
        let unpinned_here = self.orgs.get(&org).map_or(0, |h| h.by_place.len());
        let pinned_here = self.org_len(&org) - unpinned_here - old_pinned_here;
        if self.total == 0 || pinned_here >= self.per_org || self.pinned - old_pinned >= self.total
        {
            return Err(Full);
        }
        let mut evicted = Vec::new();
        if let Some(old) = self.remove(&key) {
            evicted.push((key.clone(), old));
        }
        // Room is certain now: an org (the table) holding its cap (the
        // total) holds more than its pinned entries.
        while self.org_len(&org) >= self.per_org {
            let Some(k) = self.first_of(&org).cloned() else {
                break;
            };
            evicted.extend(self.take(k));
        }
        while self.entries.len() >= self.total {
            let Some(k) = self.victim(&spent) else {
                break;
            };
            evicted.extend(self.take(k));
        }
        let at = (place, self.seq());
        let held = self.orgs.entry(org.clone()).or_insert_with(|| Held {
            by_place: BTreeMap::new(),
            n: 0,
        });
        held.by_place.insert(at.clone(), key.clone());
        held.n += 1;
        self.entries.insert(
            key,
            Slot {
                org,
                value,
                at,
                pins: 0,
            },
        );
        Ok(evicted)
    }

    /// Remove the first unpinned entries (of `org`, or of all orgs) while
    /// `spent` says they may go (the expired ones, oldest first); at most
    /// `max`.
    pub(crate) fn sweep(
        &mut self,
        org: Option<&O>,
        max: usize,
        spent: impl Fn(&P, &V) -> bool,
    ) -> Vec<(K, V)> {
        let mut gone = Vec::new();
        while gone.len() < max {
            let first = match org {
                Some(o) => self.first_of(o),
                None => self.first().map(|(k, _)| k),
            };
            let Some(k) = first.cloned() else {
                break;
            };
            match self.entries.get(&k) {
                Some(s) if spent(&s.at.0, &s.value) => gone.extend(self.take(k)),
                _ => break,
            }
        }
        gone
    }

    /// Keep the entries `keep` accepts (org, key, place, value), pinned
    /// or not; returns those that went.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&O, &K, &P, &V) -> bool) -> Vec<(K, V)> {
        let drop: Vec<K> = self
            .entries
            .iter()
            .filter(|(k, s)| !keep(&s.org, k, &s.at.0, &s.value))
            .map(|(k, _)| k.clone())
            .collect();
        drop.into_iter().filter_map(|k| self.take(k)).collect()
    }

    /// Remove every entry.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.orgs.clear();
        self.pinned = 0;
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn take(&mut self, key: K) -> Option<(K, V)> {
        self.remove(&key).map(|v| (key, v))
    }

    fn first_of(&self, org: &O) -> Option<&K> {
        self.orgs
            .get(org)?
            .by_place
            .first_key_value()
            .map(|(_, k)| k)
    }

    /// The entry to evict when the table is full: the oldest of the orgs'
    /// first entries that is spent, else the first of the org holding the
    /// most (ties: the older first) that has an unpinned entry.
    fn victim(&self, spent: &impl Fn(&P, &V) -> bool) -> Option<K> {
        let mut oldest_spent: Option<(&At<P>, &K)> = None;
        let mut most: Option<(usize, &At<P>, &K)> = None;
        for held in self.orgs.values() {
            let Some((at, k)) = held.by_place.first_key_value() else {
                continue;
            };
            let is_spent = self
                .entries
                .get(k)
                .is_some_and(|s| spent(&s.at.0, &s.value));
            if is_spent && oldest_spent.is_none_or(|(a, _)| at < a) {
                oldest_spent = Some((at, k));
            }
            if most.is_none_or(|(n, a, _)| (held.n, Reverse(at)) > (n, Reverse(a))) {
                most = Some((held.n, at, k));
            }
        }
        oldest_spent
            .map(|(_, k)| k)
            .or(most.map(|(_, _, k)| k))
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type T = FairTable<&'static str, u32, char, u32>;

    fn never(_: &u32, _: &char) -> bool {
        false
    }

    fn keys(evicted: Result<Vec<(u32, char)>, Full>) -> Vec<u32> {
        evicted.unwrap().into_iter().map(|(k, _)| k).collect()
    }

    #[test]
    fn over_its_own_cap_an_org_evicts_its_own_first_entry() {
        let mut t = T::new(10, 2);
        assert!(keys(t.insert("a", 1, 'x', 5, never)).is_empty());
        assert!(keys(t.insert("a", 2, 'y', 3, never)).is_empty());
        assert!(keys(t.insert("b", 3, 'z', 1, never)).is_empty());
        // `a`'s first place is 3 (key 2), not `b`'s 1.
        assert_eq!(keys(t.insert("a", 4, 'w', 9, never)), [2]);
        assert_eq!((t.org_len(&"a"), t.org_len(&"b"), t.len()), (2, 1, 3));
        assert_eq!(t.get(&1), Some(&'x'));
    }

    #[test]
    fn when_full_the_org_holding_the_most_pays_not_the_small_one() {
        let mut t = T::new(4, 4);
        t.insert("small", 1, 's', 0, never).unwrap();
        for k in 10..13 {
            t.insert("big", k, 'b', k, never).unwrap();
        }
        // Full: the small org's entry is first overall, but big holds more.
        assert_eq!(keys(t.insert("new", 20, 'n', 1, never)), [10]);
        assert_eq!(keys(t.insert("new", 21, 'n', 2, never)), [11]);
        // big 1, small 1, new 2: new holds the most now, its first goes.
        assert_eq!(keys(t.insert("small", 2, 's', 3, never)), [20]);
        assert_eq!(
            (t.org_len(&"big"), t.org_len(&"new"), t.org_len(&"small")),
            (1, 1, 2)
        );
        assert_eq!(keys(t.insert("x", 30, 'x', 9, never)), [1]);
    }

    #[test]
    fn a_spent_first_place_goes_before_any_share_is_weighed() {
        let mut t = T::new(3, 3);
        t.insert("big", 1, 'b', 10, never).unwrap();
        t.insert("big", 2, 'b', 11, never).unwrap();
        t.insert("small", 3, 's', 1, never).unwrap();
        let expired = |p: &u32, _: &char| *p <= 5;
        assert_eq!(keys(t.insert("big", 4, 'b', 12, expired)), [3]);
        assert_eq!(t.sweep(None, 10, |p, _| *p <= 11), vec![(1, 'b'), (2, 'b')]);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn eviction_follows_the_order_and_reorder_moves_an_entry_back() {
        let mut t = T::new(3, 3);
        for k in 1..=3 {
            t.insert("a", k, 'a', 7, never).unwrap();
        }
        // Same place: insertion order.
        t.reorder(&1, 7);
        assert_eq!(t.first(), Some((&2, &7)));
        assert_eq!(keys(t.insert("a", 4, 'a', 8, never)), [2]);
        assert_eq!(keys(t.insert("a", 5, 'a', 0, never)), [3]);
        assert_eq!(t.placed(&5).map(|(p, _)| p), Some(&0));
        // Replacing a key evicts only its old value.
        assert_eq!(t.insert("a", 5, 'z', 9, never).unwrap(), vec![(5, 'a')]);
        assert_eq!(t.get(&5), Some(&'z'));
    }

    /// A table of two, both held by `a`: keys 1 and 2 at places 0 and 1.
    fn two_of_a() -> T {
        let mut t = T::new(2, 2);
        t.insert("a", 1, 'a', 0, never).unwrap();
        t.insert("a", 2, 'a', 1, never).unwrap();
        t
    }

    #[test]
    fn pinned_entries_are_never_evicted_and_a_table_of_them_refuses() {
        let mut t = two_of_a();
        t.pin(&1);
        assert_eq!(keys(t.insert("a", 3, 'a', 2, never)), [2]);
        t.pin(&3);
        assert_eq!(t.insert("a", 4, 'a', 3, never), Err(Full));
        assert_eq!(t.insert("b", 5, 'b', 3, |_, _| true), Err(Full));
        assert_eq!(t.len(), 2);
        // Unpinned, it goes again; removed, it is gone at once.
        t.unpin(&1);
        assert_eq!(keys(t.insert("b", 5, 'b', 3, never)), [1]);
        assert_eq!(t.remove(&3), Some('a'));
        assert_eq!((t.org_len(&"a"), t.len()), (0, 1));
    }

    #[test]
    fn a_zero_table_holds_nothing_and_clear_empties_it() {
        let mut t = T::new(0, 5);
        assert_eq!(t.insert("a", 1, 'a', 0, never), Err(Full));
        let mut t = T::new(2, 9);
        t.insert("a", 1, 'a', 0, never).unwrap();
        t.clear();
        assert_eq!((t.len(), t.org_len(&"a"), t.first()), (0, 0, None));
    }

    #[test]
    fn pins_count_and_a_stale_unpin_is_harmless() {
        let mut t = two_of_a();
        t.pin(&1);
        t.pin(&1);
        t.unpin(&1);
        // One pin still held: 2 goes, not 1.
        assert_eq!(keys(t.insert("a", 3, 'a', 2, never)), [2]);
        t.unpin(&1);
        t.unpin(&1);
        t.unpin(&99);
        assert_eq!(keys(t.insert("a", 4, 'a', 3, never)), [1]);
        // A refused insert changes nothing, the replaced key included.
        t.pin(&3);
        t.pin(&4);
        assert_eq!(t.insert("a", 5, 'a', 9, never), Err(Full));
        assert_eq!((t.len(), t.get(&3), t.get(&4)), (2, Some(&'a'), Some(&'a')));
        // Replacing a pinned key frees its own room.
        assert_eq!(t.insert("a", 4, 'z', 9, never).unwrap(), vec![(4, 'a')]);
    }

    #[test]
    fn sweep_of_one_org_and_retain() {
        let mut t = T::new(10, 10);
        for (org, k, p) in [("a", 1, 1), ("b", 2, 2), ("a", 3, 3), ("a", 4, 9)] {
            t.insert(org, k, 'x', p, never).unwrap();
        }
        assert_eq!(t.first(), Some((&1, &1)));
        let gone = t.sweep(Some(&"a"), 10, |p, _| *p <= 5);
        assert_eq!(gone, vec![(1, 'x'), (3, 'x')]);
        assert_eq!(t.first(), Some((&2, &2)));
        if let Some(v) = t.get_mut(&4) {
            *v = 'y';
        }
        let gone = t.retain(|org, _, _, v| *org == "b" || *v == 'x');
        assert_eq!((gone, t.len()), (vec![(4, 'y')], 1));
    }

    /// Pseudo-random places, so that no order of arrival is assumed.
    fn places(seed: u64) -> impl FnMut() -> u32 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            u32::try_from(x % 1_000_000).unwrap_or(0)
        }
    }

    type Flood = FairTable<u32, (u32, u32), (), u32>;

    #[test]
    fn a_flooding_org_never_takes_another_below_its_fair_share() {
        // 40 orgs hold 20 each in a table of 1000 with no cap per org
        // to speak of: the fair share with the flooder is 1000 / 41 = 24.
        let mut t = Flood::new(1000, 1000);
        let mut place = places(7);
        for org in 1..=40 {
            for k in 0..20 {
                t.insert(org, (org, k), (), place(), |_, _| false).unwrap();
            }
        }
        // The flooder inserts 30 times the table, with places before,
        // among and after everyone's.
        for k in 0..30_000u32 {
            let p = match k % 3 {
                0 => 0,
                1 => place(),
                _ => u32::MAX,
            };
            t.insert(0, (0, k), (), p, |_, _| false).unwrap();
            if k % 997 == 0 {
                assert!((1..=40).all(|org| t.org_len(&org) == 20), "at {k}");
            }
        }
        assert!((1..=40).all(|org| t.org_len(&org) == 20));
        assert_eq!((t.org_len(&0), t.len()), (200, 1000));
    }

    #[test]
    fn many_flooders_cut_everyone_to_the_fair_share_and_no_lower() {
        // 10 orgs fill the table, then 5 more flood it in turn: every org
        // ends with at least 1000 / 15 = 66, whatever the places.
        let mut t = Flood::new(1000, 1000);
        let mut place = places(11);
        for org in 0..10 {
            for k in 0..100 {
                t.insert(org, (org, k), (), place(), |_, _| false).unwrap();
            }
        }
        for k in 0..10_000u32 {
            let org = 10 + k % 5;
            t.insert(org, (org, 1000 + k), (), place(), |_, _| false)
                .unwrap();
            let least = (0..10).map(|o| t.org_len(&o)).min().unwrap_or(0);
            assert!(least >= 1000 / 15, "at {k}: {least}");
        }
        // The flooders too: each came when others held more.
        for org in 0..15 {
            assert!(t.org_len(&org) >= 66, "{org}: {}", t.org_len(&org));
        }
    }

    #[test]
    fn a_flooder_pinning_all_it_holds_stops_at_its_own_cap() {
        let mut t = Flood::new(1000, 100);
        for org in 1..=10 {
            for k in 0..20 {
                t.insert(org, (org, k), (), 5, |_, _| false).unwrap();
            }
        }
        let mut refused = 0;
        for k in 0..10_000u32 {
            match t.insert(0, (0, k), (), 0, |_, _| true) {
                Ok(_) => t.pin(&(0, k)),
                Err(Full) => refused += 1,
            }
        }
        assert_eq!((t.org_len(&0), refused), (100, 9_900));
        assert!((1..=10).all(|org| t.org_len(&org) == 20));
    }
}
