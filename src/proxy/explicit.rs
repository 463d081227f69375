//! Explicit proxy mode: HTTP/1.1 CONNECT tunnels and absolute-form request
//! forwarding. Each request on a kept-alive connection is decided on its own.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tracing::{debug, info_span, Instrument};

use super::connect::{self, Refused};
use super::intercept;
use super::limits::Permit;
use super::{deny, dial, Ctx, DialError, Outcome, View};
use crate::evidence::{Kind, Mode, Record};
use crate::policy::{Credential, IdentityError, OrgRef, Reason, Verdict};
use crate::proto::http_meter::{Event, Framer};
use crate::proto::target::{normalize_host, parse_authority, Host};

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Serve one client connection until it closes or shutdown drains it.
pub async fn serve_connection(
    ctx: Arc<Ctx>,
    stream: TcpStream,
    peer: SocketAddr,
    org: Option<OrgRef>,
    permit: Permit,
) {
    // The permit lives as long as the connection or any tunnel it became.
    let permit = Arc::new(permit);
    let span = info_span!("conn", client.addr = %peer, org = org.as_ref().map(|o| &*o.name));
    async move {
        let _ = stream.set_nodelay(true);
        let limits = &ctx.limits;
        let meter = Arc::new(Meter::new(limits.max_request_head_bytes + HYPER_HEAD_SLACK));
        let stream = Metered {
            inner: stream,
            meter: meter.clone(),
        };
        let svc_ctx = ctx.clone();
        let service = service_fn(move |req| {
            let ctx = svc_ctx.clone();
            let permit = permit.clone();
            let meter = meter.clone();
            async move { Ok::<_, Infallible>(metered(ctx, peer, permit, meter, req).await) }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            // hyper's own bounds sit above ours, so that heads over our limits
            // reach `handle` and get a recorded 431; beyond hyper's bounds it
            // answers by itself and `record_parse_error` records it.
            .max_buf_size(limits.max_request_head_bytes + HYPER_HEAD_SLACK)
            .max_headers(limits.max_headers + HYPER_HEADERS_SLACK)
            .keep_alive(true);
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        tokio::pin!(conn);
        let result = tokio::select! {
            r = conn.as_mut() => r,
            _ = ctx.shutdown.cancelled() => {
                conn.as_mut().graceful_shutdown();
                tokio::select! {
                    r = conn.as_mut() => r,
                    _ = ctx.hard_stop.cancelled() => Ok(()),
                }
            }
        };
        if let Err(e) = result {
            debug!(error = %e, "connection ended with error");
            record_parse_error(&ctx, peer, &e).await;
        }
    }
    .instrument(span)
    .await
}

/// Bytes hyper may buffer beyond `max_request_head_bytes`.
const HYPER_HEAD_SLACK: usize = 64 * 1024;
/// Headers hyper may parse beyond `max_headers`.
const HYPER_HEADERS_SLACK: usize = 100;

/// A request hyper could not parse (or whose head did not arrive in time)
/// was answered by hyper itself with a bare 400/408/431; record it.
async fn record_parse_error(ctx: &Ctx, peer: SocketAddr, e: &hyper::Error) {
    if !(e.is_parse() || e.is_parse_too_large() || e.is_timeout()) {
        return;
    }
    let view = &ctx.view(peer.ip());
    let detail = format!("request not parsed: {e}");
    let mut record = view.record(
        Kind::Http,
        Mode::Explicit,
        peer,
        &bad_request_verdict(view),
        None,
        None,
    );
    record.detail = Some(detail);
    ctx.write(&mut record).await;
}

/// Handle one request with the count of the bytes it took on the wire.
/// hyper calls the service once per request, in order, after reading its
/// head, so the meter's next request is this one.
async fn metered(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    permit: Arc<Permit>,
    meter: Arc<Meter>,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let bytes = meter.next_request();
    let connect = req.method() == Method::CONNECT;
    let resp = handle(ctx, peer, permit, req, bytes).await;
    if connect {
        // A 2xx turns the connection into a tunnel; anything else keeps it HTTP.
        meter.connect_answered(resp.status().is_success());
    }
    resp
}

async fn handle(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    permit: Arc<Permit>,
    req: Request<Incoming>,
    bytes: Option<Arc<RequestBytes>>,
) -> Response<ProxyBody> {
    // Each request is decided under the policy served when it arrives, for
    // the org its address and credentials (checked on every request) name.
    let view = match identify(&ctx, peer, &req) {
        Ok(view) => view,
        Err((view, e)) => return auth_refused(&ctx, &view, peer, &req, e).await,
    };
    let view = &view;
    // hyper bounds its read buffer only roughly; these make the configured limits exact.
    let too_large = if head_size(&req) > ctx.limits.max_request_head_bytes {
        Some("request head too large")
    } else if req.headers().len() > ctx.limits.max_headers {
        Some("too many headers")
    } else {
        None
    };
    if let Some(why) = too_large {
        let kind = if req.method() == Method::CONNECT {
            Kind::Tcp
        } else {
            Kind::Http
        };
        let mut resp = reject(
            &ctx,
            view,
            kind,
            peer,
            &bad_request_verdict(view),
            (None, None),
            Some(why),
        )
        .await;
        *resp.status_mut() = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
        return resp;
    }
    if req.method() == Method::CONNECT {
        connect(ctx, peer, view, permit, req).await
    } else if req.uri().scheme().is_some() {
        forward(ctx, peer, view, req, bytes).await
    } else {
        let verdict = bad_request_verdict(view);
        reject(
            &ctx,
            view,
            Kind::Http,
            peer,
            &verdict,
            (None, None),
            Some("origin-form request: this is a proxy"),
        )
        .await
    }
}

/// The view for a request: its client address and any
/// `Proxy-Authorization: Basic base64(org:token)` it carries.
fn identify(
    ctx: &Ctx,
    peer: SocketAddr,
    req: &Request<Incoming>,
) -> Result<View, (View, IdentityError)> {
    let mut values = req.headers().get_all(header::PROXY_AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return ctx.view_as(peer.ip(), None);
    };
    let decoded = match values.next() {
        Some(_) => None,
        None => basic_credentials(value.as_bytes()),
    };
    match decoded {
        Some((user, token)) => ctx.view_as(
            peer.ip(),
            Some(Credential {
                user: &user,
                token: &token,
            }),
        ),
        None => {
            let view = View {
                policy: ctx.policy.load_full(),
                org: None,
            };
            Err((view, IdentityError::Failed("malformed Proxy-Authorization")))
        }
    }
}

/// `Basic base64(user:password)` (RFC 7617), split at the first colon.
fn basic_credentials(value: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let text = std::str::from_utf8(value).ok()?.trim();
    let (scheme, encoded) = text.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = data_encoding::BASE64
        .decode(encoded.trim().as_bytes())
        .ok()?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    Some((decoded[..colon].to_vec(), decoded[colon + 1..].to_vec()))
}

/// A request whose identity failed: record it (org null, the cause as
/// detail, never the token) and answer 407 with a challenge. The client
/// learns only the reason code, whatever the cause.
async fn auth_refused(
    ctx: &Ctx,
    view: &View,
    peer: SocketAddr,
    req: &Request<Incoming>,
    e: IdentityError,
) -> Response<ProxyBody> {
    let kind = if req.method() == Method::CONNECT {
        Kind::Tcp
    } else {
        Kind::Http
    };
    let detail = e.to_string();
    let verdict = view.verdict(e.reason());
    let (reason, id) = connect::record_denial(
        ctx,
        view,
        (kind, Mode::Explicit),
        peer,
        &verdict,
        (None, None),
        Some(&detail),
    )
    .await;
    let mut resp = denial(reason, Some(&id), None);
    if resp.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        resp.headers_mut().insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"palisade\""),
        );
    }
    resp
}

