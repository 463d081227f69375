//! `palisade evidence verify`: check a directory (or one segment file) end to
//! end: every line in canonical form, every hash, `seq` and `prev` link,
//! every segment header (its own name, its link to the segment before, how
//! the one before ended), every checkpoint signature, and a sealed end.
//!
//! The first problem is reported with its file and line. A torn last line
//! (a crash mid-write) is told apart from tampering: it is accepted inside
//! the chain only where the next segment's header recorded it, and at the
//! very end it is "truncated tail at FILE:LINE, N records intact".

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use ed25519_dalek::VerifyingKey;
use serde_json::{Map, Value};

use super::chain::{self, GENESIS};
use super::field::Fields;
use super::merkle::{self, Frontier, OrgTrees};
use super::note;
use super::segment::{self, split_lines};
use super::CONTRACT_FIELDS;

/// What to accept.
#[derive(Debug, Default, Clone)]
pub(crate) struct Options {
    /// The public key every checkpoint must be signed with. Without it the
    /// key named in the segment headers is used (consistency, not origin).
    pub key: Option<VerifyingKey>,
    /// Accept an end that is not sealed (live or crashed instance).
    pub allow_unsealed: bool,
}

/// An intact evidence set.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub files: usize,
    /// Every chained record, headers and checkpoints included.
    pub records: u64,
    /// Decision and close records.
    pub traffic: u64,
    pub allow: u64,
    pub deny: u64,
    pub closes: u64,
    pub checkpoints: u64,
    pub first_ts: Option<String>,
    pub last_ts: Option<String>,
    /// Decisions per org (`unknown` for clients of no org): (allow, deny).
    pub orgs: BTreeMap<String, (u64, u64)>,
    pub first_seq: u64,
    pub last_seq: u64,
    pub sealed: bool,
    /// Records after the last checkpoint (unsealed end).
    pub unsigned_tail: u64,
    /// `truncated tail at FILE:LINE` when the end is torn.
    pub torn_tail: Option<String>,
    pub key: Option<String>,
    pub key_pinned: bool,
    /// Things that are not errors but an assessor should know.
    pub notes: Vec<String>,
    /// Segments retention removed, as the headers still here record them,
    /// oldest first.
    pub removed: Vec<Removed>,
    /// The `format` of the segment headers, each once.
    pub formats: Vec<String>,
    /// Checkpoints whose `tree_size`, `root` and signed `note` were
    /// checked against the records.
    pub merkle_checkpoints: u64,
    /// The last checked checkpoint's tree size and root (hex).
    pub tree: Option<(u64, String)>,
}

/// A segment retention removed, as a later segment's header records it:
/// its name, the seq and time span of its records. Its records are not
/// here: they are in the shipped copy, if it was shipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Removed {
    pub segment: String,
    pub first_seq: u64,
    pub last_seq: u64,
    /// Empty when the header that recorded the removal predates the field
    /// (only the seq span is known then).
    pub first_ts: String,
    pub last_ts: String,
}

impl fmt::Display for Removed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: seq {}..={}, {} .. {}",
            self.segment,
            self.first_seq,
            self.last_seq,
            or_unknown(&self.first_ts),
            or_unknown(&self.last_ts)
        )
    }
}

/// Removed segments listed one by one; past this, counted.
const REMOVED_SHOWN: usize = 20;

impl Removed {
    /// One entry of a header's `removed` list.
    fn of(v: &Value) -> Option<Removed> {
        let m = v.as_object()?;
        let segment = m.text("segment")?.to_string();
        let last_seq = m.get("last_seq").and_then(Value::as_u64)?;
        // Older headers name no first seq: the segment's name holds it.
        let first_seq = m
            .get("first_seq")
            .and_then(Value::as_u64)
            .or_else(|| segment::first_seq_of(&segment))
            .unwrap_or(0);
        Some(Removed {
            segment,
            first_seq,
            last_seq,
            first_ts: m.text("first_ts").unwrap_or_default().to_string(),
            last_ts: m.text("last_ts").unwrap_or_default().to_string(),
        })
    }

    /// Whether this segment's time span meets `since..until` (open ends
    /// when `None`); a span not known meets every window.
    pub(crate) fn meets(&self, since: Option<SystemTime>, until: Option<SystemTime>) -> bool {
        let at = |t: &str| humantime::parse_rfc3339_weak(t).ok();
        let (Some(first), Some(last)) = (at(&self.first_ts), at(&self.last_ts)) else {
            return true;
        };
        since.is_none_or(|s| last >= s) && until.is_none_or(|u| first <= u)
    }
}

