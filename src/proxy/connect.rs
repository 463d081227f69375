//! The tunnel step shared by HTTP CONNECT and SOCKS5 CONNECT.
//!
//! [`open`]: decide the target, admit an allow ([`admission`]), record a
//! refusal, dial exactly a checked address. The caller then tells its client (a `200`, a SOCKS5 reply) and
//! hands the client stream to [`run`]: detect the first client bytes, check
//! a ClientHello's SNI or an HTTP Host against the target, record the
//! decision, replay the held bytes and copy until close, record the close.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Instant;

use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tracing::debug;

use super::admission;
use super::conn::{Conn, Link, Plan};
use super::ctx::{Ctx, DETECT_BUDGET_EXHAUSTED};
use super::decide::decide_in;
use super::dial::dial_checked;
use super::http::replay::Replay;
use super::http::wire::MeteredIo;
use super::intercepted::{self, serve::Session};
use super::record::{denied, dial_failed, volume_spent, write_record, Refused, Written};
use super::revoke;
use super::splice::Stream;
use super::tunnel::{self, Detected};
use super::verify;
use crate::config::Carry;
use crate::evidence::Record;
use crate::policy::Reason;
use crate::proto::guard;
use crate::proto::target::{normalize_host, parse_authority, Host};

/// An allowed target with its upstream connected; the decision record is
/// not written yet (that waits for the client's first bytes).
pub(crate) struct Opened {
    pub upstream: TcpStream,
    /// The address the upstream was reached at.
    pub addr: SocketAddr,
    /// The connection as decided: what its records are built from.
    pub conn: Conn,
}

/// Decide `host:port` for `link`'s client, admit an allow
/// ([`admission::admit`]) and dial it; a denial or refusal is recorded.
pub(crate) async fn open(ctx: &Ctx, link: &Link, host: Host, port: u16) -> Result<Opened, Refused> {
    let outcome = decide_in(ctx, (link.mode, link.client.ip()), &link.view, &host, port).await;
    let mut conn = link.decided(host, port, outcome.verdict);
    conn.detail = outcome.detail;
    conn.decider = outcome.decider;
    conn.grant_requests = outcome.grant_requests;
    // A synthetic address stands for its name: the records say both.
    conn.stood_for(outcome.synthetic.as_deref());
    if let Host::Ip(ip) = conn.host {
        if conn.verdict.reason == Reason::SyntheticUnbound {
            conn.synthetic = Some(ip);
        }
    }
    if !conn.is_allow() || !admission::admit(ctx, &mut conn) {
        return Err(denied(ctx, &mut conn).await);
    }
    match dial_checked(ctx, &outcome.dial, port).await {
        Ok((upstream, addr)) => {
            conn.ip = Some(addr.ip());
            Ok(Opened {
                upstream,
                addr,
                conn,
            })
        }
        Err(error) => Err(dial_failed(ctx, &mut conn, error).await),
    }
}

