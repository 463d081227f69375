//! The DNS shim's decision for one query: pure, no I/O, no clock. The name
//! question is the policy's ([`Policy::decide_name_any_port`]); this adds
//! what only DNS has: special-use names, query types and reverse lookups.
//!
//! # Truth table
//!
//! Checks run top to bottom; the first row that applies decides. "Denied"
//! means the org's `dns_denied` answer: REFUSED (default) or NXDOMAIN, both
//! with an Extended DNS Error 15 "Blocked" carrying the evidence record id.
//!
//! | # | condition | answer | reason | upstream |
//! |---|---|---|---|---|
//! | 1 | client in no org | REFUSED | `unknown_client` | no |
//! | 2 | name is not a valid host name (root, bad characters, an IP spelling) | denied | `bad_request` | no |
//! | 3 | `use-application-dns.net` | NXDOMAIN | `special_name` | no |
//! | 4 | `_dns.resolver.arpa` | NODATA | `special_name` | no |
//! | 5 | PTR in `in-addr.arpa` / `ip6.arpa` | from the org's bindings, else denied | `rule_match` / `no_matching_rule` | no |
//! | 6 | the org may not reach the name on any port | denied | policy reason | no |
//! | 7 | a never-forwarded special-use name (`localhost`, `.local`, `.invalid`, `.onion`, `home.arpa`, reverse zones) | NXDOMAIN | `special_name` | no |
//! | 8 | ANY | RFC 8482 HINFO | `rule_match` | no |
//! | 9 | A, AAAA, CNAME, HTTPS, SVCB, or a type in the org's `dns_types`, and the name is new to the org past its wildcard rule's `max_new_names_per_minute` ([`past_budget`], the state kept at the edge in `limits::names`) | REFUSED | `name_budget_exceeded` | no |
//! | 9a | the org has `dns_answers = "synthetic"`: A, AAAA | an address of the synthetic pool bound to (org, name) ([`crate::handout::synthetic`]), TTL 10 s; NODATA without a pool of the family | `rule_match` | no |
//! | 9b | the org has `dns_answers = "synthetic"`: CNAME, HTTPS, SVCB, a type in `dns_types` | NODATA | `rule_match` | no |
//! | 10 | A, AAAA, CNAME, HTTPS, SVCB, or a type in the org's `dns_types` | forwarded, answers filtered | `rule_match` | yes |
//! | 11 | any other type | REFUSED | `qtype_not_allowed` | no |
//!
//! Rows 9a-9b come before the budget of row 9: a synthetic answer lets no
//! name leave, so it spends nothing; the connection to the address does
//! (its decision spends the name as any connection's does).
//!
//! A label longer than a wildcard rule's `max_label_length` is the
//! policy's denial at row 6 (`name_budget_exceeded`, with the org's
//! `dns_denied` answer). Report-mode orgs are let through past both,
//! recorded with `would_deny = "name_budget_exceeded"`.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use hickory_server::proto::rr::RecordType;

use crate::config::DnsDenied;
use crate::handout::synthetic::Family;
use crate::limits::NameUse;
use crate::policy::{Policy, Reason, Verdict};
use crate::proto::target::{normalize_host, Host};
pub(crate) use crate::served::OrgDns;

/// Types answered for every allowed name.
pub(crate) const DEFAULT_TYPES: [RecordType; 5] = [
    RecordType::A,
    RecordType::AAAA,
    RecordType::CNAME,
    RecordType::HTTPS,
    RecordType::SVCB,
];

/// Answered NXDOMAIN for every known client: browsers take it as "this
/// network does not want DNS-over-HTTPS" (Mozilla's canary domain).
pub(crate) const DOH_CANARY: &str = "use-application-dns.net";
/// Discovery of designated resolvers (RFC 9462): NODATA, nothing to discover.
pub(crate) const DDR_NAME: &str = "_dns.resolver.arpa";

/// Names (and everything below them) never forwarded, even when a rule allows them.
const NEVER_FORWARDED: [&str; 7] = [
    "localhost",
    "local",
    "invalid",
    "onion",
    "home.arpa",
    "in-addr.arpa",
    "ip6.arpa",
];

