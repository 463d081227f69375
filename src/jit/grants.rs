//! Grants: what an approver let through, for how long and how often.
//! Pure: ids and `now` are handed in.
//!
//! A grant names an org, a target (one host name, exactly, or one CIDR),
//! a port (or, from a DNS question, any port), and its end: a TTL, a
//! number of uses, or both (never neither: [`Grants::add`] refuses it). A
//! grant matches a miss of its org on its target and port while it is
//! live ([`Grants::matching`]); each connection it allows is a use
//! ([`Grants::spend`]). A grant whose uses are spent matches nothing
//! more, but stays held until its TTL ends (the connections it allowed
//! run until then); one without a TTL ends at once. A grant given uses
//! only still ends in time: [`MAX_TTL`] after it was granted at the
//! latest ([`Grant::ends_at`]), recorded as a TTL end. So no grant given
//! more than [`MAX_TTL`] ago is live, which is what lets a restart read
//! only the recent evidence.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::proto::target::Host;

/// The longest TTL a grant may have.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// The TTL of a grant given with neither a TTL nor a number of uses.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Grants one org may hold.
pub(crate) const GRANTS_PER_ORG: usize = 256;
/// Grants held overall.
pub(crate) const GRANTS_TOTAL: usize = 4096;

/// What a grant opens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Target {
    /// One normalised host name, exactly (no wildcard).
    Name(String),
    /// Addresses: an IP target inside it.
    Cidr(IpNet),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Name(n) => f.write_str(n),
            Target::Cidr(c) => write!(f, "{c}"),
        }
    }
}

impl Target {
    /// Whether the target covers `host`.
    pub(crate) fn covers(&self, host: &Host) -> bool {
        match (self, host) {
            (Target::Name(n), Host::Name(h)) => n == h,
            (Target::Cidr(net), Host::Ip(ip)) => net.contains(&crate::policy::canonical(*ip)),
            _ => false,
        }
    }
}

/// Who may do what a grant opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Scope {
    pub(crate) org: Arc<str>,
    pub(crate) target: Target,
    /// `None`: every port (a grant from a DNS question).
    pub(crate) port: Option<u16>,
    /// Requests only, with this method (compared exactly, as an allow
    /// rule's `methods`): a request whose method and path Palisade sees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) method: Option<String>,
    /// Requests only, whose normalised path this pattern matches (a
    /// prefix, or a glob where `*` matches anything: an allow rule's
    /// `paths`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) path: Option<String>,
}

/// A request a miss carries: its method and normalised path.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    pub(crate) method: &'a str,
    pub(crate) path: &'a crate::policy::request::NormalPath,
}

impl Scope {
    /// Whether a miss of `org` on `host:port` (`request`: the request,
    /// when Palisade sees one) is covered. A scope naming a method or a
    /// path covers requests only: a tunnel under it cannot be checked.
    pub(crate) fn covers(
        &self,
        org: &str,
        host: &Host,
        port: Option<u16>,
        request: Option<Request<'_>>,
    ) -> bool {
        let requests = match (self.method.is_some() || self.path.is_some(), request) {
            (false, _) => true,
            (true, None) => false,
            (true, Some(r)) => {
                self.method.as_deref().is_none_or(|m| m == r.method)
                    && self
                        .path
                        .as_deref()
                        .is_none_or(|p| crate::policy::request::pattern_matches(p, r.path.as_str()))
            }
        };
        requests && self.covers_target(org, host, port)
    }

    /// Whether it names `org`'s `host` and `port` (`None`: a DNS
    /// question), whatever it says of requests.
    pub(crate) fn covers_target(&self, org: &str, host: &Host, port: Option<u16>) -> bool {
        &*self.org == org
            && self.target.covers(host)
            && match (self.port, port) {
                (None, _) => true,
                (Some(p), Some(q)) => p == q,
                (Some(_), None) => true,
            }
    }

