//! Prometheus metrics, exactly the CONTRACT's names and labels. Label values
//! are bounded: org names from the config (or `unknown`), reason codes,
//! modes and directions; never a host name or client address.

use std::sync::OnceLock;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::policy::{OrgRef, Reason};

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
        registry,
    };
    m.registry.register(Box::new(m.connections_total.clone()))?;
    m.registry.register(Box::new(m.dns_queries_total.clone()))?;
    m.registry
        .register(Box::new(m.active_connections.clone()))?;
    m.registry.register(Box::new(m.bytes_total.clone()))?;
    m.registry
        .register(Box::new(m.decision_duration_seconds.clone()))?;
    m.registry
        .register(Box::new(m.evidence_records_total.clone()))?;
    m.registry
        .register(Box::new(m.evidence_write_errors_total.clone()))?;
    m.registry
        .register(Box::new(m.evidence_queue_depth.clone()))?;
    m.registry
        .register(Box::new(m.policy_reloads_total.clone()))?;
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
