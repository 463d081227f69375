//! The end of one forwarded HTTP request, shared by explicit mode and
//! interception: once its allow is recorded and it is sent, relay the
//! upstream's response (hop-by-hop headers stripped, the body metered) and
//! write the request's close record when the response ends; or, without a
//! complete response head, write the close record with the cause and
//! answer the one failure for it ([`Unserved::NoResponse`]).
//!
//! [`absolute`] takes an explicit-mode absolute-form request from its
//! allow to its response, over an idle upstream connection of the
//! [`super::pool`] when there is one for its key, else a new one: a
//! request without a body over Palisade's own HTTP/1.1 exchange
//! ([`super::http::upstream`]), one with a body through hyper's client.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};
use tokio::net::TcpStream;

use super::conn::Conn;
use super::ctx::Ctx;
use super::dial::dial_checked;
use super::failure::Unserved;
use super::http::body::{Metered, OnComplete, Stopped};
use super::http::client::{Attempt, InOrder, NoResponse, Sender};
use super::http::upstream::{self, Failed, Returned, Upconn};
use super::http::wire::{RequestBytes, UpCount};
use super::http::{strip_hop_by_hop, Body};
use super::pool::Key;
use super::record::volume_record;
use super::record::{dial_failed, write_record, Refused};
use super::revoke::{self, Hold};
use crate::evidence::Record;
use crate::limits::volume::Direction;
use crate::limits::Watch;
use crate::policy::Reason;
use crate::proto::http_upstream::{request_head, Head as ResponseHead};
use crate::proto::target::Host;
use crate::serve::http::BodyError;
use tokio_util::sync::CancellationToken;

/// Called with the request's `(bytes_up, bytes_down)` when it closes.
pub(crate) type OnClose = Box<dyn FnOnce(u64, u64) + Send + Sync>;

/// A recorded, sent request waiting for its response.
pub(crate) struct Exchange {
    pub ctx: Arc<Ctx>,
    /// The request as recorded, under `id`.
    pub req: Conn,
    pub id: String,
    /// The reference its client is shown for it.
    pub shown: String,
    pub started: Instant,
    /// The request's bytes up so far (read at close).
    pub up: Box<dyn Fn() -> u64 + Send + Sync>,
    /// Whether the close record names the response status.
    pub with_status: bool,
    pub on_close: Option<OnClose>,
    /// The request held to every policy a reload serves until its response
    /// ends ([`revoke::hold`]); `None` for one held otherwise (a WebSocket
    /// handshake, held with its relay).
    pub hold: Option<Hold>,
    /// Its volume budgets, spent by both bodies as they relay and cut at
    /// the budget ([`Budgets`]); `None`: none applies, or spent otherwise
    /// (a WebSocket handshake's relay).
    pub volume: Budgets,
}

/// The volume budgets of one exchange as its bodies relay: the watch
/// that charges them ([`Metered::charging`]), `None` when no budget
/// applies; and what its bodies stop on: the hold's revocation, or the
/// watch's cut at a spent budget (an enforcing org's), which stops both
/// directions at once.
#[derive(Default)]
pub(crate) struct Budgets {
    pub watch: Option<Arc<Watch>>,
    pub stop: Option<CancellationToken>,
}

impl Budgets {
    /// `req`'s budgets, its bodies stopped by `stop` (a hold's) too.
    pub(crate) fn new(req: &Conn, stop: &CancellationToken) -> Budgets {
        let cut = stop.child_token();
        let enforce = !req.view.is_report();
        Budgets {
            watch: req
                .volume
                .clone()
                .map(|lease| Arc::new(Watch::new(lease, enforce.then(|| cut.clone())))),
            stop: Some(cut),
        }
    }

    /// A message head of `bytes` going `direction`: whether it fits in
    /// what the budgets have left (then charged; a report-mode org's
    /// always fits, told when it passed). One that does not is never
    /// sent: the exchange is cut and answered 429.
    pub(crate) fn head(&self, direction: Direction, bytes: u64) -> bool {
        self.watch
            .as_ref()
            .is_none_or(|w| w.take(direction, bytes) == bytes)
    }

    /// `body` going `direction`, charged as it goes.
    pub(crate) fn body<B>(&self, body: Metered<B>, direction: Direction) -> Metered<B> {
        match &self.watch {
            Some(w) => body.charging(w.clone(), direction),
            None => body,
        }
    }

