//! Upstream connection reuse for absolute-form HTTP/1.1 requests.
//!
//! Every request is still decided and recorded on its own (see
//! [`super::forward::absolute`]); what the pool saves is the TCP connect,
//! the upstream accept and the connection's setup per request. A connection is
//! kept under its [`Key`]: the org the request was decided for, the target
//! host and port, and the address dialled. So:
//!
//! - a connection is never shared across orgs;
//! - a request only ever rides a connection to an address its own decision
//!   checked (a re-resolution that yields another address finds no
//!   connection under that key, and dials);
//! - a connection checked out is out of the pool until its response has
//!   been read to the end, so two requests never share one at once.
//!
//! A connection goes back only after an exchange in order (see
//! [`upstream`](crate::proxy::http::upstream)): a request without a body,
//! its response read to the end its framing gives and no byte past it,
//! the upstream HTTP/1.1 and not marking it close; and only for the idle
//! timeout. A request with a body asks the upstream to close after it and
//! its connection is cut ([`InOrder`](crate::proxy::http::client::InOrder)),
//! so a head planted in a body never reaches an upstream that did not read
//! that body. An idle connection the upstream closed, or sent a byte on,
//! is dropped when met. Idle connections are bounded in total and per key;
//! over a bound the oldest idle one is closed.
//!
//! The bookkeeping ([`Pool`]) is pure: the caller passes `now` and says
//! which entries are still usable; the I/O around it ([`UpstreamPool`])
//! holds the idle connections.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{IntCounter, IntGauge};

use tokio_util::sync::CancellationToken;

use super::http::upstream::Upconn;
use crate::config::Limits;
use crate::proto::target::Host;

/// How many idle connections are kept, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    /// All keys together; 0 turns reuse off.
    pub max_total: usize,
    /// Under one key.
    pub max_per_key: usize,
    pub idle_timeout: Duration,
}

