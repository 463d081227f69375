//! One intercepted connection: terminate the client's TLS with a minted
//! leaf, then serve HTTP/1.1 or HTTP/2 (by the client's ALPN) through the
//! proxy's HTTP layer and decide each request on its own before forwarding
//! it over Palisade's own, verified TLS connection to the upstream
//! (HTTP/1.1 or HTTP/2 by the upstream's ALPN, negotiated separately).
//!
//! Per request, in order ([`decide_parts`], pure): CONNECT (other than an
//! HTTP/2 extended CONNECT) and absolute-form (HTTP/1.1) are refused
//! (`bad_request`); Host / `:authority` must name the connection's host
//! and port (`host_mismatch`); an upgrade is refused `upgrade_not_allowed`
//! unless it is a WebSocket handshake on a rule with `websocket = true`
//! (relayed by [`super::websocket`]);
//! then [`Policy::decide_request`](crate::policy::Policy::decide_request)
//! normalises the path, applies the rule's method and path rules and picks
//! the credentials (the same call `palisade explain` makes). Then the
//! credentials are added (any client copy of the header dropped); the
//! upstream TLS is set up on first use (a failure is `upstream_tls_error`,
//! never a downgrade); the decision is recorded; and the request is sent
//! with the normalised path (and the query as received). Failures are
//! answered through [`Unserved`], as everywhere in the proxy.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri, Version};
use hyper::body::{Body as _, Incoming};
use hyper::service::service_fn;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::config::CredentialConfig;
use crate::intercept::Credential;
use crate::limits::volume::Direction;
use crate::policy::request::{RequestDecision, RequestFacts};
use crate::policy::{OrgRef, Policy, Reason, Verdict};
use crate::proto::http_request::NormalPath;
use crate::proto::target::{parse_authority, Host};
use crate::proxy::admission;
use crate::proxy::conn::{Asked, Conn, Intercepting};
use crate::proxy::ctx::{Ctx, View};
use crate::proxy::decide::decide_granted_request;
use crate::proxy::dial::{dial_checked, DialError};
use crate::proxy::failure::Unserved;
use crate::proxy::forward::{Budgets, Exchange};
use crate::proxy::http::body::{drain, Drained, Metered};
use crate::proxy::http::client::{self, InOrder, NoResponse, ResponseFuture, Sender};
use crate::proxy::http::replay::Replay;
use crate::proxy::http::{self as layer, strip_hop_by_hop, Body, Drain, Protocol};
use crate::proxy::revoke::{self, Cut, Revisit};

use super::service::{Outcome, Prefixed};
use super::websocket::{self, upgrade_of, Upgrade};

/// An allowed connection the tunnel code hands over: decided (allow, by
/// an intercepting rule), its decision record written, its upstream
/// connected. Everything a request inside is decided and recorded with.
pub(crate) struct Session {
    ctx: Arc<Ctx>,
    /// The connection's state, as recorded.
    conn: Conn,
    /// Its `tcp` decision record's id.
    id: String,
    /// The checked address the upstream was reached at (re-dialled there).
    upstream: SocketAddr,
    how: Intercepting,
    /// The name (CONNECT host or SNI, checked against each other).
    name: String,
}

impl Session {
    pub(crate) fn new(
        ctx: Arc<Ctx>,
        conn: Conn,
        id: String,
        upstream: SocketAddr,
        how: Intercepting,
    ) -> Session {
        let name = conn.host.to_string();
        Session {
            ctx,
            conn,
            id,
            upstream,
            how,
            name,
        }
    }

    /// The `tcp` close record of the connection.
    fn close(&self, (up, down): (u64, u64), started: Instant, detail: Option<&str>) {
        let mut close = self.conn.close(&self.id, (up, down), started);
        close.detail = detail.map(str::to_string);
        self.ctx.submit(&mut close);
    }

    /// What the next request is decided under: the served state now, and
    /// the intercepting rule in it. Under a newer state than the one the
    /// connection was decided under, the connection is decided again
    /// ([`revoke::revisit`]): kept, its requests follow the new policy
    /// (the rule as it now stands, the credentials as they now are); in
    /// report mode, what is reported keeps the rules it was decided
    /// under; revoked, `Err` with why (the connection is being closed).
    fn current(&self) -> Result<(View, Intercepting), String> {
        let now = self.ctx.served.load_full();
        if Arc::ptr_eq(&now, &self.conn.view.served) {
            return Ok((self.conn.view.clone(), self.how.clone()));
        }
        match revoke::revisit(&now, &self.conn) {
            Revisit::Kept(view, verdict) => {
                match (view.org.clone(), verdict.rule, now.intercept.clone()) {
                    (Some(org), Some(rule), Some(interceptor)) => Ok((
                        view,
                        Intercepting {
                            interceptor,
                            org,
                            rule,
                        },
                    )),
                    _ => Err("interception is not set up".into()),
                }
            }
            Revisit::Reported(..) => Ok((self.conn.view.clone(), self.how.clone())),
            Revisit::Revoked(_, detail) => Err(detail),
        }
    }

