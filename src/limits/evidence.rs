//! The evidence budget: decision records each org may cause per second,
//! proxy and DNS together.

use std::sync::Arc;
use std::time::Instant;

use super::rate::{OrgLimiter, RateLimiter};
use crate::evidence::Live;

/// Detail of a `limit_exceeded` for an allow refused because its org's
/// evidence budget is spent.
pub(crate) const EVIDENCE_BUDGET_EXHAUSTED: &str =
    "evidence budget spent: over [evidence] max_records_per_second_per_org for this org";

/// Detail of a `limit_exceeded` for an allow refused because the evidence
/// store is full and its org holds more than its share of it.
pub(crate) const EVIDENCE_STORE_FULL: &str = "evidence store full for this org";

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
/// | a close record | never (its room in the store is reserved when its allow is written) | (at most one per allow) |
///
/// While the evidence store is full ([`crate::evidence::store`]: free
/// space accounted per write, a disk with none free the fullest case), an
/// org (or the clients of no org) whose records, written and owed (the
/// closes of its open connections), hold more than its share of the store
/// is treated as if its budget were spent, whatever is left of it: its
/// allows are refused (detail [`EVIDENCE_STORE_FULL`]) and its denials
/// summarised. Orgs within their share go on as before.
///
/// So an org's one-by-one decision records in any `T` seconds are at most
/// `rate * (T + 1)`, whatever it floods with. (A tunnel allowed and then
/// denied on its first bytes pays twice: its allow at the decision, its
/// denial when written. Records of report-mode violations inside a
/// tunnel, which cannot be refused, are not charged.)
#[derive(Debug)]
pub(crate) struct EvidenceBudget {
    buckets: OrgLimiter<Option<Arc<str>>>,
    /// The evidence as it runs: whether the store is full, and who
    /// fills it.
    store: Option<Arc<Live>>,
}

impl EvidenceBudget {
    /// `per_second` decision records per org (and for clients of no org).
    pub(crate) fn new(per_second: usize) -> EvidenceBudget {
        EvidenceBudget {
            // Orgs come from the config, plus one key for no org.
            buckets: RateLimiter::new(per_second, 65_536),
            store: None,
        }
    }

    /// Refuse the orgs over their share of a full store, as `live`
    /// (the evidence writer's) tell.
    pub(crate) fn with_store(mut self, live: Arc<Live>) -> EvidenceBudget {
        self.store = Some(live);
        self
    }

    /// Whether `org` holds more than its share of a full store.
    fn over_share(&self, org: &Option<Arc<str>>) -> bool {
        self.store
            .as_ref()
            .is_some_and(|c| c.store().over_share(org))
    }

    /// Take one record of `org`'s budget at `now`, if one is left (and the
    /// org is not over its share of a full store).
    pub(crate) fn take(&self, org: &Option<Arc<str>>, now: Instant) -> bool {
        !self.over_share(org) && self.buckets.allow(org, now)
    }

    /// Pay for an allow's record of `org` at `now`; `Err` with the detail
    /// to refuse it `limit_exceeded` with: [`EVIDENCE_STORE_FULL`] when the
    /// org is over its share of a full store, [`EVIDENCE_BUDGET_EXHAUSTED`]
    /// when its budget is spent.
    pub(crate) fn take_allow(
        &self,
        org: &Option<Arc<str>>,
        now: Instant,
    ) -> Result<(), &'static str> {
        if self.over_share(org) {
            return Err(EVIDENCE_STORE_FULL);
        }
        if self.buckets.allow(org, now) {
            Ok(())
        } else {
            Err(EVIDENCE_BUDGET_EXHAUSTED)
        }
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

    #[test]
    fn an_org_over_its_share_of_a_full_store_is_refused_and_others_are_not() {
        let live: Arc<Live> = Arc::default();
        let budget = EvidenceBudget::new(1000).with_store(live.clone());
        let (acme, beta): (Option<Arc<str>>, Option<Arc<str>>) =
            (Some(Arc::from("acme")), Some(Arc::from("beta")));
        let now = Instant::now();
        live.store().count_payers(|| 3);
        live.store().add(
            &[(acme.clone(), 9000), (beta.clone(), 1000)]
                .into_iter()
                .collect(),
        );
        assert_eq!(budget.take_allow(&acme, now), Ok(()), "not full yet");
        live.store().set_floor(true);
        assert_eq!(budget.take_allow(&acme, now), Err(EVIDENCE_STORE_FULL));
        assert!(!budget.take(&acme, now), "its denials are summarised");
        assert_eq!(budget.take_allow(&beta, now), Ok(()));
        assert_eq!(budget.take_allow(&None, now), Ok(()));
        live.store().set_floor(false);
        assert_eq!(budget.take_allow(&acme, now), Ok(()));
        // A spent budget still says so.
        let small = EvidenceBudget::new(1);
        assert_eq!(small.take_allow(&acme, now), Ok(()));
        assert_eq!(small.take_allow(&acme, now), Err(EVIDENCE_BUDGET_EXHAUSTED));
    }
}
