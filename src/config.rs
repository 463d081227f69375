//! Configuration: read the file, parse TOML into raw serde structs
//! (`deny_unknown_fields` everywhere), then validate into typed values.
//!
//! Every problem is reported as `FILE:LINE:COL: message`, naming the bad
//! value; validation collects all problems instead of stopping at the first.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::proto::target::{normalize_host, Host};

/// Default cap on concurrent client connections, all orgs together.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default cap on concurrent client connections of one org.
pub const DEFAULT_MAX_CONNECTIONS_PER_ORG: usize = 2_000;
/// Default rate of new connections per org (per second, with a burst of as many).
pub const DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_ORG: usize = 20_000;
/// Default cap on detection buffers, all connections together.
pub const DEFAULT_MAX_DETECT_MEMORY_BYTES: usize = 64 * 1024 * 1024;
/// Default cap on the size of an HTTP request head (request line and headers).
pub const DEFAULT_MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;
/// Default cap on the number of request headers.
pub const DEFAULT_MAX_HEADERS: usize = 100;
/// Default time a client has to send a complete request head (slowloris bound).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time to establish a TCP connection to an upstream address.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time a tunnel or kept-alive connection may stay silent both ways.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default time to wait for a tunnel client's first bytes (ClientHello detection).
pub const DEFAULT_DETECT_TIMEOUT: Duration = Duration::from_millis(1000);
/// Default grace period for open connections after SIGTERM/SIGINT.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time for one upstream name resolution.
pub const DEFAULT_RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Default time a DNS-over-TCP client may stay silent between queries.
pub const DEFAULT_DNS_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time one DNS query may take end to end (including upstream).
pub const DEFAULT_DNS_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap on concurrent DNS-over-TCP connections, all listeners together.
pub const DEFAULT_DNS_MAX_TCP_CONNECTIONS: usize = 256;
/// Default cap on DNS queries being answered at once (UDP and TCP).
/// Default DNS queries per second per client address.
pub const DEFAULT_DNS_MAX_QUERIES_PER_SECOND_PER_CLIENT: usize = 2_000;
pub const DEFAULT_DNS_MAX_QUERIES_IN_FLIGHT: usize = 1024;
/// Default lower bound on the TTL of answers handed out (and their bindings).
pub const DEFAULT_DNS_MIN_TTL: Duration = Duration::from_secs(5);
/// Default upper bound on the TTL of answers handed out (and their bindings).
pub const DEFAULT_DNS_MAX_TTL: Duration = Duration::from_secs(3600);
/// Default time a name-address binding outlives the TTL of its answer.
pub const DEFAULT_DNS_BINDING_GRACE: Duration = Duration::from_secs(60);
/// Default cap on addresses bound to one (org, name).
pub const DEFAULT_DNS_MAX_BINDINGS_PER_NAME: usize = 32;
/// Default cap on all name-address bindings together (oldest evicted first).
pub const DEFAULT_DNS_MAX_BINDINGS: usize = 100_000;
/// Query types the DNS shim never answers, whatever an org enables.
pub const DNS_NEVER_TYPES: [&str; 5] = ["ANY", "AXFR", "IXFR", "OPT", "TSIG"];
/// Ports an allow rule covers when it names none.
pub const DEFAULT_ALLOW_PORTS: [u16; 2] = [80, 443];

// ---------------------------------------------------------------------------
// Raw serde structs: exactly the file's shape.

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    proxy: RawProxy,
    #[serde(default)]
    dns: RawDns,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    evidence: RawEvidence,
    #[serde(default)]
    intercept: RawIntercept,
    #[serde(default)]
    org: Vec<RawOrg>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawIntercept {
    ca_dir: Option<Spanned<String>>,
    upstream_ca: Option<Spanned<String>>,
    cert_cache: Option<Spanned<i64>>,
    handshake_timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredential {
    id: Spanned<String>,
    host: Spanned<String>,
    header: Spanned<String>,
    prefix: Option<Spanned<String>>,
    secret_file: Option<Spanned<String>>,
    secret_env: Option<Spanned<String>>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    paths: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProxy {
    #[serde(default)]
    listen: Vec<Spanned<String>>,
    #[serde(default)]
    transparent: Vec<Spanned<String>>,
    #[serde(default)]
    socks5: Vec<Spanned<String>>,
    max_connections: Option<Spanned<i64>>,
    max_connections_per_org: Option<Spanned<i64>>,
    max_new_connections_per_second_per_org: Option<Spanned<i64>>,
    max_detect_memory_bytes: Option<Spanned<i64>>,
    max_request_head_bytes: Option<Spanned<i64>>,
    max_headers: Option<Spanned<i64>>,
    header_read_timeout: Option<Spanned<String>>,
    connect_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    detect_timeout: Option<Spanned<String>>,
    drain_timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDns {
    #[serde(default)]
    listen: Vec<Spanned<String>>,
    #[serde(default)]
    upstream: Vec<Spanned<String>>,
    resolve_timeout: Option<Spanned<String>>,
    idle_timeout: Option<Spanned<String>>,
    query_timeout: Option<Spanned<String>>,
    max_tcp_connections: Option<Spanned<i64>>,
    max_queries_in_flight: Option<Spanned<i64>>,
    max_queries_per_second_per_client: Option<Spanned<i64>>,
    min_ttl: Option<Spanned<String>>,
    max_ttl: Option<Spanned<String>>,
    binding_grace: Option<Spanned<String>>,
    max_bindings_per_name: Option<Spanned<i64>>,
    max_bindings: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawEvidence {
    dir: Option<Spanned<String>>,
    key: Option<Spanned<String>>,
    durability: Option<Spanned<String>>,
    checkpoint_every: Option<Spanned<i64>>,
    checkpoint_interval: Option<Spanned<String>>,
    rotate_size: Option<Spanned<RawSize>>,
    rotate_age: Option<Spanned<String>>,
    retain_size: Option<Spanned<RawSize>>,
    retain_age: Option<Spanned<String>>,
}

/// A byte size: an integer, or a string such as "64MiB", "500kB", "1GiB".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawSize {
    Bytes(i64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOrg {
    name: Spanned<String>,
    #[serde(default)]
    clients: Vec<Spanned<String>>,
    #[serde(default)]
    allow: Vec<Spanned<RawRule>>,
    #[serde(default)]
    deny: Vec<Spanned<RawRule>>,
    dns_denied: Option<Spanned<String>>,
    #[serde(default)]
    dns_types: Vec<Spanned<String>>,
    mode: Option<Spanned<String>>,
    identity: Option<Spanned<String>>,
    #[serde(default)]
    tokens: Vec<Spanned<String>>,
    #[serde(default)]
    credential: Vec<Spanned<RawCredential>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    id: Option<Spanned<String>>,
    host: Option<Spanned<String>>,
    cidr: Option<Spanned<String>>,
    ports: Option<Spanned<Vec<Spanned<i64>>>>,
    intercept: Option<Spanned<bool>>,
    tunnel: Option<Spanned<String>>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    paths: Option<Spanned<Vec<Spanned<String>>>>,
    deny_methods: Option<Spanned<Vec<Spanned<String>>>>,
    deny_paths: Option<Spanned<Vec<Spanned<String>>>>,
}

// ---------------------------------------------------------------------------
// Validated configuration.

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub proxy: ProxyConfig,
    pub dns: DnsConfig,
    pub admin: AdminConfig,
    pub evidence: EvidenceConfig,
    pub intercept: InterceptConfig,
    pub orgs: Vec<OrgConfig>,
}

/// Default number of minted leaf certificates kept (per process, all orgs).
pub const DEFAULT_CERT_CACHE: usize = 1000;
/// Default directory of the per-org interception CAs.
pub const DEFAULT_CA_DIR: &str = "ca";
/// Default upstream trust bundle for intercepted connections.
pub const DEFAULT_UPSTREAM_CA: &str = "/etc/ssl/certs/ca-certificates.crt";
/// Default time for a TLS handshake of an intercepted connection (either side).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `[intercept]`: where the per-org CAs live and what upstream certificates are trusted.
#[derive(Debug, Clone)]
pub struct InterceptConfig {
    /// `DIR/ORG.pem` and `DIR/ORG.key` (0600) per org that intercepts.
    pub ca_dir: PathBuf,
    /// PEM bundle upstream certificates are verified against.
    pub upstream_ca: PathBuf,
    /// Minted leaf certificates kept; the oldest is evicted.
    pub cert_cache: usize,
    pub handshake_timeout: Duration,
}

impl Default for InterceptConfig {
    fn default() -> Self {
        InterceptConfig {
            ca_dir: PathBuf::from(DEFAULT_CA_DIR),
            upstream_ca: PathBuf::from(DEFAULT_UPSTREAM_CA),
            cert_cache: DEFAULT_CERT_CACHE,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

/// What an intercepting allow rule lets through, request by request. Empty
/// `methods`/`paths` mean any; a `deny_*` match wins.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RequestRules {
    pub methods: Vec<String>,
    pub paths: Vec<PathPattern>,
    pub deny_methods: Vec<String>,
    pub deny_paths: Vec<PathPattern>,
}

/// A path rule: a prefix (no `*`), or a glob over the whole path in which
/// `*` matches any run of characters (including `/`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathPattern(pub String);

impl PathPattern {
    /// Does `path` match? Only a normalised path can be asked
    /// ([`crate::policy::request`]), never the raw one.
    pub fn matches(&self, path: &crate::policy::request::NormalPath) -> bool {
        let path = path.as_str();
        if !self.0.contains('*') {
            return path.starts_with(&self.0);
        }
        glob_match(self.0.as_bytes(), path.as_bytes())
    }
}

/// `*` matches any run of bytes; everything else literally. The two-pointer
/// algorithm: linear-ish, no exponential backtracking.
fn glob_match(pat: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if pat.get(p) == Some(&b'*') {
            star = Some((p, t));
            p += 1;
        } else if pat.get(p) == text.get(t) {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pat.get(p..).unwrap_or(&[]).iter().all(|&b| b == b'*')
}

/// Where a credential's secret comes from (never the policy file itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SecretSource {
    File(PathBuf),
    Env(String),
}

/// `[[org.credential]]`: a header Palisade adds to intercepted requests.
/// Holds no secret, only where to read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CredentialConfig {
    pub id: String,
    pub host: RuleTarget,
    pub methods: Vec<String>,
    pub paths: Vec<PathPattern>,
    /// Lower-case header name.
    pub header: String,
    /// Written before the secret, e.g. "Bearer ".
    pub prefix: String,
    pub source: SecretSource,
}

impl CredentialConfig {
    /// Does this credential apply to a request for `host` (normalised name)
    /// with this `method` (compared exactly) and normalised `path`? Never to
    /// `TRACE` or `TRACK`, which echo the request back.
    pub fn applies(
        &self,
        host: &str,
        method: &str,
        path: &crate::policy::request::NormalPath,
    ) -> bool {
        if crate::policy::request::is_trace(method) {
            return false;
        }
        let host_ok = match &self.host {
            RuleTarget::Exact(n) => n == host,
            RuleTarget::Below(s) => host
                .strip_suffix(s.as_str())
                .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
            RuleTarget::Cidr(_) => false,
        };
        host_ok
            && (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && (self.paths.is_empty() || self.paths.iter().any(|p| p.matches(path)))
    }
}

impl OrgConfig {
    /// Does any allow rule of this org intercept?
    pub fn intercepts(&self) -> bool {
        self.allow.iter().any(|r| r.intercept.is_some())
    }
}

#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub listen: Vec<SocketAddr>,
    pub transparent: Vec<SocketAddr>,
    /// SOCKS5 listeners (RFC 1928, CONNECT only).
    pub socks5: Vec<SocketAddr>,
    pub limits: Limits,
}

/// Bounds on what one client or all clients together may consume.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_connections: usize,
    pub max_connections_per_org: usize,
    /// New connections one org may open per second (token bucket, burst of one second's worth).
    pub max_new_connections_per_second_per_org: usize,
    /// Memory all connections together may hold in detection buffers
    /// (first bytes read and held before the decision).
    pub max_detect_memory_bytes: usize,
    pub max_request_head_bytes: usize,
    pub max_headers: usize,
    pub header_read_timeout: Duration,
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub detect_timeout: Duration,
    pub drain_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_org: DEFAULT_MAX_CONNECTIONS_PER_ORG,
            max_new_connections_per_second_per_org: DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_ORG,
            max_detect_memory_bytes: DEFAULT_MAX_DETECT_MEMORY_BYTES,
            max_request_head_bytes: DEFAULT_MAX_REQUEST_HEAD_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            detect_timeout: DEFAULT_DETECT_TIMEOUT,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }
}

#[derive(Debug, Clone)]
pub struct DnsConfig {
    pub listen: Vec<SocketAddr>,
    pub upstream: Vec<SocketAddr>,
    pub resolve_timeout: Duration,
    /// A DNS-over-TCP connection silent this long is closed.
    pub idle_timeout: Duration,
    /// One query, end to end; past it the client gets SERVFAIL.
    pub query_timeout: Duration,
    pub max_tcp_connections: usize,
    pub max_queries_in_flight: usize,
    /// Queries one client address may send per second (token bucket).
    pub max_queries_per_second_per_client: usize,
    /// Answer TTLs are clamped to `min_ttl..=max_ttl` (whole seconds).
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    /// A binding stays valid for the (clamped) TTL plus this.
    pub binding_grace: Duration,
    pub max_bindings_per_name: usize,
    pub max_bindings: usize,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            listen: Vec::new(),
            upstream: Vec::new(),
            resolve_timeout: DEFAULT_RESOLVE_TIMEOUT,
            idle_timeout: DEFAULT_DNS_IDLE_TIMEOUT,
            query_timeout: DEFAULT_DNS_QUERY_TIMEOUT,
            max_tcp_connections: DEFAULT_DNS_MAX_TCP_CONNECTIONS,
            max_queries_in_flight: DEFAULT_DNS_MAX_QUERIES_IN_FLIGHT,
            max_queries_per_second_per_client: DEFAULT_DNS_MAX_QUERIES_PER_SECOND_PER_CLIENT,
            min_ttl: DEFAULT_DNS_MIN_TTL,
            max_ttl: DEFAULT_DNS_MAX_TTL,
            binding_grace: DEFAULT_DNS_BINDING_GRACE,
            max_bindings_per_name: DEFAULT_DNS_MAX_BINDINGS_PER_NAME,
            max_bindings: DEFAULT_DNS_MAX_BINDINGS,
        }
    }
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: Option<SocketAddr>,
}

/// Default records between signed checkpoints.
pub const DEFAULT_CHECKPOINT_EVERY: u64 = 1000;
/// Default longest time between signed checkpoints while records arrive.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);
/// Default segment size that starts a new segment.
pub const DEFAULT_ROTATE_SIZE: u64 = 64 * 1024 * 1024;
/// Default segment age that starts a new segment.
pub const DEFAULT_ROTATE_AGE: Duration = Duration::from_secs(3600);

/// When a record counts as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Handed to the kernel (`write(2)` returned): survives a process crash.
    Os,
    /// On disk (`fdatasync` of the batch): survives a machine crash.
    Fsync,
    /// Measuring only: the whole pipeline runs but the bytes go to /dev/null.
    Discard,
}

