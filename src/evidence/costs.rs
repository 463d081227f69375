//! The steps a record goes through on the deciding task, one by one, for
//! `benches/evidence.rs` to time apart: its id, its reference (an HMAC of
//! the id), its timestamp, its canonical serialisation, and, on the writing
//! leader, its chaining (the line with `seq`, `prev` and the SHA-256 `hash`
//! put in, copied into the batch). Not part of the proxy: the steps are the
//! same functions [`super::Evidence`] calls, behind names a bench can reach.

use std::time::Duration;

use super::chain::Prepared;
use super::merkle::Frontier;
use super::reference::RefKey;
use super::writer::{now_ts, Ids};
use super::Record;

/// The per-record steps, with a fixed key and id prefix.
pub struct Steps {
    ids: Ids,
    refs: RefKey,
}

/// The writer's Merkle tree state (the right edge).
#[derive(Default)]
pub struct Tree(Frontier);

/// The writer's org trees ([`super::merkle::OrgTrees`]).
#[derive(Default)]
pub struct Orgs(super::merkle::OrgTrees);

/// A record serialised in its canonical form, ready to be chained.
pub struct Serialised(Prepared);

impl Default for Steps {
    fn default() -> Self {
        Steps {
            ids: Ids::new("bench", Duration::from_secs(1)),
            refs: RefKey::from_seed(&[7; 32]),
        }
    }
}

impl Steps {
    /// A new record id.
    pub fn id(&self) -> String {
        self.ids.next()
    }

    /// The reference a client would be shown for `id`.
    pub fn reference(&self, id: &str) -> String {
        self.refs.of(id)
    }

    /// The record's timestamp, now.
    pub fn ts(&self) -> String {
        now_ts()
    }

    /// The canonical serialisation.
    pub fn serialise(&self, record: &Record) -> Serialised {
        Serialised(super::canon::record(record).expect("a Record always serialises"))
    }

    /// Chain it as number `seq` after `prev` into `batch`; its hash.
    pub fn chain(&self, line: &Serialised, seq: u64, prev: &str, batch: &mut Vec<u8>) -> String {
        line.0.seal_into(seq, prev, batch)
    }

    /// Make the record whose hash is `hash` the tree's next leaf, as the
    /// writer does after chaining it.
    pub fn leaf(&self, hash: &str, tree: &mut Tree) {
        tree.0.push(super::merkle::record_leaf(hash));
    }

    /// Add the record whose hash is `hash` to `org`'s tree, as the writer
    /// does after chaining a record of an org (its leaf computed once for
    /// both trees).
    pub fn org_leaf(&self, org: &str, hash: &str, orgs: &mut Orgs) {
        orgs.0.push(org, super::merkle::record_leaf(hash));
    }

    /// A checkpoint's `org_count` and `orgs_root` over `orgs`: once per
    /// checkpoint.
    pub fn org_commitment(&self, orgs: &Orgs) -> (u64, [u8; 32]) {
        orgs.0.commitment()
    }

    /// With witnesses: the leaf of the record whose hash is `hash` copied
    /// into the write's feed for the submitter, as the writer does.
    pub fn witness_leaf(&self, hash: &str, feed: &mut Vec<[u8; 32]>) {
        feed.push(super::merkle::record_leaf(hash));
    }

    /// With witnesses, once per checkpoint and witness: the consistency
    /// proof from `old` over the leaves after it (as the submitter keeps
    /// them), the `add-checkpoint` body for `note`, and the check of a
    /// witness's cosignature of the new tree. Returns the body's length.
    pub fn witness_round(&self, old: &Tree, leaves: &[[u8; 32]], note: &str) -> usize {
        let proof = super::merkle::consistency_proof_from(&old.0, leaves);
        let body = super::witness::request_body(old.0.size(), &proof, note);
        let mut tree = old.0.clone();
        leaves.iter().for_each(|l| tree.push(*l));
        let origin = super::note::origin("bench");
        let text = super::note::checkpoint_body(&origin, tree.size(), &tree.root());
        let w = ed25519_dalek::SigningKey::from_bytes(&[8; 32]);
        let line = super::note::cosign(&text, "witness.bench/w", &w, 1_700_000_000);
        let vkey = super::note::Vkey {
            name: "witness.bench/w".into(),
            kind: super::note::COSIGNATURE_V1,
            key: w.verifying_key(),
        };
        let ok = super::note::open_cosignature(&line, &text, &vkey).is_ok();
        body.len() + usize::from(ok)
    }

    /// The tree after `leaves` more leaves (for [`Steps::witness_round`]).
    pub fn grown(&self, tree: &Tree, leaves: &[[u8; 32]]) -> Tree {
        let mut t = tree.0.clone();
        leaves.iter().for_each(|l| t.push(*l));
        Tree(t)
    }

    /// A checkpoint's signed note over `tree` (its root, the body, the
    /// Ed25519 signature): once per checkpoint, not per record.
    pub fn checkpoint_note(&self, tree: &Tree) -> String {
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let origin = super::note::origin("bench");
        let body = super::note::checkpoint_body(&origin, tree.0.size(), &tree.0.root());
        super::note::sign(&body, &origin, &key)
    }
}
