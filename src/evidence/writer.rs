//! Group commit on the callers' own threads.
//!
//! A caller serialises its record ([`Prepared`]), appends it to the pending
//! batch and tries to become the leader: the first to find the log free
//! takes every pending record, chains them, writes them with one `write(2)`
//! (and one `fdatasync` with `durability = "fsync"`), checkpoints, rotates
//! and retains segments as due, then wakes the callers of that batch. A
//! caller that finds a leader at work waits for its batch to be written or
//! for the log to be free again, whichever comes first. With the log
//! healthy no record waits for another thread. While decisions come in
//! bursts, a caller lets the tasks ready on its runtime run once before it
//! tries to lead ([`Log::join_tick`]): on a runtime with one worker, where no
//! caller finds a leader at work, that is what makes a batch of the
//! decisions of one tick.
//!
//! A record nobody waits on (a close record, a refusal summary: anything
//! submitted) does not cost a write of its own: it rides the next batch a
//! `write` caller leads, and if none comes within `RIDE_LAG` of the oldest
//! such record the duties thread writes it. Records a `write` caller waits
//! on (decisions) are written at once, by their callers.
//!
//! The riding costs no wake-up per record: the first record to ride after
//! a quiet spell wakes the duties thread once; from then on it looks by
//! itself, when the oldest record riding is due, until it finds none. It
//! writes only records that waited their whole `RIDE_LAG`, and never a
//! batch someone waits on: that batch's caller leads it (and takes what
//! rides along), so no decision is written on the duties thread and handed
//! back across threads.
//!
//! With `fsync`, a batch nobody waits on (submitted records only) is
//! written without a sync: the next synced batch's `fdatasync` covers it,
//! and the duties thread syncs it at the latest `SYNC_LAG` later. Records a
//! `write` caller waits on are always synced before the caller goes on.
//!
//! A small duties thread does what time asks for: a checkpoint
//! `checkpoint_interval` after the first unsigned record, rotation by age,
//! retries after a write error, a lagging sync, and records nobody is left
//! to write (records that ride, within `RIDE_LAG`). It leads like
//! anyone else.
//!
//! Failure handling keeps the chain consistent: a batch that fails is cut
//! off the file again (`ftruncate` to the last good length) and never
//! counted; `write` callers in it get an error (their connection is denied),
//! submitted records are kept and written first once writing works again,
//! after an `outage` record saying how many writes failed since when. If the
//! file cannot be cut back, the leader moves to a new segment whose header
//! says how many lines of the old one belong to the chain.
//!
//! Lock order: `io` before `pending`; `io` before the duties' lock. Nothing
//! takes `io` while holding another of them, and `io` is only ever waited
//! for by the duties thread, `seal` and `abandon`: callers only try it.

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant, SystemTime};

use data_encoding::HEXLOWER;
use ed25519_dalek::SigningKey;
use serde_json::{Map, Value};
use tokio::sync::Notify;
use tracing::{error, info, warn};

use super::chain::{self, Prepared, GENESIS};
use super::merkle::{self, Frontier, OrgTrees};
use super::note;
use super::retention::{self, Listed};
use super::segment::{self, Tail};
use super::store::{Owed, Owner};
use crate::config::{Durability, EvidenceConfig};

/// Records appended with a place reserved (`write`, `submit_within`, and
/// `submit` while there is room) before `write` callers (and accept loops)
/// wait for room.
pub(super) const QUEUE_CAPACITY: usize = 8192;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Longest a submitted record waits for a `write` caller's batch to ride
/// before the duties thread writes it.
pub(super) const RIDE_LAG: Duration = Duration::from_millis(5);
/// One `write` call in this many yields before it leads even when the
/// last batch carried one decision only ([`Log::join_tick`]).
const PROBE: u64 = 16;
/// How long the duties thread sleeps when nothing is due.
const IDLE: Duration = Duration::from_secs(3600);
/// `fsync`: longest a written record nobody waits on stays unsynced.
const SYNC_LAG: Duration = Duration::from_millis(100);
/// How often free space on the evidence file system is measured while
/// records are written; every write in between is taken off the last
/// measurement at once ([`super::store::Space`]).
const DISK_CHECK: Duration = Duration::from_secs(1);

/// One record waiting to be written.
pub(super) struct Entry {
    pub line: Prepared,
    /// Whose record it is, for the store's shares ([`super::store`]).
    pub org: Owner,
    /// A `write` caller waits for this record's batch.
    pub acked: bool,
    /// It holds a place in the queue's capacity.
    pub permit: bool,
    /// The room reserved for it (a close record), given back once it is
    /// written.
    pub owed: Option<Arc<Owed>>,
}

const OPEN: u8 = 0;
const WRITTEN: u8 = 1;
const FAILED: u8 = 2;

/// What the `write` callers of one batch wait on.
pub(super) struct Batch {
    outcome: AtomicU8,
    notify: Notify,
}

impl Batch {
    fn new() -> Arc<Batch> {
        Arc::new(Batch {
            outcome: AtomicU8::new(OPEN),
            notify: Notify::new(),
        })
    }

    /// Whether the batch was written, once it is decided.
    fn outcome(&self) -> Option<bool> {
        match self.outcome.load(Ordering::Acquire) {
            OPEN => None,
            o => Some(o == WRITTEN),
        }
    }

    fn decide(&self, written: bool) {
        let o = if written { WRITTEN } else { FAILED };
        self.outcome.store(o, Ordering::Release);
        self.notify.notify_waiters();
    }
}

/// Records appended and not yet taken by a leader.
struct Pending {
    entries: Vec<Entry>,
    /// The batch `entries` will be written in.
    batch: Arc<Batch>,
    /// Entries whose caller waits.
    acked: usize,
    /// Since when the oldest entry nobody waits on rides.
    riding_since: Option<Instant>,
    /// Take nothing (tests that simulate a writer stuck in a slow write).
    paused: bool,
    /// Sealed or abandoned: nothing more is appended.
    closed: bool,
}

impl Pending {
    fn add(&mut self, entry: Entry) {
        self.acked += usize::from(entry.acked);
        if !entry.acked && self.riding_since.is_none() {
            self.riding_since = Some(Instant::now());
        }
        self.entries.push(entry);
    }
}

/// Record ids: the replica, a per-start prefix and a counter.
pub(super) struct Ids {
    prefix: String,
    next: AtomicU64,
}

impl Ids {
    /// `REPLICA-START-N`: unique across replicas and restarts.
    pub(super) fn new(replica: &str, start: Duration) -> Ids {
        Ids {
            prefix: format!(
                "{replica}-{:x}{:05x}",
                start.as_secs(),
                start.subsec_micros()
            ),
            next: AtomicU64::new(0),
        }
    }

    pub(super) fn next(&self) -> String {
        let mut digits = [0u8; 20];
        let n = chain::decimal(self.next.fetch_add(1, Ordering::Relaxed), &mut digits);
        let mut id = String::with_capacity(self.prefix.len() + 1 + n.len());
        id.push_str(&self.prefix);
        id.push('-');
        id.extend(n.iter().map(|&d| char::from(d)));
        id
    }
}

pub(super) fn now_ts() -> String {
    super::ts::rfc3339_micros(SystemTime::now())
}

