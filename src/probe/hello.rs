//! The hand-built TLS ClientHello the probe runner sends.
//!
//! Enough for a TLS server to answer with a ServerHello and for Palisade to
//! read the SNI; nothing after it is ever sent, so no key is ever used. A
//! pure builder: the caller passes the random values in, so tests get fixed
//! bytes. (The fuzzing module has a similar builder for its own corpus; the
//! probe keeps its own so the two can evolve apart.)
//!
//! With `ech`, the hello carries an `encrypted_client_hello` extension
//! (0xfe0d, draft-ietf-tls-esni §5) of the outer type: cipher suite, config
//! id, a 32-byte `enc` and a random payload, the shape of a GREASE ECH
//! extension (§6.2). A server without ECH ignores it and answers normally,
//! which is why a proxy that only reads the outer SNI would let it through.

/// The extension type of `encrypted_client_hello`.
pub const EXT_ECH: u16 = 0xfe0d;
/// The extension type of `server_name` (RFC 6066 §3).
pub const EXT_SERVER_NAME: u16 = 0;
/// Bytes of the ECH payload (a GREASE-sized ciphertext of an inner hello).
const ECH_PAYLOAD_LEN: usize = 160;

/// What goes into a ClientHello.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hello<'a> {
    /// server_name host_name; none when `None` (IP targets).
    pub sni: Option<&'a str>,
    /// Add an outer `encrypted_client_hello` extension.
    pub ech: bool,
}

/// The random values of one ClientHello.
#[derive(Debug, Clone)]
pub struct Random {
    pub client_random: [u8; 32],
    pub session_id: [u8; 32],
    pub key_share: [u8; 32],
    pub ech_config_id: u8,
    pub ech_enc: [u8; 32],
    pub ech_payload: [u8; ECH_PAYLOAD_LEN],
}

impl Random {
    /// Every value from `fill` (the OS RNG in the runner).
    pub fn from_fn(mut fill: impl FnMut(&mut [u8])) -> Random {
        let mut r = Random {
            client_random: [0; 32],
            session_id: [0; 32],
            key_share: [0; 32],
            ech_config_id: 0,
            ech_enc: [0; 32],
            ech_payload: [0; ECH_PAYLOAD_LEN],
        };
        fill(&mut r.client_random);
        fill(&mut r.session_id);
        fill(&mut r.key_share);
        let mut id = [0u8; 1];
        fill(&mut id);
        r.ech_config_id = id[0];
        fill(&mut r.ech_enc);
        fill(&mut r.ech_payload);
        r
    }
}

fn ext(out: &mut Vec<u8>, typ: u16, data: &[u8]) {
    out.extend_from_slice(&typ.to_be_bytes());
    out.extend_from_slice(&(data.len() as u16).to_be_bytes());
    out.extend_from_slice(data);
}

