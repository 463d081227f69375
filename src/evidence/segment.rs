//! Segment files: naming, listing and reading the tail of the chain.
//!
//! A segment is `palisade-<first seq, 20 digits>.jsonl`; names sort in chain
//! order. A new segment is written as `*.jsonl.tmp` with its header and only
//! then renamed into place, so a crash never leaves a segment without one.

use foldhash::{HashMap, HashMapExt};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::merkle::{self, Frontier, OrgTrees};

pub(crate) const PREFIX: &str = "palisade-";
pub(crate) const SUFFIX: &str = ".jsonl";

pub(crate) fn segment_name(first_seq: u64) -> String {
    format!("{PREFIX}{first_seq:020}{SUFFIX}")
}

/// The first seq a segment's name holds (`palisade-<seq>.jsonl`).
pub(crate) fn first_seq_of(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?
        .strip_suffix(SUFFIX)?
        .parse()
        .ok()
}

/// Segment files in `dir`, in chain order.
pub(crate) fn list(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(SUFFIX))
        })
        .collect();
    v.sort();
    Ok(v)
}

/// Remove `*.jsonl.tmp` left by a crash during rotation (they were never
/// part of the chain).
pub(crate) fn remove_stale_tmp(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.to_str().is_some_and(|n| n.ends_with(".jsonl.tmp")) {
                let _ = fs::remove_file(&p);
            }
        }
    }
}

/// Split file content into complete lines and a torn remainder (bytes after
/// the last newline).
pub(crate) fn split_lines(data: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let mut lines = Vec::new();
    let mut start = 0;
    for (i, b) in data.iter().enumerate() {
        if *b == b'\n' {
            lines.push(&data[start..i]);
            start = i + 1;
        }
    }
    (lines, &data[start..])
}

/// The bytes of each org's records in the segment at `path` (`None`: the
/// clients of no org), lines included whole; headers, checkpoints and
/// anything unreadable count for no one. Reads the file once; finds the
/// `org` key by its text, which in a canonical line cannot occur inside a
/// string (a quote there is escaped). Only decision and close records
/// count, as when they are written.
pub(crate) fn bytes_by_org(path: &Path) -> HashMap<Option<Arc<str>>, u64> {
    const KEY: &[u8] = b",\"org\":";
    let mut held: HashMap<Option<Arc<str>>, u64> = HashMap::new();
    let Ok(data) = fs::read(path) else {
        return held;
    };
    let mut names: HashMap<&[u8], Arc<str>> = HashMap::new();
    let has = |line: &[u8], text: &[u8]| line.windows(text.len()).any(|w| w == text);
    for line in data.split(|b| *b == b'\n') {
        // Decision and close records only, as the writer counts them.
        if !has(line, b"\"event\":\"decision\"") && !has(line, b"\"event\":\"close\"") {
            continue;
        }
        let Some(at) = line.windows(KEY.len()).position(|w| w == KEY) else {
            continue;
        };
        let value = &line[at + KEY.len()..];
        let org = if value.starts_with(b"null") {
            None
        } else if let Some(rest) = value.strip_prefix(b"\"") {
            let Some(end) = rest.iter().position(|b| *b == b'"') else {
                continue;
            };
            let name = &rest[..end];
            let interned = names
                .entry(name)
                .or_insert_with(|| Arc::from(String::from_utf8_lossy(name).as_ref()));
            Some(interned.clone())
        } else {
            continue;
        };
        *held.entry(org).or_insert(0) += line.len() as u64 + 1;
    }
    held
}

/// What the end of a segment looks like.
#[derive(Debug, Clone)]
pub(crate) struct Tail {
    pub name: String,
    /// Complete lines that parse as chained records.
    pub lines: u64,
    pub last_seq: u64,
    pub last_hash: String,
    pub last_event: String,
    /// The first chained record's seq and time (the segment's header).
    pub first_seq: u64,
    pub first_ts: String,
    pub last_ts: String,
    /// Records after the last checkpoint or seal.
    pub unsigned: u64,
    /// Line number of a torn (incomplete) last line.
    pub torn_line: Option<u64>,
}

