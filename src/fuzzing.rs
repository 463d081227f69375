//! The properties the fuzz targets check, as plain functions over bytes, so
//! `cargo fuzz` (nightly, coverage-guided, `fuzz/`) and the stable bounded
//! fuzz run in the test suite (the `smoke` tests below) check the same
//! thing. Each panics only when a property is broken. Compiled for tests
//! and with the `fuzzing` feature (which `fuzz/` enables), never into the
//! proxy itself.

use crate::proto::guard::{Limits, Step};
use crate::proto::http_stream::HttpGuard;
use crate::proto::target::{
    normalize_host, parse_authority, parse_explain_target, ExplainTarget, Host,
};
use crate::proto::tls_stream::{TlsGuard, HELLO_RETRY_REQUEST_RANDOM};
use crate::proto::{client_hello, http_head, Parse};

/// A ClientHello parse never claims more bytes than it was given.
pub fn client_hello(data: &[u8]) {
    if let Parse::Done { len, .. } = client_hello::parse(data) {
        assert!(len <= data.len(), "len {len} > input {}", data.len());
    }
}

/// A request-head parse never claims more bytes than it was given, and a
/// head it accepts is within the bound.
pub fn http_head(data: &[u8]) {
    if let Parse::Done { len, .. } = http_head::parse(data) {
        assert!(len <= data.len() && len <= http_head::MAX_HEAD_LEN);
    }
}

fn round_trip(host: &Host) {
    let shown = host.to_string();
    assert_eq!(
        normalize_host(&shown).as_ref(),
        Ok(host),
        "{host:?} displayed as {shown:?}"
    );
}

/// Every accepted host normalises to itself again from its Display form;
/// accepted ports are never 0.
pub fn target(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(host) = normalize_host(s) {
        round_trip(&host);
    }
    if let Ok((host, port)) = parse_authority(s, Some(443)) {
        assert_ne!(port, 0);
        round_trip(&host);
    }
    match parse_explain_target(s) {
        Ok(ExplainTarget::Tcp { host, port, .. }) => {
            assert_ne!(port, 0);
            round_trip(&host);
        }
        Ok(ExplainTarget::Dns { name, .. }) => round_trip(&name),
        Err(_) => {}
    }
}

/// Config text either loads or yields located errors; a loaded config
/// compiles into a policy.
pub fn config(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match crate::config::from_str(s, std::path::Path::new("fuzz.toml")) {
        Ok(c) => {
            let _ = crate::policy::Policy::new(&c);
        }
        Err(errors) => {
            assert!(!errors.0.is_empty());
            for e in &errors.0 {
                assert!(e.line >= 1 && e.col >= 1, "{e}");
            }
        }
    }
}

/// An NFLOG datagram (netlink messages from the kernel) is read without
/// panicking into at most one message per 16 bytes; every packet read
/// names an IPv4 or IPv6 source and destination of one family, ports
/// only for TCP and UDP; and the IP packet parser agrees on `data` read
/// as a payload.
pub fn nflog(data: &[u8]) {
    use crate::bypass::packet::{ip_packet, messages, Message, Proto};
    let check = |p: &crate::bypass::packet::Attempt| {
        assert_eq!(p.src.is_ipv4(), p.dst.is_ipv4(), "{p:?}");
        if !matches!(p.proto, Proto::Tcp | Proto::Udp) {
            assert!(p.src_port.is_none() && p.dst_port.is_none(), "{p:?}");
        }
        assert_eq!(p.src_port.is_some(), p.dst_port.is_some(), "{p:?}");
        assert!(p.prefix.as_ref().is_none_or(|x| x.len() <= 64), "{p:?}");
    };
    let all = messages(data);
    assert!(all.len() <= data.len() / 16, "{} messages", all.len());
    for m in &all {
        if let Message::Packet(p) = m {
            check(p);
        }
    }
    if let Ok(p) = ip_packet(data) {
        check(&p);
    }
}

