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

/// A finished report, rendered, and its exit status (0 all matched, 1
/// otherwise).
pub(crate) struct Rendered {
    pub report: Report,
    /// `report.json`: the report as JSON (keys sorted).
    pub json: Value,
    pub markdown: String,
    pub html: String,
    pub exit: u8,
}

/// Render `report` as `report.json`, `report.md` and `report.html`.
pub(crate) fn outputs(report: Report) -> Rendered {
    Rendered {
        json: serde_json::to_value(&report).unwrap_or(Value::Null),
        markdown: markdown(&report),
        html: html(&report),
        exit: report.exit_status,
        report,
    }
}

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

/// `host:port` of a cited record (and its SNI).
fn target_of(c: &super::report::CitedRecord) -> String {
    let mut t = format!(
        "{}:{}",
        c.host.as_deref().unwrap_or("-"),
        c.port.map_or_else(|| "-".into(), |p| p.to_string())
    );
    if let Some(sni) = &c.sni {
        let _ = write!(t, " (SNI {sni})");
    }
    t
}

/// A probe's why, with what the sandbox reported that does not fit.
fn why(p: &ProbeResult) -> String {
    if p.mismatches.is_empty() {
        return p.why.clone();
    }
    format!("{}; mismatch: {}", p.why, p.mismatches.join("; "))
}

/// `report.md`.
pub(crate) fn markdown(r: &Report) -> String {
    let fleet = is_fleet(r);
    let mut m = String::new();
    let _ = writeln!(m, "# Palisade containment report\n");
    let _ = writeln!(m, "**Verdict:** {}\n", r.verdict);
    let _ = writeln!(m, "## What this report trusts\n");
    for t in &r.trust {
        let _ = writeln!(m, "- {t}");
    }
    let _ = writeln!(m);
    markdown_verification(&mut m, r, fleet);
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
    markdown_tables(&mut m, r, fleet);
    if r.counts.is_some() {
        let _ = writeln!(m, "## Records no probe accounts for\n");
        if r.unattributed.is_empty() {
            let _ = writeln!(
                m,
                "None: every record of the sandbox during the run belongs to a probe.\n"
            );
        } else {
            let _ = writeln!(m, "The sandbox's records during the run that fit no probe (its other traffic, or what a misreported probe left):\n");
            let _ = writeln!(m, "| record | time | client | target | decision | reason |\n|---|---|---|---|---|---|");
            for c in &r.unattributed {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} | {} | {} |",
                    cell(&c.id),
                    c.ts,
                    c.client.map_or_else(|| "-".into(), |a| a.to_string()),
                    cell(&target_of(c)),
                    c.decision,
                    c.reason
                );
            }
            let _ = writeln!(m);
        }
    }
    if !r.retention_cut.is_empty() {
        let _ = writeln!(m, "## What retention removed\n");
        for line in &r.retention_cut {
            let _ = writeln!(m, "- {line}");
        }
        let _ = writeln!(m);
    }
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

/// The evidence verification section of `report.md`, with the replicas'
/// chains in a fleet's report.
fn markdown_verification(m: &mut String, r: &Report, fleet: bool) {
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
}

