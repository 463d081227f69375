//! Upstream name resolution for the proxy: only the configured servers, no
//! hosts file, no search list, every name queried as fully qualified.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_resolver::config::{
    ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};
use hickory_resolver::TokioResolver;

use prometheus::Histogram;

use crate::metrics::Metrics;

/// Why a name has no addresses.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error("no upstream resolver configured")]
    NoUpstream,
    #[error("resolving {name:?} timed out")]
    Timeout { name: String },
    #[error("resolving {name:?} failed: {reason}")]
    Failed { name: String, reason: String },
    #[error("{name:?} has no addresses")]
    Empty { name: String },
}

/// What an upstream answer to a general query was, when it had no records.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RecordsError {
    #[error("no upstream resolver configured")]
    NoUpstream,
    /// The resolver may keep saying so for `negative_ttl` seconds (when the
    /// upstream answer carried an SOA to tell).
    #[error("name does not exist")]
    NxDomain { negative_ttl: Option<u32> },
    #[error("no records of this type")]
    NoData { negative_ttl: Option<u32> },
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Failed(String),
}

/// The records of a general query, and until when the resolver's cache
/// gives this same answer (its TTLs counting down meanwhile).
#[derive(Debug)]
pub(crate) struct Records {
    pub records: Vec<Record>,
    pub valid_until: Instant,
}

/// Resolves names through the configured upstream servers.
pub(crate) struct Resolver {
    inner: Option<TokioResolver>,
    timeout: Duration,
    /// Where resolution time is counted, when served: the `ok` and the
    /// `error` histograms.
    timings: Option<[Histogram; 2]>,
    failed_families: Expiring<Family>,
    /// The addresses of names resolved lately, each until one of its
    /// families would be asked again ([`Resolver::lookup`]).
    recent: Expiring<Arc<[IpAddr]>>,
}

/// How long a family that failed (while the other answered) is not asked.
pub(crate) const FAILED_FAMILY_HOLD: Duration = Duration::from_secs(10);
/// Names remembered at most (held families, recent addresses); when full,
/// expired entries go, then all.
const REMEMBERED_NAMES: usize = 4096;

/// Why one family's query gave no addresses.
#[derive(Debug, thiserror::Error)]
enum FamilyError {
    #[error("no records found")]
    NoRecords,
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Other(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// Something known about names until a moment each: bounded to
/// [`REMEMBERED_NAMES`]. Held families (a name whose A or AAAA query failed
/// while the other family answered, each for [`FAILED_FAMILY_HOLD`]) and
/// recent addresses.
struct Expiring<V>(Mutex<HashMap<Box<str>, (V, Instant)>>);

impl<V> Default for Expiring<V> {
    fn default() -> Self {
        Expiring(Mutex::new(HashMap::new()))
    }
}

impl<V: Clone> Expiring<V> {
    /// What is known about `name` at `now`, and until when.
    fn get(&self, name: &str, now: Instant) -> Option<(V, Instant)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(name) {
            Some((v, until)) if *until > now => Some((v.clone(), *until)),
            _ => None,
        }
    }

    fn put(&self, name: &str, v: V, until: Instant, now: Instant) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= REMEMBERED_NAMES && !map.contains_key(name) {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= REMEMBERED_NAMES {
                map.clear();
            }
        }
        map.insert(name.into(), (v, until));
    }
}

