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
//! The file work (reading the config, CA and secret files, writing the
//! policy text beside the evidence) runs off the async runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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

/// Reloads the config file into the served state.
pub(crate) struct Reloader {
    path: PathBuf,
    /// The config whose settings are served (its orgs and `[intercept]`
    /// are those of the served state).
    running: Arc<Config>,
    served: ServedHandle,
    metrics: Arc<Metrics>,
    /// Digest of the file content last loaded (valid or not).
    seen: Option<[u8; 32]>,
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

/// Digest of the config file and of the baseline it names (as `baseline`
/// of the running config says; a config change is seen by the first
/// part): a change of either is a change. `None`: the config cannot be
/// read; a baseline that cannot be read is a value of its own, so that
/// losing it is a change too (and its reload is refused).
fn digest(path: &Path, baseline: Option<&Path>) -> Option<[u8; 32]> {
    let config = std::fs::read(path).ok()?;
    let mut h = Sha256::new();
    h.update(Sha256::digest(&config));
    if let Some(b) = baseline {
        match std::fs::read(b) {
            Ok(bytes) => h.update(Sha256::digest(&bytes)),
            Err(_) => h.update(b"missing"),
        }
    }
    Some(h.finalize().into())
}

/// The baseline file `config` names, if any.
fn baseline_path(config: &Config) -> Option<PathBuf> {
    config.policy.baseline.as_ref().map(|b| b.path.clone())
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

/// The keys that differ between `old` and `new` and that only a restart
/// can apply: everything but the orgs, `[intercept]` and `[policy]`.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let Config {
        path: _,
        proxy,
        dns,
        admin,
        evidence,
        bypass,
        // Served: rebuilt by a reload.
        intercept: _,
        policy: _,
        orgs: _,
    } = old;
    let mut keys = Vec::new();
    if proxy != &new.proxy {
        changed!(keys, "proxy", proxy, new.proxy, ProxyConfig { listen, transparent, socks5; limits });
        changed!(
            keys,
            "proxy",
            &proxy.limits,
            new.proxy.limits,
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
    if dns != &new.dns {
        changed!(
            keys,
            "dns",
            dns,
            new.dns,
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
    changed!(
        keys,
        "admin",
        admin,
        new.admin,
        AdminConfig {
            listen,
            tail_tokens
        }
    );
    changed!(
        keys,
        "bypass",
        bypass,
        new.bypass,
        BypassConfig { nflog_group }
    );
    if evidence != &new.evidence {
        changed!(
            keys,
            "evidence",
            evidence,
            new.evidence,
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
                replica
            }
        );
    }
    keys
}

/// Load and check the file, and build what it serves. Blocking.
fn prepare(
    path: &Path,
    running: &Config,
    (served_hash, served_baseline): (&str, Option<&str>),
    served_host: &[std::net::IpAddr],
    metrics: &Arc<Metrics>,
) -> Result<Prepared, ReloadError> {
    let new = config::load(path).map_err(ReloadError::Config)?;
    let restart = restart_only_changes(running, &new);
    if !restart.is_empty() {
        return Err(ReloadError::RestartOnly(restart));
    }
    // Re-read on every reload: the host's addresses may have changed.
    let policy = Arc::new(Policy::with_host(&new, &crate::host::addresses()?));
    if policy.hash() == served_hash
        && policy.baseline_hash().map(|h| &**h) == served_baseline
        && policy.host_addresses() == served_host
        && new.intercept == running.intercept
    {
        return Ok(Prepared::Unchanged);
    }
    let served = Served::load(&new, policy, metrics)?;
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
        let seen = {
            let (path, baseline) = (path.clone(), baseline_path(&running));
            blocking(move || digest(&path, baseline.as_deref()))
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
            host_seen,
        }
    }

    /// Reload if the file's content changed since it was last read, or if
    /// the host's addresses are no longer those the served policy denies.
    pub(crate) async fn poll(&mut self) -> Option<ReloadOutcome> {
        let (path, baseline) = (self.path.clone(), baseline_path(&self.running));
        let (now, host) = blocking(move || {
            let now = digest(&path, baseline.as_deref());
            (now, crate::host::addresses().ok())
        })
        .await
        .ok()?;
        if now.is_some() && now != self.seen {
            return Some(self.reload("config file changed").await);
        }
        // An enumeration that fails here is retried by the next poll.
        let host = host.filter(|h| *h != self.host_seen)?;
        self.host_seen = host.clone();
        if host == self.served.load().policy.host_addresses() {
            return None;
        }
        info!(addresses = ?host, "host addresses changed");
        Some(self.reload("host addresses changed").await)
    }

    /// Load and check the file and, if it is accepted, serve it.
    pub(crate) async fn reload(&mut self, why: &str) -> ReloadOutcome {
        let current = self.served.load_full();
        let (path, running, metrics) = (
            self.path.clone(),
            self.running.clone(),
            self.metrics.clone(),
        );
        let served_hash = current.policy.hash().to_string();
        let served_baseline = current.policy.baseline_hash().map(|h| h.to_string());
        let served_host = current.policy.host_addresses().to_vec();
        let prepared = blocking(move || {
            // The baseline as the running config names it: what `poll`
            // compares against next.
            let seen = digest(&path, baseline_path(&running).as_deref());
            let served = (served_hash.as_str(), served_baseline.as_deref());
            let prepared = prepare(&path, &running, served, &served_host, &metrics);
            (seen, prepared)
        })
        .await;
        let prepared = match prepared {
            Ok((seen, prepared)) => {
                self.seen = seen;
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
        let hash = served.policy.hash().to_string();
        let (orgs, rules) = (served.policy.org_count(), served.policy.rule_count());
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
        self.running = Arc::from(config);
        ReloadOutcome::Applied { hash }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[proxy]
listen = ["127.0.0.1:3128"]

[evidence]
dir = "/tmp/palisade-reload-test-evidence"

[[org]]
name = "acme"
clients = ["10.0.0.0/24"]

[[org.allow]]
host = "example.com"
"#;

    fn config(text: &str) -> Config {
        config::from_str(text, Path::new("/tmp/palisade.toml")).unwrap()
    }

    #[test]
    fn dns_budgets_are_restart_only() {
        let old = config(BASE);
        let budgets = config(&format!(
            "[dns]\nmax_tcp_connections_per_client = 2\nmax_tcp_connections_per_org = 3\n\
             max_queries_in_flight_per_org = 4\nmax_bindings_per_org = 5\n{BASE}"
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
        let old = config(BASE);
        let more_rules = config(&format!(
            "{BASE}\n[[org.allow]]\nhost = \"other.example\"\n"
        ));
        assert!(restart_only_changes(&old, &more_rules).is_empty());
        let intercept = config(&format!("[intercept]\ncert_cache = 5\n{BASE}"));
        assert!(restart_only_changes(&old, &intercept).is_empty());

        let changed = config(&BASE.replace(
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
            "[dns]\nmax_queries_in_flight = 3\n[admin]\nlisten = \"127.0.0.1:9999\"\n{BASE}"
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
        let evidence = config(&BASE.replace(
            "dir = \"/tmp/palisade-reload-test-evidence\"",
            "dir = \"/tmp/palisade-reload-test-evidence\"\ndurability = \"fsync\"",
        ));
        assert_eq!(
            restart_only_changes(&old, &evidence),
            ["evidence.durability"]
        );
        let bypass = config(&format!("[bypass]\nnflog_group = 100\n{BASE}"));
        assert_eq!(restart_only_changes(&old, &bypass), ["bypass.nflog_group"]);
    }

    #[tokio::test]
    async fn a_reload_applies_whole_or_not_at_all() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("palisade.toml");
        let base = BASE.replace(
            "/tmp/palisade-reload-test-evidence",
            &dir.join("evidence").display().to_string(),
        );
        std::fs::write(&path, &base).unwrap();
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let host = crate::host::addresses().unwrap();
        let policy = Arc::new(Policy::with_host(&running, &host));
        let served = Served::load(&running, policy, &metrics)
            .unwrap()
            .into_handle();
        let first = served.load().policy.hash().to_string();
        let mut reloader = Reloader::new(running, served.clone(), metrics.clone()).await;
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
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let path = dir.join("palisade.toml");
        // One org and the clients of no org: 2 x 10 records/s x 1140 bytes
        // for 2 minutes and a second, and a 1 MiB segment, fit 4 MiB.
        let base = BASE.replace(
            "dir = \"/tmp/palisade-reload-test-evidence\"",
            &format!(
                "dir = {:?}\nrotate_size = \"1MiB\"\nretain_size = \"4MiB\"\nretain_min_age = \"2m\"\nmax_records_per_second_per_org = 10",
                dir.join("evidence").display().to_string()
            ),
        );
        std::fs::write(&path, &base).unwrap();
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let policy = Arc::new(Policy::new(&running));
        let served = Served::load(&running, policy, &metrics)
            .unwrap()
            .into_handle();
        let hash = served.load().policy.hash().to_string();
        let mut reloader = Reloader::new(running.clone(), served.clone(), metrics.clone()).await;
        // A second org is a third budget: no longer within the store.
        let more = format!("{base}\n[[org]]\nname = \"beta\"\nclients = [\"198.19.2.0/24\"]\n");
        std::fs::write(&path, &more).unwrap();
        match prepare(&path, &running, (&hash, None), &[], &metrics) {
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
    async fn a_change_of_the_host_addresses_reloads_an_unchanged_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("palisade.toml");
        let evidence = tmp.path().join("evidence").display().to_string();
        std::fs::write(
            &path,
            BASE.replace("/tmp/palisade-reload-test-evidence", &evidence),
        )
        .unwrap();
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        // Served with addresses the host no longer has (here: none).
        let served = Served::load(&running, Arc::new(Policy::new(&running)), &metrics)
            .unwrap()
            .into_handle();
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

        // New addresses and an invalid file: one refused reload for the
        // file, one for the addresses, then quiet until either changes.
        let running = config::load(&path).unwrap();
        let metrics = Arc::new(Metrics::new(Arc::default()));
        let served = Served::load(&running, Arc::new(Policy::new(&running)), &metrics)
            .unwrap()
            .into_handle();
        let mut reloader = Reloader::new(running, served.clone(), metrics).await;
        std::fs::write(&path, "[[org]]\nname = 7\n").unwrap();
        assert_eq!(reloader.poll().await, Some(ReloadOutcome::Rejected));
        assert_eq!(reloader.poll().await, Some(ReloadOutcome::Rejected));
        assert_eq!(reloader.poll().await, None, "not retried every poll");
        assert!(served.load().policy.host_addresses().is_empty());
    }
}
