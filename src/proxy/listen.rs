//! The accept loop the proxy's TCP listeners share.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tracing::warn;

use super::ctx::{Ctx, View};
use super::limits::{self, Permit};

/// The accept loop every TCP listener shares: stop on shutdown, hold back
/// while the evidence queue is full (records are never dropped), back off on
/// accept errors, take a connection permit (charged to the address's org,
/// or to the address itself: see [`limits`]), then `serve` the connection
/// in a tracked task, or `refuse` it over a limit. Each mode charges the
/// permit to the org it finally decides for ([`Ctx::charge`]).
pub async fn accept_loop<S, F, R>(
    ctx: Arc<Ctx>,
    listener: TcpListener,
    what: &'static str,
    serve: S,
    refuse: R,
) where
    S: Fn(Arc<Ctx>, TcpStream, SocketAddr, View, Permit) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(&Ctx, TcpStream, SocketAddr, &View, limits::LimitHit),
{
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => break,
            a = async {
                ctx.evidence.wait_capacity().await;
                listener.accept().await
            } => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let view = ctx.view(peer.ip());
        match ctx.conns.try_acquire(peer.ip(), view.org.as_ref()) {
            Ok(permit) => {
                ctx.tasks
                    .spawn(serve(ctx.clone(), stream, peer, view, permit));
            }
            Err(hit) => refuse(&ctx, stream, peer, &view, hit),
        }
    }
}
