//! The raw serde structs: exactly the file's shape, `deny_unknown_fields`
//! on every table, every value kept with its span so that validation can
//! locate its errors.

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) proxy: RawProxy,
    #[serde(default)]
    pub(super) dns: RawDns,
    #[serde(default)]
    pub(super) admin: RawAdmin,
    #[serde(default)]
    pub(super) evidence: RawEvidence,
    #[serde(default)]
    pub(super) intercept: RawIntercept,
    #[serde(default)]
    pub(super) bypass: RawBypass,
    #[serde(default)]
    pub(super) policy: RawPolicy,
    #[serde(default)]
    pub(super) enforcement: RawEnforcement,
    /// `[otel]`: present (even empty) turns the OTLP export on.
    pub(super) otel: Option<RawOtel>,
    /// `[decider]`: an HTTP endpoint consulted on a miss.
    pub(super) decider: Option<Spanned<RawDecider>>,
    #[serde(default)]
    pub(super) org: Vec<RawOrg>,
}

/// `[decider]`: where a miss is asked about, how long it may take, and
/// how many may be asked at once.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDecider {
    pub(super) url: Option<Spanned<String>>,
    pub(super) timeout: Option<Spanned<String>>,
    pub(super) on_error: Option<Spanned<String>>,
    pub(super) max_in_flight: Option<Spanned<i64>>,
}

/// `[otel]`: where OTLP over HTTP goes, and as what service.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOtel {
    pub(super) endpoint: Option<Spanned<String>>,
    pub(super) service_name: Option<Spanned<String>>,
    pub(super) headers: Option<std::collections::BTreeMap<String, Spanned<String>>>,
}

/// `[policy]`: the layers under the orgs' rules.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) baseline: Option<Spanned<String>>,
}

/// The baseline file (`[policy] baseline`): its own strict TOML.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBaseline {
    #[serde(default)]
    pub(super) deny: Vec<Spanned<RawBaselineEntry>>,
    #[serde(default)]
    pub(super) ceiling: Vec<Spanned<RawBaselineEntry>>,
}

/// A `[[deny]]` or `[[ceiling]]` entry of the baseline (`intercept` only
/// on a ceiling).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBaselineEntry {
    pub(super) id: Option<Spanned<String>>,
    pub(super) host: Option<Spanned<String>>,
    pub(super) cidr: Option<Spanned<String>>,
    pub(super) ports: Option<Spanned<Vec<Spanned<i64>>>>,
    pub(super) intercept: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEnforcement {
    pub(super) ruleset: Option<Spanned<String>>,
    pub(super) mode: Option<Spanned<String>>,
    pub(super) check_interval: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBypass {
    pub(super) nflog_group: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIntercept {
    pub(super) ca_dir: Option<Spanned<String>>,
    pub(super) upstream_ca: Option<Spanned<String>>,
    pub(super) cert_cache: Option<Spanned<i64>>,
    pub(super) handshake_timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredential {
    pub(super) id: Spanned<String>,
    pub(super) host: Spanned<String>,
    pub(super) header: Spanned<String>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) secret_file: Option<Spanned<String>>,
    pub(super) secret_env: Option<Spanned<String>>,
    pub(super) methods: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) paths: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProxy {
    #[serde(default)]
    pub(super) listen: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) transparent: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) socks5: Vec<Spanned<String>>,
    pub(super) max_connections: Option<Spanned<i64>>,
    pub(super) max_connections_per_org: Option<Spanned<i64>>,
    pub(super) max_new_connections_per_second_per_org: Option<Spanned<i64>>,
    pub(super) max_detect_memory_bytes: Option<Spanned<i64>>,
    pub(super) max_detect_memory_bytes_per_org: Option<Spanned<i64>>,
    pub(super) max_connections_per_client: Option<Spanned<i64>>,
    pub(super) max_new_connections_per_second_per_client: Option<Spanned<i64>>,
    pub(super) max_denial_records_per_second_per_client: Option<Spanned<i64>>,
    pub(super) max_denial_records_per_second_per_org: Option<Spanned<i64>>,
    pub(super) max_request_head_bytes: Option<Spanned<i64>>,
    pub(super) max_headers: Option<Spanned<i64>>,
    pub(super) header_read_timeout: Option<Spanned<String>>,
    pub(super) connect_timeout: Option<Spanned<String>>,
    pub(super) idle_timeout: Option<Spanned<String>>,
    pub(super) response_timeout: Option<Spanned<String>>,
    pub(super) detect_timeout: Option<Spanned<String>>,
    pub(super) drain_timeout: Option<Spanned<String>>,
    pub(super) revoke_grace: Option<Spanned<String>>,
    pub(super) upstream_idle_timeout: Option<Spanned<String>>,
    pub(super) max_idle_upstream_connections: Option<Spanned<i64>>,
    pub(super) max_idle_upstream_connections_per_target: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDns {
    #[serde(default)]
    pub(super) listen: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) upstream: Vec<Spanned<String>>,
    pub(super) resolve_timeout: Option<Spanned<String>>,
    pub(super) idle_timeout: Option<Spanned<String>>,
    pub(super) query_timeout: Option<Spanned<String>>,
    pub(super) max_tcp_connections: Option<Spanned<i64>>,
    pub(super) max_tcp_connections_per_client: Option<Spanned<i64>>,
    pub(super) max_tcp_connections_per_org: Option<Spanned<i64>>,
    pub(super) max_queries_in_flight: Option<Spanned<i64>>,
    pub(super) max_queries_in_flight_per_org: Option<Spanned<i64>>,
    pub(super) max_queries_per_second_per_client: Option<Spanned<i64>>,
    pub(super) min_ttl: Option<Spanned<String>>,
    pub(super) max_ttl: Option<Spanned<String>>,
    pub(super) binding_grace: Option<Spanned<String>>,
    pub(super) max_bindings_per_name: Option<Spanned<i64>>,
    pub(super) max_bindings_per_org: Option<Spanned<i64>>,
    pub(super) max_bindings: Option<Spanned<i64>>,
    pub(super) synthetic_pool: Option<Spanned<String>>,
    pub(super) synthetic_pool_v6: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) listen: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) tail_tokens: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) approver_tokens: Vec<Spanned<RawApprover>>,
}

