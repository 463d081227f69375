//! One forwarded HTTP/1.1 exchange as the upstream sees it, pure: the
//! request head Palisade writes ([`request_head`]), the response head it
//! reads ([`response_head`]) and where that response's body ends
//! ([`Decoder`]). The I/O around it is `proxy::http::upstream`.
//!
//! How a response is delimited (RFC 9112 §6.3), and whether its connection
//! may carry another request afterwards:
//!
//! | response | body | connection reusable |
//! |---|---|---|
//! | to a HEAD, or 204, or 304 | none | if HTTP/1.1 without `Connection: close` |
//! | 1xx other than 101 | none: an interim head, the final one follows | (the final one decides) |
//! | 101 (Palisade never asks for an upgrade) | refused | no |
//! | both `Transfer-Encoding` and `Content-Length` | refused | no |
//! | `Transfer-Encoding` in HTTP/1.0 | refused | no |
//! | `Transfer-Encoding` ending in one `chunked` | chunked (strict: `http_stream`'s decoder) | as above |
//! | other `Transfer-Encoding` | until the upstream closes | no |
//! | `Content-Length` (all values the same number) | that many bytes | as above |
//! | conflicting or malformed `Content-Length` | refused | no |
//! | neither | until the upstream closes | no |
//!
//! An HTTP/1.0 response never leaves its connection reusable, whatever it
//! says about keep-alive. Bytes after the end of a response that no
//! request asked for are never relayed: their connection is dropped.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

use super::http_stream::{
    content_length, list_items, ChunkStep, Chunked, MAX_RESPONSE_HEAD, MAX_RESPONSE_HEADERS,
    UPSTREAM_CHUNKS,
};
use super::Parse;

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body at all.
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    Chunked,
    /// Until the upstream closes the connection.
    Close,
}

/// A response head, as read from the upstream.
#[derive(Debug)]
pub(crate) struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Framing,
    /// Whether the connection may carry another request once the body
    /// is read to its end.
    pub keep_alive: bool,
}

impl Head {
    /// An interim (1xx) head: the final one follows.
    pub(crate) fn is_interim(&self) -> bool {
        self.status.is_informational()
    }
}

/// The head of an upstream's response to a request (`to_head`: a HEAD),
/// from the start of `buf`: `Done` with the head's length, `NeedMore` for
/// a valid prefix, `Malformed` for what the table in the module's notes
/// refuses, a head over [`MAX_RESPONSE_HEAD`] bytes or
/// [`MAX_RESPONSE_HEADERS`] fields, an obsolete line folding, or what
/// `httparse` or `http` reject.
pub(crate) fn response_head(buf: &[u8], to_head: bool) -> Parse<Head> {
    let mut fields = vec![httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut fields);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) if len <= MAX_RESPONSE_HEAD => len,
        Ok(httparse::Status::Partial) if buf.len() < MAX_RESPONSE_HEAD => return Parse::NeedMore,
        Ok(_) | Err(httparse::Error::TooManyHeaders) => {
            return Parse::Malformed("response head too large")
        }
        Err(_) => return Parse::Malformed("malformed response head"),
    };
    let version = match resp.version {
        Some(1) => Version::HTTP_11,
        Some(0) => Version::HTTP_10,
        _ => return Parse::Malformed("unknown HTTP version"),
    };
    let Some(status) = resp.code.and_then(|c| StatusCode::from_u16(c).ok()) else {
        return Parse::Malformed("bad status code");
    };
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Parse::Malformed("101 to a request that asked for no upgrade");
    }
    let mut headers = HeaderMap::with_capacity(resp.headers.len());
    for h in resp.headers.iter() {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(h.value),
        ) else {
            return Parse::Malformed("malformed response header");
        };
        headers.append(name, value);
    }
    let body = match framing(&headers, version, status, to_head) {
        Ok(body) => body,
        Err(why) => return Parse::Malformed(why),
    };
    let keep_alive = version == Version::HTTP_11
        && body != Framing::Close
        && !headers
            .get_all(http::header::CONNECTION)
            .iter()
            .flat_map(|v| list_items(v.as_bytes()))
            .any(|t| t.eq_ignore_ascii_case(b"close"));
    let value = Head {
        status,
        version,
        headers,
        body,
        keep_alive,
    };
    Parse::Done { value, len }
}

