//! Prometheus metrics, exactly the CONTRACT's names and labels. Label values
//! are bounded: org names from the config (or `unknown`), reason codes,
//! modes and directions; never a host name or client address.

use std::sync::OnceLock;

use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::policy::{OrgRef, Reason};

/// Values of the `mode` label of `palisade_connections_total`.
pub const MODES: &[&str] = &["explicit", "transparent", "socks5"];

/// Label value for clients that match no org.
pub const UNKNOWN_ORG: &str = "unknown";

/// All of Palisade's metrics, registered in one registry.
pub struct Metrics {
    pub registry: Registry,
    pub connections_total: IntCounterVec,
    pub dns_queries_total: IntCounterVec,
    pub active_connections: IntGaugeVec,
    pub bytes_total: IntCounterVec,
    pub decision_duration_seconds: HistogramVec,
    pub evidence_records_total: IntCounter,
    pub evidence_write_errors_total: IntCounter,
    /// Records waiting for the evidence writer.
    pub evidence_queue_depth: IntGauge,
    pub policy_reloads_total: IntCounterVec,
    /// 1, labelled with the version and the policy hash being served.
    pub build_info: IntGaugeVec,
    /// Unix time the served policy was loaded.
    pub policy_loaded_timestamp_seconds: Gauge,
    /// Failed upstream connects by kind (timeout, refused, unreachable, other).
    pub upstream_connect_errors_total: IntCounterVec,
    /// Upstream name resolution time by result (ok, error).
    pub resolve_duration_seconds: HistogramVec,
    /// Report mode: decisions let through that enforcement would have denied.
    pub would_deny_total: IntCounterVec,
    /// 1 while /readyz would answer 200 (set at each scrape).
    pub ready: prometheus::IntGauge,
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
}

/// Latency buckets from 100 µs to 5 s.
fn latency_buckets() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0,
    ]
}

