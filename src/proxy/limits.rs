//! Connection caps: one global, one per org. A permit moves into the
//! connection's task and frees its slots when dropped. Orgs are counted by
//! name, so a policy reload that reorders or adds orgs keeps every count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::policy::OrgRef;

/// Counters for the global cap and each org's cap (clients of no org share
/// the `unknown` one).
#[derive(Debug)]
pub struct ConnLimits {
    global: Arc<Slot>,
    max_per_org: usize,
    per_org: Mutex<HashMap<Arc<str>, Arc<Slot>>>,
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
    pub fn new(max_global: usize, max_per_org: usize) -> ConnLimits {
        ConnLimits {
            global: Arc::new(Slot {
                used: AtomicUsize::new(0),
                max: max_global,
            }),
            max_per_org,
            per_org: Mutex::new(HashMap::new()),
        }
    }

    fn org_slot(&self, org: Option<&OrgRef>) -> Arc<Slot> {
        let name: Arc<str> = org.map_or_else(
            || Arc::from(crate::metrics::UNKNOWN_ORG),
            |o| o.name.clone(),
        );
        let mut map = self.per_org.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(name)
            .or_insert_with(|| {
                Arc::new(Slot {
                    used: AtomicUsize::new(0),
                    max: self.max_per_org,
                })
            })
            .clone()
    }

    /// A permit if neither the global nor the org's cap is reached.
    pub fn try_acquire(&self, org: Option<&OrgRef>) -> Option<Permit> {
        let org_slot = self.org_slot(org);
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

    fn org(index: usize, name: &str) -> OrgRef {
        OrgRef {
            index,
            name: Arc::from(name),
        }
    }

    #[test]
    fn caps_hold_and_release() {
        let limits = ConnLimits::new(3, 2);
        let a = limits.try_acquire(Some(&org(0, "a"))).unwrap();
        let _b = limits.try_acquire(Some(&org(7, "a"))).unwrap();
        assert!(
            limits.try_acquire(Some(&org(0, "a"))).is_none(),
            "per-org cap, by name"
        );
        let _c = limits.try_acquire(Some(&org(0, "b"))).unwrap();
        assert!(limits.try_acquire(None).is_none(), "global cap");
        assert_eq!(limits.in_use(), 3);
        drop(a);
        assert!(limits.try_acquire(None).is_some());
    }
}
