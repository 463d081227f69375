//! What a decision says: the reason codes, the verdict, a name pending on
//! its addresses, and the layer of the deciding rule.

use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::rule::Rule;

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
    /// Intercepted request: the rule's service rules (`service`, `repos`,
    /// `push_refs`, `graphql_mutations`, `models`) refuse what it asks,
    /// the detail naming it (`git push to refs/heads/main`).
    ServiceDenied,
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
    /// A miss (`no_matching_rule`) of an org with `on_miss = "ask"`: held
    /// as a pending approval (the refusal names its reference and the
    /// destination); the client retries once an approver grants it.
    ApprovalPending,
    /// A live connection allowed by a grant, closed when the grant ended
    /// (its TTL, a revoke, a reload that denies the target).
    GrantExpired,
}

impl Reason {
    pub const ALL: [Reason; 32] = [
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
        Reason::ServiceDenied,
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
        Reason::ApprovalPending,
        Reason::GrantExpired,
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
            Reason::ServiceDenied => "service_denied",
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
            Reason::ApprovalPending => "approval_pending",
            Reason::GrantExpired => "grant_expired",
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

    pub(super) fn deny(org: &OrgRef, reason: Reason, rule: Option<&Rule>) -> Self {
        Verdict {
            org: Some(org.clone()),
            reason,
            rule: rule.map(|r| r.id.clone()),
            would_deny: None,
        }
    }

    /// A denial of `org` for `reason`, naming no rule.
    pub fn denied_for(org: &OrgRef, reason: Reason) -> Self {
        Verdict::deny(org, reason, None)
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

/// What [`Policy::decide`](super::Policy::decide) concluded.
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

/// The layer of the policy a rule belongs to: the operator's baseline
/// (`[policy] baseline`), an org's own rules, or a grant given at run
/// time (`crate::jit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    Baseline,
    Org,
    Grant,
}

impl Layer {
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Baseline => "baseline",
            Layer::Org => "org",
            Layer::Grant => "grant",
        }
    }
}
