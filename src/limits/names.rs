//! The budget of new names under wildcard allow rules: per org and rule,
//! how many names not used in the last minute may leave (a DNS query
//! forwarded upstream, a name a connection is decided for). The policy
//! says how many ([`crate::policy::Policy::name_budget`]); this holds who
//! spent what, consulted at the edges (the DNS shim, the proxy's decision
//! step) with the time passed in.
//!
//! The window slides: a name is new when the org has not used it under
//! the rule in the last [`WINDOW`], and in no span of that length does a
//! rule let more than its budget of new names through. A name refused
//! past the budget is not remembered (it is new again when asked again).
//! Memory is bounded: at most [`MAX_NAMES_PER_ORG`] names are remembered
//! per org; a new name over that cap is still counted against the budget,
//! but not remembered, so its next use within the window counts as new
//! again (an org that uses that many names a minute pays more, never
//! less). The times of what was spent are kept at most one per name the
//! budget allows (bounded by the largest budget the config accepts).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;

/// The window names are new in.
pub(crate) const WINDOW: Duration = Duration::from_secs(60);

/// Names remembered per org, across its rules.
pub(crate) const MAX_NAMES_PER_ORG: usize = 4096;

/// What one use of a name under a budgeted rule came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameUse {
    /// Used within the window already: free.
    Seen,
    /// New, within the budget: counted.
    New,
    /// New, past the budget: to be refused (`name_budget_exceeded`).
    Exceeded,
}

impl NameUse {
    /// Whether the name may leave.
    pub(crate) fn is_allowed(self) -> bool {
        self != NameUse::Exceeded
    }
}

/// One rule's window for one org.
#[derive(Default)]
struct Window {
    /// When each counted name was first used, oldest first, and the name
    /// when it is remembered.
    spent: VecDeque<(Instant, Option<Arc<str>>)>,
    seen: HashSet<Arc<str>>,
}

impl Window {
    /// Forget what is older than the window: how many remembered names went.
    fn expire(&mut self, now: Instant) -> usize {
        let mut forgotten = 0;
        while let Some((at, _)) = self.spent.front() {
            if now.saturating_duration_since(*at) < WINDOW {
                break;
            }
            if let Some((_, Some(name))) = self.spent.pop_front() {
                self.seen.remove(&name);
                forgotten += 1;
            }
        }
        forgotten
    }
}

#[derive(Default)]
struct OrgNames {
    /// Names remembered over all of the org's windows.
    remembered: usize,
    rules: HashMap<Arc<str>, Window>,
}

/// Every org's windows, shared by the proxy and the DNS shim so that a
/// name counts once however it leaves.
pub(crate) struct NameBudgets {
    orgs: Mutex<HashMap<Arc<str>, OrgNames>>,
    cap: usize,
    /// `palisade_new_names_total{org, decision}`: `allow` for a new name
    /// within the budget, `deny` for one past it.
    counted: Option<IntCounterVec>,
}

impl NameBudgets {
    /// Budgets remembering at most `cap` names per org, counting into
    /// `counted` when given.
    pub(crate) fn new(cap: usize, counted: Option<IntCounterVec>) -> NameBudgets {
        NameBudgets {
            orgs: Mutex::new(HashMap::new()),
            cap,
            counted,
        }
    }

    /// `org` uses `name` under its rule `rule`, whose budget is `budget`
    /// new names per [`WINDOW`], at `now`.
    pub(crate) fn spend(
        &self,
        org: &Arc<str>,
        rule: &Arc<str>,
        name: &str,
        budget: u32,
        now: Instant,
    ) -> NameUse {
        let mut orgs = self.orgs.lock().unwrap_or_else(|e| e.into_inner());
        let names = orgs.entry(org.clone()).or_default();
        let forgotten: usize = names.rules.values_mut().map(|w| w.expire(now)).sum();
        names.remembered = names.remembered.saturating_sub(forgotten);
        // Windows of rules no longer spent from (a reload removed them)
        // go once empty.
        names
            .rules
            .retain(|id, w| !w.spent.is_empty() || id == rule);
        let window = names.rules.entry(rule.clone()).or_default();
        if window.seen.contains(name) {
            return NameUse::Seen;
        }
        let budget = usize::try_from(budget).unwrap_or(usize::MAX);
        if window.spent.len() >= budget {
            drop(orgs);
            self.count(org, "deny");
            return NameUse::Exceeded;
        }
        let kept = if names.remembered < self.cap {
            let name: Arc<str> = Arc::from(name);
            window.seen.insert(name.clone());
            names.remembered += 1;
            Some(name)
        } else {
            None
        };
        window.spent.push_back((now, kept));
        drop(orgs);
        self.count(org, "allow");
        NameUse::New
    }