    /// A request inside, as first decided: allowed by the connection's rule
    /// (`how`, under `view`), linked to its record. `path` is what the
    /// client sent.
    fn request(&self, (view, how): (&View, &Intercepting), method: &Method, path: &str) -> Conn {
        let verdict = Verdict {
            org: Some(how.org.clone()),
            reason: Reason::RuleMatch,
            rule: Some(how.rule.clone()),
            would_deny: None,
        };
        let mut req = self.conn.request(view.clone(), verdict);
        req.sni = self.conn.sni.clone();
        req.ip = Some(self.upstream.ip());
        req.within = Some(self.id.clone());
        req.method = Some(method.as_str().to_string());
        req.path = Some(recorded_path(path));
        req.asked = Some(Asked {
            method: method.as_str().to_string(),
            path: path.to_string(),
            websocket: false,
            intercepted: true,
        });
        req
    }
}

/// Serve an intercepted connection until it ends; writes the `tcp` close
/// record. `first` holds the client bytes read during detection.
pub(crate) async fn serve<C>(s: Session, client: C, first: Vec<u8>, upstream: TcpStream)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let started = Instant::now();
    let ic = &s.how.interceptor;
    let Some(server_config) = ic.server_config(&s.how.org.name, &s.name) else {
        s.close((0, 0), started, Some("no leaf certificate could be minted"));
        return;
    };
    let accept = tokio_rustls::TlsAcceptor::from(server_config).accept(Replay::new(first, client));
    let tls = match tokio::time::timeout(ic.handshake_timeout, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            // Typically a client that does not trust the org CA (a pinned
            // client): it stays broken rather than bypassing the rules.
            let detail = format!("client TLS handshake failed: {e}");
            debug!(%detail);
            s.close((0, 0), started, Some(&detail));
            return;
        }
        Err(_) => {
            s.close((0, 0), started, Some("client TLS handshake timed out"));
            return;
        }
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let ctx = s.ctx.clone();
    // Ended by the drain, or by a reload's policy that revokes it: no new
    // request at once, the one in flight within `revoke_grace`.
    let cut = Graceful {
        graceful: ctx.shutdown.child_token(),
        hard: ctx.hard_stop.child_token(),
    };
    let shared = Arc::new(Shared {
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
        upstream: tokio::sync::Mutex::new(Upstream {
            fresh: Some(upstream),
            sender: None,
        }),
        relays: TaskTracker::new(),
        stop: cut.graceful.clone(),
        session: s,
    });
    let svc_shared = shared.clone();
    // Each request is a span of its own under the connection's (or under
    // the `traceparent` it carries).
    let conn_span = crate::otel::current();
    let service = service_fn(move |req: Request<Incoming>| {
        let shared = svc_shared.clone();
        let cx = crate::otel::request(&conn_span, req.method().as_str(), req.headers());
        crate::otel::within(
            cx,
            async move { Ok::<_, Infallible>(handle(shared, req).await) },
        )
    });
    let limits = &ctx.limits;
    let protocol = if h2 {
        Protocol::Http2 {
            max_header_list_size: limits.max_request_head_bytes as u32,
        }
    } else {
        Protocol::Http1 {
            header_read_timeout: limits.header_read_timeout.get(),
            max_buf_size: limits.max_request_head_bytes.max(8192),
            max_headers: limits.max_headers,
        }
    };
    let drain = Drain {
        shutdown: &cut.graceful,
        hard_stop: &cut.hard,
    };
    let session = &shared.session;
    let serving = async {
        let served = layer::serve(tls, service, protocol, drain).await;
        // An upgraded HTTP/1.1 connection ends its serving at the upgrade:
        // its relay (bounded by the idle timeout and the cut) is still
        // held to every reloaded policy, and counted.
        shared.relays.close();
        shared.relays.wait().await;
        served
    };
    if let Err(e) = revoke::held(&ctx, &session.conn, &session.id, &cut, serving).await {
        debug!(error = %e, "intercepted connection ended with error");
    }
    let totals = (
        shared.up.load(Ordering::Relaxed),
        shared.down.load(Ordering::Relaxed),
    );
    shared.session.close(totals, started, None);
}

