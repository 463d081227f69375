//! The shim's `RequestHandler`: decide ([`super::decide`]), forward allowed
//! names, filter and bind the answers, write evidence, then answer.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{
    Edns, Header, HeaderCounts, MessageType, Metadata, OpCode, ResponseCode,
};
use hickory_server::proto::rr::rdata::opt::EdnsOption;
use hickory_server::proto::rr::rdata::svcb::{IpHint, Mandatory, SvcParamKey, SvcParamValue};
use hickory_server::proto::rr::rdata::{A, AAAA, HINFO, HTTPS, PTR, SVCB};
use hickory_server::proto::rr::{DNSClass, Name, RData, Record, RecordType};
use hickory_server::proto::serialize::binary::{BinEncodable, BinEncoder};
use hickory_server::server::Request;
use hickory_server::zone_handler::MessageResponseBuilder;
use tracing::{debug, warn};

use super::budget::{QueryBudget, TcpBudget};
use super::cache::{AnswerCache, Key};
use super::decide::{decide_query, Action};
use super::refusals::{Recorded, Refusals};
use super::ttl::TtlMemo;
use crate::bindings::Bindings;
use crate::config::{DnsConfig, DnsDenied};
use crate::evidence::{Evidence, Kind, Mode, Record as EvRecord};
use crate::metrics::Metrics;
use crate::policy::{OrgRef, Reason, Verdict};
use crate::resolve::{RecordsError, Resolver};
use crate::served::{Served, ServedHandle};

/// EDNS option code of an Extended DNS Error (RFC 8914).
pub const EDE_OPTION: u16 = 15;
/// EDE info-code 15, "Blocked".
pub const EDE_BLOCKED: u16 = 15;
/// EDE info-code 18, "Prohibited" (unknown clients).
pub const EDE_PROHIBITED: u16 = 18;
/// Largest UDP payload we advertise and send (DNS flag day 2020).
const MAX_UDP_PAYLOAD: u16 = 1232;
/// Longest query name kept in evidence for a name that is not a host name.
const MAX_SHOWN_NAME: usize = 300;

/// Everything the shim needs to answer. What a reload changes (the policy,
/// each org's DNS settings) is in `served`, loaded once per query: one
/// query is decided and recorded under one policy version.
pub struct Shim {
    pub served: ServedHandle,
    pub resolver: Arc<Resolver>,
    pub evidence: Arc<Evidence>,
    pub metrics: Arc<Metrics>,
    pub bindings: Arc<Bindings>,
    pub config: DnsConfig,
    /// Queries in flight: global, per org (per address for a client in no org).
    pub queries: QueryBudget,
    /// DNS-over-TCP connections: global, per client address, per org.
    pub tcp: TcpBudget,
    /// Queries per second per client address.
    pub per_client: Arc<crate::limits::RateLimiter<IpAddr>>,
    /// Refusal records, one by one while the writer has room, else tallied.
    pub refusals: Refusals,
    /// Answer TTLs as first seen, so they do not count down across orgs.
    pub ttls: TtlMemo,
    /// What forwarding produced, per (org, name, type), for the served
    /// version it was decided under ([`super::cache`]).
    pub cache: AnswerCache<Served, Outcome>,
}

/// The answer to send, before encoding.
#[derive(Debug)]
pub(crate) struct Reply {
    rcode: ResponseCode,
    answers: Arc<[Record]>,
    ede: Option<(u16, String)>,
}

impl Reply {
    fn empty(rcode: ResponseCode) -> Reply {
        Reply {
            rcode,
            answers: Arc::new([]),
            ede: None,
        }
    }
}

/// What the full path made of a forwarded query, before its record is
/// written: the same for every query of one org for one name and type
/// while the answer lasts, so it is what [`super::cache`] keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The verdict the record carries (a stripped answer's denial).
    verdict: Verdict,
    /// The normalised name.
    host: String,
    rcode: ResponseCode,
    answers: Arc<[Record]>,
    /// The record's `answers`.
    described: Vec<String>,
    /// The record's `detail`.
    detail: Option<String>,
    /// Addresses were removed and none is left.
    filtered: bool,
    /// Addresses to bind to (org, name), with their TTL.
    bind: Vec<(IpAddr, u32)>,
}

