//! A connection's own state, from accept to close.
//!
//! A [`Link`] is born at accept ([`super::listen`]) with the view, kind,
//! mode and client of one client connection, and carries its connection
//! permit. Until a target is decided, it is what a refusal is recorded
//! from: [`Link::refuse`], then one write ([`super::record::refused`]).
//! Once a target is decided it becomes a [`Conn`] ([`Link::decided`]),
//! which carries the permit on to the close.
//!
//! A [`Conn`] holds what the connection is (client, target, mode), the
//! view it was decided under, the verdict as it stands, and what was
//! learnt on the way (the address dialled, the SNI, what the tunnel
//! carries, the interception [`Plan`]). Evidence records are built from
//! it only when they are written ([`Conn::record`], [`Conn::close`]); the
//! record's `decision` follows from its reason.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use super::ctx::{Ctx, View};
use crate::config::Carry;
use crate::evidence::{Kind, Mode, Owed, Record};
use crate::intercept::Interceptor;
use crate::limits::{LimitHit, Permit};
use crate::policy::{OrgRef, Reason, Verdict};
use crate::proto::target::Host;

/// One client connection, from accept until a target is decided: what
/// it is (view, kind, mode, client), the connection permit it holds, and,
/// once refused, why. A refusal before any decision is
/// [`Link::refuse`] plus one record write; a decided target makes it a
/// [`Conn`] ([`Link::decided`]).
#[derive(Debug, Clone)]
pub(crate) struct Link {
    /// What is served and the client's org in it (explicit mode: per
    /// request, as its credentials name it).
    pub view: View,
    /// `tcp` at accept; an explicit connection's requests set it each.
    pub kind: Kind,
    pub mode: Mode,
    pub client: SocketAddr,
    /// The connection permit: held while the link, or any connection
    /// decided from it, lives (none when refused at accept).
    pub permit: Option<Arc<Permit>>,
    /// The target as far as it was read, for a refusal's record.
    pub host: Option<Host>,
    pub port: Option<u16>,
    /// A synthetic address connected to (`host` then the name bound to it).
    pub synthetic: Option<IpAddr>,
    /// The verdict as it stands: the client's org, no rule, until refused
    /// ([`Link::refuse`]).
    pub verdict: Verdict,
    pub detail: Option<String>,
}

impl Link {
    /// A connection just accepted from `client` under `view`, not decided.
    pub(crate) fn new(view: View, mode: Mode, client: SocketAddr) -> Link {
        let verdict = view.verdict(Reason::BadRequest);
        Link {
            view,
            kind: Kind::Tcp,
            mode,
            client,
            permit: None,
            host: None,
            port: None,
            synthetic: None,
            verdict,
            detail: None,
        }
    }

    /// The same connection under another view (the org a request's
    /// credentials name), as `kind`.
    pub(crate) fn under(&self, view: View, kind: Kind) -> Link {
        let verdict = view.verdict(Reason::BadRequest);
        Link {
            view,
            kind,
            verdict,
            ..self.clone()
        }
    }

    /// Charge the permit to the org of the link's view, the one it is
    /// decided for (see [`crate::limits`]); over that org's cap or rate,
    /// the limit to name in the refusal.
    pub(crate) fn charge(&self, ctx: &Ctx) -> Result<(), LimitHit> {
        match &self.permit {
            Some(permit) => ctx.conns.charge(permit, self.view.org.as_ref()),
            None => Ok(()),
        }
    }

    /// The target as far as it was read.
    pub(crate) fn target(&mut self, host: Option<Host>, port: Option<u16>) {
        self.host = host;
        self.port = port;
    }

    /// Refused for `reason` before any decision (of the client's org, no
    /// rule), with `detail`.
    pub(crate) fn refuse(&mut self, reason: Reason, detail: impl Into<Option<String>>) {
        self.verdict = self.view.verdict(reason);
        self.detail = detail.into();
    }

