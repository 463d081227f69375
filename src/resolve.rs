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
    /// Where resolution time is counted, when served.
    metrics: Option<Arc<Metrics>>,
    failed_families: FailedFamilies,
    /// Addresses each name's two lookups gave, until either expires.
    answered: ByName<Vec<IpAddr>>,
}

/// How long a family that failed (while the other answered) is not asked.
pub(crate) const FAILED_FAMILY_HOLD: Duration = Duration::from_secs(10);
/// Names remembered at most; when full, expired entries go, then all.
const FAILED_FAMILY_NAMES: usize = 4096;

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

/// A value per name until an instant, bounded to `cap` names: when full,
/// expired entries go, then all.
struct ByName<V> {
    map: Mutex<HashMap<String, (V, Instant)>>,
    cap: usize,
}

impl<V: Clone> ByName<V> {
    fn new(cap: usize) -> ByName<V> {
        ByName {
            map: Mutex::default(),
            cap,
        }
    }

    /// The value held for `name`, while it has not expired at `now`.
    fn get(&self, name: &str, now: Instant) -> Option<V> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(name) {
            Some((value, until)) if *until > now => Some(value.clone()),
            _ => None,
        }
    }

    fn put(&self, name: &str, value: V, until: Instant, now: Instant) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.cap && !map.contains_key(name) {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= self.cap {
                map.clear();
            }
        }
        map.insert(name.to_string(), (value, until));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

/// Names whose A or AAAA query failed while the other family answered:
/// bounded, each for [`FAILED_FAMILY_HOLD`].
struct FailedFamilies(ByName<(Family, Instant)>);

impl Default for FailedFamilies {
    fn default() -> FailedFamilies {
        FailedFamilies(ByName::new(FAILED_FAMILY_NAMES))
    }
}

impl FailedFamilies {
    /// The family held for `name` at `now`, and until when.
    fn held(&self, name: &str, now: Instant) -> Option<(Family, Instant)> {
        self.0.get(name, now)
    }

    /// Hold `fam` for `name` from `now`: until the instant returned.
    fn hold(&self, name: &str, fam: Family, now: Instant) -> Instant {
        let until = now + FAILED_FAMILY_HOLD;
        self.0.put(name, (fam, until), until, now);
        until
    }
}

/// Names whose addresses the resolver's cache gave in full (both families
/// answered, with records or a negative answer that says for how long),
/// each until the first of the two answers expires there: a connection to
/// a name asked for moments ago takes its addresses without going through
/// the cache's two lookups, and gets what they would have given.
const ANSWERED_NAMES: usize = 4096;

impl Resolver {
    pub(crate) fn new(
        upstreams: &[SocketAddr],
        timeout: Duration,
    ) -> Result<Resolver, ResolveError> {
        if upstreams.is_empty() {
            return Ok(Resolver {
                inner: None,
                timeout,
                metrics: None,
                failed_families: FailedFamilies::default(),
                answered: ByName::new(ANSWERED_NAMES),
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
            metrics: None,
            failed_families: FailedFamilies::default(),
            answered: ByName::new(ANSWERED_NAMES),
        })
    }

    /// Count resolution time in `metrics`.
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>) -> Resolver {
        self.metrics = Some(metrics);
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
    ///
    /// When both families answered, with records or with a negative answer
    /// that says how long it holds, the addresses are kept until the first
    /// of the two answers expires in the cache: the next connection to the
    /// name within that time takes them at once.
    pub(crate) async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let Some(inner) = &self.inner else {
            return Err(ResolveError::NoUpstream);
        };
        let started = Instant::now();
        let outcome = match self.answered.get(name, started) {
            Some(addrs) => Ok(addrs),
            // Boxed: the lookups' state is large, and every future that
            // awaits a decision would otherwise carry (and move) it.
            None => Box::pin(self.ask(inner, name, started)).await,
        };
        if let Some(m) = &self.metrics {
            m.resolve_duration_seconds
                .with_label_values(&[if outcome.is_ok() { "ok" } else { "error" }])
                .observe(started.elapsed().as_secs_f64());
        }
        outcome
    }

