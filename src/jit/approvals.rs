//! Pending approvals: the misses of `on_miss = "ask"` orgs waiting for an
//! approver. Pure: ids and `now` are handed in, nothing is read from a
//! clock or a socket.
//!
//! - Identical misses (same org, host and port) share one approval: a
//!   later miss counts on it and moves its last-seen time.
//! - An approval waits at most its table's `ttl` from its first miss
//!   ([`DEFAULT_PENDING_TTL`]); expired, it is gone and grants nothing (a
//!   later miss makes a new one).
//! - The table is bounded overall and per org ([`FairTable`]): an org
//!   over its share loses its own oldest approval, never another org's.
//! - An answered approval leaves the table; its id is remembered (bounded)
//!   so that a second answer is told "answered already".

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::limits::table::FairTable;

/// How long an unanswered approval waits from its first miss.
pub(crate) const DEFAULT_PENDING_TTL: Duration = Duration::from_secs(15 * 60);
/// Pending approvals one org may hold.
pub(crate) const PENDING_PER_ORG: usize = 64;
/// Pending approvals held overall.
pub(crate) const PENDING_TOTAL: usize = 4096;
/// Answered ids remembered, to tell a second answer apart from a typo.
const ANSWERED_KEPT: usize = 4096;

/// What a miss asked for: the key identical misses share.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Asked {
    pub(crate) org: Arc<str>,
    /// A normalised name, or an address as text.
    pub(crate) host: String,
    /// `None`: a DNS question (the name on any port).
    pub(crate) port: Option<u16>,
    /// The method and normalised path of the request that missed, when
    /// Palisade saw one (a plain `http://` request): the grant answering
    /// it opens that method on that path (as a prefix), nothing wider.
    pub(crate) request: Option<(String, String)>,
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) if self.host.contains(':') => write!(f, "[{}]:{p}", self.host)?,
            Some(p) => write!(f, "{}:{p}", self.host)?,
            None => write!(f, "{} (any port, asked by DNS)", self.host)?,
        }
        match &self.request {
            Some((method, path)) => write!(f, " {method} {path}"),
            None => Ok(()),
        }
    }
}

/// One pending approval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Approval {
    pub(crate) id: String,
    pub(crate) asked: Asked,
    /// The client of the first miss, and of the latest.
    pub(crate) first_client: IpAddr,
    pub(crate) last_client: IpAddr,
    pub(crate) first_seen: SystemTime,
    pub(crate) last_seen: SystemTime,
    /// Misses it stands for.
    pub(crate) count: u64,
    pub(crate) expires: SystemTime,
}

/// Why an answer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AnswerError {
    #[error("approval {0} was answered already")]
    Answered(String),
    #[error("no pending approval {0} (expired, or never made)")]
    Unknown(String),
}

/// The pending approvals (see the module doc).
#[derive(Debug)]
pub(crate) struct Approvals {
    table: FairTable<Arc<str>, Asked, Approval, SystemTime>,
    ids: std::collections::HashMap<String, Asked>,
    answered: VecDeque<String>,
    ttl: Duration,
}

impl Approvals {
    pub(crate) fn new(total: usize, per_org: usize, ttl: Duration) -> Self {
        Approvals {
            table: FairTable::new(total, per_org),
            ids: std::collections::HashMap::new(),
            answered: VecDeque::new(),
            ttl,
        }
    }

    /// A miss of `asked` from `client` at `now`: the approval it joins, or
    /// a new one named `fresh_id()`. `None` when the table holds nothing
    /// (a total of 0).
    pub(crate) fn miss(
        &mut self,
        asked: Asked,
        client: IpAddr,
        now: SystemTime,
        fresh_id: impl FnOnce() -> String,
    ) -> Option<Approval> {
        self.expire(now);
        if let Some(a) = self.table.get(&asked) {
            let mut a = a.clone();
            a.count = a.count.saturating_add(1);
            a.last_seen = now;
            a.last_client = client;
            let expires = a.expires;
            let org = asked.org.clone();
            // Same key, same place: replaced in place.
            self.table
                .insert(org, asked, a.clone(), expires, |_, _| false)
                .ok()?;
            return Some(a);
        }
        let a = Approval {
            id: fresh_id(),
            asked: asked.clone(),
            first_client: client,
            last_client: client,
            first_seen: now,
            last_seen: now,
            count: 1,
            expires: now + self.ttl,
        };
        let evicted = self
            .table
            .insert(
                asked.org.clone(),
                asked.clone(),
                a.clone(),
                a.expires,
                |e, _| *e <= now,
            )
            .ok()?;
        for (_, gone) in evicted {
            self.ids.remove(&gone.id);
        }
        self.ids.insert(a.id.clone(), asked);
        Some(a)
    }

