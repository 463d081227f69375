//! Synthetic DNS answers: for an org with `dns_answers = "synthetic"`, the
//! shim ([`crate::dns`]) answers an allowed name with an address of the
//! `[dns] synthetic_pool` (IPv4) or `synthetic_pool_v6` (IPv6) bound to
//! (org, name), resolving nothing; the proxy ([`crate::proxy::decide`])
//! takes a connection to such an address for the name it is bound to.
//!
//! Pure bookkeeping: no clock, no I/O (recency is a sequence number).
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

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::config::MAX_SYNTHETIC_PER_ORG;
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

#[derive(Debug)]
struct Mapping {
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    /// Recency: its key in `OrgMaps::order`.
    seq: u64,
    /// Open connections using it.
    pins: usize,
    /// Tells a re-made mapping of the same key from this one.
    generation: u64,
}

/// One org's mappings, addresses and cursors: nothing in it depends on
/// any other org.
#[derive(Debug, Default)]
struct OrgMaps {
    maps: HashMap<String, Mapping>,
    by_addr: HashMap<IpAddr, String>,
    /// Every mapping by recency: the first is the least recently used.
    order: BTreeMap<u64, String>,
    next_v4: u32,
    next_v6: u128,
}

#[derive(Debug, Default)]
struct Inner {
    orgs: HashMap<Arc<str>, OrgMaps>,
    next_seq: u64,
}

impl Inner {
    fn seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }
}

impl OrgMaps {
    fn touch(&mut self, name: &str, seq: u64) {
        if let Some(m) = self.maps.get_mut(name) {
            self.order.remove(&m.seq);
            m.seq = seq;
            self.order.insert(seq, name.to_string());
        }
    }

    fn remove(&mut self, name: &str) {
        let Some(m) = self.maps.remove(name) else {
            return;
        };
        self.order.remove(&m.seq);
        if let Some(a) = m.v4 {
            self.by_addr.remove(&IpAddr::V4(a));
        }
        if let Some(a) = m.v6 {
            self.by_addr.remove(&IpAddr::V6(a));
        }
    }

    /// Evict this org's least recently used unpinned mapping; `false`:
    /// every one is pinned.
    fn evict(&mut self) -> bool {
        let victim = self
            .order
            .values()
            .find(|n| self.maps.get(*n).is_some_and(|m| m.pins == 0))
            .cloned();
        match victim {
            Some(n) => {
                self.remove(&n);
                true
            }
            None => false,
        }
    }

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
        for _ in 0..=self.maps.len() {
            let off = *cursor % size;
            *cursor = (off + 1) % size;
            let a = addr(base.wrapping_add(off));
            if !self.by_addr.contains_key(&a) {
                return Some(a);
            }
        }
        None
    }
}

/// The pools and every org's mappings, shared by the DNS shim and the proxy.
#[derive(Debug)]
pub(crate) struct Synthetic {
    inner: Mutex<Inner>,
    v4: Option<Ipv4Net>,
    v6: Option<Ipv6Net>,
    per_org: usize,
    generations: std::sync::atomic::AtomicU64,
}

