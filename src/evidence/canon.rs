//! The canonical form of a [`Record`], written by hand: every field in the
//! keys' byte order, each key a static pre-escaped constant, each value by
//! a direct writer (strings through the chain's one escaper, integers and
//! IPv4 addresses digit by digit). It gives byte for byte what
//! `Prepared::of` makes of the same record through its `Serialize`
//! implementation (the reference, kept for the tests),
//! without serde's per-field machinery, key sorting, `fmt` or buffers
//! growing on the way. The rare nested fields (`service`, `grant`,
//! `decider`) have their value written by serde_json, as the reference
//! writes it.
//!
//! The record is taken apart field by field with no `..` (see
//! [`record`]): a field added to [`Record`] does not compile here until it
//! is written in its place.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::chain::{decimal, string_into, Canonical, PrepareError, Prepared};
use super::Record;

/// `"key":`, pre-escaped (every key is plain ASCII with no escape).
macro_rules! key {
    ($k:literal) => {
        concat!("\"", $k, "\":").as_bytes()
    };
}

/// The body being written, and where the chain's fields go in it. Its
/// small writers are inlined into [`record`]: each key's length is then a
/// constant there, and its copy a few moves instead of a call.
struct Body {
    out: Vec<u8>,
    /// As [`Prepared`]'s: for `hash`, `prev` and `seq`, the offset of the
    /// first key that sorts after each (after that key's comma).
    at: [usize; 3],
}

impl Body {
    /// The next key, after a comma unless it is the first.
    #[inline(always)]
    fn key(&mut self, key: &[u8]) {
        if self.out.len() > 1 {
            self.out.push(b',');
        }
        self.out.extend_from_slice(key);
    }

    /// Chain field `i` sorts here: before the next key, which every record
    /// has, and after the key before, which every record has too (so the
    /// next key's comma comes first).
    #[inline(always)]
    fn chain(&mut self, i: usize) {
        self.at[i] = self.out.len() + 1;
    }

    #[inline(always)]
    fn str(&mut self, key: &[u8], s: &str) {
        self.key(key);
        string_into(s, &mut self.out);
    }

    /// A value from the code's own vocabulary (an enum's name: ASCII
    /// letters, digits, `_` and `-`), which never needs an escape: copied
    /// as it is, without the escaper's scan.
    #[inline(always)]
    fn word(&mut self, key: &[u8], s: &'static str) {
        debug_assert!(is_word(s), "{s:?} is not a plain word");
        self.key(key);
        self.out.push(b'"');
        self.out.extend_from_slice(s.as_bytes());
        self.out.push(b'"');
    }

    #[inline(always)]
    fn word_if(&mut self, key: &[u8], s: Option<&'static str>) {
        if let Some(s) = s {
            self.word(key, s);
        }
    }

    /// A field every record has: its value, or null.
    #[inline(always)]
    fn str_or_null(&mut self, key: &[u8], s: Option<&str>) {
        match s {
            Some(s) => self.str(key, s),
            None => self.null(key),
        }
    }

    /// A field only some records have: left out when absent.
    #[inline(always)]
    fn str_if(&mut self, key: &[u8], s: Option<&str>) {
        if let Some(s) = s {
            self.str(key, s);
        }
    }

    #[inline(always)]
    fn null(&mut self, key: &[u8]) {
        self.key(key);
        self.out.extend_from_slice(b"null");
    }

    #[inline(always)]
    fn uint(&mut self, key: &[u8], n: u64) {
        self.key(key);
        let mut digits = [0u8; 20];
        self.out.extend_from_slice(decimal(n, &mut digits));
    }

    #[inline(always)]
    fn uint_if(&mut self, key: &[u8], n: Option<u64>) {
        if let Some(n) = n {
            self.uint(key, n);
        }
    }

    #[inline(always)]
    fn bool_if(&mut self, key: &[u8], b: Option<bool>) {
        if let Some(b) = b {
            self.key(key);
            self.out
                .extend_from_slice(if b { b"true" } else { b"false" });
        }
    }

    /// An array of strings, left out when absent.
    fn strings_if(&mut self, key: &[u8], list: Option<&[String]>) {
        let Some(list) = list else { return };
        self.key(key);
        self.out.push(b'[');
        for (i, s) in list.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            string_into(s, &mut self.out);
        }
        self.out.push(b']');
    }

    /// A map of counts (its keys in byte order already), left out when
    /// absent.
    fn counts_if(&mut self, key: &[u8], map: Option<&BTreeMap<String, u64>>) {
        let Some(map) = map else { return };
        self.key(key);
        self.out.push(b'{');
        let mut digits = [0u8; 20];
        for (i, (k, n)) in map.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            string_into(k, &mut self.out);
            self.out.push(b':');
            self.out.extend_from_slice(decimal(*n, &mut digits));
        }
        self.out.push(b'}');
    }

    /// An address as a string, as its `Display` writes it.
    fn ip(&mut self, key: &[u8], ip: IpAddr) {
        self.key(key);
        self.out.push(b'"');
        match ip {
            IpAddr::V4(v4) => ipv4_into(v4, &mut self.out),
            IpAddr::V6(v6) => display_into(&v6, &mut self.out),
        }
        self.out.push(b'"');
    }

    fn socket(&mut self, key: &[u8], addr: SocketAddr) {
        self.key(key);
        self.out.push(b'"');
        match addr {
            SocketAddr::V4(v4) => {
                ipv4_into(*v4.ip(), &mut self.out);
                self.out.push(b':');
                let mut digits = [0u8; 20];
                self.out
                    .extend_from_slice(decimal(u64::from(v4.port()), &mut digits));
            }
            SocketAddr::V6(v6) => display_into(&v6, &mut self.out),
        }
        self.out.push(b'"');
    }

    /// A nested value, written by serde_json as the reference writes it.
    fn serde_if<T: serde::Serialize>(
        &mut self,
        key: &[u8],
        value: Option<&T>,
    ) -> Result<(), PrepareError> {
        if let Some(v) = value {
            self.key(key);
            serde_json::to_writer(&mut self.out, v)
                .map_err(|e| PrepareError::Value(e.to_string()))?;
        }
        Ok(())
    }
}

