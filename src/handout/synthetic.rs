//! Synthetic DNS answers: for an org with `dns_answers = "synthetic"`, the
//! shim ([`crate::dns`]) answers an allowed name with an address of the
//! `[dns] synthetic_pool` (IPv4) or `synthetic_pool_v6` (IPv6) bound to
//! (org, name), resolving nothing; the proxy ([`crate::proxy::decide`])
//! takes a connection to such an address for the name it is bound to.
//!
//! Pure bookkeeping: no clock, no I/O (recency is the order of the
//! [`FairTable`] the mappings are held in).
//!
//! Every org has the whole pool to itself: an address means (org, name)
//! for the org of the client that connects to it, and nothing for any
//! other org. Orgs share no table, cursor or bound, so nothing one org
//! does moves what another is answered, or when its answers are evicted:
//! acme cannot evict beta's mappings, and cannot learn from its own
//! addresses how many names beta asked. Bounded per org:
//!
//! - at most `per_org` mappings (never more than the smaller pool holds):
//!   over it, that org's own least recently used mapping goes;
//! - a mapping with an open connection ([`Pinned`]) is never evicted; when
//!   every one of the org's mappings is pinned, no new mapping is made
//!   ([`Answer::Exhausted`]).
//!
//! So all orgs together hold at most `per_org` times the synthetic orgs;
//! config validation keeps that within
//! [`MAX_SYNTHETIC_MAPPINGS`](crate::config::MAX_SYNTHETIC_MAPPINGS).
//!
//! Each org's addresses are handed out round-robin through each pool (its
//! own cursor), skipping those it uses, so an evicted address is reused as
//! late as possible: a client that cached it past its TTL reaches nothing
//! (`synthetic_unbound`) rather than another name, until the org's own
//! cursor has come round.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::config::MAX_SYNTHETIC_PER_ORG;
use crate::limits::table::FairTable;
use crate::policy::canonical;

/// TTL of a synthetic answer, in seconds: short, so that a client asks
/// again (and refreshes the mapping's recency) rather than holding an
/// address that may have been evicted and bound to another name since.
pub(crate) const SYNTHETIC_TTL: u32 = 10;

/// The address family of a query (A: IPv4, AAAA: IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    V4,
    V6,
}

/// What the shim answers for (org, name, family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// This address, bound to (org, name).
    Addr(IpAddr),
    /// No pool of this family: NODATA.
    NoPool,
    /// Every mapping the org could give up has an open connection:
    /// nothing to answer with.
    Exhausted,
}

/// What an address connected to stands for, for one org.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// Not in any pool: an ordinary address.
    NotSynthetic,
    /// In a pool but bound to no name of this org (never handed out to
    /// it, or evicted): `synthetic_unbound`.
    Unbound,
    /// Bound to this name for this org, pinned while `Pinned` lives.
    Bound(String, Pinned),
}

/// One mapping: (org, name) and the addresses it was given.
#[derive(Debug)]
struct Mapping {
    org: Arc<str>,
    name: Arc<str>,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
}

/// Every org's mappings in one [`FairTable`] (no total: each org holds at
/// most `per_org`, its own least recently used going first), under ids
/// never reused; place `()`: a use moves a mapping to the back.
type Table = FairTable<Arc<str>, u64, Mapping, ()>;

/// One org's names, addresses and cursors: nothing in it depends on any
/// other org.
#[derive(Debug, Default)]
struct OrgMaps {
    names: HashMap<Arc<str>, u64>,
    by_addr: HashMap<IpAddr, u64>,
    next_v4: u32,
    next_v6: u128,
}

#[derive(Debug)]
struct Inner {
    table: Table,
    orgs: HashMap<Arc<str>, OrgMaps>,
    next_id: u64,
}

impl Inner {
    /// Drop from the org's indexes the mappings that left the table.
    fn unindex(&mut self, gone: Vec<(u64, Mapping)>) {
        for (_, m) in gone {
            let Some(maps) = self.orgs.get_mut(&m.org) else {
                continue;
            };
            maps.names.remove(&m.name);
            for a in [m.v4.map(IpAddr::V4), m.v6.map(IpAddr::V6)]
                .into_iter()
                .flatten()
            {
                maps.by_addr.remove(&a);
            }
        }
    }

    /// The mapping `org` has for `addr`.
    fn at(&self, org: &str, addr: IpAddr) -> Option<(u64, &Mapping)> {
        let id = *self.orgs.get(org)?.by_addr.get(&addr)?;
        Some((id, self.table.get(&id)?))
    }
}

