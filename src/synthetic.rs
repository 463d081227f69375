//! Synthetic DNS answers: for an org with `dns_answers = "synthetic"`, the
//! shim ([`crate::dns`]) answers an allowed name with an address of the
//! `[dns] synthetic_pool` (IPv4) or `synthetic_pool_v6` (IPv6) bound to
//! (org, name), resolving nothing; the proxy ([`crate::proxy::decide`])
//! takes a connection to such an address for the name it is bound to.
//!
//! Pure bookkeeping: no clock, no I/O (recency is a sequence number).
//! Every address of the pools is bound to at most one (org, name) at a
//! time, so an address handed to one org is never bound for another.
//! Bounded:
//!
//! - at most `per_org` mappings per org: over it, that org's own least
//!   recently used mapping goes;
//! - at most `total` mappings in all (and never more than the smaller
//!   pool holds): over it, the least recently used of any org goes;
//! - a mapping with an open connection ([`Pinned`]) is never evicted; when
//!   every candidate is pinned, no new mapping is made
//!   ([`Answer::Exhausted`]).
//!
//! Addresses are handed out round-robin through each pool, skipping those
//! in use, so an evicted address is reused as late as possible: a client
//! that cached it past its TTL reaches nothing (`synthetic_unbound`)
//! rather than another name, until the pool has come round.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::policy::canonical;

/// TTL of a synthetic answer, in seconds: short, so that a client asks
/// again (and refreshes the mapping's recency) rather than holding an
/// address that may have been evicted and bound to another name since.
pub(crate) const SYNTHETIC_TTL: u32 = 10;
/// Mappings one org may hold.
pub(crate) const MAX_MAPPINGS_PER_ORG: usize = 4096;
/// Mappings of all orgs together.
pub(crate) const MAX_MAPPINGS: usize = 16_384;

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
    /// Every address that could be taken belongs to a mapping with an
    /// open connection: nothing to answer with.
    Exhausted,
}

/// What an address connected to stands for, for one org.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// Not in any pool: an ordinary address.
    NotSynthetic,
    /// In a pool but bound to no name of this org (never handed out,
    /// evicted, or another org's): `synthetic_unbound`.
    Unbound,
    /// Bound to this name for this org, pinned while `Pinned` lives.
    Bound(String, Pinned),
}

type Key = (Arc<str>, String);

#[derive(Debug)]
struct Mapping {
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
    /// Recency: its key in `Inner::order`.
    seq: u64,
    /// Open connections using it.
    pins: usize,
    /// Tells a re-made mapping of the same key from this one.
    generation: u64,
}

#[derive(Debug, Default)]
struct Inner {
    maps: HashMap<Key, Mapping>,
    by_addr: HashMap<IpAddr, Key>,
    /// Every mapping by recency: the first is the least recently used.
    order: BTreeMap<u64, Key>,
    per_org: HashMap<Arc<str>, usize>,
    next_seq: u64,
    next_v4: u32,
    next_v6: u128,
}

impl Inner {
    fn touch(&mut self, key: &Key) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(m) = self.maps.get_mut(key) {
            self.order.remove(&m.seq);
            m.seq = seq;
            self.order.insert(seq, key.clone());
        }
    }

    fn remove(&mut self, key: &Key) {
        let Some(m) = self.maps.remove(key) else {
            return;
        };
        self.order.remove(&m.seq);
        if let Some(a) = m.v4 {
            self.by_addr.remove(&IpAddr::V4(a));
        }
        if let Some(a) = m.v6 {
            self.by_addr.remove(&IpAddr::V6(a));
        }
        if let Some(n) = self.per_org.get_mut(&key.0) {
            *n -= 1;
            if *n == 0 {
                self.per_org.remove(&key.0);
            }
        }
    }

    /// Evict the least recently used unpinned mapping (of `org` only, if
    /// given); `false`: every candidate is pinned.
    fn evict(&mut self, org: Option<&str>) -> bool {
        let victim = self
            .order
            .values()
            .find(|k| {
                org.is_none_or(|o| &*k.0 == o) && self.maps.get(*k).is_some_and(|m| m.pins == 0)
            })
            .cloned();
        match victim {
            Some(k) => {
                self.remove(&k);
                true
            }
            None => false,
        }
    }
}

/// The pools and every org's mappings, shared by the DNS shim and the proxy.
#[derive(Debug)]
pub(crate) struct Synthetic {
    inner: Mutex<Inner>,
    v4: Option<Ipv4Net>,
    v6: Option<Ipv6Net>,
    per_org: usize,
    total: usize,
    generations: std::sync::atomic::AtomicU64,
}

