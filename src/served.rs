//! The served state: everything a policy reload changes, in one value.
//!
//! The proxy ([`crate::proxy::Ctx`]), the DNS shim and the admin listener
//! share one [`ServedHandle`]. Each reader loads it once per decision (the
//! proxy's [`crate::proxy::ctx::View`], one DNS query, one `/policy` answer), so
//! the org, the rules, the DNS settings, the interception plan, the
//! credentials and the `policy` hash in the records all come from the same
//! version, whatever a reload does meanwhile. [`crate::reload`] builds a new
//! [`Served`] off the async runtime and swaps it in with one store.

use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;

use hickory_server::proto::rr::RecordType;

use crate::config::{Config, DnsDenied, OrgConfig, OrgMode};
use crate::intercept::{InterceptError, Interceptor};
use crate::metrics::Metrics;
use crate::policy::Policy;

/// One version of what is served.
#[derive(Debug)]
pub(crate) struct Served {
    /// The compiled orgs and rules.
    pub policy: Arc<Policy>,
    /// Each org's DNS settings (denied-name answer, query types), indexed
    /// like the policy's orgs.
    pub dns: Vec<OrgDns>,
    /// TLS interception (per-org CAs, credentials with their secrets,
    /// upstream trust), when some org's rule intercepts.
    pub intercept: Option<Arc<Interceptor>>,
    /// What `/policy` reports.
    pub info: PolicyInfo,
    /// When this version was loaded.
    pub loaded: SystemTime,
}

/// The served state shared by every reader; a reload swaps it whole.
pub(crate) type ServedHandle = Arc<ArcSwap<Served>>;

impl Served {
    /// Build everything `config` (already validated, its orgs compiled into
    /// `policy`) serves. Blocking: it reads the per-org CAs (creating
    /// missing ones), the credentials' secrets and the upstream trust
    /// bundle; call it off the async runtime.
    pub(crate) fn load(
        config: &Config,
        policy: Arc<Policy>,
        metrics: &Arc<Metrics>,
    ) -> Result<Served, InterceptError> {
        let intercept = Interceptor::new(config, metrics.clone())?.map(Arc::new);
        let loaded = SystemTime::now();
        Ok(Served {
            dns: config.orgs.iter().map(OrgDns::from_config).collect(),
            info: PolicyInfo::new(config, policy.hash(), loaded),
            policy,
            intercept,
            loaded,
        })
    }

    /// This state with `policy` in its place: the same orgs (compiled
    /// from `config`, the config this state serves) with other host
    /// addresses. The DNS settings and interception are kept.
    pub(crate) fn with_policy(&self, config: &Config, policy: Arc<Policy>) -> Served {
        let loaded = SystemTime::now();
        Served {
            dns: self.dns.clone(),
            intercept: self.intercept.clone(),
            info: PolicyInfo::new(config, policy.hash(), loaded),
            policy,
            loaded,
        }
    }

    /// Does `self` serve what `other` serves: the same policy (its hash
    /// covers the orgs, their rules and a digest of their tokens) under
    /// the same baseline (its file's hash), the same
    /// host addresses, and interception with the same secrets, CAs and
    /// upstream trust? A reload that builds a state serving as the one
    /// served changes nothing.
    pub(crate) fn serves_as(&self, other: &Served) -> bool {
        self.policy.hash() == other.policy.hash()
            && self.policy.baseline_hash() == other.policy.baseline_hash()
            && self.policy.host_addresses() == other.policy.host_addresses()
            && self.intercept.as_ref().map(|i| i.fingerprint())
                == other.intercept.as_ref().map(|i| i.fingerprint())
    }

    /// Does org `name` get synthetic DNS answers?
    pub(crate) fn is_synthetic(&self, name: &str) -> bool {
        self.policy
            .org_index(name)
            .and_then(|i| self.dns.get(i))
            .is_some_and(|d| d.synthetic)
    }

    /// A handle serving `self`.
    pub(crate) fn into_handle(self) -> ServedHandle {
        Arc::new(ArcSwap::from_pointee(self))
    }
}

/// The served policy, as `/policy` reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct PolicyInfo {
    pub hash: String,
    /// RFC 3339 time it was loaded.
    pub loaded_at: String,
    pub config: String,
    pub orgs: Vec<OrgSummary>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct OrgSummary {
    pub name: String,
    pub clients: Vec<String>,
    pub allow_rules: usize,
    pub deny_rules: usize,
    /// `enforce`, or `report` (denials recorded as `would_deny`, let through).
    pub mode: OrgMode,
}

impl PolicyInfo {
    pub(crate) fn new(config: &Config, hash: &str, loaded: SystemTime) -> PolicyInfo {
        PolicyInfo {
            hash: hash.to_string(),
            loaded_at: humantime::format_rfc3339_millis(loaded).to_string(),
            config: config.path.display().to_string(),
            orgs: config
                .orgs
                .iter()
                .map(|o| OrgSummary {
                    name: o.name.clone(),
                    clients: o.clients.iter().map(|c| c.to_string()).collect(),
                    allow_rules: o.allow.len(),
                    deny_rules: o.deny.len(),
                    mode: o.mode,
                })
                .collect(),
        }
    }
}

/// Per-org DNS settings, by org index.
#[derive(Debug, Clone, Default)]
pub(crate) struct OrgDns {
    pub denied: DnsDenied,
    pub types: Vec<RecordType>,
    /// `dns_answers = "synthetic"`: allowed names are answered from the
    /// synthetic pool ([`crate::handout::synthetic`]), nothing resolved.
    pub synthetic: bool,
}

impl OrgDns {
    pub(crate) fn from_config(org: &OrgConfig) -> OrgDns {
        OrgDns {
            synthetic: org.dns_answers == crate::config::DnsAnswers::Synthetic,
            denied: org.dns_denied,
            types: org
                .dns_types
                .iter()
                .filter_map(|t| t.parse::<RecordType>().ok())
                .collect(),
        }
    }
}
