//! The admin listener: `/healthz` (200 while the process serves),
//! `/readyz` (200 only while every listener is bound, evidence is
//! writable and, with `[enforcement]`, the gateway ruleset is verified), `/metrics` (Prometheus text format), `/policy` (the served
//! policy's hash, load time and summary, JSON), `/v1/decisions`, the
//! live decision tail ([`tail`]), and the approvers' endpoints and page
//! ([`approvals`], [`page`]); the tail and the approvers' endpoints need a
//! token.
//!
//! It runs on its own thread and runtime, so a flood on the proxy listeners
//! cannot starve it. Connections go through the shared accept loop and
//! HTTP/1 server ([`crate::serve`]): a fixed cap, a tracked task and span
//! per connection, drained on shutdown like the proxy. Responses are
//! [`Body`]s, so an endpoint may stream ([`crate::serve::http::channel`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

pub(crate) mod approvals;
pub(crate) mod page;
pub(crate) mod tail;

use crate::evidence::Evidence;
use crate::metrics::Metrics;
use crate::serve::http::{full, Body, Drain, Http1, WriteStall};
use crate::serve::{self, Admission, Listener};
use crate::served::ServedHandle;

/// What readiness depends on, and what `/policy` and `/metrics` show.
pub(crate) struct Health {
    pub listeners_bound: AtomicBool,
    pub evidence: Arc<Evidence>,
    /// The served state: `/policy` and the policy series of `/metrics`.
    pub served: ServedHandle,
    pub metrics: Arc<Metrics>,
    /// Who may tail `/v1/decisions`, and the tails open.
    pub tails: tail::Tails,
    /// `[enforcement]`: not ready while the gateway ruleset is not verified.
    pub enforcement: Option<Arc<crate::enforcement::Enforcement>>,
    /// The volume budgets: `/v1/volume`.
    pub volumes: Arc<crate::limits::Volumes>,
    /// Approvals and grants, and who may answer them: `/v1/approvals`,
    /// `/v1/grants`, `/ui/approvals`.
    pub approvers: approvals::Approvers,
    /// The sessions of `/ui/approvals`.
    pub sessions: page::Sessions,
}

impl Health {
    pub(crate) fn is_ready(&self) -> bool {
        self.listeners_bound.load(Ordering::Relaxed)
            && self.evidence.is_healthy()
            && self.enforcement.as_ref().is_none_or(|e| e.is_verified())
    }
}

fn respond(
    health: &Health,
    shutdown: &CancellationToken,
    req: &Request<Incoming>,
) -> Response<Body> {
    let get = matches!(req.method(), &Method::GET | &Method::HEAD);
    match req.uri().path() {
        "/v1/decisions" if req.method() == Method::GET => {
            let tap = health.evidence.live().tap();
            return tail::respond(&health.tails, tap, shutdown, req);
        }
        "/metrics" if get => {
            let served = health.served.load();
            let text = health
                .metrics
                .render(health.is_ready(), &served.info.hash, served.loaded);
            let mut resp = Response::new(full(text));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return resp;
        }
        "/policy" if get => return json(&health.served.load().info),
        "/v1/volume" if get => {
            let budgets = health.volumes.state(std::time::Instant::now());
            return json(&serde_json::json!({ "budgets": budgets }));
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
    let mut resp = Response::new(full(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp
}

/// A JSON response of `value`.
fn json<T: serde::Serialize>(value: &T) -> Response<Body> {
    approvals::json_status(StatusCode::OK, value)
}

/// Serve the admin endpoints on a dedicated thread until shutdown, then
/// drain them within `drain_timeout` (see [`serve`](fn@serve)).
pub(crate) fn spawn(
    listener: std::net::TcpListener,
    health: Arc<Health>,
    shutdown: CancellationToken,
    drain_timeout: Duration,
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
                    Ok(listener) => serve(listener, health, shutdown, drain_timeout).await,
                    Err(e) => warn!(error = %e, "admin listener unusable"),
                }
            })
        })
}

/// Admin connections allowed at once; more are closed at accept.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// The bounds of an admin connection: a small head, read within 5 s (which
/// also closes idle keep-alive connections). A response may last as long
/// as it streams; a client that stops reading it is cut after
/// [`ADMIN_WRITE_STALL`].
const ADMIN_HTTP: Http1 = Http1 {
    header_read_timeout: Duration::from_secs(5),
    max_buf_size: 16 * 1024,
    max_headers: None,
    keep_alive: true,
    upgrades: false,
};

/// Time a write to an admin client may make no progress.
const ADMIN_WRITE_STALL: Duration = Duration::from_secs(30);

/// Time admin connections get to close after the drain ends.
const HARD_STOP_GRACE: Duration = Duration::from_secs(1);

/// Serve the admin endpoints until shutdown: then stop accepting (the
/// listener closes), let requests in flight finish within `drain_timeout`
/// while idle connections close at once, and cut what is left.
pub(crate) async fn serve(
    listener: TcpListener,
    health: Arc<Health>,
    shutdown: CancellationToken,
    drain_timeout: Duration,
) {
    let on = Listener {
        what: "admin",
        shutdown: shutdown.clone(),
        tasks: TaskTracker::new(),
    };
    let hard_stop = CancellationToken::new();
    let admission = Admit {
        open: Arc::new(Semaphore::new(MAX_ADMIN_CONNECTIONS)),
        health,
        shutdown,
        hard_stop: hard_stop.clone(),
    };
    serve::accept(listener, &on, admission).await;
    let tasks = on.tasks;
    tasks.close();
    if tokio::time::timeout(drain_timeout, tasks.wait())
        .await
        .is_err()
    {
        warn!(
            open = tasks.len(),
            "admin: drain grace period over; closing remaining connections"
        );
        hard_stop.cancel();
        let _ = tokio::time::timeout(HARD_STOP_GRACE, tasks.wait()).await;
    }
}

/// The admin listener's cap: a fixed number of connections at once, the
/// excess closed at accept.
struct Admit {
    open: Arc<Semaphore>,
    health: Arc<Health>,
    shutdown: CancellationToken,
    hard_stop: CancellationToken,
}

impl Admission for Admit {
    type Conn = Pin<Box<dyn Future<Output = ()> + Send>>;

    async fn admit(&self, stream: TcpStream, _peer: SocketAddr) -> Option<Self::Conn> {
        // Over the cap: the connection is dropped (closed).
        let permit = self.open.clone().try_acquire_owned().ok()?;
        let health = self.health.clone();
        let (shutdown, hard_stop) = (self.shutdown.clone(), self.hard_stop.clone());
        Some(Box::pin(async move {
            let _permit = permit;
            let tail_shutdown = shutdown.clone();
            let service = service_fn(move |req: Request<Incoming>| {
                let (health, tail_shutdown) = (health.clone(), tail_shutdown.clone());
                async move {
                    let path = req.uri().path();
                    if path.starts_with("/ui/") {
                        let both = (&health.approvers, &health.sessions);
                        return Ok::<_, Infallible>(page::respond(both, req).await);
                    }
                    if approvals::owns(path) {
                        return Ok(approvals::respond(&health.approvers, req).await);
                    }
                    Ok::<_, Infallible>(respond(&health, &tail_shutdown, &req))
                }
            });
            let drain = Drain {
                shutdown: &shutdown,
                hard_stop: &hard_stop,
            };
            let io = WriteStall::new(stream, ADMIN_WRITE_STALL);
            if let Err(e) = serve::http::serve_http1(io, service, ADMIN_HTTP, drain).await {
                debug!(error = %e, "admin connection ended with error");
            }
        }))
    }
}
