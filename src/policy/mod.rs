//! The policy decision: pure functions over values. No I/O, no clock.
//!
//! A client address maps to an org by longest prefix. A target is either a
//! normalised name or an IP address (see [`crate::proto::target`]). Names are
//! decided in two steps: the name against the org's host rules, then every
//! address the name resolves to against the address checks; the caller dials
//! only addresses that passed.
//!
//! # Which decide is which
//!
//! Every `decide*` function in the crate, from the policy's pure steps up
//! to the callers that do I/O around them:
//!
//! | function | decides | for whom |
//! |---|---|---|
//! | [`Policy::decide`] | client address → org, then [`Policy::decide_for_org`] | `palisade replay`, tests |
//! | [`Policy::decide_for_org`] | one target for a known org: an IP at once, a name's rules (then [`Decision::Resolve`]) | every decision of a target |
//! | `Policy::decide_name`, `decide_name_rules`, `decide_ip` (private) | the name step, its host rules, the address step of an IP target | [`Policy::decide_for_org`] |
//! | [`Policy::decide_name_any_port`] (and private `decide_name_any_port_enforced`) | a name on any port, addresses not considered | the DNS shim |
//! | [`Policy::decide_request`], over [`request::decide`] | one request inside an intercepted connection: method and path rules, credentials | interception, plain `http://` under an intercepting rule |
//! | `dns::decide::decide_query` | one DNS query: org, name, query type | the DNS shim |
//! | [`crate::proxy::decide::decide_with`] | a target with I/O: the name step, resolution (or transparent mode's original destination), the address step | every proxy mode, `palisade explain` |
//! | [`crate::proxy::ctx::Ctx::decide`], `Ctx::decide_in` | [`crate::proxy::decide::decide_with`] for a view's org (untimed, timed under a mode) | explicit, SOCKS5, transparent without a name |
//! | `proxy::transparent::decide` (private) | a transparent connection: the presented name against the original destination | transparent mode |
//! | `proxy::intercepted::serve::decide_parts` (crate), `decide_and_send` (private) | a request in an intercepted connection: what it addresses, then [`Policy::decide_request`]; then record and send it | interception, `palisade explain` |
//!
//! # Truth table
//!
//! Checks run top to bottom; the first row that applies decides.
//!
//! | # | target | condition | decision | reason | rule |
//! |---|---|---|---|---|---|
//! | 1 | any | client in no org's `clients` | deny | `unknown_client` | – |
//! | 1a | any | a baseline `[[deny]]` entry covers the name, or the address (or one embedded in it), on the port: for every org, never reported | deny | `explicit_deny`, layer `baseline` | baseline entry |
//! | 2 | name | a host deny rule matches the name and its ports include the port | deny | `explicit_deny` | deny rule |
//! | 3 | name | no host allow rule matches the name | deny | `no_matching_rule` | – |
//! | 4 | name | host allow rules match the name, none on this port | deny | `port_not_allowed` | – |
//! | 5 | name | the name does not resolve (caller's step) | deny | `resolution_failed` | allow rule |
//! | 6 | name | no resolved address passes the address checks (rows A-C) | deny | reason of the first address | as row A-C |
//! | 7 | name | otherwise: dial only the addresses that passed | allow | `rule_match` | allow rule |
//! | 8 | IP | the address passes the address checks (rows A-C) and a cidr allow rule covers it on the port | allow | `rule_match` | allow rule (for an always-denied address, the first rule that opens it, row C) |
//! | 9 | IP | a cidr allow rule covers it, none on this port | deny | `port_not_allowed` | – |
//! | 10 | IP | otherwise | deny | `no_matching_rule` | – |
//!
//! Address checks, for the address dialled and every IPv4 address embedded
//! in it (IPv4-compatible `::/96`, SIIT `::ffff:0:0:0/96`, NAT64
//! `64:ff9b::/96` and `64:ff9b:1::/48` (last 32 bits), 6to4, Teredo, and
//! under any prefix an ISATAP interface id `0:5efe:a.b.c.d` or
//! `200:5efe:a.b.c.d`); each must pass on its own:
//!
//! | # | condition | decision | reason |
//! |---|---|---|---|
//! | A0 | a baseline `[[deny]]` cidr covers it on the port (every org, never reported) | deny | `explicit_deny`, layer `baseline` |
//! | A | the address and port are one of Palisade's own listeners (a listener on an unspecified address matches any address on its port) | deny | `denied_address` |
//! | B | a cidr deny rule covers it on the port (a deny wins inside an allowed cidr) | deny | `explicit_deny` |
//! | C | it is in an always-denied range, and no cidr allow rule on the port both covers it and lies inside the most specific always-denied range holding it | deny | `denied_address` |
//!
//! Row C by example, for an org with `cidr = "0.0.0.0/0"`, `"::/0"` and
//! `"10.20.0.0/16"` on ports 80 and 443, another org's `clients =
//! ["10.9.0.0/16"]`, Palisade listening on `10.0.0.5:3128`, on a host whose
//! interfaces hold `198.18.2.1` and `2001:2::1` (besides loopback):
//!
//! | address | opened by | decision |
//! |---|---|---|
//! | 169.254.169.254, 127.0.0.1, 10.1.2.3, fd00:ec2::254 | nothing (`0.0.0.0/0`, `::/0` are broader than the range) | deny |
//! | 10.20.1.1 | `10.20.0.0/16` (inside `10.0.0.0/8`) | allow |
//! | 10.21.0.1 | nothing | deny |
//! | 10.9.0.7 (the other org's sandbox) | nothing: only a rule inside `10.9.0.0/16` opens it | deny |
//! | 10.0.0.5, any port | nothing: only `10.0.0.5/32` opens it (and never on 3128, row A) | deny |
//! | 198.18.2.1, 2001:2::1 (the gateway's own), any port | nothing: only `198.18.2.1/32`, `2001:2::1/128` open them | deny |
//! | 2001:2::5efe:127.0.0.1 (ISATAP) | the v6 address by `::/0`, but not the embedded 127.0.0.1 | deny |
//! | 2001:db8::1, 3fff::1 (IPv6 documentation) | nothing | deny |
//! | 8.8.8.8 | `0.0.0.0/0` (not always-denied) | allow |
//! | 64:ff9b::8.8.8.8 | `::/0`; the embedded 8.8.8.8 is open | allow |
//! | 64:ff9b::127.0.0.1 | the v6 address by `::/0`, but the embedded 127.0.0.1 is not opened: a v6 rule never opens an embedded IPv4 address, only an IPv4 rule inside its range does (`127.0.0.1/32` would) | deny |
//! | 64:ff9b:1::8.8.8.8 | nothing: `64:ff9b:1::/48` is always-denied; a rule inside it opens the v6 side, the embedded address is checked as well | deny |
//!
//! DNS answers take the same rows without a port: an address is stripped
//! if a cidr deny rule covers it on every port, or if row C finds it
//! always-denied and no rule inside its range covers it on any port. A name
//! resolving into an always-denied range is denied (row 6) or stripped from
//! answers exactly as the address itself.
//!
//! Always-denied ([`ALWAYS_DENIED`]): unspecified and "this network"
//! (`0.0.0.0/8`, `::`), loopback (`127.0.0.0/8`, `::1`), RFC 1918, shared
//! address space `100.64.0.0/10`, link-local (`169.254.0.0/16` incl. the
//! metadata address, `fe80::/10`), IETF protocol assignments `192.0.0.0/24`,
//! multicast (`224.0.0.0/4`, `ff00::/8`), reserved and broadcast
//! (`240.0.0.0/4`), SIIT `::ffff:0:0:0/96`, local-use NAT64
//! `64:ff9b:1::/48`, discard-only `100::/64`, SRv6 SIDs `5f00::/16`,
//! unique-local `fc00::/7` (incl. `fd00:ec2::254`) and site-local
//! `fec0::/10`, the IPv6 documentation ranges `2001:db8::/32` and
//! `3fff::/20`; also every org's `clients` networks (whatever its
//! identity), the address of every listener bound to a specific address
//! (every port), and every address of the host's interfaces ("gateway
//! address": IPv4 and IPv6, upstream side included, each as a /32 or
//! /128, every port; enumerated by `crate::host` at start and on every
//! reload and handed in to [`Policy::with_host`]; loopback addresses are
//! left to their fixed range). IPv4-mapped IPv6 is canonicalised to IPv4
//! before any check. Benchmarking (`198.18.0.0/15`, `2001:2::/48`) and the
//! IPv4 documentation ranges stay open: never routed, nothing internal
//! answers there, and test labs and probes use them.
//!
//! # Identity
//!
//! Which org a client belongs to, from its source address C and the
//! credentials it presented (user = org name, password = token), if any:
//!
//! | # | credentials | condition | org | reason |
//! |---|---|---|---|---|
//! | I1 | none | C in the `clients` of an org with identity `address` | that org (longest prefix) | – |
//! | I2 | none | otherwise, and some token org would accept a token from C | none | `auth_required` |
//! | I3 | none | otherwise | none | `unknown_client` (row 1) |
//! | I4 | user, token | the user names an org with identity `token` holding the token | that org | – |
//! | I5 | user, token | the user names an org with identity `address+token` holding the token, C in its `clients` | that org | – |
//! | I6 | user, token | otherwise (no such org, wrong token, address org, C outside) | none | `auth_failed` |
//!
//! Presented credentials are always checked, never ignored; tokens are
//! compared as SHA-256 digests in constant time, and a failure looks the
//! same to the client whatever its cause.
//!
//! Host rules never match an IP target (no reverse lookups), and cidr rules
//! never make a name allowed on their own: a name needs a host allow rule.
//!
//! Cost: a name lookup probes one hash map per label of the name, an address
//! lookup one hash map per distinct prefix length in use; neither grows with
//! the number of rules.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{
    Carry, Config, Identity, NameLimits, OrgConfig, PortSet, RequestRules, RuleConfig, RuleTarget,
    TokenDigest,
};
use crate::proto::target::{embedded_ipv4s, Host};

