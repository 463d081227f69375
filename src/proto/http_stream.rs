//! Verification of the plain-HTTP/1 bytes a client sends through a tunnel
//! (HTTP CONNECT, SOCKS5 or transparent REDIRECT to port 80 of an allowed
//! host).
//!
//! The tunnel is dialled to the allowed host's address, which on a CDN
//! serves thousands of other sites: checking the first request's Host is
//! not enough, since a keep-alive or pipelined request, or one behind an
//! empty line, could name any of them. [`HttpGuard`] therefore judges every
//! request on the connection before any of its bytes are forwarded. It is
//! sans-IO and speaks the [`super::guard`] protocol; it never panics on
//! input.
//!
//! What the client sends, and the answer (first matching row wins):
//!
//! | client bytes at a request start | answer |
//! |---|---|
//! | not (empty lines, a method token, SP) | `Deny(ProtocolMismatch)` at once |
//! | `PRI ` (the HTTP/2 preface; the method is reserved for it) | `Deny(UpgradeNotAllowed)` at once |
//! | `CONNECT ` | `Deny(ProtocolMismatch)` at once |
//! | a request line httparse refuses | `Deny(ProtocolMismatch)` |
//! | a head over `max_head_bytes` or `max_headers`, or malformed | `Deny(Malformed)` |
//! | `Upgrade` listing h2c (or h2, HTTP/2), any `HTTP2-Settings` | `Deny(UpgradeNotAllowed)` |
//! | `Content_Length`, `Transfer_Encoding`, `HTTP2_Settings` (underscore spellings) | `Deny(Malformed)` |
//! | no Host (HTTP/1.0 too) | `Deny(HostMismatch)`, seen none |
//! | two or more Host | `Deny(Malformed)` |
//! | Host not ASCII, or naming another host or port | `Deny(HostMismatch)` (`Malformed` for a broken authority) |
//! | target not origin-form, `*` (OPTIONS only) or http(s) absolute-form | `Deny(Malformed)` |
//! | absolute-form authority naming another host or port | `Deny(HostMismatch)` |
//! | TE and CL; TE on 1.0; TE not ending in one `chunked`; bad or conflicting CL | `Deny(Malformed)` |
//! | an `Upgrade` request while upstream responses cannot be followed | `Deny(ProtocolMismatch)` |
//! | [`MAX_IN_FLIGHT`] requests already await responses | `Wait` |
//! | otherwise | `Forward(head)`, then the body streamed (never held) |
//!
//! After a request with an `Upgrade` header (and its body) the answer is
//! `Wait` until the upstream's final response to it: `101` makes the rest of
//! the connection `Opaque`, any other status resumes verification. The
//! upstream bytes are followed for that purpose only (heads bounded, bodies
//! skipped in O(1) memory); when they cannot be followed the tracker is lost
//! and only later upgrade requests are affected.
//!
//! Chunked bodies (RFC 9112 §7.1) are strict: CRLF line ends only, a hex
//! size that fits in 64 bits, extensions of visible ASCII, lines of at most
//! [`MAX_CHUNK_LINE`] bytes, trailers bounded like a head.
//!
//! One assumption: between calls the driver only appends to the held bytes
//! or drops the forwarded prefix (the [`super::guard`] protocol). The guard
//! remembers how far it has scanned a partial head so a head fed byte by
//! byte costs linear, not quadratic, time; a driver that rewrites held
//! bytes gets a rescan when they shrink, never a forward of unjudged bytes.

use std::collections::VecDeque;

use super::guard::{Limits, Step, Violation, ViolationKind};
use super::http_head::with_header_slots;
use super::target::{is_normal_spelling, parse_authority, split_authority, Host, TargetError};

/// Longest chunk-size line (size, extensions, CRLF).
pub(crate) const MAX_CHUNK_LINE: usize = 4096;
/// Largest response head the upstream tracker holds.
pub(crate) const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// Most response header fields the upstream tracker accepts.
pub(crate) const MAX_RESPONSE_HEADERS: usize = 256;
/// Most forwarded requests awaiting their final response; past it the
/// client gets `Wait`, so the tracker's memory stays bounded.
pub(crate) const MAX_IN_FLIGHT: usize = 1024;

/// Why an upgrade request cannot be judged: its outcome would never be known.
fn upstream_lost(why: &str) -> Violation {
    violation(
        ViolationKind::ProtocolMismatch,
        None,
        format!("upstream responses could not be followed: {why}"),
    )
}

/// The verifier of one tunnel's client->upstream HTTP/1 bytes.
#[derive(Debug)]
pub(crate) struct HttpGuard {
    host: Host,
    port: u16,
    limits: Limits,
    state: Client,
    scan: HeadScan,
    requests: u64,
    first_host: Option<String>,
    upstream: Upstream,
}

/// Where the client direction is.
#[derive(Debug, Clone)]
enum Client {
    /// At a request start (possibly behind empty lines).
    Head,
    /// In a Content-Length body.
    Body {
        left: u64,
        then: Then,
    },
    /// In a chunked body.
    Chunked {
        dec: Chunked,
        then: Then,
    },
    /// An upgrade request (request number `seq`) is forwarded; its outcome
    /// is not known yet.
    AwaitUpgrade {
        seq: u64,
    },
    Opaque,
    Denied(Violation),
}

/// What follows a request's body.
#[derive(Debug, Clone, Copy)]
enum Then {
    Next,
    AwaitUpgrade(u64),
}

impl Then {
    fn state(self) -> Client {
        match self {
            Then::Next => Client::Head,
            Then::AwaitUpgrade(seq) => Client::AwaitUpgrade { seq },
        }
    }
}

/// One step of the client direction: bytes judged (and state advanced), or
/// an answer for the driver.
enum Inner {
    Advance(usize),
    Stop(Step),
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// A verified request head.
struct Verdict {
    host: String,
    framing: Framing,
    head: bool,
    upgrade: bool,
}

fn violation(kind: ViolationKind, seen: Option<&str>, detail: impl Into<String>) -> Violation {
    Violation::new(kind, seen.map(str::to_owned), detail)
}

fn malformed(detail: impl Into<String>) -> Violation {
    violation(ViolationKind::Malformed, None, detail)
}

impl HttpGuard {
    /// `host`/`port`: the tunnel's normalised target.
    pub(crate) fn new(host: Host, port: u16, limits: Limits) -> Self {
        HttpGuard {
            host,
            port,
            limits,
            state: Client::Head,
            scan: HeadScan::default(),
            requests: 0,
            first_host: None,
            upstream: Upstream::default(),
        }
    }

    /// Judge the client bytes the driver holds (see [`super::guard`] for the
    /// protocol: `Forward(n)` = first n held bytes verified; the driver drops
    /// them and calls again with the rest).
    pub(crate) fn client(&mut self, held: &[u8]) -> Step {
        let mut done = 0;
        loop {
            let rest = held.get(done..).unwrap_or_default();
            match self.client_step(rest) {
                Inner::Advance(n) => done += n,
                // Whatever stopped us is judged again on the next call, once
                // the driver has dropped the verified bytes.
                Inner::Stop(_) if done > 0 => return Step::Forward(done),
                Inner::Stop(step) => {
                    if let Step::Deny(v) = &step {
                        self.state = Client::Denied(v.clone());
                    }
                    return step;
                }
            }
        }
    }

    /// Observe upstream->client bytes as they pass (they are always
    /// forwarded).
    pub(crate) fn server(&mut self, bytes: &[u8]) {
        self.upstream.observe(bytes);
    }

    /// Request heads verified so far.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn requests(&self) -> u64 {
        self.requests
    }

    /// Host header (as sent) of the first verified request.
    pub(crate) fn first_host(&self) -> Option<&str> {
        self.first_host.as_deref()
    }

    /// Client bytes that are, for certain, the rest of a request body of
    /// known length (`Content-Length`), counted from the first byte the
    /// driver does not hold yet (ask with nothing held): it may forward up
    /// to this many without holding or showing them, then report them with
    /// [`Self::client_passed`]. 0 anywhere else (chunked bodies, heads).
    pub(crate) fn client_body_left(&self) -> u64 {
        match self.state {
            Client::Body { left, .. } => left,
            _ => 0,
        }
    }

    /// `n` client bytes (at most [`Self::client_body_left`]) went by
    /// unjudged: the state moves exactly as judging them would have moved it.
    pub(crate) fn client_passed(&mut self, n: u64) {
        if let Client::Body { left, then } = &mut self.state {
            *left -= n.min(*left);
            if *left == 0 {
                let then = *then;
                self.state = then.state();
            }
        }
    }

    /// Upstream bytes that are, for certain, the rest of a response body of
    /// known length: the driver may forward up to this many without showing
    /// them to [`Self::server`], then report them with
    /// [`Self::server_passed`]. 0 anywhere else (heads, chunked bodies, a
    /// partial unit held).
    pub(crate) fn server_body_left(&self) -> u64 {
        self.upstream.body_left()
    }

