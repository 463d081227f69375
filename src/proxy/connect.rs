//! The tunnel step shared by HTTP CONNECT and SOCKS5 CONNECT.
//!
//! [`open`]: decide the target, record a refusal, dial exactly a checked
//! address. The caller then tells its client (a `200`, a SOCKS5 reply) and
//! hands the client stream to [`run`]: detect the first client bytes, check
//! a ClientHello's SNI or an HTTP Host against the target, record the
//! decision, replay the held bytes and copy until close, record the close.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tracing::debug;

use super::tunnel::{self, Detected};
use super::{dial, Ctx, DialError, View};
use crate::evidence::{Kind, Mode, Record};
use crate::policy::{Reason, Verdict};
use crate::proto::target::{normalize_host, parse_authority, Host};

/// An allowed target with its upstream connected; the decision record is
/// not written yet (that waits for the client's first bytes).
pub struct Opened {
    pub upstream: TcpStream,
    pub host: Host,
    pub record: Record,
    /// The view the connection was decided under (report mode, and the
    /// rules an intercepted connection's requests are decided by).
    pub view: View,
}

/// Why no tunnel was opened; the record is written.
#[derive(Debug)]
pub enum Refused {
    /// Denied (by policy, or because evidence is unavailable). `reason`
    /// is what the client is told: `evidence_unavailable` if the record
    /// itself could not be written.
    Denied {
        reason: Reason,
        record: String,
        detail: Option<String>,
    },
    /// Allowed, but no checked address could be reached.
    Unreachable {
        error: DialError,
        record: String,
        /// `false`: the record could not be written either.
        written: bool,
    },
}

/// Decide `host:port` for the view's client, and dial it if allowed.
pub async fn open(
    ctx: &Ctx,
    view: &View,
    mode: Mode,
    peer: SocketAddr,
    host: Host,
    port: u16,
) -> Result<Opened, Refused> {
    let outcome = ctx.decide_in(mode, view, &host, port).await;
    let target = (Some(&host), Some(port));
    if !outcome.verdict.is_allow() {
        let detail = outcome.detail.as_deref();
        let (reason, record) = record_denial(
            ctx,
            view,
            (Kind::Tcp, mode),
            peer,
            &outcome.verdict,
            target,
            detail,
        )
        .await;
        return Err(Refused::Denied {
            reason,
            record,
            detail: outcome.detail,
        });
    }
    if !ctx.evidence.is_healthy() {
        let verdict = Verdict {
            reason: Reason::EvidenceUnavailable,
            ..outcome.verdict
        };
        let (reason, record) =
            record_denial(ctx, view, (Kind::Tcp, mode), peer, &verdict, target, None).await;
        return Err(Refused::Denied {
            reason,
            record,
            detail: None,
        });
    }
    let mut record = view.record(
        Kind::Tcp,
        mode,
        peer,
        &outcome.verdict,
        Some(&host),
        Some(port),
    );
    match dial(&outcome.dial, port, ctx.limits.connect_timeout).await {
        Ok((upstream, addr)) => {
            record.ip = Some(addr.ip());
            Ok(Opened {
                upstream,
                host,
                record,
                view: view.clone(),
            })
        }
        Err(error) => {
            let written = record_dial_failure(ctx, &mut record, &error).await;
            Err(Refused::Unreachable {
                error,
                record: record.id,
                written,
            })
        }
    }
}

/// Write the record of a denial; returns the reason the client is told
/// (`evidence_unavailable` if the record could not be written) and the
/// record id.
pub async fn record_denial(
    ctx: &Ctx,
    view: &View,
    (kind, mode): (Kind, Mode),
    peer: SocketAddr,
    verdict: &Verdict,
    (host, port): (Option<&Host>, Option<u16>),
    detail: Option<&str>,
) -> (Reason, String) {
    let mut record = view.record(kind, mode, peer, verdict, host, port);
    record.detail = detail.map(str::to_string);
    let reason = if ctx.write(&mut record).await {
        verdict.reason
    } else {
        Reason::EvidenceUnavailable
    };
    debug!(reason = %reason, record = %record.id, "denied");
    (reason, record.id)
}