/// The segments retention removed from the chain in `dir` (a directory
/// of segments), as the headers still there record them, oldest first.
/// Reads only the headers.
pub(crate) fn removed_segments(dir: &Path) -> Vec<Removed> {
    let Ok(list) = segment::list(dir) else {
        return Vec::new();
    };
    let headers: Vec<Map<String, Value>> = list.iter().filter_map(|p| header_of(p)).collect();
    removed_in(&headers)
}

fn removed_in<'a>(headers: impl IntoIterator<Item = &'a Map<String, Value>>) -> Vec<Removed> {
    let mut v: Vec<Removed> = headers
        .into_iter()
        .filter_map(|h| h.get("removed").and_then(Value::as_array))
        .flatten()
        .filter_map(Removed::of)
        .collect();
    v.sort_by_key(|r| r.first_seq);
    v.dedup();
    v
}

/// For a report over `since..until` of the chain in `dir`: what retention
/// removed from that window, as one line naming the seq and time span and
/// pointing at the shipped copy; `None` when it removed nothing there.
/// (`probe report` prints it beside its verdicts.)
pub(crate) fn retention_cut(
    dir: &Path,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
) -> Option<String> {
    let cut: Vec<Removed> = removed_segments(dir)
        .into_iter()
        .filter(|r| r.meets(since, until))
        .collect();
    let (first, last) = (cut.first()?, cut.last()?);
    Some(format!(
        "retention removed {} segment(s) of {} inside this window (seq {}..={}, {} .. {}): records there are missing here, read them in the shipped copy",
        cut.len(),
        dir.display(),
        first.first_seq,
        last.last_seq,
        or_unknown(&first.first_ts),
        or_unknown(&last.last_ts),
    ))
}

impl fmt::Display for Findings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "intact: {} records in {} files (seq {}..={})",
            self.records, self.files, self.first_seq, self.last_seq
        )?;
        writeln!(
            f,
            "  time span: {} .. {}",
            self.first_ts.as_deref().unwrap_or("-"),
            self.last_ts.as_deref().unwrap_or("-")
        )?;
        writeln!(
            f,
            "  decisions: {} allow, {} deny; {} close records; {} checkpoints",
            self.allow, self.deny, self.closes, self.checkpoints
        )?;
        let orgs: Vec<String> = self
            .orgs
            .iter()
            .map(|(o, (a, d))| format!("{o} ({a} allow, {d} deny)"))
            .collect();
        writeln!(
            f,
            "  orgs: {}",
            if orgs.is_empty() {
                "-".into()
            } else {
                orgs.join(", ")
            }
        )?;
        writeln!(
            f,
            "  signatures: {} key {}",
            if self.key_pinned {
                "pinned"
            } else {
                "embedded (pass --key to pin)"
            },
            self.key.as_deref().unwrap_or("-")
        )?;
        match &self.tree {
            Some((size, root)) => writeln!(
                f,
                "  merkle: {} checkpoint roots match the records; last tree_size {size} root {root}",
                self.merkle_checkpoints
            )?,
            None => writeln!(f, "  merkle: no checkpoint with a tree root")?,
        }
        writeln!(f, "  format: {}", self.formats.join(", "))?;
        if self.sealed {
            write!(f, "  end: sealed")?;
        } else {
            write!(
                f,
                "  end: NOT sealed; {} records after the last checkpoint",
                self.unsigned_tail
            )?;
            if let Some(t) = &self.torn_tail {
                write!(f, "; {t}")?;
            }
        }
        for n in &self.notes {
            write!(f, "\n  note: {n}")?;
        }
        if let Some(line) = self.removed_line() {
            write!(f, "\n  {line}")?;
            for r in self.removed.iter().take(REMOVED_SHOWN) {
                write!(f, "\n    {r}")?;
            }
            if self.removed.len() > REMOVED_SHOWN {
                write!(
                    f,
                    "\n    ... and {} more",
                    self.removed.len() - REMOVED_SHOWN
                )?;
            }
        }
        Ok(())
    }
}