/// Bytes of the request line and headers as sent (give or take whitespace):
/// the configured head limit's measure. Evidence counts the exact bytes
/// ([`Meter`]).
fn head_size<B>(req: &Request<B>) -> usize {
    let line = req.method().as_str().len() + req.uri().to_string().len() + 12;
    let headers: usize = req
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    line + headers + 2
}

fn bad_request_verdict(view: &View) -> Verdict {
    view.verdict(Reason::BadRequest)
}

/// Record a denial and build its response.
async fn reject(
    ctx: &Ctx,
    view: &View,
    kind: Kind,
    peer: SocketAddr,
    verdict: &Verdict,
    target: (Option<&Host>, Option<u16>),
    detail: Option<&str>,
) -> Response<ProxyBody> {
    let (reason, id) = connect::record_denial(
        ctx,
        view,
        (kind, Mode::Explicit),
        peer,
        verdict,
        target,
        detail,
    )
    .await;
    denial(reason, Some(&id), detail)
}

fn denial(reason: Reason, record: Option<&str>, detail: Option<&str>) -> Response<ProxyBody> {
    text_response(
        deny::status(reason),
        &deny::proxy_status(deny::proxy_error(reason), reason.as_str(), record),
        deny::body(reason.as_str(), record, detail),
    )
}

