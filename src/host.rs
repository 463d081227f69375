//! The host's own addresses: every address of every interface of the host
//! (or pod) Palisade runs on, IPv4 and IPv6, the upstream side's included.
//!
//! The policy denies each of them on every port unless a `cidr` rule inside
//! it names it (row C of the truth table in [`crate::policy`], labelled
//! "gateway address"): under a wide rule such as `0.0.0.0/0` the gateway
//! would otherwise dial itself, and in a DaemonSet with host networking its
//! address is the node's, where the kubelet listens.
//!
//! This is the I/O at the edge (one `getifaddrs(3)` call); the policy gets
//! the list as a value. It is read at start (a failure is a start-up error)
//! and again on every reload and config poll (a failure refuses the reload,
//! and a changed list is itself a reason to serve the policy again: DHCP, a
//! new pod IP). So that a new address is denied as it appears, not at the
//! next poll, [`AddressEvents`] wakes the reloader on the kernel's own
//! notice of each address added or removed; the poll stays as the fallback.

use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use crate::policy::canonical;

/// Why the host's addresses could not be listed.
#[derive(Debug, thiserror::Error)]
#[error("cannot list the host's interface addresses: {0}")]
pub(crate) struct HostError(#[from] std::io::Error);

/// Every interface address of this host, canonical (IPv4-mapped IPv6 as
/// IPv4), without the unspecified address, sorted and without duplicates.
/// Zone ids are not part of an address here: `fe80::1%eth0` and
/// `fe80::1%eth1` are one address to the policy, denied either way.
pub(crate) fn addresses() -> Result<Vec<IpAddr>, HostError> {
    let interfaces = if_addrs::get_if_addrs()?;
    Ok(normalise(interfaces.iter().map(|i| i.ip())))
}

/// Canonical, sorted, unique; the unspecified address is no interface's.
fn normalise(addrs: impl IntoIterator<Item = IpAddr>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = addrs
        .into_iter()
        .map(canonical)
        .filter(|a| !a.is_unspecified())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Notices of the host's address changes: a `NETLINK_ROUTE` socket in the
/// groups of IPv4 and IPv6 address changes (`RTM_NEWADDR`, `RTM_DELADDR`),
/// read on a thread of its own (registering a raw descriptor with the
/// runtime's reactor would need `unsafe`, which the crate forbids).
/// Nothing of a message is parsed or trusted: any message, or an overflow
/// of the socket's buffer (`ENOBUFS`: notices were lost), only says "read
/// the addresses again" ([`addresses`]). Notices that arrive while the
/// reader is busy are taken as one.
pub(crate) struct AddressEvents {
    notice: Arc<Notify>,
}

/// How long one read of the notice socket waits before the thread looks
/// whether its [`AddressEvents`] is still there.
const NOTICE_RECV_TIMEOUT: Duration = Duration::from_secs(1);
/// Bytes read at once (a notice is a few hundred; a longer one is cut,
/// which is all the same here).
const NOTICE_BUFFER: usize = 16 * 1024;

impl AddressEvents {
    /// Join the address groups and start the reading thread. Needs no
    /// privilege; on failure the config poll alone sees changes.
    pub(crate) fn open() -> io::Result<AddressEvents> {
        let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let groups = (libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;
        socket.bind(&netlink_sys::SocketAddr::new(0, groups))?;
        socket2::SockRef::from(&socket).set_read_timeout(Some(NOTICE_RECV_TIMEOUT))?;
        let notice = Arc::new(Notify::new());
        let weak = Arc::downgrade(&notice);
        std::thread::Builder::new()
            .name("host-addresses".into())
            .spawn(move || read_notices(&socket, &weak))?;
        Ok(AddressEvents { notice })
    }

    /// Wait until the kernel has said that an address came or went since
    /// the last call returned (at once if it already has).
    pub(crate) async fn changed(&self) {
        self.notice.notified().await;
    }
}

/// A netlink socket's receive that timed out or was interrupted: nothing
/// to read yet, read again (the bypass log's socket too).
pub(crate) fn nothing_to_read(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// The notice socket's thread: wake the [`AddressEvents`] on every notice
/// until it is dropped (seen within [`NOTICE_RECV_TIMEOUT`]) or the socket
/// fails.
fn read_notices(socket: &netlink_sys::Socket, events: &Weak<Notify>) {
    use std::io::Read;
    let sock = socket2::SockRef::from(socket);
    let mut buf = vec![0u8; NOTICE_BUFFER];
    loop {
        let read = (&*sock).read(&mut buf);
        let Some(notice) = events.upgrade() else {
            return;
        };
        match read {
            Ok(_) => notice.notify_one(),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => notice.notify_one(),
            Err(e) if nothing_to_read(&e) => {}
            Err(e) => {
                tracing::warn!(error = %e, "host address notices stopped; the config poll still sees changes");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalised_canonical_sorted_unique() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let got = normalise([
            ip("198.18.2.1"),
            ip("::ffff:198.18.2.1"),
            ip("0.0.0.0"),
            ip("::"),
            ip("2001:2::1"),
            ip("127.0.0.1"),
            ip("fe80::1"),
            ip("fe80::1"),
        ]);
        assert_eq!(
            got,
            [
                ip("127.0.0.1"),
                ip("198.18.2.1"),
                ip("2001:2::1"),
                ip("fe80::1")
            ]
        );
    }

    #[test]
    fn this_host_has_addresses() {
        // Every host has at least its loopback interface.
        let addrs = addresses().expect("getifaddrs");
        assert!(addrs.iter().any(|a| a.is_loopback()), "{addrs:?}");
    }
}
