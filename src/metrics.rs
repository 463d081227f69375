//! Prometheus metrics, exactly the CONTRACT's names and labels. Label values
//! are bounded: org names from the config (or `unknown`), reason codes,
//! modes and directions; never a host name or client address.
//!
//! One [`Metrics`] value is made by [`crate::app`] and handed to whatever
//! counts (the proxy's `Ctx`, the DNS shim, the admin listener); there is
//! no global. Decisions and close records are counted in one place,
//! [`Metrics::count_record`], for every mode. Evidence keeps its own
//! counters (in [`crate::evidence::Live`]), read when `/metrics` is scraped.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::evidence::{Event, Live, Mode, Record};
use crate::policy::{OrgRef, Reason};

/// Values of the `mode` label of `palisade_connections_total`.
pub(crate) const MODES: &[&str] = &["explicit", "transparent", "socks5"];

/// Label value for clients that match no org.
pub(crate) const UNKNOWN_ORG: &str = "unknown";

/// All of Palisade's metrics, registered in one registry.
pub(crate) struct Metrics {
    registry: Registry,
    pub connections_total: IntCounterVec,
    pub dns_queries_total: IntCounterVec,
    pub active_connections: IntGaugeVec,
    pub bytes_total: IntCounterVec,
    pub decision_duration_seconds: HistogramVec,
    /// `decision_duration_seconds` of each mode, looked up once: a series
    /// appears with its first decision, as before, and every later one
    /// skips the label lookup.
    decision_durations: [OnceLock<Histogram>; 4],
    pub policy_reloads_total: IntCounterVec,
    /// 1, labelled with the version, the policy hash being served and the
    /// evidence replica (set at each scrape).
    build_info: IntGaugeVec,
    /// `[evidence] replica`, the `replica` label of `palisade_build_info`.
    replica: String,
    /// Unix time the served policy was loaded (set at each scrape).
    policy_loaded_timestamp_seconds: Gauge,
    /// Failed upstream connects by kind (timeout, refused, unreachable, other).
    pub upstream_connect_errors_total: IntCounterVec,
    /// Upstream name resolution time by result (ok, error).
    pub resolve_duration_seconds: HistogramVec,
    /// Report mode: decisions let through that enforcement would have denied.
    pub would_deny_total: IntCounterVec,
    /// Decisions counted into summary records instead of written one by
    /// one (proxy denials, DNS refusals), by org.
    pub evidence_suppressed_total: IntCounterVec,
    /// Live connections closed because a reload's new policy denies them,
    /// by org and mode.
    pub connections_revoked_total: IntCounterVec,
    /// Names new to an org under a wildcard rule's budget, by org and
    /// decision (`allow` within the budget, `deny` past it).
    pub new_names_total: IntCounterVec,
    /// Misses put to the decider, by org and answer (`allow`, `deny`,
    /// `ask`, `error`, `busy`).
    pub decider_consultations_total: IntCounterVec,
    /// Connections and requests refused, and tunnels cut, because a volume
    /// budget is spent, by org and direction.
    pub volume_exceeded_total: IntCounterVec,
    /// 1 while /readyz would answer 200 (set at each scrape).
    ready: IntGauge,
    /// Requests decided inside intercepted connections, by org, decision and reason.
    pub intercepted_requests_total: IntCounterVec,
    /// Time from an intercepted request's arrival to its response head, by org.
    pub intercepted_request_duration_seconds: HistogramVec,
    /// Minted-certificate cache lookups and evictions (result: hit, miss, evict).
    pub intercept_cert_cache_total: IntCounterVec,
    /// Minted certificates held.
    pub intercept_cert_cache_entries: IntGauge,
    /// Upstream TLS handshakes of intercepted connections that failed, by org.
    pub upstream_tls_errors_total: IntCounterVec,
    /// Idle upstream connections kept for reuse (absolute-form HTTP).
    pub upstream_idle_connections: IntGauge,
    /// Forwarded requests sent over a reused upstream connection.
    pub upstream_reused_total: IntCounter,
    /// Packets the gateway ruleset rejected and logged to `[bypass]
    /// nflog_group`, by org and protocol ([`crate::bypass`]).
    pub bypass_attempts_total: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// Latency buckets from 100 µs to 5 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0,
    ]
}

