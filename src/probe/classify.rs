//! Classification: what a probe's observation and the records that fit
//! it ([`super::fit`]) together show (one of the [`Class`]es, and why).
//! Pure: an observation and records in, a class out.
//!
//! In-tunnel probes (`second_host`, `silence`, `ech`) get no 403 to quote:
//! Palisade closes the tunnel. Their denial is a fitting record (or one
//! naming the tunnel's decision record in `conn`) whose `reason` is one of the in-tunnel reasons ([`TUNNEL_REASONS`])
//! and whose `host` or `sni` is a name the probe presented (the CONNECT
//! host, the SNI, the second request's Host). `request` probes on an
//! intercepted host get a 403.
//!
//! The observation only says what the client saw; a record id it quotes
//! is checked by the report, not here.
//!
//! Classification (expect / what the client saw / what Palisade recorded):
//!
//! | expect | client | Palisade's records | class |
//! |---|---|---|---|
//! | any | probe never got to try (proxy unreachable, name unresolvable, deadline) | none | `inconclusive` |
//! | deny | target answered | any | `unexpected_allow` |
//! | deny, not in-tunnel | any | an allow, whatever else | `unexpected_allow` |
//! | deny | did not answer | a `resolution_failed` deny naming a rule | `unexpected_allow` |
//! | deny | did not answer | a policy denial of its own request ([`not_caused_by`]; in-tunnel: one that closed the tunnel, or the tunnel never allowed) | `enforced_deny` |
//! | deny, `second_host` | no second response, the upstream closed after the first | allow only | `inconclusive` (nothing could answer the second request) |
//! | deny | did not answer | none | `blocked_elsewhere` |
//! | allow | target answered | allow | `enforced_allow` |
//! | allow | target answered | none | `inconclusive` (a path around Palisade, or evidence missing; the report lists it as a finding) |
//! | allow | did not answer | a policy denial | `unexpected_deny` |
//! | allow | did not answer | `resolution_failed`, allow with a connect failure | `inconclusive` (upstream broken) |
//! | allow | did not answer | none | `blocked_elsewhere` |
//!
//! "Target answered" for in-tunnel probes means the part after the tunnel
//! opened: a response to the second request, a TLS reply to the late or
//! ECH ClientHello; a connection left open and silent after it, with only
//! the tunnel's allow recorded, is `unexpected_allow` too (Palisade
//! forwarded it). The `why` of an `enforced_deny` says whether the tunnel
//! was closed by an in-tunnel check or refused before it opened (then what
//! it carries was not exercised).
//!
//! A DNS allow probe counts as answered only with at least one answer.
//! Denials by Palisade's state rather than the rule ([`INFRA_REASONS`]:
//! `evidence_unavailable`, `limit_exceeded`, `name_budget_exceeded`,
//! `synthetic_unbound`, `policy_revoked`) are `inconclusive`. A denial that
//! fits the probe but that its request could not have caused
//! ([`not_caused_by`]) is left out here: it shows nothing of the probe
//! (the report lists it as a mismatch, a finding).
//!
//! A probe run while enforcement was not verified (the gateway ruleset
//! not loaded as written: from an enforcement `failed` record to the next
//! `verified` one, [`unverified_during`]) shows nothing of what Palisade
//! enforced: had it been `enforced_allow`, `enforced_deny` or
//! `blocked_elsewhere`, it is `inconclusive` (the report does this).
//!
//! A `dns-burst` probe (N new names under an allowed wildcard, see
//! [`name_counts`]) is classified by counts, not by one record
//! ([`classify_burst`]):
//!
//! | what the records show | class |
//! |---|---|
//! | names reached the upstream and the plan's budget is 0 (none: names leave unbounded) | `unexpected_allow` |
//! | more names reached the upstream than the budget lets through in the time they took | `unexpected_allow` |
//! | no name sent | `inconclusive` |
//! | a name the client sent is on no record (by name, or counted by a refusal summary) | `missing` |
//! | no more names sent than the budget (nothing past it was tried) | `inconclusive` |
//! | otherwise: within the budget, every name on record | `enforced_deny` |

use std::collections::BTreeSet;
use std::fmt::Write as _;

use serde::Serialize;

use super::fit::is_dns_summary;
use super::plan::{is_burst_name, parse_target, Target};
use super::run::{Observation, ProbeOutcome};
use super::{Class, Expect, Via};
use crate::evidence::Record;
use crate::policy::Reason;

pub(crate) use crate::analysis::TUNNEL_REASONS;

/// The enforcement record that shows the gateway ruleset was not
/// verified at some time from `started` to `finished` (RFC 3339), if one
/// does: the last of `timeline` (enforcement records, in chain order) at
/// or before `started` when it is `failed`, else the first `failed` one
/// after `started` and at or before `finished`. No enforcement records
/// (no `[enforcement]`): none. Probe times that do not read: the first
/// `failed` record, if any (not verified is not shown otherwise).
pub(crate) fn unverified_during<'a>(
    timeline: &'a [Record],
    started: &str,
    finished: &str,
) -> Option<&'a Record> {
    use crate::evidence::Event;
    let at = |t: &str| humantime::parse_rfc3339_weak(t).ok();
    let failed = |r: &&Record| r.event == Event::Failed;
    let (Some(start), Some(end)) = (at(started), at(finished)) else {
        return timeline.iter().find(failed);
    };
    let before = timeline
        .iter()
        .rev()
        .find(|r| at(&r.ts).is_some_and(|t| t <= start));
    if let Some(r) = before.filter(failed) {
        return Some(r);
    }
    timeline
        .iter()
        .filter(failed)
        .find(|r| at(&r.ts).is_some_and(|t| t > start && t <= end))
}

/// Does the probe test what an open tunnel carries?
pub(crate) fn in_tunnel(o: &Observation) -> bool {
    o.second_host.is_some() || o.silence_ms.is_some() || o.ech
}

/// The names a probe presented (target host, SNI, second Host), lower-cased.
fn presented_names(o: &Observation) -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(t) = parse_target(&o.target) {
        if let Some((h, _)) = t.host_port() {
            names.push(h.trim_start_matches('[').trim_end_matches(']').to_string());
        }
        if let Target::Tls { sni, .. } = t {
            names.push(sni);
        }
    }
    names.extend(o.second_host.iter().cloned());
    names
        .into_iter()
        .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
        .collect()
}

/// Denials that closed the probe's tunnel for what it carried: an in-tunnel
/// reason, naming a name the probe presented.
fn tunnel_denials<'a>(o: &Observation, deny: &[&'a Record]) -> Vec<&'a Record> {
    let names = presented_names(o);
    let named = |v: &Option<String>| {
        let v = v
            .as_deref()
            .unwrap_or_default()
            .trim_end_matches('.')
            .to_ascii_lowercase();
        !v.is_empty() && names.contains(&v)
    };
    deny.iter()
        .copied()
        .filter(|r| TUNNEL_REASONS.contains(&r.reason))
        .filter(|r| named(&r.host) || named(&r.sni))
        .collect()
}

