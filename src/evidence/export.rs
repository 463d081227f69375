//! `palisade evidence export --org O --proofs` and `verify-export`: one
//! org's records for a window, with the proofs that each is in the signed
//! log and that none of that org's records in the window is left out, and
//! nothing of another org; and their check with the public key alone.
//!
//! An export is a directory of three files:
//!
//! - `records.jsonl`: the org's records, each its chain line, in chain
//!   order: leaves `a..b` of the org's tree ([`merkle::OrgTrees`]).
//! - `proofs.json`: the two signed checkpoint records that bound the
//!   window (`start`, absent when the org's tree starts inside it, and
//!   `end`), each with the org's entry in its tree over the orgs and the
//!   inclusion proof of that entry; the right edge of the org's tree at
//!   `start` (`frontier`); and the leaf hash of every exported record
//!   (`leaves`), so a missing record is named by where it was.
//! - `manifest.json`: what the export says it holds (org, window, count,
//!   first and last id and seq, leaf range, the SHA-256 of `records.jsonl`,
//!   the key and log); every claim is checked against the rest.
//!
//! The check: both checkpoint records are signed by the key and their
//! notes open with it; the org's entries are in their `orgs_root`; the
//! frontier gives the start entry's root; appending `leaves` to it gives
//! the end entry's size and root; and the records, each of the org, hash to
//! those leaves in order, with their seqs between the two checkpoints.

use std::path::Path;

use data_encoding::HEXLOWER;
use ed25519_dalek::VerifyingKey;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use super::chain;
use super::field::Fields;
use super::merkle::{self, Frontier, Hash, OrgTrees};
use super::{note, segment};

/// `export` of `proofs.json` and `manifest.json`.
pub(crate) const EXPORT: &str = "palisade-org-export/1";
/// Files of an export larger than this are refused unread.
pub(crate) const MAX_FILE: u64 = 1 << 30;

/// A window: records from `since` to `until` (RFC 3339 `ts` strings as
/// the records hold them; compared as times).
#[derive(Debug, Clone, Default)]
pub(crate) struct Window {
    pub since: Option<std::time::SystemTime>,
    pub until: Option<std::time::SystemTime>,
}

fn ts_of(m: &Map<String, Value>) -> Option<std::time::SystemTime> {
    m.get("ts")
        .and_then(Value::as_str)
        .and_then(|t| humantime::parse_rfc3339(t).ok())
}

fn is_checkpoint(m: &Map<String, Value>) -> bool {
    matches!(m.text("event"), Some("checkpoint" | "seal")) && m.contains_key("orgs_root")
}

/// A checkpoint bounding the window, with the org's state at it.
struct Bound {
    record: Map<String, Value>,
    /// The org's tree at the checkpoint (`None`: no record yet).
    tree: Option<Frontier>,
    /// The org's index among the orgs and its entry's inclusion proof.
    proof: Option<(u64, Vec<Hash>)>,
}

impl Bound {
    fn at(m: &Map<String, Value>, trees: &OrgTrees, org: &str) -> Bound {
        Bound {
            record: m.clone(),
            tree: trees.tree(org).cloned(),
            proof: trees.prove(org),
        }
    }

    fn json(&self, org: &str, frontier: bool) -> Value {
        let f = self.tree.clone().unwrap_or_default();
        let (index, hashes) = self.proof.clone().unwrap_or_default();
        let mut v = json!({
            "checkpoint": self.record,
            "entry": merkle::entry(org, f.size(), &f.root()),
            "index": index,
            "hashes": hexes(&hashes),
        });
        if frontier {
            v["frontier"] = hexes(f.hashes()).into();
        }
        v
    }
}

fn hexes(h: &[Hash]) -> Vec<String> {
    h.iter().map(|x| HEXLOWER.encode(x)).collect()
}