    /// `n` upstream bytes (at most [`Self::server_body_left`]) went by
    /// unobserved: the tracker moves exactly as observing them would have.
    pub(crate) fn server_passed(&mut self, n: u64) {
        self.upstream.passed(n);
    }

    fn client_step(&mut self, held: &[u8]) -> Inner {
        match &mut self.state {
            Client::Denied(v) => Inner::Stop(Step::Deny(v.clone())),
            Client::Opaque => Inner::Stop(Step::Opaque),
            Client::Head => self.head_step(held),
            Client::Body { left, then } => {
                let n = usize::try_from(*left).unwrap_or(usize::MAX).min(held.len());
                if n == 0 {
                    return Inner::Stop(Step::NeedMore);
                }
                *left -= n as u64;
                if *left == 0 {
                    self.state = then.state();
                }
                Inner::Advance(n)
            }
            Client::Chunked { dec, then } => {
                let bounds = ChunkBounds {
                    trailer_bytes: self.limits.max_head_bytes,
                    trailer_fields: self.limits.max_headers,
                };
                match dec.step(held, bounds) {
                    ChunkStep::Advance(n) => Inner::Advance(n),
                    ChunkStep::Done(n) => {
                        self.state = then.state();
                        Inner::Advance(n)
                    }
                    ChunkStep::NeedMore => Inner::Stop(Step::NeedMore),
                    ChunkStep::Bad(detail) => Inner::Stop(Step::Deny(malformed(detail))),
                }
            }
            Client::AwaitUpgrade { seq } => match self.upstream.outcome(*seq) {
                UpgradeFate::Switched => {
                    self.state = Client::Opaque;
                    Inner::Stop(Step::Opaque)
                }
                UpgradeFate::Refused => {
                    self.state = Client::Head;
                    self.scan = HeadScan::default();
                    self.head_step(held)
                }
                UpgradeFate::Lost(why) => Inner::Stop(Step::Deny(upstream_lost(why))),
                UpgradeFate::Unknown => Inner::Stop(Step::Wait),
            },
        }
    }

    /// At a request start: hold the head until complete, deny as soon as the
    /// bytes cannot be an acceptable request.
    fn head_step(&mut self, held: &[u8]) -> Inner {
        use ViolationKind::{ProtocolMismatch, UpgradeNotAllowed};
        let stop = |kind, detail: &str| Inner::Stop(Step::Deny(violation(kind, None, detail)));
        if held.is_empty() {
            return Inner::Stop(Step::NeedMore);
        }
        let max = self.limits.max_head_bytes;
        self.scan.advance(held, max);
        let scan = self.scan;
        if scan.phase == Phase::BadCr {
            return stop(ProtocolMismatch, "bare CR before the request line");
        }
        // The method first: bytes before any later fault.
        if let Some(end) = scan.word_end {
            let method = held.get(scan.start..end).unwrap_or_default();
            if method.eq_ignore_ascii_case(b"PRI") {
                return stop(UpgradeNotAllowed, "HTTP/2 connection preface (h2c)");
            }
            if method.eq_ignore_ascii_case(b"CONNECT") {
                return stop(ProtocolMismatch, "CONNECT inside a tunnel");
            }
        }
        if scan.request_line == RequestLine::Bad {
            return stop(ProtocolMismatch, "not an HTTP/1.0 or HTTP/1.1 request line");
        }
        if let Some(line_end) = scan.line_end {
            if !scan.line_checked {
                let mut none: [httparse::Header<'_>; 0] = [];
                let line = held.get(..line_end).unwrap_or_default();
                if httparse::Request::new(&mut none).parse(line) != Ok(httparse::Status::Partial) {
                    return stop(ProtocolMismatch, "not an HTTP/1.0 or HTTP/1.1 request line");
                }
                self.scan.line_checked = true;
            }
        }
        if let Some(end) = scan.end {
            return self.complete_head(held.get(..end).unwrap_or_default());
        }
        // Check the complete lines so far, once each, so a bad field is
        // denied before the head ends.
        if scan.line_end.is_some_and(|l| scan.last_lf > l) && scan.last_lf > scan.checked_lf {
            let lines = held.get(..scan.last_lf).unwrap_or_default();
            let parsed = with_header_slots(self.limits.max_headers, |slots| {
                httparse::Request::new(slots).parse(lines)
            });
            match parsed {
                Ok(httparse::Status::Partial) => self.scan.checked_lf = scan.last_lf,
                Err(httparse::Error::TooManyHeaders) => {
                    return Inner::Stop(Step::Deny(malformed("too many request headers")))
                }
                // A complete head would have been found by the scan.
                Ok(httparse::Status::Complete(_)) | Err(_) => {
                    return Inner::Stop(Step::Deny(malformed("malformed request head")))
                }
            }
        }
        if held.len() >= max {
            return Inner::Stop(Step::Deny(malformed("request head too large")));
        }
        Inner::Stop(Step::NeedMore)
    }

    /// A complete head (`head` is exactly its bytes): verify, then commit.
    fn complete_head(&mut self, head: &[u8]) -> Inner {
        let (host, port) = (&self.host, self.port);
        let judged = with_header_slots(self.limits.max_headers, |slots| {
            let mut req = httparse::Request::new(slots);
            Ok(match req.parse(head)? {
                httparse::Status::Complete(n) if n == head.len() => Some(judge(&req, host, port)),
                _ => None,
            })
        });
        let verdict = match judged {
            Ok(Some(judged)) => judged,
            Err(httparse::Error::TooManyHeaders) => Err(malformed("too many request headers")),
            _ => Err(malformed("malformed request head")),
        };
        let verdict = match verdict {
            Ok(v) => v,
            Err(v) => return Inner::Stop(Step::Deny(v)),
        };
        if let (true, Some(why)) = (verdict.upgrade, self.upstream.lost()) {
            return Inner::Stop(Step::Deny(upstream_lost(why)));
        }
        if self.upstream.following() && self.upstream.inflight.len() >= MAX_IN_FLIGHT {
            return Inner::Stop(Step::Wait);
        }
        self.requests += 1;
        self.first_host.get_or_insert(verdict.host);
        let seq = self.upstream.push(verdict.head, verdict.upgrade);
        let then = if verdict.upgrade {
            Then::AwaitUpgrade(seq)
        } else {
            Then::Next
        };
        self.scan = HeadScan::default();
        self.state = match verdict.framing {
            Framing::None | Framing::Length(0) => then.state(),
            Framing::Length(left) => Client::Body { left, then },
            Framing::Chunked => Client::Chunked {
                dec: Chunked::default(),
                then,
            },
        };
        Inner::Advance(head.len())
    }
}

/// The semantic checks of a parsed request head.
fn judge(req: &httparse::Request<'_, '_>, host: &Host, port: u16) -> Result<Verdict, Violation> {
    use ViolationKind::{HostMismatch, UpgradeNotAllowed};
    let method = req.method.unwrap_or_default();
    let target = req.path.unwrap_or_default();
    let version = req.version.unwrap_or_default();
    let headers = &*req.headers;
    let named = |name: &'static str| {
        headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
    };

    // h2c: a switch to HTTP/2 would carry streams for any :authority.
    for value in named("upgrade") {
        if list_items(value).any(is_http2_protocol) {
            return Err(violation(UpgradeNotAllowed, None, "Upgrade to h2c"));
        }
    }
    if named("http2-settings").next().is_some() {
        return Err(violation(UpgradeNotAllowed, None, "HTTP2-Settings header"));
    }
    // Some servers (CGI-style header maps) read '_' as '-'.
    for h in headers {
        if h.name.contains('_') {
            let dashed = h.name.replace('_', "-");
            if ["content-length", "transfer-encoding", "http2-settings"]
                .iter()
                .any(|n| dashed.eq_ignore_ascii_case(n))
            {
                return Err(malformed(format!("ambiguous header name {}", h.name)));
            }
        }
    }

    let mut hosts = named("host");
    let host_value = match (hosts.next(), hosts.next()) {
        (None, _) => return Err(violation(HostMismatch, None, "request without Host")),
        (Some(one), None) => shown_value(one),
        (Some(_), Some(_)) => {
            let hosts: Vec<String> = named("host").map(shown_value).collect();
            let first = hosts.first().map_or("", String::as_str);
            let seen = hosts
                .iter()
                .find(|h| check_authority(h, host, port, "Host").is_err())
                .map_or(first, String::as_str);
            return Err(violation(
                ViolationKind::Malformed,
                Some(seen),
                "more than one Host header",
            ));
        }
    };
    check_authority(&host_value, host, port, "Host")?;
    check_target(method, target, host, port)?;

    Ok(Verdict {
        host: host_value,
        framing: request_framing(version, named("transfer-encoding"), named("content-length"))?,
        head: method == "HEAD",
        upgrade: named("upgrade").next().is_some(),
    })
}

/// A header value as sent, without the surrounding optional whitespace.
fn shown_value(value: &[u8]) -> String {
    String::from_utf8_lossy(trim_ows(value)).into_owned()
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// The elements of a comma-separated field value, trimmed.
pub(crate) fn list_items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(trim_ows)
}

