//! The enforcement check (`[enforcement]`): the proxy namespace is the
//! gateway and loads the shipped ruleset (`docker/nftables.conf`, its
//! defines set for the lab); Palisade compares the file's tables with what
//! the kernel has loaded. A table deleted from under it (`nft delete
//! table`, as a reboot, a flush or another tool would) fails `/readyz`,
//! is recorded, and in `required` mode refuses new connections, until the
//! ruleset is loaded again. Timings are printed, not asserted beyond the
//! bound a check interval sets.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Lab, DEFAULT_POLICY};
use crate::probe::{assert_classes, probe_report, probe_run};
use crate::transparent::{curl_with, gateway_ruleset, load_ruleset, TRANSPARENT};

/// The check interval of these tests.
const INTERVAL: &str = "200ms";
/// How long a change may take to show: many intervals, for a loaded machine.
const WITHIN: Duration = Duration::from_secs(10);

/// A lab whose config names the gateway ruleset (written to the lab's
/// dir) with `mode`, the ruleset loaded when `loaded`, Palisade started.
fn lab_with(mode: &str, loaded: bool) -> Lab {
    let mut lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .without_proxy()
        .start();
    // The sandbox's default route is the gateway (transparent mode).
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["route", "add", "default", "via", "198.18.1.1"],
    );
    assert!(out.success(), "{}", out.describe());
    let ruleset = lab.dir.join("gateway.nft");
    std::fs::write(&ruleset, gateway_ruleset()).unwrap();
    let mut config = std::fs::read_to_string(&lab.config_path).unwrap();
    config.push_str(&format!(
        "\n[enforcement]\nruleset = \"{}\"\nmode = \"{mode}\"\ncheck_interval = \"{INTERVAL}\"\n",
        ruleset.display()
    ));
    std::fs::write(&lab.config_path, config).unwrap();
    if loaded {
        load_ruleset(&lab, &gateway_ruleset());
    }
    lab.spawn_proxy();
    lab
}

fn nft(lab: &Lab, args: &[&str]) {
    let out = lab.proxy_ns_exec("nft", args);
    assert!(out.success(), "nft {args:?}: {}", out.describe());
}

fn enforcement_ok(lab: &Lab) -> Option<String> {
    let out = lab.proxy_ns_exec(
        "curl",
        &[
            "-sS",
            "--max-time",
            "2",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    );
    out.stdout.lines().find_map(|l| {
        l.strip_prefix("palisade_enforcement_ok ")
            .map(str::to_string)
    })
}

fn enforcement_records(lab: &Lab) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "enforcement")
        .collect()
}

/// Poll `f` until it holds (bounded by [`WITHIN`]); the time it took.
fn until(what: &str, lab: &Lab, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while start.elapsed() < WITHIN {
        if f() {
            return start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("{what}: not within {WITHIN:?}\n{}", lab.proxy_output());
}

/// Plain HTTP to allowed.test from the sandbox, no proxy settings: the
/// gateway redirects it to the transparent listener.
fn transparent(lab: &Lab) -> lab::CmdOutput {
    curl_with(
        lab,
        &[],
        "http://allowed.test/",
        "allowed.test:80:198.18.2.10",
    )
}

fn allowed(lab: &Lab) -> lab::HttpResp {
    lab.proxied_curl("http://allowed.test/", &["--max-time", "5"])
}

#[test]
fn a_deleted_table_fails_readiness_and_refuses_connections_until_it_is_loaded_again() {
    let mut lab = lab_with("required", true);
    lab.wait_proxy_ready();
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("1"));
    let first = lab.wait_evidence("the start's verified record", |v| {
        v["kind"] == "enforcement" && v["event"] == "verified"
    });
    assert_eq!(first["decision"], "allow", "{first}");
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "{ok:?}");

    // The table goes, as a flush or another tool's `nft delete` would
    // take it. Each step is timed from here.
    let deleted = Instant::now();
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    let to_503 = deleted.elapsed();
    let mut refused = None;
    until("a new connection refused", &lab, || {
        let r = allowed(&lab);
        let done = r.status == 503 && r.body.contains("enforcement_missing");
        if done {
            refused = Some(r);
        }
        done
    });
    let to_refused = deleted.elapsed();
    eprintln!(
        "enforcement: nft delete table -> /readyz 503 in {to_503:?}, -> first refused connection in {to_refused:?} (check_interval {INTERVAL})"
    );
    let failed = lab.wait_evidence("the failed record", |v| {
        v["kind"] == "enforcement" && v["event"] == "failed"
    });
    assert_eq!(failed["reason"], "enforcement_missing", "{failed}");
    assert_eq!(failed["decision"], "deny", "{failed}");
    assert_eq!(
        failed["differs"],
        serde_json::json!(["table inet palisade is not loaded"]),
        "{failed}"
    );
    let refusal = lab.wait_evidence("the refused connection's record", |v| {
        v["kind"] == "http" && v["reason"] == "enforcement_missing"
    });
    assert_eq!(refusal["org"], "acme", "{refusal}");
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("0"));
    // Checked again and again while missing, recorded once.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        enforcement_records(&lab)
            .iter()
            .filter(|v| v["event"] == "failed")
            .count(),
        1
    );

    // A changed table (a rule gone from input) is no better than none.
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 after the reload", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    assert_eq!(allowed(&lab).status, 200);
    assert!(transparent(&lab).stdout.contains("HTTP 200"));
    nft(&lab, &["flush", "chain", "inet", "palisade", "forward"]);
    until("/readyz 503 after a flushed chain", &lab, || {
        lab.admin_status("/readyz") == 503
    });
    let flushed = lab.wait_evidence("the flushed chain's record", |v| {
        v["kind"] == "enforcement"
            && v["event"] == "failed"
            && v["differs"][0] != "table inet palisade is not loaded"
    });
    assert_eq!(
        flushed["differs"],
        serde_json::json!([
            "chain inet palisade forward: rule 1 differs (0 rules loaded, the file has 1)"
        ]),
        "{flushed}"
    );
    // The redirect still works, so transparent connections reach Palisade:
    // refused (reset) and recorded, as explicit ones are.
    let reset = transparent(&lab);
    assert!(!reset.stdout.contains("HTTP 200"), "{}", reset.describe());
    let refusal = lab.wait_evidence("the transparent refusal", |v| {
        v["kind"] == "tcp" && v["mode"] == "transparent" && v["reason"] == "enforcement_missing"
    });
    assert_eq!(refusal["host"], "allowed.test", "{refusal}");
    assert_eq!(refusal["ip"], lab::ALLOWED_IP, "{refusal}");

    // Loaded again: ready, recorded, connections let through.
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 again", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("1"));
    let verified = enforcement_records(&lab)
        .into_iter()
        .filter(|v| v["event"] == "verified")
        .count();
    assert_eq!(verified, 3, "{:?}", enforcement_records(&lab));
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "{ok:?}");
}

