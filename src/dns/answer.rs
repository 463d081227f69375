//! One query's path through the shim, in short steps, carrying its
//! [`QueryState`]:
//!
//! 1. [`well_formed`]: a query, opcode QUERY, exactly one question; else
//!    FORMERR/NOTIMP and a `bad_request` record.
//! 2. [`Shim::admit`]: the client's query rate and the query budgets
//!    (global, per org or per address), held until the answer; then the
//!    class.
//! 3. [`Shim::answer_kept`]: a question this org asked before under the same
//!    served version gets what the full path made of it, recorded and bound
//!    again.
//! 4. The policy's decision ([`decide_query`]); an answer is paid for from
//!    its org's evidence budget before anything is forwarded.
//! 5. The decided action: a refusal, an RFC 8482 HINFO, a PTR from this
//!    org's bindings, or forwarding ([`Shim::forward`], in
//!    [`super::filter`]) and [`Shim::deliver`].
//! 6. Evidence: an answer's record is written before the answer
//!    ([`Shim::finish`]); a refusal's is queued or summarised
//!    ([`Shim::record_refusal`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{LowerQuery, MessageType, OpCode, ResponseCode};
use hickory_server::proto::rr::rdata::{HINFO, PTR};
use hickory_server::proto::rr::{DNSClass, Name, RData, Record, RecordType};
use hickory_server::proto::serialize::binary::BinEncodable;
use hickory_server::server::{Request, RequestInfo};
use tracing::{debug, warn};

use super::budget::InFlight;
use super::cache::{Kept, Key, KeyRef, BIND_REFRESH};
use super::decide::{decide_query, past_budget, Action, QueryDecision};
use super::encode::{blocked, denied_rcode, encode, encode_kept, encode_raw, Reply, EDE_BLOCKED};
use super::filter::{describe, filter, Filtered, Forwarded};
use super::query::QueryState;
use super::refusals::Recorded;
use super::round::{self, Round};
use super::shim::Shim;
use super::wire::{Question, MAX_NAME};
use crate::evidence::Mode;
use crate::handout::synthetic::{Answer, Family, SYNTHETIC_TTL};
use crate::limits::client_key;
use crate::metrics::DnsSeries;
use crate::policy::{OrgRef, Policy, Reason, Verdict};
use crate::resolve::RecordsError;
use crate::served::Served;

/// Longest query name kept in evidence for a name that is not a host name.
const MAX_SHOWN_NAME: usize = 300;

/// The request's one question, if it is a well-formed query; else what is
/// wrong with it and the rcode that says so.
fn well_formed(request: &Request) -> Result<RequestInfo<'_>, (&'static str, ResponseCode)> {
    if request.metadata.message_type != MessageType::Query {
        return Err(("not a query", ResponseCode::FormErr));
    }
    if request.metadata.op_code != OpCode::Query {
        return Err(("unsupported opcode", ResponseCode::NotImp));
    }
    request
        .request_info()
        .map_err(|_| ("not exactly one question", ResponseCode::FormErr))
}

/// The name as every record shows it: host names without the trailing
/// dot, others as sent (cut short).
fn shown_name(query: &LowerQuery) -> String {
    shown_text(&query.name().to_string())
}

/// [`shown_name`] of a name as hickory shows it.
fn shown_text(qname: &str) -> String {
    super::decide::shown_name(qname).unwrap_or_else(|| qname.chars().take(MAX_SHOWN_NAME).collect())
}

/// What [`Shim::kept_now`] made of a query.
pub(crate) enum Now {
    /// Not a kept answer: nothing was done, [`Shim::respond_wire`] answers it.
    Elsewhere,
    /// Answered: the response (empty: none).
    Answered(Vec<u8>),
    /// Refused before its decision: [`Shim::refused_wire`] records and
    /// answers it.
    Refused(Box<Refused>),
    /// Its record waits for the writer: [`Shim::kept_later`] writes it
    /// and answers.
    Later(Box<Later>),
}

/// A query [`Shim::kept_now`] refused for a limit, for
/// [`Shim::refused_wire`].
pub(crate) struct Refused {
    pub state: QueryState,
    /// The name as asked ([`Question::shown`]).
    pub shown: String,
    pub limit: &'static str,
    /// Its place in the query budgets, when it had taken one.
    pub held: Option<InFlight>,
}

impl Refused {
    fn new(
        state: QueryState,
        q: &Question<'_>,
        limit: &'static str,
        held: Option<InFlight>,
    ) -> Refused {
        Refused {
            state,
            shown: q.shown(),
            limit,
            held,
        }
    }
}

/// A kept answer whose record waits, for [`Shim::kept_later`].
pub(crate) struct Later {
    state: QueryState,
    /// The answer's record, built and not stamped.
    rec: crate::evidence::Record,
    kept: Arc<Kept>,
    org: OrgRef,
    reply: Reply,
    held: InFlight,
    started: Instant,
    now: Instant,
}

/// What forwarding made of a query, into its state (for its record) and
/// its reply (its TTLs counted down by `spent` seconds), before the
/// record is written.
fn delivering(state: &mut QueryState, fwd: &Forwarded, spent: u32) -> Reply {
    state.verdict = fwd.verdict.clone();
    state.name = Some(fwd.host.clone());
    state.answers = Some(fwd.described.clone());
    state.upstream = true;
    state.detail = fwd.detail.clone();
    Reply {
        rcode: fwd.rcode,
        answers: fwd.answers.clone(),
        ede: None,
        spent,
    }
}

impl Shim {
    /// Answer one decoded request: the encoded response (see
    /// [`super::encode`]).
    pub(crate) async fn respond(
        &self,
        request: &Request,
        protocol: Protocol,
        round: Option<&Arc<Round>>,
    ) -> Vec<u8> {
        let reply = self.answer(request, round).await;
        encode(request, &reply, protocol)
    }

    /// Record a DNS-over-TCP connection closed at once over `limit`.
    pub(crate) async fn refuse_connection(&self, src: SocketAddr, limit: &str) {
        let served = self.served.load_full();
        let mut query = QueryState::new(&served, src);
        query.refuse(Reason::LimitExceeded, Some(limit.into()));
        self.record_refusal(&query, Duration::ZERO).await;
    }

    /// Decide, forward if allowed, record (with `round`'s records when it
    /// came in one), and build the reply.
    pub(super) async fn answer(&self, request: &Request, round: Option<&Arc<Round>>) -> Reply {
        let started = Instant::now();
        // What is served now: this query is decided and recorded under it.
        let served = self.served.load_full();
        let mut state = QueryState::new(&served, request.src());
        state.round = round.cloned();
        let query = match well_formed(request) {
            Ok(info) => info.query,
            Err((detail, rcode)) => {
                state.refuse(Reason::BadRequest, Some(detail.into()));
                self.record_refusal(&state, Duration::ZERO).await;
                return Reply::empty(rcode);
            }
        };
        let qtype = query.query_type();
        state.qtype = Some(qtype);
        // Over a limit, the record waits for nothing.
        let _held = match self.admit(&state, started) {
            Ok(held) => held,
            Err(limit) => {
                let name = shown_name(query);
                return self
                    .refuse_early(
                        &mut state,
                        name,
                        Reason::LimitExceeded,
                        limit,
                        Duration::ZERO,
                    )
                    .await;
            }
        };
        // Within the budgets: a refusal record may wait for room.
        let wait = self.config.query_timeout.get();
        if query.query_class() != DNSClass::IN {
            let name = shown_name(query);
            return self
                .refuse_early(&mut state, name, Reason::BadRequest, "class", wait)
                .await;
        }
        let now = started;
        let name = query.name().to_bytes().unwrap_or_default().into();
        let key = Self::key(&state, name, qtype);
        if let Some(kept) = key.as_ref().and_then(|k| self.cache.get(&served, k, now)) {
            return self
                .answer_kept(&mut state, || shown_name(query), &kept, started, now)
                .await;
        }
        self.decided(&served, &mut state, query, key, started, now)
            .await
    }

