//! The export queue: bounded, never waited on, its losses counted.
//!
//! The SDK's batch processors keep their queue and their drop count to
//! themselves (the count is only logged at shutdown), and run their own
//! thread. Palisade's processors ([`LogQueue`], [`SpanQueue`]) push into a
//! [`Queue`] instead: a push that finds it full drops the item and counts
//! it in `palisade_otel_dropped_total`, so a slow or dead collector costs a
//! decision one lock and one copy, never a wait. One task per signal
//! ([`drain`]) takes batches off the queue and hands them to the SDK's
//! OTLP exporter; a batch the exporter cannot deliver (after its own
//! retries, within its timeout) is counted as dropped too, and the failure
//! is logged at most once per [`WARN_EVERY`].

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry::InstrumentationScope;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::logs::{LogBatch, LogExporter, LogProcessor, SdkLogRecord};
use opentelemetry_sdk::trace::{SpanData, SpanExporter, SpanProcessor};
use prometheus::IntCounter;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Items a queue holds; one more is dropped and counted.
pub(crate) const QUEUE_CAPACITY: usize = 2048;
/// Items per export request.
pub(crate) const MAX_BATCH: usize = 512;
/// How long an item may wait for a batch to fill.
pub(crate) const EXPORT_INTERVAL: Duration = Duration::from_secs(1);
/// The least time between two warnings about failed exports.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(60);
/// What the last export at shutdown may take.
const FINAL_EXPORT: Duration = Duration::from_secs(2);

/// A bounded FIFO with a drop counter and a wake-up for its drain.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    items: Mutex<VecDeque<T>>,
    capacity: usize,
    ready: Notify,
    dropped: IntCounter,
}

impl<T> Queue<T> {
    pub(crate) fn new(capacity: usize, dropped: IntCounter) -> Queue<T> {
        Queue {
            items: Mutex::new(VecDeque::with_capacity(capacity.min(MAX_BATCH))),
            capacity,
            ready: Notify::new(),
            dropped,
        }
    }

    /// Queue `item`, or drop and count it if the queue is full.
    pub(crate) fn push(&self, item: T) {
        let len = {
            let mut items = self.items.lock().unwrap_or_else(PoisonError::into_inner);
            if items.len() >= self.capacity {
                drop(items);
                self.dropped.inc();
                return;
            }
            items.push_back(item);
            items.len()
        };
        if len >= MAX_BATCH {
            self.ready.notify_one();
        }
    }

    /// Up to `max` of the oldest items.
    fn take(&self, max: usize) -> Vec<T> {
        let mut items = self.items.lock().unwrap_or_else(PoisonError::into_inner);
        let n = items.len().min(max);
        items.drain(..n).collect()
    }