/// Why a connection or query was allowed or denied. Stable, snake_case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    RuleMatch,
    /// Allowed only because the org is in report mode; `would_deny` says why
    /// enforcement would have denied it.
    ReportOnly,
    UnknownClient,
    NoMatchingRule,
    ExplicitDeny,
    PortNotAllowed,
    DeniedAddress,
    SniMismatch,
    HostMismatch,
    BadRequest,
    ResolutionFailed,
    EvidenceUnavailable,
    LimitExceeded,
    /// DNS shim: a special-use name (`localhost`, `.local`, `.onion`,
    /// reverse zones, ...) answered locally, never forwarded.
    SpecialName,
    /// DNS shim: a query type the org has not enabled.
    QtypeNotAllowed,
    /// No credentials, and the source address alone names no org that
    /// could be chosen without them.
    AuthRequired,
    /// Credentials that do not name an org holding that token (from that
    /// address, for `address+token`).
    AuthFailed,
    /// Intercepted request: the rule's `methods`/`deny_methods` refuse the method.
    MethodNotAllowed,
    /// Intercepted request: the rule's `paths`/`deny_paths` refuse the path.
    PathNotAllowed,
    /// Intercepted connection: the upstream's certificate did not verify
    /// (or its TLS handshake failed). Never downgraded to pass-through.
    UpstreamTlsError,
    /// A tunnel's bytes are not what its rule says it carries: no
    /// ClientHello on a TLS tunnel (silence past `detect_timeout`, other
    /// bytes, a record before the hello), no HTTP request on an HTTP one.
    ProtocolMismatch,
    /// A TLS tunnel's ClientHello names no server.
    SniMissing,
    /// A ClientHello with an `encrypted_client_hello` extension: the name
    /// that counts is encrypted, so it cannot be checked.
    EchNotAllowed,
    /// h2c on an HTTP tunnel (prior knowledge, `Upgrade: h2c`): its streams
    /// could name other hosts unseen.
    UpgradeNotAllowed,
    /// A live connection a reload's new policy no longer allows: closed
    /// (report mode: kept, with this as its `would_deny`).
    PolicyRevoked,
    /// A name under a wildcard allow rule that its rule does not let
    /// leave: new to the org past the rule's `max_new_names_per_minute`,
    /// or with a label longer than its `max_label_length` (names as a
    /// covert channel, `docs/dns.md`).
    NameBudgetExceeded,
    /// A connection or request under an allow rule whose volume budget
    /// (`max_bytes_up`, `max_bytes_down` over `volume_window`), or its
    /// org's, is spent: refused before anything is dialled; a live tunnel
    /// that spends it is cut (report mode: let through, with this as its
    /// `would_deny`).
    VolumeExceeded,
    /// A connection to an address of the synthetic pool that is bound to
    /// no name of the client's org (never handed out to it, or evicted):
    /// never dialled, nothing resolved.
    SyntheticUnbound,
    /// `[enforcement] mode = "required"`: the gateway ruleset is not
    /// loaded as written, so no new connection is let through (the
    /// sandbox may not be behind Palisade alone).
    EnforcementMissing,
}

