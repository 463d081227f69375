//! A body that counts the bytes passing through and, once, at its end (or
//! when dropped before it), hands the count to an `on_finish` hook: the
//! close record of a forwarded request is written from there. An
//! `on_complete` hook runs after it only if the body was read to its very
//! end (not on an error, not when dropped early): a pooled upstream
//! connection goes back from there.
//!
//! A metered body may also spend from its exchange's volume budgets as
//! it relays ([`Metered::charging`]): each frame is charged before it
//! goes on (a trailers frame as its field lines, whole or not at all),
//! and past the budget the frame is cut to what is left and the
//! body ends with an error (the exchange is cut, never taken as whole),
//! the watch cancelled so that the other direction stops too. Any relay
//! that moves a body through [`Metered`] inherits this.
//!
//! A body that stops with an error once told ([`Stopped`]): a unit a
//! reload revokes ends so.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use std::future::Future;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::limits::volume::Direction;
use crate::limits::Watch;
use crate::proto::http_head;
use crate::serve::http::BodyError;

/// Called once with the bytes counted.
pub(crate) type OnFinish = Box<dyn FnOnce(u64) + Send + Sync>;

/// Called once the body was read to its end.
pub(crate) type OnComplete = Box<dyn FnOnce() + Send + Sync>;

/// `inner`, counted into `count`.
pub(crate) struct Metered<B> {
    inner: B,
    count: Arc<AtomicU64>,
    on_finish: Option<OnFinish>,
    on_complete: Option<OnComplete>,
    /// `inner` said it is at its end (a reader may stop polling then).
    at_end: bool,
    /// The volume budgets it spends from, and which way it goes.
    charging: Option<(Arc<Watch>, Direction)>,
    /// Cut at its budget: the next poll ends it with an error.
    cut: bool,
}

impl<B> Metered<B> {
    /// Count into `count` (which the caller may share).
    pub(crate) fn new(inner: B, count: Arc<AtomicU64>) -> Self {
        Metered {
            inner,
            count,
            on_finish: None,
            on_complete: None,
            at_end: false,
            charging: None,
            cut: false,
        }
    }

    /// Count, and call `on_finish` with the count at the end.
    pub(crate) fn on_finish(inner: B, on_finish: OnFinish) -> Self {
        Metered {
            inner,
            count: Arc::default(),
            on_finish: Some(on_finish),
            on_complete: None,
            at_end: false,
            charging: None,
            cut: false,
        }
    }

    /// Also call `on_complete` (after `on_finish`) if the body is read to
    /// its end.
    pub(crate) fn on_complete(mut self, on_complete: OnComplete) -> Self
    where
        B: Body,
    {
        self.at_end = self.inner.is_end_stream();
        self.on_complete = Some(on_complete);
        self
    }

    /// Charge every frame to `watch`'s budgets as it goes `direction`
    /// (see the module's notes).
    pub(crate) fn charging(mut self, watch: Arc<Watch>, direction: Direction) -> Self {
        self.charging = Some((watch, direction));
        self
    }

    /// `data` about to go on: what the budgets let through of it (cut
    /// to that); `false` when none of it may go.
    fn charge(&mut self, data: &mut Bytes) -> bool {
        let Some((watch, direction)) = &self.charging else {
            return true;
        };
        let asked = data.len() as u64;
        let granted = watch.take(*direction, asked);
        if granted < asked {
            self.cut = true;
            data.truncate(usize::try_from(granted).unwrap_or(usize::MAX));
        }
        granted > 0 || asked == 0
    }

    /// Trailer fields of `bytes` about to go on: whether the budgets let
    /// all of them through (a field section is never cut short).
    fn charge_whole(&mut self, bytes: u64) -> bool {
        let Some((watch, direction)) = &self.charging else {
            return true;
        };
        if watch.take(*direction, bytes) < bytes {
            self.cut = true;
            return false;
        }
        true
    }

    /// Cut at the budget: finished; the error to end with.
    fn cut_off(&mut self) -> BodyError {
        self.finish(false);
        VOLUME_SPENT.into()
    }