/// What leaders share with the callers.
pub(super) struct Common {
    pub healthy: AtomicBool,
    pub ids: Ids,
    pub counters: Arc<super::live::Live>,
    duties: Duties,
}

/// Wakes the duties thread.
struct Duties {
    state: Mutex<DutyState>,
    cv: Condvar,
    /// The duties thread knows that records ride: it looks again when the
    /// oldest is due, and whoever submits needs not wake it.
    riding: AtomicBool,
    /// Tests: wake-ups for records that ride.
    #[cfg(test)]
    ride_wakes: AtomicU64,
    /// Tests: batches the duties thread wrote for records that rode.
    #[cfg(test)]
    ride_writes: AtomicU64,
}

#[derive(Default)]
struct DutyState {
    poked: bool,
    stop: bool,
    /// Records ride and the duties thread did not know.
    ride: bool,
}

impl Duties {
    fn lock(&self) -> MutexGuard<'_, DutyState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn poke(&self) {
        self.lock().poked = true;
        self.cv.notify_one();
    }

    fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_one();
    }

    /// Records ride: wake the duties thread unless it knows already (one
    /// wake-up per spell of riding, however many records ride).
    fn ride(&self) {
        if self.riding.load(Ordering::Acquire) || self.riding.swap(true, Ordering::AcqRel) {
            return;
        }
        self.lock().ride = true;
        self.cv.notify_one();
        #[cfg(test)]
        self.ride_wakes.fetch_add(1, Ordering::Relaxed);
    }
}

/// The log: pending records, and the leader's state.
pub(super) struct Log {
    pending: Mutex<Pending>,
    io: Mutex<Io>,
    pub common: Common,
    /// Places in the queue's capacity.
    pub slots: tokio::sync::Semaphore,
    /// Sealed or abandoned.
    pub closed: AtomicBool,
    fsync: bool,
    /// The last batch a `write` caller waited on carried more than one
    /// such record: decisions come in bursts, and a caller yields before
    /// it leads ([`Log::join_tick`]).
    company: AtomicBool,
    /// `write` calls so far, for the one in `PROBE` that yields anyway.
    calls: AtomicU64,
}

impl Log {
    pub(super) fn new(io: Io, ids: Ids, counters: Arc<super::live::Live>) -> Log {
        let fsync = io.cfg.durability == Durability::Fsync;
        Log {
            pending: Mutex::new(Pending {
                entries: Vec::new(),
                batch: Batch::new(),
                acked: 0,
                riding_since: None,
                paused: false,
                closed: false,
            }),
            io: Mutex::new(io),
            common: Common {
                healthy: AtomicBool::new(true),
                ids,
                counters,
                duties: Duties {
                    state: Mutex::new(DutyState::default()),
                    cv: Condvar::new(),
                    riding: AtomicBool::new(false),
                    #[cfg(test)]
                    ride_wakes: AtomicU64::new(0),
                    #[cfg(test)]
                    ride_writes: AtomicU64::new(0),
                },
            },
            slots: tokio::sync::Semaphore::new(QUEUE_CAPACITY),
            closed: AtomicBool::new(false),
            fsync,
            company: AtomicBool::new(true),
            calls: AtomicU64::new(0),
        }
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn io(&self) -> MutexGuard<'_, Io> {
        self.io.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn try_io(&self) -> Option<MutexGuard<'_, Io>> {
        match self.io.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Let go of the log without leading: a caller that tried to lead
    /// while it was held here found it busy and waits on its batch for a
    /// wake-up, which only a leader's hand-over ([`Log::pass_on`]) gave.
    /// Wake the callers of the pending batch, so that one leads it.
    fn release(&self, io: MutexGuard<'_, Io>) {
        drop(io);
        let batch = {
            let p = self.pending();
            (p.acked > 0).then(|| p.batch.clone())
        };
        if let Some(b) = batch {
            b.notify.notify_waiters();
        }
    }

    /// Hold the log as the duties thread does between its writes (tests).
    #[cfg(test)]
    pub(super) fn hold(&self) -> impl Drop + '_ {
        self.io()
    }

    /// Add a record to the pending batch; the batch it will be written in,
    /// or the entry back if the log is closed.
    pub(super) fn append(&self, entry: Entry) -> Result<Arc<Batch>, Entry> {
        let mut p = self.pending();
        if p.closed {
            return Err(entry);
        }
        p.add(entry);
        self.common.counters.set_queue_depth(p.entries.len());
        Ok(p.batch.clone())
    }

    /// Add records to the pending batch at once, so that one batch holds
    /// them all; that batch, or the entries back if the log is closed.
    pub(super) fn append_all(&self, entries: Vec<Entry>) -> Result<Arc<Batch>, Vec<Entry>> {
        let mut p = self.pending();
        if p.closed {
            return Err(entries);
        }
        for entry in entries {
            p.add(entry);
        }
        self.common.counters.set_queue_depth(p.entries.len());
        Ok(p.batch.clone())
    }

    /// Run `f`, which may `fdatasync`, where blocking is allowed: in
    /// `fsync` mode on a multi-threaded runtime's worker the worker's other
    /// tasks move elsewhere meanwhile (`block_in_place`). Measured
    /// (benches/evidence.rs) against syncing on the worker itself: within
    /// 5% in CPU per record, and a slow disk's sync then holds up no
    /// connection's task but the writers'.
    fn blocking<R>(&self, f: impl FnOnce() -> R) -> R {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let multi = Handle::try_current()
            .is_ok_and(|h| matches!(h.runtime_flavor(), RuntimeFlavor::MultiThread));
        if self.fsync && multi {
            tokio::task::block_in_place(f)
        } else {
            f()
        }
    }

    /// Leave what was submitted to ride the next batch a `write` caller
    /// leads, or the duties thread's `RIDE_LAG` after the oldest record
    /// riding. With the queue full, lead now instead: its places come back
    /// only with a write.
    pub(super) fn ride(&self) {
        if self.slots.available_permits() == 0 {
            self.try_lead();
        } else {
            self.common.duties.ride();
        }
    }

    /// Write what is pending if no leader is at work; whether this call led.
    pub(super) fn try_lead(&self) -> bool {
        match self.try_io() {
            Some(io) => {
                self.lead(io);
                true
            }
            None => false,
        }
    }

    /// Before a `write` caller waits on its batch: the batch of a runtime
    /// tick. The tasks ready to run now go first (a yield waits until the
    /// runtime has polled every ready task and its I/O), so those that
    /// decide a record meanwhile append it to this batch, and one write
    /// takes them all. A runtime with one worker never finds a leader at
    /// work: without this, each record paid a write of its own however
    /// many tunnels opened at once. Only while decisions come in bursts
    /// (and once in `PROBE` calls, to notice when they start to): a
    /// decision alone (a tunnel at a time) would pay a trip through the
    /// event loop for nothing.
    pub(super) async fn join_tick(&self) {
        let probe = self.calls.fetch_add(1, Ordering::Relaxed) % PROBE == 0;
        if probe || self.company.load(Ordering::Relaxed) {
            tokio::task::yield_now().await;
        }
    }