const EVIDENCE_RECORDS: (&str, &str) = (
    "palisade_evidence_records_total",
    "Evidence records written.",
);
const EVIDENCE_WRITE_ERRORS: (&str, &str) = (
    "palisade_evidence_write_errors_total",
    "Evidence writes that failed.",
);
const EVIDENCE_QUEUE_DEPTH: (&str, &str) = (
    "palisade_evidence_queue_depth",
    "Evidence records appended and not yet taken by a write.",
);
const EVIDENCE_DISK_FREE: (&str, &str) = (
    "palisade_evidence_disk_free_bytes",
    "Bytes free (for unprivileged writers) on the file system of the evidence dir, read at scrape time.",
);
const EVIDENCE_DISK_SIZE: (&str, &str) = (
    "palisade_evidence_disk_size_bytes",
    "Size in bytes of the file system of the evidence dir, read at scrape time.",
);

const EVIDENCE_STORE_FULL: (&str, &str) = (
    "palisade_evidence_store_full",
    "1 while the evidence store is full (retain_size reached with nothing older than retain_min_age, or free space below min_free), else 0.",
);
const EVIDENCE_RETAINED: (&str, &str) = (
    "palisade_evidence_retained_bytes",
    "Bytes of records by org in the evidence segments on disk written since start.",
);
const EVIDENCE_OVER_SHARE: (&str, &str) = (
    "palisade_evidence_over_share",
    "1 while the store is full and the org holds more than its share of it: its allows are refused limit_exceeded and its denials summarised.",
);

const WITNESS_COSIGNED: (&str, &str) = (
    "palisade_witness_cosigned_total",
    "Checkpoints the witness cosigned ([evidence] witnesses).",
);
const WITNESS_CONFLICTS: (&str, &str) = (
    "palisade_witness_conflicts_total",
    "Checkpoints the witness refused as inconsistent with what it cosigned before (409 with a size not ours, 422): a rewritten or forked history.",
);
const WITNESS_FAILURES: (&str, &str) = (
    "palisade_witness_failures_total",
    "Submissions to the witness that failed otherwise, by reason (unreachable, timeout, unknown_log, forbidden, bad_request, bad_reply, no_proof); retried with backoff.",
);
const WITNESS_TREE_SIZE: (&str, &str) = (
    "palisade_witness_tree_size",
    "The tree size the witness last cosigned (0 before the first).",
);
const WITNESS_FEED_DROPPED: (&str, &str) = (
    "palisade_witness_feed_dropped_total",
    "Writes whose leaves the witnesses' full queue could not take (the submitter reads the store instead).",
);

/// A metric's name and help text.
type Def = (&'static str, &'static str);

/// Makes each metric and registers it in one step, so the list of
/// metrics is written once (in [`Metrics::build`]).
struct Registrar(Registry);

impl Registrar {
    fn add<C: Collector + Clone + 'static>(
        &self,
        made: Result<C, prometheus::Error>,
    ) -> Result<C, prometheus::Error> {
        let c = made?;
        self.0.register(Box::new(c.clone()))?;
        Ok(c)
    }

    fn counters(
        &self,
        (name, help): Def,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels))
    }

    fn counter(&self, (name, help): Def) -> Result<IntCounter, prometheus::Error> {
        self.add(IntCounter::new(name, help))
    }

    fn gauges(&self, (name, help): Def, labels: &[&str]) -> Result<IntGaugeVec, prometheus::Error> {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels))
    }

    fn gauge(&self, (name, help): Def) -> Result<IntGauge, prometheus::Error> {
        self.add(IntGauge::new(name, help))
    }

    fn float_gauge(&self, (name, help): Def) -> Result<Gauge, prometheus::Error> {
        self.add(Gauge::new(name, help))
    }

    /// A histogram over [`latency_buckets`].
    fn latencies(
        &self,
        (name, help): Def,
        labels: &[&str],
    ) -> Result<HistogramVec, prometheus::Error> {
        let opts = HistogramOpts::new(name, help).buckets(latency_buckets());
        self.add(HistogramVec::new(opts, labels))
    }
}

