//! The enforcement check (`[enforcement]`): Palisade's transparent mode is
//! the sandboxes' only path only while the gateway's nftables ruleset is
//! loaded. At start and every `check_interval`, the tables the ruleset
//! file defines are compared ([`compare`], pure) with what the kernel has
//! loaded ([`nft`], the edge: `nft -j`, off the runtime, within a timeout).
//!
//! While they differ (or the kernel's ruleset cannot be read), enforcement
//! is not verified: `/readyz` fails, `palisade_enforcement_ok` is 0, and
//! with `mode = "required"` every org's new connections are refused
//! `enforcement_missing` (one ruleset is the one path of every sandbox
//! behind the gateway). Each change is recorded, `kind = "enforcement"`:
//! `event = "failed"` naming what differs, `event = "verified"` when the
//! kernel holds the file's tables again. A required ruleset that is not
//! loaded at start stops the start.

pub(crate) mod compare;
pub(crate) mod nft;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{ConfigError, EnforcementConfig, EnforcementMode};
use crate::evidence::{Event, Evidence, Kind, Mode, Record};
use crate::policy::{Reason, Verdict};
use compare::Ruleset;

/// The ruleset the file defines, or why it cannot be read, located: in
/// the file where nft says where, else at the config's `ruleset` key.
pub(crate) fn defined(config: &EnforcementConfig) -> Result<Ruleset, ConfigError> {
    let at = |message: String| ConfigError {
        path: config.at.path.clone(),
        line: config.at.line,
        col: config.at.col,
        message,
    };
    let file = config.ruleset.display();
    if let Err(e) = std::fs::metadata(&config.ruleset) {
        return Err(at(format!("enforcement.ruleset {file}: {e}")));
    }
    match nft::defined(&config.ruleset, nft::NFT_TIMEOUT) {
        Ok(set) if set.tables().next().is_none() => Err(at(format!(
            "enforcement.ruleset {file} defines no table: nothing to check"
        ))),
        Ok(set) => Ok(set),
        Err(nft::NftError::Failed { stderr, .. }) => match nft::located(&stderr) {
            Some((path, line, col, message)) => Err(ConfigError {
                path,
                line,
                col,
                message: format!("enforcement ruleset does not load: {message}"),
            }),
            None => Err(at(format!(
                "enforcement.ruleset {file} does not load: {}",
                stderr.lines().next().unwrap_or_default()
            ))),
        },
        Err(e) => Err(at(format!("enforcement.ruleset {file}: {e}"))),
    }
}

/// What one check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    Verified,
    /// What differs, or why the kernel's ruleset could not be read.
    NotVerified(Vec<String>),
}

/// Compare `expected` with what the kernel has loaded (blocking).
pub(crate) fn check(expected: &Ruleset) -> Found {
    match nft::loaded(nft::NFT_TIMEOUT) {
        Ok(loaded) => {
            let diffs = compare::differences(expected, &loaded);
            if diffs.is_empty() {
                Found::Verified
            } else {
                Found::NotVerified(diffs.iter().map(ToString::to_string).collect())
            }
        }
        Err(e) => Found::NotVerified(vec![format!("the loaded ruleset cannot be read: {e}")]),
    }
}

/// Whether enforcement is verified now, shared by the check, readiness,
/// the metric and the proxy's admission.
#[derive(Debug)]
pub(crate) struct Enforcement {
    pub ruleset: PathBuf,
    pub mode: EnforcementMode,
    verified: AtomicBool,
    gauge: prometheus::IntGauge,
}

impl Enforcement {
    pub(crate) fn new(config: &EnforcementConfig, gauge: prometheus::IntGauge) -> Enforcement {
        gauge.set(0);
        Enforcement {
            ruleset: config.ruleset.clone(),
            mode: config.mode,
            verified: AtomicBool::new(false),
            gauge,
        }
    }

    pub(crate) fn is_verified(&self) -> bool {
        self.verified.load(Ordering::Relaxed)
    }

    /// Whether new connections are refused now (`enforcement_missing`):
    /// a required ruleset that is not verified. Every org is behind it.
    pub(crate) fn refuses(&self) -> bool {
        self.mode == EnforcementMode::Required && !self.is_verified()
    }

    /// The detail of a refusal.
    pub(crate) fn refusal_detail(&self) -> String {
        format!(
            "the gateway ruleset {} is not loaded as written (enforcement mode required)",
            self.ruleset.display()
        )
    }

    /// Take what a check found; `true` if it changed the state.
    fn set(&self, found: &Found) -> bool {
        let now = *found == Found::Verified;
        self.gauge.set(i64::from(now));
        self.verified.swap(now, Ordering::Relaxed) != now
    }

