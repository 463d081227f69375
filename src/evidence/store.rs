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
//! Free space is accounted per write ([`Space`]): the writer measures it
//! (statvfs) at most once a second, and every batch it writes in between
//! is taken off that measurement at once, so a flood cannot cross the
//! `min_free` margin between two measurements. None free at all is the
//! fullest case, never a reset.
//!
//! The close record an allowed connection (or forwarded request) owes is
//! **reserved** when its allow record is written ([`Owed`]): counted
//! against its org's share and against free space until the close is
//! written (or the connection ends without one). So an org holding many
//! open connections has their closes counted already, and closing them
//! all at once writes into room it was charged for, not into the margin
//! kept for the others.
//!
//! While it is full, a payer whose records (written and reserved) hold
//! more than its share of the retained window (the bytes attributed and
//! reserved, divided by the payers: every org and the clients of no org)
//! is **over its share**: the limits layer refuses its allows and
//! summarises its denials, so that the payer that filled the store is the
//! one that stops, not everyone. Segments that were on disk before this
//! start are read once too, so a restart does not forget whose records
//! fill the store, but not on the start's path ([`Store::found`]): they
//! are counted by a thread of their own from the first time the shares
//! are needed (the store is full, or the metrics are read), one segment
//! at a time; a store full already when the writer opens is counted
//! there and then.

use std::collections::VecDeque;

use foldhash::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Whose records: an org, or `None` for the clients of no org (who pays
/// for a connection is [`crate::limits::Payer`]; this is who owns records).
pub(crate) type Owner = Option<Arc<str>>;

/// The most a close record is longer than the allow record it closes,
/// besides the allow's id (which it names in `conn`): `bytes_up`,
/// `bytes_down` and `duration_ms` (at most 20 digits each), a response
/// `status`, and a detail of why a response did not come.
pub(super) const CLOSE_EXTRA: u64 = 320;

/// What to reserve for the close record of an allow whose line is
/// `allow_line` bytes long, with an id of `id` bytes.
pub(super) fn close_bound(allow_line: usize, id: usize) -> u64 {
    allow_line as u64 + id as u64 + CLOSE_EXTRA
}

/// Free space on the evidence file system as the writer accounts it: the
/// last measurement, less every byte written since. Pure: the writer
/// measures and reports its writes; reservations are passed in.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Space {
    /// Free bytes at the last measurement; `None` before the first (and
    /// with `durability = "discard"`, which writes nothing).
    measured: Option<u64>,
    /// `min_free` in bytes on this file system.
    min_free: u64,
    /// Bytes written since the measurement.
    written: u64,
}

impl Space {
    /// A measurement: `free` bytes free now, `min_free` to be kept.
    pub(crate) fn measure(&mut self, free: u64, min_free: u64) {
        self.measured = Some(free);
        self.min_free = min_free;
        self.written = 0;
    }

    /// `bytes` written since the last measurement.
    pub(crate) fn wrote(&mut self, bytes: u64) {
        self.written = self.written.saturating_add(bytes);
    }

    /// Free bytes once `reserved` more are written, as accounted; `None`
    /// before any measurement.
    pub(crate) fn left(&self, reserved: u64) -> Option<u64> {
        self.measured
            .map(|m| m.saturating_sub(self.written).saturating_sub(reserved))
    }

    /// Whether less than `min_free` is left once `reserved` more bytes are
    /// written. None left at all is the fullest case, whatever `min_free`.
    pub(crate) fn low(&self, reserved: u64) -> bool {
        self.left(reserved)
            .is_some_and(|left| left == 0 || left < self.min_free)
    }
}

/// Bytes of records attributed per payer over the segments on disk, and
/// reserved for the close records open connections owe.
#[derive(Debug, Default)]
struct Usage {
    by_payer: HashMap<Owner, u64>,
    attributed: u64,
    reserved: HashMap<Owner, u64>,
    reserved_total: u64,
    floor: bool,
    space: Space,
}

impl Usage {
    fn full(&self) -> bool {
        self.floor || self.space.low(self.reserved_total)
    }

    fn low_disk(&self) -> bool {
        self.space.low(self.reserved_total)
    }

    /// A payer's bytes, written and reserved.
    fn held(&self, payer: &Owner) -> u64 {
        self.by_payer.get(payer).copied().unwrap_or(0)
            + self.reserved.get(payer).copied().unwrap_or(0)
    }

