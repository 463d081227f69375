//! Witnesses (c2sp.org/tlog-witness): every new checkpoint is submitted to
//! each `[evidence] witnesses` entry with `add-checkpoint`, with the
//! consistency proof from the tree size that witness last cosigned; its
//! cosignature (c2sp.org/tlog-cosignature) is kept beside the store, in
//! `DIR/witness/cosignatures.jsonl`.
//!
//! Submission never holds up a decision: the writer hands each write's
//! leaves and checkpoints to a bounded queue ([`QUEUE`] writes; a full
//! queue drops, counted, and the submitter reads the leaves it then lacks
//! from the store) and one thread of its own submits, with a timeout per
//! request and a backoff per witness. An unreachable witness is a metric
//! and a warning; a witness that refuses a checkpoint as inconsistent with
//! what it saw before (409 naming a size that is not ours, 422) is an
//! error, a metric and a `refused` line in the same file, carrying the
//! signed note it refused.
//!
//! Only the newest checkpoint is submitted to a witness: its cosignature
//! covers every earlier checkpoint of the same tree, since a witness
//! cosigns only a tree consistent with every one it saw before and each
//! checkpoint's tree is a prefix of the next ([`check_store`]).

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use data_encoding::{BASE64, HEXLOWER};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value};
use tokio::sync::Notify;
use tracing::{error, warn};

use super::chain::GENESIS;
use super::merkle::{self, Frontier, Hash};
use super::note::{self, Vkey, COSIGNATURE_V1};
use super::writer::{Feed, Signed};
use super::{segment, Evidence, Live};
use crate::config::{Durability, EvidenceConfig, WitnessConfig};

/// Why a submission failed, as `palisade_witness_failures_total` labels it.
pub(crate) const REASONS: [&str; 7] = [
    "unreachable",
    "timeout",
    "unknown_log",
    "forbidden",
    "bad_request",
    "bad_reply",
    "no_proof",
];

/// Writes whose leaves may wait for the submitter.
pub(crate) const QUEUE: usize = 1024;
/// One `add-checkpoint` request, connection included.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Leaves kept in memory past the smallest size a witness cosigned; past
/// it the oldest go, and a witness that far behind is proved from disk.
const MAX_WINDOW: usize = 1 << 20;
/// The longest witness reply read.
const MAX_REPLY: usize = 64 * 1024;
/// Where the cosignatures are kept, under the evidence dir.
pub(crate) const SUBDIR: &str = "witness";
pub(crate) const FILE: &str = "cosignatures.jsonl";

/// The file of cosignatures and refusals of the store at `dir`.
pub(crate) fn file_of(dir: &Path) -> PathBuf {
    dir.join(SUBDIR).join(FILE)
}

/// The body of an `add-checkpoint` request.
pub(crate) fn request_body(old: u64, proof: &[Hash], note: &str) -> String {
    let mut b = format!("old {old}\n");
    for h in proof {
        b.push_str(&BASE64.encode(h));
        b.push('\n');
    }
    b.push('\n');
    b.push_str(note);
    b
}

/// What a witness answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// 200: its cosignature, and its time.
    Cosigned { line: String, time: u64 },
    /// 409 with the size it last cosigned.
    Size(u64),
    /// 409 without a size: same size, another root.
    Conflict,
    /// 422: the consistency proof does not verify against what it saw.
    ProofRefused,
    /// Anything else: the failure reason (a metric label) and a detail.
    Failed(&'static str, String),
}