/// One TLS record holding a TLS 1.3 (and 1.2) ClientHello.
pub fn build(hello: &Hello<'_>, random: &Random) -> Vec<u8> {
    let mut exts = Vec::new();
    if let Some(name) = hello.sni {
        let n = name.as_bytes();
        let mut d = Vec::new();
        d.extend_from_slice(&((n.len() + 3) as u16).to_be_bytes());
        d.push(0); // host_name
        d.extend_from_slice(&(n.len() as u16).to_be_bytes());
        d.extend_from_slice(n);
        ext(&mut exts, EXT_SERVER_NAME, &d);
    }
    ext(&mut exts, 10, &[0, 4, 0, 0x1d, 0, 0x17]); // supported_groups: x25519, secp256r1
    ext(&mut exts, 11, &[1, 0]); // ec_point_formats: uncompressed
    ext(
        &mut exts,
        13,
        &[0, 16, 4, 3, 8, 4, 4, 1, 5, 3, 8, 5, 5, 1, 8, 6, 6, 1], // signature_algorithms
    );
    ext(
        &mut exts,
        16,
        &[0, 9, 8, b'h', b't', b't', b'p', b'/', b'1', b'.', b'1'],
    ); // ALPN
    ext(&mut exts, 43, &[4, 3, 4, 3, 3]); // supported_versions: 1.3, 1.2
    ext(&mut exts, 45, &[1, 1]); // psk_key_exchange_modes: psk_dhe_ke
    let mut ks = vec![0, 36, 0, 0x1d, 0, 32];
    ks.extend_from_slice(&random.key_share);
    ext(&mut exts, 51, &ks); // key_share: x25519
    if hello.ech {
        // ECHClientHello, outer: type 0, HpkeSymmetricCipherSuite
        // (HKDF-SHA256, AES-128-GCM), config_id, enc<0..2^16-1>,
        // payload<1..2^16-1>.
        let mut d = vec![0, 0, 1, 0, 1, random.ech_config_id];
        d.extend_from_slice(&(random.ech_enc.len() as u16).to_be_bytes());
        d.extend_from_slice(&random.ech_enc);
        d.extend_from_slice(&(random.ech_payload.len() as u16).to_be_bytes());
        d.extend_from_slice(&random.ech_payload);
        ext(&mut exts, EXT_ECH, &d);
    }
    let mut body = vec![3, 3];
    body.extend_from_slice(&random.client_random);
    body.push(32);
    body.extend_from_slice(&random.session_id);
    let suites: [u16; 7] = [0x1301, 0x1302, 0x1303, 0xc02f, 0xc02b, 0xc030, 0xc02c];
    body.extend_from_slice(&((suites.len() * 2) as u16).to_be_bytes());
    for s in suites {
        body.extend_from_slice(&s.to_be_bytes());
    }
    body.extend_from_slice(&[1, 0]); // compression: null
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![1]; // client_hello
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

/// The extension types of a ClientHello record built by [`build`], in
/// order (None if it is not one). For tests and for checking a hello
/// before it is sent.
pub fn extension_types(record: &[u8]) -> Option<Vec<u16>> {
    let hs = record.get(5..)?;
    let body = hs.get(4..)?;
    let sid_len = *body.get(34)? as usize;
    let mut pos = 35 + sid_len;
    let suites = u16::from_be_bytes([*body.get(pos)?, *body.get(pos + 1)?]) as usize;
    pos += 2 + suites;
    let comp = *body.get(pos)? as usize;
    pos += 1 + comp;
    let total = u16::from_be_bytes([*body.get(pos)?, *body.get(pos + 1)?]) as usize;
    pos += 2;
    let end = pos + total;
    if end != body.len() {
        return None;
    }
    let mut types = Vec::new();
    while pos < end {
        let typ = u16::from_be_bytes([*body.get(pos)?, *body.get(pos + 1)?]);
        let len = u16::from_be_bytes([*body.get(pos + 2)?, *body.get(pos + 3)?]) as usize;
        pos += 4 + len;
        types.push(typ);
    }
    (pos == end).then_some(types)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::client_hello::parse;
    use crate::proto::Parse;

    fn fixed() -> Random {
        let mut n = 0u8;
        Random::from_fn(|b| {
            for x in b {
                n = n.wrapping_add(1);
                *x = n;
            }
        })
    }

    #[test]
    fn palisade_reads_the_sni_and_the_ech_flag() {
        for (sni, ech) in [
            (Some("allowed.test"), false),
            (Some("allowed.test"), true),
            (None, false),
            (None, true),
        ] {
            let bytes = build(&Hello { sni, ech }, &fixed());
            match parse(&bytes) {
                Parse::Done { value: hello, len } => {
                    assert_eq!(hello.sni.as_deref(), sni);
                    assert_eq!(hello.ech, ech, "{sni:?} ech={ech}");
                    assert_eq!(hello.alpn, ["http/1.1"]);
                    assert_eq!(len, bytes.len());
                }
                other => panic!("{sni:?} ech={ech}: {other:?}"),
            }
            let types = extension_types(&bytes).expect("well-formed extensions");
            assert_eq!(types.contains(&EXT_ECH), ech);
            assert_eq!(types.contains(&EXT_SERVER_NAME), sni.is_some());
        }
    }

    #[test]
    fn every_prefix_is_a_valid_prefix() {
        let bytes = build(
            &Hello {
                sni: Some("allowed.test"),
                ech: true,
            },
            &fixed(),
        );
        for n in 0..bytes.len() {
            assert_eq!(parse(&bytes[..n]), Parse::NeedMore, "prefix of {n} bytes");
        }
    }

    #[test]
    fn the_ech_extension_has_the_outer_shape() {
        let r = fixed();
        let bytes = build(
            &Hello {
                sni: Some("a.test"),
                ech: true,
            },
            &r,
        );
        let at = bytes
            .windows(2)
            .rposition(|w| w == EXT_ECH.to_be_bytes())
            .expect("extension present");
        let len = u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]) as usize;
        let d = &bytes[at + 4..at + 4 + len];
        assert_eq!(&d[..6], &[0, 0, 1, 0, 1, r.ech_config_id]);
        assert_eq!(u16::from_be_bytes([d[6], d[7]]), 32);
        assert_eq!(&d[8..40], &r.ech_enc);
        assert_eq!(u16::from_be_bytes([d[40], d[41]]) as usize, ECH_PAYLOAD_LEN);
        assert_eq!(d.len(), 42 + ECH_PAYLOAD_LEN);
        assert_eq!(at + 4 + len, bytes.len(), "ECH is the last extension");
    }
}