/// What forwarding produced.
struct Forwarded {
    rcode: ResponseCode,
    answers: Vec<Record>,
    /// Addresses handed out (answers and SVCB hints), with their TTL.
    bind: Vec<(IpAddr, u32)>,
    stripped: Vec<String>,
    /// The first stripped address's denial, when nothing is left.
    denial: Option<Verdict>,
    error: Option<String>,
}

fn ede_option(code: u16, text: &str) -> EdnsOption {
    let mut data = Vec::with_capacity(2 + text.len());
    data.extend_from_slice(&code.to_be_bytes());
    data.extend_from_slice(text.as_bytes());
    EdnsOption::Unknown(EDE_OPTION, data)
}

fn describe(r: &Record) -> String {
    format!("{} {}", r.record_type(), r.data)
}

impl Shim {
    /// The shim of `config`, its limits sized from it.
    pub fn new(
        served: ServedHandle,
        resolver: Arc<Resolver>,
        evidence: Arc<Evidence>,
        metrics: Arc<Metrics>,
        bindings: Arc<Bindings>,
        config: DnsConfig,
    ) -> Shim {
        Shim {
            queries: QueryBudget::new(&config),
            tcp: TcpBudget::new(&config),
            per_client: Arc::new(crate::limits::RateLimiter::new(
                config.max_queries_per_second_per_client,
                65_536,
            )),
            // Its own until the proxy's is shared ([`Shim::with_evidence_budget`]).
            refusals: Refusals::new(
                evidence.clone(),
                metrics.clone(),
                Arc::new(crate::limits::EvidenceBudget::new(
                    crate::config::default_max_records_per_second_per_org(
                        &crate::config::Limits::default(),
                        &config,
                    ),
                )),
            ),
            ttls: TtlMemo::default(),
            cache: AnswerCache::default(),
            served,
            resolver,
            evidence,
            metrics,
            bindings,
            config,
        }
    }

    /// Charge records to `budget`, the evidence budget the proxy charges
    /// too (`[evidence] max_records_per_second_per_org`).
    pub fn with_evidence_budget(mut self, budget: Arc<crate::limits::EvidenceBudget>) -> Shim {
        self.refusals.set_budget(budget);
        self
    }

    fn clamp_ttl(&self, ttl: u32) -> u32 {
        let min = u32::try_from(self.config.min_ttl.as_secs()).unwrap_or(u32::MAX);
        let max = u32::try_from(self.config.max_ttl.as_secs()).unwrap_or(u32::MAX);
        ttl.clamp(min, max.max(min))
    }

