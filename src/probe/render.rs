//! The report for people: `report.md` and a self-contained `report.html`
//! (no script, no outside resource; a CSP that allows only its inline
//! style), both from the typed [`Report`]. HTML goes through maud, which
//! escapes every value it splices in.
//!
//! A fleet report (evidence of several replicas) adds a table of every
//! replica's chain status to the verification section, and a `replica`
//! column to the findings and probe tables; a one-chain report is laid out
//! as it always was.

use std::fmt::Write as _;

use maud::{html as page, Markup, PreEscaped, DOCTYPE};
use serde::Serialize;
use serde_json::Value;

use super::report::{Checked, ProbeResult, Report, Scope};
use super::Layer;

/// A table cell of markdown: no `|` or line break from the value.
fn cell(v: &str) -> String {
    v.replace('|', "\\|").replace('\n', " ")
}

/// Whether the report covers a fleet.
fn is_fleet(r: &Report) -> bool {
    !r.verification.replicas.is_empty()
}

/// The replica(s) that decided a probe, or `-`.
fn replica_of(p: &ProbeResult) -> &str {
    p.replica.as_deref().unwrap_or("-")
}

/// `report.md`.
pub fn markdown(r: &Report) -> String {
    let fleet = is_fleet(r);
    let mut m = String::new();
    let _ = writeln!(m, "# Palisade containment report\n");
    let _ = writeln!(m, "**Verdict:** {}\n", r.verdict);
    let _ = writeln!(m, "## Evidence verification\n");
    match &r.verification.checked {
        Checked::Verified {
            summary, sealed, ..
        } => {
            let _ = writeln!(
                m,
                "Verified before classification (`palisade evidence verify`):\n"
            );
            let _ = writeln!(m, "```\n{summary}\n```\n");
            if !sealed {
                let _ = writeln!(m, "The chain is **not sealed** (a live instance); accepted because `--allow-unsealed` was given: records after the last checkpoint are not signed yet.\n");
            }
            if !r.verification.key_pinned {
                let _ = writeln!(m, "No `--key` was given: the signatures prove the evidence is consistent, not that it came from the expected instance.\n");
            }
        }
        Checked::Failed { error, .. } => {
            let _ = writeln!(m, "**FAILED:** {error}\n\nNo probe was classified.\n");
        }
    }
    if fleet {
        let _ = writeln!(m, "Replicas:\n");
        let _ = writeln!(
            m,
            "| replica | chain | records | detail |\n|---|---|---|---|"
        );
        for c in &r.verification.replicas {
            let records = c.records.map_or_else(|| "-".into(), |n| n.to_string());
            let status = if c.ok {
                c.status.to_string()
            } else {
                format!("**{}**", c.status.to_uppercase())
            };
            let _ = writeln!(
                m,
                "| {} | {status} | {records} | {} |",
                cell(&c.replica),
                cell(&c.text)
            );
        }
        let _ = writeln!(m);
    }
    let _ = writeln!(m, "## Scope\n");
    let _ = writeln!(m, "| | |\n|---|---|");
    for (label, val) in scope_rows(&r.scope) {
        let _ = writeln!(m, "| {label} | {} |", cell(&val));
    }
    let _ = writeln!(m);
    if let Some(c) = &r.counts {
        let _ = writeln!(m, "## Counts\n");
        let _ = writeln!(m, "| class | probes |\n|---|---|");
        for (k, n) in c.rows() {
            let _ = writeln!(m, "| {k} | {n} |");
        }
        let _ = writeln!(m);
    }
    let _ = writeln!(m, "## Findings\n");
    if r.findings.is_empty() {
        let _ = writeln!(m, "None among the probes classified.\n");
    } else {
        let (head, rule) = if fleet {
            (" replica |", "---|")
        } else {
            ("", "")
        };
        let _ = writeln!(m, "| probe | target | via | expected | class |{head} why | records |\n|---|---|---|---|---|{rule}---|---|");
        for f in &r.findings {
            let replica = if fleet {
                format!(" {} |", cell(replica_of(f)))
            } else {
                String::new()
            };
            let _ = writeln!(
                m,
                "| {} | `{}` | {} | {} | **{}** |{replica} {} | {} |",
                f.id,
                cell(&f.target),
                f.via.as_str(),
                f.expect.as_str(),
                f.class.as_str(),
                cell(&f.why),
                cell(&f.record_cite())
            );
        }
        let _ = writeln!(m);
    }
    let _ = writeln!(m, "## Probes\n");
    let (head, rule) = if fleet {
        (" replica |", "---|")
    } else {
        ("", "")
    };
    let _ = writeln!(m, "| probe | target | via | expected | observed | class | matches plan |{head} Palisade records |\n|---|---|---|---|---|---|---|{rule}---|");
    for p in &r.probes {
        let replica = if fleet {
            format!(" {} |", cell(replica_of(p)))
        } else {
            String::new()
        };
        let _ = writeln!(
            m,
            "| {} | `{}` | {} | {}{} | {} | {} | {} |{replica} {} |",
            p.id,
            cell(&p.target),
            p.via.as_str(),
            p.expect.as_str(),
            any_layer(p),
            cell(&p.observed),
            p.class.as_str(),
            if p.matched { "yes" } else { "**no**" },
            cell(&p.record_cite())
        );
    }
    let _ = writeln!(m);
    let _ = writeln!(m, "## Untested surfaces\n");
    for u in &r.untested {
        let _ = writeln!(m, "- {u}");
    }
    let _ = writeln!(m);
    let _ = writeln!(m, "## Environment (collected by the probe)\n");
    if r.scope.probe_run.contains(", ") {
        // Several runs: each run's environment under its run id.
        for (run, env) in r.environment.as_object().into_iter().flatten() {
            let _ = writeln!(m, "### Run {run}\n");
            environment_list(&mut m, env);
            let _ = writeln!(m);
        }
    } else {
        environment_list(&mut m, &r.environment);
    }
    m
}

