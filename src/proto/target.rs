//! Target host and port normalisation.
//!
//! A security boundary: allowlists match on [`Host`], so every spelling of
//! one host (case, trailing dot, IDN, fullwidth forms, inet_aton IPv4, IPv6
//! text forms, IPv4-mapped IPv6) must normalise to one value, and anything
//! ambiguous is an error rather than a name.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use idna::uts46::{AsciiDenyList, DnsLength, Hyphens, Uts46};

/// Longest host name in presentation form without the trailing dot (RFC 1035 §2.3.4).
pub const MAX_NAME_LEN: usize = 253;
/// Longest label (RFC 1035 §2.3.4).
pub const MAX_LABEL_LEN: usize = 63;
/// Raw inputs longer than this are rejected before IDNA mapping (a 253-byte
/// name needs at most 4 UTF-8 bytes per character).
const MAX_INPUT_LEN: usize = 4 * MAX_NAME_LEN + 4;
/// Offending values are cut to this many characters in error messages.
const SHOWN_LEN: usize = 300;

/// A normalised target host.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// Normalised ASCII name: lowercase, no trailing dot, IDN as punycode A-labels.
    Name(String),
    /// Any IP literal spelling, canonicalised. IPv4-mapped IPv6 (::ffff:a.b.c.d) becomes V4.
    Ip(IpAddr),
}

impl Host {
    /// The text [`fmt::Display`] writes, a name copied as it is (every
    /// record of a connection carries its host).
    pub fn text(&self) -> String {
        match self {
            Host::Name(n) => n.clone(),
            Host::Ip(ip) => ip.to_string(),
        }
    }
}

impl fmt::Display for Host {
    /// Name as is; IPv4 dotted; IPv6 in RFC 5952 text without brackets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Scheme of an `http://` or `https://` explain target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `http://`, default port 80.
    Http,
    /// `https://`, default port 443.
    Https,
}

/// The TARGET argument of `palisade explain`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExplainTarget {
    /// `host:port`, `ip:port`, `[v6]:port`, `http://host[:port]/path` (default 80), `https://host[:port]/path` (default 443)
    Tcp {
        host: Host,
        port: u16,
        scheme: Option<Scheme>,
    },
    /// dns:NAME (qtype "A") or dns:NAME/TYPE; qtype uppercased, alphanumeric, 1..=10 chars.
    Dns { name: Host, qtype: String },
}

/// Why a host, authority or explain target was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("empty host")]
    EmptyHost,
    #[error("invalid host name {0:?}: longer than {MAX_INPUT_LEN} bytes")]
    InputTooLong(String),
    #[error("invalid host name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("invalid IPv4 address {0:?}")]
    InvalidIpv4(String),
    #[error("invalid IPv6 address {0:?}")]
    InvalidIpv6(String),
    #[error("invalid host {0:?}: IPv6 zone ids are not allowed")]
    ZoneId(String),
    #[error("invalid authority {0:?}: userinfo ('@') is not allowed")]
    Userinfo(String),
    #[error("invalid authority {0:?}: IPv6 addresses must be in brackets")]
    UnbracketedIpv6(String),
    #[error("invalid authority {0:?}: missing port")]
    MissingPort(String),
    #[error("invalid authority {0:?}: port must be 1..=65535")]
    InvalidPort(String),
    #[error("invalid authority {0:?}: unexpected text after ']'")]
    TrailingAfterBracket(String),
    #[error("invalid dns target {0:?}: query name must be a host name, not an IP address")]
    DnsIpLiteral(String),
    #[error("invalid dns target {0:?}: query type must be 1..=10 ASCII letters or digits")]
    InvalidQtype(String),
}

/// Cut an offending value for an error message.
fn shown(s: &str) -> String {
    s.chars().take(SHOWN_LEN).collect()
}

fn bad_name(name: &str, reason: &'static str) -> TargetError {
    TargetError::InvalidName {
        name: shown(name),
        reason,
    }
}

