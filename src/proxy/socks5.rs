//! The SOCKS5 listener (RFC 1928): CONNECT only, with domain-name, IPv4
//! and IPv6 destinations, optionally authenticated by RFC 1929
//! username/password (user = org name, password = token).
//!
//! The handshake (greeting, authentication, request) must complete within
//! `header_read_timeout`; it is parsed by [`crate::proto::socks5`]. A
//! CONNECT then takes exactly the CONNECT tunnel step ([`super::connect`]):
//! decide, dial a checked address, reply, detect the first client bytes,
//! check SNI/Host, record, copy, record the close. BIND, UDP ASSOCIATE,
//! malformed messages and failed authentication are answered with their
//! reply code and recorded.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tracing::debug;

use super::connect;
use super::ctx::{Ctx, View};
use super::listen::accept_loop;
use super::record::record_denial;
use crate::evidence::{Kind, Mode};
use crate::limits::{LimitHit, Permit};
use crate::otel;
use crate::policy::{Credential, IdentityError, Reason};
use crate::proto::socks5::{
    self, Address, Command, Malformed, Reply, MAX_MESSAGE, METHOD_NONE, METHOD_UNACCEPTABLE,
    METHOD_USERPASS,
};
use crate::proto::target::{normalize_host, Host};
use crate::proto::Parse;

/// Accept SOCKS5 connections until shutdown. A connection counts for the
/// org its address names, or its address's own budget, until the
/// authentication names its org (see [`crate::limits`]).
pub(crate) async fn serve(ctx: Arc<Ctx>, listener: TcpListener) {
    accept_loop(
        ctx,
        listener,
        "socks5",
        |ctx, stream, peer, _view, permit| {
            let span = otel::connection(ctx.otel.as_deref(), peer, "socks5", None);
            otel::within(span, handle(ctx, stream, peer, permit))
        },
        refuse_over_limit,
    )
    .await
}

/// Over a limit: record it and answer "no acceptable methods".
fn refuse_over_limit(ctx: &Ctx, stream: TcpStream, peer: SocketAddr, view: &View, hit: LimitHit) {
    let mut record = view.refusal(
        (Kind::Tcp, Mode::Socks5),
        peer,
        Reason::LimitExceeded,
        hit.describe().to_string(),
    );
    ctx.submit(&mut record);
    // Best effort and non-blocking.
    let _ = stream.try_write(&socks5::method_reply(METHOD_UNACCEPTABLE));
}

/// Why a handshake message was not read.
enum ReadFail {
    Malformed(Malformed),
    Timeout,
    Closed { empty: bool },
}

/// The handshake's buffer: bytes read and not yet parsed, bounded.
struct Handshake {
    stream: TcpStream,
    buf: Vec<u8>,
    deadline: Instant,
}

