//! An upstream HTTP/1.1 connection Palisade speaks itself, for forwarded
//! requests without a body: the request head is written on the socket, the
//! response head read from it, and the response body relayed by its
//! framing ([`Relayed`]), all over the pure [`crate::proto::http_upstream`].
//! No client library and no connection task: an exchange is one write and
//! the reads its response takes, on the task of the client's request.
//!
//! A connection carries another request only after an exchange in order:
//! the response read to the end its framing gives, no byte after it, the
//! upstream HTTP/1.1 and not closing ([`Head::keep_alive`]). Only then is
//! it handed back ([`Relayed`] puts it in its [`Returned`] slot); anything
//! else (a body cut short, an error, bytes beyond the framing, a
//! close-delimited body) drops it. While idle it is checked before it is
//! used again ([`Upconn::is_usable`]): a byte the upstream sent unasked,
//! or its close, and it is dropped.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::Response;
use hyper::body::{Frame, SizeHint};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::proto::http_upstream::{response_head, trailers, Decoder, Head, Piece};
use crate::proto::Parse;
use crate::serve::http::BodyError;

/// How much a read asks for at a time.
const READ_SIZE: usize = 16 * 1024;

/// Interim (1xx) responses skipped before a final one, at most.
const MAX_INTERIM: usize = 16;

/// An upstream connection, idle between exchanges.
#[derive(Debug)]
pub(crate) struct Upconn {
    stream: TcpStream,
    /// Read and not yet relayed: after a response head, the start of its
    /// body. Empty while idle.
    buf: BytesMut,
}

/// Why an exchange got no response head.
#[derive(Debug)]
pub(crate) enum Failed {
    /// Not a byte of the request was written.
    Unsent,
    /// The connection closed or was reset before a complete head came.
    Lost(String),
    /// What came is not a response Palisade relays.
    Malformed(&'static str),
    Timeout,
}

/// Where an upstream connection goes once its response was read in
/// order, for the one who returns it to the pool.
pub(crate) type Returned = Arc<Mutex<Option<Upconn>>>;

impl Upconn {
    pub(crate) fn new(stream: TcpStream) -> Upconn {
        Upconn {
            stream,
            buf: BytesMut::new(),
        }
    }

    /// Idle and in order: nothing came from the upstream since its last
    /// exchange, and it did not close. At most one non-blocking read (none
    /// when the reactor saw nothing), and a byte it reads condemns the
    /// connection anyway.
    pub(crate) fn is_usable(&self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(self.stream.try_read(&mut probe),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// The socket, for a client library to take over (idle: nothing held).
    pub(crate) fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// Write `head` (a request without a body; `to_head`: a HEAD) and read
    /// the final response head, interim ones skipped, all within `timeout`.
    pub(crate) async fn exchange(
        mut self,
        head: &[u8],
        to_head: bool,
        timeout: Duration,
    ) -> Result<(Head, Upconn), Failed> {
        let exchange = async {
            self.send(head).await?;
            for _ in 0..=MAX_INTERIM {
                let resp = self.read_head(to_head).await?;
                if !resp.is_interim() {
                    return Ok(resp);
                }
            }
            Err(Failed::Malformed("too many interim responses"))
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(resp)) => Ok((resp, self)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Failed::Timeout),
        }
    }

    async fn send(&mut self, head: &[u8]) -> Result<(), Failed> {
        let mut written = 0;
        while written < head.len() {
            match self
                .stream
                .write(head.get(written..).unwrap_or_default())
                .await
            {
                Ok(0) if written == 0 => return Err(Failed::Unsent),
                Ok(0) => return Err(Failed::Lost("the upstream closed".into())),
                Ok(n) => written += n,
                Err(_) if written == 0 => return Err(Failed::Unsent),
                Err(e) => return Err(Failed::Lost(e.to_string())),
            }
        }
        Ok(())
    }

    /// Read until a whole response head is held; consume it.
    async fn read_head(&mut self, to_head: bool) -> Result<Head, Failed> {
        loop {
            match response_head(&self.buf, to_head) {
                Parse::Done { value, len } => {
                    self.buf.advance(len);
                    return Ok(value);
                }
                Parse::NeedMore => {}
                Parse::Malformed(why) => return Err(Failed::Malformed(why)),
                Parse::NotThis => return Err(Failed::Malformed("not an HTTP response")),
            }
            match std::future::poll_fn(|cx| self.poll_fill(cx)).await {
                Ok(0) => {
                    return Err(Failed::Lost(
                        "the upstream closed before a complete response head".into(),
                    ))
                }
                Ok(_) => {}
                Err(e) => return Err(Failed::Lost(e.to_string())),
            }
        }
    }

    /// Read what the socket has into `buf`: the bytes read, 0 at its end.
    /// Through `AsyncRead`: a read that does not fill the buffer tells
    /// the runtime the socket is drained, so [`Upconn::is_usable`] costs
    /// no system call unless something came since.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        self.buf.reserve(READ_SIZE);
        tokio_util::io::poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.buf)
    }
}

