//! Which addresses the DNS shim handed to which org for which name, and
//! until when. The transparent proxy asks [`Bindings::is_bound`] before it
//! believes that a connection to an address belongs to an allowed name;
//! PTR queries are answered from [`Bindings::names_for`].
//!
//! Pure bookkeeping: the caller passes `now`, nothing here reads a clock.
//! Bounded: at most `per_name` addresses per (org, name), the soonest to
//! expire replaced first; at most `total` bindings overall, the oldest
//! (least recently handed out) evicted first.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::policy::canonical;

/// Expired bindings checked (and dropped) per `bind` call, oldest first.
const SWEEP_PER_BIND: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Entry {
    addr: IpAddr,
    expires: Instant,
    seq: u64,
}

#[derive(Debug, Default)]
struct OrgBindings {
    by_name: HashMap<String, Vec<Entry>>,
    by_addr: HashMap<IpAddr, Vec<String>>,
}

#[derive(Debug, Default)]
struct Inner {
    orgs: HashMap<Arc<str>, OrgBindings>,
    /// Every binding by the sequence number of its last `bind`: the first is the oldest.
    order: BTreeMap<u64, (Arc<str>, String, IpAddr)>,
    next_seq: u64,
}

impl Inner {
    fn remove(&mut self, org: &Arc<str>, name: &str, addr: IpAddr) {
        let Some(o) = self.orgs.get_mut(org) else {
            return;
        };
        if let Some(list) = o.by_name.get_mut(name) {
            if let Some(pos) = list.iter().position(|e| e.addr == addr) {
                let e = list.swap_remove(pos);
                self.order.remove(&e.seq);
            }
            if list.is_empty() {
                o.by_name.remove(name);
            }
        }
        if let Some(names) = o.by_addr.get_mut(&addr) {
            names.retain(|n| n != name);
            if names.is_empty() {
                o.by_addr.remove(&addr);
            }
        }
        if o.by_name.is_empty() {
            self.orgs.remove(org);
        }
    }

    fn entry(&self, org: &str, name: &str, addr: IpAddr) -> Option<Entry> {
        self.orgs
            .get(org)?
            .by_name
            .get(name)?
            .iter()
            .find(|e| e.addr == addr)
            .copied()
    }
}

/// Name-address bindings of every org, shared by the DNS shim and the proxy.
#[derive(Debug)]
pub struct Bindings {
    inner: Mutex<Inner>,
    per_name: usize,
    total: usize,
}

