//! One HTTP/1 connection server: hyper's HTTP/1 under our bounds, closed
//! gracefully on shutdown (in-flight requests finish, idle connections
//! close at once) and cut at the hard stop.

use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::channel::{Channel, Sender};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body as HttpBody, Incoming};
use hyper::service::HttpService;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

/// Why a streamed body stopped early.
pub(crate) type BodyError = Box<dyn StdError + Send + Sync>;

/// The body of every response served (the admin API, the proxy) and of
/// every request the proxy forwards, whole or streamed; its error (a
/// connection lost, a unit revoked) ends the exchange without a clean end
/// of body.
pub(crate) type Body = BoxBody<Bytes, BodyError>;

/// A body of `data` at once.
pub(crate) fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A body streamed as it comes: each chunk sent on the returned [`Sender`]
/// goes to the client as soon as the connection can take it (at most
/// `buffer` chunks wait); the body ends when the sender is dropped.
pub(crate) fn channel(buffer: usize) -> (Sender<Bytes, BodyError>, Body) {
    let (tx, body) = Channel::new(buffer);
    (tx, body.boxed())
}

/// The bounds of one HTTP/1 connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http1 {
    /// Time a request head may take, counted from the connection's start or
    /// the end of the previous response: it also closes idle keep-alive
    /// connections.
    pub header_read_timeout: Duration,
    /// hyper's read buffer, which bounds a request head.
    pub max_buf_size: usize,
    /// Headers one request may have (None: hyper's default).
    pub max_headers: Option<usize>,
    pub keep_alive: bool,
    /// Whether a response may upgrade the connection (CONNECT tunnels).
    pub upgrades: bool,
}

/// The shutdown signals a served connection follows: `shutdown` closes it
/// gracefully (in-flight requests finish, no new ones), `hard_stop` cuts it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Drain<'a> {
    pub shutdown: &'a CancellationToken,
    pub hard_stop: &'a CancellationToken,
}

/// Serve one HTTP/1 connection with `service` until it closes, or the
/// drain ends it.
pub(crate) async fn serve_http1<I, S, B>(
    io: I,
    service: S,
    settings: Http1,
    drain: Drain<'_>,
) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<BodyError>,
    B: HttpBody + 'static,
    B::Error: Into<BodyError>,
{
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(settings.max_buf_size)
        .keep_alive(settings.keep_alive);
    if let Some(n) = settings.max_headers {
        b.max_headers(n);
    }
    let conn = b.serve_connection(TokioIo::new(io), service);
    if settings.upgrades {
        drained(conn.with_upgrades(), |c| c.graceful_shutdown(), drain).await
    } else {
        drained(conn, |c| c.graceful_shutdown(), drain).await
    }
}

/// Run `conn` to its end; on shutdown ask it to finish gracefully, and
/// stop waiting at the hard stop (the connection is then dropped: closed).
pub(crate) async fn drained<C>(
    conn: C,
    graceful: impl FnOnce(Pin<&mut C>),
    drain: Drain<'_>,
) -> hyper::Result<()>
where
    C: Future<Output = hyper::Result<()>>,
{
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => r,
        _ = drain.shutdown.cancelled() => {
            graceful(conn.as_mut());
            tokio::select! {
                r = conn.as_mut() => r,
                _ = drain.hard_stop.cancelled() => Ok(()),
            }
        }
    }
}

/// A stream whose writes fail with `TimedOut` once one has made no
/// progress for `limit`: a client that stops reading a (streamed) response
/// cannot hold its connection forever, while one that reads, however long
/// the response lasts, is never cut. Reads are not bounded here (the head
/// is, by the header read timeout). hyper has no write timeout of its own.
pub(crate) struct WriteStall<I> {
    io: I,
    limit: Duration,
    /// Running while a write is pending.
    sleep: Pin<Box<Sleep>>,
    waiting: bool,
}

impl<I> WriteStall<I> {
    pub(crate) fn new(io: I, limit: Duration) -> Self {
        WriteStall {
            io,
            limit,
            sleep: Box::pin(tokio::time::sleep(limit)),
            waiting: false,
        }
    }