    /// Strip `ech` from an SVCB/HTTPS record and hints the org may not be
    /// handed; returns the kept hints.
    fn filter_svcb(
        &self,
        served: &Served,
        org: &OrgRef,
        svcb: &SVCB,
    ) -> (SVCB, Vec<IpAddr>, Vec<String>) {
        let mut kept_hints = Vec::new();
        let mut stripped = Vec::new();
        let mut params = Vec::with_capacity(svcb.svc_params.len());
        for (key, value) in &svcb.svc_params {
            match (key, value) {
                (SvcParamKey::EchConfigList, _) => stripped.push("ech".to_string()),
                (_, SvcParamValue::Mandatory(Mandatory(keys))) => {
                    let keys: Vec<SvcParamKey> = keys
                        .iter()
                        .copied()
                        .filter(|k| *k != SvcParamKey::EchConfigList)
                        .collect();
                    params.push((*key, SvcParamValue::Mandatory(Mandatory(keys))));
                }
                (_, SvcParamValue::Ipv4Hint(IpHint(hints))) => {
                    let mut keep = Vec::new();
                    for h in hints {
                        let ip = IpAddr::V4(h.0);
                        if served.policy.answer_allowed(org, ip).is_ok() {
                            keep.push(*h);
                            kept_hints.push(ip);
                        } else {
                            stripped.push(format!("ipv4hint {ip}"));
                        }
                    }
                    if !keep.is_empty() {
                        params.push((*key, SvcParamValue::Ipv4Hint(IpHint(keep))));
                    }
                }
                (_, SvcParamValue::Ipv6Hint(IpHint(hints))) => {
                    let mut keep = Vec::new();
                    for h in hints {
                        let ip = IpAddr::V6(h.0);
                        if served.policy.answer_allowed(org, ip).is_ok() {
                            keep.push(*h);
                            kept_hints.push(ip);
                        } else {
                            stripped.push(format!("ipv6hint {ip}"));
                        }
                    }
                    if !keep.is_empty() {
                        params.push((*key, SvcParamValue::Ipv6Hint(IpHint(keep))));
                    }
                }
                _ => params.push((*key, value.clone())),
            }
        }
        let out = SVCB::new(svcb.svc_priority, svcb.target_name.clone(), params);
        (out, kept_hints, stripped)
    }

    /// Keep what may be handed out, in order.
    fn filter(
        &self,
        served: &Served,
        org: &OrgRef,
        qtype: RecordType,
        records: Vec<Record>,
    ) -> Forwarded {
        let mut out = Forwarded {
            rcode: ResponseCode::NoError,
            answers: Vec::new(),
            bind: Vec::new(),
            stripped: Vec::new(),
            denial: None,
            error: None,
        };
        let mut had_address = false;
        for r in records {
            let ttl = self.clamp_ttl(r.ttl);
            let address = match &r.data {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                _ => None,
            };
            let data = match (address, &r.data) {
                (Some(ip), _) => self.address(served, org, ip, ttl, &mut out, &mut had_address),
                (_, RData::CNAME(_)) => Some(r.data.clone()),
                (_, RData::HTTPS(h)) => {
                    let (svcb, hints, stripped) = self.filter_svcb(served, org, &h.0);
                    out.bind.extend(hints.into_iter().map(|ip| (ip, ttl)));
                    out.stripped.extend(stripped);
                    Some(RData::HTTPS(HTTPS(svcb)))
                }
                (_, RData::SVCB(s)) => {
                    let (svcb, hints, stripped) = self.filter_svcb(served, org, s);
                    out.bind.extend(hints.into_iter().map(|ip| (ip, ttl)));
                    out.stripped.extend(stripped);
                    Some(RData::SVCB(svcb))
                }
                (_, other) if r.record_type() == qtype => Some(other.clone()),
                _ => None,
            };
            if let Some(data) = data {
                out.answers
                    .push(Record::from_rdata(r.name.clone(), ttl, data));
            }
        }
        let addresses_left = out
            .answers
            .iter()
            .any(|r| matches!(r.data, RData::A(_) | RData::AAAA(_)));
        if had_address && !addresses_left && out.denial.is_some() {
            // Every address was stripped: NODATA, and nothing to bind.
            out.answers.clear();
            out.bind.clear();
        } else {
            out.denial = None;
        }
        out
    }

    fn address(
        &self,
        served: &Served,
        org: &OrgRef,
        ip: IpAddr,
        ttl: u32,
        out: &mut Forwarded,
        had_address: &mut bool,
    ) -> Option<RData> {
        *had_address = true;
        match served.policy.answer_allowed(org, ip) {
            Ok(()) => {
                out.bind.push((ip, ttl));
                Some(match ip {
                    IpAddr::V4(v4) => RData::A(A(v4)),
                    IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
                })
            }
            Err(v) => {
                out.stripped.push(ip.to_string());
                out.denial.get_or_insert(v);
                None
            }
        }
    }

