//! Connection caps: one global, one per org, one per source address for
//! connections charged to no org. A permit moves into the connection's task
//! and frees its slots when dropped. Orgs are counted by name, so a policy
//! reload that reorders or adds orgs keeps every count.
//!
//! A connection is charged to the org it is finally decided for:
//!
//! | at accept, the address maps to | charged at accept to | later |
//! |---|---|---|
//! | an org (identity `address`) | that org's cap and rate | moved if credentials name another org |
//! | no org (strangers, token clients) | its address's cap and rate (pre-authentication) | moved to the org its credentials name (explicit: the request head; SOCKS5: the authentication) |
//!
//! Moving to an org takes that org's rate token and cap slot first and only
//! then releases the address's slot: the pre-authentication permit is not
//! kept for the connection's life, so a NAT gateway of many token clients
//! is bounded by their orgs, not by `max_connections_per_client`. A
//! connection that never names an org (a stranger) stays on its address's
//! budget until it closes: one address can exhaust only its own budget.
//! IPv6 addresses are counted by /64, the block one host usually holds.
//! The global cap is taken at accept and held throughout.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::rate::{OrgLimiter, RateLimiter};
use super::share::{client_key, Payer, Share, Shares};
use crate::config::Limits;
use crate::policy::OrgRef;

/// Counters for the global cap, each org's cap and each source address's
/// cap, and the rates of new connections per org and per address.
#[derive(Debug)]
pub(crate) struct ConnLimits {
    global: Arc<Slot>,
    max_per_org: usize,
    new_per_org: OrgLimiter<Arc<str>>,
    max_per_client: usize,
    /// Connections held per payer: each org, each address of no org.
    held: Arc<Shares<Payer>>,
    new_per_client: RateLimiter<IpAddr>,
    /// `palisade_active_connections`, by org.
    active: prometheus::IntGaugeVec,
}

/// Which limit refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitHit {
    Global,
    Org,
    Rate,
    Client,
    ClientRate,
}

impl LimitHit {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            LimitHit::Global => "max_connections reached",
            LimitHit::Org => "max_connections_per_org reached",
            LimitHit::Rate => "max_new_connections_per_second_per_org exceeded",
            LimitHit::Client => "max_connections_per_client reached",
            LimitHit::ClientRate => "max_new_connections_per_second_per_client exceeded",
        }
    }
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
/// `palisade_active_connections` under the org it is charged to
/// (`unknown` while none).
#[derive(Debug)]
pub(crate) struct Permit {
    global: Arc<Slot>,
    /// What it is charged to besides the global cap (its org, else its
    /// address), and its gauge.
    charge: Mutex<(Share<Payer>, prometheus::IntGauge)>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.global.give_back();
        let charge = self.charge.get_mut().unwrap_or_else(|p| p.into_inner());
        charge.1.dec();
    }
}

impl Permit {
    /// The org this connection is charged to, if any.
    #[cfg(test)]
    pub(crate) fn org(&self) -> Option<Arc<str>> {
        let charge = self.charge.lock().unwrap_or_else(|p| p.into_inner());
        charge.0.key().org().cloned()
    }
}

impl ConnLimits {
    /// The caps of `limits`; permits count in `active`
    /// (`palisade_active_connections`).
    pub(crate) fn new(limits: &Limits, active: prometheus::IntGaugeVec) -> ConnLimits {
        let Limits {
            max_connections: max_global,
            max_connections_per_org: max_per_org,
            max_new_connections_per_second_per_org: new_per_second_per_org,
            max_connections_per_client: max_per_client,
            max_new_connections_per_second_per_client: new_per_second_per_client,
            ..
        } = *limits;
        ConnLimits {
            global: Arc::new(Slot {
                used: AtomicUsize::new(0),
                max: max_global,
            }),
            max_per_org,
            // Orgs come from the config: a small, bounded set.
            new_per_org: RateLimiter::new(new_per_second_per_org, 65_536),
            max_per_client,
            held: Shares::new(),
            // Full of addresses active this second, a new one is refused.
            new_per_client: RateLimiter::new(new_per_second_per_client, 65_536),
            active,
        }
    }

