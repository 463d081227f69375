//! The upstream side of the HTTP layer: a connection handshaken as
//! HTTP/1.1 (one exchange at a time) or HTTP/2 (multiplexed), and the wait
//! for a response head, bounded.
//!
//! An HTTP/1.1 connection carries another request only after an exchange
//! without a request body ([`InOrder`]). Palisade does not parse bodies,
//! and an upstream that never reads the body it was sent reads it as the
//! next request (a head planted in the body), whether it answered early or
//! after the whole body. So a request with a body asks the upstream to
//! close after its answer (`Connection: close`, [`InOrder::ask_close`]),
//! and its connection is cut when the response ends. One that answered
//! early is retired at once: no more of the body is handed to it, and
//! nothing else is sent over it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use super::body::OnComplete;
use super::Body;

/// A response head on its way.
pub(crate) type ResponseFuture =
    Pin<Box<dyn Future<Output = hyper::Result<Response<Incoming>>> + Send>>;

/// Why a forwarded request got no complete response head.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NoResponse {
    #[error("upstream response timed out")]
    Timeout,
    /// Closed, reset, or not HTTP.
    #[error("{0}")]
    Failed(#[from] hyper::Error),
    /// The request could not be handed to an upstream connection.
    #[error("request not sent: {0}")]
    NotSent(String),
    /// The connection closed or was reset before a complete response
    /// head came (Palisade's own HTTP/1.1 exchange,
    /// [`super::upstream`]).
    #[error("{0}")]
    Lost(String),
    /// What the upstream sent is not a response Palisade relays.
    #[error("malformed response from upstream: {0}")]
    Malformed(&'static str),
}

/// One HTTP connection to an upstream.
pub(crate) enum Sender {
    H1(http1::SendRequest<Body>, Retire),
    H2(http2::SendRequest<Body>),
}

/// Ends an HTTP/1.1 upstream connection that must carry nothing more:
/// once retired it counts as closed (no request is handed to it), and
/// [`Retire::cut`] drops the connection at once, whatever it was still
/// writing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Retire {
    retired: Arc<AtomicBool>,
    cut: CancellationToken,
}

impl Retire {
    /// No request is handed to the connection from now on.
    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Retire it and drop it now.
    fn cut(&self) {
        self.retire();
        self.cut.cancel();
    }

    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

/// One exchange's say on whether its HTTP/1.1 connection may carry
/// another request: only if the request had no body, and the response was
/// read to its end ([`InOrder::reusable`]). Dropped otherwise (a body, a
/// response cut short), it cuts the connection. At an early answer (the
/// response head came before the whole body was handed over:
/// [`InOrder::response_began`], an `Expect` exchange answered with a final
/// status before the body) no more of the body is written. HTTP/2 streams
/// are framed: nothing to keep in order there.
pub(crate) struct InOrder {
    retire: Option<Retire>,
    /// The request has a body: the connection is never reused.
    body: bool,
    sent: Arc<AtomicBool>,
    /// Set at an early answer: the request body ([`Gated`]) stops.
    stop: Arc<AtomicBool>,
    began_after: bool,
    kept: bool,
}

impl InOrder {
    /// Watch an exchange whose request body `body_is_empty` or not; the
    /// hook marks the body sent, for the request body's
    /// [`Metered::on_complete`](super::body::Metered::on_complete). The
    /// connection is named with [`InOrder::follow`] once the request is
    /// handed to one.
    pub(crate) fn new(body_is_empty: bool) -> (InOrder, OnComplete) {
        let sent = Arc::new(AtomicBool::new(body_is_empty));
        let mark = sent.clone();
        let watch = InOrder {
            retire: None,
            body: !body_is_empty,
            sent,
            stop: Arc::default(),
            began_after: false,
            kept: false,
        };
        (watch, Box::new(move || mark.store(true, Ordering::Release)))
    }

