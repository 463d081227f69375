//! `palisade evidence prove` and `verify-proof`: inclusion proofs of one
//! record and consistency proofs between two checkpoints, as JSON, against
//! the signed checkpoint notes; and their check with the public key alone.
//!
//! Proofs are made from a store that `verify` passed (the CLI checks it
//! first); checking one needs only the proof file and the key.

use std::path::Path;

use data_encoding::HEXLOWER;
use ed25519_dalek::VerifyingKey;
use serde_json::{json, Map, Value};

use super::chain::{self, GENESIS};
use super::field::Fields;
use super::merkle::{self, Hash};
use super::{note, segment};

/// `proof` of an inclusion proof.
pub(crate) const INCLUSION: &str = "palisade-inclusion-proof/1";
/// `proof` of a consistency proof.
pub(crate) const CONSISTENCY: &str = "palisade-consistency-proof/1";
/// Proof files larger than this are refused unread.
pub(crate) const MAX_PROOF: u64 = 1 << 20;

/// A checkpoint of the store: its tree size, root (hex) and note.
#[derive(Debug, Clone)]
struct Signed {
    size: u64,
    root: String,
    note: String,
}

impl Signed {
    fn json(&self) -> Value {
        json!({"tree_size": self.size, "root": self.root, "note": self.note})
    }
}

/// The store's tree: every leaf, every checkpoint with a tree root, and
/// the record asked for (its leaf index and fields).
struct Store {
    leaves: Vec<Hash>,
    checkpoints: Vec<Signed>,
    record: Option<(u64, Map<String, Value>)>,
}

/// Read the tree of the chain at `path` (a directory of segments or one
/// segment); find the record whose `id` is `id`.
fn load(path: &Path, id: Option<&str>) -> Result<Store, String> {
    let list = if path.is_dir() {
        segment::list(path).map_err(|e| format!("{}: {e}", path.display()))?
    } else {
        vec![path.to_path_buf()]
    };
    let mut s = Store {
        leaves: Vec::new(),
        checkpoints: Vec::new(),
        record: None,
    };
    let mut first = true;
    let mut problem = None;
    segment::for_each_record(&list, 0, |m| {
        if first {
            first = false;
            let fresh = m
                .get("tree")
                .and_then(merkle::frontier_of_json)
                .is_some_and(|(_, f)| f.size() == 0);
            if m.text("prev") != Some(GENESIS) && !fresh {
                problem = Some(
                    "the store does not hold the first records of its tree (removed by retention): a proof needs every leaf"
                        .to_string(),
                );
                return false;
            }
        }
        if let (Some(size), Some(root), Some(n)) = (
            m.get("tree_size").and_then(Value::as_u64),
            m.text("root"),
            m.text("note"),
        ) {
            s.checkpoints.push(Signed {
                size,
                root: root.to_string(),
                note: n.to_string(),
            });
        }
        if id.is_some() && m.text("id") == id {
            s.record = Some((s.leaves.len() as u64, m.clone()));
        }
        let hash = m.text("hash").unwrap_or_default();
        s.leaves.push(merkle::record_leaf(hash));
        true
    });
    match problem {
        Some(p) => Err(p),
        None => Ok(s),
    }
}

fn hexes(h: &[Hash]) -> Vec<String> {
    h.iter().map(|x| HEXLOWER.encode(x)).collect()
}

/// The inclusion proof of record `id` against the checkpoint of tree size
/// `size` (default: the last checkpoint whose tree holds it).
pub(crate) fn prove_inclusion(path: &Path, id: &str, size: Option<u64>) -> Result<Value, String> {
    let s = load(path, Some(id))?;
    let (index, record) = s
        .record
        .ok_or_else(|| format!("no record with id {id:?} in {}", path.display()))?;
    let c = match size {
        Some(n) => s
            .checkpoints
            .iter()
            .find(|c| c.size == n)
            .ok_or_else(|| format!("no checkpoint of tree size {n} in the store"))?,
        None => s
            .checkpoints
            .last()
            .ok_or("no checkpoint with a tree root in the store")?,
    };
    if index >= c.size {
        return Err(format!(
            "record {id} is leaf {index}, after the checkpoint of tree size {}: prove it once a later checkpoint is written",
            c.size
        ));
    }
    let leaves = &s.leaves[..c.size as usize];
    let proof = merkle::inclusion_proof(leaves, index as usize);
    Ok(json!({
        "proof": INCLUSION,
        "record": record,
        "leaf_index": index,
        "tree_size": c.size,
        "root": c.root,
        "note": c.note,
        "hashes": hexes(&proof),
    }))
}

