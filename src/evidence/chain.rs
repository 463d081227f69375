//! The record chain: canonical serialisation, record hashes and checkpoint
//! signatures. Pure functions over JSON values; the writer and the verifier
//! both use them, so they cannot disagree.
//!
//! Canonical form of a record: its JSON object with keys sorted by byte
//! order at every level, no whitespace, strings escaped the way serde_json
//! does (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other control characters
//! as `\u00xx` in lowercase hex, everything else as UTF-8), integers in
//! decimal. Records hold only strings, integers, booleans, nulls, arrays and
//! objects with ASCII keys, so this is the RFC 8785 (JCS) form of the record.
//!
//! - `hash` = lowercase hex SHA-256 of the canonical form of the record
//!   without its `hash` field (it includes `seq` and `prev`).
//! - A line in a segment file is the canonical form of the whole record
//!   (with `hash`) followed by `\n`; the verifier re-serialises every line
//!   and requires the same bytes, so even whitespace edits are found.
//! - A checkpoint's `sig` is the Ed25519 signature of
//!   `SIG_CONTEXT || canonical(record without hash and sig)`; it covers
//!   `prev`, the hash of the record before it, i.e. the chain head.

use data_encoding::{HEXLOWER, HEXLOWER_PERMISSIVE};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// `prev` of the very first record of a chain.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Domain separation for checkpoint signatures.
pub const SIG_CONTEXT: &[u8] = b"palisade-evidence-checkpoint-v1\n";

/// Format tag written into every segment header.
pub const FORMAT: &str = "palisade-evidence/1";

/// Append the canonical form of `v` to `out`.
pub fn canonical_into(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(m) => object_into(m, &[], out, |_, _| {}),
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_into(x, out);
            }
            out.push(b']');
        }
        Value::String(s) => string_into(s, out),
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => out.extend_from_slice(n.to_string().as_bytes()),
    }
}

/// The one canonical object writer: `{"key":value,...}` with the keys of
/// `m` not in `skip`, sorted, values canonical. `at_key(key, out)` is
/// called just before each key is written (after its comma), so a caller
/// can note where a key that sorts before it would go.
fn object_into(
    m: &Map<String, Value>,
    skip: &[&str],
    out: &mut Vec<u8>,
    mut at_key: impl FnMut(&str, &[u8]),
) {
    let mut keys: Vec<&String> = m.keys().filter(|k| !skip.contains(&k.as_str())).collect();
    keys.sort();
    out.push(b'{');
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        at_key(k, out);
        string_into(k, out);
        out.push(b':');
        canonical_into(&m[k.as_str()], out);
    }
    out.push(b'}');
}

fn string_into(s: &str, out: &mut Vec<u8>) {
    // Writing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// The canonical form of an object, leaving out the named keys.
pub fn canonical_without(m: &Map<String, Value>, skip: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    object_into(m, skip, &mut out, |_, _| {});
    out
}

/// Exactly `N` bytes from `2 * N` hex digits of either case (surrounding
/// white space ignored).
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    HEXLOWER_PERMISSIVE
        .decode(s.trim().as_bytes())
        .ok()?
        .try_into()
        .ok()
}

/// The hash of a record: SHA-256 over its canonical form without `hash`.
pub fn record_hash(m: &Map<String, Value>) -> String {
    HEXLOWER.encode(&Sha256::digest(canonical_without(m, &["hash"])))
}

fn sig_message(m: &Map<String, Value>) -> Vec<u8> {
    let mut msg = SIG_CONTEXT.to_vec();
    msg.extend_from_slice(&canonical_without(m, &["hash", "sig"]));
    msg
}

/// Sign a checkpoint record (sets `sig`; `key`, `seq` and `prev` must be set).
pub fn sign(m: &mut Map<String, Value>, key: &SigningKey) {
    let sig = key.sign(&sig_message(m));
    m.insert(
        "sig".into(),
        Value::String(HEXLOWER.encode(&sig.to_bytes())),
    );
}

/// Check a checkpoint record's `sig` against `key`.
pub fn check_sig(m: &Map<String, Value>, key: &VerifyingKey) -> bool {
    let Some(sig) = m.get("sig").and_then(Value::as_str).and_then(unhex::<64>) else {
        return false;
    };
    key.verify_strict(&sig_message(m), &Signature::from_bytes(&sig))
        .is_ok()
}

/// Parse a hex public key.
pub fn parse_pubkey(s: &str) -> Option<VerifyingKey> {
    VerifyingKey::from_bytes(&unhex::<32>(s)?).ok()
}