impl Reason {
    pub const ALL: [Reason; 29] = [
        Reason::RuleMatch,
        Reason::ReportOnly,
        Reason::UnknownClient,
        Reason::NoMatchingRule,
        Reason::ExplicitDeny,
        Reason::PortNotAllowed,
        Reason::DeniedAddress,
        Reason::SniMismatch,
        Reason::HostMismatch,
        Reason::BadRequest,
        Reason::ResolutionFailed,
        Reason::EvidenceUnavailable,
        Reason::LimitExceeded,
        Reason::SpecialName,
        Reason::QtypeNotAllowed,
        Reason::AuthRequired,
        Reason::AuthFailed,
        Reason::MethodNotAllowed,
        Reason::PathNotAllowed,
        Reason::UpstreamTlsError,
        Reason::ProtocolMismatch,
        Reason::SniMissing,
        Reason::EchNotAllowed,
        Reason::UpgradeNotAllowed,
        Reason::PolicyRevoked,
        Reason::NameBudgetExceeded,
        Reason::VolumeExceeded,
        Reason::SyntheticUnbound,
        Reason::EnforcementMissing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RuleMatch => "rule_match",
            Reason::ReportOnly => "report_only",
            Reason::UnknownClient => "unknown_client",
            Reason::NoMatchingRule => "no_matching_rule",
            Reason::ExplicitDeny => "explicit_deny",
            Reason::PortNotAllowed => "port_not_allowed",
            Reason::DeniedAddress => "denied_address",
            Reason::SniMismatch => "sni_mismatch",
            Reason::HostMismatch => "host_mismatch",
            Reason::BadRequest => "bad_request",
            Reason::ResolutionFailed => "resolution_failed",
            Reason::EvidenceUnavailable => "evidence_unavailable",
            Reason::LimitExceeded => "limit_exceeded",
            Reason::SpecialName => "special_name",
            Reason::QtypeNotAllowed => "qtype_not_allowed",
            Reason::AuthRequired => "auth_required",
            Reason::AuthFailed => "auth_failed",
            Reason::MethodNotAllowed => "method_not_allowed",
            Reason::PathNotAllowed => "path_not_allowed",
            Reason::UpstreamTlsError => "upstream_tls_error",
            Reason::ProtocolMismatch => "protocol_mismatch",
            Reason::SniMissing => "sni_missing",
            Reason::EchNotAllowed => "ech_not_allowed",
            Reason::UpgradeNotAllowed => "upgrade_not_allowed",
            Reason::PolicyRevoked => "policy_revoked",
            Reason::NameBudgetExceeded => "name_budget_exceeded",
            Reason::VolumeExceeded => "volume_exceeded",
            Reason::SyntheticUnbound => "synthetic_unbound",
            Reason::EnforcementMissing => "enforcement_missing",
        }
    }

    pub fn is_allow(self) -> bool {
        matches!(self, Reason::RuleMatch | Reason::ReportOnly)
    }

    /// Denials an org in report mode lets through: the allowlist's own
    /// verdicts, a wildcard rule's name budget among them (report mode lets
    /// names no rule matches through unbudgeted anyway). Safety denials
    /// (always-denied addresses, Palisade's own listeners, bad requests,
    /// limits, evidence) are enforced in every mode.
    pub fn reportable(self) -> bool {
        matches!(
            self,
            Reason::NoMatchingRule
                | Reason::ExplicitDeny
                | Reason::PortNotAllowed
                | Reason::SniMismatch
                | Reason::HostMismatch
                | Reason::ProtocolMismatch
                | Reason::SniMissing
                | Reason::EchNotAllowed
                | Reason::UpgradeNotAllowed
                | Reason::PolicyRevoked
                | Reason::NameBudgetExceeded
                | Reason::VolumeExceeded
        )
    }

    /// `allow` or `deny`, as evidence and metrics spell it.
    pub fn decision(self) -> &'static str {
        if self.is_allow() {
            "allow"
        } else {
            "deny"
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An org, as the policy knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrgRef {
    pub index: usize,
    pub name: Arc<str>,
}

/// The outcome of a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub org: Option<OrgRef>,
    pub reason: Reason,
    /// Id of the deciding rule, where one decided.
    pub rule: Option<Arc<str>>,
    /// Report mode: what enforcement would have decided.
    pub would_deny: Option<Reason>,
}

