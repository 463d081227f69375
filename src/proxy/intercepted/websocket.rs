//! WebSocket inside an intercepted connection (`websocket = true` on the
//! intercepting rule): what a request asks to become ([`upgrade_of`],
//! pure), and, for an allowed WebSocket handshake, the relay.
//!
//! A handshake is an HTTP/1.1 `GET` with `Upgrade: websocket`, or an
//! HTTP/2 extended CONNECT with `:protocol = websocket` (RFC 8441); it is
//! decided like any request (the serving code), its credentials added to
//! the handshake only. The upstream gets it as an HTTP/1.1 upgrade over a
//! connection of its own (dialled to the same checked address, TLS
//! verified as always, ALPN `http/1.1`); an HTTP/2 client's handshake is
//! translated (a `Sec-WebSocket-Key` of our own; the client gets `200`,
//! not `101`). After the upstream's `101` both upgraded streams are copied
//! as bytes, both ways, never buffered as whole messages, until both sides
//! close, both are silent for `idle_timeout`, the connection is cut, or a
//! reload's policy revokes the stream (its path refused, its rule without
//! `websocket = true`: [`crate::proxy::revoke`]);
//! the handshake's close record then counts the bytes of each direction.
//! Another answer than `101` is relayed as an ordinary response.

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::proxy::forward::Exchange;
use crate::proxy::http::client::NoResponse;
use crate::proxy::http::{full, strip_hop_by_hop, Body};
use crate::proxy::record::volume_spent;
use crate::proxy::revoke;
use crate::proxy::tunnel;

/// What a request asks to become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Upgrade {
    /// Nothing: an ordinary request.
    None,
    /// A WebSocket handshake (HTTP/1.1 upgrade or HTTP/2 extended CONNECT).
    WebSocket,
    /// Another protocol (`h2c`, `connect-udp`, …): never relayed.
    Other(String),
}

/// Longest protocol name shown in a refusal.
const MAX_SHOWN_PROTOCOL: usize = 64;

/// What `req` asks to become: HTTP/1.1 by its `Upgrade` header (a `GET`
/// naming exactly `websocket`, any case, is a WebSocket handshake; any
/// other upgrade is another protocol), HTTP/2 by the `:protocol` of an
/// extended CONNECT.
pub(crate) fn upgrade_of(req: &http::request::Parts) -> Upgrade {
    let shown = |s: &str| s.chars().take(MAX_SHOWN_PROTOCOL).collect::<String>();
    if req.version == Version::HTTP_2 {
        if let Some(p) = req.extensions.get::<hyper::ext::Protocol>() {
            return if p.as_str().eq_ignore_ascii_case("websocket") && req.method == Method::CONNECT
            {
                Upgrade::WebSocket
            } else {
                Upgrade::Other(shown(p.as_str()))
            };
        }
    }
    let mut tokens = Vec::new();
    for v in req.headers.get_all(header::UPGRADE) {
        let text = String::from_utf8_lossy(v.as_bytes()).into_owned();
        tokens.extend(text.split(',').map(|t| t.trim().to_string()));
    }
    tokens.retain(|t| !t.is_empty());
    match tokens.as_slice() {
        [] if req.headers.contains_key(header::UPGRADE) => Upgrade::Other(String::new()),
        [] => Upgrade::None,
        [one] if one.eq_ignore_ascii_case("websocket") && req.method == Method::GET => {
            Upgrade::WebSocket
        }
        _ => Upgrade::Other(shown(&tokens.join(", "))),
    }
}