    /// The method and path, as shown (`GET /api/*`), if it names either.
    pub(crate) fn requests(&self) -> Option<String> {
        match (&self.method, &self.path) {
            (None, None) => None,
            (m, p) => Some(format!(
                "{} {}",
                m.as_deref().unwrap_or("any method"),
                p.as_deref().unwrap_or("any path")
            )),
        }
    }
}

/// Check a grant's `method` and `path` as an allow rule's `methods` and
/// `paths` are checked: an RFC 9110 token; a path pattern starting with
/// `/`, printable ASCII without `%`, that a normalised path can match.
pub(crate) fn check_requests(method: Option<&str>, path: Option<&str>) -> Result<(), GrantError> {
    if let Some(m) = method {
        if !crate::policy::request::is_method_token(m) {
            return Err(GrantError::Request(format!(
                "method {m:?} is not an RFC 9110 token"
            )));
        }
    }
    if let Some(p) = path {
        let printable = p.bytes().all(|b| b.is_ascii_graphic());
        if !p.starts_with('/') || !printable || p.len() > 1024 || p.contains('%') {
            return Err(GrantError::Request(format!(
                "path {p:?}: starts with '/', printable ASCII, no '%'; '*' matches anything"
            )));
        }
        if let Err(why) = crate::policy::request::NormalPath::parse(p) {
            return Err(GrantError::Request(format!(
                "path {p:?}: requests are matched normalised, and {why}"
            )));
        }
    }
    Ok(())
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{} {}:{p}", self.org, self.target)?,
            None => write!(f, "{} {} (any port)", self.org, self.target)?,
        }
        match self.requests() {
            Some(r) => write!(f, " ({r})"),
            None => Ok(()),
        }
    }
}

/// One grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Grant {
    pub(crate) id: String,
    #[serde(flatten)]
    pub(crate) scope: Scope,
    pub(crate) granted_at: SystemTime,
    /// When it ends, if it has a TTL.
    pub(crate) expires: Option<SystemTime>,
    pub(crate) max_uses: Option<u32>,
    pub(crate) uses: u32,
    /// The approver's token name.
    pub(crate) approver: String,
    /// Why, as the approver gave it.
    pub(crate) reason: Option<String>,
    /// The approval it answered, if any.
    pub(crate) approval: Option<String>,
}

impl Grant {
    /// When it ends at the latest: its TTL, or, given uses only,
    /// [`MAX_TTL`] after it was granted.
    pub(crate) fn ends_at(&self) -> SystemTime {
        self.expires.unwrap_or(self.granted_at + MAX_TTL)
    }

    /// Whether it still lets a new connection through at `now`.
    pub(crate) fn is_live(&self, now: SystemTime) -> bool {
        self.ends_at() > now && self.max_uses.is_none_or(|m| self.uses < m)
    }
}

/// How a grant ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum End {
    Expired,
    Revoked,
    UsedUp,
}

/// Why a grant was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum GrantError {
    #[error("a grant needs an end: max_uses = 0 allows nothing")]
    ZeroUses,
    #[error("ttl {0} is over the maximum of {max} (or zero)", max = humantime::format_duration(MAX_TTL))]
    Ttl(String),
    #[error("org {0} holds {GRANTS_PER_ORG} grants already: revoke one first")]
    Full(String),
    #[error("no grant {0} (ended, or never made)")]
    Unknown(String),
    #[error("{0}")]
    Request(String),
}

/// The grants held (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Grants {
    by_id: BTreeMap<String, Grant>,
}

impl Grants {
    /// Hold `grant`, after checking its end; a grant given neither a TTL
    /// nor uses gets [`DEFAULT_TTL`].
    pub(crate) fn add(&mut self, mut grant: Grant) -> Result<Grant, GrantError> {
        if grant.max_uses == Some(0) {
            return Err(GrantError::ZeroUses);
        }
        if let Some(e) = grant.expires {
            let ttl = e.duration_since(grant.granted_at).unwrap_or_default();
            if ttl.is_zero() || ttl > MAX_TTL {
                return Err(GrantError::Ttl(humantime::format_duration(ttl).to_string()));
            }
        }
        if grant.expires.is_none() && grant.max_uses.is_none() {
            grant.expires = Some(grant.granted_at + DEFAULT_TTL);
        }
        let org = grant.scope.org.clone();
        let held = self.by_id.values().filter(|g| g.scope.org == org).count();
        if held >= GRANTS_PER_ORG || self.by_id.len() >= GRANTS_TOTAL {
            return Err(GrantError::Full(org.to_string()));
        }
        self.by_id.insert(grant.id.clone(), grant.clone());
        Ok(grant)
    }