impl Findings {
    /// What retention removed, in one line, if anything.
    pub(crate) fn removed_line(&self) -> Option<String> {
        let (first, last) = (self.removed.first()?, self.removed.last()?);
        Some(format!(
            "removed by retention: {} segments, seq {}..={}, {} .. {} (not here: read them in the shipped copy)",
            self.removed.len(),
            first.first_seq,
            last.last_seq,
            or_unknown(&first.first_ts),
            or_unknown(&last.last_ts),
        ))
    }
}

fn or_unknown(ts: &str) -> &str {
    if ts.is_empty() {
        "?"
    } else {
        ts
    }
}

/// The first problem found.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub(crate) struct VerifyError {
    pub file: String,
    pub line: u64,
    pub message: String,
}

fn files(path: &Path) -> Result<(Vec<PathBuf>, bool), VerifyError> {
    let err = |message: String| VerifyError {
        file: path.display().to_string(),
        line: 0,
        message,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if meta.is_file() {
        return Ok((vec![path.to_path_buf()], true));
    }
    let list = segment::list(path).map_err(|e| err(e.to_string()))?;
    if list.is_empty() {
        return Err(err("no evidence segments (*.jsonl)".into()));
    }
    Ok((list, false))
}

/// The header of a segment: its first line, if it parses.
fn header_of(path: &Path) -> Option<Map<String, Value>> {
    let data = std::fs::read(path).ok()?;
    let end = data.iter().position(|b| *b == b'\n')?;
    match serde_json::from_slice::<Value>(&data[..end]).ok()? {
        Value::Object(m) if m.get("event").and_then(Value::as_str) == Some("segment_start") => {
            Some(m)
        }
        _ => None,
    }
}

/// A header's `tree` against the tree of the records before it: the same
/// when both are known; adopted when the records before it are not here
/// (it must then end at this header); required by format `/2`.
fn check_header_tree(
    m: &Map<String, Value>,
    seq: u64,
    required: bool,
    tree: &mut Option<(u64, Frontier)>,
) -> Result<(), String> {
    let Some(t) = m.get("tree") else {
        return if required {
            Err("header lacks the Merkle tree its format requires: record edited".into())
        } else {
            Ok(())
        };
    };
    let (base, f) = merkle::frontier_of_json(t)
        .ok_or_else(|| "header's Merkle tree is malformed".to_string())?;
    match tree {
        Some((b, mine)) if *b == base => {
            if *mine != f {
                return Err(format!(
                    "header's Merkle tree (size {}) does not match the records before it: inconsistent tree",
                    f.size()
                ));
            }
        }
        Some(_) if !(f.size() == 0 && base == seq) => {
            return Err(
                "header's Merkle tree starts at another record than the chain's: inconsistent tree"
                    .into(),
            );
        }
        _ => {
            if base + f.size() != seq {
                return Err(format!(
                    "header's Merkle tree ends at seq {} but the header is seq {seq}: inconsistent tree",
                    base + f.size()
                ));
            }
            *tree = Some((base, f));
        }
    }
    Ok(())
}

/// A header's `org_trees` against the org trees of the records before it
/// (adopted when they are not known: the first header of a store written
/// before them, or one whose start retention removed).
fn check_header_orgs(
    m: &Map<String, Value>,
    required: bool,
    trees: &mut Option<OrgTrees>,
) -> Result<(), String> {
    let Some(t) = m.get("org_trees") else {
        if required {
            return Err("header lacks the org trees its format requires: record edited".into());
        }
        return Ok(());
    };
    let t = OrgTrees::of_json(t).ok_or_else(|| "header's org trees are malformed".to_string())?;
    match trees {
        Some(mine) if *mine != t => {
            Err("header's org trees do not match the records before it: inconsistent tree".into())
        }
        Some(_) => Ok(()),
        None => {
            *trees = Some(t);
            Ok(())
        }
    }
}

/// A checkpoint's `org_count` and `orgs_root` against the org trees of
/// the records before it.
fn check_checkpoint_orgs(
    m: &Map<String, Value>,
    required: bool,
    trees: Option<&OrgTrees>,
) -> Result<(), String> {
    if !m.contains_key("orgs_root") && !m.contains_key("org_count") {
        if required {
            return Err("checkpoint lacks org_count and orgs_root: record edited".into());
        }
        return Ok(());
    }
    trees
        .ok_or("checkpoint has an orgs_root but no header here records the org trees")?
        .check(m)
}

/// A checkpoint's `tree_size`, `root` and `note` against the tree of the
/// records before it, the key and the replica's origin. `Some((size,
/// root))` when checked; `None` for a checkpoint of format `/1`.
fn check_checkpoint_tree(
    m: &Map<String, Value>,
    key: &VerifyingKey,
    required: bool,
    tree: Option<&(u64, Frontier)>,
    origin: Option<&str>,
) -> Result<Option<(u64, String)>, String> {
    let (size, root, signed) = (
        m.get("tree_size").and_then(Value::as_u64),
        m.text("root"),
        m.text("note"),
    );
    let (Some(size), Some(root), Some(signed)) = (size, root, signed) else {
        if required
            || m.contains_key("tree_size")
            || m.contains_key("root")
            || m.contains_key("note")
        {
            return Err("checkpoint lacks tree_size, root or note: record edited".into());
        }
        return Ok(None);
    };
    let Some((_, f)) = tree else {
        return Err("checkpoint has a tree root but no header here records the tree".into());
    };
    if size != f.size() {
        return Err(format!(
            "checkpoint tree_size {size} but {} records precede it in the tree: inconsistent checkpoint",
            f.size()
        ));
    }
    let mine = data_encoding::HEXLOWER.encode(&f.root());
    if root != mine {
        return Err(format!(
            "checkpoint root does not match the {size} records before it: inconsistent checkpoint (the first; a rewritten past)"
        ));
    }
    let c = note::open_checkpoint(signed, key).map_err(|e| format!("checkpoint note: {e}"))?;
    if c.size != size || data_encoding::HEXLOWER.encode(&c.root) != root {
        return Err(format!(
            "checkpoint note says tree size {} root {}, the record says {size} {root}: note edited or swapped",
            c.size,
            data_encoding::HEXLOWER.encode(&c.root)
        ));
    }
    if let Some(o) = origin {
        if c.origin != o {
            return Err(format!(
                "checkpoint note's origin {:?} does not name this replica ({o:?})",
                c.origin
            ));
        }
    }
    Ok(Some((size, mine)))
}

/// Check every record under `path` with default options (sealed end
/// required, embedded key).
#[cfg(test)]
pub(crate) fn verify_path(path: &Path) -> Result<Findings, VerifyError> {
    verify_with(path, &Options::default())
}

/// A `key_rotation` record: signed by the chain's key so far; the key
/// it names from here on.
fn check_rotation(
    m: &Map<String, Value>,
    key: Option<&VerifyingKey>,
) -> Result<VerifyingKey, String> {
    let k = key.ok_or("key_rotation but no public key to check it")?;
    if !chain::check_sig(m, k) {
        return Err("key_rotation not signed by the chain's key: an unannounced key change".into());
    }
    m.text("next_key")
        .and_then(chain::parse_pubkey)
        .ok_or_else(|| "key_rotation names no valid next_key".into())
}

/// Why a checkpoint's signature does not verify with `k`: a key no
/// `key_rotation` record announced, or an edit.
fn unannounced(m: &Map<String, Value>, k: &VerifyingKey, event: &str) -> String {
    let chain_key = data_encoding::HEXLOWER.encode(k.as_bytes());
    match m.text("key") {
        Some(other) if other != chain_key => format!(
            "{event} signature is by key {other}, not the chain's key {chain_key}, and no key_rotation record announced it: an unannounced key change"
        ),
        _ => format!("bad {event} signature"),
    }
}

/// Check every record under `path`.
pub(crate) fn verify_with(path: &Path, opts: &Options) -> Result<Findings, VerifyError> {
    let (list, single) = files(path)?;
    let headers: Vec<Option<Map<String, Value>>> = list.iter().map(|p| header_of(p)).collect();
    let mut walk = Walk::new(&headers, list.len(), single, opts);
    for (i, file) in list.iter().enumerate() {
        let next_header = headers.get(i + 1).and_then(|h| h.as_ref());
        walk.segment(file, next_header, i + 1 == list.len())?;
    }
    walk.finish(&list)
}

/// The walk over the segments, oldest first: what the records so far
/// established, against which the next record is checked.
struct Walk<'o> {
    opts: &'o Options,
    /// One segment given, not a directory.
    single: bool,
    /// Hashes of segments removed by retention, as recorded by later headers.
    removed: HashSet<String>,
    found: Findings,
    key: Option<VerifyingKey>,
    prev_hash: Option<String>,
    prev_seq: Option<u64>,
    last_event: String,
    /// Records since the last checkpoint.
    unsigned: u64,
    last_line: u64,
    /// The Merkle tree over the records so far (its base seq and right
    /// edge), once known: from the first record of a chain that starts at
    /// genesis, or from the first header recording it.
    tree: Option<(u64, Frontier)>,
    /// The current segment's format requires the tree.
    merkle_required: bool,
    /// Every org's tree ([`OrgTrees`]), once known, and whether the
    /// current segment's format (`/3`) requires them.
    org_trees: Option<OrgTrees>,
    orgs_required: bool,
    origin: Option<String>,
}