impl From<Failed> for super::client::NoResponse {
    fn from(f: Failed) -> Self {
        use super::client::NoResponse;
        match f {
            Failed::Unsent => NoResponse::NotSent("upstream connection closed".into()),
            Failed::Lost(e) => NoResponse::Lost(e),
            Failed::Malformed(why) => NoResponse::Malformed(why),
            Failed::Timeout => NoResponse::Timeout,
        }
    }
}

/// A response read from `conn` after `head`, its body relayed by its
/// framing; `conn` goes to `returned` once the exchange ended in order.
pub(crate) fn response(head: Head, conn: Upconn, returned: Returned) -> Response<Relayed> {
    let body = Relayed::new(conn, &head, returned);
    let mut resp = Response::new(body);
    *resp.status_mut() = head.status;
    *resp.version_mut() = head.version;
    *resp.headers_mut() = head.headers;
    resp
}

/// A response body read from its upstream connection by its framing:
/// never a byte past its end, an error for a body cut short or badly
/// chunked (the client's connection is then cut, never ended as if whole).
#[derive(Debug)]
pub(crate) struct Relayed {
    /// `None` once the body ended (or failed).
    conn: Option<Upconn>,
    dec: Decoder,
    keep_alive: bool,
    returned: Returned,
}

impl Relayed {
    fn new(conn: Upconn, head: &Head, returned: Returned) -> Relayed {
        let mut body = Relayed {
            conn: Some(conn),
            dec: Decoder::new(head.body),
            keep_alive: head.keep_alive,
            returned,
        };
        if body.dec.is_done() {
            // No body: the exchange is over already.
            body.finish();
        }
        body
    }

    /// The body's end: the connection goes back if the exchange was in
    /// order and nothing follows it.
    fn finish(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if self.keep_alive && conn.buf.is_empty() {
            // Idle: hold no buffer.
            conn.buf = BytesMut::new();
            *self.returned.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
        }
    }

    fn fail(&mut self, why: impl Into<BodyError>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.conn = None;
        Poll::Ready(Some(Err(why.into())))
    }
}

impl hyper::body::Body for Relayed {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match this.dec.step(&conn.buf) {
                Piece::Data(n) => {
                    let data = conn.buf.split_to(n).freeze();
                    if this.dec.is_done() {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Piece::Framing(n) if !this.dec.is_done() => {
                    conn.buf.advance(n);
                    continue;
                }
                Piece::Framing(n) => {
                    // A chunked body's last piece is its trailer section
                    // (a bare CRLF without trailers): relayed as the
                    // body's trailers.
                    let fields = (n > 2).then(|| trailers(&conn.buf[..n]));
                    conn.buf.advance(n);
                    this.finish();
                    let fields = fields.filter(|f| !f.is_empty());
                    return Poll::Ready(fields.map(|f| Ok(Frame::trailers(f))));
                }
                Piece::Bad(why) => return this.fail(why),
                Piece::NeedMore => {}
            }
            match std::task::ready!(conn.poll_fill(cx)) {
                Ok(0) => match this.dec.at_eof() {
                    Ok(()) => {
                        // Close-delimited: the connection is gone with it.
                        this.conn = None;
                        return Poll::Ready(None);
                    }
                    Err(why) => return this.fail(why),
                },
                Ok(_) => {}
                Err(e) => return this.fail(e),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    use super::*;

    const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: a.test\r\n\r\n";
    const WAIT: Duration = Duration::from_secs(5);

    /// A connection to an upstream on loopback that, for each request
    /// head it reads, writes the next of `answers` (then closes after the
    /// last); what it read comes back from the task.
    async fn upstream(answers: Vec<&'static [u8]>) -> (Upconn, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            for answer in answers {
                let mut heads = seen.windows(4).filter(|w| w == b"\r\n\r\n").count();
                let want = heads + 1;
                let mut buf = [0u8; 1024];
                while heads < want {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return seen,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                    heads = seen.windows(4).filter(|w| w == b"\r\n\r\n").count();
                }
                s.write_all(answer).await.unwrap();
            }
            // Hold the connection until the proxy side closes it.
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut rest)).await;
            seen.extend_from_slice(&rest);
            seen
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        (Upconn::new(stream), task)
    }