fn text_response(status: StatusCode, proxy_status: &str, body: String) -> Response<ProxyBody> {
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

fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Failure after an allow: the upstream could not be reached.
async fn dial_failed(ctx: &Ctx, record: &mut Record, err: &DialError) -> Response<ProxyBody> {
    let written = connect::record_dial_failure(ctx, record, err).await;
    unreachable_response(err, &record.id, written)
}

/// The response to an allowed target that could not be reached.
fn unreachable_response(err: &DialError, record: &str, written: bool) -> Response<ProxyBody> {
    let (status, error) = match err {
        DialError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "connection_timeout"),
        DialError::Io { source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused => {
            (StatusCode::BAD_GATEWAY, "connection_refused")
        }
        _ => (StatusCode::BAD_GATEWAY, "destination_unavailable"),
    };
    if !written {
        return denial(Reason::EvidenceUnavailable, Some(record), None);
    }
    let body = format!("palisade: upstream unreachable (evidence record {record}): {err}\n");
    text_response(
        status,
        &deny::proxy_status(error, "rule_match", Some(record)),
        body,
    )
}

// ---------------------------------------------------------------------------
// CONNECT

async fn connect(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    view: &View,
    permit: Arc<Permit>,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let target = req
        .uri()
        .authority()
        .filter(|_| req.uri().scheme().is_none() && req.uri().path_and_query().is_none())
        .map(|a| parse_authority(a.as_str(), None));
    let (host, port) = match target {
        Some(Ok(t)) => t,
        Some(Err(e)) => {
            let detail = e.to_string();
            return reject(
                &ctx,
                view,
                Kind::Tcp,
                peer,
                &bad_request_verdict(view),
                (None, None),
                Some(&detail),
            )
            .await;
        }
        None => {
            return reject(
                &ctx,
                view,
                Kind::Tcp,
                peer,
                &bad_request_verdict(view),
                (None, None),
                Some("CONNECT needs an authority-form target host:port"),
            )
            .await
        }
    };
    let opened = match connect::open(&ctx, view, Mode::Explicit, peer, host, port).await {
        Ok(opened) => opened,
        Err(Refused::Denied {
            reason,
            record,
            detail,
        }) => return denial(reason, Some(&record), detail.as_deref()),
        Err(Refused::Unreachable {
            error,
            record,
            written,
        }) => return unreachable_response(&error, &record, written),
    };

    let tunnel_ctx = ctx.clone();
    let on_upgrade = hyper::upgrade::on(req);
    ctx.tasks.spawn(
        async move {
            let _permit = permit;
            match on_upgrade.await {
                Ok(upgraded) => {
                    connect::run(tunnel_ctx, TokioIo::new(upgraded), opened, Vec::new()).await
                }
                Err(e) => debug!(error = %e, "CONNECT upgrade failed"),
            }
        }
        .instrument(tracing::Span::current()),
    );
    Response::new(full(Bytes::new()))
}

// ---------------------------------------------------------------------------
// Absolute-form forwarding

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the proxy-only ones.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

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

/// Check an absolute-form request before any decision: scheme, framing,
/// upgrades, Host consistency. Returns the target or the reason to refuse.
/// The request target, and a Host-mismatch description if the Host header
/// names another host (a denial unless the org only reports).
type Checked = (Host, u16, Option<String>);

fn check_request(req: &Request<Incoming>) -> Result<Checked, (Reason, String)> {
    let uri = req.uri();
    let bad = |msg: &str| (Reason::BadRequest, msg.to_string());
    if uri.scheme_str() != Some("http") {
        return Err(bad(
            "only http:// absolute-form requests are forwarded; use CONNECT for TLS",
        ));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| bad("absolute-form request without a host"))?;
    // Userinfo never changes which host is dialled: hyper's host() is the part after '@'.
    let host = normalize_host(authority.host()).map_err(|e| bad(&e.to_string()))?;
    let port = match authority.port_u16() {
        Some(0) => return Err(bad("port 0")),
        Some(p) => p,
        None => 80,
    };
    let headers = req.headers();
    // Transfer-Encoding with Content-Length never arrives here ambiguous:
    // hyper frames such a body by Transfer-Encoding, drops Content-Length
    // and closes the connection after the response (RFC 9112 §6.3).
    if headers.contains_key(header::UPGRADE) {
        return Err(bad("protocol upgrades are not forwarded"));
    }
    let mut hosts = headers.get_all(header::HOST).iter();
    if let Some(value) = hosts.next() {
        if hosts.next().is_some() {
            return Err(bad("more than one Host header"));
        }
        let text = value
            .to_str()
            .map_err(|_| bad("Host header is not ASCII"))?;
        match parse_authority(text, Some(80)) {
            Ok((h, p)) if h == host && p == port => {}
            Ok(_) | Err(_) => {
                let why = format!("Host header {text:?} does not name the request target");
                return Ok((host, port, Some(why)));
            }
        }
    }
    Ok((host, port, None))
}

async fn forward(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    view: &View,
    req: Request<Incoming>,
    bytes: Option<Arc<RequestBytes>>,
) -> Response<ProxyBody> {
    let (host, port, host_mismatch) = match check_request(&req) {
        Ok((host, port, Some(why))) if !view.is_report() => {
            let verdict = view.verdict(Reason::HostMismatch);
            return reject(
                &ctx,
                view,
                Kind::Http,
                peer,
                &verdict,
                (Some(&host), Some(port)),
                Some(&why),
            )
            .await;
        }
        Ok(t) => t,
        Err((reason, detail)) => {
            let verdict = view.verdict(reason);
            let host = req.uri().host().and_then(|h| normalize_host(h).ok());
            let port = req.uri().port_u16().or(host.as_ref().map(|_| 80));
            return reject(
                &ctx,
                view,
                Kind::Http,
                peer,
                &verdict,
                (host.as_ref(), port),
                Some(&detail),
            )
            .await;
        }
    };
    let Outcome {
        mut verdict,
        dial: addrs,
        detail,
    } = ctx.decide(view, &host, port).await;
    if host_mismatch.is_some() && verdict.is_allow() {
        // Report mode: what enforcement would have said first.
        verdict.would_deny = Some(Reason::HostMismatch);
        verdict.reason = Reason::ReportOnly;
    }
    if !verdict.is_allow() {
        return reject(
            &ctx,
            view,
            Kind::Http,
            peer,
            &verdict,
            (Some(&host), Some(port)),
            detail.as_deref(),
        )
        .await;
    }
    // An intercepting rule's method and path rules bind plain http:// too
    // (credentials are never added to plain HTTP).
    if let Some((verdict, detail)) =
        intercept::plain_request(view, &verdict, req.method(), req.uri())
    {
        return reject(
            &ctx,
            view,
            Kind::Http,
            peer,
            &verdict,
            (Some(&host), Some(port)),
            Some(&detail),
        )
        .await;
    }
    if !ctx.evidence.is_healthy() {
        let verdict = Verdict {
            reason: Reason::EvidenceUnavailable,
            ..verdict
        };
        return reject(
            &ctx,
            view,
            Kind::Http,
            peer,
            &verdict,
            (Some(&host), Some(port)),
            None,
        )
        .await;
    }
    let mut record = view.record(
        Kind::Http,
        Mode::Explicit,
        peer,
        &verdict,
        Some(&host),
        Some(port),
    );
    record.method = Some(req.method().to_string());
    record.path = Some(req.uri().path().chars().take(256).collect());
    let (upstream, addr) = match dial(&addrs, port, ctx.limits.connect_timeout).await {
        Ok(ok) => ok,
        Err(e) => return dial_failed(&ctx, &mut record, &e).await,
    };
    record.ip = Some(addr.ip());
    if !ctx.write(&mut record).await {
        return denial(Reason::EvidenceUnavailable, Some(&record.id), None);
    }

    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(upstream)).await {
            Ok(pair) => pair,
            Err(e) => return upstream_failed(&ctx, &record, &e.to_string()),
        };
    let conn_task = ctx.tasks.spawn(async move {
        if let Err(e) = conn.await {
            debug!(error = %e, "upstream connection error");
        }
    });

    let head_estimate = head_size(&req) as u64;
    // Rebuild the request in origin form, without hop-by-hop headers.
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = match Uri::builder().path_and_query(path).build() {
        Ok(uri) => uri,
        Err(e) => return upstream_failed(&ctx, &record, &e.to_string()),
    };
    strip_hop_by_hop(&mut parts.headers);
    if !parts.headers.contains_key(header::HOST) {
        let value = match (&host, port) {
            (Host::Ip(std::net::IpAddr::V6(v6)), 80) => format!("[{v6}]"),
            (Host::Ip(std::net::IpAddr::V6(v6)), p) => format!("[{v6}]:{p}"),
            (h, 80) => h.to_string(),
            (h, p) => format!("{h}:{p}"),
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
            parts.headers.insert(header::HOST, v);
        }
    }
    let up_count = Arc::new(AtomicU64::new(0));
    let up = match bytes {
        Some(bytes) => UpCount::Wire(bytes),
        // Only if the meter lost track (it stops where hyper refuses).
        None => UpCount::Estimate {
            head: head_estimate,
            body: up_count.clone(),
        },
    };
    let body = Counted::new(body, up_count, None);
    let upstream_req = Request::from_parts(parts, body);

    let response =
        tokio::time::timeout(ctx.limits.idle_timeout, sender.send_request(upstream_req)).await;
    let response = match response {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return upstream_failed(&ctx, &record, &e.to_string()),
        Err(_) => return upstream_failed(&ctx, &record, "upstream response timed out"),
    };
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let closer = CloseRecord {
        ctx: ctx.clone(),
        record,
        up,
        started: Instant::now(),
        _conn: conn_task,
    };
    let body = Counted::new(body, Arc::new(AtomicU64::new(0)), Some(closer));
    Response::from_parts(parts, body.boxed())
}

