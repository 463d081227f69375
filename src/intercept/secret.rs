//! Credential secrets: read from a file or an environment variable of the
//! Palisade process, held in memory that is zeroised when dropped, and never
//! printed (`Debug` is redacted; there is no `Display` and no `Serialize`).

use std::path::Path;

use http::HeaderValue;
use zeroize::Zeroizing;

use crate::config::{CredentialConfig, SecretSource};

/// Largest secret accepted (a header value; bounded like any input).
pub(crate) const MAX_SECRET_BYTES: usize = 16 * 1024;

/// A secret's bytes. Zeroised on drop.
pub(crate) struct Secret(Zeroizing<Vec<u8>>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Why a secret could not be loaded. Names the credential and the source,
/// never the value.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SecretError {
    #[error("credential {id}: cannot read secret_file {path}: {source}")]
    File {
        id: String,
        path: String,
        source: std::io::Error,
    },
    #[error("credential {id}: environment variable {var} is not set (or not UTF-8)")]
    Env { id: String, var: String },
    #[error("credential {id}: the secret is empty")]
    Empty { id: String },
    #[error("credential {id}: the secret is over {MAX_SECRET_BYTES} bytes")]
    TooLarge { id: String },
    #[error("credential {id}: the secret holds characters a header value cannot carry")]
    NotHeaderSafe { id: String },
}

impl Secret {
    /// Load the secret a credential names. One trailing newline (`\n` or
    /// `\r\n`) of a file is dropped.
    pub(crate) fn load(c: &CredentialConfig) -> Result<Secret, SecretError> {
        let id = c.id.clone();
        let mut bytes = Zeroizing::new(match &c.source {
            SecretSource::File(path) => read_file(path).map_err(|source| SecretError::File {
                id: id.clone(),
                path: path.display().to_string(),
                source,
            })?,
            SecretSource::Env(var) => std::env::var(var)
                .map_err(|_| SecretError::Env {
                    id: id.clone(),
                    var: var.clone(),
                })?
                .into_bytes(),
        });
        if bytes.ends_with(b"\n") {
            bytes.pop();
            if bytes.ends_with(b"\r") {
                bytes.pop();
            }
        }
        if bytes.is_empty() {
            return Err(SecretError::Empty { id });
        }
        if bytes.len() > MAX_SECRET_BYTES {
            return Err(SecretError::TooLarge { id });
        }
        let secret = Secret(bytes);
        if secret.header_value(&c.prefix).is_none() {
            return Err(SecretError::NotHeaderSafe { id });
        }
        Ok(secret)
    }

    /// Hand the secret's bytes to `f` (to be digested, never kept).
    pub(crate) fn feed(&self, f: impl FnOnce(&[u8])) {
        f(&self.0);
    }

    /// `prefix` followed by the secret, as a header value marked sensitive
    /// (HPACK never indexes it; `Debug` hides it).
    pub(crate) fn header_value(&self, prefix: &str) -> Option<HeaderValue> {
        let mut buf = Zeroizing::new(Vec::with_capacity(prefix.len() + self.0.len()));
        buf.extend_from_slice(prefix.as_bytes());
        buf.extend_from_slice(&self.0);
        let mut v = HeaderValue::from_bytes(&buf).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

/// SHA-256 of a secret file's content as [`Secret::load`] would read it
/// (bounded), or `None` if it cannot be read: what the reload's poll
/// compares to notice a rotated secret. Blocking.
pub(crate) fn file_digest(path: &Path) -> Option<[u8; 32]> {
    use sha2::Digest;
    let bytes = Zeroizing::new(read_file(path).ok()?);
    Some(sha2::Sha256::digest(&bytes[..]).into())
}

fn read_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let mut out = Vec::new();
    // One byte over the limit tells "too large" apart without reading more.
    f.take(MAX_SECRET_BYTES as u64 + 2).read_to_end(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RuleTarget;

    fn cred(source: SecretSource, prefix: &str) -> CredentialConfig {
        CredentialConfig {
            id: "c1".into(),
            host: RuleTarget::Exact("api.test".into()),
            methods: vec![],
            paths: vec![],
            header: "authorization".into(),
            prefix: prefix.into(),
            source,
        }
    }

    #[test]
    fn file_secret_loads_without_newline_and_never_prints() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        std::fs::write(&path, b"tok-123\r\n").unwrap();
        let s = Secret::load(&cred(SecretSource::File(path.clone()), "Bearer ")).unwrap();
        let v = s.header_value("Bearer ").unwrap();
        assert_eq!(v.as_bytes(), b"Bearer tok-123");
        assert!(v.is_sensitive());
        assert!(!format!("{s:?} {v:?}").contains("tok-123"));
        std::fs::write(&path, b"bad\x01value").unwrap();
        let e = Secret::load(&cred(SecretSource::File(path), "")).unwrap_err();
        assert!(!e.to_string().contains("bad"), "{e}");
        let e = Secret::load(&cred(
            SecretSource::Env("PALISADE_NO_SUCH_VAR_X".into()),
            "",
        ))
        .unwrap_err();
        assert!(e.to_string().contains("PALISADE_NO_SUCH_VAR_X"));
    }
}
