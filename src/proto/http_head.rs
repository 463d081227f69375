//! HTTP/1.x request heads, pure, over the bytes read so far; nothing is
//! consumed (the caller replays the bytes). [`parse`], for transparent
//! mode: is this an HTTP request, and which host does it name?
//! [`connect`], for the explicit listener: the first request head, if it
//! is a CONNECT the listener answers alone.

/// Largest request head looked at; more is `Malformed`.
pub(crate) const MAX_HEAD_LEN: usize = 16 * 1024;
/// Largest number of headers looked at; more is `Malformed`.
pub(crate) const MAX_HEADERS: usize = 100;

use super::Parse;

/// The request line starts with a method token (RFC 9110 §9: uppercase
/// letters in practice) followed by a space, within the first 16 bytes.
fn looks_like_http(buf: &[u8]) -> Option<bool> {
    for (i, &b) in buf.iter().enumerate().take(17) {
        match b {
            b'A'..=b'Z' | b'-' | b'_' => continue,
            b' ' if i > 0 => return Some(true),
            _ => return Some(false),
        }
    }
    if buf.len() >= 17 {
        Some(false)
    } else {
        None
    }
}

/// Classify `buf`. `Done`'s value is the Host header (or the authority of an
/// absolute-form target), as sent, if any, and `len` the head's length;
/// `NotThis` is not an HTTP/1.x request; `Malformed` looks like HTTP but is
/// malformed, ambiguous (two Host headers, Host disagreeing with an
/// absolute-form target) or too large. Empty lines before the request line
/// are skipped, as servers skip them (RFC 9112 §2.2), and counted in `len`.
pub(crate) fn parse(buf: &[u8]) -> Parse<Option<String>> {
    let skip = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    if skip >= MAX_HEAD_LEN {
        return Parse::Malformed("request head too large");
    }
    match parse_head(buf.get(skip..).unwrap_or_default(), MAX_HEAD_LEN - skip) {
        Parse::Done { value, len } => Parse::Done {
            value,
            len: len + skip,
        },
        other => other,
    }
}

/// [`parse`] after any empty lines, with `max` bytes left for the head.
fn parse_head(buf: &[u8], max: usize) -> Parse<Option<String>> {
    match looks_like_http(buf) {
        None => return Parse::NeedMore,
        Some(false) => return Parse::NotThis,
        Some(true) => {}
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= max => {
            return Parse::Malformed("request head too large")
        }
        Ok(httparse::Status::Partial) => return Parse::NeedMore,
        Err(httparse::Error::TooManyHeaders) => return Parse::Malformed("too many headers"),
        Err(_) => return Parse::Malformed("malformed request head"),
    };
    if len > max {
        return Parse::Malformed("request head too large");
    }
    let mut host: Option<&[u8]> = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Parse::Malformed("more than one Host header");
            }
            host = Some(h.value);
        }
    }
    let host = match host.map(std::str::from_utf8) {
        Some(Ok(h)) => Some(h.trim().to_string()),
        Some(Err(_)) => return Parse::Malformed("Host header is not UTF-8"),
        None => None,
    };
    // An absolute-form target names the host too; it must agree.
    let target_host = req
        .path
        .and_then(|p| p.split_once("://"))
        .map(|(_, rest)| rest.split(['/', '?', '#']).next().unwrap_or(""))
        .map(|auth| auth.rsplit('@').next().unwrap_or(auth).to_string());
    match (host, target_host) {
        (Some(h), Some(t)) if !h.eq_ignore_ascii_case(&t) => {
            Parse::Malformed("Host header and request target disagree")
        }
        (Some(h), _) => Parse::Done {
            value: Some(h),
            len,
        },
        (None, t) => Parse::Done { value: t, len },
    }
}

/// A CONNECT head that needs nothing of HTTP beyond it (HTTP/1.1, no body
/// framing, no expectation), as the explicit listener's checks read it:
/// the target as an [`http::Uri`], the head's size and header count, the
/// `Proxy-Authorization` values, and the trace context headers. Its
/// other headers are read (and checked as `http` would take them) but
/// not kept.
#[derive(Debug)]
pub(crate) struct ConnectHead {
    /// The request target (an authority, if the request is well formed).
    pub target: http::Uri,
    /// How many header fields the head has.
    pub headers: usize,
    /// The head's bytes as `http` types would count them: the request
    /// line and `name: value` lines, give or take whitespace (the measure
    /// of `max_request_head_bytes` for every request).
    pub size: u64,
    /// The first `Proxy-Authorization` value, and whether another follows.
    pub authorization: Option<(Vec<u8>, bool)>,
    /// `traceparent` and `tracestate`, for a trace's parent (empty, and
    /// not allocated, without them).
    pub trace: http::HeaderMap,
}

