//! The Merkle tree over the chain's records, in RFC 6962 / RFC 9162 form.
//! Pure functions over hashes: no I/O, no clock.
//!
//! - leaf hash = SHA-256(0x00 || leaf data), node hash = SHA-256(0x01 ||
//!   left || right); the tree of n leaves splits at the largest power of
//!   two below n (left-balanced, nothing duplicated).
//! - The leaf data of a record is the 32 bytes its `hash` field holds in
//!   hex (the SHA-256 of its canonical form without `hash`), so a record
//!   alone gives its leaf.
//! - [`Frontier`] is the writer's whole tree state: the roots of the
//!   complete subtrees along the right edge, at most 64 hashes.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;

use data_encoding::HEXLOWER;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// A SHA-256 value.
pub(crate) type Hash = [u8; 32];

/// SHA-256 of the empty string: the root of the empty tree.
pub(crate) fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

/// RFC 6962 leaf hash of `data`.
pub(crate) fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

/// RFC 6962 interior node hash.
pub(crate) fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The largest power of two strictly below `n` (n >= 2).
fn split(n: usize) -> usize {
    let mut k = 1;
    while k * 2 < n {
        k *= 2;
    }
    k
}

/// MTH over leaf hashes.
pub(crate) fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n);
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// The right edge of a tree: enough to append and to compute the root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Frontier {
    size: u64,
    /// Roots of the complete subtrees, largest (leftmost) first; one per
    /// set bit of `size`.
    hashes: Vec<Hash>,
}

impl Frontier {
    /// Become a copy of `other`, in the room this one already has.
    pub(crate) fn copy_from(&mut self, other: &Frontier) {
        self.size = other.size;
        self.hashes.clone_from(&other.hashes);
    }

