//! Containment of an org allow rule in the baseline's ceiling: a pure
//! proof by rule shape, decided before the policy is compiled.
//!
//! # Truth table
//!
//! A rule lies inside a ceiling entry when all three columns hold; the
//! first that fails is the reason it escapes.
//!
//! | rule target | ceiling target | target holds when |
//! |---|---|---|
//! | `host = "a.b.c"` | `host = "a.b.c"` | the names are equal |
//! | `host = "a.b.c"` | `host = "*.b.c"` | the name is strictly below the suffix |
//! | `host = "*.b.c"` | `host = "*.b.c"` or `host = "*.c"` | the suffix is equal to or strictly below the ceiling's suffix |
//! | `host = "*.b.c"` | `host = "b.c"` (exact) | never: the wildcard names more than one name |
//! | `cidr = N` | `cidr = M` | N lies inside M (same family; N = M included) |
//! | a host | a cidr, or a cidr | a host | never: a name is not an address |
//!
//! | rule ports | ceiling ports | ports hold when |
//! |---|---|---|
//! | a list | a list | every port of the rule is in the ceiling's |
//! | a list | all (ceiling without `ports`) | always |
//! | all (only an org deny rule has that) | a list | never |
//!
//! | rule | ceiling | interception holds when |
//! |---|---|---|
//! | `intercept = true` | `intercept = true` | always |
//! | `intercept = true` | without `intercept` | never |
//! | not intercepting | either | always |
//!
//! A rule is inside the ceiling when it lies inside at least one entry.
//! A baseline without `[[ceiling]]` entries sets no ceiling.

use std::fmt;

use super::model::{CeilingEntry, PortSet, RuleConfig, RuleTarget};

/// Why a rule is not inside a ceiling entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Escape {
    /// The rule's target is not inside the entry's.
    Target,
    /// These ports of the rule are not the entry's (empty: the rule
    /// covers every port and the entry does not).
    Ports(Vec<u16>),
    /// The rule intercepts and the entry does not allow interception.
    Intercept,
}

impl fmt::Display for Escape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Escape::Target => f.write_str("its target is not inside it"),
            Escape::Ports(ports) if ports.is_empty() => {
                f.write_str("it covers every port and the ceiling does not")
            }
            Escape::Ports(ports) => {
                let list: Vec<String> = ports.iter().map(u16::to_string).collect();
                write!(f, "port {} is not among its ports", list.join(", "))
            }
            Escape::Intercept => {
                f.write_str("it intercepts and the ceiling has no intercept = true")
            }
        }
    }
}

/// Whether `name`, a normalised name, is strictly below `suffix`.
fn strictly_below(name: &str, suffix: &str) -> bool {
    name.len() > suffix.len() + 1
        && name.ends_with(suffix)
        && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
}

/// Whether target `rule` names nothing that `ceiling` does not.
pub(super) fn target_inside(rule: &RuleTarget, ceiling: &RuleTarget) -> bool {
    match (rule, ceiling) {
        (RuleTarget::Exact(n), RuleTarget::Exact(m)) => n == m,
        (RuleTarget::Exact(n), RuleTarget::Below(s)) => strictly_below(n, s),
        (RuleTarget::Below(n), RuleTarget::Below(s)) => n == s || strictly_below(n, s),
        (RuleTarget::Below(_), RuleTarget::Exact(_)) => false,
        (RuleTarget::Cidr(n), RuleTarget::Cidr(m)) => m.contains(n),
        (RuleTarget::Cidr(_), _) | (_, RuleTarget::Cidr(_)) => false,
    }
}

/// The ports of `rule` that `ceiling` lacks: `None` if there are none.
fn ports_outside(rule: &PortSet, ceiling: &PortSet) -> Option<Vec<u16>> {
    match (rule, ceiling) {
        (_, PortSet::All) => None,
        (PortSet::All, PortSet::List(_)) => Some(Vec::new()),
        (PortSet::List(r), PortSet::List(c)) => {
            let out: Vec<u16> = r.iter().copied().filter(|p| !c.contains(p)).collect();
            (!out.is_empty()).then_some(out)
        }
    }
}

/// Whether `rule` lies inside `entry` (the three tables above), or why not.
pub(super) fn contained(rule: &RuleConfig, entry: &CeilingEntry) -> Result<(), Escape> {
    if !target_inside(&rule.target, &entry.target) {
        return Err(Escape::Target);
    }
    if let Some(ports) = ports_outside(&rule.ports, &entry.ports) {
        return Err(Escape::Ports(ports));
    }
    if rule.intercept.is_some() && !entry.intercept {
        return Err(Escape::Intercept);
    }
    Ok(())
}