impl<'o> Walk<'o> {
    fn new(
        headers: &[Option<Map<String, Value>>],
        files: usize,
        single: bool,
        opts: &'o Options,
    ) -> Self {
        let removed = headers
            .iter()
            .flatten()
            .filter_map(|h| h.get("removed").and_then(Value::as_array))
            .flatten()
            .filter_map(|r| r.get("last_hash").and_then(Value::as_str).map(String::from))
            .collect();
        let found = Findings {
            files,
            key_pinned: opts.key.is_some(),
            key: opts
                .key
                .as_ref()
                .map(|k| data_encoding::HEXLOWER.encode(k.as_bytes())),
            removed: removed_in(headers.iter().flatten()),
            ..Findings::default()
        };
        Walk {
            opts,
            single,
            removed,
            found,
            key: opts.key,
            prev_hash: None,
            prev_seq: None,
            last_event: String::new(),
            unsigned: 0,
            last_line: 0,
            tree: None,
            merkle_required: false,
            org_trees: None,
            orgs_required: false,
            origin: None,
        }
    }

    /// One segment file; `next_header` is its successor's header, which
    /// says how it ended.
    fn segment(
        &mut self,
        file: &Path,
        next_header: Option<&Map<String, Value>>,
        last: bool,
    ) -> Result<(), VerifyError> {
        let name = file.display().to_string();
        let base = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let data = std::fs::read(file).map_err(|e| VerifyError {
            file: name.clone(),
            line: 0,
            message: e.to_string(),
        })?;
        let (lines, torn) = split_lines(&data);
        // How this segment's successor says it ended.
        let successor = next_header
            .and_then(|h| h.get("predecessor"))
            .and_then(Value::as_object)
            .filter(|p| p.text("segment") == Some(base.as_str()));
        let counted = successor
            .and_then(|p| p.get("lines"))
            .and_then(Value::as_u64)
            .map_or(lines.len(), |n| (n as usize).min(lines.len()));
        if counted < lines.len() {
            self.found.notes.push(format!(
                "{name}: lines {}..={} were cut off after a write error (recorded by the next segment's header)",
                counted + 1,
                lines.len()
            ));
        }
        for (n, raw) in lines.iter().take(counted).enumerate() {
            let line = n as u64 + 1;
            self.record(raw, n == 0, &name, &base)
                .map_err(|message| VerifyError {
                    file: name.clone(),
                    line,
                    message,
                })?;
            self.last_line = line;
        }
        if counted == lines.len() && !torn.is_empty() {
            self.torn_end(name, lines.len() as u64 + 1, successor, last)?;
        }
        Ok(())
    }

