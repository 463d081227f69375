//! The context every connection shares ([`Ctx`]: what is served, evidence,
//! metrics, the resolver, limits, shutdown) and one decision's view of what
//! is served ([`View`]). The bottom of the proxy's layers: it names none of
//! the files above it.

use foldhash::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

use super::denials::{self, Denials};
use super::pool::UpstreamPool;
use crate::config::{Limits, TokenDigest};
use crate::evidence::{Evidence, Record};
use crate::handout::bindings::NameBindings;
use crate::limits::volume::Exceeded;
use crate::limits::{ConnLimits, DetectMemory, DetectScope, Lease, NameBudgets, Volumes};
use crate::metrics::Metrics;
use crate::policy::{Credential, IdentityError, OrgRef, Reason, Verdict};
use crate::resolve::Resolver;
use crate::served::{Served, ServedHandle};

/// Detail of a `limit_exceeded` when detection buffers are all in use.
pub(crate) const DETECT_BUDGET_EXHAUSTED: &str =
    "max_detect_memory_bytes (or the share of this org or address) in use: no room to read the first bytes";

/// Everything a connection handler needs, shared by all connections.
pub(crate) struct Ctx {
    /// What is served (policy, interception, credentials); a reload swaps
    /// it whole. Read it through [`Ctx::view`]: once per decision.
    pub served: ServedHandle,
    pub evidence: Arc<Evidence>,
    pub metrics: Arc<Metrics>,
    pub resolver: Arc<Resolver>,
    /// The DNS shim's bindings, when it runs.
    pub bindings: Option<Arc<dyn NameBindings>>,
    /// The synthetic pools' mappings, when a pool is set: a connection to
    /// a pool address stands for the name bound to it.
    pub synthetic: Option<Arc<crate::handout::synthetic::Synthetic>>,
    pub limits: Limits,
    /// The new-name budgets of wildcard rules, shared with the DNS shim.
    pub names: Arc<NameBudgets>,
    /// The volume budgets of allow rules and orgs, kept across reloads.
    pub volumes: Arc<Volumes>,
    pub conns: ConnLimits,
    /// Which denials are written one by one, and the tallies of the rest.
    pub denials: Denials,
    /// Memory held for first bytes before decisions: a global pool, a
    /// share per org and per address of no org (see [`DetectMemory`]).
    pub detect: DetectMemory,
    /// Refused connections being drained before close (bounded).
    pub refusal_drains: Arc<tokio::sync::Semaphore>,
    /// Idle upstream connections of absolute-form HTTP kept for reuse.
    pub upstream_pool: Arc<UpstreamPool>,
    /// Stop accepting; finish in-flight requests.
    pub shutdown: CancellationToken,
    /// The drain grace period is over: close tunnels now.
    pub hard_stop: CancellationToken,
    /// Told after a reload swapped `served`: live connections are decided
    /// again under it ([`super::revoke`]).
    pub policy_changed: tokio::sync::watch::Sender<()>,
    pub tasks: TaskTracker,
    /// `[enforcement]`: whether the gateway ruleset is verified now.
    pub enforcement: Option<Arc<crate::enforcement::Enforcement>>,
    /// Checked addresses dialled elsewhere (tests only; none in service).
    pub routes: Routes,
    /// The OTLP export, if on: where connection spans start.
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// Approvals and grants (`crate::jit`), shared with the DNS shim and
    /// the admin endpoints.
    pub jit: Arc<crate::jit::Jit>,
}

/// One decision's view of what is served: the [`Served`] state as it was
/// when the request arrived (its `policy`, `intercept` and credentials are
/// reached through this view), and the client's org in it. Everything
/// about one request (org, decision, interception, the policy hash in its
/// records) comes from the same view, whatever a reload does meanwhile.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub served: Arc<Served>,
    pub org: Option<OrgRef>,
    /// The digest of the token the client presented for `org`, if it did:
    /// what finds the org again after a reload ([`Policy::org_again`]).
    ///
    /// [`Policy::org_again`]: crate::policy::Policy::org_again
    pub token: Option<TokenDigest>,
}

impl std::ops::Deref for View {
    type Target = Served;

    fn deref(&self) -> &Served {
        &self.served
    }
}

impl View {
    /// Whether the client's org only reports its allowlist's denials.
    pub(crate) fn is_report(&self) -> bool {
        self.org.as_ref().is_some_and(|o| self.policy.is_report(o))
    }

    /// A verdict of this view's org, decided without a rule.
    pub(crate) fn verdict(&self, reason: Reason) -> Verdict {
        Verdict {
            org: self.org.clone(),
            reason,
            rule: None,
            would_deny: None,
        }
    }
}

