//! Transparent mode: TCP that nftables/iptables REDIRECTed to a listener.
//! The original destination comes from `SO_ORIGINAL_DST`; the name comes
//! from the client's first bytes (TLS SNI or HTTP Host), read and held
//! under the detect timeout, never forwarded before the decision.
//!
//! With a name, the name must be allowed for the org and port AND the
//! original destination must belong to it: an address the DNS shim gave
//! this org for that name, or one the name resolves to now. Otherwise
//! `sni_mismatch`. Without a name, only cidr rules apply. Denied
//! connections are reset; allowed ones dial exactly the original
//! destination and replay the held bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use super::admission;
use super::conn::{Conn, Link, Plan};
use super::connect;
use super::ctx::{Ctx, View, DETECT_BUDGET_EXHAUSTED};
use super::decide::{decide_synthetic, decide_with, stood_for, Addresses, Asker, Decided, Stands};
use super::dial::dial_checked;
use super::intercepted::{self, serve::Session};
use super::listen::accept_loop;
use super::record::{refused, write_record, Written};
use super::tunnel::{self, Detected};
use super::verify;
use crate::config::Carry;
use crate::evidence::Mode;
use crate::otel;
use crate::policy::{canonical, Reason, Verdict};
use crate::proto::target::{normalize_host, parse_authority, Host};

/// Where a REDIRECTed connection was going: `SO_ORIGINAL_DST` (IPv4) or
/// `IP6T_SO_ORIGINAL_DST` (IPv6), read from the connection's conntrack
/// entry. An IPv4 connection accepted on a dual-stack `[::]` listener has
/// an IPv4-mapped local address and an IPv4 conntrack entry: it is asked
/// the IPv4 way (the kernel answers `SOL_IP` options on such a socket).
pub(crate) fn original_destination(stream: &TcpStream) -> std::io::Result<SocketAddr> {
    let sock = socket2::SockRef::from(stream);
    let addr = match stream.local_addr()? {
        SocketAddr::V6(local) if local.ip().to_ipv4_mapped().is_none() => sock.original_dst_v6()?,
        SocketAddr::V4(_) | SocketAddr::V6(_) => sock.original_dst_v4()?,
    };
    addr.as_socket()
        .ok_or_else(|| std::io::Error::other("original destination is not an IP address"))
}

/// Accept REDIRECTed connections until shutdown. One connection, one
/// decision: under the policy served at accept.
pub(crate) async fn serve(ctx: Arc<Ctx>, listener: TcpListener) {
    accept_loop(ctx, listener, Mode::Transparent, traced, refuse).await
}

/// [`handle`] under the connection's span.
fn traced(
    ctx: Arc<Ctx>,
    client: TcpStream,
    link: Link,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let span = otel::connection(ctx.otel.as_deref(), link.client, link.mode.as_str(), None);
    otel::within(span, handle(ctx, client, link))
}

/// Over a limit: record it and reset.
fn refuse(ctx: &Ctx, stream: TcpStream, link: Link) {
    ctx.submit(&mut link.record());
    reset(stream);
}

/// Close with RST: the client learns at once that nothing will flow.
fn reset(stream: TcpStream) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// The name a client presented, from its first bytes.
fn presented_name(detected: &Detected, port: u16) -> Result<Option<Host>, &'static str> {
    match detected {
        Detected::Tls(hello) => match &hello.sni {
            Some(sni) => normalize_host(sni).map(Some).map_err(|_| "invalid SNI"),
            None => Ok(None),
        },
        Detected::Http(Some(host)) => parse_authority(host, Some(port))
            .map(|(h, _)| Some(h))
            .map_err(|_| "invalid Host header"),
        Detected::Http(None) | Detected::NotTls | Detected::Silent | Detected::Closed => Ok(None),
        Detected::Malformed(why) => Err(why),
    }
}