fn build() -> Result<Metrics, prometheus::Error> {
    let registry = Registry::new();
    let counter_vec =
        |name: &str, help: &str, labels: &[&str]| IntCounterVec::new(Opts::new(name, help), labels);
    let m = Metrics {
        connections_total: counter_vec(
            "palisade_connections_total",
            "Proxy decisions (connections and HTTP requests) by org, decision, reason and mode.",
            &["org", "decision", "reason", "mode"],
        )?,
        dns_queries_total: counter_vec(
            "palisade_dns_queries_total",
            "DNS shim queries by org, decision and reason.",
            &["org", "decision", "reason"],
        )?,
        active_connections: IntGaugeVec::new(
            Opts::new(
                "palisade_active_connections",
                "Client connections currently open, by org.",
            ),
            &["org"],
        )?,
        bytes_total: counter_vec(
            "palisade_bytes_total",
            "Bytes relayed by org and direction (up: client to upstream).",
            &["org", "direction"],
        )?,
        decision_duration_seconds: HistogramVec::new(
            HistogramOpts::new(
                "palisade_decision_duration_seconds",
                "Time to decide (including resolution), by mode.",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0,
            ]),
            &["mode"],
        )?,
        evidence_records_total: IntCounter::new(
            "palisade_evidence_records_total",
            "Evidence records written.",
        )?,
        evidence_write_errors_total: IntCounter::new(
            "palisade_evidence_write_errors_total",
            "Evidence writes that failed.",
        )?,
        evidence_queue_depth: IntGauge::new(
            "palisade_evidence_queue_depth",
            "Evidence records queued for the writer thread.",
        )?,
        policy_reloads_total: counter_vec(
            "palisade_policy_reloads_total",
            "Policy reloads by result (ok, error).",
            &["result"],
        )?,
        build_info: IntGaugeVec::new(
            Opts::new(
                "palisade_build_info",
                "Version and served policy hash (value 1).",
            ),
            &["version", "policy"],
        )?,
        policy_loaded_timestamp_seconds: Gauge::new(
            "palisade_policy_loaded_timestamp_seconds",
            "Unix time the served policy was loaded.",
        )?,
        upstream_connect_errors_total: counter_vec(
            "palisade_upstream_connect_errors_total",
            "Failed TCP connects to upstream addresses, by kind.",
            &["kind"],
        )?,
        resolve_duration_seconds: HistogramVec::new(
            HistogramOpts::new(
                "palisade_resolve_duration_seconds",
                "Upstream name resolution time, by result.",
            )
            .buckets(latency_buckets()),
            &["result"],
        )?,
        would_deny_total: counter_vec(
            "palisade_would_deny_total",
            "Report-mode orgs: decisions allowed that enforcement would have denied, by org, mode and the reason it would have used.",
            &["org", "mode", "reason"],
        )?,
        ready: prometheus::IntGauge::new(
            "palisade_ready",
            "1 while every listener is bound and evidence is writable (what /readyz reports).",
        )?,
        intercepted_requests_total: counter_vec(
            "palisade_intercepted_requests_total",
            "Requests decided inside intercepted TLS connections, by org, decision and reason.",
            &["org", "decision", "reason"],
        )?,
        intercepted_request_duration_seconds: HistogramVec::new(
            HistogramOpts::new(
                "palisade_intercepted_request_duration_seconds",
                "Intercepted request: arrival to upstream response head, by org.",
            )
            .buckets(latency_buckets()),
            &["org"],
        )?,
        intercept_cert_cache_total: counter_vec(
            "palisade_intercept_cert_cache_total",
            "Minted-certificate cache: lookups (hit, miss) and evictions (evict).",
            &["result"],
        )?,
        intercept_cert_cache_entries: IntGauge::new(
            "palisade_intercept_cert_cache_entries",
            "Minted certificates held in the cache.",
        )?,
        upstream_tls_errors_total: counter_vec(
            "palisade_upstream_tls_errors_total",
            "Failed upstream TLS handshakes of intercepted connections, by org.",
            &["org"],
        )?,
        registry,
    };
    let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
        Box::new(m.connections_total.clone()),
        Box::new(m.dns_queries_total.clone()),
        Box::new(m.active_connections.clone()),
        Box::new(m.bytes_total.clone()),
        Box::new(m.decision_duration_seconds.clone()),
        Box::new(m.evidence_records_total.clone()),
        Box::new(m.evidence_write_errors_total.clone()),
        Box::new(m.evidence_queue_depth.clone()),
        Box::new(m.policy_reloads_total.clone()),
        Box::new(m.build_info.clone()),
        Box::new(m.policy_loaded_timestamp_seconds.clone()),
        Box::new(m.upstream_connect_errors_total.clone()),
        Box::new(m.resolve_duration_seconds.clone()),
        Box::new(m.ready.clone()),
        Box::new(m.would_deny_total.clone()),
        Box::new(m.intercepted_requests_total.clone()),
        Box::new(m.intercepted_request_duration_seconds.clone()),
        Box::new(m.intercept_cert_cache_total.clone()),
        Box::new(m.intercept_cert_cache_entries.clone()),
        Box::new(m.upstream_tls_errors_total.clone()),
        // process_cpu_seconds_total, process_open_fds, process_resident_memory_bytes, ...
        Box::new(prometheus::process_collector::ProcessCollector::for_self()),
    ];
    for c in collectors {
        m.registry.register(c)?;
    }
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

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// The process-wide metrics.
pub fn metrics() -> &'static Metrics {
    METRICS.get_or_init(|| match build() {
        Ok(m) => m,
        // Static names and labels: failing here is a programming error caught by the tests.
        Err(e) => panic!("metric registration: {e}"),
    })
}

/// The org label for an optional org.
pub fn org_label(org: Option<&OrgRef>) -> &str {
    org.map_or(UNKNOWN_ORG, |o| &o.name)
}

/// Count one proxy decision.
pub fn count_connection(org: Option<&OrgRef>, reason: Reason, mode: &str) {
    metrics()
        .connections_total
        .with_label_values(&[org_label(org), reason.decision(), reason.as_str(), mode])
        .inc();
}

