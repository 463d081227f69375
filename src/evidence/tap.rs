//! The live tap on written records: what `GET /v1/decisions` streams.
//!
//! After a batch is written (handed to the operating system, as every
//! record is before its connection goes on), the writer publishes each of
//! its records' lines here, and only while someone listens. The channel
//! is a bounded ring ([`TAP_BUFFER`] lines): publishing never waits, and a
//! listener that falls further behind than the ring loses the oldest lines
//! and is told how many ([`tokio::sync::broadcast::error::RecvError::Lagged`]),
//! so a slow reader costs the writer nothing but the copy of each line.

use bytes::Bytes;
use tokio::sync::broadcast;

/// Lines a listener may be behind before it misses some.
pub(crate) const TAP_BUFFER: usize = 4096;

/// The sending side, shared by the writer and the admin listener.
#[derive(Debug)]
pub(crate) struct Tap {
    tx: broadcast::Sender<Bytes>,
}

impl Default for Tap {
    fn default() -> Self {
        Tap {
            tx: broadcast::channel(TAP_BUFFER).0,
        }
    }
}

impl Tap {
    /// Lines written from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Bytes> {
        self.tx.subscribe()
    }

    /// Whether anyone listens (the writer copies lines only then).
    pub(super) fn active(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// Publish one written line (without its newline).
    pub(crate) fn publish(&self, line: &[u8]) {
        // No receiver left: nothing to do.
        let _ = self.tx.send(Bytes::copy_from_slice(line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_gets_lines_from_its_subscription_on_and_a_lag_count_past_the_ring() {
        let tap = Tap::default();
        assert!(!tap.active());
        tap.publish(b"before");
        let mut rx = tap.subscribe();
        assert!(tap.active());
        tap.publish(b"one");
        assert_eq!(rx.try_recv().unwrap(), Bytes::from_static(b"one"));
        for _ in 0..TAP_BUFFER + 5 {
            tap.publish(b"x");
        }
        assert!(matches!(
            rx.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(5))
        ));
        drop(rx);
        assert!(!tap.active());
    }
}
