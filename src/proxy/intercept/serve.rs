//! One intercepted connection: terminate the client's TLS with a minted
//! leaf, then serve HTTP/1.1 or HTTP/2 (by the client's ALPN) and decide
//! each request on its own before forwarding it over Palisade's own,
//! verified TLS connection to the upstream (HTTP/1.1 or HTTP/2 by the
//! upstream's ALPN, negotiated separately).
//!
//! Per request, in order ([`decide_parts`], pure): CONNECT, absolute-form
//! (HTTP/1.1) and protocol upgrades are refused (`bad_request`); Host /
//! `:authority` must name the connection's host and port (`host_mismatch`);
//! then [`Policy::decide_request`](crate::policy::Policy::decide_request)
//! normalises the path, applies the rule's method and path rules and picks
//! the credentials (the same call `palisade explain` makes). Then the
//! credentials are added (any client copy of the header dropped); the
//! upstream TLS is set up on first use (a failure is `upstream_tls_error`,
//! never a downgrade); the decision is recorded; and the request is sent
//! with the normalised path (and the query as received).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1 as client1, http2 as client2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tracing::debug;

use super::Interceptor;
use crate::config::CredentialConfig;
use crate::evidence::{Kind, Mode, Record};
use crate::policy::request::{RequestDecision, RequestFacts};
use crate::policy::{OrgRef, Policy, Reason, Verdict};
use crate::proto::target::{parse_authority, Host};
use crate::proxy::{deny, dial, Ctx, View};

type Body_ = UnsyncBoxBody<Bytes, hyper::Error>;

/// What the tunnel code hands over: the connection's facts, already
/// decided (allow, intercepting rule) and recorded.
pub struct Session {
    pub ctx: Arc<Ctx>,
    pub ic: Arc<Interceptor>,
    pub view: View,
    pub mode: Mode,
    pub client: SocketAddr,
    /// The normalised name (CONNECT host or SNI); SNI was checked against it.
    pub name: String,
    pub port: u16,
    pub rule: Arc<str>,
    pub sni: Option<String>,
    pub upstream_addr: SocketAddr,
    /// The connection's `tcp` decision record, already written.
    pub record: Record,
}

impl Session {
    /// The session of an allowed, intercepted connection, from its (written)
    /// decision record; `None` if the record lacks what interception needs.
    pub fn new(ctx: Arc<Ctx>, view: View, mode: Mode, record: Record) -> Option<Session> {
        let ic = ctx.intercept.clone()?;
        Some(Session {
            ic,
            view,
            mode,
            client: record.client?,
            name: record.host.clone()?,
            port: record.port?,
            rule: record.rule.clone()?,
            sni: record.sni.clone(),
            upstream_addr: SocketAddr::new(record.ip?, record.port?),
            ctx,
            record,
        })
    }
}

/// Serve an intercepted connection until it ends; writes the `tcp` close
/// record. `first` holds the client bytes read during detection.
pub async fn serve<C>(s: Session, client: C, first: Vec<u8>, upstream: TcpStream)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let started = Instant::now();
    let org: Arc<str> = match &s.view.org {
        Some(o) => o.name.clone(),
        None => return,
    };
    let Some(server_config) = s.ic.server_config(&org, &s.name) else {
        close_record(
            &s,
            0,
            0,
            started,
            Some("no leaf certificate could be minted"),
        );
        return;
    };
    let accept = tokio_rustls::TlsAcceptor::from(server_config).accept(Rewind {
        prefix: first,
        pos: 0,
        inner: client,
    });
    let tls = match tokio::time::timeout(s.ic.handshake_timeout, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            // Typically a client that does not trust the org CA (a pinned
            // client): it stays broken rather than bypassing the rules.
            let detail = format!("client TLS handshake failed: {e}");
            debug!(%detail);
            close_record(&s, 0, 0, started, Some(&detail));
            return;
        }
        Err(_) => {
            close_record(&s, 0, 0, started, Some("client TLS handshake timed out"));
            return;
        }
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let shared = Arc::new(Shared {
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
        upstream: tokio::sync::Mutex::new(Upstream {
            fresh: Some(upstream),
            sender: None,
        }),
        session: s,
        org,
    });
    let svc_shared = shared.clone();
    let service = service_fn(move |req| {
        let shared = svc_shared.clone();
        async move { Ok::<_, Infallible>(handle(shared, req).await) }
    });
    let io = TokioIo::new(tls);
    let ctx = shared.session.ctx.clone();
    let limits = &ctx.limits;
    let result = if h2 {
        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        b.timer(TokioTimer::new())
            .max_concurrent_streams(100)
            .max_header_list_size((limits.max_request_head_bytes) as u32);
        let conn = b.serve_connection(io, service);
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => r,
            _ = ctx.shutdown.cancelled() => {
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    r = conn.as_mut() => r,
                    _ = ctx.hard_stop.cancelled() => Ok(()),
                }
            }
        }
    } else {
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(limits.max_request_head_bytes.max(8192))
            .max_headers(limits.max_headers)
            .keep_alive(true);
        let conn = b.serve_connection(io, service);
        tokio::pin!(conn);
        tokio::select! {
            r = conn.as_mut() => r,
            _ = ctx.shutdown.cancelled() => {
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    r = conn.as_mut() => r,
                    _ = ctx.hard_stop.cancelled() => Ok(()),
                }
            }
        }
    };
    if let Err(e) = result {
        debug!(error = %e, "intercepted connection ended with error");
    }
    let (up, down) = (
        shared.up.load(Ordering::Relaxed),
        shared.down.load(Ordering::Relaxed),
    );
    close_record(&shared.session, up, down, started, None);
}

