//! `palisade probe report`: verify the evidence chain first, then take
//! every probe of the assessor's plan (`--plan`; observations of another
//! plan are refused), give it the records that fit it ([`super::fit`]),
//! classify it with its observation ([`super::classify`]; none: `missing`),
//! list what the observation claims that does not fit (mismatches, a
//! finding), and build the [`Report`]: `report.json` is its serialisation, and
//! the render module makes `report.md` and a self-contained `report.html`
//! from it. Evidence that fails verification is reported, and no probe is
//! classified.
//!
//! The evidence may be a fleet ([`crate::evidence::fleet`]): several
//! directories, or a tree with one per replica. Each chain is verified on
//! its own and the verification lists every replica's status; if any
//! replica fails (broken, missing, unsealed without `--allow-unsealed`,
//! unpinned while others are pinned), nothing is classified and the report
//! names it and the intact ones. Otherwise the records of all replicas are
//! matched together, and each probe (and each cited record) names the
//! replica that decided it. Several observations files (a sandbox behind
//! each replica, one plan run in each) make one report
//! ([`merge_observations`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ed25519_dalek::VerifyingKey;
use serde::Serialize;
use serde_json::Value;

use super::classify::{
    classify, in_tunnel, name_counts, not_caused_by, observed_text, unverified_during, NameCounts,
};
use super::fit::{assign, quote_misfit, unattributed, Case, SKEW};
use super::plan::{self, parse_target, Plan};
use super::run::{Observation, Observations, ProbeOutcome};
use super::volume::{self, VolumeCounts};
use super::{Class, Expect, Layer, Via, REPORT_FORMAT};
use crate::evidence::select::Selection;
use crate::evidence::{export, fleet, query, verify, Event, Kind, Mode, Record};
use crate::policy::Reason;

/// Inputs of a report.
pub struct Options<'a> {
    /// The agreed plan(s), from the assessor (never the sandbox's copy):
    /// one per distinct plan the observations ran.
    pub plans: &'a [PathBuf],
    /// One observations file, or one per sandbox (a fleet: see
    /// [`merge_observations`]).
    pub observations: &'a [PathBuf],
    /// One chain, or a fleet (several paths, or a tree).
    pub evidence: &'a [PathBuf],
    /// The checkpoint keys: a plain one for one chain, or per replica.
    pub pins: fleet::Pins,
    pub allow_unsealed: bool,
}

impl Options<'_> {
    /// The one key of a single-chain report.
    fn key(&self) -> Option<VerifyingKey> {
        self.pins.single
    }

    /// Whether the evidence is read as a fleet.
    fn is_fleet(&self) -> bool {
        fleet::is_fleet(self.evidence) || !self.pins.by_replica.is_empty()
    }
}

/// Bad input (exit status 2).
#[derive(Debug)]
pub struct BadInput(pub String);

/// `report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub format: &'static str,
    /// What the report trusts, and what the sandbox can still do: the
    /// header, before the verification.
    pub trust: Vec<String>,
    pub verification: Verification,
    pub scope: Scope,
    /// What the probe collected about the sandbox, as it wrote it.
    pub environment: Value,
    /// Probes per class; none when the evidence failed verification.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counts: Option<Counts>,
    pub verdict: String,
    pub exit_status: u8,
    /// The probes that are findings, in plan order.
    pub findings: Vec<ProbeResult>,
    pub probes: Vec<ProbeResult>,
    /// The sandbox's records during the run that no probe accounts for.
    pub unattributed: Vec<CitedRecord>,
    /// What retention removed inside the run's window, chain by chain:
    /// those records are missing here (read them in the shipped copy), so
    /// the report cannot show enforcement while this is not empty.
    pub retention_cut: Vec<String>,
    pub untested: Vec<String>,
}

/// How the evidence chain was checked before anything was classified.
#[derive(Debug, Clone, Serialize)]
pub struct Verification {
    /// Whether it verified ([`Checked::Verified`]).
    pub ok: bool,
    /// Whether `--key` pinned the checkpoint key.
    pub key_pinned: bool,
    pub allow_unsealed: bool,
    #[serde(flatten)]
    pub checked: Checked,
    /// A fleet: every replica's chain, by name (empty for one chain).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaCheck>,
}

/// One replica's chain as verified.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaCheck {
    pub replica: String,
    pub path: Option<String>,
    /// `intact`, `broken`, `unsealed`, `unpinned` or `missing`.
    pub status: &'static str,
    pub ok: bool,
    pub records: Option<u64>,
    pub sealed: Option<bool>,
    pub key_pinned: Option<bool>,
    pub public_key: Option<String>,
    /// Where a broken chain broke.
    pub file: Option<String>,
    pub line: Option<u64>,
    /// `palisade evidence verify`'s line for it.
    pub text: String,
}

impl ReplicaCheck {
    fn of(c: &fleet::ChainCheck) -> ReplicaCheck {
        let (file, line) = match &c.status {
            fleet::Status::Broken(e) => (Some(e.file.clone()), Some(e.line)),
            _ => (None, None),
        };
        let s = c.summary.as_ref();
        ReplicaCheck {
            replica: c.name.clone(),
            path: c.path.as_ref().map(|p| p.display().to_string()),
            status: c.status.as_str(),
            ok: c.ok(),
            records: s.map(|s| s.records),
            sealed: s.map(|s| s.sealed),
            key_pinned: s.map(|s| s.key_pinned),
            public_key: s.and_then(|s| s.key.clone()),
            file,
            line,
            text: c.line(),
        }
    }
}

/// The outcome of verification.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Checked {
    Verified {
        /// `palisade evidence verify`'s summary.
        summary: String,
        sealed: bool,
        notes: Vec<String>,
    },
    Failed {
        error: String,
        file: String,
        line: u64,
        message: String,
    },
}

impl Verification {
    fn passed(summary: &verify::Findings, allow_unsealed: bool) -> Verification {
        Verification {
            ok: true,
            key_pinned: summary.key_pinned,
            allow_unsealed,
            checked: Checked::Verified {
                summary: summary.to_string().trim_end().to_string(),
                sealed: summary.sealed,
                notes: summary.notes.clone(),
            },
            replicas: Vec::new(),
        }
    }

    fn failed(e: &verify::VerifyError, opts: &Options<'_>) -> Verification {
        Verification {
            ok: false,
            key_pinned: opts.key().is_some(),
            allow_unsealed: opts.allow_unsealed,
            checked: Checked::Failed {
                error: e.to_string(),
                file: e.file.clone(),
                line: e.line,
                message: e.message.clone(),
            },
            replicas: Vec::new(),
        }
    }