    /// `body`, stopped when the exchange is revoked or cut.
    pub(crate) fn stopped<B>(&self, body: B) -> Body
    where
        B: hyper::body::Body<Data = bytes::Bytes> + Send + Sync + Unpin + 'static,
        B::Error: Into<BodyError>,
    {
        match &self.stop {
            Some(stop) => Stopped::new(body, stop.clone()).boxed(),
            None => body.map_err(Into::into).boxed(),
        }
    }

    /// When a body was cut at a spent budget: how long until the
    /// client may try again (the budget's window, by when the budget is
    /// free again); `None` when not cut.
    fn cut_retry_after(&self) -> Option<std::time::Duration> {
        let w = self.watch.as_ref().filter(|w| w.is_cut())?;
        let (scope, _) = w.crossed()?;
        w.lease().volume(&scope).map(|v| v.window)
    }
}

impl Exchange {
    /// Relay `resp`; the close record is written when its body ends, then
    /// `on_complete` runs if the body was read to its end. Its head and
    /// body spend from the exchange's volume budgets; a body cut at one
    /// (either way) ends the response short: the client's connection (or
    /// HTTP/2 stream) is cut.
    pub(crate) fn relay<B>(
        mut self,
        resp: Response<B>,
        on_complete: Option<OnComplete>,
    ) -> Response<Body>
    where
        B: hyper::body::Body<Data = bytes::Bytes> + Send + Sync + Unpin + 'static,
        B::Error: Into<BodyError>,
    {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let status = self.with_status.then_some(parts.status.as_u16());
        if !self.volume.head(Direction::Down, response_head_len(&parts)) {
            // Not a byte of it relayed: the upstream connection goes
            // with `resp`, the client is told 429.
            return self.failed(NoResponse::NotSent("response head over the budget".into()));
        }
        let volume = std::mem::take(&mut self.volume);
        let watch = volume.watch.clone();
        let finish = Box::new(move |down| {
            // The unit ends here: no longer held.
            drop(self.hold.take());
            let up = (self.up)();
            let on_close = self.on_close.take();
            if let Some(f) = on_close {
                f(up, down);
            }
            self.close((up, down), watch.as_deref(), |c| c.status = status);
        });
        let body = volume.body(Metered::on_finish(body, finish), Direction::Down);
        let body = match on_complete {
            Some(f) => body.on_complete(f),
            None => body,
        };
        Response::from_parts(parts, volume.stopped(body))
    }

    /// Write the close record of the exchange, `(up, down)` bytes moved,
    /// `edit`ed; after the `volume_exceeded` record of a budget `watch`
    /// saw spent.
    fn close(&self, moved: (u64, u64), watch: Option<&Watch>, edit: impl FnOnce(&mut Record)) {
        if let Some(mut r) = volume_record(&self.ctx, &self.req, (&self.id, "cut"), watch) {
            self.ctx.submit(&mut r);
        }
        let mut close = self.req.close(&self.id, moved, self.started);
        edit(&mut close);
        self.ctx.submit(&mut close);
    }

    /// Wait for `head` (a response head) unless the request is revoked
    /// first: then `None`.
    pub(crate) async fn unless_revoked<T>(&self, head: impl Future<Output = T>) -> Option<T> {
        match &self.hold {
            Some(h) => tokio::select! {
                // The revocation first: the exchange it cut fails with it.
                biased;
                _ = h.stop().cancelled() => None,
                t = head => Some(t),
            },
            None => Some(head.await),
        }
    }

    /// Revoked before its response came: its close record says so, and the
    /// client is refused `policy_revoked` (the revocation is on record).
    pub(crate) fn revoked(self) -> Response<Body> {
        let watch = self.volume.watch.as_deref();
        self.close(((self.up)(), 0), watch, |c| {
            c.detail = Some("revoked before the response".into());
        });
        Unserved::Denied(Reason::PolicyRevoked).response(&self.shown, None)
    }

    /// No complete response came: close the request with the cause (no
    /// `on_close`: nothing came back). A request whose body was cut at a
    /// spent volume budget is answered 429 (`volume_exceeded`, with when
    /// to retry), its `volume_exceeded` record written before the close.
    pub(crate) fn failed(self, e: NoResponse) -> Response<Body> {
        let watch = self.volume.watch.as_deref();
        let retry = self.volume.cut_retry_after();
        let detail = match retry {
            Some(_) => "cut at its volume budget".to_string(),
            None => e.to_string(),
        };
        self.close(((self.up)(), 0), watch, |c| c.detail = Some(detail));
        match retry {
            Some(after) => Unserved::OverVolume(Some(after)).response(&self.shown, None),
            None => Unserved::NoResponse(e).response(&self.shown, None),
        }
    }
}

