//! The dedicated writer thread: takes records from a bounded queue, chains,
//! batches and writes them (one `write(2)` per batch), checkpoints, rotates
//! and retains segments, and recovers from write errors by itself.
//!
//! Failure handling keeps the chain consistent: a batch that fails is cut
//! off the file again (`ftruncate` to the last good length) and never
//! counted; `write` callers in it get an error (their connection is denied),
//! submitted records are kept and written first once writing works again,
//! after an `outage` record saying how many writes failed since when. If the
//! file cannot be cut back, the writer moves to a new segment whose header
//! says how many lines of the old one belong to the chain.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ed25519_dalek::SigningKey;
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::chain::{self, GENESIS};
use super::segment::{self, Tail};
use crate::config::{Durability, EvidenceConfig};

/// Records waiting for the writer before `write` callers (and accept loops)
/// wait for room.
pub const QUEUE_CAPACITY: usize = 8192;
/// Most records written with one `write(2)`.
const MAX_BATCH: usize = 4096;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

pub(super) struct Msg {
    pub fields: Map<String, Value>,
    pub ack: Option<oneshot::Sender<bool>>,
    pub permit: bool,
}

#[derive(Default)]
pub(super) struct Queue {
    pub items: VecDeque<Msg>,
    /// Seal and stop; the sender learns whether the seal was written.
    pub stop: Option<oneshot::Sender<bool>>,
    /// Stop without sealing (tests that simulate a crash).
    pub abandon: bool,
    /// Take nothing off the queue until cleared (tests that simulate a
    /// writer stuck in a slow write).
    pub paused: bool,
}

pub(super) struct Shared {
    pub queue: Mutex<Queue>,
    pub cv: Condvar,
    pub slots: tokio::sync::Semaphore,
    pub healthy: AtomicBool,
    pub closed: AtomicBool,
    pub ids: Ids,
    pub refs: super::reference::RefKey,
    pub counters: Arc<super::Counters>,
}

/// Record ids: a per-start prefix and a counter.
pub(super) struct Ids {
    pub prefix: String,
    pub next: AtomicU64,
}

