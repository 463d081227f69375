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
//! and a changed list is itself a reason to reload: DHCP, a new pod IP).

use std::net::IpAddr;

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