/// Normalise a host as it appears in a URL authority, CONNECT target, Host header or SNI (no port).
/// Accepts bracketed IPv6 `"[::1]"` and bare IPv6 "::1". Rejects zone ids, empty, >253 chars, labels >63, chars outside `[a-z0-9-_]` after IDNA, '*'.
pub fn normalize_host(input: &str) -> Result<Host, TargetError> {
    if input.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    if input.len() > MAX_INPUT_LEN {
        return Err(TargetError::InputTooLong(shown(input)));
    }
    if let Some(inner) = input.strip_prefix('[') {
        let Some(inner) = inner.strip_suffix(']') else {
            return Err(TargetError::InvalidIpv6(shown(input)));
        };
        return parse_ipv6(inner, input);
    }
    if input.contains(':') {
        return parse_ipv6(input, input);
    }

    // UTS 46 ToASCII: case folding, NFKC width/dot mapping, punycode. No ASCII
    // deny list here: the label check below reports the offending character.
    let mapped = Uts46::new()
        .to_ascii(
            input.as_bytes(),
            AsciiDenyList::EMPTY,
            Hyphens::Allow,
            DnsLength::Ignore,
        )
        .map_err(|_| bad_name(input, "IDNA (UTS 46) mapping failed"))?;
    // Exactly one trailing (root) dot is dropped (RFC 1034 §3.1).
    let name = mapped.strip_suffix('.').unwrap_or(&mapped);
    if name.is_empty() {
        return Err(bad_name(input, "empty name"));
    }

    // WHATWG URL host parser, "ends in a number": such hosts are IPv4 or nothing.
    let last = name.rsplit('.').next().unwrap_or(name);
    if ends_in_number(last) {
        return parse_ipv4_aton(name)
            .map(|v4| Host::Ip(IpAddr::V4(v4)))
            .ok_or_else(|| TargetError::InvalidIpv4(shown(input)));
    }

    validate_name(name, input)?;
    Ok(Host::Name(name.to_owned()))
}

/// `[a-z0-9-_]` labels of 1..=63 chars, at most 253 chars in all (RFC 1035 §2.3.4;
/// '_' is allowed for SRV-style and real-world names, RFC 2181 §11).
fn validate_name(name: &str, input: &str) -> Result<(), TargetError> {
    if name.contains('*') {
        return Err(bad_name(input, "wildcard '*' is not a host"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad_name(input, "longer than 253 characters"));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(bad_name(input, "empty label"));
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(bad_name(input, "label longer than 63 characters"));
        }
        let ok = label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !ok {
            return Err(bad_name(input, "character outside [a-z0-9-_]"));
        }
    }
    Ok(())
}

/// WHATWG URL "ends in a number": all ASCII digits, or "0x"/"0X" then only hex digits.
fn ends_in_number(label: &str) -> bool {
    if !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    match label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"))
    {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => false,
    }
}

/// inet_aton(3) / WHATWG IPv4 parser: 1..=4 parts of decimal, octal (leading 0)
/// or hex (0x); the last part fills the remaining bytes. Overflow is `None`.
fn parse_ipv4_aton(s: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut nums = Vec::with_capacity(parts.len());
    for part in &parts {
        nums.push(parse_ipv4_number(part)?);
    }
    let (last, init) = nums.split_last()?;
    let mut addr: u64 = 0;
    for &n in init {
        if n > 255 {
            return None;
        }
        addr = (addr << 8) | n;
    }
    // The last part holds 5 - parts.len() bytes.
    let rest_bits = 8 * (5 - nums.len() as u32);
    if *last >= 1u64 << rest_bits {
        return None;
    }
    addr = (addr << rest_bits) | last;
    u32::try_from(addr).ok().map(Ipv4Addr::from)
}

/// One inet_aton part: "0x..." hex ("0x" alone is 0, as in WHATWG), "0..." octal, else decimal.
fn parse_ipv4_number(part: &str) -> Option<u64> {
    if part.is_empty() {
        return None;
    }
    let (digits, radix) =
        if let Some(h) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (h, 16)
        } else if let Some(o) = part.strip_prefix('0').filter(|o| !o.is_empty()) {
            (o, 8)
        } else {
            (part, 10)
        };
    let mut n: u64 = 0;
    for c in digits.chars() {
        let d = c.to_digit(radix)?;
        n = n.checked_mul(u64::from(radix))?.checked_add(u64::from(d))?;
        if n > u64::from(u32::MAX) {
            return None;
        }
    }
    Some(n)
}

/// std's RFC 4291 §2.2 text parser; '%' zone ids (RFC 6874) are refused.
fn parse_ipv6(text: &str, input: &str) -> Result<Host, TargetError> {
    if text.contains('%') {
        return Err(TargetError::ZoneId(shown(input)));
    }
    let v6: Ipv6Addr = text
        .parse()
        .map_err(|_| TargetError::InvalidIpv6(shown(input)))?;
    Ok(Host::Ip(match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }))
}

