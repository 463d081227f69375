//! The NFLOG socket: an `AF_NETLINK` / `NETLINK_NETFILTER` socket bound
//! to one log group, read from the runtime. Creating it, binding the group
//! and setting its copy mode are done once, at start, each request waiting
//! for the kernel's acknowledgement ([`NflogSocket::bind`]); the wire
//! format is [`super::packet`]'s. The socket is then read on a thread of
//! its own with a short receive timeout ([`RECV_TIMEOUT`]), so the reader
//! sees shutdown without the runtime's reactor (registering a raw netlink
//! descriptor with it would need `unsafe`, which the crate forbids).
//!
//! The socket is never `bind(2)`-ed by hand: the kernel gives it a port id
//! on its first `send`, and nfnetlink_log sends the group's packets to the
//! port id that bound the group. A group already bound by another socket
//! is refused `EBUSY`; binding needs `CAP_NET_ADMIN` (else `EPERM`). Both
//! are start-up errors ([`BindError`]).

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use super::packet::{self, Message, NETLINK_NETFILTER};

/// `AF_NETLINK`.
const AF_NETLINK: i32 = 16;
/// How long one read waits before the reader looks at shutdown again.
pub(crate) const RECV_TIMEOUT: Duration = Duration::from_millis(200);
/// How long start-up waits for each acknowledgement.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// Receive buffer asked for: a burst of logged packets waits here while
/// the reader records the previous ones (the kernel may grant less).
const RECV_BUFFER: usize = 1 << 20;
/// Largest datagram read at once (the kernel's batches are smaller).
pub(crate) const MAX_DATAGRAM: usize = 64 * 1024;

/// Why a group could not be bound: one line, naming the group.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    #[error("[bypass] nflog_group {group}: cannot open a netfilter netlink socket: {source}")]
    Socket { group: u16, source: io::Error },
    #[error("[bypass] nflog_group {group}: the group is taken by another listener (nfnetlink_log refused to bind it: {source})")]
    Busy { group: u16, source: io::Error },
    #[error("[bypass] nflog_group {group}: no permission to bind it (needs CAP_NET_ADMIN in this network namespace)")]
    Permission { group: u16 },
    #[error("[bypass] nflog_group {group}: {step} refused: {source}")]
    Refused {
        group: u16,
        step: &'static str,
        source: io::Error,
    },
    #[error("[bypass] nflog_group {group}: no answer from the kernel to {step}")]
    NoAnswer { group: u16, step: &'static str },
}

const EPERM: i32 = 1;
const EBUSY: i32 = 16;
/// The position of the group bind in [`packet::bind_requests`].
const GROUP_BIND: usize = 2;

/// What each of [`packet::bind_requests`] does, for errors.
const STEPS: [&str; 5] = [
    "binding IPv4 to the log subsystem",
    "binding IPv6 to the log subsystem",
    "binding the group",
    "setting the copy mode",
    "setting the flush timeout",
];

/// A socket bound to one NFLOG group.
#[derive(Debug)]
pub(crate) struct NflogSocket {
    socket: Socket,
}

impl NflogSocket {
    /// Open the socket and bind `group` for it, in copy mode `packet`.
    /// Blocks for at most [`ACK_TIMEOUT`] per request.
    pub(crate) fn bind(group: u16) -> Result<NflogSocket, BindError> {
        let socket = Socket::new(
            Domain::from(AF_NETLINK),
            Type::RAW,
            Some(Protocol::from(NETLINK_NETFILTER)),
        )
        .map_err(|source| BindError::Socket { group, source })?;
        // Best effort: a smaller buffer only overruns sooner.
        let _ = crate::sockopt::grow_receive_buffer(&socket, RECV_BUFFER);
        socket
            .set_read_timeout(Some(ACK_TIMEOUT))
            .map_err(|source| BindError::Socket { group, source })?;
        let mut buf = vec![0u8; MAX_DATAGRAM];
        for (n, ((seq, request), step)) in packet::bind_requests(group, 1)
            .into_iter()
            .zip(STEPS)
            .enumerate()
        {
            (&socket)
                .write_all(&request)
                .map_err(|source| BindError::Socket { group, source })?;
            match wait_ack(&socket, seq, &mut buf) {
                Some(0) => {}
                // EPERM before the group bind: no CAP_NET_ADMIN.
                Some(EPERM) if n < GROUP_BIND => return Err(BindError::Permission { group }),
                Some(errno @ (EPERM | EBUSY)) => {
                    return Err(BindError::Busy {
                        group,
                        source: io::Error::from_raw_os_error(errno),
                    })
                }
                Some(errno) => {
                    return Err(BindError::Refused {
                        group,
                        step,
                        source: io::Error::from_raw_os_error(errno),
                    })
                }
                None => return Err(BindError::NoAnswer { group, step }),
            }
        }
        socket
            .set_read_timeout(Some(RECV_TIMEOUT))
            .map_err(|source| BindError::Socket { group, source })?;
        Ok(NflogSocket { socket })
    }

    /// The next datagram from the kernel, into `buf`; its length. Blocks
    /// for at most [`RECV_TIMEOUT`] (then `WouldBlock`). An overrun
    /// (`ENOBUFS`: the kernel dropped log messages because the receive
    /// buffer was full) is returned as that error, and reading goes on
    /// after it.
    pub(crate) fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut socket: &Socket = &self.socket;
        socket.read(buf)
    }
}

/// The errno of the answer to `seq` (0: acknowledged), reading past any
/// logged packet that arrives first; `None` when none comes in time.
fn wait_ack(socket: &Socket, seq: u32, buf: &mut [u8]) -> Option<i32> {
    let deadline = Instant::now() + ACK_TIMEOUT;
    while Instant::now() < deadline {
        let mut reader: &Socket = socket;
        let n = match reader.read(buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // ENOBUFS: packets were lost, the answer may still come.
            Err(e) if e.raw_os_error() == Some(105) => continue,
            Err(_) => return None,
        };
        for m in packet::messages(&buf[..n]) {
            if let Message::Ack { seq: s, errno } = m {
                if s == seq {
                    return Some(errno);
                }
            }
        }
    }
    None
}