/// A response head's bytes as sent (give or take whitespace): the status
/// line and the headers.
fn response_head_len(parts: &http::response::Parts) -> u64 {
    super::http::headers_len(&parts.headers) + 15
}

/// The upstream connection an allowed request goes over.
enum Upstream {
    /// Idle in the pool, kept for this request's key.
    Pooled(Upconn),
    /// Just dialled.
    Dialled(TcpStream),
}

/// Forward an allowed absolute-form request (explicit mode): take an idle
/// pooled connection to one of `addrs` (each checked by its decision) or
/// dial them in order; record the decision with the address reached
/// (`conn.ip`) before a byte is sent; send the request in origin form;
/// relay the response, its close record written at its end.
///
/// A request without a body goes over Palisade's own HTTP/1.1 exchange
/// ([`bodiless`]), whose connection goes back to the pool after an
/// exchange in order. One with a body goes through hyper's client
/// ([`with_body`]) and asks the upstream to close after it
/// (`Connection: close`): it is never reused.
///
/// A pooled connection the upstream closed just as the request came is
/// not the client's problem: a request not a byte of which was written
/// goes again over a new connection to the same address, and so does one
/// that was written if it is idempotent and has no body ([`retry_fresh`]).
/// The request keeps its one decision record: the address is the same.
pub(crate) async fn absolute(
    ctx: Arc<Ctx>,
    mut conn: Conn,
    addrs: &[IpAddr],
    req: Request<Incoming>,
    (bytes, head_estimate): (Option<Arc<RequestBytes>>, u64),
    started: Instant,
) -> Response<Body> {
    let (host, port) = (conn.host.clone(), conn.port);
    let org = conn.view.org.as_ref().map(|o| o.name.clone());
    let (upstream, addr) = match upstream_for(&ctx, &mut conn, addrs).await {
        Ok(upstream) => upstream,
        Err(refused) => return refused.response(),
    };
    conn.ip = Some(addr.ip());
    let written = match write_record(&ctx, &mut conn).await {
        Ok(w) => w,
        Err(w) => return Unserved::Denied(Reason::EvidenceUnavailable).response(&w.shown, None),
    };

    let up_count = Arc::new(AtomicU64::new(0));
    let up = match bytes {
        Some(bytes) => UpCount::Wire(bytes),
        // Only if the meter lost track (it stops where hyper refuses).
        None => UpCount::Estimate {
            head: head_estimate,
            body: up_count.clone(),
        },
    };
    // Held to every policy a reload serves, its bodies both ways too,
    // which spend from its volume budgets as they go.
    let hold = revoke::hold(&ctx, &conn, &written.id);
    let volume = Budgets::new(&conn, hold.stop());
    let head_fits = volume.head(Direction::Up, head_estimate);
    let exchange = Exchange {
        ctx: ctx.clone(),
        req: conn,
        id: written.id,
        shown: written.shown,
        started,
        up: Box::new(move || up.get()),
        with_status: false,
        on_close: None,
        hold: Some(hold),
        volume,
    };

    if !head_fits {
        return exchange.failed(NoResponse::NotSent("request head over the budget".into()));
    }
    let (parts, body) = match origin_form(req, &host, port) {
        Ok(p) => p,
        Err(e) => return exchange.failed(NoResponse::NotSent(e)),
    };
    if body.is_end_stream() {
        let key = org.map(|org| Key {
            org,
            host,
            port,
            addr,
        });
        return bodiless(exchange, &parts, (upstream, addr), key).await;
    }
    // Boxed: its state (hyper's client handshake and exchange) is the
    // largest of this future's, and a bodiless request would otherwise
    // carry room for it, copied whole into the request's box.
    Box::pin(with_body(
        exchange,
        (parts, body, up_count),
        (upstream, addr),
    ))
    .await
}