    /// The record of its refusal, as the state stands.
    pub(crate) fn record(&self) -> Record {
        let mut r = Record::decided(
            self.kind,
            self.mode,
            self.client,
            &self.verdict,
            &self.view.policy,
        );
        r.host = self.host.as_ref().map(Host::text);
        r.port = self.port;
        r.synthetic = self.synthetic;
        r.detail = self.detail.clone();
        r
    }

    /// Decided for `host:port` with `verdict`: the connection's state from
    /// here to the close, carrying the permit.
    pub(crate) fn decided(&self, host: Host, port: u16, verdict: Verdict) -> Conn {
        Conn {
            view: self.view.clone(),
            kind: self.kind,
            mode: self.mode,
            client: self.client,
            host,
            port,
            verdict,
            ip: None,
            synthetic: None,
            pin: None,
            sni: None,
            tunnel: None,
            plan: Plan::PassThrough,
            method: None,
            path: None,
            within: None,
            credential: None,
            detail: None,
            decider: None,
            grant_requests: false,
            owed: None,
            asked: None,
            permit: self.permit.clone(),
            service: None,
            volume: None,
            retry_after: None,
        }
    }
}

/// What to do with an allowed tunnel once its first bytes are known.
#[derive(Debug, Clone)]
pub(crate) enum Plan {
    /// Not intercepted: copy bytes untouched.
    PassThrough,
    /// Terminate TLS and decide each request.
    Intercept(Intercepting),
    /// The rule intercepts but this connection cannot be: deny, fail closed.
    Refuse(&'static str),
}

/// What an intercepted connection is served with.
#[derive(Debug, Clone)]
pub(crate) struct Intercepting {
    pub interceptor: Arc<Interceptor>,
    /// The org whose CA and credentials serve it.
    pub org: OrgRef,
    /// The intercepting allow rule: it decides every request inside.
    pub rule: Arc<str>,
}

/// What a request asked, for a unit that is a request (a forwarded
/// request, a request or a WebSocket handshake inside an intercepted
/// connection): what a reload's policy decides it on again, besides its
/// target ([`super::revoke::revisit`]).
#[derive(Debug, Clone)]
pub(crate) struct Asked {
    pub method: String,
    /// The path as received, without the query.
    pub path: String,
    /// A WebSocket handshake (its relay runs on after it): its rule must
    /// keep `websocket = true`.
    pub websocket: bool,
    /// Inside an intercepted connection: its rule must keep intercepting.
    pub intercepted: bool,
}

/// A connection (a tunnel, a transparent connection) or a forwarded
/// request, decided for one target.
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    /// The policy and org it was decided under.
    pub view: View,
    pub kind: Kind,
    pub mode: Mode,
    pub client: SocketAddr,
    /// The target as decided: the normalised name, or the canonical IP.
    pub host: Host,
    pub port: u16,
    /// The verdict as it stands: an allow can turn into a report (report
    /// mode) or a denial of its own ([`Conn::deny`], [`Conn::refuse`]).
    pub verdict: Verdict,
    /// The address dialled (or tried; transparent: the original destination).
    pub ip: Option<IpAddr>,
    /// The synthetic address connected to, when the target was one: `host`
    /// is then the name bound to it, `ip` the real address dialled.
    pub synthetic: Option<IpAddr>,
    /// The synthetic mapping held (never evicted) while this connection lives.
    pub pin: Option<Arc<crate::handout::synthetic::Pinned>>,
    /// The SNI of the client's ClientHello.
    pub sni: Option<String>,
    /// What the tunnel was verified to carry (or `opaque`).
    pub tunnel: Option<Carry>,
    /// Pass-through or interception, once the first bytes are known.
    pub plan: Plan,
    /// Method and path of a forwarded request.
    pub method: Option<String>,
    pub path: Option<String>,
    /// A request inside an intercepted connection: the connection's
    /// decision record id, and the ids of the credentials added.
    pub within: Option<String>,
    pub credential: Option<String>,
    /// Why it failed after an allow, or the detail of a denial.
    pub detail: Option<String>,
    /// What the decider said of this miss (the record's `decider` field).
    pub decider: Option<Box<crate::decider::Said>>,
    /// Allowed by a grant naming a method or path: intercepted (or
    /// refused), each request inside decided against the grants.
    pub grant_requests: bool,
    /// The room its allow record reserved in the evidence store for its
    /// close record, carried to the close (given back if it ends without
    /// one).
    pub owed: Option<Arc<Owed>>,
    /// A request: what it asked (never recorded; `method` and `path` are).
    pub asked: Option<Asked>,
    /// The connection permit of the link it was decided on: held until
    /// the close.
    pub permit: Option<Arc<Permit>>,
    /// A request under service rules: what it was to its service (boxed:
    /// every tunnel task carries a `Conn`, few carry this).
    pub service: Option<Box<crate::policy::ServiceFacts>>,
    /// The volume budgets it spends from, when its rule or org has one
    /// (`limits::volume`): what its relay charges.
    pub volume: Option<crate::limits::Lease>,
    /// Refused `volume_exceeded`: when the window frees enough (the
    /// client's `Retry-After`).
    pub retry_after: Option<std::time::Duration>,
}

