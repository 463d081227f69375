//! One query's own state, the DNS counterpart of the proxy's `Conn`
//! (`proxy/conn.rs`): carried from its arrival through the
//! decision, forwarding and filtering to its answer.
//!
//! A [`QueryState`] holds who asked (client, org by address), under which
//! policy version, what was asked (the name as records show it, the
//! type), the verdict as it stands and what the answer carried. The
//! evidence record is built from it only when it is written
//! ([`QueryState::record`]); every DNS record has `answers` and
//! `upstream`.

use std::net::SocketAddr;
use std::sync::Arc;

use hickory_server::proto::rr::RecordType;

use crate::evidence::{Kind, Mode, Record};
use crate::policy::{OrgRef, Policy, Reason, Verdict};
use crate::served::Served;

/// A query, from its arrival to its answer.
#[derive(Debug, Clone)]
pub(crate) struct QueryState {
    /// The policy it is decided and recorded under.
    policy: Arc<Policy>,
    pub(crate) client: SocketAddr,
    /// The client's org, by its source address.
    pub(crate) org: Option<OrgRef>,
    /// The name as every record shows it (host names normalised, without
    /// the trailing dot; others as sent, cut short); none before the
    /// question is read.
    pub(crate) name: Option<String>,
    pub(crate) qtype: Option<RecordType>,
    /// The verdict as it stands: set when the query is refused
    /// ([`QueryState::refuse`]) or decided ([`QueryState::decided`]).
    pub(crate) verdict: Verdict,
    /// The answers as recorded.
    pub(crate) answers: Vec<String>,
    /// Whether the upstream was asked.
    pub(crate) upstream: bool,
    pub(crate) detail: Option<String>,
    /// What the decider said of this miss (the record's `decider` field).
    pub(crate) decider: Option<crate::decider::Said>,
    /// The receive round it came in with, which writes its answer's
    /// record with the others of the round ([`super::round`]); none: it
    /// writes its own.
    pub(crate) round: Option<Arc<super::round::Round>>,
}

impl QueryState {
    /// A query from `client` under `served`, not decided yet: until it is,
    /// it stands as the refusal of a malformed query, the first check.
    pub(crate) fn new(served: &Served, client: SocketAddr) -> QueryState {
        let org = served.policy.org_for(client.ip());
        QueryState {
            policy: served.policy.clone(),
            client,
            verdict: Verdict {
                org: org.clone(),
                reason: Reason::BadRequest,
                rule: None,
                would_deny: None,
            },
            org,
            name: None,
            qtype: None,
            answers: Vec::new(),
            upstream: false,
            detail: None,
            decider: None,
            round: None,
        }
    }

    /// Refused for `reason` before any decision (of the client's org, no
    /// rule), with `detail`.
    pub(crate) fn refuse(&mut self, reason: Reason, detail: Option<String>) {
        self.verdict = Verdict {
            org: self.org.clone(),
            reason,
            rule: None,
            would_deny: None,
        };
        self.detail = detail;
    }

    /// Decided: `verdict` for `name`.
    pub(crate) fn decided(&mut self, verdict: Verdict, name: String) {
        self.verdict = verdict;
        self.name = Some(name);
    }

    /// The org the verdict names.
    pub(crate) fn verdict_org(&self) -> Option<&OrgRef> {
        self.verdict.org.as_ref()
    }

    /// Counted as what happened when its record could not be written:
    /// refused, unrecorded.
    pub(crate) fn unrecorded(&mut self) {
        self.verdict.reason = Reason::EvidenceUnavailable;
        self.verdict.would_deny = None;
    }

    /// The decision record of this query as it stands.
    pub(crate) fn record(&self) -> Record {
        let mut rec = Record::decided(
            Kind::Dns,
            Mode::Dns,
            self.client,
            &self.verdict,
            &self.policy,
        );
        rec.host = self.name.clone();
        rec.qtype = self.qtype.map(|t| t.to_string());
        rec.answers = Some(self.answers.clone());
        rec.upstream = Some(self.upstream);
        rec.detail = self.detail.clone();
        rec.decider = self.decider.clone();
        rec
    }
}