    /// Wait until `batch` is written (`true`) or refused (`false`), leading
    /// whenever the log is free.
    pub(super) async fn wait(&self, batch: &Batch) -> bool {
        loop {
            let notified = batch.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(written) = batch.outcome() {
                return written;
            }
            // Leading writes the batch, unless the log is paused.
            if self.try_lead() {
                if let Some(written) = batch.outcome() {
                    return written;
                }
            }
            notified.await;
        }
    }

    /// As leader: write the pending batch, then hand over: `write`
    /// callers that came meanwhile are woken to lead themselves; records
    /// nobody waits on ride their batch, or the duties thread's.
    fn lead(&self, mut io: MutexGuard<'_, Io>) {
        self.commit(&mut io, None);
        drop(io);
        self.pass_on();
    }

    /// Write one record a caller waits on at once, on the caller's thread:
    /// when the log is free (no leader at work) and taking records,
    /// `entry()` (called with the log held, so nothing else is written
    /// meanwhile) is appended and written with whatever else is pending,
    /// and the outcome is whether it was written. `None`, and `entry`
    /// never called: a leader is at work, or the log is paused or closed;
    /// the caller waits as [`Log::wait`] does instead. With one record in
    /// flight this is [`Log::append`], [`Log::try_lead`] and
    /// [`Log::wait`] without the batch's wake-up or a trip through the
    /// caller's runtime.
    pub(super) fn write_now<E>(
        &self,
        entry: impl FnOnce() -> Result<Entry, E>,
    ) -> Option<Result<bool, E>> {
        let mut io = self.try_io()?;
        if self.pending().paused || self.closed.load(Ordering::Relaxed) {
            return None;
        }
        let entry = match entry() {
            Ok(e) => e,
            Err(e) => return Some(Err(e)),
        };
        let taken = {
            let mut p = self.pending();
            if p.closed || p.paused {
                // Raced with the seal (or a test's pause): refused, as a
                // write after the seal is.
                drop(p);
                if entry.permit {
                    self.slots.add_permits(1);
                }
                return Some(Ok(false));
            }
            if p.entries.is_empty() {
                Err(entry)
            } else {
                p.add(entry);
                Ok(self.take(&mut p))
            }
        };
        let written = match taken {
            Ok(taken) => self.write_taken(&mut io, taken, None),
            // Nothing else pending: nobody waits on a batch but this
            // caller, so none is made; the entry goes in the writer's
            // kept batch of one.
            Err(entry) => {
                let mut one = std::mem::take(&mut io.one);
                one.push(entry);
                let written = self.write_entries(&mut io, &mut one, None);
                io.one = one;
                written
            }
        };
        drop(io);
        self.pass_on();
        Some(Ok(written))
    }

    /// After a leader's write: `write` callers that came meanwhile are
    /// woken to lead themselves; records nobody waits on ride their batch,
    /// or the duties thread's.
    fn pass_on(&self) {
        let batch = {
            let p = self.pending();
            if p.entries.is_empty() || p.paused || p.closed {
                return;
            }
            (p.acked > 0).then(|| p.batch.clone())
        };
        match batch {
            // Its callers wait on it: the first to wake leads.
            Some(b) => b.notify.notify_waiters(),
            None => self.ride(),
        }
    }

    /// Take the pending batch and write it (with the seal when `finish`).
    /// Returns whether what was written was written.
    fn commit(&self, io: &mut Io, finish: Option<&str>) -> bool {
        let taken = {
            let mut p = self.pending();
            if p.closed && finish.is_none() {
                return false;
            }
            if p.paused && finish.is_none() {
                return true;
            }
            self.take(&mut p)
        };
        self.write_taken(io, taken, finish)
    }

    /// Take the pending batch (its entries and what their callers wait on).
    fn take(&self, p: &mut Pending) -> (Vec<Entry>, Arc<Batch>) {
        p.acked = 0;
        p.riding_since = None;
        let batch = std::mem::replace(&mut p.batch, Batch::new());
        let entries = std::mem::take(&mut p.entries);
        self.common.counters.set_queue_depth(0);
        (entries, batch)
    }

    /// Write a batch taken from the pending one and tell its callers.
    fn write_taken(
        &self,
        io: &mut Io,
        (mut entries, batch): (Vec<Entry>, Arc<Batch>),
        finish: Option<&str>,
    ) -> bool {
        let written = self.write_entries(io, &mut entries, finish);
        batch.decide(written);
        written
    }

    /// Write `entries` (left empty) as one batch, giving back their
    /// places in the queue. Returns whether they were written.
    fn write_entries(&self, io: &mut Io, entries: &mut Vec<Entry>, finish: Option<&str>) -> bool {
        let permits = entries.iter().filter(|e| e.permit).count();
        if permits > 0 {
            self.slots.add_permits(permits);
        }
        let acked = entries.iter().filter(|e| e.acked).count();
        if acked > 0 {
            self.company.store(acked > 1, Ordering::Relaxed);
        }
        // `fsync`: only what someone waits on is synced at once (a `write`,
        // the seal); submitted records reach the OS now and the disk with
        // the next sync, at the latest SYNC_LAG later.
        let sync =
            self.fsync && (finish.is_some() || entries.iter().any(|e| e.acked) || io.sync_due());
        if sync {
            self.blocking(|| io.step(&self.common, entries, finish, true))
        } else {
            io.step(&self.common, entries, finish, false)
        }
    }

    /// Stop taking records. With `seal`, write everything pending and a
    /// final signed `seal` record first (returns whether it was written);
    /// without, drop what is pending as a crash would (its `write` callers
    /// get an error). Idempotent: a second call returns `false`.
    pub(super) fn close(&self, seal: bool) -> bool {
        {
            let mut p = self.pending();
            if p.closed {
                return false;
            }
            p.closed = true;
        }
        // Waits for a leader at work; not moved off a runtime worker, as
        // this also runs when `Evidence` is dropped, where that may not be
        // allowed. Shutdown may block a worker for one write.
        let mut io = self.io();
        let sealed = if seal {
            let sealed = self.commit(&mut io, Some("seal"));
            if !sealed {
                error!("could not seal the evidence chain");
            }
            sealed
        } else {
            let (entries, batch) = {
                let mut p = self.pending();
                p.acked = 0;
                p.riding_since = None;
                let batch = std::mem::replace(&mut p.batch, Batch::new());
                (std::mem::take(&mut p.entries), batch)
            };
            let permits = entries.iter().filter(|e| e.permit).count();
            self.slots.add_permits(permits);
            batch.decide(false);
            false
        };
        drop(io);
        self.closed.store(true, Ordering::Relaxed);
        self.common.duties.stop();
        sealed
    }

    /// Hand every write's leaves and checkpoints to `sink` from now on.
    pub(super) fn set_sink(&self, sink: Sink) {
        let mut io = self.io();
        io.set_sink(sink);
        self.release(io);
    }

    /// Write a `key_rotation` record, signed by the current key and
    /// naming `next`, then sign with `next`.
    pub(super) fn rotate_key(&self, next: SigningKey) -> io::Result<()> {
        let mut io = self.io();
        let rotated = io.rotate_key(&self.common.ids, next);
        self.release(io);
        rotated
    }

    /// Stop (or resume) taking records, as a writer stuck in a slow
    /// `write(2)` would (tests).
    #[cfg(test)]
    pub(super) fn pause(&self, paused: bool) {
        let batch = {
            let mut p = self.pending();
            p.paused = paused;
            p.batch.clone()
        };
        if !paused {
            batch.notify.notify_waiters();
            self.common.duties.poke();
        }
    }