    /// Answer a plain query read from the wire ([`super::wire`]): the
    /// steps of [`Shim::answer`] in its order, with a kept answer's
    /// response built from one kept on the wire; hickory reads the query
    /// only when the policy decides it (or a refusal is encoded).
    pub(crate) async fn respond_wire(
        &self,
        q: &Question<'_>,
        raw: &[u8],
        src: SocketAddr,
        protocol: Protocol,
        round: Option<&Arc<Round>>,
    ) -> Vec<u8> {
        let started = Instant::now();
        let served = self.served.load_full();
        let mut state = QueryState::new(&served, src);
        state.round = round.cloned();
        let qtype = RecordType::from(q.qtype);
        state.qtype = Some(qtype);
        let shown = || shown_text(&q.shown());
        let _held = match self.admit(&state, started) {
            Ok(held) => held,
            Err(limit) => {
                return self
                    .refused_wire(state, q.shown(), limit, raw, src, protocol)
                    .await
            }
        };
        // The class is IN: nothing else is read from the wire. The clock
        // read at the start serves the cache's age.
        let now = started;
        let key = Self::key(&state, q.lower_name(), qtype);
        if let Some(kept) = key.as_ref().and_then(|k| self.cache.get(&served, k, now)) {
            let reply = self
                .answer_kept(&mut state, shown, &kept, started, now)
                .await;
            return encode_kept(&kept, q, raw, src, protocol, &reply);
        }
        let Ok(request) = Request::from_bytes(raw.to_vec(), src, protocol) else {
            return Vec::new();
        };
        let Ok(info) = request.request_info() else {
            return Vec::new();
        };
        let reply = self
            .decided(&served, &mut state, info.query, key, started, now)
            .await;
        encode(&request, &reply, protocol)
    }

    /// A plain query whose answer is kept ([`Shim::respond_wire`]'s
    /// common case), answered at once on the caller's thread: admitted,
    /// paid for, recorded ([`crate::evidence::Evidence::write_now`]) and
    /// encoded without a future, a task or a round. [`Now::Elsewhere`]
    /// (nothing done) when its answer is not kept; what needs to wait (a
    /// refusal's record, a record while another caller writes) is handed
    /// back to be finished by [`Shim::refused_wire`] or
    /// [`Shim::kept_later`], as the same steps.
    pub(crate) fn kept_now(
        &self,
        q: &Question<'_>,
        raw: &[u8],
        src: SocketAddr,
        protocol: Protocol,
    ) -> Now {
        let started = Instant::now();
        // A guard, not a count of its own: this returns before any wait.
        let served = self.served.load();
        let mut state = QueryState::new(&served, src);
        let qtype = RecordType::from(q.qtype);
        state.qtype = Some(qtype);
        // One clock read serves the decision's timing and the cache's age.
        let now = started;
        // Kept answers are keyed by org: a client in none has none.
        let Some(org) = state.org.clone() else {
            return Now::Elsewhere;
        };
        let mut lower = [0u8; MAX_NAME];
        let Some(name) = q.lower_name_in(&mut lower) else {
            return Now::Elsewhere;
        };
        let key = KeyRef {
            org: org.index,
            name,
            qtype,
        };
        let Some(kept) = self.cache.get(&served, &key, now) else {
            return Now::Elsewhere;
        };
        let held = match self.admit(&state, started) {
            Ok(held) => held,
            Err(limit) => return Now::Refused(Box::new(Refused::new(state, q, limit, None))),
        };
        if let Err(limit) = self.refusals.pay(&Some(org.name.clone()), now) {
            return Now::Refused(Box::new(Refused::new(state, q, limit, Some(held))));
        }
        let reply = delivering(&mut state, &kept.fwd, kept.age(now));
        let mut rec = state.take_record();
        let Some(written) = self.evidence.write_now(&mut rec) else {
            return Now::Later(Box::new(Later {
                state,
                rec,
                kept,
                org,
                reply,
                held,
                started,
                now,
            }));
        };
        let written = written.map(|()| rec).map_err(|e| e.to_string());
        let reply = self.kept_reply(&mut state, &org, &kept, reply, written, started, now);
        drop(held);
        Now::Answered(encode_kept(&kept, q, raw, src, protocol, &reply))
    }

    /// The rest of [`Shim::kept_now`] for a record that had to wait:
    /// written as [`Shim::finish`] writes it, then answered the same way.
    pub(crate) async fn kept_later(
        &self,
        later: Later,
        raw: &[u8],
        src: SocketAddr,
        protocol: Protocol,
    ) -> Vec<u8> {
        let Later {
            mut state,
            rec,
            kept,
            org,
            reply,
            held,
            started,
            now,
        } = later;
        let Some(q) = super::wire::question(raw) else {
            return Vec::new();
        };
        let written = self.write(None, rec).await;
        let reply = self.kept_reply(&mut state, &org, &kept, reply, written, started, now);
        let bytes = encode_kept(&kept, &q, raw, src, protocol, &reply);
        drop(held);
        bytes
    }

    /// A plain query refused before its decision for `limit` (the
    /// client's query rate, the query budgets, the org's evidence budget):
    /// recorded as a refusal, answered REFUSED.
    pub(crate) async fn refused_wire(
        &self,
        mut state: QueryState,
        shown: String,
        limit: &'static str,
        raw: &[u8],
        src: SocketAddr,
        protocol: Protocol,
    ) -> Vec<u8> {
        let reply = self
            .refuse_early(
                &mut state,
                shown_text(&shown),
                Reason::LimitExceeded,
                limit,
                Duration::ZERO,
            )
            .await;
        encode_raw(raw, src, protocol, &reply)
    }

    /// A kept answer's reply once its record was written (or not), its
    /// addresses bound, timed as a decision.
    #[allow(clippy::too_many_arguments)]
    fn kept_reply(
        &self,
        state: &mut QueryState,
        org: &OrgRef,
        kept: &Kept,
        reply: Reply,
        written: round::Outcome,
        started: Instant,
        now: Instant,
    ) -> Reply {
        let reply = self.finished(state, reply, written, Some(&kept.series));
        let reply = self.delivered(org, kept, reply, now);
        self.metrics.time_decision(Mode::Dns, started.elapsed());
        reply
    }

    /// The cache's key for `name` (in lower case on the wire) asked by
    /// `state`'s org; none for a client in no org.
    fn key(state: &QueryState, name: Box<[u8]>, qtype: RecordType) -> Option<Key> {
        let org = state.org.as_ref()?;
        Some(Key {
            org: org.index,
            name,
            qtype,
        })
    }

    /// The policy's decision and what follows it, timed as a decision.
    async fn decided(
        &self,
        served: &Arc<Served>,
        state: &mut QueryState,
        query: &LowerQuery,
        key: Option<Key>,
        started: Instant,
        now: Instant,
    ) -> Reply {
        let wait = self.config.query_timeout.get();
        match self.decide(served, state, query, key, wait, now).await {
            Ok(reply) => {
                self.metrics.time_decision(Mode::Dns, started.elapsed());
                reply
            }
            Err(refused) => refused,
        }
    }