    /// What a write's poll means: progress resets the clock, a pending
    /// write runs it, and past `limit` the write fails.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Ready(r) => {
                self.waiting = false;
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.waiting {
                    self.waiting = true;
                    self.sleep.as_mut().reset(Instant::now() + self.limit);
                }
                match self.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "client stopped reading",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteStall<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for WriteStall<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.watch(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http::{Request, Response};
    use hyper::service::service_fn;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    const SETTINGS: Http1 = Http1 {
        header_read_timeout: Duration::from_secs(5),
        max_buf_size: 16 * 1024,
        max_headers: None,
        keep_alive: true,
        upgrades: false,
    };

    /// Read from `s` until `needle` arrives (bounded).
    async fn read_until(s: &mut TcpStream, seen: &mut Vec<u8>, needle: &[u8]) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [0u8; 4096];
        while !seen.windows(needle.len()).any(|w| w == needle) {
            match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => seen.extend_from_slice(&buf[..n]),
                _ => return false,
            }
        }
        true
    }

    /// `service` serving one connection on loopback until `shutdown` (and
    /// never a hard stop): the client's end, and the server's task.
    async fn serve_one<S, B>(
        service: S,
        shutdown: CancellationToken,
    ) -> (TcpStream, tokio::task::JoinHandle<hyper::Result<()>>)
    where
        S: HttpService<Incoming, ResBody = B> + Send + 'static,
        S::Future: Send,
        S::Error: Into<BodyError>,
        B: HttpBody + Send + 'static,
        B::Data: Send,
        B::Error: Into<BodyError>,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let hard_stop = CancellationToken::new();
            let drain = Drain {
                shutdown: &shutdown,
                hard_stop: &hard_stop,
            };
            serve_http1(stream, service, SETTINGS, drain).await
        });
        (TcpStream::connect(addr).await.unwrap(), server)
    }

    #[tokio::test]
    async fn a_streamed_bodys_first_chunk_reaches_the_client_before_the_body_ends() {
        // The second chunk is sent only once the client has seen the first.
        let (first_seen_tx, first_seen_rx) = tokio::sync::oneshot::channel::<()>();
        let first_seen_rx = std::sync::Mutex::new(Some(first_seen_rx));
        let service = service_fn(move |_req: Request<Incoming>| {
            let seen = first_seen_rx.lock().unwrap().take();
            async move {
                let (mut tx, body) = channel(4);
                tokio::spawn(async move {
                    let _ = tx.send_data(Bytes::from_static(b"first-chunk")).await;
                    if let Some(seen) = seen {
                        let _ = seen.await;
                    }
                    let _ = tx.send_data(Bytes::from_static(b"last-chunk")).await;
                });
                Ok::<_, Infallible>(Response::new(body))
            }
        });
        let (mut client, server) = serve_one(service, CancellationToken::new()).await;
        client
            .write_all(b"GET /stream HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut seen = Vec::new();
        assert!(read_until(&mut client, &mut seen, b"first-chunk").await);
        assert!(seen.starts_with(b"HTTP/1.1 200 OK"));
        assert!(!seen.windows(10).any(|w| w == b"last-chunk"));
        first_seen_tx.send(()).unwrap();
        assert!(read_until(&mut client, &mut seen, b"last-chunk").await);
        // Chunked, and ended with the last chunk.
        assert!(read_until(&mut client, &mut seen, b"0\r\n\r\n").await);
        let done = tokio::time::timeout(Duration::from_secs(5), server).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_finish_then_closes() {
        let shutdown = CancellationToken::new();
        let service = service_fn(|_req: Request<Incoming>| async {
            Ok::<_, Infallible>(Response::new(full("done")))
        });
        let (mut client, server) = serve_one(service, shutdown.clone()).await;
        // Half a head: the request is in flight when shutdown comes.
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!server.is_finished());
        client.write_all(b"\r\n").await.unwrap();
        let mut seen = Vec::new();
        assert!(read_until(&mut client, &mut seen, b"done").await);
        assert!(seen.starts_with(b"HTTP/1.1 200 OK"));
        // Then the connection closes, without a hard stop.
        let done = tokio::time::timeout(Duration::from_secs(5), server).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
        let mut rest = [0u8; 64];
        assert!(matches!(client.read(&mut rest).await, Ok(0)));
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_after_the_write_stall_limit() {
        let (client, server) = tokio::io::duplex(64);
        let mut io = WriteStall::new(server, Duration::from_millis(100));
        let started = std::time::Instant::now();
        let big = vec![0u8; 4096];
        let err = tokio::time::timeout(Duration::from_secs(5), io.write_all(&big))
            .await
            .expect("the stalled write ends")
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(100));
        drop(client);
    }

    #[tokio::test]
    async fn a_reading_client_is_never_cut() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut io = WriteStall::new(server, Duration::from_millis(100));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 16];
            // Slowly, but always within the limit.
            while got < 1024 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            got
        });
        io.write_all(&[1u8; 1024]).await.unwrap();
        assert_eq!(reader.await.unwrap(), 1024);
    }
}
