//! How full the evidence store is, and whose records fill it.
//!
//! The writer attributes the bytes of every record it writes to the
//! record's org (clients of no org count as one more), segment by segment,
//! and gives them back when retention removes a segment: [`Store`] holds
//! the totals over the segments on disk. It also says whether the store is
//! **full**: `retain_size` reached with no closed segment old enough to
//! remove (`retain_min_age`), or less free space on the evidence file
//! system than `min_free`.
//!
//! While it is full, a payer whose records hold more than its share of the
//! retained window (the bytes attributed, divided by the payers: every org
//! and the clients of no org) is **over its share**: the limits layer
//! refuses its allows and summarises its denials, so that the payer that
//! filled the store is the one that stops, not everyone. Segments that
//! were on disk before this start are read once when the writer opens, so
//! a restart does not forget whose records fill the store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Whose records: an org, or `None` for the clients of no org.
pub(crate) type Payer = Option<Arc<str>>;

/// Bytes of records attributed per payer over the segments on disk.
#[derive(Debug, Default)]
struct Usage {
    by_payer: HashMap<Payer, u64>,
    attributed: u64,
    floor: bool,
    low_disk: bool,
}

/// How many payers there are now (every org and the clients of no org).
type PayerCount = Box<dyn Fn() -> usize + Send + Sync>;

/// The store's fill, shared by the writer (which updates it) and the
/// limits layer and metrics (which read it).
#[derive(Default)]
pub(crate) struct Store {
    full: AtomicBool,
    usage: Mutex<Usage>,
    payers: OnceLock<PayerCount>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("full", &self.is_full())
            .finish_non_exhaustive()
    }
}

impl Store {
    fn usage(&self) -> MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tell the store how to count the payers (the served policy's orgs,
    /// plus one for the clients of no org); without, there are two.
    pub(crate) fn count_payers(&self, payers: impl Fn() -> usize + Send + Sync + 'static) {
        let _ = self.payers.set(Box::new(payers));
    }

    fn payers(&self) -> u64 {
        self.payers.get().map_or(2, |f| f()).max(1) as u64
    }

    /// Whether the store is full (cheap: one atomic load).
    pub(crate) fn is_full(&self) -> bool {
        self.full.load(Ordering::Relaxed)
    }

    /// Whether `payer`'s allows are refused: the store is full and its
    /// records hold more than its share of what is attributed.
    pub(crate) fn over_share(&self, payer: &Payer) -> bool {
        if !self.is_full() {
            return false;
        }
        let payers = self.payers();
        let u = self.usage();
        let held = u.by_payer.get(payer).copied().unwrap_or(0);
        over(held, u.attributed, payers)
    }

    /// Every payer holding records, its bytes and whether it is over its
    /// share now (metrics).
    pub(crate) fn shares(&self) -> Vec<(Payer, u64, bool)> {
        let full = self.is_full();
        let payers = self.payers();
        let u = self.usage();
        let mut v: Vec<(Payer, u64, bool)> = u
            .by_payer
            .iter()
            .map(|(p, b)| (p.clone(), *b, full && over(*b, u.attributed, payers)))
            .collect();
        v.sort();
        v
    }

    /// Records written: `bytes` of `payer`'s.
    pub(crate) fn add(&self, written: &HashMap<Payer, u64>) {
        if written.is_empty() {
            return;
        }
        let mut u = self.usage();
        for (p, b) in written {
            *u.by_payer.entry(p.clone()).or_insert(0) += b;
            u.attributed += b;
        }
    }

    /// A removed segment's records given back.
    pub(super) fn remove(&self, segment: &HashMap<Payer, u64>) {
        let mut u = self.usage();
        for (p, b) in segment {
            if let Some(held) = u.by_payer.get_mut(p) {
                *held = held.saturating_sub(*b);
                if *held == 0 {
                    u.by_payer.remove(p);
                }
            }
            u.attributed = u.attributed.saturating_sub(*b);
        }
    }

    /// Whether retention was stopped by the floor at its last pass.
    pub(crate) fn set_floor(&self, blocked: bool) {
        let mut u = self.usage();
        u.floor = blocked;
        self.full.store(u.floor || u.low_disk, Ordering::Relaxed);
    }

    /// Whether free space is below `min_free`.
    pub(super) fn set_low_disk(&self, low: bool) {
        let mut u = self.usage();
        u.low_disk = low;
        self.full.store(u.floor || u.low_disk, Ordering::Relaxed);
    }
}

/// `held` bytes of `total` are over one of `payers` equal shares.
fn over(held: u64, total: u64, payers: u64) -> bool {
    u128::from(held) * u128::from(payers) > u128::from(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(Option<&str>, u64)]) -> HashMap<Payer, u64> {
        entries
            .iter()
            .map(|(p, b)| (p.map(Arc::from), *b))
            .collect()
    }

    #[test]
    fn only_a_payer_over_its_share_of_a_full_store_is_over() {
        let store = Store::default();
        store.count_payers(|| 3);
        let (acme, beta): (Payer, Payer) = (Some(Arc::from("acme")), Some(Arc::from("beta")));
        store.add(&map(&[(Some("acme"), 900), (Some("beta"), 100)]));
        // Not full: nobody is over, however much it holds.
        assert!(!store.over_share(&acme));
        store.set_floor(true);
        assert!(store.is_full());
        // A third of 1000 each: acme holds 900.
        assert!(store.over_share(&acme));
        assert!(!store.over_share(&beta));
        assert!(!store.over_share(&None), "holds nothing");
        let shares = store.shares();
        assert_eq!(shares.len(), 2);
        assert!(shares.iter().any(|(p, b, o)| p == &acme && *b == 900 && *o));
        // Retention removes a segment holding most of acme's records.
        store.remove(&map(&[(Some("acme"), 850)]));
        assert!(!store.over_share(&acme), "50 of 150");
        store.set_floor(false);
        store.set_low_disk(true);
        assert!(store.is_full());
        store.add(&map(&[(Some("acme"), 1000)]));
        assert!(store.over_share(&acme));
        store.set_low_disk(false);
        assert!(!store.is_full() && !store.over_share(&acme));
    }
}