fn upstream_failed(ctx: &Ctx, record: &Record, why: &str) -> Response<ProxyBody> {
    let mut close = record.close(0, 0, 0);
    close.detail = Some(why.to_string());
    ctx.submit(&mut close);
    let body = format!(
        "palisade: upstream failed (evidence record {}): {why}\n",
        record.id
    );
    text_response(
        StatusCode::BAD_GATEWAY,
        &deny::proxy_status("http_response_incomplete", "rule_match", Some(&record.id)),
        body,
    )
}

/// Writes the close record of a forwarded request when its response body is
/// done (or dropped).
struct CloseRecord {
    ctx: Arc<Ctx>,
    record: Record,
    up: UpCount,
    started: Instant,
    _conn: tokio::task::JoinHandle<()>,
}

impl CloseRecord {
    fn finish(&mut self, down: u64) {
        let elapsed = self.started.elapsed().as_millis() as u64;
        let mut close = self.record.close(self.up.get(), down, elapsed);
        self.ctx.submit(&mut close);
    }
}

/// `bytes_up` of a forwarded request: every byte the client sent for it.
enum UpCount {
    /// As counted on the wire by the connection's [`Meter`].
    Wire(Arc<RequestBytes>),
    /// Should the meter have lost track: the head as hyper parsed it, and
    /// the body as forwarded.
    Estimate { head: u64, body: Arc<AtomicU64> },
}

