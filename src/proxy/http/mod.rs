//! The proxy's one HTTP layer, used by explicit mode and by interception
//! alike; it knows nothing of policy or evidence.
//!
//! - [`serve`]: one client connection, HTTP/1.1 or HTTP/2, under the
//!   configured bounds, drained on shutdown (graceful close, then cut at
//!   the end of the grace period); HTTP/1.1 through the server shared with
//!   the admin listener ([`crate::serve::http`]).
//! - [`client`]: the upstream side through hyper, HTTP/1.1 or HTTP/2
//!   (interception, and forwarded requests with a body).
//! - [`upstream`]: the upstream side Palisade speaks itself, HTTP/1.1, for
//!   forwarded requests without a body (and their connections' reuse).
//! - [`strip_hop_by_hop`]: headers that never cross the proxy.
//! - [`body::Metered`]: a body that counts its bytes and reports once at
//!   its end, and may spend its exchange's volume budgets as it goes.
//! - [`replay::Replay`]: a stream that gives back bytes already read (a
//!   ClientHello held for the decision) before reading the socket.
//! - [`wire`]: each HTTP/1.1 request's bytes as received.

pub(crate) mod body;
pub(crate) mod client;
pub(crate) mod replay;
pub(crate) mod upstream;
pub(crate) mod wire;

use std::convert::Infallible;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::HttpService;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::proto::http_head;
use crate::serve::http::drained;

/// The one body type of the served and forwarded exchanges, and a
/// body of bytes at once.
pub(crate) use crate::serve::http::{full, Body};

/// A short plain-text response with a `Proxy-Status` header.
pub(crate) fn text_response(
    status: StatusCode,
    proxy_status: &str,
    body: String,
) -> Response<Body> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Ok(v) = HeaderValue::from_str(proxy_status) {
        h.insert(HeaderName::from_static("proxy-status"), v);
    }
    resp
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the proxy-only ones.
/// `Trailer` is not one (RFC 9110 §6.6.2: it names the trailer fields
/// end to end); hyper's server writes only the trailer fields a response
/// declares in it, and only to a client that sent `TE: trailers`.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "transfer-encoding",
    "upgrade",
];

/// Bytes of `headers` as sent (`name: value` lines, give or take
/// whitespace), with the blank line that ends a head.
pub(crate) fn headers_len(headers: &HeaderMap) -> u64 {
    http_head::fields_len(http_head::field_lens(headers))
}

/// A request head's bytes as sent (give or take whitespace): the request
/// line and the headers ([`http_head::head_len`]).
pub(crate) fn request_head_len(method: &http::Method, uri: &http::Uri, headers: &HeaderMap) -> u64 {
    let target = http_head::shown_len(uri);
    http_head::head_len(
        method.as_str().len(),
        target,
        http_head::field_lens(headers),
    )
}

/// Remove the hop-by-hop headers, and those `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The protocol a client connection speaks, with its bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Protocol {
    /// HTTP/1.1 (upgrades allowed: CONNECT turns a connection into a tunnel).
    Http1 {
        header_read_timeout: Duration,
        /// hyper's read buffer, which bounds a request head.
        max_buf_size: usize,
        max_headers: usize,
    },
    /// HTTP/2 (chosen by ALPN).
    Http2 { max_header_list_size: u32 },
}

/// HTTP/2 streams one client connection may have open at once.
pub(crate) const MAX_CONCURRENT_STREAMS: u32 = 100;

/// The shutdown signals a served connection follows (the shared server's).
pub(crate) use crate::serve::http::Drain;

/// Serve one client connection with `service` until it closes, or the
/// drain ends it.
pub(crate) async fn serve<I, S>(
    io: I,
    service: S,
    protocol: Protocol,
    drain: Drain<'_>,
) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = Body, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    match protocol {
        Protocol::Http1 {
            header_read_timeout,
            max_buf_size,
            max_headers,
        } => {
            // The one HTTP/1 server, shared with the admin listener.
            let settings = crate::serve::http::Http1 {
                header_read_timeout,
                max_buf_size,
                max_headers: Some(max_headers),
                keep_alive: true,
                upgrades: true,
            };
            crate::serve::http::serve_http1(io, service, settings, drain).await
        }
        Protocol::Http2 {
            max_header_list_size,
        } => {
            let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
            // Extended CONNECT (RFC 8441) is accepted so that WebSocket
            // over HTTP/2 can be decided; the service refuses what it
            // does not allow (another `:protocol`, or WebSocket where the
            // rule does not allow it).
            b.timer(TokioTimer::new())
                .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
                .max_header_list_size(max_header_list_size)
                .enable_connect_protocol();
            let conn = b.serve_connection(TokioIo::new(io), service);
            drained(conn, |c| c.graceful_shutdown(), drain).await
        }
    }
}

#[cfg(test)]
mod tests {
    use http::Request;
    use hyper::service::service_fn;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// Serve HTTP/1.1 on one end of a pipe, answering `ok` at once but
    /// never answering `/hang`.
    fn start(
        shutdown: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> (
        tokio::io::DuplexStream,
        tokio::task::JoinHandle<hyper::Result<()>>,
    ) {
        let service = service_fn(|req: Request<Incoming>| async move {
            if req.uri().path() == "/hang" {
                std::future::pending::<()>().await;
            }
            Ok::<_, Infallible>(Response::new(full("ok")))
        });
        let protocol = Protocol::Http1 {
            header_read_timeout: Duration::from_secs(5),
            max_buf_size: 8192,
            max_headers: 16,
        };
        let (client, server) = tokio::io::duplex(4096);
        let (shutdown, hard_stop) = (shutdown.clone(), hard_stop.clone());
        let task = tokio::spawn(async move {
            let drain = Drain {
                shutdown: &shutdown,
                hard_stop: &hard_stop,
            };
            serve(server, service, protocol, drain).await
        });
        (client, task)
    }

    #[tokio::test]
    async fn shutdown_closes_an_idle_connection_and_hard_stop_an_unfinished_one() {
        let (shutdown, hard_stop) = (CancellationToken::new(), CancellationToken::new());
        let (mut idle, idle_task) = start(&shutdown, &hard_stop);
        let (mut busy, busy_task) = start(&shutdown, &hard_stop);
        idle.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = idle.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
        busy.write_all(b"GET /hang HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        tokio::task::yield_now().await;

        shutdown.cancel();
        let done = tokio::time::timeout(Duration::from_secs(5), idle_task).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
        // The request in flight is waited for, until the hard stop.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!busy_task.is_finished());
        hard_stop.cancel();
        let done = tokio::time::timeout(Duration::from_secs(5), busy_task).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
    }

    #[test]
    fn hop_by_hop_headers_go_including_connection_named_ones() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("accept", HeaderValue::from_static("*/*"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("accept"));
    }
}