/// The findings and probes tables of `report.md`.
fn markdown_tables(m: &mut String, r: &Report, fleet: bool) {
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
                cell(&why(f)),
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
pub(crate) fn html(r: &Report) -> String {
    let fleet = is_fleet(r);
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
                h2 { "What this report trusts" }
                ul #trust {
                    @for t in &r.trust { li { (t) } }
                }
                h2 { "Evidence verification" }
                (verification(r))
                h2 { "Scope" }
                table #scope {
                    @for (k, v) in fields(&r.scope) {
                        tr { th { (k) } td { code { (text(&v)) } } }
                    }
                }
                h2 { "Findings" }
                (findings_table(r, fleet))
                h2 { "Probes" }
                (probes_table(r, fleet))
                @if r.counts.is_some() {
                    h2 { "Records no probe accounts for" }
                    table #unattributed {
                        tr { @for h in ["record", "time", "client", "target", "decision", "reason"] { th { (h) } } }
                        @for c in &r.unattributed {
                            tr {
                                td { (c.id) }
                                td { (c.ts) }
                                td { (c.client.map_or_else(|| "-".into(), |a| a.to_string())) }
                                td { code { (target_of(c)) } }
                                td { (c.decision) }
                                td { (c.reason.as_str()) }
                            }
                        }
                    }
                }
                @if !r.retention_cut.is_empty() {
                    h2 { "What retention removed" }
                    ul #retention {
                        @for line in &r.retention_cut { li { (line) } }
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

/// The table heads of the page: the replica column only where several
/// replicas decided.
fn heads(fleet: bool, all: &[&'static str]) -> Vec<&'static str> {
    all.iter()
        .copied()
        .filter(|h| fleet || *h != "replica")
        .collect()
}

/// The findings table of the page.
fn findings_table(r: &Report, fleet: bool) -> Markup {
    let finding_heads = heads(
        fleet,
        &[
            "probe", "target", "via", "expected", "class", "replica", "why", "records",
        ],
    );
    page! {
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
                    td { (why(f)) }
                    td { (f.record_cite()) }
                }
            }
        }
    }
}

