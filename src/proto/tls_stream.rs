//! TLS tunnel verifier: judges every byte a client sends through a tunnel to
//! a TLS name until the server can no longer accept a plaintext ClientHello.
//!
//! Why: a tunnel to an allowed name is dialled to that name's address, which
//! on a CDN serves thousands of other sites; only the SNI keeps the client on
//! the allowed one. So every ClientHello the server could act on (the first,
//! and a second one after a HelloRetryRequest) must name the tunnel host,
//! carry no encrypted_client_hello, and nothing else may slip in before it.
//!
//! Client side, as [`TlsGuard::client`] answers (see [`super::guard`]):
//!
//! | held bytes start with                         | before ServerHello        |
//! |-----------------------------------------------|---------------------------|
//! | first bytes, not a TLS handshake record       | Deny ProtocolMismatch     |
//! | first bytes, handshake but not a ClientHello  | Deny ProtocolMismatch     |
//! | a ClientHello (any) with ECH                  | Deny EchNotAllowed        |
//! | a ClientHello without SNI (host is a name)    | Deny SniMissing           |
//! | a ClientHello naming another host             | Deny SniMismatch          |
//! | a ClientHello naming the host (records whole) | Forward its records       |
//! | later: change_cipher_spec, alert, app data    | Forward, streamed         |
//! | later: handshake other than ClientHello       | Deny ProtocolMismatch     |
//! | later: any other record type                  | Deny ProtocolMismatch     |
//! | bad framing, oversize record or hello         | Deny Malformed            |
//! | a valid prefix of any of the above            | NeedMore                  |
//!
//! Once the upstream has sent a ServerHello that is not a HelloRetryRequest
//! (and only after the first hello was forwarded), every answer is `Opaque`:
//! in TLS 1.2 and 1.3 the server then accepts no plaintext ClientHello.
//! Upstream bytes that are not parseable TLS leave the verifier checking for
//! good. A `Deny` is final.
//!
//! Pure and sans-IO: no clock, no socket; the server side keeps a fixed-size
//! state, the client side only what the driver holds.

use super::client_hello::{self, ClientHello, MAX_RECORD_LEN};
use super::guard::{Step, Violation, ViolationKind};
use super::target::{normalize_host, Host};
use super::Parse;

/// ContentType values (RFC 8446 §5.1; RFC 5246 §6.2.1).
const CONTENT_CHANGE_CIPHER_SPEC: u8 = 20;
const CONTENT_ALERT: u8 = 21;
const CONTENT_HANDSHAKE: u8 = 22;
const CONTENT_APPLICATION_DATA: u8 = 23;
/// Record header: type(1) legacy_record_version(2) length(2) (RFC 8446 §5.1).
const RECORD_HEADER_LEN: usize = 5;
/// Handshake header: msg_type(1) length(3) (RFC 8446 §4).
const HANDSHAKE_HEADER_LEN: usize = 4;
/// HandshakeType server_hello (RFC 8446 §4).
const HANDSHAKE_SERVER_HELLO: u8 = 2;
/// ServerHello body up to the random: legacy_version(2) random(32) (RFC 8446 §4.1.3).
const SERVER_HELLO_PREFIX_LEN: usize = 34;

/// The ServerHello.random of a HelloRetryRequest: SHA-256("HelloRetryRequest")
/// (RFC 8446 §4.1.3).
pub const HELLO_RETRY_REQUEST_RANDOM: [u8; 32] = [
    0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c, 0x02, 0x1e, 0x65, 0xb8, 0x91,
    0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb, 0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c,
];

const NOT_A_HELLO: &str = "not a TLS ClientHello";
const NOT_A_HELLO_LATER: &str = "handshake message other than ClientHello before ServerHello";

/// Verifies the client half of a TLS tunnel to one host.
#[derive(Debug)]
pub struct TlsGuard {
    host: Host,
    hello: Option<ClientHello>,
    client: Client,
    server: Server,
}

/// Where the client byte stream is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Client {
    /// Nothing forwarded yet: the held bytes must start with a ClientHello.
    First,
    /// The first hello is forwarded; `left` bytes of a streamed
    /// (non-handshake) record are still to come, 0 between records.
    Records { left: usize },
    /// Denied; every later answer is this.
    Denied(Violation),
}

impl TlsGuard {
    /// `host`: the tunnel's normalised target name.
    pub fn new(host: Host) -> Self {
        TlsGuard {
            host,
            hello: None,
            client: Client::First,
            server: Server::default(),
        }
    }

    /// Judge held client bytes (guard.rs protocol: Forward(n) = first n held
    /// bytes verified; the driver drops them and calls again with the rest).
    pub fn client(&mut self, held: &[u8]) -> Step {
        let step = match &self.client {
            Client::Denied(v) => return Step::Deny(v.clone()),
            _ if self.server.state == ServerState::Done => return Step::Opaque,
            Client::First => self.first_hello(held),
            Client::Records { left: 0 } => self.next_record(held),
            &Client::Records { left } => {
                let n = left.min(held.len());
                if n == 0 {
                    return Step::NeedMore;
                }
                self.client = Client::Records { left: left - n };
                Step::Forward(n)
            }
        };
        if let Step::Deny(v) = &step {
            self.client = Client::Denied(v.clone());
        }
        step
    }