impl Verdict {
    pub fn is_allow(&self) -> bool {
        self.reason.is_allow()
    }

    fn deny(org: &OrgRef, reason: Reason, rule: Option<&Rule>) -> Self {
        Verdict {
            org: Some(org.clone()),
            reason,
            rule: rule.map(|r| r.id.clone()),
            would_deny: None,
        }
    }

    /// Report mode: let a reportable denial through, saying what it was.
    pub fn reported(self) -> Verdict {
        if !self.reason.reportable() {
            return self;
        }
        Verdict {
            would_deny: Some(self.reason),
            reason: Reason::ReportOnly,
            ..self
        }
    }
}

/// What [`Policy::decide`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Decided without looking at addresses (IP targets, or names denied by name).
    Final(Verdict),
    /// The name is allowed by name; the decision depends on the addresses it resolves to.
    Resolve(PendingName),
}

/// A name allowed by a host rule, waiting for its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingName {
    pub org: OrgRef,
    /// The allow rule (or, in report mode, the deny rule) that decided by name.
    pub rule: Option<Arc<str>>,
    pub port: u16,
    /// Report mode: the denial by name that is let through.
    pub would_deny: Option<Reason>,
}

/// The addresses of an allowed name that may be dialled, in order, and the verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressVerdict {
    pub verdict: Verdict,
    pub dial: Vec<IpAddr>,
}

#[derive(Debug)]
struct Rule {
    id: Arc<str>,
    ports: PortSet,
    /// Request rules of an intercepting allow rule.
    intercept: Option<Arc<RequestRules>>,
    /// What the rule's tunnels carry, when the rule says.
    tunnel: Option<Carry>,
    /// A wildcard allow rule: the length of its suffix and the bounds on
    /// the names it lets leave.
    below: Option<(usize, NameLimits)>,
    /// The rule's volume budget (allow rules).
    volume: Option<crate::config::Volume>,
}