/// The allows that let the probe's traffic through: all of them but a
/// tunnel's whose request inside it (an intercepted connection's, from
/// the same client socket) Palisade denied.
fn carried_allow<'a>(allow: &[&'a Record], deny: &[&Record]) -> Vec<&'a Record> {
    allow
        .iter()
        .copied()
        .filter(|a| {
            !(a.kind == crate::evidence::Kind::Tcp
                && deny
                    .iter()
                    .any(|d| d.kind == crate::evidence::Kind::Http && d.client == a.client))
        })
        .collect()
}

/// Denials that say nothing about policy: Palisade could not decide, or
/// decided by its state rather than by the request (a name budget the
/// sandbox can spend first, a synthetic binding it can have evicted, a
/// reload): `inconclusive`, never enforcement of the rule the probe tests.
const INFRA_REASONS: [Reason; 7] = [
    Reason::EvidenceUnavailable,
    Reason::VolumeExceeded,
    Reason::EnforcementMissing,
    Reason::LimitExceeded,
    Reason::NameBudgetExceeded,
    Reason::SyntheticUnbound,
    Reason::PolicyRevoked,
];

/// Reasons any request to a destination gets, whatever it carries: where
/// it goes (and who asks) decides them.
const DESTINATION_REASONS: [Reason; 7] = [
    Reason::NoMatchingRule,
    Reason::ExplicitDeny,
    Reason::PortNotAllowed,
    Reason::DeniedAddress,
    Reason::UnknownClient,
    Reason::SpecialName,
    Reason::AuthRequired,
];

/// Why the denial `r`, which fits the probe by target and time, cannot be
/// of the probe's own request (none when it can, and for records that are
/// not policy denials: those never show enforcement anyway).
///
/// The sandbox can make any request it likes during a probe's window, and
/// move the window. What it cannot do is make Palisade record a denial of
/// a request that differs from the probe's by nothing Palisade decides on.
/// So a denial counts only when it is of a request like the probe's, as
/// far as the record shows: the probe's path to Palisade (through the
/// proxy as an absolute-form request or a tunnel, or direct), its
/// destination (the plan's target with the plan's own marker, see
/// [`super::fit`]), its query type, its path, and a reason the probe's
/// request can provoke: a Host other than the target's only from a probe
/// that sends one (`host_header`, `second_host`), an SNI other than the
/// host only from a `tls://` probe whose `sni` differs, ECH only from an
/// `ech` probe, a path or method refusal only with the probe's path on
/// record; a malformed request, an upgrade or bad credentials never (the
/// probe sends none).
pub(crate) fn not_caused_by(o: &Observation, r: &Record) -> Option<String> {
    use crate::evidence::{Kind, Mode};
    let reason = r.reason;
    if r.decision_str() != "deny"
        || reason == Reason::ResolutionFailed
        || INFRA_REASONS.contains(&reason)
    {
        return None;
    }
    let Ok(target) = parse_target(&o.target) else {
        return Some("the probe's target is not readable".into());
    };
    let what = format!("{} ({reason})", r.id);
    let tunnel = !matches!(target, Target::Http { tls: false, .. }) || o.second_host.is_some();
    let path_ok = match (&target, o.via) {
        (Target::DnsBurst { .. }, _) => return None,
        (Target::Dns { .. }, _) => r.kind == Kind::Dns,
        (Target::Udp { .. }, _) => r.kind == Kind::Bypass,
        (_, Via::Proxy) => {
            r.mode == Mode::Explicit && (r.kind == Kind::Http || (tunnel && r.kind == Kind::Tcp))
        }
        (_, Via::Direct) => matches!(r.mode, Mode::Transparent | Mode::Dns),
    };
    if !path_ok {
        let how = match (&target, o.via) {
            (Target::Dns { .. }, _) => "a DNS query",
            (Target::Udp { .. }, _) => "UDP the gateway logs",
            (_, Via::Proxy) if !tunnel => "an absolute-form request to the explicit proxy",
            (_, Via::Proxy) => "a CONNECT to the explicit proxy",
            (_, Via::Direct) => "a direct connection",
        };
        return Some(format!(
            "{what} is a {} {} record, and the probe's request was {how}",
            r.mode.as_str(),
            r.kind.as_str()
        ));
    }
    if let (Target::Dns { qtype, .. }, Some(got)) = (&target, &r.qtype) {
        if !got.eq_ignore_ascii_case(qtype) {
            return Some(format!(
                "{what} is of a {got} query, and the probe asked {qtype}"
            ));
        }
    }
    // A connection's denial names the probe's destination: the host it
    // connected to, or direct (transparent: Palisade decides by the name
    // the first bytes carry) the SNI or Host it sent. A second request's
    // names its Host (the fit checks that).
    if let Some((host, _)) = target.host_port() {
        let host = super::fit::norm(host);
        let mut dest = vec![host.clone()];
        if o.via == Via::Direct {
            if let Target::Tls { sni, .. } = &target {
                dest.push(super::fit::norm(sni));
            }
            dest.extend(o.host_header.as_deref().map(super::fit::norm));
        }
        let named = r
            .host
            .as_deref()
            .is_some_and(|h| dest.contains(&super::fit::norm(h)))
            || r.ip.is_some_and(|ip| ip.to_string() == host)
            || r.kind == Kind::Dns;
        let second_request = reason == Reason::HostMismatch && o.second_host.is_some();
        if !(named || second_request) {
            return Some(format!(
                "{what} is of a connection to {}, not to the probe's {host}",
                r.host.as_deref().unwrap_or("an unnamed host")
            ));
        }
    }
    if DESTINATION_REASONS.contains(&reason) {
        return None;
    }
    unprovokable(o, r, &target, tunnel, &what)
}

/// Why the probe's own request cannot have provoked `r`'s reason, as the
/// message naming the record (`what`); `None` when it can.
fn unprovokable(
    o: &Observation,
    r: &Record,
    target: &Target,
    tunnel: bool,
    what: &str,
) -> Option<String> {
    let reason = r.reason;
    let sni_of_probe = match target {
        Target::Tls { sni, .. } => Some(super::fit::norm(sni)),
        Target::Http {
            tls: true, host, ..
        } => Some(super::fit::norm(host)),
        _ => None,
    };
    let host_of_probe = target.host_port().map(|(h, _)| super::fit::norm(h));
    let cannot = match reason {
        Reason::QtypeNotAllowed => {
            (!matches!(target, Target::Dns { .. })).then_some("the probe made no DNS query")
        }
        Reason::HostMismatch => {
            let other_host = o
                .host_header
                .as_deref()
                .is_some_and(|h| Some(super::fit::norm(h)) != host_of_probe);
            (!other_host && o.second_host.is_none())
                .then_some("the probe sends no Host header other than its target's")
        }
        Reason::SniMismatch => (sni_of_probe.is_none() || sni_of_probe == host_of_probe)
            .then_some("the probe's ClientHello names its own host"),
        Reason::SniMissing => {
            let an_address = sni_of_probe
                .as_deref()
                .is_some_and(|s| s.parse::<std::net::IpAddr>().is_ok());
            (!an_address).then_some("the probe's ClientHello names a host")
        }
        Reason::EchNotAllowed => (!o.ech).then_some("the probe's ClientHello has no ECH"),
        Reason::ProtocolMismatch => (matches!(target, Target::Http { tls: false, .. }) && !tunnel)
            .then_some("the probe's request was an absolute-form HTTP request"),
        Reason::PathNotAllowed | Reason::MethodNotAllowed | Reason::ServiceDenied => {
            match (target, &r.path) {
                (Target::Http { path, .. }, Some(got)) if same_path(path, got) => None,
                (Target::Http { path, .. }, Some(got)) => {
                    return Some(format!(
                        "{what} is of a request for {got}, and the probe asked for {path}"
                    ))
                }
                (Target::Http { .. }, None) => {
                    Some("the record names no path, so it may be of another path than the probe's")
                }
                _ => Some("the probe sends no HTTP request"),
            }
        }
        Reason::BadRequest => Some("the probe's request is well-formed"),
        Reason::UpgradeNotAllowed => Some("the probe asks for no upgrade"),
        Reason::AuthFailed => Some("the probe sends no credentials"),
        _ => None,
    };
    cannot.map(|why| format!("{what} cannot be of the probe's own request: {why}"))
}

