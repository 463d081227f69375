//! Fleet evidence: the chains of several replicas (Palisade instances),
//! each verified on its own and read as one stream merged by time.
//!
//! What is a fleet ([`resolve`]): several paths given, or one tree. A
//! directory holding segment files is one chain; a directory holding no
//! segment file but subdirectories that do is a tree, and every
//! (non-hidden) subdirectory of it is a replica. A subdirectory of a tree
//! holding no segment file is a replica whose chain is missing: it is named
//! as such, never skipped.
//!
//! A chain's replica name is the `replica` its newest segment header names,
//! or else its directory's name (a segment file given alone: its parent
//! directory's). Two chains with one name are bad input: which one a key or
//! a record belongs to would be ambiguous.
//!
//! Verification ([`check`]): each chain with [`verify::verify_with`], against
//! the key pinned for its replica ([`Pins`]). A chain's [`Status`]:
//!
//! | chain | key | `--allow-unsealed` | status | fails |
//! |---|---|---|---|---|
//! | verifies, sealed | pinned, or none pinned for any replica | any | intact | no |
//! | verifies, not sealed | as above | given | intact (unsealed noted) | no |
//! | verifies, not sealed | as above | not given | unsealed | yes |
//! | verifies | none pinned for it, others pinned | any | unpinned (unless `--allow-unpinned`) | yes |
//! | any problem [`verify`] finds | any | any | broken at FILE:LINE | yes |
//! | no segment file, or a key pinned for a replica not given | - | - | missing | yes |
//!
//! Reading ([`read_merged`]): each chain's decision and close records in
//! chain order, merged across replicas by `ts`, ties broken by replica
//! name, then `seq`. A k-way merge holds one record per replica in memory;
//! each chain keeps its own order, so if a replica wrote a record with an
//! earlier `ts` after a later one (records are stamped when submitted and
//! chained when written), the stream stays in that replica's chain order
//! there.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use ed25519_dalek::VerifyingKey;
use serde_json::Value;

use super::query::{self, ReadError, Stored};
use super::segment;
use super::verify::{self, Findings, VerifyError};

/// At most this many replicas in one fleet.
pub(crate) const MAX_REPLICAS: usize = 4096;
/// A segment header line longer than this is not read for its replica name.
const MAX_HEADER_LINE: u64 = 64 * 1024;
/// Longest replica name taken from a header.
const MAX_NAME: usize = 253;

/// Input that does not make a fleet (exit status 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct FleetError(pub String);

/// One replica's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chain {
    pub name: String,
    /// A directory of segments, or one segment file.
    pub path: PathBuf,
    /// Whether `name` came from the segment header (else the directory).
    pub named_by_header: bool,
}

/// A replica named but without a chain to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Missing {
    pub name: String,
    pub path: Option<PathBuf>,
    pub why: String,
}

/// The chains given, and the replicas missing among them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fleet {
    /// Sorted by name.
    pub chains: Vec<Chain>,
    pub missing: Vec<Missing>,
}

/// Does `dir` hold segment files?
fn holds_segments(dir: &Path) -> bool {
    segment::list(dir).is_ok_and(|l| !l.is_empty())
}

/// Non-hidden subdirectories of `dir`, sorted.
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Is `path` a fleet tree: a directory with no segment file of its own
/// and at least one subdirectory that holds segment files?
pub(crate) fn is_tree(path: &Path) -> bool {
    path.is_dir() && !holds_segments(path) && subdirs(path).iter().any(|d| holds_segments(d))
}

/// Whether `paths` are to be read as a fleet rather than as the one chain
/// `evidence verify PATH` has always checked.
pub(crate) fn is_fleet(paths: &[PathBuf]) -> bool {
    paths.len() != 1 || paths.iter().any(|p| is_tree(p))
}

/// The name of a directory (`evidence` for `/srv/evidence/`), or the path
/// as given when it has none.
fn dir_name(dir: &Path) -> String {
    let named = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| !n.is_empty() && n != "." && n != "..")
    };
    named(dir)
        .or_else(|| std::fs::canonicalize(dir).ok().as_deref().and_then(named))
        .unwrap_or_else(|| dir.display().to_string())
}

/// A replica name as a header may give it: printable, no whitespace.
fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name.chars().all(|c| !c.is_control() && !c.is_whitespace())
}

/// The `replica` of a `segment_start` header line, if it names a valid one.
pub(crate) fn replica_of_header_line(line: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(line).ok()?;
    if v.get("event").and_then(Value::as_str) != Some("segment_start") {
        return None;
    }
    v.get("replica")
        .and_then(Value::as_str)
        .filter(|n| valid_header_name(n))
        .map(String::from)
}

