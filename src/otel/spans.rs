//! The spans of a connection: one for the connection, a child per step
//! (`resolve`, `decide`, `dial`, `upstream_tls`) and per intercepted or
//! forwarded request. A W3C `traceparent` the client sent (on the CONNECT
//! request, or on a request Palisade reads) is the parent: the client's
//! trace goes on through the gateway. Without the export every call here
//! is a no-op on an empty value.

use std::borrow::Cow;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{Span as _, SpanKind, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_http::HeaderExtractor;
use opentelemetry_sdk::propagation::TraceContextPropagator;

use super::Otel;

/// A connection's span (empty while the export is off); it ends when the
/// last clone is dropped.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnSpan(Option<Context>);

/// One step's span; it ends when dropped.
#[derive(Debug, Default)]
pub(crate) struct Step(Option<opentelemetry_sdk::trace::Span>);

/// The context a request's `traceparent` (and `tracestate`) carries, if
/// it carries a valid one.
fn remote_parent(headers: &http::HeaderMap) -> Option<Context> {
    if !headers.contains_key("traceparent") {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

impl Otel {
    /// Start the span of a connection from `client` in `mode`; `headers`
    /// are the CONNECT request's, whose `traceparent` is the parent.
    pub(crate) fn connection(
        &self,
        client: std::net::SocketAddr,
        mode: &'static str,
        headers: Option<&http::HeaderMap>,
    ) -> ConnSpan {
        let parent = headers.and_then(remote_parent).unwrap_or_default();
        let span = self
            .tracer
            .span_builder("palisade.connection")
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("client.address", client.ip().to_string()),
                KeyValue::new("client.port", i64::from(client.port())),
                KeyValue::new("network.transport", "tcp"),
                KeyValue::new("palisade.mode", mode),
            ])
            .start_with_context(&self.tracer, &parent);
        ConnSpan(Some(
            parent
                .with_span(span)
                .with_value(TracerOf(self.tracer.clone())),
        ))
    }
}

impl ConnSpan {
    /// Whether a span is recorded (the export is on).
    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Set an attribute of the connection's span.
    pub(crate) fn set(&self, key: &'static str, value: impl Into<Value>) {
        if let Some(cx) = &self.0 {
            cx.span().set_attribute(KeyValue::new(key, value));
        }
    }

    /// Start a child step (`resolve`, `decide`, `dial`, `upstream_tls`).
    pub(crate) fn step(&self, name: &'static str) -> Step {
        let Some((cx, tracer)) = self.parts() else {
            return Step(None);
        };
        Step(Some(
            tracer
                .span_builder(name)
                .with_kind(SpanKind::Internal)
                .start_with_context(&tracer, cx),
        ))
    }

    /// Start the span of one request on this connection (intercepted, or
    /// forwarded in plain HTTP); a `traceparent` among `headers` is its
    /// parent, with a link to the connection's span.
    pub(crate) fn request(&self, method: &str, host: &str, headers: &http::HeaderMap) -> Step {
        let Some((cx, tracer)) = self.parts() else {
            return Step(None);
        };
        let attrs = vec![
            KeyValue::new("http.request.method", method.to_owned()),
            KeyValue::new("server.address", host.to_owned()),
        ];
        let mut builder = tracer
            .span_builder(Cow::Borrowed("palisade.request"))
            .with_kind(SpanKind::Server)
            .with_attributes(attrs);
        let span = match remote_parent(headers) {
            Some(remote) => {
                builder = builder.with_links(vec![opentelemetry::trace::Link::with_context(
                    cx.span().span_context().clone(),
                )]);
                builder.start_with_context(&tracer, &remote)
            }
            None => builder.start_with_context(&tracer, cx),
        };
        Step(Some(span))
    }

    fn parts(&self) -> Option<(&Context, opentelemetry_sdk::trace::SdkTracer)> {
        let cx = self.0.as_ref()?;
        let tracer = cx.get::<TracerOf>()?.0.clone();
        Some((cx, tracer))
    }
}

/// The tracer a connection's context carries, for its children.
#[derive(Debug, Clone)]
struct TracerOf(opentelemetry_sdk::trace::SdkTracer);

impl Step {
    /// Set an attribute of this step's span.
    pub(crate) fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some(s) = &mut self.0 {
            s.set_attribute(KeyValue::new(key, value));
        }
    }

    /// Mark this step failed, with why.
    pub(crate) fn fail(&mut self, why: impl std::fmt::Display) {
        if let Some(s) = &mut self.0 {
            s.set_status(opentelemetry::trace::Status::error(why.to_string()));
        }
    }
}