    /// Take `org`'s rate token and cap slot.
    fn take_org(&self, name: &Arc<str>) -> Result<Share<Payer>, LimitHit> {
        if !self.new_per_org.allow(name, Instant::now()) {
            return Err(LimitHit::Rate);
        }
        self.held
            .take(Payer::Org(name.clone()), 1, self.max_per_org)
            .ok_or(LimitHit::Org)
    }

    /// Take a slot of `client`'s address key, with its rate token.
    fn take_client(&self, client: IpAddr) -> Result<Share<Payer>, LimitHit> {
        let key = client_key(client);
        if !self.new_per_client.allow(&key, Instant::now()) {
            return Err(LimitHit::ClientRate);
        }
        self.held
            .take(Payer::Client(key), 1, self.max_per_client)
            .ok_or(LimitHit::Client)
    }

    /// A permit at accept, if no cap or rate is exceeded: charged to `org`
    /// when the address names one, otherwise to the address `client`.
    pub(crate) fn try_acquire(
        &self,
        client: IpAddr,
        org: Option<&OrgRef>,
    ) -> Result<Permit, LimitHit> {
        let charge = match org {
            Some(o) => self.take_org(&o.name)?,
            None => self.take_client(client)?,
        };
        // Over the global cap, `charge` is dropped: its slot given back.
        let global = self.global.try_take().ok_or(LimitHit::Global)?;
        let active = self
            .active
            .with_label_values(&[crate::metrics::org_label(org)]);
        active.inc();
        Ok(Permit {
            global,
            charge: Mutex::new((charge, active)),
        })
    }

    /// Charge `permit` to `org`, the org it is decided for, once known.
    /// Nothing changes when it is already charged to `org`, or when `org`
    /// is none (the connection stays on what it holds). Otherwise `org`'s
    /// rate and cap are taken first, then what the permit held is released;
    /// over them, the permit keeps what it held.
    pub(crate) fn charge(&self, permit: &Permit, org: Option<&OrgRef>) -> Result<(), LimitHit> {
        let Some(org) = org else { return Ok(()) };
        let mut charge = permit.charge.lock().unwrap_or_else(|p| p.into_inner());
        if charge.0.key().org() == Some(&org.name) {
            return Ok(());
        }
        let share = self.take_org(&org.name)?;
        let active = self.active.with_label_values(&[&org.name]);
        active.inc();
        // The old share is dropped here: its slot given back.
        let (_old, old_active) = std::mem::replace(&mut *charge, (share, active));
        old_active.dec();
        Ok(())
    }