/// Whether `input` (a host as written, no port) is the spelling
/// [`normalize_host`] makes of `host`: a name written exactly as it
/// normalises to (lowercase ASCII, no trailing dot, no IDNA A-label to
/// check again), which it normalises to unchanged. `false` says nothing:
/// other spellings of `host` need [`normalize_host`]. Lets a check of a
/// Host header against the tunnel's host skip the IDNA mapping and the
/// allocation when the client wrote the host as the proxy did.
pub fn is_normal_spelling(input: &str, host: &Host) -> bool {
    match host {
        Host::Name(name) => {
            input == name
                && !name.as_bytes().split(|&b| b == b'.').any(|label| {
                    label
                        .get(..4)
                        .is_some_and(|p| p.eq_ignore_ascii_case(b"xn--"))
                })
        }
        Host::Ip(_) => false,
    }
}

/// Parse "host:port", `"[v6]:port"` (authority-form, no userinfo allowed: '@' is an error). If the port is missing, use default_port or error when None. Port 0 is an error. Non-digit port is an error.
pub fn parse_authority(input: &str, default_port: Option<u16>) -> Result<(Host, u16), TargetError> {
    let (host, port) = split_authority(input, default_port)?;
    Ok((normalize_host(host)?, port))
}

/// [`parse_authority`]'s split: the host as written (brackets kept, not
/// normalised) and the port, under the same rules. For callers that must
/// pass a host on verbatim, such as a probe trying IP spellings.
pub fn split_authority(input: &str, default_port: Option<u16>) -> Result<(&str, u16), TargetError> {
    // Byte searches: these run for every tunnel's Host check.
    if input.as_bytes().contains(&b'@') {
        return Err(TargetError::Userinfo(shown(input)));
    }
    let (host, port) = if input.starts_with('[') {
        let Some(close) = input.find(']') else {
            return Err(TargetError::InvalidIpv6(shown(input)));
        };
        let (host, rest) = input.split_at(close + 1);
        match rest.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if rest.is_empty() => (host, None),
            None => return Err(TargetError::TrailingAfterBracket(shown(input))),
        }
    } else {
        match input.bytes().position(|b| b == b':') {
            None => (input, None),
            Some(colon) => {
                let (host, port) = (&input[..colon], &input[colon + 1..]);
                if port.as_bytes().contains(&b':') {
                    return Err(TargetError::UnbracketedIpv6(shown(input)));
                }
                (host, Some(port))
            }
        }
    };
    if host.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    let port = match port {
        Some(p) => parse_port(p).ok_or_else(|| TargetError::InvalidPort(shown(input)))?,
        None => default_port.ok_or_else(|| TargetError::MissingPort(shown(input)))?,
    };
    if port == 0 {
        return Err(TargetError::InvalidPort(shown(input)));
    }
    Ok((host, port))
}

/// Decimal digits only (RFC 3986 §3.2.3), 1..=65535.
fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse::<u16>().ok().filter(|&n| n != 0)
}

/// IPv4 embedded in an IPv6 address that, when dialled, really reaches that IPv4 host:
/// IPv4-compatible ::a.b.c.d (::/96, excluding :: and ::1), SIIT IPv4-translated
/// ::ffff:0:a.b.c.d (::ffff:0:0:0/96, RFC 2765), NAT64 well-known prefix 64:ff9b::/96 (RFC 6052),
/// NAT64 local-use prefix 64:ff9b:1::/48 (RFC 8215; the last 32 bits, as in the /96 format),
/// 6to4 2002:AABB:CCDD::/16 (RFC 3056, bits 16..48), Teredo 2001:0000::/32 (RFC 4380: client address = last 32 bits XOR 0xffffffff).
/// (IPv4-mapped ::ffff:0:0/96 is also returned, though normalize_host already canonicalises it to V4.)
pub fn embedded_ipv4(addr: &Ipv6Addr) -> Option<Ipv4Addr> {
    let s = addr.segments();
    let o = addr.octets();
    let low32 = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    match s {
        // IPv4-mapped (RFC 4291 §2.5.5.2).
        [0, 0, 0, 0, 0, 0xffff, _, _] => Some(low32),
        // SIIT IPv4-translated (RFC 2765 §2.1): ::ffff:0:a.b.c.d.
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some(low32),
        // :: and ::1 are unspecified and loopback, not IPv4 (RFC 4291 §2.5.2, §2.5.3).
        [0, 0, 0, 0, 0, 0, 0, 0] | [0, 0, 0, 0, 0, 0, 0, 1] => None,
        // IPv4-compatible (RFC 4291 §2.5.5.1, deprecated but still routable by some stacks).
        [0, 0, 0, 0, 0, 0, _, _] => Some(low32),
        // NAT64 well-known prefix 64:ff9b::/96 (RFC 6052 §2.1).
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low32),
        // NAT64 local-use prefix 64:ff9b:1::/48 (RFC 8215 §3). Sites pick
        // the prefix length; the whole /48 is always-denied in the policy,
        // and the last 32 bits (the /96 format) are checked as well.
        [0x64, 0xff9b, 1, ..] => Some(low32),
        // 6to4: 2002:V4ADDR::/48 (RFC 3056 §2).
        [0x2002, ..] => Some(Ipv4Addr::new(o[2], o[3], o[4], o[5])),
        // Teredo 2001:0::/32: obfuscated client address in the last 32 bits (RFC 4380 §4).
        [0x2001, 0, ..] => Some(Ipv4Addr::from(u32::from(low32) ^ 0xffff_ffff)),
        _ => None,
    }
}

