//! Checkpoints as C2SP signed notes (c2sp.org/signed-note) whose text is a
//! c2sp.org/tlog-checkpoint body. Pure functions.
//!
//! - Checkpoint body: `ORIGIN\nTREE_SIZE\nBASE64(ROOT)\n`; the origin is
//!   `palisade/REPLICA` (see [`origin`]).
//! - Signed note: the body, an empty line, then one line per signature:
//!   `— NAME BASE64(KEY_ID || SIGNATURE)\n` (em dash U+2014, space). The
//!   Ed25519 signature covers the body with its final newline; the key
//!   name is the origin; KEY_ID is the first 4 bytes of
//!   SHA-256(NAME || 0x0A || 0x01 || PUBLIC_KEY).
//!
//! Written here rather than taken from a crate: the encoding is a few
//! lines over `ed25519-dalek`, `sha2` and `data-encoding`, which Palisade
//! already builds; the tests check it against the published notes of the
//! spec and of Go's `sumdb/note`.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use data_encoding::BASE64;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use super::merkle::Hash;

/// The em dash and space that start a signature line.
const SIG_PREFIX: &str = "\u{2014} ";
/// Ed25519's signature type byte.
const ED25519: u8 = 0x01;
/// Notes longer than this are refused unread.
const MAX_NOTE: usize = 16 * 1024;
/// Signature lines past this are refused.
const MAX_SIGS: usize = 100;

/// The origin line of a replica's checkpoints: `palisade/REPLICA`, every
/// byte of the replica name outside `A-Z a-z 0-9 . _ -` written `%XX`, so
/// that it holds no space, no `+` and no control character.
pub(crate) fn origin(replica: &str) -> String {
    let mut o = String::from("palisade/");
    for b in replica.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

/// The key ID of an Ed25519 key under `name`.
pub(crate) fn key_id(name: &str, key: &VerifyingKey) -> [u8; 4] {
    typed_key_id(name, ED25519, key)
}

/// The verifier key text `NAME+HEX(KEY_ID)+BASE64(0x01 || KEY)`.
pub(crate) fn vkey(name: &str, key: &VerifyingKey) -> String {
    let mut typed = vec![ED25519];
    typed.extend_from_slice(key.as_bytes());
    format!(
        "{name}+{}+{}",
        data_encoding::HEXLOWER.encode(&key_id(name, key)),
        BASE64.encode(&typed)
    )
}

/// The checkpoint body.
pub(crate) fn checkpoint_body(origin: &str, size: u64, root: &Hash) -> String {
    format!("{origin}\n{size}\n{}\n", BASE64.encode(root))
}

/// Sign `text` (ending in a newline) as `name`: the whole signed note.
pub(crate) fn sign(text: &str, name: &str, key: &SigningKey) -> String {
    let sig = key.sign(text.as_bytes());
    let mut blob = key_id(name, &key.verifying_key()).to_vec();
    blob.extend_from_slice(&sig.to_bytes());
    format!("{text}\n{SIG_PREFIX}{name} {}\n", BASE64.encode(&blob))
}

/// Why a note is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoteError {
    #[error("note is malformed: {0}")]
    Malformed(&'static str),
    #[error("note carries no signature by key {0}")]
    NoSignature(String),
    #[error("note signature by {0} does not verify: note edited")]
    BadSignature(String),
    #[error("checkpoint body is malformed: {0}")]
    BadBody(&'static str),
}

/// Check `note` carries a valid signature by `key` under `name`; return
/// its text. Signatures by other keys are ignored, as the spec says.
pub(crate) fn open<'a>(
    note: &'a str,
    name: &str,
    key: &VerifyingKey,
) -> Result<&'a str, NoteError> {
    if note.len() > MAX_NOTE {
        return Err(NoteError::Malformed("longer than 16 KiB"));
    }
    if note.bytes().any(|b| b < 0x20 && b != b'\n') {
        return Err(NoteError::Malformed("control character"));
    }
    let Some(split) = note.rfind("\n\n") else {
        return Err(NoteError::Malformed("no blank line before the signatures"));
    };
    let (text, sigs) = (&note[..split + 1], &note[split + 2..]);
    let Some(sigs) = sigs.strip_suffix('\n') else {
        return Err(NoteError::Malformed("does not end in a newline: truncated"));
    };
    let want_id = key_id(name, key);
    let mut found = None;
    for (i, line) in sigs.split('\n').enumerate() {
        if i >= MAX_SIGS {
            return Err(NoteError::Malformed("too many signatures"));
        }
        let rest = line
            .strip_prefix(SIG_PREFIX)
            .ok_or(NoteError::Malformed("signature line without the em dash"))?;
        let (who, b64) = rest
            .split_once(' ')
            .ok_or(NoteError::Malformed("signature line without a signature"))?;
        let blob = BASE64
            .decode(b64.as_bytes())
            .map_err(|_| NoteError::Malformed("signature is not base64"))?;
        if who.is_empty() || who.contains('+') || blob.len() < 5 {
            return Err(NoteError::Malformed("bad signature line"));
        }
        if who == name && blob[..4] == want_id && found.is_none() {
            found = Some(blob);
        }
    }
    let blob = found.ok_or_else(|| NoteError::NoSignature(vkey(name, key)))?;
    let sig: [u8; 64] = blob[4..]
        .try_into()
        .map_err(|_| NoteError::BadSignature(name.to_string()))?;
    key.verify_strict(text.as_bytes(), &Signature::from_bytes(&sig))
        .map_err(|_| NoteError::BadSignature(name.to_string()))?;
    Ok(text)
}

