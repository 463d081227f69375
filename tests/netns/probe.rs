//! `palisade probe`: plans run with `palisade probe run` inside the sandbox
//! namespace (explicit-proxy and transparent setups), reports built from the
//! evidence Palisade wrote, every classification asserted, a planted hole,
//! tampered evidence, and the HTML rendered in headless Chromium.
//!
//! The in-tunnel probes (`silence-then-sni`, `second-request-other-host`,
//! `ech-client-hello`, `encoded-path`) are expected `enforced_deny`: that
//! needs the proxy's tunnel verification (src/proxy, src/proto/guard.rs
//! and its verifiers). Against a proxy that only checks a tunnel's first
//! bytes they come out `unexpected_allow` (or `inconclusive` for the
//! second request: the lab upstream closes after each response).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, ca_pem, palisade_bin, scratch_dir, Lab, DEFAULT_POLICY};
use crate::transparent::{load_gateway, TRANSPARENT};

const RUN_TIMEOUT: Duration = Duration::from_secs(150);

/// `plan` made fresh, as an assessor writes one by hand: its own `run`
/// nonce and the time it is `issued` (now) first, unless it has them.
fn fresh(plan: &str) -> String {
    if plan.lines().any(|l| l.starts_with("run = ")) {
        return plan.to_string();
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let nonce =
        (nanos.subsec_nanos() ^ std::process::id().rotate_left(16)) as u64 ^ nanos.as_secs();
    let issued = humantime::format_rfc3339_micros(std::time::SystemTime::now());
    format!(
        "run = \"{:08x}\"\nissued = \"{issued}\"\n{plan}",
        nonce & 0xffff_ffff
    )
}

/// Write `plan` (made [`fresh`]) into the lab dir and run it in namespace
/// `ns`; returns the observations file.
pub(crate) fn probe_run(lab: &Lab, ns: &str, name: &str, plan: &str) -> PathBuf {
    let plan_path = lab.dir.join(format!("{name}.plan.toml"));
    std::fs::write(&plan_path, fresh(plan)).unwrap();
    let out_dir = lab.dir.join(format!("{name}.obs"));
    let out = lab::run_with_timeout(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                palisade_bin(),
                "probe",
                "run",
                "--plan",
            ])
            .arg(&plan_path)
            .arg("--out")
            .arg(&out_dir),
        None,
        RUN_TIMEOUT,
    );
    assert!(out.success(), "probe run: {}", out.describe());
    let file = out_dir.join("observations.json");
    assert!(file.is_file(), "no observations: {}", out.describe());
    file
}

pub(crate) struct Reported {
    pub(crate) code: Option<i32>,
    json: Value,
    dir: PathBuf,
    output: String,
}

impl Reported {
    fn classes(&self) -> BTreeMap<String, String> {
        palisade::probe::report::classes(&self.json)
    }
    pub(crate) fn probe(&self, id: &str) -> &Value {
        self.json["probes"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["id"] == id))
            .unwrap_or_else(|| panic!("no probe {id} in report"))
    }
    fn md(&self) -> String {
        std::fs::read_to_string(self.dir.join("report.md")).unwrap()
    }
}

/// The agreed plan [`probe_run`] ran for the observations file `obs`
/// (`DIR/NAME.obs/observations.json` → `DIR/NAME.plan.toml`): the
/// assessor's copy, never read back from the sandbox.
fn plan_of(obs: &Path) -> PathBuf {
    let run_dir = obs.parent().unwrap();
    let name = run_dir.file_name().unwrap().to_str().unwrap();
    let name = name.strip_suffix(".obs").unwrap_or(name);
    run_dir.parent().unwrap().join(format!("{name}.plan.toml"))
}

/// `palisade probe report` (run on the Palisade side: no namespace
/// needed) with the agreed plan of `obs`.
pub(crate) fn probe_report(
    lab: &Lab,
    name: &str,
    obs: &Path,
    evidence: &Path,
    extra: &[&str],
) -> Reported {
    probe_report_with(lab, name, &plan_of(obs), obs, evidence, extra)
}

/// `palisade probe report --plan PLAN` over observations `obs`.
fn probe_report_with(
    lab: &Lab,
    name: &str,
    plan: &Path,
    obs: &Path,
    evidence: &Path,
    extra: &[&str],
) -> Reported {
    let dir = lab.dir.join(format!("{name}.report"));
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "report", "--plan"])
            .arg(plan)
            .arg("--observations")
            .arg(obs)
            .arg("--evidence")
            .arg(evidence)
            .arg("--out")
            .arg(&dir)
            .args(extra),
        None,
        Duration::from_secs(30),
    );
    let text = std::fs::read_to_string(dir.join("report.json"))
        .unwrap_or_else(|e| panic!("report.json: {e}\n{}", out.describe()));
    let json: Value = serde_json::from_str(&text).unwrap();
    for f in ["report.md", "report.html"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    // Keep the markdown where the closing note can quote it.
    let _ = std::fs::copy(
        dir.join("report.md"),
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("probe-report-{name}.md")),
    );
    Reported {
        code: out.code(),
        json,
        dir,
        output: out.describe(),
    }
}

pub(crate) fn assert_classes(r: &Reported, want: &[(&str, &str)]) {
    let got = r.classes();
    for (id, class) in want {
        assert_eq!(
            got.get(*id).map(String::as_str),
            Some(*class),
            "probe {id}: {:#}\n{}",
            r.probe(id),
            r.md()
        );
    }
}

/// Render report.html in headless Chromium, inside the (isolated) client
/// namespace, and return the DOM it built.
fn chromium_dom(lab: &Lab, html: &Path) -> String {
    let profile = lab.dir.join("chromium-profile");
    std::fs::create_dir_all(&profile).unwrap();
    let url = format!("file://{}", html.display());
    let out = lab::run_with_timeout(
        Command::new("ip")
            .args(["netns", "exec", &lab.ns_client, "chromium"])
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("--dump-dom")
            .arg(&url)
            .env("HOME", &profile),
        None,
        Duration::from_secs(90),
    );
    assert!(out.success(), "chromium: {}", out.describe());
    out.stdout
}

/// The lab's default policy with `a.wild.test` intercepted (first, so it
/// wins over `*.wild.test`) and a path it must not reach.
fn intercepting_policy() -> String {
    let clients = "clients = [\"198.18.1.0/24\"]\n";
    assert!(DEFAULT_POLICY.contains(clients));
    DEFAULT_POLICY.replacen(
        clients,
        &format!(
            "{clients}\n[[org.allow]]\nid = \"registry\"\nhost = \"a.wild.test\"\nports = [443]\n\
             intercept = true\ndeny_paths = [\"/api/internal*\"]\n"
        ),
        1,
    )
}

/// `[intercept]` lines: a fresh CA directory, upstreams checked against the lab CA.
fn intercept_config() -> String {
    format!(
        "ca_dir = {:?}\nupstream_ca = {:?}",
        scratch_dir("probe-ca").display().to_string(),
        ca_pem().display().to_string()
    )
}