/// After the client was told the tunnel is open: check its first bytes
/// against the target and the rule's [`Carry`], record the decision, then
/// copy until close (verifying every later byte unless the rule says
/// `opaque`), and record the close. `first` holds client bytes already read
/// past the handshake (a client that sent data before the reply); they are
/// judged and replayed too.
pub(crate) async fn run<C>(ctx: Arc<Ctx>, mut client: C, opened: Opened, mut first: Vec<u8>)
where
    C: Stream + 'static,
{
    let Opened {
        upstream,
        addr,
        mut conn,
    } = opened;
    let carry = conn.carry();
    if carry == Carry::Opaque {
        return Box::pin(run_opaque(ctx, client, upstream, conn, first)).await;
    }
    // Bytes held to judge the first unit are charged to the detection
    // budget inside `verify::first`, and released once it is judged.
    let judged = verify::first(
        &mut client,
        &mut first,
        carry,
        (&conn.host, conn.port),
        guard_limits(&ctx),
        ctx.limits.detect_timeout.get(),
        &ctx.detect_scope(&conn.view, conn.client),
    )
    .await;
    let (guard, verified) = match judged {
        verify::First::Passed { guard, forward } => (Some(guard), forward),
        verify::First::Closed => {
            // Nothing was sent, so nothing flowed: the allow stands on record.
            conn.tunnel = Some(carry);
            let _ = write_record(&ctx, &mut conn).await;
            return;
        }
        verify::First::OverBudget => {
            deny_over_budget(&ctx, &mut conn).await;
            return;
        }
        verify::First::Denied(v) => {
            let reason = verify::reason(v.kind);
            if !(conn.view.is_report() && reason.reportable()) {
                let mut r = violation_record(&conn, &v, None, false);
                Box::pin(ctx.write(&mut r)).await;
                debug!(reason = %reason, record = %r.id, "tunnel denied on its first bytes");
                return; // both sides dropped: nothing reached the upstream
            }
            conn.report(reason, Some(v.detail));
            (None, 0)
        }
    };
    let detected = guard.as_ref().map(verify::Guard::detected);
    if let Some(Detected::Tls(hello)) = &detected {
        conn.sni = hello.sni.clone();
    }
    conn.tunnel = Some(guard.as_ref().map_or(Carry::Opaque, verify::Guard::carry));
    // Opt-in TLS interception: only for an allow rule with `intercept =
    // true` (which carries TLS, so the hello was checked).
    conn.settle(intercepted::plan(
        conn.view.intercept.as_ref(),
        &conn,
        detected.as_ref().unwrap_or(&Detected::NotTls),
    ));
    let Ok(Written { id, .. }) = write_record(&ctx, &mut conn).await else {
        return;
    };
    if !conn.is_allow() {
        return;
    }
    if let Plan::Intercept(how) = conn.plan.clone() {
        let session = Session::new(ctx.clone(), conn, id, addr, how);
        // Boxed: its state is large, and a tunnel that is not intercepted
        // should not carry room for it.
        Box::pin(intercepted::serve::serve(session, client, first, upstream)).await;
        return;
    }
    relay(&ctx, client, upstream, (guard, first, verified), &conn, &id).await;
}

/// [`run`] for a CONNECT tunnel as hyper hands it over: on the TCP socket
/// under it (so that the tunnel can splice), with any bytes hyper read past
/// the CONNECT head as the first client bytes; on the upgrade itself
/// (copied in user space) if hyper would not give the socket back. Not an
/// async fn: the tunnel's state lives in one box, not also in a wrapper
/// that keeps its own copy of the arguments.
pub(crate) fn run_upgraded(
    ctx: Arc<Ctx>,
    upgraded: Upgraded,
    opened: Box<Opened>,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    // Out of its box, which is freed here, not when the tunnel ends.
    let opened = *opened;
    match upgraded.downcast::<TokioIo<MeteredIo<Replay<TcpStream>>>>() {
        Ok(parts) => {
            // What hyper read past the head, then what it never read of the
            // bytes the explicit listener held for it; an empty read buffer
            // is dropped here, not held by the tunnel.
            let (held, client) = parts.io.into_inner().into_inner().into_parts();
            let mut first = parts.read_buf.to_vec();
            first.extend_from_slice(&held);
            forget_connection_task(&client);
            Box::pin(run(ctx, client, opened, first))
        }
        Err(upgraded) => Box::pin(run(ctx, TokioIo::new(upgraded), opened, Vec::new())),
    }
}

/// [`run`] for a CONNECT the explicit listener answered itself, on the
/// client's socket, with the bytes the client sent after the head. Not an
/// async fn, for the reason [`run_upgraded`] gives.
pub(crate) fn run_opened(
    ctx: Arc<Ctx>,
    client: TcpStream,
    opened: Box<Opened>,
    first: Vec<u8>,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(run(ctx, client, *opened, first))
}

