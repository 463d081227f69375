//! The proxy: shared state, the decide-then-record step every mode uses, and
//! the accept loop. Explicit mode (CONNECT and absolute-form HTTP/1.1) lives
//! in [`explicit`]; byte copying and ClientHello detection in [`tunnel`].

pub mod deny;
pub mod explicit;
pub mod limits;
pub mod tunnel;

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
use crate::policy::{Decision, OrgRef, Policy, Reason, Verdict};
use crate::proto::target::Host;
use crate::resolve::Resolver;

use self::limits::ConnLimits;

/// Everything a connection handler needs, shared by all connections.
pub struct Ctx {
    pub policy: Arc<Policy>,
    pub policy_hash: Arc<str>,
    pub evidence: Arc<Evidence>,
    pub resolver: Arc<Resolver>,
    pub limits: Limits,
    pub conns: ConnLimits,
    /// Stop accepting; finish in-flight requests.
    pub shutdown: CancellationToken,
    /// The drain grace period is over: close tunnels now.
    pub hard_stop: CancellationToken,
    pub tasks: TaskTracker,
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
    /// Decide `host:port` for a client of `org`: the name step, resolution
    /// when the name is allowed, then the address step.
    pub async fn decide(&self, org: Option<&OrgRef>, host: &Host, port: u16) -> Outcome {
        let Some(org) = org else {
            return Outcome {
                verdict: Verdict {
                    org: None,
                    reason: Reason::UnknownClient,
                    rule: None,
                },
                dial: Vec::new(),
                detail: None,
            };
        };
        decide_with(&self.policy, &self.resolver, org, host, port).await
    }

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
        let mut r = Record::decision(kind, mode, client, verdict, &self.policy_hash);
        r.host = host.map(|h| h.to_string());
        r.port = port;
        r
    }

    /// Write a record and wait until it is with the operating system.
    /// `false` means evidence is unavailable and the caller must not let
    /// anything through.
    pub async fn write(&self, record: &mut Record) -> bool {
        match self.evidence.write(record).await {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "evidence write failed; denying");
                false
            }
        }
    }

    /// Queue a record without waiting (close records, refusals that let
    /// nothing through). Its id is assigned at once; it is never dropped.
    pub fn submit(&self, record: &mut Record) {
        self.evidence.submit(record);
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
            let dial = match (&verdict.reason, host) {
                (Reason::RuleMatch, Host::Ip(ip)) => vec![*ip],
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
                        rule: Some(pending.rule.clone()),
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

/// Dial the checked addresses in order until one answers; returns the
/// stream and the address it reached, or the last error.
pub async fn dial(
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
        debug!(%addr, error = %last, "dial failed; trying next address");
    }
    Err(last)
}

/// Accept connections on an explicit-proxy listener until shutdown.
pub async fn serve_explicit(ctx: Arc<Ctx>, listener: TcpListener) {
    loop {
        // A full evidence queue holds new connections back (never drops records).
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
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let org = ctx.policy.org_for(peer.ip());
        match ctx.conns.try_acquire(org.as_ref()) {
            Some(permit) => {
                let ctx2 = ctx.clone();
                ctx.tasks.spawn(async move {
                    explicit::serve_connection(ctx2, stream, peer, org, permit).await;
                });
            }
            None => reject_over_limit(&ctx, stream, peer, org.as_ref()),
        }
    }
}

/// Over a connection cap: record it, answer 503 without waiting, close.
fn reject_over_limit(ctx: &Ctx, stream: TcpStream, peer: SocketAddr, org: Option<&OrgRef>) {
    let verdict = Verdict {
        org: org.cloned(),
        reason: Reason::LimitExceeded,
        rule: None,
    };
    let mut record = ctx.record(Kind::Tcp, Mode::Explicit, peer, &verdict, None, None);
    ctx.submit(&mut record);
    let response = deny::raw_response(Reason::LimitExceeded, Some(&record.id));
    // Best effort and non-blocking: a flood must not tie up tasks here.
    let _ = stream.try_write(response.as_bytes());
}
