//! Which addresses the DNS shim handed to which org for which name, and
//! until when: written by the shim ([`crate::dns`]), read by the
//! transparent proxy through [`NameBindings`], which asks
//! [`Bindings::is_bound`] before it believes that a connection to an
//! address belongs to an allowed name; PTR queries are answered from
//! [`Bindings::names_for`].
//!
//! Pure bookkeeping: the caller passes `now`, nothing here reads a clock.
//! Bounded, and one org's churn cannot evict another org's bindings:
//!
//! - at most `per_name` addresses per (org, name): the soonest to expire
//!   is replaced;
//! - at most `per_org` bindings per org: over it, that org's own oldest
//!   (least recently handed out) binding is evicted;
//! - at most `total` bindings overall: when full, an expired binding goes
//!   first, else the oldest binding of the org holding the most. An org
//!   holding no more than any other is never evicted for another's sake.
//!
//! The caps per org and overall are those of the [`FairTable`] the
//! bindings are held in; the cap per name and the lookups by name and by
//! address are this file's own indexes into it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::limits::table::FairTable;
use crate::policy::canonical;

/// Expired bindings of the binding org checked (and dropped) per `bind` call, oldest first.
const SWEEP_PER_BIND: usize = 8;

/// One binding: (org, name) received `addr`, valid until `expires`.
#[derive(Debug)]
struct Bound {
    org: Arc<str>,
    name: Arc<str>,
    addr: IpAddr,
    expires: Instant,
}

/// One org's indexes into the table: its bindings by name and by address.
#[derive(Debug, Default)]
struct OrgIndex {
    by_name: HashMap<Arc<str>, Vec<u64>>,
    by_addr: HashMap<IpAddr, Vec<u64>>,
}

#[derive(Debug)]
struct Inner {
    /// Every binding under an id never reused, held by its org, in the
    /// order of its last `bind` (place `()`: a bind moves it to the back).
    table: FairTable<Arc<str>, u64, Bound, ()>,
    orgs: HashMap<Arc<str>, OrgIndex>,
    next_id: u64,
}

/// Forget `id` in `list`, and the list's entry in `map` once empty.
fn forget<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Vec<u64>>, key: &K, id: u64) {
    if let Some(list) = map.get_mut(key) {
        list.retain(|i| *i != id);
        if list.is_empty() {
            map.remove(key);
        }
    }
}