    /// A fleet, every replica checked.
    fn of_fleet(checked: &fleet::FleetCheck, allow_unsealed: bool) -> Verification {
        let replicas: Vec<ReplicaCheck> = checked.chains.iter().map(ReplicaCheck::of).collect();
        let sums = || checked.chains.iter().filter_map(|c| c.summary.as_ref());
        let key_pinned = !checked.chains.is_empty()
            && checked
                .chains
                .iter()
                .all(|c| c.summary.as_ref().is_some_and(|s| s.key_pinned));
        let checked_as = if checked.ok() {
            Checked::Verified {
                summary: checked.text(),
                sealed: sums().all(|s| s.sealed),
                notes: checked
                    .chains
                    .iter()
                    .flat_map(|c| {
                        c.summary
                            .iter()
                            .flat_map(|s| s.notes.iter())
                            .map(|n| format!("{}: {n}", c.name))
                    })
                    .collect(),
            }
        } else {
            let first = checked.failing().next();
            let (file, line, message) = match first.map(|c| (&c.status, c)) {
                Some((fleet::Status::Broken(e), _)) => (e.file.clone(), e.line, e.message.clone()),
                Some((_, c)) => (
                    c.path
                        .as_ref()
                        .map_or_else(String::new, |p| p.display().to_string()),
                    0,
                    c.line(),
                ),
                None => (String::new(), 0, "no replica given".into()),
            };
            Checked::Failed {
                error: format!(
                    "{}; {}",
                    checked
                        .first_problem()
                        .unwrap_or_else(|| "no replica given".into()),
                    checked.total_line()
                ),
                file,
                line,
                message,
            }
        };
        Verification {
            ok: checked.ok(),
            key_pinned,
            allow_unsealed,
            checked: checked_as,
            replicas,
        }
    }
}

/// What was tested, with what, and against which evidence.
#[derive(Debug, Clone, Serialize)]
pub struct Scope {
    /// The org and policy hash the plan names.
    pub org: Option<String>,
    pub plan_policy: Option<String>,
    pub probe_run: String,
    pub plan_sha256: String,
    pub probe_palisade_version: String,
    pub report_palisade_version: &'static str,
    pub window: Window,
    pub evidence_path: String,
    /// A fleet: the replicas' names (empty for one chain).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// What the verified evidence says; none when it failed verification.
    #[serde(flatten)]
    pub evidence: Option<EvidenceScope>,
}

/// The time the probes ran.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    pub start: String,
    pub end: String,
}

/// The scope as the verified evidence shows it.
#[derive(Debug, Clone, Serialize)]
pub struct EvidenceScope {
    pub evidence_public_key: Option<String>,
    pub evidence_key_pinned: bool,
    pub evidence_sealed: bool,
    pub evidence_unsigned_tail: u64,
    pub evidence_span: Span,
    /// Whether the one policy that decided the probes is the plan's (none
    /// when the plan names no policy).
    pub policy_matches_plan: Option<bool>,
    /// The policy hashes and orgs of the records matched to probes (an org
    /// unknown to Palisade is the empty name).
    pub policy_in_evidence: BTreeSet<String>,
    pub orgs_in_evidence: BTreeSet<String>,
}

/// The evidence's first and last timestamps and its record count.
#[derive(Debug, Clone, Serialize)]
pub struct Span {
    pub first: Option<String>,
    pub last: Option<String>,
    pub records: u64,
}

/// Probes per class.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counts {
    pub probes: usize,
    pub enforced_allow: usize,
    pub enforced_deny: usize,
    pub blocked_elsewhere: usize,
    pub unexpected_allow: usize,
    pub unexpected_deny: usize,
    pub inconclusive: usize,
    pub missing: usize,
    /// Probes whose class is not what the plan agreed.
    pub not_matching_expectation: usize,
}

impl Counts {
    fn of(probes: &[ProbeResult]) -> Counts {
        let mut c = Counts {
            probes: probes.len(),
            ..Counts::default()
        };
        for p in probes {
            *match p.class {
                Class::EnforcedAllow => &mut c.enforced_allow,
                Class::EnforcedDeny => &mut c.enforced_deny,
                Class::BlockedElsewhere => &mut c.blocked_elsewhere,
                Class::UnexpectedAllow => &mut c.unexpected_allow,
                Class::UnexpectedDeny => &mut c.unexpected_deny,
                Class::Inconclusive => &mut c.inconclusive,
                Class::Missing => &mut c.missing,
            } += 1;
            c.not_matching_expectation += usize::from(!p.matched);
        }
        c
    }

    /// Name and count of every field, in `report.json`'s (sorted) key order.
    pub fn rows(&self) -> [(&'static str, usize); 9] {
        [
            ("blocked_elsewhere", self.blocked_elsewhere),
            ("enforced_allow", self.enforced_allow),
            ("enforced_deny", self.enforced_deny),
            ("inconclusive", self.inconclusive),
            ("missing", self.missing),
            ("not_matching_expectation", self.not_matching_expectation),
            ("probes", self.probes),
            ("unexpected_allow", self.unexpected_allow),
            ("unexpected_deny", self.unexpected_deny),
        ]
    }
}

/// One probe: what the plan expected, what the client saw, the records
/// Palisade kept, and the class.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    pub id: String,
    pub target: String,
    pub kind: String,
    pub via: Via,
    pub expect: Expect,
    pub layer: Layer,
    pub class: Class,
    /// The replica(s) whose records decided the probe (a fleet), `, `-separated.
    pub replica: Option<String>,
    /// A finding: the class is one ([`Class::is_finding`]), or the
    /// observation does not fit the plan or the evidence (`mismatches`).
    pub finding: bool,
    /// The class is what the plan agreed, and nothing mismatched.
    pub matched: bool,
    pub why: String,
    /// What the sandbox reported that does not fit the plan or Palisade's
    /// records (a quoted record of another probe, an answer with no allow
    /// record, ...).
    pub mismatches: Vec<String>,
    /// What the client saw, in one line.
    pub observed: String,
    /// None for a missing probe.
    pub outcome: Option<ProbeOutcome>,
    pub records: Vec<CitedRecord>,
    /// Packets the gateway ruleset rejected and Palisade recorded for
    /// this probe: the `count`s of its `kind = "bypass"` records.
    pub bypass_attempts: u64,
    /// `dns-burst` probes: the names sent, refused, reached the upstream,
    /// on record, and the budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub names: Option<NameCounts>,
    /// Volume probes: the budget, what the client moved, what the close
    /// records say was relayed, and the cut.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeCounts>,
    pub note: Option<String>,
    pub marker: String,
    pub started: String,
    pub elapsed_ms: u64,
    /// As the sandbox wrote it, with the plan's target and options.
    pub observation: Option<Observation>,
}