impl Durability {
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Os => "os",
            Durability::Fsync => "fsync",
            Durability::Discard => "discard",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EvidenceConfig {
    pub dir: PathBuf,
    /// Ed25519 signing key file (created 0600 when missing).
    pub key: PathBuf,
    pub durability: Durability,
    pub checkpoint_every: u64,
    pub checkpoint_interval: Duration,
    pub rotate_size: u64,
    pub rotate_age: Duration,
    /// Remove the oldest closed segments while all together exceed this.
    pub retain_size: Option<u64>,
    /// Remove closed segments last written longer ago than this.
    pub retain_age: Option<Duration>,
}

impl EvidenceConfig {
    /// Defaults for an evidence dir.
    pub fn for_dir(dir: &Path) -> EvidenceConfig {
        EvidenceConfig {
            dir: dir.to_path_buf(),
            key: crate::evidence::key::default_key_path(dir),
            durability: Durability::Os,
            checkpoint_every: DEFAULT_CHECKPOINT_EVERY,
            checkpoint_interval: DEFAULT_CHECKPOINT_INTERVAL,
            rotate_size: DEFAULT_ROTATE_SIZE,
            rotate_age: DEFAULT_ROTATE_AGE,
            retain_size: None,
            retain_age: None,
        }
    }
}

/// One organisation: who its clients are and where they may go.
#[derive(Debug, Clone, Serialize)]
pub struct OrgConfig {
    pub name: String,
    pub clients: Vec<IpNet>,
    pub allow: Vec<RuleConfig>,
    pub deny: Vec<RuleConfig>,
    /// How the DNS shim answers a name this org may not reach. Left out of
    /// the policy hash while it has its default value.
    #[serde(skip_serializing_if = "DnsDenied::is_default")]
    pub dns_denied: DnsDenied,
    /// Extra query types the DNS shim forwards for allowed names (upper
    /// case, e.g. "TXT"), on top of A, AAAA, CNAME, HTTPS and SVCB.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dns_types: Vec<String>,
    /// `report`: decide and record what enforcement would do, but let the
    /// allowlist's denials through. Left out of the policy hash while it is
    /// `enforce`.
    #[serde(skip_serializing_if = "OrgMode::is_default")]
    pub mode: OrgMode,
    /// How a client proves it belongs to this org. Left out of the policy
    /// hash while it has its default value.
    #[serde(skip_serializing_if = "Identity::is_default")]
    pub identity: Identity,
    /// SHA-256 digests of the org's tokens. Never serialised: the policy
    /// text stored beside the evidence carries no credential material.
    #[serde(skip)]
    pub tokens: Vec<TokenDigest>,
    /// Headers added to intercepted requests (ids and sources only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<CredentialConfig>,
}

/// Whether an org's allowlist is enforced or only reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OrgMode {
    #[default]
    Enforce,
    Report,
}

impl OrgMode {
    pub fn is_default(&self) -> bool {
        *self == OrgMode::Enforce
    }
}

/// How a client proves which org it belongs to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub enum Identity {
    /// Its source address is in the org's `clients` (longest prefix).
    #[default]
    #[serde(rename = "address")]
    Address,
    /// It presents one of the org's tokens (user = org name); any address.
    #[serde(rename = "token")]
    Token,
    /// Both: a token of the org, from an address in the org's `clients`.
    #[serde(rename = "address+token")]
    AddressToken,
}

impl Identity {
    fn is_default(&self) -> bool {
        *self == Identity::Address
    }