/// The replica the newest segment under `path` names in its header.
fn header_replica(path: &Path) -> Option<String> {
    let newest = if path.is_file() {
        path.to_path_buf()
    } else {
        segment::list(path).ok()?.pop()?
    };
    let file = std::fs::File::open(newest).ok()?;
    let mut line = Vec::new();
    BufReader::new(file)
        .take(MAX_HEADER_LINE)
        .read_until(b'\n', &mut line)
        .ok()?;
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    replica_of_header_line(&line)
}

fn chain_at(path: &Path) -> Chain {
    let dir = if path.is_file() {
        path.parent().unwrap_or(Path::new("."))
    } else {
        path
    };
    match header_replica(path) {
        Some(name) => Chain {
            name,
            path: path.to_path_buf(),
            named_by_header: true,
        },
        None => Chain {
            name: dir_name(dir),
            path: path.to_path_buf(),
            named_by_header: false,
        },
    }
}

/// The chains (and missing replicas) `paths` name: each path is a segment
/// file, a chain directory or a tree of them (see the module doc).
pub(crate) fn resolve(paths: &[PathBuf]) -> Result<Fleet, FleetError> {
    let mut fleet = Fleet::default();
    for path in paths {
        match std::fs::metadata(path) {
            Err(e) => fleet.missing.push(Missing {
                name: dir_name(path),
                path: Some(path.clone()),
                why: format!("{}: {e}", path.display()),
            }),
            Ok(m) if m.is_file() => fleet.chains.push(chain_at(path)),
            Ok(_) if holds_segments(path) => fleet.chains.push(chain_at(path)),
            Ok(_) => {
                let subs = subdirs(path);
                if !subs.iter().any(|d| holds_segments(d)) {
                    fleet.missing.push(Missing {
                        name: dir_name(path),
                        path: Some(path.clone()),
                        why: format!(
                            "{}: no evidence segments (*.jsonl), and no subdirectory holding any",
                            path.display()
                        ),
                    });
                    continue;
                }
                for d in subs {
                    if holds_segments(&d) {
                        fleet.chains.push(chain_at(&d));
                    } else {
                        fleet.missing.push(Missing {
                            name: dir_name(&d),
                            path: Some(d.clone()),
                            why: format!("{}: no evidence segments (*.jsonl)", d.display()),
                        });
                    }
                }
            }
        }
        if fleet.chains.len() + fleet.missing.len() > MAX_REPLICAS {
            return Err(FleetError(format!(
                "more than {MAX_REPLICAS} replicas given"
            )));
        }
    }
    check_names(&fleet)?;
    fleet.chains.sort_by(|a, b| a.name.cmp(&b.name));
    fleet.missing.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(fleet)
}

/// Every replica name appears once.
fn check_names(fleet: &Fleet) -> Result<(), FleetError> {
    let mut seen: BTreeMap<&str, String> = BTreeMap::new();
    let all = fleet
        .chains
        .iter()
        .map(|c| (c.name.as_str(), c.path.display().to_string()))
        .chain(fleet.missing.iter().map(|m| {
            (
                m.name.as_str(),
                m.path
                    .as_ref()
                    .map_or_else(String::new, |p| p.display().to_string()),
            )
        }));
    for (name, path) in all {
        if let Some(first) = seen.insert(name, path.clone()) {
            return Err(FleetError(format!(
                "replica name {name:?} is used by both {first} and {path}: give each instance its own [evidence] replica, or its own directory name"
            )));
        }
    }
    Ok(())
}

/// Checkpoint keys pinned per replica.
#[derive(Debug, Clone, Default)]
pub struct Pins {
    pub by_replica: BTreeMap<String, VerifyingKey>,
    /// A plain `--key`: pins the one chain given.
    pub single: Option<VerifyingKey>,
    /// Accept a replica with no pinned key while others have one.
    pub allow_unpinned: bool,
}

/// A replica name usable in `--key REPLICA=HEX` and a keys file.
pub(crate) fn valid_pin_name(name: &str) -> bool {
    valid_header_name(name) && !name.contains(['=', '/'])
}

/// `--key` value: `REPLICA=KEY` (the replica, and the key text: hex or a
/// file), or a plain `KEY`. A value whose part before `=` holds a `/` is a
/// plain key (a file path).
pub(crate) fn split_pin(arg: &str) -> (Option<&str>, &str) {
    match arg.split_once('=') {
        Some((name, key)) if valid_pin_name(name) => (Some(name), key),
        _ => (None, arg),
    }
}