/// One run's environment as a markdown list.
fn environment_list(m: &mut String, env: &Value) {
    for (k, v) in env.as_object().into_iter().flatten() {
        match v {
            Value::Array(a) => {
                let _ = writeln!(m, "- {k}:");
                for x in a {
                    let _ = writeln!(m, "  - `{}`", text(x));
                }
            }
            other => {
                let _ = writeln!(m, "- {k}: `{}`", text(other));
            }
        }
    }
}

/// ` (any layer)` after the expectation of a probe any layer may deny.
fn any_layer(p: &ProbeResult) -> &'static str {
    if p.layer == Layer::Any {
        " (any layer)"
    } else {
        ""
    }
}

/// A JSON value as text: strings bare, anything else as JSON.
fn text(v: &Value) -> String {
    match v {
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

/// The scope as labelled rows for markdown (`-` where not known); a
/// fleet's replicas last.
fn scope_rows(s: &Scope) -> Vec<(&'static str, String)> {
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let joined =
        |v: &std::collections::BTreeSet<String>| v.iter().cloned().collect::<Vec<_>>().join(", ");
    let e = s.evidence.as_ref();
    let mut rows = vec![
        ("org (plan)", or_dash(s.org.clone())),
        ("policy hash (plan)", or_dash(s.plan_policy.clone())),
        (
            "policy hash (evidence)",
            or_dash(e.map(|e| joined(&e.policy_in_evidence))),
        ),
        (
            "evidence policy = plan policy",
            or_dash(e.and_then(|e| e.policy_matches_plan).map(|b| b.to_string())),
        ),
        (
            "orgs (evidence)",
            or_dash(e.map(|e| joined(&e.orgs_in_evidence))),
        ),
        ("Palisade version (probe)", s.probe_palisade_version.clone()),
        (
            "Palisade version (report)",
            s.report_palisade_version.into(),
        ),
        (
            "time window",
            format!("{} .. {}", s.window.start, s.window.end),
        ),
        (
            "evidence public key",
            or_dash(e.and_then(|e| e.evidence_public_key.clone())),
        ),
        (
            "key pinned with --key",
            or_dash(e.map(|e| e.evidence_key_pinned.to_string())),
        ),
        (
            "evidence sealed",
            or_dash(e.map(|e| e.evidence_sealed.to_string())),
        ),
        ("evidence", s.evidence_path.clone()),
        ("probe run", s.probe_run.clone()),
        ("plan SHA-256", s.plan_sha256.clone()),
    ];
    if !s.replicas.is_empty() {
        rows.push(("replicas", s.replicas.join(", ")));
    }
    rows
}

/// Every field of a value that serialises as an object, in key order: the
/// scope and environment tables.
fn fields(v: &impl Serialize) -> Vec<(String, Value)> {
    match serde_json::to_value(v) {
        Ok(Value::Object(map)) => map.into_iter().collect(),
        _ => Vec::new(),
    }
}

/// A JSON value as lines of text: an array one item a line.
fn lines(v: &Value) -> String {
    match v {
        Value::Array(a) => a.iter().map(text).collect::<Vec<_>>().join("\n"),
        other => text(other),
    }
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em;color:#111}table{border-collapse:collapse;margin:1em 0}\
    td,th{border:1px solid #999;padding:.25em .5em;text-align:left;vertical-align:top;font-size:.9em}\
    th{background:#eee}.finding{background:#fdd}.bad{color:#a00;font-weight:bold}.ok{color:#060}\
    code,pre{font-family:ui-monospace,monospace;font-size:.9em}.verdict{font-size:1.1em;padding:.5em;border:2px solid #333}";

/// `report.html`.
pub fn html(r: &Report) -> String {
    let fleet = is_fleet(r);
    // The replica column only where several replicas decided.
    let heads = |all: &[&'static str]| -> Vec<&'static str> {
        all.iter()
            .copied()
            .filter(|h| fleet || *h != "replica")
            .collect()
    };
    let finding_heads = heads(&[
        "probe", "target", "via", "expected", "class", "replica", "why", "records",
    ]);
    let probe_heads = heads(&[
        "probe",
        "target",
        "via",
        "expected",
        "observed",
        "class",
        "matches plan",
        "replica",
        "why",
        "Palisade records",
    ]);
    let doc = page! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'";
                title { "Palisade containment report" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                h1 { "Palisade containment report" }
                p.verdict #verdict { (r.verdict) }
                h2 { "Evidence verification" }
                (verification(r))
                h2 { "Scope" }
                table #scope {
                    @for (k, v) in fields(&r.scope) {
                        tr { th { (k) } td { code { (text(&v)) } } }
                    }
                }
                h2 { "Findings" }
                table #findings {
                    tr {
                        @for h in &finding_heads { th { (h) } }
                    }
                    @if r.findings.is_empty() {
                        tr { td colspan=(finding_heads.len()) { "None among the probes classified." } }
                    }
                    @for f in &r.findings {
                        tr.finding data-probe=(f.id) data-class=(f.class.as_str()) data-replica=[f.replica.as_deref()] {
                            td { (f.id) }
                            td { code { (f.target) } }
                            td { (f.via.as_str()) }
                            td { (f.expect.as_str()) }
                            td.bad { (f.class.as_str()) }
                            @if fleet { td { (replica_of(f)) } }
                            td { (f.why) }
                            td { (f.record_cite()) }
                        }
                    }
                }
                h2 { "Probes" }
                table #probes {
                    tr {
                        @for h in &probe_heads { th { (h) } }
                    }
                    @for p in &r.probes {
                        tr data-probe=(p.id) data-class=(p.class.as_str()) data-replica=[p.replica.as_deref()] class=[p.finding.then_some("finding")] {
                            td { (p.id) }
                            td { code { (p.target) } }
                            td { (p.via.as_str()) }
                            td { (p.expect.as_str()) (any_layer(p)) }
                            td { (p.observed) }
                            td { (p.class.as_str()) }
                            td class=(if p.matched { "ok" } else { "bad" }) { (if p.matched { "yes" } else { "no" }) }
                            @if fleet { td { (replica_of(p)) } }
                            td { (p.why) }
                            td { (p.record_cite()) }
                        }
                    }
                }
                h2 { "Untested surfaces" }
                ul #untested {
                    @for u in &r.untested { li { (u) } }
                }
                h2 { "Environment (collected by the probe)" }
                table #environment {
                    @for (k, v) in fields(&r.environment) {
                        tr { th { (k) } td { pre { (lines(&v)) } } }
                    }
                }
            }
        }
    };
    doc.into_string()
}

/// The verification section of the page.
fn verification(r: &Report) -> Markup {
    page! {
        @match &r.verification.checked {
            Checked::Verified { summary, sealed, .. } => {
                pre #verification { (summary) }
                @if !sealed {
                    p { "The chain is " b { "not sealed" } " (a live instance); accepted with " code { "--allow-unsealed" } "." }
                }
                @if !r.verification.key_pinned {
                    p { "No " code { "--key" } " was given: consistency, not origin, is proven." }
                }
            }
            Checked::Failed { error, .. } => {
                p.bad #verification-failed { "FAILED: " (error) }
                p { "No probe was classified." }
            }
        }
        @if !r.verification.replicas.is_empty() {
            table #replicas {
                tr { @for h in ["replica", "chain", "records", "detail"] { th { (h) } } }
                @for c in &r.verification.replicas {
                    tr data-replica=(c.replica) data-status=(c.status) {
                        td { (c.replica) }
                        td class=(if c.ok { "ok" } else { "bad" }) { (c.status) }
                        td { (c.records.map_or_else(|| "-".to_string(), |n| n.to_string())) }
                        td { code { (c.text) } }
                    }
                }
            }
        }
    }
}
