//! Deciding a target for an org: the baseline, then a name's host rules
//! (rows 2-4) or an IP's address rows, and a name on any port for the DNS
//! shim.

use std::net::IpAddr;
use std::sync::Arc;

use crate::config::{PortSet, Window};
use crate::proto::target::Host;

use super::compile::{canonical, Org, Policy};
use super::rule::covers;
use super::verdict::{Decision, Layer, OrgRef, PendingName, Reason, Verdict};

impl Policy {
    /// The baseline's denial of `name` on `port` (`None`: on every port),
    /// for any org: the first matching `[[deny]]` entry in file order.
    fn baseline_name(&self, org: &OrgRef, name: &str, port: Option<u16>) -> Option<Verdict> {
        let b = self.baseline.as_ref()?;
        let i = b
            .names
            .matches(name)
            .filter(|&i| covers(&b.deny[i].ports, port))
            .min()?;
        Some(Verdict::deny(org, Reason::ExplicitDeny, Some(&b.deny[i])))
    }

    /// Decide a connection from `client` to `host:port`.
    pub fn decide(&self, client: IpAddr, host: &Host, port: u16) -> Decision {
        let Some(org) = self.org_for(client) else {
            return Decision::Final(Verdict {
                org: None,
                reason: Reason::UnknownClient,
                rule: None,
                would_deny: None,
            });
        };
        self.decide_for_org(&org, host, port)
    }

    /// Decide for a known org (the client step already done).
    pub fn decide_for_org(&self, org: &OrgRef, host: &Host, port: u16) -> Decision {
        let Some(o) = self.orgs.get(org.index) else {
            return Decision::Final(Verdict::deny(org, Reason::UnknownClient, None));
        };
        // The baseline first, for every org, whatever its mode.
        let baseline = match host {
            Host::Ip(ip) => self.baseline_address(org, *ip, Some(port)),
            Host::Name(name) => self.baseline_name(org, name, Some(port)),
        };
        if let Some(v) = baseline {
            return Decision::Final(v);
        }
        match host {
            Host::Ip(ip) => {
                let v = self.decide_ip(o, canonical(*ip), port);
                Decision::Final(if o.report { v.reported() } else { v })
            }
            Host::Name(name) => self.decide_name(o, name, port),
        }
    }

    fn decide_name(&self, o: &Org, name: &str, port: u16) -> Decision {
        let org = &o.r#ref;
        let by_name = self.decide_name_rules(o, name, port);
        match by_name {
            Err(v) if o.report && v.reason.reportable() => {
                // Report mode: resolve and check addresses as if allowed.
                Decision::Resolve(PendingName {
                    org: org.clone(),
                    rule: v.rule,
                    port,
                    would_deny: Some(v.reason),
                })
            }
            Err(v) => Decision::Final(v),
            Ok(rule) => Decision::Resolve(PendingName {
                org: org.clone(),
                rule: Some(rule),
                port,
                would_deny: None,
            }),
        }
    }

    /// Rows 2-4: the allow rule a name matches on the port, or the denial.
    fn decide_name_rules(&self, o: &Org, name: &str, port: u16) -> Result<Arc<str>, Verdict> {
        let org = &o.r#ref;
        if let Some(i) = o
            .deny_names
            .matches(name)
            .filter(|&i| o.deny[i].ports.contains(port))
            .min()
        {
            return Err(Verdict::deny(org, Reason::ExplicitDeny, Some(&o.deny[i])));
        }
        let mut any = false;
        let mut best: Option<usize> = None;
        let mut too_long: Option<usize> = None;
        for i in o.allow_names.matches(name) {
            if !o.allow[i].live(self.at) {
                continue;
            }
            any = true;
            if !o.allow[i].ports.contains(port) {
                continue;
            }
            let slot = if o.allow[i].label_fits(name) {
                &mut best
            } else {
                &mut too_long
            };
            *slot = Some(slot.map_or(i, |b| b.min(i)));
        }
        match (best, too_long) {
            (Some(i), _) => Ok(o.allow[i].id.clone()),
            (None, Some(i)) => Err(Verdict::deny(
                org,
                Reason::NameBudgetExceeded,
                Some(&o.allow[i]),
            )),
            (None, None) if any => Err(Verdict::deny(org, Reason::PortNotAllowed, None)),
            (None, None) => Err(Verdict::deny(org, Reason::NoMatchingRule, None)),
        }
    }

    /// The name-table work of deciding `name` for `client`'s org (see
    /// [`NameTable::work`]).
    #[cfg(test)]
    pub(crate) fn name_lookup_work(&self, client: IpAddr, name: &str) -> usize {
        self.org_for(client)
            .and_then(|org| self.orgs.get(org.index))
            .map_or(0, |o| o.allow_names.work(name) + o.deny_names.work(name))
    }