fn close_record(s: &Session, up: u64, down: u64, started: Instant, detail: Option<&str>) {
    let mut close = s
        .record
        .close(up, down, started.elapsed().as_millis() as u64);
    close.detail = detail.map(str::to_string);
    s.ctx.submit(&mut close);
}

struct Shared {
    session: Session,
    org: Arc<str>,
    upstream: tokio::sync::Mutex<Upstream>,
    /// Request and response body bytes of every request, for the close record.
    up: AtomicU64,
    down: AtomicU64,
}

/// The upstream side: the connection dialled at the decision (used first),
/// then re-dialled to the same checked address when it closes.
struct Upstream {
    fresh: Option<TcpStream>,
    sender: Option<Sender>,
}

enum Sender {
    H1(client1::SendRequest<Body_>),
    H2(client2::SendRequest<Body_>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }
}

/// Why the upstream could not be used.
#[derive(Debug)]
enum UpstreamError {
    /// TLS handshake or certificate verification failed.
    Tls(String),
    /// TCP connect or the HTTP handshake failed.
    Connect(String),
}

type ResponseFuture =
    Pin<Box<dyn std::future::Future<Output = hyper::Result<Response<Incoming>>> + Send>>;

impl Shared {
    /// Send one request upstream, connecting (TCP, verified TLS, HTTP
    /// handshake) first if there is no open connection. HTTP/1.1 upstream
    /// connections carry one request at a time; HTTP/2 ones multiplex.
    async fn send(&self, req: Request<Body_>) -> Result<ResponseFuture, UpstreamError> {
        let mut up = self.upstream.lock().await;
        let mut req = Some(req);
        for _ in 0..2 {
            if up.sender.as_ref().is_none_or(Sender::is_closed) {
                let fresh = up.fresh.take();
                up.sender = Some(self.connect(fresh).await?);
            }
            let fut: ResponseFuture = match up.sender.as_mut() {
                Some(Sender::H2(s)) => match req.take() {
                    Some(r) => Box::pin(s.clone().send_request(r)),
                    None => break,
                },
                Some(Sender::H1(s)) => {
                    if s.ready().await.is_err() {
                        up.sender = None;
                        continue;
                    }
                    match req.take() {
                        Some(r) => Box::pin(s.send_request(r)),
                        None => break,
                    }
                }
                None => continue,
            };
            return Ok(fut);
        }
        Err(UpstreamError::Connect("upstream connection closed".into()))
    }

