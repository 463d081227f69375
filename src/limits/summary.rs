//! One summary engine for evidence floods: the proxy's denials
//! ([`crate::proxy::denials`]) and the DNS shim's refusals
//! ([`crate::dns::refusals`]) that are not written one by one are counted
//! into tallies, and each tally is later written as ONE signed, chained
//! record of the same shape: the first counted record's fields, with
//! `count` and `window`, and what its [`Shape`] adds.
//!
//! | | key | tallies | a summary adds |
//! |---|---|---|---|
//! | proxy denials | (org, address key) | at most `MAX_TALLIES`, then one per org | `client`, the most frequent `reason`, `reasons`, `hosts`, `detail` |
//! | DNS refusals | (org, reason) | bounded by the pairs | `answers: []`, `upstream: false`, `detail` |
//! | bypass attempts ([`crate::bypass`]) | (org, source, destination, protocol, port) | at most `MAX_TALLIES_PER_ORG` per org and `MAX_TALLIES` in all, then one per (org, protocol) | `client`, `ip`, `port`, `proto`, `detail` |
//!
//! Summaries go into the writer's queue only into a free place, waiting at
//! most what the caller allows; what finds none (or meets an unhealthy
//! writer) is kept for the next flush, so a flood can neither grow the
//! queue nor be lost.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use crate::evidence::{Evidence, Record};
use crate::policy::Reason;

/// How often tallies are written.
pub(crate) const SUMMARY_INTERVAL: Duration = Duration::from_secs(1);
/// Hosts a summary names; the others are counted under `other`.
pub(crate) const TOP_HOSTS: usize = 10;
/// Host counters a tally keeps; later hosts go straight to `other`.
pub(crate) const TRACKED_HOSTS: usize = 64;

/// What one kind of summary is keyed by and says beyond the shared fields.
pub(crate) trait Shape {
    /// What the records are tallied by.
    type Key: Hash + Eq + Clone;
    /// Tallies kept at once; beyond, a new key is counted under
    /// [`Shape::overflow`] of it.
    const MAX_TALLIES: usize = usize::MAX;
    /// Tallies of one org ([`Shape::org`]) kept at once; beyond, a new key
    /// of that org is counted under [`Shape::overflow`] of it, whatever
    /// room the others left. Overflow keys are always kept (there are
    /// few of them per org).
    const MAX_TALLIES_PER_ORG: usize = usize::MAX;

    /// The org a key's tallies count against (`None`: clients of no org,
    /// one group).
    fn org(_key: &Self::Key) -> Option<Arc<str>> {
        None
    }
    /// Whether tallies count their records' reasons and hosts.
    const BREAKDOWN: bool = true;

    /// Where a record of `key` is counted once the tallies are full.
    fn overflow(key: Self::Key) -> Self::Key {
        key
    }

    /// Complete `summary` (the template's fields with `count` and
    /// `window`) for the tally of `key`.
    fn finish(key: &Self::Key, tally: &Tally, summary: &mut Record);
}

/// Records not written one by one, for one key.
#[derive(Debug)]
pub(crate) struct Tally {
    count: u64,
    first: SystemTime,
    last: SystemTime,
    reasons: HashMap<Reason, u64>,
    hosts: HashMap<String, u64>,
    other_hosts: u64,
    /// The first record's; the summary is built from it (with the policy
    /// of the latest).
    template: Record,
}

impl Tally {
    fn new(record: &Record, now: SystemTime) -> Tally {
        Tally {
            count: 0,
            first: now,
            last: now,
            reasons: HashMap::new(),
            hosts: HashMap::new(),
            other_hosts: 0,
            template: record.clone(),
        }
    }

    fn add(&mut self, record: &Record, now: SystemTime, breakdown: bool) {
        self.count += 1;
        self.first = self.first.min(now);
        if now >= self.last {
            self.last = now;
            self.template.policy = record.policy.clone();
        }
        if breakdown {
            *self.reasons.entry(record.reason).or_insert(0) += 1;
            self.count_host(record.host.as_deref().unwrap_or("-"), 1);
        }
    }

    fn count_host(&mut self, host: &str, n: u64) {
        if let Some(m) = self.hosts.get_mut(host) {
            *m += n;
        } else if self.hosts.len() < TRACKED_HOSTS {
            self.hosts.insert(host.to_string(), n);
        } else {
            self.other_hosts += n;
        }
    }

    /// Count `other`'s records in this tally too.
    pub(crate) fn merge(&mut self, other: Tally) {
        self.count += other.count;
        self.first = self.first.min(other.first);
        if other.last >= self.last {
            self.last = other.last;
            self.template.policy = other.template.policy;
        }
        for (reason, n) in other.reasons {
            *self.reasons.entry(reason).or_insert(0) += n;
        }
        self.other_hosts += other.other_hosts;
        for (host, n) in other.hosts {
            self.count_host(&host, n);
        }
    }

    /// Records counted.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// The first counted record (the template of the summary).
    pub(crate) fn first(&self) -> &Record {
        &self.template
    }

