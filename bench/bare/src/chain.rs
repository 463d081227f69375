//! `BARE_CHAIN=1`: the least a chained, hashed DNS decision record costs,
//! written lean. Per answer: the record's JSON from a template (the
//! client's address, a counter id, a timestamp with microseconds), its
//! chain fields (`seq`, `prev`), SHA-256 over it and the hash spliced in
//! at its sorted place, a keyed reference (HMAC-SHA-256 of the id, with
//! the key's two padded blocks absorbed once), the record's leaf in two
//! Merkle trees (the log's and its org's; RFC 6962 leaf and node hashes,
//! a frontier each) and one `write(2)` of the line. For a tunnel, a
//! decision record so written before the `200`, and a close record
//! sealed when it ends and written with the next decision. Not done: signed
//! checkpoints (one Ed25519 signature per thousand records in Palisade),
//! policy, budgets, metrics. The field set and sizes are those of
//! Palisade's record for a cached allowed answer, so the bytes hashed and
//! written are the same.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

type Hash = [u8; 32];

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_into(bytes: &[u8], out: &mut Vec<u8>) {
    for &b in bytes {
        out.push(HEX[usize::from(b >> 4)]);
        out.push(HEX[usize::from(b & 15)]);
    }
}

/// A Merkle tree's right edge: `edge[i]` the root of a full subtree of
/// 2^i leaves, where bit i of the size is set.
#[derive(Default)]
struct Frontier {
    size: u64,
    edge: Vec<Hash>,
}

impl Frontier {
    fn push(&mut self, leaf: Hash) {
        let mut node = leaf;
        let mut level = 0;
        while self.size >> level & 1 == 1 {
            let mut h = Sha256::new();
            h.update([1u8]);
            h.update(self.edge[level]);
            h.update(node);
            node = h.finalize().into();
            level += 1;
        }
        if level == self.edge.len() {
            self.edge.push(node);
        } else {
            self.edge[level] = node;
        }
        self.size += 1;
    }
}

pub struct Chain {
    file: File,
    line: Vec<u8>,
    body: Vec<u8>,
    seq: u64,
    prev: Hash,
    inner: Sha256,
    outer: Sha256,
    log: Frontier,
    org: Frontier,
    /// The timestamp's date and time of day, and the second they are for.
    second: u64,
    date: String,
}

impl Chain {
    pub fn new(file: File) -> Chain {
        let key = [0x5au8; 64];
        let pad = |x: u8| key.map(|k| k ^ x);
        Chain {
            file,
            line: Vec::with_capacity(640),
            body: Vec::with_capacity(640),
            seq: 0,
            prev: [0; 32],
            inner: Sha256::new().chain_update(pad(0x36)),
            outer: Sha256::new().chain_update(pad(0x5c)),
            log: Frontier::default(),
            org: Frontier::default(),
            second: u64::MAX,
            date: String::new(),
        }
    }

    fn ts_into(&mut self, out: &mut Vec<u8>) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let secs = now.as_secs();
        if secs != self.second {
            self.second = secs;
            let days = secs / 86_400;
            let (y, m, d) = civil(days as i64);
            let t = secs % 86_400;
            self.date.clear();
            let _ = write!(
                self.date,
                "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.",
                t / 3600,
                t / 60 % 60,
                t % 60
            );
        }
        out.extend_from_slice(self.date.as_bytes());
        let micros = now.subsec_micros();
        let mut digits = [b'0'; 6];
        let mut v = micros;
        for d in digits.iter_mut().rev() {
            *d = b'0' + (v % 10) as u8;
            v /= 10;
        }
        out.extend_from_slice(&digits);
        out.push(b'Z');
    }

    /// Record a decision for `client` (a DNS answer, a tunnel) and write
    /// it, with the close records that wait (one `write(2)`, as
    /// Palisade's closes ride the next batch).
    pub fn record(&mut self, client: SocketAddr) -> std::io::Result<()> {
        self.seal(client);
        self.file.write_all(&self.line)?;
        self.line.clear();
        Ok(())
    }

    /// A tunnel's close record: sealed now, written with the next
    /// decision.
    pub fn close(&mut self, client: SocketAddr) {
        self.seal(client);
    }

    /// Seal a record into `line`, after what waits there.
    fn seal(&mut self, client: SocketAddr) {
        let mut body = std::mem::take(&mut self.body);
        body.clear();
        let id = format!("bare-{}", self.seq);
        let reference: Hash = {
            let inner: Hash = self
                .inner
                .clone()
                .chain_update(id.as_bytes())
                .finalize()
                .into();
            self.outer.clone().chain_update(inner).finalize().into()
        };
        body.extend_from_slice(b"{\"answers\":[\"A 127.0.0.1\"],\"client\":\"");
        let _ = write!(AsFmt(&mut body), "{client}");
        body.extend_from_slice(b"\",\"decision\":\"allow\",\"event\":\"decision\",");
        let splice = body.len();
        body.extend_from_slice(b"\"host\":\"allowed.bench\",\"id\":\"");
        body.extend_from_slice(id.as_bytes());
        body.extend_from_slice(
            b"\",\"ip\":null,\"kind\":\"dns\",\"layer\":\"org\",\"mode\":\"dns\",\"org\":\"bench\",\
\"policy\":\"f8a6fef004b5a9e4d7cbe0c28df51a164692a004f18e02629ea45602d1b791b5\",\"port\":null,\"prev\":\"",
        );
        hex_into(&self.prev, &mut body);
        body.extend_from_slice(b"\",\"qtype\":\"A\",\"reason\":\"rule_match\",\"ref\":\"");
        hex_into(&reference[..8], &mut body);
        body.extend_from_slice(b"\",\"rule\":\"bench/allow/0\",\"seq\":");
        let _ = write!(AsFmt(&mut body), "{}", self.seq);
        body.extend_from_slice(b",\"sni\":null,\"ts\":\"");
        self.ts_into(&mut body);
        body.extend_from_slice(b"\",\"upstream\":true}");
        let hash: Hash = Sha256::digest(&body).into();
        self.line.extend_from_slice(&body[..splice]);
        self.line.extend_from_slice(b"\"hash\":\"");
        hex_into(&hash, &mut self.line);
        self.line.extend_from_slice(b"\",");
        self.line.extend_from_slice(&body[splice..]);
        self.line.push(b'\n');
        self.body = body;
        let leaf: Hash = Sha256::new()
            .chain_update([0u8])
            .chain_update(hash)
            .finalize()
            .into();
        self.log.push(leaf);
        self.org.push(leaf);
        self.prev = hash;
        self.seq += 1;
    }
}

/// `fmt::Write` into a byte vector.
struct AsFmt<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for AsFmt<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// Year, month and day of a day count since 1970-01-01 (civil calendar).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}
