//! The validated configuration: what the rest of Palisade reads. Only
//! validation builds these from a file; matching them against traffic is
//! the policy's business, not the config's.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::Serialize;

use super::timeout::{
    ConnectTimeout, DetectTimeout, DnsIdleTimeout, DnsQueryTimeout, DrainTimeout, HandshakeTimeout,
    HeaderReadTimeout, IdleTimeout, ResolveTimeout, ResponseTimeout, RevokeGrace,
    UpstreamIdleTimeout, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DETECT_TIMEOUT, DEFAULT_DNS_IDLE_TIMEOUT,
    DEFAULT_DNS_QUERY_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_RESOLVE_TIMEOUT,
    DEFAULT_RESPONSE_TIMEOUT, DEFAULT_REVOKE_GRACE, DEFAULT_UPSTREAM_IDLE_TIMEOUT,
};
use super::window::Window;

/// Default cap on concurrent client connections, all orgs together.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default cap on concurrent client connections of one org.
pub const DEFAULT_MAX_CONNECTIONS_PER_ORG: usize = 2_000;
/// Default rate of new connections per org (per second, with a burst of as many).
pub const DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_ORG: usize = 20_000;
/// Default cap on detection buffers, all connections together.
pub const DEFAULT_MAX_DETECT_MEMORY_BYTES: usize = 64 * 1024 * 1024;
/// Connections one source address holds before they are charged to an org
/// (clients of no org, token clients before their credentials).
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = 256;
/// New connections one source address of no org (at accept) may open per second.
pub const DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_CLIENT: usize = 200;
/// Denial records one source address of a proxy listener may have written
/// one by one per second (burst of as many); beyond, they are summarised.
pub const DEFAULT_MAX_DENIAL_RECORDS_PER_SECOND_PER_CLIENT: usize = 50;
/// Denial records of one org per second, over all its addresses.
pub const DEFAULT_MAX_DENIAL_RECORDS_PER_SECOND_PER_ORG: usize = 500;
/// The share of `max_detect_memory_bytes` one org may hold, unset: a quarter.
pub const DETECT_MEMORY_ORG_SHARE: usize = 4;
/// The share of `max_detect_memory_bytes` one source address of no org may
/// hold before its decision: a sixty-fourth.
pub const DETECT_MEMORY_CLIENT_SHARE: usize = 64;
/// Default cap on the size of an HTTP request head (request line and headers).
pub const DEFAULT_MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;
/// Default cap on the number of request headers.
pub const DEFAULT_MAX_HEADERS: usize = 100;
/// Default cap on idle upstream connections kept for reuse, all together.
pub const DEFAULT_MAX_IDLE_UPSTREAM_CONNECTIONS: usize = 256;
/// Default cap on idle upstream connections kept under one org, host, port
/// and address.
pub const DEFAULT_MAX_IDLE_UPSTREAM_CONNECTIONS_PER_TARGET: usize = 64;
/// Default cap on concurrent DNS-over-TCP connections, all listeners together.
pub const DEFAULT_DNS_MAX_TCP_CONNECTIONS: usize = 256;
/// Default cap on concurrent DNS-over-TCP connections from one client address.
pub const DEFAULT_DNS_MAX_TCP_CONNECTIONS_PER_CLIENT: usize = 16;
/// Default DNS queries per second per client address.
pub const DEFAULT_DNS_MAX_QUERIES_PER_SECOND_PER_CLIENT: usize = 2_000;
/// Default cap on DNS queries being answered at once (UDP and TCP).
pub const DEFAULT_DNS_MAX_QUERIES_IN_FLIGHT: usize = 1024;
/// Default lower bound on the TTL of answers handed out (and their bindings).
pub const DEFAULT_DNS_MIN_TTL: Duration = Duration::from_secs(5);
/// Default upper bound on the TTL of answers handed out (and their bindings).
pub const DEFAULT_DNS_MAX_TTL: Duration = Duration::from_secs(3600);
/// Default time a name-address binding outlives the TTL of its answer.
pub const DEFAULT_DNS_BINDING_GRACE: Duration = Duration::from_secs(60);
/// Default cap on addresses bound to one (org, name).
pub const DEFAULT_DNS_MAX_BINDINGS_PER_NAME: usize = 32;
/// Default cap on all name-address bindings together.
pub const DEFAULT_DNS_MAX_BINDINGS: usize = 100_000;

/// The least default evidence budget of an org (decision records per second).
pub const MIN_DEFAULT_MAX_RECORDS_PER_SECOND_PER_ORG: usize = 10_000;

/// The default of `[evidence] max_records_per_second_per_org`: never below
/// what the operator's own rates let one org cause, so that an explicit
/// rate is never cut short by a budget it did not set: two records per new
/// connection (its decision, and one more inside it: a request or a
/// denial on its first bytes), plus one per DNS query a client may send;
/// at least [`MIN_DEFAULT_MAX_RECORDS_PER_SECOND_PER_ORG`]. With the
/// defaults: 2 x 20000 + 2000 = 42000.
pub fn default_max_records_per_second_per_org(limits: &Limits, dns: &DnsConfig) -> usize {
    limits
        .max_new_connections_per_second_per_org
        .saturating_mul(2)
        .saturating_add(dns.max_queries_per_second_per_client)
        .max(MIN_DEFAULT_MAX_RECORDS_PER_SECOND_PER_ORG)
}