/// Drop the HTTP connection task's claim on the socket it handed over.
/// hyper's last read of the CONNECT connection left that task's waker in
/// the socket's read slot; the tunnel waits through `readable()`, which
/// does not use the slot, so until the client sent a byte the stale waker
/// kept the finished task's whole allocation (about 3.6 KB) alive for every
/// idle tunnel. A poll with a no-op waker puts that waker in its place;
/// when the socket is readable already, the wake-up that made it so has
/// taken the old waker out.
fn forget_connection_task(client: &TcpStream) {
    let mut cx = Context::from_waker(Waker::noop());
    let _ = client.poll_read_ready(&mut cx);
}

/// The bounds a tunnel verifier applies: the explicit listener's head limits.
pub(crate) fn guard_limits(ctx: &Ctx) -> guard::Limits {
    guard::Limits {
        max_head_bytes: ctx.limits.max_request_head_bytes,
        max_headers: ctx.limits.max_headers,
    }
}

/// Copy an allowed tunnel (recorded as `id`) until close, then queue its
/// close record. With a guard, every client byte past `held[..verified]`
/// is judged first, and a violation on the way is recorded as a denial of
/// its own (linked to the tunnel's allow record by `conn`), or, in report
/// mode, as what enforcement would have denied. Without one (opaque),
/// `held` is replayed and the rest copied blind.
pub(crate) async fn relay<C>(
    ctx: &Ctx,
    client: C,
    upstream: TcpStream,
    (guard, held, verified): (Option<verify::Guard>, Vec<u8>, usize),
    conn: &Conn,
    id: &str,
) where
    C: Stream,
{
    let started = Instant::now();
    // Cut at the end of the drain, when a reload's policy revokes it, or
    // when it spends a volume budget (report mode: noted, not cut).
    let stop = ctx.hard_stop.child_token();
    // Boxed: a tunnel without a budget keeps room for a pointer only.
    let volume = conn.volume.clone().map(|lease| {
        let cut = (!conn.view.is_report()).then(|| stop.clone());
        Box::new(crate::limits::Watch::new(lease, cut))
    });
    let Some(guard) = guard else {
        let idle = ctx.limits.idle_timeout.get();
        let pump = tunnel::pump(client, upstream, &held, idle, (&stop, volume.as_deref()));
        let totals = revoke::held(ctx, conn, id, &stop, pump).await;
        volume_spent(ctx, conn, id, volume.as_deref()).await;
        close(ctx, conn, id, totals, started);
        return;
    };
    let report_violation = |v: &guard::Violation| {
        ctx.submit(&mut violation_record(conn, v, Some(id), true));
    };
    let report: Option<&(dyn Fn(&guard::Violation) + Sync)> = if conn.view.is_report() {
        Some(&report_violation)
    } else {
        None
    };
    let scope = ctx.detect_scope(&conn.view, conn.client);
    let judged = verify::Judged {
        guard,
        held,
        verified,
    };
    let watch = verify::Watch {
        idle: ctx.limits.idle_timeout.get(),
        unit_timeout: ctx.limits.header_read_timeout.get(),
        stop: &stop,
        detect: &scope,
        report,
        volume: volume.as_deref(),
    };
    let pump = verify::pump(client, upstream, judged, watch);
    let (totals, end) = revoke::held(ctx, conn, id, &stop, pump).await;
    volume_spent(ctx, conn, id, volume.as_deref()).await;
    match end {
        verify::End::Closed => {}
        verify::End::Violation(v) => {
            let mut r = violation_record(conn, &v, Some(id), false);
            Box::pin(ctx.write(&mut r)).await;
            debug!(reason = %r.reason, record = %r.id, "tunnel cut by verification");
        }
        verify::End::OverBudget => {
            let mut over = conn.clone();
            over.deny(Reason::LimitExceeded, Some(DETECT_BUDGET_EXHAUSTED.into()));
            over.within = Some(id.to_string());
            Box::pin(ctx.write(&mut over.record())).await;
        }
    }
    close(ctx, conn, id, totals, started);
}