/// How a revoked intercepted connection ends: gracefully at once (no new
/// request; HTTP/2: GOAWAY), cut once the grace is over.
struct Graceful {
    graceful: CancellationToken,
    hard: CancellationToken,
}

impl Cut for Graceful {
    async fn cut(&self, grace: std::time::Duration) {
        self.graceful.cancel();
        tokio::time::sleep(grace).await;
        self.hard.cancel();
    }
}

struct Shared {
    session: Session,
    upstream: tokio::sync::Mutex<Upstream>,
    /// The WebSocket relays of the connection: its close record waits
    /// for them.
    relays: TaskTracker,
    /// Ends the relays: the connection's graceful cut (drain, revocation).
    stop: CancellationToken,
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

/// Why the upstream could not take a request.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("{0}")]
    Dial(#[from] DialError),
    /// TLS handshake or certificate verification failed.
    #[error("{0}")]
    Tls(String),
    /// The HTTP handshake failed.
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("upstream connection closed")]
    Closed,
}

/// After an allow: an upstream that cannot be dialled is unreachable;
/// any other failure leaves the request without a response.
impl From<UpstreamError> for Unserved {
    fn from(e: UpstreamError) -> Unserved {
        match e {
            UpstreamError::Dial(e) => Unserved::Unreachable(e),
            UpstreamError::Http(e) => Unserved::NoResponse(NoResponse::Failed(e)),
            UpstreamError::Tls(_) | UpstreamError::Closed => {
                Unserved::NoResponse(NoResponse::NotSent(e.to_string()))
            }
        }
    }
}

impl Shared {
    /// An open connection to the upstream (TCP, verified TLS, HTTP
    /// handshake), set up now if there is none. Returns whether it speaks
    /// HTTP/2.
    async fn ready(&self) -> Result<bool, UpstreamError> {
        let mut up = self.upstream.lock().await;
        if up.sender.as_ref().is_none_or(Sender::is_closed) {
            let fresh = up.fresh.take();
            up.sender = Some(self.connect(fresh).await?);
        }
        Ok(up.sender.as_ref().is_some_and(Sender::is_h2))
    }

    /// Send one request upstream, connecting again first if the
    /// connection closed meanwhile. HTTP/1.1 upstream connections carry one
    /// request at a time; HTTP/2 ones multiplex.
    async fn send(
        &self,
        req: Request<Body>,
        watch: &mut InOrder,
    ) -> Result<ResponseFuture, UpstreamError> {
        let mut up = self.upstream.lock().await;
        let mut req = req;
        for _ in 0..2 {
            let sender = match up.sender.as_mut() {
                Some(s) if !s.is_closed() => s,
                _ => {
                    let fresh = up.fresh.take();
                    up.sender.insert(self.connect(fresh).await?)
                }
            };
            match sender.send(req).await {
                Ok(fut) => {
                    watch.follow(sender);
                    return Ok(fut);
                }
                Err(back) => {
                    up.sender = None;
                    req = back;
                }
            }
        }
        Err(UpstreamError::Closed)
    }

    async fn connect(&self, fresh: Option<TcpStream>) -> Result<Sender, UpstreamError> {
        let tls = self.tls(fresh, false).await?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        Ok(Sender::handshake(tls, h2, &self.session.ctx.tasks).await?)
    }