// The metrics of [`Metrics`], each a name and help text, in the order
// of its fields.
const CONNECTIONS_TOTAL: Def = (
    "palisade_connections_total",
    "Proxy decisions (connections and HTTP requests) by org, decision, reason and mode.",
);
const DNS_QUERIES_TOTAL: Def = (
    "palisade_dns_queries_total",
    "DNS shim queries by org, decision and reason.",
);
const ACTIVE_CONNECTIONS: Def = (
    "palisade_active_connections",
    "Client connections currently open, by org.",
);
const BYTES_TOTAL: Def = (
    "palisade_bytes_total",
    "Bytes relayed by org and direction (up: client to upstream).",
);
const DECISION_DURATION_SECONDS: Def = (
    "palisade_decision_duration_seconds",
    "Time to decide (including resolution), by mode.",
);
const POLICY_RELOADS_TOTAL: Def = (
    "palisade_policy_reloads_total",
    "Policy reloads by result (ok, error).",
);
const BUILD_INFO: Def = (
    "palisade_build_info",
    "Version, served policy hash and evidence replica (value 1).",
);
const POLICY_LOADED_TIMESTAMP_SECONDS: Def = (
    "palisade_policy_loaded_timestamp_seconds",
    "Unix time the served policy was loaded.",
);
const UPSTREAM_CONNECT_ERRORS_TOTAL: Def = (
    "palisade_upstream_connect_errors_total",
    "Failed TCP connects to upstream addresses, by kind.",
);
const RESOLVE_DURATION_SECONDS: Def = (
    "palisade_resolve_duration_seconds",
    "Upstream name resolution time, by result.",
);
const WOULD_DENY_TOTAL: Def = (
    "palisade_would_deny_total",
    "Report-mode orgs: decisions allowed that enforcement would have denied, by org, mode and the reason it would have used.",
);
const EVIDENCE_SUPPRESSED_TOTAL: Def = (
    "palisade_evidence_suppressed_total",
    "Decisions folded into summary records instead of written one by one (proxy denials over their record rates or their org's evidence budget, DNS refusals over the evidence budget or without room in the writer's queue), by org.",
);
const CONNECTIONS_REVOKED_TOTAL: Def = (
    "palisade_connections_revoked_total",
    "Live connections (tunnels, transparent and intercepted connections) closed because a reload's new policy denies them, by org and mode; report-mode orgs keep theirs and are not counted.",
);
const NEW_NAMES_TOTAL: Def = (
    "palisade_new_names_total",
    "Names new to an org within the window under a wildcard allow rule's max_new_names_per_minute (DNS queries forwarded, connections decided), by org and decision: allow within the budget, deny past it (name_budget_exceeded).",
);
const DECIDER_CONSULTATIONS_TOTAL: Def = (
    "palisade_decider_consultations_total",
    "Misses put to the decider ([decider] url), by org and answer: allow, deny, ask, error (a timeout, a failed exchange, an answer not understood: denied) and busy (over max_in_flight: denied without asking).",
);
const VOLUME_EXCEEDED_TOTAL: Def = (
    "palisade_volume_exceeded_total",
    "Connections and requests refused, and live tunnels cut, because a volume budget (max_bytes_up, max_bytes_down over volume_window, of the rule or the org) is spent, by org and direction (up: client to upstream, down: back); report-mode orgs counted too.",
);
const READY: Def = (
    "palisade_ready",
    "1 while every listener is bound and evidence is writable (what /readyz reports).",
);
const INTERCEPTED_REQUESTS_TOTAL: Def = (
    "palisade_intercepted_requests_total",
    "Requests decided inside intercepted TLS connections, by org, decision and reason.",
);
const INTERCEPTED_REQUEST_DURATION_SECONDS: Def = (
    "palisade_intercepted_request_duration_seconds",
    "Intercepted request: arrival to upstream response head, by org.",
);
const INTERCEPT_CERT_CACHE_TOTAL: Def = (
    "palisade_intercept_cert_cache_total",
    "Minted-certificate cache: lookups (hit, miss) and evictions (evict).",
);
const INTERCEPT_CERT_CACHE_ENTRIES: Def = (
    "palisade_intercept_cert_cache_entries",
    "Minted certificates held in the cache.",
);
const UPSTREAM_TLS_ERRORS_TOTAL: Def = (
    "palisade_upstream_tls_errors_total",
    "Failed upstream TLS handshakes of intercepted connections, by org.",
);
const UPSTREAM_IDLE_CONNECTIONS: Def = (
    "palisade_upstream_idle_connections",
    "Idle upstream connections kept for reuse by forwarded HTTP requests.",
);
const UPSTREAM_REUSED_TOTAL: Def = (
    "palisade_upstream_reused_total",
    "Forwarded HTTP requests sent over a reused upstream connection.",
);
const BYPASS_ATTEMPTS_TOTAL: Def = (
    "palisade_bypass_attempts_total",
    "Packets the gateway ruleset rejected instead of redirecting and logged to [bypass] nflog_group (UDP, QUIC, direct connections to the gateway), by org and protocol.",
);

/// The evidence writer's own counters, exposed as they are at scrape time.
struct EvidenceCollector {
    live: Arc<Live>,
    descs: Vec<Desc>,
}