    /// An HTTP/1.1 request with a body asks the upstream to close the
    /// connection after its answer (hop-by-hop headers were stripped
    /// before): every HTTP/1.1 server then stops there, and never reads an
    /// unread body as a request of its own.
    pub(crate) fn ask_close(&self, headers: &mut http::HeaderMap) {
        if self.body {
            headers.insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }

    /// The request body, stopped at an early answer: from then on not
    /// another byte of it is handed to the connection.
    pub(crate) fn gate<B>(&self, body: B) -> Gated<B> {
        Gated {
            inner: body,
            stop: self.stop.clone(),
        }
    }

    /// The request went to `sender` (or, sent again, to a new connection):
    /// watch that one.
    pub(crate) fn follow(&mut self, sender: &Sender) {
        self.retire = match sender {
            Sender::H1(_, r) => Some(r.clone()),
            Sender::H2(_) => None,
        };
    }

    /// The response head came: did the whole body go first? If not, the
    /// connection is retired at once (it never becomes usable again).
    pub(crate) fn response_began(&mut self) {
        self.began_after = self.sent.load(Ordering::Acquire);
        if !self.began_after {
            self.stop.store(true, Ordering::Release);
            if let Some(r) = &self.retire {
                r.retire();
            }
        }
    }

    /// The response was read to its end: may the connection carry another
    /// request (none had a body)? When not, it is cut here.
    pub(crate) fn reusable(mut self) -> bool {
        self.kept = !self.body && self.began_after && self.sent.load(Ordering::Acquire);
        self.kept
    }
}

/// A request body that stops at an early answer ([`InOrder::gate`]): it
/// then yields nothing more (the connection is cut when the response
/// ends, dropping it).
pub(crate) struct Gated<B> {
    inner: B,
    stop: Arc<AtomicBool>,
}

impl<B> hyper::body::Body for Gated<B>
where
    B: hyper::body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        if self.stop.load(Ordering::Acquire) {
            // Never woken: the connection is cut (and this dropped) when
            // the response ends.
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for InOrder {
    fn drop(&mut self) {
        if !self.kept {
            if let Some(r) = &self.retire {
                r.cut();
            }
        }
    }
}

impl Sender {
    /// Handshake HTTP/2 (`h2`) or HTTP/1.1 on `io`; the connection itself
    /// runs in a task of `tasks` until it closes.
    pub(crate) async fn handshake<I>(io: I, h2: bool, tasks: &TaskTracker) -> hyper::Result<Sender>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let io = TokioIo::new(io);
        if h2 {
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await?;
            tasks.spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "upstream h2 connection error");
                }
            });
            Ok(Sender::H2(sender))
        } else {
            let (sender, conn) = http1::handshake(io).await?;
            let retire = Retire::default();
            let cut = retire.cut.clone();
            tasks.spawn(async move {
                tokio::select! {
                    // The cut first: once it is given, not another byte.
                    biased;
                    // Dropping the connection closes its socket.
                    _ = cut.cancelled() => debug!("upstream connection retired"),
                    r = conn => if let Err(e) = r {
                        debug!(error = %e, "upstream connection error");
                    },
                }
            });
            Ok(Sender::H1(sender, retire))
        }
    }

    /// Handshake HTTP/1.1 on `io` for one upgrade (a WebSocket
    /// handshake): the connection runs in a task of `tasks` and, after a
    /// `101`, hands its stream to [`hyper::upgrade::on`] of the response.
    pub(crate) async fn handshake_upgrade<I>(
        io: I,
        tasks: &TaskTracker,
    ) -> hyper::Result<http1::SendRequest<Body>>
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = http1::handshake(TokioIo::new(io)).await?;
        tasks.spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                debug!(error = %e, "upstream upgrade connection error");
            }
        });
        Ok(sender)
    }

    /// Closed, or (HTTP/1.1) retired.
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s, r) => r.is_retired() || s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }

    pub(crate) fn is_h2(&self) -> bool {
        matches!(self, Sender::H2(_))
    }

    /// Ready for a request; an error once the connection closed, and
    /// `Ready(Ok(false))` once it was retired.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<hyper::Result<bool>> {
        match self {
            Sender::H1(s, r) => {
                if r.is_retired() {
                    return Poll::Ready(Ok(false));
                }
                s.poll_ready(cx).map_ok(|()| !r.is_retired())
            }
            Sender::H2(s) => s.poll_ready(cx).map_ok(|()| true),
        }
    }

    /// Wait until the connection can take a request: `true`; `false` or an
    /// error once it was retired or closed.
    pub(crate) async fn ready(&mut self) -> hyper::Result<bool> {
        std::future::poll_fn(|cx| self.poll_ready(cx)).await
    }

    /// Hand `req` to the connection once it can take one (HTTP/1.1: after
    /// the previous exchange); `Err(req)` if the connection closed first.
    pub(crate) async fn send(
        &mut self,
        req: Request<Body>,
    ) -> Result<ResponseFuture, Request<Body>> {
        match self {
            Sender::H2(s) => Ok(Box::pin(s.clone().send_request(req))),
            Sender::H1(s, r) => {
                if r.is_retired() || s.ready().await.is_err() || r.is_retired() {
                    return Err(req);
                }
                Ok(Box::pin(s.send_request(req)))
            }
        }
    }

    /// Send `req` and wait for the response head, at most `timeout`. A
    /// request the connection closed before writing any of it comes back
    /// untouched ([`Attempt::Unsent`]): it may go to another connection,
    /// whatever its method.
    pub(crate) async fn exchange(
        &mut self,
        req: Request<Body>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, Attempt> {
        if !matches!(self.ready().await, Ok(true)) {
            return Err(Attempt::Unsent(Box::new(req)));
        }
        let fut = match self {
            Sender::H1(s, _) => s.try_send_request(req),
            Sender::H2(s) => {
                let mut s = s.clone();
                return response(s.send_request(req), timeout)
                    .await
                    .map_err(Attempt::Failed);
            }
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(mut e)) => match e.take_message() {
                Some(req) => Err(Attempt::Unsent(Box::new(req))),
                None => Err(Attempt::Failed(NoResponse::Failed(e.into_error()))),
            },
            Err(_) => Err(Attempt::Failed(NoResponse::Timeout)),
        }
    }
}