async fn handle(ctx: Arc<Ctx>, mut client: TcpStream, mut link: Link) {
    let orig = match original_destination(&client) {
        Ok(orig) => orig,
        Err(e) => {
            // Connected to the listener directly (no REDIRECT): nowhere to go.
            link.refuse(Reason::BadRequest, format!("no original destination: {e}"));
            refused(&ctx, &link).await;
            return reset(client);
        }
    };
    let (view, peer) = (&link.view, link.client);
    let orig = SocketAddr::new(canonical(orig.ip()), orig.port());
    let conn_for = |verdict: Verdict, host: Host| {
        let mut conn = link.decided(host, orig.port(), verdict);
        // The original destination is recorded whatever the decision.
        conn.ip = Some(orig.ip());
        conn
    };
    // Before the decision: charged to the address's org, or for a client
    // of no org to its address's small share, never to another org.
    let Some(detect_slot) = ctx.detect_scope(view, peer).try_hold(1) else {
        let mut conn = conn_for(view.verdict(Reason::LimitExceeded), Host::Ip(orig.ip()));
        conn.detail = Some(DETECT_BUDGET_EXHAUSTED.into());
        let _ = write_record(&ctx, &mut conn).await;
        return reset(client);
    };
    let mut first = Vec::new();
    let detected = tunnel::detect(&mut client, &mut first, ctx.limits.detect_timeout.get()).await;
    // The budget bounds bytes held before decisions, not open tunnels.
    drop(detect_slot);
    let (outcome, name) = decide_presented(&ctx, (view, peer.ip()), &detected, orig).await;

    let mut conn = conn_for(outcome.verdict, name.unwrap_or(Host::Ip(orig.ip())));
    // A synthetic destination: the record's `ip` is the real address
    // dialled (none yet), `synthetic` the address connected to.
    if ctx
        .synthetic
        .as_ref()
        .is_some_and(|s| s.contains(orig.ip()))
    {
        conn.ip = None;
        conn.synthetic = Some(orig.ip());
    }
    conn.stood_for(outcome.synthetic.as_deref());
    if let Detected::Tls(hello) = &detected {
        conn.sni = hello.sni.clone();
    }
    conn.detail = outcome.detail;
    conn.decider = outcome.decider;
    conn.grant_requests = outcome.grant_requests;
    if !conn.is_allow() || detected == Detected::Closed {
        deny(&ctx, &mut conn).await;
        return reset(client);
    }
    // Charged at accept to the address's org, if it has one; the decision
    // cannot name another, so this only confirms it (see `limits`).
    if let Err(hit) = link.charge(&ctx) {
        conn.refuse(Reason::LimitExceeded, Some(hit.describe().into()));
        let _ = write_record(&ctx, &mut conn).await;
        return reset(client);
    }
    if !admission::admit(&ctx, &mut conn) {
        let _ = write_record(&ctx, &mut conn).await;
        return reset(client);
    }
    // What the rule lets the connection carry: judge the first unit again
    // as the verifier sees it (an ECH hello, an h2c preface, ...), before
    // anything is dialled.
    let Some((guard, verified)) = judge_first(&ctx, &mut client, &mut first, &mut conn).await
    else {
        return reset(client);
    };
    let (upstream, addr) = match dial_checked(&ctx, &outcome.dial, orig.port()).await {
        Ok(dialled) => dialled,
        Err(e) => {
            if conn.synthetic.is_some() {
                if let super::dial::DialError::Timeout { addr }
                | super::dial::DialError::Io { addr, .. } = &e
                {
                    conn.ip = Some(addr.ip());
                }
            }
            conn.detail = Some(e.to_string());
            let _ = write_record(&ctx, &mut conn).await;
            return reset(client);
        }
    };
    if conn.synthetic.is_some() {
        conn.ip = Some(addr.ip());
    }
    // Opt-in TLS interception, as in explicit mode.
    conn.settle(intercepted::plan(
        conn.view.intercept.as_ref(),
        &conn,
        &detected,
    ));
    let Ok(Written { id, .. }) = write_record(&ctx, &mut conn).await else {
        return reset(client);
    };
    if !conn.is_allow() {
        return reset(client);
    }
    if let Plan::Intercept(how) = conn.plan.clone() {
        let session = Session::new(ctx.clone(), conn, id, addr, how);
        // Boxed: its state is large, and a tunnel that is not intercepted
        // should not carry room for it.
        Box::pin(intercepted::serve::serve(session, client, first, upstream)).await;
        return;
    }
    connect::relay(&ctx, client, upstream, (guard, first, verified), &conn, &id).await;
}

/// The transparent decision on what the client presented in its first
/// bytes (`detected`), timed: the decision, and the name presented.
async fn decide_presented(
    ctx: &Ctx,
    (view, client): (&View, std::net::IpAddr),
    detected: &Detected,
    orig: SocketAddr,
) -> (Decided, Option<Host>) {
    let started = Instant::now();
    let asker = ctx.tunnel_asker(view, client, Mode::Transparent);
    let decided = match presented_name(detected, orig.port()) {
        Ok(name) => {
            let outcome = otel::step("decide", decide(ctx, asker, view, name.as_ref(), orig)).await;
            (report_mismatch(ctx, view, outcome, orig).await, name)
        }
        Err(why) => (
            Decided {
                verdict: view.verdict(Reason::BadRequest),
                dial: Vec::new(),
                detail: Some(why.to_string()),
                synthetic: None,
                decider: None,
                grant_requests: false,
            },
            None,
        ),
    };
    ctx.metrics
        .time_decision(Mode::Transparent, started.elapsed());
    decided
}

