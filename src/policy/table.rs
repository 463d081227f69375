//! The lookup tables a policy is compiled into: rule indices by name or
//! name suffix, values by network (longest prefix first).

use foldhash::{HashMap, HashMapExt};
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::config::RuleTarget;

/// Rule indices by the name or name suffix they match.
#[derive(Debug, Default)]
pub(super) struct NameTable {
    exact: HashMap<String, Vec<usize>>,
    below: HashMap<String, Vec<usize>>,
}

impl NameTable {
    pub(super) fn insert(&mut self, target: &RuleTarget, index: usize) {
        match target {
            RuleTarget::Exact(name) => self.exact.entry(name.clone()).or_default().push(index),
            RuleTarget::Below(suffix) => self.below.entry(suffix.clone()).or_default().push(index),
            RuleTarget::Cidr(_) => {}
        }
    }

    /// Indices of every rule matching `name`, in no particular order.
    pub(super) fn matches<'a>(&'a self, name: &'a str) -> impl Iterator<Item = usize> + 'a {
        let exact = self.exact.get(name).into_iter().flatten();
        // Every proper suffix after a '.', e.g. "b.c.com", "c.com", "com".
        let suffixes = name
            .match_indices('.')
            .filter_map(move |(i, _)| name.get(i + 1..))
            .filter_map(move |s| self.below.get(s))
            .flatten();
        exact.chain(suffixes).copied()
    }

    /// The work [`NameTable::matches`] does for `name`: hash probes plus
    /// rule indices yielded. What the lookup costs, counted rather than
    /// timed, so a test can show it does not grow with the rule count.
    #[cfg(test)]
    pub(super) fn work(&self, name: &str) -> usize {
        let probes = 1 + name.matches('.').count();
        probes + self.matches(name).count()
    }
}

/// Values by network, probed from the longest prefix length in use to the shortest.
#[derive(Debug)]
pub(super) struct PrefixTable<T> {
    v4: Vec<(u8, HashMap<Ipv4Net, T>)>,
    v6: Vec<(u8, HashMap<Ipv6Net, T>)>,
}

impl<T> Default for PrefixTable<T> {
    fn default() -> Self {
        PrefixTable {
            v4: Vec::new(),
            v6: Vec::new(),
        }
    }
}

impl<T: Default> PrefixTable<T> {
    pub(super) fn entry(&mut self, net: IpNet) -> &mut T {
        fn slot<N: std::hash::Hash + Eq, T: Default>(
            levels: &mut Vec<(u8, HashMap<N, T>)>,
            len: u8,
            net: N,
        ) -> &mut T {
            let pos = match levels.iter().position(|(l, _)| *l == len) {
                Some(pos) => pos,
                None => {
                    levels.push((len, HashMap::new()));
                    levels.sort_by_key(|(l, _)| std::cmp::Reverse(*l));
                    levels.iter().position(|(l, _)| *l == len).unwrap_or(0)
                }
            };
            levels[pos].1.entry(net).or_default()
        }
        match net.trunc() {
            IpNet::V4(n) => slot(&mut self.v4, n.prefix_len(), n),
            IpNet::V6(n) => slot(&mut self.v6, n.prefix_len(), n),
        }
    }
}

impl<T> PrefixTable<T> {
    /// Values of every network containing `ip`, longest prefix first.
    pub(super) fn matches(&self, ip: IpAddr) -> impl Iterator<Item = &T> + '_ {
        self.matches_len(ip).map(|(_, value)| value)
    }

    /// Every network containing `ip` as (prefix length, value), longest first.
    pub(super) fn matches_len(&self, ip: IpAddr) -> impl Iterator<Item = (u8, &T)> + '_ {
        let (v4, v6) = match ip {
            IpAddr::V4(a) => (Some(a), None),
            IpAddr::V6(a) => (None, Some(a)),
        };
        let m4 = v4.into_iter().flat_map(move |a| {
            self.v4.iter().filter_map(move |(len, map)| {
                Ipv4Net::new(a, *len)
                    .ok()
                    .and_then(|n| map.get(&n.trunc()))
                    .map(|v| (*len, v))
            })
        });
        let m6 = v6.into_iter().flat_map(move |a| {
            self.v6.iter().filter_map(move |(len, map)| {
                Ipv6Net::new(a, *len)
                    .ok()
                    .and_then(|n| map.get(&n.trunc()))
                    .map(|v| (*len, v))
            })
        });
        m4.chain(m6)
    }

    /// Every network in the table that contains all of `net`, longest first.
    pub(super) fn containing(&self, net: IpNet) -> Vec<(IpNet, &T)> {
        let mut found = Vec::new();
        match net.trunc() {
            IpNet::V4(n) => {
                for (len, map) in self.v4.iter().filter(|(l, _)| *l <= n.prefix_len()) {
                    if let Some((k, v)) = Ipv4Net::new(n.network(), *len)
                        .ok()
                        .and_then(|k| map.get_key_value(&k.trunc()))
                    {
                        found.push((IpNet::V4(*k), v));
                    }
                }
            }
            IpNet::V6(n) => {
                for (len, map) in self.v6.iter().filter(|(l, _)| *l <= n.prefix_len()) {
                    if let Some((k, v)) = Ipv6Net::new(n.network(), *len)
                        .ok()
                        .and_then(|k| map.get_key_value(&k.trunc()))
                    {
                        found.push((IpNet::V6(*k), v));
                    }
                }
            }
        }
        found
    }

    /// Every (network, value), in no particular order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (IpNet, &T)> + '_ {
        let e4 = self
            .v4
            .iter()
            .flat_map(|(_, map)| map.iter().map(|(n, v)| (IpNet::V4(*n), v)));
        let e6 = self
            .v6
            .iter()
            .flat_map(|(_, map)| map.iter().map(|(n, v)| (IpNet::V6(*n), v)));
        e4.chain(e6)
    }
}