    /// Resolve and filter; with the result, until when the same query
    /// would get the same result (`None`: not to be kept).
    async fn forward(
        &self,
        served: &Served,
        org: &OrgRef,
        name: &str,
        qtype: RecordType,
    ) -> (Forwarded, Option<Instant>) {
        let lookup = tokio::time::timeout(
            self.config.query_timeout.get(),
            self.resolver.lookup_records(name, qtype),
        )
        .await
        .unwrap_or(Err(RecordsError::Timeout));
        let failed = |rcode, error: Option<String>| Forwarded {
            rcode,
            answers: Vec::new(),
            bind: Vec::new(),
            stripped: Vec::new(),
            denial: None,
            error,
        };
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
                (self.filter(served, org, qtype, found.records), until)
            }
            Err(RecordsError::NxDomain { negative_ttl }) => {
                (failed(ResponseCode::NXDomain, None), negative(negative_ttl))
            }
            Err(RecordsError::NoData { negative_ttl }) => {
                (failed(ResponseCode::NoError, None), negative(negative_ttl))
            }
            Err(e) => (failed(ResponseCode::ServFail, Some(e.to_string())), None),
        }
    }

    /// What forwarding `host` produced, as the record and the reply show it.
    fn outcome(mut verdict: Verdict, host: String, fwd: Forwarded) -> Outcome {
        if let Some(d) = fwd.denial.clone() {
            verdict = Verdict {
                rule: d.rule.or(verdict.rule),
                ..d
            };
        }
        if fwd.rcode == ResponseCode::ServFail {
            verdict.reason = Reason::ResolutionFailed;
        }
        let mut details = Vec::new();
        if !fwd.stripped.is_empty() {
            details.push(format!("stripped: {}", fwd.stripped.join(", ")));
        }
        if let Some(e) = &fwd.error {
            details.push(e.clone());
        }
        if fwd.rcode == ResponseCode::NXDomain {
            details.push("upstream: NXDOMAIN".into());
        }
        Outcome {
            verdict,
            host,
            rcode: fwd.rcode,
            described: fwd.answers.iter().map(describe).collect(),
            answers: fwd.answers.into(),
            detail: (!details.is_empty()).then(|| details.join("; ")),
            filtered: fwd.denial.is_some(),
            bind: fwd.bind,
        }
    }

    /// Record a forwarded query's outcome (before the answer), bind its
    /// addresses, and build the reply: the same steps whether the outcome
    /// was just made or kept from an earlier query.
    async fn deliver(
        &self,
        served: &Served,
        src: SocketAddr,
        qtype: RecordType,
        org: &OrgRef,
        outcome: &Outcome,
        now: Instant,
    ) -> Reply {
        let mut rec = self.record(served, src, &outcome.verdict, &outcome.host, qtype);
        rec.answers = Some(outcome.described.clone());
        rec.upstream = Some(true);
        rec.detail = outcome.detail.clone();
        let reply = Reply {
            rcode: outcome.rcode,
            answers: outcome.answers.clone(),
            ede: None,
        };
        let mut reply = self.finish(rec, reply).await;
        if outcome.filtered {
            if let Some((_, text)) = &mut reply.ede {
                text.push_str("; answer addresses removed");
            }
        }
        if reply.rcode != ResponseCode::ServFail {
            let valid_for =
                |ttl: u32| Duration::from_secs(u64::from(ttl)) + self.config.binding_grace;
            for (ip, ttl) in &outcome.bind {
                self.bindings
                    .bind(&org.name, &outcome.host, *ip, valid_for(*ttl), now);
            }
        }
        reply
    }

    /// Decide, forward if allowed, record, and build the reply.
    async fn answer(&self, request: &Request) -> Reply {
        let src = request.src();
        let client = src.ip();
        let started = Instant::now();
        // What is served now: this query is decided and recorded under it.
        let served_now = self.served.load_full();
        let served = &*served_now;
        let org = served.policy.org_for(client);
        let bad = |detail: &str, rcode: ResponseCode| (detail.to_string(), rcode);

        // Shape checks first: nothing malformed reaches the decision.
        let shape = if request.metadata.message_type != MessageType::Query {
            Some(bad("not a query", ResponseCode::FormErr))
        } else if request.metadata.op_code != OpCode::Query {
            Some(bad("unsupported opcode", ResponseCode::NotImp))
        } else {
            None
        };
        let info = match (shape, request.request_info()) {
            (None, Ok(info)) => info,
            (shape, _) => {
                let (detail, rcode) =
                    shape.unwrap_or_else(|| bad("not exactly one question", ResponseCode::FormErr));
                let verdict = Verdict {
                    org: org.clone(),
                    reason: Reason::BadRequest,
                    rule: None,
                    would_deny: None,
                };
                let rec = self.refusal(served, src, &verdict, None, None, Some(detail));
                self.record_refusal(rec, Duration::ZERO).await;
                return Reply::empty(rcode);
            }
        };
        let query = info.query;
        let qtype = query.query_type();
        // Host names as every record shows them (no trailing dot); others as sent.
        let shown = || {
            let qname = query.name().to_string();
            super::decide::shown_name(&qname)
                .unwrap_or_else(|| qname.chars().take(MAX_SHOWN_NAME).collect())
        };

        // Refused before the decision, with what was asked; the record
        // waits for room at most `wait`.
        let refuse = |reason: Reason, detail: &str, wait: Duration| {
            let verdict = Verdict {
                org: org.clone(),
                reason,
                rule: None,
                would_deny: None,
            };
            let host = shown();
            let rec = self.refusal(
                served,
                src,
                &verdict,
                Some(&host),
                Some(qtype),
                Some(detail.into()),
            );
            async move {
                let recorded = self.record_refusal(rec, wait).await;
                blocked(ResponseCode::Refused, &verdict, &recorded)
            }
        };
        // Over a limit, the record waits for nothing.
        if !self.per_client.allow(&client, Instant::now()) {
            let limit = "max_queries_per_second_per_client exceeded";
            return refuse(Reason::LimitExceeded, limit, Duration::ZERO).await;
        }
        let org_name = org.as_ref().map(|o| &o.name);
        let _held = match self.queries.try_take(client, org_name) {
            Ok(held) => held,
            Err(limit) => return refuse(Reason::LimitExceeded, limit, Duration::ZERO).await,
        };
        // Within the budgets: a refusal record may wait for room.
        let wait = self.config.query_timeout.get();
        if query.query_class() != DNSClass::IN {
            return refuse(Reason::BadRequest, "class", wait).await;
        }

        // Asked before by this org, under this served version: what the
        // full path made of it then, recorded and bound again now.
        let now = Instant::now();
        let key = org.as_ref().map(|o| Key {
            org: o.index,
            name: query.name().clone(),
            qtype,
        });
        if let (Some(org), Some(key)) = (&org, &key) {
            if let Some(kept) = self.cache.get(&served_now, key, now) {
                // Only answers are kept: paid for like any other (below).
                if !self.refusals.pay(&Some(org.name.clone())) {
                    let limit = crate::limits::EVIDENCE_BUDGET_EXHAUSTED;
                    return refuse(Reason::LimitExceeded, limit, Duration::ZERO).await;
                }
                let reply = self.deliver(served, src, qtype, org, &kept, now).await;
                self.metrics.time_decision(Mode::Dns, started.elapsed());
                return reply;
            }
        }

        let qname = query.name().to_string();
        let decision = decide_query(&served.policy, &served.dns, client, &qname, qtype);
        // An answer's record is paid for from the org's evidence budget
        // before anything is forwarded; spent, the query is refused (and
        // its refusal summarised).
        let answers = matches!(
            decision.action,
            Action::Forward | Action::AnyHinfo | Action::Ptr(_)
        );
        if answers
            && !self
                .refusals
                .pay(&decision.verdict.org.as_ref().map(|o| o.name.clone()))
        {
            let limit = crate::limits::EVIDENCE_BUDGET_EXHAUSTED;
            return refuse(Reason::LimitExceeded, limit, Duration::ZERO).await;
        }
        let host = decision.name.clone().unwrap_or_else(shown);
        let mut verdict = decision.verdict;
        let reply = match decision.action {
            Action::Refuse => {
                let rec = self.refusal(served, src, &verdict, Some(&host), Some(qtype), None);
                let recorded = self.record_refusal(rec, wait).await;
                blocked(ResponseCode::Refused, &verdict, &recorded)
            }
            Action::Denied(style) => {
                let rec = self.refusal(served, src, &verdict, Some(&host), Some(qtype), None);
                let recorded = self.record_refusal(rec, wait).await;
                blocked(denied_rcode(style), &verdict, &recorded)
            }
            Action::NxDomain | Action::NoData => {
                let rcode = if decision.action == Action::NxDomain {
                    ResponseCode::NXDomain
                } else {
                    ResponseCode::NoError
                };
                let rec = self.refusal(served, src, &verdict, Some(&host), Some(qtype), None);
                self.record_refusal(rec, wait).await;
                Reply::empty(rcode)
            }
            Action::AnyHinfo => {
                let hinfo = Record::from_rdata(
                    query.original().name().clone(),
                    self.clamp_ttl(3600),
                    RData::HINFO(HINFO::new("RFC8482".into(), String::new())),
                );
                let mut rec = self.record(served, src, &verdict, &host, qtype);
                rec.answers = Some(vec![describe(&hinfo)]);
                rec.upstream = Some(false);
                self.finish(
                    rec,
                    Reply {
                        rcode: ResponseCode::NoError,
                        answers: Arc::new([hinfo]),
                        ede: None,
                    },
                )
                .await
            }
            Action::Ptr(addr) => {
                let org_name = verdict.org.as_ref().map(|o| o.name.clone());
                let names = org_name
                    .as_deref()
                    .map(|o| self.bindings.names_for(o, addr, now))
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
                        .get(verdict.org.as_ref().map_or(usize::MAX, |o| o.index))
                        .map(|o| o.denied)
                        .unwrap_or_default();
                    let rec = self.refusal(served, src, &verdict, Some(&host), Some(qtype), None);
                    let recorded = self.record_refusal(rec, wait).await;
                    blocked(denied_rcode(style), &verdict, &recorded)
                } else {
                    verdict.reason = Reason::RuleMatch;
                    let mut rec = self.record(served, src, &verdict, &host, qtype);
                    rec.answers = Some(answers.iter().map(describe).collect());
                    rec.upstream = Some(false);
                    rec.detail = Some("answered from this org's bindings".into());
                    self.finish(
                        rec,
                        Reply {
                            rcode: ResponseCode::NoError,
                            answers: answers.into(),
                            ede: None,
                        },
                    )
                    .await
                }
            }
            Action::Forward => {
                let (Some(org), Some(key)) = (verdict.org.clone(), key) else {
                    return Reply::empty(ResponseCode::Refused);
                };
                // Boxed: the resolver's future is large and only this
                // (uncached) path needs it; every query's task stays small.
                let (fwd, until) = Box::pin(self.forward(served, &org, &host, qtype)).await;
                let outcome = Arc::new(Self::outcome(verdict, host, fwd));
                if let Some(until) = until {
                    self.cache
                        .insert(&served_now, key, outcome.clone(), until, now);
                }
                self.deliver(served, src, qtype, &org, &outcome, now).await
            }
        };
        self.metrics.time_decision(Mode::Dns, started.elapsed());
        reply
    }

    fn record(
        &self,
        served: &Served,
        src: SocketAddr,
        verdict: &Verdict,
        host: &str,
        qtype: RecordType,
    ) -> EvRecord {
        let hash = served.policy.hash_arc();
        let mut rec = EvRecord::decision(Kind::Dns, Mode::Dns, src, verdict, hash);
        rec.host = Some(host.to_string());
        rec.qtype = Some(qtype.to_string());
        rec
    }

    /// The record of a query that gets no answers and sends nothing upstream.
    fn refusal(
        &self,
        served: &Served,
        src: SocketAddr,
        verdict: &Verdict,
        host: Option<&str>,
        qtype: Option<RecordType>,
        detail: Option<String>,
    ) -> EvRecord {
        let hash = served.policy.hash_arc();
        let mut rec = EvRecord::decision(Kind::Dns, Mode::Dns, src, verdict, hash);
        rec.host = host.map(str::to_string);
        rec.qtype = qtype.map(|t| t.to_string());
        rec.answers = Some(Vec::new());
        rec.upstream = Some(false);
        rec.detail = detail;
        rec
    }

    /// Record a DNS-over-TCP connection closed at once over `limit`.
    pub(crate) async fn refuse_connection(&self, src: SocketAddr, limit: &str) {
        let served = self.served.load_full();
        let verdict = Verdict {
            org: served.policy.org_for(src.ip()),
            reason: Reason::LimitExceeded,
            rule: None,
            would_deny: None,
        };
        let rec = self.refusal(&served, src, &verdict, None, None, Some(limit.into()));
        self.record_refusal(rec, Duration::ZERO).await;
    }

    /// Record a refusal (nothing flows because of it, so the answer does
    /// not wait for the write): queued when the writer has room within
    /// `wait`, else counted into a summary ([`Refusals`]).
    async fn record_refusal(&self, mut rec: EvRecord, wait: Duration) -> Recorded {
        let recorded = self.refusals.record(&mut rec, wait).await;
        debug!(client = ?rec.client, host = ?rec.host, reason = %rec.reason, ?recorded, "dns refused");
        recorded
    }

    /// Write the record of an answer before it is sent; without evidence,
    /// no answer (SERVFAIL, `evidence_unavailable`).
    async fn finish(&self, mut rec: EvRecord, mut reply: Reply) -> Reply {
        if let Err(e) = self.evidence.write(&mut rec).await {
            warn!(error = %e, "dns: evidence write failed; answering SERVFAIL");
            // Counted as what happened: refused, unrecorded.
            rec.reason = Reason::EvidenceUnavailable;
            rec.would_deny = None;
            self.metrics.count_record(&rec);
            return Reply::empty(ResponseCode::ServFail);
        }
        self.metrics.count_record(&rec);
        if !rec.reason.is_allow() && rec.reason != Reason::ResolutionFailed {
            reply.ede = Some((
                EDE_BLOCKED,
                format!("palisade: {}; record={}", rec.reason, rec.shown()),
            ));
        }
        reply
    }
}