    /// TCP (`fresh`, else dialled to the checked address) and verified
    /// TLS to the upstream; with `h1_only`, ALPN offers `http/1.1` alone
    /// (a WebSocket handshake's own connection).
    async fn tls(
        &self,
        fresh: Option<TcpStream>,
        h1_only: bool,
    ) -> Result<tokio_rustls::client::TlsStream<TcpStream>, UpstreamError> {
        let s = &self.session;
        let tcp = match fresh {
            Some(t) => t,
            None => {
                let addr = s.upstream;
                dial_checked(&s.ctx, &[addr.ip()], addr.port()).await?.0
            }
        };
        let server_name = ServerName::try_from(s.name.clone())
            .map_err(|e| UpstreamError::Tls(format!("invalid server name: {e}")))?;
        let ic = &s.how.interceptor;
        let config = if h1_only {
            let mut c = (*ic.upstream).clone();
            c.alpn_protocols = vec![b"http/1.1".to_vec()];
            Arc::new(c)
        } else {
            ic.upstream.clone()
        };
        let connector = tokio_rustls::TlsConnector::from(config);
        let handshake =
            tokio::time::timeout(ic.handshake_timeout, connector.connect(server_name, tcp));
        let tls = match crate::otel::step("upstream_tls", handshake).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => return Err(UpstreamError::Tls(e.to_string())),
            Err(_) => {
                return Err(UpstreamError::Tls(
                    "upstream TLS handshake timed out".into(),
                ))
            }
        };
        Ok(tls)
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
    // An extended CONNECT (HTTP/2 `:protocol`) is an upgrade, decided by
    // [`decide_parts`]; a plain one would open a tunnel inside.
    let extended = req.extensions.get::<hyper::ext::Protocol>().is_some();
    if req.method == Method::CONNECT && !extended {
        return bad("CONNECT inside an intercepted connection is refused");
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
/// ([`check_request`]); an upgrade (a WebSocket handshake where the rule
/// has `websocket = true`, else `upgrade_not_allowed`, and any other
/// protocol always `upgrade_not_allowed`); then
/// [`Policy::decide_request`] (path normalisation, method and path rules,
/// credentials from `credentials`), a WebSocket handshake decided as the
/// `GET` it is in HTTP/1.1 (an HTTP/2 extended CONNECT too). Pure, for
/// HTTP/1.1 and HTTP/2 alike.
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
    let upgrade = upgrade_of(parts);
    let refuse_upgrade = |detail: String| RequestDecision {
        verdict: Verdict {
            org: Some(org.clone()),
            reason: Reason::UpgradeNotAllowed,
            rule: Some(Arc::from(rule)),
            would_deny: None,
        },
        detail: Some(detail),
        path: None,
        credentials: Vec::new(),
    };
    let method = match &upgrade {
        Upgrade::None => parts.method.as_str(),
        Upgrade::Other(p) => {
            return refuse_upgrade(format!(
            "upgrade to {p:?} refused: only WebSocket is relayed, on a rule with websocket = true"
        ))
        }
        Upgrade::WebSocket => {
            let allowed = policy
                .intercept_rules(org, rule)
                .is_some_and(|r| r.websocket);
            if !allowed {
                return refuse_upgrade(format!(
                    "WebSocket refused: rule {rule} does not have websocket = true"
                ));
            }
            "GET"
        }
    };
    let req = RequestFacts {
        host: name,
        method,
        path: parts.uri.path(),
    };
    policy.decide_request(org, rule, req, credentials)
}

/// [`decide_parts`] inside a connection that a grant naming a method or
/// path let through: what the request addresses ([`check_request`]), no
/// upgrade (a grant relays no WebSocket), its path normalised, then the
/// grants ([`decide_granted_request`]: a request no grant covers is a
/// miss, and may ask). No credential is added: an org's credentials go
/// only where its allow rules say. With what the decider said, if asked.
async fn decide_granted(
    s: &Session,
    (view, how): (&View, &Intercepting),
    parts: &http::request::Parts,
) -> (RequestDecision, Option<crate::decider::Said>) {
    let refusal = |reason, detail: String| RequestDecision {
        verdict: Verdict::denied_for(&how.org, reason),
        detail: Some(detail),
        path: None,
        credentials: Vec::new(),
    };
    if let Err((reason, detail)) = check_request(parts, &s.conn.host, s.conn.port) {
        return (refusal(reason, detail), None);
    }
    if upgrade_of(parts) != Upgrade::None {
        let detail = "a grant allows requests, never an upgrade".to_string();
        return (refusal(Reason::UpgradeNotAllowed, detail), None);
    }
    let path = match NormalPath::parse(parts.uri.path()) {
        Ok(p) => p,
        Err(e) => return (refusal(Reason::PathNotAllowed, e.to_string()), None),
    };
    let mut asker = s.ctx.asker(s.conn.client.ip(), s.conn.mode);
    asker.request = Some(crate::jit::Request {
        method: parts.method.as_str(),
        path: &path,
    });
    let target = (&s.conn.host, s.conn.port);
    let (verdict, detail, said) =
        decide_granted_request(&view.policy, asker, &how.org, target).await;
    let path = verdict.is_allow().then_some(path);
    let decision = RequestDecision {
        verdict,
        detail,
        path,
        credentials: Vec::new(),
    };
    (decision, said)
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
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

/// One request inside, step by step: decided ([`decide`]), read as far
/// as the rule's service rules need ([`service_check`]), admitted
/// (evidence, the org's evidence and volume budgets), its credentials
/// added ([`add_credentials`]); then relayed as a WebSocket handshake
/// ([`websocket_handshake`]) or sent ([`send`]).
async fn decide_and_send(
    shared: &Arc<Shared>,
    mut parts: http::request::Parts,
    body: &mut Option<Incoming>,
) -> Response<Body> {
    let started = Instant::now();
    let s = &shared.session;
    let (mut req, allowed) = match decide(shared, &parts).await {
        Ok(d) => d,
        Err(refusal) => return refusal,
    };
    let read_ahead = match service_check(shared, &allowed, &parts, body, &mut req).await {
        Ok(head) => head,
        Err(refusal) => return refusal,
    };
    // Evidence writable, the org's evidence budget paid, its volume
    // budgets not spent: else refused.
    if !admission::admit(&s.ctx, &mut req) {
        let detail = req.detail.take();
        return refused_as(shared, req, detail.as_deref()).await;
    }

    // Build the upstream request.
    let upgrade = upgrade_of(&parts);
    strip_hop_by_hop(&mut parts.headers);
    if let Err(why) = add_credentials(&mut parts.headers, &allowed.credentials, &mut req) {
        req.deny(Reason::BadRequest, None);
        return refused(shared, req, why).await;
    }
    // The path the rules matched, never the raw one; the query as received.
    let path_and_query = match parts.uri.query() {
        Some(q) => format!("{}?{q}", allowed.path.as_str()),
        None => allowed.path.as_str().to_string(),
    };
    let authority = if s.conn.port == 443 {
        s.name.clone()
    } else {
        format!("{}:{}", s.name, s.conn.port)
    };
    let target = (path_and_query.as_str(), authority.as_str());

    if upgrade == Upgrade::WebSocket {
        // Its body (none, or the HTTP/2 stream) goes with the upgrade.
        body.take();
        if let Some(asked) = req.asked.as_mut() {
            asked.websocket = true;
        }
        return websocket_handshake(shared, parts, req, target, started).await;
    }
    let Some(client_body) = body.take() else {
        req.deny(Reason::BadRequest, None);
        return refused(shared, req, "request body gone").await;
    };
    let client_body = Prefixed::new(read_ahead, client_body);
    send(shared, (parts, client_body), req, target, started).await
}

/// A request the policy allowed: under which state and rule, its path as
/// normalised (what the rules matched and what is forwarded), and the
/// credentials to add, in order.
struct Allowed {
    view: View,
    how: Intercepting,
    path: NormalPath,
    credentials: Vec<Arc<Credential>>,
}

/// Decide the request under the policy served now: the request as it
/// will be recorded, and what was allowed; or the answer to a refusal
/// (recorded).
async fn decide(
    shared: &Arc<Shared>,
    parts: &http::request::Parts,
) -> Result<(Conn, Allowed), Response<Body>> {
    let s = &shared.session;
    let raw_path = parts.uri.path().to_string();
    let (view, how) = match s.current() {
        Ok(current) => current,
        Err(detail) => {
            let mut req = s.request((&s.conn.view, &s.how), &parts.method, &raw_path);
            req.refuse(Reason::PolicyRevoked, None);
            return Err(refused(shared, req, &detail).await);
        }
    };
    let mut req = s.request((&view, &how), &parts.method, &raw_path);
    let creds = how.interceptor.credentials(&how.org.name);
    let decision = if s.conn.grant_requests {
        let (decision, said) = decide_granted(s, (&view, &how), parts).await;
        req.decider = said.map(Box::new);
        decision
    } else {
        decide_parts(
            &view.policy,
            &how.org,
            &how.rule,
            (&s.name, s.conn.port),
            parts,
            creds.iter().map(|c| &c.config),
        )
    };
    // The verdict on record is the request's own (a refusal by the rule's
    // method or path rules names the rule; any other refusal none).
    req.verdict = decision.verdict.clone();
    if let Some(p) = decision.path.as_ref().filter(|p| p.as_str() != raw_path) {
        // Recorded as decided and forwarded; what the client sent in detail.
        req.path = Some(recorded_path(p.as_str()));
        req.detail = Some(format!("path normalised from {}", recorded_path(&raw_path)));
    }
    let (true, Some(path)) = (decision.is_allow(), decision.path) else {
        let detail = decision.detail.as_deref().unwrap_or("refused");
        return Err(refused(shared, req, detail).await);
    };
    let credentials = decision
        .credentials
        .iter()
        .filter_map(|&i| creds.get(i).cloned())
        .collect();
    let allowed = Allowed {
        view,
        how,
        path,
        credentials,
    };
    Ok((req, allowed))
}

/// Service rules: what the request is to its protocol, its body read as
/// far as that needs, before any credential or byte goes upstream. The
/// bytes read ahead (sent before the rest of the body), or the answer to
/// a refusal (recorded).
async fn service_check(
    shared: &Arc<Shared>,
    allowed: &Allowed,
    parts: &http::request::Parts,
    body: &mut Option<Incoming>,
    req: &mut Conn,
) -> Result<bytes::Bytes, Response<Body>> {
    let s = &shared.session;
    let rules = allowed
        .view
        .policy
        .intercept_rules(&allowed.how.org, &allowed.how.rule);
    let Some(service) = rules.as_deref().and_then(|r| r.service.as_ref()) else {
        return Ok(bytes::Bytes::new());
    };
    let timeout = s.ctx.limits.response_timeout.get();
    match super::service::decide(service, parts, &allowed.path, body.as_mut(), timeout).await {
        Outcome::Pass(facts, head) => {
            req.service = facts.map(Box::new);
            Ok(head)
        }
        Outcome::Refuse(why, facts) => {
            req.service = facts.map(Box::new);
            req.verdict.reason = Reason::ServiceDenied;
            Err(refused(shared, req.clone(), &why).await)
        }
    }
}

/// Put `credentials` in `headers` (whatever the client sent under their
/// names goes, every copy), named on the request's record; why not, if
/// one cannot be used.
fn add_credentials(
    headers: &mut http::HeaderMap,
    credentials: &[Arc<Credential>],
    req: &mut Conn,
) -> Result<(), &'static str> {
    let mut used = Vec::new();
    for c in credentials {
        let Ok(name) = HeaderName::from_bytes(c.config.header.as_bytes()) else {
            continue;
        };
        headers.remove(&name);
        match c.value() {
            Some(v) => {
                headers.insert(name, v);
                used.push(c.config.id.clone());
            }
            None => return Err("credential unusable"),
        }
    }
    if !used.is_empty() {
        req.credential = Some(used.join(","));
    }
    Ok(())
}

/// Send an allowed request (credentials added) to `target` (path and
/// query, authority) over the connection's upstream: evidence before any
/// byte of it reaches the upstream (the upstream connection and its TLS
/// are set up after the connection's own `tcp` record, already written);
/// its bodies spend from its volume budgets as they relay, cut at the
/// budget; the response relayed, its close record written at its end.
async fn send(
    shared: &Arc<Shared>,
    (mut parts, client_body): (http::request::Parts, Prefixed),
    mut req: Conn,
    target: (&str, &str),
    started: Instant,
) -> Response<Body> {
    let s = &shared.session;
    let up_count = Arc::new(AtomicU64::new(0));
    // An HTTP/1.1 upstream connection carries the next request only if
    // this one kept to order ([`InOrder`]).
    let (mut watch, body_sent) = InOrder::new(client_body.is_end_stream());
    // Cut at a budget (or answered early), the rest of the client's body
    // is read on by a task of its own, so that the 429 it is sent is not
    // lost to a reset.
    let body = Metered::new(Drained::new(client_body), up_count.clone()).on_complete(body_sent);
    let h2_upstream = match shared.ready().await {
        Ok(h2) => h2,
        Err(UpstreamError::Tls(detail)) => {
            s.ctx
                .metrics
                .upstream_tls_errors_total
                .with_label_values(&[&*s.how.org.name])
                .inc();
            // The rule allowed; the upstream failed verification.
            req.verdict.reason = Reason::UpstreamTlsError;
            return refused(shared, req, &detail).await;
        }
        Err(e) => return unreachable(shared, req, e.into()).await,
    };
    if let Err(e) = upstream_head(&mut parts, target, h2_upstream) {
        req.deny(Reason::BadRequest, None);
        return refused(shared, req, &e.to_string()).await;
    }
    if !h2_upstream {
        // A body: the upstream connection ends with this exchange.
        watch.ask_close(&mut parts.headers);
    }
    let record = match write_allowed(shared, &mut req).await {
        Ok(record) => record,
        Err(refusal) => return refusal,
    };

    // Held to every policy a reload serves, its bodies both ways too,
    // which spend from its volume budgets as they go.
    let hold = revoke::hold(&s.ctx, &req, &record.id);
    let volume = Budgets::new(&req, hold.stop());
    let head = layer::request_head_len(&parts.method, &parts.uri, &parts.headers);
    let head_fits = volume.head(Direction::Up, head);
    let body = volume.stopped(watch.gate(volume.body(body, Direction::Up)));
    let up = up_count.clone();
    let up = Box::new(move || up.load(Ordering::Relaxed));
    let exchange = exchange(shared, (req, record, started), up, (Some(hold), volume));
    if !head_fits {
        return exchange.failed(NoResponse::NotSent("request head over the budget".into()));
    }
    let timeout = s.ctx.limits.response_timeout.get();
    let sent = exchange.unless_revoked(async {
        match shared
            .send(Request::from_parts(parts, body), &mut watch)
            .await
        {
            Ok(fut) => client::response(fut, timeout).await,
            Err(e) => Err(NoResponse::NotSent(e.to_string())),
        }
    });
    let Some(answered) = sent.await else {
        // The watch, dropped, cuts an HTTP/1.1 upstream connection.
        return exchange.revoked();
    };
    match answered {
        Ok(resp) => {
            s.ctx
                .metrics
                .intercepted_request_duration_seconds
                .with_label_values(&[&*s.how.org.name])
                .observe(started.elapsed().as_secs_f64());
            watch.response_began();
            // Read to its end: the connection stays for the next request if
            // the exchange kept to order; otherwise (or cut short) the
            // watch, dropped, cuts it.
            let kept = Box::new(move || {
                watch.reusable();
            });
            exchange.relay(resp, Some(kept))
        }
        Err(e) => exchange.failed(e),
    }
}

/// The request head as the upstream gets it, to `target` (path and
/// query, authority): HTTP/2 (an absolute URI, no Host) or HTTP/1.1
/// (origin form, Host the authority).
fn upstream_head(
    parts: &mut http::request::Parts,
    (path_and_query, authority): (&str, &str),
    h2_upstream: bool,
) -> Result<(), http::Error> {
    parts.uri = if h2_upstream {
        Uri::builder()
            .scheme("https")
            .authority(authority)
            .path_and_query(path_and_query)
            .build()?
    } else {
        Uri::builder().path_and_query(path_and_query).build()?
    };
    if h2_upstream {
        parts.headers.remove(header::HOST);
        parts.version = Version::HTTP_2;
    } else {
        if let Ok(v) = HeaderValue::from_str(authority) {
            parts.headers.insert(header::HOST, v);
        }
        parts.version = Version::HTTP_11;
    }
    Ok(())
}

/// An allowed WebSocket handshake (credentials added to `parts`): record
/// it, send it upstream as an HTTP/1.1 upgrade over a connection of its
/// own, and after the upstream's `101` answer the client (`101`, or `200`
/// to an HTTP/2 extended CONNECT) and relay both upgraded streams
/// ([`websocket::relay`]); any other answer is relayed as a response.
async fn websocket_handshake(
    shared: &Arc<Shared>,
    mut parts: http::request::Parts,
    mut req: Conn,
    (path_and_query, authority): (&str, &str),
    started: Instant,
) -> Response<Body> {
    let s = &shared.session;
    let h2_client = parts.version == Version::HTTP_2;
    let Some(client_upgrade) = parts.extensions.remove::<hyper::upgrade::OnUpgrade>() else {
        req.deny(Reason::BadRequest, None);
        return refused(shared, req, "the handshake cannot be upgraded").await;
    };
    let upstream_req = match websocket::upstream_request(parts, path_and_query, authority) {
        Ok(r) => r,
        Err(e) => {
            req.deny(Reason::BadRequest, None);
            return refused(shared, req, &e).await;
        }
    };
    let how = if h2_client {
        "WebSocket (HTTP/2 extended CONNECT)"
    } else {
        "WebSocket (HTTP/1.1 upgrade)"
    };
    req.detail = Some(match req.detail.take() {
        Some(d) => format!("{how}; {d}"),
        None => how.to_string(),
    });
    let record = match write_allowed(shared, &mut req).await {
        Ok(record) => record,
        Err(refusal) => return refusal,
    };
    // Held with its relay ([`websocket::relay`]), which spends its
    // volume budgets.
    let exchange = exchange(
        shared,
        (req, record, started),
        Box::new(|| 0),
        (None, Budgets::default()),
    );
    let fresh = shared.upstream.lock().await.fresh.take();
    let tls = match shared.tls(fresh, true).await {
        Ok(t) => t,
        Err(e) => return exchange.failed(NoResponse::NotSent(e.to_string())),
    };
    let mut sender = match Sender::handshake_upgrade(tls, &s.ctx.tasks).await {
        Ok(sender) => sender,
        Err(e) => return exchange.failed(NoResponse::Failed(e)),
    };
    let timeout = s.ctx.limits.response_timeout.get();
    let mut resp = match websocket::handshake(&mut sender, upstream_req, timeout).await {
        Ok(r) => r,
        Err(e) => return exchange.failed(e),
    };
    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        return exchange.relay(resp, None);
    }
    let upstream_upgrade = hyper::upgrade::on(&mut resp);
    let answer = websocket::client_response(&resp.into_parts().0, h2_client);
    let status = answer.status().as_u16();
    let idle = s.ctx.limits.idle_timeout.get();
    shared.relays.spawn(websocket::relay(
        exchange,
        (client_upgrade, upstream_upgrade),
        status,
        idle,
        shared.stop.clone(),
    ));
    answer
}