/// RFC 9112 §6.3 for a response, refusing what two parsers could read
/// differently (see the module's table).
fn framing(
    headers: &HeaderMap,
    version: Version,
    status: StatusCode,
    to_head: bool,
) -> Result<Framing, &'static str> {
    let values = |name| -> Vec<&[u8]> {
        headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    };
    let (te, cl) = (
        values(http::header::TRANSFER_ENCODING),
        values(http::header::CONTENT_LENGTH),
    );
    if !te.is_empty() && !cl.is_empty() {
        return Err("both Transfer-Encoding and Content-Length");
    }
    if !te.is_empty() && version == Version::HTTP_10 {
        return Err("Transfer-Encoding in an HTTP/1.0 response");
    }
    let length = content_length(cl.iter().copied())?;
    if to_head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if !te.is_empty() {
        let codings: Vec<&[u8]> = te
            .iter()
            .flat_map(|v| list_items(v))
            .filter(|c| !c.is_empty())
            .collect();
        let chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
        return match codings.split_last() {
            Some((last, rest)) if chunked(last) && !rest.iter().any(chunked) => {
                Ok(Framing::Chunked)
            }
            Some((last, _)) if chunked(last) => Err("chunked applied more than once"),
            _ => Ok(Framing::Close),
        };
    }
    Ok(match length {
        Some(n) => Framing::Length(n),
        None => Framing::Close,
    })
}

/// Where a response body ends, fed its bytes as they come.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decoder(Dec);

#[derive(Debug, Clone, Copy)]
enum Dec {
    Length(u64),
    Chunked(Chunked),
    Close,
    Done,
}

/// What the next bytes of a body are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece {
    /// This many bytes (more than 0) of the body's content.
    Data(usize),
    /// This many bytes (more than 0) of chunk framing or trailers.
    Framing(usize),
    /// A valid prefix of framing: read more.
    NeedMore,
    /// Malformed chunk framing.
    Bad(&'static str),
}

impl Decoder {
    pub(crate) fn new(framing: Framing) -> Decoder {
        Decoder(match framing {
            Framing::Empty | Framing::Length(0) => Dec::Done,
            Framing::Length(n) => Dec::Length(n),
            Framing::Chunked => Dec::Chunked(Chunked::default()),
            Framing::Close => Dec::Close,
        })
    }

    /// The body ended: bytes after it are not the response's.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.0, Dec::Done)
    }

    /// The body's next bytes, from the start of `buf`.
    pub(crate) fn step(&mut self, buf: &[u8]) -> Piece {
        if buf.is_empty() {
            return Piece::NeedMore;
        }
        match &mut self.0 {
            Dec::Done => Piece::NeedMore,
            Dec::Close => Piece::Data(buf.len()),
            Dec::Length(left) => {
                let n = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                *left -= n as u64;
                if *left == 0 {
                    self.0 = Dec::Done;
                }
                Piece::Data(n)
            }
            Dec::Chunked(dec) => {
                let data = dec.in_data();
                match dec.step(buf, UPSTREAM_CHUNKS) {
                    ChunkStep::Advance(n) if data => Piece::Data(n),
                    ChunkStep::Advance(n) => Piece::Framing(n),
                    ChunkStep::Done(n) => {
                        self.0 = Dec::Done;
                        Piece::Framing(n)
                    }
                    ChunkStep::NeedMore => Piece::NeedMore,
                    ChunkStep::Bad(why) => Piece::Bad(why),
                }
            }
        }
    }

    /// The upstream closed the connection: the end of a close-delimited
    /// body, and a body cut short for any other.
    pub(crate) fn at_eof(&mut self) -> Result<(), &'static str> {
        match self.0 {
            Dec::Done => Ok(()),
            Dec::Close => {
                self.0 = Dec::Done;
                Ok(())
            }
            Dec::Length(_) | Dec::Chunked(_) => Err("the upstream closed mid-body"),
        }
    }
}

/// The trailer fields of a chunked body's trailer section (what
/// [`Decoder`] ends the body with: the field lines and the empty line
/// after the last chunk, already checked), minus those a trailer may not
/// carry (framing, routing, authentication, content metadata and the
/// hop-by-hop ones, RFC 9110 §6.5.1) and any `http` does not take.
pub(crate) fn trailers(section: &[u8]) -> HeaderMap {
    let mut map = HeaderMap::new();
    let mut fields = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let Ok(httparse::Status::Complete((_, fields))) = httparse::parse_headers(section, &mut fields)
    else {
        return map;
    };
    for f in fields {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(f.name.as_bytes()),
            HeaderValue::from_bytes(f.value),
        ) else {
            continue;
        };
        if !NOT_TRAILERS.contains(&name.as_str()) {
            map.append(name, value);
        }
    }
    map
}