/// The consistency proof from the checkpoint of tree size `old` to the
/// one of tree size `new`.
pub(crate) fn prove_consistency(path: &Path, old: u64, new: u64) -> Result<Value, String> {
    if old > new {
        return Err(format!(
            "tree size {old} is after {new}: give the earlier first"
        ));
    }
    let s = load(path, None)?;
    let find = |n: u64| {
        s.checkpoints
            .iter()
            .find(|c| c.size == n)
            .ok_or_else(|| format!("no checkpoint of tree size {n} in the store"))
    };
    let (a, b) = (find(old)?, find(new)?);
    let proof = merkle::consistency_proof(&s.leaves[..new as usize], old as usize);
    Ok(json!({
        "proof": CONSISTENCY,
        "old": a.json(),
        "new": b.json(),
        "hashes": hexes(&proof),
    }))
}

/// A checkpoint of a proof: its note opened with `key` and agreeing with
/// the `tree_size` and `root` beside it.
pub(crate) fn signed(
    v: &Value,
    what: &str,
    key: &VerifyingKey,
) -> Result<note::Checkpoint, String> {
    let size = v.need_u64("tree_size", || format!("{what}: no tree_size"))?;
    let root = v.need_text("root", || format!("{what}: no root"))?;
    let n = v.need_text("note", || format!("{what}: no note"))?;
    let c = note::open_checkpoint(n, key).map_err(|e| format!("{what}: {e}"))?;
    if c.size != size || HEXLOWER.encode(&c.root) != root {
        return Err(format!(
            "{what}: the proof is for tree size {size} root {root}, the signed note is for tree size {} root {}",
            c.size,
            HEXLOWER.encode(&c.root)
        ));
    }
    Ok(c)
}

fn proof_hashes(v: &Value) -> Result<Vec<Hash>, String> {
    merkle::hash_list(v.get("hashes"), "hashes")
}

