//! Report mode: an org whose allowlist denials are recorded as `would_deny`
//! but let through, while safety denials stay enforced.

use crate::lab::{self, Lab, DEFAULT_POLICY};

fn report_lab() -> Lab {
    let policy =
        DEFAULT_POLICY.replace("name = \"acme\"\n", "name = \"acme\"\nmode = \"report\"\n");
    assert!(policy.contains("mode = \"report\""));
    Lab::builder().policy(&policy).start()
}

fn scrape(lab: &Lab) -> String {
    lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    )
    .stdout
}

#[test]
fn report_mode_lets_allowlist_denials_through_and_records_them() {
    let lab = report_lab();
    // Not on the allowlist: let through, recorded with what enforcement would do.
    let r = lab.proxied_curl("http://other.test/", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let rec = lab.wait_evidence("report-only decision for other.test", |v| {
        v["host"] == "other.test" && v["event"] == "decision"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["reason"], "report_only", "{rec}");
    assert_eq!(rec["would_deny"], "no_matching_rule", "{rec}");

    // An explicit deny rule, through CONNECT.
    let r = lab.raw_connect("blocked.wild.test:443");
    assert_eq!(r.status, 200, "{r:?}");
    let rec = lab.wait_evidence("report-only explicit deny", |v| {
        v["host"] == "blocked.wild.test" && v["event"] == "decision"
    });
    assert_eq!(rec["would_deny"], "explicit_deny", "{rec}");

    // A Host header naming another host.
    let r = lab.proxied_curl("http://allowed.test/", &["-H", "Host: other.test"]);
    assert_eq!(r.status, 200, "{r:?}");
    lab.wait_evidence("report-only host mismatch", |v| {
        v["would_deny"] == "host_mismatch"
    });

    // Safety denials stay enforced: the metadata address and loopback.
    let r = lab.proxied_curl("http://meta.test/", &[]);
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("denied_address"), "{r:?}");
    assert!(lab.canary_log().is_empty());

    // Metrics and /policy say so.
    let m = scrape(&lab);
    assert!(
        m.contains("palisade_would_deny_total{mode=\"explicit\",org=\"acme\",reason=\"no_matching_rule\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("palisade_connections_total{decision=\"allow\",mode=\"explicit\",org=\"acme\",reason=\"report_only\"}"),
        "{m}"
    );
    let p = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    assert!(p.stdout.contains("\"mode\": \"report\""), "{}", p.stdout);
}

#[test]
fn replay_shows_which_recorded_flows_a_candidate_policy_flips() {
    let lab = Lab::start(DEFAULT_POLICY);
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 200);
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    lab.wait_evidence("three decisions", |v| v["host"] == "other.test");

    // Candidate: other.test allowed, *.wild.test denied.
    let text = std::fs::read_to_string(&lab.config_path).unwrap();
    let candidate = lab.dir.join("candidate.toml");
    std::fs::write(
        &candidate,
        format!("{text}\n[[org.allow]]\nid = \"other\"\nhost = \"other.test\"\n\n[[org.deny]]\nid = \"no-wild\"\nhost = \"*.wild.test\"\n"),
    )
    .unwrap();
    let out = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin())
            .args(["replay", "--json", "--evidence"])
            .arg(&lab.evidence_dir)
            .arg("-c")
            .arg(&candidate),
        None,
        std::time::Duration::from_secs(20),
    );
    assert!(out.success(), "{}", out.describe());
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let flips = report["flips"].as_array().unwrap();
    let find = |host: &str| {
        flips
            .iter()
            .find(|f| f["host"] == host)
            .unwrap_or_else(|| panic!("no flip for {host}: {report}"))
    };
    let wild = find("a.wild.test");
    assert_eq!(
        (wild["before"].as_str(), wild["after"].as_str()),
        (Some("allow"), Some("deny"))
    );
    assert_eq!(wild["after_rule"], "no-wild");
    let other = find("other.test");
    assert_eq!(
        (other["before"].as_str(), other["after"].as_str()),
        (Some("deny"), Some("allow"))
    );
    assert_eq!(other["after_rule"], "other");
    assert_eq!(
        other["unresolved"], true,
        "denied before resolution: address unknown"
    );
    assert!(
        flips.iter().all(|f| f["host"] != "allowed.test"),
        "{report}"
    );
    assert_eq!(
        report["by_org_rule"]["acme\tallow->deny\tno-wild"], 1,
        "{report}"
    );
    assert_eq!(
        report["by_org_rule"]["acme\tdeny->allow\tother"], 1,
        "{report}"
    );
}
