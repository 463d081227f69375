//! The shim: everything it needs to answer, shared by the UDP server and
//! every TCP connection. One query's path, from `respond` on, is in
//! [`super::answer`], forwarding and filtering in [`super::filter`], the
//! wire in [`super::encode`].

use std::net::IpAddr;
use std::sync::Arc;

use super::budget::{QueryBudget, TcpBudget};
use super::cache::{AnswerCache, Kept};
use super::filter::clamp_ttl;
use super::refusals::Refusals;
use super::ttl::TtlMemo;
use crate::config::DnsConfig;
use crate::evidence::Evidence;
use crate::handout::bindings::Bindings;
use crate::limits::{EvidenceBudget, NameBudgets, RateLimiter};
use crate::metrics::Metrics;
use crate::resolve::Resolver;
use crate::served::{Served, ServedHandle};

/// Everything the shim needs to answer. What a reload changes (the policy,
/// each org's DNS settings) is in `served`, loaded once per query: one
/// query is decided and recorded under one policy version.
pub(crate) struct Shim {
    pub served: ServedHandle,
    pub resolver: Arc<Resolver>,
    pub evidence: Arc<Evidence>,
    pub metrics: Arc<Metrics>,
    pub bindings: Arc<Bindings>,
    pub config: DnsConfig,
    /// Queries in flight: global, per org (per address for a client in no org).
    pub queries: QueryBudget,
    /// DNS-over-TCP connections: global, per client address, per org.
    pub tcp: TcpBudget,
    /// Queries per second per client address.
    pub per_client: Arc<RateLimiter<IpAddr>>,
    /// Refusal records, one by one while the writer has room, else tallied.
    pub refusals: Refusals,
    /// Answer TTLs as first seen, so they do not count down across orgs.
    pub ttls: TtlMemo,
    /// What forwarding produced, per (org, name, type), for the served
    /// version it was decided under ([`super::cache`]).
    pub cache: AnswerCache<Served, Kept>,
    /// The new-name budgets of wildcard rules, shared with the proxy
    /// ([`Shim::with_names`]).
    pub names: Arc<NameBudgets>,
    /// The synthetic pools' mappings, shared with the proxy
    /// ([`Shim::with_synthetic`]); `None`: no pool set.
    pub synthetic: Option<Arc<crate::handout::synthetic::Synthetic>>,
    /// Approvals and grants, shared with the proxy ([`Shim::with_jit`]).
    pub jit: Option<Arc<crate::jit::Jit>>,
}

impl Shim {
    /// The shim of `config`, its limits sized from it.
    pub(crate) fn new(
        served: ServedHandle,
        resolver: Arc<Resolver>,
        evidence: Arc<Evidence>,
        metrics: Arc<Metrics>,
        bindings: Arc<Bindings>,
        config: DnsConfig,
    ) -> Shim {
        Shim {
            queries: QueryBudget::new(&config),
            tcp: TcpBudget::new(&config),
            per_client: Arc::new(RateLimiter::new(
                config.max_queries_per_second_per_client,
                65_536,
            )),
            // Its own until the proxy's is shared ([`Shim::with_evidence_budget`]).
            refusals: Refusals::new(
                evidence.clone(),
                metrics.clone(),
                Arc::new(EvidenceBudget::new(
                    crate::config::default_max_records_per_second_per_org(
                        &crate::config::Limits::default(),
                        &config,
                    ),
                )),
            ),
            ttls: TtlMemo::default(),
            cache: AnswerCache::default(),
            // Its own until the proxy's is shared ([`Shim::with_names`]).
            names: Arc::new(NameBudgets::new(
                crate::limits::names::MAX_NAMES_PER_ORG,
                Some(metrics.new_names_total.clone()),
            )),
            synthetic: crate::handout::synthetic::Synthetic::from_config(&config).map(Arc::new),
            jit: None,
            served,
            resolver,
            evidence,
            metrics,
            bindings,
            config,
        }
    }

    /// Answer synthetic orgs from `synthetic`, the mappings the proxy
    /// reads too.
    pub(crate) fn with_synthetic(
        mut self,
        synthetic: Option<Arc<crate::handout::synthetic::Synthetic>>,
    ) -> Shim {
        self.synthetic = synthetic;
        self
    }

    /// Take misses to `jit`, the approvals and grants the proxy uses too.
    pub(crate) fn with_jit(mut self, jit: Arc<crate::jit::Jit>) -> Shim {
        self.jit = Some(jit);
        self
    }

    /// Charge records to `budget`, the evidence budget the proxy charges
    /// too (`[evidence] max_records_per_second_per_org`).
    pub(crate) fn with_evidence_budget(mut self, budget: Arc<EvidenceBudget>) -> Shim {
        self.refusals.set_budget(budget);
        self
    }

    /// Spend new names from `names`, the budgets the proxy spends from
    /// too, so that a name counts once however it leaves.
    pub(crate) fn with_names(mut self, names: Arc<NameBudgets>) -> Shim {
        self.names = names;
        self
    }

    /// `ttl` within `min_ttl`..`max_ttl`.
    pub(super) fn clamp_ttl(&self, ttl: u32) -> u32 {
        clamp_ttl(&self.config, ttl)
    }
}