fn explicit_plan() -> String {
    r#"
org = "acme"
proxy = "198.18.1.1:3128"
resolver = "198.18.1.1:53"
timeout = "3s"
deadline = "120s"

[[probe]]
id = "allow-http"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "allow"

[[probe]]
id = "allow-https"
target = "https://allowed.test/"
via = "proxy"
expect = "allow"

[[probe]]
id = "allow-cidr-tcp"
target = "tcp://198.18.2.30:80"
via = "proxy"
expect = "allow"

[[probe]]
id = "allow-dns"
target = "dns:allowed.test/A"
via = "direct"
expect = "allow"

[[probe]]
id = "deny-name"
target = "https://other.test/"
via = "proxy"
expect = "deny"

[[probe]]
id = "deny-explicit"
target = "http://blocked.wild.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"

[[probe]]
id = "deny-metadata"
target = "http://2852039166/latest/meta-data/"
via = "proxy"
expect = "deny"

[[probe]]
id = "deny-sni"
target = "tls://allowed.test:443?sni=other.test"
via = "proxy"
expect = "deny"

[[probe]]
id = "deny-host-header"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"
host_header = "other.test"

[[probe]]
id = "deny-dns-exfil"
target = "dns:{marker}.6a6f686e.other.test/TXT"
via = "direct"
expect = "deny"

[[probe]]
id = "routed-away"
target = "tcp://198.18.2.20:80"
via = "direct"
expect = "deny"
layer = "any"
note = "the sandbox has no route but the proxy"

[[probe]]
id = "routed-away-strict"
target = "tcp://198.18.2.20:80"
via = "direct"
expect = "deny"
note = "same path, but the plan wants Palisade to be the one denying it"

[[probe]]
id = "broken-upstream"
target = "https://nx.test/"
via = "proxy"
expect = "allow"
note = "allowed name the upstream DNS does not know"

[[probe]]
id = "silence-then-sni"
target = "tls://allowed.test:443?sni=other.test"
via = "proxy"
expect = "deny"
silence = "1500ms"
note = "detect_timeout (1s) + 500 ms"

[[probe]]
id = "second-request-other-host"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"
second_host = "other.test"

[[probe]]
id = "ech-client-hello"
target = "tls://allowed.test:443"
via = "proxy"
expect = "deny"
ech = true

[[probe]]
id = "allow-intercepted"
target = "https://a.wild.test/api/public/palisade-probe/{marker}"
via = "proxy"
expect = "allow"
request = true
note = "control: request probes reach an intercepted host"

[[probe]]
id = "encoded-path"
target = "https://a.wild.test/api/%69nternal"
via = "proxy"
expect = "deny"
request = true
"#
    .to_string()
}

#[test]
fn explicit_proxy_plan_is_classified_and_rendered() {
    let lab = Lab::builder()
        .policy(&intercepting_policy())
        .intercept_config(&intercept_config())
        .dns_listen(&["198.18.1.1:53"])
        .start();
    let obs = probe_run(&lab, &lab.ns_client, "explicit", &explicit_plan());
    let r = probe_report(
        &lab,
        "explicit",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_eq!(r.json["verification"]["ok"], true, "{}", r.output);
    assert_classes(
        &r,
        &[
            ("allow-http", "enforced_allow"),
            ("allow-https", "enforced_allow"),
            ("allow-cidr-tcp", "enforced_allow"),
            ("allow-dns", "enforced_allow"),
            ("deny-name", "enforced_deny"),
            ("deny-explicit", "enforced_deny"),
            ("deny-metadata", "enforced_deny"),
            ("deny-sni", "enforced_deny"),
            ("deny-host-header", "enforced_deny"),
            ("deny-dns-exfil", "enforced_deny"),
            ("routed-away", "blocked_elsewhere"),
            ("routed-away-strict", "blocked_elsewhere"),
            ("broken-upstream", "inconclusive"),
            ("allow-intercepted", "enforced_allow"),
        ],
    );
    // Needs the proxy's tunnel verification (see the module doc).
    assert_classes(
        &r,
        &[
            ("silence-then-sni", "enforced_deny"),
            ("second-request-other-host", "enforced_deny"),
            ("ech-client-hello", "enforced_deny"),
            ("encoded-path", "enforced_deny"),
        ],
    );
    let cited = |id: &str, reason: &str| -> Value {
        r.probe(id)["records"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["decision"] == "deny" && x["reason"] == reason)
            .cloned()
            .unwrap_or_else(|| panic!("{id}: no {reason} record: {:#}", r.probe(id)))
    };
    // In-tunnel denials: no 403 to quote, joined by socket, name and reason.
    let silent = cited("silence-then-sni", "protocol_mismatch");
    assert_eq!(silent["host"], "allowed.test");
    assert_eq!(
        cited("ech-client-hello", "ech_not_allowed")["sni"],
        "allowed.test"
    );
    let second = cited("second-request-other-host", "host_mismatch");
    assert_eq!(second["host"], "other.test");
    let tunnel = r.probe("second-request-other-host")["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["decision"] == "allow")
        .cloned()
        .expect("the tunnel's allow record");
    assert_eq!(second["conn"], tunnel["id"], "the denial names its tunnel");
    for id in [
        "silence-then-sni",
        "second-request-other-host",
        "ech-client-hello",
    ] {
        let why = r.probe(id)["why"].as_str().unwrap();
        assert!(why.contains("closed the tunnel"), "{id}: {why}");
    }
    let silence = &r.probe("silence-then-sni")["observation"];
    assert!(
        silence["closed_in_silence_ms"].as_u64().is_some(),
        "{silence:#}"
    );
    assert_eq!(
        r.probe("second-request-other-host")["observation"]["http_status"],
        200
    );
    // The encoded path: a 403 quoting the record.
    let path = cited("encoded-path", "path_not_allowed");
    assert_eq!(
        r.probe("encoded-path")["observation"]["palisade_record"],
        path["ref"]
    );
    assert_eq!(r.probe("encoded-path")["observation"]["http_status"], 403);
    // The cited records carry the reason Palisade gave.
    let reason = |id: &str| r.probe(id)["records"][0]["reason"].clone();
    assert_eq!(reason("deny-name"), "no_matching_rule");
    assert_eq!(reason("deny-explicit"), "explicit_deny");
    assert_eq!(reason("deny-metadata"), "denied_address");
    assert_eq!(reason("deny-host-header"), "host_mismatch");
    assert_eq!(reason("broken-upstream"), "resolution_failed");
    let sni = r.probe("deny-sni")["records"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["reason"] == "sni_mismatch");
    assert!(sni, "{:#}", r.probe("deny-sni"));
    // routed-away is accepted (layer any), the strict copy is not.
    assert_eq!(r.probe("routed-away")["matched"], true);
    assert_eq!(r.probe("routed-away-strict")["matched"], false);
    assert_eq!(r.json["findings"].as_array().unwrap().len(), 0);
    // Inconclusive and not-demonstrated cases make the exit status 1.
    assert_eq!(r.code, Some(1), "{}", r.output);
    let verdict = r.json["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("NOT DEMONSTRATED"), "{verdict}");
    assert!(!verdict.to_lowercase().contains("impossible"), "{verdict}");
    let untested: Vec<&str> = r.json["untested"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        untested.iter().any(|u| u.starts_with("IPv6: not probed")),
        "{untested:?}"
    );
    assert!(
        untested.iter().any(|u| u.starts_with("UDP other than DNS")),
        "{untested:?}"
    );
    assert_eq!(r.json["scope"]["evidence_sealed"], false);
    assert!(r.json["environment"]["addresses"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a.as_str().unwrap_or("").contains("198.18.1.2")));

    let dom = chromium_dom(&lab, &r.dir.join("report.html"));
    assert!(
        dom.contains("id=\"findings\""),
        "findings table not in the DOM"
    );
    assert!(
        dom.contains("data-probe=\"broken-upstream\""),
        "probe rows not in the DOM"
    );
}

/// The hole's plan: other.test denied (the policy may say otherwise).
const HOLE_PLAN: &str = r#"
proxy = "198.18.1.1:3128"
timeout = "3s"

[[probe]]
id = "allow-http"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "allow"

[[probe]]
id = "canary"
target = "http://other.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"

[[probe]]
id = "canary-tls"
target = "https://other.test/"
via = "proxy"
expect = "deny"
"#;

#[test]
fn planted_hole_is_an_unexpected_allow_however_the_sandbox_edits_its_report() {
    // The agreed plan denies other.test; this policy lets it through.
    let policy = format!("{DEFAULT_POLICY}\n[[org.allow]]\nhost = \"other.test\"\n");
    let lab = Lab::start(&policy);
    let plan = format!(
        "{HOLE_PLAN}\n[[probe]]\nid = \"blocked\"\ntarget = \"https://blocked.wild.test/\"\nvia = \"proxy\"\nexpect = \"deny\"\n"
    );
    let obs = probe_run(&lab, &lab.ns_client, "hole", &plan);
    let r = probe_report(&lab, "hole", &obs, &lab.evidence_dir, &["--allow-unsealed"]);
    assert_classes(
        &r,
        &[
            ("allow-http", "enforced_allow"),
            ("canary", "unexpected_allow"),
            ("canary-tls", "unexpected_allow"),
            ("blocked", "enforced_deny"),
        ],
    );
    assert_eq!(r.code, Some(1), "{}", r.output);
    let findings: Vec<&str> = r.json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["id"].as_str())
        .collect();
    assert_eq!(findings, ["canary", "canary-tls"]);
    assert!(r.json["verdict"].as_str().unwrap().starts_with("FINDINGS"));
    // Findings come before the probe table in both renderings.
    let md = r.md();
    let (f, p) = (
        md.find("## Findings").unwrap(),
        md.find("## Probes").unwrap(),
    );
    assert!(f < p && md[f..p].contains("unexpected_allow"), "{md}");
    let dom = chromium_dom(&lab, &r.dir.join("report.html"));
    let table = dom
        .find("id=\"findings\"")
        .map(|i| &dom[i..])
        .expect("findings table in the DOM");
    let table = &table[..table.find("</table>").unwrap_or(table.len())];
    assert!(
        table.contains("data-probe=\"canary\"") && table.contains("unexpected_allow"),
        "{table}"
    );
    assert_eq!(r.json["unattributed"], serde_json::json!([]), "{}", r.md());
    forged_observations_do_not_hide_the_hole(&lab, &obs, &r);
}

/// An observations file as JSON, edited by `edit`, written as `NAME.json`
/// beside the lab's files.
fn forge(lab: &Lab, obs: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(obs).unwrap()).unwrap();
    edit(&mut v);
    let path = lab.dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    path
}

/// The observation of probe `id` in an observations file.
fn observation_mut<'a>(v: &'a mut Value, id: &str) -> &'a mut Value {
    v["observations"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|o| o["id"] == id)
        .unwrap_or_else(|| panic!("no observation {id}"))
}