/// The first request head of an explicit-proxy connection, if it is a
/// CONNECT the listener answers alone: `Done` with its [`ConnectHead`] and
/// `len` (counting any empty lines before it, which servers skip, RFC 9112
/// §2.2) for exactly the heads `request` (the model, in the tests) would
/// take whole as `http` types with method `CONNECT`, version HTTP/1.1 and
/// no `Content-Length`, `Transfer-Encoding` or `Expect`; `NeedMore` for a valid prefix;
/// `NotThis` for any other complete head (another method, version or
/// framing); `Malformed` for what `httparse` or `http` reject or more than
/// `max_headers` headers. The caller bounds the buffer; nothing is consumed.
pub(crate) fn connect(buf: &[u8], max_headers: usize) -> Parse<ConnectHead> {
    first_head(buf, max_headers, |req| {
        let (method, path) = (req.method.unwrap_or_default(), req.path.unwrap_or_default());
        if !matches!(req.version, Some(0 | 1)) {
            return Parse::Malformed("unknown HTTP version");
        }
        // What `http` takes of a method, a target and each field.
        let Ok(target) = http::Uri::try_from(path) else {
            return Parse::Malformed("request line or header not valid");
        };
        if http::Method::from_bytes(method.as_bytes()).is_err()
            || !req.headers.iter().all(|h| field_taken(h.name, h.value))
        {
            return Parse::Malformed("request line or header not valid");
        }
        let framed = |name: &str| {
            req.headers
                .iter()
                .any(|h| h.name.eq_ignore_ascii_case(name))
        };
        if method != "CONNECT"
            || req.version != Some(1)
            || framed("content-length")
            || framed("transfer-encoding")
            || framed("expect")
        {
            return Parse::NotThis;
        }
        let mut authorization: Option<(Vec<u8>, bool)> = None;
        let mut trace = http::HeaderMap::new();
        let fields = req.headers.iter().map(|h| (h.name.len(), h.value.len()));
        let size = head_len(method.len(), shown_len(&target), fields);
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("proxy-authorization") {
                match &mut authorization {
                    Some((_, more)) => *more = true,
                    None => authorization = Some((h.value.to_vec(), false)),
                }
            } else if h.name.eq_ignore_ascii_case("traceparent")
                || h.name.eq_ignore_ascii_case("tracestate")
            {
                let name = http::HeaderName::from_bytes(h.name.as_bytes());
                let value = http::HeaderValue::from_bytes(h.value);
                if let (Ok(name), Ok(value)) = (name, value) {
                    trace.append(name, value);
                }
            }
        }
        Parse::Done {
            value: ConnectHead {
                target,
                headers: req.headers.len(),
                size,
                authorization,
                trace,
            },
            len: 0,
        }
    })
}

/// The first request head of `buf`, after any empty lines (which servers
/// skip, RFC 9112 §2.2), parsed by `httparse` into at most `max_headers`
/// fields and, once complete, judged by `take`: what it returns, a `Done`'s
/// `len` set to the head's (the empty lines counted); `NeedMore` for a
/// valid prefix; `Malformed` for what `httparse` rejects or more than
/// `max_headers` fields.
fn first_head<T>(
    buf: &[u8],
    max_headers: usize,
    take: impl Fn(&httparse::Request<'_, '_>) -> Parse<T>,
) -> Parse<T> {
    let skip = buf
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(buf.len());
    let head = buf.get(skip..).unwrap_or_default();
    if head.is_empty() {
        return Parse::NeedMore;
    }
    let parsed = with_header_slots(max_headers, |slots| {
        let mut req = httparse::Request::new(slots);
        Ok(match req.parse(head)? {
            httparse::Status::Complete(len) => match take(&req) {
                Parse::Done { value, .. } => Parse::Done {
                    value,
                    len: skip + len,
                },
                other => other,
            },
            httparse::Status::Partial => Parse::NeedMore,
        })
    });
    match parsed {
        Ok(parsed) => parsed,
        Err(httparse::Error::TooManyHeaders) => Parse::Malformed("too many headers"),
        Err(_) => Parse::Malformed("malformed request head"),
    }
}

