//! Tunnel verification: a tunnel carries what its rule says it carries
//! ([`Carry`]), checked from its first byte to its last, in every mode
//! (CONNECT, SOCKS5, transparent).
//!
//! The judging is pure ([`crate::proto::tls_stream`],
//! [`crate::proto::http_stream`], in the vocabulary of
//! [`crate::proto::guard`]); this module is the I/O around it:
//!
//! 1. [`first`] reads the client's first unit (a whole ClientHello, a whole
//!    request head) under `detect_timeout`, holding the bytes in a buffer
//!    charged to the detection memory budget. Silence, other bytes, or a
//!    unit naming another host is a denial before anything is recorded as
//!    allowed.
//! 2. The caller records the allow decision; then [`pump`] forwards the
//!    verified first unit and keeps judging every later client byte before
//!    forwarding it (a second request, a second ClientHello after a
//!    HelloRetryRequest), while the upstream's bytes are observed on their
//!    way to the client (to follow a handshake or an upgrade).
//! 3. Once a direction can no longer change what the upstream serves (the
//!    ServerHello went by, a `101 Switching Protocols`), it is copied as is.
//!
//! A violation stops the tunnel at once: the bytes that failed, and any
//! after them, never reach the upstream.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use bytes::BufMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

use crate::limits::{DetectHold, DetectScope};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::splice::{self, AsTcp, Spliced, Stream};
use super::tunnel::{self, Detected, Totals, MAX_DETECT_BYTES};
use crate::config::Carry;
use crate::policy::Reason;
use crate::proto::guard::{self, Step, Violation, ViolationKind};
use crate::proto::http_stream::HttpGuard;
use crate::proto::target::Host;
use crate::proto::tls_stream::TlsGuard;

/// The reason code a violation is recorded with.
pub(crate) fn reason(kind: ViolationKind) -> Reason {
    match kind {
        ViolationKind::ProtocolMismatch => Reason::ProtocolMismatch,
        ViolationKind::SniMissing => Reason::SniMissing,
        ViolationKind::SniMismatch => Reason::SniMismatch,
        ViolationKind::EchNotAllowed => Reason::EchNotAllowed,
        ViolationKind::HostMismatch => Reason::HostMismatch,
        ViolationKind::UpgradeNotAllowed => Reason::UpgradeNotAllowed,
        ViolationKind::Malformed => Reason::BadRequest,
    }
}

/// The verifier of one tunnel.
pub(crate) enum Guard {
    Tls(Box<TlsGuard>),
    Http(Box<HttpGuard>),
}

impl Guard {
    fn client(&mut self, held: &[u8]) -> Step {
        match self {
            Guard::Tls(g) => g.client(held),
            Guard::Http(g) => g.client(held),
        }
    }

    fn server(&mut self, bytes: &[u8]) {
        match self {
            Guard::Tls(g) => g.server(bytes),
            Guard::Http(g) => g.server(bytes),
        }
    }

    /// Client bytes that may pass unjudged: the rest of a request body of
    /// known length (HTTP), counted from the first byte not held.
    fn client_body_left(&self) -> u64 {
        match self {
            Guard::Tls(_) => 0,
            Guard::Http(g) => g.client_body_left(),
        }
    }

    fn client_passed(&mut self, n: u64) {
        if let Guard::Http(g) = self {
            g.client_passed(n);
        }
    }

    /// Upstream bytes that may pass unobserved: the rest of a response body
    /// of known length (HTTP).
    fn server_body_left(&self) -> u64 {
        match self {
            Guard::Tls(_) => 0,
            Guard::Http(g) => g.server_body_left(),
        }
    }

    fn server_passed(&mut self, n: u64) {
        if let Guard::Http(g) = self {
            g.server_passed(n);
        }
    }

    /// What the tunnel was verified as.
    pub(crate) fn carry(&self) -> Carry {
        match self {
            Guard::Tls(_) => Carry::Tls,
            Guard::Http(_) => Carry::Http,
        }
    }

