//! The DNS shim: answers only names the client's org may reach, refuses the
//! rest without sending a packet upstream, and remembers which addresses it
//! handed to which org for which name ([`crate::handout::bindings`]).
//!
//! The path of one query, which carries its own state ([`query`]'s
//! `QueryState`, the counterpart of the proxy's `Conn`) from arrival to
//! answer; its evidence record is built from it when written:
//!
//! 1. UDP: a thread per socket ([`udp`]) receives, answers a kept answer
//!    at once and hands any other datagram to a task of its own, which
//!    answers straight back on the socket. TCP: our
//!    own accept loop ([`serve_tcp`]) holds one place per connection in the
//!    [`budget`]s (global, per client address, per org), closes idle
//!    connections and hands each message to the same handler. Both decode
//!    with hickory ([`Shim::answer_bytes`]): messages that do not decode get
//!    FORMERR, responses and runts are dropped. A well-formed query takes a
//!    place in the query budgets (global, per org) before its decision
//!    ([`answer`], the flow in short steps; the limits are
//!    [`crate::limits`]', shared with the proxy).
//! 2. [`decide::decide_query`] decides purely: client → org, shape, special
//!    names, the policy's name decision, the query type. A question this
//!    org asked before under the same served version, whose answer has not
//!    expired, skips this step and the next: [`cache`] keeps what they
//!    made of it ([`filter::Forwarded`]), and the record, bindings and budgets are
//!    as in step 3-4.
//! 3. Allowed names go upstream through [`crate::resolve::Resolver`] (the
//!    configured servers only, lowercased, cached); the answers get their
//!    TTLs as first seen ([`ttl`]: no countdown across orgs), are filtered
//!    (always-denied addresses, `ech`, hints: [`filter`]) and bound to
//!    (org, name).
//! 4. Evidence is written before the answer is sent; refusals are queued
//!    when the writer has room, else summarised ([`refusals`], through the
//!    proxy's summary engine, [`crate::limits::summary`]). The reply is
//!    encoded in [`encode`].

mod answer;
pub(crate) mod budget;
pub(crate) mod cache;
pub(crate) mod decide;
mod encode;
pub(crate) mod filter;
pub(crate) mod query;
pub(crate) mod refusals;
pub(crate) mod round;
mod shim;
pub(crate) mod ttl;
mod udp;
pub(crate) mod wire;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use hickory_server::net::xfer::Protocol;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

pub(crate) use shim::Shim;

/// Queries answered on one TCP connection before it is closed.
const MAX_QUERIES_PER_TCP_CONNECTION: usize = 1000;
/// Receive buffer asked for on each UDP socket: what a flood queues there
/// while the shim is not running (another task, another process) is
/// dropped by the kernel once it is full, whoever sent the next datagram.
/// Four MiB holds a few thousand queries, about a second of a flood the
/// shim keeps up with on average; the default (208 KiB) holds a tenth of
/// that. Forced where the process may, else capped at `net.core.rmem_max`.
const UDP_RECEIVE_BUFFER: usize = 4 << 20;

/// Bound sockets for every `[dns] listen` address.
pub(crate) struct DnsListeners {
    udp: Vec<udp::Port>,
    tcp: Vec<TcpListener>,
}

/// Bind UDP and TCP on every address; the first failure is returned with its address.
pub(crate) async fn bind(addrs: &[SocketAddr]) -> Result<DnsListeners, (SocketAddr, io::Error)> {
    let mut l = DnsListeners {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    for &addr in addrs {
        let udp = udp::Port::bind(addr).map_err(|e| (addr, e))?;
        match crate::sockopt::grow_receive_buffer(udp.socket(), UDP_RECEIVE_BUFFER) {
            Ok(got) if got >= UDP_RECEIVE_BUFFER => {}
            got => warn!(
                listen = %addr,
                asked = UDP_RECEIVE_BUFFER,
                got = ?got,
                "dns: the UDP receive buffer is smaller than asked, so a flood \
                 overruns it sooner and other clients' queries are dropped with \
                 it (raise net.core.rmem_max or grant CAP_NET_ADMIN)"
            ),
        }
        l.udp.push(udp);
        l.tcp
            .push(TcpListener::bind(addr).await.map_err(|e| (addr, e))?);
    }
    Ok(l)
}

/// The shim, shared by the UDP server and every TCP connection. What a
/// reload changes is in its [`Shim::served`], loaded once per query.
pub(crate) type ShimHandle = Arc<Shim>;

/// Serve until `shutdown`; the returned task ends when every listener has stopped.
pub(crate) fn serve(
    shim: ShimHandle,
    listeners: DnsListeners,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let DnsListeners { udp, tcp } = listeners;
    let tracker = TaskTracker::new();
    for port in udp {
        tracker.spawn(udp::serve(port, shim.clone(), &shutdown));
    }
    for listener in tcp {
        tracker.spawn(serve_tcp(listener, shim.clone(), shutdown.clone()));
    }
    tracker.close();
    tokio::spawn(async move {
        // Refusals that found no room in the evidence queue are written as
        // summaries, now and then, and once more when everything stopped.
        let wait = shim.config.query_timeout.get();
        let mut tick = tokio::time::interval(refusals::SUMMARY_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => shim.refusals.flush(wait).await,
            }
        }
        tracker.wait().await;
        shim.refusals.flush(wait).await;
        let left = shim.refusals.pending_count();
        if left > 0 {
            warn!(
                refusals = left,
                "dns: refusals summarised but not written before shutdown"
            );
        }
    })
}

