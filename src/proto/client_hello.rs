//! TLS ClientHello parser: SNI, ALPN and ECH presence from the first bytes a
//! client sends, reassembled across TLS records. Pure and bounds-checked.

use super::Parse;

/// Handshake message cap: a ClientHello body longer than this is `Malformed`.
pub(crate) const MAX_HELLO_LEN: usize = 16 * 1024;

/// TLSCiphertext fragment limit, 2^14 + 2048 (RFC 5246 §6.2.3); plaintext is
/// 2^14 (RFC 8446 §5.1), the slack tolerates lax senders.
pub(crate) const MAX_RECORD_LEN: usize = 16384 + 2048;
/// ContentType handshake (RFC 8446 §5.1).
const CONTENT_HANDSHAKE: u8 = 0x16;
/// HandshakeType client_hello (RFC 8446 §4).
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
/// Record header: type(1) version(2) length(2) (RFC 8446 §5.1).
const RECORD_HEADER_LEN: usize = 5;
/// Handshake header: msg_type(1) length(3) (RFC 8446 §4).
const HANDSHAKE_HEADER_LEN: usize = 4;

const EXT_SERVER_NAME: u16 = 0; // RFC 6066 §3
const EXT_ALPN: u16 = 16; // RFC 7301 §3.1
const EXT_PRE_SHARED_KEY: u16 = 41; // RFC 8446 §4.2.11
const EXT_ECH: u16 = 0xfe0d; // draft-ietf-tls-esni (encrypted_client_hello)

/// What the proxy needs from a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientHello {
    /// server_name (RFC 6066 §3) host_name entry, as sent (ASCII; not normalised). None if the extension is absent.
    pub sni: Option<String>,
    /// ALPN protocol names (RFC 7301), lossy UTF-8.
    pub alpn: Vec<String>,
    /// true if an encrypted_client_hello extension (0xfe0d) is present.
    pub ech: bool,
}

/// Parse the ClientHello at the start of `buf`, reassembling it from as many
/// handshake records as it spans. The hello's last record must end with the
/// hello: no ClientHello is followed by another handshake message in its flight.
/// `Done`'s `len` is the number of bytes of TLS records consumed up to the end
/// of the record carrying the hello's last byte. `NotThis`: not a TLS
/// handshake at all (first byte not 0x16, or record version major != 3, or
/// first handshake type != client_hello). `Malformed`: looks like TLS but is
/// malformed (bad lengths, duplicate/garbled SNI, SNI not a valid hostname
/// byte string, hello larger than MAX_HELLO_LEN, etc.).
pub(crate) fn parse(buf: &[u8]) -> Parse<ClientHello> {
    let mut msg: Vec<u8> = Vec::new();
    let mut pos = 0usize;
    loop {
        let first = pos == 0;
        let rest = buf.get(pos..).unwrap_or_default();
        // Record header (RFC 8446 §5.1), checked byte by byte so a short
        // prefix is rejected as soon as it cannot be TLS.
        let Some(&content_type) = rest.first() else {
            return Parse::NeedMore;
        };
        if content_type != CONTENT_HANDSHAKE {
            return if first {
                Parse::NotThis
            } else {
                Parse::Malformed("non-handshake record inside ClientHello")
            };
        }
        let Some(&major) = rest.get(1) else {
            return Parse::NeedMore;
        };
        if major != 3 {
            return if first {
                Parse::NotThis
            } else {
                Parse::Malformed("bad record version")
            };
        }
        let Some(&minor) = rest.get(2) else {
            return Parse::NeedMore;
        };
        if minor > 0x0f {
            return Parse::Malformed("bad record version");
        }
        let (Some(&hi), Some(&lo)) = (rest.get(3), rest.get(4)) else {
            return Parse::NeedMore;
        };
        let rec_len = usize::from(u16::from_be_bytes([hi, lo]));
        // Zero-length handshake fragments MUST NOT be sent (RFC 8446 §5.1).
        if rec_len == 0 {
            return Parse::Malformed("empty handshake record");
        }
        if rec_len > MAX_RECORD_LEN {
            return Parse::Malformed("record too long");
        }
        let body = rest.get(RECORD_HEADER_LEN..).unwrap_or_default();
        let frag = body.get(..rec_len).unwrap_or(body);
        let rec_start = msg.len();
        msg.extend_from_slice(frag);

        if let Some(&msg_type) = msg.first() {
            if msg_type != HANDSHAKE_CLIENT_HELLO {
                return Parse::NotThis;
            }
        }
        if let Some(&[_, a, b, c]) = msg.get(..HANDSHAKE_HEADER_LEN) {
            let hello_len = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
            if hello_len > MAX_HELLO_LEN {
                return Parse::Malformed("ClientHello longer than MAX_HELLO_LEN");
            }
            let total = HANDSHAKE_HEADER_LEN + hello_len;
            if let Some(hello) = msg.get(HANDSHAKE_HEADER_LEN..total) {
                // This record carries the hello's last byte; it must end there.
                if rec_start + rec_len != total {
                    return Parse::Malformed("data after ClientHello in its record");
                }
                return match parse_hello(hello) {
                    Err(e) => Parse::Malformed(e),
                    Ok(_) if frag.len() < rec_len => Parse::NeedMore,
                    Ok(hello) => Parse::Done {
                        value: hello,
                        len: pos + RECORD_HEADER_LEN + rec_len,
                    },
                };
            }
        }
        if frag.len() < rec_len {
            return Parse::NeedMore;
        }
        pos += RECORD_HEADER_LEN + rec_len;
    }
}

