//! Per-org interception CAs and the leaf certificates minted from them.
//!
//! `DIR/ORG.pem` (certificate) and `DIR/ORG.key` (PKCS#8 key, 0600) are
//! created on first use, or provided by the operator. A leaf is minted for
//! each SNI on demand and kept in a bounded cache keyed by (org, SNI),
//! minted once however many handshakes ask for it at the same time.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use quick_cache::sync::{Cache, EntryAction, EntryResult};
use quick_cache::{DefaultHashBuilder, Lifecycle, OptionsBuilder, UnitWeighter};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// How long a generated CA is valid.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a minted leaf is valid.
const LEAF_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// A cached leaf older than this is minted again (well before it expires).
const LEAF_REFRESH: Duration = Duration::from_secs(24 * 3600);
/// Clock skew tolerated on `not_before`.
const BACKDATE: Duration = Duration::from_secs(3600);

/// A CA problem, naming the file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CaError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Invalid { path: String, why: String },
    #[error("{path} is readable or writable by group or others; chmod 600 it")]
    Permissions { path: String },
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("tls: {0}")]
    Tls(#[from] rustls::Error),
}

/// The certificate and key files of an org's CA.
pub(crate) fn ca_paths(dir: &Path, org: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{org}.pem")),
        dir.join(format!("{org}.key")),
    )
}