    /// Does this org need a token?
    pub fn needs_token(self) -> bool {
        self != Identity::Address
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Identity::Address => "address",
            Identity::Token => "token",
            Identity::AddressToken => "address+token",
        }
    }
}

/// The SHA-256 digest of a token, as the config stores it
/// (`sha256:<64 hex digits>`). Compared only in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenDigest(pub [u8; 32]);

/// The prefix of a hashed token in the config.
pub const TOKEN_DIGEST_PREFIX: &str = "sha256:";

impl TokenDigest {
    /// The digest of a presented token.
    pub fn of(token: &[u8]) -> TokenDigest {
        use sha2::Digest;
        TokenDigest(sha2::Sha256::digest(token).into())
    }

    /// Parse `sha256:<64 hex digits>`.
    pub fn parse(text: &str) -> Option<TokenDigest> {
        let hex = text.strip_prefix(TOKEN_DIGEST_PREFIX)?;
        let bytes = data_encoding::HEXLOWER_PERMISSIVE
            .decode(hex.as_bytes())
            .ok()?;
        Some(TokenDigest(bytes.try_into().ok()?))
    }

    /// Constant-time equality (the digests have a fixed length).
    pub fn ct_eq(&self, other: &TokenDigest) -> bool {
        use subtle::ConstantTimeEq;
        self.0.ct_eq(&other.0).into()
    }
}

impl fmt::Display for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{TOKEN_DIGEST_PREFIX}{}",
            data_encoding::HEXLOWER.encode(&self.0)
        )
    }
}

impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenDigest({self})")
    }
}

/// A fresh random token (32 bytes, lowercase hex) and its digest.
pub fn new_token() -> std::io::Result<(String, TokenDigest)> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    let token = data_encoding::HEXLOWER.encode(&bytes);
    let digest = TokenDigest::of(token.as_bytes());
    Ok((token, digest))
}

/// The DNS answer to a denied name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsDenied {
    /// REFUSED with an Extended DNS Error (RFC 8914, 15 "Blocked").
    #[default]
    Refused,
    /// NXDOMAIN with the same Extended DNS Error, for clients whose libc
    /// tries the next server on REFUSED.
    Nxdomain,
}

impl DnsDenied {
    fn is_default(&self) -> bool {
        *self == DnsDenied::Refused
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RuleConfig {
    pub id: String,
    pub target: RuleTarget,
    pub ports: PortSet,
    /// `intercept = true` and its request rules (allow host rules only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub intercept: Option<RequestRules>,
    /// `tunnel = ...` (allow host rules only): what the rule's tunnels may
    /// carry. `None`: the per-port default ([`Carry::default_for_port`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<Carry>,
}

/// What a tunnel allowed by a host rule may carry, verified from its first
/// byte to its last (see `src/proxy/verify.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Carry {
    /// TLS whose every plaintext ClientHello names the rule's host (no ECH).
    Tls,
    /// HTTP/1 whose every request names the rule's host (no h2c).
    Http,
    /// TLS or HTTP, told apart by the first bytes, then verified as such.
    TlsOrHttp,
    /// Anything, unverified: the rule's author accepts that the name is
    /// checked only where the client names it at the start.
    Opaque,
}

impl Carry {
    pub const NAMES: [&'static str; 4] = ["tls", "http", "tls-or-http", "opaque"];

    pub fn as_str(self) -> &'static str {
        match self {
            Carry::Tls => "tls",
            Carry::Http => "http",
            Carry::TlsOrHttp => "tls-or-http",
            Carry::Opaque => "opaque",
        }
    }

    fn parse(text: &str) -> Option<Carry> {
        match text {
            "tls" => Some(Carry::Tls),
            "http" => Some(Carry::Http),
            "tls-or-http" => Some(Carry::TlsOrHttp),
            "opaque" => Some(Carry::Opaque),
            _ => None,
        }
    }

    /// A host rule without `tunnel`: TLS on 443, HTTP on 80, and TLS or
    /// HTTP (verified either way) on any other port.
    pub fn default_for_port(port: u16) -> Carry {
        match port {
            443 => Carry::Tls,
            80 => Carry::Http,
            _ => Carry::TlsOrHttp,
        }
    }
}

impl fmt::Display for Carry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a rule matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum RuleTarget {
    /// Exactly this normalised name.
    Exact(String),
    /// Any name strictly below this normalised suffix (`*.example.com` stores `example.com`).
    Below(String),
    /// Any address in this network.
    Cidr(IpNet),
}

/// Ports a rule covers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum PortSet {
    All,
    List(Vec<u16>),
}

impl PortSet {
    pub fn contains(&self, port: u16) -> bool {
        match self {
            PortSet::All => true,
            PortSet::List(ports) => ports.contains(&port),
        }
    }
}

impl fmt::Display for RuleTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleTarget::Exact(name) => write!(f, "host {name}"),
            RuleTarget::Below(suffix) => write!(f, "host *.{suffix}"),
            RuleTarget::Cidr(net) => write!(f, "cidr {net}"),
        }
    }
}

impl Config {
    /// Every socket address Palisade itself listens on; the policy never lets a
    /// connection be dialled back to one of them.
    pub fn own_addresses(&self) -> Vec<SocketAddr> {
        let mut own: Vec<SocketAddr> = self.proxy.listen.clone();
        own.extend(&self.proxy.transparent);
        own.extend(&self.proxy.socks5);
        own.extend(&self.dns.listen);
        own.extend(self.admin.listen);
        own
    }
}

// ---------------------------------------------------------------------------
// Errors.

/// One configuration problem, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.path, self.line, self.col, self.message
        )
    }
}

/// All problems found in one configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = src.get(..offset).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let col = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (line, col)
}

struct Errors<'a> {
    path: &'a str,
    src: &'a str,
    list: Vec<ConfigError>,
    /// Listen addresses seen so far, to reject one used twice.
    listening: HashSet<SocketAddr>,
}

impl Errors<'_> {
    fn at(&mut self, span: Range<usize>, message: impl Into<String>) {
        let (line, col) = line_col(self.src, span.start);
        self.list.push(ConfigError {
            path: self.path.to_string(),
            line,
            col,
            message: message.into(),
        });
    }
}

// ---------------------------------------------------------------------------
// Loading.

/// Read, parse and validate the file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let display = path.display().to_string();
    let src = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            path: display.clone(),
            line: 1,
            col: 1,
            message: format!("cannot read config: {e}"),
        }])
    })?;
    from_str(&src, path)
}

/// Parse and validate configuration text; `path` names it in errors and
/// anchors relative paths.
pub fn from_str(src: &str, path: &Path) -> Result<Config, ConfigErrors> {
    let display = path.display().to_string();
    let mut errors = Errors {
        path: &display,
        src,
        list: Vec::new(),
        listening: HashSet::new(),
    };
    let raw: RawConfig = match toml::from_str(src) {
        Ok(raw) => raw,
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            let mut message = e.message().trim().to_string();
            // Name the offending text when the parser's message does not.
            if let Some(text) = src.get(span.clone()).map(str::trim) {
                if !text.is_empty()
                    && text.len() <= 64
                    && !text.contains('\n')
                    && !message.contains(text)
                {
                    message = format!("{message}: `{text}`");
                }
            }
            errors.at(span, message);
            return Err(ConfigErrors(errors.list));
        }
    };
    let config = validate(raw, path, &mut errors);
    if errors.list.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors.list))
    }
}

fn validate(raw: RawConfig, path: &Path, errors: &mut Errors<'_>) -> Config {
    // Destructure exhaustively: a new field cannot be silently ignored.
    let RawConfig {
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        org,
    } = raw;

    let proxy = validate_proxy(proxy, errors);
    let dns = validate_dns(dns, errors);
    let RawAdmin { listen } = admin;
    let admin = AdminConfig {
        listen: listen.and_then(|l| listen_addr(&l, errors)),
    };
    let evidence = validate_evidence(evidence, errors);

    let intercept = validate_intercept(intercept, errors);
    let orgs = validate_orgs(org, errors);

    Config {
        path: path.to_path_buf(),
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        orgs,
    }
}

fn validate_intercept(raw: RawIntercept, errors: &mut Errors<'_>) -> InterceptConfig {
    let RawIntercept {
        ca_dir,
        upstream_ca,
        cert_cache,
        handshake_timeout,
    } = raw;
    let d = InterceptConfig::default();
    let mut path = |v: Option<Spanned<String>>, default: PathBuf, what: &str| match v {
        Some(p) if p.get_ref().trim().is_empty() => {
            errors.at(p.span(), format!("intercept {what} must not be empty"));
            default
        }
        Some(p) => PathBuf::from(p.into_inner()),
        None => default,
    };
    let ca_dir = path(ca_dir, d.ca_dir, "ca_dir");
    let upstream_ca = path(upstream_ca, d.upstream_ca, "upstream_ca");
    InterceptConfig {
        ca_dir,
        upstream_ca,
        cert_cache: count(cert_cache, d.cert_cache, errors),
        handshake_timeout: duration(handshake_timeout, d.handshake_timeout, errors),
    }
}

type RawList = Option<Spanned<Vec<Spanned<String>>>>;

/// Registered methods: a case variant of one (`get`) is refused in config,
/// since matching is exact and it would only ever match that odd spelling.
const REGISTERED_METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "TRACK", "PATCH",
];