/// A request without a body over Palisade's own HTTP/1.1 exchange
/// ([`upstream`]): its head written, the response
/// head read within the response timeout, the body relayed by its
/// framing. The connection goes back to the pool under `key` once the
/// body was relayed to its end in order (none for a request of no org).
async fn bodiless(
    exchange: Exchange,
    parts: &http::request::Parts,
    (upstream, addr): (Upstream, SocketAddr),
    key: Option<Key>,
) -> Response<Body> {
    let ctx = exchange.ctx.clone();
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let head = request_head(&parts.method, target, &parts.headers);
    let to_head = parts.method == Method::HEAD;
    let timeout = ctx.limits.response_timeout.get();
    let (reused, conn) = match upstream {
        Upstream::Pooled(c) => (true, c),
        Upstream::Dialled(s) => (false, Upconn::new(s)),
    };
    let replay = replayable(&parts.method, true);
    let attempt = async {
        match conn.exchange(&head, to_head, timeout).await {
            // A retry's dial is boxed: rare, and the largest state here.
            Err(Failed::Unsent) if reused => Box::pin(fresh(&ctx, addr, &head, to_head)).await,
            Err(Failed::Lost(_)) if retry_fresh(reused, replay, true) => {
                Box::pin(fresh(&ctx, addr, &head, to_head)).await
            }
            other => other,
        }
    };
    let Some(result) = exchange.unless_revoked(attempt).await else {
        // Its connection went with the attempt.
        return exchange.revoked();
    };
    match result {
        Ok((resp, conn)) => {
            let returned = Returned::default();
            let resp = upstream::response(resp, conn, returned.clone());
            let give_back = key.map(|key| {
                Box::new(move || {
                    let conn = returned.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(conn) = conn {
                        ctx.upstream_pool.give_back(key, conn);
                    }
                }) as OnComplete
            });
            exchange.relay(resp, give_back)
        }
        Err(e) => exchange.failed(e.into()),
    }
}

/// Send `head` again over a new connection to the address the request
/// was decided and recorded for (no other: the record names it).
async fn fresh(
    ctx: &Ctx,
    addr: SocketAddr,
    head: &[u8],
    to_head: bool,
) -> Result<(ResponseHead, Upconn), Failed> {
    let (stream, _) = dial_checked(ctx, &[addr.ip()], addr.port())
        .await
        .map_err(|e| Failed::Lost(format!("reconnecting: {e}")))?;
    Upconn::new(stream)
        .exchange(head, to_head, ctx.limits.response_timeout.get())
        .await
}

/// A request with a body, through hyper's client: it asks the upstream
/// to close after it, its body is handed over until an early answer, and
/// its connection is cut when the response ends ([`InOrder`]).
async fn with_body(
    exchange: Exchange,
    (mut parts, body, up_count): (http::request::Parts, Incoming, Arc<AtomicU64>),
    (upstream, addr): (Upstream, SocketAddr),
) -> Response<Body> {
    let ctx = exchange.ctx.clone();
    let reused = matches!(upstream, Upstream::Pooled(_));
    let stream = match upstream {
        Upstream::Pooled(c) => c.into_stream(),
        Upstream::Dialled(s) => s,
    };
    let mut sender = match Sender::handshake(stream, false, &ctx.tasks).await {
        Ok(s) => s,
        Err(e) => return exchange.failed(NoResponse::Failed(e)),
    };
    let (mut in_order, body_sent) = InOrder::new(false);
    in_order.ask_close(&mut parts.headers);
    let body = Metered::new(body, up_count).on_complete(body_sent);
    let body = in_order.gate(exchange.volume.body(body, Direction::Up));
    let req = Request::from_parts(parts, exchange.volume.stopped(body));
    let timeout = ctx.limits.response_timeout.get();
    let attempt = async {
        match sender.exchange(req, timeout).await {
            // Not a byte of it written: it may go over a new connection.
            Err(Attempt::Unsent(req)) if reused => resend(&ctx, addr, &mut sender, *req).await,
            other => other,
        }
    };
    let result = exchange.unless_revoked(attempt).await;
    // The connection the request went over (a resend's new one).
    in_order.follow(&sender);
    let Some(result) = result else {
        return exchange.revoked();
    };
    match result {
        Ok(resp) => {
            in_order.response_began();
            // Held until the response ends, then cut: never reused.
            let cut = Box::new(move || drop(in_order)) as OnComplete;
            exchange.relay(resp, Some(cut))
        }
        Err(Attempt::Unsent(_)) => {
            exchange.failed(NoResponse::NotSent("upstream connection closed".into()))
        }
        Err(Attempt::Failed(e)) => exchange.failed(e),
    }
}

