//! One fair bounded table: entries held by orgs, in an order, with caps
//! per org and overall, and one eviction rule written once.
//!
//! Each entry has a key, a value, the org holding it and a place in the
//! table's order (an expiry, a last use: the first place goes first; ties
//! go in insertion order). Inserting past a cap evicts:
//!
//! - over `per_org`: the org's own first entry;
//! - over `total`: the first entry overall if the caller says its place
//!   is spent (expired), else the first entry of the org holding the most
//!   (ties: the least org). An org holding no more than any other is never
//!   evicted for another's sake.
//!
//! A pinned entry is never evicted (only removed); an org whose entries are
//! all pinned evicts nothing and its insert is refused. Pure: places are
//! values the caller gives, no clock is read.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Where an entry stands: its place, then its insertion sequence.
type At<P> = (P, u64);

#[derive(Debug)]
struct Slot<O, V, P> {
    org: O,
    value: V,
    at: At<P>,
    pinned: bool,
}

/// A bounded map from `K` to `V`, each entry held by an org `O`, ordered
/// by `P` (see the module doc).
#[derive(Debug)]
pub(crate) struct FairTable<O, K, V, P> {
    entries: HashMap<K, Slot<O, V, P>>,
    /// Every unpinned entry by place: the first goes first.
    order: BTreeMap<At<P>, K>,
    /// Per org, its unpinned entries by place, and how many it holds.
    orgs: HashMap<O, (BTreeMap<At<P>, K>, usize)>,
    next_seq: u64,
    total: usize,
    per_org: usize,
}

/// The insert did not fit: every entry that could make room is pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full;

