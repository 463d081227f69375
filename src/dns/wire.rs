//! Kept answers on the wire: the question of a plain query read straight
//! from its bytes ([`question`]), and a response encoded once and then
//! patched per query ([`Wire`]) instead of being decoded and encoded by
//! hickory every time.
//!
//! [`question`] accepts only the common shape of a query, and says `None`
//! to anything else, which then takes hickory's path: opcode QUERY, flags
//! among RD, AD and CD, one question of class IN, no answers or
//! authorities, at most one additional record which is an EDNS(0) OPT of
//! version 0 without the DO bit or an extended rcode, whose options are
//! well-formed and none that hickory reads into a value of its own; a name
//! of letters, digits, `-` and `_` only (no compression, no escapes, no
//! `xn--` label, no label starting with `-`), of a type in [`QTYPES`], and
//! nothing after the message. A question it accepts is one hickory reads
//! the same way (checked by `fuzzing::dns_question` and the tests below).
//!
//! What a response depends on, apart from the answer itself, is the
//! query's [`Shape`] (the flags it echoes, its EDNS payload size) and the
//! transport; its id and its question (the name in the case the client
//! sent it, for 0x20) are copied in, and its TTLs are counted down by the
//! time since the answer was kept. A [`Wire`] holds a response encoded for
//! one shape and where its TTLs are, and [`Wire::answer`] builds another
//! query's response from it.
//!
//! Pure: plain functions over bytes, bounded, no panics.

/// Header flags a query may carry on this path: RD, AD, CD.
const RD: u16 = 0x0100;
const AD: u16 = 0x0020;
const CD: u16 = 0x0010;
/// The header.
const HEADER: usize = 12;
/// Longest name on the wire, its length bytes and root included (RFC 1035).
pub(crate) const MAX_NAME: usize = 255;
/// Longest label.
const MAX_LABEL: usize = 63;
/// The OPT pseudo-record type.
const OPT: u16 = 41;
/// EDNS options hickory reads into values of its own (NSID, DAU, DHU,
/// N3U, client subnet): a query carrying one takes hickory's path.
const PARSED_OPTIONS: [u16; 5] = [3, 5, 6, 7, 8];
/// Largest UDP payload answered (the shim's `MAX_UDP_PAYLOAD`).
const MAX_UDP_PAYLOAD: u16 = 1232;

/// The query types read here: A, NS, CNAME, SOA, PTR, MX, TXT, AAAA, SRV,
/// SVCB, HTTPS, CAA.
pub(crate) const QTYPES: [u16; 12] = [1, 2, 5, 6, 12, 15, 16, 28, 33, 64, 65, 257];

/// [`QTYPES`] as a table by type (a lookup, not a scan: it is asked of
/// every query).
const READ_HERE: [bool; 258] = {
    let mut t = [false; 258];
    let mut i = 0;
    while i < QTYPES.len() {
        t[QTYPES[i] as usize] = true;
        i += 1;
    }
    t
};

/// Whether `qtype` is one of [`QTYPES`].
fn read_here(qtype: u16) -> bool {
    READ_HERE.get(usize::from(qtype)).copied().unwrap_or(false)
}

/// What a response depends on in the query, apart from its id and question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    /// The flags the response echoes: RD and CD as sent.
    pub flags: u16,
    /// The EDNS payload size answered (`None`: the query had no EDNS).
    pub edns: Option<u16>,
}

/// The one question of a plain query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Question<'a> {
    pub id: u16,
    /// The question section as sent: the name (in the client's case), type, class.
    pub section: &'a [u8],
    pub qtype: u16,
    pub shape: Shape,
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

/// A label this path takes: letters, digits, `-` and `_`, not starting
/// with `-`, not an IDNA (`xn--`) label (hickory shows those decoded).
fn plain_label(label: &[u8]) -> bool {
    !label.is_empty()
        && label[0] != b'-'
        && !(label.len() >= 4 && label[..4].eq_ignore_ascii_case(b"xn--"))
        && label
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
}

/// The end of the plain name starting at `at` (past its root byte).
fn plain_name(msg: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    let mut labels = 0;
    loop {
        let len = usize::from(*msg.get(i)?);
        if len == 0 {
            i += 1;
            break;
        }
        // Compression pointers and extended label types are not plain.
        if len > MAX_LABEL {
            return None;
        }
        if !plain_label(msg.get(i + 1..i + 1 + len)?) {
            return None;
        }
        i += 1 + len;
        labels += 1;
        if i - at >= MAX_NAME {
            return None;
        }
    }
    (labels > 0).then_some(i)
}