    /// The first unit, as the rest of the proxy knows it (evidence `sni`,
    /// the interception plan).
    pub(crate) fn detected(&self) -> Detected {
        match self {
            Guard::Tls(g) => Detected::Tls(g.hello().cloned().unwrap_or_default()),
            Guard::Http(g) => Detected::Http(g.first_host().map(str::to_string)),
        }
    }
}

/// Bytes held unverified, charged to the detection memory budget (the
/// global pool and the holder's share: the org's, or for a client of no org
/// its address's) in units of [`MAX_DETECT_BYTES`].
struct Budget<'a> {
    hold: DetectHold<'a>,
}

impl<'a> Budget<'a> {
    fn new(detect: &DetectScope<'a>) -> Self {
        Budget {
            hold: detect.hold(),
        }
    }

    /// Cover `bytes` held bytes; `false` if the budget has no room.
    fn cover(&mut self, bytes: usize) -> bool {
        self.hold.cover(bytes.div_ceil(MAX_DETECT_BYTES))
    }

    fn release(&mut self) {
        self.hold.release();
    }
}

/// What reading the first unit concluded.
pub(crate) enum First {
    /// The first unit passed; the first `forward` held bytes are verified.
    Passed { guard: Guard, forward: usize },
    /// The first bytes (or their absence) fail the rule.
    Denied(Violation),
    /// The client closed before sending anything.
    Closed,
    /// The detection memory budget had no room for the bytes to judge.
    OverBudget,
}

/// The largest number of bytes held to judge one unit.
fn hold_cap(limits: guard::Limits) -> usize {
    MAX_DETECT_BYTES.max(limits.max_head_bytes + 1024)
}

/// Read and judge the client's first unit for a tunnel to `host:port`
/// that must carry `carry` (not [`Carry::Opaque`]). `held` may already hold
/// bytes the client sent early; on return it holds every byte read.
pub(crate) async fn first<R: Stream>(
    client: &mut R,
    held: &mut Vec<u8>,
    carry: Carry,
    target: (&Host, u16),
    limits: guard::Limits,
    timeout: Duration,
    detect: &DetectScope<'_>,
) -> First {
    let (host, port) = target;
    let deadline = Instant::now() + timeout;
    let mut budget = Budget::new(detect);
    let mut guard: Option<Guard> = None;
    let cap = hold_cap(limits);
    loop {
        if guard.is_none() {
            if let Some(&byte) = held.first() {
                let tls = match carry {
                    Carry::Tls => true,
                    Carry::Http => false,
                    // A TLS record starts with the handshake content type.
                    Carry::TlsOrHttp | Carry::Opaque => byte == 0x16,
                };
                guard = Some(if tls {
                    Guard::Tls(Box::new(TlsGuard::new(host.clone())))
                } else {
                    Guard::Http(Box::new(HttpGuard::new(host.clone(), port, limits)))
                });
            }
        }
        if let Some(g) = guard.as_mut() {
            // How much of the first unit is verified, once it is judged.
            let forward = match g.client(held) {
                Step::Forward(n) => Some(n.min(held.len())),
                Step::Opaque => Some(held.len()),
                Step::Wait => Some(0),
                Step::Deny(v) => return First::Denied(v),
                Step::NeedMore => None,
            };
            if let (Some(forward), Some(guard)) = (forward, guard.take_if(|_| forward.is_some())) {
                return First::Passed { guard, forward };
            }
        }
        if held.len() >= cap {
            return First::Denied(Violation::new(
                ViolationKind::Malformed,
                None,
                format!("first {cap} bytes do not complete a {carry} unit"),
            ));
        }
        let room = (cap - held.len()).min(16 * 1024);
        if !budget.cover(held.len() + room) {
            return First::OverBudget;
        }
        // A silent client holds its share of the budget, but no buffer.
        let read = if held.is_empty() && !tunnel::readable(client.tcp(), deadline).await {
            None
        } else {
            held.reserve(room);
            tokio::time::timeout_at(deadline, client.read_buf(&mut held.limit(room)))
                .await
                .ok()
        };
        match read {
            Some(Ok(0)) | Some(Err(_)) if held.is_empty() => return First::Closed,
            Some(Ok(0)) | Some(Err(_)) => {
                return First::Denied(Violation::new(
                    ViolationKind::Malformed,
                    None,
                    format!("client closed in the middle of its first {carry} unit"),
                ))
            }
            Some(Ok(_)) => {}
            None if held.is_empty() => {
                return First::Denied(Violation::new(
                    ViolationKind::ProtocolMismatch,
                    None,
                    format!(
                        "client sent nothing within detect_timeout ({}); the rule's tunnel carries {carry}",
                        humantime::format_duration(timeout)
                    ),
                ))
            }
            None => {
                return First::Denied(Violation::new(
                    ViolationKind::ProtocolMismatch,
                    None,
                    format!(
                        "first {carry} unit incomplete at detect_timeout ({} bytes)",
                        held.len()
                    ),
                ))
            }
        }
    }
}