/// ClientHello body (RFC 8446 §4.1.2; RFC 5246 §7.4.1.2 for absent extensions).
fn parse_hello(body: &[u8]) -> Result<ClientHello, &'static str> {
    let mut r = Reader(body);
    r.take(2).ok_or("truncated legacy_version")?;
    r.take(32).ok_or("truncated random")?;
    let session_id = r.vec8().ok_or("truncated legacy_session_id")?;
    if session_id.len() > 32 {
        return Err("legacy_session_id longer than 32 bytes");
    }
    let suites = r.vec16().ok_or("truncated cipher_suites")?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err("bad cipher_suites length");
    }
    let compression = r.vec8().ok_or("truncated legacy_compression_methods")?;
    if compression.is_empty() {
        return Err("empty legacy_compression_methods");
    }
    let mut hello = ClientHello::default();
    if r.is_empty() {
        return Ok(hello);
    }
    let mut exts = r.vec16().ok_or("truncated extensions")?;
    if !r.is_empty() {
        return Err("trailing bytes after extensions");
    }
    let mut seen: Vec<u16> = Vec::new();
    while !exts.is_empty() {
        let ext_type = exts.u16().ok_or("truncated extension header")?;
        let data = exts.vec16().ok_or("truncated extension data")?;
        // pre_shared_key MUST be the last extension (RFC 8446 §4.2.11).
        if ext_type == EXT_PRE_SHARED_KEY && !exts.is_empty() {
            return Err("pre_shared_key is not the last extension");
        }
        match ext_type {
            EXT_SERVER_NAME if hello.sni.is_some() => {
                return Err("more than one server_name extension")
            }
            EXT_SERVER_NAME => hello.sni = Some(parse_sni(data)?),
            EXT_ALPN => hello.alpn = parse_alpn(data)?,
            EXT_ECH => hello.ech = true,
            _ => {}
        }
        seen.push(ext_type);
    }
    // At most one extension of each type (RFC 8446 §4.2).
    seen.sort_unstable();
    if seen.windows(2).any(|w| w.first() == w.get(1)) {
        return Err("duplicate extension");
    }
    Ok(hello)
}

