//! The upstream side of the HTTP layer: a connection handshaken as
//! HTTP/1.1 (one exchange at a time) or HTTP/2 (multiplexed), and the wait
//! for a response head, bounded.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::task::TaskTracker;
use tracing::debug;

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
}

/// One HTTP connection to an upstream.
pub(crate) enum Sender {
    H1(http1::SendRequest<Body>),
    H2(http2::SendRequest<Body>),
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
            tasks.spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "upstream connection error");
                }
            });
            Ok(Sender::H1(sender))
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }

    pub(crate) fn is_h2(&self) -> bool {
        matches!(self, Sender::H2(_))
    }

    /// Whether the connection can take a request now (HTTP/1.1: idle,
    /// its last exchange over).
    pub(crate) fn is_ready(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_ready(),
            Sender::H2(s) => s.is_ready(),
        }
    }

    /// Ready for a request; an error once the connection closed.
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<hyper::Result<()>> {
        match self {
            Sender::H1(s) => s.poll_ready(cx),
            Sender::H2(s) => s.poll_ready(cx),
        }
    }

    /// Wait until the connection can take a request; an error once it closed.
    pub(crate) async fn ready(&mut self) -> hyper::Result<()> {
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
            Sender::H1(s) => {
                if s.ready().await.is_err() {
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
        if self.ready().await.is_err() {
            return Err(Attempt::Unsent(Box::new(req)));
        }
        let fut = match self {
            Sender::H1(s) => s.try_send_request(req),
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

impl NoResponse {
    /// The connection closed or was reset before a complete response head
    /// came: what a kept-alive connection the upstream just closed looks
    /// like (RFC 9112 §9.3.1), as opposed to a timeout or a response that
    /// is not HTTP.
    pub(crate) fn is_connection_lost(&self) -> bool {
        let NoResponse::Failed(e) = self else {
            return false;
        };
        if e.is_incomplete_message() || e.is_canceled() {
            return true;
        }
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                return matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::UnexpectedEof
                );
            }
            source = s.source();
        }
        false
    }
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
    async fn closed_after_reading_the_request_is_a_lost_connection() {
        let (mut sender, mut server, _tasks) = connected().await;
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let _ = server.read(&mut buf).await;
        });
        match sender.exchange(get(), Duration::from_secs(5)).await {
            Err(Attempt::Failed(e)) => assert!(e.is_connection_lost(), "{e}"),
            Err(Attempt::Unsent(_)) => panic!("it was written"),
            Ok(resp) => panic!("{resp:?}"),
        }
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
        assert!(!sender.is_ready());
        let got = sender.exchange(get(), Duration::from_secs(5)).await;
        assert!(matches!(got, Err(Attempt::Unsent(_))), "{got:?}");
    }

    #[tokio::test]
    async fn no_answer_in_time_is_a_timeout_not_a_lost_connection() {
        let (mut sender, _server, _tasks) = connected().await;
        match sender.exchange(get(), Duration::from_millis(20)).await {
            Err(Attempt::Failed(e)) => {
                assert!(matches!(e, NoResponse::Timeout), "{e}");
                assert!(!e.is_connection_lost());
            }
            other => panic!("{other:?}"),
        }
    }
}