/// How a verified tunnel ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum End {
    /// Closed by either side, idle, or stopped.
    Closed,
    /// A later unit failed verification; the tunnel was cut there.
    Violation(Violation),
    /// Bytes to judge did not fit the detection memory budget.
    OverBudget,
}

/// Largest read of one direction.
const READ_CHUNK: usize = 16 * 1024;

/// A tunnel's first unit as judged: the guard that judges the rest, the
/// client bytes held, and how many of them passed.
pub(crate) struct Judged {
    pub guard: Guard,
    pub held: Vec<u8>,
    pub verified: usize,
}

/// What a verified copy is held to: its timeouts, the stop signal, the
/// detection budget units are held under, and report mode's hook.
pub(crate) struct Watch<'a> {
    /// Nothing either way for this long: closed.
    pub idle: Duration,
    /// A held unit must be complete within this of its first byte.
    pub unit_timeout: Duration,
    pub stop: &'a CancellationToken,
    pub detect: &'a DetectScope<'a>,
    /// Report mode: violations are handed here and the copy goes on.
    pub report: Option<&'a (dyn Fn(&Violation) + Sync)>,
    /// The tunnel's volume budgets, charged after every transfer.
    pub volume: Option<&'a crate::limits::Watch>,
}

/// What the two directions of one verified copy share.
struct Shared<'a> {
    start: Instant,
    /// When bytes last moved either way, in milliseconds after `start`.
    last: AtomicU64,
    up: AtomicU64,
    down: AtomicU64,
    guard: Mutex<Guard>,
    /// The upstream's bytes were observed, or it closed: a unit waiting
    /// on them may be decided now.
    server_seen: Notify,
    server_closed: AtomicBool,
    /// The client's direction went opaque: nothing is left to follow on
    /// the upstream's either.
    client_opaque: AtomicBool,
    volume: Option<&'a crate::limits::Watch>,
    /// Which directions are over (the last leaves its half-close to the
    /// tunnel's close).
    ends: tunnel::Ends,
}

