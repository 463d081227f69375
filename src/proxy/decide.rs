//! The decision step every mode takes: one [`decide_with`] (the name
//! step, the new-name budget of a wildcard rule, the addresses to check,
//! the address step), shared with `palisade explain`; transparent mode
//! hands it the original destination to check instead of what the name
//! resolves to ([`Addresses::Original`]).

use std::net::IpAddr;
use std::time::Instant;

use super::ctx::{Ctx, View};
use crate::bindings::NameBindings;
use crate::evidence::Mode;
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
}

impl Decided {
    /// `sni_mismatch` for `org`: the name presented does not own the
    /// address connected to.
    pub(crate) fn mismatch(org: &OrgRef, detail: String) -> Decided {
        Decided {
            verdict: Verdict {
                org: Some(org.clone()),
                reason: Reason::SniMismatch,
                rule: None,
                would_deny: None,
            },
            dial: Vec::new(),
            detail: Some(detail),
        }
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

impl Ctx {
    /// [`Ctx::decide`], timed under `mode`'s label: for modes whose whole
    /// decision is this one call (explicit, SOCKS5). Transparent mode
    /// decides in several steps and times them together itself.
    pub(crate) async fn decide_in(
        &self,
        mode: Mode,
        view: &View,
        host: &Host,
        port: u16,
    ) -> Decided {
        let started = std::time::Instant::now();
        let outcome = self.decide(view, host, port).await;
        self.metrics.time_decision(mode, started.elapsed());
        outcome
    }

    /// Decide `host:port` for the view's client: the name step, resolution
    /// when the name is allowed, then the address step. Not timed.
    pub(crate) async fn decide(&self, view: &View, host: &Host, port: u16) -> Decided {
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
            };
        };
        decide_with(
            &view.policy,
            (&self.resolver, Some(&*self.names)),
            org,
            (host, port),
            Addresses::Resolved,
        )
        .await
    }
}

/// The decision procedure shared by the proxy and `palisade explain`: the
/// name step; for a name allowed by a wildcard rule, its new-name budget
/// (spent from `names`; `explain` passes none and spends nothing), before
/// anything resolves it; for an allowed name, the addresses of
/// `addresses`; then the address step on them.
pub(crate) async fn decide_with(
    policy: &Policy,
    (resolver, names): (&Resolver, Option<&NameBudgets>),
    org: &OrgRef,
    (host, port): (&Host, u16),
    addresses: Addresses<'_>,
) -> Decided {
    match policy.decide_for_org(org, host, port) {
        Decision::Final(verdict) => {
            let dial = match host {
                Host::Ip(ip) if verdict.is_allow() => vec![*ip],
                _ => Vec::new(),
            };
            Decided {
                verdict,
                dial,
                detail: None,
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
            };
            let addrs = match addresses {
                Addresses::Resolved => match resolver.lookup(name).await {
                    Ok(addrs) => addrs,
                    Err(e) => return resolution_failed(e.to_string()),
                },
                Addresses::Original { ip, bindings } => {
                    let bound = bindings.is_some_and(|b| b.is_bound(&org.name, name, ip));
                    if !bound {
                        match resolver.lookup(name).await {
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
            }
        }
    }
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
    })
}
