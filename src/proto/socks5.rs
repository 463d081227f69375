//! SOCKS5 (RFC 1928) and its username/password sub-negotiation (RFC 1929):
//! pure parsers over the bytes read so far, and the server's replies.
//!
//! Each parser answers a [`Parse`]: done (with the message and its length),
//! need more bytes, not SOCKS5 (a greeting whose first byte is not version 5;
//! a server answers it [`NOT_SOCKS5`]), or malformed (with the reply code the
//! client gets). Every message is bounded by its own length fields: at most
//! [`MAX_MESSAGE`] bytes.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::Parse;

/// The longest message any parser here reads (an RFC 1929 request:
/// 1 + 1 + 255 + 1 + 255).
pub(crate) const MAX_MESSAGE: usize = 513;

/// Protocol version byte of SOCKS5 greetings, requests and replies.
pub(crate) const VERSION: u8 = 0x05;
/// Version byte of the RFC 1929 sub-negotiation.
pub(crate) const AUTH_VERSION: u8 = 0x01;

/// Authentication methods (RFC 1928 §3).
pub(crate) const METHOD_NONE: u8 = 0x00;
pub(crate) const METHOD_USERPASS: u8 = 0x02;
pub(crate) const METHOD_UNACCEPTABLE: u8 = 0xFF;

/// Reply codes (RFC 1928 §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Reply {
    Succeeded = 0x00,
    GeneralFailure = 0x01,
    NotAllowed = 0x02,
    NetworkUnreachable = 0x03,
    HostUnreachable = 0x04,
    ConnectionRefused = 0x05,
    CommandNotSupported = 0x07,
    AddressTypeNotSupported = 0x08,
}

/// A message that cannot be parsed, with the reply its sender gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Malformed {
    pub reply: Reply,
    pub why: &'static str,
}

/// What a server answers a first byte that is not SOCKS5's version (the
/// greeting's [`Parse::NotThis`]).
pub(crate) const NOT_SOCKS5: Malformed = Malformed {
    reply: Reply::GeneralFailure,
    why: "not a SOCKS5 greeting",
};

fn malformed<T>(reply: Reply, why: &'static str) -> Parse<T, Malformed> {
    Parse::Malformed(Malformed { reply, why })
}

/// The client's greeting: the methods it offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Greeting {
    pub methods: Vec<u8>,
}

impl Greeting {
    pub(crate) fn offers(&self, method: u8) -> bool {
        self.methods.contains(&method)
    }
}

/// `VER NMETHODS METHODS...` (RFC 1928 §3).
pub(crate) fn parse_greeting(buf: &[u8]) -> Parse<Greeting, Malformed> {
    let Some(&ver) = buf.first() else {
        return Parse::NeedMore;
    };
    if ver != VERSION {
        return Parse::NotThis;
    }
    let Some(&n) = buf.get(1) else {
        return Parse::NeedMore;
    };
    if n == 0 {
        return malformed(Reply::GeneralFailure, "greeting offers no method");
    }
    let len = 2 + n as usize;
    match buf.get(2..len) {
        Some(methods) => Parse::Done {
            value: Greeting {
                methods: methods.to_vec(),
            },
            len,
        },
        None => Parse::NeedMore,
    }
}

/// Username and password of an RFC 1929 request.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Credentials {
    pub user: Vec<u8>,
    pub password: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    // The password never reaches a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &String::from_utf8_lossy(&self.user))
            .field("password", &"<hidden>")
            .finish()
    }
}

/// `VER ULEN UNAME PLEN PASSWD` (RFC 1929 §2).
pub(crate) fn parse_auth(buf: &[u8]) -> Parse<Credentials, Malformed> {
    let Some(&ver) = buf.first() else {
        return Parse::NeedMore;
    };
    if ver != AUTH_VERSION {
        return malformed(
            Reply::GeneralFailure,
            "not a username/password sub-negotiation",
        );
    }
    let Some(&ulen) = buf.get(1) else {
        return Parse::NeedMore;
    };
    if ulen == 0 {
        return malformed(Reply::GeneralFailure, "empty username");
    }
    let user_end = 2 + ulen as usize;
    let Some(&plen) = buf.get(user_end) else {
        return Parse::NeedMore;
    };
    if plen == 0 {
        return malformed(Reply::GeneralFailure, "empty password");
    }
    let len = user_end + 1 + plen as usize;
    match (buf.get(2..user_end), buf.get(user_end + 1..len)) {
        (Some(user), Some(password)) => Parse::Done {
            value: Credentials {
                user: user.to_vec(),
                password: password.to_vec(),
            },
            len,
        },
        _ => Parse::NeedMore,
    }
}