    fn finish(&mut self, complete: bool) {
        if let Some(f) = self.on_finish.take() {
            f(self.count.load(Ordering::Relaxed));
        }
        if let Some(f) = self.on_complete.take() {
            if complete {
                f();
            }
        }
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        // A reader may stop polling once the body says it is at its end
        // (an empty body, or its last frame read): complete all the same.
        let complete = self.at_end;
        self.finish(complete);
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if this.cut {
            return Poll::Ready(Some(Err(this.cut_off())));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(mut frame))) => {
                if let Some(data) = frame.data_mut() {
                    if !this.charge(data) {
                        return Poll::Ready(Some(Err(this.cut_off())));
                    }
                    this.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                } else if let Some(trailers) = frame.trailers_ref() {
                    // Trailer fields carry bytes too (a request's go
                    // upstream): counted and charged as their field lines.
                    let bytes = http_head::fields_len(http_head::field_lens(trailers));
                    if !this.charge_whole(bytes) {
                        return Poll::Ready(Some(Err(this.cut_off())));
                    }
                    this.count.fetch_add(bytes, Ordering::Relaxed);
                }
                this.at_end = this.is_end_stream();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.finish(true);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish(false);
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        !self.cut && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A client's request body that, dropped before its end (the exchange
/// cut at a budget, or refused, or answered early), is read on and
/// dropped by a task of its own, a bounded amount ([`MAX_DRAIN_BYTES`]
/// within [`DRAIN_TIMEOUT`]), so that the answer the client is sent
/// meanwhile is not lost to a reset of a connection closed with unread
/// bytes.
pub(crate) struct Drained<B: Body + Send + Unpin + 'static> {
    inner: Option<B>,
}

impl<B: Body + Send + Unpin + 'static> Drained<B> {
    pub(crate) fn new(inner: B) -> Self {
        Drained { inner: Some(inner) }
    }
}

impl<B: Body + Send + Unpin + 'static> Drop for Drained<B> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            if !inner.is_end_stream() {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(drain(inner));
                }
            }
        }
    }
}

impl<B> Body for Drained<B>
where
    B: Body + Send + Unpin + 'static,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(SizeHint::default, Body::size_hint)
    }
}

/// Bytes of an unwanted request body read before giving up on it.
pub(crate) const MAX_DRAIN_BYTES: u64 = 1024 * 1024;
/// Time spent reading an unwanted request body before giving up on it.
pub(crate) const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Read (and drop) what is left of `body`, a bounded amount.
pub(crate) async fn drain<B: Body + Unpin>(mut body: B) {
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) =
            std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            seen += frame
                .data_ref()
                .map_or(0, |d| bytes::Buf::remaining(d) as u64);
            if seen > MAX_DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

/// The error of a body cut at its volume budget.
const VOLUME_SPENT: &str = "volume budget spent";