    /// Records appended and not yet taken (tests).
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.pending().entries.len()
    }

    /// Fail the next write, half of it written (tests).
    #[cfg(test)]
    pub(super) fn fail_next_write(&self) {
        self.io().fail_next = true;
    }

    /// Writes so far (tests).
    #[cfg(test)]
    pub(super) fn batches(&self) -> u64 {
        self.io().batches
    }

    /// Syncs of batches so far, and whether written records wait for one
    /// (tests).
    #[cfg(test)]
    pub(super) fn syncs(&self) -> (u64, bool) {
        let io = self.io();
        (io.syncs, io.unsynced.is_some())
    }

    /// The duties thread: checkpoints and rotation by time, retries after
    /// a write error, records that rode their whole `RIDE_LAG`; until the
    /// log is closed.
    pub(super) fn duties(self: Arc<Log>) {
        // After a round that left its records to a caller about to lead:
        // no look before this.
        let mut not_before: Option<Instant> = None;
        // The last look found nothing riding.
        let mut empty = false;
        loop {
            let deadline = {
                let mut io = self.io();
                let d = io.next_deadline();
                io.armed = d;
                self.release(io);
                d
            };
            let ride = self
                .ride_due(&mut empty)
                .map(|r| not_before.map_or(r, |n| r.max(n)));
            let due = ride.map_or(deadline, |r| r.min(deadline));
            let poked = {
                let mut st = self.common.duties.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    if st.poked || st.ride {
                        break;
                    }
                    let now = Instant::now();
                    if now >= due {
                        break;
                    }
                    st = match self.common.duties.cv.wait_timeout(st, due - now) {
                        Ok((s, _)) => s,
                        Err(p) => p.into_inner().0,
                    };
                }
                // Records ride since this round looked: look again.
                st.ride = false;
                std::mem::take(&mut st.poked)
            };
            let now = Instant::now();
            if poked || now >= deadline {
                let io = self.io();
                self.lead(io);
            } else if ride.is_some_and(|r| now >= r) {
                not_before = (!self.ride_round()).then(|| now + RIDE_LAG / 5);
            }
        }
    }

    /// When the oldest record riding is due. With none, look again
    /// `RIDE_LAG` later (between a close and the next, a batch may just
    /// have taken every record riding); with none twice in a row, the
    /// duties thread forgets that records ride, and the next one to ride
    /// wakes it.
    fn ride_due(&self, empty: &mut bool) -> Option<Instant> {
        if let Some(s) = self.pending().riding_since {
            *empty = false;
            return Some(s + RIDE_LAG);
        }
        let riding = &self.common.duties.riding;
        if !*empty && riding.load(Ordering::Acquire) {
            *empty = true;
            return Some(Instant::now() + RIDE_LAG);
        }
        *empty = false;
        riding.store(false, Ordering::Release);
        // One may have come between the look and the store; its
        // submitter saw `riding` still set and did not wake us.
        let s = self.pending().riding_since?;
        riding.store(true, Ordering::Release);
        Some(s + RIDE_LAG)
    }

    /// Write what rode its whole `RIDE_LAG`, unless a caller waits on the
    /// pending batch: that caller leads it, and what rides goes along.
    /// Whether nothing is left to a caller.
    fn ride_round(&self) -> bool {
        let io = self.io();
        {
            let p = self.pending();
            let (left, nothing_due) = if p.acked > 0 || p.paused || p.closed {
                (true, false)
            } else {
                let now = Instant::now();
                (false, p.riding_since.is_none_or(|s| s + RIDE_LAG > now))
            };
            if left || nothing_due {
                drop(p);
                // The caller of the pending batch may have found the log
                // held here: it is woken to lead.
                self.release(io);
                return !left;
            }
        }
        #[cfg(test)]
        self.common
            .duties
            .ride_writes
            .fetch_add(1, Ordering::Relaxed);
        self.lead(io);
        true
    }

    /// Wake-ups of the duties thread for records that ride, and batches it
    /// wrote for them (tests).
    #[cfg(test)]
    pub(super) fn ride_rounds(&self) -> (u64, u64) {
        let d = &self.common.duties;
        (
            d.ride_wakes.load(Ordering::Relaxed),
            d.ride_writes.load(Ordering::Relaxed),
        )
    }
}

struct Segment {
    file: File,
    name: String,
    len: u64,
    lines: u64,
    opened: Instant,
    /// Records other than the header.
    data: u64,
    /// Closed by a checkpoint for rotation; the next segment is not open yet.
    closed: bool,
    /// A failed batch could not be cut off again.
    dirty: bool,
}

struct Outage {
    since: String,
    failed_writes: u64,
    error: String,
}

/// Chain state as it would be after the records built so far.
#[derive(Clone, Default)]
struct Head {
    seq: Option<u64>,
    hash: String,
    since_ckpt: u64,
    /// The Merkle tree's right edge over the records from `tree_base` on.
    tree: Frontier,
    /// Every org's tree ([`OrgTrees`]).
    orgs: OrgTrees,
    /// With witnesses: the leaves and checkpoints not yet handed to them.
    feed: Option<Feed>,
}

impl Head {
    /// Become a copy of `other`, in the room this head already has (a
    /// batch's head is a copy of the last, every batch).
    fn copy_from(&mut self, other: &Head) {
        self.seq = other.seq;
        self.hash.clone_from(&other.hash);
        self.since_ckpt = other.since_ckpt;
        self.tree.copy_from(&other.tree);
        self.orgs.copy_from(&other.orgs);
        self.feed.clone_from(&other.feed);
    }

    /// Make the record whose hash is `hash` the next leaf.
    fn leaf(&mut self, hash: &str) {
        self.grow(merkle::record_leaf(hash));
    }

    fn grow(&mut self, leaf: merkle::Hash) {
        self.tree.push(leaf);
        if let Some(f) = &mut self.feed {
            f.leaves.push(leaf);
        }
    }
}

/// What the witnesses' submitter is handed after each write: the leaves
/// written (after the tree `before`) and the checkpoints among them.
#[derive(Clone, Debug)]
pub(crate) struct Feed {
    pub before: Frontier,
    pub leaves: Vec<merkle::Hash>,
    pub checkpoints: Vec<Signed>,
}

/// A checkpoint written: its seq, tree and signed note.
#[derive(Clone, Debug)]
pub(crate) struct Signed {
    pub seq: u64,
    pub size: u64,
    pub root: merkle::Hash,
    pub note: String,
}

/// Where feeds go (the witnesses' queue); called with the log held, so it
/// must not block.
pub(crate) type Sink = Box<dyn Fn(Feed) + Send>;