    /// The approval `id`, if pending at `now`.
    pub(crate) fn get(&self, id: &str, now: SystemTime) -> Option<&Approval> {
        let a = self.table.get(self.ids.get(id)?)?;
        (a.expires > now).then_some(a)
    }

    /// Take the approval `id` to answer it.
    pub(crate) fn answer(&mut self, id: &str, now: SystemTime) -> Result<Approval, AnswerError> {
        if self.get(id, now).is_none() {
            return Err(if self.answered.iter().any(|a| a == id) {
                AnswerError::Answered(id.to_string())
            } else {
                AnswerError::Unknown(id.to_string())
            });
        }
        let asked = self
            .ids
            .remove(id)
            .ok_or_else(|| AnswerError::Unknown(id.to_string()))?;
        let a = self
            .table
            .remove(&asked)
            .ok_or_else(|| AnswerError::Unknown(id.to_string()))?;
        if self.answered.len() >= ANSWERED_KEPT {
            self.answered.pop_front();
        }
        self.answered.push_back(a.id.clone());
        Ok(a)
    }

    /// Every approval pending at `now` that `visible` lets through, oldest
    /// first.
    pub(crate) fn list(&self, now: SystemTime, visible: impl Fn(&str) -> bool) -> Vec<Approval> {
        let mut out: Vec<Approval> = self
            .ids
            .values()
            .filter_map(|k| self.table.get(k))
            .filter(|a| a.expires > now && visible(&a.asked.org))
            .cloned()
            .collect();
        out.sort_by(|a, b| (a.first_seen, &a.id).cmp(&(b.first_seen, &b.id)));
        out
    }

    /// Drop every approval expired at `now`.
    pub(crate) fn expire(&mut self, now: SystemTime) -> Vec<Approval> {
        let gone = self.table.sweep(None, usize::MAX, |e, _| *e <= now);
        gone.into_iter()
            .map(|(_, a)| {
                self.ids.remove(&a.id);
                a
            })
            .collect()
    }

    /// Approvals held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(org: &str, host: &str, port: u16) -> Asked {
        Asked {
            org: Arc::from(org),
            host: host.into(),
            port: Some(port),
            request: None,
        }
    }

    const C: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 1, 2));

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("a{n}")
        }
    }

    #[test]
    fn identical_misses_share_one_approval() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut p = Approvals::new(10, 5, DEFAULT_PENDING_TTL);
        let mut id = ids();
        let a = p
            .miss(asked("acme", "x.test", 443), C, t0, &mut id)
            .unwrap();
        let b = p
            .miss(
                asked("acme", "x.test", 443),
                C,
                t0 + Duration::from_secs(5),
                &mut id,
            )
            .unwrap();
        assert_eq!(a.id, b.id);
        assert_eq!(b.count, 2);
        assert_eq!(b.first_seen, t0);
        assert_eq!(b.last_seen, t0 + Duration::from_secs(5));
        let c = p.miss(asked("acme", "x.test", 80), C, t0, &mut id).unwrap();
        assert_ne!(c.id, a.id);
        assert_eq!(p.len(), 2);
        // A request's method and path are part of what it asked.
        let mut req = asked("acme", "x.test", 80);
        req.request = Some(("POST".into(), "/api/x".into()));
        assert_eq!(req.to_string(), "x.test:80 POST /api/x");
        let d = p.miss(req, C, t0, &mut id).unwrap();
        assert_ne!(d.id, c.id);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn bounded_per_org_and_expire_unanswered() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut p = Approvals::new(4, 2, Duration::from_secs(60));
        let mut id = ids();
        for i in 0..10u16 {
            p.miss(asked("evil", "x.test", 1000 + i), C, t0, &mut id);
        }
        p.miss(asked("acme", "ok.test", 443), C, t0, &mut id)
            .unwrap();
        assert_eq!(p.list(t0, |o| o == "evil").len(), 2);
        assert_eq!(p.list(t0, |o| o == "acme").len(), 1);
        let late = t0 + Duration::from_secs(61);
        assert!(p.list(late, |_| true).is_empty());
        let acme = p.list(t0, |o| o == "acme")[0].id.clone();
        assert_eq!(
            p.answer(&acme, late),
            Err(AnswerError::Unknown(acme.clone()))
        );
        assert_eq!(p.expire(late).len(), 3);
        assert!(p.is_empty());
    }

    #[test]
    fn an_approval_is_answered_once() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut p = Approvals::new(10, 5, DEFAULT_PENDING_TTL);
        let a = p.miss(asked("acme", "x.test", 443), C, t0, ids()).unwrap();
        assert_eq!(p.answer(&a.id, t0).unwrap().asked.host, "x.test");
        assert_eq!(
            p.answer(&a.id, t0),
            Err(AnswerError::Answered(a.id.clone()))
        );
        assert!(p.answer("nope", t0).is_err());
    }
}
