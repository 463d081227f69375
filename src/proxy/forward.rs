//! The end of one forwarded HTTP request, shared by explicit mode and
//! interception: once its allow is recorded and it is sent, relay the
//! upstream's response (hop-by-hop headers stripped, the body metered) and
//! write the request's close record when the response ends; or, without a
//! complete response head, write the close record with the cause and
//! answer the one failure for it ([`Unserved::NoResponse`]).
//!
//! [`absolute`] takes an explicit-mode absolute-form request from its
//! allow to its response, over an idle upstream connection of the
//! [`super::pool`] when there is one for its key, else a new one.

use std::future::Future;
use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};
use tokio::net::TcpStream;

use super::conn::Conn;
use super::ctx::Ctx;
use super::dial::dial_checked;
use super::failure::Unserved;
use super::http::body::{Metered, OnComplete, Stopped};
use super::http::client::{Attempt, InOrder, NoResponse, Sender};
use super::http::wire::{RequestBytes, UpCount};
use super::http::{full, strip_hop_by_hop, Body};
use super::pool::{self, Key};
use super::record::{dial_failed, write_record};
use super::revoke::{self, Hold};
use crate::policy::Reason;
use crate::proto::target::Host;
use crate::serve::http::BodyError;

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
}

impl Exchange {
    /// Relay `resp`; the close record is written when its body ends, then
    /// `on_complete` runs if the body was read to its end.
    pub(crate) fn relay(
        self,
        resp: Response<Incoming>,
        on_complete: Option<OnComplete>,
    ) -> Response<Body> {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let status = self.with_status.then_some(parts.status.as_u16());
        let stop = self.hold.as_ref().map(|h| h.stop().clone());
        let finish = Box::new(move |down| {
            // The unit ends here: no longer held.
            drop(self.hold);
            let up = (self.up)();
            if let Some(f) = self.on_close {
                f(up, down);
            }
            let mut close = self.req.close(&self.id, (up, down), self.started);
            close.status = status;
            self.ctx.submit(&mut close);
        });
        let body = Metered::on_finish(body, finish);
        let body = match on_complete {
            Some(f) => body.on_complete(f),
            None => body,
        };
        let body = match stop {
            Some(stop) => Stopped::new(body, stop).boxed(),
            None => body.map_err(BodyError::from).boxed(),
        };
        Response::from_parts(parts, body)
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
        let mut close = self.req.close(&self.id, ((self.up)(), 0), self.started);
        close.detail = Some("revoked before the response".into());
        self.ctx.submit(&mut close);
        Unserved::Denied(Reason::PolicyRevoked).response(&self.shown, None)
    }

    /// No complete response came: close the request with the cause (no
    /// `on_close`: nothing came back).
    pub(crate) fn failed(self, e: NoResponse) -> Response<Body> {
        let mut close = self.req.close(&self.id, ((self.up)(), 0), self.started);
        close.detail = Some(e.to_string());
        self.ctx.submit(&mut close);
        Unserved::NoResponse(e).response(&self.shown, None)
    }
}

/// The upstream connection an allowed request goes over.
enum Upstream {
    /// Idle in the pool, kept for this request's key.
    Pooled(Sender),
    /// Just dialled.
    Dialled(TcpStream),
}