    /// One record line, the first of its segment when `first`.
    fn record(&mut self, raw: &[u8], first: bool, name: &str, base: &str) -> Result<(), String> {
        let value: Value = serde_json::from_slice(raw)
            .map_err(|e| format!("not a JSON record ({e}): record edited"))?;
        let Value::Object(m) = &value else {
            return Err("not a JSON object".into());
        };
        let mut canon = Vec::with_capacity(raw.len());
        chain::canonical_into(&value, &mut canon);
        if canon != *raw {
            return Err("line is not in canonical form: record edited".into());
        }
        if let Some(missing) = CONTRACT_FIELDS.iter().find(|k| !m.contains_key(**k)) {
            return Err(format!("record lacks field {missing:?}"));
        }
        let hash = m.text("hash").ok_or("record has no hash")?;
        if chain::record_hash(m) != hash {
            return Err("hash does not match the record: record edited".into());
        }
        let seq = m.need_u64("seq", || "record has no seq")?;
        let prev = m.text("prev").ok_or("record has no prev")?;
        let event = m.text("event").unwrap_or_default();
        if first {
            self.header(m, seq, prev, name, base)?;
        } else if event == "segment_start" {
            return Err("segment_start header inside a segment: record inserted".into());
        }
        self.links(seq, prev)?;
        self.checkpoint(m, event)?;
        self.count(m, event)?;
        self.advance(m, seq, hash, event);
        Ok(())
    }

