//! OpenTelemetry: a log record per decision record and a span per
//! connection, sent over OTLP/HTTP (protobuf) to a collector.
//!
//! The evidence stays the authority: log records are read off the
//! evidence tap ([`crate::evidence::tap`]) after their records are
//! written, and spans are queued when they end; both go through a bounded
//! queue ([`queue`]) that drops and counts rather than waits, so no
//! decision ever waits on a collector. The SDK's OTLP exporters send, with
//! opentelemetry-http's hyper client on Palisade's runtime.
//!
//! Where the collector is: `[otel] endpoint` if set, else the standard
//! environment variables (`OTEL_EXPORTER_OTLP_{LOGS,TRACES}_ENDPOINT`, used
//! as given, then `OTEL_EXPORTER_OTLP_ENDPOINT` with `/v1/logs` or
//! `/v1/traces` appended), else `http://localhost:4318`. Headers are the
//! file's plus `OTEL_EXPORTER_OTLP_HEADERS` and the per-signal ones (the
//! environment wins on the same name, so a secret can stay out of the
//! file); the timeout is `OTEL_EXPORTER_OTLP_TIMEOUT` (default 10 s).

pub(crate) mod logs;
pub(crate) mod queue;
pub(crate) mod spans;

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::InstrumentationScope;
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::logs::{LogExporter as _, SdkLoggerProvider};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter as _};
use opentelemetry_sdk::Resource;
use tokio_util::sync::CancellationToken;

use crate::config::otel_endpoint_problem;
use crate::config::OtelConfig;
use crate::evidence::tap::Tap;
use crate::metrics::Metrics;

pub(crate) use spans::{annotate, connection, current, request, step, step_result, within, Otel};

/// Put a written decision record's outcome on the current span (the
/// connection's or request's): what a trace viewer shows without the log.
pub(crate) fn annotate_record(record: &crate::evidence::Record) {
    if record.event != crate::evidence::Event::Decision
        || !spans::tracing()
        || !opentelemetry::trace::TraceContextExt::has_active_span(
            &opentelemetry::Context::current(),
        )
    {
        return;
    }
    let mut attrs: Vec<(&'static str, opentelemetry::Value)> = vec![
        ("palisade.record.id", record.id.clone().into()),
        ("palisade.decision", record.decision_str().into()),
        ("palisade.reason", record.reason.as_str().into()),
        ("palisade.policy", record.policy.to_string().into()),
    ];
    if let Some(org) = &record.org {
        attrs.push(("palisade.org", org.to_string().into()));
    }
    if let Some(rule) = &record.rule {
        attrs.push(("palisade.rule", rule.to_string().into()));
    }
    if let Some(host) = &record.host {
        attrs.push(("server.address", host.clone().into()));
    }
    if let Some(port) = record.port {
        attrs.push(("server.port", i64::from(port).into()));
    }
    annotate(attrs);
}

/// The endpoint when neither the file nor the environment names one.
const DEFAULT_ENDPOINT: &str = "http://localhost:4318";
/// The SDK's default request timeout, used unless the environment sets one.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request timeout the environment may set.
const MAX_TIMEOUT: Duration = Duration::from_secs(60);

/// A signal's request timeout: `OTEL_EXPORTER_OTLP_{SIGNAL}_TIMEOUT`, then
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds), else 10 s; at most 60 s.
fn timeout(signal: &str, env: impl Fn(&str) -> Option<String>) -> Duration {
    let ms = |name: &str| env(name).and_then(|v| v.trim().parse::<u64>().ok());
    ms(&format!("OTEL_EXPORTER_OTLP_{signal}_TIMEOUT"))
        .or_else(|| ms("OTEL_EXPORTER_OTLP_TIMEOUT"))
        .map_or(DEFAULT_TIMEOUT, Duration::from_millis)
        .min(MAX_TIMEOUT)
}

/// The collector URLs of the two signals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoints {
    pub(crate) logs: String,
    pub(crate) traces: String,
}