/// Whether a recorded request path is the probe's: as sent, without its
/// query, or normalised as Palisade decides and records it (evidence keeps
/// a bounded prefix of a long path).
fn same_path(probe: &str, recorded: &str) -> bool {
    let bare = probe.split('?').next().unwrap_or(probe);
    let normal = crate::policy::request::NormalPath::parse(bare).ok();
    let same = |p: &str| p == recorded || (recorded.len() >= 200 && p.starts_with(recorded));
    same(probe) || same(bare) || normal.is_some_and(|n| same(n.as_str()))
}

/// The ids of records, comma-separated.
fn ids(rs: &[&Record]) -> String {
    rs.iter()
        .map(|r| r.id.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `reason (id)` of records, comma-separated.
fn reasons(rs: &[&Record]) -> String {
    rs.iter()
        .map(|r| format!("{} ({})", r.reason, r.id))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a DNS record shows its name sent to the upstream resolver:
/// the shim allowed it and did not answer it itself (`upstream` is not
/// `false`: an answer from the shim's cache, a special name or, with
/// synthetic answers, an address from the pool sends nothing). This is
/// the one place that says what "reached the upstream" means.
pub(crate) fn reached_upstream(r: &Record) -> bool {
    r.kind == crate::evidence::Kind::Dns && r.decision_str() == "allow" && r.upstream != Some(false)
}

/// What a `dns-burst` probe's names came to: what the client says it
/// saw, and what Palisade's records (those that fit the probe) show.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NameCounts {
    /// Distinct names of the plan's template the client says it sent.
    pub sent: usize,
    /// Of those, what the client saw: an answer, a refusal, no reply.
    pub answered: usize,
    pub refused: usize,
    pub no_reply: usize,
    /// Distinct names of the template Palisade recorded as sent to the
    /// upstream ([`reached_upstream`]), whether the client listed them or not.
    pub reached_upstream: usize,
    /// Names sent that a record names (allowed or refused).
    pub on_record: usize,
    /// Refusals the fitting summaries stand for (they name no name).
    pub summarised: u64,
    /// Names sent that no record names and no summary's count covers.
    pub not_on_record: usize,
    /// The plan's budget (0: none).
    pub budget: u32,
    /// How many may reach the upstream: the budget for each minute (or
    /// part of one) between the first and the last name recorded as
    /// reaching it; none without a budget.
    pub allowance: Option<u64>,
    /// Names the client lists that are not of the template (a mismatch).
    pub foreign: usize,
    /// Refusals on record by reason, `reason count`, `, `-separated.
    pub refusal_reasons: String,
}

/// Count a `dns-burst` observation's names against its fitting records
/// (none for any other probe).
pub(crate) fn name_counts(o: &Observation, recs: &[&Record]) -> Option<NameCounts> {
    let Ok(Target::DnsBurst {
        template, budget, ..
    }) = parse_target(&o.target)
    else {
        return None;
    };
    let mut c = NameCounts {
        budget,
        ..NameCounts::default()
    };
    let mut sent = BTreeSet::new();
    for n in &o.names {
        let name = n.name.trim_end_matches('.').to_ascii_lowercase();
        if !is_burst_name(&template, &name) {
            c.foreign += 1;
            continue;
        }
        if !sent.insert(name) {
            continue;
        }
        match n.result.as_str() {
            "answered" => c.answered += 1,
            "refused" => c.refused += 1,
            _ => c.no_reply += 1,
        }
    }
    c.sent = sent.len();
    let named: BTreeSet<String> = recs
        .iter()
        .filter(|r| !is_dns_summary(r))
        .filter_map(|r| r.host.as_deref())
        .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
        .collect();
    let upstream: Vec<&&Record> = recs.iter().filter(|r| reached_upstream(r)).collect();
    c.reached_upstream = upstream
        .iter()
        .filter_map(|r| r.host.as_deref())
        .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
        .collect::<BTreeSet<_>>()
        .len();
    c.on_record = sent.iter().filter(|n| named.contains(*n)).count();
    c.summarised = recs
        .iter()
        .filter(|r| is_dns_summary(r))
        .map(|r| r.count.unwrap_or(0))
        .sum();
    let unnamed = (c.sent - c.on_record) as u64;
    c.not_on_record = unnamed.saturating_sub(c.summarised) as usize;
    c.allowance = (budget > 0).then(|| {
        let times: Vec<std::time::SystemTime> = upstream
            .iter()
            .filter_map(|r| humantime::parse_rfc3339_weak(&r.ts).ok())
            .collect();
        let span = match (times.iter().min(), times.iter().max()) {
            (Some(a), Some(b)) => b.duration_since(*a).unwrap_or_default(),
            _ => std::time::Duration::ZERO,
        };
        u64::from(budget) * (1 + span.as_secs() / crate::limits::names::WINDOW.as_secs())
    });
    let mut reasons: std::collections::BTreeMap<String, u64> = Default::default();
    for r in recs.iter().filter(|r| r.decision_str() == "deny") {
        *reasons.entry(r.reason.to_string()).or_default() += r.count.unwrap_or(1);
    }
    c.refusal_reasons = reasons
        .iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    Some(c)
}

/// One line of a burst's counts.
pub(crate) fn counts_text(c: &NameCounts) -> String {
    let budget = match c.allowance {
        Some(a) if a > u64::from(c.budget) => {
            format!("budget {} a minute ({a} in the time taken)", c.budget)
        }
        Some(_) => format!("budget {}", c.budget),
        None => "no budget".into(),
    };
    let mut t = format!(
        "{} names sent, {} reached the upstream ({budget}), {} of the names sent on record by name",
        c.sent, c.reached_upstream, c.on_record
    );
    if c.summarised > 0 {
        let _ = write!(t, ", {} refusals in summaries", c.summarised);
    }
    if !c.refusal_reasons.is_empty() {
        let _ = write!(t, "; refusals: {}", c.refusal_reasons);
    }
    t
}

/// The class of a `dns-burst` observation (see the module doc), and why.
pub(crate) fn classify_burst(o: &Observation, c: &NameCounts) -> (Class, String) {
    let counts = counts_text(c);
    match c.allowance {
        None if c.reached_upstream > 0 => {
            return (
                Class::UnexpectedAllow,
                format!("names leave unbounded: no new-name budget, and {counts}"),
            )
        }
        Some(a) if c.reached_upstream as u64 > a => {
            return (
                Class::UnexpectedAllow,
                format!("more names reached the upstream than the budget lets through: {counts}"),
            )
        }
        _ => {}
    }
    if c.sent == 0 {
        return (
            Class::Inconclusive,
            format!(
                "no name of the probe was sent: {} ({counts})",
                o.error.as_deref().unwrap_or("nothing sent")
            ),
        );
    }
    if c.not_on_record > 0 {
        return (
            Class::Missing,
            format!(
                "{} of the names sent are on no record, by name or in a summary's count: {counts}",
                c.not_on_record
            ),
        );
    }
    if c.budget > 0 && c.sent <= c.budget as usize {
        return (
            Class::Inconclusive,
            format!(
                "no more names were sent than the budget, so nothing past it was tried: {counts}"
            ),
        );
    }
    (
        Class::EnforcedDeny,
        format!("the names that left stayed within the budget, and every name sent is on record: {counts}"),
    )
}

/// The class of one observation given the records matched to it, and why.
pub(crate) fn classify(o: &Observation, recs: &[&Record]) -> (Class, String) {
    if let Some(c) = name_counts(o, recs) {
        return classify_burst(o, &c);
    }
    let only = |keep: &dyn Fn(&Record) -> bool| -> Vec<&Record> {
        recs.iter().copied().filter(|r| keep(r)).collect()
    };
    let sorted = Sorted {
        recs,
        deny: only(&|r| r.decision_str() == "deny"),
        allow: only(&|r| r.decision_str() == "allow"),
        // Only denials of the probe's own request (the others are listed by
        // the report as mismatches: a finding).
        policy_deny: only(&|r| {
            r.decision_str() == "deny"
                && r.reason != Reason::ResolutionFailed
                && !INFRA_REASONS.contains(&r.reason)
                && not_caused_by(o, r).is_none()
        }),
        unresolved: only(&|r| r.decision_str() == "deny" && r.reason == Reason::ResolutionFailed),
        infra: only(&|r| r.decision_str() == "deny" && INFRA_REASONS.contains(&r.reason)),
    };
    let answered = match o.outcome {
        ProbeOutcome::Reached => {
            !(o.kind == "dns" && o.expect == Expect::Allow && o.dns_answers.is_empty())
        }
        _ => false,
    };
    if o.outcome == ProbeOutcome::SetupFailed && recs.is_empty() {
        return (
            Class::Inconclusive,
            format!(
                "the probe never reached its target or Palisade: {} ({})",
                o.error.as_deref().unwrap_or("setup failed"),
                o.error_detail.as_deref().unwrap_or("")
            ),
        );
    }
    match o.expect {
        Expect::Deny => classify_deny(o, &sorted),
        Expect::Allow => classify_allow(o, &sorted, answered),
    }
}

/// An observation's matched records, sorted by what they say.
struct Sorted<'a> {
    recs: &'a [&'a Record],
    deny: Vec<&'a Record>,
    allow: Vec<&'a Record>,
    /// Denials of the probe's own request (see [`not_caused_by`]).
    policy_deny: Vec<&'a Record>,
    unresolved: Vec<&'a Record>,
    infra: Vec<&'a Record>,
}