/// EDNS options, well-formed to the last byte, none of [`PARSED_OPTIONS`].
fn plain_options(mut opts: &[u8]) -> bool {
    while !opts.is_empty() {
        let (Some(code), Some(len)) = (be16(opts, 0), be16(opts, 2)) else {
            return false;
        };
        let end = 4 + usize::from(len);
        if PARSED_OPTIONS.contains(&code) || opts.len() < end {
            return false;
        }
        opts = &opts[end..];
    }
    true
}

/// The EDNS payload size answered for the OPT record that is the rest of
/// `msg` from `at`, if it is a plain one and ends the message.
fn plain_opt(msg: &[u8], at: usize) -> Option<u16> {
    // Root owner, type OPT, payload size, extended rcode/version/flags,
    // options.
    if *msg.get(at)? != 0 || be16(msg, at + 1)? != OPT {
        return None;
    }
    let payload = be16(msg, at + 3)?;
    if be32(msg, at + 5)? != 0 {
        return None;
    }
    let len = usize::from(be16(msg, at + 9)?);
    let opts = msg.get(at + 11..)?;
    (opts.len() == len && plain_options(opts)).then(|| payload.clamp(512, MAX_UDP_PAYLOAD))
}

/// The question of `msg` if it is a plain query (see the module's
/// documentation); `None` for anything else.
pub(crate) fn question(msg: &[u8]) -> Option<Question<'_>> {
    let flags = be16(msg, 2)?;
    // QR 0, opcode QUERY, no AA/TC/Z, rcode 0; RD, AD, CD as they come.
    if flags & !(RD | AD | CD) != 0 {
        return None;
    }
    let counts = [be16(msg, 4)?, be16(msg, 6)?, be16(msg, 8)?, be16(msg, 10)?];
    if counts[..3] != [1, 0, 0] || counts[3] > 1 {
        return None;
    }
    let end = plain_name(msg, HEADER)?;
    let (qtype, qclass) = (be16(msg, end)?, be16(msg, end + 2)?);
    if qclass != 1 || !read_here(qtype) {
        return None;
    }
    let section = &msg[HEADER..end + 4];
    let edns = if counts[3] == 1 {
        Some(plain_opt(msg, end + 4)?)
    } else if msg.len() == end + 4 {
        None
    } else {
        return None;
    };
    Some(Question {
        id: be16(msg, 0)?,
        section,
        qtype,
        shape: Shape {
            flags: flags & (RD | CD),
            edns,
        },
    })
}

impl Question<'_> {
    /// The name's wire bytes (labels and root).
    fn name(&self) -> &[u8] {
        &self.section[..self.section.len() - 4]
    }

    /// The name in lower case on the wire: the answer cache's key.
    pub(crate) fn lower_name(&self) -> Box<[u8]> {
        self.name().to_ascii_lowercase().into()
    }

    /// [`Question::lower_name`] in `buf`, without allocating; none for a
    /// name longer than a name may be.
    pub(crate) fn lower_name_in<'b>(&self, buf: &'b mut [u8; MAX_NAME]) -> Option<&'b [u8]> {
        let name = self.name();
        let lower = buf.get_mut(..name.len())?;
        lower.copy_from_slice(name);
        lower.make_ascii_lowercase();
        Some(lower)
    }

    /// The name in lower case as hickory shows it: its labels, each
    /// followed by a dot.
    pub(crate) fn shown(&self) -> String {
        let name = self.name();
        let mut s = String::with_capacity(name.len());
        let mut i = 0;
        while let Some(&len) = name.get(i) {
            let label = name
                .get(i + 1..i + 1 + usize::from(len))
                .unwrap_or_default();
            if label.is_empty() {
                break;
            }
            for &c in label {
                s.push(char::from(c.to_ascii_lowercase()));
            }
            s.push('.');
            i += 1 + usize::from(len);
        }
        s
    }
}

/// The end of the (possibly compressed) name at `at`: a pointer ends it.
fn skip_name(msg: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    loop {
        let len = *msg.get(i)?;
        match len {
            0 => return Some(i + 1),
            1..=63 => i += 1 + usize::from(len),
            0xc0..=0xff => {
                msg.get(i + 1)?;
                return Some(i + 2);
            }
            _ => return None,
        }
        if i - at > MAX_NAME {
            return None;
        }
    }
}