    /// Items lost outside the queue (the tap's ring, a failed export).
    pub(crate) fn count_dropped(&self, n: u64) {
        self.dropped.inc_by(n);
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.items
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Where a drained batch goes: the SDK's OTLP exporter of one signal.
pub(crate) trait Sink<T>: Send {
    fn send(&mut self, batch: Vec<T>) -> impl std::future::Future<Output = OTelSdkResult> + Send;
}

/// The log records' sink, with the one scope they are all emitted under.
pub(crate) struct LogSink<E> {
    pub(crate) exporter: E,
    pub(crate) scope: InstrumentationScope,
}

impl<E: LogExporter> Sink<SdkLogRecord> for LogSink<E> {
    async fn send(&mut self, batch: Vec<SdkLogRecord>) -> OTelSdkResult {
        let pairs: Vec<(&SdkLogRecord, &InstrumentationScope)> =
            batch.iter().map(|r| (r, &self.scope)).collect();
        self.exporter.export(LogBatch::new(&pairs)).await
    }
}

/// The spans' sink.
pub(crate) struct SpanSink<E>(pub(crate) E);

impl<E: SpanExporter> Sink<SpanData> for SpanSink<E> {
    async fn send(&mut self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.export(batch).await
    }
}

/// Export what `queue` holds until `shutdown`, then what is left (once,
/// within [`FINAL_EXPORT`]). `what` names the signal in warnings.
pub(crate) async fn drain<T, S: Sink<T>>(
    what: &'static str,
    queue: std::sync::Arc<Queue<T>>,
    mut sink: S,
    shutdown: CancellationToken,
) {
    let mut failures = Failures::default();
    loop {
        let stopping = tokio::select! {
            () = shutdown.cancelled() => true,
            () = queue.ready.notified() => false,
            () = tokio::time::sleep(EXPORT_INTERVAL) => false,
        };
        loop {
            let batch = queue.take(MAX_BATCH);
            let (n, full) = (batch.len(), batch.len() == MAX_BATCH);
            if n == 0 {
                break;
            }
            let sent = if stopping {
                tokio::time::timeout(FINAL_EXPORT, sink.send(batch))
                    .await
                    .unwrap_or(Err(OTelSdkError::Timeout(FINAL_EXPORT)))
            } else {
                sink.send(batch).await
            };
            if let Err(e) = sent {
                queue.count_dropped(n as u64);
                failures.note(what, n, &e, Instant::now());
                if stopping {
                    return;
                }
            }
            if !full {
                break;
            }
        }
        if stopping {
            return;
        }
    }
}

/// Failed exports, warned about at most once per [`WARN_EVERY`].
#[derive(Default)]
struct Failures {
    last_warned: Option<Instant>,
    /// Items lost since the last warning.
    since: u64,
}

impl Failures {
    fn note(&mut self, what: &str, n: usize, error: &dyn std::fmt::Display, now: Instant) {
        self.since += n as u64;
        if self
            .last_warned
            .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
        {
            return;
        }
        warn!(signal = what, dropped = self.since, error = %error, "OTLP export failed; the evidence is unaffected (palisade_otel_dropped_total counts what was lost)");
        self.last_warned = Some(now);
        self.since = 0;
    }
}

/// The log processor: each emitted record into the bounded queue.
#[derive(Debug)]
pub(crate) struct LogQueue(pub(crate) std::sync::Arc<Queue<SdkLogRecord>>);

impl LogProcessor for LogQueue {
    fn emit(&self, data: &mut SdkLogRecord, _scope: &InstrumentationScope) {
        self.0.push(data.clone());
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // The drain task exports what is left when Palisade shuts down.
        Ok(())
    }
}

/// The span processor: each ended span into the bounded queue.
#[derive(Debug)]
pub(crate) struct SpanQueue(pub(crate) std::sync::Arc<Queue<SpanData>>);

impl SpanProcessor for SpanQueue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}
    fn on_end(&self, span: SpanData) {
        self.0.push(span);
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_and_holds_no_more_than_its_capacity() {
        let dropped = IntCounter::new("d", "d").unwrap();
        let q = Queue::new(3, dropped.clone());
        for i in 0..10 {
            q.push(i);
        }
        assert_eq!(q.len(), 3);
        assert_eq!(dropped.get(), 7);
        assert_eq!(q.take(2), [0, 1]);
        q.push(10);
        assert_eq!(q.take(10), [2, 10]);
        assert_eq!(dropped.get(), 7);
    }

    #[test]
    fn failures_warn_at_most_once_a_minute_and_count_what_they_skipped() {
        let mut f = Failures::default();
        let t0 = Instant::now();
        f.note("logs", 5, &"refused", t0);
        assert_eq!((f.since, f.last_warned), (0, Some(t0)));
        f.note("logs", 5, &"refused", t0 + Duration::from_secs(1));
        f.note("logs", 5, &"refused", t0 + Duration::from_secs(2));
        assert_eq!(f.since, 10, "not warned again within the minute");
        f.note("logs", 1, &"refused", t0 + WARN_EVERY);
        assert_eq!(f.since, 0);
    }
}