    /// The live grant of `org` covering `host` on `port` at `now` (`port`
    /// `None`: a DNS question, any port), the oldest first.
    pub(crate) fn matching(
        &self,
        org: &str,
        (host, port): (&Host, Option<u16>),
        request: Option<Request<'_>>,
        now: SystemTime,
    ) -> Option<&Grant> {
        self.by_id
            .values()
            .filter(|g| g.is_live(now) && g.scope.covers(org, host, port, request))
            .min_by_key(|g| g.granted_at)
    }

    /// The oldest live grant of `org` naming a method or path whose target
    /// and port cover `host:port`: a tunnel it may open, intercepted, each
    /// request inside decided on its own ([`Grants::matching`] with it).
    pub(crate) fn intercepting(
        &self,
        org: &str,
        (host, port): (&Host, u16),
        now: SystemTime,
    ) -> Option<&Grant> {
        self.by_id
            .values()
            .filter(|g| g.is_live(now) && g.scope.requests().is_some())
            .filter(|g| g.scope.covers_target(org, host, Some(port)))
            .min_by_key(|g| g.granted_at)
    }

    /// Count a use of grant `id` at `now`: the grant after it, and
    /// whether that use spent it (`used_up`); `None` when it is no longer
    /// live (ended, or its last use taken by another connection since it
    /// matched). A grant without a TTL ends with its last use and is no
    /// longer held.
    pub(crate) fn spend(&mut self, id: &str, now: SystemTime) -> Option<(Grant, bool)> {
        let g = self.by_id.get_mut(id).filter(|g| g.is_live(now))?;
        g.uses = g.uses.saturating_add(1);
        let used_up = g.max_uses.is_some_and(|m| g.uses >= m);
        let g = g.clone();
        if used_up && g.expires.is_none() {
            self.by_id.remove(id);
        }
        Some((g, used_up))
    }

    /// Take grant `id` out (a revoke, a denying reload).
    pub(crate) fn remove(&mut self, id: &str) -> Option<Grant> {
        self.by_id.remove(id)
    }

    pub(crate) fn get(&self, id: &str) -> Option<&Grant> {
        self.by_id.get(id)
    }

    /// Take out every grant whose TTL has ended at `now` (for one given
    /// uses only, [`MAX_TTL`] after it was granted: [`Grant::ends_at`]).
    pub(crate) fn expire(&mut self, now: SystemTime) -> Vec<Grant> {
        let ended: Vec<String> = self
            .by_id
            .values()
            .filter(|g| g.ends_at() <= now)
            .map(|g| g.id.clone())
            .collect();
        ended
            .iter()
            .filter_map(|id| self.by_id.remove(id))
            .collect()
    }

    /// Every grant held that `visible` lets through, by id.
    pub(crate) fn list(&self, visible: impl Fn(&str) -> bool) -> Vec<Grant> {
        self.by_id
            .values()
            .filter(|g| visible(&g.scope.org))
            .cloned()
            .collect()
    }

    /// Grants covering `addr` or a name, for checks of a new policy.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Grant> {
        self.by_id.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn grant(
        id: &str,
        target: Target,
        port: Option<u16>,
        ttl: Option<u64>,
        uses: Option<u32>,
    ) -> Grant {
        Grant {
            id: id.into(),
            scope: Scope {
                org: Arc::from("acme"),
                target,
                port,
                method: None,
                path: None,
            },
            granted_at: t(0),
            expires: ttl.map(t),
            max_uses: uses,
            uses: 0,
            approver: "alice".into(),
            reason: None,
            approval: None,
        }
    }