/// The RFC 1929 reply: status 0 is success, anything else failure.
pub(crate) fn auth_reply(ok: bool) -> [u8; 2] {
    [AUTH_VERSION, if ok { 0x00 } else { 0x01 }]
}

/// The method-selection reply.
pub(crate) fn method_reply(method: u8) -> [u8; 2] {
    [VERSION, method]
}

/// Request commands (RFC 1928 §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    Connect,
    Bind,
    UdpAssociate,
}

impl Command {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Command::Connect => "CONNECT",
            Command::Bind => "BIND",
            Command::UdpAssociate => "UDP ASSOCIATE",
        }
    }
}

/// A request's destination address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Address {
    V4(Ipv4Addr),
    V6(Ipv6Addr),
    /// A domain name as sent (ASCII-checked, not yet normalised).
    Domain(String),
}

/// `VER CMD RSV ATYP DST.ADDR DST.PORT` (RFC 1928 §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub command: Command,
    pub address: Address,
    pub port: u16,
}

/// Parse a request.
pub(crate) fn parse_request(buf: &[u8]) -> Parse<Request, Malformed> {
    if buf.is_empty() {
        return Parse::NeedMore;
    }
    if buf[0] != VERSION {
        return malformed(Reply::GeneralFailure, "request version is not 5");
    }
    let Some(&cmd) = buf.get(1) else {
        return Parse::NeedMore;
    };
    let command = match cmd {
        0x01 => Command::Connect,
        0x02 => Command::Bind,
        0x03 => Command::UdpAssociate,
        _ => return malformed(Reply::CommandNotSupported, "unknown command"),
    };
    let Some(&rsv) = buf.get(2) else {
        return Parse::NeedMore;
    };
    if rsv != 0 {
        return malformed(Reply::GeneralFailure, "reserved byte is not zero");
    }
    let Some(&atyp) = buf.get(3) else {
        return Parse::NeedMore;
    };
    let (addr_len, addr_start) = match atyp {
        0x01 => (4, 4),
        0x04 => (16, 4),
        0x03 => match buf.get(4) {
            None => return Parse::NeedMore,
            Some(0) => return malformed(Reply::GeneralFailure, "empty domain name"),
            Some(&n) => (n as usize, 5),
        },
        _ => return malformed(Reply::AddressTypeNotSupported, "unknown address type"),
    };
    let addr_end = addr_start + addr_len;
    let len = addr_end + 2;
    let (Some(addr), Some(port)) = (buf.get(addr_start..addr_end), buf.get(addr_end..len)) else {
        return Parse::NeedMore;
    };
    let address = match atyp {
        0x01 => {
            let mut a = [0u8; 4];
            a.copy_from_slice(addr);
            Address::V4(Ipv4Addr::from(a))
        }
        0x04 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(addr);
            Address::V6(Ipv6Addr::from(a))
        }
        _ => {
            if !addr.iter().all(|b| b.is_ascii_graphic()) {
                return malformed(Reply::GeneralFailure, "domain name is not printable ASCII");
            }
            Address::Domain(String::from_utf8_lossy(addr).into_owned())
        }
    };
    Parse::Done {
        value: Request {
            command,
            address,
            port: u16::from_be_bytes([port[0], port[1]]),
        },
        len,
    }
}

