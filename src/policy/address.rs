//! The address checks (rows A0 and A-C of the module doc): an IP target,
//! the addresses a name resolved to, the addresses of a DNS answer, and
//! which rules open which always-denied ranges.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::config::PortSet;

use super::compile::{canonical, embedded, Opening, Org, Policy};
use super::rule::covers;
use super::verdict::{AddressVerdict, OrgRef, PendingName, Reason, Verdict};

impl Policy {
    /// The baseline's denial of `ip` (or an address embedded in it) on
    /// `port` (`None`: on every port).
    pub(super) fn baseline_address(
        &self,
        org: &OrgRef,
        ip: IpAddr,
        port: Option<u16>,
    ) -> Option<Verdict> {
        let b = self.baseline.as_ref()?;
        let ip = canonical(ip);
        std::iter::once(ip).chain(embedded(ip)).find_map(|addr| {
            let i = b
                .cidrs
                .matches(addr)
                .flatten()
                .copied()
                .filter(|&i| covers(&b.deny[i].ports, port))
                .min()?;
            Some(Verdict::deny(org, Reason::ExplicitDeny, Some(&b.deny[i])))
        })
    }

    pub(super) fn decide_ip(&self, o: &Org, ip: IpAddr, port: u16) -> Verdict {
        let org = &o.r#ref;
        if let Err(v) = self.check_address(o, ip, port) {
            return v;
        }
        // An always-denied address is allowed by the rule that opened it
        // (row C), not by a broader rule that also covers it.
        let closed = self
            .always_denied
            .matches_len(ip)
            .next()
            .map_or(0, |(l, _)| l);
        let mut any = false;
        let mut best: Option<usize> = None;
        for i in o
            .allow_cidrs
            .matches_len(ip)
            .take_while(|(len, _)| *len >= closed)
            .flat_map(|(_, rules)| rules)
            .copied()
            .filter(|&i| o.allow[i].live(self.at))
        {
            any = true;
            if o.allow[i].ports.contains(port) {
                best = Some(best.map_or(i, |b| b.min(i)));
            }
        }
        match best {
            Some(i) => Verdict {
                org: Some(org.clone()),
                reason: Reason::RuleMatch,
                rule: Some(o.allow[i].id.clone()),
                would_deny: None,
            },
            None if any => Verdict::deny(org, Reason::PortNotAllowed, None),
            None => Verdict::deny(org, Reason::NoMatchingRule, None),
        }
    }

    /// Rows A-C of the address table.
    fn check_address(&self, o: &Org, ip: IpAddr, port: u16) -> Result<(), Verdict> {
        let org = &o.r#ref;
        let effective = std::iter::once(ip).chain(embedded(ip));
        for addr in effective.clone() {
            if self.is_own(addr, port) {
                return Err(Verdict::deny(org, Reason::DeniedAddress, None));
            }
            if let Some(i) = o
                .deny_cidrs
                .matches(addr)
                .flatten()
                .copied()
                .filter(|&i| o.deny[i].ports.contains(port))
                .min()
            {
                return Err(Verdict::deny(org, Reason::ExplicitDeny, Some(&o.deny[i])));
            }
        }
        for addr in effective {
            if !self.opened(o, addr, Some(port)) {
                return Err(Verdict::deny(org, Reason::DeniedAddress, None));
            }
        }
        Ok(())
    }

    /// Row C: an address outside every always-denied range is open; one
    /// inside is open only through a cidr allow rule (on `port`, or on any
    /// port for `None`) that covers it and lies inside the most specific
    /// always-denied range holding it. Ranges containing one address nest,
    /// so that rule lies inside every one of them: `10.20.0.0/16` opens
    /// 10.20.1.1, `0.0.0.0/0` and `8.0.0.0/5` open nothing always-denied,
    /// and `10.0.0.0/8` does not open an org's `clients` network inside it.
    fn opened(&self, o: &Org, addr: IpAddr, port: Option<u16>) -> bool {
        let Some((closed, _)) = self.always_denied.matches_len(addr).next() else {
            return true;
        };
        o.allow_cidrs
            .matches_len(addr)
            .take_while(|(len, _)| *len >= closed)
            .flat_map(|(_, rules)| rules)
            .filter(|&&i| o.allow[i].live(self.at))
            .any(|&i| port.is_none_or(|p| o.allow[i].ports.contains(p)))
    }