    fn name(n: &str) -> Host {
        Host::Name(n.into())
    }

    #[test]
    fn a_grant_matches_its_org_target_and_port_until_it_ends() {
        let mut g = Grants::default();
        g.add(grant(
            "g1",
            Target::Name("x.test".into()),
            Some(443),
            Some(600),
            None,
        ))
        .unwrap();
        assert!(g
            .matching("acme", (&name("x.test"), Some(443)), None, t(1))
            .is_some());
        assert!(g
            .matching("acme", (&name("x.test"), None), None, t(1))
            .is_some());
        assert!(g
            .matching("acme", (&name("x.test"), Some(80)), None, t(1))
            .is_none());
        assert!(g
            .matching("acme", (&name("y.x.test"), Some(443)), None, t(1))
            .is_none());
        assert!(g
            .matching("other", (&name("x.test"), Some(443)), None, t(1))
            .is_none());
        assert!(g
            .matching("acme", (&name("x.test"), Some(443)), None, t(600))
            .is_none());
        assert_eq!(g.expire(t(599)).len(), 0);
        assert_eq!(g.expire(t(600)).len(), 1);
        assert!(g.get("g1").is_none());
    }

    #[test]
    fn a_method_and_path_grant_covers_matching_requests_only() {
        let mut g = Grants::default();
        let mut r = grant(
            "g1",
            Target::Name("x.test".into()),
            Some(80),
            Some(60),
            None,
        );
        (r.scope.method, r.scope.path) = (Some("GET".into()), Some("/api/".into()));
        g.add(r).unwrap();
        let path = |p: &str| crate::policy::request::NormalPath::parse(p).unwrap();
        let (ok, other, outside) = (path("/api/v1"), path("/admin"), path("/api"));
        let req = |method, path| Some(Request { method, path });
        let x = name("x.test");
        let m = |request| g.matching("acme", (&x, Some(80)), request, t(1)).is_some();
        assert!(m(req("GET", &ok)));
        assert!(!m(req("get", &ok)), "methods compare exactly");
        assert!(!m(req("POST", &ok)));
        assert!(!m(req("GET", &other)));
        assert!(!m(req("GET", &outside)));
        assert!(
            !m(None),
            "a tunnel under a method/path grant cannot be checked"
        );
        assert!(
            g.matching("acme", (&x, None), None, t(1)).is_none(),
            "nor a DNS answer"
        );
        assert!(check_requests(Some("GET"), Some("/api/*")).is_ok());
        for (m, p) in [
            (Some("G T"), None),
            (None, Some("api")),
            (None, Some("/a/../b")),
            (None, Some("/%41")),
        ] {
            assert!(check_requests(m, p).is_err(), "{m:?} {p:?}");
        }
    }

    #[test]
    fn a_method_and_path_grant_may_open_a_tunnel_to_intercept_only() {
        let mut g = Grants::default();
        let mut r = grant(
            "g1",
            Target::Name("x.test".into()),
            Some(443),
            Some(60),
            None,
        );
        (r.scope.method, r.scope.path) = (Some("GET".into()), Some("/api/x".into()));
        g.add(r).unwrap();
        g.add(grant(
            "g2",
            Target::Name("y.test".into()),
            Some(443),
            Some(60),
            None,
        ))
        .unwrap();
        let (x, y) = (name("x.test"), name("y.test"));
        let found = |h, port, at| g.intercepting("acme", (h, port), at).map(|g| g.id.clone());
        assert_eq!(found(&x, 443, t(1)).as_deref(), Some("g1"));
        assert_eq!(found(&x, 8443, t(1)), None, "another port");
        assert_eq!(g.intercepting("other", (&x, 443), t(1)).map(|_| ()), None);
        assert_eq!(found(&y, 443, t(1)), None, "a tunnel grant is not one");
        assert_eq!(found(&x, 443, t(60)), None, "ended");
    }

