//! The end of one forwarded HTTP request, shared by explicit mode and
//! interception: once its allow is recorded and it is sent, relay the
//! upstream's response (hop-by-hop headers stripped, the body metered) and
//! write the request's close record when the response ends; or, without a
//! complete response head, write the close record with the cause and
//! answer the one failure for it ([`Failure::NoResponse`]).

use std::sync::Arc;
use std::time::Instant;

use http::Response;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::conn::Conn;
use super::failure::Failure;
use super::http::body::Metered;
use super::http::client::NoResponse;
use super::http::{strip_hop_by_hop, Body};
use super::Ctx;

/// Called with the request's `(bytes_up, bytes_down)` when it closes.
pub type OnClose = Box<dyn FnOnce(u64, u64) + Send + Sync>;

/// A recorded, sent request waiting for its response.
pub struct Exchange {
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
}

impl Exchange {
    /// Relay `resp`; the close record is written when its body ends.
    pub fn relay(self, resp: Response<Incoming>) -> Response<Body> {
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let status = self.with_status.then_some(parts.status.as_u16());
        let finish = Box::new(move |down| {
            let up = (self.up)();
            if let Some(f) = self.on_close {
                f(up, down);
            }
            let mut close = self.req.close(&self.id, (up, down), self.started);
            close.status = status;
            self.ctx.submit(&mut close);
        });
        Response::from_parts(parts, Metered::on_finish(body, finish).boxed())
    }

    /// No complete response came: close the request with the cause (no
    /// `on_close`: nothing came back).
    pub fn failed(self, e: NoResponse) -> Response<Body> {
        let mut close = self.req.close(&self.id, ((self.up)(), 0), self.started);
        close.detail = Some(e.to_string());
        self.ctx.submit(&mut close);
        Failure::NoResponse(e).response(&self.shown, None)
    }
}
