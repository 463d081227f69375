//! Detection memory: the first bytes of connections read and held before
//! their decisions, shared so that neither one org nor one stranger can
//! take the whole pool.

use std::net::IpAddr;
use std::sync::Arc;

use tokio::sync::{Semaphore, SemaphorePermit};

use super::share::{Payer, Share, Shares};
use crate::config::{Limits, DETECT_MEMORY_CLIENT_SHARE};
use crate::policy::OrgRef;

/// Detection memory (first bytes read and held before a decision), in
/// units of `unit` bytes (the proxy's longest first read): a global pool, a
/// share per org (`max_detect_memory_bytes_per_org`) and a small share per
/// address of no org (a sixty-fourth of the global), so that neither one
/// org nor one stranger can take the whole pool.
#[derive(Debug)]
pub(crate) struct DetectMemory {
    global: Semaphore,
    shares: Arc<Shares<Payer>>,
    per_org: usize,
    per_client: usize,
}

impl DetectMemory {
    /// The pools of `limits`, in units of `unit` bytes.
    pub(crate) fn new(limits: &Limits, unit: usize) -> DetectMemory {
        let unit = unit.max(1);
        let units = |bytes: usize| (bytes / unit).max(1);
        DetectMemory::with_units(
            units(limits.max_detect_memory_bytes),
            units(limits.max_detect_memory_bytes_per_org),
            units(limits.max_detect_memory_bytes / DETECT_MEMORY_CLIENT_SHARE),
        )
    }

    pub(crate) fn with_units(global: usize, per_org: usize, per_client: usize) -> DetectMemory {
        DetectMemory {
            global: Semaphore::new(global),
            shares: Shares::new(),
            per_org,
            per_client,
        }
    }

    /// Where a connection of `org` (or of none) from `client` is charged.
    pub(crate) fn scope(&self, org: Option<&OrgRef>, client: IpAddr) -> DetectScope<'_> {
        let holder = Payer::of(org.map(|o| &o.name), client);
        let max = match holder {
            Payer::Org(_) => self.per_org,
            Payer::Client(_) => self.per_client,
        };
        DetectScope {
            memory: self,
            holder,
            max,
        }
    }

    /// Units free in the global pool.
    #[cfg(test)]
    pub(crate) fn available(&self) -> usize {
        self.global.available_permits()
    }

    /// Units `holder` holds now.
    #[cfg(test)]
    pub(crate) fn held_by(&self, holder: &Payer) -> usize {
        self.shares.held(holder)
    }
}

/// One holder's view of the detection memory.
#[derive(Debug, Clone)]
pub(crate) struct DetectScope<'a> {
    memory: &'a DetectMemory,
    holder: Payer,
    max: usize,
}

impl<'a> DetectScope<'a> {
    /// Nothing held yet; grow with [`DetectHold::cover`].
    pub(crate) fn hold(&self) -> DetectHold<'a> {
        DetectHold {
            scope: self.clone(),
            global: None,
            share: None,
        }
    }

    /// `units` held at once, or `None` over the global pool or the share.
    pub(crate) fn try_hold(&self, units: usize) -> Option<DetectHold<'a>> {
        let mut hold = self.hold();
        hold.cover(units).then_some(hold)
    }
}

/// Units held from the global pool and the holder's share; released on drop.
#[derive(Debug)]
pub(crate) struct DetectHold<'a> {
    scope: DetectScope<'a>,
    global: Option<SemaphorePermit<'a>>,
    share: Option<Share<Payer>>,
}

impl DetectHold<'_> {
    /// Hold `units` in all (more if needed); `false` if the global pool or
    /// the holder's share has no room (what was held stays held).
    pub(crate) fn cover(&mut self, units: usize) -> bool {
        let have = self.global.as_ref().map_or(0, |p| p.num_permits());
        if units <= have {
            return true;
        }
        let more = units - have;
        let share_ok =
            match &mut self.share {
                Some(share) => share.grow(more),
                None => match self.scope.memory.shares.take(
                    self.scope.holder.clone(),
                    more,
                    self.scope.max,
                ) {
                    Some(share) => {
                        self.share = Some(share);
                        true
                    }
                    None => false,
                },
            };
        if !share_ok {
            return false;
        }
        let Ok(taken) = self.scope.memory.global.try_acquire_many(more as u32) else {
            // Give the share back to what the global pool covers.
            if let Some(share) = &mut self.share {
                share.shrink(more);
            }
            return false;
        };
        match &mut self.global {
            Some(p) => p.merge(taken),
            None => self.global = Some(taken),
        }
        true
    }

    /// Give everything back.
    pub(crate) fn release(&mut self) {
        self.global = None;
        self.share = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 2));
    const STRANGER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 9));

    fn org(index: usize, name: &str) -> OrgRef {
        OrgRef {
            index,
            name: Arc::from(name),
        }
    }

    #[test]
    fn detection_memory_is_shared_per_org_and_per_stranger_address() {
        let memory = DetectMemory::with_units(10, 4, 2);
        let (a, b) = (org(0, "a"), org(1, "b"));
        // One org takes its share, no more, and other orgs still get theirs.
        let mut hold_a = memory.scope(Some(&a), A).hold();
        assert!(hold_a.cover(4));
        assert!(!hold_a.cover(5), "org share");
        assert_eq!(memory.held_by(&Payer::Org("a".into())), 4, "kept");
        assert!(
            memory.scope(Some(&a), B).try_hold(1).is_none(),
            "share of the org, whatever the address"
        );
        let hold_b = memory.scope(Some(&b), B).try_hold(4).unwrap();
        // A stranger: its address's small share, never an org's.
        let s1 = memory.scope(None, STRANGER).try_hold(2).unwrap();
        assert!(memory.scope(None, STRANGER).try_hold(1).is_none());
        assert_eq!(memory.held_by(&Payer::Org("a".into())), 4);
        assert_eq!(memory.available(), 0);
        // The global pool bounds them all: nothing left for another address,
        // and a refusal by the pool leaves its share untouched.
        assert!(memory.scope(None, A).try_hold(1).is_none());
        assert_eq!(memory.held_by(&Payer::Client(A)), 0);
        drop((hold_b, s1));
        hold_a.release();
        assert_eq!(memory.available(), 10);
        assert_eq!(memory.shares.keys(), 0, "no entry outlives its holds");
    }
}
