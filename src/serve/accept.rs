//! The accept loop every TCP listener shares.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug_span, warn, Instrument};

/// Pause after a failed accept (EMFILE and friends), instead of spinning.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Where a listener's connections run, and when it stops.
#[derive(Debug, Clone)]
pub(crate) struct Listener {
    /// The listener's name in logs and in each connection's span.
    pub what: &'static str,
    /// Stop accepting (the listener is closed when [`accept`] returns).
    pub shutdown: CancellationToken,
    /// Every admitted connection runs as a task of this tracker; whoever
    /// drains waits on it.
    pub tasks: TaskTracker,
}

/// A listener's policy at accept: its cap, and what serving an admitted
/// connection is.
pub(crate) trait Admission {
    /// Serving one admitted connection, to its end. It holds whatever
    /// place [`Admission::admit`] took for it (a permit, a budget share).
    type Conn: Future<Output = ()> + Send + 'static;

    /// Wait until another connection may be taken (the proxy holds back
    /// while the evidence queue is full). Default: at once.
    fn ready(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// Take a place for the connection from `peer` and return its service;
    /// or, over the listener's cap, refuse it as the listener does (record
    /// it, answer, reset or just close) and return `None`.
    fn admit(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
    ) -> impl Future<Output = Option<Self::Conn>> + Send;
}

/// Accept on `listener` until `on.shutdown`: each connection `admission`
/// admits is served in a task of `on.tasks`, in a span `conn` with the
/// listener's name and the client's address. The listener is closed when
/// this returns, so new connections are refused from then on; the tasks
/// are not waited for (that is the caller's drain).
pub(crate) async fn accept<A: Admission>(listener: TcpListener, on: &Listener, admission: A) {
    loop {
        // The accept is polled first: a connection already queued is
        // taken without registering for the shutdown's wake-up (a lock
        // and a list entry, each way), which is armed only when the loop
        // is about to sleep. Under a flood the accept is always ready, so
        // shutdown is looked at here.
        if on.shutdown.is_cancelled() {
            break;
        }
        let accepted = tokio::select! {
            biased;
            a = async {
                admission.ready().await;
                listener.accept().await
            } => a,
            _ = on.shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            // An IPv4 client of a dual-stack `[::]` listener is known by
            // its IPv4 address (records, org, limits), not the mapped form.
            Ok((stream, peer)) => (
                stream,
                SocketAddr::new(peer.ip().to_canonical(), peer.port()),
            ),
            Err(e) => {
                warn!(listener = on.what, error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Some(conn) = admission.admit(stream, peer).await else {
            continue;
        };
        // Debug level: at the default level no span is built per connection (its
        // fields formatted and stored for the connection's life), and nothing
        // logged inside one at info or above needs it (records carry the client).
        let span = debug_span!("conn", listener = on.what, client.addr = %peer);
        on.tasks.spawn(conn.instrument(span));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{OwnedSemaphorePermit, Semaphore};

    use super::*;

    /// At most `cap` connections at once; each echoes one byte, then waits
    /// for `release` before closing.
    struct Capped {
        open: Arc<Semaphore>,
        release: CancellationToken,
        refused: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Admission for Capped {
        type Conn = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

        async fn admit(&self, stream: TcpStream, _peer: SocketAddr) -> Option<Self::Conn> {
            let Ok(permit) = self.open.clone().try_acquire_owned() else {
                self.refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return None;
            };
            Some(Box::pin(echo_once(stream, permit, self.release.clone())))
        }
    }

    async fn echo_once(
        mut stream: TcpStream,
        _permit: OwnedSemaphorePermit,
        release: CancellationToken,
    ) {
        let mut b = [0u8; 1];
        if stream.read_exact(&mut b).await.is_ok() {
            let _ = stream.write_all(&b).await;
        }
        release.cancelled().await;
    }

    struct Running {
        addr: SocketAddr,
        on: Listener,
        release: CancellationToken,
        refused: Arc<std::sync::atomic::AtomicUsize>,
        task: tokio::task::JoinHandle<()>,
    }

    async fn start(cap: usize) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let on = Listener {
            what: "test",
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
        };
        let release = CancellationToken::new();
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let admission = Capped {
            open: Arc::new(Semaphore::new(cap)),
            release: release.clone(),
            refused: refused.clone(),
        };
        let task = {
            let on = on.clone();
            tokio::spawn(async move { accept(listener, &on, admission).await })
        };
        Running {
            addr,
            on,
            release,
            refused,
            task,
        }
    }

    /// Connect and have one byte echoed: the connection was admitted.
    async fn echoed(addr: SocketAddr) -> (TcpStream, bool) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(b"x").await;
        let mut b = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await;
        let ok = matches!(read, Ok(Ok(1))) && b[0] == b'x';
        (s, ok)
    }

    #[tokio::test]
    async fn the_cap_refuses_the_excess_and_admitted_connections_are_tracked() {
        let r = start(2).await;
        let (_a, ok_a) = echoed(r.addr).await;
        let (_b, ok_b) = echoed(r.addr).await;
        assert!(ok_a && ok_b);
        assert_eq!(r.on.tasks.len(), 2);
        // The third is over the cap: closed without service, not tracked.
        let (_c, ok_c) = echoed(r.addr).await;
        assert!(!ok_c);
        assert_eq!(r.refused.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(r.on.tasks.len(), 2);

        // Closing the listener does not end the tracked connections; the
        // tracker tells when they are done.
        r.on.shutdown.cancel();
        r.task.await.unwrap();
        r.on.tasks.close();
        assert!(!r.on.tasks.is_empty());
        r.release.cancel();
        tokio::time::timeout(Duration::from_secs(5), r.on.tasks.wait())
            .await
            .expect("tracked connections end once released");
    }

    #[tokio::test]
    async fn shutdown_stops_accepting_and_closes_the_listener() {
        let r = start(8).await;
        let (_a, ok) = echoed(r.addr).await;
        assert!(ok);
        r.on.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), r.task)
            .await
            .expect("accept returns on shutdown")
            .unwrap();
        let refused = TcpStream::connect(r.addr).await;
        assert!(refused.is_err(), "still accepting after shutdown");
        // The connection admitted before shutdown is still served.
        assert_eq!(r.on.tasks.len(), 1);
        r.release.cancel();
    }
}