/// What to do with a query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// REFUSED, with EDE 15 "Blocked" (unknown client, type not enabled).
    Refuse,
    /// The org's answer to a denied name.
    Denied(DnsDenied),
    /// NXDOMAIN, answered here.
    NxDomain,
    /// NOERROR with no answers, answered here.
    NoData,
    /// RFC 8482 minimal answer to ANY.
    AnyHinfo,
    /// Answer from the org's bindings for this address (PTR).
    Ptr(IpAddr),
    /// Resolve upstream and filter the answers.
    Forward,
    /// An org with synthetic answers: an address of the pool of this
    /// family bound to (org, name), nothing resolved.
    Synthetic(Family),
}

/// The decision for one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QueryDecision {
    pub verdict: Verdict,
    pub action: Action,
    /// The normalised name, when the query name is one.
    pub name: Option<String>,
}

impl Action {
    /// How `explain` and the docs describe the answer.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            Action::Refuse => "REFUSED (EDE 15 Blocked), nothing sent upstream",
            Action::Denied(DnsDenied::Refused) => "REFUSED (EDE 15 Blocked), nothing sent upstream",
            Action::Denied(DnsDenied::Nxdomain) => {
                "NXDOMAIN (EDE 15 Blocked), nothing sent upstream"
            }
            Action::NxDomain => "NXDOMAIN, answered locally",
            Action::NoData => "NODATA, answered locally",
            Action::AnyHinfo => "RFC 8482 HINFO, answered locally",
            Action::Ptr(_) => "PTR from this org's own bindings, nothing sent upstream",
            Action::Forward => "forwarded upstream; answers filtered",
            Action::Synthetic(_) => {
                "a synthetic address from the pool, bound to (org, name), TTL 10 s; nothing sent upstream"
            }
        }
    }
}

fn is_under(name: &str, zone: &str) -> bool {
    name == zone
        || name
            .strip_suffix(zone)
            .is_some_and(|rest| rest.ends_with('.'))
}

/// Is `name` in a zone that is never forwarded?
pub(crate) fn never_forwarded(name: &str) -> bool {
    NEVER_FORWARDED.iter().any(|z| is_under(name, z))
}

/// The address a reverse-lookup name stands for, if it is a complete one
/// (`4.3.2.1.in-addr.arpa`, 32 nibbles under `ip6.arpa`).
pub(crate) fn reverse_address(name: &str) -> Option<IpAddr> {
    if let Some(rest) = name.strip_suffix(".in-addr.arpa") {
        let parts: Vec<&str> = rest.split('.').collect();
        if parts.len() != 4 {
            return None;
        }
        let mut octets = [0u8; 4];
        for (i, p) in parts.iter().rev().enumerate() {
            if p.is_empty() || p.len() > 3 || (p.len() > 1 && p.starts_with('0')) {
                return None;
            }
            octets[i] = p.parse().ok()?;
        }
        return Some(IpAddr::V4(Ipv4Addr::from(octets)));
    }
    if let Some(rest) = name.strip_suffix(".ip6.arpa") {
        let nibbles: Vec<&str> = rest.split('.').collect();
        if nibbles.len() != 32 {
            return None;
        }
        let mut value: u128 = 0;
        for n in nibbles.iter().rev() {
            if n.len() != 1 {
                return None;
            }
            value = (value << 4) | u128::from(u8::from_str_radix(n, 16).ok()?);
        }
        return Some(IpAddr::V6(Ipv6Addr::from(value)));
    }
    None
}

/// The normalised form of a query name that is a host name (lowercase,
/// punycode, no trailing dot), as evidence records it; `None` for anything
/// else (the root, bad characters, an IP spelling).
pub(crate) fn shown_name(qname: &str) -> Option<String> {
    match normalize_host(qname) {
        Ok(Host::Name(name)) => Some(name),
        _ => None,
    }
}

