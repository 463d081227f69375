//! The shim's budgets, so that one client or one org cannot take what all
//! share: queries in flight (global, and per org, or per address for a
//! client in no org) and DNS-over-TCP connections (global, per client
//! address, per org). A charge is held for the life of the query or the
//! connection and gives its place back when dropped.
//!
//! | budget | charged to | over it |
//! |---|---|---|
//! | `max_queries_in_flight` | everyone | REFUSED `limit_exceeded` |
//! | `max_queries_in_flight_per_org` | the client's org; a client in no org: its own address, never an org | REFUSED `limit_exceeded` |
//! | `max_tcp_connections` | everyone | connection closed at once, `limit_exceeded` |
//! | `max_tcp_connections_per_client` | the client address | connection closed at once, `limit_exceeded` |
//! | `max_tcp_connections_per_org` | the client's org (a client in no org: none) | connection closed at once, `limit_exceeded` |
//!
//! The global place is taken first, so the per-key tables never hold more
//! keys than there are global places. Who pays, and the shares they hold,
//! are the proxy's too ([`crate::limits::share`]): an org, else the client's
//! address (IPv6 by /64).

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::config::DnsConfig;
use crate::limits::{Payer, Share, Shares};

/// A place in the in-flight budgets, held while a query (or a TCP
/// connection) is being served.
#[derive(Debug)]
pub(crate) struct InFlight {
    _global: Place,
    /// One charge (a query's payer), or two (a TCP connection's client
    /// address and org): held inline, no allocation per query.
    _charges: [Option<Share<Payer>>; 2],
}

/// The places of a global budget: taken at once or refused, never
/// waited for, so a counter (no semaphore's waiter list to lock per query).
#[derive(Debug)]
struct Places {
    used: Arc<AtomicUsize>,
    max: usize,
}

/// One place of a global budget, given back when dropped.
#[derive(Debug)]
struct Place(Arc<AtomicUsize>);

impl Places {
    fn new(max: usize) -> Places {
        Places {
            used: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// A place, or the name of the limit (`limit`) when all are taken.
    fn take(&self, limit: &'static str) -> Result<Place, &'static str> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u < self.max).then_some(u + 1)
            })
            .map(|_| Place(self.used.clone()))
            .map_err(|_| limit)
    }

    /// Places not taken.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.max - self.used.load(Ordering::Acquire)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Queries in flight: global, and per payer.
#[derive(Debug)]
pub(crate) struct QueryBudget {
    global: Places,
    per_payer: Arc<Shares<Payer>>,
    max_per_payer: usize,
}

impl QueryBudget {
    pub(crate) fn new(config: &DnsConfig) -> QueryBudget {
        QueryBudget {
            global: Places::new(config.max_queries_in_flight),
            per_payer: Shares::new(),
            max_per_payer: config.max_queries_in_flight_per_org.max(1),
        }
    }

    /// A place for one query, or the name of the limit it is over.
    pub(crate) fn try_take(
        &self,
        client: IpAddr,
        org: Option<&Arc<str>>,
    ) -> Result<InFlight, &'static str> {
        let global = self.global.take("max_queries_in_flight reached")?;
        let payer = Payer::of(org, client);
        let over = match payer {
            Payer::Org(_) => "max_queries_in_flight_per_org reached",
            Payer::Client(_) => "max_queries_in_flight_per_org reached by this address (in no org)",
        };
        let charge = self
            .per_payer
            .take(payer, 1, self.max_per_payer)
            .ok_or(over)?;
        Ok(InFlight {
            _global: global,
            _charges: [Some(charge), None],
        })
    }
}

/// DNS-over-TCP connections: global, per client address, per org.
#[derive(Debug)]
pub(crate) struct TcpBudget {
    global: Places,
    /// Connections per client address and per org, in one table.
    held: Arc<Shares<Payer>>,
    max_per_client: usize,
    max_per_org: usize,
}

