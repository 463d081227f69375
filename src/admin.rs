//! The admin listener: `/healthz` (200 while the process serves) and
//! `/readyz` (200 only while every listener is bound and evidence is
//! writable).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::evidence::Evidence;

/// What readiness depends on.
pub struct Health {
    pub listeners_bound: AtomicBool,
    pub evidence: Arc<Evidence>,
}

impl Health {
    pub fn is_ready(&self) -> bool {
        self.listeners_bound.load(Ordering::Relaxed) && self.evidence.is_healthy()
    }
}

fn respond(health: &Health, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body) = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/healthz") => (StatusCode::OK, "ok\n"),
        (&Method::GET | &Method::HEAD, "/readyz") if health.is_ready() => {
            (StatusCode::OK, "ready\n")
        }
        (&Method::GET | &Method::HEAD, "/readyz") => {
            (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
        }
        (&Method::GET | &Method::HEAD, _) => (StatusCode::NOT_FOUND, "not found\n"),
        _ => (StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
    };
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp
}

/// Serve the admin endpoints until shutdown. Admin connections are few and
/// short: each gets a small head limit and a read timeout.
pub async fn serve(listener: TcpListener, health: Arc<Health>, shutdown: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let health = health.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let resp = respond(&health, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .max_buf_size(16 * 1024)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
        });
    }
}
