//! What an allow rule grants the connections it allows: what its tunnels
//! carry, its request rules, its new-name budget.

use std::sync::Arc;

use crate::config::{Carry, RequestRules};

use super::compile::Policy;
use super::request;
use super::rule::Rule;
use super::verdict::OrgRef;

impl Policy {
    /// What a tunnel allowed by `rule` to `port` may carry. Address targets
    /// (cidr rules) are opaque: the address is the identity. A name's rule
    /// says so with `tunnel`, an intercepting rule carries TLS, and
    /// otherwise the port decides ([`Carry::default_for_port`]); so does a
    /// report-mode allowance without an allow rule.
    pub fn carry(&self, org: &OrgRef, rule: Option<&str>, name: bool, port: u16) -> Carry {
        if !name {
            return Carry::Opaque;
        }
        let found = rule.and_then(|id| self.allow_rule(org, id));
        match found {
            Some(r) if r.intercept.is_some() => Carry::Tls,
            Some(Rule {
                tunnel: Some(carry),
                ..
            }) => *carry,
            _ => Carry::default_for_port(port),
        }
    }

    /// The request rules of the allow rule `rule` of `org`, when that rule
    /// intercepts. `None`: pass the connection through untouched.
    pub fn intercept_rules(&self, org: &OrgRef, rule: &str) -> Option<Arc<RequestRules>> {
        self.allow_rule(org, rule).and_then(|r| r.intercept.clone())
    }

    /// The new-name budget (names per minute, per org) of allow rule
    /// `rule` of `org`: only a wildcard rule has one, and `None` as well
    /// when it is unlimited. What the edges spend from
    /// (`limits::names`), the policy holding no state.
    pub fn name_budget(&self, org: &OrgRef, rule: &str) -> Option<u32> {
        self.allow_rule(org, rule)
            .and_then(|r| r.below)
            .and_then(|(_, limits)| limits.new_per_minute)
    }

    fn allow_rule(&self, org: &OrgRef, id: &str) -> Option<&Rule> {
        let o = self.orgs.get(org.index)?;
        o.allow_ids.get(id).and_then(|&i| o.allow.get(i))
    }

    /// Decide one request inside a connection that allow rule `rule` of
    /// `org` intercepts, and choose which of `credentials` (the org's, in
    /// file order) to add: [`request::decide`] with this rule's request
    /// rules. Its truth table and path normalisation are documented there.
    pub fn decide_request<'a>(
        &self,
        org: &OrgRef,
        rule: &str,
        req: request::RequestFacts<'_>,
        credentials: impl IntoIterator<Item = &'a crate::config::CredentialConfig>,
    ) -> request::RequestDecision {
        let rules = self.intercept_rules(org, rule);
        request::decide(org, rule, rules.as_deref(), req, credentials)
    }
}