/// The leader's state: the open segment and the chain head.
pub(super) struct Io {
    cfg: EvidenceConfig,
    key: SigningKey,
    pubkey: String,
    /// The seq of the Merkle tree's leaf 0 (0 unless the store predates
    /// the tree and its start was removed).
    tree_base: u64,
    /// The origin line of this replica's checkpoint notes.
    origin: String,
    head: Head,
    /// The head before the last batch written, kept for its room: the
    /// next batch's head is copied into it.
    spare: Head,
    seg: Option<Segment>,
    last_ckpt: Instant,
    outage: Option<Outage>,
    /// Submitted records of failed batches (with the room reserved for
    /// them), written first once writing works again.
    kept: Vec<(Prepared, Owner, Option<Arc<Owed>>)>,
    /// Bytes of records per payer in each segment on disk written by this
    /// run, oldest first (the last is the open one).
    usage: VecDeque<(String, HashMap<Owner, u64>)>,
    /// Size-based retention is held back by `retain_min_age`: when the
    /// oldest closed segment it stopped at becomes old enough.
    floor_until: Option<Instant>,
    /// When free space was last compared with `min_free`, and whether it
    /// was below.
    disk_checked: Option<Instant>,
    low_disk: bool,
    healthy: bool,
    retry_at: Instant,
    backoff: Duration,
    /// The deadline the duties thread sleeps until: a leader that makes
    /// something due earlier wakes it.
    armed: Instant,
    /// The batch buffer, kept between batches.
    buf: Vec<u8>,
    /// Bytes each payer wrote in the batch being written, kept (emptied)
    /// from one batch to the next instead of a map built per batch.
    written: HashMap<Owner, u64>,
    /// A batch of one ([`Log::write_now`] with nothing else pending),
    /// kept empty between batches for its room.
    one: Vec<Entry>,
    /// With witnesses: where written leaves and checkpoints go.
    sink: Option<Sink>,
    /// `fsync`: since when records written without a sync wait for one.
    unsynced: Option<Instant>,
    counters: Arc<super::live::Live>,
    /// Tests: fail the next write after half of it reached the file.
    #[cfg(test)]
    fail_next: bool,
    /// Tests: successful writes so far.
    #[cfg(test)]
    batches: u64,
    /// Tests: successful `fdatasync`s of batches so far.
    #[cfg(test)]
    syncs: u64,
}

fn io_err(what: impl std::fmt::Display) -> io::Error {
    io::Error::other(what.to_string())
}

impl Io {
    /// Open the evidence dir: find the chain head left by the previous run
    /// and start a new segment whose header records how that run ended.
    pub(super) fn open(
        cfg: EvidenceConfig,
        key: SigningKey,
        ids: &Ids,
        counters: Arc<super::live::Live>,
    ) -> io::Result<Io> {
        let pubkey = super::key::public_hex(&key);
        let now = Instant::now();
        let origin = note::origin(&cfg.replica);
        let mut w = Io {
            cfg,
            key,
            pubkey,
            tree_base: 0,
            origin,
            head: Head {
                seq: None,
                hash: GENESIS.to_string(),
                since_ckpt: 0,
                tree: Frontier::default(),
                orgs: OrgTrees::default(),
                feed: None,
            },
            spare: Head::default(),
            seg: None,
            last_ckpt: now,
            outage: None,
            kept: Vec::new(),
            usage: VecDeque::new(),
            floor_until: None,
            disk_checked: None,
            low_disk: false,
            healthy: true,
            retry_at: now,
            backoff: BACKOFF_MIN,
            armed: now + IDLE,
            buf: Vec::new(),
            written: HashMap::new(),
            one: Vec::with_capacity(1),
            sink: None,
            unsynced: None,
            counters,
            #[cfg(test)]
            fail_next: false,
            #[cfg(test)]
            batches: 0,
            #[cfg(test)]
            syncs: 0,
        };
        if w.cfg.durability == Durability::Discard {
            let file = OpenOptions::new().write(true).open("/dev/null")?;
            w.seg = Some(Segment {
                file,
                name: "/dev/null".into(),
                len: 0,
                lines: 0,
                opened: now,
                data: 0,
                closed: false,
                dirty: false,
            });
            return Ok(w);
        }
        fs::create_dir_all(&w.cfg.dir)?;
        segment::remove_stale_tmp(&w.cfg.dir);
        let existing = segment::list(&w.cfg.dir)?;
        // Whose records the segments already here hold, for the shares of
        // a full store: read off the start, once needed ([`Store::found`]).
        w.counters.store().found(existing.clone());
        let (start, predecessor) = match existing.last() {
            None => ("start", Value::Null),
            Some(last) => {
                let tail = segment::read_tail(last).map_err(|e| {
                    io_err(format!(
                        "cannot find the chain head: {e}; move the damaged segment aside"
                    ))
                })?;
                let (base, tree) = segment::tree_at_head(&existing, tail.last_seq);
                w.tree_base = base;
                w.head = Head {
                    seq: Some(tail.last_seq),
                    hash: tail.last_hash.clone(),
                    since_ckpt: 0,
                    tree,
                    orgs: segment::orgs_at_head(&existing, tail.last_seq).unwrap_or_default(),
                    feed: None,
                };
                let end = tail.end();
                // Anything but a seal means the previous run did not shut
                // down cleanly; `end` says whether records followed its
                // last checkpoint (`crash`) or not (`checkpoint`).
                if end != "seal" {
                    warn!(
                        segment = %tail.name,
                        unsigned = tail.unsigned,
                        torn_line = ?tail.torn_line,
                        "previous run ended without sealing its evidence; recording that in the new segment"
                    );
                }
                let kind = if end == "seal" { "start" } else { "recover" };
                (kind, tail.to_json(end))
            }
        };
        let (removed, unlink) = w.retention(None);
        w.new_segment(ids, start, predecessor, removed)?;
        w.unlink(unlink);
        w.check_disk(Instant::now());
        if w.counters.store().is_full() {
            // Full already: whose records fill it is needed at once.
            w.counters.store().count_found_now();
        }
        Ok(w)
    }

    pub(super) fn current_path(&self) -> PathBuf {
        match &self.seg {
            Some(s) if self.cfg.durability != Durability::Discard => self.cfg.dir.join(&s.name),
            _ => PathBuf::from("/dev/null"),
        }
    }

    fn meta(ids: &Ids, event: &str) -> Map<String, Value> {
        chain::meta_record(event, ids.next(), now_ts())
    }

    fn sync_dir(&self) {
        if self.cfg.durability == Durability::Fsync {
            if let Ok(d) = File::open(&self.cfg.dir) {
                let _ = d.sync_all();
            }
        }
    }