impl Rule {
    /// Whether every label of `name` left of this wildcard rule's suffix
    /// is within its `max_label_length` (always, for any other rule).
    fn label_fits(&self, name: &str) -> bool {
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

/// Rule indices by the name or name suffix they match.
#[derive(Debug, Default)]
struct NameTable {
    exact: HashMap<String, Vec<usize>>,
    below: HashMap<String, Vec<usize>>,
}

impl NameTable {
    fn insert(&mut self, target: &RuleTarget, index: usize) {
        match target {
            RuleTarget::Exact(name) => self.exact.entry(name.clone()).or_default().push(index),
            RuleTarget::Below(suffix) => self.below.entry(suffix.clone()).or_default().push(index),
            RuleTarget::Cidr(_) => {}
        }
    }

    /// Indices of every rule matching `name`, in no particular order.
    fn matches<'a>(&'a self, name: &'a str) -> impl Iterator<Item = usize> + 'a {
        let exact = self.exact.get(name).into_iter().flatten();
        // Every proper suffix after a '.', e.g. "b.c.com", "c.com", "com".
        let suffixes = name
            .match_indices('.')
            .filter_map(move |(i, _)| name.get(i + 1..))
            .filter_map(move |s| self.below.get(s))
            .flatten();
        exact.chain(suffixes).copied()
    }

    /// The work [`NameTable::matches`] does for `name`: hash probes plus
    /// rule indices yielded. What the lookup costs, counted rather than
    /// timed, so a test can show it does not grow with the rule count.
    #[cfg(test)]
    fn work(&self, name: &str) -> usize {
        let probes = 1 + name.matches('.').count();
        probes + self.matches(name).count()
    }
}

/// Values by network, probed from the longest prefix length in use to the shortest.
#[derive(Debug)]
struct PrefixTable<T> {
    v4: Vec<(u8, HashMap<Ipv4Net, T>)>,
    v6: Vec<(u8, HashMap<Ipv6Net, T>)>,
}

impl<T> Default for PrefixTable<T> {
    fn default() -> Self {
        PrefixTable {
            v4: Vec::new(),
            v6: Vec::new(),
        }
    }
}

impl<T: Default> PrefixTable<T> {
    fn entry(&mut self, net: IpNet) -> &mut T {
        fn slot<N: std::hash::Hash + Eq, T: Default>(
            levels: &mut Vec<(u8, HashMap<N, T>)>,
            len: u8,
            net: N,
        ) -> &mut T {
            let pos = match levels.iter().position(|(l, _)| *l == len) {
                Some(pos) => pos,
                None => {
                    levels.push((len, HashMap::new()));
                    levels.sort_by_key(|(l, _)| std::cmp::Reverse(*l));
                    levels.iter().position(|(l, _)| *l == len).unwrap_or(0)
                }
            };
            levels[pos].1.entry(net).or_default()
        }
        match net.trunc() {
            IpNet::V4(n) => slot(&mut self.v4, n.prefix_len(), n),
            IpNet::V6(n) => slot(&mut self.v6, n.prefix_len(), n),
        }
    }
}

impl<T> PrefixTable<T> {
    /// Values of every network containing `ip`, longest prefix first.
    fn matches(&self, ip: IpAddr) -> impl Iterator<Item = &T> + '_ {
        self.matches_len(ip).map(|(_, value)| value)
    }

    /// Every network containing `ip` as (prefix length, value), longest first.
    fn matches_len(&self, ip: IpAddr) -> impl Iterator<Item = (u8, &T)> + '_ {
        let (v4, v6) = match ip {
            IpAddr::V4(a) => (Some(a), None),
            IpAddr::V6(a) => (None, Some(a)),
        };
        let m4 = v4.into_iter().flat_map(move |a| {
            self.v4.iter().filter_map(move |(len, map)| {
                Ipv4Net::new(a, *len)
                    .ok()
                    .and_then(|n| map.get(&n.trunc()))
                    .map(|v| (*len, v))
            })
        });
        let m6 = v6.into_iter().flat_map(move |a| {
            self.v6.iter().filter_map(move |(len, map)| {
                Ipv6Net::new(a, *len)
                    .ok()
                    .and_then(|n| map.get(&n.trunc()))
                    .map(|v| (*len, v))
            })
        });
        m4.chain(m6)
    }

    /// Every network in the table that contains all of `net`, longest first.
    fn containing(&self, net: IpNet) -> Vec<(IpNet, &T)> {
        let mut found = Vec::new();
        match net.trunc() {
            IpNet::V4(n) => {
                for (len, map) in self.v4.iter().filter(|(l, _)| *l <= n.prefix_len()) {
                    if let Some((k, v)) = Ipv4Net::new(n.network(), *len)
                        .ok()
                        .and_then(|k| map.get_key_value(&k.trunc()))
                    {
                        found.push((IpNet::V4(*k), v));
                    }
                }
            }
            IpNet::V6(n) => {
                for (len, map) in self.v6.iter().filter(|(l, _)| *l <= n.prefix_len()) {
                    if let Some((k, v)) = Ipv6Net::new(n.network(), *len)
                        .ok()
                        .and_then(|k| map.get_key_value(&k.trunc()))
                    {
                        found.push((IpNet::V6(*k), v));
                    }
                }
            }
        }
        found
    }

    /// Every (network, value), in no particular order.
    fn entries(&self) -> impl Iterator<Item = (IpNet, &T)> + '_ {
        let e4 = self
            .v4
            .iter()
            .flat_map(|(_, map)| map.iter().map(|(n, v)| (IpNet::V4(*n), v)));
        let e6 = self
            .v6
            .iter()
            .flat_map(|(_, map)| map.iter().map(|(n, v)| (IpNet::V6(*n), v)));
        e4.chain(e6)
    }
}

/// Credentials a client presented: the user (an org name) and its token.
#[derive(Clone, Copy)]
pub struct Credential<'a> {
    pub user: &'a [u8],
    pub token: &'a [u8],
}

/// Why a client's identity could not be established.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// No credentials, and the address alone selects no org (row I2).
    #[error("credentials required")]
    Required,
    /// Credentials that do not verify (row I6); the cause is for evidence
    /// only, never for the client.
    #[error("credentials rejected: {0}")]
    Failed(&'static str),
}

impl IdentityError {
    pub fn reason(self) -> Reason {
        match self {
            IdentityError::Required => Reason::AuthRequired,
            IdentityError::Failed(_) => Reason::AuthFailed,
        }
    }
}