/// Where the TTLs of a message's records are (the OPT pseudo-record has
/// none), if the message reads to its last byte.
pub(crate) fn ttl_offsets(msg: &[u8]) -> Option<Vec<usize>> {
    let qd = be16(msg, 4)?;
    let records = [be16(msg, 6)?, be16(msg, 8)?, be16(msg, 10)?]
        .iter()
        .map(|&n| usize::from(n))
        .sum::<usize>();
    let mut i = HEADER;
    for _ in 0..qd {
        i = skip_name(msg, i)? + 4;
    }
    // Each record takes at least 11 bytes: a count beyond that is a lie.
    if records > msg.len() / 11 {
        return None;
    }
    let mut ttls = Vec::with_capacity(records);
    for _ in 0..records {
        i = skip_name(msg, i)?;
        if be16(msg, i)? != OPT {
            ttls.push(i + 4);
        }
        let len = usize::from(be16(msg, i + 8)?);
        i += 10 + len;
    }
    (i == msg.len()).then_some(ttls)
}

/// A response encoded once for one query shape and transport, and where
/// its TTLs are: every other query of the same shape for the same answer
/// gets these bytes with its own id, its question and the TTLs counted down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Wire {
    pub shape: Shape,
    pub tcp: bool,
    bytes: Box<[u8]>,
    ttls: Box<[usize]>,
    /// The question section's length.
    question: usize,
}

impl Wire {
    /// `bytes`, the response to a query of `shape` whose question section
    /// was `question` long; `None` if it does not read as one.
    pub(crate) fn new(shape: Shape, tcp: bool, bytes: Vec<u8>, question: usize) -> Option<Wire> {
        if be16(&bytes, 4)? != 1 || skip_name(&bytes, HEADER)? + 4 != HEADER + question {
            return None;
        }
        let ttls = ttl_offsets(&bytes)?.into();
        Some(Wire {
            shape,
            tcp,
            bytes: bytes.into(),
            ttls,
            question,
        })
    }

    /// The response's length in bytes.
    pub(crate) fn size(&self) -> usize {
        self.bytes.len()
    }

    /// The response to `q` (of this shape, for this answer), its TTLs
    /// `age` seconds less; `None` if `q`'s question is not of this length.
    pub(crate) fn answer(&self, q: &Question<'_>, age: u32) -> Option<Vec<u8>> {
        if q.section.len() != self.question {
            return None;
        }
        let mut out = self.bytes.to_vec();
        out[..2].copy_from_slice(&q.id.to_be_bytes());
        out[HEADER..HEADER + self.question].copy_from_slice(q.section);
        if age > 0 {
            for &at in &self.ttls {
                let ttl = be32(&out, at)?.saturating_sub(age);
                out[at..at + 4].copy_from_slice(&ttl.to_be_bytes());
            }
        }
        Some(out)
    }
}

/// What a query says, as compared between this path and hickory's: id,
/// echoed flags, name shown, type, payload answered.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) type Read = (u16, u16, String, u16, Option<u16>);

#[cfg(any(test, feature = "fuzzing"))]
impl Question<'_> {
    /// What this path reads.
    pub(crate) fn as_read(&self) -> Read {
        (
            self.id,
            self.shape.flags,
            self.shown(),
            self.qtype,
            self.shape.edns,
        )
    }
}

