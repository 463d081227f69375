//! Admission: the one fail-closed ladder every allow climbs after its
//! decision and before anything is dialled or forwarded. Every mode calls
//! [`admit`] on the allowed connection or request: a CONNECT or SOCKS5
//! tunnel ([`super::connect::open`]), an absolute-form request
//! ([`super::explicit`]), a transparent connection ([`super::transparent`])
//! and each request inside an intercepted connection
//! ([`super::intercepted::serve`]).
//!
//! The rungs, in order; the first that fails refuses the allow with its
//! reason (the rule no longer decides: [`Conn::refuse`]):
//!
//! | evidence writable | enforcement ruleset (when required) | org's evidence budget | outcome |
//! |---|---|---|---|
//! | no | any | any (not spent) | refused `evidence_unavailable` |
//! | yes | not loaded | any (not spent) | refused `enforcement_missing`, the ruleset's state as detail |
//! | yes | loaded, or not required | spent (or the org is over its share of a full store) | refused `limit_exceeded`, why as detail |
//! | yes | loaded, or not required | paid | admitted |
//!
//! The budget is paid last, so that an allow refused for another cause
//! spends none of it. Admission takes no decision of the policy's: a
//! denial never reaches it, and report mode's `would_deny` stays on record.
//!
//! Where a new check goes:
//!
//! - A budget the allow spends (the org's volume budget, issue 36): a rung
//!   here, after the evidence budget, refusing `limit_exceeded` with what
//!   is spent as detail. The bytes it counts are counted where they flow:
//!   the tunnel relay ([`super::connect::relay`]) and the forwarded
//!   exchange ([`super::forward`]); a relay cut for a spent budget is
//!   recorded there, like a revocation.
//! - A check of what a request inside an intercepted connection asks (a
//!   service's rules): in that request's decision
//!   ([`super::intercepted::serve`], beside the method and path rules),
//!   before it reaches [`admit`]; it is a decision, not an admission.
//! - A grant (a time-boxed allow): decided with the policy
//!   ([`super::decide`]), then admitted here like any allow; a grant's own
//!   spend (uses, bytes) is a rung here, after the budgets.

use super::conn::Conn;
use super::ctx::Ctx;
use crate::policy::Reason;

/// Why an allow is refused at admission, with what the client and the
/// record may be told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub reason: Reason,
    pub detail: Option<String>,
}

/// Admit the allowed `conn` (the table above): `true`, nothing changed
/// but the org's budget paid; `false`, `conn` is refused with the rung's
/// reason and detail, and its record is to be written as a denial.
#[must_use]
pub(crate) fn admit(ctx: &Ctx, conn: &mut Conn) -> bool {
    match ladder(ctx, conn) {
        Ok(()) => true,
        Err(Refusal { reason, detail }) => {
            conn.refuse(reason, detail);
            false
        }
    }
}

/// The rungs of [`admit`], in order.
fn ladder(ctx: &Ctx, conn: &Conn) -> Result<(), Refusal> {
    if !ctx.evidence.is_healthy() {
        return Err(Refusal {
            reason: Reason::EvidenceUnavailable,
            detail: None,
        });
    }
    if let Some(e) = ctx.enforcement.as_ref().filter(|e| e.refuses()) {
        return Err(Refusal {
            reason: Reason::EnforcementMissing,
            detail: Some(e.refusal_detail()),
        });
    }
    let org = conn.view.org.as_ref().map(|o| o.name.clone());
    if let Err(spent) = ctx.denials.pay_allow(&org) {
        return Err(Refusal {
            reason: Reason::LimitExceeded,
            detail: Some(spent.to_string()),
        });
    }
    Ok(())
}
