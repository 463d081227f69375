//! Record references: what a client is shown instead of a record's `id`.
//!
//! Ids are the replica, a per-start prefix and a global counter
//! (`REPLICA-START-N`), so two ids shown to one org would tell it how many
//! decisions every other org caused in between. A client is shown `ref` instead: the first 8 bytes (16
//! lowercase hex characters) of HMAC-SHA256 over the record's `id`, keyed
//! with a key derived from the checkpoint signing key. The record keeps
//! both fields (the chain covers `ref` like any other field), so an
//! operator finds a record by what the client quoted
//! (`palisade evidence query --ref REF`), across restarts, and whoever
//! holds the signing key can recompute any reference from an id.

#[cfg(test)]
use data_encoding::HEXLOWER;
use sha2::{Digest, Sha256};

/// Characters in a reference (hex of its first 8 HMAC bytes).
pub(crate) const REF_LEN: usize = 16;

/// Domain separation: this key is used for nothing but references.
const CONTEXT: &[u8] = b"palisade record reference v1\0";

const BLOCK: usize = 64;

/// The HMAC key references are made with: SHA-256 with the key's inner
/// and outer pads already taken in, so that a reference costs the hashing
/// of the id and of the inner hash only (the same HMAC).
#[derive(Clone)]
pub(crate) struct RefKey {
    inner: Sha256,
    outer: Sha256,
}

impl std::fmt::Debug for RefKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RefKey(..)")
    }
}

impl RefKey {
    /// Derived from the 32-byte signing key seed.
    pub(crate) fn from_seed(seed: &[u8; 32]) -> RefKey {
        let mut h = Sha256::new();
        h.update(CONTEXT);
        h.update(seed);
        RefKey::keyed(&h.finalize().into())
    }

    /// HMAC-SHA256 with `key` (32 bytes: one block with its padding).
    fn keyed(key: &[u8; 32]) -> RefKey {
        let mut k = [0u8; BLOCK];
        k[..key.len()].copy_from_slice(key);
        let pad = |x: u8| k.map(|b| b ^ x);
        RefKey {
            inner: Sha256::new().chain_update(pad(0x36)),
            outer: Sha256::new().chain_update(pad(0x5c)),
        }
    }

    /// The reference of the record whose id is `id`.
    pub(crate) fn of(&self, id: &str) -> String {
        let mac = self.mac(id.as_bytes());
        super::chain::hex(&mac[..REF_LEN / 2])
    }

    /// HMAC-SHA256 of `msg`.
    fn mac(&self, msg: &[u8]) -> [u8; 32] {
        let inner: [u8; 32] = self.inner.clone().chain_update(msg).finalize().into();
        self.outer.clone().chain_update(inner).finalize().into()
    }
}

#[cfg(test)]
pub(crate) fn is_ref(s: &str) -> bool {
    s.len() == REF_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2_shape() {
        // RFC 4231 test case 2 uses a 4-byte key; ours are 32 bytes, so
        // check case 1's construction with a zero-padded key instead:
        // key = 0x0b * 20, data = "Hi There".
        let mut key = [0u8; 32];
        key[..20].fill(0x0b);
        // A 20-byte key padded with zeros to 32 is the same HMAC key
        // (HMAC pads keys with zeros to the block size).
        let mac = RefKey::keyed(&key).mac(b"Hi There");
        assert_eq!(
            HEXLOWER.encode(&mac),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn references_are_stable_keyed_and_opaque() {
        let a = RefKey::from_seed(&[1; 32]);
        let b = RefKey::from_seed(&[2; 32]);
        let r = a.of("6b0d-41");
        assert!(is_ref(&r), "{r}");
        assert_eq!(r, RefKey::from_seed(&[1; 32]).of("6b0d-41"));
        assert_ne!(r, b.of("6b0d-41"));
        assert_ne!(r, a.of("6b0d-42"));
        assert!(!r.contains("6b0d"));
        assert!(!is_ref("6b0d-41"));
    }
}
