//! The shim's `RequestHandler`: decide ([`super::decide`]), forward allowed
//! names, filter and bind the answers, write evidence, then answer.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_server::proto::op::{
    Edns, Header, HeaderCounts, MessageType, Metadata, OpCode, ResponseCode,
};
use hickory_server::proto::rr::rdata::opt::EdnsOption;
use hickory_server::proto::rr::rdata::svcb::{IpHint, Mandatory, SvcParamKey, SvcParamValue};
use hickory_server::proto::rr::rdata::{A, AAAA, HINFO, HTTPS, PTR, SVCB};
use hickory_server::proto::rr::{DNSClass, Name, RData, Record, RecordType};
use hickory_server::server::{Request, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use tracing::{debug, warn};

use super::bindings::Bindings;
use super::budget::{QueryBudget, TcpBudget};
use super::decide::{decide_query, Action};
use super::refusals::{Recorded, Refusals};
use super::ttl::TtlMemo;
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
    pub per_client: Arc<crate::proxy::limits::RateLimiter<IpAddr>>,
    /// Refusal records, one by one while the writer has room, else tallied.
    pub refusals: Refusals,
    /// Answer TTLs as first seen, so they do not count down across orgs.
    pub ttls: TtlMemo,
}

/// The answer to send, before encoding.
#[derive(Debug)]
struct Reply {
    rcode: ResponseCode,
    answers: Vec<Record>,
    ede: Option<(u16, String)>,
}

impl Reply {
    fn empty(rcode: ResponseCode) -> Reply {
        Reply {
            rcode,
            answers: Vec::new(),
            ede: None,
        }
    }
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
            per_client: Arc::new(crate::proxy::limits::RateLimiter::new(
                config.max_queries_per_second_per_client,
                65_536,
            )),
            // Its own until the proxy's is shared ([`Shim::with_evidence_budget`]).
            refusals: Refusals::new(
                evidence.clone(),
                metrics.clone(),
                Arc::new(crate::proxy::limits::EvidenceBudget::new(
                    crate::config::default_max_records_per_second_per_org(
                        &crate::config::Limits::default(),
                        &config,
                    ),
                )),
            ),
            ttls: TtlMemo::default(),
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
    pub fn with_evidence_budget(
        mut self,
        budget: Arc<crate::proxy::limits::EvidenceBudget>,
    ) -> Shim {
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

    async fn forward(
        &self,
        served: &Served,
        org: &OrgRef,
        name: &str,
        qtype: RecordType,
    ) -> Forwarded {
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
        match lookup {
            Ok(mut records) => {
                // Every org gets the TTLs the answer had when first seen.
                self.ttls.apply(name, qtype, &mut records, Instant::now());
                self.filter(served, org, qtype, records)
            }
            Err(RecordsError::NxDomain) => failed(ResponseCode::NXDomain, None),
            Err(RecordsError::NoData) => failed(ResponseCode::NoError, None),
            Err(e) => failed(ResponseCode::ServFail, Some(e.to_string())),
        }
    }

    /// Decide, forward if allowed, record, and build the reply.
    async fn answer(&self, request: &Request) -> Reply {
        let src = request.src();
        let client = src.ip();
        let started = Instant::now();
        // What is served now: this query is decided and recorded under it.
        let served = &*self.served.load_full();
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
        let qname = query.name().to_string();
        // Host names as every record shows them (no trailing dot); others as sent.
        let shown: String = super::decide::shown_name(&qname)
            .unwrap_or_else(|| qname.chars().take(MAX_SHOWN_NAME).collect());

        // Refused before the decision, with what was asked; the record
        // waits for room at most `wait`.
        let refuse = |reason: Reason, detail: &str, wait: Duration| {
            let verdict = Verdict {
                org: org.clone(),
                reason,
                rule: None,
                would_deny: None,
            };
            let (host, qtype) = (Some(shown.as_str()), Some(qtype));
            let rec = self.refusal(served, src, &verdict, host, qtype, Some(detail.into()));
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
            let limit = crate::proxy::limits::EVIDENCE_BUDGET_EXHAUSTED;
            return refuse(Reason::LimitExceeded, limit, Duration::ZERO).await;
        }
        let host = decision.name.clone().unwrap_or(shown);
        let mut verdict = decision.verdict;
        let now = Instant::now();
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
                        answers: vec![hinfo],
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
                            answers,
                            ede: None,
                        },
                    )
                    .await
                }
            }
            Action::Forward => {
                let Some(org) = verdict.org.clone() else {
                    return Reply::empty(ResponseCode::Refused);
                };
                let fwd = self.forward(served, &org, &host, qtype).await;
                if let Some(d) = fwd.denial.clone() {
                    verdict = Verdict {
                        rule: d.rule.or(verdict.rule),
                        ..d
                    };
                }
                if fwd.rcode == ResponseCode::ServFail {
                    verdict.reason = Reason::ResolutionFailed;
                }
                let mut rec = self.record(served, src, &verdict, &host, qtype);
                rec.answers = Some(fwd.answers.iter().map(describe).collect());
                rec.upstream = Some(true);
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
                rec.detail = (!details.is_empty()).then(|| details.join("; "));
                let filtered = fwd.denial.is_some();
                let reply = Reply {
                    rcode: fwd.rcode,
                    answers: fwd.answers,
                    ede: None,
                };
                let mut reply = self.finish(rec, reply).await;
                if filtered {
                    if let Some((_, text)) = &mut reply.ede {
                        text.push_str("; answer addresses removed");
                    }
                }
                if reply.rcode != ResponseCode::ServFail {
                    let valid_for =
                        |ttl: u32| Duration::from_secs(u64::from(ttl)) + self.config.binding_grace;
                    for (ip, ttl) in &fwd.bind {
                        self.bindings
                            .bind(&org.name, &host, *ip, valid_for(*ttl), now);
                    }
                }
                reply
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
        answers: Vec::new(),
        ede: Some((
            code,
            format!("palisade: {}; {}", verdict.reason, recorded.reference()),
        )),
    }
}

impl Shim {
    /// Answer one decoded request through `response_handle`.
    pub(crate) async fn respond<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response_handle: R,
    ) -> ResponseInfo {
        let reply = self.answer(request).await;
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
        let response = builder.build(metadata, reply.answers.iter(), [], [], []);
        match response_handle.send_response(response).await {
            Ok(info) => info,
            Err(e) => {
                debug!(error = %e, "dns: sending the response failed");
                metadata.response_code = ResponseCode::ServFail;
                ResponseInfo::from(Header {
                    metadata,
                    counts: HeaderCounts::default(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ede_bytes() {
        let EdnsOption::Unknown(code, data) = ede_option(15, "x") else {
            panic!("not an unknown option")
        };
        assert_eq!(code, 15);
        assert_eq!(data, vec![0, 15, b'x']);
    }
}
