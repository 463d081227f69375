//! The decider (`[decider] url`) against a real endpoint
//! (tests/fixtures/decider.py) in the proxy namespace: asked on a miss
//! only, its allow a grant (approver `decider`) the CONNECT then passes
//! on, its deny, its answer past the timeout and its garbage all denials
//! recorded with the `decider` field and counted; an always-denied
//! address (metadata, loopback, the proxy's own listener) is denied
//! without the decider being asked even though it would allow it, and a
//! name it allows that resolves into always-denied addresses stays denied.

use std::path::Path;

use serde_json::{json, Value};

use crate::lab::{self, read_jsonl, Lab, DEFAULT_POLICY};

const DECIDER: &str = "127.0.0.1:8181";

fn refused(lab: &Lab, target: &str) -> Value {
    let r = lab.raw_connect(target);
    assert_eq!(r.status, 403, "CONNECT {target}: {r:?}");
    let host = target.rsplit_once(':').unwrap().0.to_string();
    lab.wait_evidence(&format!("the refusal of {target}"), |r| {
        r["event"] == "decision" && r["kind"] == "tcp" && r["host"] == host.as_str()
    })
}

fn consultations(lab: &Lab, answer: &str) -> f64 {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    out.stdout
        .lines()
        .find(|l| {
            l.starts_with("palisade_decider_consultations_total{")
                && l.contains("org=\"acme\"")
                && l.contains(&format!("answer=\"{answer}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

fn asked(log: &Path) -> Vec<String> {
    read_jsonl(log)
        .iter()
        .map(|q| q["host"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[test]
fn the_decider_is_asked_on_a_miss_only_and_its_answers_and_failures_are_recorded() {
    lab::require_root();
    let mut lab = Lab::builder()
        .policy(&format!(
            "[decider]\nurl = \"http://{DECIDER}/decide\"\ntimeout = \"500ms\"\n{DEFAULT_POLICY}"
        ))
        .without_proxy()
        .start();
    let log = lab.dir.join("decider.jsonl");
    let script = lab::fixtures_dir().join("decider.py");
    let _decider = lab.spawn_server_in(
        &lab.ns_proxy,
        "decider",
        "python3",
        [
            script.to_str().unwrap(),
            "--listen",
            DECIDER,
            "--log",
            log.to_str().unwrap(),
            "--answer",
            "deny.test=deny",
            "--answer",
            "slow.test=slow",
            "--answer",
            "garbage.test=garbage",
        ],
    );
    lab.spawn_proxy();
    lab.wait_proxy_ready();

    // Always denied, each decided before a miss exists: the decider, which
    // would allow any of them, is never asked.
    for target in ["169.254.169.254:443", "127.0.0.1:443", lab::PROXY_ADDR] {
        let rec = refused(&lab, target);
        assert_eq!(rec["reason"], "denied_address", "{rec}");
        assert!(rec.get("decider").is_none(), "{rec}");
    }
    assert!(
        asked(&log).is_empty(),
        "asked about always-denied addresses: {:?}",
        asked(&log)
    );

    // Allow (ttl 1m): a grant given as approver `decider`, and the CONNECT
    // passes to the upstream.
    let ok = lab.proxied_curl("https://other.test/", &["-k"]);
    assert_eq!(ok.connect_status, 200, "{ok:?}");
    assert_eq!(ok.status, 200, "{ok:?}");
    let allow = lab.wait_evidence("the allow of other.test", |r| {
        r["event"] == "decision" && r["kind"] == "tcp" && r["host"] == "other.test"
    });
    assert_eq!(allow["reason"], "rule_match", "{allow}");
    assert_eq!(allow["decision"], "allow", "{allow}");
    assert_eq!(allow["decider"], json!({"decision": "allow", "ttl": "1m"}));
    let rule = allow["rule"].as_str().unwrap_or_default().to_string();
    assert!(rule.starts_with("grant:"), "{allow}");
    let granted = lab.wait_evidence("the decider's grant", |r| {
        r["kind"] == "grant" && r["event"] == "granted" && r["host"] == "other.test"
    });
    assert_eq!(granted["grant"]["approver"], "decider", "{granted}");
    assert_eq!(granted["rule"], rule.as_str(), "{granted}");
    assert_eq!(granted["port"], 443, "{granted}");

    // Deny, past the timeout, garbage: each a denial with what stood for it.
    let rec = refused(&lab, "deny.test:443");
    assert_eq!(rec["reason"], "no_matching_rule", "{rec}");
    assert_eq!(rec["decider"], json!({"decision": "deny"}), "{rec}");
    let rec = refused(&lab, "slow.test:443");
    assert_eq!(rec["reason"], "no_matching_rule", "{rec}");
    assert_eq!(
        rec["decider"],
        json!({"decision": "deny", "error": "timeout after 500ms"}),
        "{rec}"
    );
    let rec = refused(&lab, "garbage.test:443");
    assert_eq!(rec["reason"], "no_matching_rule", "{rec}");
    assert_eq!(rec["decider"]["decision"], "deny", "{rec}");
    let error = rec["decider"]["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("not a decider answer"), "{rec}");

    // A name it allows that resolves only into always-denied ranges: asked
    // (a miss by name), granted, and still denied at the address check.
    let rec = refused(&lab, "private.test:443");
    assert_eq!(rec["reason"], "denied_address", "{rec}");
    assert_eq!(rec["decider"]["decision"], "allow", "{rec}");

    // A plain http:// request: the question carries its method and path,
    // and the grant its allow makes opens that request only.
    let plain = lab.proxied_curl("http://other.test/dec/x", &[]);
    assert_eq!(plain.status, 200, "{plain:?}");
    let q = read_jsonl(&log)
        .into_iter()
        .find(|q| q["port"] == 80)
        .expect("the plain request's question");
    assert_eq!(
        (&q["method"], &q["path"]),
        (&json!("GET"), &json!("/dec/x")),
        "{q}"
    );
    let scoped = lab.wait_evidence("the request grant", |r| {
        r["kind"] == "grant" && r["event"] == "granted" && r["port"] == 80
    });
    assert_eq!(scoped["grant"]["method"], "GET", "{scoped}");
    assert_eq!(scoped["grant"]["path"], "/dec/x", "{scoped}");
    let other = lab.proxied_curl("http://other.test/elsewhere", &[]);
    assert_eq!(other.status, 200, "asked again, allowed again: {other:?}");

    let mut hosts = asked(&log);
    hosts.sort();
    assert_eq!(
        hosts,
        [
            "deny.test",
            "garbage.test",
            "other.test",
            "other.test",
            "other.test",
            "private.test",
            "slow.test"
        ],
        "each miss asked once, nothing else"
    );
    let q = &read_jsonl(&log)[0];
    assert_eq!(q["org"], "acme", "{q}");
    assert_eq!(q["client"], lab::CLIENT_IP, "{q}");
    assert_eq!(q["port"], 443, "{q}");
    assert_eq!(q["mode"], "explicit", "{q}");

    for (answer, n) in [("allow", 4.0), ("deny", 1.0), ("error", 2.0), ("busy", 0.0)] {
        assert_eq!(consultations(&lab, answer), n, "answer {answer}");
    }
}
