//! The DNS shim: answers only names the client's org may reach, refuses the
//! rest without sending a packet upstream, and remembers which addresses it
//! handed to which org for which name ([`crate::handout::bindings`]).
//!
//! The path of one query, which carries its own state ([`query`]'s
//! `QueryState`, the counterpart of the proxy's `Conn`) from arrival to
//! answer; its evidence record is built from it when written:
//!
//! 1. UDP: our own receive loop ([`serve_udp`]) hands each datagram to a
//!    task of its own, which answers straight back on the socket. TCP: our
//!    own accept loop ([`serve_tcp`]) holds one place per connection in the
//!    [`budget`]s (global, per client address, per org), closes idle
//!    connections and hands each message to the same handler. Both decode
//!    with hickory ([`answer_bytes`]): messages that do not decode get
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
pub(crate) mod wire;

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{Header, HeaderCounts, MessageType, Metadata, ResponseCode};
use hickory_server::proto::serialize::binary::{
    BinDecodable, BinDecoder, BinEncodable, BinEncoder,
};
use hickory_server::server::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use round::Round;
pub(crate) use shim::Shim;

/// Queries answered on one TCP connection before it is closed.
const MAX_QUERIES_PER_TCP_CONNECTION: usize = 1000;
/// Longest UDP datagram read (hickory's own bound); a longer one is cut
/// short and gets FORMERR.
const MAX_UDP_MESSAGE: usize = 4096;
/// Receive buffer asked for on each UDP socket: what a flood queues there
/// while the shim is not running (another task, another process) is
/// dropped by the kernel once it is full, whoever sent the next datagram.
/// The kernel allows twice the size asked and counts each small datagram
/// as about 832 bytes (measured on loopback), so 512 KiB holds a burst of
/// some 1,200 queries, 2.5 times the default's 208 KiB. It is not larger:
/// while the shim falls behind a flood, the queue grows as far as the
/// buffer allows and every query waits its turn in it. With 4 MiB,
/// another org's queries waited seconds, past their clients' timeouts
/// (docs/dns.md#bounds). Forced where the process may, else capped at
/// `net.core.rmem_max`.
const UDP_RECEIVE_BUFFER: usize = 512 << 10;

/// Bound sockets for every `[dns] listen` address.
pub(crate) struct DnsListeners {
    udp: Vec<UdpSocket>,
    tcp: Vec<TcpListener>,
}