    /// The policy's decision and what it says to do, within `wait` for a
    /// refusal's record. `Err`: refused before anything decided was done
    /// (the org's evidence budget spent, no org to forward for), not
    /// timed as a decision.
    async fn decide(
        &self,
        served: &Arc<Served>,
        state: &mut QueryState,
        query: &LowerQuery,
        key: Option<Key>,
        wait: Duration,
        now: Instant,
    ) -> Result<Reply, Reply> {
        let qname = query.name().to_string();
        let qtype = query.query_type();
        let decision = decide_query(
            &served.policy,
            &served.dns,
            state.client.ip(),
            &qname,
            qtype,
        );
        let decision = self.missed(served, state, decision, qtype).await;
        let decision = self.spend_name(&served.policy, decision, now);
        // An answer's record is paid for from the org's evidence budget
        // before anything is forwarded; spent, the query is refused (and
        // its refusal summarised).
        let answers = matches!(
            decision.action,
            Action::Forward | Action::AnyHinfo | Action::Ptr(_) | Action::Synthetic(_)
        );
        let paid = if answers {
            self.refusals
                .pay(&decision.verdict.org.as_ref().map(|o| o.name.clone()), now)
        } else {
            Ok(())
        };
        if let Err(limit) = paid {
            let name = shown_name(query);
            let refused = self
                .refuse_early(state, name, Reason::LimitExceeded, limit, Duration::ZERO)
                .await;
            return Err(refused);
        }
        let host = decision.name.clone().unwrap_or_else(|| shown_name(query));
        state.decided(decision.verdict, host);
        Ok(match decision.action {
            Action::Refuse => {
                self.refuse_decided(state, ResponseCode::Refused, wait)
                    .await
            }
            Action::Denied(style) => {
                let mut reply = self.refuse_decided(state, denied_rcode(style), wait).await;
                if state.verdict.reason == Reason::ApprovalPending {
                    // The EDE text names the approval and the name.
                    if let (Some((_, text)), Some(detail)) = (reply.ede.as_mut(), &state.detail) {
                        text.push_str("; ");
                        text.push_str(detail);
                    }
                }
                reply
            }
            Action::NxDomain => {
                self.record_refusal(state, wait).await;
                Reply::empty(ResponseCode::NXDomain)
            }
            Action::NoData => {
                let synthetic_org = state
                    .verdict_org()
                    .is_some_and(|o| served.dns.get(o.index).is_some_and(|d| d.synthetic));
                if state.verdict.is_allow() && synthetic_org {
                    state.upstream = false;
                    state.detail = Some("synthetic answers: no data of this type".into());
                }
                self.record_refusal(state, wait).await;
                Reply::empty(ResponseCode::NoError)
            }
            Action::Synthetic(family) => self.synthetic(state, query, family, wait).await,
            Action::AnyHinfo => self.any_hinfo(state, query).await,
            Action::Ptr(addr) => self.ptr(served, state, query, addr, wait, now).await,
            Action::Forward => {
                let (Some(org), Some(key)) = (state.verdict_org().cloned(), key) else {
                    return Err(Reply::empty(ResponseCode::Refused));
                };
                self.forward_and_deliver(served, state, &org, key, now)
                    .await
            }
        })
    }

    /// A miss through the miss hook ([`crate::jit::on_miss`], for the
    /// name on any port): a grant answers it as an allow rule would, an
    /// `ask` org's miss is refused `approval_pending` (the approval's
    /// reference and the name in the EDE text).
    async fn missed(
        &self,
        served: &Served,
        state: &mut QueryState,
        decision: QueryDecision,
        qtype: hickory_server::proto::rr::RecordType,
    ) -> QueryDecision {
        let (Reason::NoMatchingRule, Action::Denied(_), Some(org), Some(name)) = (
            decision.verdict.reason,
            &decision.action,
            decision.verdict.org.clone(),
            decision.name.clone(),
        ) else {
            return decision;
        };
        let host = crate::proto::target::Host::Name(name.clone());
        let facts = crate::jit::MissFacts {
            org: &org,
            client: state.client.ip(),
            host: &host,
            port: None,
            request: None,
            intercepts: false,
            mode: Mode::Dns,
            now: std::time::SystemTime::now(),
        };
        let (miss, said) = crate::jit::on_miss(self.jit.as_deref(), &served.policy, facts).await;
        state.decider = said;
        match miss {
            crate::jit::Miss::Denied => decision,
            crate::jit::Miss::Pending(approval) => {
                state.detail = Some(crate::jit::Miss::pending_detail(&approval));
                QueryDecision {
                    verdict: Verdict {
                        reason: Reason::ApprovalPending,
                        ..decision.verdict
                    },
                    ..decision
                }
            }
            crate::jit::Miss::Granted(g) => {
                let settings = served.dns.get(org.index).cloned().unwrap_or_default();
                let verdict = Verdict {
                    org: Some(org),
                    reason: Reason::RuleMatch,
                    rule: Some(g.rule),
                    would_deny: None,
                };
                super::decide::allowed(verdict, name, qtype, &settings)
            }
        }
    }

    /// A name a wildcard rule allows, before it is forwarded: spent from
    /// its new-name budget ([`past_budget`]).
    fn spend_name(&self, policy: &Policy, decision: QueryDecision, now: Instant) -> QueryDecision {
        let used = match (&decision.action, &decision.verdict, &decision.name) {
            (
                Action::Forward,
                Verdict {
                    org: Some(org),
                    rule: Some(rule),
                    reason: Reason::RuleMatch,
                    ..
                },
                Some(name),
            ) => policy
                .name_budget(org, rule)
                .map(|budget| self.names.spend(&org.name, rule, name, budget, now)),
            _ => None,
        };
        let report = decision
            .verdict
            .org
            .as_ref()
            .is_some_and(|o| policy.is_report(o));
        past_budget(decision, used, report)
    }

    /// Forward the decided name upstream, keep what that made of it in
    /// the cache while it lasts, and deliver it.
    async fn forward_and_deliver(
        &self,
        served: &Arc<Served>,
        state: &mut QueryState,
        org: &OrgRef,
        key: Key,
        now: Instant,
    ) -> Reply {
        let host = state.name.clone().unwrap_or_default();
        let qtype = key.qtype;
        // Boxed: the resolver's future is large and only this (uncached)
        // path needs it; every query's task stays small.
        let (fwd, until) =
            Box::pin(self.forward(served, org, state.verdict.clone(), host, qtype)).await;
        // Its TTLs count down from now, when they were fixed.
        let kept = Arc::new(Kept::new(fwd, Instant::now()));
        if let Some(until) = until {
            self.cache.insert(served, key, kept.clone(), until, now);
        }
        self.deliver(state, org, &kept, 0, now).await
    }

    /// Forward `host`, decided `verdict` for `org`: what that made of
    /// it, and until when the same query would get the same (`None`: not
    /// to be kept).
    pub(super) async fn forward(
        &self,
        served: &Served,
        org: &OrgRef,
        verdict: Verdict,
        host: String,
        qtype: RecordType,
    ) -> (Forwarded, Option<Instant>) {
        let (filtered, until) = self.lookup(served, org, &host, qtype).await;
        (Forwarded::new(verdict, host, filtered), until)
    }