impl ProbeResult {
    /// `id decision reason` of each record, `; `-separated.
    /// A `dns-burst` probe's (one per name): the counts, the records by
    /// decision and reason, and the first and last id (all are in
    /// `report.json`).
    pub fn record_cite(&self) -> String {
        if let Some(c) = &self.names {
            let mut by: BTreeMap<(&str, &str), u64> = BTreeMap::new();
            for r in &self.records {
                *by.entry((r.decision, r.reason.as_str())).or_default() += r.count.unwrap_or(1);
            }
            let groups: Vec<String> = by
                .iter()
                .map(|((d, reason), n)| format!("{n} {d} {reason}"))
                .collect();
            let ids = match (self.records.first(), self.records.last()) {
                (Some(a), Some(b)) if a.id != b.id => format!(" ({} … {})", a.id, b.id),
                (Some(a), _) => format!(" ({})", a.id),
                _ => String::new(),
            };
            return format!(
                "{}; records: {}{ids}",
                super::classify::counts_text(c),
                if groups.is_empty() {
                    "none".into()
                } else {
                    groups.join(", ")
                }
            );
        }
        self.records
            .iter()
            .map(|r| format!("{} {} {}", r.id, r.decision, r.reason))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// A record matched to a probe: the fields that show what Palisade did.
#[derive(Debug, Clone, Serialize)]
pub struct CitedRecord {
    /// The replica whose chain holds it (a fleet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica: Option<Arc<str>>,
    pub id: String,
    /// The reference Palisade showed the client for it.
    #[serde(rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub ts: String,
    pub kind: Kind,
    pub mode: Mode,
    pub client: Option<SocketAddr>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub sni: Option<String>,
    pub ip: Option<IpAddr>,
    pub decision: &'static str,
    pub reason: Reason,
    pub rule: Option<Arc<str>>,
    pub detail: Option<String>,
    pub conn: Option<String>,
    /// Bypass records: the protocol and the packets the record stands for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proto: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
}

impl From<&Record> for CitedRecord {
    fn from(r: &Record) -> CitedRecord {
        CitedRecord {
            replica: None,
            id: r.id.clone(),
            reference: r.reference.clone(),
            ts: r.ts.clone(),
            kind: r.kind,
            mode: r.mode,
            client: r.client,
            host: r.host.clone(),
            port: r.port,
            sni: r.sni.clone(),
            ip: r.ip,
            decision: r.decision_str(),
            reason: r.reason,
            rule: r.rule.clone(),
            detail: r.detail.clone(),
            conn: r.conn.clone(),
            proto: r.proto.clone(),
            count: r.count,
        }
    }
}

fn read_observations(path: &Path) -> Result<Observations, BadInput> {
    let text =
        std::fs::read_to_string(path).map_err(|e| BadInput(format!("{}: {e}", path.display())))?;
    let obs: Observations = serde_json::from_str(&text)
        .map_err(|e| BadInput(format!("{}: not an observations file: {e}", path.display())))?;
    if obs.format != super::OBSERVATIONS_FORMAT {
        return Err(BadInput(format!(
            "unknown observations format {:?}",
            obs.format
        )));
    }
    Ok(obs)
}

/// Several runs as one: the same org and policy; runs, plan hashes and
/// versions listed, the window spanning them all, each run's environment
/// under its run id, and every probe id suffixed `@RUN` so the same plan
/// run from two sandboxes stays two sets of probes. One run is returned as
/// it is.
pub fn merge_observations(mut sets: Vec<Observations>) -> Result<Observations, BadInput> {
    if sets.len() <= 1 {
        return sets
            .pop()
            .ok_or_else(|| BadInput("no observations file given".into()));
    }
    let first = &sets[0];
    for o in &sets[1..] {
        if o.plan.org != first.plan.org || o.plan.policy != first.plan.policy {
            return Err(BadInput(format!(
                "observations of runs {} and {} are of different plans (org {:?} and {:?}, policy {:?} and {:?}): report them separately",
                first.run, o.run, first.plan.org, o.plan.org, first.plan.policy, o.plan.policy
            )));
        }
    }
    let runs: Vec<String> = sets.iter().map(|o| o.run.clone()).collect();
    if runs.iter().collect::<BTreeSet<_>>().len() != runs.len() {
        return Err(BadInput(format!(
            "one probe run given twice (runs {})",
            runs.join(", ")
        )));
    }
    let joined = |f: &dyn Fn(&Observations) -> String| {
        let mut seen: Vec<String> = Vec::new();
        for o in &sets {
            let v = f(o);
            if !seen.contains(&v) {
                seen.push(v);
            }
        }
        seen.join(", ")
    };
    let mut environment = serde_json::Map::new();
    for o in &sets {
        environment.insert(o.run.clone(), o.environment.clone());
    }
    let mut merged = Observations {
        format: first.format.clone(),
        run: runs.join(", "),
        palisade_version: joined(&|o| o.palisade_version.clone()),
        plan_sha256: joined(&|o| o.plan_sha256.clone()),
        plan: first.plan.clone(),
        started: sets
            .iter()
            .map(|o| o.started.clone())
            .min()
            .unwrap_or_default(),
        finished: sets
            .iter()
            .map(|o| o.finished.clone())
            .max()
            .unwrap_or_default(),
        environment: Value::Object(environment),
        observations: Vec::new(),
    };
    for set in sets {
        for mut o in set.observations {
            o.id = format!("{}@{}", o.id, set.run);
            merged.observations.push(o);
        }
    }
    Ok(merged)
}

/// The decision records under `path` (close records say nothing a probe
/// is matched by).
fn decisions(path: &Path) -> Result<Vec<Record>, BadInput> {
    query::decisions(path, &Selection::default()).map_err(|e| BadInput(e.to_string()))
}

/// The enforcement check's records under `path` (`failed`, `verified`).
fn enforcement(path: &Path) -> Result<Vec<Record>, BadInput> {
    let events = &[Event::Failed, Event::Verified];
    query::read_events(path, events)
        .map(|stored| {
            stored
                .map(|s| s.record)
                .map_err(|e| BadInput(e.to_string()))
        })
        .collect()
}

/// The close records under each of `paths` when `wanted` (a volume
/// probe reads its connection's bytes from them), else none.
fn closes(paths: &[&Path], wanted: bool) -> Result<Vec<Record>, BadInput> {
    let mut out = Vec::new();
    for path in paths.iter().filter(|_| wanted) {
        for stored in query::read_events(path, &[Event::Close]) {
            let record = stored.map_err(|e| BadInput(e.to_string()))?.record;
            if record.conn.is_some() {
                out.push(record);
            }
        }
    }
    Ok(out)
}

/// A fleet's decision records merged by time, and each one's replica.
fn fleet_decisions(chains: &[fleet::Chain]) -> Result<(Vec<Record>, Vec<Arc<str>>), BadInput> {
    let (mut records, mut replicas) = (Vec::new(), Vec::new());
    for t in fleet::read_merged(chains) {
        let t = t.map_err(|e| BadInput(e.to_string()))?;
        if t.stored.record.event == Event::Decision {
            records.push(t.stored.record);
            replicas.push(t.replica);
        }
    }
    Ok((records, replicas))
}

/// What verified evidence gives the report.
struct Verified {
    verification: Verification,
    scope: EvidenceScope,
    records: Vec<Record>,
    /// A fleet: each record's replica, by position.
    replicas: Option<Vec<Arc<str>>>,
    /// The enforcement check's records, one list per chain.
    enforcement: Vec<Vec<Record>>,
    /// Close records (read for volume probes only, else empty).
    closes: Vec<Record>,
}

/// One chain: verified, then read.
/// `volume`: the plan has volume probes (the close records are read).
fn verify_one(
    opts: &Options<'_>,
    volume: bool,
) -> Result<Result<Verified, Verification>, BadInput> {
    let path = &opts.evidence[0];
    if !path.exists() {
        return Err(BadInput(format!(
            "{}: no such evidence path",
            path.display()
        )));
    }
    if export::is_export(path) {
        return verify_export(path, opts, volume);
    }
    let vopts = verify::Options {
        key: opts.key(),
        allow_unsealed: opts.allow_unsealed,
    };
    let summary = match verify::verify_with(path, &vopts) {
        Ok(s) => s,
        Err(e) => return Ok(Err(Verification::failed(&e, opts))),
    };
    Ok(Ok(Verified {
        verification: Verification::passed(&summary, opts.allow_unsealed),
        scope: EvidenceScope {
            evidence_public_key: summary.key.clone(),
            evidence_key_pinned: summary.key_pinned,
            evidence_sealed: summary.sealed,
            evidence_unsigned_tail: summary.unsigned_tail,
            evidence_span: Span {
                first: summary.first_ts.clone(),
                last: summary.last_ts.clone(),
                records: summary.records,
            },
            policy_matches_plan: None,
            policy_in_evidence: BTreeSet::new(),
            orgs_in_evidence: BTreeSet::new(),
        },
        records: decisions(path)?,
        replicas: None,
        enforcement: vec![enforcement(path)?],
        closes: closes(&[path], volume)?,
    }))
}

/// One org's export (`evidence export --proofs`): checked with the
/// pinned key alone, then its records read. It holds only the org's
/// records, so enforcement records (of no org) are not in it.
fn verify_export(
    path: &Path,
    opts: &Options<'_>,
    volume: bool,
) -> Result<Result<Verified, Verification>, BadInput> {
    let Some(key) = opts.key() else {
        return Err(BadInput(format!(
            "{}: an org export is checked with the log's public key alone: give --key",
            path.display()
        )));
    };
    let what = match export::check(path, &key) {
        Ok(what) => what,
        Err(message) => {
            let e = verify::VerifyError {
                file: path.display().to_string(),
                line: 0,
                message,
            };
            return Ok(Err(Verification::failed(&e, opts)));
        }
    };
    let records = decisions(&path.join("records.jsonl"))?;
    Ok(Ok(Verified {
        verification: Verification {
            ok: true,
            key_pinned: true,
            allow_unsealed: opts.allow_unsealed,
            checked: Checked::Verified {
                summary: what,
                sealed: true,
                notes: Vec::new(),
            },
            replicas: Vec::new(),
        },
        scope: EvidenceScope {
            evidence_public_key: Some(data_encoding::HEXLOWER.encode(key.as_bytes())),
            evidence_key_pinned: true,
            evidence_sealed: true,
            evidence_unsigned_tail: 0,
            evidence_span: Span {
                first: records.first().map(|r| r.ts.clone()),
                last: records.last().map(|r| r.ts.clone()),
                records: records.len() as u64,
            },
            policy_matches_plan: None,
            policy_in_evidence: BTreeSet::new(),
            orgs_in_evidence: BTreeSet::new(),
        },
        records,
        replicas: None,
        enforcement: vec![Vec::new()],
        closes: closes(&[&path.join("records.jsonl")], volume)?,
    }))
}

/// A fleet: every chain verified on its own, then all read merged.
fn verify_fleet(
    opts: &Options<'_>,
    volume: bool,
) -> Result<(Vec<String>, Result<Verified, Verification>), BadInput> {
    let fl = fleet::resolve(opts.evidence).map_err(|e| BadInput(e.0))?;
    let fopts = fleet::Options {
        pins: opts.pins.clone(),
        allow_unsealed: opts.allow_unsealed,
    };
    let checked = fleet::check(&fl, &fopts).map_err(|e| BadInput(e.0))?;
    let names: Vec<String> = checked.chains.iter().map(|c| c.name.clone()).collect();
    let verification = Verification::of_fleet(&checked, opts.allow_unsealed);
    if !checked.ok() {
        return Ok((names, Err(verification)));
    }
    let sums: Vec<(&str, &verify::Findings)> = checked
        .chains
        .iter()
        .filter_map(|c| Some((c.name.as_str(), c.summary.as_ref()?)))
        .collect();
    let keys: Vec<String> = sums
        .iter()
        .map(|(n, s)| format!("{n}={}", s.key.as_deref().unwrap_or("-")))
        .collect();
    let (records, replicas) = fleet_decisions(&fl.chains)?;
    Ok((
        names,
        Ok(Verified {
            scope: EvidenceScope {
                evidence_public_key: Some(keys.join(", ")),
                evidence_key_pinned: verification.key_pinned,
                evidence_sealed: sums.iter().all(|(_, s)| s.sealed),
                evidence_unsigned_tail: sums.iter().map(|(_, s)| s.unsigned_tail).sum(),
                evidence_span: Span {
                    first: sums.iter().filter_map(|(_, s)| s.first_ts.clone()).min(),
                    last: sums.iter().filter_map(|(_, s)| s.last_ts.clone()).max(),
                    records: sums.iter().map(|(_, s)| s.records).sum(),
                },
                policy_matches_plan: None,
                policy_in_evidence: BTreeSet::new(),
                orgs_in_evidence: BTreeSet::new(),
            },
            verification,
            records,
            replicas: Some(replicas),
            enforcement: fl
                .chains
                .iter()
                .map(|c| enforcement(&c.path))
                .collect::<Result<_, _>>()?,
            closes: closes(
                &fl.chains
                    .iter()
                    .map(|c| c.path.as_path())
                    .collect::<Vec<_>>(),
                volume,
            )?,
        }),
    ))
}

/// A plan as the assessor gave it (`--plan`).
struct Agreed {
    path: PathBuf,
    sha256: String,
    plan: Plan,
}

fn read_plan(path: &Path) -> Result<Agreed, BadInput> {
    use sha2::Digest;
    let text =
        std::fs::read_to_string(path).map_err(|e| BadInput(format!("{}: {e}", path.display())))?;
    let plan = Plan::from_toml(&text).map_err(|e| BadInput(format!("{}: {e}", path.display())))?;
    if plan.run.is_none() || plan.issued.is_none() {
        return Err(BadInput(format!(
            "{}: the plan names no `run` (its nonce, 8 hex digits) or no `issued` time: without them an earlier run's observations and records could pass for this one; `probe plan` writes both, or add them by hand, fresh for every plan",
            path.display()
        )));
    }
    Ok(Agreed {
        path: path.to_path_buf(),
        sha256: data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(text.as_bytes())),
        plan,
    })
}

/// One planned probe of one run, with its observation if there is one
/// (its target and options replaced by the plan's).
struct Planned {
    id: String,
    probe: plan::Probe,
    org: Option<String>,
    observation: Option<Observation>,
    /// What in the observation does not fit the plan or the evidence.
    mismatches: Vec<String>,
    run: usize,
    /// When its plan was issued.
    issued: Option<std::time::SystemTime>,
}

impl Planned {
    /// What a record must fit to be of this probe (None: not observed).
    fn case(&self, ips: &[BTreeSet<IpAddr>]) -> Option<Case> {
        let o = self.observation.as_ref()?;
        Some(Case::new(
            o,
            &self.probe,
            self.org.as_deref(),
            ips[self.run].clone(),
            self.issued,
        ))
    }
}

/// Every probe of the agreed plan of each run, joined with its
/// observation by id; what was ignored.
fn planned(sets: &[(Observations, &Agreed)]) -> (Vec<Planned>, Vec<String>) {
    let several = sets.len() > 1;
    let (mut out, mut ignored) = (Vec::new(), Vec::new());
    for (run, (set, agreed)) in sets.iter().enumerate() {
        let issued = agreed.plan.issued_at();
        for (index, probe) in agreed.plan.probes.iter().enumerate() {
            let mut seen = set.observations.iter().filter(|o| o.id == probe.id);
            let mut mismatches = Vec::new();
            // The plan's own marker (read_plan refuses a plan without its
            // run); never the one the sandbox wrote down.
            let marker = agreed.plan.marker(index).unwrap_or_default();
            let probe = &probe.marked(&marker);
            let observation = seen.next().map(|o| {
                let mut o = o.clone();
                if o.marker != marker {
                    mismatches.push(format!(
                        "the observation names marker {}, the plan's is {marker}",
                        o.marker
                    ));
                    o.marker = marker.clone();
                }
                let started = humantime::parse_rfc3339_weak(&o.started).ok();
                if let (Some(at), Some(issued)) = (started, issued) {
                    if at + SKEW < issued {
                        mismatches.push(format!(
                            "the observation says the probe started at {}, before the plan was issued ({}): a window of an earlier run",
                            o.started,
                            agreed.plan.issued.as_deref().unwrap_or_default()
                        ));
                    }
                }
                let target = probe.target.clone();
                if o.target != target {
                    mismatches.push(format!(
                        "the observation names target {}, the plan's is {target}",
                        o.target
                    ));
                }
                if (o.expect, o.via, o.layer) != (probe.expect, probe.via, probe.layer) {
                    mismatches.push(
                        "the observation restates the probe's expectation, path or layer unlike the plan".into(),
                    );
                }
                o.kind = parse_target(&target)
                    .map(|t| t.kind())
                    .unwrap_or("invalid")
                    .into();
                o.target = target;
                o.expect = probe.expect;
                o.via = probe.via;
                o.layer = probe.layer;
                o.note = probe.note.clone();
                o.host_header = probe.host_header.clone();
                o.second_host = probe.second_host.clone();
                o.ech = probe.ech;
                o.volume = probe.volume;
                o.budget = probe.budget;
                if probe.silence.is_none() {
                    o.silence_ms = None;
                    o.closed_in_silence_ms = None;
                } else if o.silence_ms.is_none() {
                    o.silence_ms = Some(probe.silence().as_millis() as u64);
                }
                o
            });
            let extra = seen.count();
            if extra > 0 {
                mismatches.push(format!(
                    "{} observations of this probe; the first was used",
                    extra + 1
                ));
            }
            out.push(Planned {
                id: if several {
                    format!("{}@{}", probe.id, set.run)
                } else {
                    probe.id.clone()
                },
                probe: probe.clone(),
                org: agreed.plan.org.clone(),
                observation,
                mismatches,
                run,
                issued,
            });
        }
        for o in &set.observations {
            if !agreed.plan.probes.iter().any(|p| p.id == o.id) {
                ignored.push(if several {
                    format!("{}@{}", o.id, set.run)
                } else {
                    o.id.clone()
                });
            }
        }
    }
    (out, ignored)
}

/// The addresses a run's sockets claim to come from.
fn run_ips(set: &Observations) -> BTreeSet<IpAddr> {
    set.observations
        .iter()
        .flat_map(|o| o.sockets.iter())
        .filter_map(|s| s.local.as_deref()?.parse::<SocketAddr>().ok())
        .map(|a| a.ip())
        .filter(|ip| !ip.is_unspecified())
        .collect()
}

/// The plan's org and policy must be the evidence's (exit 2 otherwise).
fn plan_fits_evidence(agreed: &[Agreed], records: &[Record]) -> Result<(), BadInput> {
    for a in agreed {
        if let Some(org) = &a.plan.org {
            if !records
                .iter()
                .any(|r| r.org.as_deref() == Some(org.as_str()))
            {
                return Err(BadInput(format!(
                    "{}: the plan is for org {org:?}, and the evidence has no record of that org",
                    a.path.display()
                )));
            }
        }
        if let Some(policy) = &a.plan.policy {
            if !records.iter().any(|r| &*r.policy == policy.as_str()) {
                let seen: BTreeSet<&str> = records.iter().map(|r| &*r.policy).collect();
                return Err(BadInput(format!(
                    "{}: the plan is for policy {policy}, and no record in the evidence was decided by it (policies there: {})",
                    a.path.display(),
                    seen.into_iter().collect::<Vec<_>>().join(", ")
                )));
            }
        }
    }
    Ok(())
}

/// What the report trusts and what the sandbox can still do: the header.
fn trust(agreed: &[Agreed], verification: &Verification, ignored: &[String]) -> Vec<String> {
    let plans: Vec<String> = agreed
        .iter()
        .map(|a| format!("{} (sha256 {})", a.path.display(), a.sha256))
        .collect();
    let mut out = vec![format!(
        "The plan is the assessor's: {}. Every probe in it is listed below; the observations were written inside the sandbox, by the party under assessment, and only point at Palisade's records.",
        plans.join(", ")
    )];
    let pinned = if !verification.replicas.is_empty() {
        let keyed: Vec<&str> = verification
            .replicas
            .iter()
            .filter(|c| c.key_pinned == Some(true))
            .map(|c| c.replica.as_str())
            .collect();
        if keyed.is_empty() {
            "no key pinned".to_string()
        } else {
            format!("keys pinned for {}", keyed.join(", "))
        }
    } else if verification.key_pinned {
        "the checkpoint key pinned".to_string()
    } else {
        "no key pinned: the signatures prove consistency, not origin".to_string()
    };
    out.push(if verification.ok {
        format!("The evidence was verified before anything was classified ({pinned}).")
    } else {
        format!("The evidence failed verification ({pinned}): nothing was classified.")
    });
    out.push(format!(
        "A probe is enforced only on signed records that fit its target (with the plan's own marker), the sandbox's client address and org, and its time window (± {} s) after the plan was issued, whatever the observation quotes; and only by a denial of the probe's own request (a denial it could not have caused is listed as a finding). What the sandbox can still do: fail to run a probe or drop its observation (the probe is then missing, a finding), or misreport what it saw (at worst inconclusive, never enforced).",
        SKEW.as_secs()
    ));
    let runs: Vec<String> = agreed
        .iter()
        .map(|a| {
            format!(
                "run {} issued {}",
                a.plan.run.as_deref().unwrap_or("-"),
                a.plan.issued.as_deref().unwrap_or("-")
            )
        })
        .collect();
    out.push(format!(
        "The plan's nonce and issue time ({}) are the assessor's: no record written before the plan was issued, and none naming another plan's marker, counts for a probe, so an earlier run's observations and records cannot pass for this one.",
        runs.join("; ")
    ));
    if !ignored.is_empty() {
        out.push(format!(
            "Observations of probes that are not in the plan were ignored: {}.",
            ignored.join(", ")
        ));
    }
    out
}

/// Build the report.
pub fn build(opts: &Options<'_>) -> Result<Report, BadInput> {
    if opts.plans.is_empty() {
        return Err(BadInput(
            "no --plan given: the report needs the agreed plan".into(),
        ));
    }
    let agreed = opts
        .plans
        .iter()
        .map(|p| read_plan(p))
        .collect::<Result<Vec<_>, _>>()?;
    let paired = pair(opts, &agreed)?;
    let (cases, ignored) = planned(&paired);
    let ips: Vec<BTreeSet<IpAddr>> = paired.iter().map(|(s, _)| run_ips(s)).collect();
    let obs = merge_observations(
        paired
            .iter()
            .map(|(s, a)| Observations {
                plan: a.plan.clone(),
                observations: Vec::new(),
                ..s.clone()
            })
            .collect(),
    )?;
    if opts.evidence.is_empty() {
        return Err(BadInput("no evidence path given".into()));
    }
    let mut scope = scope_of(&obs, &agreed, opts);
    let volume = agreed
        .iter()
        .any(|a| a.plan.probes.iter().any(|p| p.volume.is_some()));
    let verified = if opts.is_fleet() {
        let (names, v) = verify_fleet(opts, volume)?;
        scope.replicas = names;
        v
    } else {
        verify_one(opts, volume)?
    };
    let Verified {
        verification,
        scope: mut evidence_scope,
        records,
        replicas: record_replicas,
        enforcement: enforcement_records,
        closes,
    } = match verified {
        Ok(v) => v,
        Err(verification) => {
            return Ok(not_assessed(
                &agreed,
                verification,
                &ignored,
                scope,
                obs.environment,
            ))
        }
    };
    plan_fits_evidence(&agreed, &records)?;
    let fits: Vec<Option<Case>> = cases.iter().map(|c| c.case(&ips)).collect();
    let assigned = assign(&fits, &records);
    let joined = Joined {
        cases: &cases,
        fits: &fits,
        records: &records,
        assigned: &assigned,
        closes: &closes,
        enforcement: &enforcement_records,
        replicas: record_replicas.as_ref(),
    };
    let probes: Vec<ProbeResult> = (0..cases.len()).map(|n| joined.result(n)).collect();
    joined.seen(&mut evidence_scope, obs.plan.policy.as_deref());
    let policy_matches = evidence_scope.policy_matches_plan;
    scope.evidence = Some(evidence_scope);

    let counts = Counts::of(&probes);
    let findings: Vec<ProbeResult> = probes.iter().filter(|p| p.finding).cloned().collect();
    let sources: BTreeSet<String> = ips.iter().flatten().map(|ip| ip.to_string()).collect();
    let sources_text = sources.iter().cloned().collect::<Vec<_>>().join(", ");
    let window = format!("{} .. {}", obs.started, obs.finished);
    let (verdict, exit) = verdict(&probes, &counts, &sources_text, &window);
    let retention_cut = retention_cut(opts, &obs.started, &obs.finished)?;
    let (verdict, exit) = if retention_cut.is_empty() || exit != 0 {
        (verdict, exit)
    } else {
        (retention_verdict(&sources_text, &window), 1)
    };
    let mut untested = untested(&obs.plan, &probes, &sources_text, &scope.replicas);
    if policy_matches == Some(false) {
        untested.insert(
            0,
            "The policy that decided (policy hash in evidence) is not the one the plan names: the results describe the policy in the evidence.".into(),
        );
    }
    Ok(Report {
        format: REPORT_FORMAT,
        trust: trust(&agreed, &verification, &ignored),
        verification,
        scope,
        environment: obs.environment,
        counts: Some(counts),
        verdict,
        exit_status: exit,
        findings,
        probes,
        unattributed: unattributed(&fits, &records, &assigned)
            .into_iter()
            .map(|i| CitedRecord {
                replica: joined.replica_of(i),
                ..CitedRecord::from(&records[i])
            })
            .collect(),
        retention_cut,
        untested,
    })
}

/// Each observations file of `opts`, paired with the agreed plan of its
/// hash; every agreed plan must have observations.
fn pair<'a>(
    opts: &Options<'_>,
    agreed: &'a [Agreed],
) -> Result<Vec<(Observations, &'a Agreed)>, BadInput> {
    let sets = opts
        .observations
        .iter()
        .map(|p| Ok((p, read_observations(p)?)))
        .collect::<Result<Vec<_>, BadInput>>()?;
    let mut paired: Vec<(Observations, &Agreed)> = Vec::new();
    for (path, set) in sets {
        let Some(a) = agreed.iter().find(|a| a.sha256 == set.plan_sha256) else {
            let given: Vec<String> = agreed
                .iter()
                .map(|a| format!("{} is sha256 {}", a.path.display(), a.sha256))
                .collect();
            return Err(BadInput(format!(
                "{}: the observations are of plan sha256 {}, not of the agreed plan ({})",
                path.display(),
                set.plan_sha256,
                given.join(", ")
            )));
        };
        paired.push((set, a));
    }
    if let Some(a) = agreed
        .iter()
        .find(|a| !paired.iter().any(|(_, p)| p.sha256 == a.sha256))
    {
        return Err(BadInput(format!(
            "{}: no observations of this plan (sha256 {}) given",
            a.path.display(),
            a.sha256
        )));
    }
    Ok(paired)
}