    /// The first counted record's reason.
    pub(crate) fn reason(&self) -> Reason {
        self.template.reason
    }

    /// The most frequent reason (the greater name loses a tie).
    pub(crate) fn top_reason(&self) -> Option<Reason> {
        self.reasons
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.as_str().cmp(a.0.as_str())))
            .map(|(reason, _)| *reason)
    }

    /// Records counted per reason.
    pub(crate) fn reasons(&self) -> BTreeMap<String, u64> {
        self.reasons
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), *v))
            .collect()
    }

    /// Records counted per host: the [`TOP_HOSTS`] most frequent, the rest
    /// under `other`.
    pub(crate) fn top_hosts(&self) -> BTreeMap<String, u64> {
        let mut hosts: Vec<(&String, &u64)> = self.hosts.iter().collect();
        hosts.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let other: u64 =
            self.other_hosts + hosts.iter().skip(TOP_HOSTS).map(|(_, n)| **n).sum::<u64>();
        let mut named: BTreeMap<String, u64> = hosts
            .into_iter()
            .take(TOP_HOSTS)
            .map(|(h, n)| (h.clone(), *n))
            .collect();
        if other > 0 {
            *named.entry("other".to_string()).or_insert(0) += other;
        }
        named
    }

    /// Host counters kept.
    #[cfg(test)]
    pub(crate) fn tracked_hosts(&self) -> usize {
        self.hosts.len()
    }

    /// The one record that stands for every counted record of `key`.
    pub(crate) fn summary<S: Shape>(&self, key: &S::Key) -> Record {
        let mut r = self.template.summary(self.count, self.first, self.last);
        S::finish(key, self, &mut r);
        r
    }
}

/// The tallies of one [`Shape`] of summary.
pub(crate) struct Tallies<S: Shape> {
    map: Mutex<Book<S>>,
    shape: PhantomData<S>,
}

/// The tallies, and how many each org holds.
struct Book<S: Shape> {
    map: HashMap<S::Key, Tally>,
    per_org: HashMap<Option<Arc<str>>, usize>,
}

impl<S: Shape> Book<S> {
    /// Whether a new tally of `key` may be kept (else it is counted under
    /// its overflow key).
    fn room_for(&self, key: &S::Key) -> bool {
        self.map.len() < S::MAX_TALLIES
            && self.per_org.get(&S::org(key)).copied().unwrap_or(0) < S::MAX_TALLIES_PER_ORG
    }

    fn insert(&mut self, key: S::Key, tally: Tally) {
        if self.map.insert(key.clone(), tally).is_none() {
            *self.per_org.entry(S::org(&key)).or_insert(0) += 1;
        }
    }
}

impl<S: Shape> Default for Tallies<S> {
    fn default() -> Self {
        Tallies {
            map: Mutex::new(Book {
                map: HashMap::new(),
                per_org: HashMap::new(),
            }),
            shape: PhantomData,
        }
    }
}

impl<S: Shape> std::fmt::Debug for Tallies<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tallies")
            .field("pending", &self.pending())
            .finish()
    }
}

impl<S: Shape> Tallies<S> {
    fn lock(&self) -> MutexGuard<'_, Book<S>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Count `record` (at `wall`) into the tally of `key` (or of its
    /// overflow key, when its org's or everyone's tallies are full).
    pub(crate) fn add(&self, key: S::Key, record: &Record, wall: SystemTime) {
        let mut held = self.lock();
        let key = if !held.map.contains_key(&key) && !held.room_for(&key) {
            S::overflow(key)
        } else {
            key
        };
        if !held.map.contains_key(&key) {
            held.insert(key.clone(), Tally::new(record, wall));
        }
        if let Some(t) = held.map.get_mut(&key) {
            t.add(record, wall, S::BREAKDOWN);
        }
    }

    /// Whether `key` would get a tally of its own: it has one, or its org
    /// and everyone have room for one.
    pub(crate) fn admits(&self, key: &S::Key) -> bool {
        let held = self.lock();
        held.map.contains_key(key) || held.room_for(key)
    }

    /// Whether `key` has a tally waiting.
    pub(crate) fn contains(&self, key: &S::Key) -> bool {
        self.lock().map.contains_key(key)
    }

    /// Every tally, taken out.
    pub(crate) fn drain(&self) -> Vec<(S::Key, Tally)> {
        let mut held = self.lock();
        held.per_org.clear();
        held.map.drain().collect()
    }

    /// Keep `tally` for the next flush (with what `key` counted since).
    pub(crate) fn put_back(&self, key: S::Key, tally: Tally) {
        let mut held = self.lock();
        match held.map.get_mut(&key) {
            Some(t) => t.merge(tally),
            None => held.insert(key, tally),
        }
    }

