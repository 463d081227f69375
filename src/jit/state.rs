//! The shared state of just-in-time access: approvals and grants behind
//! one lock, the grant records written as grants are given and end, their
//! replay at start, and each grant's end signal that live connections it
//! allowed wait on.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::approvals::{AnswerError, Approval, Approvals, Asked};
use super::grants::{End, Grant, GrantError, Grants, Request, Scope, Target};
use crate::config::ApproverToken;
use crate::evidence::{Event, Evidence, GrantFacts, Kind, Mode, Record};
use crate::policy::{Decision, OrgRef, Policy, Reason, Verdict, GRANT_RULE_PREFIX};
use crate::proto::target::Host;

/// The grant id a verdict's rule names, if a grant allowed it.
pub(crate) fn grant_of(rule: Option<&str>) -> Option<&str> {
    rule.and_then(|r| r.strip_prefix(GRANT_RULE_PREFIX))
}

/// What the miss hook was told.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MissFacts<'a> {
    pub(crate) org: &'a OrgRef,
    pub(crate) client: IpAddr,
    pub(crate) host: &'a Host,
    /// `None`: a DNS question (the name on any port).
    pub(crate) port: Option<u16>,
    /// The request, when Palisade sees one (a plain `http://` request):
    /// only then can a grant naming a method or path cover the miss.
    pub(crate) request: Option<Request<'a>>,
    /// A tunnel Palisade may intercept (a CONNECT, a SOCKS5 connection):
    /// a grant naming a method or path covers it, to be intercepted and
    /// each request inside decided against the grants.
    pub(crate) intercepts: bool,
    pub(crate) mode: Mode,
    pub(crate) now: SystemTime,
}

/// What a miss became.
#[derive(Debug, Clone)]
pub(crate) enum Miss {
    /// Still `no_matching_rule`.
    Denied,
    /// Allowed by a grant: decide it as allowed by rule `rule`.
    Granted(Granted),
    /// Refused `approval_pending`: this approval waits for an answer.
    Pending(Approval),
}

/// A use of a grant.
#[derive(Debug, Clone)]
pub(crate) struct Granted {
    /// `grant:ID`, the verdict's rule.
    pub(crate) rule: Arc<str>,
    /// A tunnel under a grant naming a method or path: allowed only to be
    /// intercepted, each request inside decided on its own (and each
    /// spending a use: the tunnel spends none).
    pub(crate) requests: Option<String>,
}

impl Miss {
    /// The detail of an `approval_pending` refusal: the approval's
    /// reference and the destination, what the client is shown.
    pub(crate) fn pending_detail(a: &Approval) -> String {
        format!(
            "approval {} pending for {}; retry once an approver grants it",
            a.id, a.asked
        )
    }
}