/// The record of a unit that failed verification in `conn`: the tunnel's
/// own decision record turned into the denial (the first unit: `linked`
/// is `None`), or a decision of its own linked to the allow record
/// `linked`. It names what the client actually presented: the SNI of a
/// hello (`sni`), the Host of a request (`host`, normalised where it can
/// be); the tunnel's own target stays in the allow record. In report mode
/// (`report`) a reportable violation is recorded as what enforcement would
/// have denied.
fn violation_record(
    conn: &Conn,
    v: &guard::Violation,
    linked: Option<&str>,
    report: bool,
) -> Record {
    let reason = verify::reason(v.kind);
    let mut c = conn.clone();
    if report && reason.reportable() {
        c.verdict.would_deny = None;
        c.report(reason, Some(v.detail.clone()));
    } else {
        c.deny(reason, Some(v.detail.clone()));
    }
    c.within = linked.map(str::to_string);
    let mut r = c.record();
    if let Some(seen) = &v.seen {
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
    r
}

/// No room in the detection budget: refused `limit_exceeded`.
async fn deny_over_budget(ctx: &Ctx, conn: &mut Conn) {
    conn.refuse(Reason::LimitExceeded, Some(DETECT_BUDGET_EXHAUSTED.into()));
    let _ = write_record(ctx, conn).await;
}

/// Queue the close record (nothing waits on it; it is never dropped).
fn close(ctx: &Ctx, conn: &Conn, id: &str, totals: tunnel::Totals, started: Instant) {
    ctx.submit(&mut conn.close(id, (totals.up, totals.down), started));
}

/// A tunnel whose rule lets it carry anything (`tunnel = "opaque"`, cidr
/// rules): its first bytes are still read for the evidence (the SNI) and
/// checked against a name where one is given, then it is copied blind.
async fn run_opaque<C>(
    ctx: Arc<Ctx>,
    mut client: C,
    upstream: TcpStream,
    mut conn: Conn,
    mut first: Vec<u8>,
) where
    C: Stream + 'static,
{
    let report = conn.view.is_report();
    conn.tunnel = Some(Carry::Opaque);
    let Some(detect_slot) = ctx.detect_scope(&conn.view, conn.client).try_hold(1) else {
        deny_over_budget(&ctx, &mut conn).await;
        return;
    };
    let detected = tunnel::detect(&mut client, &mut first, ctx.limits.detect_timeout.get()).await;
    // The budget bounds bytes held before decisions, not open tunnels.
    drop(detect_slot);
    let host = &conn.host;
    let mismatch = match &detected {
        Detected::Tls(hello) => match (host, &hello.sni) {
            (Host::Name(_), Some(sni)) => match normalize_host(sni) {
                Ok(sni_host) if &sni_host == host => None,
                _ => Some(Reason::SniMismatch),
            },
            _ => None,
        },
        Detected::Malformed(why) => {
            conn.detail = Some((*why).to_string());
            Some(Reason::BadRequest)
        }
        // Plain HTTP in a tunnel: its Host picks the virtual host at the
        // upstream, so it must name the tunnel's host too.
        Detected::Http(Some(h)) => match (host, parse_authority(h, Some(80))) {
            (Host::Name(_), Ok((req_host, _))) if &req_host != host => Some(Reason::HostMismatch),
            (Host::Name(_), Err(_)) => Some(Reason::HostMismatch),
            _ => None,
        },
        Detected::Http(None) | Detected::NotTls | Detected::Silent | Detected::Closed => None,
    };
    if let Detected::Tls(hello) = &detected {
        conn.sni = hello.sni.clone();
    }
    match mismatch {
        Some(reason) if report && reason.reportable() => conn.report(reason, None),
        Some(reason) => {
            conn.deny(reason, None);
            let id = write_record(&ctx, &mut conn).await.unwrap_or_else(|w| w).id;
            debug!(reason = %reason, record = %id, "tunnel denied after detection");
            return; // both sides dropped: nothing reached the upstream
        }
        None => {}
    }
    // (Interception needs a TLS rule: an opaque tunnel is never intercepted.)
    let Ok(Written { id, .. }) = write_record(&ctx, &mut conn).await else {
        return;
    };
    if detected == Detected::Closed || !conn.is_allow() {
        return;
    }
    relay(&ctx, client, upstream, (None, first, 0), &conn, &id).await;
}