/// The lines of a `--keys` file: `REPLICA HEX` (blank lines and `#`
/// comments ignored), each with its line number; or the first bad line as
/// `FILE:LINE: message`.
pub(crate) fn parse_keys_file(
    text: &str,
    file: &str,
) -> Result<Vec<(String, String, usize)>, FleetError> {
    let mut out: Vec<(String, String, usize)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.split_once('#').map_or(raw, |(a, _)| a).trim();
        if line.is_empty() {
            continue;
        }
        let bad = |m: String| FleetError(format!("{file}:{n}: {m}"));
        let mut words = line.split_whitespace();
        let (Some(name), Some(key), None) = (words.next(), words.next(), words.next()) else {
            return Err(bad("expected `REPLICA HEX`".into()));
        };
        if !valid_pin_name(name) {
            return Err(bad(format!("not a replica name: {name:?}")));
        }
        if out.iter().any(|(x, _, _)| x == name) {
            return Err(bad(format!("replica {name:?} pinned twice")));
        }
        out.push((name.to_string(), key.to_string(), n));
    }
    Ok(out)
}

/// What to accept when checking a fleet.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    pub pins: Pins,
    pub allow_unsealed: bool,
}

/// A replica's chain as checked.
#[derive(Debug)]
pub(crate) enum Status {
    Intact,
    /// Verified, but the end is not sealed and that was not accepted.
    Unsealed,
    /// Verified, but no key is pinned for it while others have one.
    Unpinned,
    Broken(VerifyError),
    Missing(String),
}

impl Status {
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Status::Intact => "intact",
            Status::Unsealed => "unsealed",
            Status::Unpinned => "unpinned",
            Status::Broken(_) => "broken",
            Status::Missing(_) => "missing",
        }
    }
}

/// One replica: its chain's status and, when it verified, the summary.
#[derive(Debug)]
pub(crate) struct ChainCheck {
    pub name: String,
    pub path: Option<PathBuf>,
    pub status: Status,
    pub summary: Option<Findings>,
}

impl ChainCheck {
    pub(crate) fn ok(&self) -> bool {
        matches!(self.status, Status::Intact)
    }

    /// The line `evidence verify` prints for this replica.
    pub(crate) fn line(&self) -> String {
        let at = self
            .path
            .as_ref()
            .map_or_else(String::new, |p| format!(" ({})", p.display()));
        let mut s = format!("{}: ", self.name);
        match (&self.status, &self.summary) {
            (Status::Broken(e), _) => {
                let _ = write!(s, "BROKEN at {e}");
            }
            (Status::Missing(why), _) => {
                let _ = write!(s, "MISSING: {why}");
            }
            (Status::Unsealed, Some(sum)) => {
                let _ = write!(
                    s,
                    "UNSEALED: {} records, {} after the last checkpoint{} (--allow-unsealed accepts a live or crashed instance){at}",
                    sum.records,
                    sum.unsigned_tail,
                    sum.torn_tail
                        .as_deref()
                        .map_or_else(String::new, |t| format!("; {t}"))
                );
            }
            (Status::Unpinned, Some(sum)) => {
                let _ = write!(
                    s,
                    "UNPINNED: {} records intact, but no key is pinned for this replica while others have one (--allow-unpinned accepts the key its headers name){at}",
                    sum.records
                );
            }
            (_, Some(sum)) => {
                let _ = write!(
                    s,
                    "intact: {} records (seq {}..={}), {}, key {}{at}",
                    sum.records,
                    sum.first_seq,
                    sum.last_seq,
                    if sum.sealed {
                        "sealed".to_string()
                    } else {
                        format!(
                            "NOT sealed: {} records after the last checkpoint",
                            sum.unsigned_tail
                        )
                    },
                    if sum.key_pinned { "pinned" } else { "embedded" }
                );
            }
            (status, None) => {
                let _ = write!(s, "{}{at}", status.as_str());
            }
        }
        s
    }
}

/// Every replica of a fleet, checked; sorted by name.
#[derive(Debug, Default)]
pub(crate) struct FleetCheck {
    pub chains: Vec<ChainCheck>,
}

impl FleetCheck {
    pub(crate) fn ok(&self) -> bool {
        !self.chains.is_empty() && self.chains.iter().all(ChainCheck::ok)
    }

    pub(crate) fn failing(&self) -> impl Iterator<Item = &ChainCheck> {
        self.chains.iter().filter(|c| !c.ok())
    }