/// Decide one query from `client` for `qname` (as received, any case, with
/// or without the trailing dot) of type `qtype`.
pub(crate) fn decide_query(
    policy: &Policy,
    orgs: &[OrgDns],
    client: IpAddr,
    qname: &str,
    qtype: RecordType,
) -> QueryDecision {
    let Some(org) = policy.org_for(client) else {
        return QueryDecision {
            verdict: Verdict {
                org: None,
                reason: Reason::UnknownClient,
                rule: None,
                would_deny: None,
            },
            action: Action::Refuse,
            // Recorded like every other query: normalised, no trailing dot.
            name: shown_name(qname),
        };
    };
    let settings = orgs.get(org.index).cloned().unwrap_or_default();
    let denied = Action::Denied(settings.denied);
    let local = |reason: Reason, action: Action, name: Option<String>| QueryDecision {
        verdict: Verdict {
            org: Some(org.clone()),
            reason,
            rule: None,
            would_deny: None,
        },
        action,
        name,
    };
    let Ok(Host::Name(name)) = normalize_host(qname) else {
        return local(Reason::BadRequest, denied, None);
    };
    if name == DOH_CANARY {
        return local(Reason::SpecialName, Action::NxDomain, Some(name));
    }
    if name == DDR_NAME {
        return local(Reason::SpecialName, Action::NoData, Some(name));
    }
    if qtype == RecordType::PTR {
        if let Some(addr) = reverse_address(&name) {
            // Reason and rule are settled by the bindings.
            return local(Reason::NoMatchingRule, Action::Ptr(addr), Some(name));
        }
    }
    let verdict = policy.decide_name_any_port(client, &name);
    if !verdict.is_allow() {
        return QueryDecision {
            verdict,
            action: denied,
            name: Some(name),
        };
    }
    allowed(verdict, name, qtype, &settings)
}

/// Rows 7-11: what the query of an allowed name is answered with (a name
/// allowed by a rule, or by a grant at the miss hook).
pub(crate) fn allowed(
    verdict: Verdict,
    name: String,
    qtype: RecordType,
    settings: &OrgDns,
) -> QueryDecision {
    if never_forwarded(&name) {
        return QueryDecision {
            verdict: Verdict {
                reason: Reason::SpecialName,
                rule: None,
                would_deny: None,
                ..verdict
            },
            action: Action::NxDomain,
            name: Some(name),
        };
    }
    let (verdict, action) = if qtype == RecordType::ANY {
        (verdict, Action::AnyHinfo)
    } else if settings.synthetic && qtype == RecordType::A {
        (verdict, Action::Synthetic(Family::V4))
    } else if settings.synthetic && qtype == RecordType::AAAA {
        (verdict, Action::Synthetic(Family::V6))
    } else if settings.synthetic
        && (DEFAULT_TYPES.contains(&qtype) || settings.types.contains(&qtype))
    {
        (verdict, Action::NoData)
    } else if DEFAULT_TYPES.contains(&qtype) || settings.types.contains(&qtype) {
        (verdict, Action::Forward)
    } else {
        (
            Verdict {
                reason: Reason::QtypeNotAllowed,
                ..verdict
            },
            Action::Refuse,
        )
    };
    QueryDecision {
        verdict,
        action,
        name: Some(name),
    }
}