/// A checkpoint body's origin, tree size and root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub origin: String,
    pub size: u64,
    pub root: Hash,
}

/// Parse a checkpoint body (extension lines after the root are allowed).
pub(crate) fn parse_checkpoint(text: &str) -> Result<Checkpoint, NoteError> {
    let mut lines = text.split('\n');
    let origin = lines.next().filter(|o| !o.is_empty());
    let size = lines.next();
    let root = lines.next();
    let (Some(origin), Some(size), Some(root)) = (origin, size, root) else {
        return Err(NoteError::BadBody("fewer than three lines"));
    };
    if size.is_empty()
        || !size.bytes().all(|b| b.is_ascii_digit())
        || (size.len() > 1 && size.starts_with('0'))
    {
        return Err(NoteError::BadBody("tree size is not a decimal number"));
    }
    let size = size
        .parse()
        .map_err(|_| NoteError::BadBody("tree size out of range"))?;
    let root: Hash = BASE64
        .decode(root.as_bytes())
        .ok()
        .and_then(|r| r.try_into().ok())
        .ok_or(NoteError::BadBody("root is not 32 bytes of base64"))?;
    Ok(Checkpoint {
        origin: origin.to_string(),
        size,
        root,
    })
}

/// Open a signed checkpoint note: its origin must be the key name.
pub(crate) fn open_checkpoint(note: &str, key: &VerifyingKey) -> Result<Checkpoint, NoteError> {
    let origin = note.split('\n').next().unwrap_or_default();
    let text = open(note, origin, key)?;
    parse_checkpoint(text)
}

use crate::proto::vkey::typed_key_id;
pub(crate) use crate::proto::vkey::{vkey_of, Vkey, COSIGNATURE_V1};

/// The message a `cosignature/v1` signs: `cosignature/v1`, `time T`, then
/// the checkpoint body.
fn cosigned_message(body: &str, time: u64) -> String {
    format!("cosignature/v1\ntime {time}\n{body}")
}

/// The witness key `name`'s cosignature of `body` at `time` (POSIX
/// seconds), as a signature line. What a witness does: Palisade itself
/// only verifies them; the tests and benches sign with it.
pub(crate) fn cosign(body: &str, name: &str, key: &SigningKey, time: u64) -> String {
    let sig = key.sign(cosigned_message(body, time).as_bytes());
    let mut blob = typed_key_id(name, COSIGNATURE_V1, &key.verifying_key()).to_vec();
    blob.extend_from_slice(&time.to_be_bytes());
    blob.extend_from_slice(&sig.to_bytes());
    format!("{SIG_PREFIX}{name} {}\n", BASE64.encode(&blob))
}

/// Why a cosignature is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CosignatureError {
    #[error("no cosignature by witness key {0}")]
    Missing(String),
    #[error("cosignature by {0} does not verify: not this checkpoint, or edited")]
    Bad(String),
    #[error("cosignature line is malformed: {0}")]
    Malformed(&'static str),
}