    fn total(&self) -> u64 {
        self.attributed + self.reserved_total
    }
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
    /// The segments on disk before this start, counted off the start.
    found: Mutex<Found>,
}

/// The segments that were on disk at start ([`Store::found`]).
#[derive(Debug, Default)]
struct Found {
    /// Not counted yet, oldest first: name and path.
    pending: VecDeque<(String, PathBuf)>,
    /// Counted and still on disk: their bytes per payer, given back when
    /// retention removes them.
    counted: HashMap<String, HashMap<Owner, u64>>,
    /// Whether the counting thread was started.
    counting: bool,
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

    /// Lock order: `found`, then `usage`.
    fn found_lock(&self) -> MutexGuard<'_, Found> {
        self.found.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The segments `paths` were on disk at start: their records count in
    /// the shares once read ([`Store::count_found`]), which the start does
    /// not wait for.
    pub(super) fn found(&self, paths: Vec<PathBuf>) {
        let mut f = self.found_lock();
        for path in paths {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            f.pending.push_back((name.unwrap_or_default(), path));
        }
    }

    /// Count the segments found at start now, on this thread (a store
    /// full at start: its shares are needed at once).
    pub(super) fn count_found_now(&self) {
        while self.count_one() {}
    }

    /// Count the oldest segment found at start not counted yet; `false`
    /// once none is left.
    fn count_one(&self) -> bool {
        let Some((name, path)) = self.found_lock().pending.front().cloned() else {
            return false;
        };
        let held = super::segment::bytes_by_org(&path);
        let mut f = self.found_lock();
        // Not removed by retention meanwhile: it counts.
        if f.pending.front().is_some_and(|(n, _)| *n == name) {
            f.pending.pop_front();
            self.add(&held);
            f.counted.insert(name, held);
        }
        true
    }

    /// Start counting the segments found at start on a thread of their
    /// own, once (the shares are needed: the store is full, or the
    /// metrics are read). Until it is done, they count as far as read.
    pub(crate) fn count_found(self: &Arc<Self>) {
        {
            let mut f = self.found_lock();
            if f.counting || f.pending.is_empty() {
                return;
            }
            f.counting = true;
        }
        let store = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("evidence-count".into())
            .spawn(move || {
                while let Some(store) = store.upgrade() {
                    if !store.count_one() {
                        return;
                    }
                }
            });
        if spawned.is_err() {
            // No thread: counted here, late rather than never.
            self.count_found_now();
        }
    }

    /// The segment `name` was removed: if it was found at start, its
    /// records no longer count (or will not be counted).
    pub(super) fn forget_found(&self, name: &str) {
        let mut f = self.found_lock();
        f.pending.retain(|(n, _)| n != name);
        if let Some(held) = f.counted.remove(name) {
            self.remove(&held);
        }
    }