    /// A segment's first record: its `segment_start` header, which names
    /// the segment, its format, its key and the segment before it.
    fn header(
        &mut self,
        m: &Map<String, Value>,
        seq: u64,
        prev: &str,
        name: &str,
        base: &str,
    ) -> Result<(), String> {
        if m.text("event") != Some("segment_start") {
            return Err("segment does not start with a segment_start header".into());
        }
        let format = m.text("format").unwrap_or("palisade-evidence/1");
        if !self.found.formats.iter().any(|f| f == format) {
            self.found.formats.push(format.to_string());
        }
        self.merkle_required = format != "palisade-evidence/1";
        self.orgs_required = !matches!(format, "palisade-evidence/1" | "palisade-evidence/2");
        self.origin = m.text("replica").map(note::origin);
        if self.prev_hash.is_none() && prev == GENESIS {
            self.tree = Some((0, Frontier::default()));
            self.org_trees = Some(OrgTrees::default());
        }
        check_header_tree(m, seq, self.merkle_required, &mut self.tree)?;
        check_header_orgs(m, self.orgs_required, &mut self.org_trees)?;
        if m.text("segment") != Some(base) && !self.single {
            return Err(format!(
                "header names segment {:?}, file is {base:?}: segment renamed or swapped",
                m.text("segment").unwrap_or("")
            ));
        }
        if self.key.is_none() {
            self.key = m.text("key").and_then(chain::parse_pubkey);
            self.found.key = m.text("key").map(String::from);
        }
        let pred = m.get("predecessor").and_then(Value::as_object);
        match (&self.prev_hash, pred) {
            (None, _) => self.chain_start(seq, prev, name),
            (Some(_), None) => Err("header does not describe the segment before it".into()),
            (Some(_), Some(p)) => self.predecessor(p),
        }
    }

    /// The first header of the walk: the chain starts at genesis, after a
    /// segment retention removed, or (one segment given) after one not
    /// checked here.
    fn chain_start(&mut self, seq: u64, prev: &str, name: &str) -> Result<(), String> {
        self.found.first_seq = seq;
        if prev == GENESIS || self.removed.contains(prev) {
            return Ok(());
        }
        if !self.single {
            return Err(format!(
                "chain starts at seq {seq} linking to {prev}, which no segment and no retention record accounts for: earlier segment missing"
            ));
        }
        self.found.notes.push(format!(
            "{name} continues a chain from an earlier segment not checked here"
        ));
        Ok(())
    }

    /// A header's account of the segment before it, against that segment.
    fn predecessor(&self, p: &Map<String, Value>) -> Result<(), String> {
        let end = p.text("end").unwrap_or_default();
        let closed = matches!(self.last_event.as_str(), "seal" | "checkpoint");
        if !closed && !matches!(end, "crash" | "write_error") {
            return Err(format!(
                "the segment before ends without a checkpoint but this header says it ended by {end:?}"
            ));
        }
        if p.get("last_seq").and_then(Value::as_u64) != self.prev_seq {
            return Err(
                "header's predecessor last_seq does not match the segment before: records missing"
                    .into(),
            );
        }
        Ok(())
    }

