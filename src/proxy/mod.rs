//! The proxy: shared state, the decide-then-record step every mode uses, and
//! the accept loop.
//!
//! - The modes: [`explicit`] (CONNECT and absolute-form HTTP/1.1),
//!   [`socks5`], [`transparent`]. Tunnels of every mode go through
//!   [`connect`]: detection and copying in [`tunnel`] (zero-copy with
//!   splice(2) in [`splice`]), verification of what a tunnel carries in
//!   [`verify`], opt-in TLS interception in [`intercept`].
//! - A decided connection carries its own state ([`conn::Conn`]) from the
//!   decision to the close; evidence records are built from it when written.
//! - HTTP (explicit mode, intercepted connections) is served and forwarded
//!   through one layer, [`http`], and a forwarded request ends in
//!   [`forward`].
//! - Whatever fails is told to the client from one mapping, [`failure`].
//! - Connection caps and rate limits, charged to the org a connection is
//!   decided for (strangers to their own address), and the shares of
//!   detection memory: [`crate::limits`]. Denials over a client's record rate
//!   are written as summaries: [`denials`].

pub mod conn;
pub mod connect;
pub mod denials;
pub mod explicit;
pub mod failure;
pub mod forward;
pub mod http;
pub mod intercept;
pub mod pool;
pub mod socks5;
pub mod splice;
pub mod transparent;
pub mod tunnel;
pub mod verify;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::config::Limits;
use crate::evidence::{Evidence, Kind, Mode, Record};
use crate::metrics::Metrics;
use crate::policy::{Credential, Decision, IdentityError, OrgRef, Policy, Reason, Verdict};
use crate::proto::target::Host;
use crate::resolve::Resolver;
use crate::served::{Served, ServedHandle};

use crate::bindings::NameBindings;
use crate::limits::{ConnLimits, DetectMemory, DetectScope, LimitHit, Permit};

/// Detail of a `limit_exceeded` when detection buffers are all in use.
pub const DETECT_BUDGET_EXHAUSTED: &str =
    "max_detect_memory_bytes (or the share of this org or address) in use: no room to read the first bytes";

/// Everything a connection handler needs, shared by all connections.
pub struct Ctx {
    /// What is served (policy, interception, credentials); a reload swaps
    /// it whole. Read it through [`Ctx::view`]: once per decision.
    pub served: ServedHandle,
    pub evidence: Arc<Evidence>,
    pub metrics: Arc<Metrics>,
    pub resolver: Arc<Resolver>,
    /// The DNS shim's bindings, when it runs.
    pub bindings: Option<Arc<dyn NameBindings>>,
    pub limits: Limits,
    pub conns: ConnLimits,
    /// Which denials are written one by one, and the tallies of the rest.
    pub denials: denials::Denials,
    /// Memory held for first bytes before decisions: a global pool, a
    /// share per org and per address of no org (see [`DetectMemory`]).
    pub detect: DetectMemory,
    /// Refused connections being drained before close (bounded).
    pub refusal_drains: Arc<tokio::sync::Semaphore>,
    /// Idle upstream connections of absolute-form HTTP kept for reuse.
    pub upstream_pool: pool::UpstreamPool,
    /// Stop accepting; finish in-flight requests.
    pub shutdown: CancellationToken,
    /// The drain grace period is over: close tunnels now.
    pub hard_stop: CancellationToken,
    pub tasks: TaskTracker,
}

/// An allow refused because its org's evidence budget is spent: the same
/// decision as `limit_exceeded`, naming no rule.
pub fn budget_spent(allowed: Verdict) -> Verdict {
    Verdict {
        reason: Reason::LimitExceeded,
        rule: None,
        ..allowed
    }
}

/// One decision's view of what is served: the [`Served`] state as it was
/// when the request arrived (its `policy`, `intercept` and credentials are
/// reached through this view), and the client's org in it. Everything
/// about one request (org, decision, interception, the policy hash in its
/// records) comes from the same view, whatever a reload does meanwhile.
#[derive(Debug, Clone)]
pub struct View {
    pub served: Arc<Served>,
    pub org: Option<OrgRef>,
}