/// A path as evidence keeps it.
fn recorded_path(path: &str) -> String {
    path.chars().take(MAX_RECORDED_PATH).collect()
}

/// The exchange of a request recorded as `record`, its response status
/// on its close record and its bytes added to the connection's totals;
/// `up` reads its bytes up so far, `hold` and `volume` as in
/// [`Exchange`].
fn exchange(
    shared: &Arc<Shared>,
    (req, record, started): (Conn, crate::evidence::Record, Instant),
    up: Box<dyn Fn() -> u64 + Send + Sync>,
    (hold, volume): (Option<revoke::Hold>, Budgets),
) -> Exchange {
    let totals = shared.clone();
    Exchange {
        ctx: shared.session.ctx.clone(),
        req,
        shown: record.shown().to_string(),
        id: record.id,
        started,
        up,
        with_status: true,
        on_close: Some(Box::new(move |up, down| {
            totals.up.fetch_add(up, Ordering::Relaxed);
            totals.down.fetch_add(down, Ordering::Relaxed);
        })),
        hold,
        volume,
    }
}

/// Write an allowed request's decision record, before any byte of it
/// reaches the upstream, and count it; its close record's room, reserved
/// by its allow, goes on `req`. Without evidence, the client's answer:
/// refused `evidence_unavailable`.
async fn write_allowed(
    shared: &Shared,
    req: &mut Conn,
) -> Result<crate::evidence::Record, Response<Body>> {
    let mut record = req.record();
    if !shared.session.ctx.write(&mut record).await {
        count(shared, Reason::EvidenceUnavailable);
        return Err(Unserved::Denied(Reason::EvidenceUnavailable).response(record.shown(), None));
    }
    req.owed = record.owed.take();
    count(shared, Reason::RuleMatch);
    Ok(record)
}