    /// Write each of `taken` as its summary while the writer finds room
    /// within `wait`; once one finds none the others are not tried, and
    /// are all put back (so a flush waits at most `wait` in all). Returns
    /// the summaries written.
    pub(crate) async fn write(
        &self,
        evidence: &Evidence,
        taken: Vec<(S::Key, Tally)>,
        wait: Duration,
    ) -> Vec<(S::Key, Record)> {
        let mut written = Vec::new();
        let mut room = true;
        for (key, tally) in taken {
            let mut summary = tally.summary::<S>(&key);
            room = room && evidence.submit_within(&mut summary, wait).await;
            if room {
                written.push((key, summary));
            } else {
                self.put_back(key, tally);
            }
        }
        written
    }

    /// Tallies waiting.
    pub(crate) fn pending(&self) -> usize {
        self.lock().map.len()
    }

    /// Records counted into the waiting tallies.
    pub(crate) fn pending_count(&self) -> u64 {
        self.lock().map.values().map(|t| t.count).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use super::*;
    use crate::evidence::{Kind, Mode};
    use crate::policy::Verdict;

    struct ByReason;

    impl Shape for ByReason {
        type Key = Reason;
        const MAX_TALLIES: usize = 2;

        fn overflow(_: Reason) -> Reason {
            Reason::LimitExceeded
        }

        fn finish(_: &Reason, tally: &Tally, summary: &mut Record) {
            summary.reasons = Some(tally.reasons());
            summary.hosts = Some(tally.top_hosts());
        }
    }

    fn record(reason: Reason, host: &str) -> Record {
        let verdict = Verdict {
            org: None,
            reason,
            rule: None,
            would_deny: None,
        };
        let client: SocketAddr = "198.19.1.7:1".parse().unwrap();
        let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &Arc::from("p"));
        r.host = Some(host.to_string());
        r
    }

    #[test]
    fn tallies_are_bounded_and_lose_nothing() {
        let t: Tallies<ByReason> = Tallies::default();
        let wall = SystemTime::now();
        let reasons = [
            Reason::NoMatchingRule,
            Reason::SniMismatch,
            Reason::BadRequest,
        ];
        for i in 0..300 {
            let host = format!("h{}.test", i % 100);
            t.add(reasons[i % 3], &record(reasons[i % 3], &host), wall);
        }
        assert_eq!(t.pending(), 3, "two keys and the overflow");
        assert_eq!(t.pending_count(), 300);
        let drained = t.drain();
        assert_eq!(t.pending(), 0);
        for (key, tally) in &drained {
            assert!(tally.tracked_hosts() <= TRACKED_HOSTS);
            let s = tally.summary::<ByReason>(key);
            assert_eq!(s.count, Some(100));
            let hosts = s.hosts.unwrap();
            assert_eq!(hosts.len(), TOP_HOSTS + 1, "{hosts:?}");
            assert_eq!(hosts.values().sum::<u64>(), 100);
            assert!(s.window.is_some());
        }
        let (key, first) = drained.into_iter().next().unwrap();
        let mut again = Tally::new(&record(Reason::BadRequest, "x"), wall);
        again.add(&record(Reason::BadRequest, "x"), wall, true);
        again.merge(first);
        assert_eq!(again.count(), 101);
        t.put_back(key, again);
        assert_eq!(t.pending_count(), 101);
    }

    /// Keyed by (org, host), two tallies per org.
    struct PerOrg;

    impl Shape for PerOrg {
        type Key = (Option<Arc<str>>, Option<String>);
        const MAX_TALLIES_PER_ORG: usize = 2;
        const BREAKDOWN: bool = false;

        fn overflow((org, _): Self::Key) -> Self::Key {
            (org, None)
        }

        fn org(key: &Self::Key) -> Option<Arc<str>> {
            key.0.clone()
        }

        fn finish(_: &Self::Key, _: &Tally, _: &mut Record) {}
    }

    #[test]
    fn each_org_has_its_own_share_of_tallies() {
        let t: Tallies<PerOrg> = Tallies::default();
        let wall = SystemTime::now();
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        let r = record(Reason::NoMatchingRule, "h.test");
        for i in 0..100 {
            t.add((Some(acme.clone()), Some(format!("h{i}"))), &r, wall);
        }
        assert!(!t.admits(&(Some(acme.clone()), Some("new".into()))));
        let b = (Some(beta.clone()), Some("b1".to_string()));
        assert!(t.admits(&b), "acme's flood leaves beta's share");
        t.add(b.clone(), &r, wall);
        t.add((Some(beta.clone()), Some("b2".into())), &r, wall);
        t.add((None, Some("x".into())), &r, wall);
        assert!(t.contains(&b));
        assert!(t.contains(&(Some(beta.clone()), Some("b2".into()))));
        // acme: 2 + its overflow; beta 2; the strangers 1.
        assert_eq!(t.pending(), 6);
        assert_eq!(t.pending_count(), 103);
        // Drained and put back: the shares start over.
        let drained = t.drain();
        assert!(t.admits(&(Some(acme.clone()), Some("new".into()))));
        for (k, tally) in drained {
            t.put_back(k, tally);
        }
        assert_eq!(t.pending_count(), 103);
        assert!(!t.admits(&(Some(acme), Some("new".into()))));
    }
}