/// An export made: its three files' contents.
#[derive(Debug)]
pub(crate) struct Export {
    pub records: Vec<u8>,
    pub proofs: Value,
    pub manifest: Value,
    /// Records of the org after the last checkpoint of the window, which
    /// no checkpoint signs yet (left out; named in the manifest).
    pub unsigned: u64,
}

/// Make `org`'s export for `window` from the store at `path` (which
/// `verify` passed). The window is widened to the checkpoints around it:
/// `start` is the last checkpoint at or before `since` (none: from the
/// org's first record), `end` the first at or after `until` (none: the
/// last checkpoint).
pub(crate) fn export(path: &Path, org: &str, window: &Window) -> Result<Export, String> {
    let list = if path.is_dir() {
        segment::list(path).map_err(|e| format!("{}: {e}", path.display()))?
    } else {
        vec![path.to_path_buf()]
    };
    let mut trees: Option<OrgTrees> = None;
    let mut start: Option<Bound> = None;
    // The last checkpoint read after the start, and how many of the org's
    // records preceded it.
    let mut end: Option<(Bound, usize)> = None;
    let mut records: Vec<Map<String, Value>> = Vec::new();
    let mut key: Option<String> = None;
    let mut replica: Option<String> = None;
    segment::for_each_record(&list, 0, |m| {
        if m.text("event") == Some("segment_start") {
            if m.text("prev") == Some(chain::GENESIS) {
                trees.get_or_insert_with(OrgTrees::default);
            }
            if trees.is_none() {
                trees = m.get("org_trees").and_then(OrgTrees::of_json);
            }
            replica = m.text("replica").map(String::from);
        }
        let Some(t) = trees.as_mut() else {
            return true;
        };
        if is_checkpoint(m) {
            key = m.text("key").map(String::from);
            let ts = ts_of(m);
            if matches!((window.since, ts), (Some(s), Some(t)) if t <= s) {
                start = Some(Bound::at(m, t, org));
                records.clear();
                end = None;
            } else {
                end = Some((Bound::at(m, t, org), records.len()));
                if matches!((window.until, ts), (Some(u), Some(t)) if t >= u) {
                    return false;
                }
            }
        } else if merkle::org_of(m) == Some(org) {
            records.push(m.clone());
        }
        t.push_record(m);
        true
    });
    let Some((end, signed)) = end else {
        return Err(format!(
            "no checkpoint with org trees after the window's start: nothing of org {org} can be proved (export once the next checkpoint is written)"
        ));
    };
    let after_end = (records.len() - signed) as u64;
    records.truncate(signed);
    let start = start.filter(|s| s.tree.is_some());
    if end.tree.is_none() {
        return Err(format!(
            "org {org} has no record in the store up to the window's last checkpoint"
        ));
    }
    let mut body = Vec::new();
    let mut leaves = Vec::new();
    for m in &records {
        chain::canonical_into(&Value::Object(m.clone()), &mut body);
        body.push(b'\n');
        leaves.push(merkle::record_leaf(m.text("hash").unwrap_or_default()));
    }
    let a = start
        .as_ref()
        .and_then(|s| s.tree.as_ref())
        .map_or(0, Frontier::size);
    let proofs = json!({
        "export": EXPORT,
        "org": org,
        "start": start.as_ref().map(|s| s.json(org, true)),
        "end": end.json(org, false),
        "leaves": hexes(&leaves),
    });
    let id = |m: Option<&Map<String, Value>>, f: &str| {
        m.and_then(|m| m.get(f)).cloned().unwrap_or(Value::Null)
    };
    let fmt = |t: Option<std::time::SystemTime>| {
        t.map(|t| humantime::format_rfc3339_micros(t).to_string())
    };
    let manifest = json!({
        "export": EXPORT,
        "org": org,
        "log": replica.as_deref().map(note::origin),
        "key": key,
        "window": {"since": fmt(window.since), "until": fmt(window.until)},
        "from_checkpoint": id(start.as_ref().map(|s| &s.record), "seq"),
        "to_checkpoint": id(Some(&end.record), "seq"),
        "records": records.len(),
        "leaves": [a, a + records.len() as u64],
        "first": {"id": id(records.first(), "id"), "seq": id(records.first(), "seq"), "ts": id(records.first(), "ts")},
        "last": {"id": id(records.last(), "id"), "seq": id(records.last(), "seq"), "ts": id(records.last(), "ts")},
        "records_sha256": HEXLOWER.encode(&Sha256::digest(&body)),
        "unsigned_after": after_end,
    });
    Ok(Export {
        records: body,
        proofs,
        manifest,
        unsigned: after_end,
    })
}