/// Whether to export, and where: `None` without `[otel]` and without an
/// endpoint in the environment; `Err` names a variable that is not a
/// collector URL. `env` reads one variable (empty counts as unset).
pub(crate) fn endpoints(
    config: Option<&OtelConfig>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Endpoints>, String> {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let (generic, logs, traces) = (
        var("OTEL_EXPORTER_OTLP_ENDPOINT"),
        var("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"),
        var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    );
    if config.is_none() && generic.is_none() && logs.is_none() && traces.is_none() {
        return Ok(None);
    }
    let join = |base: &str, path: &str| format!("{}{path}", base.trim_end_matches('/'));
    if let Some(base) = config.and_then(|c| c.endpoint.as_deref()) {
        return Ok(Some(Endpoints {
            logs: join(base, "/v1/logs"),
            traces: join(base, "/v1/traces"),
        }));
    }
    let checked = |name: &str, value: String| match otel_endpoint_problem(value.trim()) {
        None => Ok(value.trim().to_owned()),
        Some(why) => Err(format!("{name}={value:?} is not a collector URL: {why}")),
    };
    let base = match generic {
        Some(g) => checked("OTEL_EXPORTER_OTLP_ENDPOINT", g)?,
        None => DEFAULT_ENDPOINT.to_owned(),
    };
    Ok(Some(Endpoints {
        logs: match logs {
            Some(l) => checked("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", l)?,
            None => join(&base, "/v1/logs"),
        },
        traces: match traces {
            Some(t) => checked("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", t)?,
            None => join(&base, "/v1/traces"),
        },
    }))
}

/// A started export and its tasks (ended by the `shutdown` given).
pub(crate) type Started = (Arc<Otel>, Vec<tokio::task::JoinHandle<()>>);

/// Start the export (`config` is `[otel]`, if any; the environment is read
/// here): a task reading the evidence tap into log records, and one drain
/// task per signal, all ending with `shutdown`. `Ok(None)`: nothing to
/// export to. Must run on the runtime (the hyper client needs it).
pub(crate) fn start(
    config: Option<&OtelConfig>,
    tap: &Tap,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<Option<Started>, String> {
    let Some(urls) = endpoints(config, |name| std::env::var(name).ok())? else {
        return Ok(None);
    };
    let service_name = config.map_or(crate::config::DEFAULT_OTEL_SERVICE_NAME, |c| {
        c.service_name.as_str()
    });
    let headers: std::collections::HashMap<String, String> = config
        .map(|c| c.headers.iter().cloned().collect())
        .unwrap_or_default();
    let resource = Resource::builder_empty()
        .with_service_name(service_name.to_owned())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    let env = |name: &str| std::env::var(name).ok();
    let (logs_timeout, traces_timeout) = (timeout("LOGS", env), timeout("TRACES", env));
    let client = |t| HyperClient::with_default_connector(t, None);
    let mut log_exporter = opentelemetry_otlp::LogExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(urls.logs.clone())
        .with_timeout(logs_timeout)
        .with_http_client(client(logs_timeout))
        .with_headers(headers.clone())
        .build()
        .map_err(|e| format!("otel logs exporter: {e}"))?;
    let mut span_exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(urls.traces.clone())
        .with_timeout(traces_timeout)
        .with_http_client(client(traces_timeout))
        .with_headers(headers)
        .build()
        .map_err(|e| format!("otel traces exporter: {e}"))?;
    log_exporter.set_resource(&resource);
    span_exporter.set_resource(&resource);

    let dropped = metrics.otel_dropped();
    let log_queue = Arc::new(queue::Queue::new(
        queue::QUEUE_CAPACITY,
        dropped.with_label_values(&["logs"]),
    ));
    let span_queue = Arc::new(queue::Queue::new(
        queue::QUEUE_CAPACITY,
        dropped.with_label_values(&["traces"]),
    ));
    let scope = InstrumentationScope::builder("palisade")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let loggers = SdkLoggerProvider::builder()
        .with_resource(resource.clone())
        .with_log_processor(queue::LogQueue(log_queue.clone()))
        .build();
    let tracers = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_span_processor(queue::SpanQueue(span_queue.clone()))
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer_with_scope(&tracers, scope.clone());
    let logger = opentelemetry::logs::LoggerProvider::logger_with_scope(&loggers, scope.clone());

    // The drains stop once the follower has queued the tap's last lines.
    let drained = CancellationToken::new();
    let tasks = vec![
        tokio::spawn(logs::follow(
            tap.subscribe(),
            logger,
            log_queue.clone(),
            shutdown.clone(),
            drained.clone(),
        )),
        tokio::spawn(queue::drain(
            "logs",
            log_queue,
            queue::LogSink {
                exporter: log_exporter,
                scope,
            },
            drained.clone(),
        )),
        tokio::spawn(queue::drain(
            "traces",
            span_queue,
            queue::SpanSink(span_exporter),
            drained,
        )),
    ];
    tracing::info!(logs = %urls.logs, traces = %urls.traces, service = service_name, "OTLP export on");
    Ok(Some((
        Arc::new(Otel {
            tracer,
            _tracers: tracers,
            _loggers: loggers,
        }),
        tasks,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    fn file(endpoint: Option<&str>) -> OtelConfig {
        OtelConfig {
            endpoint: endpoint.map(str::to_owned),
            service_name: "palisade".into(),
            headers: vec![],
        }
    }

    #[test]
    fn nothing_is_exported_without_the_table_or_an_endpoint_variable() {
        assert_eq!(endpoints(None, env(&[])), Ok(None));
        assert_eq!(
            endpoints(None, env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])),
            Ok(None)
        );
        let e = endpoints(Some(&file(None)), env(&[])).unwrap().unwrap();
        assert_eq!(e.logs, "http://localhost:4318/v1/logs");
        assert_eq!(e.traces, "http://localhost:4318/v1/traces");
    }

    #[test]
    fn the_file_wins_then_the_per_signal_variable_then_the_generic_one() {
        let all: &[(&str, &str)] = &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4318/"),
            ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://logs:1/custom"),
        ];
        let e = endpoints(Some(&file(Some("http://file:4318"))), env(all))
            .unwrap()
            .unwrap();
        assert_eq!(e.logs, "http://file:4318/v1/logs");
        let e = endpoints(None, env(all)).unwrap().unwrap();
        assert_eq!(e.logs, "http://logs:1/custom", "per-signal: used as given");
        assert_eq!(e.traces, "http://generic:4318/v1/traces");
    }

    #[test]
    fn the_timeout_is_the_signal_s_then_the_generic_one_at_most_a_minute() {
        assert_eq!(timeout("LOGS", env(&[])), Duration::from_secs(10));
        let both: &[(&str, &str)] = &[
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2000"),
            ("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT", "500"),
        ];
        assert_eq!(timeout("LOGS", env(both)), Duration::from_millis(500));
        assert_eq!(timeout("TRACES", env(both)), Duration::from_secs(2));
        let long: &[(&str, &str)] = &[("OTEL_EXPORTER_OTLP_TIMEOUT", "3600000")];
        assert_eq!(timeout("TRACES", env(long)), Duration::from_secs(60));
    }

    #[test]
    fn a_variable_that_is_not_a_collector_url_is_named() {
        let e = endpoints(
            None,
            env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318")]),
        )
        .unwrap_err();
        assert!(
            e.starts_with(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=\"collector:4318\" is not a collector URL"
            ),
            "{e}"
        );
    }
}