/// What the report covers, from the observations and the plans (the
/// evidence's part comes once it is verified).
fn scope_of(obs: &Observations, agreed: &[Agreed], opts: &Options<'_>) -> Scope {
    Scope {
        org: obs.plan.org.clone(),
        plan_policy: obs.plan.policy.clone(),
        probe_run: obs.run.clone(),
        plan_sha256: {
            let mut shas: Vec<&str> = agreed.iter().map(|a| a.sha256.as_str()).collect();
            shas.dedup();
            shas.join(", ")
        },
        probe_palisade_version: obs.palisade_version.clone(),
        report_palisade_version: env!("CARGO_PKG_VERSION"),
        window: Window {
            start: obs.started.clone(),
            end: obs.finished.clone(),
        },
        evidence_path: opts
            .evidence
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        replicas: Vec::new(),
        evidence: None,
    }
}

/// The report of evidence that failed verification: nothing classified.
fn not_assessed(
    agreed: &[Agreed],
    verification: Verification,
    ignored: &[String],
    scope: Scope,
    environment: Value,
) -> Report {
    let problem = match &verification.checked {
        Checked::Failed { error, .. } => error.clone(),
        Checked::Verified { .. } => String::new(),
    };
    let verdict = format!(
        "Not assessed: the evidence failed verification ({problem}). No probe was classified: \
         evidence that cannot be trusted cannot show what Palisade enforced."
    );
    Report {
        format: REPORT_FORMAT,
        trust: trust(agreed, &verification, ignored),
        verification,
        scope,
        environment,
        counts: None,
        verdict,
        exit_status: 1,
        findings: Vec::new(),
        probes: Vec::new(),
        unattributed: Vec::new(),
        retention_cut: Vec::new(),
        untested: Vec::new(),
    }
}

