//! A body that counts the bytes passing through and, once, at its end (or
//! when dropped before it), hands the count to an `on_finish` hook: the
//! close record of a forwarded request is written from there.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

/// Called once with the bytes counted.
pub type OnFinish = Box<dyn FnOnce(u64) + Send + Sync>;

/// `inner`, counted into `count`.
pub struct Metered<B> {
    inner: B,
    count: Arc<AtomicU64>,
    on_finish: Option<OnFinish>,
}

impl<B> Metered<B> {
    /// Count into `count` (which the caller may share).
    pub fn new(inner: B, count: Arc<AtomicU64>) -> Self {
        Metered {
            inner,
            count,
            on_finish: None,
        }
    }

    /// Count, and call `on_finish` with the count at the end.
    pub fn on_finish(inner: B, on_finish: OnFinish) -> Self {
        Metered {
            inner,
            count: Arc::default(),
            on_finish: Some(on_finish),
        }
    }

    fn finish(&mut self) {
        if let Some(f) = self.on_finish.take() {
            f(self.count.load(Ordering::Relaxed));
        }
    }
}

impl<B> Drop for Metered<B> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl<B> Body for Metered<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.count.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => this.finish(),
            Poll::Pending => {}
        }
        polled
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
        let body = Metered::new(Full::new(Bytes::from_static(b"abc")), shared.clone());
        body.collect().await.unwrap();
        assert_eq!(shared.load(Ordering::Relaxed), 3);
    }
}
