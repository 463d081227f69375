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

/// Names whose A or AAAA query failed while the other family answered:
/// bounded, each for [`FAILED_FAMILY_HOLD`].
#[derive(Default)]
struct FailedFamilies(Mutex<HashMap<String, (Family, Instant)>>);

impl FailedFamilies {
    fn held(&self, name: &str, now: Instant) -> Option<Family> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(name) {
            Some(&(fam, until)) if until > now => Some(fam),
            _ => None,
        }
    }

    fn hold(&self, name: &str, fam: Family, now: Instant) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= FAILED_FAMILY_NAMES && !map.contains_key(name) {
            map.retain(|_, (_, until)| *until > now);
            if map.len() >= FAILED_FAMILY_NAMES {
                map.clear();
            }
        }
        map.insert(name.to_string(), (fam, now + FAILED_FAMILY_HOLD));
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
                metrics: None,
                failed_families: FailedFamilies::default(),
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
    pub(crate) async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let Some(inner) = &self.inner else {
            return Err(ResolveError::NoUpstream);
        };
        let fqdn = Name::from_ascii(format!("{name}.")).map_err(|e| ResolveError::Failed {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        let started = Instant::now();
        let held = self.failed_families.held(name, started);
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
                    Ok(Ok(l)) => Ok(l
                        .answers()
                        .iter()
                        .filter_map(|r| match &r.data {
                            RData::A(a) => Some(IpAddr::V4(a.0)),
                            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                            _ => None,
                        })
                        .collect::<Vec<IpAddr>>()),
                };
                Some(answer)
            }
        };
        let (v4, v6) = tokio::join!(
            family(RecordType::A, held == Some(Family::V4)),
            family(RecordType::AAAA, held == Some(Family::V6)),
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
        let outcome = match (addrs.is_empty(), failure) {
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
                    self.failed_families.hold(name, fam, started);
                }
                Ok(addrs)
            }
        };
        if let Some(m) = &self.metrics {
            m.resolve_duration_seconds
                .with_label_values(&[if outcome.is_ok() { "ok" } else { "error" }])
                .observe(started.elapsed().as_secs_f64());
        }
        outcome
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
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let aaaa = Arc::new(AtomicUsize::new(0));
        let counted = aaaa.clone();
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
                    reply.add_answer(Record::from_rdata(
                        q.name().clone(),
                        300,
                        RData::A(A::new(198, 18, 0, 5)),
                    ));
                }
                let _ = sock.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
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

    #[test]
    fn held_families_expire_and_stay_bounded() {
        let held = FailedFamilies::default();
        let t0 = Instant::now();
        held.hold("a.test", Family::V6, t0);
        assert_eq!(held.held("a.test", t0), Some(Family::V6));
        assert_eq!(held.held("b.test", t0), None);
        assert_eq!(held.held("a.test", t0 + FAILED_FAMILY_HOLD), None);
        for i in 0..FAILED_FAMILY_NAMES + 10 {
            held.hold(&format!("n{i}.test"), Family::V4, t0);
        }
        let len = held.0.lock().unwrap().len();
        assert!(len <= FAILED_FAMILY_NAMES, "{len} names held");
        assert_eq!(
            held.held(&format!("n{}.test", FAILED_FAMILY_NAMES + 9), t0),
            Some(Family::V4)
        );
    }
}
