//! Per-org interception CAs and the leaf certificates minted from them.
//!
//! `DIR/ORG.pem` (certificate) and `DIR/ORG.key` (PKCS#8 key, 0600) are
//! created on first use, or provided by the operator. A leaf is minted for
//! each SNI on demand and kept in a bounded cache keyed by (org, SNI).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

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
pub enum CaError {
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
pub fn ca_paths(dir: &Path, org: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{org}.pem")),
        dir.join(format!("{org}.key")),
    )
}

/// An org's CA: its certificate (PEM, for `ca export`) and an issuer.
pub struct OrgCa {
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
    pub fn load_or_create(dir: &Path, org: &str) -> Result<OrgCa, CaError> {
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
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<OrgCa, CaError> {
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
    pub fn server_config(
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

/// Minted server configs by (org, SNI), bounded; the oldest entry goes first.
pub struct LeafCache {
    max: usize,
    map: HashMap<(Arc<str>, String), (Arc<ServerConfig>, Instant)>,
    order: VecDeque<(Arc<str>, String)>,
}

impl LeafCache {
    pub fn new(max: usize) -> LeafCache {
        LeafCache {
            max: max.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// A fresh cached config, if any.
    pub fn get(&self, org: &Arc<str>, name: &str, now: Instant) -> Option<Arc<ServerConfig>> {
        let (config, minted) = self.map.get(&(org.clone(), name.to_string()))?;
        (now.saturating_duration_since(*minted) < LEAF_REFRESH).then(|| config.clone())
    }

    /// Insert; returns how many entries were evicted.
    pub fn insert(
        &mut self,
        org: Arc<str>,
        name: String,
        config: Arc<ServerConfig>,
        now: Instant,
    ) -> usize {
        let key = (org, name);
        if let Some(slot) = self.map.get_mut(&key) {
            *slot = (config, now);
            return 0;
        }
        let mut evicted = 0;
        while self.map.len() >= self.max {
            match self.order.pop_front() {
                Some(old) => {
                    if self.map.remove(&old).is_some() {
                        evicted += 1;
                    }
                }
                None => break,
            }
        }
        self.order.push_back(key.clone());
        self.map.insert(key, (config, now));
        evicted
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// A cache shared by every connection.
pub type SharedCache = Mutex<LeafCache>;

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

    #[test]
    fn cache_is_bounded_and_evicts_oldest() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ca");
        let ca = OrgCa::load_or_create(&dir, "o").unwrap();
        let cfg = ca.server_config("a.test", &provider()).unwrap();
        let mut c = LeafCache::new(2);
        let org: Arc<str> = Arc::from("o");
        let now = Instant::now();
        assert_eq!(c.insert(org.clone(), "a".into(), cfg.clone(), now), 0);
        assert_eq!(c.insert(org.clone(), "b".into(), cfg.clone(), now), 0);
        assert_eq!(c.insert(org.clone(), "c".into(), cfg.clone(), now), 1);
        assert_eq!(c.len(), 2);
        assert!(c.get(&org, "a", now).is_none());
        assert!(c.get(&org, "c", now).is_some());
        assert!(c.get(&org, "c", now + LEAF_REFRESH).is_none());
    }
}