    /// The time-bound allow rules of `org` that would match `host` on
    /// `port` but are outside their interval at this policy's instant
    /// (what `palisade explain` names beside a denial), in file order.
    pub fn dormant(&self, org: &OrgRef, host: &Host, port: u16) -> Vec<(Arc<str>, Window)> {
        let Some(o) = self.orgs.get(org.index) else {
            return Vec::new();
        };
        let mut found: Vec<usize> = match host {
            Host::Name(name) => o.allow_names.matches(name).collect(),
            Host::Ip(ip) => o
                .allow_cidrs
                .matches(canonical(*ip))
                .flatten()
                .copied()
                .collect(),
        };
        found.sort_unstable();
        found.dedup();
        found
            .into_iter()
            .map(|i| &o.allow[i])
            .filter(|r| r.ports.contains(port) && !r.live(self.at))
            .filter_map(|r| Some((r.id.clone(), r.window?)))
            .collect()
    }

    /// Whether an org's misses become approvals (`on_miss = "ask"`); a
    /// report-mode org never asks (its misses are let through anyway).
    pub fn asks(&self, org: &OrgRef) -> bool {
        self.orgs.get(org.index).is_some_and(|o| o.ask && !o.report)
    }

    /// Whether an org only reports its allowlist's denials.
    pub fn is_report(&self, org: &OrgRef) -> bool {
        self.orgs.get(org.index).is_some_and(|o| o.report)
    }

    /// Whether the client's org may reach `name` on any port (the DNS shim's
    /// question). Same rules as [`Policy::decide`], over every port an allow
    /// rule names; addresses are not considered here.
    pub fn decide_name_any_port(&self, client: IpAddr, name: &str) -> Verdict {
        let v = self.decide_name_any_port_enforced(client, name);
        match &v.org {
            Some(org) if self.is_report(org) => self.reported(v),
            _ => v,
        }
    }

    /// Report mode's view of a verdict: the org's own denials are let
    /// through, the baseline's never.
    fn reported(&self, v: Verdict) -> Verdict {
        if self.layer_of(&v) == Some(Layer::Baseline) {
            v
        } else {
            v.reported()
        }
    }

    fn decide_name_any_port_enforced(&self, client: IpAddr, name: &str) -> Verdict {
        let Some(org) = self.org_for(client) else {
            return Verdict {
                org: None,
                reason: Reason::UnknownClient,
                rule: None,
                would_deny: None,
            };
        };
        self.name_any_port_for(&org, name)
    }

    /// Whether the org named `org` may still be handed addresses of `name`
    /// (the DNS shim's question, [`Policy::decide_name_any_port`], for an
    /// org): what a reload asks of the bindings handed out before it.
    pub fn binds(&self, org: &str, name: &str) -> bool {
        let Some(o) = self.by_name.get(org).and_then(|&i| self.orgs.get(i)) else {
            return false;
        };
        let v = self.name_any_port_for(&o.r#ref, name);
        if o.report {
            self.reported(v).is_allow()
        } else {
            v.is_allow()
        }
    }

    /// [`Policy::decide_name_any_port`] for a known org, enforced.
    fn name_any_port_for(&self, org: &OrgRef, name: &str) -> Verdict {
        let org = org.clone();
        let Some(o) = self.orgs.get(org.index) else {
            return Verdict::deny(&org, Reason::UnknownClient, None);
        };
        if let Some(v) = self.baseline_name(&org, name, None) {
            return v;
        }
        let mut denies: Vec<usize> = o.deny_names.matches(name).collect();
        denies.sort_unstable();
        let denied = |port: u16| {
            denies.iter().any(|&i| o.deny[i].ports.contains(port))
                || self.baseline_name(&org, name, Some(port)).is_some()
        };
        if let Some(&i) = denies.iter().find(|&&i| o.deny[i].ports == PortSet::All) {
            return Verdict::deny(&org, Reason::ExplicitDeny, Some(&o.deny[i]));
        }
        let mut allows: Vec<usize> = o
            .allow_names
            .matches(name)
            .filter(|&i| o.allow[i].live(self.at))
            .collect();
        allows.sort_unstable();
        let mut too_long: Option<usize> = None;
        for &i in &allows {
            let open = match &o.allow[i].ports {
                PortSet::All => true,
                PortSet::List(ports) => ports.iter().any(|&p| !denied(p)),
            };
            if open && !o.allow[i].label_fits(name) {
                too_long = too_long.or(Some(i));
            } else if open {
                return Verdict {
                    org: Some(org.clone()),
                    reason: Reason::RuleMatch,
                    rule: Some(o.allow[i].id.clone()),
                    would_deny: None,
                };
            }
        }
        if let Some(i) = too_long {
            return Verdict::deny(&org, Reason::NameBudgetExceeded, Some(&o.allow[i]));
        }
        match (allows.is_empty(), denies.first()) {
            (false, Some(&i)) => Verdict::deny(&org, Reason::ExplicitDeny, Some(&o.deny[i])),
            _ => Verdict::deny(&org, Reason::NoMatchingRule, None),
        }
    }
}