/// HTTP methods: RFC 9110 tokens, matched exactly (methods are
/// case-sensitive), so a case variant of a registered method is refused.
fn methods(value: RawList, errors: &mut Errors<'_>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in value.map(Spanned::into_inner).unwrap_or_default() {
        let text = m.get_ref().trim();
        let variant = REGISTERED_METHODS
            .iter()
            .find(|r| r.eq_ignore_ascii_case(text) && **r != text);
        if !crate::policy::request::is_method_token(text) {
            errors.at(
                m.span(),
                format!("invalid method {text:?} (an RFC 9110 token, e.g. \"GET\")"),
            );
        } else if let Some(r) = variant {
            errors.at(
                m.span(),
                format!("invalid method {text:?}: methods are case-sensitive, write {r:?}"),
            );
        } else if !out.iter().any(|o| o == text) {
            out.push(text.to_string());
        }
    }
    out
}

/// Path rules: start with `/`, printable ASCII, no `%` escapes, and in the
/// normal form requests are matched in (no `.`/`..` or empty segments, no
/// `;`, no `\\`): a rule that no normalised path can match is a mistake.
fn paths(value: RawList, errors: &mut Errors<'_>) -> Vec<PathPattern> {
    let mut out = Vec::new();
    for p in value.map(Spanned::into_inner).unwrap_or_default() {
        let text = p.get_ref().trim();
        let printable = text.bytes().all(|b| b.is_ascii_graphic());
        if !text.starts_with('/') || !printable || text.len() > 1024 || text.contains('%') {
            errors.at(
                p.span(),
                format!(
                    "invalid path rule {text:?} (starts with '/', printable ASCII, no '%'; \
                     '*' matches anything)"
                ),
            );
        } else if let Err(why) = crate::policy::request::NormalPath::parse(text) {
            errors.at(
                p.span(),
                format!("invalid path rule {text:?}: requests are matched normalised, and {why}"),
            );
        } else {
            out.push(PathPattern(text.to_string()));
        }
    }
    out
}

/// Header names a credential must not set: framing, routing and hop-by-hop.
const CREDENTIAL_FORBIDDEN_HEADERS: [&str; 10] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
];

/// Does `rule` (an intercepting allow rule's target) cover every name `t` matches?
fn target_covers(rule: &RuleTarget, t: &RuleTarget) -> bool {
    match (rule, t) {
        (RuleTarget::Exact(a), RuleTarget::Exact(b)) => a == b,
        (RuleTarget::Below(s), RuleTarget::Exact(b)) => b.ends_with(&format!(".{s}")),
        (RuleTarget::Below(s), RuleTarget::Below(b)) => b == s || b.ends_with(&format!(".{s}")),
        _ => false,
    }
}

fn validate_credentials(
    org: &str,
    raw: Vec<Spanned<RawCredential>>,
    allow: &[RuleConfig],
    ids: &mut HashSet<String>,
    errors: &mut Errors<'_>,
) -> Vec<CredentialConfig> {
    let mut out = Vec::new();
    for spanned in raw {
        let span = spanned.span();
        let RawCredential {
            id,
            host,
            header,
            prefix,
            secret_file,
            secret_env,
            methods: m,
            paths: p,
        } = spanned.into_inner();
        let id_text = id.get_ref().trim().to_string();
        if id_text.is_empty() || id_text.len() > 128 || id_text.chars().any(char::is_control) {
            errors.at(id.span(), format!("invalid credential id {id_text:?}"));
        } else if !ids.insert(format!("credential:{id_text}")) {
            errors.at(
                id.span(),
                format!("credential id {id_text:?} is used twice"),
            );
        }
        let target = host_rule(&host, true, errors);
        if let Some(t) = &target {
            let covered = allow
                .iter()
                .any(|r| r.intercept.is_some() && target_covers(&r.target, t));
            if !covered {
                errors.at(
                    host.span(),
                    format!(
                        "credential {id_text:?}: no allow rule of org {org:?} intercepts {t} \
                         (add intercept = true to its allow rule)"
                    ),
                );
            }
        }
        let header_text = header.get_ref().trim().to_ascii_lowercase();
        if http::HeaderName::from_bytes(header_text.as_bytes()).is_err()
            || CREDENTIAL_FORBIDDEN_HEADERS.contains(&header_text.as_str())
        {
            errors.at(
                header.span(),
                format!("credential header {header_text:?} is not a header Palisade may set"),
            );
        }
        let prefix_text = prefix
            .as_ref()
            .map(|p| p.get_ref().clone())
            .unwrap_or_default();
        if let Some(p) = &prefix {
            if http::HeaderValue::from_str(&prefix_text).is_err() {
                errors.at(p.span(), "credential prefix must be printable text");
            }
        }
        let source = match (secret_file, secret_env) {
            (Some(f), None) if !f.get_ref().trim().is_empty() => {
                Some(SecretSource::File(PathBuf::from(f.into_inner())))
            }
            (None, Some(e)) if !e.get_ref().trim().is_empty() => {
                Some(SecretSource::Env(e.into_inner()))
            }
            (Some(_), Some(e)) => {
                errors.at(
                    e.span(),
                    "a credential has secret_file or secret_env, not both",
                );
                None
            }
            _ => {
                errors.at(
                    span.clone(),
                    format!(
                        "credential {id_text:?} needs secret_file or secret_env \
                         (the secret never goes in the policy file)"
                    ),
                );
                None
            }
        };
        let m = methods(m, errors);
        let p = paths(p, errors);
        if let (Some(host), Some(source)) = (target, source) {
            out.push(CredentialConfig {
                id: id_text,
                host,
                methods: m,
                paths: p,
                header: header_text,
                prefix: prefix_text,
                source,
            });
        }
    }
    out
}

fn validate_evidence(raw: RawEvidence, errors: &mut Errors<'_>) -> EvidenceConfig {
    let RawEvidence {
        dir,
        key,
        durability,
        checkpoint_every,
        checkpoint_interval,
        rotate_size,
        rotate_age,
        retain_size,
        retain_age,
    } = raw;
    let dir = match dir {
        Some(d) if d.get_ref().trim().is_empty() => {
            errors.at(d.span(), "evidence dir must not be empty");
            PathBuf::from("evidence")
        }
        Some(d) => PathBuf::from(d.into_inner()),
        None => PathBuf::from("evidence"),
    };
    let mut c = EvidenceConfig::for_dir(&dir);
    match key {
        Some(k) if k.get_ref().trim().is_empty() => {
            errors.at(k.span(), "evidence key must not be empty")
        }
        Some(k) => c.key = PathBuf::from(k.into_inner()),
        None => {}
    }
    if let Some(d) = durability {
        c.durability = match d.get_ref().as_str() {
            "os" => Durability::Os,
            "fsync" => Durability::Fsync,
            "discard" => Durability::Discard,
            other => {
                errors.at(
                    d.span(),
                    format!("durability {other:?} must be \"os\", \"fsync\" or \"discard\""),
                );
                Durability::Os
            }
        };
    }
    c.checkpoint_every = count(checkpoint_every, c.checkpoint_every as usize, errors) as u64;
    c.checkpoint_interval = duration(checkpoint_interval, c.checkpoint_interval, errors);
    c.rotate_size = size(rotate_size, errors).unwrap_or(c.rotate_size);
    c.rotate_age = duration(rotate_age, c.rotate_age, errors);
    if let Some(r) = &retain_size {
        let span = r.span();
        c.retain_size = size(retain_size, errors);
        if c.retain_size.is_some_and(|n| n < c.rotate_size) {
            errors.at(
                span,
                format!(
                    "retain_size must be at least rotate_size ({} bytes)",
                    c.rotate_size
                ),
            );
        }
    }
    if retain_age.is_some() {
        c.retain_age = Some(duration(retain_age, Duration::ZERO, errors));
    }
    c
}

/// A byte size: an integer or a number with a unit (B, kB, MB, GB, KiB,
/// MiB, GiB); must be positive.
fn size(value: Option<Spanned<RawSize>>, errors: &mut Errors<'_>) -> Option<u64> {
    let value = value?;
    let parsed = match value.get_ref() {
        RawSize::Bytes(n) => u64::try_from(*n).ok().filter(|n| *n > 0),
        RawSize::Text(t) => parse_size(t),
    };
    if parsed.is_none() {
        let shown = match value.get_ref() {
            RawSize::Bytes(n) => n.to_string(),
            RawSize::Text(t) => format!("{t:?}"),
        };
        errors.at(
            value.span(),
            format!("size {shown} must be a positive byte count (e.g. 1048576 or \"64MiB\")"),
        );
    }
    parsed
}

fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "MB" => 1000 * 1000,
        "GB" => 1000 * 1000 * 1000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult).filter(|n| *n > 0)
}