/// server_name extension data: exactly one host_name entry (RFC 6066 §3).
fn parse_sni(data: Reader<'_>) -> Result<String, &'static str> {
    let mut data = data;
    let mut list = data.vec16().ok_or("truncated server_name list")?;
    if !data.is_empty() {
        return Err("trailing bytes in server_name extension");
    }
    let mut host: Option<String> = None;
    while !list.is_empty() {
        // NameType host_name(0) is the only one defined; others cannot be
        // skipped safely, so they are refused.
        let name_type = list.u8().ok_or("truncated server_name entry")?;
        if name_type != 0 {
            return Err("unknown server_name type");
        }
        let name = list.vec16().ok_or("truncated host_name")?;
        if host.is_some() {
            return Err("more than one host_name in server_name");
        }
        if name.is_empty() || name.len() > 255 {
            return Err("host_name length not 1..=255");
        }
        // Hostname bytes only: no NUL, spaces, '%', or non-ASCII (RFC 6066 §3:
        // ASCII, no trailing dot required; RFC 952/1123 characters plus '_').
        let ok = name
            .0
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if !ok {
            return Err("host_name has a byte outside [A-Za-z0-9._-]");
        }
        host = Some(name.0.iter().map(|&b| char::from(b)).collect());
    }
    host.ok_or("empty server_name list")
}

/// ALPN extension data: ProtocolNameList<2..2^16-1> of ProtocolName<1..2^8-1> (RFC 7301 §3.1).
fn parse_alpn(data: Reader<'_>) -> Result<Vec<String>, &'static str> {
    let mut data = data;
    let mut list = data.vec16().ok_or("truncated ALPN list")?;
    if !data.is_empty() {
        return Err("trailing bytes in ALPN extension");
    }
    if list.is_empty() {
        return Err("empty ALPN list");
    }
    let mut out = Vec::new();
    while !list.is_empty() {
        let name = list.vec8().ok_or("truncated ALPN protocol name")?;
        if name.is_empty() {
            return Err("empty ALPN protocol name");
        }
        out.push(String::from_utf8_lossy(name.0).into_owned());
    }
    Ok(out)
}

/// Bounds-checked big-endian reader over a byte slice.
#[derive(Clone, Copy)]
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.0.split_at_checked(n)?;
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        let (&b, tail) = self.0.split_first()?;
        self.0 = tail;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([*b.first()?, *b.get(1)?]))
    }
    /// `opaque x<0..2^8-1>`.
    fn vec8(&mut self) -> Option<Reader<'a>> {
        let n = self.u8()?;
        self.take(usize::from(n)).map(Reader)
    }
    /// `opaque x<0..2^16-1>`.
    fn vec16(&mut self) -> Option<Reader<'a>> {
        let n = self.u16()?;
        self.take(usize::from(n)).map(Reader)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::hellos::{CURL, LARGE, OPENSSL};

    const LARGE_ALPN: &[&str] = &[
        "h2",
        "http/1.1",
        "spdy/3.1",
        "h2c",
        "acme-tls/1",
        "http/1.0",
        "stun.turn",
        "webrtc",
        "c-webrtc",
        "ftp",
        "imap",
        "pop3",
        "managesieve",
        "coap",
        "xmpp-client",
        "xmpp-server",
        "sunrpc",
        "dot",
        "ntske/1",
    ];

    fn captures() -> [(
        &'static str,
        &'static [u8],
        &'static str,
        &'static [&'static str],
    ); 3] {
        [
            ("openssl", OPENSSL, "api.example.com", &["h2", "http/1.1"]),
            ("curl", CURL, "api.example.com", &["h2", "http/1.1"]),
            ("large", LARGE, "large.example.com", LARGE_ALPN),
        ]
    }

    fn expect_done(buf: &[u8]) -> (ClientHello, usize) {
        match parse(buf) {
            Parse::Done { value, len } => (value, len),
            other => panic!("expected Done, got {other:?}"),
        }
    }

    fn check_all_prefixes(name: &str, buf: &[u8]) {
        for i in 0..buf.len() {
            assert_eq!(
                parse(buf.get(..i).unwrap()),
                Parse::NeedMore,
                "{name}: prefix of {i} bytes"
            );
        }
    }

    /// Wrap handshake bytes in records, cutting at `cuts` (offsets into `msg`).
    fn records(msg: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain([msg.len()].iter()) {
            let frag = &msg[start..end];
            out.extend_from_slice(&[0x16, 0x03, 0x01]);
            out.extend_from_slice(&(frag.len() as u16).to_be_bytes());
            out.extend_from_slice(frag);
            start = end;
        }
        out
    }

    /// The handshake message inside a single-record capture.
    fn handshake(buf: &[u8]) -> &[u8] {
        let len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
        assert_eq!(buf.len(), 5 + len, "capture is one record");
        &buf[5..]
    }

    #[test]
    fn captured_hellos() {
        for (name, buf, sni, alpn) in captures() {
            let (hello, len) = expect_done(buf);
            assert_eq!(len, buf.len(), "{name}");
            assert_eq!(hello.sni.as_deref(), Some(sni), "{name}");
            assert_eq!(hello.alpn, alpn, "{name}");
            assert!(!hello.ech, "{name}");
        }
        assert!(LARGE.len() > 1500);
    }

    #[test]
    fn captured_prefixes_need_more() {
        for (name, buf, _, _) in captures() {
            check_all_prefixes(name, buf);
        }
    }

    #[test]
    fn trailing_bytes_after_hello_record_are_not_consumed() {
        for (name, buf, _, _) in captures() {
            let mut more = buf.to_vec();
            more.extend_from_slice(&[0x14, 0x03, 0x03, 0x00, 0x01, 0x01, 0x17, 0x03]);
            let (_, len) = expect_done(&more);
            assert_eq!(len, buf.len(), "{name}");
        }
    }

    #[test]
    fn resplit_into_records() {
        for (name, buf, _, _) in captures() {
            let expected = expect_done(buf).0;
            let msg = handshake(buf);
            // Every two-record split.
            for cut in 1..msg.len() {
                let re = records(msg, &[cut]);
                assert_eq!(
                    expect_done(&re),
                    (expected.clone(), re.len()),
                    "{name} cut {cut}"
                );
            }
            // Some three-record splits, each also checked prefix by prefix,
            // including splits inside the 4-byte handshake header.
            for cuts in [[1, 2], [3, 4], [4, 100], [100, msg.len() - 1]] {
                let re = records(msg, &cuts);
                assert_eq!(
                    expect_done(&re),
                    (expected.clone(), re.len()),
                    "{name} {cuts:?}"
                );
                check_all_prefixes(name, &re);
            }
            // One record per byte.
            let cuts: Vec<usize> = (1..msg.len()).collect();
            let re = records(msg, &cuts);
            assert_eq!(
                expect_done(&re),
                (expected.clone(), re.len()),
                "{name} bytewise"
            );
        }
    }

    #[test]
    fn other_record_type_inside_hello() {
        let msg = handshake(OPENSSL);
        let mut re = records(&msg[..50], &[]);
        re.extend_from_slice(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x28]);
        assert!(matches!(parse(&re), Parse::Malformed(_)));
        let mut re = records(&msg[..50], &[]);
        re.extend_from_slice(&[0x16, 0x02, 0x00]);
        assert!(matches!(parse(&re), Parse::Malformed(_)));
    }

    // ---- hand-built hellos ----

    fn ext(ext_type: u16, data: &[u8]) -> Vec<u8> {
        let mut v = ext_type.to_be_bytes().to_vec();
        v.extend_from_slice(&(data.len() as u16).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    fn sni_ext(names: &[&[u8]]) -> Vec<u8> {
        let mut list = Vec::new();
        for n in names {
            list.push(0);
            list.extend_from_slice(&(n.len() as u16).to_be_bytes());
            list.extend_from_slice(n);
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        ext(EXT_SERVER_NAME, &data)
    }

    fn alpn_ext(protos: &[&[u8]]) -> Vec<u8> {
        let mut list = Vec::new();
        for p in protos {
            list.push(p.len() as u8);
            list.extend_from_slice(p);
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        ext(EXT_ALPN, &data)
    }

    /// A hello body with the given raw extensions block (None: no block).
    fn body(exts: Option<&[u8]>) -> Vec<u8> {
        let mut b = vec![0x03, 0x03];
        b.extend_from_slice(&[0xab; 32]);
        b.push(0); // session id
        b.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // cipher_suites
        b.extend_from_slice(&[0x01, 0x00]); // compression
        if let Some(e) = exts {
            b.extend_from_slice(&(e.len() as u16).to_be_bytes());
            b.extend_from_slice(e);
        }
        b
    }

    fn record_of_body(body: &[u8]) -> Vec<u8> {
        let mut msg = vec![0x01];
        msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        msg.extend_from_slice(body);
        records(&msg, &[])
    }

    fn hello_with(exts: &[Vec<u8>]) -> Vec<u8> {
        record_of_body(&body(Some(&exts.concat())))
    }

    fn malformed(buf: &[u8]) -> &'static str {
        match parse(buf) {
            Parse::Malformed(why) => why,
            other => panic!("expected Malformed, got {other:?}"),
        }
    }

    #[test]
    fn built_basic() {
        let buf = hello_with(&[sni_ext(&[b"Api.Example.com"]), alpn_ext(&[b"h2", b"\xff"])]);
        let (h, len) = expect_done(&buf);
        assert_eq!(len, buf.len());
        assert_eq!(h.sni.as_deref(), Some("Api.Example.com"));
        assert_eq!(h.alpn, ["h2", "\u{fffd}"]);
        check_all_prefixes("built", &buf);
    }

    #[test]
    fn no_sni_and_no_extensions() {
        let (h, _) = expect_done(&hello_with(&[alpn_ext(&[b"http/1.1"])]));
        assert_eq!(h.sni, None);
        let (h, _) = expect_done(&record_of_body(&body(None)));
        assert_eq!(h, ClientHello::default());
        let (h, _) = expect_done(&hello_with(&[]));
        assert_eq!(h, ClientHello::default());
    }

    #[test]
    fn sni_errors() {
        let m = |e: Vec<Vec<u8>>| malformed(&hello_with(&e));
        m(vec![sni_ext(&[b"a.com", b"b.com"])]);
        m(vec![sni_ext(&[b"a.com"]), sni_ext(&[b"b.com"])]);
        m(vec![
            sni_ext(&[b"a.com"]),
            alpn_ext(&[b"h2"]),
            sni_ext(&[b"a.com"]),
        ]);
        m(vec![sni_ext(&[b"a .com"])]);
        m(vec![sni_ext(&[b"a\0.com"])]);
        m(vec![sni_ext(&[b"a.com\0"])]);
        m(vec![sni_ext(&[b"a%2ecom"])]);
        m(vec![sni_ext(&["bücher.de".as_bytes()])]);
        m(vec![sni_ext(&[b""])]);
        m(vec![sni_ext(&[])]);
        m(vec![ext(EXT_SERVER_NAME, &[])]);
        m(vec![sni_ext(&[&[b'a'; 256]])]);
        // Unknown name type 1.
        m(vec![ext(EXT_SERVER_NAME, &[0, 4, 1, 0, 1, b'a'])]);
        // Trailing byte after the list.
        m(vec![ext(EXT_SERVER_NAME, &[0, 4, 0, 0, 1, b'a', 0])]);
        let (h, _) = expect_done(&hello_with(&[sni_ext(&[&[b'a'; 255]])]));
        assert_eq!(h.sni.map(|s| s.len()), Some(255));
        let (h, _) = expect_done(&hello_with(&[sni_ext(&[b"_x-1.A.com."])]));
        assert_eq!(h.sni.as_deref(), Some("_x-1.A.com."));
    }

    #[test]
    fn ech_and_duplicates() {
        let (h, _) = expect_done(&hello_with(&[
            sni_ext(&[b"public.example"]),
            ext(EXT_ECH, &[0, 1, 2]),
        ]));
        assert!(h.ech);
        assert_eq!(h.sni.as_deref(), Some("public.example"));
        assert_eq!(
            malformed(&hello_with(&[ext(EXT_ECH, &[]), ext(EXT_ECH, &[])])),
            "duplicate extension"
        );
        malformed(&hello_with(&[alpn_ext(&[b"h2"]), alpn_ext(&[b"h2"])]));
        malformed(&hello_with(&[ext(0x1234, &[]), ext(0x1234, &[1])]));
        // pre_shared_key must be last.
        malformed(&hello_with(&[
            ext(EXT_PRE_SHARED_KEY, &[]),
            ext(EXT_ALPN, &[0, 3, 2, b'h', b'2']),
        ]));
        expect_done(&hello_with(&[
            alpn_ext(&[b"h2"]),
            ext(EXT_PRE_SHARED_KEY, &[]),
        ]));
    }

    #[test]
    fn alpn_errors() {
        malformed(&hello_with(&[alpn_ext(&[])]));
        malformed(&hello_with(&[alpn_ext(&[b""])]));
        malformed(&hello_with(&[ext(EXT_ALPN, &[0, 3, 2, b'h'])]));
        malformed(&hello_with(&[ext(EXT_ALPN, &[0, 3, 2, b'h', b'2', 0])]));
    }

    #[test]
    fn truncated_lengths() {
        // Extension claims more data than the block has.
        let mut e = ext(0x1234, &[1, 2, 3]);
        e[3] = 9;
        malformed(&hello_with(&[e]));
        // Extension header cut in half.
        malformed(&hello_with(&[vec![0x00]]));
        // Extensions block length longer than the body.
        let mut b = body(Some(&sni_ext(&[b"a.com"])));
        let at = b.len() - sni_ext(&[b"a.com"]).len() - 2;
        b[at + 1] += 1;
        malformed(&record_of_body(&b));
        // Trailing bytes after the extensions block.
        let mut b = body(Some(&[]));
        b.push(0);
        malformed(&record_of_body(&b));
        // Truncated fixed fields.
        malformed(&record_of_body(&[0x03, 0x03, 1, 2]));
        malformed(&record_of_body(&[]));
        // Session id of 33 bytes; odd cipher_suites; no compression methods.
        let mut b = vec![3, 3];
        b.extend_from_slice(&[0; 32]);
        let mut sid = b.clone();
        sid.push(33);
        sid.extend_from_slice(&[0; 33]);
        sid.extend_from_slice(&[0, 2, 0x13, 1, 1, 0]);
        malformed(&record_of_body(&sid));
        let mut odd = b.clone();
        odd.extend_from_slice(&[0, 0, 3, 0x13, 1, 0, 1, 0]);
        malformed(&record_of_body(&odd));
        let mut nocomp = b;
        nocomp.extend_from_slice(&[0, 0, 2, 0x13, 1, 0]);
        malformed(&record_of_body(&nocomp));
    }

    #[test]
    fn record_length_lies() {
        let good = hello_with(&[sni_ext(&[b"a.com"])]);
        // Record longer than the hello: the extra bytes would be a second
        // handshake message in the hello's record.
        let mut long = good.clone();
        let n = u16::from_be_bytes([long[3], long[4]]) + 4;
        long[3..5].copy_from_slice(&n.to_be_bytes());
        long.extend_from_slice(&[1, 0, 0, 0]);
        malformed(&long);
        // Same, with the extra bytes not yet received.
        malformed(&long[..good.len()]);
        // Record shorter than the hello, followed by non-record bytes.
        let mut short = good.clone();
        let n = u16::from_be_bytes([short[3], short[4]]) - 10;
        short[3..5].copy_from_slice(&n.to_be_bytes());
        malformed(&short);
        // Zero-length and oversized records.
        assert_eq!(malformed(&[0x16, 3, 1, 0, 0]), "empty handshake record");
        assert_eq!(malformed(&[0x16, 3, 1, 0x48, 0x01]), "record too long");
        // Handshake length over MAX_HELLO_LEN, known from the first 4 bytes.
        malformed(&[0x16, 3, 1, 0x10, 0, 1, 0, 0x40, 0x01]);
        // Handshake length shorter than the content in its record.
        let mut hs = good.clone();
        hs[8] -= 1;
        malformed(&hs);
        // Bad minor version.
        malformed(&[0x16, 3, 0x10]);
    }

    /// xorshift64*: deterministic pseudo-random numbers for mutation tests.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Mutated captures (flips, length-field nudges, cuts, splices) never
    /// panic, and `Done` never claims more bytes than were given. The
    /// cargo-fuzz target in fuzz/ does the same without a fixed budget.
    #[test]
    fn mutated_captures_never_panic() {
        let mut rng = Rng(0x5eed_cafe_f00d_beef);
        let seeds = [OPENSSL, CURL, LARGE];
        for _ in 0..30_000 {
            let mut buf = seeds[rng.below(seeds.len())].to_vec();
            for _ in 0..=rng.below(4) {
                let at = rng.below(buf.len());
                match rng.below(5) {
                    0 => buf[at] ^= 1 << rng.below(8),
                    1 => buf[at] = buf[at].wrapping_add(1),
                    2 => buf[at] = buf[at].wrapping_sub(1),
                    3 => buf.truncate(at),
                    _ => {
                        let len = rng.below(64).min(buf.len() - at);
                        let chunk = buf[at..at + len].to_vec();
                        let to = rng.below(buf.len());
                        buf.splice(to..to, chunk);
                    }
                }
                if buf.is_empty() {
                    break;
                }
            }
            if let Parse::Done { len, .. } = parse(&buf) {
                assert!(len <= buf.len());
            }
        }
    }

    #[test]
    fn not_tls() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Parse::NotThis);
        assert_eq!(parse(b"SSH-2.0-OpenSSH_9.6\r\n"), Parse::NotThis);
        assert_eq!(parse(b"SSH-2.0"), Parse::NotThis);
        // SSLv2-compatible hello (RFC 5246 Appendix E.2).
        assert_eq!(parse(&[0x80, 0x2e, 0x01, 0x00, 0x02]), Parse::NotThis);
        assert_eq!(parse(&[0x16, 0x02]), Parse::NotThis);
        assert_eq!(parse(&[0x16, 0x03, 0x01, 0x00, 0x04, 0x02]), Parse::NotThis);
        assert_eq!(parse(&[0x17, 0x03, 0x03]), Parse::NotThis);
        assert_eq!(parse(&[]), Parse::NeedMore);
        assert_eq!(parse(&[0x16]), Parse::NeedMore);
        assert_eq!(
            parse(&[0x16, 0x03, 0x01, 0x00, 0x04, 0x01]),
            Parse::NeedMore
        );
    }
}