    /// A frontier as stored, checked: one hash per set bit of `size`.
    pub(crate) fn from_parts(size: u64, hashes: Vec<Hash>) -> Option<Frontier> {
        (hashes.len() == size.count_ones() as usize).then_some(Frontier { size, hashes })
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    pub(crate) fn hashes(&self) -> &[Hash] {
        &self.hashes
    }

    /// Append a leaf (its leaf hash).
    pub(crate) fn push(&mut self, leaf: Hash) {
        let mut h = leaf;
        // Each trailing one bit of the old size is a subtree of the same
        // height as the new one: merge them.
        let mut s = self.size;
        while s & 1 == 1 {
            // A set bit always has its hash.
            let Some(left) = self.hashes.pop() else { break };
            h = node_hash(&left, &h);
            s >>= 1;
        }
        self.hashes.push(h);
        self.size += 1;
    }

    /// The tree's root.
    pub(crate) fn root(&self) -> Hash {
        let mut it = self.hashes.iter().rev();
        let Some(last) = it.next() else {
            return empty_root();
        };
        it.fold(*last, |acc, left| node_hash(left, &acc))
    }
}

/// The leaf hash of a record whose `hash` field is `hex`: the leaf data is
/// the 32 bytes that field spells (all zeros if it spells none, which no
/// written record does and which then matches no verifier's leaf).
pub(crate) fn record_leaf(hex: &str) -> Hash {
    leaf_hash(&super::chain::unhex::<32>(hex).unwrap_or([0; 32]))
}

/// A segment header's `tree`: `{"base": SEQ, "size": N, "hashes": [HEX]}`,
/// the tree of the records from seq `base` up to the header.
pub(crate) fn frontier_json(base: u64, f: &Frontier) -> serde_json::Value {
    let hashes: Vec<serde_json::Value> = f
        .hashes()
        .iter()
        .map(|h| data_encoding::HEXLOWER.encode(h).into())
        .collect();
    serde_json::json!({"base": base, "size": f.size, "hashes": hashes})
}

/// A JSON list of hex hashes (`what` names it in the error): the hashes,
/// or which one is not 64 hex digits.
pub(crate) fn hash_list(v: Option<&serde_json::Value>, what: &str) -> Result<Vec<Hash>, String> {
    v.and_then(serde_json::Value::as_array)
        .ok_or_else(|| format!("{what}: missing"))?
        .iter()
        .enumerate()
        .map(|(i, h)| {
            h.as_str()
                .and_then(super::chain::unhex::<32>)
                .ok_or_else(|| format!("{what}[{i}] is not 64 hex digits"))
        })
        .collect()
}

/// A header's `tree`, read back: `(base, frontier)`, or `None` when it is
/// malformed.
pub(crate) fn frontier_of_json(v: &serde_json::Value) -> Option<(u64, Frontier)> {
    let base = v.get("base")?.as_u64()?;
    let size = v.get("size")?.as_u64()?;
    let hashes = v
        .get("hashes")?
        .as_array()?
        .iter()
        .map(|h| h.as_str().and_then(super::chain::unhex::<32>))
        .collect::<Option<Vec<Hash>>>()?;
    Some((base, Frontier::from_parts(size, hashes)?))
}

/// RFC 6962 `PATH(m, D[n])`: the inclusion proof of leaf `m`.
pub(crate) fn inclusion_proof(leaves: &[Hash], m: usize) -> Vec<Hash> {
    let n = leaves.len();
    if n <= 1 || m >= n {
        return Vec::new();
    }
    let k = split(n);
    if m < k {
        let mut p = inclusion_proof(&leaves[..k], m);
        p.push(root(&leaves[k..]));
        p
    } else {
        let mut p = inclusion_proof(&leaves[k..], m - k);
        p.push(root(&leaves[..k]));
        p
    }
}

/// RFC 6962 `PROOF(m, D[n])`: the consistency proof of the first `m` leaves.
pub(crate) fn consistency_proof(leaves: &[Hash], m: usize) -> Vec<Hash> {
    if m == 0 || m >= leaves.len() {
        return Vec::new();
    }
    subproof(m, leaves, true)
}

fn subproof(m: usize, leaves: &[Hash], whole: bool) -> Vec<Hash> {
    let n = leaves.len();
    if m == n {
        return if whole {
            Vec::new()
        } else {
            vec![root(leaves)]
        };
    }
    let k = split(n);
    if m <= k {
        let mut p = subproof(m, &leaves[..k], whole);
        p.push(root(&leaves[k..]));
        p
    } else {
        let mut p = subproof(m - k, &leaves[k..], false);
        p.push(root(&leaves[..k]));
        p
    }
}

/// `PROOF(m, D[n])` from what a writer keeps instead of every leaf: the
/// frontier of the first `m` leaves and the leaves after it. Every hash
/// of the proof inside the first `m` leaves is a frontier subtree or a
/// fold of the frontier's right-hand subtrees, so no older leaf is needed.
pub(crate) fn consistency_proof_from(old: &Frontier, new: &[Hash]) -> Vec<Hash> {
    let m = old.size as usize;
    if m == 0 || new.is_empty() {
        return Vec::new();
    }
    let mut nodes = Vec::with_capacity(old.hashes.len());
    let mut start = 0usize;
    let mut bits = old.hashes.iter();
    for b in (0..usize::BITS).rev() {
        if m & (1 << b) != 0 {
            let Some(h) = bits.next() else { break };
            nodes.push((start, start + (1 << b), *h));
            start += 1 << b;
        }
    }
    let t = Split {
        m,
        old: &nodes,
        new,
    };
    t.sub(0, m + new.len(), true)
}

/// The tree of [`consistency_proof_from`]: frontier subtrees left of `m`,
/// leaves right of it.
struct Split<'a> {
    m: usize,
    old: &'a [(usize, usize, Hash)],
    new: &'a [Hash],
}

impl Split<'_> {
    /// MTH of leaves `lo..hi`: wholly right of `m`, or a run of frontier
    /// subtrees ending at `m` at the latest.
    fn range(&self, lo: usize, hi: usize) -> Hash {
        if lo >= self.m {
            return root(&self.new[lo - self.m..hi - self.m]);
        }
        let mut it = self
            .old
            .iter()
            .filter(|(s, e, _)| *s >= lo && *e <= hi)
            .map(|(_, _, h)| h)
            .rev();
        let Some(last) = it.next() else {
            return empty_root();
        };
        it.fold(*last, |acc, left| node_hash(left, &acc))
    }

    /// `SUBPROOF` over leaves `lo..hi`, the old tree ending at `self.m`.
    fn sub(&self, lo: usize, hi: usize, whole: bool) -> Vec<Hash> {
        let n = hi - lo;
        if self.m == hi {
            return if whole {
                Vec::new()
            } else {
                vec![self.range(lo, hi)]
            };
        }
        let k = split(n);
        if self.m - lo <= k {
            let mut p = self.sub(lo, lo + k, whole);
            p.push(self.range(lo + k, hi));
            p
        } else {
            let mut p = self.sub(lo + k, hi, false);
            p.push(self.range(lo, lo + k));
            p
        }
    }
}

