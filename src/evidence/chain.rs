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
//!
//! Decision and close records are serialised once, field by field, into
//! their canonical form by [`super::canon`] (no `serde_json::Value` in
//! between; the tests' `Prepared::of` makes the same bytes from the
//! record's `Serialize` implementation, the reference); chaining one
//! ([`Prepared::seal_into`]) splices `seq`, `prev` and `hash` in at their
//! sorted places and gives exactly the bytes [`seal_line`] gives for the
//! same record as a JSON object.

#[cfg(test)]
use std::fmt::Display;

use data_encoding::{HEXLOWER, HEXLOWER_PERMISSIVE};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Fields every record has (null where not known), in CONTRACT order.
pub const CONTRACT_FIELDS: [&str; 15] = [
    "id", "ts", "kind", "event", "org", "client", "mode", "host", "port", "sni", "ip", "decision",
    "reason", "rule", "policy",
];

/// `prev` of the very first record of a chain.
pub(crate) const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Domain separation for checkpoint signatures.
pub(crate) const SIG_CONTEXT: &[u8] = b"palisade-evidence-checkpoint-v1\n";

/// Format tag written into every segment header: `/3` checkpoints also
/// carry `org_count` and `orgs_root` and headers `org_trees` (the tree per
/// org); `/2` checkpoints carry `tree_size`, `root` and `note` and headers
/// carry `tree`; `/1` (before the Merkle tree) and `/2` are still read and
/// verified.
pub(crate) const FORMAT: &str = "palisade-evidence/3";

/// Append the canonical form of `v` to `out`.
pub(crate) fn canonical_into(v: &Value, out: &mut Vec<u8>) {
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

pub(super) fn string_into(s: &str, out: &mut Vec<u8>) {
    // Keys, hashes and most values need no escape: copied as they are.
    if !needs_escape(s.as_bytes()) {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    // Writing a &str into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// Whether any byte of `s` is one JSON escapes: a control byte (below
/// 0x20), `"` or `\\`. Eight bytes at a time: a byte is below `n` where
/// subtracting `n` from it borrows into its top bit while that bit was
/// clear, and equal to `c` where it is zero once xored with `c`.
fn needs_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const TOPS: u64 = u64::from_ne_bytes([0x80; 8]);
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & TOPS != 0;
    let mut words = s.chunks_exact(8);
    for word in &mut words {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let w = u64::from_ne_bytes(w);
        if below(w, 0x20)
            || below(w ^ (ONES * u64::from(b'"')), 1)
            || below(w ^ (ONES * u64::from(b'\\')), 1)
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

/// The canonical form of an object, leaving out the named keys.
pub(crate) fn canonical_without(m: &Map<String, Value>, skip: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    object_into(m, skip, &mut out, |_, _| {});
    out
}

/// Exactly `N` bytes from `2 * N` hex digits of either case (surrounding
/// white space ignored).
pub(crate) fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    HEXLOWER_PERMISSIVE
        .decode(s.trim().as_bytes())
        .ok()?
        .try_into()
        .ok()
}

/// `bytes` in lowercase hex (`HEXLOWER.encode`, without its general
/// machinery: a record's hash and reference are made per record).
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0u8; 2 * bytes.len()];
    hex_into(bytes, &mut out);
    // Bytes, not chars pushed one by one (each through UTF-8 encoding):
    // every byte is an ASCII hex digit, so the check cannot fail.
    String::from_utf8(out).unwrap_or_default()
}

/// `bytes` in lowercase hex into `out` (two digits a byte, as many bytes
/// as `out` has room for).
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, &b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 15)];
    }
}

/// The hash of a record: SHA-256 over its canonical form without `hash`.
pub(crate) fn record_hash(m: &Map<String, Value>) -> String {
    HEXLOWER.encode(&Sha256::digest(canonical_without(m, &["hash"])))
}