impl Conn {
    /// A target that was a synthetic address: the connection is to the
    /// name it stood for, recorded with the address, holding the mapping.
    pub(crate) fn stood_for(&mut self, stood: Option<&super::decide::StoodFor>) {
        if let Some(s) = stood {
            self.host = Host::Name(s.name.clone());
            self.synthetic = Some(s.addr);
            self.pin = Some(s.pin.clone());
        }
    }

    pub(crate) fn is_allow(&self) -> bool {
        self.verdict.is_allow()
    }

    /// Denied by a check of its own (the first bytes, a name mismatch):
    /// the rule no longer decides and nothing is left to report. `detail`
    /// replaces the one held, if given.
    pub(crate) fn deny(&mut self, reason: Reason, detail: Option<String>) {
        self.refuse(reason, detail);
        self.verdict.would_deny = None;
    }

    /// Refused for a cause outside the policy (a limit, evidence, a host
    /// that cannot be intercepted): the rule no longer decides; what report
    /// mode would have denied stays on record.
    pub(crate) fn refuse(&mut self, reason: Reason, detail: Option<String>) {
        self.verdict.reason = reason;
        self.verdict.rule = None;
        if detail.is_some() {
            self.detail = detail;
        }
    }

    /// Report mode: let through what enforcement would deny `would`; an
    /// earlier `would_deny` (the policy's own) stays first.
    pub(crate) fn report(&mut self, would: Reason, detail: Option<String>) {
        self.verdict.would_deny.get_or_insert(would);
        self.verdict.reason = Reason::ReportOnly;
        if detail.is_some() {
            self.detail = detail;
        }
    }

    /// A request inside this connection (an intercepted one), decided
    /// `verdict` under `view`: the same client, target and permit.
    pub(crate) fn request(&self, view: View, verdict: Verdict) -> Conn {
        let mut link = Link::new(view, self.mode, self.client);
        link.kind = Kind::Http;
        link.permit = self.permit.clone();
        link.decided(self.host.clone(), self.port, verdict)
    }

    /// What the connection's rule lets it carry (no rule, no org: anything).
    pub(crate) fn carry(&self) -> Carry {
        match &self.view.org {
            Some(org) => self.view.policy.carry(
                org,
                self.verdict.rule.as_deref(),
                matches!(self.host, Host::Name(_)),
                self.port,
            ),
            None => Carry::Opaque,
        }
    }

    /// Settle pass-through or interception ([`super::intercepted::plan`]): a
    /// host that must be intercepted but cannot be is refused
    /// `bad_request`.
    pub(crate) fn settle(&mut self, plan: Plan) {
        if let Plan::Refuse(why) = plan {
            self.refuse(Reason::BadRequest, Some(why.to_string()));
        }
        self.plan = plan;
    }