impl Shared<'_> {
    /// Bytes moved: whether the tunnel may go on (its volume budgets).
    fn touch(&self) -> bool {
        let since = self.start.elapsed().as_millis() as u64;
        self.last.store(since, Ordering::Relaxed);
        self.volume.is_none_or(|w| w.moved(&self.up, &self.down))
    }

    fn guard(&self) -> MutexGuard<'_, Guard> {
        self.guard
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Copy both ways until close, idle, `stop`, or a violation, judging every
/// client byte before it is forwarded. `held[..verified]` is forwarded
/// first; the rest of `held` is judged like any later byte. With `report`,
/// a violation is handed to it and the tunnel continues unverified (report
/// mode); otherwise the tunnel ends with [`End::Violation`]. A unit the
/// verifier holds (a request head, a ClientHello) must be complete within
/// `unit_timeout` of its first byte, however the client trickles it.
///
/// What needs no judging moves with splice(2) when both ends are TCP
/// sockets: a direction gone opaque, and a body of known length (the
/// verifier says how many bytes; exactly those pass, and judging resumes
/// at the next head). Over TCP, a direction waits for readability before
/// it takes a buffer, and gives the buffer back once drained.
pub(crate) async fn pump<C, U>(
    mut client: C,
    mut upstream: U,
    judged: Judged,
    watch: Watch<'_>,
) -> (Totals, End)
where
    C: Stream,
    U: Stream,
{
    let shared = Shared {
        start: Instant::now(),
        last: AtomicU64::new(0),
        up: AtomicU64::new(0),
        down: AtomicU64::new(0),
        guard: Mutex::new(judged.guard),
        server_seen: Notify::new(),
        server_closed: AtomicBool::new(false),
        client_opaque: AtomicBool::new(false),
        volume: watch.volume,
        ends: tunnel::Ends::default(),
    };
    let (client_r, client_w) = client.halves();
    let (upstream_r, upstream_w) = upstream.halves();
    let verified = judged.verified.min(judged.held.len());
    // The directions' state lives here; their futures hold references.
    let mut up = Upward {
        shared: &shared,
        from: client_r,
        to: upstream_w,
        held: judged.held,
        verified,
        budget: Budget::new(watch.detect),
        opaque: false,
        unit_since: None,
        unit_timeout: watch.unit_timeout,
        report: watch.report,
    };
    let up_dir = up.run();
    let down_dir = downward(&shared, upstream_r, client_w);
    // Pinned here and polled through references: one copy of each
    // direction's state per tunnel.
    tokio::pin!(up_dir, down_dir);
    let end = both_ways(up_dir, down_dir, &shared, watch.idle, watch.stop).await;
    let totals = Totals {
        up: shared.up.load(Ordering::Relaxed),
        down: shared.down.load(Ordering::Relaxed),
    };
    (totals, end)
}

/// Both directions until both finish; a violation ends the tunnel at once,
/// whatever the upstream is still sending; so do `idle` without a byte
/// either way, and `stop`.
async fn both_ways(
    mut up_dir: Pin<&mut impl Future<Output = End>>,
    mut down_dir: Pin<&mut impl Future<Output = ()>>,
    shared: &Shared<'_>,
    idle: Duration,
    stop: &CancellationToken,
) -> End {
    let both = async {
        let mut up_done = false;
        let mut down_done = false;
        loop {
            tokio::select! {
                end = &mut up_dir, if !up_done => {
                    if end != End::Closed {
                        return end;
                    }
                    up_done = true;
                }
                () = &mut down_dir, if !down_done => down_done = true,
            }
            if up_done && down_done {
                return End::Closed;
            }
        }
    };
    tokio::pin!(both);
    tokio::select! {
        end = &mut both => end,
        _ = tunnel::idle_for(idle, shared.start, &shared.last) => End::Closed,
        _ = stop.cancelled() => End::Closed,
    }
}

/// What the client's direction does next.
enum Flow {
    /// Look at what is held again.
    Again,
    /// Read more of the client.
    Read,
    /// The client is done: half-close the upstream.
    Done,
    /// The tunnel ends.
    End(End),
}

/// The client's direction: every byte judged before it is forwarded.
struct Upward<'s, 'a, R, W> {
    shared: &'s Shared<'a>,
    from: R,
    to: W,
    /// Client bytes read and not yet forwarded.
    held: Vec<u8>,
    /// How many of `held` passed judging.
    verified: usize,
    budget: Budget<'a>,
    /// Judging is over: copied as is from now on.
    opaque: bool,
    /// When the unit now held began to arrive.
    unit_since: Option<Instant>,
    unit_timeout: Duration,
    report: Option<&'s (dyn Fn(&Violation) + Sync)>,
}