impl std::ops::Deref for View {
    type Target = Served;

    fn deref(&self) -> &Served {
        &self.served
    }
}

impl View {
    /// A decision record for this client and target.
    pub fn record(
        &self,
        kind: Kind,
        mode: Mode,
        client: SocketAddr,
        verdict: &Verdict,
        host: Option<&Host>,
        port: Option<u16>,
    ) -> Record {
        let mut r = Record::decision(kind, mode, client, verdict, self.policy.hash_arc());
        r.host = host.map(|h| h.to_string());
        r.port = port;
        r
    }

    /// The record of a refusal decided before any target: `reason`, for
    /// this view's client, with `detail`.
    pub fn refusal(
        &self,
        (kind, mode): (Kind, Mode),
        client: SocketAddr,
        reason: Reason,
        detail: String,
    ) -> Record {
        let mut r = self.record(kind, mode, client, &self.verdict(reason), None, None);
        r.detail = Some(detail);
        r
    }

    /// Whether the client's org only reports its allowlist's denials.
    pub fn is_report(&self) -> bool {
        self.org.as_ref().is_some_and(|o| self.policy.is_report(o))
    }

    /// A verdict of this view's org, decided without a rule.
    pub fn verdict(&self, reason: Reason) -> Verdict {
        Verdict {
            org: self.org.clone(),
            reason,
            rule: None,
            would_deny: None,
        }
    }
}

/// A policy decision for one target, with the addresses that may be dialled.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub verdict: Verdict,
    pub dial: Vec<IpAddr>,
    /// Why resolution failed, for evidence and the response.
    pub detail: Option<String>,
}

impl Ctx {
    /// Pay for an allow's record from the evidence budget of `view`'s org,
    /// at its decision, before anything is dialled or forwarded; `false`:
    /// spent, the allow is to be refused ([`budget_spent`]).
    pub fn pay_allow(&self, view: &View) -> bool {
        self.denials
            .pay_allow(&view.org.as_ref().map(|o| o.name.clone()))
    }

    /// What is served now, and the client's org in it.
    pub fn view(&self, client: IpAddr) -> View {
        let served = self.served.load_full();
        let org = served.policy.org_for(client);
        View { served, org }
    }

    /// What is served now, and the org of a client that presented
    /// `credential` (see the identity table in [`crate::policy`]). On
    /// failure, a view without an org to record the refusal under.
    pub fn view_as(
        &self,
        client: IpAddr,
        credential: Option<Credential<'_>>,
    ) -> Result<View, (View, IdentityError)> {
        let served = self.served.load_full();
        match served.policy.org_for_identity(client, credential) {
            Ok(org) => Ok(View { served, org }),
            Err(e) => Err((View { served, org: None }, e)),
        }
    }

    /// [`Ctx::decide`], timed under `mode`'s label: for modes whose whole
    /// decision is this one call (explicit, SOCKS5). Transparent mode
    /// decides in several steps and times them together itself.
    pub async fn decide_in(&self, mode: Mode, view: &View, host: &Host, port: u16) -> Outcome {
        let started = std::time::Instant::now();
        let outcome = self.decide(view, host, port).await;
        self.metrics.time_decision(mode, started.elapsed());
        outcome
    }

    /// Decide `host:port` for the view's client: the name step, resolution
    /// when the name is allowed, then the address step. Not timed.
    pub async fn decide(&self, view: &View, host: &Host, port: u16) -> Outcome {
        let Some(org) = &view.org else {
            return Outcome {
                verdict: Verdict {
                    org: None,
                    reason: Reason::UnknownClient,
                    rule: None,
                    would_deny: None,
                },
                dial: Vec::new(),
                detail: None,
            };
        };
        decide_with(&view.policy, &self.resolver, org, host, port).await
    }