/// Bind UDP and TCP on every address; the first failure is returned with its address.
pub(crate) async fn bind(addrs: &[SocketAddr]) -> Result<DnsListeners, (SocketAddr, io::Error)> {
    let mut l = DnsListeners {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    for &addr in addrs {
        let udp = UdpSocket::bind(addr).await.map_err(|e| (addr, e))?;
        match crate::sockopt::grow_receive_buffer(&udp, UDP_RECEIVE_BUFFER) {
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
    for socket in udp {
        tracker.spawn(serve_udp(Arc::new(socket), shim.clone(), shutdown.clone()));
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
async fn serve_udp(socket: Arc<UdpSocket>, shim: ShimHandle, shutdown: CancellationToken) {
    let tasks = TaskTracker::new();
    let round = Arc::new(Round::default());
    let mut buf = vec![0u8; MAX_UDP_MESSAGE];
    let mut waiting = Vec::with_capacity(round::MAX_ROUND);
    let mut pace = round::Pace::default();
    loop {
        // The receive is polled first, so that a datagram already queued
        // is taken without registering for the shutdown's wake-up (a lock
        // and a list entry, each way): that wait is armed only when the
        // loop is about to sleep. Under a flood the receive is always
        // ready, so shutdown is looked at here.
        if shutdown.is_cancelled() {
            break;
        }
        let first = tokio::select! {
            biased;
            r = socket.recv_from(&mut buf) => match r {
                Ok(r) => r,
                Err(e) => {
                    debug!(error = %e, "dns: udp receive failed");
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotConnected | io::ErrorKind::ConnectionAborted
                    ) {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        round.open();
        let more = pace.more();
        let mut got = Some(first);
        let mut taken = 0;
        while let Some((n, src)) = got.take() {
            taken += 1;
            // A round of one datagram: a kept answer goes at once.
            let answer = match more {
                false => udp_now(&socket, &shim, &buf[..n], src),
                true => Err(()),
            };
            let answer = match answer {
                Ok(answer) => answer,
                Err(()) => udp_answer(&socket, &shim, &round, &buf[..n], src),
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
                got = socket.try_recv_from(&mut buf).ok();
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
    tasks.wait().await;
}

/// An answer to send, or the rest of its work.
type UdpAnswer = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A plain query whose answer is kept, answered straight away
/// ([`Shim::kept_now`]): `Ok(None)` once sent, `Ok(Some(_))` what is left
/// to do (a refusal, a record that waits for the writer, a full socket);
/// `Err(())`, with nothing done, for any other datagram.
fn udp_now(
    socket: &Arc<UdpSocket>,
    shim: &ShimHandle,
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
            return Ok(match socket.try_send_to(&resp, src) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let socket = socket.clone();
                    Some(Box::pin(async move { send(&socket, &resp, src).await }))
                }
                Err(e) => {
                    debug!(client = %src, error = %e, "dns: sending the response failed");
                    None
                }
                Ok(_) => None,
            });
        }
        rest => rest,
    };
    let (shim, socket, raw) = (shim.clone(), socket.clone(), raw.to_vec());
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
        send(&socket, &resp, src).await;
    })))
}

/// Send `resp` (if any) to `src`; a failure is only logged (the client
/// asks again).
async fn send(socket: &UdpSocket, resp: &[u8], src: SocketAddr) {
    if resp.is_empty() {
        return;
    }
    if let Err(e) = socket.send_to(resp, src).await {
        debug!(client = %src, error = %e, "dns: sending the response failed");
    }
}

/// The answer to one datagram, sent straight back on the socket when it
/// is ready (none for an address that cannot be answered); the caller
/// bounds its time once it waits beyond its round.
fn udp_answer(
    socket: &Arc<UdpSocket>,
    shim: &ShimHandle,
    round: &Arc<Round>,
    raw: &[u8],
    src: SocketAddr,
) -> Option<UdpAnswer> {
    if !replyable(src) {
        debug!(client = %src, "dns: datagram from an address that cannot be answered");
        return None;
    }
    let raw = raw.to_vec();
    let (shim, socket, round) = (shim.clone(), socket.clone(), round.clone());
    // An IPv4 client of a dual-stack `[::]` socket is known by its IPv4
    // address; the answer goes back to the address it came from.
    let client = SocketAddr::new(src.ip().to_canonical(), src.port());
    Some(Box::pin(async move {
        let answer = answer_bytes(&shim, raw, client, Protocol::Udp, Some(&round));
        if let Some(resp) = answer.await {
            if let Err(e) = socket.send_to(&resp, src).await {
                debug!(client = %src, error = %e, "dns: sending the response failed");
            }
        }
    }))
}

/// Poll `fut` once, with a waker that does nothing: a future that is
/// pending is then handed to a task, whose first poll registers the task's
/// own waker wherever this poll left the no-op one.
fn ready_at_once<F: Future + ?Sized>(fut: Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
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
            answer_bytes(&shim, msg, src, Protocol::Tcp, None),
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

/// One DNS message in, the encoded answer out (None: no answer): a runt
/// (no complete header) or a response is dropped, a message that does not
/// decode gets FORMERR. An answer's record is written with `round`'s
/// others when it came in one.
async fn answer_bytes(
    shim: &Shim,
    raw: Vec<u8>,
    src: SocketAddr,
    protocol: Protocol,
    round: Option<&Arc<Round>>,
) -> Option<Vec<u8>> {
    // A plain query is read from the wire; anything else by hickory.
    if let Some(q) = wire::question(&raw) {
        let bytes = shim.respond_wire(&q, &raw, src, protocol, round).await;
        return (!bytes.is_empty()).then_some(bytes);
    }
    let header = {
        let mut decoder = BinDecoder::new(&raw);
        Header::read(&mut decoder).ok()?
    };
    if header.metadata.message_type == MessageType::Response {
        return None;
    }
    match Request::from_bytes(raw, src, protocol) {
        Ok(request) => {
            let bytes = shim.respond(&request, protocol, round).await;
            (!bytes.is_empty()).then_some(bytes)
        }
        Err(e) => {
            debug!(client = %src, error = %e, "dns: undecodable message; FORMERR");
            let mut metadata = Metadata::response_from_request(&header.metadata);
            metadata.response_code = ResponseCode::FormErr;
            let mut bytes = Vec::with_capacity(12);
            let mut encoder = BinEncoder::new(&mut bytes);
            Header {
                metadata,
                counts: HeaderCounts::default(),
            }
            .emit(&mut encoder)
            .ok()?;
            Some(bytes)
        }
    }
}