/// The default of a per-org DNS cap: a quarter of its global cap (rounded
/// up), so that no one org can take more than a quarter of the shim.
pub fn dns_org_share(global: usize) -> usize {
    global.div_ceil(4).max(1)
}
/// Synthetic mappings (`crate::handout::synthetic`) one org may hold, at most.
pub const MAX_SYNTHETIC_PER_ORG: usize = 4096;
/// Synthetic mappings of all synthetic orgs together, at most: config
/// validation refuses more synthetic orgs than this allows.
pub const MAX_SYNTHETIC_MAPPINGS: usize = 262_144;

/// Synthetic mappings one org may hold with these pools: what the smaller
/// pool holds, at most [`MAX_SYNTHETIC_PER_ORG`] (0: no pool).
pub fn synthetic_per_org(v4: Option<ipnet::Ipv4Net>, v6: Option<ipnet::Ipv6Net>) -> usize {
    let v4 = v4.map(|n| 32 - u32::from(n.prefix_len()));
    let v6 = v6.map(|n| 128 - u32::from(n.prefix_len()));
    [v4, v6].into_iter().flatten().min().map_or(0, |bits| {
        1usize
            .checked_shl(bits)
            .unwrap_or(usize::MAX)
            .min(MAX_SYNTHETIC_PER_ORG)
    })
}
/// Query types the DNS shim never answers, whatever an org enables.
pub const DNS_NEVER_TYPES: [&str; 5] = ["ANY", "AXFR", "IXFR", "OPT", "TSIG"];
/// Ports an allow rule covers when it names none.
pub const DEFAULT_ALLOW_PORTS: [u16; 2] = [80, 443];

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub path: PathBuf,
    pub proxy: ProxyConfig,
    pub dns: DnsConfig,
    pub admin: AdminConfig,
    pub evidence: EvidenceConfig,
    pub intercept: InterceptConfig,
    pub bypass: BypassConfig,
    /// `[policy]`: the operator's baseline under the orgs' rules.
    pub policy: PolicyConfig,
    /// `[enforcement]`: the nftables ruleset the gateway must have loaded.
    pub enforcement: Option<EnforcementConfig>,
    /// `[otel]`: the OTLP export (`crate::otel`); `None` without the table.
    pub otel: Option<OtelConfig>,
    /// `[decider]`: consulted on a miss (`crate::decider`); `None` without
    /// the table.
    pub decider: Option<DeciderConfig>,
    pub orgs: Vec<OrgConfig>,
}

/// `[decider]`: an HTTP endpoint asked about a miss (see
/// `docs/decisions.md`, "The decider").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeciderConfig {
    /// `http://HOST[:PORT][/PATH]`: where each question is POSTed.
    pub url: String,
    /// How long one consultation may take, connecting included.
    pub timeout: Duration,
    /// Consultations at once; a miss past them is denied without asking.
    pub max_in_flight: usize,
}

/// `[decider] timeout` when unset.
pub const DEFAULT_DECIDER_TIMEOUT: Duration = Duration::from_millis(500);
/// The longest `[decider] timeout` accepted.
pub const MAX_DECIDER_TIMEOUT: Duration = Duration::from_secs(10);
/// `[decider] max_in_flight` when unset.
pub const DEFAULT_DECIDER_IN_FLIGHT: usize = 64;
/// The largest `[decider] max_in_flight` accepted.
pub const MAX_DECIDER_IN_FLIGHT: usize = 4096;

/// The `service.name` of the OTLP export when `[otel]` names none.
pub const DEFAULT_OTEL_SERVICE_NAME: &str = "palisade";

/// `[otel]`: OTLP over HTTP (protobuf). What the file leaves out, the
/// standard `OTEL_EXPORTER_OTLP_*` environment variables give (read at
/// start-up, `crate::otel`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelConfig {
    /// The collector's base URL (`http://HOST:PORT[/PATH]`); the signal
    /// paths `/v1/logs` and `/v1/traces` are appended. Set here, it wins
    /// over the environment.
    pub endpoint: Option<String>,
    pub service_name: String,
    /// Headers sent with every export (name, value), validated.
    pub headers: Vec<(String, String)>,
}

/// `[policy]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyConfig {
    /// `baseline = "FILE"`, read and validated with the config.
    pub baseline: Option<Baseline>,
}

/// The baseline file: denials decided for every org before any org rule,
/// and the ceiling no org allow rule may reach beyond.
#[derive(Debug, Clone, PartialEq)]
pub struct Baseline {
    /// Where it was read from (relative paths anchored at the config's directory).
    pub path: PathBuf,
    /// SHA-256 (hex) of the file's bytes: what records carry as `baseline`.
    pub hash: String,
    /// `[[deny]]`: ids `baseline:ID` or `baseline:deny/N`; ports default to all.
    pub deny: Vec<RuleConfig>,
    /// `[[ceiling]]`; empty: no ceiling (orgs may allow anything the deny list leaves).
    pub ceiling: Vec<CeilingEntry>,
}

/// One `[[ceiling]]` entry: the most an org allow rule may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CeilingEntry {
    /// `baseline:ID`, or `baseline:ceiling/N` (N counts from 0 in file order).
    pub id: String,
    pub target: RuleTarget,
    /// Ports; default all.
    pub ports: PortSet,
    /// `intercept = true`: intercepting rules may lie inside it (default false).
    pub intercept: bool,
}