/// An allowed decision whose upstream could not be reached: record it
/// (keeping `decision: allow`) with the error and the last address tried.
pub async fn record_dial_failure(ctx: &Ctx, record: &mut Record, err: &DialError) -> bool {
    record.detail = Some(err.to_string());
    if let DialError::Timeout { addr } | DialError::Io { addr, .. } = err {
        record.ip = Some(addr.ip());
    }
    ctx.write(record).await
}

/// After the client was told the tunnel is open: check its first bytes
/// against the target, record the decision, then copy until close.
/// `first` holds client bytes already read past the handshake (a client
/// that sent data before the reply); they are detected and replayed too.
pub async fn run<C>(ctx: Arc<Ctx>, mut client: C, opened: Opened, mut first: Vec<u8>)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Opened {
        upstream,
        host,
        mut record,
        view,
    } = opened;
    let report = view.is_report();
    let Ok(detect_slot) = ctx.detect_slots.try_acquire() else {
        record.reason = Reason::LimitExceeded;
        record.decision = Reason::LimitExceeded.decision();
        record.rule = None;
        record.detail = Some(super::DETECT_BUDGET_EXHAUSTED.into());
        ctx.write(&mut record).await;
        return;
    };
    let detected = tunnel::detect(&mut client, &mut first, ctx.limits.detect_timeout).await;
    // The budget bounds bytes held before decisions, not open tunnels.
    drop(detect_slot);
    let mismatch = match &detected {
        Detected::Tls(hello) => {
            record.sni = hello.sni.clone();
            match (&host, &hello.sni) {
                (Host::Name(_), Some(sni)) => match normalize_host(sni) {
                    Ok(sni_host) if sni_host == host => None,
                    _ => Some(Reason::SniMismatch),
                },
                _ => None,
            }
        }
        Detected::Malformed(why) => {
            record.detail = Some((*why).to_string());
            Some(Reason::BadRequest)
        }
        // Plain HTTP in a tunnel: its Host picks the virtual host at the
        // upstream, so it must name the tunnel's host too.
        Detected::Http(Some(h)) => match (&host, parse_authority(h, Some(80))) {
            (Host::Name(_), Ok((req_host, _))) if req_host != host => Some(Reason::HostMismatch),
            (Host::Name(_), Err(_)) => Some(Reason::HostMismatch),
            _ => None,
        },
        Detected::Http(None) | Detected::NotTls | Detected::Silent | Detected::Closed => None,
    };
    match mismatch {
        Some(reason) if report && reason.reportable() => {
            record.would_deny.get_or_insert(reason);
            record.reason = Reason::ReportOnly;
            record.decision = Reason::ReportOnly.decision();
        }
        Some(reason) => {
            record.reason = reason;
            record.decision = reason.decision();
            record.rule = None;
            record.would_deny = None;
            ctx.write(&mut record).await;
            debug!(reason = %reason, record = %record.id, "tunnel denied after detection");
            return; // both sides dropped: nothing reached the upstream
        }
        None => {}
    }
    // Opt-in TLS interception (src/intercept): only for an allow rule with
    // `intercept = true`; a non-TLS tunnel to such a host is refused.
    let plan = crate::intercept::plan(ctx.intercept.as_deref(), &view, &mut record, &detected);
    if !ctx.write(&mut record).await || detected == Detected::Closed || !record.reason.is_allow() {
        return;
    }
    if plan == crate::intercept::Plan::Intercept {
        let mode = record.mode;
        if let Some(s) = crate::intercept::serve::Session::new(ctx.clone(), view, mode, record) {
            crate::intercept::serve::serve(s, client, first, upstream).await;
        }
        return;
    }
    let started = Instant::now();
    let totals = tunnel::pump(
        client,
        upstream,
        &first,
        ctx.limits.idle_timeout,
        &ctx.hard_stop,
    )
    .await;
    let mut close = record.close(totals.up, totals.down, started.elapsed().as_millis() as u64);
    // Nothing waits on a close record: queue it (it is never dropped).
    ctx.submit(&mut close);
}