/// Whether `path` is an export directory (its `proofs.json` names the
/// format), not a store.
pub(crate) fn is_export(path: &Path) -> bool {
    path.is_dir()
        && std::fs::read(path.join("proofs.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v.text("export") == Some(EXPORT))
}

/// Write an export's three files into `dir` (created; it must not hold
/// an export already).
pub(crate) fn write(dir: &Path, e: &Export) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let pretty = |v: &Value| {
        let mut s = serde_json::to_vec_pretty(v).unwrap_or_default();
        s.push(b'\n');
        s
    };
    std::fs::write(dir.join("records.jsonl"), &e.records)?;
    std::fs::write(dir.join("proofs.json"), pretty(&e.proofs))?;
    std::fs::write(dir.join("manifest.json"), pretty(&e.manifest))?;
    Ok(())
}

/// A checkpoint of the export (`start` or `end`): signed by `key`, its
/// note opening with `key` and agreeing with it, the org's entry in its
/// `orgs_root`. Returns the record and the entry's size and root.
fn bound(
    v: &Value,
    what: &str,
    org: &str,
    key: &VerifyingKey,
) -> Result<(Map<String, Value>, u64, Hash), String> {
    let c = v
        .get("checkpoint")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("{what}: no checkpoint record"))?;
    super::proof::signed(
        &Value::Object(c.clone()),
        &format!("{what} checkpoint"),
        key,
    )?;
    let hash = c.text("hash").unwrap_or_default();
    if chain::record_hash(c) != hash {
        return Err(format!(
            "{what} checkpoint: hash does not match the record: record edited"
        ));
    }
    if !is_checkpoint(c) {
        return Err(format!(
            "{what} checkpoint: not a checkpoint with org trees"
        ));
    }
    if !chain::check_sig(c, key) {
        return Err(format!(
            "{what} checkpoint (seq {}): bad signature, or signed by another key",
            c.get("seq").cloned().unwrap_or_default()
        ));
    }
    let entry = v.get("entry").ok_or_else(|| format!("{what}: no entry"))?;
    if entry.text("org") != Some(org) {
        return Err(format!("{what}: the entry is of another org than {org}"));
    }
    let size = entry.need_u64("size", || format!("{what}: entry has no size"))?;
    let root = entry
        .text("root")
        .and_then(chain::unhex::<32>)
        .ok_or_else(|| format!("{what}: entry has no root"))?;
    if *entry != merkle::entry(org, size, &root) {
        return Err(format!(
            "{what}: entry has fields besides org, root and size"
        ));
    }
    let index = v.need_u64("index", || format!("{what}: no index"))?;
    let hashes = merkle::hash_list(v.get("hashes"), &format!("{what} hashes"))?;
    let count = c.field("org_count").and_then(Value::as_u64).unwrap_or(0);
    let orgs_root = c
        .text("orgs_root")
        .and_then(chain::unhex::<32>)
        .ok_or_else(|| format!("{what} checkpoint: orgs_root is not 64 hex digits"))?;
    merkle::verify_inclusion(
        index,
        count,
        &merkle::entry_leaf(entry),
        &hashes,
        &orgs_root,
    )
    .map_err(|e| {
        format!("{what}: org {org}'s entry (size {size}) is not in the checkpoint's orgs_root: {e}")
    })?;
    Ok((c.clone(), size, root))
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>, String> {
    let p = dir.join(name);
    let len = std::fs::metadata(&p)
        .map_err(|e| format!("{name}: {e}"))?
        .len();
    if len > MAX_FILE {
        return Err(format!("{name}: {len} bytes is more than an export holds"));
    }
    std::fs::read(&p).map_err(|e| format!("{name}: {e}"))
}

fn json_file(dir: &Path, name: &str) -> Result<Value, String> {
    serde_json::from_slice(&read(dir, name)?).map_err(|e| format!("{name}: not JSON: {e}"))
}

fn seq_of(m: &Map<String, Value>) -> u64 {
    m.field("seq").and_then(Value::as_u64).unwrap_or(0)
}

/// Check the export in `dir` with the public key alone: what it proves,
/// or the first thing wrong, naming the file and record.
pub(crate) fn check(dir: &Path, key: &VerifyingKey) -> Result<String, String> {
    let proofs = json_file(dir, "proofs.json")?;
    let manifest = json_file(dir, "manifest.json")?;
    let body = read(dir, "records.jsonl")?;
    if proofs.text("export") != Some(EXPORT) {
        return Err(format!(
            "proofs.json: not a Palisade org export (expected export = {EXPORT:?})"
        ));
    }
    let proven = proven(&proofs, key)?;
    let records = check_records(&body, &proven)?;
    check_manifest(&manifest, &body, &proven, &records, key)?;
    let Proven {
        org,
        end,
        start_seq,
        a,
        b,
        ..
    } = proven;
    let origin = end
        .get("note")
        .and_then(Value::as_str)
        .and_then(|n| n.split('\n').next())
        .unwrap_or("?")
        .to_string();
    Ok(format!(
        "ok: export of org {org}: {} records (leaves {a}..{b} of its tree), complete from {} to checkpoint seq {} ({}), signed by {origin}",
        records.count,
        start_seq.map_or("its first record".to_string(), |s| format!("checkpoint seq {s}")),
        seq_of(&end),
        end.text("ts").unwrap_or("?"),
    ))
}

/// What `proofs.json` proves, each checkpoint's signature checked: the
/// org's signed tree of `b` records at the `end` checkpoint, and the
/// window's leaves from `a` on (after the `start` checkpoint, if any).
struct Proven<'p> {
    org: &'p str,
    end: Map<String, Value>,
    start_seq: Option<u64>,
    a: u64,
    b: u64,
    leaves: Vec<merkle::Hash>,
}