/// Set `seq`, `prev` and `hash` of `m` and return its line (with `\n`).
///
/// The record is serialised once: its canonical form without `hash` is
/// hashed, then `"hash":"…"` is spliced in at its sorted position, which
/// gives exactly the canonical form of the record with `hash`.
pub fn seal_line(m: &mut Map<String, Value>, seq: u64, prev: &str) -> (String, Vec<u8>) {
    m.insert("seq".into(), Value::from(seq));
    m.insert("prev".into(), Value::String(prev.to_string()));
    m.remove("hash");
    let mut body = Vec::with_capacity(640);
    // Where `"hash":…` goes: before the first key that sorts after it.
    let mut splice_at = None;
    object_into(m, &[], &mut body, |k, out| {
        if splice_at.is_none() && k > "hash" {
            splice_at = Some(out.len());
        }
    });
    let hash = HEXLOWER.encode(&Sha256::digest(&body));
    let field = format!("\"hash\":\"{hash}\"");
    let mut line = Vec::with_capacity(body.len() + field.len() + 2);
    match splice_at {
        Some(at) => {
            line.extend_from_slice(&body[..at]);
            line.extend_from_slice(field.as_bytes());
            line.push(b',');
            line.extend_from_slice(&body[at..]);
        }
        None => {
            line.extend_from_slice(&body[..body.len() - 1]);
            if m.is_empty() {
                line.extend_from_slice(field.as_bytes());
            } else {
                line.push(b',');
                line.extend_from_slice(field.as_bytes());
            }
            line.push(b'}');
        }
    }
    line.push(b'\n');
    m.insert("hash".into(), Value::String(hash.clone()));
    (hash, line)
}

/// A record with every CONTRACT field null, for headers and checkpoints.
pub fn meta_record(event: &str, id: String, ts: String) -> Map<String, Value> {
    let mut m = Map::new();
    for k in super::CONTRACT_FIELDS {
        m.insert(k.to_string(), Value::Null);
    }
    m.insert("id".into(), Value::String(id));
    m.insert("ts".into(), Value::String(ts));
    m.insert("event".into(), Value::String(event.into()));
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_sorts_keys_and_escapes() {
        let v = json!({"b": 1, "a": {"z": null, "y": [true, "x\ny\u{1}é"]}, "A": -3});
        let mut out = Vec::new();
        canonical_into(&v, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"A\":-3,\"a\":{\"y\":[true,\"x\\ny\\u0001é\"],\"z\":null},\"b\":1}"
        );
    }

    #[test]
    fn canonical_round_trips_through_parsing() {
        let v = json!({"s": "\"\\/\t\u{7f}\u{2028}", "n": 18446744073709551615u64, "e": []});
        let mut a = Vec::new();
        canonical_into(&v, &mut a);
        let back: Value = serde_json::from_slice(&a).unwrap();
        let mut b = Vec::new();
        canonical_into(&back, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn hash_ignores_key_order_but_not_values() {
        let a = json!({"x": 1, "y": "a"});
        let b = json!({"y": "a", "x": 1});
        let c = json!({"y": "b", "x": 1});
        let h = |v: &Value| record_hash(v.as_object().unwrap());
        assert_eq!(h(&a), h(&b));
        assert_ne!(h(&a), h(&c));
        assert_eq!(h(&a).len(), 64);
    }

    #[test]
    fn signatures_cover_the_record() {
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let mut m = meta_record("checkpoint", "i".into(), "t".into());
        m.insert("prev".into(), Value::String(GENESIS.into()));
        sign(&mut m, &key);
        assert!(check_sig(&m, &key.verifying_key()));
        m.insert("prev".into(), Value::String("1".repeat(64)));
        assert!(!check_sig(&m, &key.verifying_key()));
        let other = SigningKey::from_bytes(&[8u8; 32]);
        assert!(!check_sig(&m, &other.verifying_key()));
    }

    #[test]
    fn hex_round_trip() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(HEXLOWER.encode(&b), "0001abff");
        assert_eq!(unhex::<4>("0001ABff"), Some(b));
        assert_eq!(unhex::<4>("0001abf"), None);
        assert_eq!(unhex::<4>("0001abfg"), None);
    }
}

#[cfg(test)]
mod seal_tests {
    use super::*;

    /// The spliced line is byte for byte the canonical form of the record
    /// with its hash, wherever `hash` sorts among the keys.
    #[test]
    fn spliced_line_is_the_canonical_form() {
        let cases: [&[&str]; 4] = [&["a", "z"], &["a"], &["z"], &[]];
        for keys in cases {
            let mut m = Map::new();
            for k in keys {
                m.insert((*k).into(), Value::from(*k));
            }
            let (hash, line) = seal_line(&mut m, 7, GENESIS);
            assert_eq!(m["hash"], Value::String(hash.clone()));
            let mut expected = Vec::new();
            canonical_into(&Value::Object(m.clone()), &mut expected);
            expected.push(b'\n');
            assert_eq!(
                String::from_utf8(line).unwrap(),
                String::from_utf8(expected).unwrap()
            );
            assert_eq!(record_hash(&m), hash);
        }
    }
}
