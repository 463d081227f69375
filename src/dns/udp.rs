//! DNS over UDP: each socket is read by a thread of its own, blocked in
//! `recvfrom` until a datagram comes (as dnsmasq waits in `poll`), which
//! answers what it can at once (a kept answer: decided, recorded and sent
//! from the thread) and hands the rest to the runtime as tasks. A query
//! whose answer is kept costs the receive, the record's write and the send,
//! and no trip through the runtime's event loop and scheduler.
//!
//! Sends never wait on the thread: a full socket (`EAGAIN`) hands the
//! answer to a task, which tries again while the query's time lasts.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hickory_server::net::xfer::Protocol;
use rustix::net::{RecvFlags, SendFlags, SocketAddrAny};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error};

use super::round::{self, Round};
use super::shim::Shim;
use super::{answer, wire};

/// How long the receiving thread waits in one `recvfrom` before it looks
/// at shutdown again.
const RECV_TIMEOUT: Duration = Duration::from_millis(200);
/// Longest UDP datagram read (hickory's own bound); a longer one is cut
/// short and gets FORMERR.
const MAX_UDP_MESSAGE: usize = 4096;
/// The first wait of a send that met a full socket; each retry doubles it
/// (the query's own time bounds them all).
const SEND_RETRY: Duration = Duration::from_millis(1);

/// One bound UDP socket, blocking for the receiving thread (with
/// [`RECV_TIMEOUT`]), never for anyone else: every other receive and every
/// send is `MSG_DONTWAIT`.
pub(crate) struct Port {
    socket: UdpSocket,
}

impl Port {
    /// Bind `addr`, blocking, with the shim's receive timeout.
    pub(crate) fn bind(addr: SocketAddr) -> io::Result<Port> {
        let socket = UdpSocket::bind(addr)?;
        socket.set_read_timeout(Some(RECV_TIMEOUT))?;
        Ok(Port { socket })
    }

    pub(crate) fn socket(&self) -> &UdpSocket {
        &self.socket
    }

    /// The next datagram, waiting up to [`RECV_TIMEOUT`] for it.
    fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        self.socket.recv_from(buf)
    }

    /// A datagram already queued, if any.
    fn try_recv(&self, buf: &mut [u8]) -> Option<(usize, SocketAddr)> {
        match rustix::net::recvfrom(&self.socket, buf, RecvFlags::DONTWAIT) {
            Ok((n, Some(SocketAddrAny::V4(a)))) => Some((n, a.into())),
            Ok((n, Some(SocketAddrAny::V6(a)))) => Some((n, a.into())),
            _ => None,
        }
    }

    /// Send `resp` to `to` if the socket has room now.
    fn try_send(&self, resp: &[u8], to: SocketAddr) -> io::Result<()> {
        rustix::net::sendto(&self.socket, resp, SendFlags::DONTWAIT, &to)?;
        Ok(())
    }

    /// Send `resp` (if any) to `to`, waiting for room (the caller bounds
    /// how long); a failure is only logged (the client asks again).
    async fn send(&self, resp: &[u8], to: SocketAddr) {
        if resp.is_empty() {
            return;
        }
        let mut wait = SEND_RETRY;
        loop {
            match self.try_send(resp, to) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RECV_TIMEOUT);
                }
                Err(e) => {
                    debug!(client = %to, error = %e, "dns: sending the response failed");
                    return;
                }
                Ok(()) => return,
            }
        }
    }
}

/// Serve `port` on a thread of its own until `shutdown`. The returned
/// task ends once the thread has stopped and every answer it handed to the
/// runtime is done; if that task is dropped (the runtime goes), the thread
/// stops too.
pub(crate) fn serve(
    port: Port,
    shim: Arc<Shim>,
    shutdown: &CancellationToken,
) -> impl Future<Output = ()> + Send + 'static {
    let stop = shutdown.child_token();
    let stop_on_drop = stop.clone().drop_guard();
    let (done, stopped) = oneshot::channel();
    let runtime = tokio::runtime::Handle::current();
    let spawned = std::thread::Builder::new()
        .name("palisade-dns-udp".into())
        .spawn(move || {
            let _runtime = runtime.enter();
            let _ = done.send(receive(&Arc::new(port), &shim, &stop));
        });
    if let Err(e) = spawned {
        error!(error = %e, "dns: no thread for a UDP listener; it answers nothing");
    }
    async move {
        let _stop_on_drop = stop_on_drop;
        if let Ok(tasks) = stopped.await {
            tasks.wait().await;
        }
    }
}

/// Can an answer be sent to `src`? Not to port 0, an unspecified or the
/// broadcast address (as hickory's server checks).
fn replyable(src: SocketAddr) -> bool {
    src.port() != 0
        && match src.ip() {
            IpAddr::V4(v4) => !v4.is_unspecified() && !v4.is_broadcast(),
            IpAddr::V6(v6) => !v6.is_unspecified(),
        }
}