/// The records and observations joined: what classifying one planned
/// probe reads.
struct Joined<'a> {
    cases: &'a [Planned],
    fits: &'a [Option<Case>],
    records: &'a [Record],
    assigned: &'a [Vec<usize>],
    /// Close records (volume probes).
    closes: &'a [Record],
    /// The enforcement check's records, per chain.
    enforcement: &'a [Vec<Record>],
    /// A fleet: each record's replica, by position.
    replicas: Option<&'a Vec<Arc<str>>>,
}

impl Joined<'_> {
    fn replica_of(&self, i: usize) -> Option<Arc<str>> {
        self.replicas.and_then(|r| r.get(i)).cloned()
    }

    /// The policies and orgs the matched records name, into `scope`, and
    /// whether the one policy is the plan's (`plan`).
    fn seen(&self, scope: &mut EvidenceScope, plan: Option<&str>) {
        let matched = || self.assigned.iter().flatten().map(|i| &self.records[*i]);
        let mut policies: BTreeSet<String> = matched().map(|r| r.policy.to_string()).collect();
        policies.remove("");
        scope.orgs_in_evidence = matched()
            .map(|r| r.org.as_deref().unwrap_or_default().to_string())
            .collect();
        scope.policy_matches_plan = plan.map(|p| policies.len() == 1 && policies.contains(p));
        scope.policy_in_evidence = policies;
    }

    /// The class of planned probe `n` observed as `o` with its records
    /// `matched`, and why; what does not fit is added to `mismatches`.
    fn judged(
        &self,
        n: usize,
        o: &Observation,
        matched: &[&Record],
        volume: Option<&VolumeCounts>,
        mismatches: &mut Vec<String>,
    ) -> (Class, String) {
        let (mut class, mut why) = match volume {
            Some(v) => volume::classify(o, matched, v),
            None => classify(o, matched),
        };
        for r in matched {
            if let Some(not_ours) = not_caused_by(o, r) {
                mismatches.push(format!(
                    "a denial fits the probe's target and time, but is not of the probe's own request: {not_ours}"
                ));
            }
        }
        if let Some(c) = name_counts(o, matched).filter(|c| c.foreign > 0) {
            mismatches.push(format!(
                "the observation lists {} names that are not of the probe's target",
                c.foreign
            ));
        }
        if let Some(q) = &o.palisade_record {
            let name = |k: usize| self.cases[k].id.clone();
            mismatches.extend(quote_misfit(
                q,
                n,
                self.fits,
                self.records,
                self.assigned,
                &name,
            ));
        }
        if o.outcome == ProbeOutcome::Reached
            && !matched.iter().any(|r| r.decision_str() == "allow")
        {
            mismatches.push("the client reports the target answered, and no Palisade allow record fits it: traffic that left without a record".into());
        }
        let shown = matches!(
            class,
            Class::EnforcedAllow | Class::EnforcedDeny | Class::BlockedElsewhere
        );
        // Any chain (replica) whose ruleset was not verified meanwhile.
        let unverified = self
            .enforcement
            .iter()
            .find_map(|t| unverified_during(t, &o.started, &o.finished));
        if let (true, Some(r)) = (shown, unverified) {
            why = format!(
                "enforcement was not verified while the probe ran (enforcement record {}: {}; otherwise: {why})",
                r.id,
                r.differs.as_deref().unwrap_or_default().join("; ")
            );
            class = Class::Inconclusive;
        } else if !mismatches.is_empty() && shown {
            why = format!(
                "what the sandbox reported does not fit Palisade's records (otherwise: {why})"
            );
            class = Class::Inconclusive;
        }
        (class, why)
    }

    /// The result of planned probe `n`.
    fn result(&self, n: usize) -> ProbeResult {
        let c = &self.cases[n];
        let indices = &self.assigned[n];
        let matched: Vec<&Record> = indices.iter().map(|i| &self.records[*i]).collect();
        let deciding: BTreeSet<Arc<str>> =
            indices.iter().filter_map(|i| self.replica_of(*i)).collect();
        let mut mismatches = c.mismatches.clone();
        let volume_counts = c
            .observation
            .as_ref()
            .zip(c.probe.volume.zip(c.probe.budget))
            .map(|(o, v)| volume::counts(o, v, &matched, self.closes));
        let (class, why, observed, outcome) = match &c.observation {
        None => (
            Class::Missing,
            "the plan has this probe and the observations do not: it was not run, or its observation was removed".to_string(),
            "no observation".to_string(),
            None,
        ),
        Some(o) => {
            let (class, why) = self.judged(n, o, &matched, volume_counts.as_ref(), &mut mismatches);
            (class, why, observed_text(o), Some(o.outcome))
        }
    };
        let matched_expectation = match class {
            Class::EnforcedAllow => c.probe.expect == Expect::Allow,
            Class::EnforcedDeny => c.probe.expect == Expect::Deny,
            Class::BlockedElsewhere => {
                c.probe.expect == Expect::Deny && c.probe.layer == Layer::Any
            }
            _ => false,
        };
        let o = c.observation.as_ref();
        ProbeResult {
            id: c.id.clone(),
            target: o.map_or_else(|| c.probe.target.clone(), |o| o.target.clone()),
            kind: parse_target(&c.probe.target)
                .map(|t| t.kind())
                .unwrap_or("invalid")
                .into(),
            via: c.probe.via,
            expect: c.probe.expect,
            layer: c.probe.layer,
            class,
            replica: (!deciding.is_empty()).then(|| {
                deciding
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }),
            finding: class.is_finding() || !mismatches.is_empty(),
            matched: matched_expectation && mismatches.is_empty(),
            why,
            mismatches,
            observed,
            outcome,
            records: indices
                .iter()
                .map(|i| CitedRecord {
                    replica: self.replica_of(*i),
                    ..CitedRecord::from(&self.records[*i])
                })
                .collect(),
            bypass_attempts: indices
                .iter()
                .map(|i| &self.records[*i])
                .filter(|r| r.kind == Kind::Bypass)
                .map(|r| r.count.unwrap_or(1))
                .sum(),
            names: o.and_then(|o| name_counts(o, &matched)),
            volume: volume_counts,
            note: c.probe.note.clone(),
            marker: o.map(|o| o.marker.clone()).unwrap_or_default(),
            started: o.map(|o| o.started.clone()).unwrap_or_default(),
            elapsed_ms: o.map_or(0, |o| o.elapsed_ms),
            observation: o.cloned(),
        }
    }
}

