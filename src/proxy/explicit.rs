//! Explicit proxy mode: HTTP/1.1 CONNECT tunnels and absolute-form request
//! forwarding, served through the proxy's HTTP layer ([`super::http`]).
//! Each request on a kept-alive connection is decided on its own.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes};
use http::header;
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, debug_span, Instrument};

use super::admission;
use super::conn::{Asked, Link};
use super::connect::{self, Opened};
use super::ctx::{Ctx, View};
use super::decide::{decide_asked, Decided};
use super::failure::Unserved;
use super::forward;
use super::http::replay::Replay;
use super::http::wire::{Meter, MeteredIo, RequestBytes};
use super::http::{self as layer, full, Body, Drain, Protocol};
use super::intercepted;
use super::record::{denied, refused};
use crate::evidence::{Kind, Mode};
use crate::otel;
use crate::policy::{Credential, IdentityError, Reason};
use crate::proto::http_head::{self, ConnectHead};
use crate::proto::target::{normalize_host, parse_authority, Host};
use crate::proto::Parse;

/// Serve one client connection until it closes or shutdown drains it.
///
/// The first request head is read here: a CONNECT is answered and becomes
/// its tunnel on this task without an HTTP server in between; anything
/// else (and a refused CONNECT, whose answer hyper writes) goes to the
/// HTTP layer with the bytes read so far.
pub(crate) async fn serve_connection(ctx: Arc<Ctx>, stream: TcpStream, link: Link) {
    // The link's permit lives as long as the connection or any tunnel it
    // became (each decided connection carries it on).
    let span = debug_span!("explicit", org = link.view.org.as_ref().map(|o| &*o.name));
    async move {
        let mut stream = stream;
        let mut held = Vec::new();
        // Boxed, as every step here: the task's own state stays a few
        // pointers for the life of the tunnel it becomes.
        let (answer, cx) = match Box::pin(read_first(&ctx, &mut stream, &mut held)).await {
            First::Connect(req, len) => {
                let mode = link.mode.as_str();
                let headers = Some(&req.trace);
                let cx = otel::connection(ctx.otel.as_deref(), link.client, mode, headers);
                // Boxed inside the context's wrapper: the step's state is
                // moved into its box once, not again with the wrapper.
                let first = connect_first(&ctx, &link, &mut stream, *req);
                match otel::within(cx.clone(), Box::pin(first)).await {
                    Ok(opened) => {
                        drop(link);
                        // Bytes the client sent after the head: the tunnel
                        // judges and replays them first.
                        let early = held.split_off(len);
                        drop(held);
                        let tunnel = connect::run_opened(ctx, stream, opened, early);
                        return otel::within(cx, tunnel).await;
                    }
                    Err(answer) => (Some(answer), Some(cx)),
                }
            }
            First::Http => (None, None),
            First::Gone => return,
            First::TimedOut => {
                let why = "read header from client timeout";
                return Box::pin(record_unparsed(&ctx, &link, why)).await;
            }
        };
        let conn = ConnState { answer, cx };
        Box::pin(serve_http(ctx, Replay::new(held, stream), link, conn)).await
    }
    .instrument(span)
    .await
}

/// What [`serve_http`] starts a connection with when the explicit
/// listener already answered its first request.
struct ConnState {
    /// The response to the first request (a CONNECT refused before hyper
    /// saw it): hyper reads that request again and writes this.
    answer: Option<Response<Body>>,
    /// The connection's trace context, started with that request.
    cx: Option<opentelemetry::Context>,
}

/// What the first bytes of an explicit connection are.
enum First {
    /// A whole CONNECT head, `len` bytes long, that needs nothing of HTTP
    /// beyond it: answered here.
    Connect(Box<ConnectHead>, usize),
    /// Anything else (another method, a malformed or oversized head, a
    /// close mid-head): for the HTTP layer, which answers as it always has.
    Http,
    /// Closed (or shutdown) before a byte came.
    Gone,
    /// The head did not come within `header_read_timeout`.
    TimedOut,
}