#[derive(Debug)]
struct Org {
    r#ref: OrgRef,
    report: bool,
    identity: Identity,
    tokens: Vec<TokenDigest>,
    /// The org's own networks (checked for `address+token`).
    networks: Vec<IpNet>,
    allow: Vec<Rule>,
    deny: Vec<Rule>,
    /// Allow rules by id (ids are unique within a config).
    allow_ids: HashMap<Arc<str>, usize>,
    allow_names: NameTable,
    deny_names: NameTable,
    allow_cidrs: PrefixTable<Vec<usize>>,
    deny_cidrs: PrefixTable<Vec<usize>>,
    /// The org's volume budget over all its rules.
    volume: Option<crate::config::Volume>,
}

/// A compiled policy.
#[derive(Debug)]
pub struct Policy {
    orgs: Vec<Org>,
    /// Networks of orgs identified by address alone.
    clients: PrefixTable<Option<usize>>,
    by_name: HashMap<Arc<str>, usize>,
    own: Vec<SocketAddr>,
    /// The host's interface addresses it was compiled with (canonical,
    /// sorted, unique).
    host: Vec<IpAddr>,
    /// Always-denied ranges with what each one is (see [`ALWAYS_DENIED`]),
    /// plus every org's `clients`, Palisade's own listen addresses and the
    /// host's addresses.
    always_denied: PrefixTable<Vec<Arc<str>>>,
    hash: Arc<str>,
    rule_count: usize,
    /// The baseline's `[[deny]]` entries, decided before any org rule.
    baseline: Option<BaselineRules>,
}

/// The layer of the policy a rule belongs to: the operator's baseline
/// (`[policy] baseline`) or an org's own rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    Baseline,
    Org,
}

impl Layer {
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Baseline => "baseline",
            Layer::Org => "org",
        }
    }
}

/// The baseline's denials, compiled like an org's deny rules.
#[derive(Debug)]
struct BaselineRules {
    /// SHA-256 (hex) of the baseline file.
    hash: Arc<str>,
    deny: Vec<Rule>,
    ids: std::collections::HashSet<Arc<str>>,
    names: NameTable,
    cidrs: PrefixTable<Vec<usize>>,
}

impl BaselineRules {
    fn compile(baseline: &crate::config::Baseline) -> BaselineRules {
        let mut b = BaselineRules {
            hash: Arc::from(baseline.hash.as_str()),
            deny: Vec::new(),
            ids: Default::default(),
            names: NameTable::default(),
            cidrs: PrefixTable::default(),
        };
        compile_rules(&baseline.deny, &mut b.deny, &mut b.names, &mut b.cidrs);
        b.ids = b.deny.iter().map(|r| r.id.clone()).collect();
        b
    }
}

/// Compile `rules` into `list`, indexed by name in `names` and by
/// network in `cidrs`.
fn compile_rules(
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
        });
        match &r.target {
            RuleTarget::Cidr(net) => cidrs.entry(*net).push(i),
            t => names.insert(t, i),
        }
    }
}

pub use crate::config::ALWAYS_DENIED;

/// A cidr allow rule that opens (part of) an always-denied range: what
/// `palisade check` lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub org: Arc<str>,
    pub rule: Arc<str>,
    /// The rule's network: the part of `range` that is opened.
    pub net: IpNet,
    /// The always-denied range the rule lies inside.
    pub range: IpNet,
    /// What the range is ("private", "clients of acme", ...).
    pub what: Vec<Arc<str>>,
    pub ports: PortSet,
}

/// What the always-denied table calls a synthetic pool (`[dns] synthetic_pool`).
pub const SYNTHETIC_POOL: &str = "synthetic pool";

/// What `closed_ranges` calls an address of the host Palisade runs on.
pub const GATEWAY_ADDRESS: &str = "gateway address";

/// The always-denied table: the fixed ranges, every org's `clients` (no
/// hairpin into a sandbox network), the address of every listener bound
/// to a specific address (on every port; an unspecified listen address is
/// only its port, row A) and every address of the host's interfaces
/// (`host`, loopback aside: it is a fixed range already, which a rule
/// inside `127.0.0.0/8` or `::1` opens as before).
fn closed_ranges(
    orgs: &[OrgConfig],
    own: &[SocketAddr],
    host: &[IpAddr],
) -> PrefixTable<Vec<Arc<str>>> {
    let mut table: PrefixTable<Vec<Arc<str>>> = PrefixTable::default();
    let mut add = |net: IpNet, what: Arc<str>| {
        let entry = table.entry(net);
        if !entry.contains(&what) {
            entry.push(what);
        }
    };
    for (net, what) in ALWAYS_DENIED {
        if let Ok(net) = net.parse::<IpNet>() {
            add(net, Arc::from(*what));
        }
    }
    for org in orgs {
        let what: Arc<str> = Arc::from(format!("clients of {}", org.name));
        for net in &org.clients {
            add(canonical_net(*net), what.clone());
        }
    }
    let listener: Arc<str> = Arc::from("Palisade listener");
    for addr in own.iter().map(|a| canonical(a.ip())) {
        if !addr.is_unspecified() {
            add(IpNet::from(addr), listener.clone());
        }
    }
    let gateway: Arc<str> = Arc::from(GATEWAY_ADDRESS);
    for addr in host.iter().map(|a| canonical(*a)) {
        if !addr.is_unspecified() && !addr.is_loopback() {
            add(IpNet::from(addr), gateway.clone());
        }
    }
    table
}