    /// Write a record and wait until it is with the operating system.
    /// `false` means evidence is unavailable and the caller must not let
    /// anything through. A denial over its client's record rate is counted
    /// into a summary instead (its id becomes [`denials::SUMMARISED`]).
    pub async fn write(&self, record: &mut Record) -> bool {
        if self.summarised(record) {
            return true;
        }
        match self.evidence.write(record).await {
            Ok(()) => {
                self.metrics.count_record(record);
                true
            }
            Err(e) => {
                warn!(error = %e, "evidence write failed; denying");
                false
            }
        }
    }

    /// Whether `record`, a denial over its client's record rate, was
    /// counted into a summary (and in the metrics) rather than written.
    fn summarised(&self, record: &mut Record) -> bool {
        let now = (std::time::Instant::now(), std::time::SystemTime::now());
        if self.denials.admit(record, now.0, now.1) {
            return false;
        }
        record.id = denials::SUMMARISED.to_string();
        // What the client is shown: the summary, not a record of its own.
        record.reference = Some(denials::SUMMARISED.to_string());
        self.metrics.count_record(record);
        let org = record.org.as_deref().unwrap_or(crate::metrics::UNKNOWN_ORG);
        self.metrics
            .evidence_suppressed_total
            .with_label_values(&[org])
            .inc();
        true
    }

    /// Queue a record without waiting (close records, refusals that let
    /// nothing through). Its id is assigned at once; it is never dropped,
    /// but a denial over its client's record rate goes into a summary.
    pub fn submit(&self, record: &mut Record) {
        if self.summarised(record) {
            return;
        }
        self.evidence.submit(record);
        self.metrics.count_record(record);
    }

    /// Write the denial summaries (every [`denials::SUMMARY_INTERVAL`],
    /// and once at shutdown), counted in the metrics' record totals.
    pub async fn flush_denials(&self) {
        self.denials.flush(&self.evidence).await;
    }

    /// Where the first bytes of `client`, of `view`'s org, are charged.
    pub fn detect_scope(&self, view: &View, client: SocketAddr) -> DetectScope<'_> {
        self.detect.scope(view.org.as_ref(), client.ip())
    }

    /// Charge the connection's `permit` to the org of `view`, the one it
    /// is decided for (see [`crate::limits`]); over that org's cap or rate, the
    /// limit to name in the refusal.
    pub fn charge(&self, permit: &Permit, view: &View) -> Result<(), LimitHit> {
        self.conns.charge(permit, view.org.as_ref())
    }
}

/// The decision procedure shared by the proxy and `palisade explain`.
pub async fn decide_with(
    policy: &Policy,
    resolver: &Resolver,
    org: &OrgRef,
    host: &Host,
    port: u16,
) -> Outcome {
    match policy.decide_for_org(org, host, port) {
        Decision::Final(verdict) => {
            let dial = match host {
                Host::Ip(ip) if verdict.is_allow() => vec![*ip],
                _ => Vec::new(),
            };
            Outcome {
                verdict,
                dial,
                detail: None,
            }
        }
        Decision::Resolve(pending) => {
            // The policy asks to resolve names only; anything else fails closed.
            let Host::Name(name) = host else {
                return Outcome {
                    verdict: Verdict {
                        org: Some(org.clone()),
                        reason: Reason::BadRequest,
                        rule: None,
                        would_deny: None,
                    },
                    dial: Vec::new(),
                    detail: Some("internal: resolve asked for an address".into()),
                };
            };
            match resolver.lookup(name).await {
                Ok(addrs) => {
                    let av = policy.check_addresses(&pending, &addrs);
                    Outcome {
                        verdict: av.verdict,
                        dial: av.dial,
                        detail: None,
                    }
                }
                Err(e) => Outcome {
                    verdict: Verdict {
                        org: Some(org.clone()),
                        reason: Reason::ResolutionFailed,
                        rule: pending.rule.clone(),
                        would_deny: None,
                    },
                    dial: Vec::new(),
                    detail: Some(e.to_string()),
                },
            }
        }
    }
}