    /// Which cidr allow rules open which always-denied ranges, in file
    /// order (`palisade check`). A rule opens each range it lies inside, for
    /// its own addresses; broader rules open none.
    pub fn openings(&self) -> Vec<Opening> {
        let mut found = Vec::new();
        for o in &self.orgs {
            let mut rules: Vec<(usize, IpNet)> = o
                .allow_cidrs
                .entries()
                .flat_map(|(net, rules)| rules.iter().map(move |&i| (i, net)))
                .collect();
            rules.sort_unstable_by_key(|(i, net)| (*i, *net));
            for (i, net) in rules {
                for (range, what) in self.always_denied.containing(net) {
                    found.push(Opening {
                        org: o.r#ref.name.clone(),
                        rule: o.allow[i].id.clone(),
                        net,
                        range,
                        what: what.clone(),
                        ports: o.allow[i].ports.clone(),
                    });
                }
            }
        }
        found
    }

    /// The always-denied ranges holding `ip` or an address embedded in it
    /// (most specific first for each), with what each one is: what
    /// `palisade check` would list a `cidr` rule for `ip` as opening. Empty
    /// when such a rule opens nothing always-denied.
    pub fn closing(&self, ip: IpAddr) -> Vec<(IpNet, Vec<Arc<str>>)> {
        let ip = canonical(ip);
        std::iter::once(ip)
            .chain(embedded(ip))
            .flat_map(|a| self.always_denied.containing(IpNet::from(a)))
            .map(|(net, what)| (net, what.clone()))
            .collect()
    }

    fn is_own(&self, ip: IpAddr, port: u16) -> bool {
        self.own
            .iter()
            .any(|own| own.port() == port && (own.ip() == ip || own.ip().is_unspecified()))
    }

    /// May an address be handed to the org in a DNS answer? The address
    /// checks without a port: stripped if a cidr deny rule covers it on every
    /// port, or if it is always-denied and not opened (row C) on any port.
    pub fn answer_allowed(&self, org: &OrgRef, ip: IpAddr) -> Result<(), Verdict> {
        let Some(o) = self.orgs.get(org.index) else {
            return Err(Verdict::deny(org, Reason::UnknownClient, None));
        };
        let ip = canonical(ip);
        if let Some(v) = self.baseline_address(org, ip, None) {
            return Err(v);
        }
        for addr in std::iter::once(ip).chain(embedded(ip)) {
            if let Some(i) = o
                .deny_cidrs
                .matches(addr)
                .flatten()
                .copied()
                .filter(|&i| o.deny[i].ports == PortSet::All)
                .min()
            {
                return Err(Verdict::deny(org, Reason::ExplicitDeny, Some(&o.deny[i])));
            }
            if !self.opened(o, addr, None) {
                return Err(Verdict::deny(org, Reason::DeniedAddress, None));
            }
        }
        Ok(())
    }

    /// Judge the addresses an allowed name resolved to: keep those that pass
    /// rows A-C, in order. With none left, deny with the first address's reason.
    pub fn check_addresses(&self, pending: &PendingName, addrs: &[IpAddr]) -> AddressVerdict {
        let org = &pending.org;
        let Some(o) = self.orgs.get(org.index) else {
            return AddressVerdict {
                verdict: Verdict::deny(org, Reason::UnknownClient, None),
                dial: Vec::new(),
            };
        };
        let mut dial = Vec::new();
        let mut first_denial = None;
        let mut would_deny = pending.would_deny;
        for &ip in addrs {
            let ip = canonical(ip);
            if let Some(v) = self.baseline_address(org, ip, Some(pending.port)) {
                first_denial.get_or_insert(v);
                continue;
            }
            match self.check_address(o, ip, pending.port) {
                Ok(()) => {}
                Err(v) if o.report && v.reason.reportable() => {
                    would_deny.get_or_insert(v.reason);
                }
                Err(v) => {
                    first_denial.get_or_insert(v);
                    continue;
                }
            }
            if !dial.contains(&ip) {
                dial.push(ip)
            }
        }
        let verdict = if !dial.is_empty() {
            Verdict {
                org: Some(org.clone()),
                reason: if would_deny.is_some() {
                    Reason::ReportOnly
                } else {
                    Reason::RuleMatch
                },
                rule: pending.rule.clone(),
                would_deny,
            }
        } else {
            first_denial.unwrap_or(Verdict {
                org: Some(org.clone()),
                reason: Reason::ResolutionFailed,
                rule: pending.rule.clone(),
                would_deny: None,
            })
        };
        AddressVerdict { verdict, dial }
    }
}