/// A request [`Sender::exchange`] got no response head for.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Not a byte of it was written (boxed: it is large, and rare).
    Unsent(Box<Request<Body>>),
    Failed(NoResponse),
}

/// Wait for the response head, at most `timeout`.
pub(crate) async fn response(
    fut: impl Future<Output = hyper::Result<Response<Incoming>>>,
    timeout: Duration,
) -> Result<Response<Incoming>, NoResponse> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(NoResponse::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::io::AsyncReadExt;

    use super::super::full;
    use super::*;

    fn get() -> Request<Body> {
        Request::builder()
            .uri("/")
            .header("host", "a.test")
            .body(full(""))
            .unwrap()
    }

    async fn connected() -> (Sender, tokio::io::DuplexStream, TaskTracker) {
        let (client, server) = tokio::io::duplex(4096);
        let tasks = TaskTracker::new();
        let sender = Sender::handshake(client, false, &tasks).await.unwrap();
        (sender, server, tasks)
    }

    #[tokio::test]
    async fn closed_before_the_request_gives_it_back_unsent() {
        let (mut sender, server, _tasks) = connected().await;
        drop(server);
        for _ in 0..500 {
            if sender.is_closed() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(sender.is_closed());
        let got = sender.exchange(get(), Duration::from_secs(5)).await;
        assert!(matches!(got, Err(Attempt::Unsent(_))), "{got:?}");
    }

    /// A POST of `body`, its body watched; the watch and the request.
    fn post(body: Body, empty: bool) -> (InOrder, Request<Body>) {
        let (watch, sent) = InOrder::new(empty);
        let body = super::super::body::Metered::new(body, Default::default()).on_complete(sent);
        let body = watch.gate(body);
        let req = Request::builder()
            .method("POST")
            .uri("/p")
            .header("host", "a.test")
            .body(BodyExt::boxed(body))
            .unwrap();
        (watch, req)
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// Read `server` until it holds `until` (or ends).
    async fn read_until(server: &mut tokio::io::DuplexStream, seen: &mut Vec<u8>, until: &[u8]) {
        let mut buf = [0u8; 1024];
        while !seen.windows(until.len()).any(|w| w == until) {
            match server.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    }

    #[tokio::test]
    async fn a_body_sent_before_the_response_still_closes_the_connection() {
        use tokio::io::AsyncWriteExt;
        let (mut sender, mut server, _tasks) = connected().await;
        let (mut watch, mut req) = post(full("GET /x HTTP/1.1\r\n\r\n"), false);
        watch.ask_close(req.headers_mut());
        let answer = tokio::spawn(async move {
            let mut seen = Vec::new();
            read_until(&mut server, &mut seen, b"\r\n\r\nGET /x HTTP/1.1\r\n\r\n").await;
            server.write_all(OK).await.unwrap();
            (server, seen)
        });
        let resp = sender.exchange(req, Duration::from_secs(5)).await.unwrap();
        watch.follow(&sender);
        watch.response_began();
        let _ = resp.into_body().collect().await.unwrap();
        assert!(!watch.reusable(), "a body: never reused");
        let (_server, seen) = answer.await.unwrap();
        let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
        assert!(head.contains("connection: close\r\n"), "{head}");
        assert!(!matches!(sender.ready().await, Ok(true)));
        assert!(sender.is_closed());
    }

    #[tokio::test]
    async fn a_request_without_a_body_keeps_the_connection() {
        use tokio::io::AsyncWriteExt;
        let (mut sender, mut server, _tasks) = connected().await;
        let (mut watch, mut req) = post(full(""), true);
        watch.ask_close(req.headers_mut());
        assert!(req.headers().get(http::header::CONNECTION).is_none());
        let answer = tokio::spawn(async move {
            let mut seen = Vec::new();
            read_until(&mut server, &mut seen, b"\r\n\r\n").await;
            server.write_all(OK).await.unwrap();
            server
        });
        let resp = sender.exchange(req, Duration::from_secs(5)).await.unwrap();
        watch.follow(&sender);
        watch.response_began();
        let _ = resp.into_body().collect().await.unwrap();
        assert!(watch.reusable());
        let _server = answer.await.unwrap();
        assert!(matches!(sender.ready().await, Ok(true)));
        assert!(!sender.is_closed());
    }

    #[tokio::test]
    async fn an_early_answer_retires_the_connection_and_the_rest_of_the_body_is_never_sent() {
        use tokio::io::AsyncWriteExt;
        let (mut sender, mut server, tasks) = connected().await;
        let (mut tx, body) =
            http_body_util::channel::Channel::<bytes::Bytes, crate::serve::http::BodyError>::new(1);
        let (mut watch, req) = post(BodyExt::boxed(body), false);
        let (more, more_rx) = tokio::sync::oneshot::channel::<()>();
        // The upstream answers as soon as the head is in, the last byte of
        // its response when told.
        let answer = tokio::spawn(async move {
            let mut seen = Vec::new();
            read_until(&mut server, &mut seen, b"\r\n\r\n").await;
            server.write_all(&OK[..OK.len() - 1]).await.unwrap();
            let _ = more_rx.await;
            server.write_all(&OK[OK.len() - 1..]).await.unwrap();
            (server, seen)
        });
        let resp = sender.exchange(req, Duration::from_secs(5)).await.unwrap();
        watch.follow(&sender);
        watch.response_began();
        assert!(sender.is_closed(), "retired at the early answer");
        // The rest of the body (a planted head), while the response is
        // read and after it: never written.
        let _ = tx.send_data("GET /planted HTTP/1.1\r\n".into()).await;
        more.send(()).unwrap();
        let _ = resp.into_body().collect().await.unwrap();
        assert!(!watch.reusable());
        let _ = tx.send_data("GET /planted-too HTTP/1.1\r\n".into()).await;
        drop(tx);
        let (mut server, mut seen) = answer.await.unwrap();
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), server.read_to_end(&mut rest)).await;
        seen.extend_from_slice(&rest);
        assert!(
            !String::from_utf8_lossy(&seen).contains("planted"),
            "{:?}",
            String::from_utf8_lossy(&seen)
        );
        assert!(!matches!(sender.ready().await, Ok(true)));
        assert!(matches!(
            sender.exchange(get(), Duration::from_secs(1)).await,
            Err(Attempt::Unsent(_))
        ));
        tasks.close();
        tasks.wait().await;
    }

    #[tokio::test]
    async fn no_answer_in_time_is_a_timeout() {
        let (mut sender, _server, _tasks) = connected().await;
        match sender.exchange(get(), Duration::from_millis(20)).await {
            Err(Attempt::Failed(e)) => {
                assert!(matches!(e, NoResponse::Timeout), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }
}