/// Count a decision or close record as it is written: decisions by org,
/// decision, reason and mode; close records add their bytes.
pub fn count_record(record: &crate::evidence::Record) {
    use crate::evidence::Event;
    let m = metrics();
    let org = record.org.as_deref().unwrap_or(UNKNOWN_ORG);
    match record.event {
        Event::Decision => {
            let mode = record.mode.as_str();
            if let Some(would) = record.would_deny {
                m.would_deny_total
                    .with_label_values(&[org, mode, would.as_str()])
                    .inc();
            }
            if mode == "dns" {
                m.dns_queries_total
                    .with_label_values(&[org, record.decision_str(), record.reason.as_str()])
                    .inc();
            } else {
                m.connections_total
                    .with_label_values(&[org, record.decision_str(), record.reason.as_str(), mode])
                    .inc();
            }
        }
        Event::Close => {
            m.bytes_total
                .with_label_values(&[org, "up"])
                .inc_by(record.bytes_up.unwrap_or(0));
            m.bytes_total
                .with_label_values(&[org, "down"])
                .inc_by(record.bytes_down.unwrap_or(0));
        }
    }
}

/// Create the zero-valued series of every org (and `unknown`) so that
/// dashboards and alerts see zeros, not gaps, before the first event. The
/// label space is bounded: orgs × reason codes × modes.
pub fn init_series<'a>(orgs: impl IntoIterator<Item = &'a str>, modes: &[&str]) {
    let m = metrics();
    for org in orgs.into_iter().chain([UNKNOWN_ORG]) {
        for reason in Reason::ALL {
            for mode in modes {
                m.connections_total.with_label_values(&[
                    org,
                    reason.decision(),
                    reason.as_str(),
                    mode,
                ]);
            }
            m.dns_queries_total
                .with_label_values(&[org, reason.decision(), reason.as_str()]);
        }
        m.active_connections.with_label_values(&[org]);
        for direction in ["up", "down"] {
            m.bytes_total.with_label_values(&[org, direction]);
        }
    }
}

/// Record the policy being served.
pub fn set_policy(hash: &str, loaded_unix_seconds: f64) {
    let m = metrics();
    m.build_info.reset();
    m.build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION"), hash])
        .set(1);
    m.policy_loaded_timestamp_seconds.set(loaded_unix_seconds);
}

/// Count one DNS query.
pub fn count_dns(org: Option<&OrgRef>, reason: Reason) {
    metrics()
        .dns_queries_total
        .with_label_values(&[org_label(org), reason.decision(), reason.as_str()])
        .inc();
}

/// The text exposition of every metric.
pub fn render() -> String {
    let mut out = Vec::new();
    let families = metrics().registry.gather();
    if TextEncoder::new().encode(&families, &mut out).is_err() {
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_names_are_exposed() {
        count_connection(None, Reason::UnknownClient, "explicit");
        count_dns(None, Reason::UnknownClient);
        metrics()
            .active_connections
            .with_label_values(&["x"])
            .set(0);
        metrics()
            .bytes_total
            .with_label_values(&["x", "up"])
            .inc_by(0);
        metrics()
            .decision_duration_seconds
            .with_label_values(&["explicit"])
            .observe(0.001);
        metrics()
            .policy_reloads_total
            .with_label_values(&["ok"])
            .inc_by(0);
        let text = render();
        for name in [
            "palisade_connections_total",
            "palisade_dns_queries_total",
            "palisade_active_connections",
            "palisade_bytes_total",
            "palisade_decision_duration_seconds",
            "palisade_evidence_records_total",
            "palisade_evidence_write_errors_total",
            "palisade_policy_reloads_total",
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} missing:\n{text}"
            );
        }
        assert!(text.contains(
            "palisade_connections_total{decision=\"deny\",mode=\"explicit\",org=\"unknown\",reason=\"unknown_client\"}"
        ));
    }
}