/// Receive datagrams until `shutdown`, in rounds: the first datagram and
/// every one already queued behind it (at most [`round::MAX_ROUND`]) are
/// decided; the records of their answers are written as one batch
/// ([`round`]); then the answers go, straight back on the socket. An
/// answer that waits for something else (upstream, room in the evidence
/// queue, a full socket) goes on as a task of its own (the query budgets
/// bound how many are being served; a query over them ends at once).
/// Returns those tasks, closed.
fn receive(port: &Arc<Port>, shim: &Arc<Shim>, shutdown: &CancellationToken) -> TaskTracker {
    let tasks = TaskTracker::new();
    let round = Arc::new(Round::default());
    let mut buf = vec![0u8; MAX_UDP_MESSAGE];
    let mut waiting = Vec::with_capacity(round::MAX_ROUND);
    let mut pace = round::Pace::default();
    while !shutdown.is_cancelled() {
        let first = match port.recv(&mut buf) {
            Ok(r) => r,
            // The receive timeout, or a signal: look at shutdown again.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => {
                // An ICMP error queued on the socket, and the like: the
                // next receive goes on.
                debug!(error = %e, "dns: udp receive failed");
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
        };
        round.open();
        let more = pace.more();
        let mut got = Some(first);
        let mut taken = 0;
        while let Some((n, src)) = got.take() {
            taken += 1;
            // A round of one datagram: a kept answer goes at once.
            let answer = match more {
                false => udp_now(port, shim, &buf[..n], src),
                true => Err(()),
            };
            let answer = match answer {
                Ok(answer) => answer,
                Err(()) => udp_answer(port, shim, &round, &buf[..n], src),
            };
            if let Some(mut answer) = answer {
                // Most answers (a cached name, a refusal) wait for nothing
                // but the round's records, or not even those.
                if ready_at_once(answer.as_mut()).is_pending() {
                    waiting.push(answer);
                }
            }
            if more && taken < round::MAX_ROUND {
                // Queued already, or the round ends (an error is met again
                // by the next receive).
                got = port.try_recv(&mut buf);
            }
        }
        pace.took(taken);
        let deferred = round.close();
        if !deferred.is_empty() {
            let evidence = shim.evidence.clone();
            let mut write = Box::pin(async move { round::write(&evidence, deferred).await });
            if ready_at_once(write.as_mut()).is_pending() {
                tasks.spawn(write);
            }
        }
        // The handler bounds upstream time itself; this is a backstop, for
        // answers that wait beyond their round only (an answer ready in
        // its round never arms a timer).
        let backstop = shim.config.query_timeout.get() * 2;
        for mut answer in waiting.drain(..) {
            if ready_at_once(answer.as_mut()).is_pending() {
                tasks.spawn(async move {
                    let _ = tokio::time::timeout(backstop, answer).await;
                });
            }
        }
    }
    tasks.close();
    tasks
}

/// Poll `fut` once, with a waker that does nothing: a future that is
/// pending is then handed to a task, whose first poll registers the task's
/// own waker wherever this poll left the no-op one.
fn ready_at_once<F: Future + ?Sized>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

/// An answer to send, or the rest of its work.
type UdpAnswer = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A plain query whose answer is kept, answered straight away
/// ([`super::Shim::kept_now`]): `Ok(None)` once sent, `Ok(Some(_))` what
/// is left to do (a refusal, a record that waits for the writer, a full
/// socket); `Err(())`, with nothing done, for any other datagram.
fn udp_now(
    port: &Arc<Port>,
    shim: &Arc<Shim>,
    raw: &[u8],
    src: SocketAddr,
) -> Result<Option<UdpAnswer>, ()> {
    let q = wire::question(raw).filter(|_| replyable(src)).ok_or(())?;
    let client = SocketAddr::new(src.ip().to_canonical(), src.port());
    let rest = match shim.kept_now(&q, raw, client, Protocol::Udp) {
        answer::Now::Elsewhere => return Err(()),
        answer::Now::Answered(resp) => {
            if resp.is_empty() {
                return Ok(None);
            }
            return Ok(match port.try_send(&resp, src) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let port = port.clone();
                    Some(Box::pin(async move { port.send(&resp, src).await }))
                }
                Err(e) => {
                    debug!(client = %src, error = %e, "dns: sending the response failed");
                    None
                }
                Ok(()) => None,
            });
        }
        rest => rest,
    };
    let (shim, port, raw) = (shim.clone(), port.clone(), raw.to_vec());
    Ok(Some(Box::pin(async move {
        let resp = match rest {
            answer::Now::Refused(r) => {
                let held = r.held;
                let resp = shim
                    .refused_wire(r.state, r.shown, r.limit, &raw, client, Protocol::Udp)
                    .await;
                drop(held);
                resp
            }
            answer::Now::Later(later) => shim.kept_later(*later, &raw, client, Protocol::Udp).await,
            answer::Now::Elsewhere | answer::Now::Answered(_) => Vec::new(),
        };
        port.send(&resp, src).await;
    })))
}

/// The answer to one datagram, sent straight back on the socket when it
/// is ready (none for an address that cannot be answered); the caller
/// bounds its time once it waits beyond its round.
fn udp_answer(
    port: &Arc<Port>,
    shim: &Arc<Shim>,
    round: &Arc<Round>,
    raw: &[u8],
    src: SocketAddr,
) -> Option<UdpAnswer> {
    if !replyable(src) {
        debug!(client = %src, "dns: datagram from an address that cannot be answered");
        return None;
    }
    let raw = raw.to_vec();
    let (shim, port, round) = (shim.clone(), port.clone(), round.clone());
    // An IPv4 client of a dual-stack `[::]` socket is known by its IPv4
    // address; the answer goes back to the address it came from.
    let client = SocketAddr::new(src.ip().to_canonical(), src.port());
    Some(Box::pin(async move {
        let answer = shim.answer_bytes(raw, client, Protocol::Udp, Some(&round));
        if let Some(resp) = answer.await {
            port.send(&resp, src).await;
        }
    }))
}