impl UpCount {
    fn get(&self) -> u64 {
        match self {
            UpCount::Wire(bytes) => bytes.total(),
            UpCount::Estimate { head, body } => head + body.load(Ordering::Relaxed),
        }
    }
}

// ---------------------------------------------------------------------------
// Counting each request's bytes as received

/// The bytes one request took on the wire: its head (request line, headers,
/// any empty lines before it) and its body with any chunk framing.
#[derive(Debug)]
struct RequestBytes {
    head: u64,
    body: AtomicU64,
}

impl RequestBytes {
    fn total(&self) -> u64 {
        self.head + self.body.load(Ordering::Relaxed)
    }
}

/// Splits what one client connection sends into requests as hyper reads it
/// (see [`Framer`]); the service takes each request's count in turn.
#[derive(Debug)]
struct Meter {
    state: Mutex<MeterState>,
}

#[derive(Debug)]
struct MeterState {
    framer: Framer,
    /// Requests whose heads were read and that the service has not taken yet.
    pending: VecDeque<Arc<RequestBytes>>,
    /// The request whose body the bytes now belong to.
    current: Option<Arc<RequestBytes>>,
    events: Vec<Event>,
}

impl Meter {
    fn new(max_head: usize) -> Meter {
        Meter {
            state: Mutex::new(MeterState {
                framer: Framer::new(max_head),
                pending: VecDeque::new(),
                current: None,
                events: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes just read from the client.
    fn read(&self, data: &[u8]) {
        let mut st = self.lock();
        if st.framer.is_stopped() {
            return;
        }
        let mut events = std::mem::take(&mut st.events);
        st.framer.feed(data, &mut events);
        st.apply(&mut events);
        st.events = events;
    }

    /// The count of the next request hyper hands the service; `None` if
    /// the meter lost track.
    fn next_request(&self) -> Option<Arc<RequestBytes>> {
        self.lock().pending.pop_front()
    }

    /// The CONNECT just handled was answered: a tunnel (`accepted`) takes the
    /// rest of the connection; otherwise the next request follows.
    fn connect_answered(&self, accepted: bool) {
        let mut st = self.lock();
        if accepted {
            st.framer.stop();
            st.pending.clear();
            st.current = None;
        } else {
            let mut events = std::mem::take(&mut st.events);
            st.framer.resume(&mut events);
            st.apply(&mut events);
            st.events = events;
        }
    }
}

impl MeterState {
    fn apply(&mut self, events: &mut Vec<Event>) {
        for event in events.drain(..) {
            match event {
                Event::Head { len } => {
                    let bytes = Arc::new(RequestBytes {
                        head: len,
                        body: AtomicU64::new(0),
                    });
                    self.pending.push_back(bytes.clone());
                    self.current = Some(bytes);
                }
                Event::Body(n) => {
                    if let Some(current) = &self.current {
                        current.body.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

/// The client connection, with every byte read shown to the [`Meter`].
struct Metered<T> {
    inner: T,
    meter: Arc<Meter>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Metered<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            if let Some(new) = buf.filled().get(before..) {
                if !new.is_empty() {
                    self.meter.read(new);
                }
            }
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Metered<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A body that counts the bytes passing through and, for responses, writes
/// the close record once.
struct Counted<B> {
    inner: B,
    count: Arc<AtomicU64>,
    closer: Option<CloseRecord>,
}

impl<B> Counted<B> {
    fn new(inner: B, count: Arc<AtomicU64>, closer: Option<CloseRecord>) -> Self {
        Counted {
            inner,
            count,
            closer,
        }
    }
}

impl<B> Drop for Counted<B> {
    fn drop(&mut self) {
        if let Some(mut closer) = self.closer.take() {
            closer.finish(self.count.load(Ordering::Relaxed));
        }
    }
}

impl<B> Body for Counted<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => {
                if let Some(mut closer) = this.closer.take() {
                    closer.finish(this.count.load(Ordering::Relaxed));
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The meter against hyper itself: pipelined requests of every framing
    /// on one connection, each counted exactly as sent.
    #[tokio::test]
    async fn each_request_counts_the_bytes_it_took_on_the_wire() {
        let long = format!("http://a.test/{}", "x".repeat(3000));
        let requests: Vec<Vec<u8>> = vec![
            format!(
                "GET {long} HTTP/1.1\r\nHost: a.test\r\nX-Pad:   {}  \r\n\r\n",
                "p".repeat(500)
            )
            .into_bytes(),
            b"\r\nPOST http://a.test/ HTTP/1.1\nHost: a.test\ncontent-length: 11\n\nhello world"
                .to_vec(),
            b"PUT http://a.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
              5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
                .to_vec(),
            b"CONNECT b.test:443 HTTP/1.1\r\nHost: b.test:443\r\n\r\n".to_vec(),
            b"GET http://a.test/last HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
                .to_vec(),
        ];
        let (client, server) = tokio::io::duplex(1 << 20);
        let meter = Arc::new(Meter::new(64 * 1024));
        let io = Metered {
            inner: server,
            meter: meter.clone(),
        };
        let svc_meter = meter.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let meter = svc_meter.clone();
            async move {
                let bytes = meter.next_request();
                let connect = req.method() == Method::CONNECT;
                let _ = req.into_body().collect().await;
                let counted = bytes.map_or(0, |b| b.total());
                let mut resp = Response::new(full(counted.to_string()));
                if connect {
                    *resp.status_mut() = StatusCode::FORBIDDEN;
                    meter.connect_answered(false);
                }
                Ok::<_, Infallible>(resp)
            }
        });
        let server = tokio::spawn(async move {
            hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades()
                .await
        });
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut rd, mut wr) = tokio::io::split(client);
        wr.write_all(&requests.concat()).await.unwrap();
        let mut out = Vec::new();
        rd.read_to_end(&mut out).await.unwrap();
        let _ = server.await;
        let text = String::from_utf8_lossy(&out);
        let counts: Vec<u64> = text
            .split("HTTP/1.1 ")
            .skip(1)
            .map(|resp| {
                let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default();
                body.parse().unwrap_or_else(|_| panic!("{resp}"))
            })
            .collect();
        let want: Vec<u64> = requests.iter().map(|r| r.len() as u64).collect();
        assert_eq!(counts, want, "{text}");
    }

    #[test]
    fn basic_credentials_split_at_the_first_colon() {
        // base64("acme:t0k:en")
        assert_eq!(
            basic_credentials(b"Basic YWNtZTp0MGs6ZW4="),
            Some((b"acme".to_vec(), b"t0k:en".to_vec()))
        );
        assert_eq!(
            basic_credentials(b"basic  YWNtZTp0MGs6ZW4= "),
            Some((b"acme".to_vec(), b"t0k:en".to_vec()))
        );
        assert_eq!(basic_credentials(b"Bearer YWNtZTp0MGs6ZW4="), None);
        assert_eq!(basic_credentials(b"Basic !!!"), None);
        // base64("nocolon")
        assert_eq!(basic_credentials(b"Basic bm9jb2xvbg=="), None);
    }
}