    /// The record of `found`, under `policy`.
    fn record(&self, found: &Found, policy: &Arc<str>) -> Record {
        let (reason, event, detail, differs) = match found {
            Found::Verified => (
                Reason::RuleMatch,
                Event::Verified,
                format!(
                    "the gateway ruleset {} is loaded as written",
                    self.ruleset.display()
                ),
                None,
            ),
            Found::NotVerified(d) => (
                Reason::EnforcementMissing,
                Event::Failed,
                format!(
                    "the gateway ruleset {} is not loaded as written ({} difference{}; mode {})",
                    self.ruleset.display(),
                    d.len(),
                    if d.len() == 1 { "" } else { "s" },
                    self.mode.as_str()
                ),
                Some(d.clone()),
            ),
        };
        let verdict = Verdict {
            org: None,
            reason,
            rule: None,
            would_deny: None,
        };
        let mut record = Record::decision(
            Kind::Enforcement,
            Mode::Transparent,
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            &verdict,
            policy,
        );
        record.client = None;
        record.event = event;
        record.detail = Some(detail);
        record.differs = differs;
        record
    }
}

/// Check now and take the result: its record is written (every change,
/// and the first check); what was found is returned.
pub(crate) async fn check_now(
    state: &Enforcement,
    expected: &Arc<Ruleset>,
    evidence: &Evidence,
    policy: &Arc<str>,
    first: bool,
) -> Found {
    let expected = expected.clone();
    let found = tokio::task::spawn_blocking(move || check(&expected))
        .await
        .unwrap_or_else(|e| Found::NotVerified(vec![format!("the check failed: {e}")]));
    if state.set(&found) || first {
        match &found {
            Found::Verified => info!(ruleset = %state.ruleset.display(), "enforcement verified"),
            Found::NotVerified(d) => {
                warn!(ruleset = %state.ruleset.display(), differs = ?d, "enforcement not verified")
            }
        }
        let mut record = state.record(&found, policy);
        if let Err(e) = evidence.write(&mut record).await {
            warn!(error = %e, "enforcement record not written");
        }
    }
    found
}

/// Check every `interval` until shutdown.
pub(crate) async fn watch(
    state: Arc<Enforcement>,
    expected: Arc<Ruleset>,
    evidence: Arc<Evidence>,
    policy: impl Fn() -> Arc<str>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                check_now(&state, &expected, &evidence, &policy(), false).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigLocation;

    fn state(mode: EnforcementMode) -> Enforcement {
        let config = EnforcementConfig {
            ruleset: "gw.nft".into(),
            mode,
            check_interval: Duration::from_secs(1),
            at: ConfigLocation {
                path: "t.toml".into(),
                line: 1,
                col: 1,
            },
        };
        Enforcement::new(&config, prometheus::IntGauge::new("g", "g").unwrap())
    }

    #[test]
    fn only_a_required_ruleset_not_verified_refuses_and_each_change_is_one() {
        let missing = Found::NotVerified(vec!["table inet palisade is not loaded".into()]);
        let required = state(EnforcementMode::Required);
        // Before the first check nothing is verified.
        assert!(!required.is_verified() && required.refuses());
        assert!(required.set(&Found::Verified), "a change");
        assert!(!required.set(&Found::Verified), "no change");
        assert!(!required.refuses() && required.gauge.get() == 1);
        assert!(required.set(&missing));
        assert!(!required.set(&missing));
        assert!(required.refuses() && required.gauge.get() == 0);
        let advisory = state(EnforcementMode::Advisory);
        advisory.set(&missing);
        assert!(!advisory.is_verified() && !advisory.refuses());
    }

    #[test]
    fn records_name_what_differs_and_no_client() {
        let s = state(EnforcementMode::Required);
        let policy: Arc<str> = "p0".into();
        let missing = Found::NotVerified(vec!["a".into(), "b".into()]);
        let r = s.record(&missing, &policy);
        assert_eq!(
            (r.kind, r.event, r.reason),
            (Kind::Enforcement, Event::Failed, Reason::EnforcementMissing)
        );
        assert_eq!(r.decision_str(), "deny");
        assert_eq!(r.client, None);
        assert_eq!(r.differs, Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(
            r.detail.as_deref(),
            Some("the gateway ruleset gw.nft is not loaded as written (2 differences; mode required)")
        );
        let r = s.record(&Found::Verified, &policy);
        assert_eq!(
            (r.event, r.decision_str(), r.differs),
            (Event::Verified, "allow", None)
        );
    }
}