/// Why dialling every checked address failed.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("connecting to {addr} timed out")]
    Timeout { addr: SocketAddr },
    #[error("connecting to {addr} failed: {source}")]
    Io { addr: SocketAddr, source: io::Error },
    #[error("no address to dial")]
    NoAddress,
}

impl DialError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            DialError::Timeout { .. } => "timeout",
            DialError::Io { source, .. } => match source.kind() {
                io::ErrorKind::ConnectionRefused => "refused",
                io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => "unreachable",
                _ => "other",
            },
            DialError::NoAddress => "no_address",
        }
    }
}

impl Ctx {
    /// [`dial`] within `connect_timeout`, failures counted.
    pub async fn dial(
        &self,
        addrs: &[IpAddr],
        port: u16,
    ) -> Result<(TcpStream, SocketAddr), DialError> {
        dial(
            &self.metrics,
            addrs,
            port,
            self.limits.connect_timeout.get(),
        )
        .await
    }
}

/// Dial the checked addresses in order until one answers; returns the
/// stream and the address it reached, or the last error. Each failed
/// address counts in `palisade_upstream_connect_errors_total`.
pub async fn dial(
    metrics: &Metrics,
    addrs: &[IpAddr],
    port: u16,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), DialError> {
    let mut last = DialError::NoAddress;
    for ip in addrs {
        let addr = SocketAddr::new(*ip, port);
        match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok((stream, addr));
            }
            Ok(Err(source)) => last = DialError::Io { addr, source },
            Err(_) => last = DialError::Timeout { addr },
        }
        metrics.count_connect_error(last.kind());
        debug!(%addr, error = %last, "dial failed; trying next address");
    }
    Err(last)
}

/// The accept loop every TCP listener shares: stop on shutdown, hold back
/// while the evidence queue is full (records are never dropped), back off on
/// accept errors, take a connection permit (charged to the address's org,
/// or to the address itself: see [`crate::limits`]), then `serve` the connection
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
    R: Fn(&Ctx, TcpStream, SocketAddr, &View, LimitHit),
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

/// Accept connections on an explicit-proxy listener until shutdown.
pub async fn serve_explicit(ctx: Arc<Ctx>, listener: TcpListener) {
    accept_loop(
        ctx,
        listener,
        "explicit",
        |ctx, stream, peer, view, permit| {
            explicit::serve_connection(ctx, stream, peer, view.org, permit)
        },
        reject_over_limit,
    )
    .await
}

/// Over a connection cap: record it, answer 503 without waiting, close.
fn reject_over_limit(ctx: &Ctx, stream: TcpStream, peer: SocketAddr, view: &View, hit: LimitHit) {
    let mut record = view.refusal(
        (Kind::Tcp, Mode::Explicit),
        peer,
        Reason::LimitExceeded,
        hit.describe().to_string(),
    );
    ctx.submit(&mut record);
    let response = failure::Failure::Denied(Reason::LimitExceeded).raw_response(record.shown());
    // Non-blocking: a flood must not tie up the accept loop.
    if stream.try_write(response.as_bytes()).is_err() {
        return;
    }
    // Closing with the request unread would reset the connection and could
    // destroy the 503 before the client reads it: drain briefly first, in a
    // bounded number of short-lived tasks (beyond them, just close).
    let Ok(permit) = ctx.refusal_drains.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut stream = stream;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
        let mut sink = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + REFUSAL_DRAIN_TIME;
        let mut left = REFUSAL_DRAIN_BYTES;
        while left > 0 {
            match tokio::time::timeout_at(
                deadline,
                tokio::io::AsyncReadExt::read(&mut stream, &mut sink),
            )
            .await
            {
                Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
                _ => break,
            }
        }
    });
}

/// How long, and how many bytes, a refused connection is drained before closing.
const REFUSAL_DRAIN_TIME: Duration = Duration::from_millis(500);
const REFUSAL_DRAIN_BYTES: usize = 64 * 1024;
/// Refused connections drained at once.
pub const MAX_REFUSAL_DRAINS: usize = 256;
