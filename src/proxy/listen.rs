//! The accept loop the proxy's TCP listeners share.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};

use super::conn::Link;
use super::ctx::Ctx;
use crate::evidence::Mode;
use crate::policy::Reason;

/// The accept loop of every proxy listener: the shared loop of
/// [`crate::serve::accept`](fn@crate::serve::accept) (stop on shutdown, back off on accept errors, a
/// tracked task and span per connection), holding back while the evidence
/// queue is full (records are never dropped), with the proxy's cap: a
/// connection permit (charged to the address's org, or to the address
/// itself: see [`crate::limits`]). Each connection's state is born here: a
/// [`Link`] of `mode` under the view of its address, carrying the permit,
/// handed to `serve`; over a limit, refused `limit_exceeded` and handed
/// to `refuse` without one. Every accepted socket gets `TCP_NODELAY` (the
/// upstream leg gets it where it is dialled, [`super::dial`]): set once on
/// the listener, whose accepted sockets inherit it (Linux copies the
/// option to them), or on each socket if the listener refused it. Each mode
/// charges the permit to the org it finally decides for ([`Link::charge`]).
pub(crate) async fn accept_loop<S, F, R>(
    ctx: Arc<Ctx>,
    listener: TcpListener,
    mode: Mode,
    serve: S,
    refuse: R,
) where
    S: Fn(Arc<Ctx>, TcpStream, Link) -> F + Sync,
    F: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(&Ctx, TcpStream, Link) + Sync,
{
    // Every mode relays small writes as they come (a request head, a TLS
    // record): Nagle would hold one back for the peer's delayed ACK.
    let inherited = socket2::SockRef::from(&listener)
        .set_tcp_nodelay(true)
        .is_ok();
    let on = crate::serve::Listener {
        what: mode.as_str(),
        shutdown: ctx.shutdown.clone(),
        tasks: ctx.tasks.clone(),
    };
    let admission = ProxyAdmission {
        ctx,
        mode,
        serve,
        refuse,
        inherited,
        conn: std::marker::PhantomData,
    };
    crate::serve::accept(listener, &on, admission).await
}

/// The proxy's cap at accept, for [`accept_loop`].
struct ProxyAdmission<S, R, F> {
    ctx: Arc<Ctx>,
    mode: Mode,
    serve: S,
    refuse: R,
    /// Accepted sockets have `TCP_NODELAY` from the listener.
    inherited: bool,
    conn: std::marker::PhantomData<fn() -> F>,
}

impl<S, F, R> crate::serve::Admission for ProxyAdmission<S, R, F>
where
    S: Fn(Arc<Ctx>, TcpStream, Link) -> F + Sync,
    F: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(&Ctx, TcpStream, Link) + Sync,
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
        if !self.inherited {
            let _ = stream.set_nodelay(true);
        }
        let mut link = Link::new(self.ctx.view(peer.ip()), self.mode, peer);
        let conn = match self
            .ctx
            .conns
            .try_acquire(peer.ip(), link.view.org.as_ref())
        {
            Ok(permit) => {
                link.permit = Some(Arc::new(permit));
                Some((self.serve)(self.ctx.clone(), stream, link))
            }
            Err(hit) => {
                link.refuse(Reason::LimitExceeded, hit.describe().to_string());
                (self.refuse)(&self.ctx, stream, link);
                None
            }
        };
        std::future::ready(conn)
    }
}