    /// Resolve and filter; with the result, until when the same query
    /// would get the same result (`None`: not to be kept).
    async fn lookup(
        &self,
        served: &Served,
        org: &OrgRef,
        name: &str,
        qtype: RecordType,
    ) -> (Filtered, Option<Instant>) {
        let lookup = tokio::time::timeout(
            self.config.query_timeout.get(),
            self.resolver.lookup_records(name, qtype),
        )
        .await
        .unwrap_or(Err(RecordsError::Timeout));
        let now = Instant::now();
        // Kept no longer than `max_ttl`, whatever the resolver says.
        let bound = now + self.config.max_ttl;
        let negative = |ttl: Option<u32>| {
            ttl.filter(|t| *t > 0)
                .map(|t| (now + Duration::from_secs(u64::from(t))).min(bound))
        };
        match lookup {
            Ok(mut found) => {
                // Every org gets the TTLs the answer had when first seen.
                let memo = self.ttls.apply(name, qtype, &mut found.records, now);
                // The same answer while both the resolver's entry and the
                // memo last.
                let until = memo.map(|m| m.min(found.valid_until).min(bound));
                (
                    filter(&self.config, served, org, qtype, found.records),
                    until,
                )
            }
            Err(RecordsError::NxDomain { negative_ttl }) => (
                Filtered::failed(ResponseCode::NXDomain, None),
                negative(negative_ttl),
            ),
            Err(RecordsError::NoData { negative_ttl }) => (
                Filtered::failed(ResponseCode::NoError, None),
                negative(negative_ttl),
            ),
            Err(e) => (
                Filtered::failed(ResponseCode::ServFail, Some(e.to_string())),
                None,
            ),
        }
    }