/// hickory's own TCP loop has no connection cap: accept here, through the
/// shared accept loop ([`crate::serve::accept`](fn@crate::serve::accept)), one place in the TCP
/// budgets (global, per client address, per org) per connection; over any
/// of them a new connection is closed at once, and recorded.
async fn serve_tcp(listener: TcpListener, shim: ShimHandle, shutdown: CancellationToken) {
    let on = crate::serve::Listener {
        what: "dns",
        shutdown: shutdown.clone(),
        tasks: TaskTracker::new(),
    };
    crate::serve::accept(listener, &on, TcpAdmission { shim, shutdown }).await;
    on.tasks.close();
    on.tasks.wait().await;
}

/// The DNS-over-TCP cap at accept, for [`serve_tcp`].
struct TcpAdmission {
    shim: ShimHandle,
    shutdown: CancellationToken,
}

impl crate::serve::Admission for TcpAdmission {
    type Conn = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

    async fn admit(&self, stream: TcpStream, src: SocketAddr) -> Option<Self::Conn> {
        let org = self.shim.served.load().policy.org_for(src.ip());
        let permit = match self
            .shim
            .tcp
            .try_take(src.ip(), org.as_ref().map(|o| &o.name))
        {
            Ok(held) => held,
            Err(limit) => {
                debug!(client = %src, limit, "dns: tcp connection over a cap; closing");
                drop(stream);
                self.shim.refuse_connection(src, limit).await;
                return None;
            }
        };
        let (shim, shutdown) = (self.shim.clone(), self.shutdown.clone());
        Some(Box::pin(async move {
            let _permit = permit;
            tcp_connection(stream, src, shim, shutdown).await;
        }))
    }
}

async fn tcp_connection(
    mut stream: TcpStream,
    src: SocketAddr,
    shim: ShimHandle,
    stop: CancellationToken,
) {
    let (idle, per_query) = (
        shim.config.idle_timeout.get(),
        shim.config.query_timeout.get(),
    );
    for _ in 0..MAX_QUERIES_PER_TCP_CONNECTION {
        let mut len = [0u8; 2];
        let read = tokio::select! {
            _ = stop.cancelled() => return,
            r = tokio::time::timeout(idle, stream.read_exact(&mut len)) => r,
        };
        if !matches!(read, Ok(Ok(_))) {
            return;
        }
        let n = usize::from(u16::from_be_bytes(len));
        let mut msg = vec![0u8; n];
        if !matches!(
            tokio::time::timeout(per_query, stream.read_exact(&mut msg)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        // The handler bounds upstream time itself; this is a backstop.
        let answer = tokio::time::timeout(
            per_query * 2,
            shim.answer_bytes(msg, src, Protocol::Tcp, None),
        )
        .await;
        let Ok(Some(resp)) = answer else {
            continue;
        };
        let Ok(resp_len) = u16::try_from(resp.len()) else {
            return;
        };
        let mut out = Vec::with_capacity(resp.len() + 2);
        out.extend_from_slice(&resp_len.to_be_bytes());
        out.extend_from_slice(&resp);
        if !matches!(
            tokio::time::timeout(per_query, stream.write_all(&out)).await,
            Ok(Ok(()))
        ) {
            return;
        }
    }
}