/// Check a proof with the public key alone: what it proves, or why not.
pub(crate) fn check(v: &Value, key: &VerifyingKey) -> Result<String, String> {
    match v.text("proof") {
        Some(INCLUSION) => {
            let c = signed(v, "checkpoint", key)?;
            let record = v
                .get("record")
                .and_then(Value::as_object)
                .ok_or("no record")?;
            let hash = record.need_text("hash", || "record has no hash")?;
            if chain::record_hash(record) != hash {
                return Err("hash does not match the record: record edited".into());
            }
            let index = v.need_u64("leaf_index", || "no leaf_index")?;
            let hashes = proof_hashes(v)?;
            merkle::verify_inclusion(index, c.size, &merkle::record_leaf(hash), &hashes, &c.root)
                .map_err(|e| format!("inclusion proof: {e}"))?;
            let id = record.text("id").unwrap_or("?");
            Ok(format!(
                "ok: record {id} is leaf {index} of the tree of {} records signed by {} (root {})",
                c.size,
                c.origin,
                HEXLOWER.encode(&c.root)
            ))
        }
        Some(CONSISTENCY) => {
            let old = signed(v.get("old").unwrap_or(&Value::Null), "old checkpoint", key)?;
            let new = signed(v.get("new").unwrap_or(&Value::Null), "new checkpoint", key)?;
            if old.origin != new.origin {
                return Err(format!(
                    "the checkpoints are of two logs: {} and {}",
                    old.origin, new.origin
                ));
            }
            let hashes = proof_hashes(v)?;
            merkle::verify_consistency(old.size, new.size, &old.root, &new.root, &hashes)
                .map_err(|e| format!("consistency proof: {e}"))?;
            Ok(format!(
                "ok: the tree of {} records signed by {} extends the tree of {}",
                new.size, new.origin, old.size
            ))
        }
        other => Err(format!(
            "not a Palisade proof (proof = {other:?}; expected {INCLUSION:?} or {CONSISTENCY:?})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> (std::path::PathBuf, std::path::PathBuf, VerifyingKey) {
        crate::evidence::tests::sealed_store("proof", 4, 2500, 15, &[]).await
    }

    fn ids(dir: &Path) -> Vec<String> {
        let mut v = Vec::new();
        segment::for_each_record(&segment::list(dir).unwrap(), 0, |m| {
            v.push(m["id"].as_str().unwrap().to_string());
            true
        });
        v
    }

    #[tokio::test]
    async fn proofs_verify_and_every_tampering_fails_without_a_panic() {
        let (root, dir, key) = store().await;
        let ids = ids(&dir);
        assert!(segment::list(&dir).unwrap().len() >= 2);
        // Every record is proved against the last checkpoint but the seal.
        for id in &ids[..ids.len() - 1] {
            let p = prove_inclusion(&dir, id, None).unwrap();
            let ok = check(&p, &key).unwrap();
            assert!(ok.contains(id.as_str()), "{ok}");
        }
        let p = prove_inclusion(&dir, &ids[3], None).unwrap();
        let sizes: Vec<u64> = load(&dir, None)
            .unwrap()
            .checkpoints
            .iter()
            .map(|c| c.size)
            .collect();
        for w in sizes.windows(2) {
            let c = prove_consistency(&dir, w[0], w[1]).unwrap();
            check(&c, &key).unwrap();
        }
        let c = prove_consistency(&dir, sizes[0], *sizes.last().unwrap()).unwrap();
        check(&c, &key).unwrap();

        type Edit = fn(&mut Value);
        let inclusion_edits: [(&str, Edit); 8] = [
            ("truncated note", |p| {
                let n = p["note"].as_str().unwrap().to_string();
                p["note"] = n[..n.len() - 20].into();
            }),
            ("edited note", |p| {
                let n = p["note"].as_str().unwrap().replacen('\n', "0\n", 2);
                p["note"] = n.into();
            }),
            ("proof for another tree size", |p| {
                p["tree_size"] = (p["tree_size"].as_u64().unwrap() + 1).into();
            }),
            ("another leaf index", |p| {
                p["leaf_index"] = (p["leaf_index"].as_u64().unwrap() + 1).into();
            }),
            ("edited record", |p| {
                p["record"]["host"] = "x.test".into();
            }),
            ("hash cut off", |p| {
                p["hashes"].as_array_mut().unwrap().pop();
            }),
            ("hash not hex", |p| {
                p["hashes"][0] = "zz".into();
            }),
            ("no record", |p| {
                p.as_object_mut().unwrap().remove("record");
            }),
        ];
        for (what, edit) in inclusion_edits {
            let mut bad = p.clone();
            edit(&mut bad);
            assert!(check(&bad, &key).is_err(), "{what}");
        }
        let mut bad = c.clone();
        bad["old"]["note"] = bad["new"]["note"].clone();
        assert!(check(&bad, &key).is_err());
        let mut bad = c.clone();
        bad["hashes"].as_array_mut().unwrap().reverse();
        assert!(check(&bad, &key).is_err());
        let other = ed25519_dalek::SigningKey::from_bytes(&[3; 32]).verifying_key();
        assert!(check(&p, &other).is_err());
        for junk in [
            json!(null),
            json!([]),
            json!({"proof": INCLUSION}),
            json!({"proof": CONSISTENCY, "old": 1}),
        ] {
            assert!(check(&junk, &key).is_err(), "{junk}");
        }
        assert!(prove_inclusion(&dir, "no-such-id", None).is_err());
        assert!(prove_inclusion(&dir, ids.last().unwrap(), None).is_err());
        assert!(prove_consistency(&dir, 3, 2).is_err());
        assert!(prove_consistency(&dir, 1, 2).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