/// An IPv4-mapped network (`::ffff:a.b.c.d/104+`) is the IPv4 network.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(n) if n.prefix_len() >= 96 => match n.network().to_ipv4_mapped() {
            Some(v4) => Ipv4Net::new(v4, n.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        _ => net,
    }
}

impl Policy {
    /// Compile a validated config, knowing no host addresses: for
    /// decisions made away from the gateway (`palisade replay`, probe
    /// plans, tests). What serves traffic uses [`Policy::with_host`].
    pub fn new(config: &Config) -> Policy {
        Policy::with_host(config, &[])
    }

    /// Compile a validated config for the host whose interface addresses
    /// are `host` (each always-denied, row C; see `crate::host`).
    pub fn with_host(config: &Config, host: &[IpAddr]) -> Policy {
        let mut policy = Policy::compile(&config.orgs, config.own_addresses(), host);
        policy.baseline = config.policy.baseline.as_ref().map(BaselineRules::compile);
        // The synthetic pools are never dialled: always-denied, and no
        // cidr rule may overlap them (config validation).
        let pool: Arc<str> = Arc::from(SYNTHETIC_POOL);
        let pools = [
            config.dns.synthetic_pool.map(IpNet::V4),
            config.dns.synthetic_pool_v6.map(IpNet::V6),
        ];
        for net in pools.into_iter().flatten() {
            let entry = policy.always_denied.entry(net.trunc());
            if !entry.contains(&pool) {
                entry.push(pool.clone());
            }
        }
        policy
    }

    /// Compile orgs; `own` are Palisade's own listen addresses, `host` the
    /// addresses of the host's interfaces.
    pub fn compile(orgs: &[OrgConfig], own: Vec<SocketAddr>, host: &[IpAddr]) -> Policy {
        let mut clients: PrefixTable<Option<usize>> = PrefixTable::default();
        let mut compiled = Vec::with_capacity(orgs.len());
        let mut rule_count = 0;
        let mut by_name = HashMap::new();
        for (index, org) in orgs.iter().enumerate() {
            if org.identity == Identity::Address {
                for net in &org.clients {
                    *clients.entry(*net) = Some(index);
                }
            }
            let name: Arc<str> = Arc::from(org.name.as_str());
            by_name.insert(name.clone(), index);
            let mut o = Org {
                r#ref: OrgRef { index, name },
                report: org.mode == crate::config::OrgMode::Report,
                identity: org.identity,
                tokens: org.tokens.clone(),
                networks: org.clients.iter().map(|n| n.trunc()).collect(),
                allow: Vec::new(),
                deny: Vec::new(),
                allow_ids: HashMap::new(),
                allow_names: NameTable::default(),
                deny_names: NameTable::default(),
                allow_cidrs: PrefixTable::default(),
                deny_cidrs: PrefixTable::default(),
                volume: org.volume,
            };
            compile_rules(
                &org.allow,
                &mut o.allow,
                &mut o.allow_names,
                &mut o.allow_cidrs,
            );
            compile_rules(&org.deny, &mut o.deny, &mut o.deny_names, &mut o.deny_cidrs);
            o.allow_ids = o
                .allow
                .iter()
                .enumerate()
                .map(|(i, r)| (r.id.clone(), i))
                .collect();
            rule_count += org.allow.len() + org.deny.len();
            compiled.push(o);
        }
        let always_denied = closed_ranges(orgs, &own, host);
        let mut host: Vec<IpAddr> = host.iter().map(|a| canonical(*a)).collect();
        host.sort_unstable();
        host.dedup();
        let canonical = Policy::canonical_text(orgs);
        let hash = Arc::from(data_encoding::HEXLOWER.encode(&Sha256::digest(canonical.as_bytes())));
        Policy {
            orgs: compiled,
            clients,
            by_name,
            own,
            host,
            always_denied,
            hash,
            rule_count,
            baseline: None,
        }
    }

    /// SHA-256 (hex) of the canonical JSON form of the orgs and their rules.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The hash, shared into every record this policy decides.
    pub fn hash_arc(&self) -> &Arc<str> {
        &self.hash
    }

    /// SHA-256 (hex) of the baseline file, if there is one: what every
    /// record carries as `baseline`.
    pub fn baseline_hash(&self) -> Option<&Arc<str>> {
        self.baseline.as_ref().map(|b| &b.hash)
    }

    /// The layer of the rule that decided `verdict`, if a rule did.
    pub fn layer_of(&self, verdict: &Verdict) -> Option<Layer> {
        let rule = verdict.rule.as_ref()?;
        let baseline = self.baseline.as_ref().is_some_and(|b| b.ids.contains(rule));
        Some(if baseline {
            Layer::Baseline
        } else {
            Layer::Org
        })
    }

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

