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
    /// The answers as recorded (none set: an empty list). Shared with
    /// the kept answer they came from, so a cached answer's record copies
    /// nothing, and a new query touches no shared count.
    pub(crate) answers: Option<Arc<[String]>>,
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
            answers: None,
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
        let mut rec = self.record_base();
        rec.host = self.name.clone();
        rec.answers = Some(self.answers.clone().unwrap_or_else(no_answers));
        rec.detail = self.detail.clone();
        rec
    }

    /// [`QueryState::record`], moving what the record shows (name,
    /// answers, detail) out of the state instead of copying it: for a
    /// caller done with them (a kept answer, whose reply is built from
    /// what was kept). A record made from the state afterwards has the
    /// same verdict, org, client and decider, for counting.
    pub(crate) fn take_record(&mut self) -> Record {
        let mut rec = self.record_base();
        rec.host = self.name.take();
        rec.answers = Some(self.answers.take().unwrap_or_else(no_answers));
        rec.detail = self.detail.take();
        rec
    }

    /// The record without its name, answers and detail.
    fn record_base(&self) -> Record {
        let mut rec = Record::decided(
            Kind::Dns,
            Mode::Dns,
            self.client,
            &self.verdict,
            &self.policy,
        );
        rec.qtype = self.qtype.map(qtype);
        rec.upstream = Some(self.upstream);
        rec.decider = self.decider.clone();
        rec
    }
}

/// An empty list of answers, for a record of a query that has none.
pub(crate) fn no_answers() -> Arc<[String]> {
    Arc::from([])
}

/// A record's `qtype`: the type's mnemonic (as hickory displays it).
fn qtype(t: RecordType) -> std::borrow::Cow<'static, str> {
    std::borrow::Cow::Borrowed(<&'static str>::from(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;
    use crate::evidence::Live;
    use crate::metrics::Metrics;
    use std::path::Path;

    /// The record taken out of a state is the record it showed, field by
    /// field; what is left counts as the same decision.
    #[test]
    fn a_taken_record_is_the_record_it_stood_as() {
        let c = config::from_str(
            "[[org]]\nname = \"acme\"\nclients = [\"198.18.0.0/24\"]\n[[org.allow]]\nhost = \"a.test\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let metrics = Arc::new(Metrics::new(Arc::new(Live::default())));
        let served = Served::load(&c, Arc::new(Policy::new(&c)), &metrics).unwrap();
        let mut state = QueryState::new(&served, "198.18.0.7:5353".parse().unwrap());
        state.qtype = Some(RecordType::AAAA);
        state.refuse(Reason::LimitExceeded, Some("a detail".into()));
        state.name = Some("a.test".into());
        state.answers = Some(vec!["AAAA 2001:db8::1".into()].into());
        state.upstream = true;
        let shown = serde_json::to_value(state.record()).unwrap();
        assert_eq!(shown["qtype"], "AAAA");
        assert_eq!(serde_json::to_value(state.take_record()).unwrap(), shown);
        let left = state.record();
        assert_eq!(
            (left.org, left.reason),
            (Some("acme".into()), Reason::LimitExceeded)
        );
        assert_eq!((left.host, left.answers), (None, Some(no_answers())));
    }
}