impl<R, W> Upward<'_, '_, R, W>
where
    R: AsyncRead + AsTcp + Unpin,
    W: AsyncWrite + AsTcp + Unpin,
{
    async fn run(&mut self) -> End {
        loop {
            if !self.pass_verified().await {
                return End::Closed;
            }
            if self.opaque {
                // Boxed, as every step that is not where an idle tunnel
                // waits: the task keeps room only for the largest.
                Box::pin(self.go_opaque()).await;
                return End::Closed;
            }
            let flow = if self.held.is_empty() {
                Box::pin(self.pass_body()).await
            } else {
                Box::pin(self.judge_held()).await
            };
            let flow = match flow {
                Flow::Read => self.read_more().await,
                flow => flow,
            };
            match flow {
                Flow::Again | Flow::Read => {}
                Flow::Done => break,
                Flow::End(end) => return end,
            }
        }
        // The client finished; bytes it left unjudged are never forwarded.
        self.shared.ends.finish(&mut self.to).await;
        End::Closed
    }

    /// Forward `bytes` and count them; whether the tunnel goes on.
    async fn send(to: &mut W, shared: &Shared<'_>, bytes: &[u8]) -> bool {
        if to.write_all(bytes).await.is_err() {
            return false;
        }
        shared.up.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        shared.touch()
    }

    /// Forward what passed judging; whether the tunnel goes on.
    async fn pass_verified(&mut self) -> bool {
        if self.verified == 0 {
            return true;
        }
        let n = self.verified;
        if !Self::send(&mut self.to, self.shared, &self.held[..n]).await {
            return false;
        }
        self.held.drain(..n);
        self.verified = 0;
        true
    }

    /// Forward what is held unjudged, then copy as is until the client
    /// is done.
    async fn go_opaque(&mut self) {
        let shared = self.shared;
        shared.client_opaque.store(true, Ordering::Relaxed);
        let held = std::mem::take(&mut self.held);
        if !held.is_empty() && !Self::send(&mut self.to, shared, &held).await {
            return;
        }
        drop(held);
        self.budget.release();
        let touch = || shared.touch();
        let ends = Some(&shared.ends);
        tunnel::forward(&mut self.from, &mut self.to, &shared.up, &touch, ends).await;
    }

    /// Judge what is held: forward what passed, wait for the upstream's
    /// answer, or read on for the rest of the unit.
    async fn judge_held(&mut self) -> Flow {
        let seen = self.shared.server_seen.notified();
        tokio::pin!(seen);
        seen.as_mut().enable();
        let step = self.shared.guard().client(&self.held);
        match step {
            Step::Forward(n) => {
                self.verified = n.min(self.held.len());
                self.unit_since = None;
                Flow::Again
            }
            Step::Opaque => {
                self.opaque = true;
                Flow::Again
            }
            Step::Deny(v) => self.violation(v),
            Step::Wait => {
                if self.shared.server_closed.load(Ordering::Relaxed) {
                    // Nothing more will come to decide on.
                    return Flow::Done;
                }
                seen.await;
                Flow::Again
            }
            Step::NeedMore => {
                self.unit_since.get_or_insert_with(Instant::now);
                Flow::Read
            }
        }
    }

    /// Nothing held: the rest of a body of known length may go by unheld,
    /// exactly that many bytes.
    async fn pass_body(&mut self) -> Flow {
        let shared = self.shared;
        let body = shared.guard().client_body_left();
        if body == 0 {
            return Flow::Read;
        }
        let (Some(from), Some(to)) = (self.from.as_tcp(), self.to.as_tcp()) else {
            return Flow::Read;
        };
        let before = shared.up.load(Ordering::Relaxed);
        let touch = || shared.touch();
        let end = splice::splice(from, to, Some(body), &shared.up, &touch).await;
        let passed = shared.up.load(Ordering::Relaxed) - before;
        shared.guard().client_passed(passed);
        match end {
            Spliced::Limit => Flow::Again,
            Spliced::Unsupported => Flow::Read,
            Spliced::Eof | Spliced::Failed => Flow::Done,
        }
    }

    /// Read more of the client, within the held unit's time; over TCP with
    /// nothing held, wait for readability first, holding no buffer.
    async fn read_more(&mut self) -> Flow {
        if self.held.is_empty() {
            self.budget.release();
            if let Some(tcp) = self.from.as_tcp() {
                // An idle tunnel holds no buffer.
                self.held = Vec::new();
                if tcp.readable().await.is_err() {
                    return Flow::Done;
                }
            }
        } else if !self.budget.cover(self.held.len() + READ_CHUNK) {
            return Flow::End(End::OverBudget);
        }
        self.held.reserve(READ_CHUNK);
        let mut room = (&mut self.held).limit(READ_CHUNK);
        let read = self.from.read_buf(&mut room);
        let read = match self.unit_since {
            Some(since) => {
                let due = since + self.unit_timeout;
                match Box::pin(tokio::time::timeout_at(due, read)).await {
                    Ok(read) => read,
                    Err(_) => return self.unit_late(),
                }
            }
            None => read.await,
        };
        match read {
            Ok(0) | Err(_) => Flow::Done,
            Ok(_) => Flow::Again,
        }
    }

    /// The held unit did not complete within `unit_timeout`.
    fn unit_late(&mut self) -> Flow {
        let v = Violation::new(
            ViolationKind::ProtocolMismatch,
            None,
            format!(
                "a unit incomplete {} after its first byte",
                humantime::format_duration(self.unit_timeout)
            ),
        );
        self.violation(v)
    }

    /// Report mode hands the violation over and copies on unverified;
    /// otherwise the tunnel ends.
    fn violation(&mut self, v: Violation) -> Flow {
        match self.report {
            Some(report) => {
                report(&v);
                self.opaque = true;
                Flow::Again
            }
            None => Flow::End(End::Violation(v)),
        }
    }
}