impl Resolver {
    pub(crate) fn new(
        upstreams: &[SocketAddr],
        timeout: Duration,
    ) -> Result<Resolver, ResolveError> {
        if upstreams.is_empty() {
            return Ok(Resolver {
                inner: None,
                timeout,
                timings: None,
                failed_families: Expiring::default(),
                recent: Expiring::default(),
            });
        }
        let servers = upstreams
            .iter()
            .map(|addr| {
                let mut udp = ConnectionConfig::udp();
                udp.port = addr.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = addr.port();
                NameServerConfig::new(addr.ip(), true, vec![udp, tcp])
            })
            .collect();
        let mut opts = ResolverOpts::default();
        opts.use_hosts_file = ResolveHosts::Never;
        opts.ndots = 0;
        opts.timeout = timeout;
        opts.attempts = 1;
        opts.cache_size = 4096;
        let inner = TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(servers),
            TokioRuntimeProvider::default(),
        )
        .with_options(opts)
        .build()
        .map_err(|e| ResolveError::Failed {
            name: String::new(),
            reason: e.to_string(),
        })?;
        Ok(Resolver {
            inner: Some(inner),
            timeout,
            timings: None,
            failed_families: Expiring::default(),
            recent: Expiring::default(),
        })
    }

    /// Count resolution time in `metrics`.
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>) -> Resolver {
        let timing = |result| {
            metrics
                .resolve_duration_seconds
                .with_label_values(&[result])
        };
        self.timings = Some([timing("ok"), timing("error")]);
        self
    }

    /// Addresses of a normalised name, A records before AAAA.
    ///
    /// A and AAAA are asked for side by side through the cache. The cache
    /// keeps answers and (with an SOA) "no such records", but not a failure
    /// such as `REFUSED`, `SERVFAIL` or no answer in time: an upstream that
    /// always fails one family would be asked again (or waited for) on every
    /// connection. So when one family fails while the other has addresses,
    /// that family is not asked for this name for [`FAILED_FAMILY_HOLD`];
    /// the addresses dialled are still the other family's, decided as
    /// always.
    pub(crate) async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let started = Instant::now();
        if let Some((addrs, _)) = self.recent.get(name, started) {
            self.time(true, started);
            return Ok(addrs.to_vec());
        }
        // Boxed: the lookups' state is large, and every future that awaits
        // a decision would otherwise carry (and move) it.
        let outcome = Box::pin(self.ask(name, started)).await;
        self.time(outcome.is_ok(), started);
        outcome
    }

    /// Count a resolution's time, when served.
    fn time(&self, ok: bool, started: Instant) {
        if let Some(t) = &self.timings {
            t[usize::from(!ok)].observe(started.elapsed().as_secs_f64());
        }
    }

    /// [`Resolver::lookup`] through the resolver's cache. Addresses found
    /// are remembered in `recent` until the earliest moment the same lookup
    /// could give something else: a family's answer expiring from the
    /// cache, or a held family asked again. An outcome with a family that
    /// found no records (which the cache may not keep) is not remembered.
    async fn ask(&self, name: &str, started: Instant) -> Result<Vec<IpAddr>, ResolveError> {
        let Some(inner) = &self.inner else {
            return Err(ResolveError::NoUpstream);
        };
        let fqdn = Name::from_ascii(format!("{name}.")).map_err(|e| ResolveError::Failed {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        let held = self.failed_families.get(name, started);
        // Each family within `timeout` on its own: one that hangs (an
        // upstream that drops AAAA queries) fails alone, and the other's
        // addresses still count.
        let timeout = self.timeout;
        let family = |qtype: RecordType, skip: bool| {
            let fqdn = fqdn.clone();
            async move {
                if skip {
                    return None;
                }
                let answer = match tokio::time::timeout(timeout, inner.lookup(fqdn, qtype)).await {
                    Err(_) => Err(FamilyError::Timeout),
                    Ok(Err(NetError::Dns(DnsError::NoRecordsFound(_)))) => {
                        Err(FamilyError::NoRecords)
                    }
                    Ok(Err(NetError::Timeout)) => Err(FamilyError::Timeout),
                    Ok(Err(e)) => Err(FamilyError::Other(e.to_string())),
                    Ok(Ok(l)) => Ok((
                        l.answers()
                            .iter()
                            .filter_map(|r| match &r.data {
                                RData::A(a) => Some(IpAddr::V4(a.0)),
                                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                                _ => None,
                            })
                            .collect::<Vec<IpAddr>>(),
                        l.valid_until(),
                    )),
                };
                Some(answer)
            }
        };
        let held_family = held.map(|(fam, _)| fam);
        let (v4, v6) = tokio::join!(
            family(RecordType::A, held_family == Some(Family::V4)),
            family(RecordType::AAAA, held_family == Some(Family::V6)),
        );
        let mut addrs = Vec::new();
        let mut failure: Option<(Family, FamilyError)> = None;
        // Until when this outcome stands; none once a family found nothing.
        let mut until = held.map(|(_, until)| until);
        let mut lasting = true;
        for (fam, answer) in [(Family::V4, v4), (Family::V6, v6)] {
            match answer {
                None => {}
                Some(Err(FamilyError::NoRecords)) => lasting = false,
                Some(Ok((found, valid_until))) => {
                    addrs.extend(found);
                    until = Some(until.map_or(valid_until, |u| u.min(valid_until)));
                }
                Some(Err(f)) => {
                    // Held from now: asked again once the hold ends.
                    let hold = started + FAILED_FAMILY_HOLD;
                    until = Some(until.map_or(hold, |u| u.min(hold)));
                    failure.get_or_insert((fam, f));
                }
            }
        }
        match (addrs.is_empty(), failure) {
            (true, Some((_, FamilyError::Timeout))) => Err(ResolveError::Timeout {
                name: name.to_string(),
            }),
            (true, Some((_, f))) => Err(ResolveError::Failed {
                name: name.to_string(),
                reason: f.to_string(),
            }),
            (true, None) => Err(ResolveError::Empty {
                name: name.to_string(),
            }),
            (false, failed) => {
                if let Some((fam, _)) = failed {
                    self.failed_families
                        .put(name, fam, started + FAILED_FAMILY_HOLD, started);
                }
                if let Some(until) = until.filter(|_| lasting) {
                    self.recent
                        .put(name, addrs.as_slice().into(), until, started);
                }
                Ok(addrs)
            }
        }
    }

    /// Records of any type for a normalised name, through the same cache.
    /// The answer keeps a CNAME chain in front of the records it leads to.
    pub(crate) async fn lookup_records(
        &self,
        name: &str,
        qtype: RecordType,
    ) -> Result<Records, RecordsError> {
        let Some(inner) = &self.inner else {
            return Err(RecordsError::NoUpstream);
        };
        let fqdn = Name::from_ascii(format!("{name}."))
            .map_err(|e| RecordsError::Failed(e.to_string()))?;
        let lookup = tokio::time::timeout(self.timeout, inner.lookup(fqdn, qtype))
            .await
            .map_err(|_| RecordsError::Timeout)?;
        match lookup {
            Ok(l) => Ok(Records {
                records: l.answers().to_vec(),
                valid_until: l.valid_until(),
            }),
            Err(NetError::Dns(DnsError::NoRecordsFound(nr))) => {
                let negative_ttl = nr.negative_ttl;
                if nr.response_code == ResponseCode::NXDomain {
                    Err(RecordsError::NxDomain { negative_ttl })
                } else {
                    Err(RecordsError::NoData { negative_ttl })
                }
            }
            Err(NetError::Timeout) => Err(RecordsError::Timeout),
            Err(e) => Err(RecordsError::Failed(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_resolver::proto::op::{Message, MessageType, OpCode};
    use hickory_resolver::proto::rr::rdata::A;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::net::UdpSocket;

    /// A loopback upstream that answers A with 198.18.0.5 and AAAA with
    /// `REFUSED` (or not at all, `drop_aaaa`), counting the AAAA queries.
    async fn failing_aaaa(drop_aaaa: bool) -> (SocketAddr, Arc<AtomicUsize>) {
        let (addr, aaaa, _) = upstream_with(drop_aaaa, 300).await;
        (addr, aaaa)
    }

    /// [`failing_aaaa`] with A answers of TTL `ttl`, counting A queries too.
    async fn upstream_with(
        drop_aaaa: bool,
        ttl: u32,
    ) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let aaaa = Arc::new(AtomicUsize::new(0));
        let a = Arc::new(AtomicUsize::new(0));
        let (counted, counted_a) = (aaaa.clone(), a.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            loop {
                let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut reply =
                    Message::new(query.metadata.id, MessageType::Response, OpCode::Query);
                reply.metadata.recursion_available = true;
                reply.queries = query.queries.clone();
                let Some(q) = query.queries.first() else {
                    continue;
                };
                if q.query_type() == RecordType::AAAA {
                    counted.fetch_add(1, Ordering::SeqCst);
                    if drop_aaaa {
                        continue;
                    }
                    reply.metadata.response_code = ResponseCode::Refused;
                } else {
                    counted_a.fetch_add(1, Ordering::SeqCst);
                    reply.add_answer(Record::from_rdata(
                        q.name().clone(),
                        ttl,
                        RData::A(A::new(198, 18, 0, 5)),
                    ));
                }
                let _ = sock.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
        (addr, aaaa, a)
    }

    #[tokio::test]
    async fn a_family_that_fails_is_not_asked_again_while_the_other_answers() {
        let (upstream, aaaa) = failing_aaaa(false).await;
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        let want = vec![IpAddr::from([198, 18, 0, 5])];
        assert_eq!(resolver.lookup("two.test").await.unwrap(), want);
        let asked = aaaa.load(Ordering::SeqCst);
        assert!(asked >= 1, "AAAA was asked");
        for _ in 0..5 {
            assert_eq!(resolver.lookup("two.test").await.unwrap(), want);
        }
        assert_eq!(aaaa.load(Ordering::SeqCst), asked, "REFUSED AAAA held");
        // another name is asked for both families
        assert_eq!(resolver.lookup("other.test").await.unwrap(), want);
        assert!(aaaa.load(Ordering::SeqCst) > asked);
    }

    #[tokio::test]
    async fn a_family_that_never_answers_does_not_fail_the_other() {
        let (upstream, aaaa) = failing_aaaa(true).await;
        let resolver = Resolver::new(&[upstream], Duration::from_millis(300)).unwrap();
        let want = vec![IpAddr::from([198, 18, 0, 5])];
        assert_eq!(resolver.lookup("slow.test").await.unwrap(), want);
        let asked = aaaa.load(Ordering::SeqCst);
        assert!(asked >= 1, "AAAA was asked");
        assert_eq!(resolver.lookup("slow.test").await.unwrap(), want);
        assert_eq!(aaaa.load(Ordering::SeqCst), asked, "silent AAAA held");
    }

    #[tokio::test]
    async fn no_answer_at_all_is_a_timeout() {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let resolver =
            Resolver::new(&[sock.local_addr().unwrap()], Duration::from_millis(200)).unwrap();
        match resolver.lookup("silent.test").await {
            Err(ResolveError::Timeout { name }) => assert_eq!(name, "silent.test"),
            other => panic!("expected a timeout, got {other:?}"),
        }
        drop(sock);
    }

    #[test]
    fn remembered_names_expire_and_stay_bounded() {
        let held = Expiring::default();
        let t0 = Instant::now();
        let until = t0 + FAILED_FAMILY_HOLD;
        held.put("a.test", Family::V6, until, t0);
        assert_eq!(held.get("a.test", t0), Some((Family::V6, until)));
        assert_eq!(held.get("b.test", t0), None);
        assert_eq!(held.get("a.test", until), None);
        for i in 0..REMEMBERED_NAMES + 10 {
            held.put(&format!("n{i}.test"), Family::V4, until, t0);
        }
        let len = held.0.lock().unwrap().len();
        assert!(len <= REMEMBERED_NAMES, "{len} names held");
        assert_eq!(
            held.get(&format!("n{}.test", REMEMBERED_NAMES + 9), t0),
            Some((Family::V4, until))
        );
    }

    /// Addresses are remembered no longer than their answer's TTL: a name
    /// whose upstream answer changes is asked again once the TTL ran out,
    /// and a TTL of 0 is asked every time (a rebinding name gains nothing
    /// from the proxy's memory).
    #[tokio::test]
    async fn addresses_are_remembered_for_their_ttl_only() {
        let (upstream, _, a) = upstream_with(false, 1).await;
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        let want = vec![IpAddr::from([198, 18, 0, 5])];
        for _ in 0..5 {
            assert_eq!(resolver.lookup("ttl.test").await.unwrap(), want);
        }
        assert_eq!(a.load(Ordering::SeqCst), 1, "within the TTL: asked once");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert_eq!(resolver.lookup("ttl.test").await.unwrap(), want);
        assert_eq!(a.load(Ordering::SeqCst), 2, "after the TTL: asked again");

        let (upstream, _, a) = upstream_with(false, 0).await;
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        for _ in 0..3 {
            assert_eq!(resolver.lookup("zero.test").await.unwrap(), want);
        }
        assert_eq!(a.load(Ordering::SeqCst), 3, "TTL 0: asked every time");
    }
}
