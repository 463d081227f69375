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

use std::net::IpAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tracing::debug;

use super::conn::Link;
use super::connect;
use super::ctx::{Ctx, View};
use super::listen::accept_loop;
use super::record::refused;
use crate::evidence::{Kind, Mode};
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
    accept_loop(ctx, listener, Mode::Socks5, handle, refuse_over_limit).await
}

/// Over a limit: record it and answer "no acceptable methods".
fn refuse_over_limit(ctx: &Ctx, stream: TcpStream, link: Link) {
    ctx.submit(&mut link.record());
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

/// Refuse `link` for `reason` and record it; `detail` never holds a
/// credential.
async fn refuse(ctx: &Ctx, link: &mut Link, reason: Reason, detail: String) {
    link.refuse(reason, detail);
    refused(ctx, link).await;
}

/// The client's identity is settled: charge the connection to its org
/// and answer `yes`, or answer `no` and record why not (a failed identity,
/// the org's connection cap or rate). `None`: the connection is done.
async fn settle_identity(
    ctx: &Ctx,
    hs: &mut Handshake,
    link: &Link,
    identified: Result<View, (View, IdentityError)>,
    [yes, no]: [[u8; 2]; 2],
) -> Option<Link> {
    let mut link = match identified {
        Ok(view) => link.under(view, Kind::Tcp),
        Err((view, e)) => {
            hs.send(&no).await;
            let mut link = link.under(view, Kind::Tcp);
            refuse(ctx, &mut link, e.reason(), e.to_string()).await;
            return None;
        }
    };
    if let Err(hit) = link.charge(ctx) {
        hs.send(&no).await;
        refuse(ctx, &mut link, Reason::LimitExceeded, hit.describe().into()).await;
        return None;
    }
    hs.send(&yes).await.then_some(link)
}

fn read_fail_detail(step: &str, fail: &ReadFail) -> String {
    match fail {
        ReadFail::Malformed(m) => format!("socks5 {step}: {}", m.why),
        ReadFail::Timeout => format!("socks5 {step} not complete within header_read_timeout"),
        ReadFail::Closed { .. } => format!("socks5 client closed during {step}"),
    }
}

async fn handle(ctx: Arc<Ctx>, stream: TcpStream, mut link: Link) {
    let mut hs = Handshake {
        stream,
        buf: Vec::new(),
        deadline: Instant::now() + ctx.limits.header_read_timeout.get(),
    };

    // Greeting and method selection (RFC 1928 §3).
    let greeting = match hs.read(socks5::parse_greeting).await {
        Ok(g) => g,
        Err(ReadFail::Closed { empty: true }) => return, // a bare connect: nothing to record
        Err(fail) => {
            if matches!(fail, ReadFail::Malformed(_)) {
                hs.send(&socks5::method_reply(METHOD_UNACCEPTABLE)).await;
            }
            let detail = read_fail_detail("greeting", &fail);
            return refuse(&ctx, &mut link, Reason::BadRequest, detail).await;
        }
    };
    let link = if greeting.offers(METHOD_USERPASS) {
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
                return refuse(&ctx, &mut link, Reason::BadRequest, detail).await;
            }
        };
        let credential = Credential {
            user: &creds.user,
            token: &creds.password,
        };
        let identified = ctx.view_as(link.client.ip(), Some(credential));
        let replies = [socks5::auth_reply(true), socks5::auth_reply(false)];
        match settle_identity(&ctx, &mut hs, &link, identified, replies).await {
            Some(link) => link,
            None => return,
        }
    } else if greeting.offers(METHOD_NONE) {
        let identified = ctx.view_as(link.client.ip(), None);
        let replies = [
            socks5::method_reply(METHOD_NONE),
            socks5::method_reply(METHOD_UNACCEPTABLE),
        ];
        match settle_identity(&ctx, &mut hs, &link, identified, replies).await {
            Some(link) => link,
            None => return,
        }
    } else {
        hs.send(&socks5::method_reply(METHOD_UNACCEPTABLE)).await;
        let detail = "socks5 greeting offers no supported method (none, username/password)";
        return refuse(&ctx, &mut link, Reason::BadRequest, detail.into()).await;
    };
    connect_request(ctx, hs, link).await;
}

/// The request (RFC 1928 §4) of an identified client: a CONNECT takes the
/// tunnel step; anything else is answered with its reply code and recorded.
async fn connect_request(ctx: Arc<Ctx>, mut hs: Handshake, mut link: Link) {
    let request = match hs.read(socks5::parse_request).await {
        Ok(r) => r,
        Err(fail) => {
            if let ReadFail::Malformed(m) = &fail {
                hs.send(&socks5::reply(m.reply)).await;
            }
            let detail = read_fail_detail("request", &fail);
            return refuse(&ctx, &mut link, Reason::BadRequest, detail).await;
        }
    };
    let host = match &request.address {
        Address::V4(ip) => Ok(Host::Ip(IpAddr::V4(*ip))),
        Address::V6(ip) => Ok(Host::Ip(IpAddr::V6(*ip))),
        // Names take the same normalisation as everywhere: IP spellings become IPs.
        Address::Domain(name) => normalize_host(name).map_err(|e| e.to_string()),
    };
    let port = request.port;
    link.target(host.as_ref().ok().cloned(), Some(port));
    if request.command != Command::Connect {
        hs.send(&socks5::reply(Reply::CommandNotSupported)).await;
        let detail = format!("socks5 {} is not supported", request.command.as_str());
        return refuse(&ctx, &mut link, Reason::BadRequest, detail).await;
    }
    let host = match host {
        Ok(h) if port != 0 => h,
        Ok(_) => {
            hs.send(&socks5::reply(Reply::GeneralFailure)).await;
            return refuse(&ctx, &mut link, Reason::BadRequest, "port 0".into()).await;
        }
        Err(why) => {
            hs.send(&socks5::reply(Reply::GeneralFailure)).await;
            let detail = format!("socks5 destination: {why}");
            return refuse(&ctx, &mut link, Reason::BadRequest, detail).await;
        }
    };

    let opened = match connect::open(&ctx, &link, host, port).await {
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