/// Why an approver's request was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JitError {
    #[error(transparent)]
    Answer(#[from] AnswerError),
    #[error(transparent)]
    Grant(#[from] GrantError),
    #[error("{0}")]
    Refused(String),
}

#[derive(Debug)]
struct Inner {
    approvals: Approvals,
    grants: Grants,
    /// Each held grant's end: cancelled when it ends, which closes the
    /// live connections it allowed.
    ends: HashMap<String, CancellationToken>,
    /// The ends of the grants that ended last (TTL, revoke, a denying
    /// policy), cancelled, newest last, at most [`RECENT_ENDS`]: a
    /// connection decided under a grant just before it ended, whose watch
    /// looks its end up only after, finds it ended and is closed, instead
    /// of finding no end at all and running on.
    ended: VecDeque<(String, CancellationToken)>,
}

/// How many ended grants' signals are kept for connections decided just
/// before the end ([`Inner::ended`]): far more grants than can end between
/// a decision and its connection's watch starting (the client's hello
/// timeout at most), even by a decider answering every miss.
const RECENT_ENDS: usize = 4096;

impl Inner {
    /// End grant `id`'s live connections, and remember that it ended.
    fn end(&mut self, id: &str) {
        if let Some(end) = self.ends.remove(id) {
            end.cancel();
            if self.ended.len() >= RECENT_ENDS {
                self.ended.pop_front();
            }
            self.ended.push_back((id.to_string(), end));
        }
    }
}

/// Approvals and grants, shared by the proxy, the DNS shim and the admin
/// endpoints.
#[derive(Debug)]
pub(crate) struct Jit {
    inner: Mutex<Inner>,
    evidence: Option<Arc<Evidence>>,
    /// `[decider]`: asked about a miss no grant covers.
    decider: Option<crate::decider::Decider>,
}

/// A fresh id: `prefix` and 8 random hex digits.
fn fresh(prefix: &str) -> String {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        // Unique within a run is all an id needs; randomness only keeps
        // them from being guessed as a sequence.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
        b = N
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_be_bytes();
    }
    format!("{prefix}{}", data_encoding::HEXLOWER.encode(&b))
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The record of `grant` at `event` (`detail`: what ended it, or the
/// reason given), under `policy`.
pub(crate) fn grant_record(
    grant: &Grant,
    event: Event,
    policy: &Policy,
    ended_by: Option<&str>,
) -> Record {
    let reason = if event == Event::Granted {
        Reason::RuleMatch
    } else {
        Reason::GrantExpired
    };
    let verdict = Verdict {
        org: None,
        reason,
        rule: Some(Arc::from(format!("{GRANT_RULE_PREFIX}{}", grant.id))),
        would_deny: None,
    };
    let mut r = Record::decided(
        Kind::Grant,
        Mode::Explicit,
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        &verdict,
        policy,
    );
    r.org = Some(grant.scope.org.clone());
    r.client = None;
    r.event = event;
    r.host = Some(grant.scope.target.to_string());
    r.port = grant.scope.port;
    r.detail = grant.reason.clone();
    r.method = grant.scope.method.clone();
    r.path = grant.scope.path.clone();
    r.grant = Some(Box::new(GrantFacts {
        id: grant.id.clone(),
        method: grant.scope.method.clone(),
        path: grant.scope.path.clone(),
        target: grant.scope.target.to_string(),
        granted_at: rfc3339(grant.granted_at),
        expires: grant.expires.map(rfc3339),
        max_uses: grant.max_uses,
        uses: grant.uses,
        approver: grant.approver.clone(),
        reason: grant.reason.clone(),
        approval: grant.approval.clone(),
        ended_by: ended_by.map(str::to_string),
    }));
    r
}

/// How far back before `now` a restart reads the evidence for grants:
/// [`MAX_TTL`](super::grants::MAX_TTL), the longest any grant lives,
/// and this much more for a clock that was set back or skewed meanwhile
/// (a grant found a little past its end is recorded ended at start).
pub(crate) const REPLAY_SKEW: Duration = Duration::from_secs(3600);

/// The grants still held after the records under `dir`, at `now`: given
/// ones not ended, their uses counted from the decisions they allowed;
/// one whose end passed while Palisade was down is dropped (and its end
/// is recorded at start by [`Jit::restore`]). Reads only the segments
/// that may hold records of the last
/// [`MAX_TTL`](super::grants::MAX_TTL) + [`REPLAY_SKEW`]
/// ([`crate::evidence::segment::since`]): no grant given before that is
/// live, and a grant's uses and end are recorded after it was given.
pub(crate) fn replay(dir: &Path, now: SystemTime) -> Vec<Grant> {
    let window = super::grants::MAX_TTL + REPLAY_SKEW;
    let since = now.checked_sub(window).unwrap_or(SystemTime::UNIX_EPOCH);
    let mut held: HashMap<String, Grant> = HashMap::new();
    let events = &[
        Event::Decision,
        Event::Granted,
        Event::Expired,
        Event::Revoked,
        Event::UsedUp,
    ];
    for stored in crate::evidence::query::read_events_since(dir, since, events) {
        let Ok(stored) = stored else { continue };
        let r = stored.record;
        match (r.kind, r.event) {
            (Kind::Grant, Event::Granted) => {
                if let Some(g) = r.grant.as_deref().and_then(|f| from_facts(f, &r)) {
                    held.insert(g.id.clone(), g);
                }
            }
            (Kind::Grant, _) => {
                if let Some(f) = r.grant.as_deref() {
                    let used_up_with_ttl = r.event == Event::UsedUp && f.expires.is_some();
                    if used_up_with_ttl {
                        if let Some(g) = held.get_mut(&f.id) {
                            g.uses = g.uses.max(f.uses);
                        }
                    } else {
                        held.remove(&f.id);
                    }
                }
            }
            (_, Event::Decision) if r.reason.is_allow() => {
                if let Some(id) = grant_of(r.rule.as_deref()) {
                    if let Some(g) = held.get_mut(id) {
                        g.uses = g.uses.saturating_add(1);
                    }
                }
            }
            _ => {}
        }
    }
    let mut out: Vec<Grant> = held.into_values().collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

fn from_facts(f: &GrantFacts, r: &Record) -> Option<Grant> {
    let target = match f.target.parse::<ipnet::IpNet>() {
        Ok(net) => Target::Cidr(net),
        Err(_) => Target::Name(f.target.clone()),
    };
    let time = |s: &str| humantime::parse_rfc3339(s).ok();
    Some(Grant {
        id: f.id.clone(),
        scope: Scope {
            org: r.org.clone()?,
            target,
            port: r.port,
            method: f.method.clone(),
            path: f.path.clone(),
        },
        granted_at: time(&f.granted_at)?,
        expires: match &f.expires {
            Some(e) => Some(time(e)?),
            None => None,
        },
        max_uses: f.max_uses,
        uses: f.uses,
        approver: f.approver.clone(),
        reason: f.reason.clone(),
        approval: f.approval.clone(),
    })
}

/// What an approver asks of a grant: its end and why.
#[derive(Debug, Clone, Default)]
pub(crate) struct Terms {
    pub(crate) ttl: Option<Duration>,
    pub(crate) max_uses: Option<u32>,
    pub(crate) reason: Option<String>,
}

impl Jit {
    /// Empty, writing its records to `evidence` (none: tests).
    pub(crate) fn new(evidence: Option<Arc<Evidence>>) -> Jit {
        Jit {
            inner: Mutex::new(Inner {
                approvals: Approvals::new(
                    super::approvals::PENDING_TOTAL,
                    super::approvals::PENDING_PER_ORG,
                    super::approvals::DEFAULT_PENDING_TTL,
                ),
                grants: Grants::default(),
                ends: HashMap::new(),
                ended: VecDeque::new(),
            }),
            evidence,
            decider: None,
        }
    }

    /// With `decider` consulted on a miss.
    pub(crate) fn with_decider(mut self, decider: Option<crate::decider::Decider>) -> Jit {
        self.decider = decider;
        self
    }

    /// The decider, if one is configured.
    pub(crate) fn decider(&self) -> Option<&crate::decider::Decider> {
        self.decider.as_ref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding it leaves plain data: keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn submit(&self, mut r: Record) {
        if let Some(e) = &self.evidence {
            e.submit(&mut r);
        }
    }

    /// Take back the grants replayed from the evidence (at start): those
    /// whose end passed meanwhile (their TTL, or, given uses only,
    /// [`MAX_TTL`](super::grants::MAX_TTL) after they were granted) are
    /// recorded `expired` (`ended_by = "ttl"`) and dropped.
    pub(crate) fn restore(&self, grants: Vec<Grant>, policy: &Policy, now: SystemTime) {
        let mut ended = Vec::new();
        {
            let mut inner = self.lock();
            for g in grants {
                if g.ends_at() <= now {
                    ended.push(g);
                    continue;
                }
                let id = g.id.clone();
                // Replayed grants were checked when given.
                if inner.grants.add(g).is_ok() {
                    inner.ends.insert(id, CancellationToken::new());
                }
            }
        }
        for g in ended {
            self.submit(grant_record(&g, Event::Expired, policy, Some("ttl")));
        }
    }

    /// Rule 1 of the module table: the live grant covering the miss. No
    /// use is spent here: a connection spends one only once it is
    /// allowed ([`Jit::spend`]), so a grant whose name then fails the
    /// address checks keeps its uses.
    /// A tunnel that may be intercepted ([`MissFacts::intercepts`]) no
    /// other grant covers is covered by a grant naming a method or path
    /// on its target and port ([`Granted::requests`]).
    pub(crate) fn grant_for(&self, facts: &MissFacts<'_>) -> Option<Granted> {
        let inner = self.lock();
        let org = &facts.org.name;
        let rule = |g: &Grant| Arc::from(format!("{GRANT_RULE_PREFIX}{}", g.id));
        if let Some(g) =
            inner
                .grants
                .matching(org, (facts.host, facts.port), facts.request, facts.now)
        {
            return Some(Granted {
                rule: rule(g),
                requests: None,
            });
        }
        let (true, None, Some(port)) = (facts.intercepts, facts.request, facts.port) else {
            return None;
        };
        let g = inner
            .grants
            .intercepting(org, (facts.host, port), facts.now)?;
        Some(Granted {
            rule: rule(g),
            requests: g.scope.requests(),
        })
    }

    /// Spend a use of the grant `rule` names (`grant:ID`), for a
    /// connection it allowed at `now` (recorded `used_up` when that was
    /// its last). `false`: the grant is no longer live (ended, or its last
    /// use taken by another connection since it matched), so the
    /// connection must be refused. A rule no grant's is not spent from;
    /// nor is a grant naming a method or path by a tunnel (`request`
    /// false): each request inside spends its own.
    pub(crate) fn spend(
        &self,
        policy: &Policy,
        rule: &str,
        request: bool,
        now: SystemTime,
    ) -> bool {
        let Some(id) = grant_of(Some(rule)) else {
            return true;
        };
        let (grant, used_up) = {
            let mut inner = self.lock();
            if !request {
                if let Some(g) = inner
                    .grants
                    .get(id)
                    .filter(|g| g.scope.requests().is_some())
                {
                    return g.is_live(now);
                }
            }
            let Some(spent) = inner.grants.spend(id, now) else {
                return false;
            };
            if spent.1 && spent.0.expires.is_none() {
                // Ended with its last use; the connection it allowed runs on.
                inner.ends.remove(id);
            }
            spent
        };
        if used_up {
            self.submit(grant_record(&grant, Event::UsedUp, policy, None));
        }
        true
    }

    /// Rule 2: the approval this miss makes or joins.
    pub(crate) fn ask(&self, facts: &MissFacts<'_>) -> Option<Approval> {
        let asked = Asked {
            org: facts.org.name.clone(),
            host: facts.host.to_string(),
            port: facts.port,
            request: facts
                .request
                .map(|r| (r.method.to_string(), r.path.as_str().to_string())),
        };
        self.lock()
            .approvals
            .miss(asked, facts.client, facts.now, || fresh("a-"))
    }

    /// The pending approvals `token` may see, at `now`.
    pub(crate) fn approvals(&self, token: &ApproverToken, now: SystemTime) -> Vec<Approval> {
        self.lock().approvals.list(now, |org| token.covers(org))
    }

    /// The grants `token` may see.
    pub(crate) fn grants(&self, token: &ApproverToken) -> Vec<Grant> {
        self.lock().grants.list(|org| token.covers(org))
    }

    /// The end signal of grant `id`: while it is held, and (cancelled)
    /// for a while after it ended. `None`: unknown, or used up with no
    /// TTL left to end it (the connections it allowed run on).
    pub(crate) fn end_of(&self, id: &str) -> Option<CancellationToken> {
        let inner = self.lock();
        inner.ends.get(id).cloned().or_else(|| {
            let ended = inner.ended.iter().rev().find(|(g, _)| g == id);
            ended.map(|(_, end)| end.clone())
        })
    }

    /// Answer approval `id` as `token`: `allow` makes a grant of exactly
    /// what it asked (returned), `deny` drops it. Another org's approval
    /// is unknown to the token, as one that never was.
    pub(crate) async fn answer(
        &self,
        token: &ApproverToken,
        id: &str,
        allow: bool,
        terms: Terms,
        policy: &Policy,
        now: SystemTime,
    ) -> Result<Option<Grant>, JitError> {
        let approval = {
            let mut inner = self.lock();
            match inner.approvals.get(id, now) {
                Some(a) if !token.covers(&a.asked.org) => {
                    return Err(AnswerError::Unknown(id.to_string()).into())
                }
                _ => {}
            }
            if allow {
                // Checked before it is taken: a refused grant leaves the
                // approval pending.
                if let Some(a) = inner.approvals.get(id, now) {
                    let scope = scope_of(&a.asked);
                    check_terms(&terms)?;
                    check_scope(&scope, policy)?;
                }
            }
            inner.approvals.answer(id, now)?
        };
        if !allow {
            return Ok(None);
        }
        let scope = scope_of(&approval.asked);
        self.give(token, scope, terms, Some(approval.id), policy, now)
            .await
            .map(Some)
    }

    /// Grant `scope` as `token`, directly or answering `approval`. Its
    /// `granted` record is written (awaited, as a decision record is)
    /// before the grant is returned: an approver told "granted" has it
    /// on the evidence, so a restart finds it. No record, no grant: if
    /// the write fails the grant is taken back and refused.
    pub(crate) async fn give(
        &self,
        token: &ApproverToken,
        scope: Scope,
        terms: Terms,
        approval: Option<String>,
        policy: &Policy,
        now: SystemTime,
    ) -> Result<Grant, JitError> {
        if !token.covers(&scope.org) {
            return Err(JitError::Refused(format!(
                "token {} does not answer for org {}",
                token.name, scope.org
            )));
        }
        check_terms(&terms)?;
        check_scope(&scope, policy)?;
        let grant = Grant {
            id: fresh("g-"),
            scope,
            granted_at: now,
            expires: terms.ttl.map(|t| now + t),
            max_uses: terms.max_uses,
            uses: 0,
            approver: token.name.clone(),
            reason: terms.reason,
            approval,
        };
        let grant = {
            let mut inner = self.lock();
            let g = inner.grants.add(grant)?;
            inner.ends.insert(g.id.clone(), CancellationToken::new());
            g
        };
        let mut record = grant_record(&grant, Event::Granted, policy, None);
        if let Some(e) = &self.evidence {
            if let Err(err) = e.write(&mut record).await {
                let mut inner = self.lock();
                inner.grants.remove(&grant.id);
                inner.end(&grant.id);
                return Err(JitError::Refused(format!(
                    "the grant could not be recorded ({err}): nothing was granted"
                )));
            }
        }
        Ok(grant)
    }

    /// Revoke grant `id` as `token`: recorded, and the connections it
    /// allowed are closed.
    pub(crate) fn revoke(
        &self,
        token: &ApproverToken,
        id: &str,
        policy: &Policy,
    ) -> Result<Grant, JitError> {
        let grant = {
            let mut inner = self.lock();
            match inner.grants.get(id) {
                Some(g) if token.covers(&g.scope.org) => {}
                _ => return Err(GrantError::Unknown(id.to_string()).into()),
            }
            let g = inner
                .grants
                .remove(id)
                .ok_or_else(|| GrantError::Unknown(id.to_string()))?;
            inner.end(id);
            g
        };
        self.submit(grant_record(
            &grant,
            Event::Revoked,
            policy,
            Some(&token.name),
        ));
        Ok(grant)
    }

    /// End every grant whose TTL is over at `now`, and every grant
    /// whose target `policy` now denies outright (a reload); each is
    /// recorded, and its connections closed.
    pub(crate) fn end_due(&self, policy: &Policy, now: SystemTime) {
        let mut ended: Vec<(Grant, End, &'static str)> = Vec::new();
        {
            let mut inner = self.lock();
            for g in inner.grants.expire(now) {
                ended.push((g, End::Expired, "ttl"));
            }
            let denied: Vec<String> = inner
                .grants
                .iter()
                .filter(|g| check_scope(&g.scope, policy).is_err())
                .map(|g| g.id.clone())
                .collect();
            for id in denied {
                if let Some(g) = inner.grants.remove(&id) {
                    ended.push((g, End::Expired, "policy"));
                }
            }
            for (g, _, _) in &ended {
                inner.end(&g.id);
            }
        }
        for (g, _, by) in ended {
            self.submit(grant_record(&g, Event::Expired, policy, Some(by)));
        }
    }
}

/// The grant an approval asks for: exactly its org, host and port.
fn scope_of(asked: &Asked) -> Scope {
    let target = match asked.host.parse::<IpAddr>() {
        Ok(ip) => Target::Cidr(ipnet::IpNet::from(ip)),
        Err(_) => Target::Name(asked.host.clone()),
    };
    Scope {
        org: asked.org.clone(),
        target,
        port: asked.port,
        method: asked.request.as_ref().map(|r| r.0.clone()),
        path: asked.request.as_ref().map(|r| r.1.clone()),
    }
}

fn check_terms(terms: &Terms) -> Result<(), JitError> {
    if terms.max_uses == Some(0) {
        return Err(GrantError::ZeroUses.into());
    }
    if let Some(t) = terms.ttl {
        if t.is_zero() || t > super::grants::MAX_TTL {
            return Err(GrantError::Ttl(humantime::format_duration(t).to_string()).into());
        }
    }
    Ok(())
}

/// A grant may only open what a miss would be: never an always-denied
/// address, nor a target the policy denies (an explicit deny, the
/// baseline, a name budget), nor for an org the policy does not know.
pub(crate) fn check_scope(scope: &Scope, policy: &Policy) -> Result<(), JitError> {
    let Some(org) = policy.org_named(&scope.org) else {
        return Err(JitError::Refused(format!("no org {}", scope.org)));
    };
    let probe: Vec<Host> = match &scope.target {
        Target::Name(n) => vec![Host::Name(n.clone())],
        Target::Cidr(net) => {
            let mut always = policy.closing(net.network());
            always.extend(policy.closing(net.broadcast()));
            if let Some((range, what)) = always.first() {
                return Err(JitError::Refused(format!(
                    "{} is always denied ({range}: {}): no grant opens it",
                    scope.target,
                    what.join(", ")
                )));
            }
            vec![Host::Ip(net.network()), Host::Ip(net.broadcast())]
        }
    };
    let port = scope.port.unwrap_or(443);
    for host in probe {
        if let Decision::Final(v) = policy.decide_for_org(&org, &host, port) {
            match v.reason {
                Reason::NoMatchingRule | Reason::PortNotAllowed | Reason::RuleMatch => {}
                other => {
                    let rule = v.rule.map(|r| format!(" (rule {r})")).unwrap_or_default();
                    return Err(JitError::Refused(format!(
                        "the policy denies {} for org {}: {other}{rule}; no grant opens it",
                        scope.target, scope.org
                    )));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> Arc<Policy> {
        let text = format!(
            "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\non_miss = \"ask\"\n{extra}"
        );
        let config = crate::config::from_str(&text, std::path::Path::new("t.toml")).unwrap();
        Arc::new(Policy::new(&config))
    }

    fn token(orgs: Option<&[&str]>) -> ApproverToken {
        ApproverToken {
            name: "alice".into(),
            digest: crate::config::TokenDigest::of(b"t"),
            orgs: orgs.map(|o| o.iter().map(|s| s.to_string()).collect()),
        }
    }

    /// A grant is answered only once its `granted` record is written: an
    /// approver told "granted" has it on the evidence (a crash right after
    /// the answer cannot lose it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_is_given_only_once_its_record_is_written() {
        let root = crate::testing::scratch("jitgrant");
        let evidence = Arc::new(Evidence::open(&root.join("evidence")).unwrap());
        let jit = Jit::new(Some(evidence.clone()));
        let p = policy("");
        let t = token(None);
        let scope = Scope {
            org: Arc::from("acme"),
            target: Target::Name("new.test".into()),
            port: Some(443),
            method: None,
            path: None,
        };
        evidence.pause_writer(true);
        let give = jit.give(&t, scope, Terms::default(), None, &p, SystemTime::now());
        tokio::pin!(give);
        let early = tokio::time::timeout(Duration::from_millis(300), &mut give).await;
        assert!(
            early.is_err(),
            "a grant answered before its record was written"
        );
        evidence.pause_writer(false);
        let g = give.await.unwrap();
        assert!(jit.grants(&t).iter().any(|h| h.id == g.id));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A restart reads only the segments that can hold a live grant: a
    /// grant given uses only two days ago is not even read (its segment
    /// ends before the window), one given 30 hours ago (in the segment
    /// spanning the window's start) is found and
    /// ended at once (`MAX_TTL` after it was granted), one given an hour
    /// ago is held.
    #[test]
    fn replay_reads_the_window_and_a_uses_only_grant_ends_at_max_ttl() {
        let dir = crate::testing::scratch("jitwindow");
        let p = policy("");
        let now = SystemTime::now();
        let ago = |h: f64| now - Duration::from_secs_f64(h * 3600.0);
        let line = |id: &str, at: SystemTime| {
            let g = Grant {
                id: id.into(),
                scope: Scope {
                    org: Arc::from("acme"),
                    target: Target::Name("x.test".into()),
                    port: Some(443),
                    method: None,
                    path: None,
                },
                granted_at: at,
                expires: None,
                max_uses: Some(5),
                uses: 0,
                approver: "alice".into(),
                reason: None,
                approval: None,
            };
            let mut r = grant_record(&g, Event::Granted, &p, None);
            r.ts = humantime::format_rfc3339_micros(at).to_string();
            serde_json::to_string(&r).unwrap()
        };
        let header = |at: SystemTime| {
            let ts = humantime::format_rfc3339_micros(at);
            format!("{{\"event\":\"start\",\"seq\":0,\"ts\":\"{ts}\"}}")
        };
        for (seq, (h, id)) in [(48.0, "g-old"), (30.0, "g-edge"), (1.0, "g-new")]
            .into_iter()
            .enumerate()
        {
            let text = format!("{}\n{}\n", header(ago(h)), line(id, ago(h)));
            let name = crate::evidence::segment::segment_name(seq as u64 * 10);
            std::fs::write(dir.join(name), text).unwrap();
        }
        let list = crate::evidence::segment::list(&dir).unwrap();
        let window = crate::evidence::segment::since(list.clone(), ago(25.0));
        assert_eq!(window, list[1..].to_vec(), "the 48 h segment is not read");
        let held = replay(&dir, now);
        let ids: Vec<&str> = held.iter().map(|g| g.id.as_str()).collect();
        assert_eq!(ids, ["g-edge", "g-new"]);
        let jit = Jit::new(None);
        jit.restore(held, &p, now);
        let live: Vec<String> = jit.grants(&token(None)).into_iter().map(|g| g.id).collect();
        assert_eq!(live, ["g-new"], "the uses-only grant past MAX_TTL is ended");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A connection decided under a grant that ends before its watch
    /// looks the end up still finds it ended (and is closed); one that
    /// took a grant's last use, with no TTL left, finds no end and runs on.
    #[tokio::test]
    async fn an_end_is_found_after_the_grant_ended_and_a_used_up_grant_has_none() {
        let p = policy("");
        let jit = Jit::new(None);
        let t = token(None);
        let now = SystemTime::now();
        let scope = || Scope {
            org: Arc::from("acme"),
            target: Target::Name("new.test".into()),
            port: Some(443),
            method: None,
            path: None,
        };
        let g = jit
            .give(&t, scope(), Terms::default(), None, &p, now)
            .await
            .unwrap();
        assert!(jit.end_of(&g.id).is_some_and(|e| !e.is_cancelled()));
        jit.revoke(&t, &g.id, &p).unwrap();
        let end = jit
            .end_of(&g.id)
            .expect("an ended grant's end is still found");
        assert!(end.is_cancelled());

        let once = Terms {
            max_uses: Some(1),
            ..Terms::default()
        };
        let u = jit.give(&t, scope(), once, None, &p, now).await.unwrap();
        assert!(jit.spend(&p, &format!("{GRANT_RULE_PREFIX}{}", u.id), false, now));
        assert!(jit.end_of(&u.id).is_none(), "a used-up grant ends nothing");
    }

    /// A grant record with every field set is written in canonical form
    /// (nested keys sorted): `evidence verify` accepts it.
    #[test]
    fn a_grant_record_is_canonical() {
        let p = policy("");
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let grant = Grant {
            id: "g-1".into(),
            scope: Scope {
                org: Arc::from("acme"),
                target: Target::Name("x.test".into()),
                port: Some(80),
                method: Some("GET".into()),
                path: Some("/api/".into()),
            },
            granted_at: now,
            expires: Some(now + Duration::from_secs(60)),
            max_uses: Some(2),
            uses: 1,
            approver: "alice".into(),
            reason: Some("why".into()),
            approval: Some("a-1".into()),
        };
        let r = grant_record(&grant, Event::Revoked, &p, Some("alice"));
        let written = serde_json::to_vec(&r.grant).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&written).unwrap();
        let mut canon = Vec::new();
        crate::evidence::chain::canonical_into(&value, &mut canon);
        assert_eq!(
            String::from_utf8(written).unwrap(),
            String::from_utf8(canon).unwrap()
        );
    }

    #[tokio::test]
    async fn always_denied_and_explicitly_denied_targets_are_never_granted() {
        let p = policy("[[org.deny]]\nhost = \"bad.test\"\n");
        let jit = Jit::new(None);
        let t = token(None);
        let now = SystemTime::now();
        let scope = |target: Target| Scope {
            org: Arc::from("acme"),
            target,
            port: Some(443),
            method: None,
            path: None,
        };
        let give = |target: Target| jit.give(&t, scope(target), Terms::default(), None, &p, now);
        let e = give(Target::Cidr("169.254.169.254/32".parse().unwrap()))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("always denied"), "{e}");
        let e = give(Target::Name("bad.test".into()))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("explicit_deny"), "{e}");
        let ok = give(Target::Name("new.test".into())).await.unwrap();
        assert_eq!(ok.expires, Some(now + super::super::grants::DEFAULT_TTL));
        let other = token(Some(&["other"]));
        assert!(jit.revoke(&other, &ok.id, &p).is_err());
        assert!(jit.grants(&other).is_empty());
        assert!(jit.revoke(&t, &ok.id, &p).is_ok());
    }
}