/// Default number of minted leaf certificates kept (per process, all orgs).
pub const DEFAULT_CERT_CACHE: usize = 1000;
/// Default directory of the per-org interception CAs.
pub const DEFAULT_CA_DIR: &str = "ca";
/// Default upstream trust bundle for intercepted connections.
pub const DEFAULT_UPSTREAM_CA: &str = "/etc/ssl/certs/ca-certificates.crt";

/// `[intercept]`: where the per-org CAs live and what upstream certificates are trusted.
#[derive(Debug, Clone, PartialEq)]
pub struct InterceptConfig {
    /// `DIR/ORG.pem` and `DIR/ORG.key` (0600) per org that intercepts.
    pub ca_dir: PathBuf,
    /// PEM bundle upstream certificates are verified against.
    pub upstream_ca: PathBuf,
    /// Minted leaf certificates kept; the oldest is evicted.
    pub cert_cache: usize,
    pub handshake_timeout: HandshakeTimeout,
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
    /// `websocket = true`: WebSocket handshakes (an HTTP/1.1 upgrade, an
    /// HTTP/2 extended CONNECT) are decided like any request and, allowed,
    /// relayed; off, refused `upgrade_not_allowed`. (Left out of the
    /// serialised form when off, so a policy without it hashes as before.)
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub websocket: bool,
    /// `service` and the keys that go with it (`repos`, `push_refs`,
    /// `graphql_mutations`, `models`): the request's meaning to that
    /// protocol decides too (`policy::service`). (Left out of the
    /// serialised form when absent, so a policy without it hashes as
    /// before.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRules>,
}

/// A protocol an intercepting rule's requests are read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Service {
    /// Git smart HTTP (and a forge's `/repos/` REST paths).
    Git,
    /// A package registry: downloads only.
    Registry,
    /// GraphQL over HTTP.
    Graphql,
    /// A model API (chat, messages, embeddings).
    LlmApi,
}

impl Service {
    pub const NAMES: [&'static str; 4] = ["git", "registry", "graphql", "llm-api"];

    pub fn as_str(self) -> &'static str {
        match self {
            Service::Git => "git",
            Service::Registry => "registry",
            Service::Graphql => "graphql",
            Service::LlmApi => "llm-api",
        }
    }

    pub(super) fn parse(text: &str) -> Option<Service> {
        match text {
            "git" => Some(Service::Git),
            "registry" => Some(Service::Registry),
            "graphql" => Some(Service::Graphql),
            "llm-api" => Some(Service::LlmApi),
            _ => None,
        }
    }
}

/// The service rules of an intercepting allow rule: a `service`, or
/// `repos` alone (forge REST and git paths scoped to repositories).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ServiceRules {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<Service>,
    /// `owner/name` patterns (`*` within a segment).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub repos: Vec<String>,
    /// Ref patterns a push may update (`*` any run); empty: fetch only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub push_refs: Vec<String>,
    /// Mutation fields allowed; `None`: queries only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graphql_mutations: Option<Vec<String>>,
    /// Model patterns (`*` any run).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

/// A path rule: a prefix (no `*`), or a glob over the whole path in which
/// `*` matches any run of characters (including `/`). Validated to be in
/// the normal form of `proto::http_request`; the policy
/// (`policy::request`) matches it against normalised paths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PathPattern(pub String);

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