impl Tail {
    /// `seal`, `checkpoint` (closed by rotation), or `crash`.
    pub(crate) fn end(&self) -> &'static str {
        match self.last_event.as_str() {
            "seal" => "seal",
            "checkpoint" => "checkpoint",
            _ => "crash",
        }
    }

    /// The `predecessor` object of the next segment's header.
    pub(crate) fn to_json(&self, end: &str) -> Value {
        let mut m = Map::new();
        m.insert("segment".into(), self.name.clone().into());
        m.insert("lines".into(), self.lines.into());
        m.insert("last_seq".into(), self.last_seq.into());
        m.insert("last_hash".into(), self.last_hash.clone().into());
        m.insert("end".into(), end.into());
        m.insert("unsigned".into(), self.unsigned.into());
        m.insert(
            "torn_line".into(),
            self.torn_line.map_or(Value::Null, Value::from),
        );
        Value::Object(m)
    }
}

/// Read a segment and find its last chained record. Lines that do not
/// parse stop the scan: the head is the record before them.
pub(crate) fn read_tail(path: &Path) -> io::Result<Tail> {
    let data = fs::read(path)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (lines, rest) = split_lines(&data);
    let mut tail = Tail {
        name,
        lines: 0,
        last_seq: 0,
        last_hash: String::new(),
        last_event: String::new(),
        first_seq: 0,
        first_ts: String::new(),
        last_ts: String::new(),
        unsigned: 0,
        torn_line: None,
    };
    for line in &lines {
        let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(line) else {
            break;
        };
        let (Some(seq), Some(hash)) = (
            m.get("seq").and_then(Value::as_u64),
            m.get("hash").and_then(Value::as_str),
        ) else {
            break;
        };
        if tail.lines == 0 {
            tail.first_seq = seq;
            tail.first_ts = m
                .get("ts")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
        }
        tail.lines += 1;
        tail.last_seq = seq;
        tail.last_hash = hash.to_string();
        tail.last_event = m
            .get("event")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        tail.last_ts = m
            .get("ts")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if matches!(tail.last_event.as_str(), "checkpoint" | "seal") {
            tail.unsigned = 0;
        } else {
            tail.unsigned += 1;
        }
    }
    if tail.lines == lines.len() as u64 && !rest.is_empty() {
        tail.torn_line = Some(tail.lines + 1);
    }
    if tail.lines == 0 {
        return Err(io::Error::other(format!(
            "{}: no chained record in the segment",
            path.display()
        )));
    }
    Ok(tail)
}

/// The longest header line read: a header holds the chain link, the
/// Merkle frontier, the org trees and the segments retention removed,
/// far below this.
const MAX_HEADER: u64 = 4 << 20;

/// The first line of a segment, parsed. Reads that line only (at most
/// [`MAX_HEADER`] bytes), not the segment.
pub(crate) fn header(path: &Path) -> Option<Map<String, Value>> {
    use std::io::{BufRead, Read};
    let file = fs::File::open(path).ok()?;
    let mut line = Vec::new();
    io::BufReader::new(file.take(MAX_HEADER))
        .read_until(b'\n', &mut line)
        .ok()?;
    if line.pop() != Some(b'\n') {
        return None;
    }
    match serde_json::from_slice::<Value>(&line).ok()? {
        Value::Object(m) => Some(m),
        _ => None,
    }
}

/// The time of a segment's header (`ts`): when its first record was
/// written, and so when the segment before it was last written to.
fn header_ts(path: &Path) -> Option<std::time::SystemTime> {
    let h = header(path)?;
    humantime::parse_rfc3339_weak(h.get("ts")?.as_str()?).ok()
}

/// The segments of `list` (in chain order) that may hold a record
/// written at or after `since`: the newest ones back to the first whose
/// successor's header is dated before `since` (a segment is last written
/// just before the next one starts). Reads one header per segment kept,
/// plus one; a header that cannot be read or dated keeps the segment
/// before it (reading more, never missing a record). A segment spanning
/// `since` is kept whole. The walk ends at the newest header dated
/// before `since`: a caller allows for a clock set back by widening
/// `since` (the window of a restart: [`crate::jit::replay`]).
pub(crate) fn since(list: Vec<PathBuf>, since: std::time::SystemTime) -> Vec<PathBuf> {
    let mut first = list.len().saturating_sub(1);
    while first > 0 {
        let started = header_ts(&list[first]);
        if started.is_some_and(|t| t < since) {
            break;
        }
        first -= 1;
    }
    list.into_iter().skip(first).collect()
}

