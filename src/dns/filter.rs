//! Forwarding an allowed query and filtering what comes back: the
//! answers get their TTLs as first seen ([`super::ttl`]) within
//! `min_ttl`..`max_ttl`, addresses the org may not be handed are removed
//! (`answer_allowed`), SVCB/HTTPS lose `ech` and disallowed hints, and
//! what is left is what gets bound to (org, name). The result
//! ([`Forwarded`]) is what [`super::cache`] keeps.

use std::net::IpAddr;
use std::sync::Arc;

use hickory_server::proto::op::ResponseCode;
use hickory_server::proto::rr::rdata::svcb::{IpHint, Mandatory, SvcParamKey, SvcParamValue};
use hickory_server::proto::rr::rdata::{A, AAAA, HTTPS, SVCB};
use hickory_server::proto::rr::{RData, Record, RecordType};

use crate::config::DnsConfig;
use crate::policy::{OrgRef, Reason, Verdict};
use crate::served::Served;

/// What forwarding made of a query, before its record is written: the
/// same for every query of one org for one name and type while the answer
/// lasts, so it is what [`super::cache`] keeps.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Forwarded {
    /// The verdict the record carries (a stripped answer's denial).
    pub(super) verdict: Verdict,
    /// The normalised name.
    pub(super) host: String,
    pub(super) rcode: ResponseCode,
    pub(super) answers: Arc<[Record]>,
    /// The record's `answers`.
    pub(super) described: Arc<[String]>,
    /// The record's `detail`.
    pub(super) detail: Option<String>,
    /// Addresses were removed and none is left.
    pub(super) filtered: bool,
    /// Addresses to bind to (org, name), with their TTL.
    pub(super) bind: Vec<(IpAddr, u32)>,
}

/// The resolver's answer, filtered.
pub(super) struct Filtered {
    rcode: ResponseCode,
    answers: Vec<Record>,
    /// Addresses handed out (answers and SVCB hints), with their TTL.
    bind: Vec<(IpAddr, u32)>,
    stripped: Vec<String>,
    /// The first stripped address's denial, when nothing is left.
    denial: Option<Verdict>,
    error: Option<String>,
}

impl Filtered {
    /// No answer: `rcode`, and the error that made it, if any.
    pub(super) fn failed(rcode: ResponseCode, error: Option<String>) -> Filtered {
        Filtered {
            rcode,
            answers: Vec::new(),
            bind: Vec::new(),
            stripped: Vec::new(),
            denial: None,
            error,
        }
    }
}

/// An answer as its record shows it.
pub(super) fn describe(r: &Record) -> String {
    format!("{} {}", r.record_type(), r.data)
}

impl Forwarded {
    /// What forwarding `host` produced, as the record and the reply show it.
    pub(super) fn new(mut verdict: Verdict, host: String, fwd: Filtered) -> Forwarded {
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
        Forwarded {
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
}

/// `ttl` within `min_ttl`..`max_ttl`.
pub(super) fn clamp_ttl(config: &DnsConfig, ttl: u32) -> u32 {
    let min = u32::try_from(config.min_ttl.as_secs()).unwrap_or(u32::MAX);
    let max = u32::try_from(config.max_ttl.as_secs()).unwrap_or(u32::MAX);
    ttl.clamp(min, max.max(min))
}

/// Strip `ech` from an SVCB/HTTPS record and hints the org may not be
/// handed; returns the kept hints.
fn filter_svcb(served: &Served, org: &OrgRef, svcb: &SVCB) -> (SVCB, Vec<IpAddr>, Vec<String>) {
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
pub(super) fn filter(
    config: &DnsConfig,
    served: &Served,
    org: &OrgRef,
    qtype: RecordType,
    records: Vec<Record>,
) -> Filtered {
    let mut out = Filtered {
        rcode: ResponseCode::NoError,
        answers: Vec::new(),
        bind: Vec::new(),
        stripped: Vec::new(),
        denial: None,
        error: None,
    };
    let mut had_address = false;
    for r in records {
        let ttl = clamp_ttl(config, r.ttl);
        let address = match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        };
        let data = match (address, &r.data) {
            (Some(ip), _) => keep_address(served, org, ip, ttl, &mut out, &mut had_address),
            (_, RData::CNAME(_)) => Some(r.data.clone()),
            (_, RData::HTTPS(h)) => {
                let (svcb, hints, stripped) = filter_svcb(served, org, &h.0);
                out.bind.extend(hints.into_iter().map(|ip| (ip, ttl)));
                out.stripped.extend(stripped);
                Some(RData::HTTPS(HTTPS(svcb)))
            }
            (_, RData::SVCB(s)) => {
                let (svcb, hints, stripped) = filter_svcb(served, org, s);
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

/// An address record's data, if `org` may be handed `ip` (bound with
/// `ttl`); else it is stripped.
fn keep_address(
    served: &Served,
    org: &OrgRef,
    ip: IpAddr,
    ttl: u32,
    out: &mut Filtered,
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