/// Turn an allowed handshake (its credentials added) into the HTTP/1.1
/// upgrade request the upstream gets: `GET`, origin form with the
/// normalised path, `Host`, hop-by-hop headers gone, `Upgrade: websocket`
/// and `Connection: Upgrade`; from an HTTP/2 client also a
/// `Sec-WebSocket-Key` (and version 13) of our own.
pub(crate) fn upstream_request(
    mut parts: http::request::Parts,
    path_and_query: &str,
    authority: &str,
) -> Result<Request<Body>, String> {
    let from_h2 = parts.version == Version::HTTP_2;
    strip_hop_by_hop(&mut parts.headers);
    let h = &mut parts.headers;
    h.remove(header::HOST);
    h.insert(
        header::HOST,
        HeaderValue::from_str(authority).map_err(|e| e.to_string())?,
    );
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if from_h2 {
        let mut key = [0u8; 16];
        getrandom::fill(&mut key).map_err(|e| e.to_string())?;
        let key = data_encoding::BASE64.encode(&key);
        h.insert(
            header::SEC_WEBSOCKET_KEY,
            HeaderValue::from_str(&key).map_err(|e| e.to_string())?,
        );
        if !h.contains_key(header::SEC_WEBSOCKET_VERSION) {
            h.insert(
                header::SEC_WEBSOCKET_VERSION,
                HeaderValue::from_static("13"),
            );
        }
    }
    let mut req = Request::new(full(""));
    *req.method_mut() = Method::GET;
    *req.version_mut() = Version::HTTP_11;
    *req.uri_mut() = Uri::builder()
        .path_and_query(path_and_query)
        .build()
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = parts.headers;
    Ok(req)
}

/// The answer to the client for the upstream's `101`: `101` with the
/// upgrade headers to an HTTP/1.1 client, `200` to an HTTP/2 one (without
/// `Sec-WebSocket-Accept`, which answered our key, not theirs).
pub(crate) fn client_response(upstream: &http::response::Parts, h2_client: bool) -> Response<Body> {
    let mut headers = upstream.headers.clone();
    strip_hop_by_hop(&mut headers);
    let mut resp = Response::new(full(""));
    if h2_client {
        headers.remove(header::SEC_WEBSOCKET_ACCEPT);
        *resp.status_mut() = StatusCode::OK;
    } else {
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    }
    *resp.headers_mut() = headers;
    resp
}

/// Send the upgrade request `req` over `sender` (a connection of its own)
/// and wait for the upstream's answer, at most the response timeout.
pub(crate) async fn handshake(
    sender: &mut hyper::client::conn::http1::SendRequest<Body>,
    req: Request<Body>,
    timeout: std::time::Duration,
) -> Result<Response<hyper::body::Incoming>, NoResponse> {
    if let Err(e) = sender.ready().await {
        return Err(NoResponse::Failed(e));
    }
    crate::proxy::http::client::response(sender.send_request(req), timeout).await
}

/// After the `101`: wait for both upgraded streams, copy both ways until
/// both close, both are silent for `idle`, or `stop`; then write the
/// handshake's close record (`status`, the bytes of each direction) and
/// hand the totals to the exchange's `on_close`.
pub(crate) async fn relay(
    mut exchange: Exchange,
    (client, upstream): (OnUpgrade, OnUpgrade),
    status: u16,
    idle: std::time::Duration,
    stop: CancellationToken,
) {
    let streams = tokio::select! {
        s = async { tokio::try_join!(client, upstream) } => s,
        _ = stop.cancelled() => {
            finish(&mut exchange, (0, 0), status, Some("closed before the upgrade".into()));
            return;
        }
    };
    let (client, upstream) = match streams {
        Ok(s) => s,
        Err(e) => {
            debug!(error = %e, "websocket upgrade failed");
            finish(
                &mut exchange,
                (0, 0),
                status,
                Some(format!("upgrade failed: {e}")),
            );
            return;
        }
    };
    // Held to every policy a reload serves, as its own unit: a reload that
    // refuses its path or drops `websocket = true` cuts it at once.
    // Its bytes spend from the rule's volume budgets like a tunnel's: cut
    // once one is spent (report mode: noted).
    let cut = stop.child_token();
    let watch = exchange.req.volume.clone().map(|lease| {
        let enforce = !exchange.req.view.is_report();
        crate::limits::Watch::new(lease, enforce.then(|| cut.clone()))
    });
    let pump = tunnel::pump(
        TokioIo::new(client),
        TokioIo::new(upstream),
        &[],
        idle,
        (&cut, watch.as_ref()),
    );
    let ctx = exchange.ctx.clone();
    let totals = revoke::held(&ctx, &exchange.req, &exchange.id, &cut, pump).await;
    volume_spent(&ctx, &exchange.req, &exchange.id, watch.as_ref()).await;
    finish(&mut exchange, (totals.up, totals.down), status, None);
}