/// A request head's bytes as sent, give or take whitespace: the request
/// line (`METHOD target HTTP/1.1` and CRLF, from the method's and the
/// target's lengths), a `name: value` line per field (from each name's
/// and value's lengths) and the blank line that ends it. The measure of
/// `max_request_head_bytes` for every request, whoever parsed it.
pub(crate) fn head_len(
    method: usize,
    target: usize,
    fields: impl IntoIterator<Item = (usize, usize)>,
) -> u64 {
    (method + target + 12) as u64 + fields_len(fields)
}

/// The field lines of a head as sent (`name: value` and CRLF each, from
/// each name's and value's lengths), with the blank line that ends it.
pub(crate) fn fields_len(fields: impl IntoIterator<Item = (usize, usize)>) -> u64 {
    let lines: usize = fields.into_iter().map(|(n, v)| n + v + 4).sum();
    lines as u64 + 2
}

/// The `(name, value)` lengths of `headers`' fields, for [`head_len`]
/// and [`fields_len`].
pub(crate) fn field_lens(headers: &http::HeaderMap) -> impl Iterator<Item = (usize, usize)> + '_ {
    headers.iter().map(|(n, v)| (n.as_str().len(), v.len()))
}

/// The length of `value`'s text, counted as it is written, not built.
pub(crate) fn shown_len(value: &impl std::fmt::Display) -> usize {
    struct Count(usize);
    impl std::fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = std::fmt::write(&mut count, format_args!("{value}"));
    count.0
}

/// Whether `http` takes a field `httparse` read: a name of token
/// characters within `http`'s bound, a value without control characters
/// other than tab (`http::HeaderName::from_bytes`,
/// `http::HeaderValue::from_bytes`), checked without copying either.
fn field_taken(name: &str, value: &[u8]) -> bool {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    !name.is_empty()
        && name.len() < 1 << 16
        && name.bytes().all(token)
        && value
            .iter()
            .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f))
}

/// The whole first request head of an explicit-proxy connection, as
/// `http` types: `Done` once the head is complete (`len` counts any empty
/// lines before it, which servers skip, RFC 9112 §2.2), `NeedMore` for a
/// valid prefix, `Malformed` for what `httparse` rejects, more than
/// `max_headers` headers, or a method, target or header `http` does not
/// take. The caller bounds the buffer; nothing is consumed. The model
/// [`connect`] is held to.
#[cfg(test)]
pub(crate) fn request(buf: &[u8], max_headers: usize) -> Parse<http::Request<()>> {
    first_head(buf, max_headers, |req| {
        let version = match req.version {
            Some(1) => http::Version::HTTP_11,
            Some(0) => http::Version::HTTP_10,
            _ => return Parse::Malformed("unknown HTTP version"),
        };
        let mut built = http::Request::builder()
            .method(req.method.unwrap_or_default())
            .uri(req.path.unwrap_or_default())
            .version(version);
        for h in req.headers.iter() {
            built = built.header(h.name, h.value);
        }
        match built.body(()) {
            Ok(value) => Parse::Done { value, len: 0 },
            Err(_) => Parse::Malformed("request line or header not valid"),
        }
    })
}

/// Header slots kept on the stack for one parse; a head with more headers
/// is parsed again into as many as allowed.
const STACK_HEADER_SLOTS: usize = 32;