impl OrgMaps {
    /// The next address of the pool at `base` holding `size` addresses,
    /// from this org's `cursor` on, that this org does not use. It holds
    /// fewer mappings than the pool has addresses, so one is found within
    /// `len + 1` steps.
    fn free(
        &self,
        base: u128,
        size: u128,
        cursor: &mut u128,
        addr: impl Fn(u128) -> IpAddr,
    ) -> Option<IpAddr> {
        for _ in 0..=self.names.len() {
            let off = *cursor % size;
            *cursor = (off + 1) % size;
            let a = addr(base.wrapping_add(off));
            if !self.by_addr.contains_key(&a) {
                return Some(a);
            }
        }
        None
    }

    /// A new address of `family`'s pool for this org.
    fn next_addr(
        &mut self,
        family: Family,
        v4: Option<Ipv4Net>,
        v6: Option<Ipv6Net>,
    ) -> Option<IpAddr> {
        match (family, v4, v6) {
            (Family::V4, Some(net), _) => {
                let mut cursor = u128::from(self.next_v4);
                let size = pool_size(IpNet::V4(net));
                let base = u128::from(u32::from(net.network()));
                let found = self.free(base, size, &mut cursor, |a| {
                    IpAddr::V4(Ipv4Addr::from(u32::try_from(a).unwrap_or(u32::MAX)))
                });
                self.next_v4 = u32::try_from(cursor).unwrap_or(0);
                found
            }
            (Family::V6, _, Some(net)) => {
                let mut cursor = self.next_v6;
                let size = pool_size(IpNet::V6(net));
                let base = u128::from(net.network());
                let found = self.free(base, size, &mut cursor, |a| IpAddr::V6(Ipv6Addr::from(a)));
                self.next_v6 = cursor;
                found
            }
            _ => None,
        }
    }
}

/// The pools and every org's mappings, shared by the DNS shim and the proxy.
#[derive(Debug)]
pub(crate) struct Synthetic {
    inner: Mutex<Inner>,
    v4: Option<Ipv4Net>,
    v6: Option<Ipv6Net>,
}

/// A mapping held by an open connection: never evicted while this lives.
#[derive(Debug)]
pub(crate) struct Pinned {
    owner: Arc<Synthetic>,
    /// The mapping's id: a mapping made again after this one went has
    /// another, so a late drop releases nothing of it.
    id: u64,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.owner.lock().table.unpin(&self.id);
    }
}

fn pool_size(net: IpNet) -> u128 {
    let bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1u128.checked_shl(bits).unwrap_or(u128::MAX)
}

impl Synthetic {
    /// Pools `v4` and `v6` (either may be absent), `per_org` clamped to at
    /// least 1 and to what the smaller pool holds.
    pub(crate) fn new(v4: Option<Ipv4Net>, v6: Option<Ipv6Net>, per_org: usize) -> Synthetic {
        let v4 = v4.map(|n| n.trunc());
        let v6 = v6.map(|n| n.trunc());
        let smallest = [v4.map(IpNet::V4), v6.map(IpNet::V6)]
            .into_iter()
            .flatten()
            .map(pool_size)
            .min()
            .unwrap_or(0);
        let per_org = usize::try_from(smallest).unwrap_or(usize::MAX).min(per_org);
        Synthetic {
            inner: Mutex::new(Inner {
                table: FairTable::new(usize::MAX, per_org.max(1)),
                orgs: HashMap::new(),
                next_id: 0,
            }),
            v4,
            v6,
        }
    }