fn sig_message(m: &Map<String, Value>) -> Vec<u8> {
    let mut msg = SIG_CONTEXT.to_vec();
    msg.extend_from_slice(&canonical_without(m, &["hash", "sig"]));
    msg
}

/// Sign a checkpoint record (sets `sig`; `key`, `seq` and `prev` must be set).
pub(crate) fn sign(m: &mut Map<String, Value>, key: &SigningKey) {
    let sig = key.sign(&sig_message(m));
    m.insert(
        "sig".into(),
        Value::String(HEXLOWER.encode(&sig.to_bytes())),
    );
}

/// Check a checkpoint record's `sig` against `key`.
pub(crate) fn check_sig(m: &Map<String, Value>, key: &VerifyingKey) -> bool {
    let Some(sig) = m.get("sig").and_then(Value::as_str).and_then(unhex::<64>) else {
        return false;
    };
    key.verify_strict(&sig_message(m), &Signature::from_bytes(&sig))
        .is_ok()
}

/// Parse a hex public key.
pub(crate) fn parse_pubkey(s: &str) -> Option<VerifyingKey> {
    VerifyingKey::from_bytes(&unhex::<32>(s)?).ok()
}

/// Set `seq`, `prev` and `hash` of `m` and return its line (with `\n`).
///
/// The record is serialised once: its canonical form without `hash` is
/// hashed, then `"hash":"…"` is spliced in at its sorted position, which
/// gives exactly the canonical form of the record with `hash`.
pub(crate) fn seal_line(m: &mut Map<String, Value>, seq: u64, prev: &str) -> (String, Vec<u8>) {
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

/// The fields the chain adds to a record, in their sorted order: where each
/// goes in a [`Prepared`] body is noted when it is built.
#[cfg(test)]
const CHAIN_FIELDS: [&str; 3] = ["hash", "prev", "seq"];

/// A record serialised once, in canonical form, waiting for its place in
/// the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Prepared {
    /// The canonical form of the record without `seq`, `prev` and `hash`.
    body: Vec<u8>,
    /// For each of the chain's fields (`hash`, `prev`, `seq`): the offset in `body` of the first key
    /// that sorts after it (after that key's comma), or of the closing brace.
    at: [usize; 3],
}

/// A record that writes its own canonical form, field by field (a
/// [`super::Record`]: [`super::canon`]).
pub(crate) trait Canonical {
    /// Its canonical form, byte for byte what `Prepared::of` makes of it.
    fn prepare(&self) -> Result<Prepared, PrepareError>;
}