/// Read a witness's answer to a request for checkpoint `body`.
pub(crate) fn read_reply(
    status: u16,
    content_type: Option<&str>,
    reply: &[u8],
    body: &str,
    witness: &Vkey,
) -> Reply {
    let text = String::from_utf8_lossy(reply);
    let short: String = text.chars().take(200).collect();
    match status {
        200 => match note::open_cosignature(&text, body, witness) {
            Ok(time) => {
                let line = text
                    .lines()
                    .find(|l| note::open_cosignature(&format!("{l}\n"), body, witness) == Ok(time))
                    .map(|l| format!("{l}\n"))
                    .unwrap_or_default();
                Reply::Cosigned { line, time }
            }
            Err(e) => Reply::Failed("bad_reply", format!("200 without its cosignature: {e}")),
        },
        409 => {
            let sized = content_type.is_some_and(|c| c.trim().starts_with("text/x.tlog.size"));
            match text.trim_end_matches('\n').parse::<u64>() {
                Ok(n) if sized => Reply::Size(n),
                _ => Reply::Conflict,
            }
        }
        422 => Reply::ProofRefused,
        404 => Reply::Failed(
            "unknown_log",
            format!("404: the witness does not know this log's origin: {short}"),
        ),
        403 => Reply::Failed(
            "forbidden",
            format!("403: the witness does not trust this log's key: {short}"),
        ),
        400 => Reply::Failed("bad_request", format!("400: {short}")),
        s => Reply::Failed("unreachable", format!("HTTP {s}: {short}")),
    }
}

/// One configured witness and what is known of it.
struct Witness {
    url: http::Uri,
    key: Vkey,
    /// The size it last cosigned, once known.
    size: Option<u64>,
    /// Not before this is it asked again (backoff).
    retry_at: Instant,
    backoff: Duration,
    /// The last checkpoint it refused (not submitted again until a new one).
    refused: Option<u64>,
}

/// The submitter's state: the witnesses, the newest checkpoint, and the
/// leaves after the smallest size a witness cosigned.
struct Submitter {
    dir: PathBuf,
    fsync: bool,
    live: Arc<Live>,
    witnesses: Vec<Witness>,
    newest: Option<Signed>,
    /// The tree before `leaves`.
    base: Frontier,
    leaves: Vec<Hash>,
    /// `base`/`leaves` hold the tree up to the newest leaf written.
    whole: bool,
}

/// Start submitting `evidence`'s checkpoints to `cfg.witnesses` (none: nothing).
pub(crate) fn start(evidence: &Evidence, cfg: &EvidenceConfig) -> io::Result<()> {
    if cfg.witnesses.is_empty() || cfg.durability == Durability::Discard {
        return Ok(());
    }
    let witnesses = cfg
        .witnesses
        .iter()
        .map(|w: &WitnessConfig| {
            Ok(Witness {
                url: w.url.clone(),
                key: Vkey::parse(&w.key, COSIGNATURE_V1)
                    .map_err(|e| io::Error::other(format!("witness key {:?} {e}", w.key)))?,
                size: None,
                retry_at: Instant::now(),
                backoff: BACKOFF_MIN,
                refused: None,
            })
        })
        .collect::<io::Result<Vec<_>>>()?;
    let live = evidence.live().clone();
    for (i, w) in witnesses.iter().enumerate() {
        live.witness(i, &w.key.name, |_| {});
    }
    let mut s = Submitter {
        dir: cfg.dir.clone(),
        fsync: cfg.durability == Durability::Fsync,
        live: live.clone(),
        witnesses,
        newest: None,
        base: Frontier::default(),
        leaves: Vec::new(),
        whole: false,
    };
    let (tx, rx) = mpsc::sync_channel::<Feed>(QUEUE);
    let wake = Arc::new(Notify::new());
    let stopping = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (w2, s2) = (wake.clone(), stopping.clone());
    std::thread::Builder::new()
        .name("evidence-witness".into())
        .spawn(move || {
            rt.block_on(s.run(rx, w2, s2));
            let _ = done_tx.send(());
        })?;
    let w3 = wake.clone();
    let sink = Box::new(move |feed: Feed| {
        if tx.try_send(feed).is_err() {
            // Full: the submitter finds the gap and reads the store.
            live.witness_feed_dropped();
        }
        w3.notify_one();
    });
    let after_seal = Box::new(move || {
        stopping.store(true, Ordering::Relaxed);
        wake.notify_one();
        // The seal's checkpoint gets one bounded try.
        let _ = done_rx.recv_timeout(TIMEOUT + Duration::from_secs(2));
    });
    evidence.feed(sink, after_seal);
    Ok(())
}