    async fn connect(&self, fresh: Option<TcpStream>) -> Result<Sender, UpstreamError> {
        let s = &self.session;
        let tcp = match fresh {
            Some(t) => t,
            None => {
                let addr = s.upstream_addr;
                dial(&[addr.ip()], addr.port(), s.ctx.limits.connect_timeout)
                    .await
                    .map_err(|e| UpstreamError::Connect(e.to_string()))?
                    .0
            }
        };
        let server_name = ServerName::try_from(s.name.clone())
            .map_err(|e| UpstreamError::Tls(format!("invalid server name: {e}")))?;
        let connector = tokio_rustls::TlsConnector::from(s.ic.upstream.clone());
        let tls =
            match tokio::time::timeout(s.ic.handshake_timeout, connector.connect(server_name, tcp))
                .await
            {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return Err(UpstreamError::Tls(e.to_string())),
                Err(_) => {
                    return Err(UpstreamError::Tls(
                        "upstream TLS handshake timed out".into(),
                    ))
                }
            };
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        let tasks = &s.ctx.tasks;
        if h2 {
            let (sender, conn) = client2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .map_err(|e| UpstreamError::Connect(e.to_string()))?;
            tasks.spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "upstream h2 connection error");
                }
            });
            Ok(Sender::H2(sender))
        } else {
            let (sender, conn) = client1::handshake(io)
                .await
                .map_err(|e| UpstreamError::Connect(e.to_string()))?;
            tasks.spawn(async move {
                if let Err(e) = conn.await {
                    debug!(error = %e, "upstream connection error");
                }
            });
            Ok(Sender::H1(sender))
        }
    }
}

// ---------------------------------------------------------------------------
// One request

/// Largest request path kept in evidence.
const MAX_RECORDED_PATH: usize = 256;

/// The request checks that need no policy: what the request addresses.
/// Returns the path (no query) or the reason to refuse and why.
fn check_request(
    req: &http::request::Parts,
    host: &Host,
    port: u16,
) -> Result<(), (Reason, String)> {
    let bad = |m: &str| Err((Reason::BadRequest, m.to_string()));
    if req.method == Method::CONNECT {
        return bad("CONNECT inside an intercepted connection is refused");
    }
    if req.headers.contains_key(header::UPGRADE) {
        return bad("protocol upgrades (WebSocket) inside an intercepted connection are refused");
    }
    let uri = &req.uri;
    let authority = if req.version == Version::HTTP_2 {
        let Some(a) = uri.authority() else {
            return bad("HTTP/2 request without :authority");
        };
        a.as_str().to_string()
    } else {
        if uri.scheme().is_some() || uri.authority().is_some() {
            return bad("absolute-form request inside an intercepted connection is refused");
        }
        let mut hosts = req.headers.get_all(header::HOST).iter();
        let (Some(h), None) = (hosts.next(), hosts.next()) else {
            return bad("HTTP/1.1 request needs exactly one Host header");
        };
        match h.to_str() {
            Ok(t) => t.to_string(),
            Err(_) => return bad("Host header is not ASCII"),
        }
    };
    // An HTTP/2 request may carry Host too: it must agree.
    let mut names = vec![authority];
    if req.version == Version::HTTP_2 {
        for h in req.headers.get_all(header::HOST) {
            names.push(String::from_utf8_lossy(h.as_bytes()).into_owned());
        }
    }
    for name in names {
        match parse_authority(&name, Some(443)) {
            Ok((h, p)) if &h == host && p == port => {}
            _ => {
                return Err((
                    Reason::HostMismatch,
                    format!("request names {name:?}, the connection is to {host}:{port}"),
                ))
            }
        }
    }
    Ok(())
}

