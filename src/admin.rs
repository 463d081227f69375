//! The admin listener: `/healthz` (200 while the process serves),
//! `/readyz` (200 only while every listener is bound and evidence is
//! writable), `/metrics` (Prometheus text format) and `/policy` (the served
//! policy's hash, load time and summary, JSON).
//!
//! It runs on its own thread and runtime, so a flood on the proxy listeners
//! cannot starve it.

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
use crate::metrics::Metrics;
use crate::served::ServedHandle;

pub use crate::served::{OrgSummary, PolicyInfo};

/// What readiness depends on, and what `/policy` and `/metrics` show.
pub struct Health {
    pub listeners_bound: AtomicBool,
    pub evidence: Arc<Evidence>,
    /// The served state: `/policy` and the policy series of `/metrics`.
    pub served: ServedHandle,
    pub metrics: Arc<Metrics>,
}

impl Health {
    pub fn is_ready(&self) -> bool {
        self.listeners_bound.load(Ordering::Relaxed) && self.evidence.is_healthy()
    }
}

fn respond(health: &Health, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let get = matches!(req.method(), &Method::GET | &Method::HEAD);
    match req.uri().path() {
        "/metrics" if get => {
            let served = health.served.load();
            let text = health
                .metrics
                .render(health.is_ready(), &served.info.hash, served.loaded);
            let mut resp = Response::new(Full::new(Bytes::from(text)));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return resp;
        }
        "/policy" if get => {
            let body = serde_json::to_vec_pretty(&health.served.load().info).unwrap_or_default();
            let mut resp = Response::new(Full::new(Bytes::from(body)));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            return resp;
        }
        _ => {}
    }
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

/// Serve the admin endpoints on a dedicated thread until shutdown.
pub fn spawn(
    listener: std::net::TcpListener,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("palisade-admin".into())
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, health, shutdown).await,
                    Err(e) => warn!(error = %e, "admin listener unusable"),
                }
            })
        })
}

/// Admin connections allowed at once; more are closed at accept.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Serve the admin endpoints until shutdown. Admin connections are few and
/// short: each gets a small head limit and a read timeout.
pub async fn serve(listener: TcpListener, health: Arc<Health>, shutdown: CancellationToken) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
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
        let Ok(permit) = open.clone().try_acquire_owned() else {
            continue; // over the cap: drop the connection
        };
        let health = health.clone();
        tokio::spawn(async move {
            let _permit = permit;
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