impl OrgConfig {
    /// Does any allow rule of this org intercept?
    pub fn intercepts(&self) -> bool {
        self.allow.iter().any(|r| r.intercept.is_some())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    pub listen: Vec<SocketAddr>,
    pub transparent: Vec<SocketAddr>,
    /// SOCKS5 listeners (RFC 1928, CONNECT only).
    pub socks5: Vec<SocketAddr>,
    pub limits: Limits,
}

/// Bounds on what one client or all clients together may consume.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_connections_per_org: usize,
    /// New connections one org may open per second (token bucket, burst of one second's worth).
    pub max_new_connections_per_second_per_org: usize,
    /// Memory all connections together may hold in detection buffers
    /// (first bytes read and held before the decision).
    pub max_detect_memory_bytes: usize,
    /// Detection memory one org may hold (a quarter of the global unless set).
    pub max_detect_memory_bytes_per_org: usize,
    /// Connections one source address (an IPv6 /64) holds while charged to
    /// no org: before its credentials, or for good when it has none.
    pub max_connections_per_client: usize,
    /// New connections per second of one source address that maps to no
    /// org at accept (token bucket, burst of one second's worth).
    pub max_new_connections_per_second_per_client: usize,
    /// Denials of one source address (IPv6: /64) written one record each
    /// per second (token bucket, burst of as many); beyond, they are
    /// counted into summary records.
    pub max_denial_records_per_second_per_client: usize,
    /// Denials of one org (or of clients of no org, together) written one
    /// record each per second over all its addresses; beyond, summarised.
    pub max_denial_records_per_second_per_org: usize,
    pub max_request_head_bytes: usize,
    pub max_headers: usize,
    pub header_read_timeout: HeaderReadTimeout,
    pub connect_timeout: ConnectTimeout,
    /// A tunnel silent both ways this long is closed.
    pub idle_timeout: IdleTimeout,
    /// The wait for an upstream's response head to a forwarded request.
    pub response_timeout: ResponseTimeout,
    pub detect_timeout: DetectTimeout,
    pub drain_timeout: DrainTimeout,
    /// A live connection a reload's new policy denies is closed within this.
    pub revoke_grace: RevokeGrace,
    /// An idle upstream connection of forwarded HTTP is closed after this.
    pub upstream_idle_timeout: UpstreamIdleTimeout,
    /// Idle upstream connections kept for reuse, all together; 0: none.
    pub max_idle_upstream_connections: usize,
    /// Idle upstream connections kept under one (org, host, port, address).
    pub max_idle_upstream_connections_per_target: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_org: DEFAULT_MAX_CONNECTIONS_PER_ORG,
            max_new_connections_per_second_per_org: DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_ORG,
            max_detect_memory_bytes: DEFAULT_MAX_DETECT_MEMORY_BYTES,
            max_detect_memory_bytes_per_org: DEFAULT_MAX_DETECT_MEMORY_BYTES
                / DETECT_MEMORY_ORG_SHARE,
            max_connections_per_client: DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            max_new_connections_per_second_per_client:
                DEFAULT_MAX_NEW_CONNECTIONS_PER_SECOND_PER_CLIENT,
            max_denial_records_per_second_per_client:
                DEFAULT_MAX_DENIAL_RECORDS_PER_SECOND_PER_CLIENT,
            max_denial_records_per_second_per_org: DEFAULT_MAX_DENIAL_RECORDS_PER_SECOND_PER_ORG,
            max_request_head_bytes: DEFAULT_MAX_REQUEST_HEAD_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            detect_timeout: DEFAULT_DETECT_TIMEOUT,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            revoke_grace: DEFAULT_REVOKE_GRACE,
            upstream_idle_timeout: DEFAULT_UPSTREAM_IDLE_TIMEOUT,
            max_idle_upstream_connections: DEFAULT_MAX_IDLE_UPSTREAM_CONNECTIONS,
            max_idle_upstream_connections_per_target:
                DEFAULT_MAX_IDLE_UPSTREAM_CONNECTIONS_PER_TARGET,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DnsConfig {
    pub listen: Vec<SocketAddr>,
    pub upstream: Vec<SocketAddr>,
    pub resolve_timeout: ResolveTimeout,
    /// A DNS-over-TCP connection silent this long is closed.
    pub idle_timeout: DnsIdleTimeout,
    /// One query, end to end; past it the client gets SERVFAIL.
    pub query_timeout: DnsQueryTimeout,
    pub max_tcp_connections: usize,
    /// DNS-over-TCP connections one client address may hold.
    pub max_tcp_connections_per_client: usize,
    /// DNS-over-TCP connections the clients of one org may hold together.
    pub max_tcp_connections_per_org: usize,
    pub max_queries_in_flight: usize,
    /// Queries of one org being answered at once; a client in no org has
    /// a budget of this size for its own address.
    pub max_queries_in_flight_per_org: usize,
    /// Queries one client address may send per second (token bucket).
    pub max_queries_per_second_per_client: usize,
    /// Answer TTLs are clamped to `min_ttl..=max_ttl` (whole seconds).
    pub min_ttl: Duration,
    pub max_ttl: Duration,
    /// A binding stays valid for the (clamped) TTL plus this.
    pub binding_grace: Duration,
    pub max_bindings_per_name: usize,
    /// Bindings one org may hold; over it, its own oldest goes.
    pub max_bindings_per_org: usize,
    /// All bindings; when full, the org holding the most loses its oldest.
    pub max_bindings: usize,
    /// Synthetic answers (orgs with `dns_answers = "synthetic"`): the IPv4
    /// and IPv6 pools their addresses come from (`crate::handout::synthetic`).
    pub synthetic_pool: Option<ipnet::Ipv4Net>,
    pub synthetic_pool_v6: Option<ipnet::Ipv6Net>,
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
            max_tcp_connections_per_client: DEFAULT_DNS_MAX_TCP_CONNECTIONS_PER_CLIENT,
            max_tcp_connections_per_org: dns_org_share(DEFAULT_DNS_MAX_TCP_CONNECTIONS),
            max_queries_in_flight: DEFAULT_DNS_MAX_QUERIES_IN_FLIGHT,
            max_queries_in_flight_per_org: dns_org_share(DEFAULT_DNS_MAX_QUERIES_IN_FLIGHT),
            max_queries_per_second_per_client: DEFAULT_DNS_MAX_QUERIES_PER_SECOND_PER_CLIENT,
            min_ttl: DEFAULT_DNS_MIN_TTL,
            max_ttl: DEFAULT_DNS_MAX_TTL,
            binding_grace: DEFAULT_DNS_BINDING_GRACE,
            max_bindings_per_name: DEFAULT_DNS_MAX_BINDINGS_PER_NAME,
            max_bindings_per_org: dns_org_share(DEFAULT_DNS_MAX_BINDINGS),
            max_bindings: DEFAULT_DNS_MAX_BINDINGS,
            synthetic_pool: None,
            synthetic_pool_v6: None,
        }
    }
}

/// `[bypass]`: the NFLOG group the gateway ruleset logs the packets it
/// rejects to, which Palisade reads and records as `kind = "bypass"`
/// (unset: nothing is read). Restart-only.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BypassConfig {
    pub nflog_group: Option<u16>,
}

/// Default time between two checks of the loaded ruleset.
pub const DEFAULT_ENFORCEMENT_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// The shortest `check_interval`: each check runs `nft` once.
pub const MIN_ENFORCEMENT_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// The longest `check_interval`.
pub const MAX_ENFORCEMENT_CHECK_INTERVAL: Duration = Duration::from_secs(600);

