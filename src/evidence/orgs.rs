//! One Merkle tree per org, and the tree over the orgs that each
//! checkpoint commits to. Pure functions over hashes and JSON values: no
//! I/O (but [`at_head`], which replays the last segment at a restart), no
//! clock.
//!
//! - An org's tree has as leaves that org's records (those whose `org` is
//!   its name) in chain order, each leaf the record's Merkle leaf
//!   ([`merkle::record_leaf`]), in RFC 6962 form as the global tree.
//! - A checkpoint commits to every org's tree through `orgs_root`: the
//!   RFC 6962 root over one leaf per org that has a record, in byte order
//!   of the names, whose leaf data is the canonical JSON
//!   `{"org":NAME,"root":HEX,"size":N}` ([`entry`]). An org's export shows
//!   its own entry and the inclusion proof of it: sibling hashes, which
//!   reveal the number of orgs (within a power of two) and nothing of
//!   their names or records.
//! - A segment header's `org_trees` holds every org's right edge
//!   (`{NAME: {"size": N, "hashes": [HEX]}}`), so a restart continues the
//!   trees; it is in the store, never in an export.

use std::collections::BTreeMap;
use std::path::PathBuf;

use data_encoding::HEXLOWER;
use serde_json::{json, Map, Value};

use super::chain;
use super::merkle::{self, Frontier, Hash};

/// Every org's tree, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct OrgTrees {
    trees: BTreeMap<String, Frontier>,
}

/// The leaf data of an org's entry in the tree over the orgs.
pub(crate) fn entry(org: &str, size: u64, root: &Hash) -> Value {
    json!({"org": org, "root": HEXLOWER.encode(root), "size": size})
}

/// The leaf hash of an entry ([`entry`]).
pub(crate) fn entry_leaf(entry: &Value) -> Hash {
    let mut data = Vec::new();
    chain::canonical_into(entry, &mut data);
    merkle::leaf_hash(&data)
}

/// The org whose tree a record joins: its `org`, when a string.
pub(crate) fn org_of(m: &Map<String, Value>) -> Option<&str> {
    m.get("org").and_then(Value::as_str)
}

impl OrgTrees {
    /// Append a record's leaf ([`merkle::record_leaf`]) to `org`'s tree.
    pub(crate) fn push(&mut self, org: &str, leaf: Hash) {
        match self.trees.get_mut(org) {
            Some(f) => f.push(leaf),
            None => {
                let mut f = Frontier::default();
                f.push(leaf);
                self.trees.insert(org.to_string(), f);
            }
        }
    }

    /// Append a record (a map) to its org's tree, if it has an org.
    pub(crate) fn push_record(&mut self, m: &Map<String, Value>) {
        if let (Some(org), Some(hash)) = (org_of(m), m.get("hash").and_then(Value::as_str)) {
            self.push(org, merkle::record_leaf(hash));
        }
    }

    /// `org`'s tree, if it has a record.
    pub(crate) fn tree(&self, org: &str) -> Option<&Frontier> {
        self.trees.get(org)
    }

    /// The entries (leaf data) of the tree over the orgs, in its order.
    pub(crate) fn entries(&self) -> Vec<Value> {
        self.trees
            .iter()
            .map(|(org, f)| entry(org, f.size(), &f.root()))
            .collect()
    }

    /// The leaves of the tree over the orgs.
    pub(crate) fn leaves(&self) -> Vec<Hash> {
        self.entries().iter().map(entry_leaf).collect()
    }

    /// `org`'s index among the orgs, and the inclusion proof of its entry.
    pub(crate) fn prove(&self, org: &str) -> Option<(u64, Vec<Hash>)> {
        let i = self.trees.keys().position(|k| k == org)?;
        Some((i as u64, merkle::inclusion_proof(&self.leaves(), i)))
    }

    /// What a checkpoint commits to: the number of orgs and the root.
    pub(crate) fn commitment(&self) -> (u64, Hash) {
        (self.trees.len() as u64, merkle::root(&self.leaves()))
    }

    /// A header's `org_trees`.
    pub(crate) fn to_json(&self) -> Value {
        let m: Map<String, Value> = self
            .trees
            .iter()
            .map(|(org, f)| {
                let hashes: Vec<Value> = f
                    .hashes()
                    .iter()
                    .map(|h| HEXLOWER.encode(h).into())
                    .collect();
                (org.clone(), json!({"size": f.size(), "hashes": hashes}))
            })
            .collect();
        Value::Object(m)
    }