impl Bounds {
    pub(crate) fn of(limits: &Limits) -> Bounds {
        Bounds {
            max_total: limits.max_idle_upstream_connections,
            max_per_key: limits.max_idle_upstream_connections_per_target,
            idle_timeout: limits.upstream_idle_timeout.get(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.max_total > 0 && self.max_per_key > 0
    }
}

/// An idle entry: its place in the global age order, when it went idle.
#[derive(Debug)]
struct Entry<T> {
    seq: u64,
    since: Instant,
    value: T,
}

/// Idle values under keys, bounded in total and per key, each for at most
/// `idle_timeout`; the newest of a key is handed out first (the likeliest
/// to be alive), the oldest overall is dropped first.
///
/// Not on [`FairTable`](crate::limits::table::FairTable), measured: with
/// the pool's key as the table's holder there are as many holders as
/// keys (thousands, one or two idle connections each), and the table
/// finds the holder with the most by looking at every holder, so a
/// checkin into a full pool costs O(keys) where this costs O(log n):
/// 8 times the time per checkin and checkout at 4096 idle connections
/// over 3000 keys (`cargo test --lib limits::measure -- --ignored`).
#[derive(Debug)]
pub(crate) struct Pool<K, T> {
    bounds: Bounds,
    /// Per key, oldest first (ascending `seq`).
    keys: HashMap<K, VecDeque<Entry<T>>>,
    /// Every idle entry by age: `seq` to its key.
    order: BTreeMap<u64, K>,
    next_seq: u64,
}

impl<K: Hash + Eq + Clone, T> Pool<K, T> {
    pub(crate) fn new(bounds: Bounds) -> Self {
        Pool {
            bounds,
            keys: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
        }
    }

    /// Idle values held.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The newest idle value under `key` that has not expired and is still
    /// `usable`; the expired and unusable ones met on the way are dropped.
    pub(crate) fn checkout(
        &mut self,
        key: &K,
        now: Instant,
        usable: impl Fn(&T) -> bool,
    ) -> Option<T> {
        let timeout = self.bounds.idle_timeout;
        let idle = self.keys.get_mut(key)?;
        let mut found = None;
        while let Some(entry) = idle.pop_back() {
            self.order.remove(&entry.seq);
            if now.saturating_duration_since(entry.since) < timeout && usable(&entry.value) {
                found = Some(entry.value);
                break;
            }
        }
        if idle.is_empty() {
            self.keys.remove(key);
        }
        found
    }

    /// Keep `value` idle under `key` from `now`; `false` (and the value
    /// dropped) when reuse is off. Over a bound, the oldest idle value (of
    /// the key, else of all) is dropped to make room.
    pub(crate) fn checkin(&mut self, key: K, value: T, now: Instant) -> bool {
        if !self.bounds.enabled() {
            return false;
        }
        let per_key_full = self
            .keys
            .get(&key)
            .is_some_and(|idle| idle.len() >= self.bounds.max_per_key);
        if per_key_full {
            self.drop_oldest_of(&key);
        } else if self.order.len() >= self.bounds.max_total {
            self.drop_oldest();
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, key.clone());
        self.keys.entry(key).or_default().push_back(Entry {
            seq,
            since: now,
            value,
        });
        true
    }

    fn drop_oldest_of(&mut self, key: &K) {
        let Some(idle) = self.keys.get_mut(key) else {
            return;
        };
        if let Some(entry) = idle.pop_front() {
            self.order.remove(&entry.seq);
        }
        if idle.is_empty() {
            self.keys.remove(key);
        }
    }

    fn drop_oldest(&mut self) {
        if let Some((_, key)) = self.order.first_key_value() {
            let key = key.clone();
            self.drop_oldest_of(&key);
        }
    }

    /// Drop every expired or unusable idle value; returns how many went.
    pub(crate) fn prune(&mut self, now: Instant, usable: impl Fn(&T) -> bool) -> usize {
        let before = self.order.len();
        let timeout = self.bounds.idle_timeout;
        let mut gone = Vec::new();
        for idle in self.keys.values_mut() {
            idle.retain(|e| {
                let keep = now.saturating_duration_since(e.since) < timeout && usable(&e.value);
                if !keep {
                    gone.push(e.seq);
                }
                keep
            });
        }
        self.keys.retain(|_, idle| !idle.is_empty());
        for seq in gone {
            self.order.remove(&seq);
        }
        before - self.order.len()
    }

    /// Drop everything.
    pub(crate) fn clear(&mut self) {
        self.keys.clear();
        self.order.clear();
    }

    /// Whether an entry idle since `since` would have expired at `now`.
    #[cfg(test)]
    fn would_expire(&self, since: Instant, now: Instant) -> bool {
        now.saturating_duration_since(since) >= self.bounds.idle_timeout
    }
}

/// Where a pooled connection goes: never shared across orgs, hosts, ports
/// or dialled addresses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub org: Arc<str>,
    pub host: Host,
    pub port: u16,
    pub addr: SocketAddr,
}

/// The proxy's pool of idle upstream HTTP/1.1 connections.
pub(crate) struct UpstreamPool {
    idle: Mutex<Pool<Key, Upconn>>,
    bounds: Bounds,
    /// Shutdown began: nothing is kept or handed out any more.
    closed: AtomicBool,
    /// `palisade_upstream_idle_connections`.
    gauge: IntGauge,
    /// `palisade_upstream_reused_total`.
    reused: IntCounter,
}

impl std::fmt::Debug for UpstreamPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool")
            .field("bounds", &self.bounds)
            .finish_non_exhaustive()
    }
}

/// A connection that can take a request now.
fn usable(c: &Upconn) -> bool {
    c.is_usable()
}