fn validate_proxy(raw: RawProxy, errors: &mut Errors<'_>) -> ProxyConfig {
    let RawProxy {
        listen,
        transparent,
        socks5,
        max_connections,
        max_connections_per_org,
        max_new_connections_per_second_per_org,
        max_detect_memory_bytes,
        max_request_head_bytes,
        max_headers,
        header_read_timeout,
        connect_timeout,
        idle_timeout,
        detect_timeout,
        drain_timeout,
    } = raw;
    let d = Limits::default();
    let limits = Limits {
        max_connections: count(max_connections, d.max_connections, errors),
        max_connections_per_org: count(max_connections_per_org, d.max_connections_per_org, errors),
        max_new_connections_per_second_per_org: count(
            max_new_connections_per_second_per_org,
            d.max_new_connections_per_second_per_org,
            errors,
        ),
        max_detect_memory_bytes: count(max_detect_memory_bytes, d.max_detect_memory_bytes, errors),
        max_request_head_bytes: count(max_request_head_bytes, d.max_request_head_bytes, errors),
        max_headers: count(max_headers, d.max_headers, errors),
        header_read_timeout: duration(header_read_timeout, d.header_read_timeout, errors),
        connect_timeout: duration(connect_timeout, d.connect_timeout, errors),
        idle_timeout: duration(idle_timeout, d.idle_timeout, errors),
        detect_timeout: duration(detect_timeout, d.detect_timeout, errors),
        drain_timeout: duration(drain_timeout, d.drain_timeout, errors),
    };
    ProxyConfig {
        listen: listen
            .iter()
            .filter_map(|l| listen_addr(l, errors))
            .collect(),
        transparent: transparent
            .iter()
            .filter_map(|l| listen_addr(l, errors))
            .collect(),
        socks5: socks5
            .iter()
            .filter_map(|l| listen_addr(l, errors))
            .collect(),
        limits,
    }
}

fn validate_dns(raw: RawDns, errors: &mut Errors<'_>) -> DnsConfig {
    let RawDns {
        listen,
        upstream,
        resolve_timeout,
        idle_timeout,
        query_timeout,
        max_tcp_connections,
        max_queries_in_flight,
        max_queries_per_second_per_client,
        min_ttl,
        max_ttl,
        binding_grace,
        max_bindings_per_name,
        max_bindings,
    } = raw;
    let d = DnsConfig::default();
    let max_ttl_span = max_ttl.as_ref().map(|m| m.span());
    let config = DnsConfig {
        listen: listen
            .iter()
            .filter_map(|l| listen_addr(l, errors))
            .collect(),
        upstream: upstream
            .iter()
            .filter_map(|l| socket_addr(l, Some(53), errors))
            .collect(),
        resolve_timeout: duration(resolve_timeout, d.resolve_timeout, errors),
        idle_timeout: duration(idle_timeout, d.idle_timeout, errors),
        query_timeout: duration(query_timeout, d.query_timeout, errors),
        max_tcp_connections: count(max_tcp_connections, d.max_tcp_connections, errors),
        max_queries_in_flight: count(max_queries_in_flight, d.max_queries_in_flight, errors),
        max_queries_per_second_per_client: count(
            max_queries_per_second_per_client,
            d.max_queries_per_second_per_client,
            errors,
        ),
        min_ttl: duration(min_ttl, d.min_ttl, errors),
        max_ttl: duration(max_ttl, d.max_ttl, errors),
        binding_grace: duration(binding_grace, d.binding_grace, errors),
        max_bindings_per_name: count(max_bindings_per_name, d.max_bindings_per_name, errors),
        max_bindings: count(max_bindings, d.max_bindings, errors),
    };
    if config.min_ttl > config.max_ttl {
        errors.at(
            max_ttl_span.unwrap_or(0..0),
            format!(
                "dns max_ttl {:?} is below min_ttl {:?}",
                config.max_ttl, config.min_ttl
            ),
        );
    }
    config
}

/// A listen address, unique across all listeners.
fn listen_addr(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<SocketAddr> {
    let addr = socket_addr(value, None, errors)?;
    if !errors.listening.insert(addr) {
        errors.at(value.span(), format!("listen address {addr} is used twice"));
        return None;
    }
    Some(addr)
}

fn socket_addr(
    value: &Spanned<String>,
    default_port: Option<u16>,
    errors: &mut Errors<'_>,
) -> Option<SocketAddr> {
    let text = value.get_ref().trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        if addr.port() == 0 {
            errors.at(value.span(), format!("address {text:?} has port 0"));
            return None;
        }
        return Some(addr);
    }
    if let (Some(port), Ok(ip)) = (default_port, text.parse::<IpAddr>()) {
        return Some(SocketAddr::new(ip, port));
    }
    errors.at(
        value.span(),
        format!("invalid socket address {text:?} (expected ip:port or [v6]:port)"),
    );
    None
}

fn count(value: Option<Spanned<i64>>, default: usize, errors: &mut Errors<'_>) -> usize {
    let Some(value) = value else { return default };
    match usize::try_from(*value.get_ref()) {
        Ok(n) if n > 0 => n,
        _ => {
            errors.at(
                value.span(),
                format!("limit {} must be a positive integer", value.get_ref()),
            );
            default
        }
    }
}

fn duration(
    value: Option<Spanned<String>>,
    default: Duration,
    errors: &mut Errors<'_>,
) -> Duration {
    let Some(value) = value else { return default };
    match humantime::parse_duration(value.get_ref().trim()) {
        Ok(d) if !d.is_zero() => d,
        Ok(_) => {
            errors.at(
                value.span(),
                format!("duration {:?} must be positive", value.get_ref()),
            );
            default
        }
        Err(e) => {
            errors.at(
                value.span(),
                format!(
                    "invalid duration {:?} ({e}; e.g. \"5s\", \"250ms\")",
                    value.get_ref()
                ),
            );
            default
        }
    }
}

/// Org names appear in metrics labels and evidence: keep them plain.
fn valid_org_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn validate_orgs(raw: Vec<RawOrg>, errors: &mut Errors<'_>) -> Vec<OrgConfig> {
    let mut orgs = Vec::new();
    let mut names: HashSet<String> = HashSet::new();
    let mut client_nets: HashMap<IpNet, String> = HashMap::new();
    let mut rule_ids: HashSet<String> = HashSet::new();
    let mut token_orgs: Vec<(TokenDigest, String)> = Vec::new();

    for org in raw {
        let RawOrg {
            name,
            clients,
            allow,
            deny,
            dns_denied,
            dns_types,
            mode,
            identity,
            tokens,
            credential,
        } = org;
        let org_name = name.get_ref().clone();
        if !valid_org_name(&org_name) {
            errors.at(
                name.span(),
                format!("invalid org name {org_name:?} (use 1-64 of a-z, 0-9, '-', '_')"),
            );
        } else if org_name == "unknown" {
            errors.at(
                name.span(),
                "org name \"unknown\" is reserved for clients that match no org",
            );
        } else if !names.insert(org_name.clone()) {
            errors.at(name.span(), format!("org {org_name:?} is defined twice"));
        }

        let identity_span = identity.as_ref().map_or(name.span(), |i| i.span());
        let identity = validate_identity(identity.as_ref(), errors);
        let tokens = validate_tokens(
            (&org_name, identity_span),
            identity,
            &tokens,
            &mut token_orgs,
            errors,
        );
        if identity == Identity::Token {
            if let Some(first) = clients.first() {
                errors.at(
                    first.span(),
                    "an org with identity = \"token\" takes no clients (use \"address+token\" to require both)",
                );
            }
        }
        let mut nets = Vec::new();
        for client in &clients {
            let Some(net) = cidr(client, errors) else {
                continue;
            };
            // Token orgs may share a network (a NAT, a shared pool): their
            // token tells them apart. Address orgs may not.
            if identity == Identity::Address {
                if let Some(other) = client_nets.get(&net) {
                    errors.at(
                        client.span(),
                        format!("client network {net} already belongs to org {other:?}"),
                    );
                    continue;
                }
                client_nets.insert(net, org_name.clone());
            }
            nets.push(net);
        }
        if clients.is_empty() && identity != Identity::Token {
            errors.at(name.span(), format!("org {org_name:?} has no clients"));
        }

        let allow = validate_rules(&org_name, "allow", allow, &mut rule_ids, errors);
        let deny = validate_rules(&org_name, "deny", deny, &mut rule_ids, errors);
        let dns_denied = match dns_denied {
            None => DnsDenied::default(),
            Some(v) => {
                match v.get_ref().as_str() {
                    "refused" => DnsDenied::Refused,
                    "nxdomain" => DnsDenied::Nxdomain,
                    other => {
                        errors.at(
                        v.span(),
                        format!("invalid dns_denied {other:?} (expected \"refused\" or \"nxdomain\")"),
                    );
                        DnsDenied::default()
                    }
                }
            }
        };
        let dns_types = validate_dns_types(&dns_types, errors);
        let mode = match mode {
            None => OrgMode::default(),
            Some(v) => match v.get_ref().as_str() {
                "enforce" => OrgMode::Enforce,
                "report" => OrgMode::Report,
                other => {
                    errors.at(
                        v.span(),
                        format!("invalid mode {other:?} (expected \"enforce\" or \"report\")"),
                    );
                    OrgMode::default()
                }
            },
        };
        let credentials =
            validate_credentials(&org_name, credential, &allow, &mut rule_ids, errors);
        orgs.push(OrgConfig {
            name: org_name,
            clients: nets,
            allow,
            deny,
            dns_denied,
            dns_types,
            mode,
            identity,
            tokens,
            credentials,
        });
    }
    orgs
}

fn validate_identity(raw: Option<&Spanned<String>>, errors: &mut Errors<'_>) -> Identity {
    let Some(v) = raw else {
        return Identity::default();
    };
    match v.get_ref().trim() {
        "address" => Identity::Address,
        "token" => Identity::Token,
        "address+token" => Identity::AddressToken,
        other => {
            errors.at(
                v.span(),
                format!(
                    "invalid identity {other:?} (expected \"address\", \"token\" or \"address+token\")"
                ),
            );
            Identity::default()
        }
    }
}