/// Read the first request head into `held`, within the listener's bounds:
/// at most hyper's buffer (so that hyper answers an oversized head as
/// before), until `header_read_timeout` after the connection was accepted
/// (the bound a slow client gets, whoever parses the head).
async fn read_first(ctx: &Ctx, stream: &mut TcpStream, held: &mut Vec<u8>) -> First {
    let limits = &ctx.limits;
    let cap = limits.max_request_head_bytes + HYPER_HEAD_SLACK;
    let max_headers = limits.max_headers + HYPER_HEADERS_SLACK;
    let deadline = tokio::time::Instant::now() + limits.header_read_timeout.get();
    loop {
        if !held.is_empty() {
            match http_head::connect(held, max_headers) {
                Parse::NeedMore if held.len() < cap => {}
                Parse::Done { value, len } => return First::Connect(Box::new(value), len),
                _ => return First::Http,
            }
        }
        // Read straight into `held` (no buffer in this future's state, which
        // is moved into its box), at most `READ_CHUNK` bytes at a time.
        let room = READ_CHUNK.min(cap - held.len());
        held.reserve(room);
        let mut into = (&mut *held).limit(room);
        // The read first: bytes already there are taken without arming
        // the shutdown's wake-up (a lock and a list entry, each way).
        let read = tokio::select! {
            biased;
            r = tokio::time::timeout_at(deadline, stream.read_buf(&mut into)) => Some(r),
            _ = ctx.shutdown.cancelled() => None,
        };
        match read {
            Some(Ok(Ok(n))) if n > 0 => {}
            Some(Err(_)) => return First::TimedOut,
            // Shutdown, a close or a read error: what hyper makes of the
            // bytes so far (nothing, or a parse error it answers).
            _ if held.is_empty() => return First::Gone,
            _ => return First::Http,
        }
    }
}

/// The most [`read_first`] reads at a time.
const READ_CHUNK: usize = 2048;

/// Decide and open the first CONNECT as [`handle`] would, and on success
/// tell the client (`200`): the opened tunnel. A refusal is recorded and
/// its answer returned, for hyper to write on this connection.
async fn connect_first(
    ctx: &Ctx,
    link: &Link,
    stream: &mut TcpStream,
    req: ConnectHead,
) -> Result<Box<Opened>, Response<Body>> {
    let link = admitted(ctx, link.clone(), &req, Kind::Tcp).await?;
    let opened = connect_open(ctx, link, &req).await?;
    // A client already gone is noticed by the tunnel at its first read.
    let _ = stream.write_all(CONNECT_ESTABLISHED).await;
    Ok(opened)
}

/// The answer to a CONNECT that became a tunnel.
const CONNECT_ESTABLISHED: &[u8] = b"HTTP/1.1 200 OK\r\n\r\n";

/// Serve the rest of a connection with hyper, `io` giving back the bytes
/// already read first.
async fn serve_http(ctx: Arc<Ctx>, io: Replay<TcpStream>, link: Link, first: ConnState) {
    let limits = &ctx.limits;
    let meter = Arc::new(Meter::new(limits.max_request_head_bytes + HYPER_HEAD_SLACK));
    let stream = MeteredIo::new(io, meter.clone());
    let svc_ctx = ctx.clone();
    let svc_link = link.clone();
    let answer = std::sync::Mutex::new(first.answer);
    // The connection's span starts with its first request, under that
    // request's `traceparent` (a CONNECT's is the tunnel's parent).
    let conn_span = std::sync::OnceLock::new();
    if let Some(cx) = first.cx {
        let _ = conn_span.set(cx);
    }
    let service = service_fn(move |req: Request<Incoming>| {
        let ctx = svc_ctx.clone();
        let link = svc_link.clone();
        let meter = meter.clone();
        let conn = conn_span.get_or_init(|| {
            let mode = link.mode.as_str();
            otel::connection(ctx.otel.as_deref(), link.client, mode, Some(req.headers()))
        });
        let cx = if req.method() == Method::CONNECT {
            conn.clone()
        } else {
            otel::request(conn, req.method().as_str(), req.headers())
        };
        let answered = answer.lock().unwrap_or_else(|p| p.into_inner()).take();
        otel::within(cx, async move {
            Ok::<_, Infallible>(match answered {
                Some(resp) => {
                    meter.next_request();
                    meter.connect_answered(false);
                    resp
                }
                // Boxed where it is made: the request's future is moved
                // twice before it is polled (into the span's wrapper, then
                // into hyper's slot), and each move of the whole forwarding
                // state machine, some 12 KiB, was a copy of it.
                None => Box::pin(metered(ctx, link, meter, req)).await,
            })
        })
    });
    let protocol = Protocol::Http1 {
        header_read_timeout: limits.header_read_timeout.get(),
        // hyper's own bounds sit above ours, so that heads over our limits
        // reach `handle` and get a recorded 431; beyond hyper's bounds it
        // answers by itself and `record_parse_error` records it.
        max_buf_size: limits.max_request_head_bytes + HYPER_HEAD_SLACK,
        max_headers: limits.max_headers + HYPER_HEADERS_SLACK,
    };
    let drain = Drain {
        shutdown: &ctx.shutdown,
        hard_stop: &ctx.hard_stop,
    };
    if let Err(e) = layer::serve(stream, service, protocol, drain).await {
        debug!(error = %e, "connection ended with error");
        record_parse_error(&ctx, &link, &e).await;
    }
}