impl Inner {
    /// Drop from the org's indexes the bindings that left the table.
    fn unindex(&mut self, gone: Vec<(u64, Bound)>) {
        for (id, b) in gone {
            let Some(o) = self.orgs.get_mut(&b.org) else {
                continue;
            };
            forget(&mut o.by_name, &b.name, id);
            forget(&mut o.by_addr, &b.addr, id);
            if o.by_name.is_empty() {
                self.orgs.remove(&b.org);
            }
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(b) = self.table.remove(&id) {
            self.unindex(vec![(id, b)]);
        }
    }

    /// The binding of (org, name) to `addr`.
    fn find(&self, org: &str, name: &str, addr: IpAddr) -> Option<(u64, &Bound)> {
        self.orgs
            .get(org)?
            .by_name
            .get(name)?
            .iter()
            .filter_map(|id| Some((*id, self.table.get(id)?)))
            .find(|(_, b)| b.addr == addr)
    }
}

/// Epochs, unique across every table of this process ([`Bindings::epoch`]).
static EPOCHS: AtomicU64 = AtomicU64::new(1);

/// Name-address bindings of every org, shared by the DNS shim and the proxy.
#[derive(Debug)]
pub(crate) struct Bindings {
    inner: Mutex<Inner>,
    per_name: usize,
    /// Changes whenever a binding leaves the table ([`Bindings::epoch`]).
    epoch: AtomicU64,
}

impl Bindings {
    /// `per_name`, `per_org` and `total` are clamped to at least 1.
    pub(crate) fn new(per_name: usize, per_org: usize, total: usize) -> Bindings {
        Bindings {
            inner: Mutex::new(Inner {
                table: FairTable::new(total.max(1), per_org.max(1)),
                orgs: HashMap::new(),
                next_id: 0,
            }),
            per_name: per_name.max(1),
            epoch: AtomicU64::new(EPOCHS.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// A number that changes whenever a binding leaves this table (expired
    /// and swept, evicted, dropped by a reload), never taken by another
    /// table: while it stays the same, every binding made since it was
    /// read is still held, and a caller that made its own needs not look.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// A binding left the table: a new epoch.
    fn left(&self) {
        self.epoch
            .store(EPOCHS.fetch_add(1, Ordering::Relaxed), Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent-enough maps:
        // every operation re-checks expiry, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record that `org` received `addr` for `name`, valid for `valid`
    /// (the answer's TTL plus the grace period) from `now`. Binding an
    /// address again refreshes it.
    pub(crate) fn bind(
        &self,
        org: &Arc<str>,
        name: &str,
        addr: IpAddr,
        valid: Duration,
        now: Instant,
    ) {
        let addr = canonical(addr);
        let expires = now + valid;
        let mut inner = self.lock();
        let expired = |_: &(), b: &Bound| b.expires <= now;

        // Drop a few of this org's expired bindings, oldest first, so
        // memory follows use.
        let gone = inner.table.sweep(Some(org), SWEEP_PER_BIND, expired);
        if !gone.is_empty() {
            self.left();
        }
        inner.unindex(gone);

        if let Some((id, _)) = inner.find(org, name, addr) {
            inner
                .table
                .reorder_with(&id, (), |b| b.expires = b.expires.max(expires));
            return;
        }

        // Per-name cap: replace the binding that expires soonest.
        let full = inner
            .orgs
            .get(org)
            .and_then(|o| o.by_name.get(name))
            .filter(|ids| ids.len() >= self.per_name)
            .and_then(|ids| {
                ids.iter()
                    .filter_map(|id| Some((*id, inner.table.get(id)?.expires)))
                    .min_by_key(|(_, e)| *e)
            });
        if let Some((victim, _)) = full {
            inner.remove(victim);
            self.left();
        }

        // Per-org cap: this org's own oldest goes; global cap: an expired
        // binding, else the oldest of the org holding the most.
        let id = inner.next_id;
        inner.next_id += 1;
        let name: Arc<str> = Arc::from(name);
        let bound = Bound {
            org: org.clone(),
            name: name.clone(),
            addr,
            expires,
        };
        // Nothing is pinned: the insert always finds room.
        if let Ok(gone) = inner.table.insert(org.clone(), id, bound, (), expired) {
            if !gone.is_empty() {
                self.left();
            }
            inner.unindex(gone);
            let o = inner.orgs.entry(org.clone()).or_default();
            o.by_name.entry(name).or_default().push(id);
            o.by_addr.entry(addr).or_default().push(id);
        }
    }

    /// Did `org` receive `addr` for `name`, and is that still valid at `now`?
    pub(crate) fn is_bound(&self, org: &str, name: &str, addr: IpAddr, now: Instant) -> bool {
        self.lock()
            .find(org, name, canonical(addr))
            .is_some_and(|(_, b)| b.expires > now)
    }

    /// Names `org` received `addr` for that are still valid at `now`, each
    /// with its remaining validity; sorted by name.
    pub(crate) fn names_for(
        &self,
        org: &str,
        addr: IpAddr,
        now: Instant,
    ) -> Vec<(String, Duration)> {
        let addr = canonical(addr);
        let inner = self.lock();
        let Some(ids) = inner.orgs.get(org).and_then(|o| o.by_addr.get(&addr)) else {
            return Vec::new();
        };
        let mut out: Vec<(String, Duration)> = ids
            .iter()
            .filter_map(|id| inner.table.get(id))
            .filter(|b| b.expires > now)
            .map(|b| (b.name.to_string(), b.expires - now))
            .collect();
        out.sort();
        out
    }

    /// Keep only the bindings whose (org, name) `keep` accepts (after a
    /// reload: those the new policy still allows); returns how many went.
    pub(crate) fn retain(&self, mut keep: impl FnMut(&str, &str) -> bool) -> usize {
        let mut inner = self.lock();
        let gone = inner.table.retain(|_, _, _, b| keep(&b.org, &b.name));
        let n = gone.len();
        if n > 0 {
            self.left();
        }
        inner.unindex(gone);
        n
    }

    /// Number of bindings held (expired ones not yet swept included).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().table.len()
    }

    /// Number of bindings `org` holds (expired ones not yet swept included).
    #[cfg(test)]
    pub(crate) fn len_of(&self, org: &str) -> usize {
        self.lock().table.org_len(&Arc::from(org))
    }
}

/// What the DNS shim handed out: did org `org` receive `addr` for `name`,
/// and is that binding still valid? Transparent mode uses it to check that
/// a connection's original destination belongs to the name it presents.
pub(crate) trait NameBindings: Send + Sync {
    fn is_bound(&self, org: &str, name: &str, addr: IpAddr, now: Instant) -> bool;
}

/// The proxy's view of the bindings (transparent mode): valid as of `now`.
impl NameBindings for Bindings {
    fn is_bound(&self, org: &str, name: &str, addr: IpAddr, now: Instant) -> bool {
        Bindings::is_bound(self, org, name, addr, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    const SEC: Duration = Duration::from_secs(1);

    /// The tests' origin of time: the only clock read here, and only to
    /// have an `Instant` to count from; the code under test is handed it.
    #[expect(clippy::disallowed_methods, reason = "an Instant to count from")]
    fn origin() -> Instant {
        Instant::now()
    }

    #[test]
    fn bound_until_expiry_and_per_org() {
        let b = Bindings::new(4, 100, 100);
        let t0 = origin();
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
    fn retain_drops_what_it_is_told_to_and_nothing_else() {
        let b = Bindings::new(4, 100, 100);
        let t0 = origin();
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.11"), 10 * SEC, t0);
        b.bind(&acme, "b.test", ip("198.18.2.10"), 10 * SEC, t0);
        b.bind(&beta, "a.test", ip("198.18.2.10"), 10 * SEC, t0);
        let gone = b.retain(|org, name| !(org == "acme" && name == "a.test"));
        assert_eq!((gone, b.len(), b.len_of("acme")), (2, 2, 1));
        assert!(!b.is_bound("acme", "a.test", ip("198.18.2.10"), t0));
        assert!(b.is_bound("acme", "b.test", ip("198.18.2.10"), t0));
        assert!(b.is_bound("beta", "a.test", ip("198.18.2.10"), t0));
        // PTR answers follow.
        assert_eq!(b.names_for("acme", ip("198.18.2.10"), t0).len(), 1);
        assert!(b.names_for("acme", ip("198.18.2.11"), t0).is_empty());
    }

    #[test]
    fn rebinding_refreshes() {
        let b = Bindings::new(4, 100, 100);
        let t0 = origin();
        let acme: Arc<str> = Arc::from("acme");
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0);
        b.bind(&acme, "a.test", ip("198.18.2.10"), 10 * SEC, t0 + 5 * SEC);
        assert!(b.is_bound("acme", "a.test", ip("198.18.2.10"), t0 + 14 * SEC));
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn per_name_cap_replaces_soonest_expiry() {
        let b = Bindings::new(2, 100, 100);
        let t0 = origin();
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
        let b = Bindings::new(8, 3, 3);
        let t0 = origin();
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
        let b = Bindings::new(8, 100, 100);
        let t0 = origin();
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
        let b = Bindings::new(8, 100, 100);
        let t0 = origin();
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

    /// `org` binds `n` names (`pattern` with `{}` replaced by 0..n) to one
    /// address for 10 minutes, one millisecond apart from `t0`.
    fn bind_many(b: &Bindings, org: &str, pattern: &str, n: u32, t0: Instant) {
        let org: Arc<str> = Arc::from(org);
        for i in 0..n {
            let t = t0 + Duration::from_millis(u64::from(i));
            let name = pattern.replace("{}", &i.to_string());
            b.bind(&org, &name, ip("198.18.2.2"), 600 * SEC, t);
        }
    }

    #[test]
    fn an_org_churning_ten_times_its_share_leaves_other_orgs_intact() {
        // Room for 40 bindings, 10 per org.
        let b = Bindings::new(8, 10, 40);
        let t0 = origin();
        bind_many(&b, "b", "b{}.test", 10, t0);
        // Org a churns random names under its wildcard: 10x its share.
        bind_many(&b, "a", "r{}.wild.test", 100, t0);
        assert_eq!(b.len_of("a"), 10);
        assert_eq!(b.len_of("b"), 10);
        for i in 0..10u8 {
            let name = format!("b{i}.test");
            assert!(b.is_bound("b", &name, ip("198.18.2.2"), t0 + SEC), "{name}");
        }
        // a keeps its newest.
        assert!(b.is_bound("a", "r99.wild.test", ip("198.18.2.2"), t0 + SEC));
        assert!(!b.is_bound("a", "r89.wild.test", ip("198.18.2.2"), t0 + SEC));
    }

    #[test]
    fn when_all_are_taken_the_biggest_holder_loses_its_oldest() {
        // No org cap to speak of: only the global one.
        let b = Bindings::new(8, 100, 10);
        let t0 = origin();
        bind_many(&b, "b", "b{}.test", 3, t0);
        bind_many(&b, "a", "r{}.test", 50, t0);
        let a: Arc<str> = Arc::from("a");
        assert_eq!(b.len(), 10);
        assert_eq!(b.len_of("b"), 3);
        assert_eq!(b.len_of("a"), 7);
        // An expired binding goes before any live one, whoever holds it.
        let c: Arc<str> = Arc::from("c");
        b.bind(&c, "short.test", ip("198.18.2.3"), SEC, t0);
        assert_eq!(b.len_of("a"), 6);
        b.bind(&a, "late.test", ip("198.18.2.2"), 600 * SEC, t0 + 2 * SEC);
        assert_eq!(b.len_of("c"), 0);
        assert_eq!(b.len_of("a"), 7);
        assert_eq!(b.len_of("b"), 3);
    }

    #[test]
    fn the_epoch_changes_when_a_binding_leaves_and_only_then() {
        let b = Bindings::new(1, 2, 4);
        let other = Bindings::new(1, 2, 4);
        assert_ne!(b.epoch(), other.epoch(), "never another table's");
        let t0 = origin();
        let a: IpAddr = "198.18.0.1".parse().unwrap();
        let c: IpAddr = "198.18.0.2".parse().unwrap();
        let org: Arc<str> = Arc::from("acme");
        let e0 = b.epoch();
        b.bind(&org, "a.test", a, Duration::from_secs(10), t0);
        b.bind(&org, "a.test", a, Duration::from_secs(20), t0);
        assert_eq!(b.epoch(), e0, "bound and refreshed: nothing left");
        // One address per name: the other one replaces it.
        b.bind(&org, "a.test", c, Duration::from_secs(10), t0);
        let e1 = b.epoch();
        assert_ne!(e1, e0, "replaced");
        // Over the org's two: its oldest is evicted.
        b.bind(&org, "b.test", a, Duration::from_secs(10), t0);
        b.bind(&org, "c.test", a, Duration::from_secs(10), t0);
        let e2 = b.epoch();
        assert_ne!(e2, e1, "evicted");
        // Expired and swept by the next bind.
        let late = t0 + Duration::from_secs(30);
        b.bind(&org, "d.test", a, Duration::from_secs(10), late);
        let e3 = b.epoch();
        assert_ne!(e3, e2, "swept");
        assert_eq!(b.retain(|_, _| true), 0);
        assert_eq!(b.epoch(), e3, "nothing dropped");
        assert_eq!(b.retain(|_, _| false), 1);
        assert_ne!(b.epoch(), e3, "dropped by a reload");
    }
}
