//! The netfilter log (NFLOG) wire format, purely: the configuration
//! messages Palisade sends to bind a group, and the packets the kernel
//! sends back, read down to what a bypass record names (addresses,
//! protocol, ports). Bytes in, values out; nothing here touches a socket,
//! and no input makes it panic (`fuzz/fuzz_targets/nflog.rs`).
//!
//! A datagram from the kernel holds netlink messages one after another
//! (`nlmsghdr`: length, type, flags, sequence, port id, in host order,
//! each padded to 4 bytes). An NFLOG packet message (type
//! `NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_PACKET`) carries an `nfgenmsg`
//! (family, version, group in network order) and then attributes
//! (`nlattr`: length, type, padded to 4): `NFULA_PACKET_HDR` (the hardware
//! protocol), `NFULA_PREFIX` (the rule's `log prefix`, NUL-terminated) and
//! `NFULA_PAYLOAD` (the packet from its IP header, as much of it as the
//! copy range lets through). Only the IP and TCP/UDP headers are read; an
//! IPv6 packet's extension headers are skipped (at most
//! [`MAX_EXTENSION_HEADERS`]). The layouts are those of the kernel's uapi
//! headers `linux/netlink.h`, `linux/netfilter/nfnetlink.h` and
//! `linux/netfilter/nfnetlink_log.h`.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// `NETLINK_NETFILTER`, the netlink protocol of nfnetlink.
pub(crate) const NETLINK_NETFILTER: i32 = 12;
/// `NFNL_SUBSYS_ULOG`: the log subsystem.
const NFNL_SUBSYS_ULOG: u16 = 4;
/// A logged packet.
const NFULNL_MSG_PACKET: u16 = 0;
/// A configuration request.
const NFULNL_MSG_CONFIG: u16 = 1;
/// `NLMSG_ERROR`: an error, or (error 0) an acknowledgement.
const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`, the end of a multipart answer.
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
/// The length of `nlmsghdr`.
const NLMSG_HDRLEN: usize = 16;
/// The length of `nfgenmsg`.
const NFGENMSG_LEN: usize = 4;
/// Attribute type bits that are flags, not the type.
const NLA_TYPE_MASK: u16 = !(0x8000 | 0x4000);

/// Packet attributes read.
const NFULA_PACKET_HDR: u16 = 1;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

/// Configuration attributes sent.
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_TIMEOUT: u16 = 4;

/// Configuration commands.
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_CFG_CMD_PF_BIND: u8 = 3;
/// Copy the packet (up to the copy range), not only its metadata.
const NFULNL_COPY_PACKET: u8 = 2;

/// Bytes of each packet the kernel is asked to copy: an IPv6 header with
/// a few extension headers and the first bytes of TCP or UDP.
pub(crate) const COPY_RANGE: u32 = 128;
/// IPv6 extension headers skipped before giving up on the ports.
pub(crate) const MAX_EXTENSION_HEADERS: usize = 8;
/// Longest prefix kept from `NFULA_PREFIX` (the kernel allows 64 bytes).
const MAX_PREFIX: usize = 64;

/// The transport protocol of a logged packet, as records and metrics name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Proto {
    Tcp,
    Udp,
    Icmp,
    Icmpv6,
    /// Any other IP protocol number.
    Other(u8),
}

impl Proto {
    fn of(number: u8) -> Proto {
        match number {
            6 => Proto::Tcp,
            17 => Proto::Udp,
            1 => Proto::Icmp,
            58 => Proto::Icmpv6,
            n => Proto::Other(n),
        }
    }

    /// The `proto` of a record and of `palisade_bypass_attempts_total`
    /// (bounded: every other protocol is `other`).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
            Proto::Icmpv6 => "icmpv6",
            Proto::Other(_) => "other",
        }
    }
}

/// What one logged packet says about the attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Attempt {
    pub(crate) src: IpAddr,
    pub(crate) dst: IpAddr,
    pub(crate) proto: Proto,
    /// TCP and UDP only, and only when the copied bytes hold them (not in
    /// a later fragment).
    pub(crate) src_port: Option<u16>,
    pub(crate) dst_port: Option<u16>,
    /// The rule's `log prefix`, when it has one.
    pub(crate) prefix: Option<String>,
}

/// One netlink message of a datagram from the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    /// A logged packet.
    Packet(Attempt),
    /// A logged packet whose bytes say too little (no IP header, a
    /// truncated one), with why.
    Unreadable(&'static str),
    /// The answer to request `seq`: 0 for an acknowledgement, else a
    /// (positive) errno.
    Ack { seq: u32, errno: i32 },
    /// Anything else (the end of a multipart answer, other types).
    Other,
}

/// Read every netlink message of `datagram`, in order. Stops at the first
/// header that is malformed (a length shorter than the header, or past
/// the end), since nothing after it can be framed.
pub(crate) fn messages(datagram: &[u8]) -> Vec<Message> {
    let mut out = Vec::new();
    let mut rest = datagram;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32_ne(&rest[0..4]) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            break;
        }
        let kind = u16_ne(&rest[4..6]);
        let seq = u32_ne(&rest[8..12]);
        let body = &rest[NLMSG_HDRLEN..len];
        out.push(message(kind, seq, body));
        rest = rest.get(align4(len)..).unwrap_or_default();
    }
    out
}

fn message(kind: u16, seq: u32, body: &[u8]) -> Message {
    match kind {
        NLMSG_ERROR => match body.get(0..4) {
            // The error is a negative errno (0: acknowledged); the
            // request's own header follows, and its sequence number is
            // the one the caller knows.
            Some(e) => {
                let errno = (u32_ne(e) as i32).saturating_neg();
                let seq = body.get(4 + 8..4 + 12).map_or(seq, u32_ne);
                Message::Ack { seq, errno }
            }
            None => Message::Unreadable("truncated netlink error"),
        },
        NLMSG_DONE => Message::Other,
        k if k == (NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_PACKET) => packet(body),
        _ => Message::Other,
    }
}

/// An NFLOG packet message's body: `nfgenmsg`, then attributes.
fn packet(body: &[u8]) -> Message {
    let Some(mut attrs) = body.get(NFGENMSG_LEN..) else {
        return Message::Unreadable("truncated nfgenmsg");
    };
    let (mut payload, mut prefix) = (None, None);
    while attrs.len() >= 4 {
        let len = usize::from(u16_ne(&attrs[0..2]));
        let kind = u16_ne(&attrs[2..4]) & NLA_TYPE_MASK;
        if len < 4 || len > attrs.len() {
            return Message::Unreadable("malformed attribute");
        }
        let value = &attrs[4..len];
        match kind {
            NFULA_PAYLOAD => payload = Some(value),
            NFULA_PREFIX => prefix = Some(prefix_text(value)),
            // The hardware protocol says IPv4 or IPv6 as the payload's
            // own version nibble does; the payload is what is read.
            NFULA_PACKET_HDR => {}
            _ => {}
        }
        attrs = attrs.get(align4(len)..).unwrap_or_default();
    }
    let Some(payload) = payload else {
        return Message::Unreadable("no payload (is the copy mode packet?)");
    };
    match ip_packet(payload) {
        Ok(mut attempt) => {
            attempt.prefix = prefix.filter(|p| !p.is_empty());
            Message::Packet(attempt)
        }
        Err(why) => Message::Unreadable(why),
    }
}

/// The prefix up to its NUL, bounded, with anything unprintable replaced.
fn prefix_text(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    value[..end.min(MAX_PREFIX)]
        .iter()
        .map(|b| {
            if b.is_ascii_graphic() || *b == b' ' {
                char::from(*b)
            } else {
                '?'
            }
        })
        .collect()
}

/// An IPv4 or IPv6 packet from its IP header: addresses, protocol, ports.
pub(crate) fn ip_packet(p: &[u8]) -> Result<Attempt, &'static str> {
    match p.first().map(|b| b >> 4) {
        Some(4) => ipv4(p),
        Some(6) => ipv6(p),
        Some(_) => Err("not an IP packet"),
        None => Err("empty payload"),
    }
}

fn ipv4(p: &[u8]) -> Result<Attempt, &'static str> {
    if p.len() < 20 {
        return Err("truncated IPv4 header");
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    if ihl < 20 {
        return Err("bad IPv4 header length");
    }
    let proto = Proto::of(p[9]);
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    // A later fragment carries no transport header.
    let offset = u16::from_be_bytes([p[6], p[7]]) & 0x1fff;
    let ports = if offset == 0 {
        ports(proto, p.get(ihl..))
    } else {
        None
    };
    Ok(attempt(src.into(), dst.into(), proto, ports))
}

fn ipv6(p: &[u8]) -> Result<Attempt, &'static str> {
    if p.len() < 40 {
        return Err("truncated IPv6 header");
    }
    let mut octets = [0u8; 16];
    octets.copy_from_slice(&p[8..24]);
    let src = Ipv6Addr::from(octets);
    octets.copy_from_slice(&p[24..40]);
    let dst = Ipv6Addr::from(octets);
    let (mut next, mut at) = (p[6], 40usize);
    for _ in 0..MAX_EXTENSION_HEADERS {
        match next {
            // Hop-by-hop, routing, destination options: length in 8-byte
            // units beyond the first 8.
            0 | 43 | 60 => {
                let Some(h) = p.get(at..at + 2) else {
                    return Ok(attempt(src.into(), dst.into(), Proto::of(next), None));
                };
                next = h[0];
                at += (usize::from(h[1]) + 1) * 8;
            }
            // Fragment: 8 bytes; a later fragment carries no transport header.
            44 => {
                let Some(h) = p.get(at..at + 8) else {
                    return Ok(attempt(src.into(), dst.into(), Proto::of(next), None));
                };
                next = h[0];
                at += 8;
                if u16::from_be_bytes([h[2], h[3]]) >> 3 != 0 {
                    return Ok(attempt(src.into(), dst.into(), Proto::of(next), None));
                }
            }
            _ => {
                let proto = Proto::of(next);
                return Ok(attempt(
                    src.into(),
                    dst.into(),
                    proto,
                    ports(proto, p.get(at..)),
                ));
            }
        }
    }
    Ok(attempt(src.into(), dst.into(), Proto::of(next), None))
}

/// Source and destination port of a TCP or UDP header's first bytes.
fn ports(proto: Proto, l4: Option<&[u8]>) -> Option<(u16, u16)> {
    match proto {
        Proto::Tcp | Proto::Udp => {
            let h = l4?.get(0..4)?;
            Some((
                u16::from_be_bytes([h[0], h[1]]),
                u16::from_be_bytes([h[2], h[3]]),
            ))
        }
        _ => None,
    }
}

fn attempt(src: IpAddr, dst: IpAddr, proto: Proto, ports: Option<(u16, u16)>) -> Attempt {
    Attempt {
        src,
        dst,
        proto,
        src_port: ports.map(|p| p.0),
        dst_port: ports.map(|p| p.1),
        prefix: None,
    }
}

/// The configuration requests that bind `group` for this socket, each
/// asking for an acknowledgement, numbered from `seq`: bind the IPv4 and
/// IPv6 families to the log subsystem (a no-op on recent kernels, needed
/// on old ones), bind the group, ask for packets (copy mode `packet`,
/// [`COPY_RANGE`] bytes each) and for batches to be sent within a tenth
/// of a second.
pub(crate) fn bind_requests(group: u16, seq: u32) -> Vec<(u32, Vec<u8>)> {
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend([NFULNL_COPY_PACKET, 0]);
    let steps: [(u8, u16, u16, Vec<u8>); 5] = [
        (AF_INET, 0, NFULA_CFG_CMD, vec![NFULNL_CFG_CMD_PF_BIND]),
        (AF_INET6, 0, NFULA_CFG_CMD, vec![NFULNL_CFG_CMD_PF_BIND]),
        (0, group, NFULA_CFG_CMD, vec![NFULNL_CFG_CMD_BIND]),
        (0, group, NFULA_CFG_MODE, mode),
        // In hundredths of a second.
        (0, group, NFULA_CFG_TIMEOUT, 10u32.to_be_bytes().to_vec()),
    ];
    steps
        .into_iter()
        .zip(seq..)
        .map(|((family, res_id, attr, value), seq)| {
            (seq, config_request(seq, family, res_id, attr, &value))
        })
        .collect()
}

/// One `NFULNL_MSG_CONFIG` request with one attribute.
fn config_request(seq: u32, family: u8, res_id: u16, attr: u16, value: &[u8]) -> Vec<u8> {
    let attr_len = 4 + value.len();
    let len = NLMSG_HDRLEN + NFGENMSG_LEN + align4(attr_len);
    let mut m = Vec::with_capacity(len);
    m.extend((len as u32).to_ne_bytes());
    m.extend((NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_CONFIG).to_ne_bytes());
    m.extend((NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m.extend(seq.to_ne_bytes());
    // Port id 0: the kernel fills in the socket's own.
    m.extend(0u32.to_ne_bytes());
    // nfgenmsg: family, NFNETLINK_V0, the group in network order.
    m.extend([family, 0]);
    m.extend(res_id.to_be_bytes());
    m.extend((attr_len as u16).to_ne_bytes());
    m.extend(attr.to_ne_bytes());
    m.extend(value);
    m.resize(len, 0);
    m
}

fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

fn u16_ne(b: &[u8]) -> u16 {
    u16::from_ne_bytes([b[0], b[1]])
}

fn u32_ne(b: &[u8]) -> u32 {
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

/// Test and fuzz seeds: one NFLOG packet message carrying `payload`.
#[cfg(test)]
pub(crate) fn packet_message(group: u16, prefix: &str, payload: &[u8]) -> Vec<u8> {
    let mut attrs = Vec::new();
    let mut attr = |kind: u16, value: &[u8]| {
        let len = 4 + value.len();
        attrs.extend((len as u16).to_ne_bytes());
        attrs.extend(kind.to_ne_bytes());
        attrs.extend(value);
        attrs.resize(align4(attrs.len()), 0);
    };
    let hw = if payload.first().map(|b| b >> 4) == Some(6) {
        0x86ddu16
    } else {
        0x0800
    };
    let mut hdr = hw.to_be_bytes().to_vec();
    hdr.extend([0, 0]);
    attr(NFULA_PACKET_HDR, &hdr);
    let mut p = prefix.as_bytes().to_vec();
    p.push(0);
    attr(NFULA_PREFIX, &p);
    attr(NFULA_PAYLOAD, payload);
    let len = NLMSG_HDRLEN + NFGENMSG_LEN + attrs.len();
    let mut m = Vec::new();
    m.extend((len as u32).to_ne_bytes());
    m.extend((NFNL_SUBSYS_ULOG << 8 | NFULNL_MSG_PACKET).to_ne_bytes());
    m.extend(0u16.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m.extend([2, 0]);
    m.extend(group.to_be_bytes());
    m.extend(attrs);
    m
}

/// Test and fuzz seeds: an IPv4 packet's first bytes.
#[cfg(test)]
pub(crate) fn ipv4_header(
    proto: u8,
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
) -> Vec<u8> {
    let mut p = vec![0x45, 0, 0, 28, 0, 0, 0x40, 0, 64, proto, 0, 0];
    p.extend(src);
    p.extend(dst);
    p.extend(sport.to_be_bytes());
    p.extend(dport.to_be_bytes());
    p.extend([0, 8, 0, 0]);
    p
}

/// Test and fuzz seeds: an IPv6 packet's first bytes, with a
/// destination-options header before UDP.
#[cfg(test)]
pub(crate) fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, dport: u16) -> Vec<u8> {
    let mut p = vec![0x60, 0, 0, 0, 0, 16, 60, 64];
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend([17, 0, 1, 4, 0, 0, 0, 0]);
    p.extend(40000u16.to_be_bytes());
    p.extend(dport.to_be_bytes());
    p.extend([0, 8, 0, 0]);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(datagram: &[u8]) -> Message {
        let m = messages(datagram);
        assert_eq!(m.len(), 1, "{m:?}");
        m.into_iter().next().unwrap()
    }

    #[test]
    fn a_logged_udp_packet_names_addresses_protocol_and_ports() {
        let ip = ipv4_header(17, [198, 18, 1, 2], [198, 18, 2, 10], 40000, 443);
        let m = one(&packet_message(100, "palisade-bypass ", &ip));
        assert_eq!(
            m,
            Message::Packet(Attempt {
                src: "198.18.1.2".parse().unwrap(),
                dst: "198.18.2.10".parse().unwrap(),
                proto: Proto::Udp,
                src_port: Some(40000),
                dst_port: Some(443),
                prefix: Some("palisade-bypass ".into()),
            })
        );
    }

    #[test]
    fn ipv6_extension_headers_are_skipped_and_fragments_have_no_ports() {
        let (a, b): (Ipv6Addr, Ipv6Addr) = (
            "2001:2::2".parse().unwrap(),
            "2001:2:0:2::10".parse().unwrap(),
        );
        let Message::Packet(p) = one(&packet_message(1, "", &ipv6_header(a, b, 443))) else {
            panic!()
        };
        assert_eq!((p.src, p.dst), (a.into(), b.into()));
        assert_eq!(
            (p.proto, p.dst_port, p.prefix),
            (Proto::Udp, Some(443), None)
        );

        // A later IPv4 fragment: protocol, no ports.
        let mut ip = ipv4_header(6, [198, 18, 1, 2], [198, 18, 1, 1], 1, 22);
        ip[6] = 0x00;
        ip[7] = 0x10;
        let Message::Packet(p) = one(&packet_message(1, "", &ip)) else {
            panic!()
        };
        assert_eq!((p.proto, p.dst_port), (Proto::Tcp, None));
        // ICMP: no ports.
        let ip = ipv4_header(1, [198, 18, 1, 2], [198, 18, 2, 10], 0x0800, 0);
        let Message::Packet(p) = one(&packet_message(1, "", &ip)) else {
            panic!()
        };
        assert_eq!((p.proto.as_str(), p.dst_port), ("icmp", None));
        assert_eq!(Proto::of(47).as_str(), "other");
    }

    #[test]
    fn every_prefix_of_a_datagram_is_read_without_panicking() {
        let ip = ipv4_header(17, [198, 18, 1, 2], [198, 18, 2, 10], 40000, 443);
        let one = packet_message(100, "x", &ip);
        let two = [one.clone(), one.clone()].concat();
        assert_eq!(messages(&two).len(), 2);
        for n in 0..two.len() {
            let got = messages(&two[..n]);
            assert!(got.len() <= 2);
            // A message is read only once it is whole.
            if n < one.len() {
                assert!(got.is_empty(), "{n}: {got:?}");
            }
        }
        // Truncated payloads say why.
        for n in [0, 1, 19] {
            let m = super::messages(&packet_message(1, "", &ip[..n]));
            assert!(matches!(m[0], Message::Unreadable(_)), "{n}: {m:?}");
        }
    }

    #[test]
    fn acknowledgements_and_errors_carry_the_requests_sequence() {
        let requests = bind_requests(7, 40);
        assert_eq!(requests.len(), 5);
        assert_eq!(requests[2].0, 42);
        for (seq, req) in &requests {
            assert_eq!(req.len() % 4, 0);
            assert_eq!(u32_ne(&req[0..4]) as usize, req.len());
            assert_eq!(u32_ne(&req[8..12]), *seq);
            // The group, in network order, in nfgenmsg.
            assert!(req[18..20] == [0, 0] || req[18..20] == 7u16.to_be_bytes());
        }
        // An error answer: -EBUSY, then the request's header.
        let mut e = Vec::new();
        let len = (NLMSG_HDRLEN + 4 + NLMSG_HDRLEN) as u32;
        e.extend(len.to_ne_bytes());
        e.extend(NLMSG_ERROR.to_ne_bytes());
        e.extend(0u16.to_ne_bytes());
        e.extend(42u32.to_ne_bytes());
        e.extend(0u32.to_ne_bytes());
        e.extend((-16i32).to_ne_bytes());
        e.extend(&requests[2].1[..NLMSG_HDRLEN]);
        assert_eq!(one(&e), Message::Ack { seq: 42, errno: 16 });
    }
}