fn count(shared: &Shared, reason: Reason) {
    shared
        .session
        .ctx
        .metrics
        .intercepted_requests_total
        .with_label_values(&[
            &*shared.session.how.org.name,
            reason.decision(),
            reason.as_str(),
        ])
        .inc();
}

/// Record a refused request (its verdict as set) and answer it inside the
/// intercepted connection.
async fn refused(shared: &Shared, req: Conn, detail: &str) -> Response<Body> {
    refused_as(shared, req, Some(detail)).await
}

/// [`refused`] with `detail`, if any, recorded and told.
async fn refused_as(shared: &Shared, mut req: Conn, detail: Option<&str>) -> Response<Body> {
    req.detail = detail.map(str::to_string);
    let mut record = req.record();
    let written = shared.session.ctx.write(&mut record).await;
    let failure = Unserved::Denied(req.verdict.reason).recorded(written);
    count(shared, failure.reason());
    debug!(reason = %failure.reason(), record = %record.id, "intercepted request refused");
    failure.response(record.shown(), detail)
}

/// The upstream could not be reached (or spoke no HTTP) for an allowed
/// request: the allow is recorded with the cause, nothing was sent.
async fn unreachable(shared: &Shared, mut req: Conn, failure: Unserved) -> Response<Body> {
    req.detail = Some(failure.to_string());
    let mut record = req.record();
    let failure = failure.recorded(shared.session.ctx.write(&mut record).await);
    count(shared, failure.reason());
    failure.response(record.shown(), None)
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