/// A record that cannot be serialised into a chained line.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PrepareError {
    #[cfg(test)]
    #[error("a record must serialise as a struct with fields")]
    NotAStruct,
    #[cfg(test)]
    #[error("record field {0:?} is the chain's own")]
    ChainField(&'static str),
    #[cfg(test)]
    #[error("record field {0:?} appears twice")]
    Duplicate(&'static str),
    #[error("record not serialisable: {0}")]
    Value(String),
}

#[cfg(test)]
impl serde::ser::Error for PrepareError {
    fn custom<T: Display>(msg: T) -> Self {
        PrepareError::Value(msg.to_string())
    }
}

impl Prepared {
    /// The most its line can take once chained: the body, the three chain
    /// fields (`"hash":` and `"prev":` with 64 hex digits each, `"seq":`
    /// with at most 20 digits), their commas and the newline.
    pub(crate) fn line_bound(&self) -> usize {
        self.body.len() + 3 * 2 + 2 * (7 + 66) + (6 + 20) + 1
    }

    /// The canonical form of `record`, written by its own [`Canonical`]
    /// writer.
    pub(crate) fn canonical<T: Canonical + ?Sized>(record: &T) -> Result<Prepared, PrepareError> {
        record.prepare()
    }

    /// A body written by hand in canonical form ([`super::canon`]), with
    /// the offsets of the chain's fields in it.
    pub(super) fn from_parts(body: Vec<u8>, at: [usize; 3]) -> Prepared {
        Prepared { body, at }
    }

    /// Serialise `record` (a struct whose fields hold strings, integers,
    /// booleans, nulls, arrays and maps with sorted keys, as
    /// [`super::Record`] does) into its canonical form.
    #[cfg(test)]
    pub(crate) fn of<T: serde::Serialize + ?Sized>(record: &T) -> Result<Prepared, PrepareError> {
        let mut values = Vec::with_capacity(512);
        let mut fields = Vec::with_capacity(40);
        record.serialize(Capture {
            values: &mut values,
            fields: &mut fields,
        })?;
        if fields.is_empty() {
            return Err(PrepareError::NotAStruct);
        }
        let mut at = [0usize; 3];
        let mut next = 0;
        ORDER
            .with_borrow_mut(|order| {
                order.sort(&fields)?;
                let mut body = Vec::with_capacity(values.len() + 16 * fields.len() + 2);
                body.push(b'{');
                for (i, &f) in order.sorted.iter().enumerate() {
                    let (key, start, end) = fields[f];
                    if i > 0 {
                        body.push(b',');
                    }
                    while next < CHAIN_FIELDS.len() && CHAIN_FIELDS[next] < key {
                        at[next] = body.len();
                        next += 1;
                    }
                    string_into(key, &mut body);
                    body.push(b':');
                    body.extend_from_slice(&values[start..end]);
                }
                Ok(body)
            })
            .map(|mut body| {
                for slot in &mut at[next..] {
                    *slot = body.len();
                }
                body.push(b'}');
                Prepared { body, at }
            })
    }

    /// The canonical form of the record as serialised (without the chain's
    /// fields).
    #[cfg(test)]
    pub(crate) fn body(&self) -> &[u8] {
        &self.body
    }

    /// Chain the record as number `seq` after the record whose hash is
    /// `prev`: append its line (with `\n`) to `out` and return its hash.
    /// The line is byte for byte what [`seal_line`] makes of the record.
    ///
    /// The hash covers the line without `hash`: the body with `prev` and
    /// `seq` in their places, written straight into `out` and hashed there;
    /// then `"hash":"…"` is appended and rotated into its place.
    pub(crate) fn seal_into(&self, seq: u64, prev: &str, out: &mut Vec<u8>) -> String {
        let (_, at) = self.seal(seq, prev, out);
        String::from_utf8_lossy(&out[at]).into_owned()
    }

    /// [`Prepared::seal_into`], giving the hash as bytes (a Merkle leaf is
    /// made of them) and where its hex is in `out`, instead of a string of
    /// its own.
    pub(crate) fn seal(
        &self,
        seq: u64,
        prev: &str,
        out: &mut Vec<u8>,
    ) -> ([u8; 32], std::ops::Range<usize>) {
        let [at_hash, at_prev, at_seq] = self.at;
        let body = &self.body;
        let start = out.len();
        out.reserve(body.len() + prev.len() + 2 * 66 + 48);
        out.extend_from_slice(&body[..at_hash]);
        // `hash` sorts first of the three: its field's room is kept here
        // and filled once the rest is hashed around it.
        let gap = out.len();
        out.resize(gap + HASH_FIELD, 0);
        out.extend_from_slice(&body[at_hash..at_prev]);
        self.field_into("prev", at_prev, out, |o| string_into(prev, o));
        out.extend_from_slice(&body[at_prev..at_seq]);
        let mut digits = [0u8; 20];
        let seq = decimal(seq, &mut digits);
        self.field_into("seq", at_seq, out, |o| o.extend_from_slice(seq));
        out.extend_from_slice(&body[at_seq..]);
        let digest: [u8; 32] = Sha256::new()
            .chain_update(&out[start..gap])
            .chain_update(&out[gap + HASH_FIELD..])
            .finalize()
            .into();
        // As `field_into` writes it (hex needs no escape), in place.
        let (lead, trail): (&[u8], &[u8]) = match at_hash + 1 == body.len() {
            true => (b",\"hash\":\"", b"\""),
            false => (b"\"hash\":\"", b"\","),
        };
        let field = &mut out[gap..gap + HASH_FIELD];
        let (l, h) = (lead.len(), 2 * digest.len());
        field[..l].copy_from_slice(lead);
        hex_into(&digest, &mut field[l..l + h]);
        field[l + h..].copy_from_slice(trail);
        out.push(b'\n');
        (digest, gap + l..gap + l + h)
    }

    /// `"key":value` with the comma on the side that keeps the object well
    /// formed when it goes in at `at`: before the closing brace it follows
    /// a field (a body is never empty), anywhere else a field follows it.
    fn field_into(
        &self,
        key: &str,
        at: usize,
        out: &mut Vec<u8>,
        value: impl FnOnce(&mut Vec<u8>),
    ) {
        let closing = at + 1 == self.body.len();
        if closing {
            out.push(b',');
        }
        string_into(key, out);
        out.push(b':');
        value(out);
        if !closing {
            out.push(b',');
        }
    }
}

/// Bytes of the `hash` field in a line: `"hash":`, the quoted 64 hex
/// digits and the one comma that joins it to its neighbour.
const HASH_FIELD: usize = "\"hash\":".len() + 66 + 1;

/// `n` in decimal, written at the end of `buf`.
pub(super) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        // A digit: n % 10 < 10.
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// The fields of a struct as serialised: key, and the range of its value.
#[cfg(test)]
type Fields = Vec<(&'static str, usize, usize)>;

#[cfg(test)]
thread_local! {
    /// The sorted order of the keys a struct was last serialised with.
    static ORDER: std::cell::RefCell<Order> = const {
        std::cell::RefCell::new(Order {
            keys: Vec::new(),
            sorted: Vec::new(),
        })
    };
}

/// The keys of the last struct serialised on this thread, and their
/// sorted order, checked (no key twice, none of the chain's). Records of a
/// kind come with the same keys in the same order each time: when the
/// keys are the very same (the same `&'static str`s, as a derived
/// `Serialize` gives them), their order is known without sorting.
#[cfg(test)]
struct Order {
    /// Each key's address and length, in the order serialised.
    keys: Vec<(usize, usize)>,
    /// Indexes into the fields, in the keys' byte order.
    sorted: Vec<usize>,
}

#[cfg(test)]
impl Order {
    /// Make `sorted` the order of `fields` by key; an error for a key
    /// twice or one of the chain's.
    fn sort(&mut self, fields: &Fields) -> Result<(), PrepareError> {
        let same = self.keys.len() == fields.len()
            && self
                .keys
                .iter()
                .zip(fields)
                .all(|(&(ptr, len), (key, _, _))| ptr == key.as_ptr() as usize && len == key.len());
        if same {
            return Ok(());
        }
        self.keys.clear();
        self.sorted.clear();
        self.sorted.extend(0..fields.len());
        self.sorted.sort_unstable_by_key(|&i| fields[i].0);
        let key = |i: usize| fields[self.sorted[i]].0;
        if let Some(i) = (1..fields.len()).find(|&i| key(i - 1) == key(i)) {
            return Err(PrepareError::Duplicate(key(i)));
        }
        if let Some(i) = (0..fields.len()).find(|&i| CHAIN_FIELDS.contains(&key(i))) {
            return Err(PrepareError::ChainField(key(i)));
        }
        self.keys.extend(
            fields
                .iter()
                .map(|(k, _, _)| (k.as_ptr() as usize, k.len())),
        );
        Ok(())
    }
}

/// Collects a struct's fields: each value serialised by serde_json into
/// `values`, its key and byte range into `fields`.
#[cfg(test)]
struct Capture<'a> {
    values: &'a mut Vec<u8>,
    fields: &'a mut Vec<(&'static str, usize, usize)>,
}