/// A mapping held by an open connection: never evicted while this lives.
#[derive(Debug)]
pub(crate) struct Pinned {
    owner: Arc<Synthetic>,
    key: Key,
    generation: u64,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut inner = self.owner.lock();
        if let Some(m) = inner.maps.get_mut(&self.key) {
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
    /// Pools `v4` and `v6` (either may be absent), `per_org` and `total`
    /// clamped to at least 1 and `total` to what the smaller pool holds.
    pub(crate) fn new(
        v4: Option<Ipv4Net>,
        v6: Option<Ipv6Net>,
        per_org: usize,
        total: usize,
    ) -> Synthetic {
        let v4 = v4.map(|n| n.trunc());
        let v6 = v6.map(|n| n.trunc());
        let smallest = [v4.map(IpNet::V4), v6.map(IpNet::V6)]
            .into_iter()
            .flatten()
            .map(pool_size)
            .min()
            .unwrap_or(0);
        let total = usize::try_from(smallest).unwrap_or(usize::MAX).min(total);
        Synthetic {
            inner: Mutex::new(Inner::default()),
            v4,
            v6,
            per_org: per_org.max(1),
            total: total.max(1),
            generations: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The pools of `[dns]`, with the fixed bounds; `None` when neither is set.
    pub(crate) fn from_config(dns: &crate::config::DnsConfig) -> Option<Synthetic> {
        if dns.synthetic_pool.is_none() && dns.synthetic_pool_v6.is_none() {
            return None;
        }
        Some(Synthetic::new(
            dns.synthetic_pool,
            dns.synthetic_pool_v6,
            MAX_MAPPINGS_PER_ORG,
            MAX_MAPPINGS,
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
    /// already, else a new one (round-robin through the pool), making room
    /// by evicting least recently used mappings that no connection holds.
    pub(crate) fn answer(&self, org: &Arc<str>, name: &str, family: Family) -> Answer {
        if match family {
            Family::V4 => self.v4.is_none(),
            Family::V6 => self.v6.is_none(),
        } {
            return Answer::NoPool;
        }
        let key: Key = (org.clone(), name.to_string());
        let mut inner = self.lock();
        if let Some(m) = inner.maps.get(&key) {
            let have = match family {
                Family::V4 => m.v4.map(IpAddr::V4),
                Family::V6 => m.v6.map(IpAddr::V6),
            };
            if let Some(addr) = have {
                inner.touch(&key);
                return Answer::Addr(addr);
            }
        } else {
            while inner.per_org.get(org).copied().unwrap_or(0) >= self.per_org {
                if !inner.evict(Some(org)) {
                    return Answer::Exhausted;
                }
            }
            while inner.maps.len() >= self.total {
                if !inner.evict(None) {
                    return Answer::Exhausted;
                }
            }
            let seq = inner.next_seq;
            inner.next_seq += 1;
            let generation = self
                .generations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            inner.maps.insert(
                key.clone(),
                Mapping {
                    v4: None,
                    v6: None,
                    seq,
                    pins: 0,
                    generation,
                },
            );
            inner.order.insert(seq, key.clone());
            *inner.per_org.entry(org.clone()).or_default() += 1;
        }
        // Fewer mappings than the smaller pool holds: a free address exists
        // within `len + 1` steps of the cursor.
        let addr = match family {
            Family::V4 => {
                let Some(net) = self.v4 else {
                    return Answer::NoPool;
                };
                let size = u32::try_from(pool_size(IpNet::V4(net))).unwrap_or(u32::MAX);
                let base = u32::from(net.network());
                let mut found = None;
                for _ in 0..=inner.maps.len() {
                    let off = inner.next_v4 % size;
                    inner.next_v4 = inner.next_v4.wrapping_add(1) % size;
                    let a = IpAddr::V4(Ipv4Addr::from(base.wrapping_add(off)));
                    if !inner.by_addr.contains_key(&a) {
                        found = Some(a);
                        break;
                    }
                }
                found
            }
            Family::V6 => {
                let Some(net) = self.v6 else {
                    return Answer::NoPool;
                };
                let size = pool_size(IpNet::V6(net));
                let base = u128::from(net.network());
                let mut found = None;
                for _ in 0..=inner.maps.len() {
                    let off = inner.next_v6 % size;
                    inner.next_v6 = inner.next_v6.wrapping_add(1) % size;
                    let a = IpAddr::V6(Ipv6Addr::from(base.wrapping_add(off)));
                    if !inner.by_addr.contains_key(&a) {
                        found = Some(a);
                        break;
                    }
                }
                found
            }
        };
        let Some(addr) = addr else {
            return Answer::Exhausted;
        };
        inner.by_addr.insert(addr, key.clone());
        if let Some(m) = inner.maps.get_mut(&key) {
            match addr {
                IpAddr::V4(a) => m.v4 = Some(a),
                IpAddr::V6(a) => m.v6 = Some(a),
            }
        }
        inner.touch(&key);
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
        let Some(key) = inner.by_addr.get(&addr).cloned() else {
            return Lookup::Unbound;
        };
        if &*key.0 != org {
            return Lookup::Unbound;
        }
        inner.touch(&key);
        let Some(m) = inner.maps.get_mut(&key) else {
            return Lookup::Unbound;
        };
        m.pins += 1;
        let generation = m.generation;
        Lookup::Bound(
            key.1.clone(),
            Pinned {
                owner: self.clone(),
                key,
                generation,
            },
        )
    }

    /// The name `addr` is bound to for `org`, without pinning.
    #[cfg(test)]
    pub(crate) fn name_of(&self, org: &str, addr: IpAddr) -> Option<String> {
        let inner = self.lock();
        let key = inner.by_addr.get(&canonical(addr))?;
        (&*key.0 == org).then(|| key.1.clone())
    }

    /// Keep only the mappings whose (org, name) `keep` accepts (after a
    /// reload: orgs still synthetic, names still allowed); returns how
    /// many went. A pinned one goes too: its connection is the
    /// revocation's to close, and its pin is released harmlessly.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&str, &str) -> bool) -> usize {
        let mut inner = self.lock();
        let gone: Vec<Key> = inner
            .maps
            .keys()
            .filter(|(org, name)| !keep(org, name))
            .cloned()
            .collect();
        for k in &gone {
            inner.remove(k);
        }
        gone.len()
    }

    /// Mappings held (all orgs).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().maps.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools(per_org: usize, total: usize) -> Arc<Synthetic> {
        Arc::new(Synthetic::new(
            Some("198.18.200.0/24".parse().unwrap()),
            Some("2001:2:0:200::/120".parse().unwrap()),
            per_org,
            total,
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
        let s = pools(100, 1000);
        let acme: Arc<str> = Arc::from("acme");
        let beta: Arc<str> = Arc::from("beta");
        let a = addr(s.answer(&acme, "a.test", Family::V4));
        assert_eq!(a, "198.18.200.0".parse::<IpAddr>().unwrap());
        assert_eq!(addr(s.answer(&acme, "a.test", Family::V4)), a);
        let a6 = addr(s.answer(&acme, "a.test", Family::V6));
        assert!(s.contains(a6) && a6.is_ipv6());
        // Another name, another org: other addresses.
        let b = addr(s.answer(&acme, "b.test", Family::V4));
        let beta_a = addr(s.answer(&beta, "a.test", Family::V4));
        assert!(a != b && a != beta_a && b != beta_a);
        assert_eq!(s.name_of("acme", a).as_deref(), Some("a.test"));
        assert_eq!(s.name_of("acme", a6).as_deref(), Some("a.test"));
        // Acme's address means nothing to beta.
        assert!(matches!(s.pin("beta", a), Lookup::Unbound));
        assert!(matches!(s.pin("acme", beta_a), Lookup::Unbound));
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
        let s = Synthetic::new(Some("198.18.200.0/24".parse().unwrap()), None, 10, 10);
        let acme: Arc<str> = Arc::from("acme");
        assert_eq!(s.answer(&acme, "a.test", Family::V6), Answer::NoPool);
        assert!(matches!(
            s.answer(&acme, "a.test", Family::V4),
            Answer::Addr(_)
        ));
    }

    #[test]
    fn least_recently_used_goes_and_its_address_comes_back_last() {
        let s = pools(3, 1000);
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
        let s = pools(4, 8);
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
        let s = pools(2, 2);
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
    fn one_org_cannot_evict_another_below_its_share() {
        let s = pools(3, 6);
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        let b = addr(s.answer(&beta, "b.test", Family::V4));
        for i in 0..100 {
            s.answer(&acme, &format!("n{i}.test"), Family::V4);
        }
        assert_eq!(s.name_of("beta", b).as_deref(), Some("b.test"));
    }

    #[test]
    fn the_total_never_exceeds_the_smaller_pool() {
        let s = Synthetic::new(
            Some("198.18.200.0/24".parse().unwrap()),
            None,
            100_000,
            100_000,
        );
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
        let s = pools(10, 10);
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
