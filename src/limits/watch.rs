//! A relay's volume budgets as it runs: [`Watch`], told what moved (a
//! tunnel's totals, or a body's pieces before they go) and cutting the
//! relay once a budget is spent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

use super::volume::{Direction, Scope};
use super::Lease;

/// A tunnel's volume budgets, told the totals after every transfer (the
/// copy's or splice's activity mark): it charges what moved since to the
/// budgets, and the first time one is spent it notes which and, when
/// `cut` is given (an enforcing org), cancels it to close the tunnel. So
/// a tunnel passes a budget by at most the one transfer that crossed it:
/// a read of the tunnel's copy buffer (64 KiB) or one splice (256 KiB).
pub(crate) struct Watch {
    lease: Lease,
    charged: [AtomicU64; 2],
    crossed: Mutex<Option<(Scope, Direction)>>,
    cut: Option<CancellationToken>,
}

impl Watch {
    /// Watch `lease`, cancelling `cut` (if any) once a budget is spent.
    pub(crate) fn new(lease: Lease, cut: Option<CancellationToken>) -> Watch {
        Watch {
            lease,
            charged: [AtomicU64::new(0), AtomicU64::new(0)],
            crossed: Mutex::new(None),
            cut,
        }
    }

    /// The tunnel's totals are `up` and `down`: charge what is new.
    /// `false` once a budget is spent and the tunnel is to be cut: the
    /// copy stops at once, without waiting for its task to be polled.
    pub(crate) fn moved(&self, up: &AtomicU64, down: &AtomicU64) -> bool {
        let now = std::time::Instant::now();
        for (i, direction, total) in [(0, Direction::Up, up), (1, Direction::Down, down)] {
            let total = total.load(Ordering::Relaxed);
            // fetch_max: each byte charged once, whichever side reports.
            let before = self.charged[i].fetch_max(total, Ordering::Relaxed);
            if total <= before {
                continue;
            }
            if let Some(scope) = self.lease.spend(direction, total - before, now) {
                self.cross(scope, direction);
            }
        }
        self.cut.as_ref().is_none_or(|c| !c.is_cancelled())
    }

    /// `bytes` of a body about to move `direction`: how many of them may
    /// go (all of them for a report-mode org), charged. Fewer than asked:
    /// the budget is spent, the watch cut (its relay is to stop at once,
    /// both ways), the rest held back. So a body never passes its budget.
    pub(crate) fn take(&self, direction: Direction, bytes: u64) -> u64 {
        let now = std::time::Instant::now();
        let (granted, over) = self.lease.take(direction, bytes, now, self.cut.is_none());
        if let Some(scope) = over {
            self.cross(scope, direction);
        }
        granted
    }

    /// `scope`'s budget was spent moving `direction`: noted the first
    /// time, and the relay cut (an enforcing org's).
    fn cross(&self, scope: Scope, direction: Direction) {
        let mut crossed = self.crossed.lock().unwrap_or_else(|e| e.into_inner());
        if crossed.is_none() {
            *crossed = Some((scope, direction));
            if let Some(cut) = &self.cut {
                cut.cancel();
            }
        }
    }

    /// Whether a budget was spent and the relay cut (an enforcing org's).
    pub(crate) fn is_cut(&self) -> bool {
        self.cut.is_some() && self.crossed().is_some()
    }

    /// The budget the tunnel spent, and in which direction, if it did.
    pub(crate) fn crossed(&self) -> Option<(Scope, Direction)> {
        self.crossed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The budgets watched.
    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }
}