/// `proofs.json`: the end checkpoint, the start frontier and the leaves
/// that take it to the end's root.
fn proven<'p>(proofs: &'p Value, key: &VerifyingKey) -> Result<Proven<'p>, String> {
    let org = proofs
        .get("org")
        .and_then(Value::as_str)
        .ok_or("proofs.json: no org")?;
    let (end, b, end_root) = bound(
        proofs.get("end").unwrap_or(&Value::Null),
        "proofs.json: end",
        org,
        key,
    )?;
    let (start_seq, mut frontier) = match proofs.get("start") {
        None | Some(Value::Null) => (None, Frontier::default()),
        Some(s) => {
            let (c, a, root) = bound(s, "proofs.json: start", org, key)?;
            let hashes = merkle::hash_list(s.get("frontier"), "proofs.json: start frontier")?;
            let f = Frontier::from_parts(a, hashes)
                .filter(|f| f.root() == root)
                .ok_or("proofs.json: start frontier does not give the start entry's root")?;
            if seq_of(&c) >= seq_of(&end) {
                return Err(
                    "proofs.json: the start checkpoint is not before the end checkpoint".into(),
                );
            }
            (Some(seq_of(&c)), f)
        }
    };
    let a = frontier.size();
    let leaves = merkle::hash_list(proofs.get("leaves"), "proofs.json: leaves")?;
    for l in &leaves {
        frontier.push(*l);
    }
    if frontier.size() != b || frontier.root() != end_root {
        return Err(format!(
            "proofs.json: leaves {a}..{} do not make org {org}'s signed tree of {b} records: a leaf removed, added or reordered",
            frontier.size()
        ));
    }
    Ok(Proven {
        org,
        end,
        start_seq,
        a,
        b,
        leaves,
    })
}

