//! `palisade probe report`: verify the evidence chain first, join each
//! observation to Palisade's records and classify it ([`super::classify`]),
//! and build the [`Report`]: `report.json` is its serialisation, and
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

use super::classify::{classify, in_tunnel, match_indices, observed_text};
use super::plan::parse_target;
use super::run::{Observation, Observations, ProbeOutcome};
use super::{Class, Expect, Layer, Via, REPORT_FORMAT};
use crate::evidence::{fleet, query, verify, Event, Kind, Mode, Record};
use crate::policy::Reason;

/// Inputs of a report.
pub struct Options<'a> {
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
    fn passed(summary: &verify::Summary, allow_unsealed: bool) -> Verification {
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

    fn failed(e: &verify::VerifyError, opts: &Options) -> Verification {
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
            } += 1;
            c.not_matching_expectation += usize::from(!p.matched);
        }
        c
    }

    /// Name and count of every field, in `report.json`'s (sorted) key order.
    pub fn rows(&self) -> [(&'static str, usize); 8] {
        [
            ("blocked_elsewhere", self.blocked_elsewhere),
            ("enforced_allow", self.enforced_allow),
            ("enforced_deny", self.enforced_deny),
            ("inconclusive", self.inconclusive),
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
    /// The class is a finding ([`Class::is_finding`]).
    pub finding: bool,
    /// The class is what the plan agreed.
    pub matched: bool,
    pub why: String,
    /// What the client saw, in one line.
    pub observed: String,
    pub outcome: ProbeOutcome,
    pub records: Vec<CitedRecord>,
    pub note: Option<String>,
    pub marker: String,
    pub started: String,
    pub elapsed_ms: u64,
    pub observation: Observation,
}

impl ProbeResult {
    /// `id decision reason` of each record, `; `-separated.
    pub fn record_cite(&self) -> String {
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
    let mut out = Vec::new();
    for stored in query::read_records(path) {
        let record = stored.map_err(|e| BadInput(e.to_string()))?.record;
        if record.event == Event::Decision {
            out.push(record);
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
}

/// One chain: verified, then read.
fn verify_one(opts: &Options) -> Result<Result<Verified, Verification>, BadInput> {
    let path = &opts.evidence[0];
    if !path.exists() {
        return Err(BadInput(format!(
            "{}: no such evidence path",
            path.display()
        )));
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
    }))
}

/// A fleet: every chain verified on its own, then all read merged.
fn verify_fleet(opts: &Options) -> Result<(Vec<String>, Result<Verified, Verification>), BadInput> {
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
    let sums: Vec<(&str, &verify::Summary)> = checked
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
        }),
    ))
}