impl Handshake {
    /// Read until `parse` is done with a message; the message's bytes are
    /// consumed, anything after them stays in `buf`.
    async fn read<T>(&mut self, parse: fn(&[u8]) -> Parse<T, Malformed>) -> Result<T, ReadFail> {
        loop {
            match parse(&self.buf) {
                Parse::Done { value, len } => {
                    self.buf.drain(..len);
                    return Ok(value);
                }
                Parse::Malformed(m) => return Err(ReadFail::Malformed(m)),
                Parse::NotThis => return Err(ReadFail::Malformed(socks5::NOT_SOCKS5)),
                Parse::NeedMore => {}
            }
            // Every message fits in MAX_MESSAGE; a valid prefix never exceeds it.
            let mut chunk = [0u8; MAX_MESSAGE];
            let read = tokio::time::timeout_at(self.deadline, self.stream.read(&mut chunk)).await;
            match read {
                Err(_) => return Err(ReadFail::Timeout),
                Ok(Ok(0)) | Ok(Err(_)) => {
                    return Err(ReadFail::Closed {
                        empty: self.buf.is_empty(),
                    })
                }
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Send a short reply; bounded by the handshake deadline.
    async fn send(&mut self, bytes: &[u8]) -> bool {
        matches!(
            tokio::time::timeout_at(self.deadline, self.stream.write_all(bytes)).await,
            Ok(Ok(()))
        )
    }
}

/// Record a refusal under `view`; `detail` never holds a credential.
async fn refuse(
    ctx: &Ctx,
    view: &View,
    peer: SocketAddr,
    reason: Reason,
    target: (Option<&Host>, Option<u16>),
    detail: &str,
) {
    let verdict = view.verdict(reason);
    record_denial(
        ctx,
        view,
        (Kind::Tcp, Mode::Socks5),
        peer,
        &verdict,
        target,
        Some(detail),
    )
    .await;
}

/// The client's identity is settled: charge the connection to its org
/// and answer `yes`, or answer `no` and record why not (a failed identity,
/// the org's connection cap or rate). `None`: the connection is done.
async fn settle_identity(
    ctx: &Ctx,
    hs: &mut Handshake,
    permit: &Permit,
    peer: SocketAddr,
    identified: Result<View, (View, IdentityError)>,
    [yes, no]: [[u8; 2]; 2],
) -> Option<View> {
    let view = match identified {
        Ok(view) => view,
        Err((view, e)) => {
            hs.send(&no).await;
            auth_refused(ctx, &view, peer, e).await;
            return None;
        }
    };
    if let Err(hit) = ctx.charge(permit, &view) {
        hs.send(&no).await;
        let (reason, detail) = (Reason::LimitExceeded, hit.describe());
        refuse(ctx, &view, peer, reason, (None, None), detail).await;
        return None;
    }
    hs.send(&yes).await.then_some(view)
}

fn read_fail_detail(step: &str, fail: &ReadFail) -> String {
    match fail {
        ReadFail::Malformed(m) => format!("socks5 {step}: {}", m.why),
        ReadFail::Timeout => format!("socks5 {step} not complete within header_read_timeout"),
        ReadFail::Closed { .. } => format!("socks5 client closed during {step}"),
    }
}

async fn handle(ctx: Arc<Ctx>, stream: TcpStream, peer: SocketAddr, permit: Permit) {
    let mut hs = Handshake {
        stream,
        buf: Vec::new(),
        deadline: Instant::now() + ctx.limits.header_read_timeout.get(),
    };
    let address_view = ctx.view(peer.ip());

    // Greeting and method selection (RFC 1928 §3).
    let greeting = match hs.read(socks5::parse_greeting).await {
        Ok(g) => g,
        Err(ReadFail::Closed { empty: true }) => return, // a bare connect: nothing to record
        Err(fail) => {
            if matches!(fail, ReadFail::Malformed(_)) {
                hs.send(&socks5::method_reply(METHOD_UNACCEPTABLE)).await;
            }
            let detail = read_fail_detail("greeting", &fail);
            return refuse(
                &ctx,
                &address_view,
                peer,
                Reason::BadRequest,
                (None, None),
                &detail,
            )
            .await;
        }
    };
    let view = if greeting.offers(METHOD_USERPASS) {
        // Credentials offered are always checked (RFC 1929).
        if !hs.send(&socks5::method_reply(METHOD_USERPASS)).await {
            return;
        }
        let creds = match hs.read(socks5::parse_auth).await {
            Ok(c) => c,
            Err(fail) => {
                if matches!(fail, ReadFail::Malformed(_)) {
                    hs.send(&socks5::auth_reply(false)).await;
                }
                let detail = read_fail_detail("authentication", &fail);
                return refuse(
                    &ctx,
                    &address_view,
                    peer,
                    Reason::BadRequest,
                    (None, None),
                    &detail,
                )
                .await;
            }
        };
        let credential = Credential {
            user: &creds.user,
            token: &creds.password,
        };
        let identified = ctx.view_as(peer.ip(), Some(credential));
        let replies = [socks5::auth_reply(true), socks5::auth_reply(false)];
        match settle_identity(&ctx, &mut hs, &permit, peer, identified, replies).await {
            Some(view) => view,
            None => return,
        }
    } else if greeting.offers(METHOD_NONE) {
        let identified = ctx.view_as(peer.ip(), None);
        let replies = [
            socks5::method_reply(METHOD_NONE),
            socks5::method_reply(METHOD_UNACCEPTABLE),
        ];
        match settle_identity(&ctx, &mut hs, &permit, peer, identified, replies).await {
            Some(view) => view,
            None => return,
        }
    } else {
        hs.send(&socks5::method_reply(METHOD_UNACCEPTABLE)).await;
        let detail = "socks5 greeting offers no supported method (none, username/password)";
        return refuse(
            &ctx,
            &address_view,
            peer,
            Reason::BadRequest,
            (None, None),
            detail,
        )
        .await;
    };

    // The request (RFC 1928 §4).
    let request = match hs.read(socks5::parse_request).await {
        Ok(r) => r,
        Err(fail) => {
            if let ReadFail::Malformed(m) = &fail {
                hs.send(&socks5::reply(m.reply)).await;
            }
            let detail = read_fail_detail("request", &fail);
            return refuse(&ctx, &view, peer, Reason::BadRequest, (None, None), &detail).await;
        }
    };
    let host = match &request.address {
        Address::V4(ip) => Ok(Host::Ip(IpAddr::V4(*ip))),
        Address::V6(ip) => Ok(Host::Ip(IpAddr::V6(*ip))),
        // Names take the same normalisation as everywhere: IP spellings become IPs.
        Address::Domain(name) => normalize_host(name).map_err(|e| e.to_string()),
    };
    let port = request.port;
    if request.command != Command::Connect {
        hs.send(&socks5::reply(Reply::CommandNotSupported)).await;
        let detail = format!("socks5 {} is not supported", request.command.as_str());
        let target = (host.as_ref().ok(), Some(port));
        return refuse(&ctx, &view, peer, Reason::BadRequest, target, &detail).await;
    }
    let host = match host {
        Ok(h) if port != 0 => h,
        Ok(h) => {
            hs.send(&socks5::reply(Reply::GeneralFailure)).await;
            let target = (Some(&h), Some(port));
            return refuse(&ctx, &view, peer, Reason::BadRequest, target, "port 0").await;
        }
        Err(why) => {
            hs.send(&socks5::reply(Reply::GeneralFailure)).await;
            let detail = format!("socks5 destination: {why}");
            return refuse(
                &ctx,
                &view,
                peer,
                Reason::BadRequest,
                (None, Some(port)),
                &detail,
            )
            .await;
        }
    };

    let opened = match connect::open(&ctx, &view, Mode::Socks5, peer, host, port).await {
        Ok(opened) => opened,
        Err(refused) => {
            hs.send(&socks5::reply(refused.failure.socks_reply())).await;
            debug!(?refused, "socks5 connect refused");
            return;
        }
    };
    if !hs.send(&socks5::reply(Reply::Succeeded)).await {
        return;
    }
    let Handshake { stream, buf, .. } = hs;
    connect::run(ctx, stream, opened, buf).await;
}

/// Failed identity: recorded with org null and the cause as detail (never
/// the token); the client saw only the SOCKS authentication failure.
async fn auth_refused(ctx: &Ctx, view: &View, peer: SocketAddr, e: IdentityError) {
    let detail = e.to_string();
    refuse(ctx, view, peer, e.reason(), (None, None), &detail).await;
}