/// The records of `records.jsonl` as checked: how many, the first and
/// the last.
struct Records {
    count: usize,
    first: Option<Map<String, Value>>,
    last: Option<Map<String, Value>>,
}

/// `records.jsonl`: one record per leaf, in order, each intact and of the
/// org, inside the window.
fn check_records(body: &[u8], p: &Proven<'_>) -> Result<Records, String> {
    let (org, a, leaves) = (p.org, p.a, &p.leaves);
    let (lines, torn) = segment::split_lines(body);
    if !torn.is_empty() {
        return Err(format!("records.jsonl:{}: truncated line", lines.len() + 1));
    }
    let mut prev_seq = p.start_seq;
    let mut first: Option<Map<String, Value>> = None;
    let mut last: Option<Map<String, Value>> = None;
    for (i, raw) in lines.iter().enumerate() {
        let bad = |m: String| format!("records.jsonl:{}: {m}", i + 1);
        let v: Value = serde_json::from_slice(raw).map_err(|e| bad(format!("not JSON ({e})")))?;
        let Value::Object(m) = &v else {
            return Err(bad("not a JSON object".into()));
        };
        let id = m.text("id").unwrap_or("?");
        let mut canon = Vec::new();
        chain::canonical_into(&v, &mut canon);
        if canon != *raw {
            return Err(bad(format!(
                "record {id}: line is not in canonical form: record edited"
            )));
        }
        let hash = m.text("hash").unwrap_or_default();
        if chain::record_hash(m) != hash {
            return Err(bad(format!(
                "record {id}: hash does not match the record: record edited"
            )));
        }
        if merkle::org_of(m) != Some(org) {
            return Err(bad(format!(
                "record {id} is of org {}, not {org}: a record of another org",
                m.get("org").cloned().unwrap_or_default()
            )));
        }
        let seq = seq_of(m);
        if prev_seq.is_some_and(|p| seq <= p) || seq >= seq_of(&p.end) {
            return Err(bad(format!(
                "record {id} (seq {seq}) is out of chain order or outside the window: record reordered or added"
            )));
        }
        prev_seq = Some(seq);
        let leaf = merkle::record_leaf(hash);
        match leaves.get(i) {
            Some(l) if *l == leaf => {}
            Some(expected) => {
                let after = last.as_ref().and_then(|m| m.text("id"));
                return Err(bad(misplaced(&lines, p, i, id, leaf, expected, after)));
            }
            None => {
                return Err(bad(format!(
                    "record {id} is beyond the {} leaves the signed tree holds: record added",
                    leaves.len()
                )))
            }
        }
        if first.is_none() {
            first = Some(m.clone());
        }
        last = Some(m.clone());
    }
    if lines.len() < leaves.len() {
        return Err(format!(
            "records.jsonl: holds {} records, org {org}'s signed tree {} in the window: the last {} missing: record removed (leaf {} on)",
            lines.len(),
            leaves.len(),
            leaves.len() - lines.len(),
            a + lines.len() as u64
        ));
    }
    Ok(Records {
        count: lines.len(),
        first,
        last,
    })
}