/// The handshake's close record: the upgraded bytes each way.
fn finish(exchange: &mut Exchange, (up, down): (u64, u64), status: u16, detail: Option<String>) {
    if let Some(f) = exchange.on_close.take() {
        f(up, down);
    }
    let mut close = exchange
        .req
        .close(&exchange.id, (up, down), exchange.started);
    close.status = Some(status);
    close.detail = detail;
    exchange.ctx.submit(&mut close);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(b: http::request::Builder) -> http::request::Parts {
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn what_a_request_asks_to_become() {
        let h1 = |m: &str, up: &[&str]| {
            let mut b = Request::builder().method(m).uri("/ws");
            for u in up {
                b = b.header(header::UPGRADE, *u);
            }
            upgrade_of(&parts(b))
        };
        assert_eq!(h1("GET", &[]), Upgrade::None);
        assert_eq!(h1("GET", &["websocket"]), Upgrade::WebSocket);
        assert_eq!(h1("GET", &["WebSocket"]), Upgrade::WebSocket);
        assert_eq!(h1("GET", &["h2c"]), Upgrade::Other("h2c".into()));
        assert_eq!(
            h1("GET", &["websocket, h2c"]),
            Upgrade::Other("websocket, h2c".into())
        );
        assert_eq!(
            h1("POST", &["websocket"]),
            Upgrade::Other("websocket".into())
        );
        assert_eq!(h1("GET", &[""]), Upgrade::Other(String::new()));
        let h2 = |m: Method, p: Option<&'static str>| {
            let mut b = Request::builder()
                .method(m)
                .version(Version::HTTP_2)
                .uri("https://a.test/ws");
            if let Some(p) = p {
                b = b.extension(hyper::ext::Protocol::from_static(p));
            }
            upgrade_of(&parts(b))
        };
        assert_eq!(h2(Method::CONNECT, Some("websocket")), Upgrade::WebSocket);
        assert_eq!(
            h2(Method::CONNECT, Some("connect-udp")),
            Upgrade::Other("connect-udp".into())
        );
        assert_eq!(h2(Method::CONNECT, None), Upgrade::None);
        assert_eq!(h2(Method::GET, None), Upgrade::None);
    }

    #[test]
    fn the_upstream_gets_an_http1_upgrade() {
        let (p, _) = Request::builder()
            .method(Method::CONNECT)
            .version(Version::HTTP_2)
            .uri("https://a.test/ws?x=1")
            .header("sec-websocket-version", "13")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap()
            .into_parts();
        let req = upstream_request(p, "/ws?x=1", "a.test").unwrap();
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.uri(), "/ws?x=1");
        let h = req.headers();
        assert_eq!(h[header::HOST], "a.test");
        assert_eq!(h[header::UPGRADE], "websocket");
        assert_eq!(h[header::CONNECTION], "Upgrade");
        assert_eq!(h["authorization"], "Bearer t");
        let key = data_encoding::BASE64
            .decode(h[header::SEC_WEBSOCKET_KEY].as_bytes())
            .unwrap();
        assert_eq!(key.len(), 16);

        let (up, _) = Response::builder()
            .status(101)
            .header("upgrade", "websocket")
            .header("connection", "upgrade")
            .header("sec-websocket-accept", "abc")
            .body(())
            .unwrap()
            .into_parts();
        let to_h1 = client_response(&up, false);
        assert_eq!(to_h1.status(), 101);
        assert_eq!(to_h1.headers()["sec-websocket-accept"], "abc");
        assert_eq!(to_h1.headers()[header::UPGRADE], "websocket");
        let to_h2 = client_response(&up, true);
        assert_eq!(to_h2.status(), 200);
        assert!(to_h2.headers().get("sec-websocket-accept").is_none());
        assert!(to_h2.headers().get(header::UPGRADE).is_none());
    }
}