/// The verdict when retention removed evidence inside the run's window.
fn retention_verdict(sources_text: &str, window: &str) -> String {
    format!(
        "NOT DEMONSTRATED: retention removed evidence inside the run's window, so a record that would contradict the plan may be missing here. \
         Run the report over the shipped copy of the evidence. Tested from {sources_text} during {window}."
    )
}

/// The verdict line and the exit status, before retention is checked.
fn verdict(
    probes: &[ProbeResult],
    counts: &Counts,
    sources_text: &str,
    window: &str,
) -> (String, u8) {
    let findings = probes.iter().filter(|p| p.finding).count();
    let (total, inconclusive) = (counts.probes, counts.inconclusive);
    let unmatched = counts.not_matching_expectation;
    let exit = if unmatched == 0 && findings == 0 {
        0
    } else {
        1
    };
    let mismatched = probes.iter().filter(|p| !p.mismatches.is_empty()).count();
    let verdict = if findings > 0 {
        format!(
            "FINDINGS: {} of {total} probes did not match the agreed paths ({} unexpected allow, {} unexpected deny, {} missing, {mismatched} reported unlike the evidence); {inconclusive} inconclusive. \
             Fix or explain each finding below, then re-run the plan: until then the environment is not shown to have the agreed network paths. Tested from {sources_text} during {window}.",
            findings,
            counts.unexpected_allow,
            counts.unexpected_deny,
            counts.missing,
        )
    } else if unmatched > 0 {
        format!(
            "NOT DEMONSTRATED: no probe contradicted the plan, but {unmatched} of {total} probes did not show \
             enforcement ({inconclusive} inconclusive, {} blocked by another layer where the plan expected Palisade, \
             or allowed without an allow record). Re-run them once fixed. Tested from {sources_text} during {window}.",
            unmatched - inconclusive
        )
    } else {
        format!(
            "Within the {total} paths tested, from {sources_text} during {window}, the network paths matched the plan: \
             {} allowed with a Palisade allow record, {} denied with a Palisade deny record, {} stopped by another layer \
             where the plan accepted that. This covers the tested paths only: it does not show that no other path \
             exists (see the untested surfaces).",
            counts.enforced_allow,
            counts.enforced_deny,
            counts.blocked_elsewhere,
        )
    };
    (verdict, exit)
}

