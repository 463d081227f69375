//! Containment demonstration: `palisade probe plan|run|report`.
//!
//! An assessor agrees a plan of network paths (each expected `allow` or
//! `deny`), runs it from inside the sandbox with real sockets
//! ([`run`]), and joins what the client saw with Palisade's verified
//! evidence on the Palisade side ([`report`]). A blocked attempt alone proves
//! little: the report tells a denial Palisade recorded apart from one some
//! other layer caused and from a probe that never reached its target.
//!
//! - [`plan`]: the plan format (TOML), its targets and its validation.
//! - [`generate`]: `probe plan`, a default plan generated from a policy
//!   (one probe per allow rule, canaries, standard bypass attempts).
//! - [`run`]: performs each probe within its own timeout and a total
//!   deadline, and writes `observations.json`; [`hello`] builds the
//!   ClientHellos it sends (with or without an ECH extension).
//! - [`fit`]: which verified records belong to a planned probe, by what
//!   Palisade recorded (pure).
//! - [`classify`]: the class an observation and its records make (pure).
//! - [`report`]: verifies the evidence chain first, classifies every
//!   observation, and builds the typed report (`report.json`).
//! - [`render`]: `report.md` and a self-contained `report.html`.
//! - [`volume`]: volume probes (a budgeted rule's budget plus a margin
//!   moved through it), how they run and how they are classified.

pub(crate) mod classify;
pub(crate) mod fit;
pub(crate) mod generate;
pub mod hello;
pub(crate) mod plan;
pub(crate) mod render;
pub mod report;
pub(crate) mod run;
pub(crate) mod volume;

use serde::{Deserialize, Serialize};

/// Format tag of `observations.json`.
pub const OBSERVATIONS_FORMAT: &str = "palisade-probe-observations/1";
/// Format tag of `report.json`.
pub const REPORT_FORMAT: &str = "palisade-probe-report/1";
/// Path prefix carrying a probe's marker in HTTP requests.
pub const MARKER_PATH: &str = "/palisade-probe/";
/// Header carrying a probe's marker in HTTP requests.
pub const MARKER_HEADER: &str = "X-Palisade-Probe";

/// How a probe reaches its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// Through the explicit proxy (CONNECT or absolute-form HTTP).
    Proxy,
    /// The sandbox's default path: plain sockets, no proxy settings.
    Direct,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Proxy => "proxy",
            Via::Direct => "direct",
        }
    }
}

/// The agreed outcome of a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    Allow,
    Deny,
}

impl Expect {
    pub fn as_str(self) -> &'static str {
        match self {
            Expect::Allow => "allow",
            Expect::Deny => "deny",
        }
    }
}

/// Which layer the plan counts on to deny a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layer {
    /// Palisade must record the denial (the default).
    #[default]
    Palisade,
    /// Any layer may stop it (routing, the gateway ruleset): Palisade never
    /// sees this kind of traffic (UDP other than DNS, IPv6 off the proxy,
    /// direct egress in explicit-proxy deployments).
    Any,
}

impl Layer {
    fn is_default(&self) -> bool {
        *self == Layer::Palisade
    }
}

/// What the report concludes about one probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// A deny probe got through, or Palisade allowed it: a finding.
    UnexpectedAllow,
    /// An allow probe that Palisade denied by policy: a finding.
    UnexpectedDeny,
    /// The probe could not establish anything (setup failed, upstream
    /// down, never reached Palisade), or what the sandbox reported does not
    /// fit Palisade's records.
    Inconclusive,
    /// The plan has the probe and the observations do not: it was not run,
    /// or its observation was dropped. A finding.
    Missing,
    /// Failed with no Palisade record: another layer stopped it.
    BlockedElsewhere,
    /// Palisade recorded the denial.
    EnforcedDeny,
    /// Palisade recorded the allow and the target answered.
    EnforcedAllow,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::UnexpectedAllow => "unexpected_allow",
            Class::UnexpectedDeny => "unexpected_deny",
            Class::Inconclusive => "inconclusive",
            Class::Missing => "missing",
            Class::BlockedElsewhere => "blocked_elsewhere",
            Class::EnforcedDeny => "enforced_deny",
            Class::EnforcedAllow => "enforced_allow",
        }
    }

    /// A finding: the environment does not match the agreed paths, or a
    /// planned probe has no observation.
    pub fn is_finding(self) -> bool {
        matches!(
            self,
            Class::UnexpectedAllow | Class::UnexpectedDeny | Class::Missing
        )
    }
}