impl EvidenceCollector {
    fn new(live: Arc<Live>) -> Result<EvidenceCollector, prometheus::Error> {
        let mut descs = Vec::new();
        for (name, help) in [
            EVIDENCE_RECORDS,
            EVIDENCE_WRITE_ERRORS,
            EVIDENCE_QUEUE_DEPTH,
            EVIDENCE_DISK_FREE,
            EVIDENCE_DISK_SIZE,
            EVIDENCE_STORE_FULL,
            WITNESS_FEED_DROPPED,
        ] {
            descs.push(Desc::new(
                name.into(),
                help.into(),
                Vec::new(),
                Default::default(),
            )?);
        }
        for (name, help) in [EVIDENCE_RETAINED, EVIDENCE_OVER_SHARE] {
            descs.push(Desc::new(
                name.into(),
                help.into(),
                vec!["org".into()],
                Default::default(),
            )?);
        }
        for ((name, help), labels) in [
            (WITNESS_COSIGNED, &["witness"][..]),
            (WITNESS_CONFLICTS, &["witness"][..]),
            (WITNESS_TREE_SIZE, &["witness"][..]),
            (WITNESS_FAILURES, &["reason", "witness"][..]),
        ] {
            descs.push(Desc::new(
                name.into(),
                help.into(),
                labels.iter().map(|l| l.to_string()).collect(),
                Default::default(),
            )?);
        }
        Ok(EvidenceCollector { live, descs })
    }

    fn families(&self) -> Result<Vec<MetricFamily>, prometheus::Error> {
        let c = &self.live;
        let mut out = Vec::with_capacity(3);
        for ((name, help), value) in [
            (EVIDENCE_RECORDS, c.records_written()),
            (EVIDENCE_WRITE_ERRORS, c.write_errors()),
            (WITNESS_FEED_DROPPED, c.witness_feed_drops()),
        ] {
            let counter = IntCounter::new(name, help)?;
            counter.inc_by(value);
            out.extend(counter.collect());
        }
        let (name, help) = EVIDENCE_QUEUE_DEPTH;
        let depth = IntGauge::new(name, help)?;
        depth.set(i64::try_from(c.queue_depth()).unwrap_or(i64::MAX));
        out.extend(depth.collect());
        if let Some((free, size)) = c.disk_space() {
            for ((name, help), value) in [(EVIDENCE_DISK_FREE, free), (EVIDENCE_DISK_SIZE, size)] {
                let gauge = IntGauge::new(name, help)?;
                gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
                out.extend(gauge.collect());
            }
        }
        let (name, help) = EVIDENCE_STORE_FULL;
        let full = IntGauge::new(name, help)?;
        full.set(i64::from(c.store().is_full()));
        out.extend(full.collect());
        let shares = c.store().shares();
        let retained = IntGaugeVec::new(
            Opts::new(EVIDENCE_RETAINED.0, EVIDENCE_RETAINED.1),
            &["org"],
        )?;
        let over = IntGaugeVec::new(
            Opts::new(EVIDENCE_OVER_SHARE.0, EVIDENCE_OVER_SHARE.1),
            &["org"],
        )?;
        for (payer, bytes, is_over) in &shares {
            let org = payer.as_deref().unwrap_or("unknown");
            retained
                .with_label_values(&[org])
                .set(i64::try_from(*bytes).unwrap_or(i64::MAX));
            over.with_label_values(&[org]).set(i64::from(*is_over));
        }
        // A family without series cannot be encoded.
        if !shares.is_empty() {
            out.extend(retained.collect());
            out.extend(over.collect());
        }
        out.extend(witness_families(&c.witnesses())?);
        Ok(out)
    }
}

/// Each witness's series (none without witnesses).
fn witness_families(
    witnesses: &[crate::evidence::WitnessCounts],
) -> Result<Vec<MetricFamily>, prometheus::Error> {
    if witnesses.is_empty() {
        return Ok(Vec::new());
    }
    let vec = |(name, help): (&str, &str), labels: &[&str]| {
        prometheus::IntCounterVec::new(Opts::new(name, help), labels)
    };
    let cosigned = vec(WITNESS_COSIGNED, &["witness"])?;
    let conflicts = vec(WITNESS_CONFLICTS, &["witness"])?;
    let failures = vec(WITNESS_FAILURES, &["reason", "witness"])?;
    let size = IntGaugeVec::new(
        Opts::new(WITNESS_TREE_SIZE.0, WITNESS_TREE_SIZE.1),
        &["witness"],
    )?;
    for w in witnesses {
        let name = w.name.as_str();
        cosigned.with_label_values(&[name]).inc_by(w.cosigned);
        conflicts.with_label_values(&[name]).inc_by(w.conflicts);
        // Every reason exists from the start, at zero: alerts need the series.
        for reason in crate::evidence::witness::REASONS {
            let n = w.failures.get(reason).copied().unwrap_or(0);
            failures.with_label_values(&[reason, name]).inc_by(n);
        }
        size.with_label_values(&[name])
            .set(i64::try_from(w.size).unwrap_or(i64::MAX));
    }
    let mut out = cosigned.collect();
    out.extend(conflicts.collect());
    out.extend(failures.collect());
    out.extend(size.collect());
    Ok(out)
}