    fn names(it: impl Iterator<Item = impl AsRef<str>>) -> String {
        let v: Vec<String> = it.map(|s| s.as_ref().to_string()).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(", ")
        }
    }

    /// The last line of `evidence verify` for a fleet.
    pub(crate) fn total_line(&self) -> String {
        let intact = Self::names(self.chains.iter().filter(|c| c.ok()).map(|c| &c.name));
        if self.ok() {
            let sums = || self.chains.iter().filter_map(|c| c.summary.as_ref());
            let records: u64 = sums().map(|s| s.records).sum();
            let first = sums().filter_map(|s| s.first_ts.clone()).min();
            let last = sums().filter_map(|s| s.last_ts.clone()).max();
            format!(
                "fleet intact: {} replicas ({intact}), {records} records, {} .. {}",
                self.chains.len(),
                first.as_deref().unwrap_or("-"),
                last.as_deref().unwrap_or("-")
            )
        } else {
            let failing: Vec<String> = self
                .failing()
                .map(|c| format!("{} {}", c.name, c.status.as_str()))
                .collect();
            format!(
                "fleet NOT intact: {} of {} replicas failed ({}); intact: {intact}",
                failing.len(),
                self.chains.len(),
                if failing.is_empty() {
                    "no replica given".into()
                } else {
                    failing.join(", ")
                }
            )
        }
    }

    /// Every replica's line, then the total.
    pub(crate) fn text(&self) -> String {
        let mut s = String::new();
        for c in &self.chains {
            let _ = writeln!(s, "{}", c.line());
            if let Some(sum) = &c.summary {
                if let Some(line) = sum.removed_line() {
                    let _ = writeln!(s, "  {line}");
                }
            }
        }
        s.push_str(&self.total_line());
        s
    }

    /// The first failing replica's problem in one line: `replica NAME:
    /// FILE:LINE: message` (or why it failed).
    pub(crate) fn first_problem(&self) -> Option<String> {
        let c = self.failing().next()?;
        Some(format!("replica {}", c.line()))
    }
}

/// The key a chain is checked against: its replica's pin, or the plain
/// `--key` when it is the only chain.
fn key_for(fleet: &Fleet, name: &str, pins: &Pins) -> Option<VerifyingKey> {
    pins.by_replica
        .get(name)
        .copied()
        .or_else(|| (fleet.chains.len() == 1).then_some(pins.single).flatten())
}

/// A plain key with several chains, or with replica pins, is ambiguous.
pub(crate) fn check_pins(fleet: &Fleet, pins: &Pins) -> Result<(), FleetError> {
    if pins.single.is_some() && !pins.by_replica.is_empty() {
        return Err(FleetError(
            "--key HEX (no replica) cannot be combined with --key REPLICA=HEX or --keys".into(),
        ));
    }
    if pins.single.is_some() && fleet.chains.len() + fleet.missing.len() > 1 {
        return Err(FleetError(format!(
            "--key HEX pins one chain, but {} replicas were given: pin each with --key REPLICA=HEX or --keys FILE",
            fleet.chains.len() + fleet.missing.len()
        )));
    }
    Ok(())
}

/// Check every chain of `fleet` on its own (see the module doc's table).
pub(crate) fn check(fleet: &Fleet, opts: &Options) -> Result<FleetCheck, FleetError> {
    check_pins(fleet, &opts.pins)?;
    let any_pinned = !opts.pins.by_replica.is_empty();
    let mut out = FleetCheck::default();
    for c in &fleet.chains {
        let key = key_for(fleet, &c.name, &opts.pins);
        let vopts = verify::Options {
            key,
            allow_unsealed: true,
        };
        let (status, summary) = match verify::verify_with(&c.path, &vopts) {
            Err(e) => (Status::Broken(e), None),
            Ok(s) => {
                let status = if !s.sealed && !opts.allow_unsealed {
                    Status::Unsealed
                } else if key.is_none() && any_pinned && !opts.pins.allow_unpinned {
                    Status::Unpinned
                } else {
                    Status::Intact
                };
                (status, Some(s))
            }
        };
        out.chains.push(ChainCheck {
            name: c.name.clone(),
            path: Some(c.path.clone()),
            status,
            summary,
        });
    }
    for m in &fleet.missing {
        let pinned = if opts.pins.by_replica.contains_key(&m.name) {
            " (a key is pinned for it)"
        } else {
            ""
        };
        out.chains.push(ChainCheck {
            name: m.name.clone(),
            path: m.path.clone(),
            status: Status::Missing(format!("{}{pinned}", m.why)),
            summary: None,
        });
    }
    for name in opts.pins.by_replica.keys() {
        if !out.chains.iter().any(|c| &c.name == name) {
            out.chains.push(ChainCheck {
                name: name.clone(),
                path: None,
                status: Status::Missing(
                    "a key is pinned for this replica, but no chain of that name was given".into(),
                ),
                summary: None,
            });
        }
    }
    out.chains.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// A record and the replica whose chain holds it.
#[derive(Debug, Clone)]
pub(crate) struct Tagged {
    pub replica: Arc<str>,
    pub stored: Stored,
}

/// Merge order of a record: time, then replica, then chain position.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct MergeKey {
    /// `None` (an unreadable `ts`) sorts first.
    pub ts: Option<SystemTime>,
    pub replica: Arc<str>,
    pub seq: Option<u64>,
}

impl MergeKey {
    pub(crate) fn of(t: &Tagged) -> MergeKey {
        MergeKey {
            ts: humantime::parse_rfc3339_weak(&t.stored.record.ts).ok(),
            replica: t.replica.clone(),
            seq: t.stored.seq,
        }
    }
}