    /// The baseline's denial of `ip` (or an address embedded in it) on
    /// `port` (`None`: on every port).
    fn baseline_address(&self, org: &OrgRef, ip: IpAddr, port: Option<u16>) -> Option<Verdict> {
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

    /// The canonical JSON text the hash is taken over: stored beside the
    /// evidence so any record can be re-explained later.
    pub fn canonical_text(orgs: &[OrgConfig]) -> String {
        serde_json::to_string(orgs).unwrap_or_default()
    }

    /// The host addresses this policy was compiled with (canonical,
    /// sorted, unique; loopback among them but left to its fixed range): a
    /// reload compares them with a fresh enumeration.
    pub fn host_addresses(&self) -> &[IpAddr] {
        &self.host
    }

    pub fn org_count(&self) -> usize {
        self.orgs.len()
    }

    pub fn rule_count(&self) -> usize {
        self.rule_count
    }

    /// The org a client address belongs to (longest prefix wins).
    pub fn org_for(&self, client: IpAddr) -> Option<OrgRef> {
        let client = canonical(client);
        let index = self.clients.matches(client).find_map(|o| *o)?;
        self.orgs.get(index).map(|o| o.r#ref.clone())
    }

    /// The org of a client that presented `credential` (or none): the
    /// identity table above. Presented credentials are always checked.
    pub fn org_for_identity(
        &self,
        client: IpAddr,
        credential: Option<Credential<'_>>,
    ) -> Result<Option<OrgRef>, IdentityError> {
        let client = canonical(client);
        let Some(cred) = credential else {
            return match self.org_for(client) {
                Some(org) => Ok(Some(org)),
                None if self.orgs.iter().any(|o| accepts_from(o, client)) => {
                    Err(IdentityError::Required)
                }
                None => Ok(None),
            };
        };
        self.org_for_token(client, cred.user, &TokenDigest::of(cred.token))
    }

    /// The org of a live connection under this policy: found again from
    /// the identity it was decided with (its address; for a token org, the
    /// digest of the token it presented, `token`), and only if that is
    /// still the org `was`. `None`: the connection has no org here.
    pub fn org_again(
        &self,
        client: IpAddr,
        was: &OrgRef,
        token: Option<&TokenDigest>,
    ) -> Option<OrgRef> {
        let client = canonical(client);
        let found = match token {
            None => self.org_for(client),
            Some(digest) => self
                .org_for_token(client, was.name.as_bytes(), digest)
                .ok()
                .flatten(),
        };
        found.filter(|org| org.name == was.name)
    }

    /// The identity table's rows for a presented token (`user` names the
    /// org), given as its digest.
    fn org_for_token(
        &self,
        client: IpAddr,
        user: &[u8],
        presented: &TokenDigest,
    ) -> Result<Option<OrgRef>, IdentityError> {
        // Hash and compare whether or not the org exists, so that the time
        // taken says little about which it is.
        let org = std::str::from_utf8(user)
            .ok()
            .and_then(|name| self.by_name.get(name))
            .and_then(|&i| self.orgs.get(i));
        let dummy = [TokenDigest([0u8; 32])];
        let stored = org.map_or(&dummy[..], |o| &o.tokens[..]);
        let mut matched = false;
        for digest in stored {
            matched |= presented.ct_eq(digest);
        }
        let Some(org) = org else {
            return Err(IdentityError::Failed("no such org"));
        };
        match org.identity {
            Identity::Address => Err(IdentityError::Failed("org is identified by address")),
            _ if !matched => Err(IdentityError::Failed("wrong token")),
            Identity::AddressToken if !accepts_from(org, client) => {
                Err(IdentityError::Failed("address is not in the org's clients"))
            }
            Identity::Token | Identity::AddressToken => Ok(Some(org.r#ref.clone())),
        }
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

    /// The index of org `name` (its place in the config), if there is one.
    pub fn org_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
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
        let mut allows: Vec<usize> = o.allow_names.matches(name).collect();
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

    fn decide_ip(&self, o: &Org, ip: IpAddr, port: u16) -> Verdict {
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

/// Whether `ports` hold `port` (`None`: every port, so only all ports do).
fn covers(ports: &PortSet, port: Option<u16>) -> bool {
    match port {
        Some(p) => ports.contains(p),
        None => *ports == PortSet::All,
    }
}

/// Would `org` accept a token presented from `client`?
fn accepts_from(org: &Org, client: IpAddr) -> bool {
    match org.identity {
        Identity::Address => false,
        Identity::Token => true,
        Identity::AddressToken => org.networks.iter().any(|n| n.contains(&client)),
    }
}

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

    /// The volume budgets a decision of `org` under allow rule `rule`
    /// spends from: the rule's and the org's (either `None` when unset).
    /// What the edges spend from (`limits::volume`), the policy holding
    /// no state.
    pub fn volume(
        &self,
        org: &OrgRef,
        rule: &str,
    ) -> (Option<crate::config::Volume>, Option<crate::config::Volume>) {
        let by_org = self.orgs.get(org.index).and_then(|o| o.volume);
        (self.allow_rule(org, rule).and_then(|r| r.volume), by_org)
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

/// The IPv4 addresses an IPv6 address reaches (prefix forms and ISATAP,
/// [`embedded_ipv4s`]); none for IPv4.
fn embedded(ip: IpAddr) -> impl Iterator<Item = IpAddr> + Clone {
    let v6 = match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    };
    v6.into_iter()
        .flat_map(|v6| embedded_ipv4s(&v6).map(IpAddr::V4))
}

/// IPv4-mapped IPv6 is the IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

pub(crate) mod request;
mod token;

#[cfg(test)]
mod tests;
