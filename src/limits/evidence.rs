//! The evidence budget: decision records each org may cause per second,
//! proxy and DNS together.

use std::sync::Arc;
use std::time::Instant;

use super::rate::RateLimiter;

/// Detail of a `limit_exceeded` for an allow refused because its org's
/// evidence budget is spent.
pub(crate) const EVIDENCE_BUDGET_EXHAUSTED: &str =
    "evidence budget spent: over [evidence] max_records_per_second_per_org for this org";

/// The evidence budget: decision records each org may cause per second,
/// proxy and DNS together (`[evidence] max_records_per_second_per_org`), a
/// token bucket per org with a burst of one second's worth. Clients of no
/// org share one bucket of the same size, never an org's.
///
/// | record | charged | over the budget |
/// |---|---|---|
/// | an allow decision (connection, absolute-form or intercepted request, DNS answer) | at the decision, before anything flows ([`EvidenceBudget::take`]) | refused `limit_exceeded` (detail [`EVIDENCE_BUDGET_EXHAUSTED`]); the refusal is summarised |
/// | a denial, a DNS refusal | when written ([`EvidenceBudget::take`]) | counted into a summary instead of written one by one |
/// | a summary | when written ([`EvidenceBudget::charge`]) | written anyway (the bucket goes into debt); an org's proxy summaries fold into one |
/// | a close record | never | (at most one per allow) |
///
/// So an org's one-by-one decision records in any `T` seconds are at most
/// `rate * (T + 1)`, whatever it floods with. (A tunnel allowed and then
/// denied on its first bytes pays twice: its allow at the decision, its
/// denial when written. Records of report-mode violations inside a
/// tunnel, which cannot be refused, are not charged.)
#[derive(Debug)]
pub(crate) struct EvidenceBudget {
    buckets: RateLimiter<Option<Arc<str>>>,
}

impl EvidenceBudget {
    /// `per_second` decision records per org (and for clients of no org).
    pub(crate) fn new(per_second: usize) -> EvidenceBudget {
        EvidenceBudget {
            // Orgs come from the config, plus one key for no org.
            buckets: RateLimiter::new(per_second, 65_536),
        }
    }

    /// Take one record of `org`'s budget at `now`, if one is left.
    pub(crate) fn take(&self, org: &Option<Arc<str>>, now: Instant) -> bool {
        self.buckets.allow(org, now)
    }

    /// Charge one record that is written whatever the budget (a summary).
    pub(crate) fn charge(&self, org: &Option<Arc<str>>, now: Instant) {
        self.buckets.charge(org, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_evidence_budget_bounds_each_org_on_its_own() {
        let budget = EvidenceBudget::new(100);
        let (acme, beta): (Option<Arc<str>>, Option<Arc<str>>) =
            (Some(Arc::from("acme")), Some(Arc::from("beta")));
        let t0 = Instant::now();
        // acme floods for ten seconds, ten attempts every 10 ms (a
        // thousand a second): it gets its burst plus its rate, no more.
        let mut taken = 0;
        for step in 0..1000u64 {
            let now = t0 + std::time::Duration::from_millis(step * 10);
            for _ in 0..10 {
                if budget.take(&acme, now) {
                    taken += 1;
                }
            }
        }
        let t_end = 9.99;
        assert!(taken as f64 <= 100.0 * (t_end + 1.0) + 1.0, "{taken}");
        assert!(taken >= 1000, "the rate is granted: {taken}");
        // beta and the clients of no org each have a budget of their own.
        let later = t0 + std::time::Duration::from_millis(9990);
        assert!(budget.take(&beta, later));
        assert!(budget.take(&None, later));
        assert!(!budget.take(&acme, later));
        // Summaries are charged: they push acme into debt, not beta.
        for _ in 0..50 {
            budget.charge(&acme, later);
        }
        assert!(!budget.take(&acme, later + std::time::Duration::from_millis(400)));
        assert!(budget.take(&beta, later));
    }
}
