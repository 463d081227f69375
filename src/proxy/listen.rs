//! The accept loop the proxy's TCP listeners share.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};

use super::ctx::{Ctx, View};
use crate::limits::{self, Permit};

/// The accept loop of every proxy listener: the shared loop of
/// [`crate::serve::accept`](fn@crate::serve::accept) (stop on shutdown, back off on accept errors, a
/// tracked task and span per connection), holding back while the evidence
/// queue is full (records are never dropped), with the proxy's cap: a
/// connection permit (charged to the address's org, or to the address
/// itself: see [`limits`]), then `serve` the connection, or `refuse` it
/// over a limit. Each mode charges the permit to the org it finally
/// decides for ([`Ctx::charge`]).
pub(crate) async fn accept_loop<S, F, R>(
    ctx: Arc<Ctx>,
    listener: TcpListener,
    what: &'static str,
    serve: S,
    refuse: R,
) where
    S: Fn(Arc<Ctx>, TcpStream, SocketAddr, View, Permit) -> F + Sync,
    F: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(&Ctx, TcpStream, SocketAddr, &View, limits::LimitHit) + Sync,
{
    let on = crate::serve::Listener {
        what,
        shutdown: ctx.shutdown.clone(),
        tasks: ctx.tasks.clone(),
    };
    let admission = ProxyAdmission {
        ctx,
        serve,
        refuse,
        conn: std::marker::PhantomData,
    };
    crate::serve::accept(listener, &on, admission).await
}

/// The proxy's cap at accept, for [`accept_loop`].
struct ProxyAdmission<S, R, F> {
    ctx: Arc<Ctx>,
    serve: S,
    refuse: R,
    conn: std::marker::PhantomData<fn() -> F>,
}

impl<S, F, R> crate::serve::Admission for ProxyAdmission<S, R, F>
where
    S: Fn(Arc<Ctx>, TcpStream, SocketAddr, View, Permit) -> F + Sync,
    F: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(&Ctx, TcpStream, SocketAddr, &View, limits::LimitHit) + Sync,
{
    type Conn = F;

    fn ready(&self) -> impl std::future::Future<Output = ()> + Send {
        self.ctx.evidence.wait_capacity()
    }

    fn admit(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl std::future::Future<Output = Option<F>> + Send {
        let view = self.ctx.view(peer.ip());
        let conn = match self.ctx.conns.try_acquire(peer.ip(), view.org.as_ref()) {
            Ok(permit) => Some((self.serve)(self.ctx.clone(), stream, peer, view, permit)),
            Err(hit) => {
                (self.refuse)(&self.ctx, stream, peer, &view, hit);
                None
            }
        };
        std::future::ready(conn)
    }
}