    /// Observe upstream->client bytes as they pass (always forwarded).
    pub fn server(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        // A TLS server speaks only after the ClientHello: upstream bytes
        // before it was forwarded are another protocol, never a ServerHello.
        if self.client == Client::First {
            self.server.state = ServerState::Unparseable;
        }
        self.server.feed(bytes);
    }

    /// The first ClientHello, once parsed (for evidence: its SNI as sent, ALPN).
    pub fn hello(&self) -> Option<&ClientHello> {
        self.hello.as_ref()
    }

    fn first_hello(&mut self, held: &[u8]) -> Step {
        match client_hello::parse(held) {
            Parse::NeedMore => Step::NeedMore,
            Parse::NotThis => deny(ViolationKind::ProtocolMismatch, None, NOT_A_HELLO),
            Parse::Malformed(why) => deny(ViolationKind::Malformed, None, why),
            Parse::Done { value: hello, len } => {
                let verdict = self.check(&hello);
                self.hello = Some(hello);
                match verdict {
                    Err(v) => Step::Deny(v),
                    Ok(()) => {
                        self.client = Client::Records { left: 0 };
                        Step::Forward(len)
                    }
                }
            }
        }
    }

    /// A record boundary after the first hello, before the ServerHello.
    fn next_record(&mut self, held: &[u8]) -> Step {
        // Record header (RFC 8446 §5.1), judged byte by byte.
        let Some(&content_type) = held.first() else {
            return Step::NeedMore;
        };
        if !matches!(
            content_type,
            CONTENT_CHANGE_CIPHER_SPEC
                | CONTENT_ALERT
                | CONTENT_HANDSHAKE
                | CONTENT_APPLICATION_DATA
        ) {
            return deny(
                ViolationKind::ProtocolMismatch,
                None,
                format!("TLS record type {content_type} before ServerHello"),
            );
        }
        let Some(&major) = held.get(1) else {
            return Step::NeedMore;
        };
        if major != 3 {
            return deny(ViolationKind::Malformed, None, "bad record version");
        }
        let (Some(&hi), Some(&lo)) = (held.get(3), held.get(4)) else {
            return Step::NeedMore;
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        if len > MAX_RECORD_LEN {
            return deny(ViolationKind::Malformed, None, "record too long");
        }
        if content_type == CONTENT_HANDSHAKE {
            return self.later_hello(held);
        }
        // change_cipher_spec (middlebox compatibility, RFC 8446 §D.4), alert,
        // application_data (0-RTT early data, RFC 8446 §4.2.10): streamed,
        // never past the end of this record.
        let n = (RECORD_HEADER_LEN + len).min(held.len());
        self.client = Client::Records {
            left: RECORD_HEADER_LEN + len - n,
        };
        Step::Forward(n)
    }

    /// Handshake records after the first hello: a whole ClientHello (after a
    /// HelloRetryRequest, or pipelined), held until complete. Handshake
    /// messages spanning records admit no other record in between (RFC 8446
    /// §5.1), so the hello's records are contiguous in `held`.
    fn later_hello(&mut self, held: &[u8]) -> Step {
        match client_hello::parse(held) {
            Parse::NeedMore => Step::NeedMore,
            // The record type and version were checked by the caller, so
            // this is the handshake type.
            Parse::NotThis => deny(ViolationKind::ProtocolMismatch, None, NOT_A_HELLO_LATER),
            Parse::Malformed(why) => deny(ViolationKind::Malformed, None, why),
            Parse::Done { value: hello, len } => match self.check(&hello) {
                Err(v) => Step::Deny(v),
                Ok(()) => Step::Forward(len),
            },
        }
    }

    /// Rule for every ClientHello: no ECH, an SNI naming exactly the tunnel
    /// host (an IP host also admits no SNI: RFC 6066 §3 forbids literals).
    fn check(&self, hello: &ClientHello) -> Result<(), Violation> {
        if hello.ech {
            return Err(Violation::new(
                ViolationKind::EchNotAllowed,
                hello.sni.clone(),
                "ClientHello carries encrypted_client_hello: the real name is hidden",
            ));
        }
        let Some(sni) = &hello.sni else {
            return match self.host {
                Host::Ip(_) => Ok(()),
                Host::Name(_) => Err(Violation::new(
                    ViolationKind::SniMissing,
                    None,
                    "ClientHello without server_name",
                )),
            };
        };
        match normalize_host(sni) {
            Ok(named) if named == self.host => Ok(()),
            Ok(named) => Err(Violation::new(
                ViolationKind::SniMismatch,
                Some(sni.clone()),
                format!("server_name {named} is not the tunnel host {}", self.host),
            )),
            Err(e) => Err(Violation::new(
                ViolationKind::SniMismatch,
                Some(sni.clone()),
                format!("server_name is not a host: {e}"),
            )),
        }
    }
}

fn deny(kind: ViolationKind, seen: Option<String>, detail: impl Into<String>) -> Step {
    Step::Deny(Violation::new(kind, seen, detail))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum ServerState {
    /// Following the upstream's records, looking for a ServerHello.
    #[default]
    Parsing,
    /// Saw bytes that are not TLS as a server sends it; stop looking.
    Unparseable,
    /// Saw a ServerHello that is not a HelloRetryRequest.
    Done,
}

/// Upstream record and handshake framing, just enough to find a ServerHello
/// and read its random. Fixed size whatever the upstream sends.
#[derive(Debug)]
struct Server {
    state: ServerState,
    /// Record header being read, `header_len` bytes of it so far.
    header: [u8; RECORD_HEADER_LEN],
    header_len: usize,
    /// Content type and bytes left of the record body being read.
    record_type: u8,
    record_left: usize,
    /// Handshake message header being read (RFC 8446 §4).
    msg_header: [u8; HANDSHAKE_HEADER_LEN],
    msg_header_len: usize,
    /// Type and body bytes left of the handshake message being read.
    msg_type: u8,
    msg_left: usize,
    /// First bytes of a ServerHello body.
    prefix: [u8; SERVER_HELLO_PREFIX_LEN],
    prefix_len: usize,
    /// HelloRetryRequests seen (for tests and debugging).
    retries: u32,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            state: ServerState::Parsing,
            header: [0; RECORD_HEADER_LEN],
            header_len: 0,
            record_type: 0,
            record_left: 0,
            msg_header: [0; HANDSHAKE_HEADER_LEN],
            msg_header_len: 0,
            msg_type: 0,
            msg_left: 0,
            prefix: [0; SERVER_HELLO_PREFIX_LEN],
            prefix_len: 0,
            retries: 0,
        }
    }
}

