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
