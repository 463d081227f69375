//! Just-in-time access: a miss held for an approver, and grants that end.
//!
//! - [`approvals`] (pure): the pending approvals of `on_miss = "ask"`
//!   orgs, identical misses sharing one, bounded per org, expiring
//!   unanswered.
//! - [`grants`] (pure): what approvers let through, each with a TTL, a
//!   number of uses, or both.
//! - This module: the shared state ([`Jit`]) and the one miss hook every
//!   decision path calls ([`on_miss`]), the grant records of the evidence
//!   and their replay at start, and the task that ends grants at their
//!   TTL.
//!
//! # Where a grant is consulted
//!
//! Only where a decision would be `no_matching_rule` (a miss: no allow
//! rule names the target, and nothing denied it first). An explicit deny,
//! the baseline, an always-denied address, Palisade's own listeners, a
//! name budget and a volume budget are all decided before that point, so
//! no grant and no approval ever overrides them. A grant for a name is
//! then held to the address checks like any allow rule: a name that
//! resolves into an always-denied range stays denied. `on_miss` answers:
//!
//! | # | condition | outcome |
//! |---|---|---|
//! | 1 | a live grant of the org covers the target and port | allowed, rule `grant:ID` (layer `grant`); a use is spent only once the connection is allowed, address checks and all ([`Jit::spend`]) |
//! | 1b | a `[decider]` is configured | what it said ([`decider::consult`]): allow a grant (used at once), ask rule 2, anything else `no_matching_rule` |
//! | 2 | the org has `on_miss = "ask"` (and enforces) | refused `approval_pending`, the approval made or joined |
//! | 3 | otherwise | `no_matching_rule`, as before |
//!
//! Report-mode orgs never reach it: their misses are let through as
//! `report_only` before any of this.

pub(crate) mod approvals;
mod decider;
pub(crate) mod grants;
pub(crate) mod state;

pub(crate) use grants::Request;
pub(crate) use state::{grant_of, replay, Granted, Jit, Miss, MissFacts, Terms};

use crate::policy::Policy;

/// How often grants are checked for their end: a connection a grant
/// allowed is closed at most this long after the grant ends (plus the
/// time to write its record).
pub(crate) const END_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// The miss hook: what a `no_matching_rule` of `facts` becomes (the
/// table in the module doc). Called from the proxy's decision step and
/// the DNS shim; without a [`Jit`] (`palisade explain`, replay) a miss
/// stays a miss. With a decider, what it said rides along for the
/// record's `decider` field.
pub(crate) async fn on_miss(
    jit: Option<&Jit>,
    policy: &Policy,
    facts: MissFacts<'_>,
) -> (Miss, Option<crate::evidence::said::Said>) {
    let Some(jit) = jit else {
        return (Miss::Denied, None);
    };
    if let Some(granted) = jit.grant_for(&facts) {
        return (Miss::Granted(granted), None);
    }
    if let Some(decider) = jit.decider() {
        let (miss, said) = decider::consult(decider, jit, policy, &facts).await;
        return (miss, Some(said));
    }
    if policy.asks(facts.org) {
        if let Some(a) = jit.ask(&facts) {
            return (Miss::Pending(a), None);
        }
    }
    (Miss::Denied, None)
}