/// The host the [`tls_stream`] property's tunnel is for (the SNI of the
/// captured hellos in `tests/data`).
const TLS_STREAM_HOST: &str = "api.example.com";

/// TLS tunnel verification of `data` as the client's byte stream, under
/// several upstream behaviours (none, HelloRetryRequest, ServerHello, both,
/// garbage, `data` itself before and after the first hello): fed whole, in
/// pseudo-random chunks and (when short) byte by byte, the outcome and the
/// number of bytes forwarded are the same; never more than given is
/// forwarded; the same question gets the same answer; and the verifier never
/// turns opaque without a ServerHello after the first ClientHello.
pub fn tls_stream(data: &[u8]) {
    let host = Host::Name(TLS_STREAM_HOST.to_owned());
    let first_len = match client_hello::parse(data) {
        Parse::Done { len, .. } => len,
        _ => 0,
    };
    let hrr = server_hello_bytes(true);
    let sh = server_hello_bytes(false);
    let garbage: &[u8] = b"HTTP/1.1 400 Bad Request\r\n\r\n";
    // (upstream bytes; whether the verifier may end up opaque)
    let scenarios: [(&[UpstreamAt<'_>], bool); 7] = [
        (&[], false),
        (&[(1, &hrr)], false),
        (&[(1, &sh)], true),
        (&[(1, &hrr), (first_len + 1, &sh)], true),
        (&[(1, garbage), (first_len + 1, &sh)], false),
        (&[(0, data), (first_len + 1, &sh)], false),
        (&[(1, data)], true),
    ];
    let mut chunkings: Vec<Vec<&[u8]>> = vec![random_chunks(data)];
    if data.len() <= 512 {
        chunkings.push(data.chunks(1).collect());
    }
    for (upstream, may_open) in scenarios {
        let whole = drive_tls(&host, &[data], upstream);
        assert!(
            whole.1 <= data.len(),
            "forwarded {} of {}",
            whole.1,
            data.len()
        );
        if !may_open {
            assert_ne!(whole.0, Step::Opaque, "opaque without a ServerHello");
        }
        for chunks in &chunkings {
            assert_eq!(
                drive_tls(&host, chunks, upstream),
                whole,
                "split into {} chunks",
                chunks.len()
            );
        }
    }
}

/// Upstream bytes a [`drive_tls`] run observes once at least this many
/// client bytes have been forwarded.
pub(crate) type UpstreamAt<'a> = (usize, &'a [u8]);

/// Feed `chunks` of client bytes to a [`TlsGuard`] as a tunnel pump would,
/// observing each `upstream` entry's bytes once at least that many client
/// bytes have been forwarded (entries in order). Returns the final step
/// (`NeedMore`, `Opaque` or `Deny`) and the number of client bytes forwarded.
pub(crate) fn drive_tls(
    host: &Host,
    chunks: &[&[u8]],
    upstream: &[UpstreamAt<'_>],
) -> (Step, usize) {
    let mut guard = TlsGuard::new(host.clone());
    let mut upstream = upstream.iter().peekable();
    let mut held: Vec<u8> = Vec::new();
    let mut forwarded = 0;
    let mut opaque = false;
    for chunk in chunks {
        if opaque {
            forwarded += chunk.len();
            continue;
        }
        held.extend_from_slice(chunk);
        loop {
            while let Some((_, bytes)) = upstream.next_if(|(at, _)| *at <= forwarded) {
                guard.server(bytes);
            }
            let step = guard.client(&held);
            if !matches!(step, Step::Forward(_)) {
                assert_eq!(guard.client(&held), step, "asked twice");
            }
            match step {
                Step::Forward(n) => {
                    assert!(n > 0 && n <= held.len(), "Forward({n}) of {}", held.len());
                    held.drain(..n);
                    forwarded += n;
                }
                Step::NeedMore => break,
                Step::Opaque => {
                    forwarded += held.len();
                    held.clear();
                    opaque = true;
                    break;
                }
                Step::Wait => panic!("TlsGuard never waits for the upstream"),
                Step::Deny(_) => return (step, forwarded),
            }
        }
    }
    let end = if opaque { Step::Opaque } else { Step::NeedMore };
    (end, forwarded)
}

/// `data` cut into chunks of 1..=64 bytes, the cuts derived from `data`.
fn random_chunks(data: &[u8]) -> Vec<&[u8]> {
    // FNV-1a of the data seeds a xorshift64.
    let mut x = data.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1;
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = usize::try_from(x % 64).unwrap_or(0) + 1;
        let (chunk, tail) = rest.split_at_checked(n).unwrap_or((rest, &[]));
        out.push(chunk);
        rest = tail;
    }
    out
}

/// legacy_session_id of the built hellos (TLS 1.3 middlebox compatibility
/// mode, RFC 8446 §D.4), echoed by the built ServerHello.
const BUILT_SESSION_ID: [u8; 32] = [0x5a; 32];
/// An X25519 public key (RFC 7748 §6.1, Alice's).
const BUILT_X25519_SHARE: [u8; 32] = [
    0x85, 0x20, 0xf0, 0x09, 0x89, 0x30, 0xa7, 0x54, 0x74, 0x8b, 0x7d, 0xdc, 0xb4, 0x3e, 0xf7, 0x5a,
    0x0d, 0xbf, 0x3a, 0x0d, 0x26, 0x38, 0x1a, 0xf4, 0xeb, 0xa4, 0xa9, 0x8e, 0xaa, 0x9b, 0x4e, 0x6a,
];

/// A TLS 1.3 ClientHello in one handshake record (RFC 8446 §4.1.2), as a
/// client would send it first: `sni` as the server_name host_name, written
/// as given (None: no server_name extension); `ech`: with an outer
/// encrypted_client_hello extension (draft-ietf-tls-esni §5), as sent when
/// the real name is hidden. For tests, integration tests and probes that
/// must send raw hellos; names over 16 KiB give a malformed hello.
#[cfg(test)]
pub(crate) fn client_hello_bytes(sni: Option<&str>, ech: bool) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(name) = sni {
        // server_name (RFC 6066 §3): one host_name(0) entry.
        let mut entry = vec![0];
        entry.extend(vec16(name.as_bytes()));
        push_ext(&mut exts, 0x0000, &vec16(&entry));
    }
    // supported_versions (RFC 8446 §4.2.1): TLS 1.3, TLS 1.2.
    push_ext(&mut exts, 0x002b, &[4, 0x03, 0x04, 0x03, 0x03]);
    // supported_groups (RFC 8446 §4.2.7): x25519, secp256r1.
    push_ext(&mut exts, 0x000a, &vec16(&[0x00, 0x1d, 0x00, 0x17]));
    // signature_algorithms (RFC 8446 §4.2.3): ecdsa_secp256r1_sha256,
    // rsa_pss_rsae_sha256, rsa_pkcs1_sha256, ed25519.
    push_ext(
        &mut exts,
        0x000d,
        &vec16(&[0x04, 0x03, 0x08, 0x04, 0x04, 0x01, 0x08, 0x07]),
    );
    // key_share (RFC 8446 §4.2.8): one x25519 share.
    let mut share = vec![0x00, 0x1d];
    share.extend(vec16(&BUILT_X25519_SHARE));
    push_ext(&mut exts, 0x0033, &vec16(&share));
    // psk_key_exchange_modes (RFC 8446 §4.2.9): psk_dhe_ke.
    push_ext(&mut exts, 0x002d, &[1, 1]);
    // application_layer_protocol_negotiation (RFC 7301 §3.1): h2, http/1.1.
    push_ext(&mut exts, 0x0010, &vec16(b"\x02h2\x08http/1.1"));
    if ech {
        // ECHClientHello outer(0): HPKE HKDF-SHA256(1)/AES-128-GCM(1),
        // config_id, enc, payload (draft-ietf-tls-esni §5).
        let mut e = vec![0, 0x00, 0x01, 0x00, 0x01, 0x2a];
        e.extend(vec16(&[0x11; 32]));
        e.extend(vec16(&[0x22; 144]));
        push_ext(&mut exts, 0xfe0d, &e);
    }
    let mut body = vec![0x03, 0x03]; // legacy_version
    body.extend([0x3c; 32]); // random
    body.push(32);
    body.extend(BUILT_SESSION_ID);
    // cipher_suites: TLS_AES_128_GCM_SHA256, TLS_AES_256_GCM_SHA384,
    // TLS_CHACHA20_POLY1305_SHA256, two TLS 1.2 ECDHE-GCM suites.
    body.extend(vec16(&[
        0x13, 0x01, 0x13, 0x02, 0x13, 0x03, 0xc0, 0x2b, 0xc0, 0x2f,
    ]));
    body.extend([1, 0]); // legacy_compression_methods: null
    body.extend(vec16(&exts));
    // legacy_record_version 0x0301 for the first hello (RFC 8446 §5.1).
    record([0x03, 0x01], &handshake(1, &body))
}