/// One entry of `[admin] approver_tokens`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawApprover {
    pub(super) name: Spanned<String>,
    pub(super) token: Spanned<String>,
    pub(super) orgs: Spanned<Vec<Spanned<String>>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEvidence {
    pub(super) dir: Option<Spanned<String>>,
    pub(super) key: Option<Spanned<String>>,
    pub(super) durability: Option<Spanned<String>>,
    pub(super) checkpoint_every: Option<Spanned<i64>>,
    pub(super) checkpoint_interval: Option<Spanned<String>>,
    pub(super) rotate_size: Option<Spanned<RawSize>>,
    pub(super) rotate_age: Option<Spanned<String>>,
    pub(super) retain_size: Option<Spanned<RawSize>>,
    pub(super) retain_age: Option<Spanned<String>>,
    pub(super) retain_min_age: Option<Spanned<String>>,
    pub(super) min_free: Option<Spanned<RawSize>>,
    pub(super) max_records_per_second_per_org: Option<Spanned<i64>>,
    pub(super) replica: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) witnesses: Vec<Spanned<RawWitness>>,
}

/// One `[evidence] witnesses` entry: `{ url = "...", key = "..." }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWitness {
    pub(super) url: Spanned<String>,
    pub(super) key: Spanned<String>,
}

/// A byte size: an integer, or a string such as "64MiB", "500kB", "1GiB".
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    Bytes(i64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOrg {
    pub(super) name: Spanned<String>,
    #[serde(default)]
    pub(super) clients: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) allow: Vec<Spanned<RawRule>>,
    #[serde(default)]
    pub(super) deny: Vec<Spanned<RawRule>>,
    pub(super) dns_denied: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) dns_types: Vec<Spanned<String>>,
    pub(super) dns_answers: Option<Spanned<String>>,
    pub(super) mode: Option<Spanned<String>>,
    pub(super) on_miss: Option<Spanned<String>>,
    pub(super) identity: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) tokens: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) credential: Vec<Spanned<RawCredential>>,
    pub(super) max_bytes_up: Option<Spanned<RawSize>>,
    pub(super) max_bytes_down: Option<Spanned<RawSize>>,
    pub(super) volume_window: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) id: Option<Spanned<String>>,
    pub(super) host: Option<Spanned<String>>,
    pub(super) cidr: Option<Spanned<String>>,
    pub(super) ports: Option<Spanned<Vec<Spanned<i64>>>>,
    pub(super) intercept: Option<Spanned<bool>>,
    pub(super) tunnel: Option<Spanned<String>>,
    pub(super) methods: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) paths: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) deny_methods: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) deny_paths: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) max_new_names_per_minute: Option<Spanned<i64>>,
    pub(super) max_label_length: Option<Spanned<i64>>,
    pub(super) websocket: Option<Spanned<bool>>,
    pub(super) max_bytes_up: Option<Spanned<RawSize>>,
    pub(super) max_bytes_down: Option<Spanned<RawSize>>,
    pub(super) volume_window: Option<Spanned<String>>,
    pub(super) service: Option<Spanned<String>>,
    pub(super) repos: RawList,
    pub(super) push_refs: RawList,
    pub(super) graphql_mutations: RawList,
    pub(super) models: RawList,
    pub(super) not_before: Option<Spanned<String>>,
    pub(super) expires: Option<Spanned<String>>,
}

/// A list of strings, each located.
pub(super) type RawList = Option<Spanned<Vec<Spanned<String>>>>;