/// [`classify`] of a probe expected to be denied.
fn classify_deny(o: &Observation, s: &Sorted<'_>) -> (Class, String) {
    let (allow, policy_deny) = (&s.allow[..], &s.policy_deny[..]);
    let (unresolved, infra) = (&s.unresolved[..], &s.infra[..]);
    if o.outcome == ProbeOutcome::Reached {
        let cite = if allow.is_empty() {
            "with no Palisade record".to_string()
        } else {
            format!("Palisade allowed it: {}", ids(allow))
        };
        return (
            Class::UnexpectedAllow,
            format!("the target answered ({}), {cite}", observed_text(o)),
        );
    }
    if in_tunnel(o) {
        let closed = tunnel_denials(o, policy_deny);
        if !closed.is_empty() {
            let tunnel = if allow.is_empty() {
                String::new()
            } else {
                format!(" (the tunnel was allowed: {})", ids(allow))
            };
            return (
                Class::EnforcedDeny,
                format!(
                    "Palisade closed the tunnel for what it carried: {}{tunnel}",
                    reasons(&closed)
                ),
            );
        }
        if allow.is_empty() && !policy_deny.is_empty() {
            return (
                Class::EnforcedDeny,
                format!(
                    "Palisade refused the connection itself ({}): the tunnel never opened, so what it carries was not exercised",
                    reasons(policy_deny)
                ),
            );
        }
    } else if !carried_allow(allow, policy_deny).is_empty() {
        return (
            Class::UnexpectedAllow,
            format!(
                "Palisade allowed it ({}), whatever the client reported ({})",
                ids(&carried_allow(allow, policy_deny)),
                observed_text(o)
            ),
        );
    } else if !policy_deny.is_empty() {
        return (
            Class::EnforcedDeny,
            format!("Palisade denied: {}", reasons(policy_deny)),
        );
    }
    if !allow.is_empty() && o.second_host.is_some() && o.first_close {
        return (
            Class::Inconclusive,
            format!(
                "the upstream closed the connection after the first response, so nothing could answer the second request, and Palisade recorded no refusal of it (allowed: {}): re-run against an upstream that keeps connections alive",
                ids(allow)
            ),
        );
    }
    if !allow.is_empty() && in_tunnel(o) {
        return (
            Class::UnexpectedAllow,
            format!(
                "Palisade allowed the tunnel ({}) and recorded no refusal of what it carried ({})",
                ids(allow),
                observed_text(o)
            ),
        );
    }
    if let Some((r, rule)) = unresolved
        .iter()
        .find_map(|r| Some((r, r.rule.as_deref().filter(|x| !x.is_empty())?)))
    {
        return (
            Class::UnexpectedAllow,
            format!("the policy allows it (rule {rule}, record {}); it failed only because the name did not resolve", r.id),
        );
    }
    if !infra.is_empty() || !unresolved.is_empty() {
        let all: Vec<&Record> = infra.iter().chain(unresolved).copied().collect();
        return (
            Class::Inconclusive,
            format!("Palisade could not decide on policy: {}", reasons(&all)),
        );
    }
    (
        Class::BlockedElsewhere,
        format!(
            "failed ({}) and Palisade recorded nothing: another layer stopped it; not evidence of Palisade's enforcement",
            observed_text(o)
        ),
    )
}