/// A reply to a request. The bound address is always `0.0.0.0:0`: the
/// client has no use for Palisade's upstream-side address.
pub(crate) fn reply(code: Reply) -> [u8; 10] {
    [VERSION, code as u8, 0x00, 0x01, 0, 0, 0, 0, 0, 0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every strict prefix of a valid message needs more; the whole is done
    /// with its length, whatever follows it.
    fn check_all_prefixes<T: std::fmt::Debug + PartialEq + Clone>(
        msg: &[u8],
        parse: fn(&[u8]) -> Parse<T, Malformed>,
        want: T,
    ) {
        for n in 0..msg.len() {
            assert_eq!(parse(&msg[..n]), Parse::NeedMore, "prefix {n} of {msg:?}");
        }
        let mut longer = msg.to_vec();
        longer.extend_from_slice(b"trailing");
        for buf in [msg, &longer[..]] {
            assert_eq!(
                parse(buf),
                Parse::Done {
                    value: want.clone(),
                    len: msg.len()
                }
            );
        }
    }

    /// The reply a server sends for `p`, if it refuses it.
    fn reply_of<T>(p: Parse<T, Malformed>) -> Option<Reply> {
        match p {
            Parse::Malformed(m) => Some(m.reply),
            Parse::NotThis => Some(NOT_SOCKS5.reply),
            _ => None,
        }
    }

    #[test]
    fn greeting_prefixes_and_errors() {
        check_all_prefixes(
            &[5, 2, 0, 2],
            parse_greeting,
            Greeting {
                methods: vec![0, 2],
            },
        );
        assert_eq!(parse_greeting(&[4, 1, 0]), Parse::NotThis);
        assert_eq!(parse_greeting(b"GET / HTTP/1.1\r\n"), Parse::NotThis);
        assert_eq!(
            reply_of(parse_greeting(&[4, 1, 0])),
            Some(Reply::GeneralFailure)
        );
        assert_eq!(
            reply_of(parse_greeting(b"GET / HTTP/1.1\r\n")),
            Some(Reply::GeneralFailure)
        );
        assert_eq!(
            reply_of(parse_greeting(&[5, 0])),
            Some(Reply::GeneralFailure)
        );
        assert!(parse_greeting(&[5, 1, 2]).is_done_with(|g| g.offers(METHOD_USERPASS)));
    }

    #[test]
    fn auth_prefixes_and_errors() {
        let mut msg = vec![1, 4];
        msg.extend_from_slice(b"acme");
        msg.push(6);
        msg.extend_from_slice(b"s3cret");
        check_all_prefixes(
            &msg,
            parse_auth,
            Credentials {
                user: b"acme".to_vec(),
                password: b"s3cret".to_vec(),
            },
        );
        assert_eq!(
            reply_of(parse_auth(&[5, 1, b'a'])),
            Some(Reply::GeneralFailure)
        );
        assert_eq!(reply_of(parse_auth(&[1, 0])), Some(Reply::GeneralFailure));
        assert_eq!(
            reply_of(parse_auth(&[1, 1, b'a', 0])),
            Some(Reply::GeneralFailure)
        );
        let shown = format!(
            "{:?}",
            Credentials {
                user: b"acme".to_vec(),
                password: b"s3cret".to_vec(),
            }
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert_eq!(auth_reply(true), [1, 0]);
        assert_eq!(auth_reply(false), [1, 1]);
    }

    #[test]
    fn request_prefixes_every_address_type() {
        check_all_prefixes(
            &[5, 1, 0, 1, 198, 18, 2, 10, 0x08, 0xae],
            parse_request,
            Request {
                command: Command::Connect,
                address: Address::V4(Ipv4Addr::new(198, 18, 2, 10)),
                port: 2222,
            },
        );
        let mut v6 = vec![5, 1, 0, 4];
        v6.extend_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        v6.extend_from_slice(&443u16.to_be_bytes());
        check_all_prefixes(
            &v6,
            parse_request,
            Request {
                command: Command::Connect,
                address: Address::V6("2001:db8::1".parse().unwrap()),
                port: 443,
            },
        );
        let mut name = vec![5, 3, 0, 3, 12];
        name.extend_from_slice(b"allowed.test");
        name.extend_from_slice(&80u16.to_be_bytes());
        check_all_prefixes(
            &name,
            parse_request,
            Request {
                command: Command::UdpAssociate,
                address: Address::Domain("allowed.test".into()),
                port: 80,
            },
        );
    }

    #[test]
    fn request_errors_get_their_reply_codes() {
        let cases: [(&[u8], Reply); 6] = [
            (&[4, 1, 0, 1], Reply::GeneralFailure),
            (&[5, 9, 0, 1], Reply::CommandNotSupported),
            (&[5, 1, 1, 1], Reply::GeneralFailure),
            (&[5, 1, 0, 7], Reply::AddressTypeNotSupported),
            (&[5, 1, 0, 3, 0], Reply::GeneralFailure),
            (&[5, 1, 0, 3, 2, b'a', 0, 0, 80], Reply::GeneralFailure),
        ];
        for (msg, want) in cases {
            assert_eq!(reply_of(parse_request(msg)), Some(want), "{msg:?}");
        }
        assert_eq!(reply(Reply::NotAllowed), [5, 2, 0, 1, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn no_input_panics() {
        // Every short buffer of a few interesting byte values.
        let alphabet = [0u8, 1, 2, 3, 4, 5, 0xff];
        let mut buf = Vec::new();
        for len in 0..6u32 {
            for n in 0..alphabet.len().pow(len) {
                buf.clear();
                let mut k = n;
                for _ in 0..len {
                    buf.push(alphabet[k % alphabet.len()]);
                    k /= alphabet.len();
                }
                let _ = parse_greeting(&buf);
                let _ = parse_auth(&buf);
                let _ = parse_request(&buf);
            }
        }
    }

    impl<T> Parse<T, Malformed> {
        fn is_done_with(&self, f: impl Fn(&T) -> bool) -> bool {
            matches!(self, Parse::Done { value, .. } if f(value))
        }
    }
}