impl Server {
    fn feed(&mut self, mut bytes: &[u8]) {
        while self.state == ServerState::Parsing && !bytes.is_empty() {
            if self.record_left == 0 {
                bytes = fill(&mut self.header, &mut self.header_len, bytes);
                if self.header_len == RECORD_HEADER_LEN {
                    self.header_len = 0;
                    self.record_header();
                }
            } else {
                let (body, rest) = split(bytes, self.record_left);
                if self.record_type == CONTENT_HANDSHAKE {
                    self.handshake(body);
                }
                self.record_left -= body.len();
                bytes = rest;
            }
        }
    }

    /// A complete record header (RFC 8446 §5.1).
    fn record_header(&mut self) {
        let [content_type, major, _minor, hi, lo] = self.header;
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        let known = matches!(
            content_type,
            CONTENT_CHANGE_CIPHER_SPEC
                | CONTENT_ALERT
                | CONTENT_HANDSHAKE
                | CONTENT_APPLICATION_DATA
        );
        // A handshake message split over records admits no other record
        // type in between (RFC 8446 §5.1).
        let mid_message = self.msg_header_len > 0 || self.msg_left > 0;
        if !known
            || major != 3
            || len > MAX_RECORD_LEN
            || (mid_message && content_type != CONTENT_HANDSHAKE)
        {
            self.state = ServerState::Unparseable;
            return;
        }
        self.record_type = content_type;
        self.record_left = len;
    }

    /// Handshake record payload: messages may span records, several may
    /// share one (RFC 8446 §5.1).
    fn handshake(&mut self, mut bytes: &[u8]) {
        while self.state == ServerState::Parsing && !bytes.is_empty() {
            if self.msg_left == 0 {
                bytes = fill(&mut self.msg_header, &mut self.msg_header_len, bytes);
                if self.msg_header_len == HANDSHAKE_HEADER_LEN {
                    self.msg_header_len = 0;
                    let [msg_type, a, b, c] = self.msg_header;
                    self.msg_type = msg_type;
                    self.msg_left = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                    self.prefix_len = 0;
                    if msg_type == HANDSHAKE_SERVER_HELLO && self.msg_left < SERVER_HELLO_PREFIX_LEN
                    {
                        self.state = ServerState::Unparseable;
                    }
                }
            } else {
                let (body, rest) = split(bytes, self.msg_left);
                if self.msg_type == HANDSHAKE_SERVER_HELLO
                    && self.prefix_len < SERVER_HELLO_PREFIX_LEN
                {
                    fill(&mut self.prefix, &mut self.prefix_len, body);
                    if self.prefix_len == SERVER_HELLO_PREFIX_LEN {
                        self.server_hello();
                    }
                }
                self.msg_left -= body.len();
                bytes = rest;
            }
        }
    }

    /// legacy_version and random of a ServerHello (RFC 8446 §4.1.3): a
    /// HelloRetryRequest keeps the client side checking, any other
    /// ServerHello ends it.
    fn server_hello(&mut self) {
        let [major, _minor, random @ ..] = self.prefix;
        if major != 3 {
            self.state = ServerState::Unparseable;
        } else if random == HELLO_RETRY_REQUEST_RANDOM {
            self.retries = self.retries.saturating_add(1);
        } else {
            self.state = ServerState::Done;
        }
    }
}

/// Copy bytes into the unfilled tail of `buf`; returns the bytes left over.
fn fill<'a>(buf: &mut [u8], filled: &mut usize, bytes: &'a [u8]) -> &'a [u8] {
    let mut rest = bytes;
    while let Some(slot) = buf.get_mut(*filled) {
        let Some((&b, tail)) = rest.split_first() else {
            break;
        };
        *slot = b;
        *filled += 1;
        rest = tail;
    }
    rest
}