    /// Whether the store is full as `u` stands now.
    fn update(&self, u: &Usage) {
        self.full.store(u.full(), Ordering::Relaxed);
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
    pub(crate) fn over_share(self: &Arc<Self>, payer: &Owner) -> bool {
        if !self.is_full() {
            return false;
        }
        self.count_found();
        let payers = self.payers();
        let u = self.usage();
        over(u.held(payer), u.total(), payers)
    }

    /// Every payer holding records, the bytes of its records on disk and
    /// whether it is over its share now (metrics).
    pub(crate) fn shares(self: &Arc<Self>) -> Vec<(Owner, u64, bool)> {
        self.count_found();
        let full = self.is_full();
        let payers = self.payers();
        let u = self.usage();
        let mut v: Vec<(Owner, u64, bool)> = u
            .by_payer
            .iter()
            .map(|(p, b)| (p.clone(), *b, full && over(u.held(p), u.total(), payers)))
            .collect();
        v.sort();
        v
    }

    /// Records on disk: `bytes` of `payer`'s (segments found at start).
    pub(crate) fn add(&self, written: &HashMap<Owner, u64>) {
        if written.is_empty() {
            return;
        }
        let mut u = self.usage();
        attribute(&mut u, written);
    }

    /// `bytes` written to the evidence file system (every line: records,
    /// headers, checkpoints), taken off free space at once.
    pub(super) fn wrote(&self, bytes: u64) {
        let mut u = self.usage();
        u.space.wrote(bytes);
        self.update(&u);
    }

    /// Free space measured: `free` bytes, of which `min_free` are to be
    /// kept.
    pub(super) fn measure(&self, free: u64, min_free: u64) {
        let mut u = self.usage();
        u.space.measure(free, min_free);
        self.update(&u);
    }

    /// Whether free space, as accounted with what is reserved, is below
    /// `min_free` (or none is left).
    pub(crate) fn low_disk(&self) -> bool {
        self.usage().low_disk()
    }

    /// Free bytes as accounted (the last measurement less what was
    /// written since and what is reserved), if measured.
    pub(crate) fn free(&self) -> Option<u64> {
        let u = self.usage();
        u.space.left(u.reserved_total)
    }

    /// Bytes reserved for `payer` (tests).
    #[cfg(test)]
    pub(crate) fn reserved(&self, payer: &Owner) -> u64 {
        self.usage().reserved.get(payer).copied().unwrap_or(0)
    }

    /// Reserve `bytes` for a record `payer` owes.
    fn reserve(&self, payer: &Owner, bytes: u64) {
        let mut u = self.usage();
        *u.reserved.entry(payer.clone()).or_insert(0) += bytes;
        u.reserved_total += bytes;
        self.update(&u);
    }

    /// Give back a reservation of [`Store::reserve`].
    fn release(&self, payer: &Owner, bytes: u64) {
        let mut u = self.usage();
        if let Some(r) = u.reserved.get_mut(payer) {
            *r = r.saturating_sub(bytes);
            if *r == 0 {
                u.reserved.remove(payer);
            }
        }
        u.reserved_total = u.reserved_total.saturating_sub(bytes);
        self.update(&u);
    }

    /// A removed segment's records given back.
    pub(super) fn remove(&self, segment: &HashMap<Owner, u64>) {
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
        self.update(&u);
    }
}

fn attribute(u: &mut Usage, written: &HashMap<Owner, u64>) {
    for (p, b) in written {
        *u.by_payer.entry(p.clone()).or_insert(0) += b;
        u.attributed += b;
    }
}

/// Room reserved in the store for a record owed (an allowed connection's
/// close): counted against its payer's share and against free space until
/// dropped. The allow's record carries it to the connection, the
/// connection to its close record, the close record to the writer, which
/// drops it once the close is written; a connection that ends without a
/// close drops it then.
pub(crate) struct Owed {
    payer: Owner,
    bytes: u64,
    store: Arc<Store>,
}

impl Owed {
    /// Reserve `bytes` of `payer`'s in `store`.
    pub(super) fn reserve(store: &Arc<Store>, payer: &Owner, bytes: u64) -> Owed {
        store.reserve(payer, bytes);
        Owed {
            payer: payer.clone(),
            bytes,
            store: store.clone(),
        }
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        self.store.release(&self.payer, self.bytes);
    }
}

impl std::fmt::Debug for Owed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owed")
            .field("payer", &self.payer)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// `held` bytes of `total` are over one of `payers` equal shares.
fn over(held: u64, total: u64, payers: u64) -> bool {
    u128::from(held) * u128::from(payers) > u128::from(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(Option<&str>, u64)]) -> HashMap<Owner, u64> {
        entries
            .iter()
            .map(|(p, b)| (p.map(Arc::from), *b))
            .collect()
    }