impl UpstreamPool {
    pub(crate) fn new(limits: &Limits, gauge: IntGauge, reused: IntCounter) -> Self {
        let bounds = Bounds::of(limits);
        UpstreamPool {
            idle: Mutex::new(Pool::new(bounds)),
            bounds,
            closed: AtomicBool::new(false),
            gauge,
            reused,
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.bounds.enabled() && !self.closed.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool<Key, Upconn>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update_gauge(&self, pool: &Pool<Key, Upconn>) {
        self.gauge
            .set(i64::try_from(pool.len()).unwrap_or(i64::MAX));
    }

    /// An idle connection to one of `addrs` (each checked by the request's
    /// decision, tried in their order) on `port`, for `org` and `host`.
    pub(crate) fn checkout(
        &self,
        org: &Arc<str>,
        host: &Host,
        port: u16,
        addrs: &[std::net::IpAddr],
    ) -> Option<(Upconn, SocketAddr)> {
        if !self.enabled() {
            return None;
        }
        let now = Instant::now();
        let mut pool = self.lock();
        if pool.is_empty() {
            return None;
        }
        let mut key = Key {
            org: org.clone(),
            host: host.clone(),
            port,
            addr: SocketAddr::new([0, 0, 0, 0].into(), port),
        };
        let mut found = None;
        for ip in addrs {
            key.addr = SocketAddr::new(*ip, port);
            if let Some(conn) = pool.checkout(&key, now, usable) {
                found = Some((conn, key.addr));
                break;
            }
        }
        self.update_gauge(&pool);
        drop(pool);
        if found.is_some() {
            self.reused.inc();
        }
        found
    }

    /// Keep `conn`, whose exchange ended in order, idle under `key`.
    pub(crate) fn give_back(&self, key: Key, conn: Upconn) {
        if !self.enabled() {
            return;
        }
        let mut pool = self.lock();
        pool.checkin(key, conn, Instant::now());
        self.update_gauge(&pool);
    }

    /// Drop what expired or closed.
    pub(crate) fn prune(&self) {
        let mut pool = self.lock();
        pool.prune(Instant::now(), usable);
        self.update_gauge(&pool);
    }

    /// Shutdown: close every idle connection, keep none from now on.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let mut pool = self.lock();
        pool.clear();
        self.update_gauge(&pool);
    }

    /// How often [`reap`] prunes: often enough that an expired connection
    /// does not linger long past its timeout, rarely enough to cost nothing.
    pub(crate) fn prune_interval(&self) -> Duration {
        prune_interval(self.bounds.idle_timeout)
    }
}

/// A quarter of the idle timeout, within 100 ms..=5 s.
fn prune_interval(idle_timeout: Duration) -> Duration {
    (idle_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
}

/// Prune the pool now and then; at `shutdown`, close every idle connection
/// (their sockets close with them, and the drain does not wait on them).
pub(crate) async fn reap(pool: Arc<UpstreamPool>, shutdown: CancellationToken) {
    if !pool.enabled() {
        return;
    }
    let mut tick = tokio::time::interval(pool.prune_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => pool.prune(),
        }
    }
    pool.close();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(max_total: usize, max_per_key: usize) -> Bounds {
        Bounds {
            max_total,
            max_per_key,
            idle_timeout: Duration::from_secs(30),
        }
    }

    fn ok(_: &u32) -> bool {
        true
    }

    #[test]
    fn a_value_comes_back_only_under_its_own_key() {
        let t0 = Instant::now();
        let mut p: Pool<&str, u32> = Pool::new(bounds(10, 10));
        assert!(p.checkin("org-a/h/80/1.2.3.4", 1, t0));
        assert_eq!(p.checkout(&"org-b/h/80/1.2.3.4", t0, ok), None);
        assert_eq!(p.checkout(&"org-a/h/80/1.2.3.5", t0, ok), None);
        assert_eq!(p.checkout(&"org-a/h/80/1.2.3.4", t0, ok), Some(1));
        // Checked out: it is no longer there for anyone.
        assert_eq!(p.checkout(&"org-a/h/80/1.2.3.4", t0, ok), None);
        assert!(p.is_empty());
    }

    #[test]
    fn the_key_separates_orgs_hosts_ports_and_addresses() {
        let a: SocketAddr = "198.18.2.10:80".parse().unwrap();
        let key = |org: &str, host: &str, port, addr| Key {
            org: Arc::from(org),
            host: Host::Name(host.into()),
            port,
            addr,
        };
        let base = key("acme", "a.test", 80, a);
        let mut p: Pool<Key, u32> = Pool::new(bounds(10, 10));
        let t0 = Instant::now();
        p.checkin(base.clone(), 7, t0);
        for other in [
            key("other", "a.test", 80, a),
            key("acme", "b.test", 80, a),
            key("acme", "a.test", 8080, a),
            key("acme", "a.test", 80, "198.18.2.11:80".parse().unwrap()),
        ] {
            assert_ne!(other, base);
            assert_eq!(p.checkout(&other, t0, ok), None, "{other:?}");
        }
        assert_eq!(p.checkout(&base, t0, ok), Some(7));
    }

    #[test]
    fn newest_first_and_expired_ones_are_dropped() {
        let t0 = Instant::now();
        let mut p: Pool<&str, u32> = Pool::new(bounds(10, 10));
        p.checkin("k", 1, t0);
        p.checkin("k", 2, t0 + Duration::from_secs(20));
        assert!(p.would_expire(t0, t0 + Duration::from_secs(30)));
        assert!(!p.would_expire(t0, t0 + Duration::from_secs(29)));
        // At 35 s the first has expired, the second has not.
        let at = t0 + Duration::from_secs(35);
        assert_eq!(p.checkout(&"k", at, ok), Some(2));
        assert_eq!(p.checkout(&"k", at, ok), None);
        assert!(p.is_empty());
        // Expired at checkout even with no reaper.
        p.checkin("k", 3, t0);
        assert_eq!(p.checkout(&"k", t0 + Duration::from_secs(30), ok), None);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn unusable_ones_are_skipped_and_dropped() {
        let t0 = Instant::now();
        let mut p: Pool<&str, u32> = Pool::new(bounds(10, 10));
        p.checkin("k", 1, t0);
        p.checkin("k", 2, t0);
        p.checkin("k", 3, t0);
        // 3 closed while idle: skipped; 2 is handed out; 1 stays.
        assert_eq!(p.checkout(&"k", t0, |v| *v != 3), Some(2));
        assert_eq!(p.len(), 1);
        assert_eq!(p.checkout(&"k", t0, ok), Some(1));
    }

    #[test]
    fn bounds_drop_the_oldest_of_the_key_then_overall() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut p: Pool<&str, u32> = Pool::new(bounds(3, 2));
        p.checkin("a", 1, at(0));
        p.checkin("a", 2, at(1));
        p.checkin("a", 3, at(2)); // per key: 1 goes
        assert_eq!(p.len(), 2);
        p.checkin("b", 4, at(3));
        assert_eq!(p.len(), 3);
        p.checkin("c", 5, at(4)); // total: the oldest overall (2) goes
        assert_eq!(p.len(), 3);
        assert_eq!(p.checkout(&"a", at(5), ok), Some(3));
        assert_eq!(p.checkout(&"a", at(5), ok), None);
        assert_eq!(p.checkout(&"b", at(5), ok), Some(4));
        assert_eq!(p.checkout(&"c", at(5), ok), Some(5));
        assert!(p.is_empty());
    }

    #[test]
    fn zero_turns_reuse_off() {
        let mut p: Pool<&str, u32> = Pool::new(bounds(0, 8));
        assert!(!p.checkin("k", 1, Instant::now()));
        assert!(p.is_empty());
        assert!(!bounds(0, 8).enabled());
        assert!(bounds(1, 1).enabled());
    }

    #[test]
    fn prune_drops_expired_and_closed_and_clear_drops_all() {
        let t0 = Instant::now();
        let mut p: Pool<&str, u32> = Pool::new(bounds(10, 10));
        p.checkin("a", 1, t0);
        p.checkin("a", 2, t0 + Duration::from_secs(10));
        p.checkin("b", 3, t0 + Duration::from_secs(10));
        p.checkin("b", 4, t0 + Duration::from_secs(10));
        let gone = p.prune(t0 + Duration::from_secs(31), |v| *v != 4);
        assert_eq!(gone, 2);
        assert_eq!(p.len(), 2);
        // The global order stays consistent: bounds still find the oldest.
        assert_eq!(p.checkout(&"b", t0 + Duration::from_secs(31), ok), Some(3));
        p.clear();
        assert!(p.is_empty());
        assert_eq!(p.checkout(&"a", t0, ok), None);
    }

    #[test]
    fn prune_runs_a_quarter_of_the_timeout_within_bounds() {
        assert_eq!(
            prune_interval(Duration::from_secs(30)),
            Duration::from_secs(5)
        );
        assert_eq!(
            prune_interval(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(
            prune_interval(Duration::from_millis(1)),
            Duration::from_millis(100)
        );
    }
}