/// Why a proof does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ProofError {
    #[error("leaf index {index} is not in a tree of {size} leaves")]
    IndexOutOfRange { index: u64, size: u64 },
    #[error("tree size {new} is smaller than {old}")]
    Shrinks { old: u64, new: u64 },
    #[error("the proof has {got} hashes; a proof for these tree sizes has {want}")]
    Length { got: usize, want: usize },
    #[error("the proof does not lead to the signed root")]
    RootMismatch,
    #[error("the proof does not lead to the earlier root")]
    OldRootMismatch,
}

/// RFC 9162 2.1.3.2: verify that `leaf` is leaf `index` of the tree of
/// `size` leaves whose root is `root`.
pub(crate) fn verify_inclusion(
    index: u64,
    size: u64,
    leaf: &Hash,
    proof: &[Hash],
    root: &Hash,
) -> Result<(), ProofError> {
    if index >= size {
        return Err(ProofError::IndexOutOfRange { index, size });
    }
    let (mut fn_, mut sn) = (index, size - 1);
    let mut r = *leaf;
    for p in proof {
        if sn == 0 {
            return Err(ProofError::Length {
                got: proof.len(),
                want: inclusion_len(index, size),
            });
        }
        if fn_ & 1 == 1 || fn_ == sn {
            r = node_hash(p, &r);
            if fn_ & 1 == 0 {
                while fn_ & 1 == 0 && fn_ != 0 {
                    fn_ >>= 1;
                    sn >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        fn_ >>= 1;
        sn >>= 1;
    }
    if sn != 0 {
        return Err(ProofError::Length {
            got: proof.len(),
            want: inclusion_len(index, size),
        });
    }
    if r != *root {
        return Err(ProofError::RootMismatch);
    }
    Ok(())
}

/// How many hashes an inclusion proof of `index` in `size` has.
fn inclusion_len(index: u64, size: u64) -> usize {
    let (mut fn_, mut sn, mut n) = (index, size.saturating_sub(1), 0);
    while sn != 0 {
        if fn_ & 1 == 0 && fn_ == sn {
            while fn_ & 1 == 0 && fn_ != 0 {
                fn_ >>= 1;
                sn >>= 1;
            }
        }
        if sn == 0 {
            break;
        }
        n += 1;
        fn_ >>= 1;
        sn >>= 1;
    }
    n
}

/// RFC 9162 2.1.4.2: verify that the tree of `new` leaves with root
/// `new_root` extends the tree of `old` leaves with root `old_root`.
pub(crate) fn verify_consistency(
    old: u64,
    new: u64,
    old_root: &Hash,
    new_root: &Hash,
    proof: &[Hash],
) -> Result<(), ProofError> {
    if old > new {
        return Err(ProofError::Shrinks { old, new });
    }
    if old == new {
        if !proof.is_empty() {
            return Err(ProofError::Length {
                got: proof.len(),
                want: 0,
            });
        }
        return if old_root == new_root {
            Ok(())
        } else {
            Err(ProofError::RootMismatch)
        };
    }
    if old == 0 {
        // Every tree extends the empty one; nothing to prove.
        return if proof.is_empty() {
            Ok(())
        } else {
            Err(ProofError::Length {
                got: proof.len(),
                want: 0,
            })
        };
    }
    let wrong_len = |want| ProofError::Length {
        got: proof.len(),
        want,
    };
    let mut path: Vec<Hash> = Vec::with_capacity(proof.len() + 1);
    if old.is_power_of_two() {
        path.push(*old_root);
    }
    path.extend_from_slice(proof);
    let (mut fn_, mut sn) = (old - 1, new - 1);
    while fn_ & 1 == 1 {
        fn_ >>= 1;
        sn >>= 1;
    }
    let Some((first, rest)) = path.split_first() else {
        return Err(wrong_len(1));
    };
    let (mut fr, mut sr) = (*first, *first);
    for c in rest {
        if sn == 0 {
            return Err(wrong_len(path.len() - 1));
        }
        if fn_ & 1 == 1 || fn_ == sn {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            if fn_ & 1 == 0 {
                while fn_ & 1 == 0 && fn_ != 0 {
                    fn_ >>= 1;
                    sn >>= 1;
                }
            }
        } else {
            sr = node_hash(&sr, c);
        }
        fn_ >>= 1;
        sn >>= 1;
    }
    if sn != 0 {
        return Err(wrong_len(proof.len() + 1));
    }
    if fr != *old_root {
        return Err(ProofError::OldRootMismatch);
    }
    if sr != *new_root {
        return Err(ProofError::RootMismatch);
    }
    Ok(())
}

// The tree per org ([`OrgTrees`]), and the tree over the orgs that each
// checkpoint commits to:
//
// - An org's tree has as leaves that org's records (those whose `org` is
//   its name) in chain order, each leaf the record's Merkle leaf
//   ([`record_leaf`]), in RFC 6962 form as the global tree.
// - A checkpoint commits to every org's tree through `orgs_root`: the
//   RFC 6962 root over one leaf per org that has a record, in byte order
//   of the names, whose leaf data is the canonical JSON
//   `{"org":NAME,"root":HEX,"size":N}` ([`entry`]). An org's export shows
//   its own entry and the inclusion proof of it: sibling hashes, which
//   reveal the number of orgs (within a power of two) and nothing of
//   their names or records.
// - A segment header's `org_trees` holds every org's right edge
//   (`{NAME: {"size": N, "hashes": [HEX]}}`), so a restart continues the
//   trees ([`super::segment::orgs_at_head`]); it is in the store, never in
//   an export.

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
    super::chain::canonical_into(entry, &mut data);
    leaf_hash(&data)
}

/// The org whose tree a record joins: its `org`, when a string.
pub(crate) fn org_of(m: &Map<String, Value>) -> Option<&str> {
    m.get("org").and_then(Value::as_str)
}

impl OrgTrees {
    /// Become a copy of `other`, in the room this one already has when
    /// both have the same orgs (as a batch's copy of the head has).
    pub(crate) fn copy_from(&mut self, other: &OrgTrees) {
        if self.trees.len() == other.trees.len() && self.trees.keys().eq(other.trees.keys()) {
            for (mine, theirs) in self.trees.values_mut().zip(other.trees.values()) {
                mine.copy_from(theirs);
            }
        } else {
            self.trees.clone_from(&other.trees);
        }
    }

    /// Append a record's leaf ([`record_leaf`]) to `org`'s tree.
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
            self.push(org, record_leaf(hash));
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
        Some((i as u64, inclusion_proof(&self.leaves(), i)))
    }

    /// What a checkpoint commits to: the number of orgs and the root.
    pub(crate) fn commitment(&self) -> (u64, Hash) {
        (self.trees.len() as u64, root(&self.leaves()))
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
                .map(|h| h.as_str().and_then(super::chain::unhex::<32>))
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

#[cfg(test)]
mod tests {
    use super::*;
    use data_encoding::HEXLOWER;

    // The reference tree of RFC 6962's test data (certificate-transparency
    // merkle_tree_test, Go merkle/logverifier tests): eight leaf inputs and
    // the root of the tree over the first n of them.
    const LEAVES: [&str; 8] = [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ];
    const ROOTS: [&str; 8] = [
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    ];

    fn h(s: &str) -> Hash {
        HEXLOWER.decode(s.as_bytes()).unwrap().try_into().unwrap()
    }

    fn leaves() -> Vec<Hash> {
        LEAVES
            .iter()
            .map(|l| leaf_hash(&HEXLOWER.decode(l.as_bytes()).unwrap()))
            .collect()
    }

    #[test]
    fn roots_match_the_reference_vectors() {
        let l = leaves();
        assert_eq!(
            HEXLOWER.encode(&empty_root()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let mut f = Frontier::default();
        for n in 1..=8 {
            f.push(l[n - 1]);
            assert_eq!(root(&l[..n]), h(ROOTS[n - 1]), "size {n}");
            assert_eq!(f.root(), h(ROOTS[n - 1]), "frontier size {n}");
            assert_eq!(f.hashes().len(), n.count_ones() as usize);
        }
    }

    /// (index, size, proof) of the reference inclusion vectors.
    fn inclusion_vectors() -> Vec<(usize, usize, Vec<&'static str>)> {
        vec![
            (0, 1, vec![]),
            (
                0,
                8,
                vec![
                    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
                ],
            ),
            (
                5,
                8,
                vec![
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                    "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
            (
                2,
                3,
                vec!["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"],
            ),
            (
                1,
                5,
                vec![
                    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                ],
            ),
        ]
    }

    #[test]
    fn inclusion_proofs_match_the_reference_vectors() {
        let l = leaves();
        for (m, n, want) in inclusion_vectors() {
            let want: Vec<Hash> = want.iter().map(|s| h(s)).collect();
            assert_eq!(inclusion_proof(&l[..n], m), want, "leaf {m} of {n}");
            let r = h(ROOTS[n - 1]);
            verify_inclusion(m as u64, n as u64, &l[m], &want, &r).unwrap();
            // Another index, another size, another leaf, a proof cut or
            // padded: each fails.
            if n > 1 {
                assert!(verify_inclusion(m as u64 ^ 1, n as u64, &l[m], &want, &r).is_err());
                assert!(verify_inclusion(m as u64, n as u64 * 2, &l[m], &want, &r).is_err());
                assert!(verify_inclusion(m as u64, n as u64, &l[(m + 1) % n], &want, &r).is_err());
                assert!(verify_inclusion(m as u64, n as u64, &l[m], &want[1..], &r).is_err());
            }
            let mut longer = want.clone();
            longer.push(r);
            assert!(verify_inclusion(m as u64, n as u64, &l[m], &longer, &r).is_err());
        }
        assert!(verify_inclusion(8, 8, &l[0], &[], &h(ROOTS[7])).is_err());
        assert!(verify_inclusion(0, 0, &l[0], &[], &empty_root()).is_err());
    }

    #[test]
    fn every_inclusion_proof_verifies_up_to_33_leaves() {
        let l: Vec<Hash> = (0u32..33).map(|i| leaf_hash(&i.to_be_bytes())).collect();
        for n in 1..=l.len() {
            let r = root(&l[..n]);
            for m in 0..n {
                let p = inclusion_proof(&l[..n], m);
                assert_eq!(p.len(), inclusion_len(m as u64, n as u64));
                verify_inclusion(m as u64, n as u64, &l[m], &p, &r).unwrap();
            }
        }
    }

    /// (old, new, proof) of the reference consistency vectors.
    fn consistency_vectors() -> Vec<(usize, usize, Vec<&'static str>)> {
        vec![
            (1, 1, vec![]),
            (
                1,
                8,
                vec![
                    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
                ],
            ),
            (
                6,
                8,
                vec![
                    "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
                    "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
            (
                2,
                5,
                vec![
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                ],
            ),
        ]
    }

    #[test]
    fn consistency_proofs_match_the_reference_vectors() {
        let l = leaves();
        for (m, n, want) in consistency_vectors() {
            let want: Vec<Hash> = want.iter().map(|s| h(s)).collect();
            assert_eq!(consistency_proof(&l[..n], m), want, "{m} -> {n}");
            let (r1, r2) = (h(ROOTS[m - 1]), h(ROOTS[n - 1]));
            verify_consistency(m as u64, n as u64, &r1, &r2, &want).unwrap();
            if m != n {
                assert!(verify_consistency(m as u64 + 1, n as u64, &r1, &r2, &want).is_err());
                assert!(verify_consistency(m as u64, n as u64 * 2, &r1, &r2, &want).is_err());
                assert!(verify_consistency(m as u64, n as u64, &r2, &r1, &want).is_err());
                assert!(verify_consistency(m as u64, n as u64, &r1, &r2, &[]).is_err());
                let mut bad = want.clone();
                bad[0] = empty_root();
                assert!(verify_consistency(m as u64, n as u64, &r1, &r2, &bad).is_err());
                assert!(
                    verify_consistency(m as u64, n as u64, &r1, &r2, &want[..want.len() - 1])
                        .is_err()
                );
            }
        }
        assert!(verify_consistency(2, 1, &l[0], &l[0], &[]).is_err());
        assert!(verify_consistency(1, 1, &l[0], &l[1], &[]).is_err());
    }

    #[test]
    fn every_consistency_proof_verifies_up_to_33_leaves() {
        let l: Vec<Hash> = (0u32..33).map(|i| leaf_hash(&i.to_be_bytes())).collect();
        for n in 1..=l.len() {
            for m in 1..=n {
                let p = consistency_proof(&l[..n], m);
                verify_consistency(m as u64, n as u64, &root(&l[..m]), &root(&l[..n]), &p).unwrap();
            }
        }
    }

    #[test]
    fn consistency_proofs_from_a_frontier_are_the_full_ones() {
        let l: Vec<Hash> = (0u32..40).map(|i| leaf_hash(&i.to_be_bytes())).collect();
        for n in 1..=l.len() {
            for m in 0..=n {
                let mut f = Frontier::default();
                l[..m].iter().for_each(|h| f.push(*h));
                assert_eq!(
                    consistency_proof_from(&f, &l[m..n]),
                    consistency_proof(&l[..n], m),
                    "m {m} n {n}"
                );
            }
        }
    }

    #[test]
    fn frontier_parts_round_trip() {
        let mut f = Frontier::default();
        for i in 0u8..13 {
            f.push(leaf_hash(&[i]));
        }
        let g = Frontier::from_parts(f.size(), f.hashes().to_vec()).unwrap();
        assert_eq!(f, g);
        assert!(Frontier::from_parts(13, vec![]).is_none());
    }
}

#[cfg(test)]
mod org_tests {
    use super::*;
    use data_encoding::HEXLOWER;
    use serde_json::{json, Map, Value};

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
        let acme: Vec<Hash> = [1u8, 2, 4].iter().map(|b| record_leaf(&h(*b))).collect();
        assert_eq!(t.tree("acme").unwrap().root(), root(&acme));
        assert_eq!(t.tree("acme").unwrap().size(), 3);
        assert!(t.tree("nobody").is_none());
        // The orgs in name order; acme's entry is proved against the root.
        let (count, orgs_root) = t.commitment();
        assert_eq!(count, 3);
        let (i, proof) = t.prove("acme").unwrap();
        assert_eq!(i, 0);
        let e = entry("acme", 3, &root(&acme));
        verify_inclusion(i, count, &entry_leaf(&e), &proof, &orgs_root).unwrap();
        // A wrong size in the entry does not verify.
        let e2 = entry("acme", 2, &root(&acme));
        assert!(verify_inclusion(i, count, &entry_leaf(&e2), &proof, &orgs_root).is_err());
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

#[cfg(test)]
mod copy_tests {
    use super::*;

    fn trees(orgs: &[&str], leaves: u8) -> OrgTrees {
        let mut t = OrgTrees::default();
        for i in 0..leaves {
            for org in orgs {
                t.push(org, leaf_hash(&[i, org.len() as u8]));
            }
        }
        t
    }

    /// A copy made in the room of another is the source, whatever the two
    /// held before: same orgs, other orgs, more or fewer of them.
    #[test]
    fn copies_in_place_equal_the_source() {
        let sources = [
            trees(&["a", "b"], 5),
            trees(&["a", "b"], 1),
            trees(&["a"], 9),
            trees(&["b", "c", "d"], 3),
            OrgTrees::default(),
        ];
        for into in &sources {
            for from in &sources {
                let mut copy = into.clone();
                copy.copy_from(from);
                assert_eq!(&copy, from);
                let mut f = into.tree("a").cloned().unwrap_or_default();
                let want = from.tree("a").cloned().unwrap_or_default();
                f.copy_from(&want);
                assert_eq!(f, want);
            }
        }
    }
}
