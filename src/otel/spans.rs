//! The spans of a connection: one for the connection, a child per step
//! (`resolve`, `decide`, `dial`, `upstream_tls`) and per intercepted or
//! forwarded request. A W3C `traceparent` the client sent (on the CONNECT
//! request, or on a request Palisade reads) is the parent: the client's
//! trace goes on through the gateway.
//!
//! The connection's context travels with its futures
//! ([`opentelemetry::trace::FutureExt::with_context`]), so a step only
//! names itself ([`step`]); without the export the context is empty and
//! every call here records nothing.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{FutureExt as _, SpanKind, TraceContextExt, Tracer as _, WithContext};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_http::HeaderExtractor;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracer;

/// The tracer a connection's context carries, for its children.
#[derive(Debug, Clone)]
struct TracerOf(SdkTracer);

/// Whether a connection's context was given a tracer in this process (the
/// export runs). Until then no context holds a tracer or a span, and the
/// calls below return at once instead of looking into the current one on
/// every step and record.
static TRACING: AtomicBool = AtomicBool::new(false);

pub(crate) fn tracing() -> bool {
    TRACING.load(Ordering::Acquire)
}

/// The context a request's `traceparent` (and `tracestate`) carries, if
/// it carries a valid one.
fn remote_parent(headers: &http::HeaderMap) -> Option<Context> {
    if !headers.contains_key("traceparent") {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

/// The context of a new connection's span (`otel` off: an empty one).
/// `headers` are those of its first request (a CONNECT's), whose
/// `traceparent` is the parent.
pub(crate) fn connection(
    otel: Option<&Otel>,
    client: std::net::SocketAddr,
    mode: &'static str,
    headers: Option<&http::HeaderMap>,
) -> Context {
    let Some(otel) = otel else {
        return Context::new();
    };
    TRACING.store(true, Ordering::Release);
    let parent = headers.and_then(remote_parent).unwrap_or_default();
    let span = otel
        .tracer
        .span_builder("palisade.connection")
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("client.address", client.ip().to_string()),
            KeyValue::new("client.port", i64::from(client.port())),
            KeyValue::new("network.transport", "tcp"),
            KeyValue::new("palisade.mode", mode),
        ])
        .start_with_context(&otel.tracer, &parent);
    parent
        .with_span(span)
        .with_value(TracerOf(otel.tracer.clone()))
}

/// The context of one request on a connection whose context is `conn`
/// (intercepted, or forwarded in plain HTTP): its own span, whose parent
/// is a `traceparent` among `headers` (linked to the connection's span)
/// or else the connection's span.
pub(crate) fn request(conn: &Context, method: &str, headers: &http::HeaderMap) -> Context {
    let Some(TracerOf(tracer)) = conn.get::<TracerOf>() else {
        return conn.clone();
    };
    let mut builder = tracer
        .span_builder("palisade.request")
        .with_kind(SpanKind::Server)
        .with_attributes([KeyValue::new("http.request.method", method.to_owned())]);
    let span = match remote_parent(headers) {
        Some(remote) => {
            builder = builder.with_links(vec![opentelemetry::trace::Link::with_context(
                conn.span().span_context().clone(),
            )]);
            builder.start_with_context(tracer, &remote)
        }
        None => builder.start_with_context(tracer, conn),
    };
    conn.with_span(span)
}

/// A child context of the current one for `name`, if a span is recorded.
fn child(name: &'static str) -> Context {
    if !tracing() {
        return Context::new();
    }
    let cx = Context::current();
    let Some(TracerOf(tracer)) = cx.get::<TracerOf>() else {
        return cx;
    };
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .start_with_context(tracer, &cx);
    cx.with_span(span)
}

/// Run `fut` as the step `name` of the current connection or request.
pub(crate) fn step<F: Future>(name: &'static str, fut: F) -> Within<F> {
    within(child(name), fut)
}

/// [`step`] for a fallible step: an `Err` marks the span failed, with why.
pub(crate) async fn step_result<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    name: &'static str,
    fut: F,
) -> Result<T, E> {
    let cx = child(name);
    let out = within(cx.clone(), fut).await;
    if let Err(e) = &out {
        cx.span()
            .set_status(opentelemetry::trace::Status::error(e.to_string()));
    }
    out
}

/// Set attributes of the current span (the connection's or request's).
pub(crate) fn annotate(attrs: impl IntoIterator<Item = (&'static str, Value)>) {
    if !tracing() {
        return;
    }
    let cx = Context::current();
    if cx.has_active_span() {
        let span = cx.span();
        for (k, v) in attrs {
            span.set_attribute(KeyValue::new(k, v));
        }
    }
}

/// Attach `cx` to `fut` (a task spawned for a connection keeps its span).
/// Without the export the context is empty and `fut` runs bare: nothing
/// is attached on each of its polls.
pub(crate) fn within<F: Future>(cx: Context, fut: F) -> Within<F> {
    if tracing() && (cx.has_active_span() || cx.get::<TracerOf>().is_some()) {
        Within::Traced {
            fut: fut.with_context(cx),
        }
    } else {
        Within::Bare { fut }
    }
}

pin_project_lite::pin_project! {
    /// A future under a connection's context ([`within`]).
    #[project = WithinProj]
    pub(crate) enum Within<F> {
        Traced { #[pin] fut: WithContext<F> },
        Bare { #[pin] fut: F },
    }
}

impl<F: Future> Future for Within<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        match self.project() {
            WithinProj::Traced { fut } => fut.poll(cx),
            WithinProj::Bare { fut } => fut.poll(cx),
        }
    }
}

/// The current context, to carry into a spawned task or a service.
pub(crate) fn current() -> Context {
    Context::current()
}

/// The running export: what the proxy starts spans with.
#[derive(Debug)]
pub(crate) struct Otel {
    pub(super) tracer: opentelemetry_sdk::trace::SdkTracer,
    // Kept so the providers (and their processors) live as long as this.
    pub(super) _tracers: opentelemetry_sdk::trace::SdkTracerProvider,
    pub(super) _loggers: opentelemetry_sdk::logs::SdkLoggerProvider,
}