/// An upstream connection for `conn`: an idle one of the pool (only an
/// org's allowed request is pooled, never one of no org), else one dialled
/// to the checked `addrs`; a failure to dial is recorded.
async fn upstream_for(
    ctx: &Ctx,
    conn: &mut Conn,
    addrs: &[IpAddr],
) -> Result<(Upstream, SocketAddr), Refused> {
    let org = conn.view.org.as_ref().map(|o| &o.name);
    let pooled = org.and_then(|org| {
        ctx.upstream_pool
            .checkout(org, &conn.host, conn.port, addrs)
    });
    match pooled {
        Some((c, addr)) => Ok((Upstream::Pooled(c), addr)),
        None => match dial_checked(ctx, addrs, conn.port).await {
            Ok((stream, addr)) => Ok((Upstream::Dialled(stream), addr)),
            Err(e) => Err(dial_failed(ctx, conn, e).await),
        },
    }
}

/// Send `req` again over a new connection to the address the request was
/// decided and recorded for (no other: the record names it); `sender`
/// becomes that connection.
async fn resend(
    ctx: &Ctx,
    addr: SocketAddr,
    sender: &mut Sender,
    req: Request<Body>,
) -> Result<Response<Incoming>, Attempt> {
    let (stream, _) = dial_checked(ctx, &[addr.ip()], addr.port())
        .await
        .map_err(|e| Attempt::Failed(NoResponse::NotSent(format!("reconnecting: {e}"))))?;
    *sender = Sender::handshake(stream, false, &ctx.tasks)
        .await
        .map_err(|e| Attempt::Failed(NoResponse::Failed(e)))?;
    sender
        .exchange(req, ctx.limits.response_timeout.get())
        .await
}

/// The request in origin form for the upstream, hop-by-hop headers gone,
/// a Host header added when it had none.
fn origin_form(
    req: Request<Incoming>,
    host: &Host,
    port: u16,
) -> Result<(http::request::Parts, Incoming), String> {
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = Uri::builder()
        .path_and_query(path)
        .build()
        .map_err(|e| e.to_string())?;
    strip_hop_by_hop(&mut parts.headers);
    if !parts.headers.contains_key(header::HOST) {
        if let Ok(v) = HeaderValue::from_str(&host_header(host, port)) {
            parts.headers.insert(header::HOST, v);
        }
    }
    Ok((parts, body))
}

/// `host[:port]` as a Host header names it (the port only when not 80).
fn host_header(host: &Host, port: u16) -> String {
    match (host, port) {
        (Host::Ip(IpAddr::V6(v6)), 80) => format!("[{v6}]"),
        (Host::Ip(IpAddr::V6(v6)), p) => format!("[{v6}]:{p}"),
        (h, 80) => h.to_string(),
        (h, p) => format!("{h}:{p}"),
    }
}

/// Whether a request may be sent again after a connection failed under
/// it: idempotent (RFC 9110 §9.2.2) and without a body to replay.
fn replayable(method: &Method, body_empty: bool) -> bool {
    body_empty
        && matches!(
            *method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::TRACE
                | Method::PUT
                | Method::DELETE
        )
}

/// Whether a request that failed on its connection goes again over a new
/// one: only off a reused connection (a new one failing is the upstream's
/// answer), only when the connection was lost before a response came, and
/// only a request that may be replayed (RFC 9112 §9.3.1). A request not a
/// byte of which was written always may ([`Attempt::Unsent`]).
fn retry_fresh(reused: bool, replayable: bool, connection_lost: bool) -> bool {
    reused && replayable && connection_lost
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bodiless_idempotent_requests_replay() {
        for m in [
            Method::GET,
            Method::HEAD,
            Method::PUT,
            Method::DELETE,
            Method::OPTIONS,
        ] {
            assert!(replayable(&m, true), "{m}");
            assert!(!replayable(&m, false), "{m} with a body");
        }
        for m in [Method::POST, Method::PATCH, Method::CONNECT] {
            assert!(!replayable(&m, true), "{m}");
        }
    }

    #[test]
    fn only_a_reused_connection_lost_under_a_replayable_request_retries() {
        assert!(retry_fresh(true, true, true));
        assert!(
            !retry_fresh(false, true, true),
            "a new connection's failure stands"
        );
        assert!(!retry_fresh(true, false, true), "not replayable");
        assert!(
            !retry_fresh(true, true, false),
            "a timeout or bad response stands"
        );
    }

    #[test]
    fn host_header_names_the_port_unless_80() {
        let name = Host::Name("a.test".into());
        assert_eq!(host_header(&name, 80), "a.test");
        assert_eq!(host_header(&name, 8080), "a.test:8080");
        let v6 = Host::Ip("2001:db8::1".parse().unwrap());
        assert_eq!(host_header(&v6, 80), "[2001:db8::1]");
        assert_eq!(host_header(&v6, 81), "[2001:db8::1]:81");
    }
}