/// Why record `id`, line `i`, is not the leaf `expected` there: added,
/// reordered (the expected leaf is a record further on), or the expected
/// one removed (after the record `after`).
fn misplaced(
    lines: &[&[u8]],
    p: &Proven<'_>,
    i: usize,
    id: &str,
    leaf: merkle::Hash,
    expected: &merkle::Hash,
    after: Option<&str>,
) -> String {
    let (org, at) = (p.org, p.a + i as u64);
    let held = lines.iter().any(|l| {
        serde_json::from_slice::<Map<String, Value>>(l)
            .is_ok_and(|m| merkle::record_leaf(m.text("hash").unwrap_or_default()) == *expected)
    });
    match p.leaves.iter().position(|l| *l == leaf) {
        None => format!("record {id} is no leaf of org {org}'s signed tree: record added"),
        Some(_) if held => format!(
            "record {id} is not leaf {at} of org {org}'s signed tree, which is further on: records reordered"
        ),
        Some(_) => format!(
            "leaf {at} of org {org}'s signed tree is missing before record {id} (after {}): record removed",
            after.unwrap_or("the window's start")
        ),
    }
}

/// Every claim of the manifest against what was checked.
fn check_manifest(
    manifest: &Value,
    body: &[u8],
    p: &Proven<'_>,
    records: &Records,
    key: &VerifyingKey,
) -> Result<(), String> {
    let (org, a, end) = (p.org, p.a, &p.end);
    let (first, last) = (&records.first, &records.last);
    let n = body.iter().filter(|b| **b == b'\n').count() as u64;
    let field = |m: &Option<Map<String, Value>>, f: &str| {
        m.as_ref()
            .and_then(|m| m.get(f))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let claims: [(&str, Value, Value); 9] = [
        ("export", manifest["export"].clone(), EXPORT.into()),
        ("org", manifest["org"].clone(), org.into()),
        ("records", manifest["records"].clone(), n.into()),
        ("leaves", manifest["leaves"].clone(), json!([a, a + n])),
        (
            "first.id",
            manifest["first"]["id"].clone(),
            field(first, "id"),
        ),
        ("last.id", manifest["last"]["id"].clone(), field(last, "id")),
        (
            "records_sha256",
            manifest["records_sha256"].clone(),
            HEXLOWER.encode(&Sha256::digest(body)).into(),
        ),
        (
            "key",
            manifest["key"].clone(),
            HEXLOWER.encode(key.as_bytes()).into(),
        ),
        (
            "to_checkpoint",
            manifest["to_checkpoint"].clone(),
            end.get("seq").cloned().unwrap_or_default(),
        ),
    ];
    for (what, says, is) in claims {
        if says != is {
            return Err(format!(
                "manifest.json: {what} says {says}, the records and proofs say {is}: the manifest disagrees with its records"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store of acme's and beta's decisions, interleaved, with a
    /// checkpoint every 5 records and a few segments.
    async fn store(name: &str) -> (std::path::PathBuf, std::path::PathBuf, VerifyingKey) {
        let orgs = ["acme", "beta", "beta", "acme", "beta"];
        crate::evidence::tests::sealed_store(name, 5, 4000, 40, &orgs).await
    }

    fn lines(dir: &Path) -> Vec<String> {
        let t = std::fs::read_to_string(dir.join("records.jsonl")).unwrap();
        t.lines().map(|l| format!("{l}\n")).collect()
    }

    #[tokio::test]
    async fn an_org_export_verifies_and_every_tampering_fails_naming_it() {
        let (root, dir, key) = store("export").await;
        assert!(segment::list(&dir).unwrap().len() >= 2);
        crate::evidence::verify::verify_path(&dir).unwrap();
        let e = export(&dir, "acme", &Window::default()).unwrap();
        let out = root.join("acme");
        write(&out, &e).unwrap();
        let ok = check(&out, &key).unwrap();
        assert!(ok.contains("16 records (leaves 0..16"), "{ok}");
        let text = std::fs::read_to_string(out.join("records.jsonl")).unwrap()
            + &std::fs::read_to_string(out.join("proofs.json")).unwrap()
            + &std::fs::read_to_string(out.join("manifest.json")).unwrap();
        assert!(!text.contains("beta"), "beta appears in acme's export");
        // A window: widened to the checkpoints around it.
        let ts: Vec<String> = lines(&out)
            .iter()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["ts"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        let w = Window {
            since: humantime::parse_rfc3339(&ts[6]).ok(),
            until: humantime::parse_rfc3339(&ts[9]).ok(),
        };
        let part = export(&dir, "acme", &w).unwrap();
        let pout = root.join("acme-part");
        write(&pout, &part).unwrap();
        let ok = check(&pout, &key).unwrap();
        assert!(ok.contains("from checkpoint seq"), "{ok}");
        let held = lines(&pout);
        assert!(held.len() >= 4 && held.len() < 16, "{}", held.len());
        assert!(export(&dir, "nobody", &Window::default()).is_err());

        type Edit = fn(&Path, &Path);
        let edits: [(&str, &str, Edit); 9] = [
            ("record removed", "removed", |out, _| {
                let mut l = lines(out);
                l.remove(3);
                std::fs::write(out.join("records.jsonl"), l.concat()).unwrap();
            }),
            ("record reordered", "reordered", |out, _| {
                let mut l = lines(out);
                l.swap(2, 3);
                std::fs::write(out.join("records.jsonl"), l.concat()).unwrap();
            }),
            (
                "record of beta spliced in",
                "of another org",
                |out, store| {
                    let mut beta = None;
                    segment::for_each_record(&segment::list(store).unwrap(), 0, |m| {
                        if merkle::org_of(m) == Some("beta") {
                            let mut b = Vec::new();
                            chain::canonical_into(&Value::Object(m.clone()), &mut b);
                            beta = Some(String::from_utf8(b).unwrap() + "\n");
                            return false;
                        }
                        true
                    });
                    let mut l = lines(out);
                    l.insert(1, beta.unwrap());
                    std::fs::write(out.join("records.jsonl"), l.concat()).unwrap();
                },
            ),
            ("record duplicated", "reordered or added", |out, _| {
                let mut l = lines(out);
                l.insert(1, l[1].clone());
                std::fs::write(out.join("records.jsonl"), l.concat()).unwrap();
            }),
            ("record edited", "record edited", |out, _| {
                let l = lines(out)
                    .concat()
                    .replacen("acme-0.test", "acme-9.test", 1);
                std::fs::write(out.join("records.jsonl"), l).unwrap();
            }),
            ("manifest count", "manifest disagrees", |out, _| {
                let p = out.join("manifest.json");
                let mut m: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
                m["records"] = 15.into();
                std::fs::write(p, m.to_string()).unwrap();
            }),
            ("truncated note", "note", |out, _| {
                let p = out.join("proofs.json");
                let mut m: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
                let n = m["end"]["checkpoint"]["note"].as_str().unwrap().to_string();
                m["end"]["checkpoint"]["note"] = n[..n.len() - 10].into();
                std::fs::write(p, m.to_string()).unwrap();
            }),
            ("entry for another size", "entry", |out, _| {
                let p = out.join("proofs.json");
                let mut m: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
                m["end"]["entry"]["size"] = 15.into();
                std::fs::write(p, m.to_string()).unwrap();
            }),
            ("leaf dropped with its record", "do not make", |out, _| {
                let p = out.join("proofs.json");
                let mut m: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
                m["leaves"].as_array_mut().unwrap().remove(3);
                std::fs::write(p, m.to_string()).unwrap();
                let mut l = lines(out);
                l.remove(3);
                std::fs::write(out.join("records.jsonl"), l.concat()).unwrap();
            }),
        ];
        for (i, (what, says, edit)) in edits.into_iter().enumerate() {
            let copy = root.join(format!("bad{i}"));
            write(&copy, &e).unwrap();
            edit(&copy, &dir);
            let err = check(&copy, &key).expect_err(what);
            assert!(err.contains(says), "{what}: {err}");
        }
        let other = ed25519_dalek::SigningKey::from_bytes(&[3; 32]).verifying_key();
        assert!(check(&out, &other)
            .unwrap_err()
            .contains("no signature by key"));
        assert!(check(&root.join("none"), &key).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