    /// Create the next segment (as `.tmp`, header written, then renamed).
    fn new_segment(
        &mut self,
        ids: &Ids,
        start: &str,
        predecessor: Value,
        removed: Vec<Value>,
    ) -> io::Result<()> {
        let seq = self.head.seq.map_or(0, |s| s + 1);
        let name = segment::segment_name(seq);
        let path = self.cfg.dir.join(&name);
        let tmp = self.cfg.dir.join(format!("{name}.tmp"));
        let _ = fs::remove_file(&tmp);
        let mut m = Self::meta(ids, "segment_start");
        m.insert("format".into(), chain::FORMAT.into());
        m.insert("segment".into(), name.clone().into());
        m.insert("start".into(), start.into());
        m.insert("predecessor".into(), predecessor);
        m.insert("removed".into(), Value::Array(removed));
        m.insert("key".into(), self.pubkey.clone().into());
        m.insert("replica".into(), self.cfg.replica.clone().into());
        m.insert("durability".into(), self.cfg.durability.as_str().into());
        m.insert(
            "tree".into(),
            merkle::frontier_json(self.tree_base, &self.head.tree),
        );
        m.insert("org_trees".into(), self.head.orgs.to_json());
        let (hash, line) = chain::seal_line(&mut m, seq, &self.head.hash);
        let result = (|| {
            let mut file = OpenOptions::new()
                .append(true)
                .create_new(true)
                .mode(0o640)
                .open(&tmp)?;
            file.write_all(&line)?;
            if self.cfg.durability == Durability::Fsync {
                file.sync_data()?;
            }
            fs::rename(&tmp, &path)?;
            Ok(file)
        })();
        let file = match result {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        self.sync_dir();
        self.counters.store().wrote(line.len() as u64);
        self.head.seq = Some(seq);
        self.head.leaf(&hash);
        self.head.hash = hash;
        self.head.since_ckpt += 1;
        self.usage.push_back((name.clone(), HashMap::new()));
        self.seg = Some(Segment {
            file,
            name,
            len: line.len() as u64,
            lines: 1,
            opened: Instant::now(),
            data: 0,
            closed: false,
            dirty: false,
        });
        self.counters.written(1);
        info!(segment = %self.current_path().display(), start, "evidence segment opened");
        Ok(())
    }

    /// Old segments to remove under the retention caps: their descriptions
    /// for the next header, and their paths to unlink once it is written.
    /// A closed segment last written less than `retain_min_age` ago is
    /// never removed for size: retention stops there, and the store is
    /// full until that segment is old enough ([`super::store`]).
    fn retention(&mut self, keep: Option<&str>) -> (Vec<Value>, Vec<PathBuf>) {
        let caps = retention::Caps {
            size: self.cfg.retain_size,
            age: self.cfg.retain_age,
            min_age: self.cfg.retain_min_age,
        };
        self.floor_until = None;
        if caps.size.is_none() && caps.age.is_none() {
            self.counters.store().set_floor(false);
            return (Vec::new(), Vec::new());
        }
        let Ok(list) = segment::list(&self.cfg.dir) else {
            return (Vec::new(), Vec::new());
        };
        let now = SystemTime::now();
        let listing: Vec<Listed> = list
            .into_iter()
            .filter_map(|path| {
                let md = fs::metadata(&path).ok()?;
                let age = md.modified().ok().and_then(|t| now.duration_since(t).ok());
                Some(Listed {
                    path,
                    len: md.len(),
                    age,
                })
            })
            .collect();
        let plan = retention::plan(&listing, caps, keep);
        let (mut removed, mut unlink) = (Vec::new(), Vec::new());
        let mut floor_in = plan.floor_in;
        for seg in listing.iter().take(plan.remove) {
            let Ok(tail) = segment::read_tail(&seg.path) else {
                warn!(segment = %seg.path.display(), "retention: cannot read segment; keeping it");
                floor_in = None;
                break;
            };
            let mut desc = tail.to_json(tail.end());
            if let Value::Object(m) = &mut desc {
                m.insert("first_seq".into(), tail.first_seq.into());
                m.insert("first_ts".into(), tail.first_ts.clone().into());
                m.insert("last_ts".into(), tail.last_ts.clone().into());
            }
            removed.push(desc);
            unlink.push(seg.path.clone());
        }
        if let (Some(wait), Some(seg)) = (floor_in, listing.get(plan.remove)) {
            self.floor_until = Some(Instant::now() + wait);
            warn!(
                segment = %seg.path.display(),
                age = ?seg.age.unwrap_or(Duration::ZERO),
                retain_min_age = ?caps.min_age,
                "retention: the store is over retain_size but its oldest segment is younger than retain_min_age; keeping it, and refusing the orgs over their share"
            );
        }
        self.counters.store().set_floor(self.floor_until.is_some());
        (removed, unlink)
    }

    /// Measure free space (at most every [`DISK_CHECK`]; between two
    /// measurements the store takes every write off the last one), and
    /// say when it crosses `min_free`. While it is below, every write
    /// measures again, so that space freed (a shipper's copy removed, the
    /// disk grown) ends the refusals at the next write.
    fn check_disk(&mut self, now: Instant) {
        if self.cfg.durability == Durability::Discard {
            return;
        }
        if self.low_disk
            || self
                .disk_checked
                .is_none_or(|t| now.saturating_duration_since(t) >= DISK_CHECK)
        {
            self.disk_checked = Some(now);
            if let Some((free, size)) = self.counters.disk_space() {
                self.counters
                    .store()
                    .measure(free, self.cfg.min_free.bytes(size));
            }
        }
        let store = self.counters.store();
        let low = store.low_disk();
        if low != self.low_disk {
            let free = store.free();
            if low {
                warn!(
                    ?free,
                    "evidence file system below min_free (written and reserved records counted); refusing the orgs over their share"
                );
            } else {
                info!(?free, "evidence file system above min_free again");
            }
        }
        self.low_disk = low;
    }

    fn unlink(&mut self, paths: Vec<PathBuf>) {
        for p in paths {
            match fs::remove_file(&p) {
                Ok(()) => info!(segment = %p.display(), "retention: removed old evidence segment"),
                Err(e) => warn!(segment = %p.display(), error = %e, "retention: cannot remove"),
            }
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            if let Some(i) = self
                .usage
                .iter()
                .position(|(n, _)| Some(n) == name.as_ref())
            {
                if let Some((_, held)) = self.usage.remove(i) {
                    self.counters.store().remove(&held);
                }
            } else if let Some(name) = &name {
                self.counters.store().forget_found(name);
            }
        }
        self.sync_dir();
    }

    /// Whether the segment is to be closed before the next write, at `now`.
    fn rotation_due(&self, now: Instant) -> bool {
        if self.cfg.durability == Durability::Discard {
            return false;
        }
        match &self.seg {
            None => true,
            Some(s) => {
                s.closed
                    || s.dirty
                    || (s.data > 0
                        && (s.len >= self.cfg.rotate_size
                            || now.saturating_duration_since(s.opened) >= self.cfg.rotate_age
                            // The segment retention stopped at is old
                            // enough now: rotate, so that it is removed.
                            || self.floor_until.is_some_and(|t| now >= t)))
            }
        }
    }

    /// Close the current segment with a checkpoint and open the next one.
    fn rotate(&mut self, ids: &Ids) -> io::Result<()> {
        let (end, kind) = match &self.seg {
            Some(s) if s.dirty => ("write_error", "write_error"),
            _ => ("checkpoint", "rotate"),
        };
        if self.seg.as_ref().is_some_and(|s| !s.closed && !s.dirty) {
            let mut buf = Vec::new();
            let mut head = self.head.clone();
            self.push_checkpoint(ids, &mut head, &mut buf, "checkpoint");
            self.write_buf(&buf, 1, head, true)?;
            self.counters.written(1);
            if let Some(s) = &mut self.seg {
                s.closed = true;
            }
        }
        let Some(seg) = &self.seg else {
            return Err(io_err("no segment"));
        };
        let tail = Tail {
            name: seg.name.clone(),
            lines: seg.lines,
            last_seq: self.head.seq.unwrap_or(0),
            last_hash: self.head.hash.clone(),
            last_event: end.into(),
            first_seq: 0,
            first_ts: String::new(),
            last_ts: String::new(),
            unsigned: self.head.since_ckpt,
            torn_line: None,
        };
        let keep = seg.name.clone();
        let (removed, unlink) = self.retention(Some(&keep));
        self.new_segment(ids, kind, tail.to_json(end), removed)?;
        self.unlink(unlink);
        Ok(())
    }

    /// Chain `m` after `head`, append its line to `buf`.
    fn push(head: &mut Head, buf: &mut Vec<u8>, m: &mut Map<String, Value>) {
        let seq = head.seq.map_or(0, |s| s + 1);
        let (hash, line) = chain::seal_line(m, seq, &head.hash);
        buf.extend_from_slice(&line);
        head.seq = Some(seq);
        head.leaf(&hash);
        head.hash = hash;
        head.since_ckpt += 1;
    }

    /// Chain a prepared record after `head`, straight into `buf`.
    fn push_prepared(head: &mut Head, buf: &mut Vec<u8>, p: &Prepared, org: &Owner) {
        let seq = head.seq.map_or(0, |s| s + 1);
        let (digest, at) = p.seal(seq, &head.hash, buf);
        // The head's hash in the room it has: hex digits, so the check
        // cannot fail.
        head.hash.clear();
        head.hash
            .push_str(std::str::from_utf8(&buf[at]).unwrap_or_default());
        // The leaf of the hash just written (`record_leaf` of its hex).
        let leaf = merkle::leaf_hash(&digest);
        head.grow(leaf);
        if let Some(org) = org {
            head.orgs.push(org, leaf);
        }
        head.seq = Some(seq);
        head.since_ckpt += 1;
    }

    fn push_checkpoint(&self, ids: &Ids, head: &mut Head, buf: &mut Vec<u8>, event: &str) {
        let mut m = Self::meta(ids, event);
        m.insert("key".into(), self.pubkey.clone().into());
        m.insert("signed".into(), head.since_ckpt.into());
        // The tree of every record before this checkpoint.
        let (size, root) = (head.tree.size(), head.tree.root());
        m.insert("tree_size".into(), size.into());
        m.insert("root".into(), HEXLOWER.encode(&root).into());
        head.orgs.commit_into(&mut m);
        let body = note::checkpoint_body(&self.origin, size, &root);
        let signed = note::sign(&body, &self.origin, &self.key);
        let seq = head.seq.map_or(0, |s| s + 1);
        if let Some(f) = &mut head.feed {
            f.checkpoints.push(Signed {
                seq,
                size,
                root,
                note: signed.clone(),
            });
        }
        m.insert("note".into(), signed.into());
        m.insert("seq".into(), Value::from(seq));
        m.insert("prev".into(), head.hash.clone().into());
        chain::sign(&mut m, &self.key);
        Self::push(head, buf, &mut m);
        head.since_ckpt = 0;
    }

    /// Write `buf` (holding `lines` lines) to the current segment and make
    /// `head` the chain head. On failure the segment is cut back.
    /// With `sync` (`fsync` mode) the file is `fdatasync`ed after.
    fn write_buf(&mut self, buf: &[u8], lines: u64, head: Head, sync: bool) -> io::Result<()> {
        let fsync = self.cfg.durability == Durability::Fsync;
        let sync_now = fsync && sync;
        #[cfg(test)]
        let inject = std::mem::take(&mut self.fail_next);
        let Some(seg) = &mut self.seg else {
            return Err(io_err("no segment"));
        };
        #[cfg(test)]
        if inject {
            // Half the batch reaches the file, then the disk is full.
            let _ = seg.file.write_all(&buf[..buf.len() / 2]);
            return self.cut_back(io::Error::from(io::ErrorKind::StorageFull));
        }
        let result = seg.file.write_all(buf).and_then(|()| {
            if sync_now {
                seg.file.sync_data()
            } else {
                Ok(())
            }
        });
        match result {
            Ok(()) => {
                #[cfg(test)]
                {
                    self.batches += 1;
                }
                seg.len += buf.len() as u64;
                seg.lines += lines;
                if self.cfg.durability != Durability::Discard {
                    self.counters.store().wrote(buf.len() as u64);
                }
                if sync_now {
                    self.unsynced = None;
                    #[cfg(test)]
                    {
                        self.syncs += 1;
                    }
                } else if fsync && self.unsynced.is_none() {
                    self.unsynced = Some(Instant::now());
                }
                let was_ckpt = head.since_ckpt == 0;
                self.spare = std::mem::replace(&mut self.head, head);
                if was_ckpt {
                    self.last_ckpt = Instant::now();
                }
                self.hand_over();
                Ok(())
            }
            Err(e) => self.cut_back(e),
        }
    }

    /// A `key_rotation` record (`key` the current public key, `next_key`
    /// and `next_vkey` the next one's), signed by the current key; every
    /// checkpoint after it is signed by `next`.
    fn rotate_key(&mut self, ids: &Ids, next: SigningKey) -> io::Result<()> {
        let mut head = self.head.clone();
        let mut buf = Vec::new();
        let mut m = Self::meta(ids, "key_rotation");
        let next_hex = super::key::public_hex(&next);
        m.insert("key".into(), self.pubkey.clone().into());
        m.insert("next_key".into(), next_hex.clone().into());
        m.insert(
            "next_vkey".into(),
            note::vkey(&self.origin, &next.verifying_key()).into(),
        );
        m.insert("seq".into(), Value::from(head.seq.map_or(0, |s| s + 1)));
        m.insert("prev".into(), head.hash.clone().into());
        chain::sign(&mut m, &self.key);
        Self::push(&mut head, &mut buf, &mut m);
        self.write_buf(&buf, 1, head, true)?;
        self.counters.written(1);
        info!(from = %self.pubkey, to = %next_hex, "evidence key rotated");
        self.key = next;
        self.pubkey = next_hex;
        Ok(())
    }

    /// Hand what was written since the last time to the witnesses' sink.
    fn hand_over(&mut self) {
        let (Some(sink), Some(feed)) = (&self.sink, &mut self.head.feed) else {
            return;
        };
        if feed.leaves.is_empty() {
            return;
        }
        let next = Feed {
            before: self.head.tree.clone(),
            leaves: Vec::new(),
            checkpoints: Vec::new(),
        };
        sink(std::mem::replace(feed, next));
    }

    /// From now on, hand written leaves and checkpoints to `sink`.
    fn set_sink(&mut self, sink: Sink) {
        self.head.feed = Some(Feed {
            before: self.head.tree.clone(),
            leaves: Vec::new(),
            checkpoints: Vec::new(),
        });
        self.sink = Some(sink);
    }

    /// `fsync`: sync what was written without a sync (submitted records).
    fn sync_tail(&mut self) -> io::Result<()> {
        let Some(seg) = &self.seg else {
            return Err(io_err("no segment"));
        };
        seg.file.sync_data()?;
        self.unsynced = None;
        #[cfg(test)]
        {
            self.syncs += 1;
        }
        Ok(())
    }

    /// `fsync`: written records have waited SYNC_LAG for a sync.
    fn sync_due(&self) -> bool {
        self.unsynced.is_some_and(|t| t.elapsed() >= SYNC_LAG)
    }

    /// After a failed write: cut the segment back to its last good length
    /// (or mark it for rotation if that fails), and return `e`.
    fn cut_back(&mut self, e: io::Error) -> io::Result<()> {
        if self.cfg.durability != Durability::Discard {
            if let Some(seg) = &mut self.seg {
                let cut = seg.file.set_len(seg.len);
                let len = seg.file.metadata().map(|m| m.len());
                if cut.is_err() || len.ok() != Some(seg.len) {
                    seg.dirty = true;
                }
            }
        }
        Err(e)
    }

    /// Write the batch (after an outage record and kept submissions, with
    /// a checkpoint or seal when due). Returns the lines written.
    fn attempt(
        &mut self,
        ids: &Ids,
        batch: &[Entry],
        finish: Option<&str>,
        sync: bool,
    ) -> io::Result<()> {
        // One clock read serves the batch's checks (rotation, checkpoint,
        // free space).
        let now = Instant::now();
        if self.rotation_due(now) {
            self.rotate(ids)?;
        }
        let mut lines = 0u64;
        let mut head = std::mem::take(&mut self.spare);
        head.copy_from(&self.head);
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut data = 0u64;
        if let Some(o) = &self.outage {
            let mut m = Self::meta(ids, "outage");
            m.insert("since".into(), o.since.clone().into());
            m.insert("failed_writes".into(), o.failed_writes.into());
            m.insert("error".into(), o.error.clone().into());
            Self::push(&mut head, &mut buf, &mut m);
            lines += 1;
        }
        let mut written = std::mem::take(&mut self.written);
        written.clear();
        // The records' lines in `buf`, for the tap, while anyone listens.
        let tapped = self.counters.tap().active();
        let mut records: Vec<(usize, usize)> = Vec::new();
        for (p, org, _) in &self.kept {
            let at = buf.len();
            Self::push_prepared(&mut head, &mut buf, p, org);
            *written.entry(org.clone()).or_insert(0) += (buf.len() - at) as u64;
            if tapped {
                records.push((at, buf.len()));
            }
            lines += 1;
            data += 1;
        }
        for e in batch {
            let at = buf.len();
            Self::push_prepared(&mut head, &mut buf, &e.line, &e.org);
            *written.entry(e.org.clone()).or_insert(0) += (buf.len() - at) as u64;
            if tapped {
                records.push((at, buf.len()));
            }
            lines += 1;
            data += 1;
        }
        let ckpt_due = head.since_ckpt >= self.cfg.checkpoint_every
            || (head.since_ckpt > 0
                && now.saturating_duration_since(self.last_ckpt) >= self.cfg.checkpoint_interval);
        if let Some(event) = finish {
            self.push_checkpoint(ids, &mut head, &mut buf, event);
            lines += 1;
        } else if ckpt_due {
            self.push_checkpoint(ids, &mut head, &mut buf, "checkpoint");
            lines += 1;
        }
        let result = if !buf.is_empty() {
            self.write_buf(&buf, lines, head, sync)
        } else if sync && self.unsynced.is_some() {
            self.sync_tail()
        } else {
            Ok(())
        };
        if result.is_ok() {
            // Written: now the tail may see them.
            for &(from, to) in &records {
                let line = &buf[from..to];
                self.counters
                    .tap()
                    .publish(line.strip_suffix(b"\n").unwrap_or(line));
            }
        }
        // Bounded: a batch buffer grown by a burst is not kept.
        if buf.capacity() <= 1 << 20 {
            self.buf = buf;
        }
        if result.is_ok() {
            self.counters.written(lines);
            self.kept.clear();
            if let Some(s) = &mut self.seg {
                s.data += data;
            }
            if self.cfg.durability != Durability::Discard {
                if let Some((_, held)) = self.usage.back_mut() {
                    for (p, b) in &written {
                        *held.entry(p.clone()).or_insert(0) += b;
                    }
                }
                self.counters.store().add(&written);
                self.check_disk(now);
            }
        }
        self.written = written;
        result
    }

    /// One batch: write it, or refuse it while writing is failing and the
    /// next retry is not due. Returns whether it was written.
    /// `batch` is left empty (its entries written, kept or failed).
    fn step(
        &mut self,
        c: &Common,
        batch: &mut Vec<Entry>,
        finish: Option<&str>,
        sync: bool,
    ) -> bool {
        if !self.healthy && Instant::now() < self.retry_at && finish.is_none() {
            self.refuse(batch, None);
            return false;
        }
        let written = match self.attempt(&c.ids, batch, finish, sync) {
            Ok(()) => {
                if !self.healthy {
                    info!("evidence writable again");
                }
                self.healthy = true;
                c.healthy.store(true, Ordering::Relaxed);
                self.outage = None;
                self.backoff = BACKOFF_MIN;
                // Written: their places and reservations go back now.
                batch.clear();
                true
            }
            Err(e) => {
                c.counters.write_failed();
                if self.healthy {
                    error!(error = %e, "evidence write failed; denying new connections until it works again");
                }
                self.healthy = false;
                c.healthy.store(false, Ordering::Relaxed);
                self.retry_at = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                self.refuse(batch, Some(e.to_string()));
                // Measure at once: a full disk is the fullest store.
                self.disk_checked = None;
                self.check_disk(Instant::now());
                false
            }
        };
        // Something due earlier than the duties thread sleeps (the first
        // unsigned record, the first record of a segment, a retry): wake it.
        let due = self.next_deadline();
        if due < self.armed {
            self.armed = due;
            c.duties.poke();
        }
        written
    }

    /// Fail the waiting writes of a batch; keep its submitted records.
    fn refuse(&mut self, batch: &mut Vec<Entry>, error: Option<String>) {
        let outage = self.outage.get_or_insert_with(|| Outage {
            since: now_ts(),
            failed_writes: 0,
            error: String::new(),
        });
        if let Some(e) = error {
            outage.error = e;
        }
        for e in batch.drain(..) {
            if e.acked {
                outage.failed_writes += 1;
            } else {
                self.kept.push((e.line, e.org, e.owed));
            }
        }
    }

    fn next_deadline(&self) -> Instant {
        let mut d = self.last_ckpt.max(self.retry_at) + IDLE;
        if !self.healthy {
            d = d.min(self.retry_at);
        }
        if self.head.since_ckpt > 0 {
            d = d.min(self.last_ckpt + self.cfg.checkpoint_interval);
        }
        if let Some(s) = &self.seg {
            if s.data > 0 && self.cfg.durability != Durability::Discard {
                d = d.min(s.opened + self.cfg.rotate_age);
                if let Some(t) = self.floor_until {
                    d = d.min(t);
                }
            }
        }
        if let Some(t) = self.unsynced {
            d = d.min(t + SYNC_LAG);
        }
        d
    }
}

#[cfg(test)]
mod ids_tests {
    use super::*;

    /// An id is `PREFIX-N`, N in decimal, counting from 0, as `format!`
    /// writes it.
    #[test]
    fn ids_are_the_prefix_and_a_counter() {
        let ids = Ids::new("gw-1", Duration::new(0x6b0d_1234, 5_000));
        assert_eq!(ids.next(), "gw-1-6b0d123400005-0");
        assert_eq!(ids.next(), "gw-1-6b0d123400005-1");
        ids.next.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(ids.next(), format!("{}-{}", ids.prefix, u64::MAX));
        ids.next.store(1_000_000_007, Ordering::Relaxed);
        assert_eq!(ids.next(), format!("{}-1000000007", ids.prefix));
    }
}