impl Collector for EvidenceCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Names and help are constants: this cannot fail once registered.
        self.families().unwrap_or_default()
    }
}

/// One `palisade_dns_queries_total` series, kept with the answer whose
/// queries it counts ([`Metrics::count_dns_record`]).
#[derive(Debug)]
pub(crate) struct DnsSeries {
    org: Arc<str>,
    reason: Reason,
    counter: IntCounter,
}

impl Metrics {
    /// Every metric, registered, with the series that exist from the start;
    /// the evidence series read `evidence` at each scrape.
    pub(crate) fn new(evidence: Arc<Live>) -> Metrics {
        match Metrics::build(evidence) {
            Ok(m) => m,
            // Static names and labels: failing here is a programming error caught by the tests.
            Err(e) => panic!("metric registration: {e}"),
        }
    }

    fn build(evidence: Arc<Live>) -> Result<Metrics, prometheus::Error> {
        let r = Registrar(Registry::new());
        let m = Metrics {
            connections_total: r
                .counters(CONNECTIONS_TOTAL, &["org", "decision", "reason", "mode"])?,
            dns_queries_total: r.counters(DNS_QUERIES_TOTAL, &["org", "decision", "reason"])?,
            active_connections: r.gauges(ACTIVE_CONNECTIONS, &["org"])?,
            bytes_total: r.counters(BYTES_TOTAL, &["org", "direction"])?,
            decision_duration_seconds: r.latencies(DECISION_DURATION_SECONDS, &["mode"])?,
            decision_durations: Default::default(),
            policy_reloads_total: r.counters(POLICY_RELOADS_TOTAL, &["result"])?,
            build_info: r.gauges(BUILD_INFO, &["version", "policy", "replica"])?,
            replica: evidence.replica().to_string(),
            policy_loaded_timestamp_seconds: r.float_gauge(POLICY_LOADED_TIMESTAMP_SECONDS)?,
            upstream_connect_errors_total: r.counters(UPSTREAM_CONNECT_ERRORS_TOTAL, &["kind"])?,
            resolve_duration_seconds: r.latencies(RESOLVE_DURATION_SECONDS, &["result"])?,
            would_deny_total: r.counters(WOULD_DENY_TOTAL, &["org", "mode", "reason"])?,
            evidence_suppressed_total: r.counters(EVIDENCE_SUPPRESSED_TOTAL, &["org"])?,
            connections_revoked_total: r.counters(CONNECTIONS_REVOKED_TOTAL, &["org", "mode"])?,
            new_names_total: r.counters(NEW_NAMES_TOTAL, &["org", "decision"])?,
            decider_consultations_total: r
                .counters(DECIDER_CONSULTATIONS_TOTAL, &["org", "answer"])?,
            volume_exceeded_total: r.counters(VOLUME_EXCEEDED_TOTAL, &["org", "direction"])?,
            ready: r.gauge(READY)?,
            intercepted_requests_total: r
                .counters(INTERCEPTED_REQUESTS_TOTAL, &["org", "decision", "reason"])?,
            intercepted_request_duration_seconds: r
                .latencies(INTERCEPTED_REQUEST_DURATION_SECONDS, &["org"])?,
            intercept_cert_cache_total: r.counters(INTERCEPT_CERT_CACHE_TOTAL, &["result"])?,
            intercept_cert_cache_entries: r.gauge(INTERCEPT_CERT_CACHE_ENTRIES)?,
            upstream_tls_errors_total: r.counters(UPSTREAM_TLS_ERRORS_TOTAL, &["org"])?,
            upstream_idle_connections: r.gauge(UPSTREAM_IDLE_CONNECTIONS)?,
            upstream_reused_total: r.counter(UPSTREAM_REUSED_TOTAL)?,
            bypass_attempts_total: r.counters(BYPASS_ATTEMPTS_TOTAL, &["org", "proto"])?,
            registry: r.0.clone(),
        };
        r.0.register(Box::new(EvidenceCollector::new(evidence)?))?;
        // process_cpu_seconds_total, process_open_fds, process_resident_memory_bytes, ...
        r.0.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        // Series that exist from the start, so dashboards and alerts see zeros.
        for result in ["ok", "error"] {
            m.policy_reloads_total.with_label_values(&[result]);
        }
        for kind in ["timeout", "refused", "unreachable", "other", "no_address"] {
            m.upstream_connect_errors_total.with_label_values(&[kind]);
        }
        for result in ["hit", "miss", "evict"] {
            m.intercept_cert_cache_total.with_label_values(&[result]);
        }
        Ok(m)
    }

