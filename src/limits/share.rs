//! Who pays, and the keyed shares they pay with: one table of units held
//! per [`Payer`], each payer bounded, an entry only while it holds
//! something, every unit given back when its [`Share`] is dropped.
//!
//! A connection, a query or detection memory is paid for by its org; a
//! client of no org pays with its own source address, never an org's.
//! IPv6 addresses are counted by /64, the block one host usually holds
//! ([`client_key`]).

use std::hash::{BuildHasher, Hash, RandomState};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

use hashbrown::hash_table::{Entry, HashTable};

/// The key a source address is counted under: IPv4 (and IPv4-mapped IPv6)
/// as is, other IPv6 by its /64.
pub(crate) fn client_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Who a connection, a query or held memory is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Payer {
    Org(Arc<str>),
    /// A client of no org, by its address key ([`client_key`]).
    Client(IpAddr),
}

impl Payer {
    /// `org` when there is one, else `client`'s address key.
    pub(crate) fn of(org: Option<&Arc<str>>, client: IpAddr) -> Payer {
        org.map_or_else(|| Payer::client(client), |o| Payer::Org(o.clone()))
    }

    /// `client`'s address key, whatever its org.
    pub(crate) fn client(client: IpAddr) -> Payer {
        Payer::Client(client_key(client))
    }

    /// The org that pays, if one does.
    pub(crate) fn org(&self) -> Option<&Arc<str>> {
        match self {
            Payer::Org(name) => Some(name),
            Payer::Client(_) => None,
        }
    }
}

/// Units held per key, each key bounded (the bound given at each take);
/// a key has an entry only while it holds something. Keys can be what a
/// client chooses (its address), so they are hashed with SipHash, keyed
/// per table; a [`Share`] hashes its key once and finds its entry with
/// that hash on every grow and shrink.
#[derive(Debug)]
pub(crate) struct Shares<K> {
    table: Mutex<HashTable<(K, usize)>>,
    hasher: RandomState,
}

/// Units of one key held; given back when dropped.
#[derive(Debug)]
pub(crate) struct Share<K: Hash + Eq + Clone> {
    shares: Arc<Shares<K>>,
    key: K,
    /// `key`'s hash in the table.
    hash: u64,
    max: usize,
    held: usize,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Shares {
            table: Mutex::new(HashTable::new()),
            hasher: RandomState::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashTable<(K, usize)>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `n` units of `key`, if that keeps it within `max`.
    pub(crate) fn take(self: &Arc<Self>, key: K, n: usize, max: usize) -> Option<Share<K>> {
        let mut share = Share {
            shares: self.clone(),
            hash: self.hasher.hash_one(&key),
            key,
            max,
            held: 0,
        };
        share.grow(n).then_some(share)
    }

    /// Units `key` holds now.
    #[cfg(test)]
    pub(crate) fn held(&self, key: &K) -> usize {
        let hash = self.hasher.hash_one(key);
        self.lock()
            .find(hash, |(k, _)| k == key)
            .map_or(0, |(_, used)| *used)
    }

    /// Keys holding anything.
    #[cfg(test)]
    pub(crate) fn keys(&self) -> usize {
        self.lock().len()
    }
}

impl<K: Hash + Eq + Clone> Share<K> {
    /// Hold `n` more units, if the key stays within its bound.
    pub(crate) fn grow(&mut self, n: usize) -> bool {
        if n == 0 {
            return true;
        }
        let shares = &*self.shares;
        let mut table = shares.lock();
        let key = &self.key;
        let entry = table.entry(
            self.hash,
            |(k, _)| k == key,
            |(k, _)| shares.hasher.hash_one(k),
        );
        let used = match &entry {
            Entry::Occupied(e) => e.get().1,
            Entry::Vacant(_) => 0,
        };
        if used + n > self.max {
            return false;
        }
        match entry {
            Entry::Occupied(mut e) => e.get_mut().1 += n,
            Entry::Vacant(e) => {
                e.insert((key.clone(), n));
            }
        }
        self.held += n;
        true
    }

    /// Give back `n` units.
    pub(crate) fn shrink(&mut self, n: usize) {
        let n = n.min(self.held);
        let mut table = self.shares.lock();
        let key = &self.key;
        if let Ok(mut e) = table.find_entry(self.hash, |(k, _)| k == key) {
            let used = &mut e.get_mut().1;
            *used -= n.min(*used);
            if *used == 0 {
                e.remove();
            }
        }
        self.held -= n;
    }

    /// Units this share holds.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// The key it is held under.
    pub(crate) fn key(&self) -> &K {
        &self.key
    }
}

impl<K: Hash + Eq + Clone> Drop for Share<K> {
    fn drop(&mut self) {
        if self.held > 0 {
            self.shrink(self.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 1));

    #[test]
    fn ipv6_addresses_count_by_their_64() {
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_key(a), client_key(b));
        assert_ne!(client_key(a), client_key(c));
        let mapped: IpAddr = "::ffff:198.19.1.1".parse().unwrap();
        assert_eq!(client_key(mapped), A);
    }

    #[test]
    fn a_share_is_bounded_per_key_and_leaves_no_entry_behind() {
        let shares = Shares::new();
        let (acme, stranger) = (Payer::Org(Arc::from("acme")), Payer::client(A));
        let mut a = shares.take(acme.clone(), 2, 3).unwrap();
        assert!(shares.take(acme.clone(), 2, 3).is_none(), "over its bound");
        assert!(
            !a.grow(2) && a.held() == 2,
            "a refused grow keeps what it held"
        );
        let s = shares.take(stranger.clone(), 3, 3).unwrap();
        assert_eq!((shares.held(&acme), shares.held(&stranger)), (2, 3));
        a.shrink(1);
        assert_eq!(shares.held(&acme), 1);
        drop((a, s));
        assert_eq!(shares.keys(), 0);
        assert_eq!(Payer::of(None, A), stranger);
        assert_eq!(
            Payer::of(Some(&Arc::from("acme")), A).org().map(|o| &**o),
            Some("acme")
        );
    }
}