impl Bindings {
    /// `per_name` and `total` are clamped to at least 1.
    pub fn new(per_name: usize, total: usize) -> Bindings {
        Bindings {
            inner: Mutex::new(Inner::default()),
            per_name: per_name.max(1),
            total: total.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent-enough maps:
        // every operation re-checks expiry, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record that `org` received `addr` for `name`, valid for `valid`
    /// (the answer's TTL plus the grace period) from `now`. Binding an
    /// address again refreshes it.
    pub fn bind(&self, org: &Arc<str>, name: &str, addr: IpAddr, valid: Duration, now: Instant) {
        let addr = canonical(addr);
        let expires = now + valid;
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.next_seq += 1;

        // Drop a few expired bindings, oldest first, so memory follows use.
        let stale: Vec<(Arc<str>, String, IpAddr)> = inner
            .order
            .values()
            .take(SWEEP_PER_BIND)
            .filter(|(o, n, a)| inner.entry(o, n, *a).is_none_or(|e| e.expires <= now))
            .cloned()
            .collect();
        for (o, n, a) in stale {
            inner.remove(&o, &n, a);
        }

        if let Some(old) = inner.entry(org, name, addr) {
            inner.order.remove(&old.seq);
            let o = inner.orgs.entry(org.clone()).or_default();
            if let Some(e) = o
                .by_name
                .get_mut(name)
                .and_then(|l| l.iter_mut().find(|e| e.addr == addr))
            {
                e.expires = e.expires.max(expires);
                e.seq = seq;
            }
            inner
                .order
                .insert(seq, (org.clone(), name.to_string(), addr));
            return;
        }

        // Per-name cap: replace the binding that expires soonest.
        let full = inner
            .orgs
            .get(org)
            .and_then(|o| o.by_name.get(name))
            .filter(|l| l.len() >= self.per_name)
            .and_then(|l| l.iter().min_by_key(|e| e.expires).map(|e| e.addr));
        if let Some(victim) = full {
            inner.remove(org, name, victim);
        }
        // Global cap: evict the oldest.
        while inner.order.len() >= self.total {
            let Some((_, (o, n, a))) = inner.order.pop_first() else {
                break;
            };
            inner.remove(&o, &n, a);
        }

        let o = inner.orgs.entry(org.clone()).or_default();
        o.by_name
            .entry(name.to_string())
            .or_default()
            .push(Entry { addr, expires, seq });
        o.by_addr.entry(addr).or_default().push(name.to_string());
        inner
            .order
            .insert(seq, (org.clone(), name.to_string(), addr));
    }

    /// Did `org` receive `addr` for `name`, and is that still valid at `now`?
    pub fn is_bound(&self, org: &str, name: &str, addr: IpAddr, now: Instant) -> bool {
        self.lock()
            .entry(org, name, canonical(addr))
            .is_some_and(|e| e.expires > now)
    }

    /// Names `org` received `addr` for that are still valid at `now`, each
    /// with its remaining validity; sorted by name.
    pub fn names_for(&self, org: &str, addr: IpAddr, now: Instant) -> Vec<(String, Duration)> {
        let addr = canonical(addr);
        let inner = self.lock();
        let Some(names) = inner.orgs.get(org).and_then(|o| o.by_addr.get(&addr)) else {
            return Vec::new();
        };
        let mut out: Vec<(String, Duration)> = names
            .iter()
            .filter_map(|n| {
                let e = inner.entry(org, n, addr)?;
                (e.expires > now).then(|| (n.clone(), e.expires - now))
            })
            .collect();
        out.sort();
        out
    }

    /// Number of bindings held (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.lock().order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The proxy's view of the bindings (transparent mode): valid as of now.
impl crate::proxy::NameBindings for Bindings {
    fn is_bound(&self, org: &str, name: &str, addr: IpAddr) -> bool {
        Bindings::is_bound(self, org, name, addr, Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn bound_until_expiry_and_per_org() {
        let b = Bindings::new(4, 100);
        let t0 = Instant::now();
        let acme: Arc<str> = Arc::from("acme");
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0);
        assert!(b.is_bound("acme", "a.test", ip("198.18.2.10"), t0 + 9 * SEC));
        assert!(!b.is_bound("acme", "a.test", ip("198.18.2.10"), t0 + 10 * SEC));
        assert!(!b.is_bound("other", "a.test", ip("198.18.2.10"), t0));
        assert!(!b.is_bound("acme", "b.test", ip("198.18.2.10"), t0));
        assert!(!b.is_bound("acme", "a.test", ip("198.18.2.11"), t0));
        // IPv4-mapped IPv6 is the same address.
        assert!(b.is_bound("acme", "a.test", ip("::ffff:198.18.2.10"), t0));
    }

    #[test]
    fn rebinding_refreshes() {
        let b = Bindings::new(4, 100);
        let t0 = Instant::now();
        let acme: Arc<str> = Arc::from("acme");
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0 + 5 * SEC);
        assert!(b.is_bound("acme", "a.test", ip("198.18.2.10"), t0 + 14 * SEC));
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn per_name_cap_replaces_soonest_expiry() {
        let b = Bindings::new(2, 100);
        let t0 = Instant::now();
        let acme: Arc<str> = Arc::from("acme");
        b.bind(&acme, "a.test", ip("198.18.2.1"), 5 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.2"), 50 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.3"), 50 * SEC, t0);
        assert!(!b.is_bound("acme", "a.test", ip("198.18.2.1"), t0));
        assert!(b.is_bound("acme", "a.test", ip("198.18.2.2"), t0));
        assert!(b.is_bound("acme", "a.test", ip("198.18.2.3"), t0));
        assert_eq!(b.len(), 2);
        assert!(b.names_for("acme", ip("198.18.2.1"), t0).is_empty());
    }

    #[test]
    fn global_cap_evicts_oldest() {
        let b = Bindings::new(8, 3);
        let t0 = Instant::now();
        let acme: Arc<str> = Arc::from("acme");
        for i in 1..=5u8 {
            b.bind(&acme, &format!("n{i}.test"), ip("198.18.2.1"), 60 * SEC, t0);
        }
        assert_eq!(b.len(), 3);
        assert!(!b.is_bound("acme", "n1.test", ip("198.18.2.1"), t0));
        assert!(!b.is_bound("acme", "n2.test", ip("198.18.2.1"), t0));
        assert!(b.is_bound("acme", "n5.test", ip("198.18.2.1"), t0));
        let names: Vec<String> = b
            .names_for("acme", ip("198.18.2.1"), t0)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["n3.test", "n4.test", "n5.test"]);
    }

    #[test]
    fn expired_bindings_are_swept() {
        let b = Bindings::new(8, 100);
        let t0 = Instant::now();
        let acme: Arc<str> = Arc::from("acme");
        for i in 0..4u8 {
            b.bind(&acme, &format!("n{i}.test"), ip("198.18.2.1"), SEC, t0);
        }
        b.bind(&acme, "later.test", ip("198.18.2.2"), SEC, t0 + 2 * SEC);
        assert_eq!(b.len(), 1);
        assert!(b
            .names_for("acme", ip("198.18.2.1"), t0 + 2 * SEC)
            .is_empty());
    }

    #[test]
    fn names_for_is_per_org_with_remaining_validity() {
        let b = Bindings::new(8, 100);
        let t0 = Instant::now();
        let (acme, other): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("other"));
        b.bind(&acme, "b.test", ip("198.18.2.1"), 30 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.1"), 10 * SEC, t0);
        b.bind(&other, "secret.test", ip("198.18.2.1"), 30 * SEC, t0);
        let got = b.names_for("acme", ip("198.18.2.1"), t0 + 4 * SEC);
        assert_eq!(
            got,
            vec![
                ("a.test".to_string(), 6 * SEC),
                ("b.test".to_string(), 26 * SEC)
            ]
        );
        assert_eq!(b.names_for("nobody", ip("198.18.2.1"), t0), vec![]);
    }
}