    /// A place for the query within the client's query rate and the query
    /// budgets (held until it is answered), or the limit it is over.
    fn admit(&self, state: &QueryState, now: Instant) -> Result<InFlight, &'static str> {
        let client = state.client.ip();
        if !self.per_client.allow(&client_key(client), now) {
            return Err("max_queries_per_second_per_client exceeded");
        }
        self.queries
            .try_take(client, state.org.as_ref().map(|o| &o.name))
    }

    /// Asked before by this org, under this served version: what the full
    /// path made of it then (its TTLs counted down since), recorded and
    /// bound again now, paid for like any other answer (`shown`: the name
    /// its refusal records).
    async fn answer_kept(
        &self,
        state: &mut QueryState,
        shown: impl FnOnce() -> String,
        kept: &Kept,
        started: Instant,
        now: Instant,
    ) -> Reply {
        // Kept answers are keyed by org: a client in none has none.
        let Some(org) = state.org.clone() else {
            return Reply::empty(ResponseCode::Refused);
        };
        if let Err(limit) = self.refusals.pay(&Some(org.name.clone()), now) {
            return self
                .refuse_early(state, shown(), Reason::LimitExceeded, limit, Duration::ZERO)
                .await;
        }
        let reply = self.deliver(state, &org, kept, kept.age(now), now).await;
        self.metrics.time_decision(Mode::Dns, started.elapsed());
        reply
    }

    /// Refused before the decision, with what was asked (`name`, as
    /// records show it); the record waits for room at most `wait`.
    async fn refuse_early(
        &self,
        state: &mut QueryState,
        name: String,
        reason: Reason,
        detail: &str,
        wait: Duration,
    ) -> Reply {
        state.name = Some(name);
        state.refuse(reason, Some(detail.into()));
        let recorded = self.record_refusal(state, wait).await;
        blocked(ResponseCode::Refused, &state.verdict, &recorded)
    }

    /// Refused by the decision, answered `rcode` with its EDE.
    async fn refuse_decided(
        &self,
        state: &QueryState,
        rcode: ResponseCode,
        wait: Duration,
    ) -> Reply {
        let recorded = self.record_refusal(state, wait).await;
        blocked(rcode, &state.verdict, &recorded)
    }

    /// An org with synthetic answers: the pool address bound to (org,
    /// name) for `family`, nothing upstream; NODATA without a pool of the
    /// family; refused (`limit_exceeded`) when every address the pool
    /// could give is held by an open connection.
    async fn synthetic(
        &self,
        state: &mut QueryState,
        query: &LowerQuery,
        family: Family,
        wait: Duration,
    ) -> Reply {
        state.upstream = false;
        let (Some(pools), Some(org), Some(name)) = (
            self.synthetic.as_ref(),
            state.verdict_org().cloned(),
            state.name.clone(),
        ) else {
            state.detail = Some("synthetic answers: no pool".into());
            return self
                .finish(state, Reply::empty(ResponseCode::NoError), None)
                .await;
        };
        let addr = match pools.answer(&org.name, &name, family) {
            Answer::Addr(addr) => addr,
            Answer::NoPool => {
                state.detail = Some("synthetic answers: no pool of this family".into());
                return self
                    .finish(state, Reply::empty(ResponseCode::NoError), None)
                    .await;
            }
            Answer::Exhausted => {
                state.refuse(
                    Reason::LimitExceeded,
                    Some("synthetic pool exhausted: every address it could give is held by an open connection".into()),
                );
                return self
                    .refuse_decided(state, ResponseCode::Refused, wait)
                    .await;
            }
        };
        let rdata = match addr {
            IpAddr::V4(a) => RData::A(a.into()),
            IpAddr::V6(a) => RData::AAAA(a.into()),
        };
        let record = Record::from_rdata(query.original().name().clone(), SYNTHETIC_TTL, rdata);
        state.answers = Some(vec![describe(&record)].into());
        state.detail = Some("synthetic answer: nothing resolved".into());
        let reply = Reply {
            rcode: ResponseCode::NoError,
            answers: Arc::new([record]),
            ede: None,
            spent: 0,
        };
        self.finish(state, reply, None).await
    }

    /// ANY is answered with one HINFO (RFC 8482), nothing upstream.
    async fn any_hinfo(&self, state: &mut QueryState, query: &LowerQuery) -> Reply {
        let hinfo = Record::from_rdata(
            query.original().name().clone(),
            self.clamp_ttl(3600),
            RData::HINFO(HINFO::new("RFC8482".into(), String::new())),
        );
        state.answers = Some(vec![describe(&hinfo)].into());
        state.upstream = false;
        let reply = Reply {
            rcode: ResponseCode::NoError,
            answers: Arc::new([hinfo]),
            ede: None,
            spent: 0,
        };
        self.finish(state, reply, None).await
    }

    /// A reverse query, answered from this org's bindings only: the names
    /// it was handed `addr` for, or its denial.
    async fn ptr(
        &self,
        served: &Served,
        state: &mut QueryState,
        query: &LowerQuery,
        addr: std::net::IpAddr,
        wait: Duration,
        now: Instant,
    ) -> Reply {
        let names = state
            .verdict_org()
            .map(|o| self.bindings.names_for(&o.name, addr, now))
            .unwrap_or_default();
        let answers: Vec<Record> = names
            .iter()
            .filter_map(|(n, left)| {
                let target = Name::from_ascii(format!("{n}.")).ok()?;
                let ttl = u32::try_from(left.as_secs()).unwrap_or(u32::MAX).max(1);
                Some(Record::from_rdata(
                    query.original().name().clone(),
                    ttl.min(self.clamp_ttl(ttl)),
                    RData::PTR(PTR(target)),
                ))
            })
            .collect();
        if answers.is_empty() {
            let style = served
                .dns
                .get(state.verdict_org().map_or(usize::MAX, |o| o.index))
                .map(|o| o.denied)
                .unwrap_or_default();
            return self.refuse_decided(state, denied_rcode(style), wait).await;
        }
        state.verdict.reason = Reason::RuleMatch;
        state.answers = Some(answers.iter().map(describe).collect());
        state.upstream = false;
        state.detail = Some("answered from this org's bindings".into());
        let reply = Reply {
            rcode: ResponseCode::NoError,
            answers: answers.into(),
            ede: None,
            spent: 0,
        };
        self.finish(state, reply, None).await
    }

    /// Record what forwarding made of a query (before the answer), bind
    /// its addresses, and build the reply: the same steps whether it was
    /// just made or kept from an earlier query (`spent` seconds ago: its
    /// TTLs are counted down by that much).
    async fn deliver(
        &self,
        state: &mut QueryState,
        org: &OrgRef,
        kept: &Kept,
        spent: u32,
        now: Instant,
    ) -> Reply {
        let reply = delivering(state, &kept.fwd, spent);
        let reply = self.finish(state, reply, Some(&kept.series)).await;
        self.delivered(org, kept, reply, now)
    }

    /// After [`delivering`] and the record: bind the answer's addresses
    /// (unless its record was not written) and say what was filtered.
    /// Bindings made for a kept answer cover the answers of the next
    /// [`BIND_REFRESH`] too ([`Kept::bind_due`]): each lasts that much
    /// longer, and is made again once it has passed, not per answer.
    fn delivered(&self, org: &OrgRef, kept: &Kept, mut reply: Reply, now: Instant) -> Reply {
        let fwd = &kept.fwd;
        if fwd.filtered {
            if let Some((_, text)) = &mut reply.ede {
                text.push_str("; answer addresses removed");
            }
        }
        if reply.rcode != ResponseCode::ServFail
            && !fwd.bind.is_empty()
            && kept.bind_due(now, self.bindings.epoch())
        {
            let valid_for = |ttl: u32| {
                Duration::from_secs(u64::from(ttl)) + self.config.binding_grace + BIND_REFRESH
            };
            for (ip, ttl) in &fwd.bind {
                self.bindings
                    .bind(&org.name, &fwd.host, *ip, valid_for(*ttl), now);
            }
        }
        reply
    }

    /// Record a refusal (nothing flows because of it, so the answer does
    /// not wait for the write): queued when the writer has room within
    /// `wait`, else counted into a summary ([`super::refusals`]).
    pub(super) async fn record_refusal(&self, state: &QueryState, wait: Duration) -> Recorded {
        let mut rec = state.record();
        let recorded = self.refusals.record(&mut rec, wait).await;
        debug!(client = ?rec.client, host = ?rec.host, reason = %rec.reason, ?recorded, "dns refused");
        recorded
    }

    /// Write the record of an answer before it is sent (with its round's,
    /// when it came in one); without evidence, no answer (SERVFAIL,
    /// `evidence_unavailable`).
    async fn finish(
        &self,
        state: &mut QueryState,
        reply: Reply,
        series: Option<&OnceLock<DnsSeries>>,
    ) -> Reply {
        let written = self.write(state.round.as_deref(), state.record()).await;
        self.finished(state, reply, written, series)
    }

    /// [`Shim::finish`] once the record was `written` (or not).
    /// A kept answer's records count through its kept `series`.
    fn finished(
        &self,
        state: &mut QueryState,
        mut reply: Reply,
        written: round::Outcome,
        series: Option<&OnceLock<DnsSeries>>,
    ) -> Reply {
        let rec = match written {
            Ok(rec) => rec,
            Err(e) => {
                warn!(error = %e, "dns: evidence write failed; answering SERVFAIL");
                // Counted as what happened: refused, unrecorded.
                state.unrecorded();
                self.metrics.count_record(&state.record());
                return Reply::empty(ResponseCode::ServFail);
            }
        };
        match series {
            Some(series) => self.metrics.count_dns_record(&rec, series),
            None => self.metrics.count_record(&rec),
        }
        if !rec.reason.is_allow() && rec.reason != Reason::ResolutionFailed {
            reply.ede = Some((
                EDE_BLOCKED,
                format!("palisade: {}; record={}", rec.reason, rec.shown()),
            ));
        }
        reply
    }

    /// Write an answer's record: left to `round` while it gathers, else
    /// alone. The record as written, or why it was not.
    async fn write(&self, round: Option<&Round>, rec: crate::evidence::Record) -> round::Outcome {
        let mut rec = match round {
            Some(r) => match r.defer(rec) {
                Ok(deferred) => return round::outcome(deferred).await,
                Err(rec) => *rec,
            },
            None => rec,
        };
        match self.evidence.write(&mut rec).await {
            Ok(()) => Ok(rec),
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use hickory_server::proto::op::{Message, Query};
    use hickory_server::proto::rr::rdata::{CNAME, SOA};
    use serde_json::Value;

    use std::net::SocketAddr;

    use hickory_server::net::xfer::Protocol;
    use hickory_server::proto::op::Edns;
    use hickory_server::proto::rr::rdata::A;
    use hickory_server::proto::rr::RecordType;

    use crate::config::{self, DnsConfig};
    use crate::dns::cache::AnswerCache;
    use crate::dns::encode::encode;
    use crate::evidence::Evidence;
    use crate::handout::bindings::Bindings;
    use crate::metrics::Metrics;
    use crate::policy::Policy;
    use crate::resolve::Resolver;

    fn name(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    /// The upstream's answer to `q` (rcode, answers, authorities).
    fn upstream_answer(q: &Query) -> (ResponseCode, Vec<Record>, Vec<Record>) {
        let n = q.name().to_ascii().to_ascii_lowercase();
        let a = |owner: &str, ttl: u32, ip: [u8; 4]| {
            Record::from_rdata(
                name(owner),
                ttl,
                RData::A(A::new(ip[0], ip[1], ip[2], ip[3])),
            )
        };
        let soa = Record::from_rdata(
            name("test."),
            3600,
            RData::SOA(SOA::new(
                name("ns.test."),
                name("h.test."),
                1,
                60,
                60,
                600,
                60,
            )),
        );
        match (n.as_str(), q.query_type()) {
            ("allowed.test.", RecordType::A) => (
                ResponseCode::NoError,
                vec![a("allowed.test.", 300, [198, 18, 2, 10])],
                vec![],
            ),
            ("chain.test.", RecordType::A) => (
                ResponseCode::NoError,
                vec![
                    Record::from_rdata(
                        name("chain.test."),
                        600,
                        RData::CNAME(CNAME(name("c1.elsewhere.test."))),
                    ),
                    Record::from_rdata(
                        name("c1.elsewhere.test."),
                        500,
                        RData::CNAME(CNAME(name("c2.far.test."))),
                    ),
                    a("c2.far.test.", 120, [198, 18, 2, 11]),
                ],
                vec![],
            ),
            // One address the org may not be handed, one it may.
            ("rebind.test.", RecordType::A) => (
                ResponseCode::NoError,
                vec![
                    a("rebind.test.", 300, [127, 0, 0, 1]),
                    a("rebind.test.", 300, [198, 18, 2, 10]),
                ],
                vec![],
            ),
            // Only addresses it may not be handed.
            ("private.test.", RecordType::A) => (
                ResponseCode::NoError,
                vec![a("private.test.", 300, [169, 254, 169, 254])],
                vec![],
            ),
            ("nx.test.", _) => (ResponseCode::NXDomain, vec![], vec![soa]),
            ("nodata.test.", _) => (ResponseCode::NoError, vec![], vec![]),
            (_, _) => (ResponseCode::ServFail, vec![], vec![]),
        }
    }

    /// A loopback upstream answering [`upstream_answer`]; counts queries.
    async fn upstream() -> (SocketAddr, Arc<AtomicUsize>) {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        let count = seen.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                count.fetch_add(1, Ordering::Relaxed);
                let mut m = Message::response(q.metadata.id, OpCode::Query);
                m.metadata.recursion_desired = q.metadata.recursion_desired;
                m.metadata.recursion_available = true;
                if let Some(query) = q.queries.first() {
                    let (rcode, answers, authorities) = upstream_answer(query);
                    m.metadata.response_code = rcode;
                    m.add_query(query.clone());
                    m.add_answers(answers);
                    for r in authorities {
                        m.add_authority(r);
                    }
                }
                let _ = sock.send_to(&m.to_vec().unwrap(), from).await;
            }
        });
        (addr, seen)
    }

    const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "chain.test"
