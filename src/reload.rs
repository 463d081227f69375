//! Policy reload: on SIGHUP or when the config file's content changes
//! (polled, so that a Kubernetes ConfigMap's symlink swap is seen too), the
//! file is loaded and validated whole, and what it serves (the orgs and
//! their rules, the DNS settings of each org, interception with its CAs,
//! credentials and upstream trust) is built into a new [`Served`] and
//! swapped in with one store: new decisions use it, open tunnels keep
//! running, listeners keep their sockets.
//!
//! A reload is all or nothing. An invalid file, an interception set-up that
//! fails (a CA that cannot be created, a secret that cannot be read), or a
//! change to a setting that only a restart can apply (listeners, limits
//! that size pools, DNS and evidence settings: everything outside the orgs
//! and `[intercept]`) is refused with a message naming the problem or the
//! key, `palisade_policy_reloads_total{result="error"}` rises, and the old
//! state keeps serving.
//!
//! A reload changes nothing only if what it built serves as what is served
//! ([`Served::serves_as`]): a replaced org token changes the policy hash
//! (it covers a digest of each org's tokens, never a token), and a rotated
//! secret, org CA or upstream trust bundle changes the interception
//! fingerprint (compared here, written nowhere). The poll watches the
//! secret files with the config file, so a secret rotated in place
//! reloads like an edited config. Once swapped in, live connections are
//! decided again ([`crate::proxy::revoke`]): one opened with a removed
//! token no longer has an org and is closed.
//!
//! A change of the host's addresses (a kernel notice, see
//! [`crate::host::AddressEvents`], or the poll) serves the running config
//! again compiled with the new addresses ([`Reloader::host_changed`]),
//! reading no file: whatever is on disk, a new gateway address is denied.
//!
//! The file work (reading the config, CA and secret files, writing the
//! policy text beside the evidence) runs off the async runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::config::{
    self, AdminConfig, BypassConfig, Config, DnsConfig, EvidenceConfig, Limits, ProxyConfig,
};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::served::{Served, ServedHandle};

/// How often the config file's content is checked for changes.
pub(crate) const DEFAULT_CONFIG_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// The longest wait for a time-bound rule's next change before the
/// instant is looked at again.
pub(crate) const MAX_RULE_CHANGE_WAIT: Duration = Duration::from_secs(60);