/// IPv4 embedded in an ISATAP interface identifier (RFC 5214 §6.1): any
/// prefix, then `0000:5efe:a.b.c.d` or, with the "u" bit set for a global
/// IPv4 address, `0200:5efe:a.b.c.d`. An ISATAP router delivers such an
/// address to that IPv4 host, so the policy judges it by it. The "g" bit
/// is ignored as well (`0100:5efe`, `0300:5efe`): matching more forms only
/// denies more.
pub fn isatap_ipv4(addr: &Ipv6Addr) -> Option<Ipv4Addr> {
    let s = addr.segments();
    let o = addr.octets();
    (s[4] & !0x0300 == 0 && s[5] == 0x5efe).then(|| Ipv4Addr::new(o[12], o[13], o[14], o[15]))
}

/// Every IPv4 address an IPv6 address reaches when dialled: the prefix
/// form of [`embedded_ipv4`] and the ISATAP interface identifier of
/// [`isatap_ipv4`] (an address can carry both, e.g. 6to4 with an ISATAP
/// suffix), each once.
pub fn embedded_ipv4s(addr: &Ipv6Addr) -> impl Iterator<Item = Ipv4Addr> + Clone {
    let prefix = embedded_ipv4(addr);
    let isatap = isatap_ipv4(addr).filter(|v4| prefix != Some(*v4));
    prefix.into_iter().chain(isatap)
}