/// `[enforcement]`: the nftables ruleset whose tables the kernel must
/// have loaded as the file defines them (`crate::enforcement`).
#[derive(Debug, Clone, PartialEq)]
pub struct EnforcementConfig {
    /// The ruleset file, as written (relative to the working directory).
    pub ruleset: PathBuf,
    pub mode: EnforcementMode,
    pub check_interval: Duration,
    /// Where `ruleset` is set in the config, to locate a problem of the
    /// file that the file itself cannot (it is missing, unreadable).
    pub at: ConfigLocation,
}

/// A place in the config file: `FILE:LINE:COL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigLocation {
    pub path: String,
    pub line: usize,
    pub col: usize,
}

/// What a ruleset that is not loaded as written does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnforcementMode {
    /// New connections of the orgs behind it are refused
    /// (`enforcement_missing`), and start-up fails without it.
    Required,
    /// Recorded and reported (`/readyz`, the metric), nothing refused.
    Advisory,
}

impl EnforcementMode {
    pub const NAMES: [&'static str; 2] = ["required", "advisory"];

    pub fn as_str(self) -> &'static str {
        match self {
            EnforcementMode::Required => "required",
            EnforcementMode::Advisory => "advisory",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct AdminConfig {
    pub listen: Option<SocketAddr>,
    /// SHA-256 digests of the bearer tokens `GET /v1/decisions` accepts
    /// (none: the tail is refused to everyone).
    pub tail_tokens: Vec<TokenDigest>,
    /// `approver_tokens`: who may answer approvals and grant, for which
    /// orgs (none: the approval endpoints refuse everyone).
    pub approver_tokens: Vec<ApproverToken>,
}

/// One approver's bearer token: its name (recorded as the approver), its
/// digest and the orgs it answers for.
#[derive(Debug, Clone, PartialEq)]
pub struct ApproverToken {
    pub name: String,
    pub digest: TokenDigest,
    /// `None`: every org (`orgs = ["*"]`).
    pub orgs: Option<Vec<String>>,
}

impl ApproverToken {
    /// Whether this token answers for `org`.
    pub fn covers(&self, org: &str) -> bool {
        self.orgs
            .as_ref()
            .is_none_or(|orgs| orgs.iter().any(|o| o == org))
    }
}

/// Default evidence directory.
pub const DEFAULT_EVIDENCE_DIR: &str = "evidence";
/// Default records between signed checkpoints.
pub const DEFAULT_CHECKPOINT_EVERY: u64 = 1000;
/// Default longest time between signed checkpoints while records arrive.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);
/// Default segment size that starts a new segment.
pub const DEFAULT_ROTATE_SIZE: u64 = 64 * 1024 * 1024;
/// Default segment age that starts a new segment.
pub const DEFAULT_ROTATE_AGE: Duration = Duration::from_secs(3600);
/// Default `[evidence] retain_min_age`: no closed segment younger than this
/// is removed by size-based retention. An hour: three times what the
/// shipped shipper needs at most (a pass every 5 minutes over segments
/// untouched for 15).
pub const DEFAULT_RETAIN_MIN_AGE: Duration = Duration::from_secs(3600);
/// The least `retain_min_age`: the time any shipper is given to copy a
/// closed segment (one polling every minute with no `--min-age`).
pub const MIN_RETAIN_MIN_AGE: Duration = Duration::from_secs(60);
/// Default `[evidence] min_free`: 1% of the evidence file system, at most
/// [`DEFAULT_MIN_FREE_MAX`]: room for the orgs within their share to go on
/// being recorded for a while after the store counts as full.
pub const DEFAULT_MIN_FREE: MinFree = MinFree::Default;
/// The most the default `min_free` asks for on a large file system.
pub const DEFAULT_MIN_FREE_MAX: u64 = 256 << 20;
/// Bytes one decision record costs at most in the capacity check: an
/// allow (about 535 bytes) and its close (about 605), see
/// docs/evidence.md#sizing.
pub const WORST_BYTES_PER_RECORD: u64 = 1140;
/// Bytes of one signed checkpoint (with its Merkle `tree_size`, `root`
/// and signed `note`, about 896).
pub const CHECKPOINT_BYTES: u64 = 900;

/// `[evidence] min_free`: below this much free space on the evidence file
/// system the store counts as full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MinFree {
    Bytes(u64),
    /// Percent of the file system's size, above 0 and below 100.
    Percent(f64),
    /// Unset: 1% of the file system, at most [`DEFAULT_MIN_FREE_MAX`].
    Default,
}

impl MinFree {
    /// The bytes this leaves free on a file system of `size` bytes.
    pub fn bytes(self, size: u64) -> u64 {
        match self {
            MinFree::Bytes(b) => b,
            MinFree::Percent(p) => (size as f64 * p / 100.0) as u64,
            MinFree::Default => (size / 100).min(DEFAULT_MIN_FREE_MAX),
        }
    }
}

/// How fast the evidence store can fill in the worst case, and whether
/// size-based retention can then reach a segment younger than
/// `retain_min_age` (see [`capacity`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// Who has an evidence budget: every org, and the clients of no org.
    pub payers: u64,
    /// Decision records per second, all payers together.
    pub records_per_second: u64,
    /// Bytes per second at worst (records, checkpoints).
    pub bytes_per_second: f64,
    /// Bytes written in `retain_min_age` at worst (with each budget's
    /// burst of one second), plus one open segment of `rotate_size`.
    pub needed: u64,
    /// `retain_size`.
    pub retain_size: u64,
    /// The largest `max_records_per_second_per_org` that fits.
    pub max_budget: u64,
    /// The longest `retain_min_age` that fits, if any does.
    pub max_min_age: Option<Duration>,
}

impl Capacity {
    pub fn fits(&self) -> bool {
        self.needed <= self.retain_size
    }
}

/// The worst-case fill of the store of `e` with `orgs` orgs, when
/// size-based retention is on: each of `orgs + 1` payers (the clients of no
/// org share one budget) writes its whole budget of allows with their
/// closes ([`WORST_BYTES_PER_RECORD`]) for `retain_min_age` plus one
/// second of burst, with a checkpoint every `checkpoint_every` records or
/// `checkpoint_interval`; the newest segment can hold `rotate_size` more.
pub fn capacity(e: &EvidenceConfig, orgs: usize) -> Option<Capacity> {
    let retain_size = e.retain_size?;
    let payers = orgs as u64 + 1;
    let budget = e.max_records_per_second_per_org as f64;
    let per_record =
        WORST_BYTES_PER_RECORD as f64 + CHECKPOINT_BYTES as f64 / e.checkpoint_every.max(1) as f64;
    let ckpt_per_second = CHECKPOINT_BYTES as f64 / e.checkpoint_interval.as_secs_f64().max(1e-3);
    let t = e.retain_min_age.as_secs_f64();
    let fill = |budget: f64, t: f64| {
        payers as f64 * budget * (t + 1.0) * per_record + ckpt_per_second * t + e.rotate_size as f64
    };
    let needed = fill(budget, t).ceil().min(u64::MAX as f64) as u64;
    let room = retain_size as f64 - e.rotate_size as f64 - ckpt_per_second * t;
    let max_budget = if room > 0.0 {
        (room / (payers as f64 * (t + 1.0) * per_record)).floor() as u64
    } else {
        0
    };
    let rate = payers as f64 * budget * per_record;
    let spare = retain_size as f64 - e.rotate_size as f64 - rate;
    let max_min_age = (spare > 0.0)
        .then(|| Duration::from_secs((spare / (rate + ckpt_per_second)).floor() as u64))
        .filter(|d| *d >= MIN_RETAIN_MIN_AGE);
    Some(Capacity {
        payers,
        records_per_second: payers.saturating_mul(e.max_records_per_second_per_org as u64),
        bytes_per_second: rate + ckpt_per_second,
        needed,
        retain_size,
        max_budget,
        max_min_age,
    })
}

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

#[derive(Debug, Clone, PartialEq)]
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
    /// No closed segment last written more recently than this is removed
    /// by `retain_size` (at least [`MIN_RETAIN_MIN_AGE`], at most
    /// `retain_age`).
    pub retain_min_age: Duration,
    /// Below this much free space the store counts as full.
    pub min_free: MinFree,
    /// Decision records one org may cause per second, proxy and DNS
    /// together (token bucket, burst of one second's worth); clients of no
    /// org share one such budget. Over it an allow is refused
    /// `limit_exceeded` and a denial summarised.
    pub max_records_per_second_per_org: usize,
    /// Who writes this evidence, in every segment header and record id
    /// (default: the host name).
    pub replica: String,
    /// Witnesses each new checkpoint is submitted to (c2sp.org/tlog-witness).
    pub witnesses: Vec<WitnessConfig>,
}

