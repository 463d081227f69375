//! One compiled rule: its id, its ports, and what it says beyond allow or
//! deny, compiled from its config and indexed into the tables.

use std::sync::Arc;
use std::time::SystemTime;

use crate::config::{Carry, NameLimits, PortSet, RequestRules, RuleConfig, RuleTarget, Window};

use super::table::{NameTable, PrefixTable};

#[derive(Debug)]
pub(super) struct Rule {
    pub(super) id: Arc<str>,
    pub(super) ports: PortSet,
    /// Request rules of an intercepting allow rule.
    pub(super) intercept: Option<Arc<RequestRules>>,
    /// What the rule's tunnels carry, when the rule says.
    pub(super) tunnel: Option<Carry>,
    /// A wildcard allow rule: the length of its suffix and the bounds on
    /// the names it lets leave.
    pub(super) below: Option<(usize, NameLimits)>,
    /// The rule's volume budget (allow rules).
    pub(super) volume: Option<crate::config::Volume>,
    /// When a time-bound allow rule matches.
    pub(super) window: Option<Window>,
}

impl Rule {
    /// Does the rule match at `at` (the instant the policy decides at)?
    /// A rule without an interval always does; a time-bound one only
    /// inside it, and never when the instant is unknown.
    pub(super) fn live(&self, at: Option<SystemTime>) -> bool {
        self.window
            .is_none_or(|w| at.is_some_and(|now| w.contains(now)))
    }

    /// Whether every label of `name` left of this wildcard rule's suffix
    /// is within its `max_label_length` (always, for any other rule).
    pub(super) fn label_fits(&self, name: &str) -> bool {
        let Some((suffix, limits)) = self.below else {
            return true;
        };
        let left = name
            .get(..name.len().saturating_sub(suffix + 1))
            .unwrap_or("");
        left.split('.')
            .all(|label| label.len() <= usize::from(limits.max_label_length))
    }
}

/// Compile `rules` into `list`, indexed by name in `names` and by
/// network in `cidrs`.
pub(super) fn compile_rules(
    rules: &[RuleConfig],
    list: &mut Vec<Rule>,
    names: &mut NameTable,
    cidrs: &mut PrefixTable<Vec<usize>>,
) {
    for (i, r) in rules.iter().enumerate() {
        list.push(Rule {
            id: Arc::from(r.id.as_str()),
            ports: r.ports.clone(),
            intercept: r.intercept.clone().map(Arc::new),
            tunnel: r.tunnel,
            below: match &r.target {
                RuleTarget::Below(suffix) => Some((suffix.len(), r.names)),
                _ => None,
            },
            volume: r.volume,
            window: r.window,
        });
        match &r.target {
            RuleTarget::Cidr(net) => cidrs.entry(*net).push(i),
            t => names.insert(t, i),
        }
    }
}

/// Whether `ports` hold `port` (`None`: every port, so only all ports do).
pub(super) fn covers(ports: &PortSet, port: Option<u16>) -> bool {
    match port {
        Some(p) => ports.contains(p),
        None => *ports == PortSet::All,
    }
}
