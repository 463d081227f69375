//! Adoption tools on real evidence: `palisade evidence summary` (what was
//! denied), the live decision tail, `palisade draft`.

use std::process::Command;

use crate::lab::{self, run_with_timeout, CmdOutput, Lab, DEFAULT_POLICY};

fn palisade(args: &[&str]) -> CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        lab::CMD_TIMEOUT,
    )
}

#[test]
fn evidence_summary_lists_what_was_denied_with_counts_and_hints() {
    let lab = Lab::start(DEFAULT_POLICY);
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    for _ in 0..2 {
        assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    }
    assert_eq!(lab.proxied_curl("http://meta.test/", &[]).status, 403);
    assert_eq!(lab.proxied_curl("http://169.254.169.254/", &[]).status, 403);
    lab.wait_evidence("the metadata literal's denial", |v| {
        v["host"] == "169.254.169.254"
    });
    let dir = lab.evidence_dir.to_str().unwrap();

    let out = palisade(&["evidence", "summary", dir, "--format", "json"]);
    assert!(out.success(), "{}", out.describe());
    let s: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let acme = &s["orgs"]["acme"];
    assert_eq!(acme["denied"], 4, "{s}");
    let target = |name: &str| {
        acme["targets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["target"] == name)
            .unwrap_or_else(|| panic!("no {name} in {s}"))
            .clone()
    };
    let other = target("other.test");
    assert_eq!(other["count"], 2);
    assert_eq!(other["reasons"]["no_matching_rule"], 2);
    assert_eq!(other["clients"], 1);
    assert_eq!(
        other["hint"],
        "allow with: host = \"other.test\", ports = [80]"
    );
    let meta = target("meta.test");
    assert_eq!(meta["reasons"]["denied_address"], 1, "{s}");
    assert!(
        meta["hint"]
            .as_str()
            .unwrap()
            .starts_with("resolves to an always-denied address: no rule should allow it"),
        "{meta}"
    );
    let literal = target("169.254.169.254");
    assert!(
        literal["hint"]
            .as_str()
            .unwrap()
            .contains("no rule should allow it"),
        "{literal}"
    );
    assert!(acme["targets"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["target"] != "allowed.test"));

    let md = palisade(&[
        "evidence", "summary", dir, "--org", "acme", "--format", "markdown",
    ]);
    assert!(md.success(), "{}", md.describe());
    println!("{}", md.stdout);
    assert!(
        md.stdout.contains("### Org `acme`: 4 denied"),
        "{}",
        md.stdout
    );
    assert!(
        md.stdout
            .contains("| `other.test` | 80 | 2 | no_matching_rule=2 |"),
        "{}",
        md.stdout
    );

    let table = palisade(&["evidence", "summary", dir]);
    assert!(table.success(), "{}", table.describe());
    assert!(
        table.stdout.contains("org acme: 4 denied"),
        "{}",
        table.stdout
    );

    // A window after everything: nothing.
    let later = palisade(&[
        "evidence",
        "summary",
        dir,
        "--since",
        "2999-01-01T00:00:00Z",
    ]);
    assert!(later.success(), "{}", later.describe());
    assert!(later.stdout.contains("no decisions"), "{}", later.stdout);

    // Bad input: one line each, non-zero, nothing on stdout.
    for (args, code) in [
        (vec!["evidence", "summary", dir, "--org", "nosuch"], 1),
        (vec!["evidence", "summary", dir, "--since", "yesterday"], 2),
        (vec!["evidence", "summary", "/nonexistent/evidence"], 1),
        (vec!["evidence", "summary", dir, "--format", "xml"], 2),
    ] {
        let out = palisade(&args);
        assert_eq!(out.code(), Some(code), "{args:?}: {}", out.describe());
        assert!(out.stdout.is_empty(), "{args:?}: {}", out.describe());
        assert!(!out.stderr.trim().is_empty(), "{}", out.describe());
        if code == 1 {
            assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.describe());
        }
    }
}