/// Bytes hyper may buffer beyond `max_request_head_bytes`.
const HYPER_HEAD_SLACK: usize = 64 * 1024;
/// Headers hyper may parse beyond `max_headers`.
const HYPER_HEADERS_SLACK: usize = 100;

/// A request hyper could not parse (or whose head did not arrive in time)
/// was answered by hyper itself with a bare 400/431 (or, for the timeout,
/// closed); record it.
async fn record_parse_error(ctx: &Ctx, link: &Link, e: &hyper::Error) {
    if e.is_parse() || e.is_parse_too_large() || e.is_timeout() {
        record_unparsed(ctx, link, &e.to_string()).await;
    }
}

/// Record a request that was not parsed (`why`); the client gets no
/// answer beyond hyper's.
async fn record_unparsed(ctx: &Ctx, link: &Link, why: &str) {
    let mut link = link.under(ctx.view(link.client.ip()), Kind::Http);
    link.refuse(Reason::BadRequest, format!("request not parsed: {why}"));
    refused(ctx, &link).await;
}

/// Handle one request with the count of the bytes it took on the wire.
/// hyper calls the service once per request, in order, after reading its
/// head, so the meter's next request is this one.
async fn metered(
    ctx: Arc<Ctx>,
    link: Link,
    meter: Arc<Meter>,
    req: Request<Incoming>,
) -> Response<Body> {
    let bytes = meter.next_request();
    let connect = req.method() == Method::CONNECT;
    let resp = handle(ctx, link, req, bytes).await;
    if connect {
        // A 2xx turns the connection into a tunnel; anything else keeps it HTTP.
        meter.connect_answered(resp.status().is_success());
    }
    resp
}

async fn handle(
    ctx: Arc<Ctx>,
    link: Link,
    req: Request<Incoming>,
    bytes: Option<Arc<RequestBytes>>,
) -> Response<Body> {
    let kind = if req.method() == Method::CONNECT {
        Kind::Tcp
    } else {
        Kind::Http
    };
    let link = match admitted(&ctx, link, &req, kind).await {
        Ok(link) => link,
        Err(refused) => return refused,
    };
    // Only the common branch, an absolute-form request, is awaited in
    // place; the others are boxed where they are made, so that this
    // future (copied whole into its box per request, see `serve_http`)
    // is sized by the path a kept-alive GET takes, not by the largest.
    if req.method() == Method::CONNECT {
        Box::pin(connect(ctx, link, req)).await
    } else if req.uri().scheme().is_some() {
        forward(ctx, link, req, bytes).await
    } else {
        let mut link = link;
        link.refuse(
            Reason::BadRequest,
            "origin-form request: this is a proxy".to_string(),
        );
        Box::pin(reject(&ctx, &link)).await
    }
}

/// The checks every request passes before its method's: who it is for
/// (address and credentials, checked on every request), the org's
/// connection budget, and the configured head bounds. The link under the
/// request's org, or the recorded refusal's answer.
async fn admitted(
    ctx: &Ctx,
    link: Link,
    req: &impl Head,
    kind: Kind,
) -> Result<Link, Response<Body>> {
    // Each request is decided under the policy served when it arrives, for
    // the org its address and credentials (checked on every request) name.
    let mut link = match identify(ctx, link.client, req) {
        Ok(view) => link.under(view, kind),
        Err((view, e)) => return Err(Box::pin(auth_refused(ctx, link.under(view, kind), e)).await),
    };
    // The connection now counts for the org this request names (see
    // `limits`): a token client leaves its address's pre-auth budget.
    if let Err(hit) = link.charge(ctx) {
        link.refuse(Reason::LimitExceeded, hit.describe().to_string());
        return Err(Box::pin(reject(ctx, &link)).await);
    }
    // hyper bounds its read buffer only roughly; these make the configured limits exact.
    let size = usize::try_from(req.size()).unwrap_or(usize::MAX);
    let too_large = if size > ctx.limits.max_request_head_bytes {
        Some("request head too large")
    } else if req.header_count() > ctx.limits.max_headers {
        Some("too many headers")
    } else {
        None
    };
    if let Some(why) = too_large {
        link.refuse(Reason::BadRequest, why.to_string());
        let mut refused = Box::pin(refused(ctx, &link)).await;
        if refused.failure.reason() == Reason::BadRequest {
            refused.failure = Unserved::HeadTooLarge;
        }
        return Err(refused.response());
    }
    Ok(link)
}