/// A TLS 1.3 ServerHello in one handshake record (RFC 8446 §4.1.3); `hrr`:
/// a HelloRetryRequest (its random is the SHA-256 of "HelloRetryRequest")
/// asking for a secp256r1 share.
pub(crate) fn server_hello_bytes(hrr: bool) -> Vec<u8> {
    let mut body = vec![0x03, 0x03]; // legacy_version
    body.extend(if hrr {
        HELLO_RETRY_REQUEST_RANDOM
    } else {
        [0x6b; 32]
    });
    body.push(32);
    body.extend(BUILT_SESSION_ID);
    body.extend([0x13, 0x01, 0]); // cipher_suite, legacy_compression_method
    let mut exts = Vec::new();
    push_ext(&mut exts, 0x002b, &[0x03, 0x04]); // supported_versions: TLS 1.3
    if hrr {
        // key_share in a HelloRetryRequest: selected_group (RFC 8446 §4.2.8).
        push_ext(&mut exts, 0x0033, &[0x00, 0x17]);
    } else {
        let mut share = vec![0x00, 0x1d];
        share.extend(vec16(&BUILT_X25519_SHARE));
        push_ext(&mut exts, 0x0033, &share);
    }
    body.extend(vec16(&exts));
    record([0x03, 0x03], &handshake(2, &body))
}