#[test]
fn advisory_mode_records_and_reports_but_refuses_nothing() {
    // Started without the ruleset: it serves, but is not ready.
    let lab = lab_with("advisory", false);
    until("the admin listener up, not ready", &lab, || {
        lab.admin_status("/readyz") == 503
    });
    assert_eq!(lab.admin_status("/healthz"), 200);
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("0"));
    let failed = lab.wait_evidence("the start's failed record", |v| {
        v["kind"] == "enforcement" && v["event"] == "failed"
    });
    assert_eq!(
        failed["differs"],
        serde_json::json!(["table inet palisade is not loaded"]),
        "{failed}"
    );
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "advisory refuses nothing: {ok:?}");

    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 once loaded", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    lab.wait_evidence("the verified record", |v| {
        v["kind"] == "enforcement" && v["event"] == "verified"
    });
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    assert_eq!(allowed(&lab).status, 200);
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["reason"] == "enforcement_missing" && v["kind"] != "enforcement"),
        "nothing refused in advisory mode"
    );
}

#[test]
fn start_up_with_a_required_ruleset_absent_fails_with_one_line() {
    let mut lab = lab_with("required", false);
    let status = lab
        .wait_proxy_exit(WITHIN)
        .unwrap_or_else(|| panic!("still running\n{}", lab.proxy_output()));
    assert!(!status.success(), "{status}");
    let out = lab.proxy_output();
    let last = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.contains("enforcement: the required ruleset ")
            && last.ends_with(
                "gateway.nft is not loaded as written: table inet palisade is not loaded"
            ),
        "{out}"
    );
    // A ruleset that does not load is a located error, in the file.
    let broken = lab.dir.join("gateway.nft");
    std::fs::write(
        &broken,
        "table inet palisade {\n  chain c {\n    bogus\n  }\n}\n",
    )
    .unwrap();
    let out = lab.proxy_ns_exec(
        crate::lab::palisade_bin(),
        &["check", "-c", &lab.config_path.display().to_string()],
    );
    assert_eq!(out.code(), Some(1), "{}", out.describe());
    assert!(
        out.stderr.starts_with(&format!("{}:3:", broken.display()))
            && out
                .stderr
                .contains(": enforcement ruleset does not load: syntax error"),
        "{}",
        out.describe()
    );
}

/// Probes through the explicit proxy: one allowed, one denied by policy.
const PLAN: &str = r#"
org = "acme"
proxy = "198.18.1.1:3128"
timeout = "3s"
deadline = "60s"

[[probe]]
id = "allow"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "allow"

[[probe]]
id = "deny"
target = "http://other.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"
"#;

#[test]
fn probes_run_while_enforcement_was_not_verified_are_inconclusive() {
    // Advisory: the proxy lets the allowed probe through and denies the
    // other, as it would with the ruleset, but nothing holds the sandbox
    // to the proxy meanwhile.
    let mut lab = lab_with("advisory", true);
    lab.wait_proxy_ready();
    let verified = probe_run(&lab, &lab.ns_client, "verified", PLAN);
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    let missing = probe_run(&lab, &lab.ns_client, "missing", PLAN);
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200", &lab, || lab.admin_status("/readyz") == 200);
    let again = probe_run(&lab, &lab.ns_client, "again", PLAN);

    let unsealed = ["--allow-unsealed"];
    for (name, obs) in [("verified", &verified), ("again", &again)] {
        let r = probe_report(&lab, name, obs, &lab.evidence_dir, &unsealed);
        assert_classes(
            &r,
            &[("allow", "enforced_allow"), ("deny", "enforced_deny")],
        );
    }
    let r = probe_report(&lab, "missing", &missing, &lab.evidence_dir, &unsealed);
    assert_classes(&r, &[("allow", "inconclusive"), ("deny", "inconclusive")]);
    let why = r.probe("deny")["why"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        why.contains("enforcement was not verified while the probe ran")
            && why.contains("table inet palisade is not loaded"),
        "{why}"
    );
}