[[org.allow]]
host = "rebind.test"
[[org.allow]]
host = "private.test"
[[org.allow]]
host = "nx.test"
[[org.allow]]
host = "nodata.test"
[[org.allow]]
host = "fail.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
"#;

    fn served(policy: &str, metrics: &Arc<Metrics>) -> Served {
        let c = config::from_str(policy, Path::new("t.toml")).unwrap();
        Served::load(&c, Arc::new(Policy::new(&c)), metrics).unwrap()
    }

    /// A shim on `dir`'s evidence, resolving through `upstream`; with an
    /// answer cache or without.
    fn shim(dir: &Path, upstream: SocketAddr, cached: bool) -> Shim {
        let ev = Arc::new(Evidence::open(&dir.join("evidence")).unwrap());
        let metrics = Arc::new(Metrics::new(ev.live().clone()));
        let resolver = Resolver::new(&[upstream], Duration::from_secs(2)).unwrap();
        let mut shim = Shim::new(
            served(POLICY, &metrics).into_handle(),
            Arc::new(resolver),
            ev,
            metrics,
            Arc::new(Bindings::new(8, 1024, 4096)),
            DnsConfig::default(),
        );
        if !cached {
            shim.cache = AnswerCache::new(0, 0);
        }
        shim
    }

    fn request(client: &str, qname: &str, qtype: RecordType) -> Request {
        let mut m = Message::query();
        m.metadata.id = 0x4242;
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(name(qname), qtype));
        m.edns = Some(Edns::new());
        let src = SocketAddr::new(client.parse().unwrap(), 40000);
        Request::from_bytes(m.to_vec().unwrap(), src, Protocol::Udp).unwrap()
    }

    /// A reply with the record reference in its EDE masked.
    fn shown(reply: &Reply) -> (ResponseCode, Vec<Record>, Option<(u16, String)>) {
        let ede = reply.ede.clone().map(|(code, text)| {
            let masked = match text.find("record=") {
                Some(i) => {
                    let rest = &text[i + 7..];
                    let end = rest.find(';').unwrap_or(rest.len());
                    format!("{}record=*{}", &text[..i], &rest[end..])
                }
                None => text,
            };
            (code, masked)
        });
        (reply.rcode, reply.answers.to_vec(), ede)
    }

    /// The dns decision records in `dir`, without what differs per record.
    async fn records(shim: &Shim, dir: &Path) -> Vec<Value> {
        assert!(shim.evidence.seal().await);
        crate::evidence::segment::list(&dir.join("evidence"))
            .unwrap()
            .iter()
            .flat_map(|p| {
                std::fs::read_to_string(p)
                    .unwrap()
                    .lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap())
                    .collect::<Vec<_>>()
            })
            .filter(|v| v["kind"] == "dns")
            .map(|mut v| {
                let m = v.as_object_mut().unwrap();
                for k in ["id", "ts", "ref", "seq", "prev", "hash"] {
                    m.remove(k);
                }
                v
            })
            .collect()
    }

    const ACME: &str = "198.18.1.2";
    const BETA: &str = "198.18.4.2";

    /// Every kind of forwarded answer, asked twice of a caching shim (the
    /// second from its cache, or not when it may not be kept) and once of
    /// a shim without a cache: the same reply, the same bytes on the wire,
    /// the same record, the same bindings.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cached_answers_and_records_are_the_full_paths() {
        let (up, seen) = upstream().await;
        let (dir_c, dir_u) = (
            crate::testing::scratch("dnscache"),
            crate::testing::scratch("dnscache"),
        );
        let mut cached = shim(&dir_c, up, true);
        let plain = shim(&dir_u, up, false);
        let cases: &[(&str, RecordType, bool)] = &[
            ("allowed.test.", RecordType::A, true),
            ("chain.test.", RecordType::A, true),
            ("rebind.test.", RecordType::A, true),
            ("private.test.", RecordType::A, true),
            ("nx.test.", RecordType::A, true),
            // No SOA: the upstream did not say for how long; not kept.
            ("nodata.test.", RecordType::A, false),
            // SERVFAIL is never kept.
            ("fail.test.", RecordType::A, false),
            // Denied: decided every time, never kept.
            ("nope.test.", RecordType::A, false),
        ];
        let mut wire = Vec::new();
        for &(qname, qtype, kept) in cases {
            let req = request(ACME, qname, qtype);
            let hits = cached.cache.hits();
            // The full path, with fresh bindings to see what it binds.
            cached.bindings = Arc::new(Bindings::new(8, 1024, 4096));
            let first = cached.answer(&req, None).await;
            assert_eq!(cached.cache.hits(), hits, "{qname}: first is a miss");
            let bound_first = cached.bindings.len();
            cached.bindings = Arc::new(Bindings::new(8, 1024, 4096));
            let second = cached.answer(&req, None).await;
            let hit = cached.cache.hits() == hits + 1;
            assert_eq!(hit, kept, "{qname}: kept");
            assert_eq!(cached.bindings.len(), bound_first, "{qname}: bindings");
            let third = plain.answer(&req, None).await;
            assert_eq!(shown(&first), shown(&second), "{qname}");
            assert_eq!(shown(&first), shown(&third), "{qname}");
            let bytes = [&first, &second, &third].map(|r| encode(&req, r, Protocol::Udp));
            if first.ede.is_none() {
                assert_eq!(bytes[0], bytes[1], "{qname}: wire");
                assert_eq!(bytes[0], bytes[2], "{qname}: wire");
            }
            wire.push((qname, first));
        }
        // What the answers are, so that "the same" is not "equally empty".
        let get = |q: &str| &wire.iter().find(|(n, _)| *n == q).unwrap().1;
        assert_eq!(get("allowed.test.").answers.len(), 1);
        assert_eq!(get("allowed.test.").answers[0].ttl, 300);
        assert_eq!(get("chain.test.").answers.len(), 3);
        assert_eq!(get("rebind.test.").answers.len(), 1);
        assert_eq!(get("private.test.").answers.len(), 0);
        assert!(get("private.test.").ede.is_some());
        assert_eq!(get("nx.test.").rcode, ResponseCode::NXDomain);
        assert_eq!(get("fail.test.").rcode, ResponseCode::ServFail);
        assert_eq!(get("nope.test.").rcode, ResponseCode::Refused);
        assert!(seen.load(Ordering::Relaxed) > 0);

        // Records: per query, in order, the same whether cached or not.
        let (rc, ru) = (
            records(&cached, &dir_c).await,
            records(&plain, &dir_u).await,
        );
        assert_eq!(rc.len(), 2 * cases.len(), "{rc:#?}");
        assert_eq!(ru.len(), cases.len(), "{ru:#?}");
        for (i, (qname, _, _)) in cases.iter().enumerate() {
            assert_eq!(rc[2 * i], rc[2 * i + 1], "{qname}: cached record");
            assert_eq!(rc[2 * i], ru[i], "{qname}: uncached record");
        }
        let allowed = &rc[0];
        assert_eq!(allowed["decision"], "allow", "{allowed}");
        assert_eq!(allowed["upstream"], true, "{allowed}");
        assert_eq!(allowed["org"], "acme", "{allowed}");
        assert!(allowed["answers"].to_string().contains("198.18.2.10"));
        let _ = std::fs::remove_dir_all(&dir_c);
        let _ = std::fs::remove_dir_all(&dir_u);
    }

    /// A query on the wire: `qname`/`qtype` with id `id`, CD set or not,
    /// EDNS with `payload` or none, and a cookie with it.
    fn raw_query(
        id: u16,
        qname: &str,
        qtype: RecordType,
        cd: bool,
        payload: Option<u16>,
    ) -> Vec<u8> {
        let mut m = Message::query();
        m.metadata.id = id;
        m.metadata.recursion_desired = true;
        m.metadata.checking_disabled = cd;
        m.add_query(Query::query(name(qname), qtype));
        m.edns = payload.map(|p| {
            let mut e = Edns::new();
            e.set_max_payload(p);
            e.options_mut()
                .insert(hickory_server::proto::rr::rdata::opt::EdnsOption::Unknown(
                    10,
                    vec![id as u8; 8],
                ));
            e
        });
        m.to_vec().unwrap()
    }

    /// `a` and `b` are the same response, their TTLs (which may be a
    /// second apart) and the record reference of an EDE aside.
    fn same_response(a: &[u8], b: &[u8], what: &str) {
        let (ma, mb) = (Message::from_vec(a).unwrap(), Message::from_vec(b).unwrap());
        let ede = |m: &Message| {
            m.edns.as_ref().and_then(|e| {
                e.option(hickory_server::proto::rr::rdata::opt::EdnsCode::Unknown(15))
                    .cloned()
            })
        };
        if ede(&ma).is_some() {
            assert!(ede(&mb).is_some(), "{what}: EDE");
            assert_eq!(ma.metadata, mb.metadata, "{what}");
            assert_eq!(ma.queries, mb.queries, "{what}");
            assert_eq!(ma.answers, mb.answers, "{what}");
            return;
        }
        assert_eq!(a.len(), b.len(), "{what}: {ma:?} / {mb:?}");
        let ttls = crate::dns::wire::ttl_offsets(a).unwrap();
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            if let Some(at) = ttls.iter().find(|&&at| (at..at + 4).contains(&i)) {
                let ttl = |m: &[u8]| u32::from_be_bytes(m[*at..at + 4].try_into().unwrap());
                assert!(
                    ttl(a).abs_diff(ttl(b)) <= 1,
                    "{what}: TTL {} / {}",
                    ttl(a),
                    ttl(b)
                );
            } else {
                assert_eq!(x, y, "{what}: byte {i}: {ma:?} / {mb:?}");
            }
        }
    }

    /// Queries of every shape the wire path reads (names in mixed case,
    /// with and without EDNS, payload sizes, CD, UDP and TCP), for every
    /// kind of answer: hickory's path and the wire path answer the same
    /// bytes and write the same records, whether kept or not; the wire
    /// path builds kept answers from responses kept on the wire.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_wire_path_answers_as_hickorys_path() {
        let (up, _) = upstream().await;
        let dir = crate::testing::scratch("dnswire");
        let shim = shim(&dir, up, true);
        let mut id = 7u16;
        let mut pairs = 0;
        for qname in [
            "allowed.test.",
            "AlLoWeD.tEsT.",
            "chain.test.",
            "rebind.test.",
            "private.test.",
            "nx.test.",
            "nodata.test.",
            "fail.test.",
            "nope.test.",
        ] {
            for (cd, payload, protocol) in [
                (false, None, Protocol::Udp),
                (false, Some(512), Protocol::Udp),
                (true, Some(1232), Protocol::Udp),
                (false, Some(4096), Protocol::Udp),
                (false, Some(1232), Protocol::Tcp),
            ] {
                for client in [ACME, BETA] {
                    id = id.wrapping_mul(31).wrapping_add(1);
                    let raw = raw_query(id, qname, RecordType::A, cd, payload);
                    let src = SocketAddr::new(client.parse().unwrap(), 40000);
                    let q = crate::dns::wire::question(&raw).expect("plain");
                    let req = Request::from_bytes(raw.clone(), src, protocol).unwrap();
                    let by_hickory = shim.respond(&req, protocol, None).await;
                    let by_wire = shim.respond_wire(&q, &raw, src, protocol, None).await;
                    let what = format!("{qname} {client} cd={cd} {payload:?} {protocol:?}");
                    same_response(&by_hickory, &by_wire, &what);
                    assert_eq!(Message::from_vec(&by_wire).unwrap().metadata.id, id);
                    pairs += 1;
                }
            }
        }
        // The answers kept were answered from the wire.
        let key = Key {
            org: 0,
            name: crate::dns::wire::question(&raw_query(
                1,
                "allowed.test.",
                RecordType::A,
                false,
                None,
            ))
            .unwrap()
            .lower_name(),
            qtype: RecordType::A,
        };
        let kept = shim
            .cache
            .get(&shim.served.load_full(), &key, Instant::now())
            .unwrap();
        let q = raw_query(9, "ALLOWED.test.", RecordType::A, false, None);
        let answer = kept.wire_answer(&crate::dns::wire::question(&q).unwrap(), false, 0);
        let answer = Message::from_vec(&answer.expect("kept on the wire")).unwrap();
        assert_eq!(answer.queries[0].name().to_ascii(), "ALLOWED.test.");
        assert_eq!(answer.answers[0].ttl, 300);

        // Records: the same, pair by pair, each with its own org.
        let recs = records(&shim, &dir).await;
        assert_eq!(recs.len(), 2 * pairs, "{recs:#?}");
        for pair in recs.chunks(2) {
            assert_eq!(pair[0], pair[1]);
        }
        assert_eq!(recs[0]["org"], "acme");
        assert_eq!(recs[2]["org"], "beta");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A kept answer answered at once ([`Shim::kept_now`], the UDP
    /// listener's path for a round of one query) is the response and the
    /// record [`Shim::respond_wire`] makes of it; a question with nothing
    /// kept for it is left alone, nothing recorded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_answer_answered_now_is_the_wire_paths_answer() {
        let (up, _) = upstream().await;
        let dir = crate::testing::scratch("dnsnow");
        let shim = shim(&dir, up, true);
        let mut id = 11u16;
        let mut ask = |qname: &str, payload| {
            id += 1;
            raw_query(id, qname, RecordType::A, false, payload)
        };
        let src = SocketAddr::new(ACME.parse().unwrap(), 40000);
        let first = ask("allowed.test.", None);
        let q = crate::dns::wire::question(&first).unwrap();
        assert!(matches!(
            shim.kept_now(&q, &first, src, Protocol::Udp),
            Now::Elsewhere
        ));
        let names = [
            "allowed.test.",
            "AlLoWeD.tEsT.",
            "private.test.",
            "nx.test.",
        ];
        for (i, qname) in names.into_iter().enumerate() {
            let payload = [None, Some(1232)][i % 2];
            let raw = ask(qname, payload);
            let q = crate::dns::wire::question(&raw).unwrap();
            shim.respond_wire(&q, &raw, src, Protocol::Udp, None).await;
            let by_wire = shim.respond_wire(&q, &raw, src, Protocol::Udp, None).await;
            let Now::Answered(now) = shim.kept_now(&q, &raw, src, Protocol::Udp) else {
                panic!("{qname}: kept, answered at once");
            };
            same_response(&by_wire, &now, qname);
        }
        // A writer busy (here: paused): the record waits, the rest of the
        // query after it ([`Shim::kept_later`]), as the same steps.
        let raw = ask("allowed.test.", None);
        let q = crate::dns::wire::question(&raw).unwrap();
        let by_wire = shim.respond_wire(&q, &raw, src, Protocol::Udp, None).await;
        shim.evidence.pause_writer(true);
        let Now::Later(later) = shim.kept_now(&q, &raw, src, Protocol::Udp) else {
            panic!("a paused writer: the record waits");
        };
        shim.evidence.pause_writer(false);
        let later = shim.kept_later(*later, &raw, src, Protocol::Udp).await;
        same_response(&by_wire, &later, "later");
        let refused = ask("nope.test.", None);
        let q = crate::dns::wire::question(&refused).unwrap();
        shim.respond_wire(&q, &refused, src, Protocol::Udp, None)
            .await;
        assert!(matches!(
            shim.kept_now(&q, &refused, src, Protocol::Udp),
            Now::Elsewhere
        ));
        let recs = records(&shim, &dir).await;
        assert_eq!(recs.len(), 3 * names.len() + 3, "{recs:#?}");
        for three in recs[..3 * names.len()].chunks(3) {
            assert_eq!(three[1], three[2]);
            assert_eq!(three[2]["upstream"], true);
        }
        let n = 3 * names.len();
        assert_eq!(recs[n], recs[n + 1], "the record that waited");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Org beta asking what acme has in the cache goes the full path: its
    /// own record, the TTL not counted down; a reload denying the name
    /// refuses it at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_shared_across_orgs_or_policy_versions() {
        let (up, _) = upstream().await;
        let dir = crate::testing::scratch("dnscache");
        let shim = shim(&dir, up, true);
        let a = request(ACME, "allowed.test.", RecordType::A);
        let b = request(BETA, "allowed.test.", RecordType::A);
        let first = shim.answer(&a, None).await;
        assert_eq!(shim.answer(&a, None).await.answers[0].ttl, 300);
        assert_eq!(shim.cache.hits(), 1);
        // The same name in any case is the same question.
        let upper = request(ACME, "ALLOWED.Test.", RecordType::A);
        assert_eq!(shown(&shim.answer(&upper, None).await), shown(&first));
        assert_eq!(shim.cache.hits(), 2);
        let beta = shim.answer(&b, None).await;
        assert_eq!(shim.cache.hits(), 2, "beta's first answer is its own");
        assert_eq!(beta.answers.len(), 1);
        assert_eq!(beta.answers[0].ttl, 300);
        shim.answer(&b, None).await;
        assert_eq!(shim.cache.hits(), 3);
        assert_eq!(shim.cache.org_len(0), 1);
        assert_eq!(shim.cache.org_len(1), 1);

        // A reload that denies the name to acme.
        let denied = POLICY.replacen("host = \"allowed.test\"", "host = \"other.test\"", 1);
        shim.served.store(Arc::new(served(&denied, &shim.metrics)));
        let refused = shim.answer(&a, None).await;
        assert_eq!(refused.rcode, ResponseCode::Refused);
        assert_eq!(shim.cache.hits(), 3);
        // Beta's entry went with the old version; its answer is unchanged.
        let beta_again = shim.answer(&b, None).await;
        assert_eq!(shown(&beta_again), shown(&beta));
        assert_eq!(shim.cache.hits(), 3);

        let recs = records(&shim, &dir).await;
        let orgs: Vec<&str> = recs.iter().map(|r| r["org"].as_str().unwrap()).collect();
        assert_eq!(
            orgs,
            ["acme", "acme", "acme", "beta", "beta", "acme", "beta"]
        );
        assert_eq!(recs[1], recs[2], "any case: the same record");
        assert_eq!(recs[5]["decision"], "deny", "{}", recs[5]);
        assert_ne!(recs[5]["policy"], recs[0]["policy"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A synthetic org: A and AAAA answered from the pools, bound to
    /// (org, name), other types NODATA; the upstream sees nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn synthetic_answers_resolve_nothing() {
        let (up, seen) = upstream().await;
        let dir = crate::testing::scratch("dnssyn");
        let policy = format!(
            "[dns]\nsynthetic_pool = \"198.18.200.0/24\"\n{}",
            POLICY.replacen(
                "clients = [\"198.18.1.0/24\"]",
                "clients = [\"198.18.1.0/24\"]\ndns_answers = \"synthetic\"",
                1
            )
        );
        let ev = Arc::new(Evidence::open(&dir.join("evidence")).unwrap());
        let metrics = Arc::new(Metrics::new(ev.live().clone()));
        let resolver = Resolver::new(&[up], Duration::from_secs(2)).unwrap();
        let c = config::from_str(&policy, Path::new("t.toml")).unwrap();
        let served = Served::load(&c, Arc::new(Policy::new(&c)), &metrics).unwrap();
        let shim = Shim::new(
            served.into_handle(),
            Arc::new(resolver),
            ev,
            metrics,
            Arc::new(Bindings::new(8, 1024, 4096)),
            c.dns.clone(),
        );
        let pools = shim.synthetic.clone().unwrap();
        let a = shim
            .answer(&request(ACME, "allowed.test.", RecordType::A), None)
            .await;
        assert_eq!(a.rcode, ResponseCode::NoError);
        assert_eq!(a.answers.len(), 1);
        assert_eq!(a.answers[0].ttl, SYNTHETIC_TTL);
        let RData::A(addr) = &a.answers[0].data else {
            panic!("{a:?}")
        };
        let addr = IpAddr::V4(addr.0);
        assert!(pools.contains(addr));
        assert_eq!(pools.name_of("acme", addr).as_deref(), Some("allowed.test"));
        // The same name again: the same address.
        let again = shim
            .answer(&request(ACME, "ALLOWED.test.", RecordType::A), None)
            .await;
        assert_eq!(again.answers, a.answers);
        // No IPv6 pool: NODATA; HTTPS: NODATA; denied: refused.
        let aaaa = shim
            .answer(&request(ACME, "allowed.test.", RecordType::AAAA), None)
            .await;
        assert_eq!((aaaa.rcode, aaaa.answers.len()), (ResponseCode::NoError, 0));
        let https = shim
            .answer(&request(ACME, "allowed.test.", RecordType::HTTPS), None)
            .await;
        assert_eq!(
            (https.rcode, https.answers.len()),
            (ResponseCode::NoError, 0)
        );
        let nope = shim
            .answer(&request(ACME, "nope.test.", RecordType::A), None)
            .await;
        assert_eq!(nope.rcode, ResponseCode::Refused);
        // No synthetic address was bound as a real one.
        assert!(!shim
            .bindings
            .is_bound("acme", "allowed.test", addr, Instant::now()));
        assert_eq!(seen.load(Ordering::Relaxed), 0, "nothing upstream");
        // Beta resolves as before.
        let beta = shim
            .answer(&request(BETA, "allowed.test.", RecordType::A), None)
            .await;
        assert_eq!(beta.answers.len(), 1);
        assert_eq!(seen.load(Ordering::Relaxed), 1);

        let recs = records(&shim, &dir).await;
        let first = &recs[0];
        assert_eq!(first["decision"], "allow", "{first}");
        assert_eq!(first["upstream"], false, "{first}");
        assert_eq!(
            first["answers"],
            serde_json::json!([format!("A {addr}")]),
            "{first}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