impl Ids {
    pub fn next(&self) -> String {
        format!(
            "{}-{}",
            self.prefix,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }
}

pub(super) fn now_ts() -> String {
    humantime::format_rfc3339_micros(SystemTime::now()).to_string()
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
#[derive(Clone)]
struct Head {
    seq: Option<u64>,
    hash: String,
    since_ckpt: u64,
}

pub(super) struct Writer {
    cfg: EvidenceConfig,
    key: SigningKey,
    pubkey: String,
    shared: Arc<Shared>,
    head: Head,
    seg: Option<Segment>,
    last_ckpt: Instant,
    outage: Option<Outage>,
    pending: VecDeque<Map<String, Value>>,
    healthy: bool,
    retry_at: Instant,
    backoff: Duration,
}

fn io_err(what: impl std::fmt::Display) -> io::Error {
    io::Error::other(what.to_string())
}

impl Writer {
    /// Open the evidence dir: find the chain head left by the previous run
    /// and start a new segment whose header records how that run ended.
    pub fn open(cfg: EvidenceConfig, key: SigningKey, shared: Arc<Shared>) -> io::Result<Writer> {
        let pubkey = super::key::public_hex(&key);
        let mut w = Writer {
            cfg,
            key,
            pubkey,
            shared,
            head: Head {
                seq: None,
                hash: GENESIS.to_string(),
                since_ckpt: 0,
            },
            seg: None,
            last_ckpt: Instant::now(),
            outage: None,
            pending: VecDeque::new(),
            healthy: true,
            retry_at: Instant::now(),
            backoff: BACKOFF_MIN,
        };
        if w.cfg.durability == Durability::Discard {
            let file = OpenOptions::new().write(true).open("/dev/null")?;
            w.seg = Some(Segment {
                file,
                name: "/dev/null".into(),
                len: 0,
                lines: 0,
                opened: Instant::now(),
                data: 0,
                closed: false,
                dirty: false,
            });
            return Ok(w);
        }
        fs::create_dir_all(&w.cfg.dir)?;
        segment::remove_stale_tmp(&w.cfg.dir);
        let existing = segment::list(&w.cfg.dir)?;
        let (start, predecessor) = match existing.last() {
            None => ("start", Value::Null),
            Some(last) => {
                let tail = segment::read_tail(last).map_err(|e| {
                    io_err(format!(
                        "cannot find the chain head: {e}; move the damaged segment aside"
                    ))
                })?;
                w.head = Head {
                    seq: Some(tail.last_seq),
                    hash: tail.last_hash.clone(),
                    since_ckpt: 0,
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
        w.new_segment(start, predecessor, removed)?;
        w.unlink(unlink);
        Ok(w)
    }

    pub fn current_path(&self) -> PathBuf {
        match &self.seg {
            Some(s) if self.cfg.durability != Durability::Discard => self.cfg.dir.join(&s.name),
            _ => PathBuf::from("/dev/null"),
        }
    }

    fn meta(&self, event: &str) -> Map<String, Value> {
        chain::meta_record(event, self.shared.ids.next(), now_ts())
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
        start: &str,
        predecessor: Value,
        removed: Vec<Value>,
    ) -> io::Result<()> {
        let seq = self.head.seq.map_or(0, |s| s + 1);
        let name = segment::segment_name(seq);
        let path = self.cfg.dir.join(&name);
        let tmp = self.cfg.dir.join(format!("{name}.tmp"));
        let _ = fs::remove_file(&tmp);
        let mut m = self.meta("segment_start");
        m.insert("format".into(), chain::FORMAT.into());
        m.insert("segment".into(), name.clone().into());
        m.insert("start".into(), start.into());
        m.insert("predecessor".into(), predecessor);
        m.insert("removed".into(), Value::Array(removed));
        m.insert("key".into(), self.pubkey.clone().into());
        m.insert("durability".into(), self.cfg.durability.as_str().into());
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
        self.head.seq = Some(seq);
        self.head.hash = hash;
        self.head.since_ckpt += 1;
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
        self.shared.counters.written(1);
        info!(segment = %self.current_path().display(), start, "evidence segment opened");
        Ok(())
    }

    /// Old segments to remove under the retention caps: their descriptions
    /// for the next header, and their paths to unlink once it is written.
    fn retention(&self, keep: Option<&str>) -> (Vec<Value>, Vec<PathBuf>) {
        let (size_cap, age_cap) = (self.cfg.retain_size, self.cfg.retain_age);
        if size_cap.is_none() && age_cap.is_none() {
            return (Vec::new(), Vec::new());
        }
        let Ok(list) = segment::list(&self.cfg.dir) else {
            return (Vec::new(), Vec::new());
        };
        let sizes: Vec<(PathBuf, u64, Option<SystemTime>)> = list
            .into_iter()
            .filter_map(|p| {
                let md = fs::metadata(&p).ok()?;
                Some((p, md.len(), md.modified().ok()))
            })
            .collect();
        let mut total: u64 = sizes.iter().map(|s| s.1).sum();
        let (mut removed, mut unlink) = (Vec::new(), Vec::new());
        // The newest segment always stays: it is the chain head.
        for (path, len, mtime) in sizes.iter().take(sizes.len().saturating_sub(1)) {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            if name.as_deref() == keep {
                break;
            }
            let too_big = size_cap.is_some_and(|cap| total > cap);
            let too_old = age_cap
                .is_some_and(|age| mtime.is_some_and(|t| t.elapsed().is_ok_and(|e| e > age)));
            if !too_big && !too_old {
                break;
            }
            let Ok(tail) = segment::read_tail(path) else {
                warn!(segment = %path.display(), "retention: cannot read segment; keeping it");
                break;
            };
            let mut desc = tail.to_json(tail.end());
            if let Value::Object(m) = &mut desc {
                m.insert("last_ts".into(), tail.last_ts.clone().into());
            }
            removed.push(desc);
            unlink.push(path.clone());
            total -= len;
        }
        (removed, unlink)
    }

    fn unlink(&self, paths: Vec<PathBuf>) {
        for p in paths {
            match fs::remove_file(&p) {
                Ok(()) => info!(segment = %p.display(), "retention: removed old evidence segment"),
                Err(e) => warn!(segment = %p.display(), error = %e, "retention: cannot remove"),
            }
        }
        self.sync_dir();
    }

    fn rotation_due(&self) -> bool {
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
                            || s.opened.elapsed() >= self.cfg.rotate_age))
            }
        }
    }

    /// Close the current segment with a checkpoint and open the next one.
    fn rotate(&mut self) -> io::Result<()> {
        let (end, kind) = match &self.seg {
            Some(s) if s.dirty => ("write_error", "write_error"),
            _ => ("checkpoint", "rotate"),
        };
        if self.seg.as_ref().is_some_and(|s| !s.closed && !s.dirty) {
            let mut buf = Vec::new();
            let mut head = self.head.clone();
            self.push_checkpoint(&mut head, &mut buf, "checkpoint");
            self.write_buf(&buf, 1, &head)?;
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
            last_ts: String::new(),
            unsigned: self.head.since_ckpt,
            torn_line: None,
        };
        let keep = seg.name.clone();
        let (removed, unlink) = self.retention(Some(&keep));
        self.new_segment(kind, tail.to_json(end), removed)?;
        self.unlink(unlink);
        Ok(())
    }

    /// Chain `m` after `head`, append its line to `buf`.
    fn push(&self, head: &mut Head, buf: &mut Vec<u8>, m: &mut Map<String, Value>) {
        let seq = head.seq.map_or(0, |s| s + 1);
        let (hash, line) = chain::seal_line(m, seq, &head.hash);
        buf.extend_from_slice(&line);
        head.seq = Some(seq);
        head.hash = hash;
        head.since_ckpt += 1;
    }

    fn push_checkpoint(&self, head: &mut Head, buf: &mut Vec<u8>, event: &str) {
        let mut m = self.meta(event);
        m.insert("key".into(), self.pubkey.clone().into());
        m.insert("signed".into(), head.since_ckpt.into());
        m.insert("seq".into(), Value::from(head.seq.map_or(0, |s| s + 1)));
        m.insert("prev".into(), head.hash.clone().into());
        chain::sign(&mut m, &self.key);
        self.push(head, buf, &mut m);
        head.since_ckpt = 0;
    }

    /// Write `buf` (holding `lines` lines) to the current segment and make
    /// `head` the chain head. On failure the segment is cut back.
    fn write_buf(&mut self, buf: &[u8], lines: u64, head: &Head) -> io::Result<()> {
        let fsync = self.cfg.durability == Durability::Fsync;
        let Some(seg) = &mut self.seg else {
            return Err(io_err("no segment"));
        };
        let result =
            seg.file
                .write_all(buf)
                .and_then(|()| if fsync { seg.file.sync_data() } else { Ok(()) });
        match result {
            Ok(()) => {
                seg.len += buf.len() as u64;
                seg.lines += lines;
                let was_ckpt = head.since_ckpt == 0;
                self.head = head.clone();
                if was_ckpt {
                    self.last_ckpt = Instant::now();
                }
                Ok(())
            }
            Err(e) => {
                if self.cfg.durability != Durability::Discard {
                    let cut = seg.file.set_len(seg.len);
                    let len = seg.file.metadata().map(|m| m.len());
                    if cut.is_err() || len.ok() != Some(seg.len) {
                        seg.dirty = true;
                    }
                }
                Err(e)
            }
        }
    }

    /// Write queued records (and an outage record, pending submissions and
    /// a checkpoint or seal when due).
    fn attempt(&mut self, batch: &mut [Msg], finish: Option<&str>) -> io::Result<u64> {
        if self.rotation_due() {
            self.rotate()?;
        }
        let mut head = self.head.clone();
        let mut buf = Vec::with_capacity(600 * (batch.len() + self.pending.len() + 2));
        let mut lines = 0u64;
        let mut data = 0u64;
        if let Some(o) = &self.outage {
            let mut m = self.meta("outage");
            m.insert("since".into(), o.since.clone().into());
            m.insert("failed_writes".into(), o.failed_writes.into());
            m.insert("error".into(), o.error.clone().into());
            self.push(&mut head, &mut buf, &mut m);
            lines += 1;
        }
        let mut pending = std::mem::take(&mut self.pending);
        for m in pending.iter_mut() {
            self.push(&mut head, &mut buf, m);
            lines += 1;
            data += 1;
        }
        for msg in batch.iter_mut() {
            self.push(&mut head, &mut buf, &mut msg.fields);
            lines += 1;
            data += 1;
        }
        let ckpt_due = head.since_ckpt >= self.cfg.checkpoint_every
            || (head.since_ckpt > 0 && self.last_ckpt.elapsed() >= self.cfg.checkpoint_interval);
        if let Some(event) = finish {
            self.push_checkpoint(&mut head, &mut buf, event);
            lines += 1;
        } else if ckpt_due {
            self.push_checkpoint(&mut head, &mut buf, "checkpoint");
            lines += 1;
        }
        if lines == 0 {
            return Ok(0);
        }
        match self.write_buf(&buf, lines, &head) {
            Ok(()) => {
                if let Some(s) = &mut self.seg {
                    s.data += data;
                }
                Ok(lines)
            }
            Err(e) => {
                self.pending = pending;
                Err(e)
            }
        }
    }

    /// One round: write the batch, acknowledge it, handle failure.
    fn step(&mut self, mut batch: Vec<Msg>, finish: Option<&str>) -> bool {
        if !self.healthy && Instant::now() < self.retry_at && finish.is_none() {
            self.refuse(batch, None);
            return false;
        }
        match self.attempt(&mut batch, finish) {
            Ok(lines) => {
                self.shared.counters.written(lines);
                if !self.healthy {
                    info!("evidence writable again");
                }
                self.healthy = true;
                self.shared.healthy.store(true, Ordering::Relaxed);
                self.outage = None;
                self.backoff = BACKOFF_MIN;
                for msg in batch {
                    if let Some(ack) = msg.ack {
                        let _ = ack.send(true);
                    }
                }
                true
            }
            Err(e) => {
                self.shared.counters.write_failed();
                if self.healthy {
                    error!(error = %e, "evidence write failed; denying new connections until it works again");
                }
                self.healthy = false;
                self.shared.healthy.store(false, Ordering::Relaxed);
                self.retry_at = Instant::now() + self.backoff;
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                self.refuse(batch, Some(e.to_string()));
                false
            }
        }
    }

    /// Fail the waiting writes of a batch; keep its submitted records.
    fn refuse(&mut self, batch: Vec<Msg>, error: Option<String>) {
        let outage = self.outage.get_or_insert_with(|| Outage {
            since: now_ts(),
            failed_writes: 0,
            error: String::new(),
        });
        if let Some(e) = error {
            outage.error = e;
        }
        for msg in batch {
            match msg.ack {
                Some(ack) => {
                    outage.failed_writes += 1;
                    let _ = ack.send(false);
                }
                None => self.pending.push_back(msg.fields),
            }
        }
    }

    fn next_deadline(&self) -> Instant {
        let mut d = Instant::now() + Duration::from_secs(3600);
        if !self.healthy {
            d = d.min(self.retry_at);
        }
        if self.head.since_ckpt > 0 {
            d = d.min(self.last_ckpt + self.cfg.checkpoint_interval);
        }
        if let Some(s) = &self.seg {
            if s.data > 0 && self.cfg.durability != Durability::Discard {
                d = d.min(s.opened + self.cfg.rotate_age);
            }
        }
        d
    }

    /// The writer thread's loop.
    pub fn run(mut self) {
        loop {
            let deadline = self.next_deadline();
            let (batch, stop, abandon) = {
                let mut q = match self.shared.queue.lock() {
                    Ok(q) => q,
                    Err(p) => p.into_inner(),
                };
                while (q.items.is_empty() || q.paused) && q.stop.is_none() && !q.abandon {
                    let now = Instant::now();
                    if now >= deadline && !q.paused {
                        break;
                    }
                    let wait = if q.paused {
                        BACKOFF_MIN
                    } else {
                        deadline - now
                    };
                    q = match self.shared.cv.wait_timeout(q, wait) {
                        Ok((q, _)) => q,
                        Err(p) => p.into_inner().0,
                    };
                }
                let n = q.items.len().min(MAX_BATCH);
                let batch: Vec<Msg> = q.items.drain(..n).collect();
                self.shared.counters.set_queue_depth(q.items.len());
                let stop = if q.items.is_empty() {
                    q.stop.take()
                } else {
                    None
                };
                (batch, stop, q.abandon)
            };
            let permits = batch.iter().filter(|m| m.permit).count();
            self.shared.slots.add_permits(permits);
            if abandon {
                return;
            }
            if let Some(done) = stop {
                let sealed = self.step(batch, Some("seal"));
                if !sealed {
                    error!("could not seal the evidence chain");
                }
                self.shared.closed.store(true, Ordering::Relaxed);
                let _ = done.send(sealed);
                return;
            }
            let due = !batch.is_empty()
                || !self.healthy
                || !self.pending.is_empty()
                || Instant::now() >= deadline;
            if due {
                self.step(batch, None);
            }
        }
    }
}
