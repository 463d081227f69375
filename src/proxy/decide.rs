//! The decision step every mode takes: one [`decide_with`] (the name
//! step, the new-name budget of a wildcard rule, the addresses to check,
//! the address step), shared with `palisade explain`; transparent mode
//! hands it the original destination to check instead of what the name
//! resolves to ([`Addresses::Original`]).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use super::ctx::{Ctx, View};
use crate::evidence::Mode;
use crate::handout::bindings::NameBindings;
use crate::handout::synthetic::{Lookup, Pinned};
use crate::jit::{Jit, Miss, MissFacts};
use crate::limits::NameBudgets;
use crate::policy::{canonical, Decision, OrgRef, PendingName, Policy, Reason, Verdict};
use crate::proto::target::Host;
use crate::resolve::Resolver;

/// A policy decision for one target, with the addresses that may be dialled.
#[derive(Debug, Clone)]
pub(crate) struct Decided {
    pub verdict: Verdict,
    pub dial: Vec<IpAddr>,
    /// Why it was denied without a rule (resolution failed; transparent
    /// mode: a name that does not own the address), for evidence and the
    /// response.
    pub detail: Option<String>,
    /// A target that was a synthetic address: what it stood for. The
    /// decision is the bound name's, `dial` what the name resolved to.
    pub synthetic: Option<Box<StoodFor>>,
    /// What the decider said of this miss (the record's `decider` field).
    pub decider: Option<Box<crate::decider::Said>>,
    /// Allowed by a grant naming a method or path ([`crate::jit::Granted::requests`]):
    /// the tunnel must be intercepted, and each request inside is decided
    /// against the grants (`intercepted::serve`).
    pub grant_requests: bool,
}

/// A synthetic address connected to, the name bound to it for the org,
/// and the mapping held while the connection lives.
#[derive(Debug, Clone)]
pub(crate) struct StoodFor {
    pub addr: IpAddr,
    pub name: String,
    pub pin: Arc<Pinned>,
}

impl Decided {
    /// A denial of `org` for `reason` with `detail`, naming no rule.
    pub(crate) fn denied(org: &OrgRef, reason: Reason, detail: String) -> Decided {
        Decided {
            verdict: Verdict {
                org: Some(org.clone()),
                reason,
                rule: None,
                would_deny: None,
            },
            dial: Vec::new(),
            detail: Some(detail),
            synthetic: None,
            decider: None,
            grant_requests: false,
        }
    }

    /// `synthetic_unbound`: a pool address bound to no name of `org`.
    pub(crate) fn unbound(org: &OrgRef, addr: IpAddr) -> Decided {
        Decided::denied(
            org,
            Reason::SyntheticUnbound,
            format!("synthetic address {addr} is bound to no name of this org (never handed out to it, or evicted)"),
        )
    }

    /// `sni_mismatch` for `org`: the name presented does not own the
    /// address connected to.
    pub(crate) fn mismatch(org: &OrgRef, detail: String) -> Decided {
        Decided::denied(org, Reason::SniMismatch, detail)
    }
}

/// Which addresses an allowed name's address step checks.
#[derive(Clone, Copy)]
pub(crate) enum Addresses<'a> {
    /// What the name resolves to now (explicit, SOCKS5, `palisade explain`).
    Resolved,
    /// Transparent mode: the original destination `ip` (canonical), which
    /// must belong to the name: bound to it for the org by the DNS shim
    /// (`bindings`), else among what the name resolves to now; otherwise
    /// `sni_mismatch`.
    Original {
        ip: IpAddr,
        bindings: Option<&'a dyn NameBindings>,
    },
}