/// Forward an allowed absolute-form request (explicit mode): take an idle
/// pooled connection to one of `addrs` (each checked by its decision) or
/// dial them in order; record the decision with the address reached
/// (`conn.ip`) before a byte is sent; send the request in origin form;
/// relay the response, its close record written at its end. A connection
/// whose response was read to its end goes back to the pool, unless the
/// request had a body: that one asks the upstream to close after it
/// (`Connection: close`) and is never reused.
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
    // Only an org's allowed request is pooled (never one of no org).
    let org = conn.view.org.as_ref().map(|o| o.name.clone());
    let pooled = org
        .as_ref()
        .and_then(|org| ctx.upstream_pool.checkout(org, &host, port, addrs));
    let (upstream, addr) = match pooled {
        Some((sender, addr)) => (Upstream::Pooled(sender), addr),
        None => match dial_checked(&ctx, addrs, port).await {
            Ok((stream, addr)) => (Upstream::Dialled(stream), addr),
            Err(e) => return dial_failed(&ctx, &mut conn, e).await.response(),
        },
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
    // Held to every policy a reload serves, its bodies both ways too.
    let hold = revoke::hold(&ctx, &conn, &written.id);
    let stop = hold.stop().clone();
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
    };

    let (mut parts, body) = match origin_form(req, &host, port) {
        Ok(p) => p,
        Err(e) => return exchange.failed(NoResponse::NotSent(e)),
    };
    let reused = matches!(upstream, Upstream::Pooled(_));
    // What a retry needs to send the request again, kept only when one
    // could be (a reused connection, an idempotent request without a body).
    let again = (reused && replayable(&parts.method, body.is_end_stream())).then(|| Resend {
        method: parts.method.clone(),
        uri: parts.uri.clone(),
        version: parts.version,
        headers: parts.headers.clone(),
    });
    let mut sender = match upstream {
        Upstream::Pooled(sender) => sender,
        Upstream::Dialled(stream) => match Sender::handshake(stream, false, &ctx.tasks).await {
            Ok(s) => s,
            Err(e) => return exchange.failed(NoResponse::Failed(e)),
        },
    };
    // Whether the connection may go back to the pool after this exchange
    // (no request body, the response read to its end); a resend below
    // carries no body, so its connection is in order from the start. A
    // request with a body asks the upstream to close after it.
    let (mut in_order, body_sent) = InOrder::new(body.is_end_stream());
    in_order.ask_close(&mut parts.headers);
    let body = in_order.gate(Metered::new(body, up_count).on_complete(body_sent));
    let req = Request::from_parts(parts, Stopped::new(body, stop).boxed());
    let timeout = ctx.limits.response_timeout.get();
    let attempt = async {
        match sender.exchange(req, timeout).await {
            Err(Attempt::Unsent(req)) if reused => resend(&ctx, addr, &mut sender, *req).await,
            Err(Attempt::Failed(e))
                if retry_fresh(reused, again.is_some(), e.is_connection_lost()) =>
            {
                match again {
                    Some(again) => resend(&ctx, addr, &mut sender, again.request()).await,
                    None => Err(Attempt::Failed(e)),
                }
            }
            other => other,
        }
    };
    let result = exchange.unless_revoked(attempt).await;
    // The connection the request went over (a resend's new one).
    in_order.follow(&sender);
    let Some(result) = result else {
        // The watch, dropped, cuts the connection.
        return exchange.revoked();
    };
    match result {
        Ok(resp) => {
            in_order.response_began();
            // Held until the response ends (the connection lives while it
            // is read); then back to the pool if the exchange had no body and kept to
            // order, else cut (the watch, dropped, cuts it).
            let give_back = Box::new(move || {
                let Some(org) = org.filter(|_| in_order.reusable()) else {
                    return;
                };
                let key = Key {
                    org,
                    host,
                    port,
                    addr,
                };
                pool::give_back(&ctx.upstream_pool, (&ctx.tasks, &ctx.shutdown), key, sender)
            }) as OnComplete;
            exchange.relay(resp, Some(give_back))
        }
        Err(Attempt::Unsent(_)) => {
            exchange.failed(NoResponse::NotSent("upstream connection closed".into()))
        }
        Err(Attempt::Failed(e)) => exchange.failed(e),
    }
}

/// Send `req` again over a new connection to the address the request was
/// decided and recorded for (no other: the record names it); `sender`
/// becomes that connection.
async fn resend(
    ctx: &Ctx,
    addr: std::net::SocketAddr,
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

/// A request head kept to send again.
struct Resend {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
}

impl Resend {
    fn request(self) -> Request<Body> {
        let mut req = Request::new(full(bytes::Bytes::new()));
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers;
        req
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

    #[test]
    fn a_resent_request_keeps_its_head_and_has_no_body() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("a.test"));
        let req = Resend {
            method: Method::GET,
            uri: Uri::from_static("/x?y"),
            version: Version::HTTP_11,
            headers,
        }
        .request();
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri(), "/x?y");
        assert_eq!(req.headers()[header::HOST], "a.test");
        assert!(req.body().is_end_stream());
    }
}