/// The view for a request: its client address and any
/// `Proxy-Authorization: Basic base64(org:token)` it carries.
fn identify(ctx: &Ctx, peer: SocketAddr, req: &impl Head) -> Result<View, (View, IdentityError)> {
    let Some((value, more)) = req.authorization() else {
        return ctx.view_as(peer.ip(), None);
    };
    let decoded = match more {
        true => None,
        false => basic_credentials(value),
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
                served: ctx.served.load_full(),
                org: None,
                token: None,
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
async fn auth_refused(ctx: &Ctx, mut link: Link, e: IdentityError) -> Response<Body> {
    link.refuse(e.reason(), e.to_string());
    let mut refused = refused(ctx, &link).await;
    // The client learns the reason code (and a challenge), not the cause.
    refused.detail = None;
    refused.response()
}

/// What the checks every request passes ([`admitted`], [`connect_open`])
/// read of its head: a request as hyper parsed it, or a CONNECT the
/// listener parsed itself ([`ConnectHead`]).
trait Head {
    /// The request target.
    fn target(&self) -> &http::Uri;
    /// How many header fields the head has.
    fn header_count(&self) -> usize;
    /// Bytes of the request line and headers as sent (give or take
    /// whitespace): the configured head limit's measure. Evidence counts
    /// the exact bytes ([`Meter`]).
    fn size(&self) -> u64;
    /// The first `Proxy-Authorization` value, and whether another follows.
    fn authorization(&self) -> Option<(&[u8], bool)>;
}

impl<B> Head for Request<B> {
    fn target(&self) -> &http::Uri {
        self.uri()
    }
    fn header_count(&self) -> usize {
        self.headers().len()
    }
    fn size(&self) -> u64 {
        super::http::request_head_len(self.method(), self.uri(), self.headers())
    }
    fn authorization(&self) -> Option<(&[u8], bool)> {
        let mut values = self.headers().get_all(header::PROXY_AUTHORIZATION).iter();
        let first = values.next()?;
        Some((first.as_bytes(), values.next().is_some()))
    }
}

impl Head for ConnectHead {
    fn target(&self) -> &http::Uri {
        &self.target
    }
    fn header_count(&self) -> usize {
        self.headers
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn authorization(&self) -> Option<(&[u8], bool)> {
        let (value, more) = self.authorization.as_ref()?;
        Some((value, *more))
    }
}

/// Record `link`'s refusal and build its response.
async fn reject(ctx: &Ctx, link: &Link) -> Response<Body> {
    refused(ctx, link).await.response()
}

// ---------------------------------------------------------------------------
// CONNECT

async fn connect(ctx: Arc<Ctx>, link: Link, req: Request<Incoming>) -> Response<Body> {
    let opened = match connect_open(&ctx, link, &req).await {
        Ok(opened) => opened,
        Err(refused) => return refused,
    };
    let tunnel_ctx = ctx.clone();
    let on_upgrade = hyper::upgrade::on(req);
    // Boxed until the upgrade (`run_upgraded` frees the box): the task that
    // waits for it then holds a pointer, not room for the whole `Opened`,
    // for the tunnel's life. The tunnel's state carries the permit.
    // The tunnel keeps the connection's span (it ends with the tunnel).
    ctx.tasks.spawn(otel::within(
        otel::current(),
        async move {
            match on_upgrade.await {
                Ok(upgraded) => connect::run_upgraded(tunnel_ctx, upgraded, opened).await,
                Err(e) => debug!(error = %e, "CONNECT upgrade failed"),
            }
        }
        .instrument(tracing::Span::current()),
    ));
    Response::new(full(Bytes::new()))
}

/// A CONNECT's target checked, decided, admitted and dialled
/// ([`connect::open`]); a refusal is recorded and answered.
async fn connect_open(
    ctx: &Ctx,
    mut link: Link,
    req: &impl Head,
) -> Result<Box<Opened>, Response<Body>> {
    let uri = req.target();
    let target = uri
        .authority()
        .filter(|_| uri.scheme().is_none() && uri.path_and_query().is_none())
        .map(|a| parse_authority(a.as_str(), None));
    let (host, port) = match target {
        Some(Ok(t)) => t,
        Some(Err(e)) => {
            link.refuse(Reason::BadRequest, e.to_string());
            return Err(reject(ctx, &link).await);
        }
        None => {
            let why = "CONNECT needs an authority-form target host:port";
            link.refuse(Reason::BadRequest, why.to_string());
            return Err(reject(ctx, &link).await);
        }
    };
    match connect::open(ctx, &link, host, port).await {
        Ok(opened) => Ok(Box::new(opened)),
        Err(refused) => Err(refused.response()),
    }
}

// ---------------------------------------------------------------------------
// Absolute-form forwarding

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
    mut link: Link,
    req: Request<Incoming>,
    bytes: Option<Arc<RequestBytes>>,
) -> Response<Body> {
    let started = Instant::now();
    let (host, port, host_mismatch) = match check_request(&req) {
        Ok((host, port, Some(why))) if !link.view.is_report() => {
            link.target(Some(host), Some(port));
            link.refuse(Reason::HostMismatch, why);
            return Box::pin(reject(&ctx, &link)).await;
        }
        Ok(t) => t,
        Err((reason, detail)) => {
            let host = req.uri().host().and_then(|h| normalize_host(h).ok());
            let port = req.uri().port_u16().or(host.as_ref().map(|_| 80));
            link.target(host, port);
            link.refuse(reason, detail);
            return Box::pin(reject(&ctx, &link)).await;
        }
    };
    let Decided {
        verdict,
        dial: addrs,
        detail,
        synthetic,
        decider,
        ..
    } = {
        // The request, for a grant naming a method or path.
        let path = crate::policy::request::NormalPath::parse(req.uri().path()).ok();
        let mut asker = ctx.asker(link.client.ip(), Mode::Explicit);
        asker.request = path.as_ref().map(|path| crate::jit::Request {
            method: req.method().as_str(),
            path,
        });
        decide_asked(&ctx, asker, &link.view, &host, port).await
    };
    let mut conn = link.decided(host, port, verdict);
    conn.detail = detail;
    conn.decider = decider;
    // A synthetic address stands for the name bound to it.
    conn.stood_for(synthetic.as_deref());
    if host_mismatch.is_some() && conn.is_allow() {
        // Report mode: what enforcement would have said first.
        conn.verdict.would_deny = Some(Reason::HostMismatch);
        conn.verdict.reason = Reason::ReportOnly;
    }
    // An intercepting rule's method and path rules bind plain http:// too
    // (credentials are never added to plain HTTP).
    if conn.is_allow() {
        if let Some((verdict, detail)) =
            intercepted::plain_request(&conn.view, &conn.verdict, req.method(), req.uri())
        {
            conn.verdict = verdict;
            conn.detail = Some(detail);
        }
    }
    if !conn.is_allow() || !admission::admit(&ctx, &mut conn) {
        return denied(&ctx, &mut conn).await.response();
    }
    conn.method = Some(req.method().to_string());
    conn.path = Some(req.uri().path().chars().take(256).collect());
    conn.asked = Some(Asked {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        websocket: false,
        intercepted: false,
    });
    let head_estimate = req.size();
    forward::absolute(ctx, conn, &addrs, req, (bytes, head_estimate), started).await
}

/// Accept connections on an explicit-proxy listener until shutdown.
pub(crate) async fn serve_explicit(ctx: Arc<Ctx>, listener: TcpListener) {
    super::listen::accept_loop(
        ctx,
        listener,
        Mode::Explicit,
        serve_connection,
        reject_over_limit,
    )
    .await
}

/// Over a connection cap: record it, answer 503 without waiting, close.
fn reject_over_limit(ctx: &Ctx, stream: TcpStream, link: Link) {
    let mut record = link.record();
    ctx.submit(&mut record);
    let response = Unserved::Denied(Reason::LimitExceeded).raw_response(record.shown());
    // Non-blocking: a flood must not tie up the accept loop.
    if stream.try_write(response.as_bytes()).is_err() {
        return;
    }
    // Closing with the request unread would reset the connection and could
    // destroy the 503 before the client reads it: drain briefly first, in a
    // bounded number of short-lived tasks (beyond them, just close).
    let Ok(permit) = ctx.refusal_drains.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
        let mut sink = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + REFUSAL_DRAIN_TIME;
        let mut left = REFUSAL_DRAIN_BYTES;
        while left > 0 {
            match tokio::time::timeout_at(
                deadline,
                tokio::io::AsyncReadExt::read(&mut stream, &mut sink),
            )
            .await
            {
                Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
                _ => break,
            }
        }
    });
}

/// How long, and how many bytes, a refused connection is drained before closing.
const REFUSAL_DRAIN_TIME: Duration = Duration::from_millis(500);
const REFUSAL_DRAIN_BYTES: usize = 64 * 1024;
/// Refused connections drained at once.
pub(crate) const MAX_REFUSAL_DRAINS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

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
