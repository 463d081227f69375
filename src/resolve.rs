//! Upstream name resolution for the proxy: only the configured servers, no
//! hosts file, no search list, every name queried as fully qualified.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_resolver::config::{
    ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::net::{DnsError, NetError};
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{Name, Record, RecordType};
use hickory_resolver::TokioResolver;

use crate::metrics::Metrics;

/// Why a name has no addresses.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
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
pub enum RecordsError {
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
pub struct Records {
    pub records: Vec<Record>,
    pub valid_until: Instant,
}

/// Resolves names through the configured upstream servers.
pub struct Resolver {
    inner: Option<TokioResolver>,
    timeout: Duration,
    /// Where resolution time is counted, when served.
    metrics: Option<Arc<Metrics>>,
}

impl Resolver {
    pub fn new(upstreams: &[SocketAddr], timeout: Duration) -> Result<Resolver, ResolveError> {
        if upstreams.is_empty() {
            return Ok(Resolver {
                inner: None,
                timeout,
                metrics: None,
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
        opts.ip_strategy = hickory_resolver::config::LookupIpStrategy::Ipv4AndIpv6;
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
        })
    }

    /// Count resolution time in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Resolver {
        self.metrics = Some(metrics);
        self
    }

    /// Addresses of a normalised name, A records before AAAA.
    pub async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let Some(inner) = &self.inner else {
            return Err(ResolveError::NoUpstream);
        };
        let fqdn = format!("{name}.");
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(self.timeout, inner.lookup_ip(fqdn.as_str())).await;
        if let Some(m) = &self.metrics {
            m.resolve_duration_seconds
                .with_label_values(&[if matches!(result, Ok(Ok(_))) {
                    "ok"
                } else {
                    "error"
                }])
                .observe(started.elapsed().as_secs_f64());
        }
        let lookup = result
            .map_err(|_| ResolveError::Timeout {
                name: name.to_string(),
            })?
            .map_err(|e| ResolveError::Failed {
                name: name.to_string(),
                reason: e.to_string(),
            })?;
        let addrs: Vec<IpAddr> = lookup.iter().collect();
        if addrs.is_empty() {
            return Err(ResolveError::Empty {
                name: name.to_string(),
            });
        }
        Ok(addrs)
    }

    /// Records of any type for a normalised name, through the same cache.
    /// The answer keeps a CNAME chain in front of the records it leads to.
    pub async fn lookup_records(
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
