//! A log record per decision record, read off the evidence tap.
//!
//! The tap carries each record's line once it is written (the evidence
//! came first); its ring is bounded, and lines this follower missed
//! because it fell behind are counted as dropped log records. The record's
//! fields, as written, are the log record's body (a map); its attributes
//! are the semantic-convention ones a collector indexes (`server.address`,
//! `server.port`, `client.address`, `client.port`, `network.transport`,
//! `http.request.method`) and Palisade's own (`palisade.*`).

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use opentelemetry::logs::{AnyValue, Logger as _, Severity};
use opentelemetry::Key;
use opentelemetry_sdk::logs::{SdkLogRecord, SdkLogger};
use serde_json::{Map, Value};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio_util::sync::CancellationToken;

use super::queue::Queue;

/// Nesting a body value may have (records nest two levels at most).
const MAX_DEPTH: usize = 4;

/// Turn each decision line of the tap into a log record, until `shutdown`.
pub(crate) async fn follow(
    mut tap: broadcast::Receiver<Bytes>,
    logger: SdkLogger,
    queue: Arc<Queue<SdkLogRecord>>,
    shutdown: CancellationToken,
    drained: CancellationToken,
) {
    let emit = |line: &[u8]| {
        if let Some(record) = decision(line) {
            let mut log = logger.create_log_record();
            fill(&mut log, &record, SystemTime::now());
            logger.emit(log);
        }
    };
    loop {
        let line = tokio::select! {
            () = shutdown.cancelled() => break,
            line = tap.recv() => line,
        };
        match line {
            Ok(line) => emit(&line),
            Err(RecvError::Lagged(n)) => queue.count_dropped(n),
            Err(RecvError::Closed) => break,
        }
    }
    // What the tap still holds (the evidence is sealed by now), then the
    // drains may send their last batches.
    while let Ok(line) = tap.try_recv() {
        emit(&line);
    }
    drained.cancel();
}

/// The record of a line, if it is a decision record.
fn decision(line: &[u8]) -> Option<Map<String, Value>> {
    match serde_json::from_slice(line).ok()? {
        Value::Object(m) if m.get("event").and_then(Value::as_str) == Some("decision") => Some(m),
        _ => None,
    }
}