    /// Connections currently held, all orgs together.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        self.global.used.load(Ordering::Relaxed)
    }

    /// Connections held by `client`'s address key while charged to no org.
    #[cfg(test)]
    pub(crate) fn held_by_client(&self, client: IpAddr) -> usize {
        self.held.held(&Payer::client(client))
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

    fn limits(l: Limits) -> (ConnLimits, prometheus::IntGaugeVec) {
        let active =
            prometheus::IntGaugeVec::new(prometheus::Opts::new("a", "a"), &["org"]).unwrap();
        (ConnLimits::new(&l, active.clone()), active)
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 1, 2));
    const STRANGER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(203, 0, 113, 9));

    #[test]
    fn caps_hold_and_release() {
        let (limits, active) = limits(Limits {
            max_connections: 3,
            max_connections_per_org: 2,
            max_new_connections_per_second_per_org: 1000,
            ..Limits::default()
        });
        let a = limits.try_acquire(A, Some(&org(0, "a"))).unwrap();
        let _b = limits.try_acquire(A, Some(&org(7, "a"))).unwrap();
        assert!(
            limits.try_acquire(A, Some(&org(0, "a"))).err() == Some(LimitHit::Org),
            "per-org cap, by name"
        );
        let _c = limits.try_acquire(B, Some(&org(0, "b"))).unwrap();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::Global),
            "global cap"
        );
        assert_eq!(limits.in_use(), 3);
        assert_eq!(active.with_label_values(&["a"]).get(), 2);
        assert_eq!(limits.held_by_client(STRANGER), 0, "refused: nothing held");
        drop(a);
        assert_eq!(active.with_label_values(&["a"]).get(), 1);
        assert!(limits.try_acquire(STRANGER, None).is_ok());
    }

    #[test]
    fn a_stranger_exhausts_only_its_own_address_budget() {
        let (limits, active) = limits(Limits {
            max_connections_per_client: 3,
            max_connections_per_org: 2,
            ..Limits::default()
        });
        let held: Vec<Permit> = (0..3)
            .map(|_| limits.try_acquire(STRANGER, None).unwrap())
            .collect();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::Client)
        );
        assert_eq!(limits.held_by_client(STRANGER), 3);
        assert_eq!(active.with_label_values(&["unknown"]).get(), 3);
        // A token client on another address: pre-auth on its own address,
        // then charged to its org, whose cap is untouched by the stranger.
        let token = org(1, "tok");
        let p = limits.try_acquire(A, None).unwrap();
        assert_eq!(limits.held_by_client(A), 1);
        limits.charge(&p, Some(&token)).unwrap();
        assert_eq!(limits.held_by_client(A), 0, "pre-auth slot released");
        assert_eq!(p.org().as_deref(), Some("tok"));
        assert_eq!(active.with_label_values(&["tok"]).get(), 1);
        assert_eq!(active.with_label_values(&["unknown"]).get(), 3);
        limits.charge(&p, Some(&token)).unwrap();
        let q = limits.try_acquire(A, None).unwrap();
        limits.charge(&q, Some(&token)).unwrap();
        // Over the org's cap: the connection keeps its pre-auth slot.
        let r = limits.try_acquire(A, None).unwrap();
        assert_eq!(limits.charge(&r, Some(&token)), Err(LimitHit::Org));
        assert_eq!(limits.held_by_client(A), 1);
        assert_eq!(r.org(), None);
        drop((p, q, r));
        assert_eq!(limits.held_by_client(A), 0);
        assert_eq!(active.with_label_values(&["tok"]).get(), 0);
        drop(held);
        assert_eq!(
            limits.held_by_client(STRANGER),
            0,
            "entries go with their slots"
        );
        assert_eq!(limits.held.keys(), 0);
        assert_eq!(limits.in_use(), 0);
    }

    #[test]
    fn a_stranger_spends_only_its_own_address_rate() {
        let (limits, _) = limits(Limits {
            max_new_connections_per_second_per_client: 2,
            ..Limits::default()
        });
        let _held: Vec<Permit> = (0..2)
            .map(|_| limits.try_acquire(STRANGER, None).unwrap())
            .collect();
        assert_eq!(
            limits.try_acquire(STRANGER, None).err(),
            Some(LimitHit::ClientRate)
        );
        assert!(limits.try_acquire(A, None).is_ok(), "another address");
    }

    #[test]
    fn an_org_moves_its_connection_to_another_org() {
        let (limits, active) = limits(Limits::default());
        let p = limits.try_acquire(A, Some(&org(0, "addr"))).unwrap();
        limits.charge(&p, None).unwrap();
        assert_eq!(p.org().as_deref(), Some("addr"), "no org named: kept");
        limits.charge(&p, Some(&org(1, "tok"))).unwrap();
        assert_eq!(active.with_label_values(&["addr"]).get(), 0);
        assert_eq!(active.with_label_values(&["tok"]).get(), 1);
        drop(p);
        assert_eq!(active.with_label_values(&["tok"]).get(), 0);
        assert_eq!(limits.in_use(), 0);
    }
}