    /// The record follows the one before: the next seq, and its hash as
    /// `prev`.
    fn links(&self, seq: u64, prev: &str) -> Result<(), String> {
        if let Some(ps) = self.prev_seq {
            if seq != ps + 1 {
                return Err(format!(
                    "seq {seq} follows seq {ps}: record deleted, inserted or reordered"
                ));
            }
        }
        if let Some(ph) = &self.prev_hash {
            if prev != ph {
                return Err(
                    "prev does not match the previous record's hash: record deleted, inserted or reordered"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// A checkpoint or seal: its signature, and the trees it signs.
    fn checkpoint(&mut self, m: &Map<String, Value>, event: &str) -> Result<(), String> {
        if event == "key_rotation" {
            self.key = Some(check_rotation(m, self.key.as_ref())?);
            self.found.notes.push(format!(
                "seq {}: key rotated to {} by a record signed with the key before",
                m.get("seq").and_then(Value::as_u64).unwrap_or_default(),
                m.text("next_key").unwrap_or_default()
            ));
            return Ok(());
        }
        if !matches!(event, "checkpoint" | "seal") {
            self.unsigned += 1;
            return Ok(());
        }
        let Some(k) = &self.key else {
            return Err("checkpoint but no public key to check it".into());
        };
        if !chain::check_sig(m, k) {
            return Err(unannounced(m, k, event));
        }
        if let Some((size, root)) = check_checkpoint_tree(
            m,
            k,
            self.merkle_required,
            self.tree.as_ref(),
            self.origin.as_deref(),
        )? {
            self.found.merkle_checkpoints += 1;
            self.found.tree = Some((size, root));
        }
        check_checkpoint_orgs(m, self.orgs_required, self.org_trees.as_ref())?;
        self.found.checkpoints += 1;
        self.unsigned = 0;
        Ok(())
    }

    /// Decisions and closes counted, per org too.
    fn count(&mut self, m: &Map<String, Value>, event: &str) -> Result<(), String> {
        let s = &mut self.found;
        match event {
            "decision" => {
                s.traffic += 1;
                let org = m.text("org").unwrap_or("unknown").to_string();
                let e = s.orgs.entry(org).or_default();
                match m.text("decision") {
                    Some("allow") => {
                        s.allow += 1;
                        e.0 += 1;
                    }
                    Some("deny") => {
                        s.deny += 1;
                        e.1 += 1;
                    }
                    other => return Err(format!("bad decision {other:?}")),
                }
            }
            "close" => {
                s.traffic += 1;
                s.closes += 1;
            }
            _ => {}
        }
        Ok(())
    }

    /// The record checked: it is what the next one follows, and a leaf of
    /// the trees.
    fn advance(&mut self, m: &Map<String, Value>, seq: u64, hash: &str, event: &str) {
        if let Some(ts) = m.text("ts") {
            if self.found.first_ts.is_none() {
                self.found.first_ts = Some(ts.to_string());
            }
            self.found.last_ts = Some(ts.to_string());
        }
        if let Some((_, f)) = &mut self.tree {
            f.push(merkle::record_leaf(hash));
        }
        if let Some(o) = &mut self.org_trees {
            o.push_record(m);
        }
        self.found.records += 1;
        self.found.last_seq = seq;
        self.prev_seq = Some(seq);
        self.prev_hash = Some(hash.to_string());
        self.last_event = event.to_string();
    }

    /// An incomplete last line: accepted at the end of the last segment
    /// with `allow_unsealed`, elsewhere only where the next header records
    /// it.
    fn torn_end(
        &mut self,
        name: String,
        torn_line: u64,
        successor: Option<&Map<String, Value>>,
        last: bool,
    ) -> Result<(), VerifyError> {
        let recorded = successor.is_some_and(|p| {
            p.get("torn_line").and_then(Value::as_u64) == Some(torn_line)
                || p.text("end") == Some("write_error")
        });
        if last {
            let msg = format!(
                "truncated tail at {name}:{torn_line}, {} records intact",
                self.found.records
            );
            if !self.opts.allow_unsealed {
                return Err(VerifyError {
                    file: name,
                    line: torn_line,
                    message: format!("{msg} (a crash mid-write; --allow-unsealed accepts it)"),
                });
            }
            self.found.torn_tail = Some(msg);
        } else if !recorded {
            return Err(VerifyError {
                file: name,
                line: torn_line,
                message: "incomplete line that the next segment's header does not record: segment truncated"
                    .into(),
            });
        } else {
            self.found.notes.push(format!(
                "{name}:{torn_line}: torn line from a crash, recorded by the next segment's header"
            ));
        }
        Ok(())
    }

    /// The end of the chain: sealed, or accepted unsealed.
    fn finish(self, list: &[PathBuf]) -> Result<Findings, VerifyError> {
        let mut s = self.found;
        s.sealed = self.last_event == "seal";
        s.unsigned_tail = self.unsigned;
        if !s.sealed && !self.opts.allow_unsealed {
            let last = list
                .last()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            return Err(VerifyError {
                file: last,
                line: self.last_line,
                message: format!(
                    "chain end is not sealed ({} records after the last checkpoint): records may have been dropped from the tail; --allow-unsealed accepts a live or crashed instance",
                    self.unsigned
                ),
            });
        }
        Ok(s)
    }
}