/// Who missed, for the miss hook ([`crate::jit::on_miss`]): the client
/// and its mode, and the state of approvals and grants.
#[derive(Clone, Copy)]
pub(crate) struct Asker<'a> {
    pub jit: &'a Jit,
    pub client: IpAddr,
    pub mode: Mode,
    /// The request that missed, when Palisade sees one (a plain
    /// `http://` request): grants naming a method or path are held to it.
    pub request: Option<crate::jit::Request<'a>>,
    /// A tunnel whose TLS may be intercepted (a CONNECT, SOCKS5), which a
    /// grant naming a method or path may then allow: `Some(true)` when
    /// the org has an interception CA, `Some(false)` when it has none
    /// (such a grant is then refused with why).
    pub intercepts: Option<bool>,
}

impl Ctx {
    /// The miss hook's view of `client` in `mode`.
    pub(crate) fn asker(&self, client: IpAddr, mode: Mode) -> Asker<'_> {
        Asker {
            jit: &self.jit,
            client,
            mode,
            request: None,
            intercepts: None,
        }
    }

    /// [`Ctx::asker`] for a tunnel whose TLS may be intercepted (a
    /// CONNECT, SOCKS5, transparent), under `view`: [`Asker::intercepts`].
    pub(crate) fn tunnel_asker(&self, view: &View, client: IpAddr, mode: Mode) -> Asker<'_> {
        let ca = |org: &OrgRef| {
            view.intercept
                .as_ref()
                .is_some_and(|ic| ic.has_ca(&org.name))
        };
        Asker {
            intercepts: Some(view.org.as_ref().is_some_and(ca)),
            ..self.asker(client, mode)
        }
    }
}

/// [`decide`] of a tunnel (a CONNECT, SOCKS5), timed under `mode`'s
/// label: for modes whose whole decision is this one call. Transparent
/// mode decides in several steps and times them together itself. Its
/// TLS may be intercepted ([`Asker::intercepts`]).
pub(crate) async fn decide_in(
    ctx: &Ctx,
    (mode, client): (Mode, IpAddr),
    view: &View,
    host: &Host,
    port: u16,
) -> Decided {
    decide_asked(ctx, ctx.tunnel_asker(view, client, mode), view, host, port).await
}

/// [`decide_in`] for `asker` (which may carry the request that missed).
pub(crate) async fn decide_asked(
    ctx: &Ctx,
    asker: Asker<'_>,
    view: &View,
    host: &Host,
    port: u16,
) -> Decided {
    let (started, mode) = (std::time::Instant::now(), asker.mode);
    let outcome = crate::otel::step("decide", decide(ctx, asker, view, host, port)).await;
    ctx.metrics.time_decision(mode, started.elapsed());
    outcome
}

/// Decide `host:port` for the view's client: the name step, resolution
/// when the name is allowed, then the address step. Not timed. A
/// synthetic address stands for the name bound to it ([`stood_for`]).
pub(crate) async fn decide(
    ctx: &Ctx,
    asker: Asker<'_>,
    view: &View,
    host: &Host,
    port: u16,
) -> Decided {
    let Some(org) = &view.org else {
        return Decided {
            verdict: Verdict {
                org: None,
                reason: Reason::UnknownClient,
                rule: None,
                would_deny: None,
            },
            dial: Vec::new(),
            detail: None,
            synthetic: None,
            decider: None,
            grant_requests: false,
        };
    };
    if let Host::Ip(ip) = host {
        match stood_for(ctx, org, *ip) {
            Stands::Not => {}
            Stands::Unbound => return Decided::unbound(org, canonical(*ip)),
            Stands::For(stood) => {
                return decide_synthetic(ctx, asker, view, org, stood, port).await
            }
        }
    }
    decide_with(
        &view.policy,
        (&ctx.resolver, Some(&*ctx.names), Some(asker)),
        org,
        (host, port),
        Addresses::Resolved,
    )
    .await
}

/// What an address connected to is, for an org.
pub(crate) enum Stands {
    /// Not a synthetic address.
    Not,
    /// A synthetic address bound to no name of the org.
    Unbound,
    /// A synthetic address bound to a name of the org (now pinned).
    For(StoodFor),
}