impl<O, K, V, P> FairTable<O, K, V, P>
where
    O: Hash + Eq + Ord + Clone,
    K: Hash + Eq + Clone,
    P: Ord + Clone,
{
    /// At most `total` entries, `per_org` of one org (at least one, at
    /// most `total`). A total of 0 holds nothing.
    pub(crate) fn new(total: usize, per_org: usize) -> Self {
        FairTable {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            orgs: HashMap::new(),
            next_seq: 0,
            total,
            per_org: per_org.clamp(1, total.max(1)),
        }
    }

    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for the tables still to come onto it")
    )]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries `org` holds.
    pub(crate) fn org_len(&self, org: &O) -> usize {
        self.orgs.get(org).map_or(0, |(_, n)| *n)
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|s| &s.value)
    }

    /// The place of `key`.
    pub(crate) fn place(&self, key: &K) -> Option<&P> {
        self.entries.get(key).map(|s| &s.at.0)
    }

    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for the tables still to come onto it")
    )]
    /// The first entry (unpinned) in the order: key and place.
    pub(crate) fn first(&self) -> Option<(&K, &P)> {
        self.order.first_key_value().map(|((p, _), k)| (k, p))
    }

    /// Take `key` out, pinned or not.
    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let slot = self.entries.remove(key)?;
        if !slot.pinned {
            self.order.remove(&slot.at);
        }
        if let Some((by_place, n)) = self.orgs.get_mut(&slot.org) {
            if !slot.pinned {
                by_place.remove(&slot.at);
            }
            *n -= 1;
            if *n == 0 {
                self.orgs.remove(&slot.org);
            }
        }
        Some(slot.value)
    }

    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for the tables still to come onto it")
    )]
    /// Move `key` to `place` (a new expiry, a new last use), behind the
    /// entries already there.
    pub(crate) fn reorder(&mut self, key: &K, place: P) {
        let seq = self.seq();
        let Some(slot) = self.entries.get_mut(key) else {
            return;
        };
        let old = std::mem::replace(&mut slot.at, (place, seq));
        if slot.pinned {
            return;
        }
        self.order.remove(&old);
        self.order.insert(slot.at.clone(), key.clone());
        if let Some((by_place, _)) = self.orgs.get_mut(&slot.org) {
            by_place.remove(&old);
            by_place.insert(slot.at.clone(), key.clone());
        }
    }

    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for the tables still to come onto it")
    )]
    /// Pin `key` (never evicted) or unpin it.
    pub(crate) fn pin(&mut self, key: &K, pinned: bool) {
        let Some(slot) = self.entries.get_mut(key) else {
            return;
        };
        if slot.pinned == pinned {
            return;
        }
        slot.pinned = pinned;
        let by_place = self.orgs.get_mut(&slot.org).map(|(b, _)| b);
        if pinned {
            self.order.remove(&slot.at);
            if let Some(b) = by_place {
                b.remove(&slot.at);
            }
        } else {
            self.order.insert(slot.at.clone(), key.clone());
            if let Some(b) = by_place {
                b.insert(slot.at.clone(), key.clone());
            }
        }
    }

    /// Keep `value` for `key`, held by `org`, at `place`; what it replaces
    /// (the same key) goes first. Evicts by the module's rule, with
    /// `spent` saying whether the first place overall may go before any
    /// org's share is considered (expired). Returns what was evicted, or
    /// [`Full`] when pinned entries leave no room: `key` is then not held
    /// (what was evicted on the way stays evicted).
    pub(crate) fn insert(
        &mut self,
        org: O,
        key: K,
        value: V,
        place: P,
        spent: impl Fn(&P) -> bool,
    ) -> Result<Vec<(K, V)>, Full> {
        if self.total == 0 {
            return Err(Full);
        }
        let mut evicted = Vec::new();
        if let Some(old) = self.remove(&key) {
            evicted.push((key.clone(), old));
        }
        while self.org_len(&org) >= self.per_org {
            let Some(k) = self.first_of(&org) else {
                return Err(Full);
            };
            evicted.extend(self.take(k));
        }
        while self.entries.len() >= self.total {
            let Some(k) = self.victim(&spent) else {
                return Err(Full);
            };
            evicted.extend(self.take(k));
        }
        let at = (place, self.seq());
        self.order.insert(at.clone(), key.clone());
        let (by_place, n) = self.orgs.entry(org.clone()).or_default();
        by_place.insert(at.clone(), key.clone());
        *n += 1;
        self.entries.insert(
            key,
            Slot {
                org,
                value,
                at,
                pinned: false,
            },
        );
        Ok(evicted)
    }

    /// Remove the first entries overall while `spent` says their place is
    /// (the expired ones, oldest first); at most `max`.
    pub(crate) fn sweep(&mut self, max: usize, spent: impl Fn(&P) -> bool) -> Vec<(K, V)> {
        let mut gone = Vec::new();
        while gone.len() < max {
            match self.order.first_key_value() {
                Some(((p, _), k)) if spent(p) => {
                    let k = k.clone();
                    gone.extend(self.take(k));
                }
                _ => break,
            }
        }
        gone
    }

    /// Remove every entry.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.orgs.clear();
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn take(&mut self, key: K) -> Option<(K, V)> {
        self.remove(&key).map(|v| (key, v))
    }

    fn first_of(&self, org: &O) -> Option<K> {
        let (by_place, _) = self.orgs.get(org)?;
        by_place.first_key_value().map(|(_, k)| k.clone())
    }

    /// The entry to evict when the table is full: the first overall if its
    /// place is spent, else the first of the org holding the most that
    /// has an unpinned entry.
    fn victim(&self, spent: &impl Fn(&P) -> bool) -> Option<K> {
        if let Some(((p, _), k)) = self.order.first_key_value() {
            if spent(p) {
                return Some(k.clone());
            }
        }
        let (org, _) = self
            .orgs
            .iter()
            .filter(|(_, (by_place, _))| !by_place.is_empty())
            .max_by_key(|(org, (_, n))| (*n, std::cmp::Reverse(*org)))?;
        self.first_of(org)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type T = FairTable<&'static str, u32, char, u32>;

    fn never(_: &u32) -> bool {
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
        let expired = |p: &u32| *p <= 5;
        assert_eq!(keys(t.insert("big", 4, 'b', 12, expired)), [3]);
        assert_eq!(t.sweep(10, |p| *p <= 11), vec![(1, 'b'), (2, 'b')]);
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
        assert_eq!(t.place(&5), Some(&0));
        // Replacing a key evicts only its old value.
        assert_eq!(t.insert("a", 5, 'z', 9, never).unwrap(), vec![(5, 'a')]);
        assert_eq!(t.get(&5), Some(&'z'));
    }

    #[test]
    fn pinned_entries_are_never_evicted_and_a_table_of_them_refuses() {
        let mut t = T::new(2, 2);
        t.insert("a", 1, 'a', 0, never).unwrap();
        t.insert("a", 2, 'a', 1, never).unwrap();
        t.pin(&1, true);
        assert_eq!(keys(t.insert("a", 3, 'a', 2, never)), [2]);
        t.pin(&3, true);
        assert_eq!(t.insert("a", 4, 'a', 3, never), Err(Full));
        assert_eq!(t.insert("b", 5, 'b', 3, |_| true), Err(Full));
        assert_eq!(t.len(), 2);
        // Unpinned, it goes again; removed, it is gone at once.
        t.pin(&1, false);
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
}
