//! What opt-in TLS interception needs, per org: the CAs its leaves are
//! minted from ([`ca`]), the credentials added to requests with their
//! secrets ([`secret`]), and the upstream trust. Built at start and by each
//! reload into the served state ([`crate::served`]); the serving itself is
//! a part of the proxy ([`crate::proxy::intercepted`]).
//!
//! An allow rule with `intercept = true` makes Palisade terminate the
//! client's TLS with a leaf minted for the SNI from the org's CA ([`ca`]),
//! originate its own verified TLS to the upstream, and decide every HTTP
//! request inside on its own (`proxy::intercepted::serve`): Host/`:authority`
//! must be the SNI, the path is normalised and the rule's method and path
//! rules apply, and
//! the org's credentials ([`secret`]) are added to matching requests, all in
//! one pure decision ([`crate::policy::request::decide`]).
//! Every other connection passes through untouched.

pub(crate) mod ca;
pub(crate) mod secret;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::CertificateDer;

use crate::config::{Config, CredentialConfig};

use self::ca::{CaError, Leaf, LeafCache, OrgCa};
use self::secret::{Secret, SecretError};

/// A credential with its secret, ready to be added to requests.
#[derive(Debug)]
pub(crate) struct Credential {
    pub config: CredentialConfig,
    secret: Secret,
}

impl Credential {
    /// The header value to send (prefix + secret), marked sensitive.
    pub(crate) fn value(&self) -> Option<http::HeaderValue> {
        self.secret.header_value(&self.config.prefix)
    }
}

/// Why interception could not be set up (at start or on a reload).
#[derive(Debug, thiserror::Error)]
pub(crate) enum InterceptError {
    #[error("org {org}: CA: {source}")]
    Ca { org: String, source: CaError },
    #[error("{0}")]
    Secret(#[from] SecretError),
    #[error("upstream_ca {path}: {why}")]
    Roots { path: String, why: String },
    #[error("tls: {0}")]
    Tls(#[from] rustls::Error),
}

/// Everything interception needs, built at start and by each reload
/// ([`crate::served::Served::load`]).
pub(crate) struct Interceptor {
    provider: Arc<rustls::crypto::CryptoProvider>,
    cas: HashMap<String, OrgCa>,
    cache: LeafCache,
    /// Upstream TLS: verified against `[intercept] upstream_ca`.
    pub upstream: Arc<ClientConfig>,
    credentials: HashMap<String, Vec<Arc<Credential>>>,
    /// A digest over what was read from files and the environment rather
    /// than the policy file: the credentials' secrets, the org CAs and the
    /// upstream trust ([`Interceptor::fingerprint`]).
    fingerprint: [u8; 32],
    pub handshake_timeout: std::time::Duration,
    metrics: Arc<crate::metrics::Metrics>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor")
            .field("orgs", &self.cas.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// The ring provider, the only one built in.
pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Trust anchors from a PEM bundle; each certificate read is also fed
/// to `seen`.
fn load_roots(
    path: &std::path::Path,
    seen: &mut Fingerprint,
) -> Result<RootCertStore, InterceptError> {
    use rustls_pki_types::pem::PemObject;
    let err = |why: String| InterceptError::Roots {
        path: path.display().to_string(),
        why,
    };
    let mut roots = RootCertStore::empty();
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| err(e.to_string()))?;
    for cert in iter {
        let cert = cert.map_err(|e| err(e.to_string()))?;
        seen.add(&cert);
        // Bundles carry the odd certificate webpki cannot use; skip those.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(err("no usable certificate in the bundle".into()));
    }
    Ok(roots)
}

impl Interceptor {
    /// Build from the config; `None` when no org intercepts anything.
    pub(crate) fn new(
        config: &Config,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Result<Option<Interceptor>, InterceptError> {
        if !config.orgs.iter().any(|o| o.intercepts()) {
            return Ok(None);
        }
        let provider = provider();
        let mut cas = HashMap::new();
        let mut credentials: HashMap<String, Vec<Arc<Credential>>> = HashMap::new();
        let mut seen = Fingerprint::default();
        for org in config.orgs.iter().filter(|o| o.intercepts()) {
            let ca =
                OrgCa::load_or_create(&config.intercept.ca_dir, &org.name).map_err(|source| {
                    InterceptError::Ca {
                        org: org.name.clone(),
                        source,
                    }
                })?;
            seen.add(org.name.as_bytes());
            seen.add(ca.cert_pem.as_bytes());
            cas.insert(org.name.clone(), ca);
            for c in &org.credentials {
                let secret = Secret::load(c)?;
                seen.add(c.id.as_bytes());
                secret.feed(|bytes| seen.add(bytes));
                credentials
                    .entry(org.name.clone())
                    .or_default()
                    .push(Arc::new(Credential {
                        config: c.clone(),
                        secret,
                    }));
            }
        }
        let roots = load_roots(&config.intercept.upstream_ca, &mut seen)?;
        let mut upstream = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        upstream.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(Interceptor {
            provider,
            cas,
            cache: LeafCache::new(config.intercept.cert_cache),
            upstream: Arc::new(upstream),
            credentials,
            fingerprint: seen.finish(),
            handshake_timeout: config.intercept.handshake_timeout.get(),
            metrics,
        }))
    }

    /// The TLS server config presenting a leaf for `name` from `org`'s CA,
    /// from the cache or freshly minted (once for concurrent handshakes).
    pub(crate) fn server_config(&self, org: &Arc<str>, name: &str) -> Option<Arc<ServerConfig>> {
        let m = &self.metrics;
        let mint = || {
            m.intercept_cert_cache_total
                .with_label_values(&["miss"])
                .inc();
            let ca = self.cas.get(&**org)?;
            match ca.server_config(name, &self.provider) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot mint a leaf certificate");
                    None
                }
            }
        };
        match self.cache.get_or_mint(org, name, Instant::now(), mint) {
            Leaf::Cached(c) => {
                m.intercept_cert_cache_total
                    .with_label_values(&["hit"])
                    .inc();
                Some(c)
            }
            Leaf::Minted(config) => {
                m.intercept_cert_cache_total
                    .with_label_values(&["evict"])
                    .inc_by(self.cache.take_evictions());
                m.intercept_cert_cache_entries
                    .set(i64::try_from(self.cache.len()).unwrap_or(i64::MAX));
                config
            }
        }
    }

    /// A digest over the secrets, org CAs and upstream trust this was
    /// built with: equal for two builds that add the same secrets and
    /// trust the same certificates. A reload compares it to tell a
    /// rotated secret from nothing new; it is never written anywhere.
    pub(crate) fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }

    /// Whether `org` has an interception CA (one of its allow rules
    /// intercepts): what a grant naming a method or path needs to be
    /// honoured inside TLS.
    pub(crate) fn has_ca(&self, org: &str) -> bool {
        self.cas.contains_key(org)
    }

    /// The org's credentials, in file order: the request decision
    /// ([`crate::policy::request::decide`]) picks those to add.
    pub(crate) fn credentials(&self, org: &str) -> &[Arc<Credential>] {
        self.credentials.get(org).map_or(&[], Vec::as_slice)
    }
}

/// A digest over length-prefixed byte strings, in the order given.
#[derive(Default)]
struct Fingerprint(sha2::Sha256);

impl Fingerprint {
    fn add(&mut self, bytes: &[u8]) {
        use sha2::Digest;
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
    }

    fn finish(self) -> [u8; 32] {
        use sha2::Digest;
        self.0.finalize().into()
    }
}