    #[test]
    fn cidr_grants_cover_addresses_only() {
        let mut g = Grants::default();
        let net: IpNet = "198.18.7.0/24".parse().unwrap();
        g.add(grant("g1", Target::Cidr(net), Some(443), Some(60), None))
            .unwrap();
        let ip = |s: &str| Host::Ip(s.parse().unwrap());
        assert!(g
            .matching("acme", (&ip("198.18.7.9"), Some(443)), None, t(1))
            .is_some());
        assert!(g
            .matching("acme", (&ip("198.18.8.9"), Some(443)), None, t(1))
            .is_none());
        assert!(g
            .matching("acme", (&name("198-18-7-9.test"), Some(443)), None, t(1))
            .is_none());
    }

    #[test]
    fn max_uses_allows_exactly_that_many() {
        let mut g = Grants::default();
        g.add(grant(
            "g1",
            Target::Name("x.test".into()),
            Some(443),
            None,
            Some(1),
        ))
        .unwrap();
        let id = g
            .matching("acme", (&name("x.test"), Some(443)), None, t(1))
            .unwrap()
            .id
            .clone();
        let (_, used_up) = g.spend(&id, t(1)).unwrap();
        assert!(
            g.spend(&id, t(1)).is_none(),
            "a spent grant has no use left"
        );
        assert!(used_up);
        assert!(g
            .matching("acme", (&name("x.test"), Some(443)), None, t(1))
            .is_none());
        assert!(g.get("g1").is_none(), "no TTL: ended with its last use");
        // With a TTL, a used-up grant stays held (its connections run) until it ends.
        g.add(grant(
            "g2",
            Target::Name("x.test".into()),
            Some(443),
            Some(60),
            Some(1),
        ))
        .unwrap();
        g.spend("g2", t(1)).unwrap();
        assert!(g.spend("g2", t(1)).is_none());
        assert!(g.get("g2").is_some());
        assert!(g
            .matching("acme", (&name("x.test"), Some(443)), None, t(1))
            .is_none());
    }

    /// A grant given uses only ends in time all the same: at most
    /// `MAX_TTL` after it was granted, unused or not.
    #[test]
    fn a_uses_only_grant_ends_at_max_ttl() {
        let mut g = Grants::default();
        let x = Target::Name("x.test".into());
        g.add(grant("g1", x, Some(443), None, Some(3))).unwrap();
        let end = t(0) + MAX_TTL;
        assert_eq!(g.get("g1").unwrap().ends_at(), end);
        let x = name("x.test");
        let before = end - Duration::from_secs(1);
        assert!(g.matching("acme", (&x, Some(443)), None, before).is_some());
        assert!(g.expire(before).is_empty());
        assert!(g.matching("acme", (&x, Some(443)), None, end).is_none());
        assert!(g.spend("g1", end).is_none(), "no use after its end");
        let ended = g.expire(end);
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].expires, None, "recorded as given: uses only");
        assert!(g.get("g1").is_none());
    }

    #[test]
    fn every_grant_has_a_bounded_end() {
        let mut g = Grants::default();
        let x = || Target::Name("x.test".into());
        assert_eq!(
            g.add(grant("a", x(), Some(443), None, Some(0))),
            Err(GrantError::ZeroUses)
        );
        let over = MAX_TTL.as_secs() + 1;
        assert!(matches!(
            g.add(grant("b", x(), Some(443), Some(over), None)),
            Err(GrantError::Ttl(_))
        ));
        let d = g.add(grant("c", x(), Some(443), None, None)).unwrap();
        assert_eq!(d.expires, Some(t(0) + DEFAULT_TTL));
        for i in 1..GRANTS_PER_ORG {
            g.add(grant(&format!("n{i}"), x(), Some(443), Some(60), None))
                .unwrap();
        }
        assert!(matches!(
            g.add(grant("z", x(), Some(443), Some(60), None)),
            Err(GrantError::Full(_))
        ));
    }
}