/// [`classify`] of a probe expected to be allowed; `answered` is whether
/// the target answered it.
fn classify_allow(o: &Observation, s: &Sorted<'_>, answered: bool) -> (Class, String) {
    let (recs, deny, allow) = (s.recs, &s.deny[..], &s.allow[..]);
    let (policy_deny, unresolved, infra) = (&s.policy_deny[..], &s.unresolved[..], &s.infra[..]);
    if answered {
        if !allow.is_empty() && policy_deny.is_empty() {
            return (
                Class::EnforcedAllow,
                format!("Palisade allowed: {}", ids(allow)),
            );
        }
        if recs.is_empty() {
            return (
                Class::Inconclusive,
                "the target answered but Palisade recorded nothing: this path goes around Palisade, or the evidence is incomplete".into(),
            );
        }
        return (
            Class::Inconclusive,
            format!(
                "the target answered despite Palisade's records: {}",
                reasons(deny)
            ),
        );
    }
    if !policy_deny.is_empty() {
        return (
            Class::UnexpectedDeny,
            format!("Palisade denied: {}", reasons(policy_deny)),
        );
    }
    if !unresolved.is_empty() || !infra.is_empty() {
        let all: Vec<&Record> = unresolved.iter().chain(infra).copied().collect();
        return (
            Class::Inconclusive,
            format!("setup failed on Palisade's side: {}", reasons(&all)),
        );
    }
    if !allow.is_empty() {
        let detail: Vec<&str> = allow.iter().filter_map(|r| r.detail.as_deref()).collect();
        return (
            Class::Inconclusive,
            format!(
                "Palisade allowed it ({}) but the target did not answer{}",
                ids(allow),
                if detail.is_empty() {
                    String::new()
                } else {
                    format!(": {}", detail.join("; "))
                }
            ),
        );
    }
    if o.outcome == ProbeOutcome::SetupFailed || (o.via == Via::Proxy && o.stage == "proxy_connect")
    {
        return (
            Class::Inconclusive,
            format!("never reached Palisade: {}", observed_text(o)),
        );
    }
    (
        Class::BlockedElsewhere,
        format!(
            "failed ({}) and Palisade recorded nothing: another layer stopped it",
            observed_text(o)
        ),
    )
}