/// Token digests of one org: hashed form only, only where the identity
/// uses them, at least one where it needs them, none shared between orgs.
fn validate_tokens(
    (org, span): (&str, Range<usize>),
    identity: Identity,
    raw: &[Spanned<String>],
    seen: &mut Vec<(TokenDigest, String)>,
    errors: &mut Errors<'_>,
) -> Vec<TokenDigest> {
    let mut out = Vec::new();
    for t in raw {
        if !identity.needs_token() {
            errors.at(
                t.span(),
                format!("org {org:?} lists tokens but its identity is \"address\" (set identity = \"token\" or \"address+token\")"),
            );
            break;
        }
        // Never echo the value: it may be a plain token pasted by mistake.
        let Some(digest) = TokenDigest::parse(t.get_ref().trim()) else {
            errors.at(
                t.span(),
                "token must be stored hashed as \"sha256:<64 hex digits>\", never plain (`palisade token new` prints the line)",
            );
            continue;
        };
        if let Some((_, other)) = seen.iter().find(|(d, _)| *d == digest) {
            errors.at(
                t.span(),
                format!("token is already listed for org {other:?}"),
            );
            continue;
        }
        seen.push((digest.clone(), org.to_string()));
        out.push(digest);
    }
    if identity.needs_token() && raw.is_empty() {
        errors.at(
            span,
            format!(
                "org {org:?} has identity {:?} but no tokens",
                identity.as_str()
            ),
        );
    }
    out
}

/// Query type names an org enables, upper case, each known to hickory and
/// none of [`DNS_NEVER_TYPES`].
fn validate_dns_types(raw: &[Spanned<String>], errors: &mut Errors<'_>) -> Vec<String> {
    use hickory_server::proto::rr::RecordType;
    let mut out: Vec<String> = Vec::new();
    for t in raw {
        let text = t.get_ref().trim().to_ascii_uppercase();
        if DNS_NEVER_TYPES.contains(&text.as_str()) {
            errors.at(
                t.span(),
                format!("dns type {text:?} is never answered by the DNS shim"),
            );
            continue;
        }
        match text.parse::<RecordType>() {
            Ok(RecordType::Unknown(_)) | Err(_) => errors.at(
                t.span(),
                format!(
                    "unknown dns type {:?} (e.g. \"TXT\", \"MX\", \"SRV\")",
                    t.get_ref()
                ),
            ),
            Ok(rt) => {
                let name = rt.to_string();
                if !out.contains(&name) {
                    out.push(name);
                }
            }
        }
    }
    out
}