/// What `ip` stands for for `org`: a pool address is bound to one of its
/// names (pinned from here on), or to none.
pub(crate) fn stood_for(ctx: &Ctx, org: &OrgRef, ip: IpAddr) -> Stands {
    let Some(pools) = &ctx.synthetic else {
        return Stands::Not;
    };
    let addr = canonical(ip);
    match pools.pin(&org.name, addr) {
        Lookup::NotSynthetic => Stands::Not,
        Lookup::Unbound => Stands::Unbound,
        Lookup::Bound(name, pin) => Stands::For(StoodFor {
            addr,
            name,
            pin: Arc::new(pin),
        }),
    }
}

/// A connection to a synthetic address, decided as one to its bound name
/// for `org` (the same step, budgets and all); only an allowed
/// name is resolved, and what it resolves to is checked and dialled.
pub(crate) async fn decide_synthetic(
    ctx: &Ctx,
    asker: Asker<'_>,
    view: &View,
    org: &OrgRef,
    stood: StoodFor,
    port: u16,
) -> Decided {
    let name = Host::Name(stood.name.clone());
    let mut decided = decide_with(
        &view.policy,
        (&ctx.resolver, Some(&*ctx.names), Some(asker)),
        org,
        (&name, port),
        Addresses::Resolved,
    )
    .await;
    decided.synthetic = Some(Box::new(stood));
    decided
}