/// An org's CA: its certificate (PEM, for `ca export`) and an issuer.
pub(crate) struct OrgCa {
    pub cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for OrgCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrgCa(..)")
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl OrgCa {
    /// Load the org's CA from `dir`, creating it (and `dir`, 0700) if
    /// neither file exists. A key file open to group or others is refused.
    pub(crate) fn load_or_create(dir: &Path, org: &str) -> Result<OrgCa, CaError> {
        let (cert_path, key_path) = ca_paths(dir, org);
        if !key_path.exists() && !cert_path.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io_err(dir))?;
            create(org, &cert_path, &key_path)?;
        }
        OrgCa::load(&cert_path, &key_path)
    }

    /// Load an existing CA.
    pub(crate) fn load(cert_path: &Path, key_path: &Path) -> Result<OrgCa, CaError> {
        let meta = std::fs::metadata(key_path).map_err(io_err(key_path))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(CaError::Permissions {
                path: key_path.display().to_string(),
            });
        }
        let key_pem =
            zeroize::Zeroizing::new(std::fs::read_to_string(key_path).map_err(io_err(key_path))?);
        let key = KeyPair::from_pem(&key_pem).map_err(|e| CaError::Invalid {
            path: key_path.display().to_string(),
            why: format!("not a PKCS#8 PEM private key: {e}"),
        })?;
        let cert_pem = std::fs::read_to_string(cert_path).map_err(io_err(cert_path))?;
        let invalid = |why: String| CaError::Invalid {
            path: cert_path.display().to_string(),
            why,
        };
        let cert_der = {
            use rustls_pki_types::pem::PemObject;
            CertificateDer::from_pem_slice(cert_pem.as_bytes())
                .map_err(|e| invalid(format!("not a PEM certificate: {e}")))?
        };
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)
            .map_err(|e| invalid(format!("not a usable CA certificate: {e}")))?;
        Ok(OrgCa {
            cert_pem,
            cert_der,
            issuer,
        })
    }

    /// Mint a leaf for `name` and build the TLS server config that presents
    /// it (ALPN h2 and http/1.1).
    pub(crate) fn server_config(
        &self,
        name: &str,
        provider: &Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Arc<ServerConfig>, CaError> {
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + LEAF_LIFETIME).into();
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let leaf = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone(), self.cert_der.clone()], key_der)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Generate a CA: key first with O_EXCL (so two starters cannot pair a
/// key with the other's certificate), then the certificate via rename.
fn create(org: &str, cert_path: &Path, key_path: &Path) -> Result<(), CaError> {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Palisade");
    dn.push(
        DnType::CommonName,
        format!("Palisade interception CA ({org})"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + CA_LIFETIME).into();
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    let key_pem = zeroize::Zeroizing::new(key.serialize_pem());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(key_path)
        .map_err(io_err(key_path))?;
    f.write_all(key_pem.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(io_err(key_path))?;
    let tmp = cert_path.with_extension("pem.tmp");
    std::fs::write(&tmp, cert.pem()).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, cert_path).map_err(io_err(cert_path))?;
    Ok(())
}

type LeafKey = (Arc<str>, String);
type LeafEntry = (Arc<ServerConfig>, Instant);

/// Counts the entries the cache evicts, for the metrics.
#[derive(Clone, Default)]
struct Evictions(Arc<AtomicU64>);

impl Lifecycle<LeafKey, LeafEntry> for Evictions {
    type RequestState = ();

    fn begin_request(&self) {}

    fn on_evict(&self, _: &mut (), _: LeafKey, _: LeafEntry) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`LeafCache::get_or_mint`] found.
pub(crate) enum Leaf {
    /// A fresh cached config (perhaps minted just now by another handshake
    /// that this one waited for).
    Cached(Arc<ServerConfig>),
    /// Minted by this call (`None`: minting failed, nothing was cached).
    Minted(Option<Arc<ServerConfig>>),
}

/// Minted server configs by (org, SNI), at most `max` of them (quick_cache,
/// one shard so that `max` is a hard bound). A leaf is minted once however
/// many handshakes ask for it at the same time: the others wait for it.
pub(crate) struct LeafCache {
    cache: Cache<LeafKey, LeafEntry, UnitWeighter, DefaultHashBuilder, Evictions>,
    evictions: Evictions,
}

impl LeafCache {
    pub(crate) fn new(max: usize) -> LeafCache {
        let max = max.max(1);
        let evictions = Evictions::default();
        let options = OptionsBuilder::new()
            .shards(1)
            .estimated_items_capacity(max)
            .weight_capacity(max as u64)
            .build();
        let cache = match options {
            Ok(options) => Cache::with_options(
                options,
                UnitWeighter,
                DefaultHashBuilder::default(),
                evictions.clone(),
            ),
            // Never: every option above is set.
            Err(_) => Cache::with(
                max,
                max as u64,
                UnitWeighter,
                DefaultHashBuilder::default(),
                evictions.clone(),
            ),
        };
        LeafCache { cache, evictions }
    }

    /// The config for `name` from `org`'s CA: the cached one if it is
    /// younger than [`LEAF_REFRESH`] at `now`, else the one `mint` makes,
    /// cached from `now` on.
    pub(crate) fn get_or_mint(
        &self,
        org: &Arc<str>,
        name: &str,
        now: Instant,
        mint: impl FnOnce() -> Option<Arc<ServerConfig>>,
    ) -> Leaf {
        let fresh = |minted: &Instant| now.saturating_duration_since(*minted) < LEAF_REFRESH;
        let key: LeafKey = (org.clone(), name.to_string());
        if let Some((config, minted)) = self.cache.get(&key) {
            if fresh(&minted) {
                return Leaf::Cached(config);
            }
        }
        let guard = match self.cache.entry(&key, None, |_, (config, minted)| {
            if fresh(minted) {
                EntryAction::Retain(config.clone())
            } else {
                EntryAction::ReplaceWithGuard
            }
        }) {
            EntryResult::Retained(config) => return Leaf::Cached(config),
            EntryResult::Vacant(guard) | EntryResult::Replaced(guard, _) => Some(guard),
            // Neither is asked for (no Remove, no timeout): mint uncached.
            EntryResult::Removed(..) | EntryResult::Timeout => None,
        };
        let config = mint();
        if let (Some(guard), Some(config)) = (guard, &config) {
            let _ = guard.insert((config.clone(), now));
        }
        Leaf::Minted(config)
    }

    /// Entries evicted since the last call.
    pub(crate) fn take_evictions(&self) -> u64 {
        self.evictions.0.swap(0, Ordering::Relaxed)
    }

    pub(crate) fn len(&self) -> usize {
        self.cache.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    #[test]
    fn ca_is_created_0600_reloaded_and_mints_leaves() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ca");
        let a = OrgCa::load_or_create(&dir, "acme").unwrap();
        let (cert, key) = ca_paths(&dir, "acme");
        assert_eq!(
            std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(std::fs::read_to_string(&cert)
            .unwrap()
            .starts_with("-----BEGIN CERTIFICATE-----"));
        let b = OrgCa::load_or_create(&dir, "acme").unwrap();
        assert_eq!(a.cert_pem, b.cert_pem, "second start reuses the CA");
        b.server_config("api.example.test", &provider()).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            OrgCa::load_or_create(&dir, "acme"),
            Err(CaError::Permissions { .. })
        ));
    }

    fn cached(leaf: Leaf) -> Option<Arc<ServerConfig>> {
        match leaf {
            Leaf::Cached(c) => Some(c),
            Leaf::Minted(_) => None,
        }
    }

    #[test]
    fn cache_is_bounded_and_refreshes_old_leaves() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ca");
        let ca = OrgCa::load_or_create(&dir, "o").unwrap();
        let cfg = ca.server_config("a.test", &provider()).unwrap();
        let c = LeafCache::new(2);
        let org: Arc<str> = Arc::from("o");
        let now = Instant::now();
        let minted = AtomicU64::new(0);
        let mint = || {
            minted.fetch_add(1, Ordering::Relaxed);
            Some(cfg.clone())
        };
        for name in ["a", "b", "c", "d", "e"] {
            assert!(matches!(
                c.get_or_mint(&org, name, now, mint),
                Leaf::Minted(Some(_))
            ));
            assert!(c.len() <= 2, "{} entries", c.len());
        }
        assert_eq!(c.len(), 2);
        assert_eq!(c.take_evictions(), 3);
        assert_eq!(c.take_evictions(), 0);
        // What stayed is a hit; at LEAF_REFRESH it is minted again.
        let kept = ["a", "b", "c", "d", "e"]
            .into_iter()
            .find(|n| cached(c.get_or_mint(&org, n, now, || None)).is_some())
            .unwrap();
        let before = minted.load(Ordering::Relaxed);
        assert!(matches!(
            c.get_or_mint(&org, kept, now + LEAF_REFRESH, mint),
            Leaf::Minted(Some(_))
        ));
        assert_eq!(minted.load(Ordering::Relaxed), before + 1);
        assert!(cached(c.get_or_mint(&org, kept, now + LEAF_REFRESH, || None)).is_some());
        // A failed mint caches nothing.
        assert!(matches!(
            c.get_or_mint(&org, "f", now, || None),
            Leaf::Minted(None)
        ));
        assert!(matches!(
            c.get_or_mint(&org, "f", now, || None),
            Leaf::Minted(None)
        ));
        assert!(c.len() <= 2);
    }

    /// Two handshakes for one host at the same time mint one leaf: the
    /// second waits for the first's and is handed the same config.
    #[test]
    fn concurrent_lookups_for_one_host_mint_once() {
        let tmp = tempfile::tempdir().unwrap();
        let ca = OrgCa::load_or_create(&tmp.path().join("ca"), "o").unwrap();
        let provider = provider();
        let c = LeafCache::new(8);
        let org: Arc<str> = Arc::from("o");
        let minted = AtomicU64::new(0);
        let start = std::sync::Barrier::new(2);
        let got: Vec<Arc<ServerConfig>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        let leaf = c.get_or_mint(&org, "a.test", Instant::now(), || {
                            minted.fetch_add(1, Ordering::Relaxed);
                            // Long enough for the other lookup to arrive.
                            std::thread::sleep(Duration::from_millis(200));
                            ca.server_config("a.test", &provider).ok()
                        });
                        match leaf {
                            Leaf::Cached(c) | Leaf::Minted(Some(c)) => c,
                            Leaf::Minted(None) => panic!("mint failed"),
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(minted.load(Ordering::Relaxed), 1);
        assert!(Arc::ptr_eq(&got[0], &got[1]));
        assert_eq!(c.len(), 1);
    }
}