    /// The pools of `[dns]`, with the fixed bound; `None` when neither is set.
    pub(crate) fn from_config(dns: &crate::config::DnsConfig) -> Option<Synthetic> {
        if dns.synthetic_pool.is_none() && dns.synthetic_pool_v6.is_none() {
            return None;
        }
        Some(Synthetic::new(
            dns.synthetic_pool,
            dns.synthetic_pool_v6,
            MAX_SYNTHETIC_PER_ORG,
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every operation keeps the maps consistent before it can panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Is `addr` in a pool?
    pub(crate) fn contains(&self, addr: IpAddr) -> bool {
        match canonical(addr) {
            IpAddr::V4(a) => self.v4.is_some_and(|n| n.contains(&a)),
            IpAddr::V6(a) => self.v6.is_some_and(|n| n.contains(&a)),
        }
    }

    /// The address `org` is answered for `name` in `family`: the one bound
    /// already, else a new one (round-robin through the pool on the org's
    /// own cursor), making room by evicting the org's own least recently
    /// used mappings that no connection holds.
    pub(crate) fn answer(&self, org: &Arc<str>, name: &str, family: Family) -> Answer {
        if match family {
            Family::V4 => self.v4.is_none(),
            Family::V6 => self.v6.is_none(),
        } {
            return Answer::NoPool;
        }
        let mut inner = self.lock();
        let inner = &mut *inner;
        let known = inner.orgs.get(org).and_then(|m| m.names.get(name)).copied();
        let id = match known {
            Some(id) => {
                let have = inner.table.get(&id).and_then(|m| match family {
                    Family::V4 => m.v4.map(IpAddr::V4),
                    Family::V6 => m.v6.map(IpAddr::V6),
                });
                inner.table.reorder(&id, ());
                if let Some(addr) = have {
                    return Answer::Addr(addr);
                }
                id
            }
            None => {
                let id = inner.next_id;
                let name: Arc<str> = Arc::from(name);
                let mapping = Mapping {
                    org: org.clone(),
                    name: name.clone(),
                    v4: None,
                    v6: None,
                };
                // Over the org's cap its own least recently used unpinned
                // mapping goes; all pinned: refused.
                let Ok(gone) = inner
                    .table
                    .insert(org.clone(), id, mapping, (), |_, _| false)
                else {
                    return Answer::Exhausted;
                };
                inner.next_id += 1;
                inner.unindex(gone);
                let maps = inner.orgs.entry(org.clone()).or_default();
                maps.names.insert(name, id);
                id
            }
        };
        let maps = inner.orgs.entry(org.clone()).or_default();
        let Some(addr) = maps.next_addr(family, self.v4, self.v6) else {
            // Unreachable by the bound above; the mapping made stays empty
            // and goes like any other.
            return Answer::Exhausted;
        };
        maps.by_addr.insert(addr, id);
        if let Some(m) = inner.table.get_mut(&id) {
            match addr {
                IpAddr::V4(a) => m.v4 = Some(a),
                IpAddr::V6(a) => m.v6 = Some(a),
            }
        }
        Answer::Addr(addr)
    }

    /// What `addr` stands for for `org`; a bound one is pinned (and made
    /// the most recently used) until the returned [`Pinned`] is dropped.
    pub(crate) fn pin(self: &Arc<Self>, org: &str, addr: IpAddr) -> Lookup {
        let addr = canonical(addr);
        if !self.contains(addr) {
            return Lookup::NotSynthetic;
        }
        let mut inner = self.lock();
        let Some((id, m)) = inner.at(org, addr) else {
            return Lookup::Unbound;
        };
        let name = m.name.to_string();
        inner.table.reorder(&id, ());
        inner.table.pin(&id);
        Lookup::Bound(
            name,
            Pinned {
                owner: self.clone(),
                id,
            },
        )
    }

    /// The name `addr` is bound to for `org`, without pinning.
    #[cfg(test)]
    pub(crate) fn name_of(&self, org: &str, addr: IpAddr) -> Option<String> {
        let inner = self.lock();
        inner
            .at(org, canonical(addr))
            .map(|(_, m)| m.name.to_string())
    }

    /// Keep only the mappings whose (org, name) `keep` accepts (after a
    /// reload: orgs still synthetic, names still allowed); returns how
    /// many went. A pinned one goes too: its connection is the
    /// revocation's to close, and its pin is released harmlessly.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&str, &str) -> bool) -> usize {
        let mut inner = self.lock();
        let gone = inner.table.retain(|_, _, _, m| keep(&m.org, &m.name));
        let n = gone.len();
        inner.unindex(gone);
        inner.orgs.retain(|_, maps| !maps.names.is_empty());
        n
    }

    /// Mappings held (all orgs).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools(per_org: usize) -> Arc<Synthetic> {
        Arc::new(Synthetic::new(
            Some("198.18.200.0/24".parse().unwrap()),
            Some("2001:2:0:200::/120".parse().unwrap()),
            per_org,
        ))
    }

    fn addr(a: Answer) -> IpAddr {
        match a {
            Answer::Addr(a) => a,
            other => panic!("no address: {other:?}"),
        }
    }

    #[test]
    fn one_address_per_org_name_and_family_stable_until_evicted() {
        let s = pools(100);
        let acme: Arc<str> = Arc::from("acme");
        let beta: Arc<str> = Arc::from("beta");
        let a = addr(s.answer(&acme, "a.test", Family::V4));
        assert_eq!(a, "198.18.200.0".parse::<IpAddr>().unwrap());
        assert_eq!(addr(s.answer(&acme, "a.test", Family::V4)), a);
        let a6 = addr(s.answer(&acme, "a.test", Family::V6));
        assert!(s.contains(a6) && a6.is_ipv6());
        // Another name: another address. Another org: its own cursor over
        // the whole pool, so its first name gets the first address too,
        // and that address means its own name to it.
        let b = addr(s.answer(&acme, "b.test", Family::V4));
        let beta_c = addr(s.answer(&beta, "c.test", Family::V4));
        assert!(a != b);
        assert_eq!(beta_c, a);
        assert_eq!(s.name_of("acme", a).as_deref(), Some("a.test"));
        assert_eq!(s.name_of("acme", a6).as_deref(), Some("a.test"));
        assert_eq!(s.name_of("beta", a).as_deref(), Some("c.test"));
        // Acme's other address means nothing to beta.
        assert!(matches!(s.pin("beta", b), Lookup::Unbound));
        assert!(matches!(s.pin("beta", a), Lookup::Bound(n, _) if n == "c.test"));
        assert!(matches!(
            s.pin("acme", "198.18.200.200".parse().unwrap()),
            Lookup::Unbound
        ));
        assert!(matches!(
            s.pin("acme", "198.18.2.1".parse().unwrap()),
            Lookup::NotSynthetic
        ));
        assert!(matches!(s.pin("acme", a), Lookup::Bound(n, _) if n == "a.test"));
        // IPv4-mapped is the same address.
        let mapped: IpAddr = "::ffff:198.18.200.0".parse().unwrap();
        assert!(matches!(s.pin("acme", mapped), Lookup::Bound(..)));
    }

    #[test]
    fn no_pool_of_the_family_is_said() {
        let s = Synthetic::new(Some("198.18.200.0/24".parse().unwrap()), None, 10);
        let acme: Arc<str> = Arc::from("acme");
        assert_eq!(s.answer(&acme, "a.test", Family::V6), Answer::NoPool);
        assert!(matches!(
            s.answer(&acme, "a.test", Family::V4),
            Answer::Addr(_)
        ));
    }

    #[test]
    fn least_recently_used_goes_and_its_address_comes_back_last() {
        let s = pools(3);
        let acme: Arc<str> = Arc::from("acme");
        let a = addr(s.answer(&acme, "a.test", Family::V4));
        addr(s.answer(&acme, "b.test", Family::V4));
        addr(s.answer(&acme, "c.test", Family::V4));
        // a is used again: b is now the oldest.
        s.answer(&acme, "a.test", Family::V4);
        let d = addr(s.answer(&acme, "d.test", Family::V4));
        assert_eq!(s.len(), 3);
        assert!(s.name_of("acme", a).is_some());
        assert_eq!(s.name_of("acme", "198.18.200.1".parse().unwrap()), None);
        // Round-robin: the freed address is not handed out next.
        assert_eq!(d, "198.18.200.3".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_pinned_mapping_survives_churn_and_is_freed_after() {
        let s = pools(4);
        let acme: Arc<str> = Arc::from("acme");
        let held = addr(s.answer(&acme, "held.test", Family::V4));
        let Lookup::Bound(name, pin) = s.pin("acme", held) else {
            panic!("bound")
        };
        assert_eq!(name, "held.test");
        for i in 0..2000 {
            s.answer(&acme, &format!("n{i}.test"), Family::V4);
            assert_eq!(s.name_of("acme", held).as_deref(), Some("held.test"), "{i}");
        }
        assert!(s.len() <= 4);
        drop(pin);
        s.answer(&acme, "x1.test", Family::V4);
        s.answer(&acme, "x2.test", Family::V4);
        s.answer(&acme, "x3.test", Family::V4);
        s.answer(&acme, "x4.test", Family::V4);
        assert_eq!(s.name_of("acme", held), None);
    }

    #[test]
    fn all_pinned_is_exhausted_not_evicted() {
        let s = pools(2);
        let acme: Arc<str> = Arc::from("acme");
        let a = addr(s.answer(&acme, "a.test", Family::V4));
        let b = addr(s.answer(&acme, "b.test", Family::V4));
        let (pa, pb) = (s.pin("acme", a), s.pin("acme", b));
        assert_eq!(s.answer(&acme, "c.test", Family::V4), Answer::Exhausted);
        assert_eq!(s.name_of("acme", a).as_deref(), Some("a.test"));
        drop((pa, pb));
        assert!(matches!(
            s.answer(&acme, "c.test", Family::V4),
            Answer::Addr(_)
        ));
    }

    #[test]
    fn one_org_never_evicts_another_and_a_full_org_evicts_only_its_own() {
        let s = Synthetic::new(Some("198.18.200.0/24".parse().unwrap()), None, 4096);
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        let held: Vec<IpAddr> = (0..10)
            .map(|i| addr(s.answer(&beta, &format!("b{i}.test"), Family::V4)))
            .collect();
        // Acme churns through four times the pool.
        for i in 0..1024 {
            addr(s.answer(&acme, &format!("n{i}.test"), Family::V4));
        }
        for (i, a) in held.iter().enumerate() {
            assert_eq!(s.name_of("beta", *a), Some(format!("b{i}.test")));
        }
        assert_eq!(s.len(), 256 + 10, "each org at most the pool");
        // Beta filling the pool evicts beta's own, never acme's.
        let acme_last = addr(s.answer(&acme, "n1023.test", Family::V4));
        for i in 10..600 {
            addr(s.answer(&beta, &format!("b{i}.test"), Family::V4));
        }
        assert_eq!(s.name_of("acme", acme_last).as_deref(), Some("n1023.test"));
        assert_eq!(s.len(), 256 + 256);
    }

    #[test]
    fn one_orgs_addresses_say_nothing_of_another_orgs_names() {
        let acme: Arc<str> = Arc::from("acme");
        let beta: Arc<str> = Arc::from("beta");
        // Acme asks 5 names, beta asks `n`, acme asks 5 more: acme's ten
        // addresses are the same whatever `n` was.
        let run = |n: usize| {
            let s = pools(4096);
            let mut seen = Vec::new();
            for i in 0..5 {
                seen.push(addr(s.answer(&acme, &format!("a{i}.test"), Family::V4)));
            }
            for i in 0..n {
                addr(s.answer(&beta, &format!("b{i}.test"), Family::V4));
                addr(s.answer(&beta, &format!("b{i}.test"), Family::V6));
            }
            for i in 5..10 {
                seen.push(addr(s.answer(&acme, &format!("a{i}.test"), Family::V4)));
            }
            seen
        };
        let alone = run(0);
        for n in [1, 37, 255, 1000] {
            assert_eq!(run(n), alone, "{n}");
        }
        let expected: Vec<IpAddr> = (0..10)
            .map(|i| format!("198.18.200.{i}").parse().unwrap())
            .collect();
        assert_eq!(alone, expected);
    }

    #[test]
    fn the_per_org_cap_never_exceeds_the_smaller_pool() {
        let v4: Ipv4Net = "198.18.200.0/24".parse().unwrap();
        let v6: Ipv6Net = "2001:2::/96".parse().unwrap();
        use crate::config::synthetic_per_org;
        assert_eq!(synthetic_per_org(Some(v4), Some(v6)), 256);
        assert_eq!(synthetic_per_org(None, Some(v6)), MAX_SYNTHETIC_PER_ORG);
        assert_eq!(synthetic_per_org(None, None), 0);
        let s = Synthetic::new(Some(v4), None, 100_000);
        let acme: Arc<str> = Arc::from("acme");
        for i in 0..600 {
            assert!(matches!(
                s.answer(&acme, &format!("n{i}.test"), Family::V4),
                Answer::Addr(_)
            ));
        }
        assert_eq!(s.len(), 256);
    }

    #[test]
    fn retain_drops_what_it_is_told_and_a_stale_pin_is_harmless() {
        let s = pools(10);
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        let a = addr(s.answer(&acme, "a.test", Family::V4));
        let b = addr(s.answer(&beta, "b.test", Family::V4));
        let pin = s.pin("acme", a);
        assert_eq!(s.retain(|org, _| org != "acme"), 1);
        assert_eq!(s.name_of("acme", a), None);
        assert_eq!(s.name_of("beta", b).as_deref(), Some("b.test"));
        // Re-made after the reload, then the old pin goes: the new mapping
        // is not pinned by it.
        s.answer(&acme, "a.test", Family::V4);
        drop(pin);
        assert_eq!(s.retain(|_, _| true), 0);
    }
}