/// `opaque x<0..2^16-1>`: u16 length, then the bytes.
fn vec16(data: &[u8]) -> Vec<u8> {
    let len = u16::try_from(data.len()).unwrap_or(u16::MAX);
    let mut v = len.to_be_bytes().to_vec();
    v.extend_from_slice(data);
    v
}

/// Extension: type(2), then its data as `opaque<0..2^16-1>` (RFC 8446 §4.2).
fn push_ext(exts: &mut Vec<u8>, ext_type: u16, data: &[u8]) {
    exts.extend(ext_type.to_be_bytes());
    exts.extend(vec16(data));
}

/// Handshake message: msg_type(1) length(3) body (RFC 8446 §4).
fn handshake(msg_type: u8, body: &[u8]) -> Vec<u8> {
    let [_, a, b, c] = u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes();
    let mut m = vec![msg_type, a, b, c];
    m.extend_from_slice(body);
    m
}

/// One handshake record (RFC 8446 §5.1).
fn record(version: [u8; 2], fragment: &[u8]) -> Vec<u8> {
    let [major, minor] = version;
    let mut r = vec![22, major, minor];
    r.extend(vec16(fragment));
    r
}

/// What a scripted tunnel pump over an [`HttpGuard`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pumped {
    /// Client bytes forwarded upstream (all of them once `Opaque`).
    pub forwarded: usize,
    /// The last answer that was not `Forward`.
    pub end: Step,
    pub requests: u64,
    pub first_host: Option<String>,
}