/// Row 9: a forwarded name's use of its wildcard rule's budget (`used`,
/// `None` when its rule has none). Past it, REFUSED `name_budget_exceeded`;
/// a report-mode org (`report`) is let through, with that as the
/// `would_deny` of its record.
pub(crate) fn past_budget(
    decision: QueryDecision,
    used: Option<NameUse>,
    report: bool,
) -> QueryDecision {
    if decision.action != Action::Forward || used.is_none_or(NameUse::is_allowed) {
        return decision;
    }
    let denied = Verdict {
        reason: Reason::NameBudgetExceeded,
        would_deny: None,
        ..decision.verdict
    };
    if report {
        QueryDecision {
            verdict: denied.reported(),
            ..decision
        }
    } else {
        QueryDecision {
            verdict: denied,
            action: Action::Refuse,
            ..decision
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use std::path::Path;

    const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
dns_types = ["TXT"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "*.wild.test"
[[org.allow]]
host = "printer.local"
[[org.allow]]
host = "localhost"
[[org.allow]]
host = "use-application-dns.net"
[[org.deny]]
host = "blocked.wild.test"

[[org]]
name = "beta"
clients = ["198.18.5.0/24"]
dns_denied = "nxdomain"
[[org.allow]]
host = "beta.test"

[[org]]
name = "syn"
clients = ["198.18.6.0/24"]
dns_answers = "synthetic"
dns_types = ["TXT"]
[[org.allow]]
host = "*.wild.test"

[dns]
synthetic_pool = "198.19.128.0/24"
"#;

    fn setup() -> (Policy, Vec<OrgDns>) {
        let c = config::from_str(POLICY, Path::new("t.toml")).unwrap();
        let orgs = c.orgs.iter().map(OrgDns::from_config).collect();
        (Policy::new(&c), orgs)
    }

    fn d(client: &str, name: &str, qtype: RecordType) -> (Reason, Action) {
        let (p, o) = setup();
        let q = decide_query(&p, &o, client.parse().unwrap(), name, qtype);
        (q.verdict.reason, q.action)
    }

    const ACME: &str = "198.18.1.2";
    const BETA: &str = "198.18.5.2";
    const SYN: &str = "198.18.6.2";

    #[test]
    fn unknown_clients_name_is_recorded_normalised() {
        let (p, o) = setup();
        let client = "198.18.9.9".parse().unwrap();
        let q = decide_query(&p, &o, client, "Allowed.TEST.", RecordType::A);
        assert_eq!(q.verdict.reason, Reason::UnknownClient);
        assert_eq!(q.name.as_deref(), Some("allowed.test"));
        let q = decide_query(&p, &o, client, ".", RecordType::A);
        assert_eq!(q.name, None);
        assert_eq!(
            shown_name("bücher.test."),
            Some("xn--bcher-kva.test".into())
        );
    }

    #[test]
    fn truth_table() {
        use RecordType as T;
        let refused = Action::Denied(DnsDenied::Refused);
        let cases: &[(&str, &str, T, Reason, Action)] = &[
            (
                "198.18.9.9",
                "allowed.test.",
                T::A,
                Reason::UnknownClient,
                Action::Refuse,
            ),
            (ACME, ".", T::A, Reason::BadRequest, refused.clone()),
            (ACME, "a b.test.", T::A, Reason::BadRequest, refused.clone()),
            (
                ACME,
                "127.0.0.1.",
                T::A,
                Reason::BadRequest,
                refused.clone(),
            ),
            (
                ACME,
                "use-application-dns.net.",
                T::A,
                Reason::SpecialName,
                Action::NxDomain,
            ),
            (
                BETA,
                "_dns.resolver.arpa.",
                T::SVCB,
                Reason::SpecialName,
                Action::NoData,
            ),
            (
                ACME,
                "10.2.18.198.in-addr.arpa.",
                T::PTR,
                Reason::NoMatchingRule,
                Action::Ptr("198.18.2.10".parse().unwrap()),
            ),
            (
                ACME,
                "2.18.198.in-addr.arpa.",
                T::PTR,
                Reason::NoMatchingRule,
                refused.clone(),
            ),
            (
                ACME,
                "nope.test.",
                T::A,
                Reason::NoMatchingRule,
                refused.clone(),
            ),
            (
                ACME,
                "NOPE.allowed.test.",
                T::A,
                Reason::NoMatchingRule,
                refused.clone(),
            ),
            (
                ACME,
                "blocked.wild.test.",
                T::A,
                Reason::ExplicitDeny,
                refused.clone(),
            ),
            (
                BETA,
                "allowed.test.",
                T::A,
                Reason::NoMatchingRule,
                Action::Denied(DnsDenied::Nxdomain),
            ),
            (
                ACME,
                "printer.local.",
                T::A,
                Reason::SpecialName,
                Action::NxDomain,
            ),
            (
                ACME,
                "localhost.",
                T::AAAA,
                Reason::SpecialName,
                Action::NxDomain,
            ),
            (
                ACME,
                "other.local.",
                T::A,
                Reason::NoMatchingRule,
                refused.clone(),
            ),
            (
                ACME,
                "ALLOWED.Test.",
                T::ANY,
                Reason::RuleMatch,
                Action::AnyHinfo,
            ),
            (
                ACME,
                "allowed.test",
                T::A,
                Reason::RuleMatch,
                Action::Forward,
            ),
            (
                ACME,
                "x.wild.test.",
                T::HTTPS,
                Reason::RuleMatch,
                Action::Forward,
            ),
            (
                ACME,
                "allowed.test.",
                T::TXT,
                Reason::RuleMatch,
                Action::Forward,
            ),
            (
                ACME,
                "allowed.test.",
                T::MX,
                Reason::QtypeNotAllowed,
                Action::Refuse,
            ),
            (
                ACME,
                "allowed.test.",
                T::AXFR,
                Reason::QtypeNotAllowed,
                Action::Refuse,
            ),
            (
                BETA,
                "beta.test.",
                T::TXT,
                Reason::QtypeNotAllowed,
                Action::Refuse,
            ),
            (
                BETA,
                "beta.test.",
                T::NULL,
                Reason::QtypeNotAllowed,
                Action::Refuse,
            ),
            (
                SYN,
                "x.wild.test.",
                T::A,
                Reason::RuleMatch,
                Action::Synthetic(Family::V4),
            ),
            (
                SYN,
                "x.wild.test.",
                T::AAAA,
                Reason::RuleMatch,
                Action::Synthetic(Family::V6),
            ),
            (
                SYN,
                "x.wild.test.",
                T::HTTPS,
                Reason::RuleMatch,
                Action::NoData,
            ),
            (
                SYN,
                "x.wild.test.",
                T::CNAME,
                Reason::RuleMatch,
                Action::NoData,
            ),
            (
                SYN,
                "x.wild.test.",
                T::TXT,
                Reason::RuleMatch,
                Action::NoData,
            ),
            (
                SYN,
                "x.wild.test.",
                T::MX,
                Reason::QtypeNotAllowed,
                Action::Refuse,
            ),
            (
                SYN,
                "nope.test.",
                T::A,
                Reason::NoMatchingRule,
                Action::Denied(DnsDenied::Refused),
            ),
        ];
        for (client, name, qtype, reason, action) in cases {
            assert_eq!(
                d(client, name, *qtype),
                (*reason, action.clone()),
                "{client} {name} {qtype}"
            );
        }
    }

    #[test]
    fn past_the_budget_refused_report_mode_let_through() {
        let (p, o) = setup();
        let q = decide_query(&p, &o, ACME.parse().unwrap(), "x.wild.test", RecordType::A);
        assert_eq!(q.action, Action::Forward);
        for used in [None, Some(NameUse::Seen), Some(NameUse::New)] {
            assert_eq!(past_budget(q.clone(), used, false), q);
        }
        let refused = past_budget(q.clone(), Some(NameUse::Exceeded), false);
        assert_eq!(refused.action, Action::Refuse);
        assert_eq!(refused.verdict.reason, Reason::NameBudgetExceeded);
        assert_eq!(refused.verdict.rule, q.verdict.rule);
        let reported = past_budget(q.clone(), Some(NameUse::Exceeded), true);
        assert_eq!(reported.action, Action::Forward);
        assert_eq!(reported.verdict.reason, Reason::ReportOnly);
        assert_eq!(
            reported.verdict.would_deny,
            Some(Reason::NameBudgetExceeded)
        );
        // Only a forwarded name spends.
        let hinfo = decide_query(
            &p,
            &o,
            ACME.parse().unwrap(),
            "x.wild.test",
            RecordType::ANY,
        );
        assert_eq!(
            past_budget(hinfo.clone(), Some(NameUse::Exceeded), false),
            hinfo
        );
    }

    #[test]
    fn reverse_names() {
        assert_eq!(
            reverse_address("4.3.2.1.in-addr.arpa"),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(reverse_address("04.3.2.1.in-addr.arpa"), None);
        assert_eq!(reverse_address("256.3.2.1.in-addr.arpa"), None);
        assert_eq!(reverse_address("3.2.1.in-addr.arpa"), None);
        let v6 = "1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.8.b.d.0.1.0.0.2.ip6.arpa";
        assert_eq!(reverse_address(v6), Some("2001:db8::1".parse().unwrap()));
        assert_eq!(reverse_address("8.b.d.0.1.0.0.2.ip6.arpa"), None);
        assert!(never_forwarded("in-addr.arpa"));
        assert!(never_forwarded("x.onion"));
        assert!(!never_forwarded("notlocal"));
        assert!(!never_forwarded("example.com"));
    }
}
