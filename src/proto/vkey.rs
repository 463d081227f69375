//! Verifier keys of c2sp.org/signed-note (`NAME+HEX(KEY_ID)+BASE64(TYPE ||
//! KEY)`), Ed25519 only: the note keys of Palisade's checkpoints (type
//! 0x01) and witnesses' cosignature keys (type 0x04). Pure: the config
//! checks `[evidence] witnesses` keys with it, the evidence uses them.

use data_encoding::BASE64;
use ed25519_dalek::VerifyingKey;
use sha2::{Digest, Sha256};

/// A witness's cosignature type byte (c2sp.org/tlog-cosignature,
/// Ed25519 `cosignature/v1`).
pub(crate) const COSIGNATURE_V1: u8 = 0x04;

/// A verifier key (c2sp.org/signed-note): `NAME+HEX(KEY_ID)+BASE64(TYPE || KEY)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Vkey {
    pub name: String,
    pub kind: u8,
    pub key: VerifyingKey,
}

impl Vkey {
    /// Parse a verifier key of type `kind`; the key ID must be the one
    /// its name, type and key give.
    pub(crate) fn parse(text: &str, kind: u8) -> Result<Vkey, String> {
        let mut parts = text.trim().splitn(3, '+');
        let (Some(name), Some(id), Some(b64)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("is not NAME+KEY_ID+BASE64(KEY)".into());
        };
        if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("has an empty name or one with white space".into());
        }
        let typed = BASE64
            .decode(b64.as_bytes())
            .map_err(|_| "key is not base64".to_string())?;
        if typed.first() != Some(&kind) {
            return Err(format!(
                "is not of type 0x{kind:02x} ({})",
                if kind == COSIGNATURE_V1 {
                    "an Ed25519 cosignature/v1 witness key"
                } else {
                    "an Ed25519 note key"
                }
            ));
        }
        let raw: [u8; 32] = typed[1..]
            .try_into()
            .map_err(|_| "key is not 32 bytes".to_string())?;
        let key =
            VerifyingKey::from_bytes(&raw).map_err(|_| "is not an Ed25519 key".to_string())?;
        let v = Vkey {
            name: name.to_string(),
            kind,
            key,
        };
        if data_encoding::HEXLOWER.encode(&v.id()) != id {
            return Err(format!("key ID {id:?} is not the one of its name and key"));
        }
        Ok(v)
    }

    /// The key ID: the first 4 bytes of SHA-256(NAME || 0x0A || TYPE || KEY).
    pub(crate) fn id(&self) -> [u8; 4] {
        typed_key_id(&self.name, self.kind, &self.key)
    }
}

/// The key ID of `key` under `name` and signature type `kind`.
pub(crate) fn typed_key_id(name: &str, kind: u8, key: &VerifyingKey) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([b'\n', kind]);
    h.update(key.as_bytes());
    let d = h.finalize();
    [d[0], d[1], d[2], d[3]]
}

/// The verifier key text of `v`.
pub(crate) fn vkey_of(v: &Vkey) -> String {
    let mut typed = vec![v.kind];
    typed.extend_from_slice(v.key.as_bytes());
    format!(
        "{}+{}+{}",
        v.name,
        data_encoding::HEXLOWER.encode(&v.id()),
        BASE64.encode(&typed)
    )
}