/// A sans-IO tunnel pump, as the proxy's runs it: the client's bytes arrive
/// in `client` pieces and the guard is asked about the held bytes until it
/// stops forwarding; the upstream's bytes (in `server` pieces) pass the
/// first time it answers `Wait`, or once the client's bytes are all in.
/// Panics if the guard breaks the [`crate::proto::guard`] protocol: a
/// `Forward` of nothing or of more than is held, or another answer when
/// asked again about the same bytes.
pub(crate) fn pump_http(guard: &mut HttpGuard, client: &[&[u8]], server: &[&[u8]]) -> Pumped {
    let total = client.iter().map(|c| c.len()).sum();
    let mut pieces = client.iter();
    let mut held = Vec::new();
    let mut forwarded = 0;
    let mut served = false;
    let end = loop {
        let step = guard.client(&held);
        if let Step::Forward(n) = step {
            assert!(n > 0 && n <= held.len(), "Forward({n}) of {}", held.len());
            forwarded += n;
            held.drain(..n);
            continue;
        }
        assert_eq!(guard.client(&held), step, "asked again");
        match step {
            Step::Opaque => {
                forwarded = total;
                break step;
            }
            Step::Deny(_) => break step,
            Step::Wait if !served => {}
            _ => match pieces.next() {
                Some(piece) => {
                    held.extend_from_slice(piece);
                    continue;
                }
                None if served => break step,
                None => {}
            },
        }
        for s in server {
            guard.server(s);
        }
        served = true;
    };
    Pumped {
        forwarded,
        end,
        requests: guard.requests(),
        first_host: guard.first_host().map(str::to_owned),
    }
}

/// The HTTP tunnel verifier: the client's bytes (before the first `00 00`;
/// the upstream's after it) fed whole, byte by byte or in pieces of a few
/// sizes, give the same forwarded length, final answer and requests; it
/// never forwards more than it was given and never panics.
pub fn http_stream(data: &[u8]) {
    let (client, server) = match data.windows(2).position(|w| w == [0, 0]) {
        Some(i) => (
            data.get(..i).unwrap_or_default(),
            data.get(i + 2..).unwrap_or_default(),
        ),
        None => (data, &[][..]),
    };
    let run = |client: Vec<&[u8]>, server: Vec<&[u8]>| {
        let limits = Limits {
            max_head_bytes: 1024,
            max_headers: 16,
        };
        let mut guard = HttpGuard::new(Host::Name("a.test".into()), 80, limits);
        pump_http(&mut guard, &client, &server)
    };
    let whole = run(vec![client], vec![server]);
    assert!(whole.forwarded <= client.len());
    for size in [1, 2, 3, 7, 64] {
        let pieces = run(
            client.chunks(size).collect(),
            server.chunks(size + 1).collect(),
        );
        assert_eq!(pieces, whole, "pieces of {size}");
    }
}

/// An upstream's response as the forwarding relay reads it: the head
/// parse never claims more bytes than it was given or than its bound, and
/// the body after it decodes to the same content, ending at the same byte
/// (or failing alike), however the bytes are split into reads. The first
/// byte's low bit says whether the request was a HEAD.
pub fn http_upstream(data: &[u8]) {
    use crate::proto::http_stream::MAX_RESPONSE_HEAD;
    use crate::proto::http_upstream::{decode_all, response_head};
    let Some((&flag, rest)) = data.split_first() else {
        return;
    };
    let Parse::Done { value, len } = response_head(rest, flag & 1 == 1) else {
        return;
    };
    assert!(len <= rest.len() && len <= MAX_RESPONSE_HEAD, "len {len}");
    let body = rest.get(len..).unwrap_or_default();
    let whole = decode_all(value.body, body, body.len().max(1));
    for size in [1, 2, 3, 7, 64] {
        let pieces = decode_all(value.body, body, size);
        assert_eq!(pieces, whole, "pieces of {size}");
    }
}