/// The live decision on one request inside an intercepted connection to
/// `name`:`port` under allow rule `rule`: what the request addresses
/// ([`check_request`]), then [`Policy::decide_request`] (path
/// normalisation, method and path rules, credentials from `credentials`).
/// Pure, for HTTP/1.1 and HTTP/2 alike.
pub(crate) fn decide_parts<'a>(
    policy: &Policy,
    org: &OrgRef,
    rule: &str,
    (name, port): (&str, u16),
    parts: &http::request::Parts,
    credentials: impl IntoIterator<Item = &'a CredentialConfig>,
) -> RequestDecision {
    if let Err((reason, detail)) = check_request(parts, &Host::Name(name.to_string()), port) {
        return RequestDecision {
            verdict: Verdict {
                org: Some(org.clone()),
                reason,
                rule: None,
                would_deny: None,
            },
            detail: Some(detail),
            path: None,
            credentials: Vec::new(),
        };
    }
    let req = RequestFacts {
        host: name,
        method: parts.method.as_str(),
        path: parts.uri.path(),
    };
    policy.decide_request(org, rule, req, credentials)
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body_> {
    let (parts, body) = req.into_parts();
    let mut body = Some(body);
    let response = decide_and_send(&shared, parts, &mut body).await;
    if let Some(body) = body {
        // Refused: read (and drop) what the client is still sending, a
        // bounded amount, so that the refusal is not lost to a reset.
        drain(body).await;
    }
    response
}

/// Bytes of a refused request's body read before answering.
const MAX_DRAIN_BYTES: u64 = 1024 * 1024;
/// Time spent reading a refused request's body before answering.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

async fn drain(mut body: Incoming) {
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, |d| d.len() as u64);
            if seen > MAX_DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

async fn decide_and_send(
    shared: &Arc<Shared>,
    mut parts: http::request::Parts,
    body: &mut Option<Incoming>,
) -> Response<Body_> {
    let started = Instant::now();
    let s = &shared.session;
    let host = Host::Name(s.name.clone());
    let mut record = s.view.record(
        Kind::Http,
        s.mode,
        s.client,
        &Verdict {
            org: s.view.org.clone(),
            reason: Reason::RuleMatch,
            rule: Some(s.rule.clone()),
            would_deny: None,
        },
        Some(&host),
        Some(s.port),
    );
    record.sni = s.sni.clone();
    record.ip = Some(s.upstream_addr.ip());
    record.conn = Some(s.record.id.clone());
    let method = parts.method.as_str().to_string();
    let raw_path = parts.uri.path().to_string();
    record.method = Some(method.clone());
    record.path = Some(raw_path.chars().take(MAX_RECORDED_PATH).collect());

    let Some(org) = &s.view.org else {
        return refuse(shared, &mut record, Reason::UnknownClient, "no org").await;
    };
    let creds = s.ic.credentials(&org.name);
    let decision = decide_parts(
        &s.view.policy,
        org,
        &s.rule,
        (&s.name, s.port),
        &parts,
        creds.iter().map(|c| &c.config),
    );
    record.rule = decision.verdict.rule.clone();
    if let Some(p) = decision.path.as_ref().filter(|p| p.as_str() != raw_path) {
        // Recorded as decided and forwarded; what the client sent in detail.
        record.path = Some(p.as_str().chars().take(MAX_RECORDED_PATH).collect());
        let sent: String = raw_path.chars().take(MAX_RECORDED_PATH).collect();
        record.detail = Some(format!("path normalised from {sent}"));
    }
    let (true, Some(path)) = (decision.is_allow(), &decision.path) else {
        let detail = decision.detail.as_deref().unwrap_or("refused");
        return refuse(shared, &mut record, decision.verdict.reason, detail).await;
    };

    // Build the upstream request.
    crate::proxy::explicit::strip_hop_by_hop(&mut parts.headers);
    let mut used = Vec::new();
    for c in decision.credentials.iter().filter_map(|&i| creds.get(i)) {
        let Ok(name) = HeaderName::from_bytes(c.config.header.as_bytes()) else {
            continue;
        };
        // Whatever the client sent under this name goes, every copy.
        parts.headers.remove(&name);
        match c.value() {
            Some(v) => {
                parts.headers.insert(name, v);
                used.push(c.config.id.clone());
            }
            None => {
                return refuse(
                    shared,
                    &mut record,
                    Reason::BadRequest,
                    "credential unusable",
                )
                .await
            }
        }
    }
    if !used.is_empty() {
        record.credential = Some(used.join(","));
    }
    // The path the rules matched, never the raw one; the query as received.
    let path_and_query = match parts.uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let authority = if s.port == 443 {
        s.name.clone()
    } else {
        format!("{}:{}", s.name, s.port)
    };

    // Evidence before any byte of this request reaches the upstream. The
    // upstream connection (and its TLS) is set up after the connection's
    // own `tcp` record, which is already written.
    let up_count = Arc::new(AtomicU64::new(0));
    let Some(client_body) = body.take() else {
        return refuse(shared, &mut record, Reason::BadRequest, "request body gone").await;
    };
    let body = Metered::new(client_body, up_count.clone(), None).boxed_unsync();
    let sender_check = {
        let mut up = shared.upstream.lock().await;
        if up.sender.as_ref().is_none_or(Sender::is_closed) {
            let fresh = up.fresh.take();
            match shared.connect(fresh).await {
                Ok(sender) => {
                    up.sender = Some(sender);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        } else {
            Ok(())
        }
    };
    let h2_upstream = match sender_check {
        Ok(()) => matches!(shared.upstream.lock().await.sender, Some(Sender::H2(_))),
        Err(UpstreamError::Tls(detail)) => {
            crate::metrics::metrics()
                .upstream_tls_errors_total
                .with_label_values(&[&*shared.org])
                .inc();
            return refuse(shared, &mut record, Reason::UpstreamTlsError, &detail).await;
        }
        Err(UpstreamError::Connect(detail)) => {
            return upstream_failed(shared, &mut record, &detail).await;
        }
    };
    if h2_upstream {
        parts.uri = match Uri::builder()
            .scheme("https")
            .authority(authority.as_str())
            .path_and_query(path_and_query.as_str())
            .build()
        {
            Ok(u) => u,
            Err(e) => return refuse(shared, &mut record, Reason::BadRequest, &e.to_string()).await,
        };
        parts.headers.remove(header::HOST);
        parts.version = Version::HTTP_2;
    } else {
        parts.uri = match Uri::builder()
            .path_and_query(path_and_query.as_str())
            .build()
        {
            Ok(u) => u,
            Err(e) => return refuse(shared, &mut record, Reason::BadRequest, &e.to_string()).await,
        };
        if let Ok(v) = HeaderValue::from_str(&authority) {
            parts.headers.insert(header::HOST, v);
        }
        parts.version = Version::HTTP_11;
    }
    if !s.ctx.write(&mut record).await {
        count(shared, Reason::EvidenceUnavailable);
        return denial(Reason::EvidenceUnavailable, Some(&record.id), None);
    }
    count(shared, Reason::RuleMatch);

    let upstream_req = Request::from_parts(parts, body);
    let fut = match shared.send(upstream_req).await {
        Ok(f) => f,
        Err(UpstreamError::Tls(d)) | Err(UpstreamError::Connect(d)) => {
            return upstream_failed_after(shared, &record, &d, &up_count)
        }
    };
    let response = match tokio::time::timeout(s.ctx.limits.idle_timeout, fut).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return upstream_failed_after(shared, &record, &e.to_string(), &up_count),
        Err(_) => {
            return upstream_failed_after(shared, &record, "upstream response timed out", &up_count)
        }
    };
    crate::metrics::metrics()
        .intercepted_request_duration_seconds
        .with_label_values(&[&shared.org])
        .observe(started.elapsed().as_secs_f64());
    let (mut parts, body) = response.into_parts();
    crate::proxy::explicit::strip_hop_by_hop(&mut parts.headers);
    let status = parts.status.as_u16();
    let closer_shared = shared.clone();
    let record_for_close = record.clone();
    let finish: Finish = Box::new(move |down| {
        let up = up_count.load(Ordering::Relaxed);
        closer_shared.up.fetch_add(up, Ordering::Relaxed);
        closer_shared.down.fetch_add(down, Ordering::Relaxed);
        let mut close = record_for_close.close(up, down, started.elapsed().as_millis() as u64);
        close.status = Some(status);
        closer_shared.session.ctx.submit(&mut close);
    });
    let body = Metered::new(body, Arc::new(AtomicU64::new(0)), Some(finish));
    Response::from_parts(parts, body.boxed_unsync())
}

fn count(shared: &Shared, reason: Reason) {
    crate::metrics::metrics()
        .intercepted_requests_total
        .with_label_values(&[&shared.org, reason.decision(), reason.as_str()])
        .inc();
}

/// Record a refused request and answer it inside the intercepted connection.
async fn refuse(
    shared: &Shared,
    record: &mut Record,
    reason: Reason,
    detail: &str,
) -> Response<Body_> {
    record.reason = reason;
    if !matches!(
        reason,
        Reason::MethodNotAllowed | Reason::PathNotAllowed | Reason::UpstreamTlsError
    ) {
        record.rule = None;
    }
    record.detail = Some(detail.to_string());
    let reason = if shared.session.ctx.write(record).await {
        reason
    } else {
        Reason::EvidenceUnavailable
    };
    count(shared, reason);
    debug!(reason = %reason, record = %record.id, "intercepted request refused");
    denial(reason, Some(&record.id), Some(detail))
}

/// The upstream could not be reached for an allowed request.
async fn upstream_failed(shared: &Shared, record: &mut Record, detail: &str) -> Response<Body_> {
    record.detail = Some(detail.to_string());
    let written = shared.session.ctx.write(record).await;
    count(shared, Reason::RuleMatch);
    if !written {
        return denial(Reason::EvidenceUnavailable, Some(&record.id), None);
    }
    gateway_error(&record.id, detail)
}

/// The request was recorded and sent, but no response came back.
fn upstream_failed_after(
    shared: &Shared,
    record: &Record,
    detail: &str,
    up: &AtomicU64,
) -> Response<Body_> {
    let mut close = record.close(up.load(Ordering::Relaxed), 0, 0);
    close.detail = Some(detail.to_string());
    shared.session.ctx.submit(&mut close);
    gateway_error(&record.id, detail)
}

fn gateway_error(id: &str, detail: &str) -> Response<Body_> {
    let clean: String = detail
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    text_response(
        StatusCode::BAD_GATEWAY,
        &deny::proxy_status("destination_unavailable", "rule_match", Some(id)),
        format!("palisade: upstream failed (evidence record {id}): {clean}\n"),
    )
}

fn denial(reason: Reason, record: Option<&str>, detail: Option<&str>) -> Response<Body_> {
    text_response(
        deny::status(reason),
        &deny::proxy_status(deny::proxy_error(reason), reason.as_str(), record),
        deny::body(reason.as_str(), record, detail),
    )
}

fn text_response(status: StatusCode, proxy_status: &str, body: String) -> Response<Body_> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
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

// ---------------------------------------------------------------------------
// Plumbing

type Finish = Box<dyn FnOnce(u64) + Send>;

/// A body that counts its bytes and calls `finish` once, at its end or drop.
struct Metered<B> {
    inner: B,
    count: Arc<AtomicU64>,
    finish: Mutex<Option<Finish>>,
}

impl<B> Metered<B> {
    fn new(inner: B, count: Arc<AtomicU64>, finish: Option<Finish>) -> Self {
        Metered {
            inner,
            count,
            finish: Mutex::new(finish),
        }
    }

    fn done(&self) {
        let f = self.finish.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(f) = f {
            f(self.count.load(Ordering::Relaxed));
        }
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        self.done();
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.done(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Replays the bytes read during detection, then reads the stream.
struct Rewind<C> {
    prefix: Vec<u8>,
    pos: usize,
    inner: C,
}

impl<C: AsyncRead + Unpin> AsyncRead for Rewind<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(rest) = this.prefix.get(this.pos..).filter(|r| !r.is_empty()) {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for Rewind<C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(req: Request<()>) -> http::request::Parts {
        req.into_parts().0
    }

    #[test]
    fn every_request_must_name_the_tunnels_host() {
        let host = Host::Name("reg.test".into());
        let h1 = |hosts: &[&str]| {
            let mut b = Request::builder().uri("/x");
            for h in hosts {
                b = b.header(header::HOST, *h);
            }
            check_request(&parts(b.body(()).unwrap()), &host, 443)
        };
        assert!(h1(&["reg.test"]).is_ok());
        assert!(h1(&["REG.test:443"]).is_ok());
        assert!(h1(&["reg.test."]).is_ok());
        for bad in [&["other.test"][..], &["reg.test:8443"], &["reg.test.evil"]] {
            assert_eq!(h1(bad).unwrap_err().0, Reason::HostMismatch, "{bad:?}");
        }
        assert_eq!(h1(&[]).unwrap_err().0, Reason::BadRequest);
        assert_eq!(
            h1(&["reg.test", "reg.test"]).unwrap_err().0,
            Reason::BadRequest
        );
        let absolute = Request::builder()
            .uri("https://reg.test/x")
            .header(header::HOST, "reg.test")
            .body(())
            .unwrap();
        assert_eq!(
            check_request(&parts(absolute), &host, 443).unwrap_err().0,
            Reason::BadRequest
        );
        let h2 = |authority: &str, hosts: &[&str]| {
            let mut b = Request::builder()
                .version(Version::HTTP_2)
                .uri(format!("https://{authority}/x"));
            for h in hosts {
                b = b.header(header::HOST, *h);
            }
            check_request(&parts(b.body(()).unwrap()), &host, 443)
        };
        assert!(h2("reg.test", &[]).is_ok());
        assert!(h2("reg.test", &["reg.test"]).is_ok());
        assert_eq!(h2("other.test", &[]).unwrap_err().0, Reason::HostMismatch);
        // :authority right, Host wrong: refused too.
        assert_eq!(
            h2("reg.test", &["other.test"]).unwrap_err().0,
            Reason::HostMismatch
        );
    }
}