/// Call `f` with every chained record of the segments `list[start..]`, in
/// order: complete lines that parse, as many of a segment's lines as the
/// next segment's header says belong to the chain. Stops at the first
/// line that does not parse, or when `f` returns false. Reads one segment
/// at a time.
pub(crate) fn for_each_record(
    list: &[PathBuf],
    start: usize,
    mut f: impl FnMut(&Map<String, Value>) -> bool,
) {
    for i in start..list.len() {
        let Ok(data) = fs::read(&list[i]) else { return };
        let (lines, _) = split_lines(&data);
        let name = list[i]
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let counted = list
            .get(i + 1)
            .and_then(|p| header(p))
            .and_then(|h| h.get("predecessor").cloned())
            .filter(|p| p.get("segment").and_then(Value::as_str) == name.as_deref())
            .and_then(|p| p.get("lines").and_then(Value::as_u64))
            .map_or(lines.len(), |n| (n as usize).min(lines.len()));
        for line in &lines[..counted] {
            let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(line) else {
                return;
            };
            if !f(&m) {
                return;
            }
        }
    }
}

/// The Merkle tree at the chain head (the record `last_seq`) of the
/// segments `list`: `(base, frontier)`. Replays the records from the
/// newest header that records the tree (normally the last segment's), or
/// from the start of a chain that predates the tree; a chain whose start
/// is gone and that never recorded a tree gets a new tree starting at the
/// next record.
pub(crate) fn tree_at_head(list: &[PathBuf], last_seq: u64) -> (u64, Frontier) {
    let fresh = (last_seq + 1, Frontier::default());
    let mut from = None;
    for (i, p) in list.iter().enumerate().rev() {
        let Some(h) = header(p) else { continue };
        if let Some(t) = h.get("tree").and_then(merkle::frontier_of_json) {
            from = Some((i, t));
            break;
        }
        if h.get("prev").and_then(Value::as_str) == Some(super::chain::GENESIS) {
            from = Some((i, (0, Frontier::default())));
            break;
        }
    }
    let Some((start, (base, mut tree))) = from else {
        return fresh;
    };
    // A header's tree covers the records before it: replay from the header.
    let mut next = base + tree.size();
    for_each_record(list, start, |m| {
        let (Some(seq), Some(hash)) = (
            m.get("seq").and_then(Value::as_u64),
            m.get("hash").and_then(Value::as_str),
        ) else {
            return false;
        };
        if seq != next {
            return false;
        }
        tree.push(merkle::record_leaf(hash));
        next += 1;
        seq < last_seq
    });
    if next == last_seq + 1 {
        (base, tree)
    } else {
        tracing::warn!(
            "evidence: the Merkle tree could not be rebuilt up to seq {last_seq}; a new tree starts at the next record"
        );
        fresh
    }
}

/// The org trees at the chain head `last_seq` of the segments `list`
/// (a restart): from the last header holding `org_trees` (or a chain
/// starting at genesis), replaying the records after it. `None` when no
/// header holds them (a store written before the org trees, whose trees
/// then start at the next header) or the replay does not reach the head.
pub(crate) fn orgs_at_head(list: &[PathBuf], last_seq: u64) -> Option<OrgTrees> {
    let mut from = None;
    for (i, p) in list.iter().enumerate().rev() {
        let Some(h) = header(p) else {
            continue;
        };
        if let Some(t) = h.get("org_trees").and_then(OrgTrees::of_json) {
            from = Some((i, t));
            break;
        }
        if h.get("prev").and_then(Value::as_str) == Some(super::chain::GENESIS) {
            from = Some((i, OrgTrees::default()));
            break;
        }
    }
    let (start, mut trees) = from?;
    let mut reached = false;
    for_each_record(list, start, |m| {
        let Some(seq) = m.get("seq").and_then(Value::as_u64) else {
            return false;
        };
        trees.push_record(m);
        reached = seq == last_seq;
        seq < last_seq
    });
    reached.then_some(trees)
}