/// A bounded, stable-Rust fuzz run of every fuzz target's property: the seed
/// corpus, then deterministic random mutations of it, within a fixed count
/// and time per target. Coverage-guided runs are `cargo +nightly fuzz run
/// TARGET` in `fuzz/` (see "Fuzzing" in `docs/architecture.md`).
/// The pkt-line command reader of a push: never claims more bytes than it
/// was given or than its bound, accepts only ref names git accepts, and
/// answers "need more" for every strict prefix of a section it accepts
/// (so it never decides on a part of the commands).
pub fn pktline(data: &[u8]) {
    use crate::proto::pktline::{
        read_commands, valid_ref_name, Commands, MAX_COMMANDS, MAX_COMMAND_BYTES,
    };
    if let Commands::Done { updates, len } = read_commands(data) {
        assert!(
            len <= data.len() && len <= MAX_COMMAND_BYTES + 4,
            "len {len}"
        );
        assert!(!updates.is_empty() && updates.len() <= MAX_COMMANDS);
        for u in &updates {
            assert!(valid_ref_name(&u.name), "{:?}", u.name);
        }
        assert_eq!(
            read_commands(&data[..len]),
            Commands::Done {
                updates: updates.clone(),
                len
            }
        );
        assert_eq!(read_commands(&data[..len - 1]), Commands::NeedMore);
    }
}

/// The GraphQL operation check: never panics on a body, a document or a
/// URL query, and the operation it picks without a name is the one it
/// picks by that operation's own name (one operation, unambiguous).
pub fn graphql(data: &[u8]) {
    use crate::proto::graphql::{operation, operation_of_url_query, operations_of_body};
    let _ = operations_of_body(data);
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = operation_of_url_query(text);
    if let Ok(op) = operation(text, None) {
        if let Some(name) = op.name.clone() {
            assert_eq!(operation(text, Some(&name)), Ok(op));
        }
    }
}

/// A DNS query the shim reads from the wire itself is one hickory reads
/// the same way (so the wire path never answers another question than
/// hickory's would), a response built from it keeps its length, and
/// finding the TTLs of any message ends within it.
pub fn dns_question(data: &[u8]) {
    use crate::dns::wire::{as_hickory_reads, question, ttl_offsets, Wire};
    if let Some(q) = question(data) {
        assert_eq!(Some(q.as_read()), as_hickory_reads(data), "{data:02x?}");
        let wire = Wire::new(q.shape, false, data.to_vec(), q.section.len());
        let answer = wire.and_then(|w| w.answer(&q, 7)).expect("its own wire");
        assert_eq!(answer.len(), data.len());
    }
    if let Some(ttls) = ttl_offsets(data) {
        assert!(ttls.iter().all(|&at| at + 4 <= data.len()), "{ttls:?}");
    }
}

#[cfg(test)]
mod smoke {
    use std::time::{Duration, Instant};