/// The upstream's direction: observed on its way to the client (to follow
/// a handshake or an upgrade), never held back.
async fn downward<R, W>(shared: &Shared<'_>, mut from: R, mut to: W)
where
    R: AsyncRead + AsTcp + Unpin,
    W: AsyncWrite + AsTcp + Unpin,
{
    let touch = || shared.touch();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        if shared.client_opaque.load(Ordering::Relaxed) {
            // Nothing left to follow on this side either.
            drop(std::mem::take(&mut buf));
            Box::pin(tunnel::forward(
                &mut from,
                &mut to,
                &shared.down,
                &touch,
                None,
            ))
            .await;
            break;
        }
        // The rest of a response body of known length goes by
        // unobserved, exactly that many bytes.
        let body = shared.guard().server_body_left();
        if body > 0 {
            if let (Some(f), Some(t)) = (from.as_tcp(), to.as_tcp()) {
                buf = Vec::new();
                let before = shared.down.load(Ordering::Relaxed);
                let end = Box::pin(splice::splice(f, t, Some(body), &shared.down, &touch)).await;
                let passed = shared.down.load(Ordering::Relaxed) - before;
                shared.guard().server_passed(passed);
                shared.server_seen.notify_waiters();
                match end {
                    Spliced::Limit => continue,
                    Spliced::Unsupported => {}
                    Spliced::Eof | Spliced::Failed => break,
                }
            }
        }
        if buf.capacity() == 0 {
            if let Some(tcp) = from.as_tcp() {
                if tcp.readable().await.is_err() {
                    break;
                }
            }
        }
        buf.clear();
        buf.reserve(READ_CHUNK);
        let n = match from.read_buf(&mut (&mut buf).limit(READ_CHUNK)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Observe before forwarding: the client's answer to these bytes
        // must be judged in the state they create.
        shared.guard().server(&buf[..n]);
        shared.server_seen.notify_waiters();
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        shared.down.fetch_add(n as u64, Ordering::Relaxed);
        if !touch() {
            break;
        }
        if n < READ_CHUNK && from.as_tcp().is_some() {
            // Drained: hold no buffer while the upstream is quiet.
            buf = Vec::new();
        }
    }
    shared.server_closed.store(true, Ordering::Relaxed);
    shared.server_seen.notify_waiters();
    shared.ends.finish(&mut to).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::{DetectMemory, Payer as Holder};

    const CLIENT: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 7));
    use tokio::io::duplex;

    fn allowed() -> Host {
        Host::Name("allowed.test".into())
    }

    fn http_guard() -> Guard {
        Guard::Http(Box::new(HttpGuard::new(
            allowed(),
            80,
            guard::Limits::default(),
        )))
    }

    #[tokio::test(start_paused = true)]
    async fn silence_is_a_protocol_mismatch() {
        let (mut client, _peer) = duplex(1024);
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let mut held = Vec::new();
        let got = first(
            &mut client,
            &mut held,
            Carry::Tls,
            (&allowed(), 443),
            guard::Limits::default(),
            Duration::from_secs(1),
            &slots,
        )
        .await;
        let First::Denied(v) = got else {
            panic!("silence passed")
        };
        assert_eq!(v.kind, ViolationKind::ProtocolMismatch);
        assert!(v.detail.contains("nothing"), "{}", v.detail);
        assert_eq!(memory.available(), 4, "budget released");
        assert_eq!(memory.held_by(&Holder::Client(CLIENT)), 0, "share released");
    }

    #[tokio::test]
    async fn first_unit_is_judged_by_the_rules_carry() {
        let request = b"\r\nGET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
        for (carry, kind) in [
            (Carry::Tls, ViolationKind::ProtocolMismatch),
            (Carry::Http, ViolationKind::HostMismatch),
            (Carry::TlsOrHttp, ViolationKind::HostMismatch),
        ] {
            let (mut client, mut peer) = duplex(1024);
            peer.write_all(request).await.unwrap();
            let memory = DetectMemory::with_units(4, 4, 4);
            let slots = memory.scope(None, CLIENT);
            let mut held = Vec::new();
            let got = first(
                &mut client,
                &mut held,
                carry,
                (&allowed(), 80),
                guard::Limits::default(),
                Duration::from_secs(5),
                &slots,
            )
            .await;
            match got {
                First::Denied(v) => assert_eq!(v.kind, kind, "{carry}: {v}"),
                _ => panic!("{carry}: passed"),
            }
        }
        let (mut client, peer) = duplex(1024);
        drop(peer);
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let got = first(
            &mut client,
            &mut Vec::new(),
            Carry::Http,
            (&allowed(), 80),
            guard::Limits::default(),
            Duration::from_secs(5),
            &slots,
        )
        .await;
        assert!(matches!(got, First::Closed));
    }

    /// A tunnel judged by [`http_guard`], `held` not yet judged.
    fn judged(held: Vec<u8>) -> Judged {
        Judged {
            guard: http_guard(),
            held,
            verified: 0,
        }
    }

    /// The tests' watch: 5 s idle and unit timeouts, no report mode, no
    /// volume budget.
    fn watch<'a>(stop: &'a CancellationToken, detect: &'a DetectScope<'a>) -> Watch<'a> {
        Watch {
            idle: Duration::from_secs(5),
            unit_timeout: Duration::from_secs(5),
            stop,
            detect,
            report: None,
            volume: None,
        }
    }

    #[tokio::test]
    async fn a_second_request_for_another_host_never_reaches_the_upstream() {
        let (client, mut client_peer) = duplex(64 * 1024);
        let (upstream, mut upstream_peer) = duplex(64 * 1024);
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let stop = CancellationToken::new();
        let good = b"GET /a HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
        let bad = b"GET /b HTTP/1.1\r\nHost: other.test\r\n\r\n";
        let task = async { pump(client, upstream, judged(Vec::new()), watch(&stop, &slots)).await };
        let drive = async {
            client_peer.write_all(good).await.unwrap();
            let mut got = vec![0u8; good.len()];
            upstream_peer.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, good);
            upstream_peer
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            client_peer.write_all(bad).await.unwrap();
        };
        let ((totals, end), ()) = tokio::join!(task, drive);
        let End::Violation(v) = end else {
            panic!("second request passed: {end:?}")
        };
        assert_eq!(v.kind, ViolationKind::HostMismatch);
        assert_eq!(v.seen.as_deref(), Some("other.test"));
        assert_eq!(totals.up, good.len() as u64);
        let mut rest = Vec::new();
        upstream_peer.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "forwarded after the violation: {rest:?}");
    }

    /// Over TCP, bodies of known length move unjudged (spliced) both ways,
    /// counted exactly; the head after them is judged as ever.
    #[tokio::test]
    async fn after_bodies_of_known_length_the_next_head_is_judged() {
        let (client, mut client_peer) = crate::testing::tcp_pair().await;
        let (upstream, mut upstream_peer) = crate::testing::tcp_pair().await;
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let stop = CancellationToken::new();
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        let post = format!(
            "POST /a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let reply: Vec<u8> = (0..500_000u32).map(|i| (i % 241) as u8).collect();
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", reply.len());
        let bad = b"GET /b HTTP/1.1\r\nHost: other.test\r\n\r\n";
        let task = pump(client, upstream, judged(Vec::new()), watch(&stop, &slots));
        let drive = async {
            let up = async {
                client_peer.write_all(post.as_bytes()).await.unwrap();
                client_peer.write_all(&body).await.unwrap();
            };
            let got = async {
                let mut got = vec![0u8; post.len() + body.len()];
                upstream_peer.read_exact(&mut got).await.unwrap();
                got
            };
            let ((), got) = tokio::join!(up, got);
            assert!(
                got == [post.as_bytes(), &body].concat(),
                "request bytes differ"
            );
            let down = async {
                upstream_peer.write_all(head.as_bytes()).await.unwrap();
                upstream_peer.write_all(&reply).await.unwrap();
            };
            let got = async {
                let mut got = vec![0u8; head.len() + reply.len()];
                client_peer.read_exact(&mut got).await.unwrap();
                got
            };
            let ((), got) = tokio::join!(down, got);
            assert!(
                got == [head.as_bytes(), &reply].concat(),
                "response bytes differ"
            );
            client_peer.write_all(bad).await.unwrap();
        };
        let ((totals, end), ()) = tokio::join!(task, drive);
        let End::Violation(v) = end else {
            panic!("a head after the bodies passed: {end:?}")
        };
        assert_eq!(v.kind, ViolationKind::HostMismatch);
        assert_eq!(totals.up, (post.len() + body.len()) as u64);
        assert_eq!(totals.down, (head.len() + reply.len()) as u64);
        let mut rest = Vec::new();
        upstream_peer.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "forwarded after the violation: {rest:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_head_must_complete_within_the_unit_timeout() {
        let (client, mut client_peer) = duplex(64 * 1024);
        let (upstream, mut upstream_peer) = duplex(64 * 1024);
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let stop = CancellationToken::new();
        let good = b"GET /a HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
        let task = pump(
            client,
            upstream,
            judged(Vec::new()),
            Watch {
                idle: Duration::from_secs(300),
                unit_timeout: Duration::from_secs(10),
                ..watch(&stop, &slots)
            },
        );
        let drive = async {
            client_peer.write_all(good).await.unwrap();
            let mut got = vec![0u8; good.len()];
            upstream_peer.read_exact(&mut got).await.unwrap();
            upstream_peer
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            // A second head, one byte every few seconds, never finished.
            // (Writes fail once the tunnel is cut.)
            for b in b"GET /b HTTP/1.1\r\nHost: allo" {
                if client_peer.write_all(&[*b]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            (client_peer, upstream_peer)
        };
        let ((totals, end), _peers) = tokio::join!(task, drive);
        let End::Violation(v) = end else {
            panic!("a trickled head was held open: {end:?}")
        };
        assert_eq!(v.kind, ViolationKind::ProtocolMismatch);
        assert!(v.detail.contains("incomplete"), "{}", v.detail);
        assert_eq!(totals.up, good.len() as u64, "nothing of the second head");
    }

    #[tokio::test]
    async fn report_mode_hands_over_the_violation_and_carries_on() {
        let (client, mut client_peer) = duplex(64 * 1024);
        let (upstream, mut upstream_peer) = duplex(64 * 1024);
        let memory = DetectMemory::with_units(4, 4, 4);
        let slots = memory.scope(None, CLIENT);
        let stop = CancellationToken::new();
        let seen = Mutex::new(Vec::new());
        let report = |v: &Violation| seen.lock().unwrap().push(v.kind);
        let bytes = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
        let task = pump(
            client,
            upstream,
            judged(bytes.to_vec()),
            Watch {
                report: Some(&report),
                ..watch(&stop, &slots)
            },
        );
        let drive = async {
            let mut got = vec![0u8; bytes.len()];
            upstream_peer.read_exact(&mut got).await.unwrap();
            drop(upstream_peer);
            client_peer.shutdown().await.unwrap();
        };
        let ((totals, end), ()) = tokio::join!(task, drive);
        assert_eq!(end, End::Closed);
        assert_eq!(totals.up, bytes.len() as u64);
        assert_eq!(*seen.lock().unwrap(), vec![ViolationKind::HostMismatch]);
    }
}