    /// `palisade_enforcement_ok`, registered now: only a config with
    /// `[enforcement]` has it (a 0 then means something, never "unset").
    pub(crate) fn enforcement_gauge(&self) -> IntGauge {
        let gauge = IntGauge::new(
            "palisade_enforcement_ok",
            "1 while the kernel has the tables of [enforcement] ruleset loaded as the file defines them, 0 while it does not (or cannot be read).",
        )
        .expect("a valid metric name");
        // Registered once per process (app::run calls this once).
        let _ = self.registry.register(Box::new(gauge.clone()));
        gauge
    }

    /// `palisade_otel_dropped_total{signal}`, registered now: only an
    /// instance that exports (`[otel]` or the environment) has it.
    pub(crate) fn otel_dropped(&self) -> IntCounterVec {
        let counter = IntCounterVec::new(
            Opts::new(
                "palisade_otel_dropped_total",
                "Log records (signal=logs) and spans (signal=traces) the OTLP export lost: its bounded queue was full, or the collector did not take the batch. The evidence has them all.",
            ),
            &["signal"],
        )
        .expect("a valid metric name");
        for signal in ["logs", "traces"] {
            counter.with_label_values(&[signal]);
        }
        // Registered once per process (app::run calls this once).
        let _ = self.registry.register(Box::new(counter.clone()));
        counter
    }

    /// Count a decision or close record as it is written, for every mode
    /// (proxy and DNS alike): decisions by org, decision, reason and mode
    /// (DNS in `palisade_dns_queries_total`), report-mode decisions by what
    /// enforcement would have done; close records add their bytes.
    pub(crate) fn count_record(&self, record: &Record) {
        let org = record.org.as_deref().unwrap_or(UNKNOWN_ORG);
        match record.event {
            Event::Decision => {
                if let Some(said) = &record.decider {
                    self.decider_consultations_total
                        .with_label_values(&[org, said.label()])
                        .inc();
                }
                let mode = record.mode.as_str();
                if let Some(would) = record.would_deny {
                    self.would_deny_total
                        .with_label_values(&[org, mode, would.as_str()])
                        .inc();
                }
                if record.mode == Mode::Dns {
                    self.dns_queries_total
                        .with_label_values(&[org, record.decision_str(), record.reason.as_str()])
                        .inc();
                } else {
                    self.connections_total
                        .with_label_values(&[
                            org,
                            record.decision_str(),
                            record.reason.as_str(),
                            mode,
                        ])
                        .inc();
                }
            }
            Event::Close => {
                for (direction, bytes) in [("up", record.bytes_up), ("down", record.bytes_down)] {
                    self.bytes_total
                        .with_label_values(&[org, direction])
                        .inc_by(bytes.unwrap_or(0));
                }
            }
            // The enforcement check's own records: its gauge says it.
            Event::Failed | Event::Verified => {}
            // Grant records: counted by reason as they end, nothing else.
            Event::Granted | Event::Expired | Event::Revoked | Event::UsedUp => {}
        }
    }

    /// [`Metrics::count_record`] for the records of one kept DNS answer
    /// (one org, one name): their `palisade_dns_queries_total` series is
    /// looked up once and kept in `series`, not by its labels per query.
    /// A record that counts elsewhere too (a decider's, report mode's) or
    /// under other labels than those kept is counted the general way.
    pub(crate) fn count_dns_record(&self, record: &Record, series: &OnceLock<DnsSeries>) {
        let plain = record.event == Event::Decision
            && record.mode == Mode::Dns
            && record.decider.is_none()
            && record.would_deny.is_none();
        let Some(org) = record.org.as_ref().filter(|_| plain) else {
            return self.count_record(record);
        };
        let kept = series.get_or_init(|| DnsSeries {
            org: org.clone(),
            reason: record.reason,
            counter: self.dns_queries_total.with_label_values(&[
                org,
                record.decision_str(),
                record.reason.as_str(),
            ]),
        });
        if kept.reason == record.reason && *kept.org == **org {
            kept.counter.inc();
        } else {
            self.count_record(record);
        }
    }

