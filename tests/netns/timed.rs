//! Time-bound rules: `expires` and `not_before` on allow rules take effect
//! at their instant, with no reload. A CONNECT tunnel opened under a rule
//! that expires a few seconds into the test is closed at its end, with a
//! `policy_revoked` record naming the rule's end; the next attempt is
//! refused (`port_not_allowed`: the name keeps its web ports); a rule whose `not_before` is that same
//! instant starts matching then; the served policy hash never changes;
//! and `palisade check` warns about the expired rule. The upstream's echo
//! (what still flows) is the witness.

use std::process::Command;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::lab::{
    self, dump, run_with_timeout, Closed, Lab, RawConn, BANNER, BANNER_PORT, DEFAULT_POLICY,
};

const SECS5: Duration = Duration::from_secs(5);

/// How far into the test the timed rule ends: past the lab's start-up,
/// with the tunnel opened and checked before it.
const LEAD: Duration = Duration::from_secs(12);
/// The end reaches the live tunnel within this (the revocation is queued
/// at the instant, the tunnel cut at once); the margin is the test's.
const CLOSED_WITHIN: Duration = Duration::from_secs(3);

fn tunnel(lab: &Lab, host: &str) -> RawConn {
    let mut c = lab.client_conn();
    assert_eq!(
        c.connect(&format!("{host}:{BANNER_PORT}")),
        200,
        "CONNECT {host}"
    );
    assert!(
        c.read_until(BANNER.as_bytes(), SECS5).is_some(),
        "{host}: no banner"
    );
    c
}

fn echo(c: &mut RawConn, line: &str) -> bool {
    c.send(line.as_bytes()).is_ok() && c.read_until(line.as_bytes(), SECS5).is_some()
}

#[test]
fn a_rule_ends_and_another_begins_at_their_instant_without_a_reload() {
    let end = SystemTime::now() + LEAD;
    let end_text = humantime::format_rfc3339_seconds(end).to_string();
    // The second boundary: the instant the text names (whole seconds).
    let end = humantime::parse_rfc3339(&end_text).unwrap();
    let lab = Lab::builder()
        .policy(&format!(
            "{DEFAULT_POLICY}
[[org.allow]]
id = \"timed\"
host = \"allowed.test\"
ports = [{BANNER_PORT}]
tunnel = \"opaque\"
expires = \"{end_text}\"

[[org.allow]]
id = \"later\"
host = \"other.test\"
ports = [{BANNER_PORT}]
tunnel = \"opaque\"
not_before = \"{end_text}\"
"
        ))
        .start();
    let hash = crate::revoke::served_hash(&lab);
    assert!(
        SystemTime::now() < end,
        "the lab started too late for the test"
    );

    // Before the instant: the timed rule matches, the later one does not.
    let mut live = tunnel(&lab, "allowed.test");
    assert!(echo(&mut live, "before\n"), "no echo before the end");
    let mut early = lab.client_conn();
    assert_eq!(early.connect(&format!("other.test:{BANNER_PORT}")), 403);
    let id = lab.wait_evidence("the timed tunnel's decision", |v| {
        v["event"] == "decision"
            && v["host"] == "allowed.test"
            && v["decision"] == "allow"
            && v["rule"] == "timed"
    })["id"]
        .as_str()
        .unwrap()
        .to_string();

    // At the instant: the live tunnel is closed and recorded.
    let wait = end.duration_since(SystemTime::now()).unwrap_or_default();
    let _ = live.send(b"across\n");
    let closed = live.wait_closed(wait + CLOSED_WITHIN);
    let Closed::After(_) = closed else {
        panic!("tunnel still open {CLOSED_WITHIN:?} after its rule expired");
    };
    let late = SystemTime::now()
        .duration_since(end)
        .unwrap_or_else(|e| panic!("closed {:?} before the rule's end", e.duration()));
    eprintln!("timed rule: tunnel closed {late:?} after the rule's end");
    let r = lab.wait_evidence("the revocation", |v| {
        v["event"] == "decision" && v["conn"] == id.as_str()
    });
    assert_eq!(
        (&r["decision"], &r["reason"], &r["org"]),
        (
            &Value::from("deny"),
            &Value::from("policy_revoked"),
            &Value::from("acme")
        ),
        "{r}"
    );
    assert_eq!(
        r["detail"],
        format!("rule timed expired at {end_text}").as_str(),
        "{r}"
    );
    lab.wait_evidence("the close record", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });

    // After it: refused (the name keeps only its web ports); the later
    // rule matches; no reload.
    let mut again = lab.client_conn();
    assert_eq!(again.connect(&format!("allowed.test:{BANNER_PORT}")), 403);
    lab.wait_evidence("the refusal after the end", |v| {
        v["event"] == "decision"
            && v["host"] == "allowed.test"
            && v["port"] == BANNER_PORT
            && v["reason"] == "port_not_allowed"
    });
    let mut now_open = tunnel(&lab, "other.test");
    assert!(echo(&mut now_open, "later\n"), "no echo under not_before");
    let opened = lab.wait_evidence("the later rule's decision", |v| {
        v["event"] == "decision" && v["host"] == "other.test" && v["decision"] == "allow"
    });
    assert_eq!(opened["rule"], "later", "{}", dump(&lab.evidence()));
    assert_eq!(crate::revoke::served_hash(&lab), hash, "a reload happened");
    let reloads =
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"ok\"}");
    assert_eq!(reloads, 0.0, "a rule's instant is counted as a reload");

    // `palisade check` warns about the expired rule, and still passes.
    let out = run_with_timeout(
        Command::new(lab::palisade_bin()).args(["check", "-c", lab.config_path.to_str().unwrap()]),
        None,
        lab::CMD_TIMEOUT,
    );
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(
        out.stdout.contains(&format!(
            "warning: rule timed of org acme expired (until {end_text})"
        )),
        "{}",
        out.describe()
    );
    assert!(!out.stdout.contains("rule later"), "{}", out.describe());
}
