//! Policy reload: on SIGHUP or when the config file's content changes
//! (polled, so that a Kubernetes ConfigMap's symlink swap is seen too), the
//! file is loaded and validated whole. A valid policy is swapped in
//! atomically for the proxy and the DNS shim: new decisions use it, open
//! tunnels keep running, listeners keep their sockets. An invalid file is
//! rejected whole and the old policy keeps serving. Settings other than the
//! orgs (listeners, limits, DNS and evidence settings) need a restart; a
//! reload that changes them says so and keeps the running values.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::admin::{Health, PolicyInfo};
use crate::config::{self, Config};
use crate::dns::{decide::OrgDns, ShimHandle};
use crate::policy::Policy;
use crate::proxy::Ctx;

/// How often the config file's content is checked for changes.
pub const DEFAULT_CONFIG_POLL_INTERVAL: Duration = Duration::from_secs(2);

/// Everything a reload swaps.
pub struct Reloader {
    pub path: PathBuf,
    pub running: Config,
    pub ctx: Arc<Ctx>,
    pub shim: ShimHandle,
    pub health: Arc<Health>,
    /// Digest of the file content last loaded (valid or not).
    seen: Option<[u8; 32]>,
}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The new policy is served.
    Applied { hash: String },
    /// The file is valid and its policy is the one already served.
    Unchanged,
    /// The file is invalid; the old policy keeps serving.
    Rejected,
}

fn digest(path: &Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

/// Write the canonical policy text of `hash` beside the evidence, so any
/// record can be re-explained later (`DIR/policies/HASH.json`).
pub fn store_policy_text(evidence_dir: &Path, config: &Config, hash: &str) {
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

/// Names of the settings whose change needs a restart.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let differs =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
    if differs(&old.proxy, &new.proxy) {
        changed.push("[proxy]");
    }
    if differs(&old.dns, &new.dns) {
        changed.push("[dns]");
    }
    if differs(&old.admin, &new.admin) {
        changed.push("[admin]");
    }
    if differs(&old.evidence, &new.evidence) {
        changed.push("[evidence]");
    }
    changed
}

impl Reloader {
    pub fn new(
        path: PathBuf,
        running: Config,
        ctx: Arc<Ctx>,
        shim: ShimHandle,
        health: Arc<Health>,
    ) -> Reloader {
        let seen = digest(&path);
        Reloader {
            path,
            running,
            ctx,
            shim,
            health,
            seen,
        }
    }

    /// Reload if the file's content changed since it was last read.
    pub fn poll(&mut self) -> Option<Outcome> {
        let now = digest(&self.path);
        if now.is_none() || now == self.seen {
            return None;
        }
        Some(self.reload("config file changed"))
    }

    /// Load, validate and, if valid, serve the file's policy.
    pub fn reload(&mut self, why: &str) -> Outcome {
        self.seen = digest(&self.path);
        let m = crate::metrics::metrics();
        let new = match config::load(&self.path) {
            Ok(c) => c,
            Err(errors) => {
                for e in &errors.0 {
                    warn!(error = %e, "policy reload rejected; the old policy keeps serving");
                }
                m.policy_reloads_total.with_label_values(&["error"]).inc();
                return Outcome::Rejected;
            }
        };
        let restart = restart_only_changes(&self.running, &new);
        if !restart.is_empty() {
            warn!(
                sections = ?restart,
                "reload: these settings change only on restart; the running values are kept"
            );
        }
        // Own addresses come from the listeners actually bound.
        let policy = Arc::new(Policy::compile(&new.orgs, self.running.own_addresses()));
        m.policy_reloads_total.with_label_values(&["ok"]).inc();
        let old_hash = self.ctx.policy.load().hash().to_string();
        if policy.hash() == old_hash {
            info!(why, policy = %old_hash, "reload: policy unchanged");
            return Outcome::Unchanged;
        }
        let hash = policy.hash().to_string();
        store_policy_text(&self.running.evidence.dir, &new, &hash);

        // Swap: the proxy first, then the DNS shim, then what reports them.
        self.ctx.policy.store(policy.clone());
        let mut shim = (**self.shim.load()).clone();
        shim.policy = policy.clone();
        shim.orgs = new.orgs.iter().map(OrgDns::from_config).collect();
        shim.policy_hash = policy.hash_arc().clone();
        self.shim.store(Arc::new(shim));

        let mut info = PolicyInfo::new(&new, &hash);
        info.config = self.path.display().to_string();
        match self.health.policy.write() {
            Ok(mut p) => *p = Arc::new(info),
            Err(p) => *p.into_inner() = Arc::new(info),
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        crate::metrics::set_policy(&hash, now.as_secs_f64());
        crate::metrics::init_series(
            new.orgs.iter().map(|o| o.name.as_str()),
            crate::metrics::MODES,
        );
        info!(why, from = %old_hash, to = %hash, orgs = policy.org_count(), rules = policy.rule_count(), "policy reloaded");
        self.running.orgs = new.orgs;
        Outcome::Applied { hash }
    }
}