/// What hickory reads in `msg`, if it reads one query of class IN in it.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn as_hickory_reads(msg: &[u8]) -> Option<Read> {
    use hickory_server::net::xfer::Protocol;
    use hickory_server::proto::op::{MessageType, OpCode};
    use hickory_server::proto::rr::DNSClass;
    let src = std::net::SocketAddr::from(([198, 18, 1, 2], 4000));
    let r = hickory_server::server::Request::from_bytes(msg.to_vec(), src, Protocol::Udp).ok()?;
    let q = r.request_info().ok()?.query;
    let query =
        r.metadata.message_type == MessageType::Query && r.metadata.op_code == OpCode::Query;
    if !query || q.query_class() != DNSClass::IN {
        return None;
    }
    let flags = if r.metadata.recursion_desired { RD } else { 0 }
        | if r.metadata.checking_disabled { CD } else { 0 };
    Some((
        r.metadata.id,
        flags,
        q.name().to_string(),
        u16::from(q.query_type()),
        r.edns
            .as_ref()
            .map(|e| e.max_payload().clamp(512, MAX_UDP_PAYLOAD)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_server::proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_server::proto::rr::rdata::opt::EdnsOption;
    use hickory_server::proto::rr::rdata::{A, CNAME};
    use hickory_server::proto::rr::{Name, RData, Record, RecordType};
    use hickory_server::proto::serialize::binary::BinEncodable;

    #[test]
    fn the_types_read_here_are_qtypes() {
        for t in 0..=u16::MAX {
            assert_eq!(read_here(t), QTYPES.contains(&t), "{t}");
        }
    }

    fn query(name: &str, qtype: RecordType, edns: Option<Edns>) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.id = 0xbeef;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
        m.edns = edns;
        m.to_vec().unwrap()
    }

    fn edns(payload: u16) -> Edns {
        let mut e = Edns::new();
        e.set_max_payload(payload);
        e
    }

    /// A plain query reads as hickory reads it.
    fn same_as_hickory(msg: &[u8]) {
        let q = question(msg).expect("plain");
        assert_eq!(Some(q.as_read()), as_hickory_reads(msg));
    }

    #[test]
    fn plain_queries_read_as_hickory_reads_them() {
        for (name, qtype, e) in [
            ("allowed.test.", RecordType::A, None),
            ("AlLoWeD.TeSt.", RecordType::AAAA, Some(edns(4096))),
            ("_acme-challenge.a1.test.", RecordType::TXT, Some(edns(100))),
            ("x.test.", RecordType::HTTPS, Some(edns(1232))),
        ] {
            let msg = query(name, qtype, e);
            same_as_hickory(&msg);
            let q = question(&msg).unwrap();
            assert_eq!(q.shown(), name.to_ascii_lowercase());
            let lower = Name::from_ascii(name.to_ascii_lowercase()).unwrap();
            assert_eq!(&*q.lower_name(), &lower.to_bytes().unwrap()[..]);
        }
        // A cookie (not read by hickory into a value) is fine.
        let mut e = edns(1232);
        e.options_mut()
            .insert(EdnsOption::Unknown(10, vec![1, 2, 3, 4, 5, 6, 7, 8]));
        same_as_hickory(&query("a.test.", RecordType::A, Some(e)));
        // CD and AD: CD is echoed, AD is not.
        let mut msg = query("a.test.", RecordType::A, None);
        msg[3] |= 0x30;
        same_as_hickory(&msg);
        assert_eq!(question(&msg).unwrap().shape.flags, RD | CD);
    }

    /// Everything that is not the plain shape is left to hickory.
    #[test]
    fn anything_unusual_is_not_plain() {
        let base = query("a.test.", RecordType::A, Some(edns(1232)));
        assert!(question(&base).is_some());
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut m = base.clone();
            f(&mut m);
            question(&m).is_none()
        };
        // The header: a response, another opcode, AA, TC, Z, an rcode.
        for (byte, bit) in [
            (2, 0x80),
            (2, 0x08),
            (2, 0x04),
            (2, 0x02),
            (3, 0x40),
            (3, 0x01),
        ] {
            assert!(with(&|m| m[byte] |= bit), "{byte}:{bit:#x}");
        }
        // Counts: two questions, an answer, an authority, two additionals.
        for at in [5, 7, 9] {
            assert!(with(&|m| m[at] += 1), "{at}");
        }
        assert!(with(&|m| m[11] = 2));
        // A pointer or an odd byte in the name, an IDNA label, a leading dash.
        assert!(with(&|m| m[12] = 0xc0));
        assert!(with(&|m| m[13] = b'*'));
        assert!(with(&|m| m[13] = b' '));
        assert!(question(&query("xn--bcher-kva.test.", RecordType::A, None)).is_none());
        let dash = query("ab.test.", RecordType::A, None);
        let mut dash = dash.clone();
        dash[13] = b'-';
        assert!(question(&dash).is_none());
        // Another class, an unknown type, ANY.
        let (t, c) = (base.len() - 11 - 4, base.len() - 11 - 2);
        assert!(with(&|m| m[c + 1] = 3));
        assert!(with(&|m| m[t + 1] = 99));
        assert!(with(&|m| m[t + 1] = 255));
        // EDNS: version 1, DO, an extended rcode, a non-root owner.
        let opt = base.len() - 11;
        for at in [opt + 6, opt + 7, opt + 5] {
            assert!(with(&|m| m[at] = 1 << 7), "{at}");
        }
        assert!(with(&|m| m[opt] = 1));
        // Trailing bytes, or a message cut short.
        assert!(with(&|m| m.push(0)));
        for n in 0..base.len() {
            assert!(question(&base[..n]).is_none(), "{n}");
        }
        // Client subnet and NSID are read by hickory: its path.
        for code in PARSED_OPTIONS {
            let mut e = edns(1232);
            e.options_mut()
                .insert(EdnsOption::Unknown(code, vec![0; 4]));
            let m = query("a.test.", RecordType::A, Some(e));
            assert!(question(&m).is_none(), "{code}");
        }
        // An option longer than the record.
        assert!(with(&|m| {
            m.extend_from_slice(&[0, 10, 0, 9, 1]);
            let len = m.len() - opt - 11;
            m[opt + 10] = len as u8;
        }));
        // A name of 255 bytes is one, of 256 is not.
        let named = |last: usize| {
            let mut m = vec![0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
            for len in [63, 63, 63, last] {
                m.push(len as u8);
                m.extend(std::iter::repeat_n(b'a', len));
            }
            m.extend_from_slice(&[0, 0, 1, 0, 1]);
            m
        };
        same_as_hickory(&named(61));
        assert!(question(&named(62)).is_none());
        assert!(as_hickory_reads(&named(62)).is_none());
    }

    #[test]
    fn a_pointer_loop_ends() {
        // A response whose answer's owner points at itself.
        let mut m = vec![0, 1, 0x81, 0x80, 0, 0, 0, 1, 0, 0, 0, 0];
        m.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 198, 18, 2, 10]);
        assert_eq!(ttl_offsets(&m), Some(vec![18]));
        // Counts far beyond the bytes.
        m[7] = 0xff;
        assert_eq!(ttl_offsets(&m), None);
        assert_eq!(ttl_offsets(&[0xff; 40]), None);
    }

    /// A response to `q` as the shim's encoder would build it.
    fn response(q: &[u8], ttl: u32, ttl_a: u32) -> Vec<u8> {
        let req = Message::from_vec(q).unwrap();
        let mut m = Message::response(req.metadata.id, OpCode::Query);
        m.metadata.message_type = MessageType::Response;
        m.add_query(req.queries[0].clone());
        // Owners unlike the question's name: hickory's Message (unlike
        // the shim's encoder) compresses against the question.
        let owner = Name::from_ascii("www.cdn.example.").unwrap();
        let cdn = Name::from_ascii("edge.cdn.example.").unwrap();
        m.add_answer(Record::from_rdata(
            owner,
            ttl,
            RData::CNAME(CNAME(cdn.clone())),
        ));
        m.add_answer(Record::from_rdata(
            cdn,
            ttl_a,
            RData::A(A::new(198, 18, 2, 10)),
        ));
        m.edns = req.edns.clone();
        m.to_vec().unwrap()
    }

    #[test]
    fn patched_responses_are_the_encoded_ones() {
        let first = query("allowed.test.", RecordType::A, Some(edns(1232)));
        let q = question(&first).unwrap();
        let wire = Wire::new(q.shape, false, response(&first, 300, 150), q.section.len()).unwrap();
        assert_eq!(wire.answer(&q, 0).unwrap(), response(&first, 300, 150));
        // Another id, the name in mixed case, 100 s later.
        let mut other = query("AlLoWeD.tEsT.", RecordType::A, Some(edns(1232)));
        other[..2].copy_from_slice(&[0x12, 0x34]);
        let o = question(&other).unwrap();
        assert_eq!(o.shape, q.shape);
        let got = wire.answer(&o, 100).unwrap();
        assert_eq!(got, response(&other, 200, 50));
        let m = Message::from_vec(&got).unwrap();
        assert_eq!(m.metadata.id, 0x1234);
        assert_eq!(m.queries[0].name().to_ascii(), "AlLoWeD.tEsT.");
        assert_eq!(m.answers[1].ttl, 50);
        assert_eq!(m.edns.as_ref().unwrap().max_payload(), 1232);
        // Counted down to 0, never below.
        let late = Message::from_vec(&wire.answer(&o, 10_000).unwrap()).unwrap();
        assert!(late.answers.iter().all(|r| r.ttl == 0));
        // Another question length is not this answer.
        let longer = query("allowed.test.x.", RecordType::A, Some(edns(1232)));
        assert!(wire.answer(&question(&longer).unwrap(), 0).is_none());
        // Not a response to one question: no wire.
        assert!(Wire::new(q.shape, false, vec![0; 12], q.section.len()).is_none());
        assert!(Wire::new(q.shape, false, response(&first, 1, 1), 3).is_none());
    }
}