#[cfg(test)]
impl serde::ser::SerializeStruct for Capture<'_> {
    type Ok = ();
    type Error = PrepareError;

    fn serialize_field<T: serde::Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), PrepareError> {
        let start = self.values.len();
        serde_json::to_writer(&mut *self.values, value)
            .map_err(|e| PrepareError::Value(e.to_string()))?;
        self.fields.push((key, start, self.values.len()));
        Ok(())
    }

    fn end(self) -> Result<(), PrepareError> {
        Ok(())
    }
}

/// Everything but a struct is refused.
#[cfg(test)]
macro_rules! not_a_struct {
    ($($name:ident($($arg:ty),*);)*) => {
        $(fn $name(self, $(_: $arg),*) -> Result<(), PrepareError> {
            Err(PrepareError::NotAStruct)
        })*
    };
}

#[cfg(test)]
impl<'a> serde::Serializer for Capture<'a> {
    type Ok = ();
    type Error = PrepareError;
    type SerializeSeq = serde::ser::Impossible<(), PrepareError>;
    type SerializeTuple = serde::ser::Impossible<(), PrepareError>;
    type SerializeTupleStruct = serde::ser::Impossible<(), PrepareError>;
    type SerializeTupleVariant = serde::ser::Impossible<(), PrepareError>;
    type SerializeMap = serde::ser::Impossible<(), PrepareError>;
    type SerializeStruct = Capture<'a>;
    type SerializeStructVariant = serde::ser::Impossible<(), PrepareError>;