/// At most `n` bytes, and the rest.
fn split(bytes: &[u8], n: usize) -> (&[u8], &[u8]) {
    bytes.split_at_checked(n).unwrap_or((bytes, &[]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::{client_hello_bytes, drive_tls, server_hello_bytes, UpstreamAt};
    use sha2::{Digest, Sha256};

    use crate::testing::hellos::{CURL, LARGE, OPENSSL};

    const HOST: &str = "api.example.com";
    /// change_cipher_spec as TLS 1.3 clients send it (RFC 8446 §D.4).
    const CCS: &[u8] = &[20, 3, 3, 0, 1, 1];
    const HTTP_RESPONSE: &[u8] = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";

    fn captures() -> [(&'static str, &'static [u8], &'static str); 3] {
        [
            ("openssl", OPENSSL, HOST),
            ("curl", CURL, HOST),
            ("large", LARGE, "large.example.com"),
        ]
    }

    fn guard(host: &str) -> TlsGuard {
        TlsGuard::new(normalize_host(host).unwrap())
    }

    fn hello(sni: &str) -> Vec<u8> {
        client_hello_bytes(Some(sni), false)
    }

    /// A record of `content_type` with `payload`.
    fn record(content_type: u8, payload: &[u8]) -> Vec<u8> {
        let mut r = vec![content_type, 3, 3];
        r.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        r.extend_from_slice(payload);
        r
    }

    /// The payload of a single-record message.
    fn payload(rec: &[u8]) -> &[u8] {
        assert_eq!(
            rec.len(),
            5 + usize::from(u16::from_be_bytes([rec[3], rec[4]]))
        );
        &rec[5..]
    }

    /// `msg` cut into handshake records at `cuts`.
    fn handshake_records(msg: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain([msg.len()].iter()) {
            out.extend(record(CONTENT_HANDSHAKE, &msg[start..end]));
            start = end;
        }
        out
    }

    fn kind(step: &Step) -> ViolationKind {
        match step {
            Step::Deny(v) => v.kind,
            other => panic!("expected Deny, got {other:?}"),
        }
    }

    fn denial(step: Step) -> Violation {
        match step {
            Step::Deny(v) => v,
            other => panic!("expected Deny, got {other:?}"),
        }
    }

    /// A guard that has forwarded a good first hello.
    fn after_hello(host: &str) -> TlsGuard {
        let mut g = guard(host);
        let ch = hello(host);
        assert_eq!(g.client(&ch), Step::Forward(ch.len()));
        g
    }

    #[test]
    fn hrr_random_is_sha256_of_its_name() {
        assert_eq!(
            Sha256::digest(b"HelloRetryRequest").as_slice(),
            &HELLO_RETRY_REQUEST_RANDOM[..]
        );
    }

    #[test]
    fn captured_hellos_every_prefix() {
        for (name, buf, host) in captures() {
            let mut g = guard(host);
            for i in 0..buf.len() {
                assert_eq!(g.client(&buf[..i]), Step::NeedMore, "{name}: prefix {i}");
            }
            assert_eq!(g.client(buf), Step::Forward(buf.len()), "{name}");
            assert_eq!(g.hello().and_then(|h| h.sni.as_deref()), Some(host));
            assert_eq!(g.client(&[]), Step::NeedMore, "{name}");
        }
    }

    #[test]
    fn captured_hello_then_trailing_records() {
        for (name, buf, host) in captures() {
            let mut held = buf.to_vec();
            held.extend_from_slice(CCS);
            held.extend(record(CONTENT_APPLICATION_DATA, &[7; 40]));
            held.extend_from_slice(&[23, 3, 3]);
            let mut g = guard(host);
            assert_eq!(g.client(&held), Step::Forward(buf.len()), "{name}");
            let held = &held[buf.len()..];
            assert_eq!(g.client(held), Step::Forward(6), "{name}");
            let held = &held[6..];
            assert_eq!(g.client(held), Step::Forward(45), "{name}");
            assert_eq!(g.client(&held[45..]), Step::NeedMore, "{name}");
        }
    }

    #[test]
    fn first_record_not_handshake_is_protocol_mismatch() {
        for first in [
            CCS.to_vec(),
            record(CONTENT_ALERT, &[2, 40]),
            record(CONTENT_APPLICATION_DATA, &[0; 8]),
            record(24, &[1, 0, 0]),
            vec![CONTENT_CHANGE_CIPHER_SPEC],
            vec![0x80, 0x2e, 0x01],
        ] {
            let v = denial(guard(HOST).client(&first));
            assert_eq!(v.kind, ViolationKind::ProtocolMismatch, "{first:?}");
            assert_eq!(v.detail, NOT_A_HELLO);
        }
        // A handshake record with another handshake type first.
        let mut g = guard(HOST);
        assert_eq!(
            kind(&g.client(&[22, 3, 1, 0, 40, 2])),
            ViolationKind::ProtocolMismatch
        );
    }

    #[test]
    fn http_and_ssh_are_protocol_mismatch() {
        for bytes in [
            &b"GET / HTTP/1.1\r\nHost: api.example.com\r\n\r\n"[..],
            b"G",
            b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n",
            b"SSH-2.0-OpenSSH_9.6\r\n",
        ] {
            assert_eq!(
                kind(&guard(HOST).client(bytes)),
                ViolationKind::ProtocolMismatch
            );
        }
    }

    #[test]
    fn malformed_first_hello() {
        // Record over 2^14+2048; handshake over MAX_HELLO_LEN; record longer
        // than its hello.
        assert_eq!(
            kind(&guard(HOST).client(&[22, 3, 1, 0x48, 0x01])),
            ViolationKind::Malformed
        );
        assert_eq!(
            kind(&guard(HOST).client(&[22, 3, 1, 0x10, 0, 1, 0, 0x40, 1])),
            ViolationKind::Malformed
        );
        let mut long = hello(HOST);
        let n = u16::from_be_bytes([long[3], long[4]]) + 1;
        long[3..5].copy_from_slice(&n.to_be_bytes());
        long.push(1);
        assert_eq!(kind(&guard(HOST).client(&long)), ViolationKind::Malformed);
    }

    #[test]
    fn ech_is_denied_naming_the_outer_sni() {
        let v = denial(guard(HOST).client(&client_hello_bytes(Some(HOST), true)));
        assert_eq!(v.kind, ViolationKind::EchNotAllowed);
        assert_eq!(v.seen.as_deref(), Some(HOST));
        let v = denial(guard(HOST).client(&client_hello_bytes(None, true)));
        assert_eq!((v.kind, v.seen), (ViolationKind::EchNotAllowed, None));
        // Also to an IP host, where a hello without SNI is fine.
        let mut g = guard("192.0.2.7");
        assert_eq!(
            kind(&g.client(&client_hello_bytes(None, true))),
            ViolationKind::EchNotAllowed
        );
        // The hello is kept for evidence all the same.
        assert!(g.hello().unwrap().ech);
    }

    #[test]
    fn sni_missing() {
        let mut g = guard(HOST);
        let v = denial(g.client(&client_hello_bytes(None, false)));
        assert_eq!((v.kind, v.seen), (ViolationKind::SniMissing, None));
        assert_eq!(g.hello().unwrap().alpn, ["h2", "http/1.1"]);
    }

    #[test]
    fn ip_host_sni_absent_or_same_ip() {
        let none = client_hello_bytes(None, false);
        for (host, sni) in [
            ("192.0.2.7", None),
            ("192.0.2.7", Some("192.0.2.7")),
            ("192.0.2.7", Some("3221225991")),
            ("[::ffff:192.0.2.7]", Some("192.0.2.7")),
            ("[2001:db8::1]", None),
        ] {
            let ch = sni.map_or(none.clone(), hello);
            assert_eq!(
                guard(host).client(&ch),
                Step::Forward(ch.len()),
                "{host} {sni:?}"
            );
        }
        for (host, sni) in [
            ("192.0.2.7", "192.0.2.8"),
            ("192.0.2.7", HOST),
            ("[2001:db8::1]", "192.0.2.7"),
        ] {
            let v = denial(guard(host).client(&hello(sni)));
            assert_eq!(v.kind, ViolationKind::SniMismatch, "{host} {sni}");
            assert_eq!(v.seen.as_deref(), Some(sni));
        }
    }

    #[test]
    fn other_sni_is_mismatch_named_as_sent() {
        for sni in [
            "Evil.Example",
            "api.example.com.evil",
            "xapi.example.com",
            "api-example.com",
            "api.example.com..",
            "a..b",
            "127.0.0.1",
        ] {
            let v = denial(guard(HOST).client(&hello(sni)));
            assert_eq!(v.kind, ViolationKind::SniMismatch, "{sni}");
            assert_eq!(v.seen.as_deref(), Some(sni));
        }
        // The parser already refuses names with bytes a host cannot have.
        assert_eq!(
            kind(&guard(HOST).client(&hello("api.example.com\0.evil"))),
            ViolationKind::Malformed
        );
    }

    #[test]
    fn sni_differing_in_case_or_trailing_dot_is_allowed() {
        for sni in ["API.Example.COM", "api.example.com.", "Api.Example.Com."] {
            let ch = hello(sni);
            let mut g = guard(HOST);
            assert_eq!(g.client(&ch), Step::Forward(ch.len()), "{sni}");
            // Evidence keeps the name as sent.
            assert_eq!(g.hello().unwrap().sni.as_deref(), Some(sni));
        }
        let ch = hello("API.EXAMPLE.COM");
        assert_eq!(
            guard("Api.Example.Com.").client(&ch),
            Step::Forward(ch.len())
        );
    }

    #[test]
    fn hello_retry_request_flow_then_opaque() {
        let mut g = after_hello(HOST);
        let mut up = server_hello_bytes(true);
        up.extend_from_slice(CCS);
        g.server(&up);
        assert_eq!(g.server.retries, 1);
        assert_eq!(g.client(&[]), Step::NeedMore);
        let mut held = CCS.to_vec();
        let ch2 = hello("API.example.com");
        held.extend(&ch2);
        assert_eq!(g.client(&held), Step::Forward(CCS.len()));
        assert_eq!(g.client(&ch2[..10]), Step::NeedMore);
        assert_eq!(g.client(&ch2), Step::Forward(ch2.len()));
        // The first hello stays the evidence.
        assert_eq!(g.hello().unwrap().sni.as_deref(), Some(HOST));
        g.server(&server_hello_bytes(false));
        assert_eq!(g.client(&[]), Step::Opaque);
        assert_eq!(g.client(b"anything at all"), Step::Opaque);
        assert_eq!(g.client(&hello("evil.example")), Step::Opaque);
    }

    #[test]
    fn pipelined_evil_second_hello_is_denied_unforwarded() {
        let ch1 = hello(HOST);
        let ch2 = hello("evil.example");
        let mut held = ch1.clone();
        held.extend(&ch2);
        let mut g = guard(HOST);
        assert_eq!(g.client(&held), Step::Forward(ch1.len()));
        // Nothing of the second hello goes before it is whole, then denied.
        for i in 0..ch2.len() {
            assert_eq!(g.client(&ch2[..i]), Step::NeedMore, "prefix {i}");
        }
        let v = denial(g.client(&ch2));
        assert_eq!(v.kind, ViolationKind::SniMismatch);
        assert_eq!(v.seen.as_deref(), Some("evil.example"));
        // Final, whatever comes next.
        assert_eq!(g.client(&[]), Step::Deny(v.clone()));
        g.server(&server_hello_bytes(false));
        assert_eq!(g.client(CCS), Step::Deny(v));
    }

    #[test]
    fn evil_second_hello_after_hrr_is_denied() {
        for (ch2, want) in [
            (hello("evil.example"), ViolationKind::SniMismatch),
            (
                client_hello_bytes(Some(HOST), true),
                ViolationKind::EchNotAllowed,
            ),
            (client_hello_bytes(None, false), ViolationKind::SniMissing),
        ] {
            let mut g = after_hello(HOST);
            g.server(&server_hello_bytes(true));
            assert_eq!(g.client(CCS), Step::Forward(CCS.len()));
            assert_eq!(kind(&g.client(&ch2)), want);
        }
    }

    #[test]
    fn second_hello_split_over_records() {
        let ch2 = hello(HOST);
        let msg = payload(&ch2);
        for cuts in [&[1][..], &[4, 5], &[100, msg.len() - 1]] {
            let recs = handshake_records(msg, cuts);
            let mut g = after_hello(HOST);
            for i in 0..recs.len() {
                assert_eq!(g.client(&recs[..i]), Step::NeedMore, "{cuts:?} {i}");
            }
            assert_eq!(g.client(&recs), Step::Forward(recs.len()), "{cuts:?}");
        }
        // Another record inside the hello's records (RFC 8446 §5.1).
        let mut recs = handshake_records(&msg[..50], &[]);
        recs.extend_from_slice(CCS);
        recs.extend(handshake_records(&msg[50..], &[]));
        assert_eq!(
            kind(&after_hello(HOST).client(&recs)),
            ViolationKind::Malformed
        );
    }

    #[test]
    fn early_data_is_streamed_record_by_record() {
        let mut g = after_hello(HOST);
        let rec = record(CONTENT_APPLICATION_DATA, &[9; 100]);
        assert_eq!(g.client(&rec[..3]), Step::NeedMore);
        assert_eq!(g.client(&rec[..15]), Step::Forward(15));
        assert_eq!(g.client(&[]), Step::NeedMore);
        assert_eq!(g.client(&rec[15..65]), Step::Forward(50));
        // The rest of this record and the next record in one read: never
        // past the end of the record.
        let mut held = rec[65..].to_vec();
        held.extend(record(CONTENT_APPLICATION_DATA, &[8; 10]));
        held.extend(record(CONTENT_ALERT, &[1, 0]));
        assert_eq!(g.client(&held), Step::Forward(40));
        assert_eq!(g.client(&held[40..]), Step::Forward(15));
        assert_eq!(g.client(&held[55..]), Step::Forward(7));
        // Zero-length application data (RFC 8446 §5.1 allows it).
        assert_eq!(g.client(&[23, 3, 3, 0, 0, 22]), Step::Forward(5));
        // A record type byte inside a record body is just data.
        let rec = record(CONTENT_APPLICATION_DATA, &[24; 3]);
        assert_eq!(g.client(&rec[..5]), Step::Forward(5));
        assert_eq!(g.client(&rec[5..]), Step::Forward(3));
    }

    #[test]
    fn non_hello_handshake_before_server_hello_is_denied() {
        // Finished(20), Certificate(11), ClientKeyExchange(16), KeyUpdate(24),
        // a ServerHello(2), as soon as the type byte arrives.
        for msg_type in [20u8, 11, 16, 24, 2, 0] {
            let rec = record(CONTENT_HANDSHAKE, &[msg_type, 0, 0, 1, 0]);
            let mut g = after_hello(HOST);
            for i in 0..6 {
                assert_eq!(g.client(&rec[..i]), Step::NeedMore, "{msg_type} {i}");
            }
            let v = denial(g.client(&rec));
            assert_eq!(v.kind, ViolationKind::ProtocolMismatch, "{msg_type}");
            assert_eq!(v.detail, NOT_A_HELLO_LATER);
        }
        // A good hello followed by another message in its record.
        let mut msg = payload(&hello(HOST)).to_vec();
        msg.extend_from_slice(&[20, 0, 0, 0]);
        assert_eq!(
            kind(&after_hello(HOST).client(&record(CONTENT_HANDSHAKE, &msg))),
            ViolationKind::Malformed
        );
    }

    #[test]
    fn other_records_after_hello_are_denied() {
        for (rec, want) in [
            (record(24, &[1, 0, 16]), ViolationKind::ProtocolMismatch),
            (vec![24], ViolationKind::ProtocolMismatch),
            (vec![0], ViolationKind::ProtocolMismatch),
            (
                b"GET / HTTP/1.1\r\n".to_vec(),
                ViolationKind::ProtocolMismatch,
            ),
            (vec![23, 2], ViolationKind::Malformed),
            (vec![20, 0x7f], ViolationKind::Malformed),
            (vec![23, 3, 3, 0x48, 0x01], ViolationKind::Malformed),
            (vec![22, 3, 3, 0x48, 0x01], ViolationKind::Malformed),
            (vec![22, 3, 3, 0, 0], ViolationKind::Malformed),
            (vec![22, 3, 0x10, 0, 1, 1], ViolationKind::Malformed),
        ] {
            assert_eq!(kind(&after_hello(HOST).client(&rec)), want, "{rec:?}");
        }
        // The largest allowed record is streamed.
        let mut g = after_hello(HOST);
        assert_eq!(g.client(&[23, 3, 3, 0x48, 0x00]), Step::Forward(5));
    }

    #[test]
    fn server_garbage_never_opens() {
        let alert = record(CONTENT_ALERT, &[2, 40]);
        let sh = server_hello_bytes(false);
        let sh_msg = payload(&sh);
        let mut bad_version = sh.clone();
        bad_version[5 + 4] = 2;
        let mut short_sh = record(CONTENT_HANDSHAKE, &[2, 0, 0, 33]);
        short_sh.extend(&sh_msg[4..37]);
        // ServerHello interrupted by another record (RFC 8446 §5.1).
        let mut interleaved = record(CONTENT_HANDSHAKE, &sh_msg[..20]);
        interleaved.extend_from_slice(CCS);
        interleaved.extend(record(CONTENT_HANDSHAKE, &sh_msg[20..]));
        let mut unknown = record(24, &[1, 0, 0]);
        unknown.extend(&sh);
        let mut oversize = vec![23, 3, 3, 0x48, 0x01];
        oversize.extend(&sh);
        for upstream in [
            HTTP_RESPONSE.to_vec(),
            b"SSH-2.0-x\r\n".to_vec(),
            bad_version,
            short_sh,
            interleaved,
            unknown,
            oversize,
            [HTTP_RESPONSE, &sh[..]].concat(),
        ] {
            let mut g = after_hello(HOST);
            g.server(&upstream);
            assert_eq!(g.client(&[]), Step::NeedMore, "{upstream:?}");
            g.server(&sh);
            assert_ne!(
                g.client(&[]),
                Step::Opaque,
                "{upstream:?} then a ServerHello"
            );
            assert_eq!(
                kind(&g.client(&hello("evil.example"))),
                ViolationKind::SniMismatch
            );
        }
        // An alert alone keeps checking; a (warning) alert then a
        // ServerHello: alerts are parseable, so the hello counts.
        let mut g = after_hello(HOST);
        g.server(&alert);
        assert_eq!(g.client(&[]), Step::NeedMore);
        g.server(&sh);
        assert_eq!(g.client(&[]), Step::Opaque);
    }

    #[test]
    fn server_bytes_before_the_first_hello_never_open() {
        let mut g = guard(HOST);
        g.server(&server_hello_bytes(false));
        let ch = hello(HOST);
        assert_eq!(g.client(&ch), Step::Forward(ch.len()));
        g.server(&server_hello_bytes(false));
        assert_eq!(g.client(&[]), Step::NeedMore);
        assert_eq!(
            kind(&g.client(&hello("evil.example"))),
            ViolationKind::SniMismatch
        );
    }

    /// Upstream flight: HRR + CCS, then ServerHello sharing its record with
    /// EncryptedExtensions-like bytes, then application data.
    fn upstream_flight() -> (Vec<u8>, usize) {
        let mut up = server_hello_bytes(true);
        up.extend_from_slice(CCS);
        let mut msgs = payload(&server_hello_bytes(false)).to_vec();
        // Where the ServerHello's random ends in the stream.
        let decided = up.len() + 5 + 4 + SERVER_HELLO_PREFIX_LEN;
        msgs.extend_from_slice(&[8, 0, 0, 2, 0, 0]);
        up.extend(record(CONTENT_HANDSHAKE, &msgs));
        up.extend(record(CONTENT_APPLICATION_DATA, &[0xaa; 30]));
        (up, decided)
    }

    #[test]
    fn server_hello_found_at_every_split() {
        let (up, decided) = upstream_flight();
        for cut in 0..=up.len() {
            let mut g = after_hello(HOST);
            g.server(&up[..cut]);
            let want = if cut >= decided {
                Step::Opaque
            } else {
                Step::NeedMore
            };
            assert_eq!(g.client(&[]), want, "cut {cut}");
            g.server(&up[cut..]);
            assert_eq!(g.client(&[]), Step::Opaque, "cut {cut}");
        }
        // Byte by byte.
        let mut g = after_hello(HOST);
        for (i, b) in up.iter().enumerate() {
            g.server(&[*b]);
            let want = if i + 1 >= decided {
                Step::Opaque
            } else {
                Step::NeedMore
            };
            assert_eq!(g.client(&[]), want, "byte {i}");
        }
        // Handshake messages cut across records anywhere, header included.
        let mut msgs = payload(&server_hello_bytes(true)).to_vec();
        msgs.extend(payload(&server_hello_bytes(false)));
        for cut in 1..msgs.len() {
            let mut g = after_hello(HOST);
            g.server(&handshake_records(&msgs, &[cut]));
            assert_eq!(g.client(&[]), Step::Opaque, "cut {cut}");
            assert_eq!(g.server.retries, 1, "cut {cut}");
        }
    }

    #[test]
    fn tls12_server_hello_opens() {
        // A TLS 1.2 ServerHello (no supported_versions) then Certificate.
        let mut body = vec![3, 3];
        body.extend([0x42; 32]);
        body.extend([0, 0xc0, 0x2f, 0]);
        let mut msg = vec![2, 0, 0, body.len() as u8];
        msg.extend(&body);
        msg.extend([11, 0, 0, 3, 0, 0, 0]);
        let mut g = after_hello(HOST);
        g.server(&record(CONTENT_HANDSHAKE, &msg));
        assert_eq!(g.client(&[]), Step::Opaque);
    }

    #[test]
    fn echoing_upstream_never_opens() {
        // An upstream that echoes what it gets (not TLS) sees only what the
        // client sent, and the client cannot send a ServerHello.
        let mut g = guard(HOST);
        let ch = hello(HOST);
        let mut held = ch.clone();
        held.extend_from_slice(CCS);
        held.extend(record(CONTENT_APPLICATION_DATA, &server_hello_bytes(false)));
        held.extend(record(CONTENT_ALERT, &server_hello_bytes(false)));
        held.extend(server_hello_bytes(false));
        let mut denied = false;
        while !held.is_empty() {
            match g.client(&held) {
                Step::Forward(n) => {
                    let sent: Vec<u8> = held.drain(..n).collect();
                    g.server(&sent);
                }
                Step::Deny(v) => {
                    assert_eq!(v.detail, NOT_A_HELLO_LATER);
                    denied = true;
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(denied);
    }

    /// Client streams and their outcome, under upstream scenarios, every
    /// way they can be cut: the same outcome and forwarded count as whole.
    #[test]
    fn every_split_same_outcome() {
        let host = normalize_host(HOST).unwrap();
        let ch1 = hello(HOST);
        let evil = hello("evil.example");
        let early = record(CONTENT_APPLICATION_DATA, &[5; 20]);
        let finished = record(CONTENT_HANDSHAKE, &[20, 0, 0, 32]);
        let hrr = server_hello_bytes(true);
        let sh = server_hello_bytes(false);
        let cat = |parts: &[&[u8]]| parts.concat();
        let n1 = ch1.len();
        let flows: Vec<(Vec<u8>, Vec<UpstreamAt<'_>>, Step, usize)> = vec![
            // (client bytes, upstream, outcome, forwarded)
            (OPENSSL.to_vec(), vec![], Step::NeedMore, OPENSSL.len()),
            (
                cat(&[&ch1, CCS, &early]),
                vec![],
                Step::NeedMore,
                n1 + 6 + 25,
            ),
            (
                cat(&[&ch1, CCS, &ch1, &early[..10]]),
                vec![(1, &hrr)],
                Step::NeedMore,
                2 * n1 + 6 + 10,
            ),
            (
                cat(&[&ch1, CCS, &ch1, &early, &evil]),
                vec![(1, &hrr), (n1 + 1, &sh)],
                Step::Opaque,
                2 * n1 + 6 + 25 + evil.len(),
            ),
            (
                cat(&[&ch1, &early, &evil]),
                vec![],
                denial_step(ViolationKind::SniMismatch),
                n1 + 25,
            ),
            (
                cat(&[&ch1, CCS, &evil]),
                vec![(1, &hrr)],
                denial_step(ViolationKind::SniMismatch),
                n1 + 6,
            ),
            (
                cat(&[&ch1, CCS, &finished]),
                vec![(1, HTTP_RESPONSE), (n1 + 1, &sh)],
                denial_step(ViolationKind::ProtocolMismatch),
                n1 + 6,
            ),
            (
                cat(&[&ch1, &finished]),
                vec![(1, &sh)],
                Step::Opaque,
                n1 + finished.len(),
            ),
            (
                cat(&[&evil, &ch1]),
                vec![],
                denial_step(ViolationKind::SniMismatch),
                0,
            ),
        ];
        for (i, (client, upstream, want, fwd)) in flows.iter().enumerate() {
            let whole = drive_tls(&host, &[client], upstream);
            assert_eq!(kindless(&whole.0), kindless(want), "flow {i}");
            assert_eq!(whole.1, *fwd, "flow {i}");
            for cut in 0..=client.len() {
                let (a, b) = client.split_at(cut);
                assert_eq!(
                    drive_tls(&host, &[a, b], upstream),
                    whole,
                    "flow {i} cut {cut}"
                );
            }
            let bytes: Vec<&[u8]> = client.chunks(1).collect();
            assert_eq!(
                drive_tls(&host, &bytes, upstream),
                whole,
                "flow {i} bytewise"
            );
            // The fuzz property over the same stream.
            crate::fuzzing::tls_stream(client);
        }
    }

    /// A Deny of `kind`, for comparison by kind only.
    fn denial_step(kind: ViolationKind) -> Step {
        Step::Deny(Violation::new(kind, None, ""))
    }

    fn kindless(step: &Step) -> Step {
        match step {
            Step::Deny(v) => denial_step(v.kind),
            other => other.clone(),
        }
    }

    #[test]
    fn same_question_same_answer() {
        let ch = hello(HOST);
        let mut g = guard(HOST);
        for held in [&ch[..0], &ch[..7], &ch[..ch.len() - 1]] {
            assert_eq!(g.client(held), Step::NeedMore);
            assert_eq!(g.client(held), Step::NeedMore);
        }
        assert_eq!(g.client(&ch), Step::Forward(ch.len()));
        let evil = hello("evil.example");
        let first = g.client(&evil);
        assert_eq!(kind(&first), ViolationKind::SniMismatch);
        assert_eq!(g.client(&evil), first);
        assert_eq!(g.client(&ch), first);
    }
}