fn cidr(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<IpNet> {
    let text = value.get_ref().trim();
    let net = if text.contains('/') {
        text.parse::<IpNet>().ok()
    } else {
        text.parse::<IpAddr>().ok().map(IpNet::from)
    };
    let Some(net) = net else {
        errors.at(
            value.span(),
            format!("invalid cidr {text:?} (expected e.g. 198.18.7.0/24 or 2001:db8::/32)"),
        );
        return None;
    };
    if net.trunc() != net {
        errors.at(
            value.span(),
            format!(
                "cidr {text:?} has host bits set (did you mean {}?)",
                net.trunc()
            ),
        );
        return None;
    }
    Some(net)
}

fn validate_rules(
    org: &str,
    kind: &str,
    raw: Vec<Spanned<RawRule>>,
    ids: &mut HashSet<String>,
    errors: &mut Errors<'_>,
) -> Vec<RuleConfig> {
    let mut rules = Vec::new();
    for (n, spanned) in raw.into_iter().enumerate() {
        let span = spanned.span();
        let RawRule {
            id,
            host,
            cidr: cidr_value,
            ports,
            intercept,
            tunnel,
            methods: allow_methods,
            paths: allow_paths,
            deny_methods,
            deny_paths,
        } = spanned.into_inner();
        let request_span = [&allow_methods, &allow_paths, &deny_methods, &deny_paths]
            .iter()
            .find_map(|k| k.as_ref().map(|k| k.span()));
        let intercept = match intercept {
            Some(flag) if *flag.get_ref() => {
                if kind != "allow" || host.is_none() {
                    errors.at(
                        flag.span(),
                        "intercept is only valid on allow rules with a host",
                    );
                }
                Some(RequestRules {
                    methods: methods(allow_methods, errors),
                    paths: paths(allow_paths, errors),
                    deny_methods: methods(deny_methods, errors),
                    deny_paths: paths(deny_paths, errors),
                })
            }
            _ => {
                if let Some(span) = request_span {
                    errors.at(
                        span,
                        "methods, paths, deny_methods and deny_paths need intercept = true",
                    );
                }
                None
            }
        };

        let tunnel = tunnel.and_then(|t| {
            let Some(carry) = Carry::parse(t.get_ref()) else {
                errors.at(
                    t.span(),
                    format!(
                        "unknown tunnel {:?} (one of {})",
                        t.get_ref(),
                        Carry::NAMES.join(", ")
                    ),
                );
                return None;
            };
            if kind != "allow" || host.is_none() {
                errors.at(
                    t.span(),
                    "tunnel is only valid on allow rules with a host \
                     (a cidr rule's address is its identity: its tunnels are opaque)",
                );
            } else if intercept.is_some() && carry != Carry::Tls {
                errors.at(
                    t.span(),
                    "an intercepting rule carries TLS: tunnel must be \"tls\" or omitted",
                );
            }
            Some(carry)
        });

        let id = match id {
            Some(id) => {
                let text = id.get_ref().trim().to_string();
                if text.is_empty() || text.len() > 128 || text.chars().any(char::is_control) {
                    errors.at(id.span(), format!("invalid rule id {text:?}"));
                }
                if !ids.insert(text.clone()) {
                    errors.at(id.span(), format!("rule id {text:?} is used twice"));
                }
                text
            }
            None => {
                let text = format!("{org}/{kind}/{n}");
                ids.insert(text.clone());
                text
            }
        };

        let target = match (host, cidr_value) {
            (Some(_), Some(c)) => {
                errors.at(c.span(), "a rule has either host or cidr, not both");
                None
            }
            (None, None) => {
                errors.at(span.clone(), format!("rule {id:?} needs host or cidr"));
                None
            }
            (Some(h), None) => host_rule(&h, kind == "allow", errors),
            (None, Some(c)) => cidr(&c, errors).map(RuleTarget::Cidr),
        };

        let ports = match ports {
            None if kind == "allow" => PortSet::List(DEFAULT_ALLOW_PORTS.to_vec()),
            None => PortSet::All,
            Some(list) => {
                if list.get_ref().is_empty() {
                    errors.at(
                        list.span(),
                        "ports must not be empty (omit it for the default)",
                    );
                }
                let mut ports = Vec::new();
                for p in list.get_ref() {
                    match u16::try_from(*p.get_ref()) {
                        Ok(port) if port > 0 => {
                            if !ports.contains(&port) {
                                ports.push(port)
                            }
                        }
                        _ => errors.at(
                            p.span(),
                            format!("port {} out of range 1-65535", p.get_ref()),
                        ),
                    }
                }
                ports.sort_unstable();
                PortSet::List(ports)
            }
        };

        if let Some(target) = target {
            rules.push(RuleConfig {
                id,
                target,
                ports,
                intercept,
                tunnel,
            });
        }
    }
    rules
}

fn host_rule(
    value: &Spanned<String>,
    is_allow: bool,
    errors: &mut Errors<'_>,
) -> Option<RuleTarget> {
    let text = value.get_ref().trim();
    let (wildcard, rest) = match text.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    if text == "*" {
        errors.at(
            value.span(),
            "host \"*\" would match every name; list the names instead",
        );
        return None;
    }
    if rest.contains('*') {
        errors.at(
            value.span(),
            format!("invalid host {text:?}: '*' is only allowed as the whole leftmost label (\"*.example.com\")"),
        );
        return None;
    }
    let name = match normalize_host(rest) {
        Ok(Host::Name(name)) => name,
        Ok(Host::Ip(ip)) => {
            errors.at(
                value.span(),
                format!("host {text:?} is an IP address; use cidr = \"{ip}\" for addresses"),
            );
            return None;
        }
        Err(e) => {
            errors.at(value.span(), format!("invalid host {text:?}: {e}"));
            return None;
        }
    };
    if wildcard {
        if is_allow && !name.contains('.') {
            errors.at(
                value.span(),
                format!("wildcard {text:?} would allow a whole top-level domain"),
            );
            return None;
        }
        Some(RuleTarget::Below(name))
    } else {
        Some(RuleTarget::Exact(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(src: &str) -> Result<Config, ConfigErrors> {
        from_str(src, Path::new("t.toml"))
    }

    fn first_error(src: &str) -> String {
        parse(src).unwrap_err().0[0].to_string()
    }

    const BASE: &str = r#"
[proxy]
listen = ["127.0.0.1:3128"]
[admin]
listen = "127.0.0.1:9711"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]
"#;

    #[test]
    fn minimal_config_loads_with_defaults() {
        let src = format!("{BASE}[[org.allow]]\nhost = \"api.example.com\"\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].allow[0].id, "acme/allow/0");
        assert_eq!(c.orgs[0].allow[0].ports, PortSet::List(vec![80, 443]));
        assert_eq!(c.proxy.limits.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(c.evidence.dir, PathBuf::from("evidence"));
    }

    #[test]
    fn unknown_key_is_located() {
        let src = format!("{BASE}bogus = 1\n");
        let e = first_error(&src);
        assert!(e.starts_with("t.toml:9:1: "), "{e}");
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn bad_values_are_named_and_located() {
        let cases = [
            ("host = \"*.com\"", "top-level domain"),
            ("host = \"*\"", "every name"),
            ("host = \"login.*.x.com\"", "leftmost label"),
            ("host = \"1.2.3.4\"", "use cidr"),
            ("cidr = \"198.18.7.0/33\"", "invalid cidr"),
            ("cidr = \"198.18.7.1/24\"", "host bits"),
            ("host = \"a.com\"\nports = [0]", "port 0 out of range"),
            (
                "host = \"a.com\"\nports = [65536]",
                "port 65536 out of range",
            ),
            ("host = \"a.com\"\ncidr = \"198.18.0.0/15\"", "not both"),
            ("ports = [1]", "needs host or cidr"),
        ];
        for (rule, want) in cases {
            let src = format!("{BASE}[[org.allow]]\n{rule}\n");
            let e = first_error(&src);
            assert!(e.contains(want), "{rule}: {e}");
            let line: usize = e.split(':').nth(1).unwrap().parse().unwrap();
            assert!((9..=11).contains(&line), "{rule}: {e}");
        }
    }

    #[test]
    fn tunnel_key_is_checked_and_located() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"a.com\"\nports = [22]\ntunnel = \"opaque\"\n\
             [[org.allow]]\nhost = \"b.com\"\n"
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].allow[0].tunnel, Some(Carry::Opaque));
        assert_eq!(c.orgs[0].allow[1].tunnel, None);
        let cases = [
            (
                "[[org.allow]]\nhost = \"a.com\"\ntunnel = \"ssh\"",
                "unknown tunnel \"ssh\"",
            ),
            (
                "[[org.allow]]\ncidr = \"198.18.0.0/15\"\ntunnel = \"tls\"",
                "a cidr rule's address is its identity",
            ),
            (
                "[[org.deny]]\nhost = \"a.com\"\ntunnel = \"tls\"",
                "only valid on allow rules",
            ),
            (
                "[[org.allow]]\nhost = \"a.com\"\nintercept = true\ntunnel = \"opaque\"",
                "intercepting rule carries TLS",
            ),
        ];
        for (rule, want) in cases {
            let src = format!("{BASE}{rule}\n");
            let e = first_error(&src);
            assert!(e.contains(want), "{rule}: {e}");
            let line: usize = e.split(':').nth(1).unwrap().parse().unwrap();
            assert!((10..=12).contains(&line), "{rule}: {e}");
        }
    }

    #[test]
    fn policy_answers_what_a_rule_carries() {
        let src = format!(
            "{BASE}[[org.allow]]\nid = \"ssh\"\nhost = \"a.com\"\nports = [22]\ntunnel = \"opaque\"\n\
             [[org.allow]]\nid = \"web\"\nhost = \"b.com\"\nports = [80, 443, 8080]\n\
             [[org.allow]]\nid = \"forced\"\nhost = \"c.com\"\nports = [443, 8443]\ntunnel = \"http\"\n\
             [[org.allow]]\nid = \"net\"\ncidr = \"198.18.0.0/15\"\n"
        );
        let policy = crate::policy::Policy::new(&parse(&src).unwrap());
        let org = policy.org_for("198.19.1.2".parse().unwrap()).unwrap();
        let carry = |rule: &str, name: bool, port| policy.carry(&org, Some(rule), name, port);
        assert_eq!(carry("ssh", true, 22), Carry::Opaque);
        assert_eq!(carry("web", true, 443), Carry::Tls);
        assert_eq!(carry("web", true, 80), Carry::Http);
        assert_eq!(carry("web", true, 8080), Carry::TlsOrHttp);
        assert_eq!(carry("forced", true, 443), Carry::Http);
        assert_eq!(carry("net", false, 443), Carry::Opaque);
        // Report mode without an allow rule: the port decides.
        assert_eq!(policy.carry(&org, None, true, 443), Carry::Tls);
    }

    #[test]
    fn tunnel_defaults_by_port() {
        assert_eq!(Carry::default_for_port(443), Carry::Tls);
        assert_eq!(Carry::default_for_port(80), Carry::Http);
        assert_eq!(Carry::default_for_port(8443), Carry::TlsOrHttp);
    }

    #[test]
    fn wildcard_tld_is_fine_in_deny() {
        let src = format!("{BASE}[[org.deny]]\nhost = \"*.com\"\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].deny[0].target, RuleTarget::Below("com".into()));
        assert_eq!(c.orgs[0].deny[0].ports, PortSet::All);
    }

    #[test]
    fn same_client_network_in_two_orgs_is_rejected() {
        let src = format!("{BASE}[[org]]\nname = \"other\"\nclients = [\"198.19.1.0/24\"]\n");
        let e = first_error(&src);
        assert!(e.contains("already belongs to org \"acme\""), "{e}");
        assert!(e.starts_with("t.toml:11:"), "{e}");
    }

    #[test]
    fn all_errors_are_collected() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"*\"\n[[org.allow]]\ncidr = \"x\"\n[[org.allow]]\nhost = \"a.com\"\nports = [70000]\n"
        );
        assert_eq!(parse(&src).unwrap_err().0.len(), 3);
    }

    #[test]
    fn durations_and_limits() {
        let src = BASE.replace(
            "[proxy]\n",
            "[proxy]\nconnect_timeout = \"250ms\"\nmax_connections = 7\n",
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.proxy.limits.connect_timeout, Duration::from_millis(250));
        assert_eq!(c.proxy.limits.max_connections, 7);
        let bad = BASE.replace("[proxy]\n", "[proxy]\nidle_timeout = \"soon\"\n");
        assert!(first_error(&bad).contains("invalid duration \"soon\""));
        let zero = BASE.replace("[proxy]\n", "[proxy]\nmax_headers = 0\n");
        assert!(first_error(&zero).contains("positive"));
    }

    #[test]
    fn parse_errors_name_the_offending_text() {
        let e = first_error(&format!("{BASE}[proxy]\n"));
        assert!(e.contains("`proxy`") || e.contains("proxy"), "{e}");
        let src = BASE.replace("[proxy]\n", "[proxy]\ntransparent = []\ntransparent = []\n");
        let e = first_error(&src);
        assert!(
            e.contains("duplicate key") && e.contains("transparent"),
            "{e}"
        );
    }

    #[test]
    fn dns_keys_parse_and_validate() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.dns.query_timeout, DEFAULT_DNS_QUERY_TIMEOUT);
        assert_eq!(
            c.dns.max_bindings_per_name,
            DEFAULT_DNS_MAX_BINDINGS_PER_NAME
        );
        assert_eq!(c.orgs[0].dns_denied, DnsDenied::Refused);
        assert!(c.orgs[0].dns_types.is_empty());

        let src = format!(
            "[dns]\nidle_timeout = \"2s\"\nquery_timeout = \"1s\"\nmax_tcp_connections = 3\n\
             max_queries_in_flight = 9\nmin_ttl = \"1s\"\nmax_ttl = \"60s\"\nbinding_grace = \"5s\"\n\
             max_bindings_per_name = 4\nmax_bindings = 10\n{BASE}dns_denied = \"nxdomain\"\n\
             dns_types = [\"txt\", \"MX\", \"TXT\"]\n"
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.dns.idle_timeout, Duration::from_secs(2));
        assert_eq!(c.dns.query_timeout, Duration::from_secs(1));
        assert_eq!(c.dns.max_tcp_connections, 3);
        assert_eq!(c.dns.max_queries_in_flight, 9);
        assert_eq!(c.dns.min_ttl, Duration::from_secs(1));
        assert_eq!(c.dns.max_ttl, Duration::from_secs(60));
        assert_eq!(c.dns.binding_grace, Duration::from_secs(5));
        assert_eq!(c.dns.max_bindings_per_name, 4);
        assert_eq!(c.dns.max_bindings, 10);
        assert_eq!(c.orgs[0].dns_denied, DnsDenied::Nxdomain);
        assert_eq!(
            c.orgs[0].dns_types,
            vec!["TXT".to_string(), "MX".to_string()]
        );
    }

    #[test]
    fn bad_dns_keys_are_located() {
        let e = first_error(&format!("{BASE}dns_denied = \"drop\"\n"));
        assert!(
            e.starts_with("t.toml:9:") && e.contains("invalid dns_denied \"drop\""),
            "{e}"
        );
        let e = first_error(&format!("{BASE}dns_types = [\"AXFR\"]\n"));
        assert!(e.contains("never answered"), "{e}");
        let e = first_error(&format!("{BASE}dns_types = [\"BOGUS\"]\n"));
        assert!(e.contains("unknown dns type \"BOGUS\""), "{e}");
        let e = first_error(&format!("[dns]\nmin_ttl = \"2h\"\n{BASE}"));
        assert!(e.contains("below min_ttl"), "{e}");
        let e = first_error(&format!("[dns]\nmax_tcp_connections = 0\n{BASE}"));
        assert!(e.starts_with("t.toml:2:") && e.contains("positive"), "{e}");
    }

    #[test]
    fn default_dns_settings_keep_the_policy_hash() {
        let c = parse(BASE).unwrap();
        let json = serde_json::to_string(&c.orgs).unwrap();
        assert!(!json.contains("dns_"), "{json}");
    }

    #[test]
    fn evidence_settings() {
        let src = format!(
            "{BASE}[evidence]\ndir = \"/e\"\ndurability = \"fsync\"\ncheckpoint_every = 10\n\
             checkpoint_interval = \"250ms\"\nrotate_size = \"1MiB\"\nretain_size = 4194304\nretain_age = \"7days\"\n"
        );
        let c = parse(&src).unwrap().evidence;
        assert_eq!(c.key, PathBuf::from("/e.key"));
        assert_eq!(c.durability, Durability::Fsync);
        assert_eq!(c.checkpoint_every, 10);
        assert_eq!(c.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(c.rotate_size, 1 << 20);
        assert_eq!(c.retain_size, Some(4 << 20));
        assert_eq!(c.retain_age, Some(Duration::from_secs(7 * 86400)));
        for (line, want) in [
            ("durability = \"sometimes\"", "durability \"sometimes\""),
            ("rotate_size = \"12 parsecs\"", "size \"12 parsecs\""),
            ("rotate_size = 0", "size 0"),
            ("retain_size = \"1kB\"", "at least rotate_size"),
            ("checkpoint_every = 0", "positive"),
            ("key = \"\"", "key must not be empty"),
        ] {
            let e = first_error(&format!("{BASE}[evidence]\n{line}\n"));
            assert!(e.contains(want), "{line}: {e}");
            assert!(e.starts_with("t.toml:10:"), "{line}: {e}");
        }
    }

    #[test]
    fn socks5_listeners_are_own_addresses_and_unique() {
        let src = BASE.replace("[proxy]\n", "[proxy]\nsocks5 = [\"127.0.0.1:1080\"]\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.proxy.socks5, vec!["127.0.0.1:1080".parse().unwrap()]);
        assert!(c
            .own_addresses()
            .contains(&"127.0.0.1:1080".parse().unwrap()));
        let dup = BASE.replace("[proxy]\n", "[proxy]\nsocks5 = [\"127.0.0.1:3128\"]\n");
        assert!(first_error(&dup).contains("used twice"));
    }

    #[test]
    fn token_identity_validates() {
        let digest = TokenDigest::of(b"secret-token").to_string();
        let ok = format!(
            "{BASE}[[org]]\nname = \"t\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n             [[org]]\nname = \"at\"\nidentity = \"address+token\"\nclients = [\"198.19.1.0/24\"]\n             tokens = [\"{}\"]\n",
            TokenDigest::of(b"other").to_string().to_uppercase().replace("SHA256:", "sha256:")
        );
        let c = parse(&ok).unwrap();
        assert_eq!(c.orgs[1].identity, Identity::Token);
        assert!(c.orgs[1].tokens[0].ct_eq(&TokenDigest::of(b"secret-token")));
        assert_eq!(c.orgs[2].identity, Identity::AddressToken);
        // The digests never reach the policy text.
        let json = serde_json::to_string(&c.orgs).unwrap();
        assert!(
            !json.contains(&digest[7..]) && json.contains("address+token"),
            "{json}"
        );

        let cases = [
            ("identity = \"token\"\ntokens = [\"secret-token\"]\n", "never plain"),
            ("identity = \"token\"\n", "no tokens"),
            ("identity = \"cert\"\n", "invalid identity \"cert\""),
            (&*format!("tokens = [\"{digest}\"]\n"), "identity is \"address\""),
            (
                &*format!("identity = \"token\"\nclients = [\"198.18.0.0/24\"]\ntokens = [\"{digest}\"]\n"),
                "takes no clients",
            ),
        ];
        for (lines, want) in cases {
            let src = format!("{BASE}[[org]]\nname = \"t\"\n{lines}");
            let e = first_error(&src);
            assert!(e.contains(want), "{lines}: {e}");
            assert!(!e.contains("secret-token"), "{e}");
            assert!(e.starts_with("t.toml:1"), "{lines}: {e}");
        }
        let twice = format!(
            "{BASE}[[org]]\nname = \"t\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n             [[org]]\nname = \"u\"\nidentity = \"token\"\ntokens = [\"{digest}\"]\n"
        );
        assert!(first_error(&twice).contains("already listed for org \"t\""));
    }

    #[test]
    fn new_tokens_are_fresh_and_match_their_digest() {
        let (a, da) = new_token().unwrap();
        let (b, _) = new_token().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(da.ct_eq(&TokenDigest::of(a.as_bytes())));
        assert_eq!(TokenDigest::parse(&da.to_string()), Some(da));
    }

    #[test]
    fn line_col_counts_chars() {
        assert_eq!(line_col("ab\ncdé\nx", 0), (1, 1));
        assert_eq!(line_col("ab\ncdé\nx", 3), (2, 1));
        assert_eq!(line_col("ab\ncdé\nx", 8), (3, 1));
        assert_eq!(line_col("ab\ncdé\nx", 7), (2, 4));
    }
}

#[cfg(test)]
mod intercept_tests {
    use super::*;

    const ORG: &str = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n";

    fn errors(extra: &str) -> Vec<String> {
        match from_str(&format!("{ORG}{extra}"), Path::new("t.toml")) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn intercept_rules_and_credentials_validate_with_locations() {
        let ok = "[[org.allow]]\nhost = \"*.reg.test\"\nintercept = true\nmethods = [\"GET\"]\n\
                  paths = [\"/simple/\", \"/p/*.whl\"]\ndeny_paths = [\"/upload\"]\n\
                  [[org.credential]]\nid = \"t\"\nhost = \"api.reg.test\"\nheader = \"Authorization\"\n\
                  prefix = \"Bearer \"\nsecret_env = \"TOKEN\"\n";
        assert!(errors(ok).is_empty(), "{:?}", errors(ok));
        let c = from_str(&format!("{ORG}{ok}"), Path::new("t.toml")).unwrap();
        assert_eq!(c.orgs[0].credentials[0].header, "authorization");
        assert!(c.orgs[0].intercepts());
        // The secret's source is in the policy hash text, never a secret.
        assert!(crate::policy::Policy::canonical_text(&c.orgs).contains("TOKEN"));

        let cases = [
            ("[[org.deny]]\nhost = \"x.test\"\nintercept = true\n", "t.toml:6:", "only valid on allow rules"),
            ("[[org.allow]]\ncidr = \"198.18.0.0/24\"\nintercept = true\n", "t.toml:6:", "only valid on allow rules"),
            ("[[org.allow]]\nhost = \"x.test\"\nmethods = [\"GET\"]\n", "t.toml:6:", "need intercept = true"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\nmethods = [\"get\"]\n", "t.toml:7:", "invalid method"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\npaths = [\"simple\"]\n", "t.toml:7:", "invalid path rule"),
            ("[[org.allow]]\nhost = \"x.test\"\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"authorization\"\nsecret_env = \"T\"\n", "t.toml:8:", "no allow rule"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"host\"\nsecret_env = \"T\"\n", "t.toml:10:", "not a header"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\n", "t.toml:", "needs secret_file or secret_env"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\nsecret_env = \"A\"\nsecret_file = \"/f\"\n", "t.toml:11:", "not both"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\nsecret = \"inline\"\n", "t.toml:", "unknown field"),
        ];
        for (src, at, want) in cases {
            let e = errors(src);
            assert!(
                e.iter().any(|e| e.starts_with(at) && e.contains(want)) || { false },
                "{src}: want {at} {want}, got {e:?}"
            );
        }
    }

    #[test]
    fn path_patterns() {
        let p = |s: &str| PathPattern(s.to_string());
        let n = |s: &str| crate::policy::request::NormalPath::parse(s).unwrap();
        assert!(p("/simple/").matches(&n("/simple/x/")));
        assert!(!p("/simple/").matches(&n("/simplex")));
        assert!(p("/p/*.whl").matches(&n("/p/a/b-1.0.whl")));
        assert!(!p("/p/*.whl").matches(&n("/p/a.whl.tar")));
        assert!(p("*").matches(&n("/anything")));
        assert!(p("/a*b*c").matches(&n("/a--b--c")));
        assert!(!p("/a*b*c").matches(&n("/a--c--b")));
        // Matched after decoding unreserved escapes.
        assert!(p("/api/internal*").matches(&n("/api/%69nternal")));
    }

    #[test]
    fn methods_are_tokens_and_path_rules_are_normal() {
        let rule = |k: &str, v: &str| {
            errors(&format!(
                "[[org.allow]]\nhost = \"x.test\"\nintercept = true\n{k} = [{v}]\n"
            ))
        };
        for ok in ["\"GET\"", "\"PROPFIND\"", "\"M-SEARCH\"", "\"TRACE\""] {
            assert!(
                rule("methods", ok).is_empty(),
                "{ok}: {:?}",
                rule("methods", ok)
            );
        }
        for (bad, want) in [
            ("\"get\"", "case-sensitive, write \"GET\""),
            ("\"Delete\"", "case-sensitive"),
            ("\"GE T\"", "RFC 9110 token"),
            ("\"\"", "RFC 9110 token"),
        ] {
            let e = rule("deny_methods", bad);
            assert!(e.iter().any(|e| e.contains(want)), "{bad}: {e:?}");
        }
        for bad in ["/a/../b", "/a//b", "/a;x", "/a\\b", "/./x"] {
            let e = rule("paths", &format!("{bad:?}"));
            assert!(
                e.iter()
                    .any(|e| e.contains("requests are matched normalised")),
                "{bad}: {e:?}"
            );
        }
        assert!(rule("deny_paths", "\"/api/internal*\", \"/x/...\"").is_empty());
    }
}