impl Submitter {
    async fn run(
        &mut self,
        rx: mpsc::Receiver<Feed>,
        wake: Arc<Notify>,
        stopping: Arc<AtomicBool>,
    ) {
        loop {
            let due = self
                .witnesses
                .iter()
                .map(|w| w.retry_at)
                .min()
                .unwrap_or_else(Instant::now)
                .max(Instant::now());
            let sleep = tokio::time::sleep_until(due.into());
            tokio::select! {
                () = wake.notified() => {}
                () = sleep => {}
            }
            loop {
                match rx.try_recv() {
                    Ok(f) => self.take(f),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            let last = stopping.load(Ordering::Relaxed);
            self.submit_due(last).await;
            if last {
                return;
            }
        }
    }

    /// Add a write's leaves and checkpoints.
    fn take(&mut self, f: Feed) {
        let end = self.base.size() + self.leaves.len() as u64;
        if !self.whole || f.before.size() != end {
            // The first feed, or one after a dropped one: start again here.
            self.base = f.before;
            self.leaves.clear();
            self.whole = true;
        }
        self.leaves.extend_from_slice(&f.leaves);
        if let Some(c) = f.checkpoints.into_iter().last() {
            self.newest = Some(c);
        }
        if self.leaves.len() > MAX_WINDOW {
            let cut = self.leaves.len() - MAX_WINDOW;
            self.advance(cut);
        }
    }

    /// Move `n` leaves from the window into its base.
    fn advance(&mut self, n: usize) {
        for l in self.leaves.drain(..n) {
            self.base.push(l);
        }
    }

    async fn submit_due(&mut self, last: bool) {
        let Some(c) = self.newest.clone() else {
            return;
        };
        for i in 0..self.witnesses.len() {
            let w = &self.witnesses[i];
            let current = w.size == Some(c.size) || w.refused == Some(c.size);
            if current || (!last && Instant::now() < w.retry_at) {
                continue;
            }
            self.submit(i, &c).await;
        }
        // Keep only the leaves some witness may still need a proof from.
        let known: Option<u64> = self.witnesses.iter().map(|w| w.size).min().flatten();
        if let Some(m) = known {
            let n = m
                .saturating_sub(self.base.size())
                .min(self.leaves.len() as u64);
            self.advance(n as usize);
        }
    }

    /// Submit checkpoint `c` to witness `i`: at most three requests (the
    /// first may learn the witness's size from a 409).
    async fn submit(&mut self, i: usize, c: &Signed) {
        let body_text = note::checkpoint_body(&origin_of(&c.note), c.size, &c.root);
        for _ in 0..3 {
            let w = &self.witnesses[i];
            let old = w.size.unwrap_or(0);
            if old > c.size {
                let why = format!(
                    "the witness cosigned tree size {old}, larger than this log's {}: it saw another history",
                    c.size
                );
                return self.conflict(i, c, Some(old), &why);
            }
            let proof = if old == 0 || old == c.size {
                Vec::new()
            } else {
                match self.proof(old, c.size, &c.root) {
                    Ok(p) => p,
                    Err(e) => return self.failed(i, "no_proof", &e),
                }
            };
            let req = request_body(old, &proof, &c.note);
            let reply = match post(&w.url, req).await {
                Ok((status, ctype, bytes)) => {
                    read_reply(status, ctype.as_deref(), &bytes, &body_text, &w.key)
                }
                Err((reason, e)) => return self.failed(i, reason, &e),
            };
            match reply {
                Reply::Cosigned { line, time } => return self.cosigned(i, c, &line, time),
                Reply::Size(n) if n != old && n <= c.size => {
                    self.witnesses[i].size = Some(n);
                }
                Reply::Size(n) => {
                    let why = format!(
                        "409: the witness cosigned tree size {n}, which this log's checkpoint of size {} does not extend",
                        c.size
                    );
                    return self.conflict(i, c, Some(n), &why);
                }
                Reply::Conflict => {
                    let why = format!(
                        "409: the witness holds another root for tree size {}",
                        c.size
                    );
                    return self.conflict(i, c, Some(old), &why);
                }
                Reply::ProofRefused => {
                    let why = format!(
                        "422: the witness refused the consistency proof from tree size {old}: the tree it cosigned there is not this log's"
                    );
                    return self.conflict(i, c, Some(old), &why);
                }
                Reply::Failed(reason, e) => return self.failed(i, reason, &e),
            }
        }
        self.failed(i, "bad_reply", "the witness's size kept changing");
    }

    /// The consistency proof from size `old` to the checkpoint (`new`,
    /// `root`): from the window, or else from the store.
    fn proof(&self, old: u64, new: u64, root: &Hash) -> Result<Vec<Hash>, String> {
        let b = self.base.size();
        let end = b + self.leaves.len() as u64;
        if self.whole && old >= b && new <= end {
            let mut f = self.base.clone();
            for l in &self.leaves[..(old - b) as usize] {
                f.push(*l);
            }
            return Ok(merkle::consistency_proof_from(
                &f,
                &self.leaves[(old - b) as usize..(new - b) as usize],
            ));
        }
        let leaves = store_leaves(&self.dir, new)?;
        if leaves.len() < new as usize || merkle::root(&leaves[..new as usize]) != *root {
            return Err(format!(
                "the store does not hold the tree of size {new} its checkpoint signs"
            ));
        }
        Ok(merkle::consistency_proof(
            &leaves[..new as usize],
            old as usize,
        ))
    }

    fn cosigned(&mut self, i: usize, c: &Signed, line: &str, time: u64) {
        let w = &mut self.witnesses[i];
        w.size = Some(c.size);
        w.backoff = BACKOFF_MIN;
        w.retry_at = Instant::now();
        let name = w.key.name.clone();
        self.live.witness(i, &name, |n| {
            n.cosigned += 1;
            n.size = c.size;
        });
        let mut m = self.line(i, "cosigned", c);
        m.insert("time".into(), time.into());
        m.insert("cosignature".into(), line.into());
        self.keep(&m);
    }

    fn conflict(&mut self, i: usize, c: &Signed, size: Option<u64>, why: &str) {
        let w = &mut self.witnesses[i];
        w.refused = Some(c.size);
        w.size = size;
        w.retry_at = Instant::now() + BACKOFF_MAX;
        let name = w.key.name.clone();
        error!(witness = %name, url = %w.url, tree_size = c.size, seq = c.seq, "witness refused the checkpoint: {why}");
        self.live.witness(i, &name, |n| n.conflicts += 1);
        let mut m = self.line(i, "refused", c);
        m.insert("witness_size".into(), size.into());
        m.insert("detail".into(), why.into());
        m.insert("note".into(), c.note.clone().into());
        self.keep(&m);
    }

    fn failed(&mut self, i: usize, reason: &'static str, why: &str) {
        let w = &mut self.witnesses[i];
        w.retry_at = Instant::now() + w.backoff;
        w.backoff = (w.backoff * 2).min(BACKOFF_MAX);
        let name = w.key.name.clone();
        warn!(witness = %name, url = %w.url, reason, "witness submission failed (retrying): {why}");
        self.live.witness(i, &name, |n| {
            *n.failures.entry(reason).or_insert(0) += 1;
        });
    }

    fn line(&self, i: usize, event: &str, c: &Signed) -> Map<String, Value> {
        let w = &self.witnesses[i];
        let mut m = Map::new();
        m.insert("ts".into(), super::writer::now_ts().into());
        m.insert("event".into(), event.into());
        m.insert("witness".into(), note::vkey_of(&w.key).into());
        m.insert("url".into(), w.url.to_string().into());
        m.insert("origin".into(), origin_of(&c.note).into());
        m.insert("seq".into(), c.seq.into());
        m.insert("tree_size".into(), c.size.into());
        m.insert("root".into(), HEXLOWER.encode(&c.root).into());
        m
    }

    /// Append a line to the cosignatures file.
    fn keep(&self, m: &Map<String, Value>) {
        let path = file_of(&self.dir);
        let r = (|| {
            if let Some(p) = path.parent() {
                fs::create_dir_all(p)?;
            }
            let mut f = OpenOptions::new().create(true).append(true).open(&path)?;
            let mut line = serde_json::to_vec(m).map_err(io::Error::other)?;
            line.push(b'\n');
            f.write_all(&line)?;
            if self.fsync {
                f.sync_data()?;
            }
            Ok::<(), io::Error>(())
        })();
        if let Err(e) = r {
            error!(path = %path.display(), error = %e, "witness cosignature not kept");
        }
    }
}

/// The origin line of a note.
fn origin_of(note: &str) -> String {
    note.split('\n').next().unwrap_or_default().to_string()
}

/// POST a request to `PREFIX/add-checkpoint`: status, content type, body;
/// or a failure reason and detail.
async fn post(
    url: &http::Uri,
    body: String,
) -> Result<(u16, Option<String>, Bytes), (&'static str, String)> {
    let go = async {
        let host = url.host().unwrap_or_default();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = url.port_u16().unwrap_or(80);
        let stream = tokio::net::TcpStream::connect((host, port))
            .await
            .map_err(|e| ("unreachable", format!("connect {host}:{port}: {e}")))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ("unreachable", e.to_string()))?;
        tokio::spawn(conn);
        let path = format!("{}/add-checkpoint", url.path().trim_end_matches('/'));
        let authority = url.authority().map(|a| a.to_string()).unwrap_or_default();
        let req = http::Request::post(path)
            .header(http::header::HOST, authority)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ("bad_request", e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ("unreachable", e.to_string()))?;
        let status = resp.status().as_u16();
        let ctype = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = Limited::new(resp.into_body(), MAX_REPLY)
            .collect()
            .await
            .map_err(|e| ("bad_reply", e.to_string()))?
            .to_bytes();
        Ok((status, ctype, bytes))
    };
    match tokio::time::timeout(TIMEOUT, go).await {
        Ok(r) => r,
        Err(_) => Err(("timeout", format!("no answer within {TIMEOUT:?}"))),
    }
}

/// Every leaf of the store at `dir` up to `upto`: the store must hold the
/// first records of its tree.
fn store_leaves(dir: &Path, upto: u64) -> Result<Vec<Hash>, String> {
    let list = segment::list(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut leaves = Vec::new();
    let mut problem = None;
    segment::for_each_record(&list, 0, |m| {
        if leaves.is_empty() {
            let fresh = m
                .get("tree")
                .and_then(merkle::frontier_of_json)
                .is_some_and(|(_, f)| f.size() == 0);
            if m.get("prev").and_then(Value::as_str) != Some(GENESIS) && !fresh {
                problem =
                    Some("the store lacks the first records of its tree (retention)".to_string());
                return false;
            }
        }
        let hash = m.get("hash").and_then(Value::as_str).unwrap_or_default();
        leaves.push(merkle::record_leaf(hash));
        (leaves.len() as u64) < upto
    });
    match problem {
        Some(p) => Err(p),
        None => Ok(leaves),
    }
}

/// Cosignatures kept for the store at `dir`, as `(tree size, root hex,
/// witness key text, signature line)`.
pub(crate) fn kept(dir: &Path) -> Vec<(u64, String, String, String)> {
    let Ok(text) = fs::read_to_string(file_of(dir)) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<Map<String, Value>>(l).ok())
        .filter(|m| m.get("event").and_then(Value::as_str) == Some("cosigned"))
        .filter_map(|m| {
            Some((
                m.get("tree_size")?.as_u64()?,
                m.get("root")?.as_str()?.to_string(),
                m.get("witness")?.as_str()?.to_string(),
                m.get("cosignature")?.as_str()?.to_string(),
            ))
        })
        .collect()
}

/// A checkpoint as `verify --witness-key` sees it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub seq: u64,
    pub size: u64,
    pub root: Hash,
    pub origin: String,
}

