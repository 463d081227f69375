//! The evidence as it runs, shared with its readers: [`Live`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{store, tap};

/// The evidence as it runs, shared with its readers: what the writer has
/// written and failed to write, its queue, the file system it writes to,
/// how full the store is and whose records fill it (read by the evidence
/// budget, `limits::evidence`), and the tap of written records (the live
/// tail). The metrics layer reads it when scraped (evidence knows nothing
/// of metrics).
#[derive(Debug, Default)]
pub struct Live {
    /// Lines written (records, checkpoints, segment headers).
    records_written: AtomicU64,
    /// Writes that failed, and records that could not be queued.
    write_errors: AtomicU64,
    /// Records appended and not yet taken by a writer.
    queue_depth: AtomicU64,
    /// The evidence dir, for the disk space metrics read at scrape time.
    dir: std::sync::OnceLock<PathBuf>,
    /// The replica this instance records as (`[evidence] replica`).
    replica: std::sync::OnceLock<String>,
    /// How full the store is, and whose records fill it.
    store: Arc<store::Store>,
    /// Written records, live, for the decision tail.
    tap: tap::Tap,
    /// What each witness did ([`super::witness`]), in `[evidence] witnesses` order.
    witnesses: Mutex<Vec<WitnessCounts>>,
    /// Writes whose leaves the witnesses' full queue could not take.
    witness_dropped: AtomicU64,
}

/// What one witness did since start, read by the metrics layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WitnessCounts {
    /// The witness's key name.
    pub name: String,
    /// Checkpoints it cosigned.
    pub cosigned: u64,
    /// Refusals of a checkpoint as inconsistent with what it saw before
    /// (409 with a size not ours, 422): a rewritten or forked history.
    pub conflicts: u64,
    /// Submissions that failed otherwise: by `reason` (`unreachable`,
    /// `timeout`, `unknown_log` (404), `forbidden` (403), `bad_request`
    /// (400), `bad_reply`, `no_proof`).
    pub failures: std::collections::BTreeMap<&'static str, u64>,
    /// The tree size it last cosigned (0 before the first).
    pub size: u64,
}

impl Live {
    /// Note where the evidence is kept and the replica it records as.
    pub(super) fn started(&self, dir: &Path, replica: &str) {
        let _ = self.dir.set(dir.to_path_buf());
        let _ = self.replica.set(replica.to_string());
    }

    pub fn records_written(&self) -> u64 {
        self.records_written.load(Ordering::Relaxed)
    }

    pub fn write_errors(&self) -> u64 {
        self.write_errors.load(Ordering::Relaxed)
    }

    pub fn queue_depth(&self) -> u64 {
        self.queue_depth.load(Ordering::Relaxed)
    }

    /// How full the store is, and whose records fill it.
    /// The live tap on written records ([`tap`]).
    pub(crate) fn tap(&self) -> &tap::Tap {
        &self.tap
    }

    pub(crate) fn store(&self) -> &Arc<store::Store> {
        &self.store
    }

    /// The replica this instance records as (empty before it started).
    pub fn replica(&self) -> &str {
        self.replica.get().map_or("", String::as_str)
    }

    /// Bytes free for unprivileged writers, and the size, of the file
    /// system holding the evidence dir (statvfs), when known.
    pub fn disk_space(&self) -> Option<(u64, u64)> {
        let st = rustix::fs::statvfs(self.dir.get()?).ok()?;
        let unit = st.f_frsize.max(1);
        Some((
            st.f_bavail.saturating_mul(unit),
            st.f_blocks.saturating_mul(unit),
        ))
    }

    pub(super) fn written(&self, lines: u64) {
        self.records_written.fetch_add(lines, Ordering::Relaxed);
    }

    pub(super) fn write_failed(&self) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn set_queue_depth(&self, depth: usize) {
        self.queue_depth.store(depth as u64, Ordering::Relaxed);
    }

    /// Writes whose leaves the witnesses' full queue could not take (the
    /// submitter reads them from the store instead).
    pub fn witness_feed_drops(&self) -> u64 {
        self.witness_dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn witness_feed_dropped(&self) {
        self.witness_dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Every witness's counts.
    pub fn witnesses(&self) -> Vec<WitnessCounts> {
        self.witnesses.lock().map(|w| w.clone()).unwrap_or_default()
    }

    /// Change witness `i`'s counts (adding it, and any before it, if new).
    pub(crate) fn witness(&self, i: usize, name: &str, f: impl FnOnce(&mut WitnessCounts)) {
        if let Ok(mut w) = self.witnesses.lock() {
            while w.len() <= i {
                w.push(WitnessCounts::default());
            }
            w[i].name = name.to_string();
            f(&mut w[i]);
        }
    }
}