/// `inner` until `stop` is cancelled, then an error: the exchange ends
/// without a clean end of body (HTTP/1.1 cuts the connection, HTTP/2
/// resets the stream), so a body cut short is never taken as whole.
pub(crate) struct Stopped<B> {
    inner: B,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl<B> Stopped<B> {
    pub(crate) fn new(inner: B, stop: CancellationToken) -> Self {
        Stopped {
            inner,
            stop: Box::pin(stop.cancelled_owned()),
        }
    }
}

impl<B> Body for Stopped<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BodyError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err("revoked by a reloaded policy".into())));
        }
        Pin::new(&mut self.inner).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn counts_and_finishes_once_at_the_end_or_on_drop() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook = |seen: &Arc<Mutex<Vec<u64>>>| -> OnFinish {
            let seen = seen.clone();
            Box::new(move |n| seen.lock().unwrap().push(n))
        };
        let body = Metered::on_finish(Full::new(Bytes::from_static(b"hello")), hook(&seen));
        let got = body.collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"hello");
        assert_eq!(*seen.lock().unwrap(), vec![5]);

        drop(Metered::on_finish(
            Full::new(Bytes::from_static(b"x")),
            hook(&seen),
        ));
        assert_eq!(*seen.lock().unwrap(), vec![5, 0]);

        let shared = Arc::new(AtomicU64::new(0));
        let shared_body = Metered::new(Full::new(Bytes::from_static(b"abc")), shared.clone());
        drop(shared_body);
        assert_eq!(shared.load(Ordering::Relaxed), 0);
        let body = Metered::new(Full::new(Bytes::from_static(b"abc")), shared.clone());
        body.collect().await.unwrap();
        assert_eq!(shared.load(Ordering::Relaxed), 3);
    }

    /// A body of `frames`, one a poll.
    fn frames(frames: &[&'static [u8]]) -> crate::serve::http::Body {
        let (mut tx, body) = crate::serve::http::channel(frames.len().max(1));
        for f in frames {
            tx.try_send(Frame::data(Bytes::from_static(f))).unwrap();
        }
        body
    }

    /// An org's lease under `rule`, with `up` bytes a minute upstream.
    fn lease(
        volumes: &crate::limits::volume::Volumes,
        rule: &str,
        up: u64,
    ) -> crate::limits::volume::Lease {
        let budget = crate::config::Volume {
            up: Some(up),
            down: None,
            window: std::time::Duration::from_secs(60),
        };
        let (org, rule) = (Arc::from("acme"), Arc::from(rule));
        let now = std::time::Instant::now();
        volumes
            .admit(&org, &rule, (Some(budget), None), now)
            .unwrap()
            .unwrap()
    }

    fn volumes() -> crate::limits::volume::Volumes {
        use crate::limits::volume::{Volumes, MAX_METERS};
        Volumes::new(std::time::Instant::now(), MAX_METERS, None)
    }

    #[tokio::test]
    async fn a_charged_body_is_cut_to_its_budget_and_ends_in_an_error() {
        use crate::limits::volume::Scope;
        let volumes = volumes();
        let admit = |rule: &str| lease(&volumes, rule, 5);
        let cut = CancellationToken::new();
        let watch = Arc::new(Watch::new(admit("gh"), Some(cut.clone())));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook = seen.clone();
        let mut body = Metered::on_finish(
            frames(&[b"abc", b"def", b"ghi"]),
            Box::new(move |n| hook.lock().unwrap().push(n)),
        )
        .charging(watch.clone(), Direction::Up);
        let mut got = Vec::new();
        let err = loop {
            match body.frame().await {
                Some(Ok(f)) => got.extend_from_slice(&f.into_data().unwrap()),
                Some(Err(e)) => break e,
                None => panic!("not cut"),
            }
        };
        assert_eq!(got, b"abcde", "cut to what the budget had left");
        assert_eq!(err.to_string(), VOLUME_SPENT);
        assert!(cut.is_cancelled(), "the other direction stops too");
        assert_eq!(
            watch.crossed(),
            Some((Scope::Rule(Arc::from("gh")), Direction::Up))
        );
        assert_eq!(*seen.lock().unwrap(), vec![5]);
        // Report mode (no cut): everything goes, the crossing noted.
        let report = Arc::new(Watch::new(admit("pkg"), None));
        let body = Metered::new(frames(&[b"abcdef"]), Arc::default())
            .charging(report.clone(), Direction::Up);
        assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"abcdef");
        assert!(report.crossed().is_some() && !report.is_cut());
    }

    #[tokio::test]
    async fn trailer_fields_are_counted_and_charged_whole() {
        let lease = lease(&volumes(), "gh", 40);
        let watch = Arc::new(Watch::new(lease, Some(CancellationToken::new())));
        let with_trailers = |value: &'static str| {
            let (mut tx, body) = crate::serve::http::channel(2);
            tx.try_send(Frame::data(Bytes::from_static(b"abc")))
                .unwrap();
            let mut t = http::HeaderMap::new();
            t.insert("x-data", http::HeaderValue::from_static(value));
            tx.try_send(Frame::trailers(t)).unwrap();
            body
        };
        // "x-data: 0123456789" and its CRLF, and the blank line: 22 bytes.
        let counted = Arc::new(AtomicU64::new(0));
        let body = Metered::new(with_trailers("0123456789"), counted.clone())
            .charging(watch.clone(), Direction::Up);
        let got = body.collect().await.unwrap();
        assert_eq!(got.trailers().unwrap()["x-data"], "0123456789");
        assert_eq!(counted.load(Ordering::Relaxed), 3 + 22);
        // 15 bytes left: the data goes (12 left), trailers of 22 do not.
        let mut body = Metered::new(with_trailers("0123456789"), Arc::default())
            .charging(watch.clone(), Direction::Up);
        assert!(body.frame().await.unwrap().unwrap().is_data());
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), VOLUME_SPENT);
        assert!(watch.is_cut());
    }

    /// A body with one frame that is not at its end until polled once more.
    struct TwoStep(u8);

    impl Body for TwoStep {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0 += 1;
            match self.0 {
                1 => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"ab"))))),
                _ => Poll::Ready(None),
            }
        }

        fn is_end_stream(&self) -> bool {
            self.0 >= 2
        }
    }

    #[tokio::test]
    async fn complete_only_when_read_to_the_end() {
        let completed = Arc::new(Mutex::new(Vec::new()));
        let metered = |name: &'static str, body: TwoStep| {
            let (c, f) = (completed.clone(), completed.clone());
            Metered::on_finish(body, Box::new(move |n| f.lock().unwrap().push((name, n))))
                .on_complete(Box::new(move || c.lock().unwrap().push((name, 99))))
        };
        // Read to the end.
        metered("full", TwoStep(0)).collect().await.unwrap();
        // Dropped before its end.
        let mut early = metered("early", TwoStep(0));
        let _ = std::future::poll_fn(|cx| Pin::new(&mut early).poll_frame(cx)).await;
        drop(early);
        // Dropped at its end without the last poll (as hyper does).
        drop(metered("at-end", TwoStep(2)));
        assert_eq!(
            *completed.lock().unwrap(),
            vec![
                ("full", 2),
                ("full", 99),
                ("early", 2),
                ("at-end", 0),
                ("at-end", 99)
            ]
        );
    }
}