/// Whether `s` is written the same with or without JSON's escapes, and
/// is one of the words enums name themselves with.
fn is_word(s: &str) -> bool {
    s.bytes()
        .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
}

/// `a.b.c.d`, each octet in decimal.
fn ipv4_into(ip: Ipv4Addr, out: &mut Vec<u8>) {
    for (i, o) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            out.push(b'.');
        }
        if o >= 100 {
            out.push(b'0' + o / 100);
        }
        if o >= 10 {
            out.push(b'0' + o / 10 % 10);
        }
        out.push(b'0' + o % 10);
    }
}

/// What `Display` writes (IPv6: rare enough to go through `fmt`).
fn display_into(v: &impl std::fmt::Display, out: &mut Vec<u8>) {
    use std::io::Write as _;
    // Writing into a Vec cannot fail.
    let _ = write!(out, "{v}");
}

/// The canonical form of `r`: byte for byte `Prepared::of(r)`.
pub(crate) fn record(r: &Record) -> Result<Prepared, PrepareError> {
    let Record {
        id,
        reference,
        ts,
        kind,
        event,
        org,
        client,
        mode,
        host,
        port,
        sni,
        ip,
        synthetic,
        decision,
        reason,
        rule,
        policy,
        baseline,
        layer,
        would_deny,
        method,
        path,
        detail,
        conn,
        bytes_up,
        bytes_down,
        duration_ms,
        qtype,
        answers,
        upstream,
        intercepted,
        status,
        credential,
        tunnel,
        service,
        proto,
        count,
        reasons,
        hosts,
        window,
        differs,
        grant,
        decider,
        owed: _,
    } = r;
    let mut b = Body {
        out: Vec::with_capacity(512),
        at: [0; 3],
    };
    b.out.push(b'{');
    // Keys in byte order (`_` sorts before the letters).
    b.strings_if(key!("answers"), answers.as_deref());
    b.str_if(key!("baseline"), baseline.as_deref());
    b.uint_if(key!("bytes_down"), *bytes_down);
    b.uint_if(key!("bytes_up"), *bytes_up);
    match client {
        Some(c) => b.socket(key!("client"), *c),
        None => b.null(key!("client")),
    }
    b.str_if(key!("conn"), conn.as_deref());
    b.uint_if(key!("count"), *count);
    b.str_if(key!("credential"), credential.as_deref());
    b.serde_if(key!("decider"), decider.as_ref())?;
    b.word(key!("decision"), decision);
    b.str_if(key!("detail"), detail.as_deref());
    b.strings_if(key!("differs"), differs.as_deref());
    b.uint_if(key!("duration_ms"), *duration_ms);
    b.word(key!("event"), event.as_str());
    b.serde_if(key!("grant"), grant.as_deref())?;
    b.chain(0); // hash
    b.str_or_null(key!("host"), host.as_deref());
    b.counts_if(key!("hosts"), hosts.as_ref());
    b.str(key!("id"), id);
    b.bool_if(key!("intercepted"), *intercepted);
    match ip {
        Some(a) => b.ip(key!("ip"), *a),
        None => b.null(key!("ip")),
    }
    b.word(key!("kind"), kind.as_str());
    b.word_if(key!("layer"), layer.map(|l| l.as_str()));
    b.str_if(key!("method"), method.as_deref());
    b.word(key!("mode"), mode.as_str());
    b.str_or_null(key!("org"), org.as_deref());
    b.str_if(key!("path"), path.as_deref());
    b.str(key!("policy"), policy);
    match port {
        Some(p) => b.uint(key!("port"), u64::from(*p)),
        None => b.null(key!("port")),
    }
    b.chain(1); // prev
    b.str_if(key!("proto"), proto.as_deref());
    b.str_if(key!("qtype"), qtype.as_deref());
    b.word(key!("reason"), reason.as_str());
    b.counts_if(key!("reasons"), reasons.as_ref());
    b.str_if(key!("ref"), reference.as_deref());
    b.str_or_null(key!("rule"), rule.as_deref());
    b.chain(2); // seq
    b.serde_if(key!("service"), service.as_ref())?;
    b.str_or_null(key!("sni"), sni.as_deref());
    b.uint_if(key!("status"), status.map(u64::from));
    if let Some(a) = synthetic {
        b.ip(key!("synthetic"), *a);
    }
    b.str(key!("ts"), ts);
    b.word_if(key!("tunnel"), tunnel.map(|t| t.as_str()));
    b.bool_if(key!("upstream"), *upstream);
    b.strings_if(key!("window"), window.as_ref().map(|w| &w[..]));
    b.word_if(key!("would_deny"), would_deny.map(|w| w.as_str()));
    b.out.push(b'}');
    Ok(Prepared::from_parts(b.out, b.at))
}

impl Canonical for Record {
    fn prepare(&self) -> Result<Prepared, PrepareError> {
        record(self)
    }
}

#[cfg(test)]
mod tests;