/// Fields never relayed as trailers.
const NOT_TRAILERS: [&str; 18] = [
    "authorization",
    "cache-control",
    "connection",
    "content-encoding",
    "content-length",
    "content-range",
    "content-type",
    "host",
    "keep-alive",
    "max-forwards",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "set-cookie",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The head of a request without a body for the upstream: the request
/// line in origin form (`target`), always HTTP/1.1 (RFC 9110 §6.2: an
/// intermediary sends its own version), then `headers` as they are (the
/// caller rewrote them: hop-by-hop ones gone, a Host). A method whose
/// request content has a meaning gets `content-length: 0` unless it has
/// one, so the upstream never waits for a body.
pub(crate) fn request_head(method: &Method, target: &str, headers: &HeaderMap) -> Vec<u8> {
    let size: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    let mut out = Vec::with_capacity(method.as_str().len() + target.len() + size + 32);
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let bodiless = matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    );
    if !bodiless && !headers.contains_key(http::header::CONTENT_LENGTH) {
        out.extend_from_slice(b"content-length: 0\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// A body framed so, `body` fed `step` bytes at a time (the tests' and
/// the fuzz target's driver): its content and how many bytes follow its
/// end, or why it failed.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn decode_all(
    framing: Framing,
    body: &[u8],
    step: usize,
) -> Result<(Vec<u8>, usize), &'static str> {
    let mut dec = Decoder::new(framing);
    let (mut content, mut held, mut fed) = (Vec::new(), Vec::<u8>::new(), 0);
    loop {
        if dec.is_done() {
            return Ok((content, held.len() + body.len() - fed));
        }
        match dec.step(&held) {
            Piece::Data(n) => {
                assert!(n > 0 && n <= held.len());
                content.extend(held.drain(..n));
            }
            Piece::Framing(n) => {
                assert!(n > 0 && n <= held.len());
                held.drain(..n);
            }
            Piece::Bad(why) => return Err(why),
            Piece::NeedMore if fed == body.len() => {
                dec.at_eof()?;
                return Ok((content, 0));
            }
            Piece::NeedMore => {
                let n = step.max(1).min(body.len() - fed);
                held.extend_from_slice(body.get(fed..fed + n).unwrap_or_default());
                fed += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(buf: &[u8], to_head: bool) -> (Head, usize) {
        match response_head(buf, to_head) {
            Parse::Done { value, len } => (value, len),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    fn refused(buf: &[u8]) -> &'static str {
        match response_head(buf, false) {
            Parse::Malformed(why) => why,
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(buf)),
        }
    }

    #[test]
    fn every_prefix_of_a_head_needs_more_and_the_whole_is_done() {
        let head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello";
        let end = head.len() - 5;
        for cut in 0..end {
            assert_eq!(
                response_head(&head[..cut], false).map_done(),
                None,
                "prefix of {cut}"
            );
        }
        let (h, len) = done(head, false);
        assert_eq!(len, end);
        assert_eq!(h.status, StatusCode::OK);
        assert_eq!(h.body, Framing::Length(5));
        assert!(h.keep_alive);
        assert_eq!(h.headers["x-a"], "b");
    }

    impl Parse<Head> {
        /// `None` for `NeedMore`; panics on anything else but `Done`.
        fn map_done(self) -> Option<usize> {
            match self {
                Parse::NeedMore => None,
                Parse::Done { len, .. } => Some(len),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn framing_follows_rfc_9112_and_the_request() {
        let cases: &[(&[u8], bool, Framing, bool)] = &[
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                false,
                Framing::Chunked,
                true,
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                false,
                Framing::Close,
                false,
            ),
            (b"HTTP/1.1 200 OK\r\n\r\n", false, Framing::Close, false),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n",
                true,
                Framing::Empty,
                true,
            ),
            (
                b"HTTP/1.1 204 No Content\r\n\r\n",
                false,
                Framing::Empty,
                true,
            ),
            (
                b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                false,
                Framing::Empty,
                true,
            ),
            (
                b"HTTP/1.1 100 Continue\r\n\r\n",
                false,
                Framing::Empty,
                true,
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n",
                false,
                Framing::Length(3),
                true,
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: keep-alive, Close\r\n\r\n",
                false,
                Framing::Length(3),
                false,
            ),
            (
                b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\n",
                false,
                Framing::Length(3),
                false,
            ),
            (
                b"HTTP/1.1 200 OK\nContent-Length: 3\n\n",
                false,
                Framing::Length(3),
                true,
            ),
        ];
        for (head, to_head, body, keep) in cases {
            let (h, _) = done(head, *to_head);
            let shown = String::from_utf8_lossy(head);
            assert_eq!(h.body, *body, "{shown}");
            assert_eq!(h.keep_alive, *keep, "{shown}");
        }
        assert!(done(b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n", false)
            .0
            .is_interim());
    }

    #[test]
    fn what_two_parsers_could_read_differently_is_refused() {
        for (head, why) in [
            (
                &b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
                "both",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                "conflicting",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\n",
                "conflicting",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\n",
                "not a number",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                "overflows",
            ),
            (
                b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                "HTTP/1.0",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
                "more than once",
            ),
            (b"HTTP/1.1 200 OK\r\nX-A: b\r\n c\r\n\r\n", "malformed"),
            (
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
                "101",
            ),
            (b"HTTP/1.1 099 Low\r\n\r\n", "status"),
            (b"HTTP/2.0 200 OK\r\n\r\n", "malformed"),
            (b"GET / HTTP/1.1\r\n\r\n", "malformed"),
        ] {
            let got = refused(head);
            assert!(
                got.contains(why),
                "{:?}: {got}",
                String::from_utf8_lossy(head)
            );
        }
        let mut big = b"HTTP/1.1 200 OK\r\n".to_vec();
        big.resize(MAX_RESPONSE_HEAD + 1, b'a');
        assert_eq!(refused(&big), "response head too large");
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_RESPONSE_HEADERS {
            many.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(refused(&many), "response head too large");
    }

    #[test]
    fn bodies_end_where_their_framing_says_whatever_the_reads() {
        let chunked = b"5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\nGET /next";
        for step in 1..=chunked.len() {
            assert_eq!(
                decode_all(Framing::Chunked, chunked, step),
                Ok((b"hello world".to_vec(), 9)),
                "pieces of {step}"
            );
            assert_eq!(
                decode_all(Framing::Length(5), b"hello, more", step),
                Ok((b"hello".to_vec(), 6))
            );
            assert_eq!(
                decode_all(Framing::Close, b"all of it", step),
                Ok((b"all of it".to_vec(), 0))
            );
        }
        assert_eq!(decode_all(Framing::Empty, b"extra", 1), Ok((vec![], 5)));
        assert_eq!(decode_all(Framing::Length(0), b"", 1), Ok((vec![], 0)));
    }

    #[test]
    fn a_body_cut_short_or_badly_chunked_is_an_error() {
        assert!(decode_all(Framing::Length(10), b"short", 3).is_err());
        assert!(decode_all(Framing::Chunked, b"5\r\nhel", 2).is_err());
        assert!(decode_all(Framing::Chunked, b"5\r\nhelloX\r\n", 2).is_err());
        assert!(decode_all(Framing::Chunked, b"5\nhello\r\n0\r\n\r\n", 2).is_err());
        assert!(decode_all(Framing::Chunked, b"zz\r\n", 1).is_err());
    }

    #[test]
    fn a_request_head_is_written_in_origin_form_as_http_1_1() {
        let mut h = HeaderMap::new();
        h.insert(http::header::HOST, HeaderValue::from_static("a.test:8080"));
        h.append("x-b", HeaderValue::from_static("1"));
        h.append("x-b", HeaderValue::from_static("2"));
        assert_eq!(
            request_head(&Method::GET, "/p?q", &h),
            b"GET /p?q HTTP/1.1\r\nhost: a.test:8080\r\nx-b: 1\r\nx-b: 2\r\n\r\n"
        );
        assert_eq!(
            request_head(&Method::POST, "/", &HeaderMap::new()),
            b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
        );
        let mut cl = HeaderMap::new();
        cl.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        assert_eq!(
            request_head(&Method::PUT, "/", &cl),
            b"PUT / HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
        );
    }
    #[test]
    fn trailer_sections_keep_only_fields_a_trailer_may_carry() {
        let t = trailers(b"X-Checksum: abc\r\nContent-Length: 5\r\nx-two: 1\r\nX-Two: 2\r\n\r\n");
        assert_eq!(t.get("x-checksum").unwrap(), "abc");
        assert!(t.get("content-length").is_none());
        assert_eq!(t.get_all("x-two").iter().count(), 2);
        assert!(trailers(b"\r\n").is_empty());
        assert!(trailers(b"bad line\r\n\r\n").is_empty());
    }
}