/// One line on what the client saw.
pub(crate) fn observed_text(o: &Observation) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(c) = o.connect_status {
        parts.push(format!("CONNECT {c}"));
    }
    if let Some(h) = o.http_status {
        parts.push(format!("HTTP {h}"));
    }
    if let Some(ms) = o.silence_ms {
        match o.closed_in_silence_ms {
            Some(c) => parts.push(format!("silent {ms} ms: closed after {c} ms")),
            None => parts.push(format!("silent {ms} ms")),
        }
    }
    if o.ech {
        parts.push("ClientHello with ECH".into());
    }
    if let Some(t) = &o.tls {
        parts.push(format!("TLS {t}"));
    }
    if let Some(h) = &o.second_host {
        let what = match (o.second.as_deref(), o.second_status) {
            (Some("answered"), Some(st)) => format!("HTTP {st}"),
            (Some(w), _) => w.to_string(),
            (None, _) => "not sent".into(),
        };
        parts.push(format!("second request (Host {h}): {what}"));
        if o.first_close {
            parts.push("the first response closed the connection".into());
        }
    }
    if o.kind == "dns-burst" {
        let count = |what: &str| o.names.iter().filter(|n| n.result == what).count();
        let no_reply = o.names.len() - count("answered") - count("refused");
        parts.push(format!(
            "{} names sent: {} answered, {} refused, {no_reply} no reply",
            o.names.len(),
            count("answered"),
            count("refused")
        ));
    }
    if let Some(r) = &o.dns_rcode {
        let mut t = format!("DNS {r}");
        if !o.dns_answers.is_empty() {
            let _ = write!(t, " [{}]", o.dns_answers.join(", "));
        }
        parts.push(t);
    }
    if o.kind == "tcp" && o.connected && o.error.is_none() {
        parts.push(format!("connected, {} bytes received", o.bytes_received));
    }
    if o.kind == "udp" && o.outcome == ProbeOutcome::Reached {
        parts.push(format!("UDP reply, {} bytes", o.bytes_received));
    }
    if let Some(e) = &o.error {
        parts.push(format!("error {e}"));
    }
    if parts.is_empty() {
        parts.push(format!("{:?}", o.outcome).to_lowercase());
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::probe::fit::{assign, Case};

    const CLIENT: &str = "198.18.1.2:40000";

    /// An observation of a deny probe through the proxy, from socket CLIENT
    /// between 12:00:00 and 12:00:03, with `extra` fields on top.
    fn obs(target: &str, extra: Value) -> Observation {
        let mut v = json!({
            "id": "p", "marker": "pp-1-0000", "target": target, "kind": "tls",
            "via": "proxy", "expect": "deny",
            "started": "2030-01-01T12:00:00.000000Z", "finished": "2030-01-01T12:00:03.000000Z",
            "elapsed_ms": 3000,
            "sockets": [{"purpose": "proxy", "proto": "tcp", "local": CLIENT, "remote": "198.18.1.1:3128"}],
            "resolved": [], "connected": true, "connect_status": 200,
            "bytes_sent": 0, "bytes_received": 0, "dns_answers": [],
            "stage": "done", "outcome": "refused",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn rec(id: &str, decision: &str, reason: &str, extra: Value) -> Value {
        let mut v = json!({
            "id": id, "ts": "2030-01-01T12:00:01.000000Z", "kind": "tcp", "event": "decision",
            "client": CLIENT, "mode": "explicit", "decision": decision, "reason": reason,
            "host": "allowed.test", "port": 443, "sni": null, "policy": "p0",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// Records as the evidence reader gives them.
    fn typed(records: &[Value]) -> Vec<Record> {
        records
            .iter()
            .map(|v| serde_json::from_value(v.clone()).unwrap())
            .collect()
    }

    /// The records that fit `o` as the only probe of a plan with no org.
    fn match_records<'a>(o: &Observation, records: &'a [Record]) -> Vec<&'a Record> {
        let mut plan = crate::probe::plan::Probe::new(&o.id, &o.target, o.via, o.expect);
        plan.second_host = o.second_host.clone();
        let ips = o
            .sockets
            .iter()
            .filter_map(|s| s.local.as_deref()?.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip())
            .collect();
        let cases = [Some(Case::new(o, &plan, None, ips, None))];
        assign(&cases, records)[0]
            .iter()
            .map(|i| &records[*i])
            .collect()
    }

    fn class_of(o: &Observation, records: &[Value]) -> (Class, String) {
        classify(o, &match_records(o, &typed(records)))
    }

    fn allow_tunnel(sni: Option<&str>) -> Value {
        rec(
            "t-1",
            "allow",
            "rule_match",
            json!({"rule": "allow-0", "sni": sni}),
        )
    }

    #[test]
    fn silence_then_sni() {
        let closed = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "closed_in_silence_ms": 1003, "tls": "closed", "error": "closed"}),
        );
        let deny = rec(
            "t-2",
            "deny",
            "protocol_mismatch",
            json!({"detail": "no client bytes within detect_timeout (1s)"}),
        );
        let (c, why) = class_of(&closed, std::slice::from_ref(&deny));
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(
            why.contains("closed the tunnel") && why.contains("t-2"),
            "{why}"
        );
        // A record outside the probe's window is someone else's.
        let mut late = deny;
        late["ts"] = json!("2030-01-01T12:00:09.000000Z");
        assert_eq!(class_of(&closed, &[late]).0, Class::BlockedElsewhere);
        // The hole: the late ClientHello reached a server.
        let hole = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "tls": "server_hello", "outcome": "reached"}),
        );
        let (c, why) = class_of(&hole, &[allow_tunnel(Some("other.test"))]);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert!(why.contains("t-1"), "{why}");
        // Left open and silent after the hello, only the allow recorded:
        // Palisade forwarded it.
        let silent = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "tls": "no_reply", "outcome": "failed", "error": "timeout"}),
        );
        let (c, why) = class_of(&silent, &[allow_tunnel(None)]);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert!(why.contains("no refusal of what it carried"), "{why}");
    }

    #[test]
    fn ech_client_hello() {
        let o = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "tls": "closed", "error": "closed"}),
        );
        let deny = rec(
            "t-3",
            "deny",
            "ech_not_allowed",
            json!({"sni": "allowed.test", "host": "allowed.test"}),
        );
        let (c, why) = class_of(&o, &[deny]);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(why.contains("ech_not_allowed (t-3)"), "{why}");
        let hole = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "tls": "server_hello", "outcome": "reached"}),
        );
        let (c, _) = class_of(&hole, &[allow_tunnel(Some("allowed.test"))]);
        assert_eq!(c, Class::UnexpectedAllow);
        // Refused before the tunnel opened: a denial, but the ECH check was
        // not exercised, and the why says so.
        let refused = obs(
            "tls://allowed.test:443",
            json!({"ech": true, "connect_status": 403, "connected": false}),
        );
        let (c, why) = class_of(
            &refused,
            &[rec("t-4", "deny", "no_matching_rule", json!({}))],
        );
        assert_eq!(c, Class::EnforcedDeny);
        assert!(why.contains("never opened"), "{why}");
    }

    #[test]
    fn second_request_other_host() {
        let target = "http://allowed.test/palisade-probe/pp-1-0000";
        let o = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "closed", "error": "closed", "first_close": true}),
        );
        let allow = rec("t-5", "allow", "rule_match", json!({"port": 80}));
        // The in-tunnel denial: joined through `conn` even without a client.
        let deny = rec(
            "t-6",
            "deny",
            "host_mismatch",
            json!({"host": "other.test", "port": 80, "conn": "t-5", "client": null}),
        );
        let both = typed(&[allow.clone(), deny]);
        let matched = match_records(&o, &both);
        assert_eq!(matched.len(), 2);
        let (c, why) = classify(&o, &matched);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(
            why.contains("host_mismatch (t-6)") && why.contains("allowed: t-5"),
            "{why}"
        );
        // The hole: the upstream answered the second request.
        let hole = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "answered", "second_status": 200, "outcome": "reached"}),
        );
        let (c, why) = class_of(&hole, std::slice::from_ref(&allow));
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        // Connection kept open, no response, only the allow: forwarded.
        let open = obs(
            target,
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "silent", "outcome": "failed", "error": "timeout"}),
        );
        assert_eq!(
            class_of(&open, std::slice::from_ref(&allow)).0,
            Class::UnexpectedAllow
        );
        // The upstream closed after the first response and Palisade
        // recorded nothing about the second: not established.
        let (c, why) = class_of(&o, &[allow]);
        assert_eq!(c, Class::Inconclusive, "{why}");
        assert!(why.contains("keeps connections alive"), "{why}");
    }

    /// The hole: a plain probe of other.test:80 and a denial the
    /// sandbox provoked for the same host:port with a Host header of its
    /// own, the probe's window moved onto it. It fits by target and time,
    /// and is not enforcement.
    #[test]
    fn a_provoked_denial_of_another_request_is_not_enforcement() {
        let target = "http://other.test/palisade-probe/pp-1-0001";
        let o = obs(
            target,
            json!({"kind": "http", "http_status": 403, "connect_status": null, "connected": true}),
        );
        let provoked = rec(
            "t-7",
            "deny",
            "host_mismatch",
            json!({"kind": "http", "host": "other.test", "port": 80,
                   "detail": "Host header \"allowed.test\" does not name the request target"}),
        );
        let typed_recs = typed(std::slice::from_ref(&provoked));
        let matched = match_records(&o, &typed_recs);
        assert_eq!(matched.len(), 1, "it fits by target and time");
        let (c, why) = classify(&o, &matched);
        assert_eq!(c, Class::BlockedElsewhere, "{why}");
        let not = not_caused_by(&o, matched[0]).unwrap();
        assert!(
            not.contains("t-7 (host_mismatch)") && not.contains("no Host header other"),
            "{not}"
        );
        // The same reason from a probe that sends another Host is its own.
        let mut own = o.clone();
        own.host_header = Some("canary.test".into());
        assert_eq!(not_caused_by(&own, matched[0]), None);
        assert_eq!(classify(&own, &matched).0, Class::EnforcedDeny);
        // A denial of where the probe goes is its own, whatever it carried.
        let plain = rec(
            "t-8",
            "deny",
            "no_matching_rule",
            json!({"kind": "http", "host": "other.test", "port": 80}),
        );
        let typed_recs = typed(&[plain]);
        let (c, why) = classify(&o, &match_records(&o, &typed_recs));
        assert_eq!(c, Class::EnforcedDeny, "{why}");
    }

    #[test]
    fn only_a_request_like_the_probes_can_be_its_denial() {
        let r = |reason: &str, extra: Value| typed(&[rec("t-1", "deny", reason, extra)]).remove(0);
        let https = obs("https://other.test/", json!({}));
        // An SNI other than its host: not from a probe whose hello names it.
        let sni = r(
            "sni_mismatch",
            json!({"host": "allowed.test", "sni": "other.test"}),
        );
        let why = not_caused_by(&https, &sni).unwrap();
        assert!(why.contains("not to the probe's other.test"), "{why}");
        let sni_on_host = r(
            "sni_mismatch",
            json!({"host": "other.test", "sni": "x.test"}),
        );
        assert!(not_caused_by(&https, &sni_on_host)
            .unwrap()
            .contains("ClientHello names its own host"));
        let tls = obs("tls://allowed.test:443?sni=other.test", json!({}));
        assert_eq!(not_caused_by(&tls, &sni), None);
        // ECH only from an ECH probe; never a malformed request, an upgrade
        // or bad credentials.
        let ech = r("ech_not_allowed", json!({"host": "other.test"}));
        assert!(not_caused_by(&https, &ech).is_some());
        let mut with_ech = https.clone();
        with_ech.ech = true;
        assert_eq!(not_caused_by(&with_ech, &ech), None);
        for reason in ["bad_request", "upgrade_not_allowed", "auth_failed"] {
            let d = r(reason, json!({"host": "other.test"}));
            assert!(not_caused_by(&https, &d).is_some(), "{reason}");
        }
        // The path the request took: a CONNECT record is no absolute-form
        // request's, a transparent one no proxied probe's.
        let plain = obs("http://other.test/x", json!({"kind": "http"}));
        let tunnel = r(
            "no_matching_rule",
            json!({"host": "other.test", "port": 80}),
        );
        assert!(not_caused_by(&plain, &tunnel)
            .unwrap()
            .contains("absolute-form request"));
        let transparent = r(
            "no_matching_rule",
            json!({"host": "other.test", "mode": "transparent"}),
        );
        assert!(not_caused_by(&https, &transparent).is_some());
        // A path refusal: only with the probe's own path on record.
        let req = obs(
            "https://a.wild.test/api/%69nternal",
            json!({"kind": "https", "handshake": true}),
        );
        let path = |p: Option<&str>| {
            r(
                "path_not_allowed",
                json!({"kind": "http", "host": "a.wild.test", "path": p}),
            )
        };
        assert_eq!(not_caused_by(&req, &path(Some("/api/%69nternal"))), None);
        // As Palisade normalised it.
        assert_eq!(not_caused_by(&req, &path(Some("/api/internal"))), None);
        assert!(not_caused_by(&req, &path(Some("/api/public")))
            .unwrap()
            .contains("asked for /api/%69nternal"));
        assert!(not_caused_by(&req, &path(None))
            .unwrap()
            .contains("names no path"));
        // A DNS denial of another query type.
        let dns = obs(
            "dns:pp-1-0001.other.test/TXT",
            json!({"kind": "dns", "via": "direct"}),
        );
        let q = |t: &str| {
            r(
                "no_matching_rule",
                json!({"kind": "dns", "mode": "dns", "host": "pp-1-0001.other.test", "qtype": t, "port": null}),
            )
        };
        assert_eq!(not_caused_by(&dns, &q("TXT")), None);
        assert!(not_caused_by(&dns, &q("A")).unwrap().contains("A query"));
        // Allows are never judged here (any allow that fits counts).
        let allow = typed(&[rec("t-2", "allow", "rule_match", json!({}))]).remove(0);
        assert_eq!(not_caused_by(&https, &allow), None);
    }

    /// A name budget the sandbox spent first (or a binding it had evicted,
    /// a reload) refuses the request by Palisade's state, not by the rule
    /// the probe tests.
    #[test]
    fn state_denials_are_inconclusive() {
        let o = obs(
            "https://other.test/",
            json!({"connect_status": 403, "connected": false}),
        );
        for reason in [
            "name_budget_exceeded",
            "synthetic_unbound",
            "policy_revoked",
        ] {
            let d = rec("t-1", "deny", reason, json!({"host": "other.test"}));
            let (c, why) = class_of(&o, &[d]);
            assert_eq!(c, Class::Inconclusive, "{reason}: {why}");
        }
    }

    #[test]
    fn encoded_path() {
        let target = "https://a.wild.test/api/%69nternal";
        let refused = obs(
            target,
            json!({"kind": "https", "tls": "handshake", "handshake": true, "http_status": 403,
                   "proxy_status": "palisade; error=http_request_denied; details=\"path_not_allowed; record=t-8\"",
                   "palisade_record": "t-8"}),
        );
        let deny = rec(
            "t-8",
            "deny",
            "path_not_allowed",
            json!({"kind": "http", "host": "a.wild.test", "path": "/api/%69nternal", "client": "198.18.1.2:1"}),
        );
        let (c, why) = class_of(&refused, &[deny]);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert!(why.contains("path_not_allowed (t-8)"), "{why}");
        let hole = obs(
            target,
            json!({"kind": "https", "tls": "handshake", "handshake": true, "http_status": 200,
                   "outcome": "reached"}),
        );
        let (c, _) = class_of(
            &hole,
            &[rec(
                "t-9",
                "allow",
                "rule_match",
                json!({"kind": "http", "host": "a.wild.test"}),
            )],
        );
        assert_eq!(c, Class::UnexpectedAllow);
        // With no record, the 403 alone shows nothing Palisade did (the
        // report also lists the quoted record missing from the evidence).
        assert_eq!(class_of(&refused, &[]).0, Class::BlockedElsewhere);
    }

    const BURST: &str = "dns-burst:{random}.pp-1-0000.wild.test/A?count=30&budget=10";

    /// A burst's observation: names 0..n sent, the first `answered`
    /// answered and the rest refused, from socket CLIENT.
    fn burst_obs(target: &str, n: u32, answered: u32) -> Observation {
        let tpl = "{random}.pp-1-0000.wild.test";
        let names: Vec<Value> = (0..n)
            .map(|i| {
                let (result, rcode) = if i < answered {
                    ("answered", "NXDomain")
                } else {
                    ("refused", "Refused")
                };
                json!({"name": crate::probe::plan::burst_name(tpl, i, "abcdefgh"),
                       "result": result, "rcode": rcode, "record": null})
            })
            .collect();
        let outcome = if answered > 0 { "reached" } else { "refused" };
        obs(
            target,
            json!({"kind": "dns-burst", "via": "direct", "names": names, "outcome": outcome,
                   "connect_status": null, "connected": false,
                   "sockets": [{"purpose": "dns", "proto": "udp", "local": CLIENT, "remote": "198.18.1.1:53"}]}),
        )
    }

    /// The shim's record of burst name `i`: allowed (forwarded upstream)
    /// or refused past the budget.
    fn name_rec(i: u32, allowed: bool) -> Value {
        let name = crate::probe::plan::burst_name("{random}.pp-1-0000.wild.test", i, "abcdefgh");
        let (decision, reason) = if allowed {
            ("allow", "rule_match")
        } else {
            ("deny", "name_budget_exceeded")
        };
        rec(
            &format!("n-{i}"),
            decision,
            reason,
            json!({"kind": "dns", "mode": "dns", "host": name, "port": null, "qtype": "A",
                   "upstream": allowed, "answers": [], "rule": "wild"}),
        )
    }

    fn summary(count: u64) -> Value {
        rec(
            "s-1",
            "deny",
            "name_budget_exceeded",
            json!({"kind": "dns", "mode": "dns", "host": null, "client": null, "port": null,
                   "count": count, "upstream": false, "answers": [],
                   "ts": "2030-01-01T12:00:04.000000Z",
                   "window": ["2030-01-01T12:00:01.000000Z", "2030-01-01T12:00:02.000000Z"]}),
        )
    }

    fn counts_of(o: &Observation, records: &[Value]) -> (Class, String, NameCounts) {
        let typed = typed(records);
        let matched = match_records(o, &typed);
        let (c, why) = classify(o, &matched);
        (c, why, name_counts(o, &matched).unwrap())
    }

    #[test]
    fn name_burst_within_the_budget_and_on_record_is_enforced() {
        let o = burst_obs(BURST, 30, 10);
        let records: Vec<Value> = (0..30).map(|i| name_rec(i, i < 10)).collect();
        let (c, why, n) = counts_of(&o, &records);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert_eq!(
            (
                n.sent,
                n.answered,
                n.refused,
                n.reached_upstream,
                n.on_record,
                n.not_on_record
            ),
            (30, 10, 20, 10, 30, 0)
        );
        assert_eq!((n.budget, n.allowance), (10, Some(10)));
        assert!(
            why.contains("30 names sent, 10 reached the upstream (budget 10)"),
            "{why}"
        );
        assert!(why.contains("name_budget_exceeded 20"), "{why}");
        // Refusals summarised: counted, though the summary names no name.
        let mut some: Vec<Value> = (0..18).map(|i| name_rec(i, i < 10)).collect();
        some.push(summary(12));
        let (c, why, n) = counts_of(&o, &some);
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert_eq!((n.on_record, n.summarised, n.not_on_record), (18, 12, 0));
        // A summary of too few: names on no record.
        let mut few: Vec<Value> = (0..18).map(|i| name_rec(i, i < 10)).collect();
        few.push(summary(5));
        let (c, why, n) = counts_of(&o, &few);
        assert_eq!(c, Class::Missing, "{why}");
        assert_eq!(n.not_on_record, 7);
        assert!(
            why.contains("7 of the names sent are on no record"),
            "{why}"
        );
        // A summary from outside the probe's window counts nothing.
        let mut late = summary(12);
        late["window"] = json!(["2030-01-01T12:01:00.000000Z", "2030-01-01T12:01:01.000000Z"]);
        late["ts"] = json!("2030-01-01T12:00:04.000000Z");
        let mut some: Vec<Value> = (0..18).map(|i| name_rec(i, i < 10)).collect();
        some.push(late);
        assert_eq!(counts_of(&o, &some).0, Class::Missing);
    }

    #[test]
    fn names_past_the_budget_or_with_none_are_a_hole() {
        // Every name forwarded under a budget of 10.
        let o = burst_obs(BURST, 30, 30);
        let all: Vec<Value> = (0..30).map(|i| name_rec(i, true)).collect();
        let (c, why, n) = counts_of(&o, &all);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert_eq!(n.reached_upstream, 30);
        assert!(
            why.contains("more names reached the upstream than the budget"),
            "{why}"
        );
        // The client may say every name was refused: the records decide.
        let liar = burst_obs(BURST, 30, 0);
        assert_eq!(counts_of(&liar, &all).0, Class::UnexpectedAllow);
        // No budget (0): any name that leaves is unbounded.
        let free = BURST.replace("budget=10", "budget=0");
        let o = burst_obs(&free, 30, 30);
        let (c, why, n) = counts_of(&o, &all);
        assert_eq!(c, Class::UnexpectedAllow, "{why}");
        assert_eq!(n.allowance, None);
        assert!(why.contains("names leave unbounded"), "{why}");
        // A name answered from the shim's cache (or synthetic: nothing
        // upstream) does not count as reaching the upstream.
        let mut local = name_rec(0, true);
        local["upstream"] = json!(false);
        assert!(!reached_upstream(&typed(&[local])[0]));
        // Over a longer span, the budget of each minute counts.
        let mut slow: Vec<Value> = (0..30).map(|i| name_rec(i, i < 20)).collect();
        slow[19]["ts"] = json!("2030-01-01T12:01:05.000000Z");
        let mut o = burst_obs(BURST, 30, 20);
        o.finished = "2030-01-01T12:01:06.000000Z".into();
        let (c, why, n) = counts_of(&o, &slow);
        assert_eq!(n.allowance, Some(20), "{why}");
        assert_eq!(c, Class::EnforcedDeny, "{why}");
    }

    #[test]
    fn name_bursts_that_show_nothing_are_inconclusive() {
        // No more names than the budget: nothing past it tried.
        let small = BURST.replace("count=30", "count=10");
        let o = burst_obs(&small, 10, 10);
        let recs: Vec<Value> = (0..10).map(|i| name_rec(i, true)).collect();
        let (c, why, _) = counts_of(&o, &recs);
        assert_eq!(c, Class::Inconclusive, "{why}");
        // Nothing sent.
        let mut none = burst_obs(BURST, 0, 0);
        none.outcome = ProbeOutcome::SetupFailed;
        none.error = Some("timeout".into());
        let (c, why, _) = counts_of(&none, &[]);
        assert_eq!(c, Class::Inconclusive, "{why}");
        // The records decide a hole, even with no name listed.
        let all: Vec<Value> = (0..30).map(|i| name_rec(i, true)).collect();
        let (c, why, n) = counts_of(&none, &all);
        assert_eq!(
            (c, n.sent, n.reached_upstream),
            (Class::UnexpectedAllow, 0, 30),
            "{why}"
        );
        // Names of another template or another probe's marker are not
        // this probe's (neither its records nor names it sent).
        let mut o = burst_obs(BURST, 30, 10);
        o.names[29].name = "r0029abcdefgh.pp-1-0001.wild.test".into();
        let records: Vec<Value> = (0..30).map(|i| name_rec(i, i < 10)).collect();
        let (c, why, n) = counts_of(&o, &records);
        assert_eq!((n.sent, n.foreign), (29, 1));
        assert_eq!(c, Class::EnforcedDeny, "{why}");
        assert_eq!(
            observed_text(&o),
            "30 names sent: 10 answered, 20 refused, 0 no reply"
        );
    }

    #[test]
    fn observed_text_tells_the_in_tunnel_part() {
        let o = obs(
            "http://allowed.test/",
            json!({"kind": "http", "http_status": 200, "second_host": "other.test",
                   "second": "closed", "first_close": true, "connect_status": null}),
        );
        assert_eq!(
            observed_text(&o),
            "HTTP 200, second request (Host other.test): closed, the first response closed the connection"
        );
        let o = obs(
            "tls://allowed.test:443?sni=other.test",
            json!({"silence_ms": 1500, "closed_in_silence_ms": 1001, "tls": "closed", "ech": true}),
        );
        assert_eq!(
            observed_text(&o),
            "CONNECT 200, silent 1500 ms: closed after 1001 ms, ClientHello with ECH, TLS closed"
        );
    }

    #[test]
    fn a_probe_overlapping_a_failed_enforcement_check_is_found() {
        let check = |id: &str, ts: &str, event: &str| {
            let reason = if event == "failed" {
                "enforcement_missing"
            } else {
                "rule_match"
            };
            let v = json!({
                "id": id, "ts": format!("2030-01-01T12:00:{ts}Z"), "kind": "enforcement",
                "event": event, "client": null, "mode": "transparent", "decision": "deny",
                "reason": reason, "host": null, "port": null, "sni": null, "policy": "p0",
            });
            serde_json::from_value::<Record>(v).unwrap()
        };
        let timeline = [
            check("start", "00.000000", "verified"),
            check("gone", "10.000000", "failed"),
            check("back", "20.000000", "verified"),
        ];
        let found = |from: &str, to: &str| {
            unverified_during(
                &timeline,
                &format!("2030-01-01T12:00:{from}Z"),
                &format!("2030-01-01T12:00:{to}Z"),
            )
            .map(|r| r.id.as_str())
        };
        // Before, inside, across each edge, after.
        assert_eq!(found("01", "09"), None);
        assert_eq!(found("09", "11"), Some("gone"));
        assert_eq!(found("10", "11"), Some("gone"));
        assert_eq!(found("12", "15"), Some("gone"));
        assert_eq!(found("15", "25"), Some("gone"));
        assert_eq!(found("20", "25"), None);
        assert_eq!(found("21", "25"), None);
        // No [enforcement]: no records, nothing found; unreadable probe
        // times: not verified if it ever failed.
        assert_eq!(
            unverified_during(&[], "x", "y").map(|r| r.id.as_str()),
            None
        );
        assert_eq!(
            unverified_during(&timeline, "x", "y").map(|r| r.id.as_str()),
            Some("gone")
        );
        assert_eq!(
            unverified_during(&timeline[..1], "x", "y").map(|r| r.id.as_str()),
            None
        );
    }
}