/// `h2c`, `h2` or `HTTP/2...` as an Upgrade protocol.
fn is_http2_protocol(item: &[u8]) -> bool {
    let name = item.split(|&b| b == b'/').next().unwrap_or_default();
    if name.eq_ignore_ascii_case(b"h2c") || name.eq_ignore_ascii_case(b"h2") {
        return true;
    }
    item.get(..6)
        .is_some_and(|p| p.eq_ignore_ascii_case(b"HTTP/2"))
}

/// RFC 9110 §5.6.2 tchar.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `seen` (a Host value or absolute-form authority, as sent) must name the
/// tunnel's host, and its port if one is written.
fn check_authority(seen: &str, host: &Host, port: u16, what: &str) -> Result<(), Violation> {
    if !seen.bytes().all(|b| b.is_ascii_graphic()) {
        // Servers match the raw bytes; no IDNA or width mapping happens there.
        return Err(violation(
            ViolationKind::HostMismatch,
            Some(seen),
            format!("{what} is not printable ASCII"),
        ));
    }
    // The common case, the host written as the tunnel's own: no mapping.
    if let Ok((h, p)) = split_authority(seen, Some(port)) {
        if p == port && is_normal_spelling(h, host) {
            return Ok(());
        }
    }
    match parse_authority(seen, Some(port)) {
        Ok((h, p)) if h == *host && p == port => Ok(()),
        Ok(_) => Err(violation(
            ViolationKind::HostMismatch,
            Some(seen),
            format!("{what} names another host"),
        )),
        Err(e) => {
            let kind = match e {
                TargetError::Userinfo(_)
                | TargetError::UnbracketedIpv6(_)
                | TargetError::MissingPort(_)
                | TargetError::InvalidPort(_)
                | TargetError::TrailingAfterBracket(_) => ViolationKind::Malformed,
                _ => ViolationKind::HostMismatch,
            };
            Err(violation(kind, Some(seen), format!("{what}: {e}")))
        }
    }
}

/// Origin-form, asterisk-form (OPTIONS only) or http(s) absolute-form whose
/// authority names the tunnel's host (RFC 9112 §3.2).
fn check_target(method: &str, target: &str, host: &Host, port: u16) -> Result<(), Violation> {
    if target.starts_with('/') {
        return Ok(());
    }
    if target == "*" {
        return if method == "OPTIONS" {
            Ok(())
        } else {
            Err(malformed("asterisk-form target without OPTIONS"))
        };
    }
    for scheme in ["http://", "https://"] {
        let matches = target
            .get(..scheme.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(scheme));
        if let (true, Some(rest)) = (matches, target.get(scheme.len()..)) {
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let authority = rest.get(..end).unwrap_or(rest);
            return check_authority(authority, host, port, "request target");
        }
    }
    Err(malformed(
        "request target is not origin-form or http(s) absolute-form",
    ))
}

/// RFC 9112 §6.1-6.3 for a request, refusing anything two parsers could
/// read differently.
fn request_framing<'a>(
    version: u8,
    te: impl Iterator<Item = &'a [u8]>,
    cl: impl Iterator<Item = &'a [u8]>,
) -> Result<Framing, Violation> {
    let te: Vec<&[u8]> = te.collect();
    let cl: Vec<&[u8]> = cl.collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err(malformed("both Transfer-Encoding and Content-Length"));
        }
        if version == 0 {
            return Err(malformed("Transfer-Encoding in an HTTP/1.0 request"));
        }
        let codings: Vec<&[u8]> = te.iter().flat_map(|v| list_items(v)).collect();
        if codings
            .iter()
            .any(|c| c.is_empty() || !c.iter().all(|&b| is_tchar(b)))
        {
            return Err(malformed("Transfer-Encoding is not a list of codings"));
        }
        let chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
        return match codings.split_last() {
            Some((last, rest)) if chunked(last) && !rest.iter().any(chunked) => {
                Ok(Framing::Chunked)
            }
            Some((last, _)) if chunked(last) => Err(malformed("chunked applied more than once")),
            _ => Err(malformed("final transfer coding is not chunked")),
        };
    }
    match content_length(cl.iter().copied()) {
        Ok(Some(n)) => Ok(Framing::Length(n)),
        Ok(None) => Ok(Framing::None),
        Err(detail) => Err(malformed(detail)),
    }
}

/// The Content-Length of all its field lines: digits only, several values
/// only if all are the same number.
pub(crate) fn content_length<'a>(
    values: impl IntoIterator<Item = &'a [u8]>,
) -> Result<Option<u64>, &'static str> {
    let mut length = None;
    for item in values.into_iter().flat_map(list_items) {
        if item.is_empty() || !item.iter().all(u8::is_ascii_digit) {
            return Err("Content-Length is not a number");
        }
        let mut n: u64 = 0;
        for &d in item {
            n = n
                .checked_mul(10)
                .and_then(|n| n.checked_add(u64::from(d - b'0')))
                .ok_or("Content-Length overflows")?;
        }
        match length {
            Some(l) if l != n => return Err("conflicting Content-Length values"),
            _ => length = Some(n),
        }
    }
    Ok(length)
}

// ---------------------------------------------------------------------------
// Head scanning, shared by both directions.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Phase {
    /// Leading empty lines.
    #[default]
    Empty,
    /// A CR among the leading empty lines.
    EmptyCr,
    /// The start line.
    Line,
    /// Field lines; 1 just after an LF, 2 after LF CR, 0 elsewhere.
    Fields(u8),
    /// The head ended.
    Done,
    /// A CR not followed by LF among the leading empty lines.
    BadCr,
}

/// How far a start line is a valid request line, `method SP target SP
/// HTTP/1.x CRLF` (RFC 9112 §3, bare LF allowed, as httparse has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum RequestLine {
    #[default]
    Start,
    Method,
    TargetStart,
    Target,
    /// This many bytes of `HTTP/1.x` matched.
    Version(u8),
    Cr,
    Done,
    Bad,
}

impl RequestLine {
    fn next(self, b: u8) -> Self {
        use RequestLine::{Bad, Cr, Done, Method, Start, Target, TargetStart, Version};
        // httparse's request-target bytes.
        let uri = |b: u8| matches!(b, 0x21..=0x7e | 0x80..=0xff);
        match (self, b) {
            (Method, b' ') => TargetStart,
            (Start | Method, b) if is_tchar(b) => Method,
            (TargetStart | Target, b) if uri(b) => Target,
            (Target, b' ') => Version(0),
            (Version(n @ 0..=6), b) if b"HTTP/1.".get(usize::from(n)) == Some(&b) => Version(n + 1),
            (Version(7), b'0' | b'1') => Version(8),
            (Version(8), b'\r') => Cr,
            (Version(8) | Cr, b'\n') => Done,
            _ => Bad,
        }
    }
}

/// An incremental scan of a message head for its end and the landmarks
/// the early checks need. Offsets are from the head's first byte (leading
/// empty lines included). `line_checked` and `checked_lf` record checks
/// the caller has passed, so each is done once.
#[derive(Debug, Clone, Copy, Default)]
struct HeadScan {
    pos: usize,
    phase: Phase,
    /// Where the start line begins.
    start: usize,
    /// The start line as a request line (meaningless for responses).
    request_line: RequestLine,
    /// The SP after the method.
    word_end: Option<usize>,
    /// Just past the start line's LF.
    line_end: Option<usize>,
    /// Just past the last LF of the start line or a field line.
    last_lf: usize,
    /// Just past the head.
    end: Option<usize>,
    line_checked: bool,
    checked_lf: usize,
}

impl HeadScan {
    /// Scan `buf[..limit]` on from where the last call stopped.
    fn advance(&mut self, buf: &[u8], limit: usize) {
        let stop = buf.len().min(limit);
        if self.pos > stop {
            // The bytes shrank: not the protocol; start over.
            *self = HeadScan::default();
        }
        while self.pos < stop {
            let i = self.pos;
            let Some(&b) = buf.get(i) else { return };
            match self.phase {
                Phase::Empty => match b {
                    b'\r' => self.phase = Phase::EmptyCr,
                    b'\n' => {}
                    _ => {
                        self.start = i;
                        self.phase = Phase::Line;
                        self.line(b, i);
                    }
                },
                Phase::EmptyCr if b == b'\n' => self.phase = Phase::Empty,
                Phase::EmptyCr => {
                    self.phase = Phase::BadCr;
                    return;
                }
                Phase::Line => self.line(b, i),
                // Inside a field line only its LF matters: go to it at once.
                Phase::Fields(0) if b != b'\n' => {
                    let rest = buf.get(i..stop).unwrap_or_default();
                    match rest.iter().position(|&c| c == b'\n') {
                        Some(at) => self.pos = i + at,
                        None => self.pos = stop,
                    }
                    continue;
                }
                Phase::Fields(after) => match (after, b) {
                    (1 | 2, b'\n') => {
                        self.end = Some(i + 1);
                        self.phase = Phase::Done;
                    }
                    (1, b'\r') => self.phase = Phase::Fields(2),
                    (_, b'\n') => {
                        self.last_lf = i + 1;
                        self.phase = Phase::Fields(1);
                    }
                    _ => self.phase = Phase::Fields(0),
                },
                Phase::Done | Phase::BadCr => return,
            }
            self.pos = i + 1;
        }
    }

