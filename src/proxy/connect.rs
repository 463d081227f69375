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
use super::{dial, verify, Ctx, DialError, View};
use crate::config::Carry;
use crate::evidence::{Kind, Mode, Record};
use crate::policy::{Reason, Verdict};
use crate::proto::guard;
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
/// against the target and the rule's [`Carry`], record the decision, then
/// copy until close (verifying every later byte unless the rule says
/// `opaque`), and record the close. `first` holds client bytes already read
/// past the handshake (a client that sent data before the reply); they are
/// judged and replayed too.
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
    let port = record.port.unwrap_or(0);
    let carry = match &view.org {
        Some(org) => view.policy.carry(
            org,
            record.rule.as_deref(),
            matches!(host, Host::Name(_)),
            port,
        ),
        None => Carry::Opaque,
    };
    if carry == Carry::Opaque {
        return run_opaque(ctx, client, upstream, host, record, view, first).await;
    }
    // Bytes held to judge the first unit are charged to the detection
    // budget inside `verify::first`, and released once it is judged.
    let judged = verify::first(
        &mut client,
        &mut first,
        carry,
        (&host, port),
        guard_limits(&ctx),
        ctx.limits.detect_timeout,
        &ctx.detect_slots,
    )
    .await;
    let (guard, verified) = match judged {
        verify::First::Passed { guard, forward } => (Some(guard), forward),
        verify::First::Closed => {
            // Nothing was sent, so nothing flowed: the allow stands on record.
            record.tunnel = Some(carry);
            ctx.write(&mut record).await;
            return;
        }
        verify::First::OverBudget => {
            deny_over_budget(&ctx, &mut record).await;
            return;
        }
        verify::First::Denied(v) => {
            let reason = verify::reason(v.kind);
            if !(view.is_report() && reason.reportable()) {
                deny_first(&ctx, &mut record, &v).await;
                return; // both sides dropped: nothing reached the upstream
            }
            record.would_deny.get_or_insert(reason);
            record.reason = Reason::ReportOnly;
            record.detail = Some(v.detail);
            (None, 0)
        }
    };
    let detected = guard.as_ref().map(verify::Guard::detected);
    if let Some(Detected::Tls(hello)) = &detected {
        record.sni = hello.sni.clone();
    }
    record.tunnel = Some(guard.as_ref().map_or(Carry::Opaque, verify::Guard::carry));
    // Opt-in TLS interception ([`super::intercept`]): only for an allow rule with
    // `intercept = true` (which carries TLS, so the hello was checked).
    let plan = super::intercept::plan(
        ctx.intercept.as_deref(),
        &view,
        &mut record,
        detected.as_ref().unwrap_or(&Detected::NotTls),
    );
    if !ctx.write(&mut record).await || !record.reason.is_allow() {
        return;
    }
    if plan == super::intercept::Plan::Intercept {
        let mode = record.mode;
        if let Some(s) = super::intercept::serve::Session::new(ctx.clone(), view, mode, record) {
            super::intercept::serve::serve(s, client, first, upstream).await;
        }
        return;
    }
    relay(
        &ctx, client, upstream, guard, first, verified, &record, &view,
    )
    .await;
}

/// The bounds a tunnel verifier applies: the explicit listener's head limits.
pub fn guard_limits(ctx: &Ctx) -> guard::Limits {
    guard::Limits {
        max_head_bytes: ctx.limits.max_request_head_bytes,
        max_headers: ctx.limits.max_headers,
    }
}

/// Copy an allowed tunnel until close, then queue its close record. With a
/// `guard`, every client byte past `held[..verified]` is judged first, and
/// a violation on the way is recorded as a denial of its own (linked to the
/// tunnel's allow record by `conn`), or, in report mode, as what
/// enforcement would have denied. Without one (opaque), `held` is replayed
/// and the rest copied blind.
#[allow(clippy::too_many_arguments)]
pub async fn relay<C>(
    ctx: &Ctx,
    client: C,
    upstream: TcpStream,
    guard: Option<verify::Guard>,
    held: Vec<u8>,
    verified: usize,
    record: &Record,
    view: &View,
) where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let started = Instant::now();
    let Some(guard) = guard else {
        let totals = tunnel::pump(
            client,
            upstream,
            &held,
            ctx.limits.idle_timeout,
            &ctx.hard_stop,
        )
        .await;
        close(ctx, record, totals, started);
        return;
    };
    let report_violation = |v: &guard::Violation| {
        let reason = verify::reason(v.kind);
        let mut r = violation_record(record, v);
        if reason.reportable() {
            r.would_deny = Some(reason);
            r.reason = Reason::ReportOnly;
            r.rule = record.rule.clone();
        }
        ctx.submit(&mut r);
    };
    let report: Option<&(dyn Fn(&guard::Violation) + Sync)> = if view.is_report() {
        Some(&report_violation)
    } else {
        None
    };
    let (totals, end) = verify::pump(
        client,
        upstream,
        guard,
        held,
        verified,
        ctx.limits.idle_timeout,
        &ctx.hard_stop,
        &ctx.detect_slots,
        report,
    )
    .await;
    match end {
        verify::End::Closed => {}
        verify::End::Violation(v) => {
            let mut r = violation_record(record, &v);
            ctx.write(&mut r).await;
            debug!(reason = %r.reason, record = %r.id, "tunnel cut by verification");
        }
        verify::End::OverBudget => {
            let mut r = violation_record(
                record,
                &guard::Violation::new(
                    guard::ViolationKind::Malformed,
                    None,
                    super::DETECT_BUDGET_EXHAUSTED,
                ),
            );
            r.reason = Reason::LimitExceeded;
            ctx.write(&mut r).await;
        }
    }
    close(ctx, record, totals, started);
}