    /// Mutations per target, and the time cap per target.
    const RUNS: u64 = 200_000;
    const TIME_CAP: Duration = Duration::from_secs(15);

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    fn seeds() -> Vec<Vec<u8>> {
        let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
        let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(data)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "bin"))
            .map(|p| std::fs::read(p).unwrap())
            .collect();
        let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/palisade.toml");
        seeds.push(std::fs::read(config).unwrap());
        for text in [
            "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
            "CONNECT [::1]:443 HTTP/1.1\r\n\r\n",
            "0x7f.1",
            "https://u@Bücher.example:8443/x",
            "dns:a.example/TXT",
            "[::ffff:127.0.0.1]:80",
            "SSH-2.0-x\r\n",
            // Pipelined requests through an HTTP tunnel to a.test:80; after a
            // `00 00`, the upstream's responses.
            "GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n\
             3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\nHEAD /h HTTP/1.1\r\nHost: a.test:80\r\n\r\n\
             GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\n\r\nhi\
             GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\
             GET / HTTP/1.1\r\nHost: b.test\r\n\r\n\0\0\
             HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n\
             HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n\
             HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n\
             HTTP/1.1 101 Switching Protocols\r\n\r\nframes",
        ] {
            seeds.push(text.as_bytes().to_vec());
        }
        seeds
    }

    fn mutate(rng: &mut XorShift, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..=rng.below(4) {
            match rng.below(5) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] = rng.next() as u8;
                }
                1 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v.truncate(i);
                }
                2 => {
                    let i = rng.below(v.len() + 1);
                    v.insert(i, rng.next() as u8);
                }
                3 if v.len() > 2 => {
                    let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                    v.swap(a, b);
                }
                _ => {
                    let i = rng.below(v.len() + 1);
                    let byte =
                        [0u8, 0xff, b'.', b':', b'[', b']', b'%', b'*', 0x16, b'\n'][rng.below(10)];
                    v.insert(i, byte);
                }
            }
        }
        v
    }

    fn run(name: &str, check: fn(&[u8])) {
        run_seeds(name, check, seeds());
    }

    fn run_seeds(name: &str, check: fn(&[u8]), seeds: Vec<Vec<u8>>) {
        for s in &seeds {
            check(s);
        }
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
        let started = Instant::now();
        let mut runs = 0;
        while runs < RUNS && started.elapsed() < TIME_CAP {
            let seed = &seeds[rng.below(seeds.len())];
            check(&mutate(&mut rng, seed));
            runs += 1;
        }
        eprintln!("{name}: {runs} mutated inputs in {:?}", started.elapsed());
        assert!(runs >= 1000, "{name}: only {runs} runs");
    }

    #[test]
    fn client_hello() {
        run("client_hello", super::client_hello);
    }

    #[test]
    fn http_head() {
        run("http_head", super::http_head);
    }

    #[test]
    fn http_upstream() {
        let mut seeds = seeds();
        for text in [
            "\0HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x\r\nhello\r\n0\r\nT: 1\r\n\r\nmore",
            "\0HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello world",
            "\x01HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
            "\0HTTP/1.0 200 OK\r\n\r\nuntil close",
        ] {
            seeds.push(text.as_bytes().to_vec());
        }
        run_seeds("http_upstream", super::http_upstream, seeds);
    }

    #[test]
    fn target() {
        run("target", super::target);
    }

    #[test]
    fn config() {
        run("config", super::config);
    }

    /// TLS tunnel streams: the captures, plus built flows (hello, then
    /// change_cipher_spec, early data, a second hello, other handshake
    /// messages) so mutations reach the checks after the first hello.
    #[test]
    fn tls_stream() {
        use super::client_hello_bytes;
        let good = client_hello_bytes(Some("api.example.com"), false);
        let evil = client_hello_bytes(Some("evil.example"), false);
        let ccs: &[u8] = &[20, 3, 3, 0, 1, 1];
        let early: &[u8] = &[23, 3, 3, 0, 4, 1, 2, 3, 4];
        let finished: &[u8] = &[22, 3, 3, 0, 8, 20, 0, 0, 4, 1, 2, 3, 4];
        let mut seeds = seeds();
        for flow in [
            [&good[..], ccs, &good, early].concat(),
            [&good[..], early, early, &evil].concat(),
            [&good[..], ccs, finished].concat(),
            client_hello_bytes(Some("api.example.com"), true),
            client_hello_bytes(None, false),
        ] {
            seeds.push(flow);
        }
        run_seeds("tls_stream", super::tls_stream, seeds);
    }

    /// DNS queries of every shape the wire path reads, and some it does not.
    #[test]
    fn dns_question() {
        use hickory_server::proto::op::{Edns, Message, Query};
        use hickory_server::proto::rr::rdata::opt::EdnsOption;
        use hickory_server::proto::rr::{Name, RecordType};
        let mut seeds = seeds();
        for (name, qtype, edns) in [
            ("allowed.test.", RecordType::A, None),
            ("AlLoWeD.tEsT.", RecordType::AAAA, Some(1232)),
            ("_x._tcp.a-1.test.", RecordType::SRV, Some(4096)),
            ("xn--bcher-kva.test.", RecordType::HTTPS, Some(512)),
            ("a.test.", RecordType::ANY, Some(1232)),
        ] {
            let mut m = Message::query();
            m.metadata.recursion_desired = true;
            m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
            m.edns = edns.map(|p| {
                let mut e = Edns::new();
                e.set_max_payload(p);
                e.options_mut().insert(EdnsOption::Unknown(10, vec![7; 8]));
                e
            });
            seeds.push(m.to_vec().unwrap());
        }
        // A response with a pointer loop in its answer.
        seeds.push(vec![
            0, 1, 0x81, 0x80, 0, 0, 0, 1, 0, 0, 0, 0, 0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 198,
            18, 2, 10,
        ]);
        run_seeds("dns_question", super::dns_question, seeds);
    }

    #[test]
    fn http_stream() {
        run("http_stream", super::http_stream);
    }

    /// Push command sections: commands with capabilities, shallow lines,
    /// SHA-256 ids, deletes, then a pack.
    #[test]
    fn pktline() {
        let pkt = |p: &str| format!("{:04x}{p}", p.len() + 4);
        let (a, b, z) = ("1".repeat(40), "2".repeat(40), "0".repeat(40));
        let seeds = vec![
            format!(
                "{}{}0000PACK",
                pkt(&format!(
                    "{a} {b} refs/heads/agent/x\0report-status side-band-64k\n"
                )),
                pkt(&format!("{a} {z} refs/heads/main\n"))
            ),
            format!(
                "{}{}0000",
                pkt(&format!("shallow {a}")),
                pkt(&format!(
                    "{} {} refs/tags/v1\0 push-options\n",
                    "a".repeat(64),
                    "b".repeat(64)
                ))
            ),
            format!("{}0000", pkt("push-cert\0report-status\n")),
        ]
        .into_iter()
        .map(String::into_bytes)
        .collect();
        run_seeds("pktline", super::pktline, seeds);
    }

    /// GraphQL bodies, batches, documents and URL queries: aliases,
    /// fragments, comments, several operations.
    #[test]
    fn graphql() {
        let seeds = [
            r#"{"query":"query Q { a } mutation M { x: deleteRepository(input: {id: \"1\"}) { id } }","operationName":"M","variables":{}}"#,
            r#"[{"query":"{ viewer { login } }"},{"query":"mutation { ...F } fragment F on Mutation { createPullRequest { id } ... on Mutation { b } }"}]"#,
            "# comment\nsubscription S($v: Int = 1) @d { s(a: [1, 2.5, \"x\", \"\"\"block\"\"\", true, null, ENUM, {k: $v}]) }",
            "query=mutation%7Ba%7D&operationName=&variables=%7B%7D",
            r#"{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"ab"}}}"#,
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        run_seeds("graphql", super::graphql, seeds);
    }

    /// NFLOG datagrams: logged IPv4 and IPv6 packets (TCP, UDP, ICMP, a
    /// fragment), two in one datagram, an acknowledgement.
    #[test]
    fn nflog() {
        use crate::bypass::packet::{ipv4_header, ipv6_header, packet_message};
        let v4 = ipv4_header(17, [198, 18, 1, 2], [198, 18, 2, 10], 40000, 443);
        let tcp = ipv4_header(6, [198, 18, 1, 2], [198, 18, 1, 1], 40000, 15001);
        let icmp = ipv4_header(1, [198, 18, 1, 2], [198, 18, 2, 10], 0x0800, 0);
        let v6 = ipv6_header(
            "2001:2::2".parse().unwrap(),
            "2001:2:0:2::10".parse().unwrap(),
            443,
        );
        let one = packet_message(100, "palisade-bypass ", &v4);
        let seeds = vec![
            one.clone(),
            packet_message(100, "", &tcp),
            packet_message(7, "x", &icmp),
            packet_message(100, "palisade-bypass ", &v6),
            [one.clone(), packet_message(100, "", &v6)].concat(),
            v4,
            v6,
        ];
        run_seeds("nflog", super::nflog, seeds);
    }
}
