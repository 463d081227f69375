//! Dialling: exactly the checked addresses, in order, within the connect
//! timeout, each failure counted.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;
use tracing::debug;

use super::ctx::{Ctx, Routes};
use crate::metrics::Metrics;

/// Why dialling every checked address failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    #[error("connecting to {addr} timed out")]
    Timeout { addr: SocketAddr },
    #[error("connecting to {addr} failed: {source}")]
    Io { addr: SocketAddr, source: io::Error },
    #[error("no address to dial")]
    NoAddress,
}

impl DialError {
    /// A bounded label for metrics.
    pub(crate) fn kind(&self) -> &'static str {
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

/// [`dial`] within the context's `connect_timeout`, failures counted.
pub(crate) async fn dial_checked(
    ctx: &Ctx,
    addrs: &[IpAddr],
    port: u16,
) -> Result<(TcpStream, SocketAddr), DialError> {
    let timeout = ctx.limits.connect_timeout.get();
    crate::otel::step_result(
        "dial",
        dial(&ctx.metrics, &ctx.routes, (addrs, port), timeout),
    )
    .await
}

/// Dial the checked addresses in order until one answers; returns the
/// stream and the address it reached, or the last error. Each failed
/// address counts in `palisade_upstream_connect_errors_total`.
async fn dial(
    metrics: &Metrics,
    routes: &Routes,
    (addrs, port): (&[IpAddr], u16),
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), DialError> {
    let mut last = DialError::NoAddress;
    for ip in addrs {
        let addr = SocketAddr::new(*ip, port);
        match tokio::time::timeout(timeout, connect(routes.of(addr))).await {
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

/// Connect to `addr`, as tokio's connect does, but without waiting on the
/// runtime when the connection is up as soon as connect(2) returns (a
/// local upstream: the loopback handshake completes within the call): its
/// peer address is known at once, and the stream goes on in the same
/// poll, one trip through the runtime's event loop less per dial. Otherwise it
/// waits until the socket is writable and takes the connect's error.
async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.nonblocking(),
        Some(socket2::Protocol::TCP),
    )?;
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let up = socket.peer_addr().is_ok();
    let stream = TcpStream::from_std(socket.into())?;
    if !up {
        stream.writable().await?;
        if let Some(e) = stream.take_error()? {
            return Err(e);
        }
    }
    Ok(stream)
}