/// Reloads the config file into the served state.
pub(crate) struct Reloader {
    path: PathBuf,
    /// The config whose settings are served (its orgs and `[intercept]`
    /// are those of the served state).
    running: Arc<Config>,
    served: ServedHandle,
    metrics: Arc<Metrics>,
    /// Digest of the file content last loaded (valid or not) and of the
    /// secret files it names ([`watched`]).
    seen: Option<[u8; 32]>,
    /// The secret files the poll watches: those of the file last loaded
    /// (those a reload would read).
    watched_files: Watched,
    /// The host addresses the poll last saw: a change reloads once, even
    /// if that reload is refused (an invalid file is not retried each poll).
    host_seen: Vec<std::net::IpAddr>,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReloadOutcome {
    /// The new state is served (`hash`: its policy).
    Applied { hash: String },
    /// The file is valid and serves what is already served.
    Unchanged,
    /// The reload was refused; the old state keeps serving.
    Rejected,
}

/// Why a reload was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    #[error("{0}")]
    Config(config::ConfigErrors),
    #[error("{} cannot change without a restart", .0.join(", "))]
    RestartOnly(Vec<&'static str>),
    #[error("interception: {0}")]
    Intercept(#[from] crate::intercept::InterceptError),
    #[error("{0}")]
    Host(#[from] crate::host::HostError),
    #[error("internal: {0}")]
    Internal(String),
}

/// What the blocking half of a reload prepared.
enum Prepared {
    Unchanged,
    Apply { config: Box<Config>, served: Served },
}

fn digest(path: &Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

/// The files besides the config that a reload of `config` reads.
#[derive(Debug, Clone, Default)]
struct Watched {
    /// `[policy] baseline`, digested whole.
    baseline: Option<PathBuf>,
    /// The secret files of the credentials of every org that intercepts.
    secrets: Vec<PathBuf>,
}

/// The files besides the config that a reload of `config` reads.
fn watched_files(config: &Config) -> Watched {
    let secrets = config
        .orgs
        .iter()
        .filter(|o| o.intercepts())
        .flat_map(|o| &o.credentials)
        .filter_map(|c| match &c.source {
            config::SecretSource::File(path) => Some(path.clone()),
            config::SecretSource::Env(_) => None,
        })
        .collect();
    Watched {
        baseline: config.policy.baseline.as_ref().map(|b| b.path.clone()),
        secrets,
    }
}

/// What the poll compares: the digest of the config file's content
/// (`file`, `None` if it cannot be read), of the baseline file and of
/// every secret file in `files` (one that cannot be read counts as such),
/// so that a baseline edited or a secret rotated in place (a Kubernetes
/// Secret swaps a symlinked directory like a ConfigMap) reloads like a
/// changed file, and a baseline gone missing is a change (whose reload is
/// refused). Blocking.
fn watched(file: Option<[u8; 32]>, files: &Watched) -> Option<[u8; 32]> {
    let mut h = Sha256::new();
    h.update(file?);
    let baseline = files.baseline.as_deref().map(digest);
    let secrets = files
        .secrets
        .iter()
        .map(|path| crate::intercept::secret::file_digest(path));
    for found in baseline.into_iter().chain(secrets) {
        match found {
            Some(d) => {
                h.update([1]);
                h.update(d);
            }
            None => h.update([0]),
        }
    }
    Some(h.finalize().into())
}

/// Run blocking file work off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ReloadError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ReloadError::Internal(e.to_string()))
}

/// Write the canonical policy text of `hash` beside the evidence, so any
/// record can be re-explained later (`DIR/policies/HASH.json`). Blocking.
pub(crate) fn store_policy_text(evidence_dir: &Path, config: &Config, hash: &str) {
    let dir = evidence_dir.join("policies");
    let path = dir.join(format!("{hash}.json"));
    if path.exists() {
        return;
    }
    let text = Policy::canonical_text(&config.orgs);
    let result = std::fs::create_dir_all(&dir).and_then(|()| {
        let tmp = dir.join(format!("{hash}.json.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)
    });
    if let Err(e) = result {
        warn!(path = %path.display(), error = %e, "cannot store the policy text beside the evidence");
    }
}

/// Push `PREFIX.field` for each listed field whose value differs. The
/// pattern names every field of the struct, so a new setting is a compile
/// error here until it is listed (or explicitly skipped with `_`).
macro_rules! changed {
    ($keys:ident, $prefix:literal, $old:expr, $new:expr,
     $ty:ident { $($field:ident),* $(; $($skip:ident),*)? }) => {{
        let $ty { $($field,)* $($($skip: _,)*)? } = $old;
        $(
            if *$field != $new.$field {
                $keys.push(concat!($prefix, ".", stringify!($field)));
            }
        )*
    }};
}

/// What of `[enforcement]` a restart applies (not where it is written).
fn enforcement_key(
    e: &Option<crate::config::EnforcementConfig>,
) -> Option<(
    &std::path::Path,
    crate::config::EnforcementMode,
    std::time::Duration,
)> {
    let crate::config::EnforcementConfig {
        ruleset,
        mode,
        check_interval,
        at: _,
    } = e.as_ref()?;
    Some((ruleset, *mode, *check_interval))
}

/// The keys that differ between `old` and `new` and that only a restart
/// can apply: everything but the orgs and `[intercept]`.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let Config {
        path: _,
        proxy,
        dns,
        admin,
        evidence,
        bypass,
        enforcement,
        otel,
        decider,
        // Served: rebuilt by a reload.
        intercept: _,
        policy: _,
        orgs: _,
    } = old;
    let mut keys = Vec::new();
    if proxy != &new.proxy {
        proxy_changes(&mut keys, proxy, &new.proxy);
    }
    if dns != &new.dns {
        dns_changes(&mut keys, dns, &new.dns);
    }
    changed!(
        keys,
        "admin",
        admin,
        new.admin,
        AdminConfig {
            listen,
            tail_tokens,
            approver_tokens
        }
    );
    changed!(
        keys,
        "bypass",
        bypass,
        new.bypass,
        BypassConfig { nflog_group }
    );
    if enforcement_key(enforcement) != enforcement_key(&new.enforcement) {
        keys.push("enforcement");
    }
    if otel != &new.otel {
        keys.push("otel");
    }
    if decider != &new.decider {
        keys.push("decider");
    }
    if evidence != &new.evidence {
        evidence_changes(&mut keys, evidence, &new.evidence);
    }
    keys
}

/// The `[proxy]` keys (its limits too) that differ.
fn proxy_changes(keys: &mut Vec<&'static str>, proxy: &ProxyConfig, new: &ProxyConfig) {
    changed!(keys, "proxy", proxy, new, ProxyConfig { listen, transparent, socks5; limits });
    changed!(
        keys,
        "proxy",
        &proxy.limits,
        new.limits,
        Limits {
            max_connections,
            max_connections_per_org,
            max_new_connections_per_second_per_org,
            max_detect_memory_bytes,
            max_detect_memory_bytes_per_org,
            max_connections_per_client,
            max_new_connections_per_second_per_client,
            max_denial_records_per_second_per_client,
            max_denial_records_per_second_per_org,
            max_request_head_bytes,
            max_headers,
            header_read_timeout,
            connect_timeout,
            idle_timeout,
            response_timeout,
            detect_timeout,
            drain_timeout,
            revoke_grace,
            upstream_idle_timeout,
            max_idle_upstream_connections,
            max_idle_upstream_connections_per_target
        }
    );
}

/// The `[dns]` keys that differ.
fn dns_changes(keys: &mut Vec<&'static str>, dns: &DnsConfig, new: &DnsConfig) {
    changed!(
        keys,
        "dns",
        dns,
        new,
        DnsConfig {
            listen,
            upstream,
            resolve_timeout,
            idle_timeout,
            query_timeout,
            max_tcp_connections,
            max_tcp_connections_per_client,
            max_tcp_connections_per_org,
            max_queries_in_flight,
            max_queries_in_flight_per_org,
            max_queries_per_second_per_client,
            min_ttl,
            max_ttl,
            binding_grace,
            max_bindings_per_name,
            max_bindings_per_org,
            max_bindings,
            synthetic_pool,
            synthetic_pool_v6
        }
    );
}

/// The `[evidence]` keys that differ.
fn evidence_changes(keys: &mut Vec<&'static str>, evidence: &EvidenceConfig, new: &EvidenceConfig) {
    changed!(
        keys,
        "evidence",
        evidence,
        new,
        EvidenceConfig {
            dir,
            key,
            durability,
            checkpoint_every,
            checkpoint_interval,
            rotate_size,
            rotate_age,
            retain_size,
            retain_age,
            retain_min_age,
            min_free,
            max_records_per_second_per_org,
            replica,
            witnesses
        }
    );
}

/// Check the loaded file `new` against what runs, and build what it
/// serves: unchanged only if that serves as `current` does (the same
/// policy hash, which covers the orgs' tokens; the same host addresses;
/// and the same secrets, CAs and upstream trust, read again here) under
/// the same `[intercept]` settings. Blocking.
fn prepare(
    new: Config,
    running: &Config,
    current: &Served,
    metrics: &Arc<Metrics>,
) -> Result<Prepared, ReloadError> {
    let restart = restart_only_changes(running, &new);
    if !restart.is_empty() {
        return Err(ReloadError::RestartOnly(restart));
    }
    // Re-read on every reload: the host's addresses may have changed.
    let policy =
        Arc::new(Policy::with_host(&new, &crate::host::addresses()?).at(SystemTime::now()));
    let served = Served::load(&new, policy, metrics)?;
    if served.serves_as(current) && new.intercept == running.intercept {
        return Ok(Prepared::Unchanged);
    }
    store_policy_text(&new.evidence.dir, &new, served.policy.hash());
    Ok(Prepared::Apply {
        config: Box::new(new),
        served,
    })
}

impl Reloader {
    /// A reloader of `running`'s file into `served` (which serves it now).
    pub(crate) async fn new(
        running: Config,
        served: ServedHandle,
        metrics: Arc<Metrics>,
    ) -> Reloader {
        let path = running.path.clone();
        let watched_files = watched_files(&running);
        let seen = {
            let (path, secrets) = (path.clone(), watched_files.clone());
            blocking(move || watched(digest(&path), &secrets))
                .await
                .ok()
                .flatten()
        };
        let host_seen = served.load().policy.host_addresses().to_vec();
        Reloader {
            path,
            running: Arc::new(running),
            served,
            metrics,
            seen,
            watched_files,
            host_seen,
        }
    }

    /// Reload if the file's content, or that of a secret file it names,
    /// changed since it was last read, or if the host's addresses are no
    /// longer those the served policy denies.
    pub(crate) async fn poll(&mut self) -> Option<ReloadOutcome> {
        let (path, secrets) = (self.path.clone(), self.watched_files.clone());
        let (now, host) = blocking(move || {
            (
                watched(digest(&path), &secrets),
                crate::host::addresses().ok(),
            )
        })
        .await
        .ok()?;
        if now.is_some() && now != self.seen {
            return Some(self.reload("config or secret file changed").await);
        }
        // An enumeration that fails here is retried by the next poll.
        let host = host.filter(|h| *h != self.host_seen)?;
        self.serve_host(host).await
    }

    /// The kernel said an address came or went ([`crate::host::AddressEvents`]):
    /// read the host's addresses and, if they are not those the served
    /// policy denies, serve it with them ([`Reloader::serve_host`]). An
    /// enumeration that fails is retried by the next notice or poll.
    pub(crate) async fn host_changed(&mut self) -> Option<ReloadOutcome> {
        let host = blocking(crate::host::addresses).await.ok()?.ok()?;
        self.serve_host(host).await
    }

    /// Serve the policy again with the host addresses `host`, if the served
    /// policy has others: the running config compiled again with them, the
    /// rest of the served state kept. No file is read, so a config file
    /// being edited (or broken) on disk never holds a new address of the
    /// gateway open; the file is the poll's business.
    async fn serve_host(&mut self, host: Vec<std::net::IpAddr>) -> Option<ReloadOutcome> {
        self.host_seen = host.clone();
        let current = self.served.load_full();
        if host == current.policy.host_addresses() {
            return None;
        }
        info!(addresses = ?host, "host addresses changed");
        let (running, now) = (self.running.clone(), current.clone());
        let served = blocking(move || {
            let policy = Arc::new(Policy::with_host(&running, &host).at(SystemTime::now()));
            now.with_policy(&running, policy)
        })
        .await
        .ok()?;
        Some(self.serve("host addresses changed", &current, None, served))
    }

    /// How long until the served policy's next rule change
    /// ([`Policy::next_change`]: a time-bound rule starts or ends), at
    /// most [`MAX_RULE_CHANGE_WAIT`] (a wall clock set meanwhile is seen
    /// then); `None` while no time-bound rule is left to change.
    pub(crate) fn until_rule_change(&self) -> Option<Duration> {
        let next = self.served.load().policy.next_change()?;
        let wait = next
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        Some(wait.min(MAX_RULE_CHANGE_WAIT))
    }

    /// Serve the running config again at the current instant if a
    /// time-bound rule started or ended since the served policy's instant:
    /// compiled with the same host addresses, the rest of the served state
    /// kept, no file read. Counted as no reload; live connections are
    /// decided again as after one (the caller's [`ReloadOutcome::Applied`]).
    pub(crate) async fn rule_change(&mut self) -> Option<ReloadOutcome> {
        let current = self.served.load_full();
        let now = SystemTime::now();
        let due = current.policy.next_change().is_some_and(|t| t <= now);
        if !due {
            return None;
        }
        let (running, served) = (self.running.clone(), current.clone());
        let next = blocking(move || {
            let host = served.policy.host_addresses().to_vec();
            let policy = Arc::new(Policy::with_host(&running, &host).at(now));
            served.with_policy(&running, policy)
        })
        .await
        .ok()?;
        let hash = next.policy.hash().to_string();
        // A reload in between has swapped in a policy of its own, as new.
        let swapped = self.served.compare_and_swap(&current, Arc::new(next));
        if !Arc::ptr_eq(&swapped, &current) {
            return None;
        }
        let active: Vec<&str> = self
            .running
            .orgs
            .iter()
            .flat_map(|o| &o.allow)
            .filter(|r| r.window.is_some_and(|w| w.contains(now)))
            .map(|r| r.id.as_str())
            .collect();
        info!(at = %crate::config::rfc3339(now), active = ?active, "time-bound rules changed");
        Some(ReloadOutcome::Applied { hash })
    }

    /// Load and check the file and, if it is accepted, serve it.
    pub(crate) async fn reload(&mut self, why: &str) -> ReloadOutcome {
        let current = self.served.load_full();
        let (path, running, metrics) = (
            self.path.clone(),
            self.running.clone(),
            self.metrics.clone(),
        );
        let (served, secrets) = (current.clone(), self.watched_files.clone());
        let prepared = blocking(move || {
            // Digested before they are loaded: a change after this is seen
            // by the next poll.
            let file = digest(&path);
            let new = config::load(&path).map_err(ReloadError::Config);
            let secrets = new.as_ref().map_or(secrets, watched_files);
            let seen = watched(file, &secrets);
            let prepared = new.and_then(|new| prepare(new, &running, &served, &metrics));
            (seen, secrets, prepared)
        })
        .await;
        let prepared = match prepared {
            Ok((seen, secrets, prepared)) => {
                self.seen = seen;
                self.watched_files = secrets;
                prepared
            }
            Err(e) => Err(e),
        };
        let (config, served) = match prepared {
            Ok(Prepared::Apply { config, served }) => (config, served),
            Ok(Prepared::Unchanged) => {
                self.metrics
                    .policy_reloads_total
                    .with_label_values(&["ok"])
                    .inc();
                info!(why, policy = %current.policy.hash(), "reload: nothing changed");
                return ReloadOutcome::Unchanged;
            }
            Err(e) => {
                self.metrics
                    .policy_reloads_total
                    .with_label_values(&["error"])
                    .inc();
                match e {
                    // One line per error, each located FILE:LINE:COL.
                    ReloadError::Config(errors) => {
                        for e in &errors.0 {
                            warn!(why, error = %e, "policy reload rejected; the old policy keeps serving");
                        }
                    }
                    e => {
                        warn!(why, error = %e, "policy reload rejected; the old policy keeps serving")
                    }
                }
                return ReloadOutcome::Rejected;
            }
        };
        self.serve(why, &current, Some(config), served)
    }

    /// Swap in `served`, built from `config` (`None`: from the running
    /// one), in place of `current`, and say so.
    fn serve(
        &mut self,
        why: &str,
        current: &Served,
        config: Option<Box<Config>>,
        served: Served,
    ) -> ReloadOutcome {
        let hash = served.policy.hash().to_string();
        let (orgs, rules) = (served.policy.org_count(), served.policy.rule_count());
        if let Some(config) = config {
            self.running = Arc::from(config);
        }
        let config = &self.running;
        let intercepting: Vec<&str> = config
            .orgs
            .iter()
            .filter(|o| o.intercepts())
            .map(|o| o.name.as_str())
            .collect();
        self.metrics
            .init_series(config.orgs.iter().map(|o| o.name.as_str()));
        // One store: every reader sees the old state or the new, never a mix.
        self.served.store(Arc::new(served));
        self.metrics
            .policy_reloads_total
            .with_label_values(&["ok"])
            .inc();
        info!(
            why,
            from = %current.policy.hash(),
            to = %hash,
            orgs,
            rules,
            intercepting = ?intercepting,
            "policy reloaded"
        );
        ReloadOutcome::Applied { hash }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{TokenDigest, TOKEN_DIGEST_PREFIX};

    /// A proxy listener, evidence under /tmp, and acme allowed example.com.
    fn base() -> String {
        let acme = crate::testing::org_toml("acme", &["10.0.0.0/24"], &["example.com"]);
        format!(
            "[proxy]\nlisten = [\"127.0.0.1:3128\"]\n\n\
             [evidence]\ndir = \"/tmp/palisade-reload-test-evidence\"\n\n{acme}"
        )
    }

    fn config(text: &str) -> Config {
        config::from_str(text, Path::new("/tmp/palisade.toml")).unwrap()
    }

    /// [`base`] with its evidence in a fresh directory, `evidence_keys` added
    /// to `[evidence]`, written to `palisade.toml` there: the directory
    /// (kept while it lives), the file and its text.
    fn config_file(evidence_keys: &str) -> (tempfile::TempDir, PathBuf, String) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("palisade.toml");
        let dir = tmp.path().join("evidence").display().to_string();
        let base = base().replace(
            "dir = \"/tmp/palisade-reload-test-evidence\"",
            &format!("dir = {dir:?}{evidence_keys}"),
        );
        std::fs::write(&path, &base).unwrap();
        (tmp, path, base)
    }

    /// `running` served under `policy`.
    fn serve(running: &Config, policy: Arc<Policy>, metrics: &Arc<Metrics>) -> ServedHandle {
        Served::load(running, policy, metrics)
            .unwrap()
            .into_handle()
    }

    /// The file at `path` served as at start (with the host's addresses),
    /// and its reloader.
    async fn serving(path: &Path) -> (Reloader, ServedHandle, Arc<Metrics>) {
        let running = config::load(path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let host = crate::host::addresses().unwrap();
        let served = serve(
            &running,
            Arc::new(Policy::with_host(&running, &host)),
            &metrics,
        );
        let reloader = Reloader::new(running, served.clone(), metrics.clone()).await;
        (reloader, served, metrics)
    }

    #[test]
    fn dns_budgets_are_restart_only() {
        let base = base();
        let old = config(&base);
        let budgets = config(&format!(
            "[dns]\nmax_tcp_connections_per_client = 2\nmax_tcp_connections_per_org = 3\n\
             max_queries_in_flight_per_org = 4\nmax_bindings_per_org = 5\n{base}"
        ));
        assert_eq!(
            restart_only_changes(&old, &budgets),
            [
                "dns.max_tcp_connections_per_client",
                "dns.max_tcp_connections_per_org",
                "dns.max_queries_in_flight_per_org",
                "dns.max_bindings_per_org"
            ]
        );
    }

    #[test]
    fn orgs_and_intercept_reload_the_rest_is_named_key_by_key() {
        let base = base();
        let old = config(&base);
        let more_rules = config(&format!(
            "{base}\n[[org.allow]]\nhost = \"other.example\"\n"
        ));
        assert!(restart_only_changes(&old, &more_rules).is_empty());
        let intercept = config(&format!("[intercept]\ncert_cache = 5\n{base}"));
        assert!(restart_only_changes(&old, &intercept).is_empty());

        let changed = config(&base.replace(
            "listen = [\"127.0.0.1:3128\"]",
            "listen = [\"127.0.0.1:3129\"]\nmax_connections = 7\nidle_timeout = \"9s\"",
        ));
        assert_eq!(
            restart_only_changes(&old, &changed),
            [
                "proxy.listen",
                "proxy.max_connections",
                "proxy.idle_timeout",
                // Unset, it follows idle_timeout.
                "proxy.response_timeout"
            ]
        );
        let dns = config(&format!(
            "[dns]\nmax_queries_in_flight = 3\n[admin]\nlisten = \"127.0.0.1:9999\"\n{base}"
        ));
        // The per-org share follows the global cap it defaults from.
        assert_eq!(
            restart_only_changes(&old, &dns),
            [
                "dns.max_queries_in_flight",
                "dns.max_queries_in_flight_per_org",
                "admin.listen"
            ]
        );
        let evidence = config(&base.replace(
            "dir = \"/tmp/palisade-reload-test-evidence\"",
            "dir = \"/tmp/palisade-reload-test-evidence\"\ndurability = \"fsync\"",
        ));
        assert_eq!(
            restart_only_changes(&old, &evidence),
            ["evidence.durability"]
        );
        let bypass = config(&format!("[bypass]\nnflog_group = 100\n{base}"));
        assert_eq!(restart_only_changes(&old, &bypass), ["bypass.nflog_group"]);
    }

    #[tokio::test]
    async fn a_reload_applies_whole_or_not_at_all() {
        let (tmp, path, base) = config_file("");
        let dir = tmp.path();
        let (mut reloader, served, metrics) = serving(&path).await;
        let first = served.load().policy.hash().to_string();
        let count = |result: &str| {
            metrics
                .policy_reloads_total
                .with_label_values(&[result])
                .get()
        };

        assert_eq!(reloader.reload("test").await, ReloadOutcome::Unchanged);
        assert_eq!(reloader.poll().await, None, "nothing new to read");

        std::fs::write(
            &path,
            format!("{base}\n[[org.allow]]\nhost = \"b.example\"\n"),
        )
        .unwrap();
        let Some(ReloadOutcome::Applied { hash }) = reloader.poll().await else {
            panic!("the changed file was not applied");
        };
        assert_ne!(hash, first);
        assert_eq!(served.load().policy.hash(), hash);
        assert_eq!(served.load().info.hash, hash);
        assert!(dir.join(format!("evidence/policies/{hash}.json")).is_file());

        // A new rule with a restart-only change: nothing of it is served.
        let refused = base.replace("[proxy]\n", "[proxy]\nmax_headers = 7\n");
        std::fs::write(
            &path,
            format!("{refused}\n[[org.allow]]\nhost = \"c.example\"\n"),
        )
        .unwrap();
        assert_eq!(reloader.reload("test").await, ReloadOutcome::Rejected);
        assert_eq!(served.load().policy.hash(), hash);
        // An invalid file likewise.
        std::fs::write(&path, "[[org]]\nname = 7\n").unwrap();
        assert_eq!(reloader.reload("test").await, ReloadOutcome::Rejected);
        assert_eq!(served.load().policy.hash(), hash);
        assert_eq!((count("ok"), count("error")), (2, 2));
    }

    #[tokio::test]
    async fn a_reload_whose_orgs_could_outrun_the_evidence_store_is_rejected() {
        // One org and the clients of no org: 2 x 10 records/s x 1140 bytes
        // for 2 minutes and a second, and a 1 MiB segment, fit 4 MiB.
        let (_tmp, path, base) = config_file(
            "\nrotate_size = \"1MiB\"\nretain_size = \"4MiB\"\nretain_min_age = \"2m\"\nmax_records_per_second_per_org = 10",
        );
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let served = serve(&running, Arc::new(Policy::new(&running)), &metrics);
        let hash = served.load().policy.hash().to_string();
        let mut reloader = Reloader::new(running.clone(), served.clone(), metrics.clone()).await;
        // A second org is a third budget: no longer within the store.
        let more = format!("{base}\n[[org]]\nname = \"beta\"\nclients = [\"198.19.2.0/24\"]\n");
        std::fs::write(&path, &more).unwrap();
        let new = config::load(&path).map_err(ReloadError::Config);
        match new.and_then(|new| prepare(new, &running, &served.load(), &metrics)) {
            Err(ReloadError::Config(e)) => {
                let e = e.to_string();
                assert!(
                    e.contains("3 payers (2 orgs and the clients of no org)"),
                    "{e}"
                );
            }
            Err(e) => panic!("rejected for another reason: {e}"),
            Ok(_) => panic!("a reload past the store's capacity was accepted"),
        }
        assert_eq!(reloader.reload("test").await, ReloadOutcome::Rejected);
        assert_eq!(served.load().policy.hash(), hash);
    }

    #[tokio::test]
    async fn a_rotated_token_or_secret_is_a_change_and_the_poll_sees_the_secret() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (path, secret) = (dir.join("palisade.toml"), dir.join("secret"));
        std::fs::write(&secret, "old-secret\n").unwrap();
        let (old, new) = (TokenDigest::of(b"old"), TokenDigest::of(b"new"));
        let text = |token: &TokenDigest| {
            // The org CA, created before the roots are read, is the trust.
            format!(
                "[intercept]\nca_dir = {ca:?}\nupstream_ca = {roots:?}\n\n\
                 [evidence]\ndir = {evidence:?}\n\n\
                 [[org]]\nname = \"acme\"\nidentity = \"token\"\ntokens = [\"{token}\"]\n\
                 [[org.allow]]\nhost = \"example.com\"\nintercept = true\n\
                 [[org.credential]]\nid = \"c\"\nhost = \"example.com\"\n\
                 header = \"Authorization\"\nsecret_file = {secret:?}\n",
                ca = dir.join("ca").display().to_string(),
                roots = dir.join("ca/acme.pem").display().to_string(),
                evidence = dir.join("evidence").display().to_string(),
                secret = secret.display().to_string(),
            )
        };
        std::fs::write(&path, text(&old)).unwrap();
        let (mut reloader, served, _) = serving(&path).await;
        let first = served.load_full();
        assert_eq!(reloader.reload("test").await, ReloadOutcome::Unchanged);
        assert_eq!(reloader.poll().await, None);

        // The secret rotated in place: the poll reloads, the hash stays.
        std::fs::write(&secret, "new-secret\n").unwrap();
        assert_eq!(
            reloader.poll().await,
            Some(ReloadOutcome::Applied {
                hash: first.policy.hash().to_string()
            })
        );
        let now = served.load_full();
        assert!(!now.serves_as(&first), "the rotated secret is served");
        assert_eq!(reloader.poll().await, None, "nothing changed since");
        assert_eq!(reloader.reload("test").await, ReloadOutcome::Unchanged);

        // The token replaced: a new policy hash, whose stored text holds
        // neither token digest.
        std::fs::write(&path, text(&new)).unwrap();
        let Some(ReloadOutcome::Applied { hash }) = reloader.poll().await else {
            panic!("the rotated token was not applied");
        };
        assert_ne!(hash, first.policy.hash());
        let stored =
            std::fs::read_to_string(dir.join(format!("evidence/policies/{hash}.json"))).unwrap();
        assert!(stored.contains("tokens_fingerprint"), "{stored}");
        for digest in [&old, &new] {
            let hex = digest.to_string();
            assert!(
                !stored.contains(&hex[TOKEN_DIGEST_PREFIX.len()..]),
                "{stored}"
            );
        }
        assert!(!stored.contains("-secret"), "{stored}");
    }

    #[tokio::test]
    async fn a_change_of_the_host_addresses_reloads_an_unchanged_file() {
        let (_tmp, path, _) = config_file("");
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        // Served with addresses the host no longer has (here: none).
        let served = serve(&running, Arc::new(Policy::new(&running)), &metrics);
        let hash = served.load().policy.hash().to_string();
        let mut reloader = Reloader::new(running, served.clone(), metrics).await;
        let host = crate::host::addresses().unwrap();
        assert!(!host.is_empty(), "no interface addresses at all");
        assert_eq!(
            reloader.poll().await,
            Some(ReloadOutcome::Applied { hash: hash.clone() }),
            "the file is the same, the addresses are not"
        );
        assert_eq!(served.load().policy.host_addresses(), host);
        assert_eq!(reloader.poll().await, None, "nothing changed since");

        // New addresses and an invalid file: the file is refused once, and
        // the addresses are served all the same (with the running config:
        // a broken file never holds a new gateway address open), then
        // quiet until either changes.
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let served = serve(&running, Arc::new(Policy::new(&running)), &metrics);
        let mut reloader = Reloader::new(running, served.clone(), metrics).await;
        std::fs::write(&path, "[[org]]\nname = 7\n").unwrap();
        assert_eq!(reloader.poll().await, Some(ReloadOutcome::Rejected));
        assert_eq!(
            reloader.poll().await,
            Some(ReloadOutcome::Applied { hash: hash.clone() })
        );
        assert_eq!(reloader.poll().await, None, "not retried every poll");
        assert_eq!(served.load().policy.host_addresses(), host);
        assert_eq!(served.load().policy.hash(), hash);

        // A notice of the kernel with nothing new: nothing served.
        assert_eq!(reloader.host_changed().await, None);
        // Served without the addresses again: a notice serves them at once.
        served.store(Arc::new(served.load().with_policy(
            &reloader.running,
            Arc::new(Policy::new(&reloader.running)),
        )));
        assert_eq!(
            reloader.host_changed().await,
            Some(ReloadOutcome::Applied { hash })
        );
        assert_eq!(served.load().policy.host_addresses(), host);
    }
}