impl Ctx {
    /// The volume budgets an allowed `verdict` spends from (its rule's
    /// and its org's, [`crate::limits::volume`]), checked at admission:
    /// `Ok` with the lease its relay charges (`None`: no budget applies),
    /// `Err` when one is spent. A report-mode org is let through,
    /// `volume_exceeded` set as the verdict's `would_deny`.
    pub(crate) fn admit_volume(
        &self,
        view: &View,
        verdict: &mut Verdict,
    ) -> Result<Option<Lease>, Exceeded> {
        let Some(org) = &verdict.org else {
            return Ok(None);
        };
        let budgets = match &verdict.rule {
            Some(rule) => view.policy.volume(org, rule),
            None => (None, view.policy.volume(org, "").1),
        };
        let rule = verdict.rule.clone().unwrap_or_else(|| Arc::from(""));
        let now = std::time::Instant::now();
        match self.volumes.admit(&org.name, &rule, budgets, now) {
            Ok(lease) => Ok(lease),
            Err(e) if view.is_report() => {
                verdict.would_deny.get_or_insert(Reason::VolumeExceeded);
                Ok(e.lease)
            }
            Err(e) => Err(e),
        }
    }

    /// What is served now, and the client's org in it.
    pub(crate) fn view(&self, client: IpAddr) -> View {
        let served = self.served.load_full();
        let org = served.policy.org_for(client);
        View {
            served,
            org,
            token: None,
        }
    }

    /// What is served now, and the org of a client that presented
    /// `credential` (see the identity table in [`crate::policy`]). On
    /// failure, a view without an org to record the refusal under.
    pub(crate) fn view_as(
        &self,
        client: IpAddr,
        credential: Option<Credential<'_>>,
    ) -> Result<View, (View, IdentityError)> {
        let served = self.served.load_full();
        let token = credential.as_ref().map(|c| TokenDigest::of(c.token));
        match served.policy.org_for_identity(client, credential) {
            Ok(org) => Ok(View { served, org, token }),
            Err(e) => Err((
                View {
                    served,
                    org: None,
                    token: None,
                },
                e,
            )),
        }
    }

    /// Write a record and wait until it is with the operating system.
    /// `false` means evidence is unavailable and the caller must not let
    /// anything through. A denial over its client's record rate is counted
    /// into a summary instead (its id becomes [`denials::SUMMARISED`]).
    pub(crate) async fn write(&self, record: &mut Record) -> bool {
        if self.summarised(record) {
            return true;
        }
        match self.evidence.write(record).await {
            Ok(()) => {
                self.metrics.count_record(record);
                crate::otel::annotate_record(record);
                true
            }
            Err(e) => {
                warn!(error = %e, "evidence write failed; denying");
                false
            }
        }
    }

    /// Whether `record`, a denial over its client's record rate, was
    /// counted into a summary (and in the metrics) rather than written.
    fn summarised(&self, record: &mut Record) -> bool {
        // Only denials are: the clocks are read for them alone.
        if denials::counted(record).is_none() {
            return false;
        }
        let now = (std::time::Instant::now(), std::time::SystemTime::now());
        if self.denials.admit(record, now.0, now.1) {
            return false;
        }
        record.id = denials::SUMMARISED.to_string();
        // What the client is shown: the summary, not a record of its own.
        record.reference = Some(denials::SUMMARISED.to_string());
        self.metrics.count_record(record);
        let org = record.org.as_deref().unwrap_or(crate::metrics::UNKNOWN_ORG);
        self.metrics
            .evidence_suppressed_total
            .with_label_values(&[org])
            .inc();
        true
    }

    /// Queue a record without waiting (close records, refusals that let
    /// nothing through). Its id is assigned at once; it is never dropped,
    /// but a denial over its client's record rate goes into a summary.
    pub(crate) fn submit(&self, record: &mut Record) {
        if self.summarised(record) {
            return;
        }
        self.evidence.submit(record);
        self.metrics.count_record(record);
    }

    /// Write the denial summaries (every [`denials::SUMMARY_INTERVAL`],
    /// and once at shutdown), counted in the metrics' record totals.
    pub(crate) async fn flush_denials(&self) {
        self.denials.flush(&self.evidence).await;
    }

    /// Where the first bytes of `client`, of `view`'s org, are charged.
    pub(crate) fn detect_scope(&self, view: &View, client: SocketAddr) -> DetectScope<'_> {
        self.detect.scope(view.org.as_ref(), client.ip())
    }
}

/// Checked addresses dialled somewhere else: none in service. A test of
/// the whole proxy without root ([`crate::app::Started::route_upstream`])
/// routes an address its policy allows to a server of its own on
/// loopback (which the policy denies). Decisions and records name the
/// checked address; only the socket's far end differs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Routes(Arc<HashMap<SocketAddr, SocketAddr>>);

impl Routes {
    /// Dial `to` for `from` from now on.
    pub(crate) fn insert(&mut self, from: SocketAddr, to: SocketAddr) {
        Arc::make_mut(&mut self.0).insert(from, to);
    }

    /// Where `addr` is dialled.
    pub(crate) fn of(&self, addr: SocketAddr) -> SocketAddr {
        self.0.get(&addr).copied().unwrap_or(addr)
    }
}