/// The probes table of the page.
fn probes_table(r: &Report, fleet: bool) -> Markup {
    let probe_heads = heads(
        fleet,
        &[
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
        ],
    );
    page! {
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
                    td { (why(p)) }
                    td { (p.record_cite()) }
                }
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};
    use std::time::{Duration, SystemTime};

    use serde_json::json;

    use super::*;
    use crate::evidence::{fleet, Evidence, Kind, Mode, Record};
    use crate::policy::Reason;
    use crate::policy::Verdict;
    use crate::probe::report::{build, classes, BadInput, Options};
    use crate::probe::REPORT_FORMAT;

    /// A sealed chain with an allow for allowed.test (from port 40001) and
    /// a deny for other.test (from 40002); their ids.
    async fn chain(dir: &Path) -> (String, String) {
        let (mut ids, _) = chain_of(
            dir,
            &[
                (40001, "allowed.test", Reason::RuleMatch),
                (40002, "other.test", Reason::NoMatchingRule),
            ],
        )
        .await;
        (ids.remove(0), ids.remove(0))
    }

    /// A sealed chain with a decision per (client port, host, reason),
    /// from 198.18.1.2; the record ids and the public key.
    async fn chain_of(dir: &Path, decisions: &[(u16, &str, Reason)]) -> (Vec<String>, String) {
        chain_from(dir, [198, 18, 1, 2], decisions).await
    }

    /// As [`chain_of`], from client address `ip`.
    async fn chain_from(
        dir: &Path,
        ip: [u8; 4],
        decisions: &[(u16, &str, Reason)],
    ) -> (Vec<String>, String) {
        // Each chain named by its directory, as replicas on one host must be.
        let mut cfg = crate::config::EvidenceConfig::for_dir(dir);
        cfg.replica = dir.file_name().unwrap().to_string_lossy().into_owned();
        // Only the records written here: no checkpoint by time, however
        // slowly a loaded machine writes them (the tests count records).
        cfg.checkpoint_interval = std::time::Duration::from_secs(3600);
        let ev = Evidence::start(&cfg).unwrap();
        let mut ids = Vec::new();
        for &(port, host, reason) in decisions {
            let verdict = Verdict {
                org: None,
                reason,
                rule: reason.is_allow().then(|| "allow-0".into()),
                would_deny: None,
            };
            let client = SocketAddr::from((ip, port));
            let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &"p0".into());
            r.host = Some(host.into());
            r.port = Some(443);
            ev.write(&mut r).await.unwrap();
            ids.push(r.id);
        }
        let key = ev.public_key().to_string();
        assert!(ev.seal().await);
        (ids, key)
    }

    fn ts(t: SystemTime) -> String {
        humantime::format_rfc3339_micros(t).to_string()
    }

    /// An observation from local port `port` around now.
    fn observation(id: &str, port: u16, expect: &str, extra: Value) -> Value {
        let now = SystemTime::now();
        let mut v = json!({
            "id": id, "marker": TEST_MARKERS.iter().find(|(i, _)| *i == id).map_or("pp-?", |m| m.1),
            "target": "https://allowed.test/",
            "kind": "https", "via": "proxy", "expect": expect,
            "started": ts(now - Duration::from_secs(5)), "finished": ts(now + Duration::from_secs(1)),
            "elapsed_ms": 6000,
            "sockets": [{"purpose": "proxy", "proto": "tcp", "local": format!("198.18.1.2:{port}"), "remote": "198.18.1.1:3128"}],
            "resolved": [], "connected": true, "bytes_sent": 0, "bytes_received": 0,
            "dns_answers": [], "stage": "done", "outcome": "failed",
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// The markers of [`plan_file`]'s probes (its run is `0a1b2c3d`).
    const TEST_MARKERS: [(&str, &str); 3] = [
        ("allow-https", "pp-0a1b2c3d-0000"),
        ("deny-name", "pp-0a1b2c3d-0001"),
        ("routed-away", "pp-0a1b2c3d-0002"),
    ];

    /// The agreed plan of [`observations`], written into `dir`, issued a
    /// minute ago; its sha256.
    fn plan_file(dir: &Path, org: Option<&str>) -> String {
        use sha2::Digest;
        let org = org.map_or_else(String::new, |o| format!("org = {o:?}\n"));
        let issued = ts(SystemTime::now() - Duration::from_secs(60));
        let text = format!(
            "{org}policy = \"p0\"\nrun = \"0a1b2c3d\"\nissued = \"{issued}\"\nproxy = \"198.18.1.1:3128\"\n\n\
             [[probe]]\nid = \"allow-https\"\ntarget = \"https://allowed.test/\"\nvia = \"proxy\"\nexpect = \"allow\"\n\n\
             [[probe]]\nid = \"deny-name\"\ntarget = \"https://other.test/\"\nvia = \"proxy\"\nexpect = \"deny\"\n\n\
             [[probe]]\nid = \"routed-away\"\ntarget = \"tcp://198.18.2.20:80\"\nvia = \"direct\"\nexpect = \"deny\"\nlayer = \"any\"\n"
        );
        std::fs::write(dir.join("plan.toml"), &text).unwrap();
        data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(text.as_bytes()))
    }

    /// The agreed plans of observations files written by [`observations`].
    fn plans_of(observations: &[PathBuf]) -> Vec<PathBuf> {
        observations
            .iter()
            .map(|o| o.parent().unwrap().join("plan.toml"))
            .collect()
    }

    fn observations(dir: &Path, deny_id: &str) -> PathBuf {
        let now = ts(SystemTime::now());
        let sha = plan_file(dir, None);
        let obs = json!({
            "format": super::super::OBSERVATIONS_FORMAT, "run": "r1", "palisade_version": "0",
            "plan_sha256": sha, "plan": {"org": "acme", "policy": "p0", "probe": []},
            "started": now, "finished": now,
            "environment": {"hostname": "sandbox", "addresses": ["1: lo <x>", "2: eth0 198.18.1.2/24"]},
            "observations": [
                observation("allow-https", 40001, "allow",
                    json!({"connect_status": 200, "tls": "server_hello", "outcome": "reached"})),
                observation("deny-name", 40002, "deny",
                    json!({"target": "https://other.test/", "connect_status": 403, "connected": false,
                           "outcome": "refused", "palisade_record": deny_id})),
                observation("routed-away", 40003, "deny",
                    json!({"target": "tcp://198.18.2.20:80", "kind": "tcp", "via": "direct", "layer": "any",
                           "error": "timeout", "connected": false})),
            ],
        });
        let path = dir.join("observations.json");
        std::fs::write(&path, obs.to_string()).unwrap();
        path
    }

    fn report(observations: &Path, evidence: &Path) -> Result<Rendered, String> {
        let evidence = [evidence.to_path_buf()];
        let observations = [observations.to_path_buf()];
        let plans = plans_of(&observations);
        let opts = Options {
            plans: &plans,
            observations: &observations,
            evidence: &evidence,
            pins: fleet::Pins::default(),
            allow_unsealed: false,
        };
        build(&opts).map(outputs).map_err(|BadInput(e)| e)
    }

    /// From evidence and observations to the report.json fields, the
    /// markdown and the HTML the netns tests read.
    #[tokio::test]
    async fn verified_evidence_is_classified_and_rendered() {
        let dir = crate::testing::scratch("report-ok");
        let evidence = dir.join("evidence");
        let (allow_id, deny_id) = chain(&evidence).await;
        let obs = observations(&dir, &deny_id);
        let r = report(&obs, &evidence).unwrap();
        let j = &r.json;
        assert_eq!(j["format"], REPORT_FORMAT);
        assert_eq!(j["verification"]["ok"], true, "{j:#}");
        assert_eq!(j["verification"]["sealed"], true);
        let classes = classes(j);
        assert_eq!(classes["allow-https"], "enforced_allow");
        assert_eq!(classes["deny-name"], "enforced_deny");
        assert_eq!(classes["routed-away"], "blocked_elsewhere");
        assert_eq!((r.exit, j["exit_status"].clone()), (0, json!(0)));
        assert_eq!(j["counts"]["probes"], 3);
        assert_eq!(j["counts"]["not_matching_expectation"], 0);
        let deny = &j["probes"][1];
        assert_eq!(deny["records"][0]["id"], deny_id.as_str());
        assert_eq!(deny["records"][0]["reason"], "no_matching_rule");
        assert_eq!(deny["records"][0]["client"], "198.18.1.2:40002");
        assert!(deny["records"][0]["detail"].is_null());
        assert_eq!(deny["observation"]["palisade_record"], deny_id.as_str());
        assert_eq!(
            j["probes"][0]["why"],
            format!("Palisade allowed: {allow_id}")
        );
        assert_eq!(j["scope"]["policy_matches_plan"], true);
        assert_eq!(j["scope"]["evidence_sealed"], true);
        assert_eq!(
            j["scope"]["evidence_span"]["records"], 4,
            "{:#}",
            j["scope"]
        );
        assert!(j["findings"].as_array().unwrap().is_empty());
        assert!(j["verdict"]
            .as_str()
            .unwrap()
            .starts_with("Within the 3 paths tested"));
        assert!(j["untested"][0]
            .as_str()
            .unwrap()
            .starts_with("IPv6: not probed"));

        assert!(
            r.markdown
                .contains("| evidence policy = plan policy | true |"),
            "{}",
            r.markdown
        );
        assert!(r
            .markdown
            .contains("| routed-away | `tcp://198.18.2.20:80` | direct | deny (any layer) |"));
        assert!(r.markdown.contains("None among the probes classified."));
        assert!(r.markdown.contains("  - `2: eth0 198.18.1.2/24`"));
        for needle in [
            "id=\"findings\"",
            "data-probe=\"deny-name\" data-class=\"enforced_deny\"",
            "<pre id=\"verification\">",
            "<td colspan=\"7\">None among the probes classified.</td>",
            "<th>evidence_sealed</th><td><code>true</code></td>",
            "<pre>1: lo &lt;x&gt;\n2: eth0 198.18.1.2/24</pre>",
        ] {
            assert!(r.html.contains(needle), "{needle} not in {}", r.html);
        }
        // Values are escaped wherever they land.
        let mut report = r.report;
        report.verdict = "<script>alert(1)</script>".into();
        report.probes[0].why = "\"><img src=x>".into();
        let html = html(&report);
        assert!(
            !html.contains("<script>") && !html.contains("<img"),
            "{html}"
        );
        assert!(html.contains("&lt;script&gt;"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Retention removed segments inside the run's window: the report says
    /// so, names what went, and cannot show enforcement (exit 1).
    #[tokio::test]
    async fn a_window_cut_by_retention_is_not_demonstrated() {
        let dir = crate::testing::scratch("report-cut");
        let evidence = dir.join("evidence");
        let mut cfg = crate::config::EvidenceConfig::for_dir(&evidence);
        cfg.replica = "evidence".into();
        cfg.rotate_size = 3000;
        cfg.retain_size = Some(9000);
        // No floor, so the filler's segments go at once.
        cfg.retain_min_age = Duration::ZERO;
        let ev = Evidence::start(&cfg).unwrap();
        let decide = |port: u16, host: &str, reason: Reason| {
            let verdict = Verdict {
                org: None,
                reason,
                rule: reason.is_allow().then(|| "allow-0".into()),
                would_deny: None,
            };
            let client = SocketAddr::from(([198, 18, 1, 2], port));
            let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &"p0".into());
            r.host = Some(host.into());
            r.port = Some(443);
            r
        };
        for i in 0..60 {
            ev.write(&mut decide(
                41000 + i,
                "filler.test",
                Reason::NoMatchingRule,
            ))
            .await
            .unwrap();
        }
        ev.write(&mut decide(40001, "allowed.test", Reason::RuleMatch))
            .await
            .unwrap();
        let mut deny = decide(40002, "other.test", Reason::NoMatchingRule);
        ev.write(&mut deny).await.unwrap();
        assert!(ev.seal().await);
        assert!(
            !crate::evidence::verify::removed_segments(&evidence).is_empty(),
            "the filler was not removed"
        );
        let obs = observations(&dir, &deny.id);
        let r = report(&obs, &evidence).unwrap();
        let j = &r.json;
        assert_eq!(j["verification"]["ok"], true, "{j:#}");
        assert_eq!(classes(j)["deny-name"], "enforced_deny");
        let cut = j["retention_cut"].as_array().unwrap();
        assert_eq!(cut.len(), 1, "{j:#}");
        assert!(cut[0].as_str().unwrap().contains("shipped copy"), "{cut:?}");
        assert_eq!((r.exit, j["exit_status"].clone()), (1, json!(1)));
        assert!(j["verdict"]
            .as_str()
            .unwrap()
            .starts_with("NOT DEMONSTRATED: retention removed evidence"));
        assert!(
            r.markdown.contains("## What retention removed"),
            "{}",
            r.markdown
        );
        assert!(r.html.contains("id=\"retention\""));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The plan is the assessor's: a probe with no observation is
    /// missing, observations of another plan are refused.
    #[tokio::test]
    async fn the_plan_decides_what_is_reported() {
        let dir = crate::testing::scratch("report-plan");
        let evidence = dir.join("evidence");
        let (_, deny_id) = chain(&evidence).await;
        let obs = observations(&dir, &deny_id);
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&obs).unwrap()).unwrap();
        v["observations"].as_array_mut().unwrap().remove(1);
        std::fs::write(&obs, v.to_string()).unwrap();
        let r = report(&obs, &evidence).unwrap();
        assert_eq!(classes(&r.json)["deny-name"], "missing");
        assert_eq!(r.exit, 1);
        assert_eq!(r.json["findings"][0]["id"], "deny-name");
        assert!(r.markdown.contains("## What this report trusts"));
        assert!(r.markdown.contains("| missing | 1 |"), "{}", r.markdown);
        v["plan_sha256"] = "ab".repeat(32).into();
        std::fs::write(&obs, v.to_string()).unwrap();
        let e = report(&obs, &evidence).map(|_| ()).unwrap_err();
        assert!(
            e.contains(&"ab".repeat(32)) && e.contains("plan.toml is sha256 "),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A plan is for one run: without its nonce it is refused; issued after
    /// the evidence was written, no record fits it (an earlier run's), and
    /// observations with another marker or an earlier window are findings.
    #[tokio::test]
    async fn an_earlier_run_does_not_pass_for_a_fresh_plan() {
        use sha2::Digest;
        let dir = crate::testing::scratch("report-fresh");
        let evidence = dir.join("evidence");
        let (_, deny_id) = chain(&evidence).await;
        let obs = observations(&dir, &deny_id);
        let plan_path = dir.join("plan.toml");
        let text = std::fs::read_to_string(&plan_path).unwrap();
        let issued_line = text.lines().find(|l| l.starts_with("issued")).unwrap();
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&obs).unwrap()).unwrap();
        let mut with_plan = |text: String| {
            std::fs::write(&plan_path, &text).unwrap();
            v["plan_sha256"] = data_encoding::HEXLOWER
                .encode(&sha2::Sha256::digest(text.as_bytes()))
                .into();
            std::fs::write(&obs, v.to_string()).unwrap();
            v.clone()
        };
        // Issued after the records (and the windows) were: nothing counts.
        let later = ts(SystemTime::now() + Duration::from_secs(60));
        let _ = with_plan(text.replace(issued_line, &format!("issued = \"{later}\"")));
        let r = report(&obs, &evidence).unwrap();
        let deny = &r.json["probes"][1];
        assert_eq!(deny["class"], "inconclusive", "{deny:#}");
        assert_eq!(deny["records"], json!([]), "{deny:#}");
        let mismatches = deny["mismatches"].to_string();
        assert!(
            mismatches.contains("before the plan was issued"),
            "{mismatches}"
        );
        assert_eq!(r.exit, 1);
        // Another marker than the plan's: a mismatch.
        let mut other = with_plan(text.clone());
        other["observations"][1]["marker"] = "pp-99999999-0001".into();
        std::fs::write(&obs, other.to_string()).unwrap();
        let r = report(&obs, &evidence).unwrap();
        let deny = &r.json["probes"][1];
        assert!(
            deny["mismatches"]
                .to_string()
                .contains("marker pp-99999999-0001, the plan's is pp-0a1b2c3d-0001"),
            "{deny:#}"
        );
        assert_eq!((deny["finding"].clone(), r.exit), (json!(true), 1));
        // No run (or no issue time): not a plan a report can rest on.
        for line in ["run = \"0a1b2c3d\"", issued_line] {
            let _ = with_plan(text.replace(line, ""));
            let e = report(&obs, &evidence).map(|_| ()).unwrap_err();
            assert!(e.contains("the plan names no `run`"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Evidence that fails verification: reported, nothing classified.
    #[tokio::test]
    async fn tampered_evidence_classifies_nothing() {
        let dir = crate::testing::scratch("report-tampered");
        let evidence = dir.join("evidence");
        let (_, deny_id) = chain(&evidence).await;
        let segment = &crate::evidence::segment::list(&evidence).unwrap()[0];
        let text = std::fs::read_to_string(segment).unwrap();
        std::fs::write(
            segment,
            text.replace("\"decision\":\"deny\"", "\"decision\":\"allow\""),
        )
        .unwrap();
        let obs = observations(&dir, &deny_id);
        let r = report(&obs, &evidence).unwrap();
        let j = &r.json;
        assert_eq!(j["verification"]["ok"], false);
        assert!(
            j["verification"]["error"]
                .as_str()
                .unwrap()
                .contains("hash does not match"),
            "{j:#}"
        );
        assert!(j["verification"]["line"].as_u64().is_some());
        assert!(j.get("counts").is_none());
        assert!(j["scope"].get("evidence_sealed").is_none());
        assert_eq!(j["probes"].as_array().unwrap().len(), 0);
        assert_eq!(r.exit, 1);
        assert!(j["verdict"].as_str().unwrap().starts_with("Not assessed"));
        assert!(r.markdown.contains("**FAILED:**") && !r.markdown.contains("## Counts"));
        assert!(r.markdown.contains("| evidence sealed | - |"));
        assert!(r.html.contains("id=\"verification-failed\""));
        // Bad input is not a report.
        std::fs::write(&obs, "{").unwrap();
        assert!(report(&obs, &evidence).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn fleet_report(observations: &[PathBuf], evidence: &[PathBuf], pins: fleet::Pins) -> Rendered {
        let plans = plans_of(observations);
        let opts = Options {
            plans: &plans,
            observations,
            evidence,
            pins,
            allow_unsealed: false,
        };
        build(&opts).map(outputs).map_err(|BadInput(e)| e).unwrap()
    }

    /// Two replicas: the allow in one chain, the denial in the other. Each
    /// probe names the replica that decided it; a tampered replica stops
    /// the report, named, with the other named intact.
    #[tokio::test]
    async fn fleet_probes_name_their_replica() {
        let dir = crate::testing::scratch("report-fleet");
        let tree = dir.join("tree");
        let (_, ka) = chain_of(
            &tree.join("gw-a"),
            &[(40001, "allowed.test", Reason::RuleMatch)],
        )
        .await;
        let (ids, kb) = chain_of(
            &tree.join("gw-b"),
            &[
                (40009, "unrelated.test", Reason::NoMatchingRule),
                (40002, "other.test", Reason::NoMatchingRule),
            ],
        )
        .await;
        let obs = observations(&dir, &ids[1]);
        let pins = fleet::Pins {
            by_replica: [("gw-a", &ka), ("gw-b", &kb)]
                .into_iter()
                .map(|(n, k)| {
                    (
                        n.to_string(),
                        crate::evidence::chain::parse_pubkey(k).unwrap(),
                    )
                })
                .collect(),
            ..fleet::Pins::default()
        };
        let r = fleet_report(
            std::slice::from_ref(&obs),
            std::slice::from_ref(&tree),
            pins.clone(),
        );
        let j = &r.json;
        assert_eq!(j["verification"]["ok"], true, "{j:#}");
        assert_eq!(j["verification"]["key_pinned"], true);
        let replicas = j["verification"]["replicas"].as_array().unwrap();
        assert_eq!(replicas.len(), 2);
        assert_eq!(replicas[0]["replica"], "gw-a");
        assert_eq!(replicas[1]["status"], "intact");
        assert_eq!(classes(j)["allow-https"], "enforced_allow");
        assert_eq!(classes(j)["deny-name"], "enforced_deny");
        assert_eq!(j["probes"][0]["replica"], "gw-a");
        assert_eq!(j["probes"][0]["records"][0]["replica"], "gw-a");
        assert_eq!(j["probes"][1]["replica"], "gw-b");
        assert_eq!(j["probes"][1]["records"][0]["id"], ids[1].as_str());
        assert!(j["probes"][2]["replica"].is_null(), "no record, no replica");
        assert_eq!(j["scope"]["replicas"], json!(["gw-a", "gw-b"]));
        assert_eq!(j["scope"]["evidence_span"]["records"], 3 + 4);
        assert!(
            r.markdown
                .contains("| gw-a | intact | 3 | gw-a: intact: 3 records"),
            "{}",
            r.markdown
        );
        assert!(
            r.markdown
                .contains("| matches plan | replica | Palisade records |"),
            "{}",
            r.markdown
        );
        assert!(
            r.markdown.contains("| enforced_deny | yes | gw-b |"),
            "{}",
            r.markdown
        );
        assert!(
            r.markdown.contains("| replicas | gw-a, gw-b |"),
            "{}",
            r.markdown
        );
        assert!(
            r.html.contains(
                "data-probe=\"deny-name\" data-class=\"enforced_deny\" data-replica=\"gw-b\""
            ),
            "{}",
            r.html
        );
        assert!(
            r.html
                .contains("<tr data-replica=\"gw-a\" data-status=\"intact\">"),
            "{}",
            r.html
        );
        // One chain's report keeps its layout: no replica column.
        let single = report(&obs, &tree.join("gw-b")).unwrap();
        assert!(!single.markdown.contains("replica"), "{}", single.markdown);
        assert!(single.json["probes"][1]["replica"].is_null());

        // Tamper with gw-b's denial.
        let seg = &crate::evidence::segment::list(&tree.join("gw-b")).unwrap()[0];
        let text = std::fs::read_to_string(seg).unwrap();
        std::fs::write(
            seg,
            text.replacen("\"host\":\"other.test\"", "\"host\":\"fine.test\"", 1),
        )
        .unwrap();
        let t = fleet_report(
            std::slice::from_ref(&obs),
            std::slice::from_ref(&tree),
            pins,
        );
        let j = &t.json;
        assert_eq!(t.exit, 1);
        assert_eq!(j["verification"]["ok"], false);
        assert!(j.get("counts").is_none());
        assert_eq!(j["probes"].as_array().unwrap().len(), 0);
        let error = j["verification"]["error"].as_str().unwrap();
        assert!(error.starts_with("replica gw-b: BROKEN at "), "{error}");
        assert!(error.contains("hash does not match"), "{error}");
        assert!(error.ends_with("intact: gw-a"), "{error}");
        assert_eq!(j["verification"]["replicas"][0]["status"], "intact");
        assert_eq!(j["verification"]["replicas"][1]["status"], "broken");
        assert_eq!(j["verification"]["replicas"][1]["line"], 3);
        let verdict = j["verdict"].as_str().unwrap();
        assert!(
            verdict.starts_with("Not assessed") && verdict.contains("replica gw-b"),
            "{verdict}"
        );
        assert!(
            t.markdown.contains("| gw-b | **BROKEN** |"),
            "{}",
            t.markdown
        );
        assert!(t.markdown.contains("| gw-a | intact |"), "{}", t.markdown);
        assert!(t
            .html
            .contains("data-replica=\"gw-b\" data-status=\"broken\""));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two sandboxes' runs of one plan make one report: probe ids carry
    /// their run, the window spans both, each attributed to its replica.
    #[tokio::test]
    async fn runs_from_two_sandboxes_make_one_report() {
        let dir = crate::testing::scratch("report-runs");
        let tree = dir.join("tree");
        let (a_ids, _) = chain_of(
            &tree.join("gw-a"),
            &[
                (40001, "allowed.test", Reason::RuleMatch),
                (40002, "other.test", Reason::NoMatchingRule),
            ],
        )
        .await;
        let (b_ids, _) = chain_from(
            &tree.join("gw-b"),
            [198, 18, 4, 2],
            &[
                (40001, "allowed.test", Reason::RuleMatch),
                (40002, "other.test", Reason::NoMatchingRule),
            ],
        )
        .await;
        let a = dir.join("a");
        let b = dir.join("b");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let obs_a = observations(&a, &a_ids[1]);
        let obs_b = observations(&b, &b_ids[1]);
        // The two sandboxes: one run id each, sandbox b from another address.
        let mut vb: Value =
            serde_json::from_str(&std::fs::read_to_string(&obs_b).unwrap()).unwrap();
        vb["run"] = "r2".into();
        for o in vb["observations"].as_array_mut().unwrap() {
            let local = o["sockets"][0]["local"]
                .as_str()
                .unwrap()
                .replace("198.18.1.2", "198.18.4.2");
            o["sockets"][0]["local"] = local.into();
        }
        std::fs::write(&obs_b, vb.to_string()).unwrap();
        let both = [obs_a.clone(), obs_b.clone()];
        let r = fleet_report(&both, std::slice::from_ref(&tree), fleet::Pins::default());
        let j = &r.json;
        assert_eq!(j["scope"]["probe_run"], "r1, r2");
        let classes = classes(j);
        assert_eq!(classes["deny-name@r1"], "enforced_deny", "{j:#}");
        assert_eq!(classes["deny-name@r2"], "enforced_deny");
        let probe = |id: &str| {
            j["probes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["id"] == id)
                .cloned()
                .unwrap()
        };
        assert_eq!(probe("deny-name@r1")["replica"], "gw-a");
        assert_eq!(probe("deny-name@r2")["replica"], "gw-b");
        assert_eq!(probe("allow-https@r1")["replica"], "gw-a");
        assert_eq!(probe("allow-https@r2")["replica"], "gw-b");
        let sources = j["verdict"].as_str().unwrap();
        assert!(
            sources.contains("from 198.18.1.2, 198.18.4.2 during"),
            "{sources}"
        );
        assert_eq!(j["environment"]["r2"]["hostname"], "sandbox");
        assert!(
            r.markdown
                .contains("### Run r2\n\n- addresses:\n  - `1: lo <x>`"),
            "{}",
            r.markdown
        );
        // One run given twice, or runs of different plans: bad input.
        let twice = [obs_a.clone(), obs_a.clone()];
        let plans = plans_of(&both);
        let opts = Options {
            plans: &plans,
            observations: &twice,
            evidence: std::slice::from_ref(&tree),
            pins: fleet::Pins::default(),
            allow_unsealed: false,
        };
        assert!(build(&opts).is_err());
        // The sandbox's copy of the plan is not read; the agreed plans are.
        vb["plan"]["org"] = "other".into();
        std::fs::write(&obs_b, vb.to_string()).unwrap();
        assert!(build(&Options {
            observations: &both,
            pins: fleet::Pins::default(),
            ..opts
        })
        .is_ok());
        vb["plan_sha256"] = plan_file(&b, Some("other")).into();
        std::fs::write(&obs_b, vb.to_string()).unwrap();
        let opts = Options {
            observations: &both,
            ..opts
        };
        let e = build(&opts).map(|_| ()).unwrap_err();
        assert!(e.0.contains("different plans"), "{}", e.0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