/// Judge the first unit of an admitted connection as its rule's
/// verifier sees it: the guard for the rest and how many held bytes
/// passed, or `None` when it is denied or gone (recorded; reset it).
async fn judge_first(
    ctx: &Ctx,
    client: &mut TcpStream,
    first: &mut Vec<u8>,
    conn: &mut Conn,
) -> Option<(Option<verify::Guard>, usize)> {
    let carry = conn.carry();
    if carry == Carry::Opaque {
        conn.tunnel = Some(Carry::Opaque);
        return Some((None, 0));
    }
    let judged = verify::first(
        client,
        first,
        carry,
        (&conn.host, conn.port),
        connect::guard_limits(ctx),
        ctx.limits.detect_timeout.get(),
        &ctx.detect_scope(&conn.view, conn.client),
    )
    .await;
    match judged {
        verify::First::Passed { guard, forward } => {
            conn.tunnel = Some(guard.carry());
            Some((Some(guard), forward))
        }
        verify::First::Denied(v)
            if conn.view.is_report() && verify::reason(v.kind).reportable() =>
        {
            conn.report(verify::reason(v.kind), Some(v.detail));
            conn.tunnel = Some(Carry::Opaque);
            Some((None, 0))
        }
        verify::First::Denied(v) => {
            conn.deny(verify::reason(v.kind), Some(v.detail));
            deny(ctx, conn).await;
            None
        }
        verify::First::Closed => {
            let _ = write_record(ctx, conn).await;
            None
        }
        verify::First::OverBudget => {
            conn.refuse(Reason::LimitExceeded, Some(DETECT_BUDGET_EXHAUSTED.into()));
            let _ = write_record(ctx, conn).await;
            None
        }
    }
}

/// Record a denied connection.
async fn deny(ctx: &Ctx, conn: &mut Conn) {
    let id = write_record(ctx, conn).await.unwrap_or_else(|w| w).id;
    debug!(reason = %conn.verdict.reason, record = %id, "transparent connection denied");
}

/// Report mode: a name/address mismatch is let through to the original
/// destination, judged as an IP target (safety checks still apply), and
/// recorded as what enforcement would have denied.
async fn report_mismatch(ctx: &Ctx, view: &View, outcome: Decided, orig: SocketAddr) -> Decided {
    let (Some(org), Reason::SniMismatch) = (&view.org, outcome.verdict.reason) else {
        return outcome;
    };
    if !view.is_report() {
        return outcome;
    }
    let mut by_address = decide_with(
        &view.policy,
        (&ctx.resolver, Some(&*ctx.names), None),
        org,
        (&Host::Ip(orig.ip()), orig.port()),
        Addresses::Resolved,
    )
    .await;
    if by_address.verdict.is_allow() {
        by_address.verdict.reason = Reason::ReportOnly;
        by_address.verdict.would_deny = Some(Reason::SniMismatch);
        by_address.detail = outcome.detail;
    }
    by_address
}

/// The transparent decision: the name's rules and the address's consistency
/// with the name, or cidr rules alone without a name. `outcome.dial` is the
/// original destination when allowed.
async fn decide(
    ctx: &Ctx,
    asker: Asker<'_>,
    view: &View,
    name: Option<&Host>,
    orig: SocketAddr,
) -> Decided {
    let Some(org) = &view.org else {
        return super::decide::decide(ctx, asker, view, &Host::Ip(orig.ip()), orig.port()).await;
    };
    // A synthetic address: the name presented must be the one bound to it
    // for this org; then it is decided (and resolved) as that name.
    match stood_for(ctx, org, orig.ip()) {
        Stands::Not => {}
        Stands::Unbound => return Decided::unbound(org, orig.ip()),
        Stands::For(stood) => {
            return match name {
                Some(Host::Name(n)) if *n == stood.name => {
                    decide_synthetic(ctx, asker, view, org, stood, orig.port()).await
                }
                Some(other) => Decided::mismatch(
                    org,
                    format!(
                        "client named {other} but connected to the synthetic address {} of another name",
                        orig.ip()
                    ),
                ),
                None => Decided::mismatch(
                    org,
                    format!(
                        "no name presented at the synthetic address {}: it stands for the name it was handed out for, which the client must present",
                        orig.ip()
                    ),
                ),
            };
        }
    }
    let by_address = Host::Ip(orig.ip());
    let host = match name {
        None => &by_address,
        Some(Host::Ip(ip)) if canonical(*ip) != orig.ip() => {
            return Decided::mismatch(
                org,
                format!("client named {ip} but connected to {}", orig.ip()),
            )
        }
        Some(host) => host,
    };
    // A name's address is the original destination, which must belong to
    // it (an IP target is decided by its own rules alone).
    let original = Addresses::Original {
        ip: orig.ip(),
        bindings: ctx.bindings.as_deref(),
    };
    decide_with(
        &view.policy,
        (&ctx.resolver, Some(&*ctx.names), Some(asker)),
        org,
        (host, orig.port()),
        original,
    )
    .await
}