/// What retention removed from each chain inside the run's window
/// (widened by the fitting skew), one line per chain that lost records.
fn retention_cut(
    opts: &Options<'_>,
    started: &str,
    finished: &str,
) -> Result<Vec<String>, BadInput> {
    let at = |t: &str| humantime::parse_rfc3339_weak(t).ok();
    let since = at(started).map(|t| t - SKEW);
    let until = at(finished).map(|t| t + SKEW);
    let chains: Vec<(String, PathBuf)> = if opts.is_fleet() {
        let fl = fleet::resolve(opts.evidence).map_err(|e| BadInput(e.0))?;
        fl.chains.into_iter().map(|c| (c.name, c.path)).collect()
    } else {
        vec![(String::new(), opts.evidence[0].clone())]
    };
    Ok(chains
        .iter()
        .filter_map(|(name, path)| {
            let line = verify::retention_cut(path, since, until)?;
            Some(if name.is_empty() {
                line
            } else {
                format!("{name}: {line}")
            })
        })
        .collect())
}

/// A surface: none of its probes in the plan (`none` is said), or none
/// that could run.
fn surface(
    out: &mut Vec<String>,
    probes: &[ProbeResult],
    name: &str,
    of: &dyn Fn(&ProbeResult) -> bool,
    none: &str,
) {
    let ran = |p: &ProbeResult| {
        p.observation
            .as_ref()
            .is_some_and(|o| o.outcome != ProbeOutcome::SetupFailed)
    };
    let all: Vec<&ProbeResult> = probes.iter().filter(|p| of(p)).collect();
    if all.is_empty() {
        out.push(none.to_string());
    } else if !all.iter().any(|p| ran(p)) {
        let ids: Vec<&str> = all.iter().map(|p| p.id.as_str()).collect();
        out.push(format!(
            "{name}: planned ({}) but no probe of it could run (missing, or set up failed: e.g. no such path in the sandbox): not examined.",
            ids.join(", ")
        ));
    }
}