/// The checkpoints of a store (a dir of segments), in chain order.
pub(crate) fn checkpoints(dir: &Path) -> Result<Vec<Seen>, String> {
    let list = segment::list(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    segment::for_each_record(&list, 0, |m| {
        if let (Some(seq), Some(size), Some(note)) = (
            m.get("seq").and_then(Value::as_u64),
            m.get("tree_size").and_then(Value::as_u64),
            m.get("note").and_then(Value::as_str),
        ) {
            if let Ok(c) = note::parse_checkpoint(note.split("\n\n").next().unwrap_or_default()) {
                let _ = size;
                out.push(Seen {
                    seq,
                    size: c.size,
                    root: c.root,
                    origin: c.origin,
                });
            }
        }
        true
    });
    Ok(out)
}

/// Check that witness `w` cosigned `checkpoints` (in chain order): each is
/// covered by a valid cosignature of `w` on it or on a later checkpoint of
/// the same tree. `cosigs` are `(tree size, signature line)` pairs. A
/// cosignature by `w` for a checkpoint's size that does not verify on it
/// (another root: the history was rewritten) fails, naming the
/// checkpoint; so does the first checkpoint after the last one covered.
pub(crate) fn check_witnessed(
    checkpoints: &[Seen],
    cosigs: &[(u64, String)],
    w: &Vkey,
) -> Result<usize, String> {
    let mut by_size: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    for (size, line) in cosigs {
        by_size.entry(*size).or_default().push(line);
    }
    let mut covered_to: Option<usize> = None;
    let mut count = 0;
    for (i, c) in checkpoints.iter().enumerate() {
        let Some(lines) = by_size.get(&c.size) else {
            continue;
        };
        let body = note::checkpoint_body(&c.origin, c.size, &c.root);
        for line in lines {
            match note::open_cosignature(line, &body, w) {
                Ok(_) => {
                    covered_to = Some(i);
                    count += 1;
                }
                Err(note::CosignatureError::Missing(_)) => {}
                Err(e) => {
                    return Err(format!(
                        "checkpoint seq {} (tree size {}): {e}: witness {} cosigned another tree of this size, so this history is not the one it saw",
                        c.seq, c.size, w.name
                    ))
                }
            }
        }
    }
    let first_uncovered = match covered_to {
        None => checkpoints.first(),
        Some(i) => checkpoints.get(i + 1),
    };
    if let Some(c) = first_uncovered {
        return Err(format!(
            "checkpoint seq {} (tree size {}) carries no cosignature of witness {} (nor does any later one): not witnessed",
            c.seq, c.size, note::vkey_of(w)
        ));
    }
    Ok(count)
}

/// `verify --witness-key`: every checkpoint of the store at `dir` is
/// witnessed by each of `keys`. What passed, or which checkpoint failed.
pub(crate) fn check_store(dir: &Path, keys: &[Vkey]) -> Result<String, String> {
    let cps = checkpoints(dir)?;
    let kept = kept(dir);
    let mut out = Vec::new();
    for w in keys {
        let cosigs: Vec<(u64, String)> = kept
            .iter()
            .map(|(size, _, _, line)| (*size, line.clone()))
            .collect();
        let n = check_witnessed(&cps, &cosigs, w)?;
        out.push(format!(
            "witness {}: {} checkpoint(s) cosigned, all {} covered",
            w.name,
            n,
            cps.len()
        ));
    }
    Ok(out.join("\n"))
}

/// The file of an org export holding its witnesses' cosignatures.
pub(crate) const EXPORT_FILE: &str = "witness.json";

/// The end checkpoint of an export (`proofs.json`): seq, size, root, origin.
fn export_end(dir: &Path) -> Result<Seen, String> {
    let text =
        fs::read_to_string(dir.join("proofs.json")).map_err(|e| format!("proofs.json: {e}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("proofs.json: {e}"))?;
    let c = &v["end"]["checkpoint"];
    let note = c["note"]
        .as_str()
        .ok_or("proofs.json: end checkpoint without a note")?;
    let body = note::parse_checkpoint(note.split("\n\n").next().unwrap_or_default())
        .map_err(|e| format!("proofs.json: end checkpoint: {e}"))?;
    Ok(Seen {
        seq: c["seq"].as_u64().unwrap_or_default(),
        size: body.size,
        root: body.root,
        origin: body.origin,
    })
}

/// Write `witness.json` into the export at `out`: for each witness of the
/// store at `store`, its cosignature of the export's end checkpoint, or of
/// the first later checkpoint it cosigned with the consistency proof from
/// the end checkpoint to it. Returns how many witnesses it holds.
pub(crate) fn export_cosignatures(store: &Path, out: &Path) -> Result<usize, String> {
    let kept = kept(store);
    if kept.is_empty() {
        return Ok(0);
    }
    let end = export_end(out)?;
    // Only cosignatures of this store's checkpoints (not of a history the
    // store no longer holds).
    let ours: std::collections::BTreeSet<(u64, String)> = checkpoints(store)?
        .into_iter()
        .map(|c| (c.size, HEXLOWER.encode(&c.root)))
        .collect();
    let mut best: BTreeMap<String, (u64, String, String)> = BTreeMap::new();
    for (size, r, w, line) in kept {
        if size < end.size || !ours.contains(&(size, r.clone())) {
            continue;
        }
        let e = best.entry(w).or_insert((size, r.clone(), line.clone()));
        if size < e.0 {
            *e = (size, r, line);
        }
    }
    let mut list = Vec::new();
    for (w, (size, r, line)) in &best {
        let hashes = if *size == end.size {
            Value::Array(Vec::new())
        } else {
            super::proof::prove_consistency(store, end.size, *size)?["hashes"].clone()
        };
        list.push(serde_json::json!({
            "witness": w, "origin": end.origin, "tree_size": size, "root": r,
            "cosignature": line, "consistency": hashes,
        }));
    }
    let v = serde_json::json!({"from_tree_size": end.size, "cosignatures": list});
    let text = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
    fs::write(out.join(EXPORT_FILE), text + "\n").map_err(|e| format!("{EXPORT_FILE}: {e}"))?;
    Ok(best.len())
}

/// `verify-export --witness-key`: the export's end checkpoint (which
/// covers its start) is cosigned by each of `keys`, directly or through a
/// later checkpoint and a consistency proof to it.
pub(crate) fn check_export(dir: &Path, keys: &[Vkey]) -> Result<String, String> {
    let end = export_end(dir)?;
    let named = format!(
        "the export's end checkpoint (seq {}, tree size {})",
        end.seq, end.size
    );
    let v: Value = fs::read_to_string(dir.join(EXPORT_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    let entries = v["cosignatures"].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for w in keys {
        let mut why = format!(
            "{named} carries no cosignature of witness {}",
            note::vkey_of(w)
        );
        let mut ok = None;
        for e in &entries {
            let (Some(size), Some(root), Some(line)) = (
                e["tree_size"].as_u64(),
                e["root"].as_str().and_then(super::chain::unhex::<32>),
                e["cosignature"].as_str(),
            ) else {
                why = format!("{EXPORT_FILE}: an entry without tree_size, root or cosignature");
                continue;
            };
            let body = note::checkpoint_body(&end.origin, size, &root);
            match note::open_cosignature(line, &body, w) {
                Err(note::CosignatureError::Missing(_)) => continue,
                Err(e) => {
                    why = format!("{named}: {e}");
                    continue;
                }
                Ok(_) => {}
            }
            let proof = merkle::hash_list(e.get("consistency"), "consistency")?;
            let holds = if size == end.size {
                root == end.root
            } else {
                merkle::verify_consistency(end.size, size, &end.root, &root, &proof).is_ok()
            };
            if holds {
                ok = Some(size);
                break;
            }
            why = format!(
                "{named}: witness {} cosigned tree size {size}, which does not extend it",
                w.name
            );
        }
        let Some(size) = ok else {
            return Err(why);
        };
        out.push(format!(
            "witness {} cosigned tree size {size}, which extends {named}",
            w.name
        ));
    }
    Ok(out.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    fn wkey(seed: u8, name: &str) -> (SigningKey, Vkey) {
        let sk = SigningKey::from_bytes(&[seed; 32]);
        let v = Vkey {
            name: name.into(),
            kind: COSIGNATURE_V1,
            key: sk.verifying_key(),
        };
        (sk, v)
    }

    #[test]
    fn request_bodies_are_the_spec_s() {
        let b = request_body(3, &[[0u8; 32], [255u8; 32]], "o\n5\nAAAA\n\n\u{2014} o x\n");
        assert_eq!(
            b,
            "old 3\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n//////////////////////////////////////////8=\n\no\n5\nAAAA\n\n\u{2014} o x\n"
        );
        assert_eq!(request_body(0, &[], "n\n"), "old 0\n\nn\n");
    }

    #[test]
    fn replies_are_read_as_the_spec_says() {
        let (sk, v) = wkey(5, "w.test/a");
        let body = "palisade/r\n4\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n";
        let line = note::cosign(body, "w.test/a", &sk, 1700000000);
        let (_, other) = wkey(6, "w.test/b");
        let other_line = note::cosign(body, "w.test/b", &SigningKey::from_bytes(&[6; 32]), 1);
        let both = format!("{other_line}{line}");
        assert_eq!(
            read_reply(200, None, both.as_bytes(), body, &v),
            Reply::Cosigned {
                line: line.clone(),
                time: 1700000000
            }
        );
        assert!(matches!(
            read_reply(200, None, other_line.as_bytes(), body, &v),
            Reply::Failed("bad_reply", _)
        ));
        let _ = other;
        assert_eq!(
            read_reply(409, Some("text/x.tlog.size"), b"17\n", body, &v),
            Reply::Size(17)
        );
        assert_eq!(
            read_reply(409, Some("text/plain"), b"17\n", body, &v),
            Reply::Conflict
        );
        assert_eq!(read_reply(422, None, b"", body, &v), Reply::ProofRefused);
        for (s, r) in [
            (404, "unknown_log"),
            (403, "forbidden"),
            (400, "bad_request"),
            (500, "unreachable"),
        ] {
            assert!(
                matches!(read_reply(s, None, b"x", body, &v), Reply::Failed(x, _) if x == r),
                "{s}"
            );
        }
    }

    #[test]
    fn witnessed_means_every_checkpoint_covered_by_a_valid_cosignature() {
        let (sk, v) = wkey(5, "w.test/a");
        let cp = |seq: u64, size: u64, r: u8| Seen {
            seq,
            size,
            root: [r; 32],
            origin: "palisade/r".into(),
        };
        let cosig = |c: &Seen| {
            (
                c.size,
                note::cosign(
                    &note::checkpoint_body(&c.origin, c.size, &c.root),
                    "w.test/a",
                    &sk,
                    9,
                ),
            )
        };
        let cps = vec![cp(10, 11, 1), cp(20, 21, 2), cp(30, 31, 3)];
        // The last one cosigned covers the earlier ones.
        assert_eq!(check_witnessed(&cps, &[cosig(&cps[2])], &v), Ok(1));
        // Not the last: the first after the covered ones is named.
        let e = check_witnessed(&cps, &[cosig(&cps[0])], &v).unwrap_err();
        assert!(e.contains("seq 20 (tree size 21)"), "{e}");
        let e = check_witnessed(&cps, &[], &v).unwrap_err();
        assert!(e.contains("seq 10"), "{e}");
        // A cosignature of another root at the same size: rewritten.
        let rewritten = vec![cp(10, 11, 1), cp(20, 21, 9), cp(30, 31, 3)];
        let e = check_witnessed(&rewritten, &[cosig(&cps[1]), cosig(&cps[2])], &v).unwrap_err();
        assert!(e.contains("seq 20") && e.contains("another tree"), "{e}");
        // An unknown witness's cosignatures cover nothing.
        let (_, stranger) = wkey(7, "w.test/a");
        let e = check_witnessed(&cps, &[cosig(&cps[2])], &stranger).unwrap_err();
        assert!(e.contains("no cosignature"), "{e}");
    }
}