/// Parse the TARGET of `palisade explain`.
///
/// `http://`/`https://` (case-insensitive) URLs: the authority ends at the first
/// '/', '?', '#' or '\\' (WHATWG treats '\\' as '/' for special schemes), and the
/// host is the part after the last '@'. `dns:` (case-insensitive) selects a DNS
/// query. Anything else is authority form with a required port.
pub fn parse_explain_target(input: &str) -> Result<ExplainTarget, TargetError> {
    for (prefix, scheme, default) in [
        ("http://", Scheme::Http, 80),
        ("https://", Scheme::Https, 443),
    ] {
        if let Some(rest) = strip_prefix_ci(input, prefix) {
            let end = rest.find(['/', '?', '#', '\\']).unwrap_or(rest.len());
            let authority = rest.get(..end).unwrap_or(rest);
            let hostport = authority.rsplit('@').next().unwrap_or(authority);
            let (host, port) = parse_authority(hostport, Some(default))?;
            return Ok(ExplainTarget::Tcp {
                host,
                port,
                scheme: Some(scheme),
            });
        }
    }
    if let Some(rest) = strip_prefix_ci(input, "dns:") {
        let (name, qtype) = match rest.split_once('/') {
            Some((name, qtype)) => (name, qtype),
            None => (rest, "A"),
        };
        if qtype.is_empty() || qtype.len() > 10 || !qtype.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(TargetError::InvalidQtype(shown(input)));
        }
        let name = normalize_host(name)?;
        if matches!(name, Host::Ip(_)) {
            return Err(TargetError::DnsIpLiteral(shown(input)));
        }
        return Ok(ExplainTarget::Dns {
            name,
            qtype: qtype.to_ascii_uppercase(),
        });
    }
    let (host, port) = parse_authority(input, None)?;
    Ok(ExplainTarget::Tcp {
        host,
        port,
        scheme: None,
    })
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        s.get(prefix.len()..)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Host {
        Host::Name(s.to_owned())
    }
    fn v4(a: u8, b: u8, c: u8, d: u8) -> Host {
        Host::Ip(IpAddr::V4(Ipv4Addr::new(a, b, c, d)))
    }
    fn v6(s: &str) -> Host {
        Host::Ip(IpAddr::V6(s.parse().unwrap()))
    }
    fn ok(s: &str) -> Host {
        normalize_host(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }
    fn err(s: &str) -> TargetError {
        match normalize_host(s) {
            Ok(h) => panic!("{s:?} accepted as {h:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn the_text_of_a_host_is_its_display_and_its_own_spelling_is_normal() {
        for input in [
            "a.test",
            "xn--bcher-kva.example",
            "10.0.0.1",
            "[2001:db8::1]",
            "::ffff:1.2.3.4",
        ] {
            let host = normalize_host(input).unwrap();
            assert_eq!(host.text(), host.to_string(), "{input}");
            let normal = is_normal_spelling(&host.text(), &host);
            // A name (but an A-label) is written as it normalises; an
            // address is always normalised again.
            let expect = matches!(&host, Host::Name(n) if !n.starts_with("xn--"));
            assert_eq!(normal, expect, "{input}");
            if normal {
                assert_eq!(normalize_host(&host.text()).unwrap(), host, "{input}");
            }
        }
        assert!(!is_normal_spelling("A.test", &name("a.test")));
        assert!(!is_normal_spelling("a.test.", &name("a.test")));
        assert!(!is_normal_spelling("b.test", &name("a.test")));
    }

    #[test]
    fn names() {
        assert_eq!(ok("Example.COM."), name("example.com"));
        assert_eq!(ok("example.com"), name("example.com"));
        assert_eq!(ok("a_b.example.com"), name("a_b.example.com"));
        assert_eq!(ok("localhost"), name("localhost"));
        assert_eq!(ok("1.2.3.com"), name("1.2.3.com"));
        assert_eq!(ok("1.0x1g"), name("1.0x1g"));
        assert_eq!(ok("0xg"), name("0xg"));
    }

    #[test]
    fn trailing_dots() {
        assert_eq!(ok("a.com."), name("a.com"));
        assert!(matches!(
            err("a.com.."),
            TargetError::InvalidName {
                reason: "empty label",
                ..
            }
        ));
        assert!(matches!(err("."), TargetError::InvalidName { .. }));
        assert!(matches!(err(".a.com"), TargetError::InvalidName { .. }));
    }

    #[test]
    fn idna() {
        assert_eq!(ok("bücher.de"), name("xn--bcher-kva.de"));
        assert_eq!(ok("BÜCHER.DE"), name("xn--bcher-kva.de"));
        assert_eq!(ok("xn--bcher-kva.de"), name("xn--bcher-kva.de"));
        // Fullwidth letters and ideographic full stop (UTS 46 mapping).
        assert_eq!(ok("ｅｘａｍｐｌｅ。ｃｏｍ"), name("example.com"));
        assert_eq!(ok("example。com。"), name("example.com"));
        assert_eq!(ok("１２７.０.０.１"), v4(127, 0, 0, 1));
        assert_eq!(ok("１２７。０。０。１"), v4(127, 0, 0, 1));
        // Invalid punycode.
        err("xn--a.com");
    }

    #[test]
    fn bad_names() {
        assert_eq!(err(""), TargetError::EmptyHost);
        assert_eq!(
            err("a..b").to_string(),
            "invalid host name \"a..b\": empty label"
        );
        assert!(err("*.a.com").to_string().contains("wildcard"));
        err("a b.com");
        err("a/b.com");
        err("a%2e.com");
        err("a\0.com");
        err("[a.com]");
        err("a.com:80");
        let label63 = "a".repeat(63);
        assert_eq!(
            ok(&format!("{label63}.com")),
            name(&format!("{label63}.com"))
        );
        let label64 = "a".repeat(64);
        assert!(err(&format!("{label64}.com"))
            .to_string()
            .contains("label longer"));
        // 253 chars ok, 254 not.
        let l = "a".repeat(62);
        let n253 = format!("{l}.{l}.{l}.{l}.b");
        assert_eq!(n253.len(), 253);
        assert_eq!(ok(&n253), name(&n253));
        assert_eq!(ok(&format!("{n253}.")), name(&n253));
        let n254 = format!("{l}.{l}.{l}.{l}.bc");
        assert!(err(&n254).to_string().contains("longer than 253"));
        assert!(matches!(
            err(&"a".repeat(5000)),
            TargetError::InputTooLong(_)
        ));
    }

    #[test]
    fn ipv4_spellings() {
        let lo = v4(127, 0, 0, 1);
        for s in [
            "127.0.0.1",
            "127.0.0.1.",
            "127.1",
            "127.0.1",
            "0x7f000001",
            "0X7F000001",
            "2130706433",
            "017700000001",
            "0177.0.0.1",
            "0177.0.0.01",
            "0x7f.1",
            "127.0.0.0x1",
            "0x7f.0.0.0x1",
        ] {
            assert_eq!(ok(s), lo, "{s}");
        }
        assert_eq!(ok("0"), v4(0, 0, 0, 0));
        assert_eq!(ok("0x"), v4(0, 0, 0, 0));
        assert_eq!(ok("4294967295"), v4(255, 255, 255, 255));
        assert_eq!(ok("169.254.43518"), v4(169, 254, 169, 254));
        assert_eq!(ok("1.2.3.4"), v4(1, 2, 3, 4));
    }

    #[test]
    fn ipv4_errors() {
        for s in [
            "4294967296",
            "1.2.3.4.5",
            "0x1g.1",
            "256.1.1.1",
            "1.256.1.1",
            "1.2.3.256",
            "1.2.65536",
            "1.16777216",
            "08.1.1.1",
            "1..1",
            "a.1",
            "a.b.0x",
            "99999999999999999999999999",
        ] {
            assert!(
                matches!(err(s), TargetError::InvalidIpv4(_)),
                "{s} should be an invalid IPv4"
            );
        }
    }

    #[test]
    fn ipv6() {
        assert_eq!(ok("::ffff:127.0.0.1"), v4(127, 0, 0, 1));
        assert_eq!(ok("[::ffff:7f00:1]"), v4(127, 0, 0, 1));
        assert_eq!(ok("[::1]"), v6("::1"));
        assert_eq!(ok("::1"), v6("::1"));
        assert_eq!(ok("[2001:DB8:0:0:0:0:0:1]"), v6("2001:db8::1"));
        assert_eq!(ok("64:ff9b::a9fe:a9fe"), v6("64:ff9b::a9fe:a9fe"));
        assert!(matches!(err("fe80::1%eth0"), TargetError::ZoneId(_)));
        assert!(matches!(err("[fe80::1%25eth0]"), TargetError::ZoneId(_)));
        err("[::1");
        err("[]");
        err("[1.2.3.4]");
        err(":::1");
        err("[::1]:80");
        assert_eq!(
            ok("2001:db8:0:0:1:0:0:1").to_string(),
            "2001:db8::1:0:0:1",
            "RFC 5952 text"
        );
    }

    #[test]
    fn embedded() {
        let e = |s: &str| embedded_ipv4(&s.parse().unwrap());
        let md = Some(Ipv4Addr::new(169, 254, 169, 254));
        assert_eq!(e("64:ff9b::a9fe:a9fe"), md);
        assert_eq!(e("64:ff9b::169.254.169.254"), md);
        assert_eq!(e("2002:a9fe:a9fe::1"), md);
        assert_eq!(e("::169.254.169.254"), md);
        assert_eq!(e("::ffff:169.254.169.254"), md);
        // RFC 4380 §4 example: client 192.0.2.45 behind server 65.54.227.120.
        assert_eq!(
            e("2001:0000:4136:e378:8000:63bf:3fff:fdd2"),
            Some(Ipv4Addr::new(192, 0, 2, 45))
        );
        assert_eq!(e("::"), None);
        assert_eq!(e("::1"), None);
        assert_eq!(e("::2"), Some(Ipv4Addr::new(0, 0, 0, 2)));
        assert_eq!(e("2001:db8::1"), None);
        assert_eq!(e("2001:1::1"), None);
        // SIIT IPv4-translated and the local-use NAT64 prefix (last 32 bits).
        assert_eq!(e("::ffff:0:169.254.169.254"), md);
        assert_eq!(e("::ffff:0:a9fe:a9fe"), md);
        assert_eq!(e("64:ff9b:1::a9fe:a9fe"), md);
        assert_eq!(e("64:ff9b:1:ffff::7f00:1"), Some(Ipv4Addr::LOCALHOST));
        assert_eq!(e("64:ff9b:2::1"), None);
        assert_eq!(e("::ffff:1:0:1"), None);
        assert_eq!(e("fe80::1"), None);
    }

    #[test]
    fn isatap_interface_ids_embed_ipv4() {
        let e = |s: &str| isatap_ipv4(&s.parse().unwrap());
        let all = |s: &str| embedded_ipv4s(&s.parse().unwrap()).collect::<Vec<_>>();
        let md = Some(Ipv4Addr::new(169, 254, 169, 254));
        assert_eq!(e("2001:2::5efe:169.254.169.254"), md);
        assert_eq!(e("2001:2::200:5efe:a9fe:a9fe"), md);
        assert_eq!(e("fe80::5efe:169.254.169.254"), md);
        assert_eq!(e("2001:2:0:1:100:5efe:a9fe:a9fe"), md);
        assert_eq!(e("2001:2:0:1:300:5efe:a9fe:a9fe"), md);
        assert_eq!(e("2001:2::400:5efe:a9fe:a9fe"), None);
        assert_eq!(e("2001:2::5eff:a9fe:a9fe"), None);
        assert_eq!(e("2001:2::1"), None);
        // 6to4 with an ISATAP suffix reaches two IPv4 hosts: both count.
        assert_eq!(
            all("2002:c612:201::5efe:127.0.0.1"),
            [Ipv4Addr::new(198, 18, 2, 1), Ipv4Addr::LOCALHOST]
        );
        // One address named twice is listed once.
        assert_eq!(all("64:ff9b:1::5efe:127.0.0.1"), [Ipv4Addr::LOCALHOST]);
        assert!(all("2001:2::1").is_empty());
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "Example.COM.",
            "bücher.de",
            "127.1",
            "[::FFFF:1.2.3.4]",
            "[2001:DB8::0:1]",
            "a_b.c",
        ] {
            let h = ok(s);
            assert_eq!(ok(&h.to_string()), h, "{s}");
        }
        assert_eq!(ok("[::1]").to_string(), "::1");
        assert_eq!(ok("0x7f.1").to_string(), "127.0.0.1");
    }

    /// The split keeps the host as written, under parse_authority's rules.
    #[test]
    fn split_authority_keeps_the_host_verbatim() {
        let s = |s: &'static str, d| split_authority(s, d);
        assert_eq!(s("0x7f.1:80", None), Ok(("0x7f.1", 80)));
        assert_eq!(s("A.com.", Some(443)), Ok(("A.com.", 443)));
        assert_eq!(
            s("[::FFFF:1.2.3.4]", Some(80)),
            Ok(("[::FFFF:1.2.3.4]", 80))
        );
        assert_eq!(
            s("[fe80::1%25eth0]:8080", None),
            Ok(("[fe80::1%25eth0]", 8080))
        );
        for bad in [
            "",
            ":80",
            "a.com",
            "a:b:80",
            "[::1]x",
            "[::1",
            "a.com:+80",
            "u@a.com:80",
        ] {
            assert!(s(bad, None).is_err(), "{bad}");
            assert!(parse_authority(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn authority() {
        let a = |s: &str, d| parse_authority(s, d);
        assert_eq!(a("a.com:443", None), Ok((name("a.com"), 443)));
        assert_eq!(a("A.com.:443", None), Ok((name("a.com"), 443)));
        assert_eq!(a("a.com", Some(443)), Ok((name("a.com"), 443)));
        assert_eq!(
            a("a.com", None),
            Err(TargetError::MissingPort("a.com".into()))
        );
        assert!(matches!(
            a("a.com:0", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert!(matches!(
            a("a.com:65536", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert!(matches!(
            a("a.com:", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert!(matches!(
            a("a.com:+80", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert!(matches!(
            a("a.com:8o", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert!(matches!(
            a("a.com: 80", None),
            Err(TargetError::InvalidPort(_))
        ));
        assert_eq!(a("a.com:080", None), Ok((name("a.com"), 80)));
        assert_eq!(a("[::1]:80", None), Ok((v6("::1"), 80)));
        assert_eq!(a("[::1]", Some(443)), Ok((v6("::1"), 443)));
        assert_eq!(a("[::ffff:10.0.0.1]:80", None), Ok((v4(10, 0, 0, 1), 80)));
        assert_eq!(a("127.1:22", None), Ok((v4(127, 0, 0, 1), 22)));
        assert!(matches!(
            a("::1:80", None),
            Err(TargetError::UnbracketedIpv6(_))
        ));
        assert!(matches!(
            a("[::1]x:80", None),
            Err(TargetError::TrailingAfterBracket(_))
        ));
        assert!(matches!(a("[::1", None), Err(TargetError::InvalidIpv6(_))));
        assert!(matches!(
            a("[a.com]:80", None),
            Err(TargetError::InvalidIpv6(_))
        ));
        assert!(matches!(
            a("u@a.com:80", None),
            Err(TargetError::Userinfo(_))
        ));
        assert_eq!(a(":80", None), Err(TargetError::EmptyHost));
        assert_eq!(a("", Some(80)), Err(TargetError::EmptyHost));
        assert!(a("1.2.3.4.5:80", None).is_err());
    }

    #[test]
    fn explain() {
        let p = parse_explain_target;
        let tcp = |host, port, scheme| ExplainTarget::Tcp { host, port, scheme };
        assert_eq!(
            p("https://u:p@Host.Example/x"),
            Ok(tcp(name("host.example"), 443, Some(Scheme::Https)))
        );
        assert_eq!(
            p("HTTP://h:8080"),
            Ok(tcp(name("h"), 8080, Some(Scheme::Http)))
        );
        assert_eq!(p("http://h"), Ok(tcp(name("h"), 80, Some(Scheme::Http))));
        assert_eq!(
            p("http://a@b@c.com?x=@d"),
            Ok(tcp(name("c.com"), 80, Some(Scheme::Http)))
        );
        assert_eq!(
            p("http://good.com\\@evil.com/"),
            Ok(tcp(name("good.com"), 80, Some(Scheme::Http)))
        );
        assert_eq!(
            p("https://[::1]:8443/"),
            Ok(tcp(v6("::1"), 8443, Some(Scheme::Https)))
        );
        assert_eq!(
            p("http://0x7f.1#frag"),
            Ok(tcp(v4(127, 0, 0, 1), 80, Some(Scheme::Http)))
        );
        assert_eq!(p("a.com:443"), Ok(tcp(name("a.com"), 443, None)));
        assert_eq!(p("[::1]:53"), Ok(tcp(v6("::1"), 53, None)));
        assert!(matches!(p("a.com"), Err(TargetError::MissingPort(_))));
        assert!(p("http://").is_err());
        assert!(p("http:///x").is_err());
        assert!(p("http://a.com:0/").is_err());
        assert!(p("ftp://a.com").is_err());

        let dns = |n: &str, q: &str| ExplainTarget::Dns {
            name: name(n),
            qtype: q.into(),
        };
        assert_eq!(p("dns:Example.com"), Ok(dns("example.com", "A")));
        assert_eq!(p("DNS:example.com."), Ok(dns("example.com", "A")));
        assert_eq!(p("dns:a.com/txt"), Ok(dns("a.com", "TXT")));
        assert_eq!(p("dns:a.com/type65"), Ok(dns("a.com", "TYPE65")));
        assert_eq!(p("dns:_dmarc.a.com/TXT"), Ok(dns("_dmarc.a.com", "TXT")));
        assert_eq!(p("dns:"), Err(TargetError::EmptyHost));
        assert!(matches!(p("dns:a.com/"), Err(TargetError::InvalidQtype(_))));
        assert!(matches!(
            p("dns:a.com/TOOLONGTYPE"),
            Err(TargetError::InvalidQtype(_))
        ));
        assert!(matches!(
            p("dns:a.com/A-A"),
            Err(TargetError::InvalidQtype(_))
        ));
        assert!(matches!(
            p("dns:a.com/A/B"),
            Err(TargetError::InvalidQtype(_))
        ));
        assert!(matches!(
            p("dns:1.2.3.4"),
            Err(TargetError::DnsIpLiteral(_))
        ));
        assert!(p("dns:*.a.com").is_err());
    }

    /// Random strings over an alphabet of tricky characters never panic, and
    /// every accepted host normalises to itself from its Display form. The
    /// cargo-fuzz target in fuzz/ does the same without a fixed budget.
    #[test]
    fn random_inputs_round_trip() {
        const ALPHABET: &[&str] = &[
            "a", "Z", "0", "1", "7", "9", "f", "x", "X", "0x", ".", "。", "．", ":", "::", "[",
            "]", "%", "@", "/", "?", "#", "\\", "-", "_", "*", " ", "\0", "ü", "ß", "１", "ｘ",
            "xn--", "ffff", "http://", "https://", "dns:", "\u{200d}", "\u{ad}", "255",
        ];
        let mut state: u64 = 0x0123_4567_89ab_cdef;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..20_000 {
            let len = next(12);
            let s: String = (0..len).map(|_| ALPHABET[next(ALPHABET.len())]).collect();
            let mut hosts = Vec::new();
            hosts.extend(normalize_host(&s).ok());
            hosts.extend(parse_authority(&s, Some(443)).ok().map(|(h, _)| h));
            match parse_explain_target(&s) {
                Ok(ExplainTarget::Tcp { host, .. }) => hosts.push(host),
                Ok(ExplainTarget::Dns { name, .. }) => hosts.push(name),
                Err(_) => {}
            }
            for h in hosts {
                assert_eq!(normalize_host(&h.to_string()), Ok(h.clone()), "{s:?}");
            }
        }
    }

    #[test]
    fn error_messages_are_lowercase_and_name_the_value() {
        for (input, msg) in [
            ("a..b", "invalid host name \"a..b\": empty label"),
            ("1.2.3.4.5", "invalid IPv4 address \"1.2.3.4.5\""),
            (
                "fe80::1%eth0",
                "invalid host \"fe80::1%eth0\": IPv6 zone ids are not allowed",
            ),
        ] {
            assert_eq!(err(input).to_string(), msg);
        }
        let e = parse_authority("u@a.com:80", None).unwrap_err().to_string();
        assert!(e.starts_with("invalid authority \"u@a.com:80\""), "{e}");
    }
}