/// The rcode of a denied name, as the org wants it.
fn denied_rcode(style: DnsDenied) -> ResponseCode {
    match style {
        DnsDenied::Refused => ResponseCode::Refused,
        DnsDenied::Nxdomain => ResponseCode::NXDomain,
    }
}

/// A refusal with its Extended DNS Error (naming its record, or saying it
/// was summarised).
fn blocked(rcode: ResponseCode, verdict: &Verdict, recorded: &Recorded) -> Reply {
    let code = if verdict.reason == Reason::UnknownClient {
        EDE_PROHIBITED
    } else {
        EDE_BLOCKED
    };
    Reply {
        rcode,
        answers: Arc::new([]),
        ede: Some((
            code,
            format!("palisade: {}; {}", verdict.reason, recorded.reference()),
        )),
    }
}

impl Shim {
    /// Answer one decoded request: the encoded response. Over UDP it is cut
    /// to what the client can take (its EDNS payload size, at most
    /// [`MAX_UDP_PAYLOAD`], else 512 bytes), with TC set when records did
    /// not fit.
    pub(crate) async fn respond(&self, request: &Request, protocol: Protocol) -> Vec<u8> {
        let reply = self.answer(request).await;
        encode(request, &reply, protocol)
    }
}

/// The response to `request` carrying `reply`.
fn encode(request: &Request, reply: &Reply, protocol: Protocol) -> Vec<u8> {
    let mut metadata = Metadata::response_from_request(&request.metadata);
    metadata.recursion_available = true;
    metadata.response_code = reply.rcode;
    let mut builder = MessageResponseBuilder::from_message_request(request);
    // Only our own EDNS goes back: client options (ECS, cookies,
    // unknown ones) are neither echoed nor forwarded.
    let edns = request.edns.as_ref().map(|req| {
        let mut e = Edns::new();
        e.set_max_payload(req.max_payload().clamp(512, MAX_UDP_PAYLOAD));
        e.set_version(0);
        if let Some((code, text)) = &reply.ede {
            e.options_mut().insert(ede_option(*code, text));
        }
        e
    });
    if let Some(e) = &edns {
        builder.edns(e);
    }
    let max = match (protocol, &edns) {
        (Protocol::Udp, Some(e)) => e.max_payload(),
        (Protocol::Udp, None) => 512,
        _ => u16::MAX,
    };
    let response = builder.build(metadata, reply.answers.iter(), [], [], []);
    let mut bytes = Vec::with_capacity(512);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.set_max_size(max);
    if let Err(e) = response.destructive_emit(&mut encoder) {
        warn!(error = %e, "dns: encoding the response failed; answering SERVFAIL");
        bytes.clear();
        metadata.response_code = ResponseCode::ServFail;
        let header = Header {
            metadata,
            counts: HeaderCounts::default(),
        };
        let mut encoder = BinEncoder::new(&mut bytes);
        if header.emit(&mut encoder).is_err() {
            bytes.clear();
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use hickory_server::proto::op::{Message, Query};
    use hickory_server::proto::rr::rdata::{CNAME, SOA};
    use serde_json::Value;

    use crate::config;
    use crate::policy::Policy;

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
        let metrics = Arc::new(Metrics::new(ev.counters().clone()));
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
            let first = cached.answer(&req).await;
            assert_eq!(cached.cache.hits(), hits, "{qname}: first is a miss");
            let bound_first = cached.bindings.len();
            cached.bindings = Arc::new(Bindings::new(8, 1024, 4096));
            let second = cached.answer(&req).await;
            let hit = cached.cache.hits() == hits + 1;
            assert_eq!(hit, kept, "{qname}: kept");
            assert_eq!(cached.bindings.len(), bound_first, "{qname}: bindings");
            let third = plain.answer(&req).await;
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
        let first = shim.answer(&a).await;
        assert_eq!(shim.answer(&a).await.answers[0].ttl, 300);
        assert_eq!(shim.cache.hits(), 1);
        // The same name in any case is the same question.
        let upper = request(ACME, "ALLOWED.Test.", RecordType::A);
        assert_eq!(shown(&shim.answer(&upper).await), shown(&first));
        assert_eq!(shim.cache.hits(), 2);
        let beta = shim.answer(&b).await;
        assert_eq!(shim.cache.hits(), 2, "beta's first answer is its own");
        assert_eq!(beta.answers.len(), 1);
        assert_eq!(beta.answers[0].ttl, 300);
        shim.answer(&b).await;
        assert_eq!(shim.cache.hits(), 3);
        assert_eq!(shim.cache.org_len(0), 1);
        assert_eq!(shim.cache.org_len(1), 1);

        // A reload that denies the name to acme.
        let denied = POLICY.replacen("host = \"allowed.test\"", "host = \"other.test\"", 1);
        shim.served.store(Arc::new(served(&denied, &shim.metrics)));
        let refused = shim.answer(&a).await;
        assert_eq!(refused.rcode, ResponseCode::Refused);
        assert_eq!(shim.cache.hits(), 3);
        // Beta's entry went with the old version; its answer is unchanged.
        let beta_again = shim.answer(&b).await;
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

    #[test]
    fn ede_bytes() {
        let EdnsOption::Unknown(code, data) = ede_option(15, "x") else {
            panic!("not an unknown option")
        };
        assert_eq!(code, 15);
        assert_eq!(data, vec![0, 15, b'x']);
    }
}