    /// A header's `org_trees` read back, or `None` when malformed.
    pub(crate) fn of_json(v: &Value) -> Option<OrgTrees> {
        let mut trees = BTreeMap::new();
        for (org, t) in v.as_object()? {
            let size = t.get("size")?.as_u64()?;
            let hashes = t
                .get("hashes")?
                .as_array()?
                .iter()
                .map(|h| h.as_str().and_then(chain::unhex::<32>))
                .collect::<Option<Vec<Hash>>>()?;
            trees.insert(org.clone(), Frontier::from_parts(size, hashes)?);
        }
        Some(OrgTrees { trees })
    }

    /// Add a checkpoint's `org_count` and `orgs_root` to `m`.
    pub(crate) fn commit_into(&self, m: &mut Map<String, Value>) {
        let (count, root) = self.commitment();
        m.insert("org_count".into(), count.into());
        m.insert("orgs_root".into(), HEXLOWER.encode(&root).into());
    }

    /// A checkpoint's `org_count` and `orgs_root` against these trees.
    pub(crate) fn check(&self, m: &Map<String, Value>) -> Result<(), String> {
        let (count, root) = self.commitment();
        let (c, r) = (
            m.get("org_count").and_then(Value::as_u64),
            m.get("orgs_root").and_then(Value::as_str),
        );
        if c != Some(count) || r != Some(HEXLOWER.encode(&root).as_str()) {
            return Err(format!(
                "checkpoint orgs_root does not match the trees of the {count} orgs' records before it: inconsistent checkpoint"
            ));
        }
        Ok(())
    }
}

/// The org trees at the chain head `last_seq` of the segments `list`
/// (a restart): from the last header holding `org_trees` (or a chain
/// starting at genesis), replaying the records after it. `None` when no
/// header holds them (a store written before the org trees, whose trees
/// then start at the next header) or the replay does not reach the head.
pub(crate) fn at_head(list: &[PathBuf], last_seq: u64) -> Option<OrgTrees> {
    let mut from = None;
    for (i, p) in list.iter().enumerate().rev() {
        let Some(h) = super::segment::header(p) else {
            continue;
        };
        if let Some(t) = h.get("org_trees").and_then(OrgTrees::of_json) {
            from = Some((i, t));
            break;
        }
        if h.get("prev").and_then(Value::as_str) == Some(chain::GENESIS) {
            from = Some((i, OrgTrees::default()));
            break;
        }
    }
    let (start, mut trees) = from?;
    let mut reached = false;
    super::segment::for_each_record(list, start, |m| {
        let Some(seq) = m.get("seq").and_then(Value::as_u64) else {
            return false;
        };
        trees.push_record(m);
        reached = seq == last_seq;
        seq < last_seq
    });
    reached.then_some(trees)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(org: Option<&str>, hash: &str) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("org".into(), org.map_or(Value::Null, Value::from));
        m.insert("hash".into(), hash.into());
        m
    }

    #[test]
    fn trees_per_org_commit_and_round_trip() {
        let h = |b: u8| HEXLOWER.encode(&[b; 32]);
        let mut t = OrgTrees::default();
        for (i, org) in ["beta", "acme", "acme", "zed", "acme"].iter().enumerate() {
            t.push_record(&rec(Some(org), &h(i as u8)));
        }
        t.push_record(&rec(None, &h(9)));
        // acme's tree is the RFC 6962 tree of its own leaves.
        let acme: Vec<Hash> = [1u8, 2, 4]
            .iter()
            .map(|b| merkle::record_leaf(&h(*b)))
            .collect();
        assert_eq!(t.tree("acme").unwrap().root(), merkle::root(&acme));
        assert_eq!(t.tree("acme").unwrap().size(), 3);
        assert!(t.tree("nobody").is_none());
        // The orgs in name order; acme's entry is proved against the root.
        let (count, root) = t.commitment();
        assert_eq!(count, 3);
        let (i, proof) = t.prove("acme").unwrap();
        assert_eq!(i, 0);
        let e = entry("acme", 3, &merkle::root(&acme));
        merkle::verify_inclusion(i, count, &entry_leaf(&e), &proof, &root).unwrap();
        // A wrong size in the entry does not verify.
        let e2 = entry("acme", 2, &merkle::root(&acme));
        assert!(merkle::verify_inclusion(i, count, &entry_leaf(&e2), &proof, &root).is_err());
        // Header form round trip; malformed is None.
        assert_eq!(OrgTrees::of_json(&t.to_json()).unwrap(), t);
        assert!(OrgTrees::of_json(&json!({"a": {"size": 3, "hashes": []}})).is_none());
        assert!(OrgTrees::of_json(&json!([])).is_none());
        let mut m = Map::new();
        t.commit_into(&mut m);
        t.check(&m).unwrap();
        m.insert("org_count".into(), 2.into());
        assert!(t.check(&m).unwrap_err().contains("inconsistent checkpoint"));
    }
}