/// A mapping held by an open connection: never evicted while this lives.
#[derive(Debug)]
pub(crate) struct Pinned {
    owner: Arc<Synthetic>,
    org: Arc<str>,
    name: String,
    generation: u64,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut inner = self.owner.lock();
        if let Some(m) = inner
            .orgs
            .get_mut(&self.org)
            .and_then(|o| o.maps.get_mut(&self.name))
        {
            if m.generation == self.generation {
                m.pins = m.pins.saturating_sub(1);
            }
        }
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
            inner: Mutex::new(Inner::default()),
            v4,
            v6,
            per_org: per_org.max(1),
            generations: std::sync::atomic::AtomicU64::new(0),
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
        let seq = inner.seq();
        let maps = inner.orgs.entry(org.clone()).or_default();
        if let Some(m) = maps.maps.get(name) {
            let have = match family {
                Family::V4 => m.v4.map(IpAddr::V4),
                Family::V6 => m.v6.map(IpAddr::V6),
            };
            if let Some(addr) = have {
                maps.touch(name, seq);
                return Answer::Addr(addr);
            }
        } else {
            while maps.maps.len() >= self.per_org {
                if !maps.evict() {
                    return Answer::Exhausted;
                }
            }
            let generation = self
                .generations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            maps.maps.insert(
                name.to_string(),
                Mapping {
                    v4: None,
                    v6: None,
                    seq,
                    pins: 0,
                    generation,
                },
            );
            maps.order.insert(seq, name.to_string());
        }
        let addr = match (family, self.v4, self.v6) {
            (Family::V4, Some(net), _) => {
                let mut cursor = u128::from(maps.next_v4);
                let size = pool_size(IpNet::V4(net));
                let base = u128::from(u32::from(net.network()));
                let found = maps.free(base, size, &mut cursor, |a| {
                    IpAddr::V4(Ipv4Addr::from(u32::try_from(a).unwrap_or(u32::MAX)))
                });
                maps.next_v4 = u32::try_from(cursor).unwrap_or(0);
                found
            }
            (Family::V6, _, Some(net)) => {
                let mut cursor = maps.next_v6;
                let size = pool_size(IpNet::V6(net));
                let base = u128::from(net.network());
                let found = maps.free(base, size, &mut cursor, |a| IpAddr::V6(Ipv6Addr::from(a)));
                maps.next_v6 = cursor;
                found
            }
            _ => None,
        };
        let Some(addr) = addr else {
            // Unreachable by the bound above; the mapping made stays empty
            // and goes like any other.
            return Answer::Exhausted;
        };
        maps.by_addr.insert(addr, name.to_string());
        if let Some(m) = maps.maps.get_mut(name) {
            match addr {
                IpAddr::V4(a) => m.v4 = Some(a),
                IpAddr::V6(a) => m.v6 = Some(a),
            }
        }
        maps.touch(name, seq);
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
        let seq = inner.seq();
        let Some(org) = inner.orgs.get_key_value(org).map(|(k, _)| k.clone()) else {
            return Lookup::Unbound;
        };
        let Some(maps) = inner.orgs.get_mut(&org) else {
            return Lookup::Unbound;
        };
        let Some(name) = maps.by_addr.get(&addr).cloned() else {
            return Lookup::Unbound;
        };
        maps.touch(&name, seq);
        let Some(m) = maps.maps.get_mut(&name) else {
            return Lookup::Unbound;
        };
        m.pins += 1;
        let generation = m.generation;
        Lookup::Bound(
            name.clone(),
            Pinned {
                owner: self.clone(),
                org,
                name,
                generation,
            },
        )
    }

    /// The name `addr` is bound to for `org`, without pinning.
    #[cfg(test)]
    pub(crate) fn name_of(&self, org: &str, addr: IpAddr) -> Option<String> {
        let inner = self.lock();
        inner.orgs.get(org)?.by_addr.get(&canonical(addr)).cloned()
    }

    /// Keep only the mappings whose (org, name) `keep` accepts (after a
    /// reload: orgs still synthetic, names still allowed); returns how
    /// many went. A pinned one goes too: its connection is the
    /// revocation's to close, and its pin is released harmlessly.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&str, &str) -> bool) -> usize {
        let mut inner = self.lock();
        let mut gone = 0;
        for (org, maps) in &mut inner.orgs {
            let drop: Vec<String> = maps
                .maps
                .keys()
                .filter(|name| !keep(org, name))
                .cloned()
                .collect();
            for name in &drop {
                maps.remove(name);
            }
            gone += drop.len();
        }
        inner.orgs.retain(|_, maps| !maps.maps.is_empty());
        gone
    }

    /// Mappings held (all orgs).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().orgs.values().map(|o| o.maps.len()).sum()
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