    /// Byte `b` at offset `i` of the start line.
    fn line(&mut self, b: u8, i: usize) {
        let was = self.request_line;
        self.request_line = was.next(b);
        if was == RequestLine::Method && self.request_line == RequestLine::TargetStart {
            self.word_end = Some(i);
        }
        if b == b'\n' {
            self.line_end = Some(i + 1);
            self.last_lf = i + 1;
            self.phase = Phase::Fields(1);
        }
    }
}

// ---------------------------------------------------------------------------
// Chunked transfer coding (RFC 9112 §7.1), shared by both directions.

#[derive(Debug, Clone, Copy, Default)]
enum ChunkState {
    /// Before a chunk-size line.
    #[default]
    Size,
    /// Inside chunk data.
    Data(u64),
    /// The CRLF after chunk data.
    DataEnd,
    /// After the last chunk: trailer fields, then CRLF. `checked` bytes of
    /// complete, valid field lines (`fields` of them) were seen before.
    Trailers { checked: usize, fields: usize },
}

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Chunked {
    state: ChunkState,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkBounds {
    pub(crate) trailer_bytes: usize,
    pub(crate) trailer_fields: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkStep {
    /// This many bytes (more than 0) are framing or data; state advanced.
    Advance(usize),
    /// This many bytes (more than 0) end the body.
    Done(usize),
    NeedMore,
    Bad(&'static str),
}

impl Chunked {
    /// Inside chunk data: what the next step advances over is data.
    pub(crate) fn in_data(&self) -> bool {
        matches!(self.state, ChunkState::Data(_))
    }

    pub(crate) fn step(&mut self, buf: &[u8], bounds: ChunkBounds) -> ChunkStep {
        if buf.is_empty() {
            return ChunkStep::NeedMore;
        }
        match self.state {
            ChunkState::Size => match chunk_size_line(buf) {
                Ok(Some((0, len))) => {
                    self.state = ChunkState::Trailers {
                        checked: 0,
                        fields: 0,
                    };
                    ChunkStep::Advance(len)
                }
                Ok(Some((size, len))) => {
                    self.state = ChunkState::Data(size);
                    ChunkStep::Advance(len)
                }
                Ok(None) => ChunkStep::NeedMore,
                Err(detail) => ChunkStep::Bad(detail),
            },
            ChunkState::Data(left) => {
                let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                let left = left - n as u64;
                self.state = if left == 0 {
                    ChunkState::DataEnd
                } else {
                    ChunkState::Data(left)
                };
                ChunkStep::Advance(n)
            }
            ChunkState::DataEnd => match (buf.first(), buf.get(1)) {
                (Some(b'\r'), None) => ChunkStep::NeedMore,
                (Some(b'\r'), Some(b'\n')) => {
                    self.state = ChunkState::Size;
                    ChunkStep::Advance(2)
                }
                _ => ChunkStep::Bad("chunk data not followed by CRLF"),
            },
            ChunkState::Trailers { checked, fields } => {
                let (checked, fields) = if checked > buf.len() {
                    (0, 0)
                } else {
                    (checked, fields)
                };
                self.trailers(buf, checked, fields, bounds)
            }
        }
    }

    /// The trailer section from `start` on (earlier lines already checked).
    fn trailers(
        &mut self,
        buf: &[u8],
        mut start: usize,
        mut fields: usize,
        bounds: ChunkBounds,
    ) -> ChunkStep {
        let limit = buf.len().min(bounds.trailer_bytes);
        let window = buf.get(..limit).unwrap_or_default();
        loop {
            let line = window.get(start..).unwrap_or_default();
            let Some(cr) = line.iter().position(|&b| b == b'\r' || b == b'\n') else {
                break;
            };
            match (line.get(cr), line.get(cr + 1)) {
                (Some(b'\r'), Some(b'\n')) => {}
                (Some(b'\r'), None) => break,
                _ => return ChunkStep::Bad("trailer line not ended by CRLF"),
            }
            if cr == 0 {
                return ChunkStep::Done(start + 2);
            }
            if !is_field_line(line.get(..cr).unwrap_or_default()) {
                return ChunkStep::Bad("malformed trailer field");
            }
            fields += 1;
            if fields > bounds.trailer_fields {
                return ChunkStep::Bad("too many trailer fields");
            }
            start += cr + 2;
        }
        if buf.len() >= bounds.trailer_bytes {
            return ChunkStep::Bad("trailer section too large");
        }
        self.state = ChunkState::Trailers {
            checked: start,
            fields,
        };
        ChunkStep::NeedMore
    }
}

/// `1*HEXDIG [BWS] [";" ext] CRLF`, ext of HTAB and visible ASCII: the size
/// and the line's length, `None` for a valid prefix.
fn chunk_size_line(buf: &[u8]) -> Result<Option<(u64, usize)>, &'static str> {
    let line = buf.get(..MAX_CHUNK_LINE).unwrap_or(buf);
    let more = || {
        if buf.len() >= MAX_CHUNK_LINE {
            Err("chunk-size line too long")
        } else {
            Ok(None)
        }
    };
    let mut size: u64 = 0;
    let mut i = 0;
    while let Some(d) = line.get(i).and_then(|&b| char::from(b).to_digit(16)) {
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(d)))
            .ok_or("chunk size overflows")?;
        i += 1;
    }
    if i == 0 {
        return match line.first() {
            None => more(),
            Some(_) => Err("chunk size is not hexadecimal"),
        };
    }
    while matches!(line.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    if line.get(i) == Some(&b';') {
        while matches!(line.get(i), Some(b'\t' | 0x20..=0x7e)) {
            i += 1;
        }
    }
    match (line.get(i), line.get(i + 1)) {
        (Some(b'\r'), Some(b'\n')) => Ok(Some((size, i + 2))),
        (None, _) | (Some(b'\r'), None) => more(),
        _ => Err("malformed chunk-size line"),
    }
}

/// `field-name ":" OWS field-value OWS`: a token, then HTAB, SP, visible
/// ASCII or obs-text.
fn is_field_line(line: &[u8]) -> bool {
    let Some(colon) = line.iter().position(|&b| b == b':') else {
        return false;
    };
    let (name, value) = line.split_at(colon);
    !name.is_empty()
        && name.iter().all(|&b| is_tchar(b))
        && value
            .iter()
            .skip(1)
            .all(|&b| b == b'\t' || b == b' ' || b.is_ascii_graphic() || b >= 0x80)
}

// ---------------------------------------------------------------------------
// The upstream direction: follows responses to learn upgrade outcomes.

#[derive(Debug, Clone, Copy, Default)]
enum Up {
    /// At a response start.
    #[default]
    Head,
    Body(u64),
    Chunked(Chunked),
    /// A close-delimited body: no later response can be followed.
    UntilClose,
    /// A 101 to the upgrade request: the rest is another protocol.
    Switched,
    /// The bytes could not be followed.
    Lost(&'static str),
}

/// What became of an upgrade request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UpgradeFate {
    Switched,
    Refused,
    Lost(&'static str),
    Unknown,
}

#[derive(Debug, Default)]
struct Upstream {
    state: Up,
    /// The unparsed tail of a response head, chunk-size line or trailer
    /// section (bounded by the limits of each).
    pending: Vec<u8>,
    scan: HeadScan,
    /// For each forwarded request awaiting its final response: is it HEAD?
    inflight: VecDeque<bool>,
    /// Requests forwarded (sequence number of the last one).
    sent: u64,
    /// Final responses seen.
    answered: u64,
    /// Sequence number of the upgrade request awaiting its outcome.
    upgrade: Option<u64>,
}

/// The bounds of a response's chunk trailers.
pub(crate) const UPSTREAM_CHUNKS: ChunkBounds = ChunkBounds {
    trailer_bytes: MAX_RESPONSE_HEAD,
    trailer_fields: MAX_RESPONSE_HEADERS,
};

impl Upstream {
    fn following(&self) -> bool {
        matches!(self.state, Up::Head | Up::Body(_) | Up::Chunked(_))
    }

    /// Why no later response can be followed, if so.
    fn lost(&self) -> Option<&'static str> {
        match self.state {
            Up::Head | Up::Body(_) | Up::Chunked(_) | Up::Switched => None,
            Up::UntilClose => Some("a close-delimited response"),
            Up::Lost(why) => Some(why),
        }
    }

    /// Bytes left of a Content-Length body, when nothing is pending.
    fn body_left(&self) -> u64 {
        match self.state {
            Up::Body(left) if self.pending.is_empty() => left,
            _ => 0,
        }
    }

    /// `n` body bytes passed unobserved (the `Up::Body` step of [`Self::step`]).
    fn passed(&mut self, n: u64) {
        if let Up::Body(left) = self.state {
            if self.pending.is_empty() {
                let left = left - n.min(left);
                self.state = if left == 0 { Up::Head } else { Up::Body(left) };
            }
        }
    }

    /// A request was forwarded; its sequence number.
    fn push(&mut self, head: bool, upgrade: bool) -> u64 {
        self.sent += 1;
        if self.following() {
            self.inflight.push_back(head);
            if upgrade {
                self.upgrade = Some(self.sent);
            }
        }
        self.sent
    }

    fn outcome(&self, seq: u64) -> UpgradeFate {
        if matches!(self.state, Up::Switched) {
            UpgradeFate::Switched
        } else if self.answered >= seq {
            UpgradeFate::Refused
        } else if let Some(why) = self.lost() {
            UpgradeFate::Lost(why)
        } else {
            UpgradeFate::Unknown
        }
    }

    fn lose(&mut self, why: &'static str) {
        self.state = Up::Lost(why);
        self.pending = Vec::new();
        self.inflight = VecDeque::new();
    }

    /// Follow `bytes`, holding only an unfinished head or framing line.
    fn observe(&mut self, mut input: &[u8]) {
        // Room for the largest bounded unit plus one byte, so every bound
        // is reached before `pending` is full.
        const CAP: usize = MAX_RESPONSE_HEAD + 1;
        while self.following() {
            if self.pending.is_empty() {
                if input.is_empty() {
                    return;
                }
                match self.step(input) {
                    Some(n) => input = input.get(n..).unwrap_or_default(),
                    None => {
                        if self.following() {
                            self.pending.extend_from_slice(input);
                        }
                        return;
                    }
                }
            } else {
                let take = CAP.saturating_sub(self.pending.len()).min(input.len());
                let (more, rest) = input.split_at(take);
                self.pending.extend_from_slice(more);
                input = rest;
                let pending = std::mem::take(&mut self.pending);
                match self.step(&pending) {
                    Some(n) => {
                        self.pending = pending;
                        self.pending.drain(..n.min(self.pending.len()));
                    }
                    None if !self.following() => return,
                    None if input.is_empty() => {
                        self.pending = pending;
                        return;
                    }
                    // Unreachable: every unit's bound is below CAP.
                    None => return self.lose("response framing exceeds its bound"),
                }
            }
        }
        self.pending = Vec::new();
    }

    /// Judge a prefix of `buf` (not empty): bytes consumed (more than 0),
    /// or `None` to wait for more (or the tracker stopped following).
    fn step(&mut self, buf: &[u8]) -> Option<usize> {
        match self.state {
            Up::Head => self.head(buf),
            Up::Body(left) => {
                let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                let left = left - n as u64;
                self.state = if left == 0 { Up::Head } else { Up::Body(left) };
                Some(n).filter(|&n| n > 0)
            }
            Up::Chunked(mut dec) => match dec.step(buf, UPSTREAM_CHUNKS) {
                ChunkStep::Advance(n) => {
                    self.state = Up::Chunked(dec);
                    Some(n)
                }
                ChunkStep::Done(n) => {
                    self.state = Up::Head;
                    Some(n)
                }
                ChunkStep::NeedMore => {
                    self.state = Up::Chunked(dec);
                    None
                }
                ChunkStep::Bad(why) => {
                    self.lose(why);
                    None
                }
            },
            Up::UntilClose | Up::Switched | Up::Lost(_) => None,
        }
    }

    fn head(&mut self, buf: &[u8]) -> Option<usize> {
        if self.inflight.is_empty() {
            self.lose("response bytes with no request awaiting one");
            return None;
        }
        self.scan.advance(buf, MAX_RESPONSE_HEAD);
        let Some(end) = self.scan.end else {
            if self.scan.phase == Phase::BadCr {
                self.lose("bare CR before a status line");
            } else if buf.len() >= MAX_RESPONSE_HEAD {
                self.lose("response head too large");
            }
            return None;
        };
        self.scan = HeadScan::default();
        let head = buf.get(..end).unwrap_or_default();
        let parsed = with_header_slots(MAX_RESPONSE_HEADERS, |slots| {
            let mut resp = httparse::Response::new(slots);
            Ok(match resp.parse(head)? {
                httparse::Status::Complete(n) if n == end => {
                    resp.code.map(|code| (code, framing(resp.headers)))
                }
                _ => None,
            })
        });
        let Ok(Some((code, framing))) = parsed else {
            self.lose("malformed response head");
            return None;
        };
        let is_head = self.inflight.front().copied().unwrap_or_default();
        match code {
            101 if self.upgrade == Some(self.answered + 1) => {
                self.state = Up::Switched;
                return Some(end);
            }
            101 => {
                self.lose("101 to a request that asked for no upgrade");
                return None;
            }
            // Interim: the same request still awaits its final response.
            100..=199 => return Some(end),
            200..=999 => {}
            _ => {
                self.lose("status code below 100");
                return None;
            }
        }
        self.inflight.pop_front();
        self.answered += 1;
        if self.upgrade == Some(self.answered) {
            self.upgrade = None;
        }
        // RFC 9112 §6.3.
        self.state = if is_head || code == 204 || code == 304 {
            Up::Head
        } else {
            match framing {
                ResponseFraming::Chunked => Up::Chunked(Chunked::default()),
                ResponseFraming::UntilClose | ResponseFraming::Length(Ok(None)) => Up::UntilClose,
                ResponseFraming::Length(Ok(Some(0))) => Up::Head,
                ResponseFraming::Length(Ok(Some(n))) => Up::Body(n),
                ResponseFraming::Length(Err(why)) => {
                    self.lose(why);
                    return None;
                }
            }
        };
        Some(end)
    }
}

/// What a response head's fields say of its body's framing (RFC 9112
/// §6.3), for a status that has a body.
enum ResponseFraming {
    /// Transfer-Encoding whose last coding is chunked.
    Chunked,
    /// Transfer-Encoding ending in another coding: the body runs to the close.
    UntilClose,
    /// No Transfer-Encoding: the Content-Length, if any (or why it is bad).
    Length(Result<Option<u64>, &'static str>),
}

fn framing(headers: &[httparse::Header<'_>]) -> ResponseFraming {
    let named = |name: &'static str| {
        headers
            .iter()
            .filter(move |h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value)
    };
    if named("transfer-encoding").next().is_some() {
        let last = named("transfer-encoding")
            .flat_map(list_items)
            .filter(|c| !c.is_empty())
            .last();
        if last.is_some_and(|c| c.eq_ignore_ascii_case(b"chunked")) {
            ResponseFraming::Chunked
        } else {
            ResponseFraming::UntilClose
        }
    } else {
        ResponseFraming::Length(content_length(named("content-length")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::{pump_http, Pumped};
    use ViolationKind::{HostMismatch, Malformed, ProtocolMismatch, UpgradeNotAllowed};

    const A: &[u8] = b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
    const B: &[u8] = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    const WS: &[u8] = b"GET /chat HTTP/1.1\r\nHost: allowed.test\r\n\
        Connection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\
        Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    const SWITCHED: &[u8] = b"HTTP/1.1 101 Switching Protocols\r\n\
        Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x02hi";

    fn guard() -> HttpGuard {
        on(80, Limits::default())
    }

    fn on(port: u16, limits: Limits) -> HttpGuard {
        HttpGuard::new(Host::Name("allowed.test".into()), port, limits)
    }

    fn cat(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    /// Pump `client` (with `server` passing at the first `Wait`) whole, split
    /// at every position, and byte by byte: all give the same result.
    fn check_on(mk: impl Fn() -> HttpGuard, client: &[u8], server: &[u8]) -> Pumped {
        let whole = pump_http(&mut mk(), &[client], &[server]);
        for at in 0..=client.len() {
            let (a, b) = client.split_at(at);
            let split = pump_http(&mut mk(), &[a, b], &[server]);
            assert_eq!(split, whole, "client split at {at}");
        }
        for at in 0..=server.len() {
            let (a, b) = server.split_at(at);
            let split = pump_http(&mut mk(), &[client], &[a, b]);
            assert_eq!(split, whole, "server split at {at}");
        }
        let client_bytes: Vec<&[u8]> = client.chunks(1).collect();
        let server_bytes: Vec<&[u8]> = server.chunks(1).collect();
        let bytewise = pump_http(&mut mk(), &client_bytes, &server_bytes);
        assert_eq!(bytewise, whole, "byte by byte");
        assert!(whole.forwarded <= client.len());
        whole
    }

    fn check(client: &[u8], server: &[u8]) -> Pumped {
        check_on(guard, client, server)
    }

    /// Everything forwarded, nothing denied.
    fn passes(client: &[u8], server: &[u8]) -> Pumped {
        let p = check(client, server);
        assert_eq!(p.forwarded, client.len(), "{p:?}");
        assert!(matches!(p.end, Step::NeedMore | Step::Opaque), "{p:?}");
        p
    }

    /// Denied with `kind`, after forwarding exactly `forwarded` bytes.
    fn denied(client: &[u8], server: &[u8], forwarded: usize, kind: ViolationKind) -> Violation {
        denied_on(guard, client, server, forwarded, kind)
    }

    fn denied_on(
        mk: impl Fn() -> HttpGuard,
        client: &[u8],
        server: &[u8],
        forwarded: usize,
        kind: ViolationKind,
    ) -> Violation {
        let p = check_on(mk, client, server);
        assert_eq!(p.forwarded, forwarded, "{p:?}");
        match p.end {
            Step::Deny(v) if v.kind == kind => v,
            other => panic!("expected {kind:?}, got {other:?}"),
        }
    }

    /// The answer for `bytes` given at once to a fresh guard.
    fn first(bytes: &[u8]) -> Step {
        guard().client(bytes)
    }

    fn deny_kind(step: Step) -> ViolationKind {
        match step {
            Step::Deny(v) => v.kind,
            other => panic!("not a denial: {other:?}"),
        }
    }

    #[test]
    fn every_prefix_needs_more_then_forwards() {
        for i in 0..A.len() {
            assert_eq!(first(&A[..i]), Step::NeedMore, "prefix {i}");
        }
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        assert_eq!(g.requests(), 1);
        assert_eq!(g.first_host(), Some("allowed.test"));
        assert_eq!(g.client(b""), Step::NeedMore);
    }

    #[test]
    fn keep_alive_request_for_another_host_is_denied() {
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        let v = match g.client(B) {
            Step::Deny(v) => v,
            other => panic!("{other:?}"),
        };
        assert_eq!(v.kind, HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        // Denial is final.
        assert_eq!(g.client(A), Step::Deny(v));
        assert_eq!(g.requests(), 1);

        let v = denied(&cat(&[A, B]), b"", A.len(), HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        // The other host second in a pipeline is denied too.
        denied(&cat(&[A, A, B, A]), b"", 2 * A.len(), HostMismatch);
    }

    #[test]
    fn pipelined_requests_in_one_buffer() {
        let post = b"POST /f HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n\r\nhello";
        let all = cat(&[A, post, A]);
        let mut g = guard();
        assert_eq!(g.client(&all), Step::Forward(all.len()));
        assert_eq!(g.requests(), 3);
        let p = passes(&all, b"");
        assert_eq!(p.requests, 3);
        assert_eq!(p.first_host.as_deref(), Some("allowed.test"));
    }

    #[test]
    fn leading_empty_lines() {
        passes(&cat(&[b"\r\n\n\r\n", A, b"\r\n", A]), b"");
        let v = denied(&cat(&[A, b"\r\n\r\n", B]), b"", A.len(), HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        denied(&cat(&[b"\n", B]), b"", 0, HostMismatch);
        // Empty lines alone are held, not forwarded.
        let p = check(&cat(&[A, b"\r\n\r\n"]), b"");
        assert_eq!((p.forwarded, p.end), (A.len(), Step::NeedMore));
        // A CR that does not end a line is not HTTP.
        denied(b"\r\rGET / HTTP/1.1\r\n", b"", 0, ProtocolMismatch);
        // They count toward the head bound.
        let small = || {
            on(
                80,
                Limits {
                    max_head_bytes: 64,
                    max_headers: 10,
                },
            )
        };
        let many = cat(&[&b"\r\n".repeat(20), A]);
        let v = denied_on(small, &many, b"", 0, Malformed);
        assert_eq!(v.detail, "request head too large");
    }

    #[test]
    fn host_and_port() {
        let req = |host: &str| format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes();
        passes(&req("allowed.test:80"), b"");
        passes(&req("ALLOWED.test."), b"");
        passes(&req("allowed.test:080"), b"");
        let v = denied(&req("allowed.test:8080"), b"", 0, HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("allowed.test:8080"));
        let v = denied(&req("other.test"), b"", 0, HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        // A tunnel on another port: a Host without port is that port.
        let on_8080 = || on(8080, Limits::default());
        let p = check_on(on_8080, &req("allowed.test"), b"");
        assert_eq!(p.forwarded, req("allowed.test").len());
        denied_on(on_8080, &req("allowed.test:80"), b"", 0, HostMismatch);
        // Names that are not hosts, or an authority that is not one.
        let v = denied(&req(""), b"", 0, HostMismatch);
        assert_eq!(v.seen.as_deref(), Some(""));
        denied(&req("a..test"), b"", 0, HostMismatch);
        denied(&req("allowed.test:0"), b"", 0, Malformed);
        denied(&req("u@allowed.test"), b"", 0, Malformed);
        denied(&req("[::1"), b"", 0, HostMismatch);
        // Servers match the bytes: no IDNA or width mapping of a Host.
        let v = denied(&req("ａｌｌｏｗｅｄ.test"), b"", 0, HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("ａｌｌｏｗｅｄ.test"));
        // An IP tunnel.
        let ip = || HttpGuard::new(Host::Ip([192, 0, 2, 1].into()), 80, Limits::default());
        let p = check_on(ip, &req("192.0.2.1"), b"");
        assert_eq!(p.first_host.as_deref(), Some("192.0.2.1"));
    }

    #[test]
    fn missing_host() {
        for version in ["1.0", "1.1"] {
            let req = format!("GET / HTTP/{version}\r\nAccept: */*\r\n\r\n");
            let v = denied(req.as_bytes(), b"", 0, HostMismatch);
            assert_eq!(v.seen, None);
            assert_eq!(v.detail, "request without Host");
        }
        passes(b"GET / HTTP/1.0\r\nHost: allowed.test\r\n\r\n", b"");
    }

    #[test]
    fn duplicate_host() {
        let two = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nhost: other.test\r\n\r\n";
        let v = denied(two, b"", 0, Malformed);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        let same = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: allowed.test\r\n\r\n";
        denied(same, b"", 0, Malformed);
    }

    #[test]
    fn request_target_forms() {
        let with = |target: &str, host: &str| {
            format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes()
        };
        passes(&with("http://allowed.test/x?y", "allowed.test"), b"");
        passes(&with("HTTPS://allowed.test:80", "allowed.test"), b"");
        passes(&with("http://allowed.test?q", "allowed.test:80"), b"");
        let v = denied(
            &with("http://other.test/", "allowed.test"),
            b"",
            0,
            HostMismatch,
        );
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        let v = denied(
            &with("http://allowed.test/", "other.test"),
            b"",
            0,
            HostMismatch,
        );
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        denied(
            &with("http://allowed.test:81/", "allowed.test"),
            b"",
            0,
            HostMismatch,
        );
        denied(
            &with("http://u@allowed.test/", "allowed.test"),
            b"",
            0,
            Malformed,
        );
        denied(&with("http:///x", "allowed.test"), b"", 0, HostMismatch);
        denied(
            &with("ftp://allowed.test/", "allowed.test"),
            b"",
            0,
            Malformed,
        );
        denied(&with("allowed.test:80", "allowed.test"), b"", 0, Malformed);
        passes(b"OPTIONS * HTTP/1.1\r\nHost: allowed.test\r\n\r\n", b"");
        denied(&with("*", "allowed.test"), b"", 0, Malformed);
        denied(
            b"OPTIONS * HTTP/1.1\r\nHost: other.test\r\n\r\n",
            b"",
            0,
            HostMismatch,
        );
    }

    #[test]
    fn not_http_is_denied_at_once() {
        for (bytes, kind) in [
            (&b"\x16\x03\x01"[..], ProtocolMismatch),
            (b"SSH-2.0-OpenSSH_9.6 Ubuntu\r\n", ProtocolMismatch),
            (b" GET", ProtocolMismatch),
            (b"GET\r\n", ProtocolMismatch),
            (b"G(", ProtocolMismatch),
            (b"GET  / HTTP/1.1", ProtocolMismatch),
            (b"GET / HTTP/2.0\r\n", ProtocolMismatch),
            (b"GET / HTTP/1.1 x\r\n", ProtocolMismatch),
            (b"CONNECT ", ProtocolMismatch),
            (b"\r\nconnect ", ProtocolMismatch),
        ] {
            assert_eq!(deny_kind(first(bytes)), kind, "{bytes:?}");
            denied(bytes, b"", 0, kind);
        }
        let v = denied(
            b"CONNECT allowed.test:80 HTTP/1.1\r\n\r\n",
            b"",
            0,
            ProtocolMismatch,
        );
        assert_eq!(v.detail, "CONNECT inside a tunnel");
        // Method tokens are not only upper case; the server decides.
        assert_eq!(first(b"get "), Step::NeedMore);
        assert_eq!(first(b"M-SEARCH / HT"), Step::NeedMore);
    }

    #[test]
    fn head_bounds_and_malformed_fields() {
        let limits = Limits {
            max_head_bytes: 256,
            max_headers: 4,
        };
        let small = || on(80, limits);
        let mut big = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nX: ".to_vec();
        big.resize(300, b'a');
        let v = denied_on(small, &big, b"", 0, Malformed);
        assert_eq!(v.detail, "request head too large");
        let five = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n";
        denied_on(small, five, b"", 0, Malformed);
        let four = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
        let p = check_on(small, four, b"");
        assert_eq!(p.forwarded, four.len());
        // A bad field line is denied when its line ends, before the head does.
        let bad = b"GET / HTTP/1.1\r\nBad Name: x\r\n";
        assert_eq!(deny_kind(first(bad)), Malformed);
        denied(
            b"GET / HTTP/1.1\r\nHost : allowed.test\r\n\r\n",
            b"",
            0,
            Malformed,
        );
        denied(
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\n folded\r\n\r\n",
            b"",
            0,
            Malformed,
        );
        denied(
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\rX\r\n\r\n",
            b"",
            0,
            Malformed,
        );
    }

    #[test]
    fn body_framing() {
        let with = |fields: &str, body: &str| {
            format!("POST / HTTP/1.1\r\nHost: allowed.test\r\n{fields}\r\n{body}").into_bytes()
        };
        for fields in [
            "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
            "Transfer-Encoding: gzip\r\n",
            "Transfer-Encoding: chunked, gzip\r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n",
            "Transfer-Encoding: chunked, chunked\r\n",
            "Transfer-Encoding: \r\n",
            "Transfer-Encoding: gzip,,chunked\r\n",
            "Transfer-Encoding: chunked;q=1\r\n",
            "Content-Length: 3, 4\r\n",
            "Content-Length: 3\r\nContent-Length: 4\r\n",
            "Content-Length: +3\r\n",
            "Content-Length: 0x3\r\n",
            "Content-Length: \r\n",
            "Content-Length: 3 3\r\n",
            "Content-Length: 18446744073709551616\r\n",
            "Content_Length: 3\r\n",
            "Transfer_Encoding: chunked\r\n",
        ] {
            let v = denied(&with(fields, "abc"), b"", 0, Malformed);
            assert!(!v.detail.is_empty(), "{fields}");
        }
        denied(
            b"POST / HTTP/1.0\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"",
            0,
            Malformed,
        );
        for fields in [
            "Content-Length: 3\r\n",
            "Content-Length: 3, 3\r\nContent-Length: 003\r\n",
            "Content-length:3 \r\n",
        ] {
            passes(&cat(&[&with(fields, "abc"), A]), b"");
        }
        passes(
            &with(
                "Transfer-Encoding: gzip, Chunked\r\n",
                "3\r\nabc\r\n0\r\n\r\n",
            ),
            b"",
        );
        // A body is data, whatever it looks like.
        let hidden = with(
            &format!("Content-Length: {}\r\n", B.len()),
            std::str::from_utf8(B).unwrap_or_default(),
        );
        passes(&cat(&[&hidden, A]), b"");
        denied(&cat(&[&hidden, B]), b"", hidden.len(), HostMismatch);
        // Without framing fields there is no body.
        denied(
            &cat(&[&with("", ""), B]),
            b"",
            with("", "").len(),
            HostMismatch,
        );
    }

    #[test]
    fn body_bytes_are_streamed_not_held() {
        let head = b"PUT /f HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 10\r\n\r\n";
        let mut g = guard();
        assert_eq!(
            g.client(&cat(&[head, b"abcd"])),
            Step::Forward(head.len() + 4)
        );
        assert_eq!(g.client(b"e"), Step::Forward(1));
        assert_eq!(g.client(b""), Step::NeedMore);
        assert_eq!(g.client(&cat(&[b"fghij", B])), Step::Forward(5));
        assert_eq!(deny_kind(g.client(B)), HostMismatch);

        let chunked =
            b"PUT /f HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut g = guard();
        assert_eq!(
            g.client(&cat(&[chunked, b"a"])),
            Step::Forward(chunked.len())
        );
        assert_eq!(
            g.client(b"a\r"),
            Step::NeedMore,
            "size line held until complete"
        );
        assert_eq!(g.client(b"a\r\n0123"), Step::Forward(7));
        assert_eq!(g.client(b"456789\r"), Step::Forward(6));
        assert_eq!(g.client(b"\r"), Step::NeedMore);
        assert_eq!(g.client(b"\r\n0\r\n\r\n"), Step::Forward(7));
        assert_eq!(g.client(A), Step::Forward(A.len()));
    }

    #[test]
    fn chunked_with_extensions_and_trailers_then_another_host() {
        let post = b"POST /u HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n\
            5;name=\"v a\";x\r\nhello\r\n10 ; big\r\n0123456789abcdef\r\n\
            0;last\r\nChecksum: abc\r\nX-T:  y \r\n\r\n";
        passes(&cat(&[post, A]), b"");
        let v = denied(&cat(&[post, B]), b"", post.len(), HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        // A request inside chunk data is data.
        let inside = cat(&[
            b"POST /u HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n",
            format!("{:x}\r\n", B.len()).as_bytes(),
            B,
            b"\r\n0\r\n\r\n",
        ]);
        passes(&cat(&[&inside, A]), b"");
    }

    #[test]
    fn chunked_errors() {
        let head = b"POST / HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n";
        for body in [
            &b"g\r\n"[..],
            b"\r\n",
            b" 5\r\n",
            b"-5\r\n",
            b"5\n",
            b"5\rx",
            b"5;a\nb\r\n",
            b"5;\x01\r\n",
            b"5 x\r\n",
            b"10000000000000000\r\n",
            b"5\r\nhelloX",
            b"5\r\nhello\n0\r\n\r\n",
            b"0\r\nBad Trailer\r\n\r\n",
            b"0\r\nT: v\n\r\n",
            b"0\r\n\n",
            b"0\r\n\rx",
        ] {
            let all = cat(&[head, body]);
            let p = check(&all, b"");
            assert!(
                matches!(&p.end, Step::Deny(v) if v.kind == Malformed),
                "{:?}: {p:?}",
                String::from_utf8_lossy(body)
            );
            assert!(p.forwarded < all.len());
        }
        let long = cat(&[head, b"5;", &[b'x'; MAX_CHUNK_LINE]]);
        let v = denied(&long, b"", head.len(), Malformed);
        assert_eq!(v.detail, "chunk-size line too long");
        let zeros = cat(&[head, &[b'0'; 4000], b"5\r\nhello\r\n0\r\n\r\n", A]);
        passes(&zeros, b"");
        // Trailers are bounded like a head.
        let small = || {
            on(
                80,
                Limits {
                    max_head_bytes: 128,
                    max_headers: 2,
                },
            )
        };
        let three = cat(&[head, b"0\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n"]);
        let v = denied_on(small, &three, b"", head.len() + 3, Malformed);
        assert_eq!(v.detail, "too many trailer fields");
        let big = cat(&[head, b"0\r\nA: ", &[b'a'; 200]]);
        let v = denied_on(small, &big, b"", head.len() + 3, Malformed);
        assert_eq!(v.detail, "trailer section too large");
    }

    #[test]
    fn h2c_is_denied() {
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        for i in 0..4 {
            assert_eq!(first(&PREFACE[..i]), Step::NeedMore, "prefix {i}");
        }
        for i in 4..=PREFACE.len() {
            assert_eq!(
                deny_kind(first(&PREFACE[..i])),
                UpgradeNotAllowed,
                "prefix {i}"
            );
        }
        denied(&cat(&[A, PREFACE]), b"", A.len(), UpgradeNotAllowed);
        for fields in [
            "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
            "Connection: Upgrade\r\nUpgrade: websocket, H2C\r\n",
            "Connection: Upgrade\r\nUpgrade: websocket\r\nUpgrade: h2c/1\r\n",
            "Upgrade: HTTP/2.0\r\n",
            "HTTP2-Settings: x\r\n",
        ] {
            let req = format!("GET / HTTP/1.1\r\nHost: allowed.test\r\n{fields}\r\n");
            denied(&cat(&[A, req.as_bytes()]), b"", A.len(), UpgradeNotAllowed);
        }
        denied(
            b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHTTP2_Settings: x\r\n\r\n",
            b"",
            0,
            Malformed,
        );
    }

    #[test]
    fn websocket_upgrade_switched_goes_opaque() {
        let frames = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
        let mut g = guard();
        assert_eq!(g.client(&cat(&[WS, frames])), Step::Forward(WS.len()));
        assert_eq!(g.client(frames), Step::Wait);
        g.server(&SWITCHED[..20]);
        assert_eq!(g.client(frames), Step::Wait);
        g.server(&SWITCHED[20..]);
        assert_eq!(g.client(frames), Step::Opaque);
        assert_eq!(g.client(B), Step::Opaque);
        g.server(b"\x88\x00 anything at all");

        let p = check(
            &cat(&[A, WS, frames, B]),
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        );
        assert_eq!(p.end, Step::Wait, "the 101 never came");
        assert_eq!(p.forwarded, A.len() + WS.len());
        let server = cat(&[b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", SWITCHED]);
        let p = check(&cat(&[A, WS, frames, B]), &server);
        assert_eq!(p.end, Step::Opaque);
        assert_eq!(p.requests, 2);
        // An upgrade request with a body: the body is forwarded, then Wait.
        let body = b"POST /up HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: x\r\nContent-Length: 3\r\n\r\nabc";
        let mut g = guard();
        assert_eq!(g.client(&cat(&[body, A])), Step::Forward(body.len()));
        assert_eq!(g.client(A), Step::Wait);
    }

    #[test]
    fn upgrade_refused_resumes_verification() {
        for response in [
            &b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n",
        ] {
            let v = denied(
                &cat(&[WS, A, B]),
                response,
                WS.len() + A.len(),
                HostMismatch,
            );
            assert_eq!(v.seen.as_deref(), Some("other.test"));
            let p = passes(&cat(&[WS, A]), response);
            assert_eq!(p.requests, 2);
        }
        // Without the outcome, nothing after the upgrade request moves.
        let p = check(
            &cat(&[WS, A]),
            b"HTTP/1.1 426 Upgrade Required\r\nContent-Length: 0\r\n",
        );
        assert_eq!((p.forwarded, p.end), (WS.len(), Step::Wait));
    }

    #[test]
    fn head_response_has_no_body() {
        let head = b"HEAD / HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
        let server = cat(&[
            b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1000\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
            SWITCHED,
        ]);
        let p = passes(&cat(&[head, A, A, A, WS, b"frames"]), &server);
        assert_eq!(p.end, Step::Opaque);
    }

    #[test]
    fn interim_responses() {
        let post = b"POST / HTTP/1.1\r\nHost: allowed.test\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n";
        let server = cat(&[
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
            SWITCHED,
        ]);
        let p = passes(&cat(&[post, b"hello", WS, b"frames"]), &server);
        assert_eq!(p.end, Step::Opaque);
        let mut g = guard();
        assert_eq!(g.client(post), Step::Forward(post.len()));
        g.server(b"HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(g.client(b"hello"), Step::Forward(5));
        // A 100 to the upgrade request itself is not its outcome.
        let mut g = guard();
        assert_eq!(g.client(WS), Step::Forward(WS.len()));
        g.server(b"HTTP/1.1 100 Continue\r\n\r\n");
        assert_eq!(g.client(A), Step::Wait);
        g.server(SWITCHED);
        assert_eq!(g.client(A), Step::Opaque);
    }

    #[test]
    fn upstream_lost_then_upgrade_is_denied() {
        let lost = |server: &[u8], requests: &[&[u8]]| {
            let mut g = guard();
            for r in requests {
                assert_eq!(g.client(r), Step::Forward(r.len()));
            }
            g.server(server);
            // Ordinary requests still pass: they need no upstream tracking.
            assert_eq!(g.client(A), Step::Forward(A.len()));
            match g.client(WS) {
                Step::Deny(v) => {
                    assert_eq!(v.kind, ProtocolMismatch);
                    assert!(v
                        .detail
                        .starts_with("upstream responses could not be followed"));
                }
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(server)),
            }
        };
        lost(b"HTTP/1.1 200 OK\r\n\r\n", &[]);
        lost(b"garbage\r\n\r\n", &[A]);
        lost(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", &[A]);
        lost(b"HTTP/1.1 200 OK\r\n\r\nbody until close", &[A]);
        lost(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", &[A]);
        lost(
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n",
            &[A],
        );
        lost(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", &[A]);
        lost(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nz\r\n",
            &[A],
        );
        lost(b"HTTP/1.1 099 Odd\r\n\r\n", &[A]);
        lost(b"\r\rHTTP/1.1 200 OK\r\n\r\n", &[A]);
        let mut huge = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        huge.resize(MAX_RESPONSE_HEAD + 10, b'a');
        lost(&huge, &[A]);
        // Lost while the upgrade's outcome is awaited.
        let mut g = guard();
        assert_eq!(g.client(WS), Step::Forward(WS.len()));
        assert_eq!(g.client(A), Step::Wait);
        g.server(b"HTTP/1.1 junk\r\n\r\n");
        assert_eq!(deny_kind(g.client(A)), ProtocolMismatch);
        // Through the pump, split anywhere.
        let v = denied(
            &cat(&[A, WS]),
            b"HTTP/1.1 200 OK\r\n\r\nabc",
            A.len() + WS.len(),
            ProtocolMismatch,
        );
        assert!(
            v.detail.ends_with("a close-delimited response"),
            "{}",
            v.detail
        );
    }

    #[test]
    fn requests_in_flight_are_bounded() {
        let many = A.repeat(MAX_IN_FLIGHT + 1);
        let mut g = guard();
        assert_eq!(g.client(&many), Step::Forward(MAX_IN_FLIGHT * A.len()));
        assert_eq!(g.client(A), Step::Wait);
        g.server(b"HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(g.client(A), Step::Forward(A.len()));
        // Once responses cannot be followed, there is nothing to bound.
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        g.server(b"HTTP/1.1 200 OK\r\n\r\n");
        assert_eq!(g.client(&many), Step::Forward(many.len()));
    }

    #[test]
    fn upstream_memory_is_bounded() {
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        g.server(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n");
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..20 {
            g.server(&chunk);
        }
        assert!(g.upstream.pending.capacity() < 1024);
        g.server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        g.server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffff\r\n");
        for _ in 0..20 {
            g.server(&chunk);
        }
        assert!(g.upstream.pending.capacity() < 1024);
        assert!(g.upstream.following());
        // A partial head is held up to its bound, then the tracker gives up.
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        g.server(b"HTTP/1.1 200 OK\r\n");
        for _ in 0..MAX_RESPONSE_HEAD / 64 {
            g.server(&[b'a'; 64]);
        }
        assert!(g.upstream.pending.len() <= MAX_RESPONSE_HEAD + 1);
        g.server(&chunk);
        assert!(!g.upstream.following());
        assert!(g.upstream.pending.capacity() == 0);
    }

    #[test]
    fn driver_that_shrinks_held_bytes_gets_a_rescan() {
        let mut g = guard();
        assert_eq!(g.client(b"GET / HTTP/1.1\r\nHost: allowed"), Step::NeedMore);
        assert_eq!(deny_kind(g.client(b"\x16")), ProtocolMismatch);
        let mut g = guard();
        assert_eq!(g.client(b"GET / HTTP/1.1\r\nHost: allowed"), Step::NeedMore);
        assert_eq!(deny_kind(g.client(B)), HostMismatch);
    }

    /// Bodies of known length passed unjudged (the driver's splice) leave
    /// the guard exactly where judging them would: the next head is judged.
    #[test]
    fn bodies_passed_unjudged_end_where_judged_ones_do() {
        // Request body: POST with 10 bytes, then a head for another host.
        let post = b"POST / HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 10\r\n\r\n";
        let mut g = guard();
        assert_eq!(g.client_body_left(), 0);
        assert_eq!(g.client(post), Step::Forward(post.len()));
        assert_eq!(g.client_body_left(), 10);
        g.client_passed(4);
        assert_eq!(g.client_body_left(), 6);
        g.client_passed(6);
        assert_eq!(g.client_body_left(), 0);
        assert_eq!(deny_kind(g.client(B)), HostMismatch);
        // Passing more than is left never runs into the next head.
        let mut g = guard();
        assert_eq!(g.client(post), Step::Forward(post.len()));
        g.client_passed(1000);
        assert_eq!(g.client_body_left(), 0);
        assert_eq!(deny_kind(g.client(b"\x16")), ProtocolMismatch);
        // Chunked bodies are never passed unjudged.
        let mut g = guard();
        let chunked =
            b"POST / HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(g.client(chunked), Step::Forward(chunked.len()));
        assert_eq!(g.client_body_left(), 0);

        // Response body: passed unobserved, the next response is followed
        // from its first byte (one byte off and the 101 would be lost).
        for split in [0usize, 1, 5, 9] {
            let mut g = guard();
            assert_eq!(g.client(&cat(&[A, WS])), Step::Forward(A.len() + WS.len()));
            assert_eq!(g.server_body_left(), 0);
            g.server(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n");
            g.server(&b"012345678"[..split]);
            assert_eq!(g.server_body_left(), 9 - split as u64);
            g.server_passed(9 - split as u64);
            assert_eq!(g.server_body_left(), 0);
            // The upgrade's outcome is still to come: Wait, then 101.
            assert_eq!(g.client(A), Step::Wait);
            g.server(SWITCHED);
            assert_eq!(g.client(A), Step::Opaque);
        }
        // A partial head pending: nothing may pass unobserved.
        let mut g = guard();
        assert_eq!(g.client(A), Step::Forward(A.len()));
        g.server(b"HTTP/1.1 200 OK\r\nContent-Le");
        assert_eq!(g.server_body_left(), 0);
        g.server_passed(5);
        g.server(b"ngth: 2\r\n\r\n");
        assert_eq!(g.server_body_left(), 2);
    }

    #[test]
    fn fuzz_property_holds_on_seeds() {
        let seeds: &[&[u8]] = &[
            A,
            &cat(&[A, B]),
            &cat(&[WS, b"frames\0\0", SWITCHED]),
            &cat(&[WS, A, b"\0\0HTTP/1.1 426 No\r\nContent-Length: 0\r\n\r\n"]),
            b"\0\0HTTP/1.1 200 OK\r\n\r\n",
            b"",
        ];
        for s in seeds {
            crate::fuzzing::http_stream(s);
        }
    }
}