/// `sha256sum` of a file, as `probe run` writes it into observations.
fn sha256_of(path: &Path) -> String {
    let out = lab::run_with_timeout(
        Command::new("sha256sum").arg(path),
        None,
        Duration::from_secs(10),
    );
    assert!(out.success(), "{}", out.describe());
    out.stdout.split_whitespace().next().unwrap().to_string()
}

/// `probe report` that must refuse its input: exit 2, one line, nothing written.
fn refused_report(lab: &Lab, name: &str, plan: &Path, obs: &Path) -> String {
    let dir = lab.dir.join(format!("{name}.report"));
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "report", "--plan"])
            .arg(plan)
            .arg("--observations")
            .arg(obs)
            .arg("--evidence")
            .arg(&lab.evidence_dir)
            .args(["--allow-unsealed", "--out"])
            .arg(&dir),
        None,
        Duration::from_secs(30),
    );
    assert_eq!(out.code(), Some(2), "{name}: {}", out.describe());
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.describe());
    assert!(!dir.exists(), "{name}: a report was written");
    out.stderr
}

/// The sandbox edits what it reported about the hole (`canary`, allowed
/// by the policy, denied by the plan): it never becomes `enforced_deny`.
fn forged_observations_do_not_hide_the_hole(lab: &Lab, obs: &Path, honest: &Reported) {
    let plan = plan_of(obs);
    // An unrelated denial's reference (what Palisade showed the client), or id.
    let blocked = &honest.probe("blocked")["records"][0];
    assert_eq!(blocked["decision"], "deny", "{blocked:#}");
    let quoted = blocked["ref"]
        .as_str()
        .or(blocked["id"].as_str())
        .unwrap()
        .to_string();
    let refused = |o: &mut Value| {
        o["outcome"] = "refused".into();
        o["http_status"] = 403.into();
        o["bytes_received"] = 0.into();
        o["palisade_record"] = quoted.as_str().into();
        o["proxy_status"] =
            format!("palisade; error=destination_ip_prohibited; details=\"record={quoted}\"")
                .into();
        o["error"] = Value::Null;
    };
    // 1. "refused", quoting the unrelated denial: the allow record fits.
    let forged = forge(lab, obs, "forged-refused", |v| {
        refused(observation_mut(v, "canary"))
    });
    let r = probe_report_with(
        lab,
        "forged",
        &plan,
        &forged,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[("canary", "unexpected_allow"), ("blocked", "enforced_deny")],
    );
    assert_eq!(r.code, Some(1), "{}", r.output);
    let canary = r.probe("canary");
    assert_eq!(canary["finding"], true);
    let mismatch = canary["mismatches"][0].as_str().unwrap_or_default();
    assert!(mismatch.contains("belongs to probe blocked"), "{canary:#}");
    assert!(
        canary["records"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["decision"] == "allow" && x["host"] == "other.test"),
        "{canary:#}"
    );
    assert!(r.md().contains("## What this report trusts"), "{}", r.md());
    let _ = std::fs::copy(
        r.dir.join("report.md"),
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("probe-report-forged-refused.md"),
    );
    // 2. The same, with the sockets it claims moved to other ports: the
    // record still fits by address, target and time.
    let moved = forge(lab, obs, "forged-sockets", |v| {
        let o = observation_mut(v, "canary");
        refused(o);
        for s in o["sockets"].as_array_mut().unwrap() {
            s["local"] = "198.18.1.2:9".into();
        }
    });
    let r = probe_report_with(
        lab,
        "forged-sockets",
        &plan,
        &moved,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(&r, &[("canary", "unexpected_allow")]);
    assert_eq!(r.code, Some(1), "{}", r.output);
    // 3. And with the time windows moved away from the allow records. The
    // canary's request carried its marker, which its allow record names:
    // it is the probe's, wherever the window is (unexpected_allow). The
    // TLS canary's CONNECT record names no marker: nothing fits, so the
    // quote is all there is: inconclusive, the mismatches named, and its
    // allow listed with the records no probe accounts for.
    let shifted = forge(lab, obs, "forged-window", |v| {
        for id in ["canary", "canary-tls"] {
            let o = observation_mut(v, id);
            refused(o);
            o["started"] = "2001-01-01T00:00:00.000000Z".into();
            o["finished"] = "2001-01-01T00:00:01.000000Z".into();
        }
    });
    let r = probe_report_with(
        lab,
        "forged-window",
        &plan,
        &shifted,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[
            ("canary", "unexpected_allow"),
            ("canary-tls", "inconclusive"),
        ],
    );
    assert_eq!(r.code, Some(1), "{}", r.output);
    let canary = r.probe("canary");
    assert!(
        canary["records"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| { x["decision"] == "allow" && x["host"] == "other.test" && x["port"] == 80 }),
        "{canary:#}"
    );
    for id in ["canary", "canary-tls"] {
        let p = r.probe(id);
        assert_eq!(p["finding"], true, "{p:#}");
        let said = |what: &str| {
            p["mismatches"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m.as_str().unwrap_or_default().contains(what))
        };
        assert!(said("quotes record"), "{p:#}");
        assert!(said("before the plan was issued"), "{p:#}");
    }
    assert!(
        r.json["unattributed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["decision"] == "allow" && x["host"] == "other.test" && x["port"] == 443),
        "{:#}",
        r.json["unattributed"]
    );
    assert!(
        r.md().contains("## Records no probe accounts for"),
        "{}",
        r.md()
    );
    // 4. The observation deleted: the plan still has the probe.
    let dropped = forge(lab, obs, "forged-dropped", |v| {
        v["observations"]
            .as_array_mut()
            .unwrap()
            .retain(|o| o["id"] != "canary");
    });
    let r = probe_report_with(
        lab,
        "forged-dropped",
        &plan,
        &dropped,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[("canary", "missing"), ("canary-tls", "unexpected_allow")],
    );
    assert_eq!(r.code, Some(1), "{}", r.output);
    assert_eq!(r.json["counts"]["missing"], 1);
    assert!(
        r.json["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["id"] == "canary"),
        "{:#}",
        r.json["findings"]
    );
    // 5. The embedded plan and its hash rewritten to expect the hole: the
    // agreed plan catches it, naming both hashes.
    let rewritten_plan = lab.dir.join("rewritten.plan.toml");
    let text = std::fs::read_to_string(&plan).unwrap().replace(
        "id = \"canary\"\ntarget = \"http://other.test/palisade-probe/{marker}\"\nvia = \"proxy\"\nexpect = \"deny\"",
        "id = \"canary\"\ntarget = \"http://other.test/palisade-probe/{marker}\"\nvia = \"proxy\"\nexpect = \"allow\"",
    );
    std::fs::write(&rewritten_plan, &text).unwrap();
    let fake_sha = sha256_of(&rewritten_plan);
    let rewritten = forge(lab, obs, "forged-plan", |v| {
        v["plan_sha256"] = fake_sha.as_str().into();
        for p in v["plan"]["probe"].as_array_mut().unwrap() {
            if p["id"] == "canary" {
                p["expect"] = "allow".into();
            }
        }
        observation_mut(v, "canary")["expect"] = "allow".into();
    });
    let e = refused_report(lab, "forged-plan", &plan, &rewritten);
    assert!(
        e.contains(&fake_sha) && e.contains(&sha256_of(&plan)),
        "{e}"
    );
    // A plan for an org the evidence does not know: refused too.
    let ghost_plan = lab.dir.join("ghost.plan.toml");
    std::fs::write(
        &ghost_plan,
        format!(
            "org = \"ghost\"\n{}",
            std::fs::read_to_string(&plan).unwrap()
        ),
    )
    .unwrap();
    let ghost_sha = sha256_of(&ghost_plan);
    let ghost = forge(lab, obs, "forged-ghost", |v| {
        v["plan_sha256"] = ghost_sha.as_str().into();
    });
    let e = refused_report(lab, "ghost", &ghost_plan, &ghost);
    assert!(e.contains("org \"ghost\""), "{e}");
}

/// A record's `ts` moved by `ms` milliseconds, as an observation's time.
fn ts_plus(ts: &str, ms: i64) -> String {
    let t = humantime::parse_rfc3339_weak(ts).unwrap();
    let d = Duration::from_millis(ms.unsigned_abs());
    let t = if ms < 0 { t - d } else { t + d };
    humantime::format_rfc3339_micros(t).to_string()
}

/// The sandbox hides a hole (the policy came to allow other.test, the
/// plan denies it) behind denials it provoked itself for the same
/// host:port, moving the observations' windows onto them, or behind an
/// earlier run's observations and records: neither is enforcement. Each
/// probe is a finding, and the report exits 1.
#[test]
fn provoked_denials_and_replayed_runs_do_not_pass_for_enforcement() {
    let lab = Lab::start(DEFAULT_POLICY);
    // An earlier run, while the policy still denied other.test: enforced.
    let earlier = probe_run(&lab, &lab.ns_client, "earlier", HOLE_PLAN);
    let r = probe_report(
        &lab,
        "earlier",
        &earlier,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    let enforced = [
        ("allow-http", "enforced_allow"),
        ("canary", "enforced_deny"),
        ("canary-tls", "enforced_deny"),
    ];
    assert_classes(&r, &enforced);
    assert_eq!(r.code, Some(0), "{}\n{}", r.output, r.md());
    let earlier_records: Vec<Value> = r.json["probes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            p["records"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x["id"].clone())
        })
        .collect();
    assert!(earlier_records.len() >= 3, "{}", r.md());

    // The hole opens.
    let config = std::fs::read_to_string(&lab.config_path).unwrap();
    std::fs::write(
        &lab.config_path,
        format!("{config}\n[[org.allow]]\nid = \"hole\"\nhost = \"other.test\"\n"),
    )
    .unwrap();
    lab.signal_proxy("-HUP");
    lab::wait_until("other.test allowed", Duration::from_secs(10), || {
        lab.proxied_curl("http://other.test/", &[]).status == 200
    });
    // A fresh plan, issued after the earlier run's records (more than the
    // 2 s of tolerated skew), run honestly: the hole shows.
    std::thread::sleep(Duration::from_secs(3));
    let fresh_run = probe_run(&lab, &lab.ns_client, "fresh", HOLE_PLAN);
    let plan = plan_of(&fresh_run);
    let honest = probe_report(
        &lab,
        "fresh",
        &fresh_run,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &honest,
        &[
            ("allow-http", "enforced_allow"),
            ("canary", "unexpected_allow"),
            ("canary-tls", "unexpected_allow"),
        ],
    );

    // 1. Provoked: later (the allow records left out of the moved windows),
    // a Host header naming allowed.test on a request for other.test (a
    // host_mismatch for other.test:80), and a ClientHello for other.test
    // in a tunnel to allowed.test:443 (an sni_mismatch naming other.test).
    std::thread::sleep(Duration::from_secs(4));
    let hm = lab.proxied_curl("http://other.test/", &["-H", "Host: allowed.test"]);
    assert_eq!(hm.status, 403, "{hm:?}");
    let hm = lab.wait_evidence("the provoked host_mismatch", |v| {
        v["reason"] == "host_mismatch" && v["host"] == "other.test"
    });
    let sni = lab.proxied_curl(
        "https://other.test/",
        &["--connect-to", "other.test:443:allowed.test:443"],
    );
    assert_ne!(sni.exit, Some(0), "{sni:?}");
    let sni = lab.wait_evidence("the provoked sni_mismatch", |v| {
        v["reason"] == "sni_mismatch" && v["sni"] == "other.test"
    });
    let onto = |o: &mut Value, rec: &Value| {
        let ts = rec["ts"].as_str().unwrap();
        o["started"] = ts_plus(ts, -300).into();
        o["finished"] = ts_plus(ts, 300).into();
        for s in o["sockets"].as_array_mut().unwrap() {
            s["local"] = rec["client"].clone();
        }
        o["outcome"] = "refused".into();
        o["bytes_received"] = 0.into();
        o["error"] = Value::Null;
    };
    let forged = forge(&lab, &fresh_run, "provoked", |v| {
        let o = observation_mut(v, "canary");
        onto(o, &hm);
        o["http_status"] = 403.into();
        let o = observation_mut(v, "canary-tls");
        onto(o, &sni);
        o["tls"] = "closed".into();
    });
    let r = probe_report_with(
        &lab,
        "provoked",
        &plan,
        &forged,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    // The canary's own request named its marker in its allow record,
    // which fits wherever the window was moved; the TLS canary's CONNECT
    // named none: nothing of its own fits.
    assert_classes(
        &r,
        &[
            ("canary", "unexpected_allow"),
            ("canary-tls", "inconclusive"),
        ],
    );
    for (id, rec) in [("canary", &hm), ("canary-tls", &sni)] {
        let p = r.probe(id);
        assert_ne!(p["class"], "enforced_deny", "{p:#}\n{}", r.md());
        assert_eq!(p["finding"], true, "{p:#}");
        let named = p["mismatches"].as_array().unwrap().iter().any(|m| {
            m.as_str().is_some_and(|m| {
                m.contains("not of the probe's own request")
                    && m.contains(rec["id"].as_str().unwrap())
            })
        });
        assert!(named, "{id}: the provoked denial is not named: {p:#}");
    }
    assert_eq!(r.code, Some(1), "{}\n{}", r.output, r.md());
    assert!(
        r.json["verdict"].as_str().unwrap().starts_with("FINDINGS"),
        "{}",
        r.json["verdict"]
    );

    // 2. Replayed: the earlier run's observations, windows and all, given
    // for the fresh plan. As they were, they are of another plan (exit 2).
    let e = refused_report(&lab, "replayed-as-is", &plan, &earlier);
    assert!(e.contains("not of the agreed plan"), "{e}");
    // Relabelled with the fresh plan's hash, copy and markers: the earlier
    // records are older than the plan, so none counts.
    let fresh_v: Value =
        serde_json::from_str(&std::fs::read_to_string(&fresh_run).unwrap()).unwrap();
    let replayed = forge(&lab, &earlier, "replayed", |v| {
        v["plan_sha256"] = sha256_of(&plan).into();
        v["plan"] = fresh_v["plan"].clone();
        for o in v["observations"].as_array_mut().unwrap() {
            let fresh_o = fresh_v["observations"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["id"] == o["id"])
                .unwrap();
            o["marker"] = fresh_o["marker"].clone();
            o["target"] = fresh_o["target"].clone();
        }
    });
    let r = probe_report_with(
        &lab,
        "replayed",
        &plan,
        &replayed,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    for (id, _) in enforced {
        let p = r.probe(id);
        assert!(
            !p["class"].as_str().unwrap().starts_with("enforced"),
            "{id}: {p:#}\n{}",
            r.md()
        );
        assert_eq!(p["finding"], true, "{p:#}");
        let old = p["mismatches"].as_array().unwrap().iter().any(|m| {
            m.as_str()
                .is_some_and(|m| m.contains("before the plan was issued"))
        });
        assert!(old, "{id}: the replay is not named: {p:#}");
        // None of the earlier run's records counts (the fresh run's own
        // requests, naming the fresh markers, may).
        for x in p["records"].as_array().unwrap() {
            assert!(!earlier_records.contains(&x["id"]), "{id}: {x:#}");
        }
    }
    assert_eq!(r.code, Some(1), "{}\n{}", r.output, r.md());
}

#[test]
fn sealed_evidence_with_key_passes_and_tampering_refuses_classification() {
    let mut lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .start();
    let plan = r#"
proxy = "198.18.1.1:3128"
resolver = "198.18.1.1:53"
timeout = "3s"

[[probe]]
id = "allow-http"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "allow"

[[probe]]
id = "deny-name"
target = "http://other.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"

[[probe]]
id = "deny-dns"
target = "dns:other.test/A"
via = "direct"
expect = "deny"

[[probe]]
id = "routed-away"
target = "udp://198.18.2.20:443"
via = "direct"
expect = "deny"
layer = "any"
"#;
    let obs = probe_run(&lab, &lab.ns_client, "sealed", plan);
    let key = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["evidence", "pubkey", "-c"])
            .arg(&lab.config_path),
        None,
        Duration::from_secs(10),
    );
    assert!(key.success(), "{}", key.describe());
    let key = key.stdout.trim().to_string();
    // A live chain is refused without --allow-unsealed.
    let live = probe_report(&lab, "live", &obs, &lab.evidence_dir, &["--key", &key]);
    assert_eq!(live.json["verification"]["ok"], false, "{}", live.output);
    assert_eq!(live.code, Some(1));

    lab.signal_proxy("-TERM");
    assert!(lab.wait_proxy_exit(Duration::from_secs(15)).is_some());
    let r = probe_report(&lab, "sealed", &obs, &lab.evidence_dir, &["--key", &key]);
    assert_classes(
        &r,
        &[
            ("allow-http", "enforced_allow"),
            ("deny-name", "enforced_deny"),
            ("deny-dns", "enforced_deny"),
            ("routed-away", "blocked_elsewhere"),
        ],
    );
    assert_eq!(r.code, Some(0), "{}\n{}", r.output, r.md());
    assert_eq!(r.json["scope"]["evidence_sealed"], true);
    assert_eq!(r.json["scope"]["evidence_key_pinned"], true);
    assert_eq!(r.json["scope"]["evidence_public_key"], key.as_str());
    assert!(r.json["verdict"]
        .as_str()
        .unwrap()
        .starts_with("Within the 4 paths tested"));

    // acme's export (docs/evidence.md, "One org's export") gives the
    // same report; an export with a record removed is not assessed.
    let export = lab.dir.join("acme-export");
    let e = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["evidence", "export"])
            .arg(&lab.evidence_dir)
            .args(["--org", "acme", "--proofs", "--key", &key, "--out"])
            .arg(&export),
        None,
        Duration::from_secs(30),
    );
    assert!(e.success(), "{}", e.describe());
    let x = probe_report(&lab, "export", &obs, &export, &["--key", &key]);
    assert_eq!(x.code, Some(0), "{}\n{}", x.output, x.md());
    assert_eq!(x.json["probes"], r.json["probes"], "{}", x.md());
    let records = std::fs::read_to_string(export.join("records.jsonl")).unwrap();
    let kept: Vec<&str> = records
        .lines()
        .filter(|l| !l.contains("other.test"))
        .collect();
    assert!(
        kept.len() < records.lines().count(),
        "no record of other.test exported"
    );
    std::fs::write(export.join("records.jsonl"), kept.join("\n") + "\n").unwrap();
    let x = probe_report(&lab, "export-cut", &obs, &export, &["--key", &key]);
    assert_eq!(x.code, Some(1), "{}", x.output);
    assert!(
        x.json["verification"]["error"]
            .as_str()
            .unwrap()
            .contains("record removed"),
        "{:#}",
        x.json["verification"]
    );

    // Tamper: turn the recorded denial into an allow in a copy.
    let copy = lab.dir.join("tampered");
    std::fs::create_dir_all(&copy).unwrap();
    let mut edited = false;
    for entry in std::fs::read_dir(&lab.evidence_dir).unwrap() {
        let path = entry.unwrap().path();
        // Segments only (the dir also keeps `policies/`, the policy texts).
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let text = if !edited && text.contains("\"host\":\"other.test\"") {
            edited = true;
            text.lines()
                .map(|l| {
                    if l.contains("\"host\":\"other.test\"") && l.contains("\"decision\":\"deny\"")
                    {
                        l.replace("\"decision\":\"deny\"", "\"decision\":\"allow\"")
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        } else {
            text
        };
        std::fs::write(copy.join(path.file_name().unwrap()), text).unwrap();
    }
    assert!(edited, "no record to tamper with");
    let t = probe_report(&lab, "tampered", &obs, &copy, &["--key", &key]);
    assert_eq!(t.code, Some(1), "{}", t.output);
    assert_eq!(t.json["verification"]["ok"], false);
    assert!(
        t.json["verification"]["error"]
            .as_str()
            .unwrap()
            .contains("hash does not match"),
        "{:#}",
        t.json["verification"]
    );
    assert_eq!(t.json["probes"].as_array().unwrap().len(), 0);
    assert!(t.json["verdict"]
        .as_str()
        .unwrap()
        .starts_with("Not assessed"));
    let md = t.md();
    let verification = md.find("## Evidence verification").unwrap();
    assert!(md[verification..].contains("**FAILED:**"), "{md}");
    assert!(!md.contains("enforced_"), "{md}");

    // Bad input exits 2.
    let junk = lab.dir.join("junk.json");
    std::fs::write(&junk, "{").unwrap();
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "report", "--plan"])
            .arg(plan_of(&obs))
            .arg("--observations")
            .arg(&junk)
            .arg("--evidence")
            .arg(&lab.evidence_dir)
            .arg("--out")
            .arg(lab.dir.join("junk.report")),
        None,
        Duration::from_secs(10),
    );
    assert_eq!(out.code(), Some(2), "{}", out.describe());
}

#[test]
fn transparent_plan_is_classified() {
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .dns_listen(&["198.18.1.1:5353"])
        .start();
    load_gateway(&lab);
    let plan = r#"
org = "acme"
resolver = "198.18.1.1:53"
timeout = "3s"

[[probe]]
id = "allow-https"
target = "https://allowed.test/"
via = "direct"
expect = "allow"

[[probe]]
id = "allow-http"
target = "http://allowed.test/palisade-probe/{marker}"
via = "direct"
expect = "allow"

[[probe]]
id = "deny-name-dns"
target = "https://other.test/"
via = "direct"
expect = "deny"
note = "the DNS shim refuses the name"

[[probe]]
id = "deny-name-pinned"
target = "https://other.test/"
via = "direct"
expect = "deny"
resolve = "198.18.2.13"
note = "address known to the sandbox already"

[[probe]]
id = "deny-sni"
target = "tls://allowed.test:443?sni=other.test"
via = "direct"
expect = "deny"

[[probe]]
id = "deny-outside-resolver"
target = "dns:other.test/A"
via = "direct"
expect = "deny"
server = "198.18.2.2:53"

[[probe]]
id = "routed-away-udp"
target = "udp://198.18.2.20:443"
via = "direct"
expect = "deny"
layer = "any"

[[probe]]
id = "routed-away-ipv6"
target = "tcp://[2001:db8::1]:443"
via = "direct"
expect = "deny"
layer = "any"

[[probe]]
id = "broken-upstream"
target = "https://nx.test/"
via = "direct"
expect = "allow"

[[probe]]
id = "second-request-other-host"
target = "http://allowed.test/palisade-probe/{marker}"
via = "direct"
expect = "deny"
second_host = "other.test"
"#;
    let obs = probe_run(&lab, &lab.ns_client, "transparent", plan);
    let r = probe_report(
        &lab,
        "transparent",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[
            ("allow-https", "enforced_allow"),
            ("allow-http", "enforced_allow"),
            ("deny-name-dns", "enforced_deny"),
            ("deny-name-pinned", "enforced_deny"),
            ("deny-sni", "enforced_deny"),
            ("deny-outside-resolver", "enforced_deny"),
            ("routed-away-udp", "blocked_elsewhere"),
            ("routed-away-ipv6", "blocked_elsewhere"),
            ("broken-upstream", "inconclusive"),
            // Needs the proxy's tunnel verification (see the module doc).
            ("second-request-other-host", "enforced_deny"),
        ],
    );
    let modes: Vec<String> = r.probe("deny-name-pinned")["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["mode"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(modes, ["transparent"], "{:#}", r.probe("deny-name-pinned"));
    assert_eq!(r.probe("deny-name-dns")["records"][0]["mode"], "dns");
    assert_eq!(r.code, Some(1), "{}", r.output);
    assert!(!r.json["untested"]
        .as_array()
        .unwrap()
        .iter()
        .any(|u| u.as_str().unwrap_or("").starts_with("IPv6: not probed")));
}

#[test]
fn generated_plan_runs_against_the_policy_it_came_from() {
    let policy = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [80, 443]

[[org.allow]]
cidr = "198.18.2.30/32"
ports = [80]

[[org.deny]]
host = "blocked.wild.test"
"#;
    let lab = Lab::builder()
        .policy(policy)
        .dns_listen(&["198.18.1.1:53"])
        .start();
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "plan", "-c"])
            .arg(&lab.config_path)
            .args(["--org", "acme", "--outside", "198.18.2.20"]),
        None,
        Duration::from_secs(10),
    );
    assert!(out.success(), "{}", out.describe());
    // detect_timeout (default 1s) + 500 ms, read from the config.
    assert!(
        out.stdout.contains("silence = \"1500ms\""),
        "{}",
        out.stdout
    );
    let plan = out.stdout.replace("timeout = \"5s\"", "timeout = \"2s\"");
    for id in [
        "canary-https",
        "metadata",
        "spelling-decimal",
        "sni-mismatch",
        "host-mismatch",
        "dns-exfil",
        "udp-quic",
        "ipv6-direct",
        "doh-google",
        "silence-then-sni",
        "second-request-other-host",
        "ech-client-hello",
    ] {
        assert!(
            plan.contains(&format!("id = \"{id}\"")),
            "{id} missing:\n{plan}"
        );
    }
    let obs = probe_run(&lab, &lab.ns_client, "generated", &plan);
    let r = probe_report(
        &lab,
        "generated",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    let classes = r.classes();
    // Every probe of the policy's own plan is classified; none is a finding.
    assert!(
        r.json["findings"].as_array().unwrap().is_empty(),
        "{}",
        r.md()
    );
    for id in [
        "allow-0-80",
        "allow-0-443",
        "allow-1-80",
        "canary-https",
        "metadata",
        "spelling-octal",
        "sni-mismatch",
        "host-mismatch",
        "dns-canary",
        "dns-exfil",
        "doh-google",
        "deny-0",
        // Need the proxy's tunnel verification (see the module doc).
        "silence-then-sni",
        "second-request-other-host",
        "ech-client-hello",
    ] {
        let c = classes.get(id).map(String::as_str);
        assert!(
            matches!(c, Some("enforced_allow") | Some("enforced_deny")),
            "{id}: {c:?}\n{}",
            r.md()
        );
    }
    assert_eq!(
        classes.get("udp-quic").map(String::as_str),
        Some("blocked_elsewhere")
    );
}

/// With `[bypass] nflog_group` behind the shipped gateway ruleset, the
/// generated plan's UDP probes and its direct connection to the gateway
/// are Palisade's to see: refused at once, each with a bypass record the
/// report counts in the probe's window.
#[test]
fn bypass_probes_are_planned_refused_and_counted() {
    let mut lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .without_proxy()
        .start();
    let mut cfg = std::fs::read_to_string(&lab.config_path).unwrap();
    cfg.push_str("\n[bypass]\nnflog_group = 100\n");
    std::fs::write(&lab.config_path, cfg).unwrap();
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    load_gateway(&lab);
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "plan", "-c"])
            .arg(&lab.config_path)
            .args(["--org", "acme", "--outside", lab::UNLISTED_IP]),
        None,
        Duration::from_secs(10),
    );
    assert!(out.success(), "{}", out.describe());
    // Run the bypass probes of the generated plan (the others have tests
    // of their own), exactly as generated.
    let mut plan: toml::Table = toml::from_str(&out.stdout).unwrap();
    let ids = ["udp-quic", "udp-ntp", "direct-gateway"];
    let probes = plan["probe"].as_array().unwrap().clone();
    let kept: Vec<toml::Value> = probes
        .into_iter()
        .filter(|p| ids.contains(&p["id"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(kept.len(), ids.len(), "{}", out.stdout);
    for p in &kept {
        assert!(p.get("layer").is_none(), "Palisade's layer: {p}");
    }
    assert_eq!(
        kept.iter()
            .find(|p| p["id"].as_str() == Some("direct-gateway"))
            .unwrap()["target"]
            .as_str(),
        Some(format!("tcp://{TRANSPARENT}").as_str())
    );
    plan.insert("probe".into(), toml::Value::Array(kept));
    let plan = toml::to_string(&plan).unwrap();
    let obs = probe_run(&lab, &lab.ns_client, "bypass", &plan);
    // Bypass records are summaries, written about a second after their
    // packets: the report is made once they are there.
    for (port, what) in [(443, "QUIC"), (123, "UDP 123"), (15001, "the gateway")] {
        lab.wait_evidence(&format!("the bypass record of {what}"), |v| {
            v["kind"] == "bypass" && v["port"] == port
        });
    }
    let r = probe_report(
        &lab,
        "bypass",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[
            ("udp-quic", "enforced_deny"),
            ("udp-ntp", "enforced_deny"),
            ("direct-gateway", "enforced_deny"),
        ],
    );
    for id in ids {
        let p = r.probe(id);
        assert_eq!(
            p["observation"]["error"], "connection_refused",
            "{id}: {p:#}"
        );
        assert!(p["bypass_attempts"].as_u64() >= Some(1), "{id}: {p:#}");
        let recs = p["records"].as_array().unwrap();
        assert!(
            !recs.is_empty() && recs.iter().all(|x| x["kind"] == "bypass"),
            "{id}: {p:#}"
        );
    }
    assert_eq!(r.probe("direct-gateway")["records"][0]["proto"], "tcp");
    assert_eq!(r.probe("udp-quic")["records"][0]["port"], 443);
    assert_eq!(r.code, Some(0), "{}\n{}", r.output, r.md());
}

/// `*.wild.test` with a budget of 10 new names a minute, `*.free.test`
/// with none (0): the name-channel probes the plan generates for them.
const NAME_POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "wild"
host = "*.wild.test"
max_new_names_per_minute = 10

[[org.allow]]
id = "free"
host = "*.free.test"
max_new_names_per_minute = 0
"#;

/// The distinct names the upstream resolver was asked that end in `tail`.
fn upstream_names_ending(lab: &Lab, tail: &str) -> std::collections::BTreeSet<String> {
    lab.dns_log()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .map(|n| n.trim_end_matches('.').to_ascii_lowercase())
        .filter(|n| n.ends_with(tail))
        .collect()
}

/// plan -> run -> report for the name channel, the upstream resolver's
/// own query log as the witness: under a budget of 10, 30 new names are
/// sent, exactly 10 reach the upstream and the report says so and
/// `enforced_deny` (every name on record, one by one or in a summary's
/// count); with no budget all 40 leave and the report says
/// `unexpected_allow`.
/// `probe plan` for `lab`'s config, cut to its name-channel probes
/// (exactly as generated, their targets checked against `targets`), run in
/// the client namespace as `name`: the observations file and each
/// probe's marker.
fn run_name_probes(lab: &Lab, name: &str, targets: &[&str]) -> (PathBuf, BTreeMap<String, String>) {
    let out = lab::run_with_timeout(
        Command::new(palisade_bin())
            .args(["probe", "plan", "-c"])
            .arg(&lab.config_path)
            .args(["--org", "acme", "--outside", lab::UNLISTED_IP]),
        None,
        Duration::from_secs(10),
    );
    assert!(out.success(), "{}", out.describe());
    let mut plan: toml::Table = toml::from_str(&out.stdout).unwrap();
    let kept: Vec<toml::Value> = plan["probe"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| id.starts_with("names-")))
        .cloned()
        .collect();
    let got: Vec<&str> = kept.iter().filter_map(|p| p["target"].as_str()).collect();
    assert_eq!(got, targets, "{}", out.stdout);
    plan.insert("probe".into(), toml::Value::Array(kept));
    let plan = toml::to_string(&plan).unwrap();
    let obs = probe_run(lab, &lab.ns_client, name, &plan);
    let observed: Value = serde_json::from_str(&std::fs::read_to_string(&obs).unwrap()).unwrap();
    let markers = observed["observations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["id"].as_str().unwrap().to_string(),
                o["marker"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    (obs, markers)
}

/// DNS refusals past a name budget on record, one by one or summarised.
fn budget_refusals(lab: &Lab) -> u64 {
    lab.evidence()
        .iter()
        .filter(|v| v["kind"] == "dns" && v["reason"] == "name_budget_exceeded")
        .map(|v| v["count"].as_u64().unwrap_or(1))
        .sum()
}

const WILD_BURST: &str = "dns-burst:{random}.{marker}.wild.test/A?count=30&budget=10";

/// plan -> run -> report for the name channel, the upstream resolver's
/// own query log as the witness: under a budget of 10, 30 new names are
/// sent, exactly 10 reach the upstream and the report says so and
/// `enforced_deny` (every name on record); with no budget all 40 leave
/// and the report says `unexpected_allow`.
#[test]
fn name_channel_probe_counts_what_reached_the_upstream() {
    let lab = Lab::builder()
        .policy(NAME_POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .start();
    let (obs, markers) = run_name_probes(
        &lab,
        "names",
        &[
            WILD_BURST,
            "dns-burst:{random}.{marker}.free.test/A?count=40&budget=0",
        ],
    );
    let (wild, free) = (&markers["names-0"], &markers["names-1"]);
    // The witness: what the upstream resolver saw of each probe's names.
    let wild_seen = upstream_names_ending(&lab, &format!(".{wild}.wild.test"));
    let free_seen = upstream_names_ending(&lab, &format!(".{free}.free.test"));
    assert_eq!(wild_seen.len(), 10, "{wild_seen:?}");
    assert_eq!(free_seen.len(), 40, "{free_seen:?}");
    // Refusals past the budget are written one by one or summarised a
    // second later: the report is made once all 20 are on record.
    lab::wait_until("20 refusals on record", Duration::from_secs(8), || {
        budget_refusals(&lab) == 20
    });
    let r = probe_report(
        &lab,
        "names",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(
        &r,
        &[
            ("names-0", "enforced_deny"),
            ("names-1", "unexpected_allow"),
        ],
    );
    let counts = |id: &str| r.probe(id)["names"].clone();
    let w = counts("names-0");
    assert_eq!(w["sent"], 30, "{w}");
    assert_eq!(w["answered"], 10, "{w}");
    assert_eq!(w["refused"], 20, "{w}");
    assert_eq!(
        w["reached_upstream"].as_u64(),
        Some(wild_seen.len() as u64),
        "{w}"
    );
    assert_eq!(w["not_on_record"], 0, "{w}");
    assert_eq!(w["budget"], 10, "{w}");
    let f = counts("names-1");
    assert_eq!(f["sent"], 40, "{f}");
    assert_eq!(
        f["reached_upstream"].as_u64(),
        Some(free_seen.len() as u64),
        "{f}"
    );
    assert!(r.probe("names-1")["why"]
        .as_str()
        .unwrap()
        .contains("names leave unbounded"));
    // The report shows the counts, and the hole is a finding.
    let md = r.md();
    assert!(
        md.contains("30 names sent, 10 reached the upstream (budget 10)"),
        "{md}"
    );
    assert!(
        md.contains("40 names sent, 40 reached the upstream (no budget)"),
        "{md}"
    );
    assert_eq!(r.code, Some(1), "{}\n{md}", r.output);
    eprintln!(
        "name-channel probe: of 30 new names, {} reached the upstream with max_new_names_per_minute = 10 (enforced_deny); of 40, {} with 0 (unexpected_allow)",
        wild_seen.len(),
        free_seen.len()
    );
}

/// The same burst with an evidence budget of 12 records a second: past
/// the 10 answers and a refusal or two, the refusals are summarised (a
/// count, no names), and the report still finds every name on record.
#[test]
fn name_channel_probe_counts_summarised_refusals() {
    let policy = NAME_POLICY
        .split("\n[[org.allow]]\nid = \"free\"")
        .next()
        .unwrap();
    let lab = Lab::builder()
        .policy(policy)
        .dns_listen(&["198.18.1.1:53"])
        .evidence_config("max_records_per_second_per_org = 12")
        .start();
    let (obs, markers) = run_name_probes(&lab, "names-summarised", &[WILD_BURST]);
    let seen = upstream_names_ending(&lab, &format!(".{}.wild.test", markers["names-0"]));
    assert_eq!(seen.len(), 10, "{seen:?}");
    lab::wait_until("20 refusals on record", Duration::from_secs(8), || {
        budget_refusals(&lab) == 20
    });
    let r = probe_report(
        &lab,
        "names-summarised",
        &obs,
        &lab.evidence_dir,
        &["--allow-unsealed"],
    );
    assert_classes(&r, &[("names-0", "enforced_deny")]);
    let w = r.probe("names-0")["names"].clone();
    assert_eq!(w["sent"], 30, "{w}");
    assert_eq!(
        w["reached_upstream"].as_u64(),
        Some(seen.len() as u64),
        "{w}"
    );
    assert!(w["summarised"].as_u64() > Some(0), "{w}");
    assert!(w["on_record"].as_u64() < Some(30), "{w}");
    assert_eq!(w["not_on_record"], 0, "{w}");
    assert_eq!(r.code, Some(0), "{}\n{}", r.output, r.md());
}