/// Build the report.
pub fn build(opts: &Options) -> Result<Report, BadInput> {
    let sets = opts
        .observations
        .iter()
        .map(|p| read_observations(p))
        .collect::<Result<Vec<_>, _>>()?;
    let obs = merge_observations(sets)?;
    if opts.evidence.is_empty() {
        return Err(BadInput("no evidence path given".into()));
    }
    let mut scope = Scope {
        org: obs.plan.org.clone(),
        plan_policy: obs.plan.policy.clone(),
        probe_run: obs.run.clone(),
        plan_sha256: obs.plan_sha256.clone(),
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
    };
    let verified = if opts.is_fleet() {
        let (names, v) = verify_fleet(opts)?;
        scope.replicas = names;
        v
    } else {
        verify_one(opts)?
    };
    let Verified {
        verification,
        scope: mut evidence_scope,
        records,
        replicas: record_replicas,
    } = match verified {
        Ok(v) => v,
        Err(verification) => {
            let problem = match &verification.checked {
                Checked::Failed { error, .. } => error.clone(),
                Checked::Verified { .. } => String::new(),
            };
            let verdict = format!(
                "Not assessed: the evidence failed verification ({problem}). No probe was classified: \
                 evidence that cannot be trusted cannot show what Palisade enforced."
            );
            return Ok(Report {
                format: REPORT_FORMAT,
                verification,
                scope,
                environment: obs.environment,
                counts: None,
                verdict,
                exit_status: 1,
                findings: Vec::new(),
                probes: Vec::new(),
                untested: Vec::new(),
            });
        }
    };
    let replica_of = |i: usize| record_replicas.as_ref().and_then(|r| r.get(i)).cloned();

    let mut probes = Vec::new();
    let mut policies = BTreeSet::new();
    let mut record_orgs = BTreeSet::new();
    for o in &obs.observations {
        let indices = match_indices(o, &records);
        let matched: Vec<&Record> = indices.iter().map(|i| &records[*i]).collect();
        for r in &matched {
            policies.insert(r.policy.to_string());
            record_orgs.insert(r.org.as_deref().unwrap_or_default().to_string());
        }
        let deciding: BTreeSet<Arc<str>> = indices.iter().filter_map(|i| replica_of(*i)).collect();
        let (class, why) = classify(o, &matched);
        let matched_expectation = match class {
            Class::EnforcedAllow => o.expect == Expect::Allow,
            Class::EnforcedDeny => o.expect == Expect::Deny,
            Class::BlockedElsewhere => o.expect == Expect::Deny && o.layer == Layer::Any,
            _ => false,
        };
        probes.push(ProbeResult {
            id: o.id.clone(),
            target: o.target.clone(),
            kind: o.kind.clone(),
            via: o.via,
            expect: o.expect,
            layer: o.layer,
            class,
            replica: (!deciding.is_empty()).then(|| {
                deciding
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }),
            finding: class.is_finding(),
            matched: matched_expectation,
            why,
            observed: observed_text(o),
            outcome: o.outcome,
            records: indices
                .iter()
                .map(|i| CitedRecord {
                    replica: replica_of(*i),
                    ..CitedRecord::from(&records[*i])
                })
                .collect(),
            note: o.note.clone(),
            marker: o.marker.clone(),
            started: o.started.clone(),
            elapsed_ms: o.elapsed_ms,
            observation: o.clone(),
        });
    }
    policies.remove("");
    let policy_matches = obs
        .plan
        .policy
        .as_ref()
        .map(|p| policies.len() == 1 && policies.contains(p));
    evidence_scope.policy_matches_plan = policy_matches;
    evidence_scope.policy_in_evidence = policies;
    evidence_scope.orgs_in_evidence = record_orgs;
    scope.evidence = Some(evidence_scope);

    let counts = Counts::of(&probes);
    let findings: Vec<ProbeResult> = probes.iter().filter(|p| p.finding).cloned().collect();
    let (total, inconclusive) = (counts.probes, counts.inconclusive);
    let unmatched = counts.not_matching_expectation;
    let exit = if unmatched == 0 { 0 } else { 1 };
    let sources: BTreeSet<String> = obs
        .observations
        .iter()
        .flat_map(|o| o.sockets.iter())
        .filter_map(|s| s.local.as_deref())
        .filter_map(|l| {
            l.rsplit_once(':')
                .map(|(ip, _)| ip.trim_matches(['[', ']']).to_string())
        })
        .filter(|ip| ip != "0.0.0.0" && ip != "::")
        .collect();
    let sources_text = sources.iter().cloned().collect::<Vec<_>>().join(", ");
    let window = format!("{} .. {}", obs.started, obs.finished);
    let verdict = if !findings.is_empty() {
        format!(
            "FINDINGS: {} of {total} probes did not match the agreed paths ({} unexpected allow, {} unexpected deny); {inconclusive} inconclusive. \
             The environment does not have exactly the agreed network paths. Tested from {sources_text} during {window}.",
            findings.len(),
            counts.unexpected_allow,
            counts.unexpected_deny,
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
    let mut untested = untested(&obs, &sources_text);
    if policy_matches == Some(false) {
        untested.insert(
            0,
            "The policy that decided (policy hash in evidence) is not the one the plan names: the results describe the policy in the evidence.".into(),
        );
    }
    Ok(Report {
        format: REPORT_FORMAT,
        verification,
        scope,
        environment: obs.environment,
        counts: Some(counts),
        verdict,
        exit_status: exit,
        findings,
        probes,
        untested,
    })
}

/// What the plan did not cover, listed explicitly.
fn untested(obs: &Observations, sources: &str) -> Vec<String> {
    let os = &obs.observations;
    let mut out = Vec::new();
    let has = |f: &dyn Fn(&Observation) -> bool| os.iter().any(f);
    let ipv6 = |o: &Observation| {
        parse_target(&o.target).is_ok_and(|t| t.is_ipv6())
            || o.server.as_deref().is_some_and(|s| s.starts_with('['))
    };
    if !has(&ipv6) {
        out.push("IPv6: not probed.".to_string());
    }
    let udp_ports: BTreeSet<String> = os
        .iter()
        .filter(|o| o.kind == "udp")
        .filter_map(|o| o.target.rsplit_once(':').map(|x| x.1.to_string()))
        .collect();
    if udp_ports.is_empty() {
        out.push("UDP other than DNS (QUIC, NTP, ...): not probed.".to_string());
    } else {
        out.push(format!(
            "UDP other than DNS: only port(s) {} probed.",
            udp_ports.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if !has(&|o| o.kind == "dns") {
        out.push("DNS: not probed.".into());
    }
    if !has(&|o| o.via == Via::Direct && o.kind != "dns") {
        out.push("Connections that skip the proxy (direct egress): not probed.".into());
    }
    if !has(&|o| o.kind == "https" || o.kind == "tls") {
        out.push("TLS: not probed.".into());
    }
    let not_run: Vec<&str> = os
        .iter()
        .filter(|o| o.error.as_deref() == Some("deadline"))
        .map(|o| o.id.as_str())
        .collect();
    if !not_run.is_empty() {
        out.push(format!(
            "Probes not run (deadline): {}.",
            not_run.join(", ")
        ));
    }
    out.push("ICMP and IP protocols other than TCP and UDP: not probed.".into());
    out.push("TCP and UDP ports and destinations not in the probe table: not probed.".into());
    out.push(format!(
        "Only the source address(es) the probes ran from ({sources}): other sandbox hosts, other orgs' addresses and spoofed sources not probed."
    ));
    out.push(
        "Wildcard and CIDR rules: probed with the names and addresses in the table only.".into(),
    );
    let tunnel: Vec<&str> = os
        .iter()
        .filter(|o| in_tunnel(o) || o.handshake)
        .map(|o| o.id.as_str())
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