/// One `[evidence] witnesses` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WitnessConfig {
    /// The submission prefix: `http://HOST[:PORT][/PATH]`;
    /// `add-checkpoint` is posted to `PREFIX/add-checkpoint`.
    pub url: http::Uri,
    /// Its verifier key (c2sp.org/signed-note form, type 0x04, Ed25519
    /// `cosignature/v1`): `NAME+KEY_ID+BASE64(0x04 || KEY)`.
    pub key: String,
}

impl EvidenceConfig {
    /// Defaults for an evidence dir.
    pub fn for_dir(dir: &Path) -> EvidenceConfig {
        EvidenceConfig {
            dir: dir.to_path_buf(),
            key: default_key_path(dir),
            durability: Durability::Os,
            checkpoint_every: DEFAULT_CHECKPOINT_EVERY,
            checkpoint_interval: DEFAULT_CHECKPOINT_INTERVAL,
            rotate_size: DEFAULT_ROTATE_SIZE,
            rotate_age: DEFAULT_ROTATE_AGE,
            retain_size: None,
            retain_age: None,
            retain_min_age: DEFAULT_RETAIN_MIN_AGE,
            min_free: DEFAULT_MIN_FREE,
            max_records_per_second_per_org: default_max_records_per_second_per_org(
                &Limits::default(),
                &DnsConfig::default(),
            ),
            replica: default_replica(),
            witnesses: Vec::new(),
        }
    }
}

/// Longest `[evidence] replica`.
pub const REPLICA_MAX_LEN: usize = 63;

/// What is wrong with a replica name, if anything: 1 to 63 of
/// `A-Z a-z 0-9 . _ -`.
pub fn replica_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("must not be empty")
    } else if name.len() > REPLICA_MAX_LEN {
        Some("must be at most 63 characters")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("may hold only A-Z a-z 0-9 . _ -")
    } else {
        None
    }
}

