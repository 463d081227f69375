//! The record's `decider` field: what the decider (`crate::decider`) said
//! of a miss, or the deny that stood for an error.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What the decider said (or what stood for it), as the record's
/// `decider` field carries it. Fields in sorted order: the chain's
/// canonical form sorts nested keys too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Said {
    /// `allow`, `deny` or `ask`: what the miss becomes (`deny` for any
    /// error).
    pub(crate) decision: Answer,
    /// Why it stands for a deny it did not give: `timeout after 500ms`,
    /// `status 500`, `not a decider answer: ...`, `busy: ...`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
    /// An allow's TTL, as the decider wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ttl: Option<String>,
}

/// The three answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Answer {
    Allow,
    Deny,
    Ask,
}

impl Said {
    pub(crate) fn failed(error: String) -> Said {
        Said {
            decision: Answer::Deny,
            ttl: None,
            error: Some(error),
        }
    }

    /// The `answer` label of `palisade_decider_consultations_total`:
    /// `allow`, `deny`, `ask`, `error` or `busy`.
    pub(crate) fn label(&self) -> &'static str {
        match (&self.error, self.decision) {
            (Some(e), _) if e.starts_with("busy") => "busy",
            (Some(_), _) => "error",
            (None, Answer::Allow) => "allow",
            (None, Answer::Deny) => "deny",
            (None, Answer::Ask) => "ask",
        }
    }

    /// An allow's TTL, parsed (`None`: this decision only, or not an allow).
    pub(crate) fn ttl(&self) -> Option<Duration> {
        match self.decision {
            Answer::Allow => self
                .ttl
                .as_deref()
                .and_then(|t| humantime::parse_duration(t).ok()),
            _ => None,
        }
    }
}