/// The surfaces (IPv6, UDP, DNS, the name channel, direct egress, TLS)
/// the plan left out or whose probes could not run.
fn untested_surfaces(out: &mut Vec<String>, probes: &[ProbeResult]) {
    let ipv6 = |p: &ProbeResult| {
        parse_target(&p.target).is_ok_and(|t| t.is_ipv6())
            || p.observation
                .as_ref()
                .and_then(|o| o.server.as_deref())
                .is_some_and(|s| s.starts_with('['))
    };
    surface(out, probes, "IPv6", &ipv6, "IPv6: not probed.");
    let udp_ports: BTreeSet<String> = probes
        .iter()
        .filter(|p| p.kind == "udp")
        .filter_map(|p| p.target.rsplit_once(':').map(|x| x.1.to_string()))
        .collect();
    if udp_ports.is_empty() {
        out.push("UDP other than DNS (QUIC, NTP, ...): not probed.".to_string());
    } else {
        surface(out, probes, "UDP other than DNS", &|p| p.kind == "udp", "");
        out.push(format!(
            "UDP other than DNS: only port(s) {} probed.",
            udp_ports.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    surface(out, probes, "DNS", &|p| p.kind == "dns", "DNS: not probed.");
    surface(
        out,
        probes,
        "New names under allowed wildcards (the name channel)",
        &|p| p.kind == "dns-burst",
        "New names under allowed wildcards (the name channel): not probed (no dns-burst probe).",
    );
    surface(
        out,
        probes,
        "Connections that skip the proxy (direct egress, the transparent path)",
        &|p| p.via == Via::Direct && !p.kind.starts_with("dns"),
        "Connections that skip the proxy (direct egress): not probed.",
    );
    surface(
        out,
        probes,
        "TLS",
        &|p| p.kind == "https" || p.kind == "tls",
        "TLS: not probed.",
    );
}

/// Probes that did not run (the deadline) or left no observation.
fn not_run(out: &mut Vec<String>, probes: &[ProbeResult]) {
    let failed_with = |error: &str| -> Vec<&str> {
        probes
            .iter()
            .filter(|p| {
                p.observation
                    .as_ref()
                    .is_some_and(|o| o.error.as_deref() == Some(error))
            })
            .map(|p| p.id.as_str())
            .collect()
    };
    let not_run = failed_with("deadline");
    if !not_run.is_empty() {
        out.push(format!(
            "Probes not run (deadline): {}.",
            not_run.join(", ")
        ));
    }
    let too_large = failed_with("not_run");
    if !too_large.is_empty() {
        out.push(format!(
            "Volume probes not run (a budget over the {} MiB a probe sends): {}.",
            plan::MAX_VOLUME_BUDGET >> 20,
            too_large.join(", ")
        ));
    }
    let missing: Vec<&str> = probes
        .iter()
        .filter(|p| p.class == Class::Missing)
        .map(|p| p.id.as_str())
        .collect();
    if !missing.is_empty() {
        out.push(format!(
            "Probes with no observation (not examined): {}.",
            missing.join(", ")
        ));
    }
}

/// The gateway itself, when no probe reached its own addresses beyond
/// the proxy and DNS ports.
fn gateway_untested(plan: &Plan, probes: &[ProbeResult]) -> Option<String> {
    let gateway: BTreeSet<IpAddr> = plan
        .proxy
        .iter()
        .chain(plan.resolver.iter())
        .chain(plan.probes.iter().filter_map(|p| p.proxy.as_ref()))
        .map(|a| a.ip())
        .collect();
    let reached_gateway = probes.iter().any(|p| {
        parse_target(&p.target).is_ok_and(|t| {
            t.host_port().is_some_and(|(h, _)| {
                crate::proto::target::normalize_host(h)
                    .ok()
                    .and_then(|h| h.to_string().parse::<IpAddr>().ok())
                    .is_some_and(|ip| gateway.contains(&ip))
            })
        })
    });
    if gateway.is_empty() || reached_gateway {
        return None;
    }
    let list: Vec<String> = gateway.iter().map(|ip| ip.to_string()).collect();
    Some(format!(
        "The gateway's own addresses ({}) on ports other than its proxy and DNS service, and its management interfaces (admin listener, SSH): not probed.",
        list.join(", ")
    ))
}

/// Replicas no probe was decided by.
fn replicas_untested(out: &mut Vec<String>, probes: &[ProbeResult], replicas: &[String]) {
    for replica in replicas {
        let decided = probes.iter().any(|p| {
            p.replica
                .as_deref()
                .is_some_and(|r| r.split(", ").any(|x| x == replica))
        });
        if !decided {
            out.push(format!(
                "Replica {replica}: no probe was decided by it: its enforcement was not examined."
            ));
        }
    }
}

/// What the report did not examine, listed explicitly: surfaces the plan
/// left out or whose probes could not run, the gateway itself, replicas
/// no probe reached.
fn untested(
    plan: &Plan,
    probes: &[ProbeResult],
    sources: &str,
    replicas: &[String],
) -> Vec<String> {
    let mut out = Vec::new();
    untested_surfaces(&mut out, probes);
    not_run(&mut out, probes);
    out.extend(gateway_untested(plan, probes));
    replicas_untested(&mut out, probes, replicas);
    out.push("ICMP and IP protocols other than TCP and UDP: not probed.".into());
    out.push("TCP and UDP ports and destinations not in the probe table: not probed.".into());
    out.push(format!(
        "Only the source address(es) the probes ran from ({sources}): other sandbox hosts, other orgs' addresses and spoofed sources not probed."
    ));
    out.push(
        "Wildcard and CIDR rules: probed with the names and addresses in the table only.".into(),
    );
    let tunnel: Vec<&str> = probes
        .iter()
        .filter(|p| {
            p.observation
                .as_ref()
                .is_some_and(|o| in_tunnel(o) || o.handshake)
        })
        .map(|p| p.id.as_str())
        .collect();
    if tunnel.is_empty() {
        out.push("TLS probes stop at the server's first reply: data carried inside allowed connections (covert channels, timing) not assessed.".into());
    } else {
        out.push(format!(
            "Inside allowed connections only what the in-tunnel probes sent was tested ({}); other data carried inside them (covert channels, timing) not assessed.",
            tunnel.join(", ")
        ));
    }
    out
}

/// The class of every probe in a `report.json`, by probe id.
pub fn classes(report: &Value) -> BTreeMap<String, String> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    report["probes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| (text(&p["id"]), text(&p["class"])))
        .collect()
}