/// The default replica name: the host name
/// (`/proc/sys/kernel/hostname`), with characters a replica name may not
/// hold replaced by `-` and cut to 63; `palisade` when there is none.
pub fn default_replica() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(REPLICA_MAX_LEN)
        .collect();
    if name.is_empty() {
        "palisade".into()
    } else {
        name
    }
}

/// The default key path for an evidence dir: `DIR.key` beside the directory,
/// so that handing the evidence directory to an assessor never hands over
/// the key.
pub fn default_key_path(dir: &Path) -> PathBuf {
    match dir.file_name() {
        Some(name) => {
            let mut n = name.to_os_string();
            n.push(".key");
            dir.with_file_name(n)
        }
        None => dir.join("palisade-evidence.key"),
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
    /// How the DNS shim answers a name this org may reach: resolved
    /// upstream (default), or a synthetic address of `[dns]
    /// synthetic_pool`, resolving nothing. Left out of the policy hash
    /// while it has its default value.
    #[serde(skip_serializing_if = "DnsAnswers::is_default")]
    pub dns_answers: DnsAnswers,
    /// `report`: decide and record what enforcement would do, but let the
    /// allowlist's denials through. Left out of the policy hash while it is
    /// `enforce`.
    #[serde(skip_serializing_if = "OrgMode::is_default")]
    pub mode: OrgMode,
    /// What a miss (`no_matching_rule`) becomes: a denial (default), or a
    /// pending approval an approver answers (`crate::jit`). Left out of
    /// the policy hash while it has its default value.
    #[serde(skip_serializing_if = "OnMiss::is_default")]
    pub on_miss: OnMiss,
    /// How a client proves it belongs to this org. Left out of the policy
    /// hash while it has its default value.
    #[serde(skip_serializing_if = "Identity::is_default")]
    pub identity: Identity,
    /// SHA-256 digests of the org's tokens. Serialised only as one digest
    /// over the set ([`tokens_fingerprint`]): replacing a token changes the
    /// policy hash (a reload that rotates one is a change), while the text
    /// stored beside the evidence holds no token and none of their digests.
    #[serde(
        rename = "tokens_fingerprint",
        serialize_with = "serialize_tokens_fingerprint",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tokens: Vec<TokenDigest>,
    /// Headers added to intercepted requests (ids and sources only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<CredentialConfig>,
    /// `max_bytes_up`, `max_bytes_down` over `volume_window` on `[[org]]`:
    /// the org's total over all its rules.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume: Option<Volume>,
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

/// How a grant (`crate::jit`) stands as the rule of a verdict it
/// allowed: `grant:` then its id. Config rule ids may not start so.
pub const GRANT_RULE_PREFIX: &str = "grant:";

/// `on_miss`: what an org's miss becomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMiss {
    /// Denied `no_matching_rule`.
    #[default]
    Deny,
    /// Refused `approval_pending`, held as an approval an approver answers.
    Ask,
}

impl OnMiss {
    pub fn is_default(&self) -> bool {
        *self == OnMiss::Deny
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
/// (`sha256:<64 hex digits>`). The policy matches a presented token's
/// digest against these only in constant time (`policy::token`).
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

/// One digest over a set of token digests (order and repeats do not
/// matter), as the policy text carries it: `sha256:<64 hex digits>`.
pub fn tokens_fingerprint(tokens: &[TokenDigest]) -> String {
    use sha2::Digest;
    let mut sorted: Vec<&[u8; 32]> = tokens.iter().map(|t| &t.0).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut h = sha2::Sha256::new();
    h.update(b"palisade org tokens\0");
    for d in sorted {
        h.update(d);
    }
    format!(
        "{TOKEN_DIGEST_PREFIX}{}",
        data_encoding::HEXLOWER.encode(&h.finalize())
    )
}

fn serialize_tokens_fingerprint<S: serde::Serializer>(
    tokens: &[TokenDigest],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&tokens_fingerprint(tokens))
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

/// The DNS answer to an allowed name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsAnswers {
    /// Resolved upstream, the answers filtered.
    #[default]
    Resolved,
    /// An address of the synthetic pool bound to (org, name); the name is
    /// resolved only when a connection to that address is allowed.
    Synthetic,
}

impl DnsAnswers {
    fn is_default(&self) -> bool {
        *self == DnsAnswers::Resolved
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// What names a wildcard allow rule lets leave (`max_new_names_per_minute`,
    /// `max_label_length`); the default on every other rule, where it is
    /// unused. Left out of the policy hash while it has its default value.
    #[serde(skip_serializing_if = "NameLimits::is_default")]
    pub names: NameLimits,
    /// `max_bytes_up`, `max_bytes_down` over `volume_window` (allow rules
    /// only): what the org may move through this rule per window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume: Option<Volume>,
    /// `not_before`, `expires` (allow rules only): when the rule matches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<Window>,
}

/// A volume budget: at most `up` bytes from clients and `down` bytes to
/// them (`None`: that direction unbounded) in any span of `window`
/// (sliding), counted as relayed. See `docs/limits.md`, "Volume budgets".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Volume {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub up: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down: Option<u64>,
    #[serde(with = "window_millis")]
    pub window: Duration,
}

/// `volume_window` when a budget is set without one.
pub const DEFAULT_VOLUME_WINDOW: Duration = Duration::from_secs(3600);
/// The shortest `volume_window` accepted.
pub const MIN_VOLUME_WINDOW: Duration = Duration::from_secs(1);
/// The longest `volume_window` accepted (seven days).
pub const MAX_VOLUME_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// A window serialised as whole milliseconds (the policy hash sees it).
mod window_millis {
    pub(super) fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// New names per minute per org under a wildcard allow rule, by default.
pub const DEFAULT_MAX_NEW_NAMES_PER_MINUTE: u32 = 60;
/// The largest `max_new_names_per_minute` accepted.
pub const MAX_NEW_NAMES_PER_MINUTE: u32 = 100_000;
/// The longest label a wildcard allow rule lets through, by default (the
/// DNS maximum).
pub const DEFAULT_MAX_LABEL_LENGTH: u8 = 63;

/// Bounds on the names a wildcard allow rule lets leave: how many new ones
/// per minute per org, and how long a label below the wildcard may be (see
/// `docs/dns.md`, "Names as a channel").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NameLimits {
    /// New names per minute per org; `None`: unlimited (`0` written).
    pub new_per_minute: Option<u32>,
    /// The longest label allowed left of the wildcard's suffix.
    pub max_label_length: u8,
}

impl Default for NameLimits {
    fn default() -> Self {
        NameLimits {
            new_per_minute: Some(DEFAULT_MAX_NEW_NAMES_PER_MINUTE),
            max_label_length: DEFAULT_MAX_LABEL_LENGTH,
        }
    }
}

impl NameLimits {
    pub fn is_default(&self) -> bool {
        *self == NameLimits::default()
    }
}

/// What a tunnel allowed by a host rule may carry, verified from its first
/// byte to its last (see `src/proxy/verify.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
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

    pub(super) fn parse(text: &str) -> Option<Carry> {
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
        // Destructured exhaustively: a new listener cannot be left out.
        let Config {
            path: _,
            proxy,
            dns,
            admin,
            evidence: _,
            intercept: _,
            bypass: _,
            policy: _,
            enforcement: _,
            otel: _,
            decider: _,
            orgs: _,
        } = self;
        let ProxyConfig {
            listen,
            transparent,
            socks5,
            limits: _,
        } = proxy;
        let DnsConfig {
            listen: dns_listen,
            upstream: _,
            resolve_timeout: _,
            idle_timeout: _,
            query_timeout: _,
            max_tcp_connections: _,
            max_tcp_connections_per_client: _,
            max_tcp_connections_per_org: _,
            max_queries_in_flight: _,
            max_queries_in_flight_per_org: _,
            max_queries_per_second_per_client: _,
            min_ttl: _,
            max_ttl: _,
            binding_grace: _,
            max_bindings_per_name: _,
            max_bindings_per_org: _,
            max_bindings: _,
            synthetic_pool: _,
            synthetic_pool_v6: _,
        } = dns;
        let AdminConfig {
            listen: admin_listen,
            tail_tokens: _,
            approver_tokens: _,
        } = admin;
        let mut own: Vec<SocketAddr> = listen.clone();
        own.extend(transparent);
        own.extend(socks5);
        own.extend(dns_listen);
        own.extend(*admin_listen);
        own
    }
}

/// Ranges no broad rule opens: (network, what it is). `check` prints the
/// names; the policy re-exports it (`crate::policy::ALWAYS_DENIED`), and
/// config validation keeps the synthetic pools out of it. The IPv6 documentation ranges `2001:db8::/32` and `3fff::/20`
/// (RFC 3849, RFC 9637) are denied: nothing legitimate answers there, and
/// a site that numbers internal hosts from them (as some labs and
/// examples do) must not be reachable through a wide `::/0`. Left open on
/// purpose: `198.18.0.0/15` and `2001:2::/48` (benchmarking, RFC
/// 2544/5180: test labs, ours included, run there) and the IPv4
/// documentation ranges (`192.0.2.0/24`, `198.51.100.0/24`,
/// `203.0.113.0/24`), which probes and examples use.
pub const ALWAYS_DENIED: &[(&str, &str)] = &[
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared address space"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local incl. cloud metadata"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.168.0.0/16", "private"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved incl. broadcast"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::ffff:0:0:0/96", "SIIT IPv4-translated"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("100::/64", "discard-only"),
    ("2001:db8::/32", "documentation"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "SRv6 SIDs"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::{parse, BASE};

    #[test]
    fn tunnel_defaults_by_port() {
        assert_eq!(Carry::default_for_port(443), Carry::Tls);
        assert_eq!(Carry::default_for_port(80), Carry::Http);
        assert_eq!(Carry::default_for_port(8443), Carry::TlsOrHttp);
    }

    #[test]
    fn new_tokens_are_fresh_and_match_their_digest() {
        let (a, da) = new_token().unwrap();
        let (b, _) = new_token().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert_eq!(da, TokenDigest::of(a.as_bytes()));
        assert_eq!(TokenDigest::parse(&da.to_string()), Some(da));
    }

    #[test]
    fn default_path_is_beside_the_dir() {
        assert_eq!(
            default_key_path(Path::new("evidence")),
            PathBuf::from("evidence.key")
        );
        assert_eq!(
            default_key_path(Path::new("/var/lib/p/evidence/")),
            PathBuf::from("/var/lib/p/evidence.key")
        );
    }

    #[test]
    fn default_dns_settings_keep_the_policy_hash() {
        let c = parse(BASE).unwrap();
        let json = serde_json::to_string(&c.orgs).unwrap();
        assert!(!json.contains("dns_"), "{json}");
    }
}