    /// Time one decision under its mode's label.
    pub(crate) fn time_decision(&self, mode: Mode, took: Duration) {
        let i = match mode {
            Mode::Explicit => 0,
            Mode::Transparent => 1,
            Mode::Dns => 2,
            Mode::Socks5 => 3,
        };
        self.decision_durations[i]
            .get_or_init(|| {
                self.decision_duration_seconds
                    .with_label_values(&[mode.as_str()])
            })
            .observe(took.as_secs_f64());
    }

    /// Count one failed connect to an upstream address.
    pub(crate) fn count_connect_error(&self, kind: &str) {
        self.upstream_connect_errors_total
            .with_label_values(&[kind])
            .inc();
    }

    /// Create the zero-valued series of every org (and `unknown`) so that
    /// dashboards and alerts see zeros, not gaps, before the first event.
    /// The label space is bounded: orgs × reason codes × modes.
    pub(crate) fn init_series<'a>(&self, orgs: impl IntoIterator<Item = &'a str>) {
        for org in orgs.into_iter().chain([UNKNOWN_ORG]) {
            for reason in Reason::ALL {
                for mode in MODES {
                    self.connections_total.with_label_values(&[
                        org,
                        reason.decision(),
                        reason.as_str(),
                        mode,
                    ]);
                }
                self.dns_queries_total.with_label_values(&[
                    org,
                    reason.decision(),
                    reason.as_str(),
                ]);
            }
            self.active_connections.with_label_values(&[org]);
            self.evidence_suppressed_total.with_label_values(&[org]);
            for mode in MODES {
                self.connections_revoked_total
                    .with_label_values(&[org, mode]);
            }
            for proto in ["tcp", "udp"] {
                self.bypass_attempts_total.with_label_values(&[org, proto]);
            }
            for decision in ["allow", "deny"] {
                self.new_names_total.with_label_values(&[org, decision]);
            }
            for direction in ["up", "down"] {
                self.bytes_total.with_label_values(&[org, direction]);
                self.volume_exceeded_total
                    .with_label_values(&[org, direction]);
            }
        }
    }

    /// The text exposition of every metric, with what is read at scrape
    /// time: readiness and the policy served (its hash and load time).
    pub(crate) fn render(&self, ready: bool, policy: &str, loaded: SystemTime) -> String {
        self.ready.set(i64::from(ready));
        self.build_info.reset();
        self.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), policy, &self.replica])
            .set(1);
        self.policy_loaded_timestamp_seconds.set(
            loaded
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
        );
        let mut out = Vec::new();
        let families = self.registry.gather();
        if TextEncoder::new().encode(&families, &mut out).is_err() {
            return String::new();
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The org label for an optional org.
pub(crate) fn org_label(org: Option<&OrgRef>) -> &str {
    org.map_or(UNKNOWN_ORG, |o| &o.name)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::evidence::{Evidence, Kind};
    use crate::policy::Verdict;

    fn decision(mode: Mode, org: Option<&str>, reason: Reason) -> Record {
        let verdict = Verdict {
            org: org.map(|name| OrgRef {
                index: 0,
                name: Arc::from(name),
            }),
            reason,
            rule: None,
            would_deny: None,
        };
        let client: SocketAddr = "198.18.1.2:40000".parse().unwrap();
        let kind = if mode == Mode::Dns {
            Kind::Dns
        } else {
            Kind::Tcp
        };
        Record::decision(kind, mode, client, &verdict, &Arc::from("hash"))
    }

    /// The value of one series line of `text`, if present.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn contract_series_exist_at_zero_and_count_what_is_recorded() {
        let dir = crate::testing::scratch("metrics").join("evidence");
        let evidence = Evidence::open(&dir).unwrap();
        let m = Metrics::new(evidence.live().clone());
        m.init_series(["acme"]);
        let text = m.render(true, "abc", SystemTime::now());
        for name in [
            "palisade_connections_total",
            "palisade_dns_queries_total",
            "palisade_active_connections",
            "palisade_bytes_total",
            "palisade_evidence_records_total",
            "palisade_evidence_write_errors_total",
            "palisade_evidence_queue_depth",
            "palisade_evidence_suppressed_total",
            "palisade_connections_revoked_total",
            "palisade_new_names_total",
            "palisade_volume_exceeded_total",
            "palisade_evidence_disk_free_bytes",
            "palisade_evidence_disk_size_bytes",
            "palisade_evidence_store_full",
            "palisade_policy_reloads_total",
            "palisade_build_info",
            "palisade_ready",
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} missing:\n{text}"
            );
        }
        let unknown_explicit = "palisade_connections_total{decision=\"deny\",mode=\"explicit\",org=\"unknown\",reason=\"unknown_client\"}";
        let acme_dns = "palisade_dns_queries_total{decision=\"deny\",org=\"acme\",reason=\"no_matching_rule\"}";
        let acme_socks = "palisade_connections_total{decision=\"allow\",mode=\"socks5\",org=\"acme\",reason=\"rule_match\"}";
        for series in [unknown_explicit, acme_dns, acme_socks] {
            assert_eq!(value(&text, series), Some(0.0), "{series}:\n{text}");
        }
        assert_eq!(
            value(&text, "palisade_policy_reloads_total{result=\"error\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(
                &text,
                &format!(
                    "palisade_build_info{{policy=\"abc\",replica=\"{}\",version=\"{}\"}}",
                    evidence.live().replica(),
                    env!("CARGO_PKG_VERSION")
                )
            ),
            Some(1.0)
        );
        assert_eq!(value(&text, "palisade_ready"), Some(1.0));
        assert_eq!(
            value(&text, "palisade_evidence_suppressed_total{org=\"acme\"}"),
            Some(0.0)
        );
        let free = value(&text, "palisade_evidence_disk_free_bytes").unwrap();
        let size = value(&text, "palisade_evidence_disk_size_bytes").unwrap();
        assert!(free > 0.0 && free <= size, "{free} of {size}");

        // Records as the proxy and the DNS shim write them, through evidence.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut records = [
            decision(Mode::Explicit, None, Reason::UnknownClient),
            decision(Mode::Dns, Some("acme"), Reason::NoMatchingRule),
            decision(Mode::Socks5, Some("acme"), Reason::RuleMatch),
        ];
        for r in &mut records {
            rt.block_on(evidence.write(r)).unwrap();
            m.count_record(r);
        }
        let mut close = records[2].close(10, 20, 1);
        rt.block_on(evidence.write(&mut close)).unwrap();
        m.count_record(&close);
        let text = m.render(false, "def", SystemTime::now());
        for series in [unknown_explicit, acme_dns, acme_socks] {
            assert_eq!(value(&text, series), Some(1.0), "{series}:\n{text}");
        }
        // The store's shares, by org: not full, so nobody is over.
        assert_eq!(value(&text, "palisade_evidence_store_full"), Some(0.0));
        let acme_bytes = value(&text, "palisade_evidence_retained_bytes{org=\"acme\"}");
        assert!(acme_bytes.is_some_and(|b| b > 1000.0), "{text}");
        assert!(value(&text, "palisade_evidence_retained_bytes{org=\"unknown\"}").is_some());
        assert_eq!(
            value(&text, "palisade_evidence_over_share{org=\"acme\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(
                &text,
                "palisade_bytes_total{direction=\"down\",org=\"acme\"}"
            ),
            Some(20.0)
        );
        let written = value(&text, "palisade_evidence_records_total").unwrap();
        assert!(written >= 4.0, "four records written, not {written}");
        assert_eq!(
            value(&text, "palisade_evidence_write_errors_total"),
            Some(0.0)
        );
        assert_eq!(value(&text, "palisade_ready"), Some(0.0));
        assert!(
            !text.contains("policy=\"abc\""),
            "the old policy's build_info is gone:\n{text}"
        );
        drop(evidence);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn report_mode_decisions_count_what_enforcement_would_have_done_for_dns_too() {
        let m = Metrics::new(Arc::default());
        for mode in [Mode::Transparent, Mode::Dns] {
            let mut r = decision(mode, Some("acme"), Reason::ReportOnly);
            r.would_deny = Some(Reason::NoMatchingRule);
            m.count_record(&r);
        }
        let text = m.render(true, "abc", SystemTime::now());
        for mode in ["transparent", "dns"] {
            let series = format!(
                "palisade_would_deny_total{{mode=\"{mode}\",org=\"acme\",reason=\"no_matching_rule\"}}"
            );
            assert_eq!(value(&text, &series), Some(1.0), "{series}:\n{text}");
        }
    }
}