/// Whether `rule` is inside the ceiling `entries`: `Ok` with the entry
/// that holds it, or the entry it comes closest to (the first whose
/// target holds it, else the first entry of the same kind, name or
/// address, else the first) and why it escapes that one. `Ok(None)`:
/// there is no ceiling.
pub(super) fn check<'a>(
    rule: &RuleConfig,
    entries: &'a [CeilingEntry],
) -> Result<Option<&'a CeilingEntry>, (&'a CeilingEntry, Escape)> {
    let Some(first) = entries.first() else {
        return Ok(None);
    };
    let mut closest: Option<(&CeilingEntry, Escape)> = None;
    for entry in entries {
        match contained(rule, entry) {
            Ok(()) => return Ok(Some(entry)),
            Err(Escape::Target) => {}
            Err(why) => {
                closest.get_or_insert((entry, why));
            }
        }
    }
    let is_cidr = |t: &RuleTarget| matches!(t, RuleTarget::Cidr(_));
    Err(closest.unwrap_or_else(|| {
        let same = entries
            .iter()
            .find(|e| is_cidr(&e.target) == is_cidr(&rule.target));
        (same.unwrap_or(first), Escape::Target)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::model::{NameLimits, RequestRules};

    fn target(text: &str) -> RuleTarget {
        if let Some(s) = text.strip_prefix("*.") {
            RuleTarget::Below(s.to_string())
        } else if text.contains('/') {
            RuleTarget::Cidr(text.parse().unwrap())
        } else {
            RuleTarget::Exact(text.to_string())
        }
    }

    fn ports(list: &[u16]) -> PortSet {
        if list.is_empty() {
            PortSet::All
        } else {
            PortSet::List(list.to_vec())
        }
    }

    fn rule(t: &str, p: &[u16], intercept: bool) -> RuleConfig {
        RuleConfig {
            id: "r".into(),
            target: target(t),
            ports: ports(p),
            intercept: intercept.then(RequestRules::default),
            tunnel: None,
            names: NameLimits::default(),
            volume: None,
            window: None,
        }
    }

    fn entry(t: &str, p: &[u16], intercept: bool) -> CeilingEntry {
        CeilingEntry {
            id: "c".into(),
            target: target(t),
            ports: ports(p),
            intercept,
        }
    }

    #[test]
    fn target_truth_table() {
        let table = [
            ("a.example.com", "a.example.com", true),
            ("a.example.com", "b.example.com", false),
            ("a.example.com", "*.example.com", true),
            ("x.a.example.com", "*.example.com", true),
            ("example.com", "*.example.com", false),
            ("badexample.com", "*.example.com", false),
            ("a.example.com.evil", "*.example.com", false),
            ("*.example.com", "*.example.com", true),
            ("*.a.example.com", "*.example.com", true),
            ("*.badexample.com", "*.example.com", false),
            ("*.com", "*.example.com", false),
            ("*.example.com", "example.com", false),
            ("*.a.example.com", "a.example.com", false),
            ("198.18.7.0/24", "198.18.0.0/15", true),
            ("198.18.0.0/15", "198.18.0.0/15", true),
            ("198.18.0.0/14", "198.18.0.0/15", false),
            ("198.20.0.0/24", "198.18.0.0/15", false),
            ("2001:db8::/48", "2001:db8::/32", true),
            ("2001:db8::/32", "2001:db8::/48", false),
            ("0.0.0.0/0", "::/0", false),
            ("::/0", "0.0.0.0/0", false),
            ("a.example.com", "198.18.0.0/15", false),
            ("198.18.0.0/24", "*.example.com", false),
        ];
        for (r, c, want) in table {
            assert_eq!(target_inside(&target(r), &target(c)), want, "{r} in {c}");
        }
    }

    #[test]
    fn ports_truth_table() {
        // (rule ports, ceiling ports; empty = all, escaping ports)
        type Row = (&'static [u16], &'static [u16], Option<Vec<u16>>);
        let table: [Row; 7] = [
            (&[443], &[443], None),
            (&[443], &[80, 443], None),
            (&[80, 443], &[443], Some(vec![80])),
            (&[22, 80, 443], &[443], Some(vec![22, 80])),
            (&[443], &[], None),
            (&[], &[], None),
            (&[], &[443], Some(vec![])),
        ];
        for (r, c, want) in table {
            assert_eq!(ports_outside(&ports(r), &ports(c)), want, "{r:?} in {c:?}");
        }
    }

    #[test]
    fn interception_truth_table() {
        for (rule_intercepts, ceiling_allows, want) in [
            (true, true, Ok(())),
            (true, false, Err(Escape::Intercept)),
            (false, true, Ok(())),
            (false, false, Ok(())),
        ] {
            let r = rule("api.example.com", &[443], rule_intercepts);
            let c = entry("*.example.com", &[443], ceiling_allows);
            assert_eq!(
                contained(&r, &c),
                want,
                "{rule_intercepts} {ceiling_allows}"
            );
        }
    }

    #[test]
    fn the_first_failing_column_is_the_reason() {
        let c = entry("*.example.com", &[443], false);
        let cases = [
            (rule("evil.test", &[22], true), Escape::Target),
            (rule("a.example.com", &[22], true), Escape::Ports(vec![22])),
            (rule("a.example.com", &[443], true), Escape::Intercept),
        ];
        for (r, want) in cases {
            assert_eq!(contained(&r, &c), Err(want));
        }
    }

    #[test]
    fn a_rule_is_inside_when_one_entry_holds_it_and_names_the_closest_otherwise() {
        let entries = [
            entry("198.18.0.0/15", &[], false),
            entry("*.example.com", &[443], false),
            entry("git.example.com", &[22, 443], true),
        ];
        let held = check(&rule("git.example.com", &[22], true), &entries).unwrap();
        assert_eq!(held.unwrap().target, target("git.example.com"));
        // Inside the wildcard by name, but port 22 is not its.
        let (e, why) = check(&rule("a.example.com", &[22], false), &entries).unwrap_err();
        assert_eq!(
            (&e.target, why),
            (&target("*.example.com"), Escape::Ports(vec![22]))
        );
        // No entry holds the name: the first name entry is named.
        let (e, why) = check(&rule("evil.test", &[443], false), &entries).unwrap_err();
        assert_eq!((&e.target, why), (&target("*.example.com"), Escape::Target));
        // An address rule against the address entry.
        let (e, why) = check(&rule("203.0.113.0/24", &[443], false), &entries).unwrap_err();
        assert_eq!((&e.target, why), (&target("198.18.0.0/15"), Escape::Target));
        // No entries: no ceiling.
        assert_eq!(check(&rule("evil.test", &[443], true), &[]), Ok(None));
    }
}
