//! Connection caps: one global, one per org. A permit moves into the
//! connection's task and frees its slots when dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::policy::OrgRef;

/// Counters for the global cap and each org's cap (the last slot counts
/// clients of no org).
#[derive(Debug)]
pub struct ConnLimits {
    global: Arc<Slot>,
    per_org: Vec<Arc<Slot>>,
}

#[derive(Debug)]
struct Slot {
    used: AtomicUsize,
    max: usize,
}

impl Slot {
    fn try_take(self: &Arc<Self>) -> Option<Arc<Self>> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            if used >= self.max {
                return None;
            }
            match self.used.compare_exchange_weak(
                used,
                used + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.clone()),
                Err(now) => used = now,
            }
        }
    }

    fn give_back(&self) {
        self.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Held for the life of one client connection; counted in
/// `palisade_active_connections` while it lives.
#[derive(Debug)]
pub struct Permit {
    slots: [Arc<Slot>; 2],
    active: prometheus::IntGauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        for slot in &self.slots {
            slot.give_back();
        }
        self.active.dec();
    }
}

impl ConnLimits {
    pub fn new(org_count: usize, max_global: usize, max_per_org: usize) -> ConnLimits {
        let slot = |max| {
            Arc::new(Slot {
                used: AtomicUsize::new(0),
                max,
            })
        };
        ConnLimits {
            global: slot(max_global),
            per_org: (0..=org_count).map(|_| slot(max_per_org)).collect(),
        }
    }

    /// A permit if neither the global nor the org's cap is reached.
    pub fn try_acquire(&self, org: Option<&OrgRef>) -> Option<Permit> {
        let index = org.map_or(self.per_org.len() - 1, |o| o.index);
        let org_slot = self.per_org.get(index).or(self.per_org.last())?;
        let global = self.global.try_take()?;
        match org_slot.try_take() {
            Some(org_slot) => {
                let active = crate::metrics::metrics()
                    .active_connections
                    .with_label_values(&[crate::metrics::org_label(org)]);
                active.inc();
                Some(Permit {
                    slots: [global, org_slot],
                    active,
                })
            }
            None => {
                global.give_back();
                None
            }
        }
    }

    /// Connections currently held, all orgs together.
    pub fn in_use(&self) -> usize {
        self.global.used.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn org(index: usize) -> OrgRef {
        OrgRef {
            index,
            name: Arc::from("o"),
        }
    }

    #[test]
    fn caps_hold_and_release() {
        let limits = ConnLimits::new(2, 3, 2);
        let a = limits.try_acquire(Some(&org(0))).unwrap();
        let _b = limits.try_acquire(Some(&org(0))).unwrap();
        assert!(limits.try_acquire(Some(&org(0))).is_none(), "per-org cap");
        let _c = limits.try_acquire(Some(&org(1))).unwrap();
        assert!(limits.try_acquire(None).is_none(), "global cap");
        assert_eq!(limits.in_use(), 3);
        drop(a);
        assert!(limits.try_acquire(None).is_some());
    }
}