/// Write `record` into `log`: time, severity, body, attributes.
pub(crate) fn fill(
    log: &mut impl opentelemetry::logs::LogRecord,
    record: &Map<String, Value>,
    now: SystemTime,
) {
    let text = |k: &str| record.get(k).and_then(Value::as_str);
    log.set_event_name("palisade.decision");
    if let Some(ts) = text("ts").and_then(|t| humantime::parse_rfc3339(t).ok()) {
        log.set_timestamp(ts);
    }
    log.set_observed_timestamp(now);
    let denied = text("decision") == Some("deny");
    log.set_severity_number(if denied {
        Severity::Warn
    } else {
        Severity::Info
    });
    log.set_severity_text(if denied { "WARN" } else { "INFO" });
    log.set_body(any(&Value::Object(record.clone()), 0).unwrap_or(AnyValue::from("")));

    let mut attrs: Vec<(&'static str, AnyValue)> = Vec::with_capacity(16);
    if let Some(host) = text("host") {
        attrs.push(("server.address", host.to_owned().into()));
    }
    if let Some(port) = record.get("port").and_then(Value::as_i64) {
        attrs.push(("server.port", port.into()));
    }
    if let Some(client) = text("client").and_then(|c| c.parse::<std::net::SocketAddr>().ok()) {
        attrs.push(("client.address", client.ip().to_string().into()));
        attrs.push(("client.port", i64::from(client.port()).into()));
    }
    // DNS records do not say which transport the query came over.
    if matches!(text("kind"), Some("tcp" | "http")) {
        attrs.push(("network.transport", "tcp".into()));
    }
    if let Some(method) = text("method") {
        attrs.push(("http.request.method", method.to_owned().into()));
    }
    for (key, field) in [
        ("palisade.record.id", "id"),
        ("palisade.record.ref", "ref"),
        ("palisade.org", "org"),
        ("palisade.decision", "decision"),
        ("palisade.reason", "reason"),
        ("palisade.rule", "rule"),
        ("palisade.policy", "policy"),
        ("palisade.baseline", "baseline"),
        ("palisade.kind", "kind"),
        ("palisade.mode", "mode"),
    ] {
        if let Some(v) = text(field) {
            attrs.push((key, v.to_owned().into()));
        }
    }
    log.add_attributes(attrs);
}

/// A JSON value as an OTLP value (`null`: none; deeper than [`MAX_DEPTH`]:
/// its JSON text).
fn any(value: &Value, depth: usize) -> Option<AnyValue> {
    if depth > MAX_DEPTH {
        return Some(value.to_string().into());
    }
    Some(match value {
        Value::Null => return None,
        Value::Bool(b) => AnyValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AnyValue::Int(i),
            None => AnyValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => s.clone().into(),
        Value::Array(items) => AnyValue::ListAny(Box::new(
            items.iter().filter_map(|v| any(v, depth + 1)).collect(),
        )),
        Value::Object(m) => AnyValue::Map(Box::new(
            m.iter()
                .filter_map(|(k, v)| Some((Key::from(k.clone()), any(v, depth + 1)?)))
                .collect(),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_decision_lines_become_log_records() {
        assert!(decision(br#"{"event":"decision","id":"a"}"#).is_some());
        assert!(decision(br#"{"event":"close","id":"a"}"#).is_none());
        assert!(decision(br#"{"kind":"checkpoint"}"#).is_none());
        assert!(decision(b"not json").is_none());
    }

    #[test]
    fn a_record_gives_its_fields_as_body_and_the_conventional_attributes() {
        let line = br#"{"id":"r1","ts":"2026-12-05T04:00:00.5Z","kind":"http","event":"decision","org":"acme","client":"198.18.1.2:40000","mode":"explicit","host":"allowed.test","port":80,"ip":"198.18.2.10","decision":"deny","reason":"no_rule","rule":null,"policy":"p1","method":"GET","answers":["a",1]}"#;
        let record = decision(line).unwrap();
        let loggers = opentelemetry_sdk::logs::SdkLoggerProvider::builder().build();
        let mut log =
            opentelemetry::logs::LoggerProvider::logger(&loggers, "t").create_log_record();
        fill(&mut log, &record, SystemTime::UNIX_EPOCH);
        let attr = |k: &str| {
            log.attributes_iter()
                .find(|(key, _)| key.as_str() == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(attr("server.address"), Some("allowed.test".into()));
        assert_eq!(attr("server.port"), Some(AnyValue::Int(80)));
        assert_eq!(attr("client.address"), Some("198.18.1.2".into()));
        assert_eq!(attr("client.port"), Some(AnyValue::Int(40000)));
        assert_eq!(attr("network.transport"), Some("tcp".into()));
        assert_eq!(attr("http.request.method"), Some("GET".into()));
        assert_eq!(attr("palisade.reason"), Some("no_rule".into()));
        assert_eq!(attr("palisade.record.id"), Some("r1".into()));
        assert_eq!(attr("palisade.policy"), Some("p1".into()));
        assert_eq!(attr("palisade.rule"), None, "null: absent");
        assert_eq!(log.severity_number(), Some(Severity::Warn));
        assert_eq!(
            log.timestamp(),
            Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_796_443_200_500))
        );
        let Some(AnyValue::Map(body)) = log.body() else {
            panic!("body is a map: {:?}", log.body());
        };
        assert_eq!(body.get(&Key::from("host")), Some(&"allowed.test".into()));
        assert_eq!(
            body.get(&Key::from("answers")),
            Some(&AnyValue::ListAny(Box::new(vec![
                "a".into(),
                AnyValue::Int(1)
            ])))
        );
        assert!(!body.contains_key(&Key::from("rule")));
    }
}