    /// A new name of `org` counted under `decision` (`allow` within the
    /// budget, `deny` past it; a seen name is not counted).
    fn count(&self, org: &str, decision: &str) {
        if let Some(counter) = &self.counted {
            counter.with_label_values(&[org, decision]).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> (Arc<str>, Arc<str>, Arc<str>) {
        (Arc::from("acme"), Arc::from("beta"), Arc::from("wild"))
    }

    #[test]
    fn a_budget_of_new_names_per_window_seen_names_free() {
        let (acme, beta, rule) = ids();
        let other: Arc<str> = Arc::from("other");
        let b = NameBudgets::new(MAX_NAMES_PER_ORG, None);
        let t0 = Instant::now();
        let (later, after) = (t0 + Duration::from_secs(59), t0 + WINDOW);
        use NameUse::{Exceeded, New, Seen};
        // (org, rule, name, budget, at, what it comes to), in order.
        let steps = [
            (&acme, &rule, "n0.wild.test", 3, t0, New),
            (&acme, &rule, "n1.wild.test", 3, t0, New),
            (&acme, &rule, "n2.wild.test", 3, t0, New),
            (&acme, &rule, "n3.wild.test", 3, t0, Exceeded),
            // Refused names are not remembered; seen ones stay free.
            (&acme, &rule, "n3.wild.test", 3, t0, Exceeded),
            (&acme, &rule, "n1.wild.test", 3, t0, Seen),
            // Another org, another rule: budgets of their own.
            (&beta, &rule, "n3.wild.test", 3, t0, New),
            (&acme, &other, "x.other.test", 1, t0, New),
            // The window slides: 59 s later still spent, 60 s after the
            // first use room again, and the old names new again.
            (&acme, &rule, "n4.wild.test", 3, later, Exceeded),
            (&acme, &rule, "n4.wild.test", 3, after, New),
            (&acme, &rule, "n0.wild.test", 3, after, New),
        ];
        for (n, (org, rule, name, budget, at, wants)) in steps.into_iter().enumerate() {
            assert_eq!(
                b.spend(org, rule, name, budget, at),
                wants,
                "step {n}: {name}"
            );
        }
    }

    #[test]
    fn over_the_cap_names_count_but_are_not_remembered() {
        let (acme, _, rule) = ids();
        let b = NameBudgets::new(2, None);
        let t0 = Instant::now();
        for n in ["a.w.test", "b.w.test", "c.w.test"] {
            assert_eq!(b.spend(&acme, &rule, n, 10, t0), NameUse::New);
        }
        assert_eq!(b.spend(&acme, &rule, "a.w.test", 10, t0), NameUse::Seen);
        // Not remembered: counted again.
        assert_eq!(b.spend(&acme, &rule, "c.w.test", 10, t0), NameUse::New);
        let orgs = b.orgs.lock().unwrap();
        let names = &orgs[&acme];
        assert_eq!(names.remembered, 2);
        assert_eq!(names.rules[&rule].spent.len(), 4);
    }

    #[test]
    fn new_names_are_counted_allow_and_past_the_budget_deny() {
        let (acme, _, rule) = ids();
        let counter = IntCounterVec::new(
            prometheus::Opts::new("palisade_new_names_total", "t"),
            &["org", "decision"],
        )
        .unwrap();
        let b = NameBudgets::new(8, Some(counter.clone()));
        let t0 = Instant::now();
        assert_eq!(b.spend(&acme, &rule, "a.w.test", 1, t0), NameUse::New);
        assert_eq!(b.spend(&acme, &rule, "a.w.test", 1, t0), NameUse::Seen);
        assert!(!b.spend(&acme, &rule, "b.w.test", 1, t0).is_allowed());
        assert!(!b.spend(&acme, &rule, "c.w.test", 0, t0).is_allowed());
        assert_eq!(counter.with_label_values(&["acme", "allow"]).get(), 1);
        assert_eq!(counter.with_label_values(&["acme", "deny"]).get(), 2);
    }
}