impl TcpBudget {
    pub(crate) fn new(config: &DnsConfig) -> TcpBudget {
        TcpBudget {
            global: Places::new(config.max_tcp_connections),
            held: Shares::new(),
            max_per_client: config.max_tcp_connections_per_client.max(1),
            max_per_org: config.max_tcp_connections_per_org.max(1),
        }
    }

    /// A place for one connection, or the name of the limit it is over.
    pub(crate) fn try_take(
        &self,
        client: IpAddr,
        org: Option<&Arc<str>>,
    ) -> Result<InFlight, &'static str> {
        let global = self.global.take("max_tcp_connections reached")?;
        let by_client = self
            .held
            .take(Payer::client(client), 1, self.max_per_client)
            .ok_or("max_tcp_connections_per_client reached")?;
        let by_org = match org {
            Some(org) => Some(
                self.held
                    .take(Payer::Org(org.clone()), 1, self.max_per_org)
                    .ok_or("max_tcp_connections_per_org reached")?,
            ),
            None => None,
        };
        Ok(InFlight {
            _global: global,
            _charges: [Some(by_client), by_org],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tcp: usize, per_client: usize, per_org: usize) -> DnsConfig {
        DnsConfig {
            max_tcp_connections: tcp,
            max_tcp_connections_per_client: per_client,
            max_tcp_connections_per_org: per_org,
            max_queries_in_flight: tcp,
            max_queries_in_flight_per_org: per_org,
            ..DnsConfig::default()
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_client_cannot_take_every_tcp_place() {
        let b = TcpBudget::new(&config(8, 2, 4));
        let (acme, beta): (Arc<str>, Arc<str>) = (Arc::from("acme"), Arc::from("beta"));
        let a1 = ip("198.18.1.2");
        let held: Vec<InFlight> = (0..2)
            .map(|_| b.try_take(a1, Some(&acme)).unwrap())
            .collect();
        assert_eq!(
            b.try_take(a1, Some(&acme)).unwrap_err(),
            "max_tcp_connections_per_client reached"
        );
        // Other clients of the org, up to the org's share.
        let more: Vec<InFlight> = ["198.18.1.3", "198.18.1.3"]
            .iter()
            .map(|c| b.try_take(ip(c), Some(&acme)).unwrap())
            .collect();
        assert_eq!(
            b.try_take(ip("198.18.1.4"), Some(&acme)).unwrap_err(),
            "max_tcp_connections_per_org reached"
        );
        // Another org is untouched.
        let other = b.try_take(ip("198.18.4.2"), Some(&beta)).unwrap();
        // A refused charge gives back what it took.
        assert_eq!(b.global.available(), 8 - 5);
        drop((held, more, other));
        assert_eq!(b.global.available(), 8);
        assert_eq!(b.held.keys(), 0);
    }

    #[test]
    fn clients_in_no_org_pay_by_address_never_for_an_org() {
        let b = QueryBudget::new(&config(16, 1, 2));
        let acme: Arc<str> = Arc::from("acme");
        let stranger = ip("198.18.3.2");
        let held: Vec<InFlight> = (0..2)
            .map(|_| b.try_take(stranger, None).unwrap())
            .collect();
        assert!(b
            .try_take(stranger, None)
            .unwrap_err()
            .contains("by this address"));
        // Another stranger has its own budget; the org keeps all of its own.
        let other = b.try_take(ip("198.18.3.3"), None).unwrap();
        let orgs: Vec<InFlight> = (0..2)
            .map(|_| b.try_take(ip("198.18.1.2"), Some(&acme)).unwrap())
            .collect();
        assert_eq!(
            b.try_take(ip("198.18.1.2"), Some(&acme)).unwrap_err(),
            "max_queries_in_flight_per_org reached"
        );
        drop((held, other, orgs));
        assert_eq!(b.per_payer.keys(), 0);
        assert_eq!(b.global.available(), 16);
    }
}