/// The denial of a unit inside an allowed tunnel: the name actually
/// presented (when there was one) as `host`, linked to the tunnel's allow
/// record by `conn`.
fn violation_record(allow: &Record, v: &guard::Violation) -> Record {
    let reason = verify::reason(v.kind);
    let mut r = allow.clone();
    r.id = String::new();
    r.ts = String::new();
    r.reason = reason;
    r.rule = None;
    r.would_deny = None;
    r.conn = Some(allow.id.clone());
    r.detail = Some(v.detail.clone());
    r.intercepted = None;
    name_seen(&mut r, v);
    r
}

/// A verification denial names what the client actually presented: the
/// SNI of a hello (`sni`), the Host of a request (`host`, normalised where
/// it can be). The tunnel's own target stays in the allow record.
fn name_seen(r: &mut Record, v: &guard::Violation) {
    let Some(seen) = &v.seen else {
        return;
    };
    match v.kind {
        guard::ViolationKind::SniMismatch | guard::ViolationKind::EchNotAllowed => {
            r.sni = Some(seen.clone())
        }
        _ => {
            r.host = Some(match normalize_host(seen) {
                Ok(h) => h.to_string(),
                Err(_) => seen.clone(),
            })
        }
    }
}

/// The first unit failed: the tunnel's decision record becomes the denial,
/// naming what the client presented (the target stays in `detail`).
async fn deny_first(ctx: &Ctx, record: &mut Record, v: &guard::Violation) {
    let reason = verify::reason(v.kind);
    record.reason = reason;
    record.rule = None;
    record.would_deny = None;
    record.detail = Some(v.detail.clone());
    name_seen(record, v);
    ctx.write(record).await;
    debug!(reason = %reason, record = %record.id, "tunnel denied on its first bytes");
}

async fn deny_over_budget(ctx: &Ctx, record: &mut Record) {
    record.reason = Reason::LimitExceeded;
    record.rule = None;
    record.detail = Some(super::DETECT_BUDGET_EXHAUSTED.into());
    ctx.write(record).await;
}

/// Queue the close record (nothing waits on it; it is never dropped).
fn close(ctx: &Ctx, record: &Record, totals: tunnel::Totals, started: Instant) {
    let mut close = record.close(totals.up, totals.down, started.elapsed().as_millis() as u64);
    ctx.submit(&mut close);
}

/// A tunnel whose rule lets it carry anything (`tunnel = "opaque"`, cidr
/// rules): its first bytes are still read for the evidence (the SNI) and
/// checked against a name where one is given, then it is copied blind.
async fn run_opaque<C>(
    ctx: Arc<Ctx>,
    mut client: C,
    upstream: TcpStream,
    host: Host,
    mut record: Record,
    view: View,
    mut first: Vec<u8>,
) where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let report = view.is_report();
    record.tunnel = Some(Carry::Opaque);
    let Ok(detect_slot) = ctx.detect_slots.try_acquire() else {
        deny_over_budget(&ctx, &mut record).await;
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
        }
        Some(reason) => {
            record.reason = reason;
            record.rule = None;
            record.would_deny = None;
            ctx.write(&mut record).await;
            debug!(reason = %reason, record = %record.id, "tunnel denied after detection");
            return; // both sides dropped: nothing reached the upstream
        }
        None => {}
    }
    // (Interception needs a TLS rule: an opaque tunnel is never intercepted.)
    if !ctx.write(&mut record).await || detected == Detected::Closed || !record.reason.is_allow() {
        return;
    }
    relay(&ctx, client, upstream, None, first, 0, &record, &view).await;
}