    fn serialize_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Capture<'a>, PrepareError> {
        Ok(self)
    }

    not_a_struct! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_f32(f32);
        serialize_f64(f64);
        serialize_char(char);
        serialize_str(&str);
        serialize_bytes(&[u8]);
        serialize_none();
        serialize_unit();
        serialize_unit_struct(&'static str);
        serialize_unit_variant(&'static str, u32, &'static str);
    }

    fn serialize_some<T: serde::Serialize + ?Sized>(self, _: &T) -> Result<(), PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_newtype_struct<T: serde::Serialize + ?Sized>(
        self,
        _: &'static str,
        _: &T,
    ) -> Result<(), PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_newtype_variant<T: serde::Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, PrepareError> {
        Err(PrepareError::NotAStruct)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, PrepareError> {
        Err(PrepareError::NotAStruct)
    }
}

/// A record with every CONTRACT field null, for headers and checkpoints.
pub(crate) fn meta_record(event: &str, id: String, ts: String) -> Map<String, Value> {
    let mut m = Map::new();
    for k in CONTRACT_FIELDS {
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

    /// A string is written as serde_json writes it, whether or not it
    /// needs an escape: every ASCII character, alone and among others,
    /// and some beyond.
    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        let mut cases: Vec<String> = (0u8..0x80).map(|b| char::from(b).to_string()).collect();
        cases.extend(
            [
                "",
                "plain-host.example",
                "a\"b",
                "é\u{2028}\u{7f}x",
                "\u{1f}end",
            ]
            .map(String::from),
        );
        cases.push((0u8..0x80).map(char::from).collect());
        for s in cases {
            let mut out = Vec::new();
            string_into(&s, &mut out);
            assert_eq!(out, serde_json::to_vec(&s).unwrap(), "{s:?}");
        }
    }

    /// The eight-at-a-time check agrees with a byte by byte one on every
    /// byte at every place of a word, and on drawn strings of every length.
    #[test]
    fn escape_check_agrees_with_bytewise() {
        let bytewise = |s: &[u8]| s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
        for b in 0..=255u8 {
            for at in 0..17 {
                let mut s = vec![b'a'; 17];
                s[at] = b;
                assert_eq!(needs_escape(&s), bytewise(&s), "{b:#x} at {at}");
                s.fill(0xff);
                s[at] = b;
                assert_eq!(needs_escape(&s), bytewise(&s), "{b:#x} at {at} among 0xff");
            }
        }
        let pool = [
            0x00, 0x1f, 0x20, 0x21, b'"', b'\\', 0x5b, 0x5d, 0x7f, 0x80, 0xc3, 0xa9, 0xff, b'a',
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 40) as usize;
            let s: Vec<u8> = (0..len)
                .map(|i| {
                    let pick = (state >> (i % 50)) as usize + i * 7;
                    // Mostly plain bytes, an escape now and then.
                    if pick % 11 == 0 {
                        pool[pick % pool.len()]
                    } else {
                        b'a' + (pick % 26) as u8
                    }
                })
                .collect();
            assert_eq!(needs_escape(&s), bytewise(&s), "{s:?}");
        }
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
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(hex(&all), HEXLOWER.encode(&all));
        assert_eq!(hex(&[]), "");
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

#[cfg(test)]
mod prepared_tests {
    use super::*;
    use serde::Serialize;
    use std::collections::BTreeMap;

    fn via_value<T: Serialize>(v: &T, seq: u64, prev: &str) -> (String, Vec<u8>) {
        let Value::Object(mut m) = serde_json::to_value(v).unwrap() else {
            panic!("not an object")
        };
        seal_line(&mut m, seq, prev)
    }

    fn check<T: Serialize>(v: &T) {
        for (seq, prev) in [(0, GENESIS), (18446744073709551615, "ab\"c")] {
            let p = Prepared::of(v).unwrap();
            let mut out = b"earlier line\n".to_vec();
            let hash = p.seal_into(seq, prev, &mut out);
            let (want_hash, want) = via_value(v, seq, prev);
            assert_eq!(
                String::from_utf8_lossy(&out[13..]),
                String::from_utf8_lossy(&want)
            );
            assert_eq!(hash, want_hash);
            let back: Value = serde_json::from_slice(&out[13..]).unwrap();
            assert_eq!(record_hash(back.as_object().unwrap()), hash);
        }
    }

    #[derive(Serialize)]
    struct Before {
        a: u8,
        b: &'static str,
    }

    #[derive(Serialize)]
    struct After {
        z: Option<u8>,
        sni: bool,
    }

    #[derive(Serialize)]
    struct Between {
        r#ref: &'static str,
        id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
        port: u16,
        reasons: BTreeMap<String, u64>,
        window: [String; 2],
        answers: Vec<String>,
        policy: &'static str,
        rule: Option<String>,
        host: &'static str,
    }

    /// Wherever `hash`, `prev` and `seq` sort among the keys, the line is
    /// what the `Value` path makes of the same record.
    #[test]
    fn prepared_lines_equal_the_value_path() {
        check(&Before {
            a: 1,
            b: "x\ny\u{1}é",
        });
        check(&After { z: None, sni: true });
        check(&Between {
            r#ref: "r",
            id: "a-b-1".into(),
            skipped: None,
            port: 443,
            reasons: [("z".to_string(), 1), ("a".to_string(), 2)].into(),
            window: ["t0".into(), "t1".into()],
            answers: vec!["198.18.0.1".into()],
            policy: "p",
            rule: None,
            host: "h\"\\",
        });
    }

    #[test]
    fn only_structs_without_chain_fields_are_prepared() {
        #[derive(Serialize)]
        struct Forged {
            hash: u8,
        }
        #[derive(Serialize)]
        struct Empty {}
        assert!(matches!(
            Prepared::of(&Forged { hash: 1 }),
            Err(PrepareError::ChainField("hash"))
        ));
        assert!(Prepared::of(&Empty {}).is_err());
        assert!(Prepared::of(&5u8).is_err());
        assert!(Prepared::of(&vec![1]).is_err());
        let m: BTreeMap<String, u8> = BTreeMap::new();
        assert!(Prepared::of(&m).is_err());
    }
}