/// Find `witness`'s cosignature among signature `lines` (each `— NAME
/// BASE64`, newline-terminated; lines by other keys are ignored, as the
/// spec says) and check it covers checkpoint `body`. Returns its time.
pub(crate) fn open_cosignature(
    lines: &str,
    body: &str,
    witness: &Vkey,
) -> Result<u64, CosignatureError> {
    let id = witness.id();
    for line in lines.lines().take(MAX_SIGS) {
        let Some((who, b64)) = line
            .strip_prefix(SIG_PREFIX)
            .and_then(|rest| rest.split_once(' '))
        else {
            return Err(CosignatureError::Malformed(
                "a line without the em dash and a name",
            ));
        };
        if who != witness.name {
            continue;
        }
        let Ok(blob) = BASE64.decode(b64.trim_end().as_bytes()) else {
            return Err(CosignatureError::Malformed("signature is not base64"));
        };
        if blob.len() < 4 || blob[..4] != id {
            continue;
        }
        let (Ok(time), Ok(sig)) = (
            <[u8; 8]>::try_from(blob.get(4..12).unwrap_or_default()),
            <[u8; 64]>::try_from(blob.get(12..).unwrap_or_default()),
        ) else {
            return Err(CosignatureError::Malformed(
                "not key ID, time and 64-byte signature",
            ));
        };
        let time = u64::from_be_bytes(time);
        let msg = cosigned_message(body, time);
        return witness
            .key
            .verify_strict(msg.as_bytes(), &Signature::from_bytes(&sig))
            .map(|()| time)
            .map_err(|_| CosignatureError::Bad(witness.name.clone()));
    }
    Err(CosignatureError::Missing(vkey_of(witness)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed, the verifier key and the signed note of Go's
    /// golang.org/x/mod/sumdb/note tests (`PeterNeumann`).
    const PETER_SKEY: &str =
        "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz";
    const PETER_VKEY: &str = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW";
    const PETER_TEXT: &str = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n";
    const PETER_NOTE: &str = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n\n\u{2014} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
    /// The verifier key and note of the c2sp.org/signed-note example.
    const SPEC_VKEY: &str = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k";
    const SPEC_NOTE: &str = "This is an example message.\n\n\u{2014} example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n";

    fn vkey_parts(v: &str) -> (String, VerifyingKey) {
        let mut parts = v.splitn(3, '+');
        let name = parts.next().unwrap().to_string();
        let _id = parts.next().unwrap();
        let typed = BASE64.decode(parts.next().unwrap().as_bytes()).unwrap();
        assert_eq!(typed[0], ED25519);
        let key = VerifyingKey::from_bytes(&typed[1..].try_into().unwrap()).unwrap();
        (name, key)
    }

    #[test]
    fn published_notes_verify_and_signing_reproduces_them() {
        for (v, note) in [(PETER_VKEY, PETER_NOTE), (SPEC_VKEY, SPEC_NOTE)] {
            let (name, key) = vkey_parts(v);
            assert_eq!(vkey(&name, &key), v, "key id of {name}");
            open(note, &name, &key).unwrap();
        }
        // Ed25519 is deterministic: the Go seed signs the same note.
        let seed = BASE64
            .decode(PETER_SKEY.splitn(5, '+').nth(4).unwrap().as_bytes())
            .unwrap();
        let sk = SigningKey::from_bytes(&seed[1..].try_into().unwrap());
        assert_eq!(sign(PETER_TEXT, "PeterNeumann", &sk), PETER_NOTE);
    }

    /// The example of docs/evidence.md, computed independently (Python's
    /// `cryptography`) with the seed of 32 bytes 0x07.
    #[test]
    fn the_documented_example_note_is_what_palisade_writes() {
        let sk = SigningKey::from_bytes(&[7u8; 32]);
        use sha2::{Digest, Sha256};
        let root: Hash = Sha256::digest(b"example").into();
        let o = origin("gw-a");
        let note = sign(&checkpoint_body(&o, 1804, &root), &o, &sk);
        assert_eq!(
            note,
            "palisade/gw-a\n1804\nUNhY4JhezH9gQYqvDMWrWH9CwlcKiECVqejMrND2VFw=\n\n\u{2014} palisade/gw-a 76ySKijXb0ppXF0PPxNAUZrkyC3CnII6Ub5+tnE2TJT1OiBmKjmzbf66bc5XPgkfKQSD+FE+TfLfqDKgoo78mWiDvQA=\n"
        );
        assert_eq!(
            vkey(&o, &sk.verifying_key()),
            "palisade/gw-a+efac922a+AepKbGPinFIKvvVQexMuxfmVR3auvr57kkIe6mkURtIs"
        );
        let doc = include_str!("../../docs/evidence.md");
        assert!(doc.contains("76ySKijXb0ppXF0PPxNAUZrkyC3CnII6Ub5+tnE2TJT1OiBmKjmzbf66bc5XPgkfKQSD+FE+TfLfqDKgoo78mWiDvQA="));
    }

    #[test]
    fn edited_truncated_or_foreign_notes_fail() {
        let (name, key) = vkey_parts(PETER_VKEY);
        let edited = PETER_NOTE.replace("answer", "Answer");
        assert!(matches!(
            open(&edited, &name, &key),
            Err(NoteError::BadSignature(_))
        ));
        for cut in [1, 10, 60, PETER_NOTE.len() - 40] {
            let t = &PETER_NOTE[..PETER_NOTE.len() - cut];
            assert!(open(t, &name, &key).is_err(), "cut {cut}");
        }
        let (_, other) = vkey_parts(SPEC_VKEY);
        assert!(matches!(
            open(PETER_NOTE, &name, &other),
            Err(NoteError::NoSignature(_))
        ));
        assert!(open("", &name, &key).is_err());
        assert!(open("\n\n", &name, &key).is_err());
        assert!(open("a\n\n\u{2014} PeterNeumann !!\n", &name, &key).is_err());
    }

    #[test]
    fn checkpoints_round_trip_and_refuse_bad_bodies() {
        let sk = SigningKey::from_bytes(&[9u8; 32]);
        let o = origin("gw a+b");
        assert_eq!(o, "palisade/gw%20a%2Bb");
        let root = [7u8; 32];
        let note = sign(&checkpoint_body(&o, 42, &root), &o, &sk);
        let c = open_checkpoint(&note, &sk.verifying_key()).unwrap();
        assert_eq!((c.origin.as_str(), c.size, c.root), (o.as_str(), 42, root));
        for body in ["o\n", "o\n01\nAAAA\n", "o\nx\nAAAA\n", "o\n1\nAAAA\n"] {
            assert!(parse_checkpoint(body).is_err(), "{body:?}");
        }
        let other = SigningKey::from_bytes(&[8u8; 32]);
        assert!(open_checkpoint(&note, &other.verifying_key()).is_err());
    }

    /// The cosigned checkpoint of the c2sp.org/tlog-cosignature example:
    /// its cosignature line carries the time of the example's signed
    /// message (`time 1679315147`); the spec gives no public key.
    const SPEC_COSIGNATURE: &str = "\u{2014} witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==\n";

    #[test]
    fn cosignatures_follow_the_spec_and_refuse_strangers() {
        let blob = BASE64
            .decode(
                SPEC_COSIGNATURE
                    .rsplit(' ')
                    .next()
                    .unwrap()
                    .trim()
                    .as_bytes(),
            )
            .unwrap();
        assert_eq!(blob.len(), 4 + 8 + 64);
        assert_eq!(
            u64::from_be_bytes(blob[4..12].try_into().unwrap()),
            1679315147
        );
        let w = SigningKey::from_bytes(&[3u8; 32]);
        let name = "witness.test/w1";
        let vk = Vkey {
            name: name.into(),
            kind: COSIGNATURE_V1,
            key: w.verifying_key(),
        };
        let text = vkey_of(&vk);
        assert_eq!(Vkey::parse(&text, COSIGNATURE_V1).unwrap(), vk);
        // A note key (type 0x01) is not a witness key, and the ID must fit.
        let note_key = vkey(name, &w.verifying_key());
        assert!(Vkey::parse(&note_key, COSIGNATURE_V1)
            .unwrap_err()
            .contains("type 0x04"));
        let wrong_id = format!("{name}+00000000+{}", text.rsplit('+').next().unwrap());
        assert!(Vkey::parse(&wrong_id, COSIGNATURE_V1)
            .unwrap_err()
            .contains("key ID"));
        for bad in ["", "a", "a+b", " +00+AA==", "a+00000000+!!"] {
            assert!(Vkey::parse(bad, COSIGNATURE_V1).is_err(), "{bad:?}");
        }
        let body =
            "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n";
        let line = cosign(body, name, &w, 1679315147);
        // Lines of other witnesses (the spec's) are skipped.
        let lines = format!("{SPEC_COSIGNATURE}{line}");
        assert_eq!(open_cosignature(&lines, body, &vk), Ok(1679315147));
        let other = body.replace("20852163", "20852164");
        assert!(matches!(
            open_cosignature(&lines, &other, &vk),
            Err(CosignatureError::Bad(_))
        ));
        let stranger = Vkey {
            name: name.into(),
            kind: COSIGNATURE_V1,
            key: SigningKey::from_bytes(&[4u8; 32]).verifying_key(),
        };
        assert!(matches!(
            open_cosignature(&lines, body, &stranger),
            Err(CosignatureError::Missing(_))
        ));
        let cut = &line[..line.len() - 20];
        assert!(open_cosignature(cut, body, &vk).is_err());
        assert!(open_cosignature("garbage\n", body, &vk).is_err());
    }
}