    /// One exchange on `conn`: the status, the body (or the error) and
    /// the connection if it came back.
    async fn exchange(conn: Upconn, to_head: bool) -> (u16, Result<Bytes, String>, Option<Upconn>) {
        let (head, conn) = conn.exchange(GET, to_head, WAIT).await.unwrap();
        let returned = Returned::default();
        let resp = response(head, conn, returned.clone());
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await;
        let body = body.map(|b| b.to_bytes()).map_err(|e| e.to_string());
        let back = returned.lock().unwrap().take();
        (status, body, back)
    }

    #[tokio::test]
    async fn an_exchange_in_order_gives_the_connection_back_for_the_next() {
        let (conn, task) = upstream(vec![
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ])
        .await;
        let (status, body, back) = exchange(conn, false).await;
        assert_eq!((status, body.unwrap()), (200, Bytes::from("hello")));
        let conn = back.expect("in order: back");
        assert!(conn.is_usable());
        let (_, body, back) = exchange(conn, false).await;
        assert_eq!(body.unwrap(), "abc");
        let (_, body, back) = exchange(back.expect("back"), true).await;
        assert_eq!(body.unwrap(), "", "a HEAD's response has no body");
        let (status, _, back) = exchange(back.expect("back"), false).await;
        assert_eq!(status, 204);
        drop(back);
        let seen = task.await.unwrap();
        assert_eq!(seen, GET.repeat(4));
    }

    #[tokio::test]
    async fn a_connection_out_of_order_is_never_given_back() {
        for (answer, body) in [
            // The upstream closes.
            (
                &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"[..],
                Ok("ok"),
            ),
            // HTTP/1.0, whatever it says.
            (
                b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok",
                Ok("ok"),
            ),
            // More than framed: never relayed, and the connection goes.
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n\r\n",
                Ok("ok"),
            ),
            // A body that lies about its length: cut, an error.
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort",
                Err(()),
            ),
            // Bad chunk framing.
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcX",
                Err(()),
            ),
        ] {
            let (conn, _task) = upstream(vec![answer]).await;
            let (_, got, back) = exchange(conn, false).await;
            let shown = String::from_utf8_lossy(answer);
            match body {
                Ok(b) => assert_eq!(got.unwrap(), b, "{shown}"),
                Err(()) => assert!(got.is_err(), "{shown}: {got:?}"),
            }
            assert!(back.is_none(), "{shown}");
        }
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_wrote_on_or_closed_is_not_usable() {
        // A byte past the framing came with the response.
        let (conn, task) = upstream(vec![b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nX"]).await;
        let (_, _, back) = exchange(conn, false).await;
        assert!(back.is_none());
        drop(task);
        // The upstream closes an idle connection.
        let (conn, task) = upstream(vec![b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]).await;
        let (_, _, back) = exchange(conn, false).await;
        let conn = back.expect("in order");
        task.abort();
        let _ = task.await;
        let mut usable = true;
        for _ in 0..500 {
            usable = conn.is_usable();
            if !usable {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(!usable, "closed while idle");
    }

    #[tokio::test]
    async fn a_refused_response_or_none_is_an_error_not_a_body() {
        let (conn, _task) = upstream(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
        ])
        .await;
        let got = conn.exchange(GET, false, WAIT).await;
        assert!(matches!(got, Err(Failed::Malformed(_))), "{got:?}");
        let (conn, task) = upstream(vec![b"HTTP/1.1 200 OK\r\n"]).await;
        let got = conn.exchange(GET, false, Duration::from_millis(300)).await;
        assert!(matches!(got, Err(Failed::Timeout)), "{got:?}");
        task.abort();
        // Closed after reading the request, no answer.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
        });
        let conn = Upconn::new(TcpStream::connect(addr).await.unwrap());
        let got = conn.exchange(GET, false, WAIT).await;
        assert!(matches!(got, Err(Failed::Lost(_))), "{got:?}");
    }
}