/// The decision procedure shared by the proxy and `palisade explain`: the
/// name step; for a name allowed by a wildcard rule, its new-name budget
/// (spent from `names`; `explain` passes none and spends nothing), before
/// anything resolves it; for an allowed name, the addresses of
/// `addresses`; then the address step on them. A miss goes through the
/// miss hook ([`crate::jit::on_miss`], with `asker`; `explain` passes
/// none): a grant decides it as an allow rule would, an `ask` org's miss
/// is refused `approval_pending`.
pub(crate) async fn decide_with(
    policy: &Policy,
    (resolver, names, asker): (&Resolver, Option<&NameBudgets>, Option<Asker<'_>>),
    org: &OrgRef,
    (host, port): (&Host, u16),
    addresses: Addresses<'_>,
) -> Decided {
    let mut grant_requests = false;
    let (decision, said) = match policy.decide_for_org(org, host, port) {
        Decision::Final(v) if v.reason == Reason::NoMatchingRule => {
            // Boxed: the miss hook's state is large (it may ask the
            // decider), and every decision would otherwise carry and move it.
            match Box::pin(missed(policy, asker, org, (host, port))).await {
                (Ok((decision, requests)), said) => {
                    grant_requests = requests;
                    (decision, said)
                }
                (Err(pending), said) => {
                    return Decided {
                        decider: said.map(Box::new),
                        ..pending
                    }
                }
            }
        }
        decision => (decision, None),
    };
    let mut decided = settle(policy, (resolver, names), org, host, addresses, decision).await;
    if let (Some(asker), Some(rule)) = (asker, decided.verdict.rule.clone()) {
        // A grant's use is spent only by a connection it allowed.
        let now = std::time::SystemTime::now();
        let request = asker.request.is_some();
        if decided.verdict.is_allow() && !asker.jit.spend(policy, &rule, request, now) {
            decided = Decided::denied(
                org,
                Reason::NoMatchingRule,
                format!("{rule} ended (its last use taken) before this connection"),
            );
        }
    }
    decided.decider = said.map(Box::new);
    decided.grant_requests = grant_requests && decided.verdict.is_allow();
    decided
}

/// A decision taken to its end: a name resolved (its budget spent) and
/// its addresses checked.
async fn settle(
    policy: &Policy,
    (resolver, names): (&Resolver, Option<&NameBudgets>),
    org: &OrgRef,
    host: &Host,
    addresses: Addresses<'_>,
    decision: Decision,
) -> Decided {
    match decision {
        Decision::Final(verdict) => {
            let dial = match host {
                Host::Ip(ip) if verdict.is_allow() => vec![*ip],
                _ => Vec::new(),
            };
            Decided {
                verdict,
                dial,
                detail: None,
                synthetic: None,
                decider: None,
                grant_requests: false,
            }
        }
        Decision::Resolve(mut pending) => {
            // The policy asks to resolve names only; anything else fails closed.
            let Host::Name(name) = host else {
                return Decided {
                    verdict: Verdict {
                        org: Some(org.clone()),
                        reason: Reason::BadRequest,
                        rule: None,
                        would_deny: None,
                    },
                    dial: Vec::new(),
                    detail: Some("internal: resolve asked for an address".into()),
                    synthetic: None,
                    decider: None,
                    grant_requests: false,
                };
            };
            if let Err(spent) = spend_name(policy, names, &mut pending, name) {
                return spent;
            }
            let resolution_failed = |e: String| Decided {
                verdict: Verdict {
                    org: Some(org.clone()),
                    reason: Reason::ResolutionFailed,
                    rule: pending.rule.clone(),
                    would_deny: None,
                },
                dial: Vec::new(),
                detail: Some(e),
                synthetic: None,
                decider: None,
                grant_requests: false,
            };
            let addrs = match addresses {
                Addresses::Resolved => {
                    match crate::otel::step("resolve", resolver.lookup(name)).await {
                        Ok(addrs) => addrs,
                        Err(e) => return resolution_failed(e.to_string()),
                    }
                }
                Addresses::Original { ip, bindings } => {
                    let bound =
                        bindings.is_some_and(|b| b.is_bound(&org.name, name, ip, Instant::now()));
                    if !bound {
                        match crate::otel::step("resolve", resolver.lookup(name)).await {
                            Ok(addrs) if addrs.iter().any(|a| canonical(*a) == ip) => {}
                            Ok(_) => {
                                return Decided::mismatch(
                                    org,
                                    format!("{name} does not resolve to {ip}"),
                                )
                            }
                            Err(e) => return resolution_failed(e.to_string()),
                        }
                    }
                    vec![ip]
                }
            };
            let av = policy.check_addresses(&pending, &addrs);
            Decided {
                verdict: av.verdict,
                dial: av.dial,
                detail: None,
                synthetic: None,
                decider: None,
                grant_requests: false,
            }
        }
    }
}

/// A miss through the miss hook: still the miss, a grant's allow (an
/// address at once, a name on to its addresses; `true` when the grant
/// names a method or path, so the tunnel must be intercepted), or
/// (`Err`) the `approval_pending` refusal, or the refusal of such a
/// grant for an org without an interception CA; with what the decider
/// said, if asked.
async fn missed(
    policy: &Policy,
    asker: Option<Asker<'_>>,
    org: &OrgRef,
    (host, port): (&Host, u16),
) -> (
    Result<(Decision, bool), Decided>,
    Option<crate::decider::Said>,
) {
    let miss = Decision::Final(Verdict::denied_for(org, Reason::NoMatchingRule));
    let Some(asker) = asker else {
        return (Ok((miss, false)), None);
    };
    let facts = MissFacts {
        org,
        client: asker.client,
        host,
        port: Some(port),
        request: asker.request,
        intercepts: asker.intercepts.is_some(),
        mode: asker.mode,
        now: std::time::SystemTime::now(),
    };
    let (outcome, said) = crate::jit::on_miss(Some(asker.jit), policy, facts).await;
    let decision = match outcome {
        Miss::Denied => Ok((miss, false)),
        Miss::Pending(approval) => Err(Decided::denied(
            org,
            Reason::ApprovalPending,
            Miss::pending_detail(&approval),
        )),
        Miss::Granted(crate::jit::Granted {
            rule,
            requests: Some(requests),
        }) if asker.intercepts != Some(true) => Err(Decided::denied(
            org,
            Reason::NoMatchingRule,
            format!(
                "{rule} allows only requests ({requests}), which inside TLS need interception, \
                 and org {} has no interception CA (an org has one once an allow rule of it \
                 intercepts)",
                org.name
            ),
        )),
        Miss::Granted(g) => Ok((
            match host {
                Host::Ip(_) => Decision::Final(Verdict {
                    org: Some(org.clone()),
                    reason: Reason::RuleMatch,
                    rule: Some(g.rule),
                    would_deny: None,
                }),
                Host::Name(_) => Decision::Resolve(PendingName {
                    org: org.clone(),
                    rule: Some(g.rule),
                    port,
                    would_deny: None,
                }),
            },
            g.requests.is_some(),
        )),
    };
    (decision, said)
}

/// A name allowed by a wildcard rule with a budget, before it leaves: free
/// when seen in the window, counted when new, and past the budget
/// `name_budget_exceeded` (report mode: let through, with that as its
/// `would_deny`).
fn spend_name(
    policy: &Policy,
    names: Option<&NameBudgets>,
    pending: &mut PendingName,
    name: &str,
) -> Result<(), Decided> {
    let (Some(names), Some(rule), None) = (names, &pending.rule, pending.would_deny) else {
        return Ok(());
    };
    let Some(budget) = policy.name_budget(&pending.org, rule) else {
        return Ok(());
    };
    if names
        .spend(&pending.org.name, rule, name, budget, Instant::now())
        .is_allowed()
    {
        return Ok(());
    }
    if policy.is_report(&pending.org) {
        pending.would_deny = Some(Reason::NameBudgetExceeded);
        return Ok(());
    }
    Err(Decided {
        verdict: Verdict {
            org: Some(pending.org.clone()),
            reason: Reason::NameBudgetExceeded,
            rule: Some(rule.clone()),
            would_deny: None,
        },
        dial: Vec::new(),
        detail: Some(format!(
            "{budget} new names a minute under this rule already used"
        )),
        synthetic: None,
        decider: None,
        grant_requests: false,
    })
}

/// A request inside a tunnel that a grant naming a method or path let
/// through (intercepted, [`Decided::grant_requests`]), decided as the
/// miss of a plain `http://` request is ([`missed`] with `asker`'s
/// request): a live grant covering it allows it (rule `grant:ID`, a use
/// spent); on an `ask` org it is refused `approval_pending`, with an
/// approval of its own; otherwise `no_matching_rule`. With the detail of
/// a refusal and what the decider said, if asked. Its address was checked
/// when the tunnel was decided.
pub(crate) async fn decide_granted_request(
    policy: &Policy,
    asker: Asker<'_>,
    org: &OrgRef,
    (host, port): (&Host, u16),
) -> (Verdict, Option<String>, Option<crate::decider::Said>) {
    let shown = asker
        .request
        .map(|r| format!("{} {}", r.method, r.path.as_str()))
        .unwrap_or_default();
    let (outcome, said) = missed(policy, Some(asker), org, (host, port)).await;
    let verdict = match outcome {
        Err(refused) => return (refused.verdict, refused.detail, said),
        Ok((Decision::Final(v), _)) => v,
        Ok((Decision::Resolve(pending), _)) => Verdict {
            org: Some(org.clone()),
            reason: Reason::RuleMatch,
            rule: pending.rule,
            would_deny: None,
        },
    };
    let Some(rule) = verdict.rule.clone().filter(|_| verdict.is_allow()) else {
        let detail = format!(
            "{shown} to {host}:{port}: no grant of org {} covers it",
            org.name
        );
        return (verdict, Some(detail), said);
    };
    if !asker
        .jit
        .spend(policy, &rule, true, std::time::SystemTime::now())
    {
        let detail = format!("{rule} ended (its last use taken) before this request");
        let verdict = Verdict::denied_for(org, Reason::NoMatchingRule);
        return (verdict, Some(detail), said);
    }
    (verdict, None, said)
}