/// Run `parse` over header slots for at most `max` headers: first over a
/// few on the stack, and again over all `max` (allocated) only when those
/// were too few, that is when it returned
/// `Err(httparse::Error::TooManyHeaders)`. A head parses as it would into
/// `max` slots at once, without allocating and filling them for the
/// common head of a few headers.
pub(crate) fn with_header_slots<'b, T>(
    max: usize,
    mut parse: impl FnMut(&mut [httparse::Header<'b>]) -> Result<T, httparse::Error>,
) -> Result<T, httparse::Error> {
    let mut slots = [httparse::EMPTY_HEADER; STACK_HEADER_SLOTS];
    if let Some(enough) = slots.get_mut(..max) {
        return parse(enough);
    }
    match parse(&mut slots) {
        Err(httparse::Error::TooManyHeaders) => parse(&mut vec![httparse::EMPTY_HEADER; max]),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_with_more_headers_than_the_stack_slots_parse_up_to_the_bound() {
        let head = |n: usize| {
            let mut h = b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n".to_vec();
            for i in 1..n {
                h.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
            }
            h.extend_from_slice(b"\r\n");
            h
        };
        for n in [1, STACK_HEADER_SLOTS, STACK_HEADER_SLOTS + 1, 100] {
            match request(&head(n), 100) {
                Parse::Done { value, len } => {
                    assert_eq!(value.headers().len(), n);
                    assert_eq!(len, head(n).len());
                }
                other => panic!("{n} headers: {other:?}"),
            }
        }
        for (n, max) in [(101, 100), (3, 2)] {
            let got = request(&head(n), max);
            assert!(
                matches!(got, Parse::Malformed("too many headers")),
                "{got:?}"
            );
        }
        // A partial head past the stack slots still needs more.
        let partial = head(40);
        let got = request(&partial[..partial.len() - 2], 100);
        assert!(matches!(got, Parse::NeedMore), "{got:?}");
    }

    const GET: &[u8] = b"GET /x HTTP/1.1\r\nHost: Allowed.test\r\nAccept: */*\r\n\r\nbody";

    #[test]
    fn leading_empty_lines_are_skipped_and_counted() {
        let mut req = b"\r\n\n".to_vec();
        req.extend_from_slice(GET);
        assert_eq!(
            parse(&req),
            Parse::Done {
                value: Some("Allowed.test".into()),
                len: GET.len() - 4 + 3
            }
        );
        assert_eq!(parse(b"\r\n\r\n"), Parse::NeedMore);
        assert_eq!(parse(b"\r\nSSH-2.0-x\r\n"), Parse::NotThis);
    }

    #[test]
    fn every_prefix_needs_more_then_done() {
        let end = GET.len() - 4;
        for i in 0..end {
            assert_eq!(parse(&GET[..i]), Parse::NeedMore, "prefix {i}");
        }
        assert_eq!(
            parse(GET),
            Parse::Done {
                value: Some("Allowed.test".into()),
                len: end
            }
        );
    }

    #[test]
    fn not_http() {
        assert_eq!(parse(b"SSH-2.0-OpenSSH\r\n"), Parse::NotThis);
        assert_eq!(parse(&[0x16, 0x03, 0x01]), Parse::NotThis);
        assert_eq!(parse(b"get / HTTP/1.1\r\n"), Parse::NotThis);
        assert_eq!(parse(b"AAAAAAAAAAAAAAAAAAAA"), Parse::NotThis);
    }

    #[test]
    fn ambiguous_or_bad_heads() {
        let two = b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n";
        assert!(matches!(parse(two), Parse::Malformed(_)));
        let disagree = b"GET http://b.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n";
        assert!(matches!(parse(disagree), Parse::Malformed(_)));
        let abs = b"GET http://u@b.test:8080/x HTTP/1.1\r\n\r\n";
        assert_eq!(
            parse(abs),
            Parse::Done {
                value: Some("b.test:8080".into()),
                len: abs.len()
            }
        );
        let none = b"GET / HTTP/1.0\r\n\r\n";
        assert_eq!(
            parse(none),
            Parse::Done {
                value: None,
                len: none.len()
            }
        );
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert!(matches!(parse(&many), Parse::Malformed(_)));
        let mut huge = b"GET / HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD_LEN + 10, b'a');
        assert!(matches!(parse(&huge), Parse::Malformed(_)));
        assert!(matches!(
            parse(b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n"),
            Parse::Malformed(_)
        ));
    }

    /// [`connect`] takes exactly the heads [`request`] takes whole as a
    /// lone HTTP/1.1 CONNECT, and reads of them what `http` types say.
    #[test]
    fn connect_heads_are_those_the_http_types_take_as_a_lone_connect() {
        let heads: &[&[u8]] = &[
            b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n",
            b"\r\n\r\nCONNECT a.test:443 HTTP/1.1\r\n\r\nearly",
            b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Basic eDp5\r\nX-Y:  v \r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nproxy-authorization: a\r\nPROXY-AUTHORIZATION: b\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ntracestate: x=1\r\n\r\n",
            b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n",
            b"CONNECT a.test HTTP/1.1\r\n\r\n",
            b"CONNECT /path HTTP/1.1\r\n\r\n",
            b"CONNECT http://a.test/ HTTP/1.1\r\n\r\n",
            b"CONNECT * HTTP/1.1\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.0\r\n\r\n",
            b"CONNECT a.test:443 HTTP/2.0\r\n\r\n",
            b"connect a.test:443 HTTP/1.1\r\n\r\n",
            b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nexpect: 100-continue\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nX: a\x7fb\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nX: caf\xc3\xa9\tok\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nX{}: v\r\n\r\n",
            b"CONNECT a.te\"st:443 HTTP/1.1\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n",
            b"CONNECT a.test:443 HTTP/1.1\r\nHost: a",
            b"\x16\x03\x01\x02\x00",
        ];
        for &head in heads {
            let model = match request(head, 2) {
                Parse::Done { value, len } => {
                    let h = value.headers();
                    let alone = value.method() == http::Method::CONNECT
                        && value.version() == http::Version::HTTP_11
                        && !h.contains_key("content-length")
                        && !h.contains_key("transfer-encoding")
                        && !h.contains_key("expect");
                    alone.then_some((value, len))
                }
                _ => None,
            };
            let got = connect(head, 2);
            let shown = String::from_utf8_lossy(head);
            match (model, got) {
                (Some((want, want_len)), Parse::Done { value, len }) => {
                    assert_eq!(len, want_len, "{shown}");
                    assert_eq!(value.target, *want.uri(), "{shown}");
                    assert_eq!(value.headers, want.headers().len(), "{shown}");
                    let fields: usize = want
                        .headers()
                        .iter()
                        .map(|(n, v)| n.as_str().len() + v.len() + 4)
                        .sum();
                    let line = "CONNECT".len() + want.uri().to_string().len() + 12;
                    assert_eq!(value.size, (line + fields + 2) as u64, "{shown}");
                    let mut auth = want.headers().get_all("proxy-authorization").iter();
                    let first = auth
                        .next()
                        .map(|v| (v.as_bytes().to_vec(), auth.next().is_some()));
                    assert_eq!(value.authorization, first, "{shown}");
                    for name in ["traceparent", "tracestate"] {
                        assert_eq!(value.trace.get(name), want.headers().get(name), "{shown}");
                    }
                }
                (None, Parse::Done { .. }) => panic!("taken alone, not by the model: {shown}"),
                (Some(_), other) => panic!("model takes it, connect says {other:?}: {shown}"),
                (None, Parse::NeedMore) => {
                    assert!(matches!(request(head, 2), Parse::NeedMore), "{shown}");
                }
                (None, _) => {}
            }
        }
        assert_eq!(
            shown_len(&http::Uri::from_static("http://a.test/x?y")),
            "http://a.test/x?y".len()
        );
    }

    #[test]
    fn whole_request_heads_as_http_types() {
        let connect = b"\r\nCONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\nhello";
        let end = connect.len() - 5;
        for i in 0..end {
            assert!(
                matches!(request(&connect[..i], 8), Parse::NeedMore),
                "prefix {i}"
            );
        }
        let Parse::Done { value, len } = request(connect, 8) else {
            panic!("CONNECT not parsed");
        };
        assert_eq!(len, end);
        assert_eq!(value.method(), http::Method::CONNECT);
        assert_eq!(value.uri().authority().unwrap().as_str(), "a.test:443");
        assert_eq!(value.version(), http::Version::HTTP_11);
        assert_eq!(value.headers()["host"], "a.test:443");
        let many = b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
        assert!(matches!(
            request(many, 2),
            Parse::Malformed("too many headers")
        ));
        assert!(matches!(request(many, 3), Parse::Done { .. }));
        for bad in [
            &b"CONNECT a.test:443 HTTP/2.0\r\n\r\n"[..],
            b"CONNECT a b HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n",
            b"\x16\x03\x01\x02\x00",
        ] {
            assert!(matches!(request(bad, 8), Parse::Malformed(_)), "{bad:?}");
        }
    }
}