    /// The segments found at start are not read until the shares are
    /// needed; then each counts once, and one removed first never does.
    #[test]
    fn segments_found_at_start_count_once_needed() {
        let dir = crate::testing::scratch("found");
        let line = |org: &str| format!("{{\"event\":\"decision\",\"org\":\"{org}\"}}\n");
        let (a, b) = (dir.join("palisade-1.jsonl"), dir.join("palisade-2.jsonl"));
        std::fs::write(&a, line("acme").repeat(10)).unwrap();
        std::fs::write(&b, line("beta")).unwrap();
        let store = Arc::new(Store::default());
        store.found(vec![a.clone(), b]);
        assert!(store.usage().by_payer.is_empty(), "nothing read at start");
        store.forget_found("palisade-2.jsonl");
        store.count_found_now();
        let acme: Owner = Some(Arc::from("acme"));
        let len = std::fs::metadata(&a).unwrap().len();
        assert_eq!(store.usage().by_payer.get(&acme), Some(&len));
        assert_eq!(
            store.usage().by_payer.len(),
            1,
            "the removed one never counts"
        );
        store.forget_found("palisade-1.jsonl");
        assert!(store.usage().by_payer.is_empty(), "given back when removed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_payer_over_its_share_of_a_full_store_is_over() {
        let store = Arc::new(Store::default());
        store.count_payers(|| 3);
        let (acme, beta): (Owner, Owner) = (Some(Arc::from("acme")), Some(Arc::from("beta")));
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
        store.measure(10, 100);
        assert!(store.is_full());
        store.add(&map(&[(Some("acme"), 1000)]));
        assert!(store.over_share(&acme));
        store.measure(1000, 100);
        assert!(!store.is_full() && !store.over_share(&acme));
    }

    #[test]
    fn free_space_is_the_measurement_less_what_was_written_and_reserved() {
        let mut space = Space::default();
        assert_eq!(space.left(0), None);
        assert!(!space.low(u64::MAX), "never measured: not low");
        space.measure(3000, 1000);
        assert_eq!(space.left(0), Some(3000));
        assert!(!space.low(0));
        // Writes between two measurements count at once.
        space.wrote(1500);
        assert_eq!(space.left(0), Some(1500));
        assert!(!space.low(0));
        assert!(space.low(501), "a reservation counts as written");
        space.wrote(501);
        assert!(space.low(0), "999 left of a margin of 1000");
        // More written than measured free: none left, the fullest case.
        space.wrote(10_000);
        assert_eq!(space.left(0), Some(0));
        assert!(space.low(0));
        // A new measurement replaces what was accounted.
        space.measure(5000, 1000);
        assert_eq!(space.left(0), Some(5000));
        assert!(!space.low(0));
        // None free is full, even with a margin of zero.
        space.measure(0, 0);
        assert!(space.low(0));
        space.measure(1, 0);
        assert!(!space.low(0));
    }

    #[test]
    fn a_full_disk_is_full_and_a_write_past_the_margin_makes_the_store_full_at_once() {
        let store = Arc::new(Store::default());
        store.count_payers(|| 3);
        let (acme, beta): (Owner, Owner) = (Some(Arc::from("acme")), Some(Arc::from("beta")));
        store.measure(4000, 1000);
        assert!(!store.is_full());
        // One batch of acme's takes it under the margin: full now, not at
        // the next measurement.
        store.add(&map(&[(Some("acme"), 3000), (Some("beta"), 100)]));
        store.wrote(3100);
        assert!(store.is_full());
        assert_eq!(store.free(), Some(900));
        assert!(store.over_share(&acme));
        assert!(!store.over_share(&beta));
        // A disk with no byte free is the fullest store, not a reset.
        store.measure(0, 1000);
        assert!(store.is_full() && store.low_disk());
        assert!(store.over_share(&acme));
        assert!(!store.over_share(&beta));
    }

    #[test]
    fn reserved_closes_count_against_the_share_and_free_space_until_dropped() {
        let live: Arc<crate::evidence::Live> = Arc::default();
        let store = live.store();
        store.count_payers(|| 3);
        let (acme, beta): (Owner, Owner) = (Some(Arc::from("acme")), Some(Arc::from("beta")));
        store.measure(10_000, 1000);
        store.add(&map(&[(Some("acme"), 500), (Some("beta"), 500)]));
        store.wrote(1000);
        // acme holds 2000 open connections' closes: 8000 bytes reserved.
        let owed: Vec<Owed> = (0..2000).map(|_| Owed::reserve(store, &acme, 4)).collect();
        assert_eq!(store.free(), Some(1000));
        assert!(!store.is_full(), "exactly the margin left");
        let one_more = Owed::reserve(store, &acme, 1);
        assert!(store.is_full(), "reserved closes fill the store");
        assert!(store.over_share(&acme), "8501 of 9001");
        assert!(!store.over_share(&beta));
        // The closes are written, each giving back its reservation: free
        // space as accounted does not move, and acme stays over.
        store.add(&map(&[(Some("acme"), 8001)]));
        store.wrote(8001);
        drop(owed);
        drop(one_more);
        assert_eq!(store.free(), Some(999));
        assert!(store.is_full());
        assert!(store.over_share(&acme));
        assert!(!store.over_share(&beta));
        // Everything given back: nothing reserved is left over.
        assert_eq!(store.usage().reserved_total, 0);
        assert!(store.usage().reserved.is_empty());
    }
}