    /// The decision record, as the state stands now.
    pub(crate) fn record(&self) -> Record {
        let mut r = Record::decided(
            self.kind,
            self.mode,
            self.client,
            &self.verdict,
            &self.view.policy,
        );
        r.host = Some(self.host.text());
        r.port = Some(self.port);
        r.ip = self.ip;
        r.synthetic = self.synthetic;
        r.sni = self.sni.clone();
        r.tunnel = self.tunnel;
        r.intercepted = matches!(self.plan, Plan::Intercept(_)).then_some(true);
        r.method = self.method.clone();
        r.path = self.path.clone();
        r.conn = self.within.clone();
        r.credential = self.credential.clone();
        r.detail = self.detail.clone();
        r.decider = self.decider.as_deref().cloned();
        r.service = self.service.as_deref().cloned();
        r
    }

    /// The close record of the decision record written as `id`.
    pub(crate) fn close(&self, id: &str, (up, down): (u64, u64), started: Instant) -> Record {
        // The decision's id goes straight into `conn`: copied once, not
        // set on the decision and copied again by `Record::close`.
        let mut close = self
            .record()
            .close(up, down, started.elapsed().as_millis() as u64);
        close.conn = Some(id.to_string());
        close.owed = self.owed.clone();
        close
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;

    fn conn() -> Conn {
        let src = "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
                   [[org.allow]]\nhost = \"a.test\"\n";
        let config = crate::config::from_str(src, std::path::Path::new("t.toml")).unwrap();
        let policy = Arc::new(Policy::new(&config));
        let org = policy.org_for("198.18.1.2".parse().unwrap());
        let verdict = Verdict {
            org: org.clone(),
            reason: Reason::RuleMatch,
            rule: Some(Arc::from("acme/allow/0")),
            would_deny: Some(Reason::PortNotAllowed),
        };
        let metrics = Arc::new(crate::metrics::Metrics::new(Arc::default()));
        let served = crate::served::Served::load(&config, policy, &metrics).unwrap();
        let view = View {
            served: Arc::new(served),
            org,
            token: None,
        };
        Link::new(view, Mode::Explicit, "198.18.1.2:5000".parse().unwrap()).decided(
            Host::Name("a.test".into()),
            443,
            verdict,
        )
    }

    #[test]
    fn records_follow_the_state() {
        let mut c = conn();
        c.ip = Some("198.18.2.10".parse().unwrap());
        let r = c.record();
        assert_eq!(
            (r.decision_str(), r.reason, r.rule.as_deref()),
            ("allow", Reason::RuleMatch, Some("acme/allow/0"))
        );
        assert_eq!(r.host.as_deref(), Some("a.test"));
        assert_eq!(r.ip, c.ip);
        assert_eq!(r.org.as_deref(), Some("acme"));

        let mut refused = c.clone();
        refused.refuse(Reason::LimitExceeded, Some("over".into()));
        let r = refused.record();
        assert_eq!((r.decision_str(), r.rule.as_deref()), ("deny", None));
        assert_eq!(r.would_deny, Some(Reason::PortNotAllowed));
        assert_eq!(r.detail.as_deref(), Some("over"));

        let mut denied = c.clone();
        denied.deny(Reason::SniMismatch, None);
        let r = denied.record();
        assert_eq!((r.reason, r.would_deny), (Reason::SniMismatch, None));

        let mut reported = c.clone();
        reported.report(Reason::SniMismatch, Some("seen".into()));
        let r = reported.record();
        assert_eq!(r.decision_str(), "allow");
        assert_eq!(r.would_deny, Some(Reason::PortNotAllowed));

        let mut refused = c.clone();
        refused.settle(Plan::Refuse("must carry TLS"));
        assert_eq!(refused.record().reason, Reason::BadRequest);
        assert_eq!(refused.record().intercepted, None);

        let close = c.close("d1", (3, 4), Instant::now());
        assert_eq!(close.conn.as_deref(), Some("d1"));
        assert_eq!((close.bytes_up, close.bytes_down), (Some(3), Some(4)));
        assert_eq!(close.detail, None);
    }
}
