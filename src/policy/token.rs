//! How a presented token is checked against an org's stored digests: the
//! config holds the digests; comparing them is the policy's, and only in
//! constant time.

use crate::config::TokenDigest;

impl TokenDigest {
    /// Constant-time equality (the digests have a fixed length).
    pub fn ct_eq(&self, other: &TokenDigest) -> bool {
        use subtle::ConstantTimeEq;
        self.0.ct_eq(&other.0).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_digests_match_others_do_not() {
        let a = TokenDigest::of(b"a");
        assert!(a.ct_eq(&TokenDigest::of(b"a")));
        assert!(!a.ct_eq(&TokenDigest::of(b"b")));
        let mut flipped = a.clone();
        flipped.0[31] ^= 1;
        assert!(!a.ct_eq(&flipped));
    }
}