    /// [`Resolver::lookup`] through the resolver's cache (and upstream):
    /// both families side by side, each within `timeout`.
    async fn ask(
        &self,
        inner: &TokioResolver,
        name: &str,
        started: Instant,
    ) -> Result<Vec<IpAddr>, ResolveError> {
        let fqdn = Name::from_ascii(format!("{name}.")).map_err(|e| ResolveError::Failed {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        let held = self.failed_families.held(name, started);
        let skip = |fam: Family| match held {
            Some((f, until)) if f == fam => Some(until),
            _ => None,
        };
        // Each family within `timeout` on its own: one that hangs (an
        // upstream that drops AAAA queries) fails alone, and the other's
        // addresses still count. With each answer, until when the cache
        // gives it (`None`: not known, so not remembered here); a family
        // held is not asked until its hold ends.
        let timeout = self.timeout;
        let family = |qtype: RecordType, held: Option<Instant>| {
            let fqdn = fqdn.clone();
            async move {
                if held.is_some() {
                    return (None, held);
                }
                let (answer, until) =
                    match tokio::time::timeout(timeout, inner.lookup(fqdn, qtype)).await {
                        Err(_) => (Err(FamilyError::Timeout), None),
                        Ok(Err(NetError::Dns(DnsError::NoRecordsFound(nr)))) => {
                            let until = nr
                                .negative_ttl
                                .map(|ttl| Instant::now() + Duration::from_secs(u64::from(ttl)));
                            (Err(FamilyError::NoRecords), until)
                        }
                        Ok(Err(NetError::Timeout)) => (Err(FamilyError::Timeout), None),
                        Ok(Err(e)) => (Err(FamilyError::Other(e.to_string())), None),
                        Ok(Ok(l)) => {
                            let found = l
                                .answers()
                                .iter()
                                .filter_map(|r| match &r.data {
                                    RData::A(a) => Some(IpAddr::V4(a.0)),
                                    RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                                    _ => None,
                                })
                                .collect::<Vec<IpAddr>>();
                            (Ok(found), Some(l.valid_until()))
                        }
                    };
                (Some(answer), until)
            }
        };
        let ((v4, mut v4_until), (v6, mut v6_until)) = tokio::join!(
            family(RecordType::A, skip(Family::V4)),
            family(RecordType::AAAA, skip(Family::V6)),
        );
        let mut addrs = Vec::new();
        let mut failure: Option<(Family, FamilyError)> = None;
        for (fam, answer) in [(Family::V4, v4), (Family::V6, v6)] {
            match answer {
                None | Some(Err(FamilyError::NoRecords)) => {}
                Some(Ok(found)) => addrs.extend(found),
                Some(Err(f)) => {
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
                    let until = Some(self.failed_families.hold(name, fam, started));
                    match fam {
                        Family::V4 => v4_until = until,
                        Family::V6 => v6_until = until,
                    }
                }
                // Both families answered (or one is held), and each says
                // for how long.
                if let (Some(a), Some(b)) = (v4_until, v6_until) {
                    self.answered.put(name, addrs.clone(), a.min(b), started);
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

    /// A loopback upstream whose `answer` fills the reply to each query
    /// (`false`: no reply at all).
    async fn upstream(
        answer: impl Fn(&hickory_resolver::proto::op::Query, &mut Message) -> bool + Send + 'static,
    ) -> SocketAddr {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
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
                if answer(q, &mut reply) {
                    let _ = sock.send_to(&reply.to_vec().unwrap(), from).await;
                }
            }
        });
        addr
    }

    /// A loopback upstream that answers A with 198.18.0.5 and AAAA with
    /// `REFUSED` (or not at all, `drop_aaaa`), counting the AAAA queries.
    async fn failing_aaaa(drop_aaaa: bool) -> (SocketAddr, Arc<AtomicUsize>) {
        let aaaa = Arc::new(AtomicUsize::new(0));
        let counted = aaaa.clone();
        let addr = upstream(move |q, reply| {
            if q.query_type() == RecordType::AAAA {
                counted.fetch_add(1, Ordering::SeqCst);
                reply.metadata.response_code = ResponseCode::Refused;
                return !drop_aaaa;
            }
            let a = RData::A(A::new(198, 18, 0, 5));
            reply.add_answer(Record::from_rdata(q.name().clone(), 300, a));
            true
        })
        .await;
        (addr, aaaa)
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

    /// A loopback upstream that answers A with 198.18.0.`last` (TTL `ttl`)
    /// and AAAA with no records and an SOA (negative TTL 60), counting the A
    /// queries.
    async fn changing_a(ttl: u32, last: Arc<AtomicUsize>) -> (SocketAddr, Arc<AtomicUsize>) {
        use hickory_resolver::proto::rr::rdata::SOA;
        let asked = Arc::new(AtomicUsize::new(0));
        let counted = asked.clone();
        let addr = upstream(move |q, reply| {
            if q.query_type() == RecordType::AAAA {
                let zone = Name::from_ascii("test.").unwrap();
                let soa = SOA::new(zone.clone(), zone.clone(), 1, 60, 60, 60, 60);
                reply.add_authority(Record::from_rdata(zone, 60, RData::SOA(soa)));
            } else {
                counted.fetch_add(1, Ordering::SeqCst);
                let octet = u8::try_from(last.load(Ordering::SeqCst)).unwrap();
                let a = RData::A(A::new(198, 18, 0, octet));
                reply.add_answer(Record::from_rdata(q.name().clone(), ttl, a));
            }
            true
        })
        .await;
        (addr, asked)
    }

    #[tokio::test]
    async fn answered_names_are_kept_until_the_first_answer_expires() {
        let last = Arc::new(AtomicUsize::new(5));
        let (upstream, asked) = changing_a(1, last.clone()).await;
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        let five = vec![IpAddr::from([198, 18, 0, 5])];
        assert_eq!(resolver.lookup("kept.test").await.unwrap(), five);
        assert_eq!(resolver.answered.len(), 1, "both families answered");
        // The upstream changes its answer; within the TTL the name keeps
        // the one it had, after it the new one is asked for and given.
        last.store(6, Ordering::SeqCst);
        assert_eq!(resolver.lookup("kept.test").await.unwrap(), five);
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let six = vec![IpAddr::from([198, 18, 0, 6])];
        assert_eq!(resolver.lookup("kept.test").await.unwrap(), six);
        assert_eq!(asked.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_held_family_keeps_the_answer_no_longer_than_its_hold() {
        let (upstream, aaaa) = failing_aaaa(false).await;
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        let before = Instant::now();
        resolver.lookup("two.test").await.unwrap();
        let asked = aaaa.load(Ordering::SeqCst);
        resolver.lookup("two.test").await.unwrap();
        assert_eq!(aaaa.load(Ordering::SeqCst), asked);
        // The A answer's TTL is 300 s, the AAAA hold 10 s: the hold ends it.
        let map = resolver.answered.map.lock().unwrap();
        let (_, until) = map.get("two.test").expect("kept");
        assert!(*until <= Instant::now() + FAILED_FAMILY_HOLD);
        assert!(*until >= before + FAILED_FAMILY_HOLD);
    }

    #[test]
    fn held_families_expire_and_stay_bounded() {
        let held = FailedFamilies::default();
        let t0 = Instant::now();
        held.hold("a.test", Family::V6, t0);
        assert_eq!(
            held.held("a.test", t0),
            Some((Family::V6, t0 + FAILED_FAMILY_HOLD))
        );
        assert_eq!(held.held("b.test", t0), None);
        assert_eq!(held.held("a.test", t0 + FAILED_FAMILY_HOLD), None);
        for i in 0..FAILED_FAMILY_NAMES + 10 {
            held.hold(&format!("n{i}.test"), Family::V4, t0);
        }
        let len = held.0.len();
        assert!(len <= FAILED_FAMILY_NAMES, "{len} names held");
        assert_eq!(
            held.held(&format!("n{}.test", FAILED_FAMILY_NAMES + 9), t0),
            Some((Family::V4, t0 + FAILED_FAMILY_HOLD))
        );
    }
}