/// One input of [`merge`].
pub(crate) type Source<T, E> = Box<dyn Iterator<Item = Result<T, E>>>;

/// A k-way merge of sources that are each in their own order: the
/// smallest head by `key` first (ties: the earlier source). An error from
/// a source is yielded as soon as it is read, and that source is not read
/// further.
pub(crate) fn merge<T: 'static, K: Ord, E: 'static>(
    sources: Vec<Source<T, E>>,
    key: impl Fn(&T) -> K,
) -> impl Iterator<Item = Result<T, E>> {
    struct Head<K, T> {
        key: K,
        source: usize,
        item: T,
    }
    impl<K: Ord, T> PartialEq for Head<K, T> {
        fn eq(&self, o: &Self) -> bool {
            self.cmp(o) == Ordering::Equal
        }
    }
    impl<K: Ord, T> Eq for Head<K, T> {}
    impl<K: Ord, T> PartialOrd for Head<K, T> {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl<K: Ord, T> Ord for Head<K, T> {
        fn cmp(&self, o: &Self) -> Ordering {
            (&self.key, self.source).cmp(&(&o.key, o.source))
        }
    }
    let mut sources = sources;
    let count = sources.len();
    let mut heap: BinaryHeap<Reverse<Head<K, T>>> = BinaryHeap::new();
    let mut pending: Vec<E> = Vec::new();
    let mut primed = false;
    std::iter::from_fn(move || {
        let mut pull =
            |i: usize, heap: &mut BinaryHeap<Reverse<Head<K, T>>>, pending: &mut Vec<E>| {
                match sources[i].next() {
                    Some(Ok(item)) => heap.push(Reverse(Head {
                        key: key(&item),
                        source: i,
                        item,
                    })),
                    Some(Err(e)) => {
                        pending.push(e);
                        sources[i] = Box::new(std::iter::empty());
                    }
                    None => {}
                }
            };
        if !primed {
            primed = true;
            for i in 0..count {
                pull(i, &mut heap, &mut pending);
            }
        }
        if let Some(e) = pending.pop() {
            return Some(Err(e));
        }
        let Reverse(head) = heap.pop()?;
        pull(head.source, &mut heap, &mut pending);
        Some(Ok(head.item))
    })
}

/// Every decision and close record of `chains`, each tagged with its
/// replica, merged by [`MergeKey`].
pub(crate) fn read_merged(chains: &[Chain]) -> impl Iterator<Item = Result<Tagged, ReadError>> {
    let sources: Vec<Source<Tagged, ReadError>> = chains
        .iter()
        .map(|c| {
            let replica: Arc<str> = c.name.as_str().into();
            let it = query::read_records(&c.path).map(move |r| {
                r.map(|stored| Tagged {
                    replica: replica.clone(),
                    stored,
                })
            });
            Box::new(it) as Source<Tagged, ReadError>
        })
        .collect();
    merge(sources, MergeKey::of)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use serde_json::json;

    use super::*;
    use crate::evidence::{Evidence, Kind, Mode, Record};
    use crate::policy::{Reason, Verdict};

    /// A chain in `dir` with one deny decision per host (client port 40000
    /// + i); sealed unless `crash`. Returns the public key (hex).
    async fn chain(dir: &Path, hosts: &[&str], crash: bool) -> String {
        // Each chain named by its directory, as replicas on one host must be.
        let mut cfg = crate::config::EvidenceConfig::for_dir(dir);
        cfg.replica = dir.file_name().unwrap().to_string_lossy().into_owned();
        let ev = Evidence::start(&cfg).unwrap();
        for (i, host) in hosts.iter().enumerate() {
            let verdict = Verdict {
                org: None,
                reason: Reason::NoMatchingRule,
                rule: None,
                would_deny: None,
            };
            let client = SocketAddr::from(([198, 18, 1, 2], 40000 + i as u16));
            let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &"p0".into());
            r.host = Some((*host).into());
            r.port = Some(443);
            ev.write(&mut r).await.unwrap();
        }
        let key = ev.public_key().to_string();
        if crash {
            ev.abandon();
        } else {
            assert!(ev.seal().await);
        }
        key
    }

    fn key(hex: &str) -> VerifyingKey {
        crate::evidence::chain::parse_pubkey(hex).unwrap()
    }

    fn pins(list: &[(&str, &str)]) -> Pins {
        Pins {
            by_replica: list.iter().map(|(n, k)| (n.to_string(), key(k))).collect(),
            ..Pins::default()
        }
    }

    fn status_of<'a>(c: &'a FleetCheck, name: &str) -> &'a ChainCheck {
        c.chains
            .iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("no replica {name}: {}", c.text()))
    }

    #[tokio::test]
    async fn a_tree_is_detected_and_every_subdirectory_is_a_replica() {
        let tree = crate::testing::scratch("fleet-tree");
        chain(&tree.join("gw-a"), &["a.test"], false).await;
        chain(&tree.join("gw-b"), &["b.test"], false).await;
        std::fs::create_dir_all(tree.join("gw-c").join("policies")).unwrap();
        std::fs::create_dir_all(tree.join(".hidden")).unwrap();
        assert!(is_tree(&tree));
        assert!(!is_tree(&tree.join("gw-a")), "a chain is not a tree");
        assert!(!is_tree(&tree.join("gw-c")), "no segments below");
        assert!(is_fleet(std::slice::from_ref(&tree)));
        assert!(!is_fleet(&[tree.join("gw-a")]));
        assert!(is_fleet(&[tree.join("gw-a"), tree.join("gw-b")]));
        let f = resolve(std::slice::from_ref(&tree)).unwrap();
        let names: Vec<&str> = f.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["gw-a", "gw-b"]);
        assert!(f.chains.iter().all(|c| c.named_by_header));
        assert_eq!(f.missing.len(), 1);
        assert_eq!(f.missing[0].name, "gw-c");
        assert!(
            f.missing[0].why.contains("no evidence segments"),
            "{:?}",
            f.missing
        );
        // Given one by one, the same chains; a path that is not there is
        // a missing replica, named.
        let f = resolve(&[tree.join("gw-b"), tree.join("gw-a"), tree.join("gw-x")]).unwrap();
        let names: Vec<&str> = f.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["gw-a", "gw-b"]);
        assert_eq!(f.missing[0].name, "gw-x");
        // One name twice is ambiguous.
        let e = resolve(&[tree.join("gw-a"), tree.join("gw-a")]).unwrap_err();
        assert!(e.0.contains("\"gw-a\" is used by both"), "{e}");
        // A verified tree, one line per replica; the missing one fails it.
        let c = check(&f, &Options::default()).unwrap();
        assert!(!c.ok());
        assert!(status_of(&c, "gw-a").ok() && status_of(&c, "gw-b").ok());
        let text = c.text();
        assert!(text.contains("gw-a: intact: 3 records"), "{text}");
        assert!(text.contains("gw-x: MISSING: "), "{text}");
        assert!(
            text.ends_with(
                "fleet NOT intact: 1 of 3 replicas failed (gw-x missing); intact: gw-a, gw-b"
            ),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&tree);
    }

    #[test]
    fn a_header_names_its_replica() {
        let line = br#"{"event":"segment_start","replica":"pod-7","seq":0}"#;
        assert_eq!(replica_of_header_line(line).as_deref(), Some("pod-7"));
        for bad in [
            &br#"{"event":"segment_start"}"#[..],
            br#"{"event":"segment_start","replica":""}"#,
            br#"{"event":"segment_start","replica":"a b"}"#,
            br#"{"event":"decision","replica":"x"}"#,
            b"not json",
        ] {
            assert_eq!(replica_of_header_line(bad), None);
        }
        let dir = crate::testing::scratch("fleet-header").join("evidence");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(segment::segment_name(0)),
            format!("{}\n", String::from_utf8_lossy(line)),
        )
        .unwrap();
        let f = resolve(std::slice::from_ref(&dir)).unwrap();
        assert_eq!(f.chains[0].name, "pod-7");
        assert!(f.chains[0].named_by_header);
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    #[tokio::test]
    async fn keys_are_pinned_per_replica() {
        let tree = crate::testing::scratch("fleet-pins");
        let ka = chain(&tree.join("gw-a"), &["a.test"], false).await;
        let kb = chain(&tree.join("gw-b"), &["b.test"], false).await;
        let f = resolve(std::slice::from_ref(&tree)).unwrap();
        let run = |pins: Pins| {
            check(
                &f,
                &Options {
                    pins,
                    allow_unsealed: false,
                },
            )
            .unwrap()
        };

        let c = run(pins(&[("gw-a", &ka), ("gw-b", &kb)]));
        assert!(c.ok(), "{}", c.text());
        assert!(c.text().contains("key pinned"), "{}", c.text());

        // A key pinned for a replica that is not there: missing, named.
        let c = run(pins(&[("gw-a", &ka), ("gw-b", &kb), ("gw-c", &kb)]));
        assert!(!c.ok());
        assert!(matches!(status_of(&c, "gw-c").status, Status::Missing(_)));
        assert!(
            c.text().contains("gw-c: MISSING: a key is pinned"),
            "{}",
            c.text()
        );

        // One pinned, the other not: refused unless allowed.
        let c = run(pins(&[("gw-a", &ka)]));
        assert!(matches!(status_of(&c, "gw-b").status, Status::Unpinned));
        assert!(status_of(&c, "gw-a").ok());
        let mut allowed = pins(&[("gw-a", &ka)]);
        allowed.allow_unpinned = true;
        assert!(run(allowed).ok());

        // The wrong key: broken, at the checkpoint it fails.
        let c = run(pins(&[("gw-a", &kb), ("gw-b", &kb)]));
        let a = status_of(&c, "gw-a");
        assert!(
            matches!(&a.status, Status::Broken(e) if e.message.contains("signature")),
            "{}",
            a.line()
        );
        assert!(status_of(&c, "gw-b").ok());

        // A plain key is for one chain only.
        let single = Pins {
            single: Some(key(&ka)),
            ..Pins::default()
        };
        let e = check(
            &f,
            &Options {
                pins: single.clone(),
                allow_unsealed: false,
            },
        )
        .unwrap_err();
        assert!(e.0.contains("pins one chain, but 2 replicas"), "{e}");
        let one = resolve(&[tree.join("gw-a")]).unwrap();
        assert!(check(
            &one,
            &Options {
                pins: single,
                allow_unsealed: false
            }
        )
        .unwrap()
        .ok());
        let _ = std::fs::remove_dir_all(&tree);
    }

    #[test]
    fn pins_and_keys_files_parse() {
        assert_eq!(split_pin("gw-a=abcd"), (Some("gw-a"), "abcd"));
        assert_eq!(split_pin("abcd"), (None, "abcd"));
        assert_eq!(split_pin("./keys/a=b.pub"), (None, "./keys/a=b.pub"));
        assert_eq!(split_pin("=abcd"), (None, "=abcd"));
        let text = "# fleet keys\n\ngw-a 00aa  # first\ngw-b\t00bb\n";
        let got = parse_keys_file(text, "keys.txt").unwrap();
        assert_eq!(
            got,
            [
                ("gw-a".to_string(), "00aa".to_string(), 3),
                ("gw-b".to_string(), "00bb".to_string(), 4)
            ]
        );
        for (bad, want) in [
            ("gw-a\n", "keys.txt:1: expected `REPLICA HEX`"),
            ("gw-a 00 extra\n", "keys.txt:1: expected"),
            ("\ngw/a 00\n", "keys.txt:2: not a replica name"),
            (
                "gw-a 00\ngw-a 01\n",
                "keys.txt:2: replica \"gw-a\" pinned twice",
            ),
        ] {
            let e = parse_keys_file(bad, "keys.txt").unwrap_err();
            assert!(e.0.starts_with(want), "{bad:?}: {e}");
        }
    }

    #[tokio::test]
    async fn broken_and_unsealed_replicas_are_named() {
        let tree = crate::testing::scratch("fleet-broken");
        chain(&tree.join("gw-a"), &["a.test", "b.test"], false).await;
        chain(&tree.join("gw-b"), &["c.test", "d.test"], false).await;
        chain(&tree.join("gw-c"), &["e.test"], true).await;
        let seg = &segment::list(&tree.join("gw-b")).unwrap()[0];
        let text = std::fs::read_to_string(seg).unwrap();
        std::fs::write(
            seg,
            text.replacen("\"host\":\"d.test\"", "\"host\":\"x.test\"", 1),
        )
        .unwrap();
        let f = resolve(std::slice::from_ref(&tree)).unwrap();
        let c = check(&f, &Options::default()).unwrap();
        assert!(!c.ok());
        let b = status_of(&c, "gw-b");
        let Status::Broken(e) = &b.status else {
            panic!("{}", b.line())
        };
        assert_eq!(e.line, 3, "{e}");
        assert!(
            b.line().starts_with(&format!(
                "gw-b: BROKEN at {}:3: hash does not match",
                seg.display()
            )),
            "{}",
            b.line()
        );
        let u = status_of(&c, "gw-c");
        assert!(matches!(u.status, Status::Unsealed), "{}", u.line());
        assert!(
            u.line()
                .contains("UNSEALED: 2 records, 2 after the last checkpoint"),
            "{}",
            u.line()
        );
        assert!(status_of(&c, "gw-a").ok());
        assert!(
            c.total_line()
                .ends_with("2 of 3 replicas failed (gw-b broken, gw-c unsealed); intact: gw-a"),
            "{}",
            c.total_line()
        );
        assert!(c
            .first_problem()
            .unwrap()
            .starts_with("replica gw-b: BROKEN at "));
        // Unsealed is accepted when asked; broken never is.
        let c = check(
            &f,
            &Options {
                allow_unsealed: true,
                ..Options::default()
            },
        )
        .unwrap();
        assert!(status_of(&c, "gw-c").ok(), "{}", c.text());
        assert!(
            status_of(&c, "gw-c")
                .line()
                .contains("NOT sealed: 2 records after"),
            "{}",
            c.text()
        );
        assert!(!c.ok());
        let _ = std::fs::remove_dir_all(&tree);
    }

    fn tagged(replica: &str, ts: &str, seq: u64) -> Tagged {
        let stored: Stored = serde_json::from_value(json!({
            "id": format!("{replica}-{seq}"), "ts": ts, "kind": "tcp", "event": "decision",
            "org": null, "client": null, "mode": "explicit", "host": null, "port": null,
            "sni": null, "ip": null, "decision": "deny", "reason": "no_matching_rule",
            "rule": null, "policy": "p", "seq": seq,
        }))
        .unwrap();
        Tagged {
            replica: replica.into(),
            stored,
        }
    }

    #[test]
    fn merge_orders_by_time_then_replica_then_seq() {
        let t = |s: u32| format!("2030-01-01T00:00:{s:02}.000000Z");
        let a = vec![
            tagged("a", &t(1), 0),
            tagged("a", &t(3), 1),
            tagged("a", &t(3), 2),
        ];
        let b = vec![
            tagged("b", &t(0), 7),
            tagged("b", &t(3), 8),
            tagged("b", &t(4), 9),
        ];
        let src =
            |v: Vec<Tagged>| Box::new(v.into_iter().map(Ok::<_, String>)) as Source<Tagged, String>;
        // Source order does not matter: the replica name breaks ties.
        for sources in [
            vec![src(a.clone()), src(b.clone())],
            vec![src(b.clone()), src(a.clone())],
        ] {
            let got: Vec<String> = merge(sources, MergeKey::of)
                .map(|t| t.unwrap().stored.record.id)
                .collect();
            assert_eq!(got, ["b-7", "a-0", "a-1", "a-2", "b-8", "b-9"]);
        }
        // An error is yielded, and its source read no further.
        let failing = Box::new(
            vec![
                Ok(tagged("c", &t(2), 0)),
                Err("bad".to_string()),
                Ok(tagged("c", &t(5), 2)),
            ]
            .into_iter(),
        ) as Source<Tagged, String>;
        let got: Vec<Result<String, String>> = merge(vec![src(a), failing], MergeKey::of)
            .map(|r| r.map(|t| t.stored.record.id))
            .collect();
        assert_eq!(
            got,
            [
                Ok("a-0".to_string()),
                Ok("c-0".to_string()),
                Err("bad".to_string()),
                Ok("a-1".to_string()),
                Ok("a-2".to_string()),
            ]
        );
    }

    #[tokio::test]
    async fn fleet_records_are_read_merged_and_tagged() {
        let tree = crate::testing::scratch("fleet-merged");
        chain(&tree.join("gw-b"), &["b1.test"], false).await;
        chain(&tree.join("gw-a"), &["a1.test"], false).await;
        chain(&tree.join("gw-b2"), &["b2.test", "b3.test"], false).await;
        let f = resolve(std::slice::from_ref(&tree)).unwrap();
        let got: Vec<(String, String)> = read_merged(&f.chains)
            .map(|t| {
                let t = t.unwrap();
                (t.replica.to_string(), t.stored.record.host.unwrap())
            })
            .collect();
        // Written one chain after the other: time order is chain order.
        assert_eq!(
            got,
            [
                ("gw-b".into(), "b1.test".into()),
                ("gw-a".into(), "a1.test".into()),
                ("gw-b2".into(), "b2.test".into()),
                ("gw-b2".into(), "b3.test".into()),
            ]
        );
        // Query output: one chain as stored; a fleet with `replica`. The
        // fleet's records printed as `output`: how many, and the text.
        let print = |output| {
            let mut out = Vec::new();
            let records = read_merged(&f.chains).map(|r| r.map(|t| (Some(t.replica), t.stored)));
            let selection = crate::evidence::select::Selection::default();
            let n = query::print(records, true, &selection, output, &mut out).unwrap();
            (n, String::from_utf8(out).unwrap())
        };
        let (n, out) = print(query::Output::JsonLines);
        assert_eq!(n, 4);
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[1]["replica"], "gw-a");
        assert_eq!(lines[1]["host"], "a1.test");
        let (_, table) = print(query::Output::Table);
        assert!(table.starts_with("replica\tts\t"), "{table}");
        assert!(
            table.lines().nth(2).unwrap().starts_with("gw-a\t"),
            "{table}"
        );
        let (_, ocsf) = print(query::Output::Ocsf);
        let first: Value = serde_json::from_str(ocsf.lines().next().unwrap()).unwrap();
        assert_eq!(first["unmapped"]["replica"], "gw-b");
        let mut single = Vec::new();
        query::query(
            &tree.join("gw-a"),
            &crate::evidence::select::Selection::default(),
            false,
            &mut single,
        )
        .unwrap();
        assert!(!String::from_utf8(single).unwrap().contains("replica"));
        let _ = std::fs::remove_dir_all(&tree);
    }
}
