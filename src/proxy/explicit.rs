//! Explicit proxy mode: HTTP/1.1 CONNECT tunnels and absolute-form request
//! forwarding. Each request on a kept-alive connection is decided on its own.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tracing::{debug, info_span, Instrument};

use super::limits::Permit;
use super::tunnel::{self, Detected};
use super::{deny, dial, Ctx, DialError, Outcome, View};
use crate::evidence::{Kind, Mode, Record};
use crate::intercept;
use crate::policy::{OrgRef, Reason, Verdict};
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
        let svc_ctx = ctx.clone();
        let service = service_fn(move |req| {
            let ctx = svc_ctx.clone();
            let permit = permit.clone();
            async move { Ok::<_, Infallible>(handle(ctx, peer, permit, req).await) }
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

async fn handle(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    permit: Arc<Permit>,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    // Each request is decided under the policy served when it arrives.
    let view = &ctx.view(peer.ip());
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
        forward(ctx, peer, view, req).await
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

/// Bytes of the request line and headers as sent (give or take whitespace).
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
    (host, port): (Option<&Host>, Option<u16>),
    detail: Option<&str>,
) -> Response<ProxyBody> {
    let mut record = view.record(kind, Mode::Explicit, peer, verdict, host, port);
    record.detail = detail.map(str::to_string);
    let reason = if ctx.write(&mut record).await {
        verdict.reason
    } else {
        Reason::EvidenceUnavailable
    };
    debug!(reason = %reason, record = %record.id, "denied");
    denial(reason, Some(&record.id), detail)
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
    record.detail = Some(err.to_string());
    if let DialError::Timeout { addr } | DialError::Io { addr, .. } = err {
        record.ip = Some(addr.ip());
    }
    let written = ctx.write(record).await;
    let (status, error) = match err {
        DialError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "connection_timeout"),
        DialError::Io { source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused => {
            (StatusCode::BAD_GATEWAY, "connection_refused")
        }
        _ => (StatusCode::BAD_GATEWAY, "destination_unavailable"),
    };
    if !written {
        return denial(Reason::EvidenceUnavailable, Some(&record.id), None);
    }
    let body = format!(
        "palisade: upstream unreachable (evidence record {}): {err}\n",
        record.id
    );
    text_response(
        status,
        &deny::proxy_status(error, "rule_match", Some(&record.id)),
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
    let outcome = ctx.decide(view, &host, port).await;
    if !outcome.verdict.is_allow() {
        return reject(
            &ctx,
            view,
            Kind::Tcp,
            peer,
            &outcome.verdict,
            (Some(&host), Some(port)),
            outcome.detail.as_deref(),
        )
        .await;
    }
    if !ctx.evidence.is_healthy() {
        let verdict = Verdict {
            reason: Reason::EvidenceUnavailable,
            ..outcome.verdict
        };
        return reject(
            &ctx,
            view,
            Kind::Tcp,
            peer,
            &verdict,
            (Some(&host), Some(port)),
            None,
        )
        .await;
    }
    let mut record = view.record(
        Kind::Tcp,
        Mode::Explicit,
        peer,
        &outcome.verdict,
        Some(&host),
        Some(port),
    );
    let (upstream, addr) = match dial(&outcome.dial, port, ctx.limits.connect_timeout).await {
        Ok(ok) => ok,
        Err(e) => return dial_failed(&ctx, &mut record, &e).await,
    };
    record.ip = Some(addr.ip());

    let tunnel_ctx = ctx.clone();
    let view = view.clone();
    let on_upgrade = hyper::upgrade::on(req);
    ctx.tasks.spawn(
        async move {
            let _permit = permit;
            match on_upgrade.await {
                Ok(upgraded) => {
                    let io = TokioIo::new(upgraded);
                    run_tunnel(tunnel_ctx, view, io, upstream, host, record).await
                }
                Err(e) => debug!(error = %e, "CONNECT upgrade failed"),
            }
        }
        .instrument(tracing::Span::current()),
    );
    Response::new(full(Bytes::new()))
}

/// After `200`: check the client's first bytes against the CONNECT host,
/// record the decision, then copy.
async fn run_tunnel(
    ctx: Arc<Ctx>,
    view: View,
    mut client: TokioIo<hyper::upgrade::Upgraded>,
    upstream: TcpStream,
    host: Host,
    mut record: Record,
) {
    let mut first = Vec::new();
    let detected = tunnel::detect(&mut client, &mut first, ctx.limits.detect_timeout).await;
    let mismatch = match &detected {
        Detected::Tls(hello) => {
            record.sni = hello.sni.clone();
            match (&host, &hello.sni) {
                (Host::Name(_), Some(sni)) => match normalize_host(sni) {
                    Ok(sni_host) if sni_host == host => None,
                    _ => Some(Reason::SniMismatch),
                },
                _ => None,
            }
        }
        Detected::Malformed(why) => {
            record.detail = Some((*why).to_string());
            Some(Reason::BadRequest)
        }
        // Plain HTTP in a tunnel: its Host picks the virtual host at the
        // upstream, so it must name the CONNECT host too.
        Detected::Http(Some(h)) => match (&host, parse_authority(h, Some(80))) {
            (Host::Name(_), Ok((req_host, _))) if req_host != host => Some(Reason::HostMismatch),
            (Host::Name(_), Err(_)) => Some(Reason::HostMismatch),
            _ => None,
        },
        Detected::Http(None) | Detected::NotTls | Detected::Silent | Detected::Closed => None,
    };
    if let Some(reason) = mismatch {
        record.reason = reason;
        record.decision = reason.decision();
        record.rule = None;
        ctx.write(&mut record).await;
        debug!(reason = %reason, record = %record.id, "tunnel denied after detection");
        return; // both sides dropped: nothing reached the upstream
    }
    // Opt-in TLS interception (src/intercept): only for an allow rule with
    // `intercept = true`; a non-TLS tunnel to such a host is refused.
    let plan = intercept::plan(ctx.intercept.as_deref(), &view, &mut record, &detected);
    if !ctx.write(&mut record).await || detected == Detected::Closed || !record.reason.is_allow() {
        return;
    }
    if plan == intercept::Plan::Intercept {
        if let Some(s) = intercept::serve::Session::new(ctx.clone(), view, Mode::Explicit, record) {
            intercept::serve::serve(s, client, first, upstream).await;
        }
        return;
    }
    let started = Instant::now();
    let totals = tunnel::pump(
        client,
        upstream,
        &first,
        ctx.limits.idle_timeout,
        &ctx.hard_stop,
    )
    .await;
    let mut close = record.close(totals.up, totals.down, started.elapsed().as_millis() as u64);
    ctx.write(&mut close).await;
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
fn check_request(req: &Request<Incoming>) -> Result<(Host, u16), (Reason, String)> {
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
                return Err((
                    Reason::HostMismatch,
                    format!("Host header {text:?} does not name the request target"),
                ))
            }
        }
    }
    Ok((host, port))
}

async fn forward(
    ctx: Arc<Ctx>,
    peer: SocketAddr,
    view: &View,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let (host, port) = match check_request(&req) {
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
        verdict,
        dial: addrs,
        detail,
    } = ctx.decide(view, &host, port).await;
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
    let body = Counted::new(body, up_count.clone(), None);
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
        up: up_count,
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
    up: Arc<AtomicU64>,
    started: Instant,
    _conn: tokio::task::JoinHandle<()>,
}

impl CloseRecord {
    fn finish(&mut self, down: u64) {
        let elapsed = self.started.elapsed().as_millis() as u64;
        let mut close = self
            .record
            .close(self.up.load(Ordering::Relaxed), down, elapsed);
        self.ctx.submit(&mut close);
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
}
