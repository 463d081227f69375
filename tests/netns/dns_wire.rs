//! Kept answers sent from the wire (`src/dns/wire.rs`), seen by `dig`: the
//! id and the name's case (0x20) as the client sent them, TTLs counted
//! down while the answer is kept and whole again once it expired, every
//! query recorded with its own org, another org's query in another case
//! answered as its own, a name a reload revokes refused at once in any
//! case, and hostile bytes around a kept question answered as before.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::dns::{dig2, message, raw_cases_then_allowed};
use crate::lab::{self, Dig, Lab, CLIENT2_IP, CLIENT_IP};
use crate::revoke::reload;

const SECS5: Duration = Duration::from_secs(5);

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
id = "allowed"
host = "allowed.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
"#;

/// Answers are kept (and their TTLs clamped to) 3 s.
fn wire_lab() -> Lab {
    Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra("min_ttl = \"1s\"\nmax_ttl = \"3s\"\n")
        .second_client()
        .start()
}

/// The answer section's TTLs.
fn ttls(d: &Dig) -> Vec<u32> {
    let section = d.output.split(";; ANSWER SECTION:").nth(1).unwrap_or("");
    section
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty() && !l.starts_with(';'))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect()
}

/// The question as the response carried it (dig prints it as received).
fn question(d: &Dig) -> String {
    let section = d.output.split(";; QUESTION SECTION:").nth(1).unwrap_or("");
    let line = section.lines().nth(1).unwrap_or("");
    line.trim_start_matches(';')
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

fn allowed(d: &Dig, what: &str) {
    assert_eq!(d.status, "NOERROR", "{what}: {}", d.output);
    assert_eq!(d.of("A"), [lab::ALLOWED_IP], "{what}: {}", d.output);
}

/// Decision records of allowed.test, in order.
fn records(lab: &Lab) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "dns" && v["event"] == "decision" && v["host"] == "allowed.test")
        .collect()
}

#[test]
fn kept_answers_echo_id_and_case_count_ttls_down_and_expire() {
    let lab = wire_lab();
    let first = lab.dig(&["allowed.test", "A"]);
    let t0 = Instant::now();
    allowed(&first, "first");
    assert_eq!(ttls(&first), [3], "{}", first.output);

    // Kept: the name in the case it was asked (dig checks the id itself),
    // with EDNS, without, over TCP.
    let mut asked = 1;
    for (name, opts) in [
        ("AlLoWeD.TeSt", vec![]),
        ("ALLOWED.test", vec!["+noedns"]),
        ("allowed.TEST", vec!["+bufsize=512"]),
        ("aLLOWED.TesT", vec!["+tcp"]),
        ("aLLOWED.TesT", vec!["+tcp"]),
        ("AlLoWeD.TeSt", vec!["+cdflag"]),
    ] {
        let mut args = vec![name, "A"];
        args.extend(opts.iter().copied());
        let d = lab.dig(&args);
        allowed(&d, name);
        assert_eq!(d.exit, Some(0), "{name}: {}", d.output);
        assert_eq!(question(&d), format!("{name}."), "{name}: {}", d.output);
        asked += 1;
    }
    // Another org asking in another case: its own answer and record.
    let beta = dig2(&lab, &["ALLOWED.TEST", "A"]);
    allowed(&beta, "beta");
    assert_eq!(question(&beta), "ALLOWED.TEST.", "{}", beta.output);

    // Counted down while kept.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(t0.elapsed()));
    let later = lab.dig(&["AlLoWeD.test", "A"]);
    allowed(&later, "later");
    asked += 1;
    let ttl = ttls(&later);
    assert!(
        ttl.len() == 1 && ttl[0] < 3 && ttl[0] >= 1,
        "{ttl:?}: {}",
        later.output
    );
    // Past its 3 s: decided and kept again, TTL whole.
    std::thread::sleep(Duration::from_millis(3600).saturating_sub(t0.elapsed()));
    let fresh = lab.dig(&["allowed.test", "A"]);
    allowed(&fresh, "after expiry");
    asked += 1;
    assert_eq!(ttls(&fresh), [3], "{}", fresh.output);

    // Every query has its decision record, with its own org and client.
    lab::wait_until("every allowed.test record", SECS5, || {
        records(&lab).len() == asked + 1
    });
    let recs = records(&lab);
    let beta_rec: Vec<&Value> = recs.iter().filter(|r| r["org"] == "beta").collect();
    assert_eq!(beta_rec.len(), 1, "{recs:#?}");
    crate::assert_client_ip(beta_rec[0], CLIENT2_IP);
    for r in recs.iter().filter(|r| r["org"] == "acme") {
        assert_eq!(r["reason"], "rule_match", "{r}");
        assert_eq!(r["rule"], "allowed", "{r}");
        assert_eq!(r["upstream"], true, "{r}");
        assert_eq!(r["answers"], serde_json::json!(["A 198.18.2.10"]), "{r}");
        crate::assert_client_ip(r, CLIENT_IP);
    }

    // Revoked by a reload: refused at once, in any case, from the wire
    // path too; the other org keeps its answer.
    reload(&lab, |text| {
        text.replacen("host = \"allowed.test\"", "host = \"other.test\"", 1)
    });
    for name in ["allowed.test", "AlLoWeD.TeSt"] {
        let d = lab.dig(&[name, "A"]);
        assert_eq!(d.status, "REFUSED", "{name}: {}", d.output);
        assert!(d.answers.is_empty(), "{name}: {}", d.output);
        let id = d.record_id().expect("record reference in the EDE");
        let rec = lab.wait_evidence("the refusal", |v| {
            crate::record_ref(v).as_deref() == Some(id.as_str())
        });
        assert_eq!(rec["reason"], "no_matching_rule", "{rec}");
    }
    allowed(&dig2(&lab, &["allowed.test", "A"]), "beta after the reload");
}

#[test]
fn hostile_bytes_around_a_kept_question_are_answered_as_before() {
    let mut lab = wire_lab();
    allowed(&lab.dig(&["allowed.test", "A"]), "kept");
    let kept = message(0x2201, 0x0100, 1, &[("allowed.test", 1)]);
    let cases: Vec<(&str, String, &str)> = vec![
        // The kept question itself, raw: answered, its id echoed.
        ("kept", kept.clone(), "rcode=0 id=8705"),
        (
            "kept, other case",
            message(0x2202, 0x0100, 1, &[("ALLOWED.test", 1)]),
            "rcode=0 id=8706",
        ),
        // Cut short by one byte, by the class.
        ("cut", kept[..kept.len() - 2].to_string(), "rcode=1 id=8705"),
        (
            "no class",
            kept[..kept.len() - 4].to_string(),
            "rcode=1 id=8705",
        ),
        // A pointer loop where the name should be.
        (
            "pointer loop",
            format!("{}c00c00010001", &message(0x2203, 0x0100, 1, &[])),
            "rcode=1 id=8707",
        ),
        // The kept question twice.
        (
            "two questions",
            message(
                0x2204,
                0x0100,
                2,
                &[("allowed.test", 1), ("allowed.test", 1)],
            ),
            "rcode=1 id=8708",
        ),
        // A response carrying the kept question: dropped.
        (
            "response",
            message(0x2205, 0x8180, 1, &[("allowed.test", 1)]),
            "none",
        ),
        // Another class (CH): refused, not the kept IN answer.
        (
            "class CH",
            format!(
                "{}{}00010003",
                message(0x2206, 0x0100, 1, &[]),
                &kept[24..kept.len() - 8]
            ),
            "rcode=5 id=8710",
        ),
    ];
    raw_cases_then_allowed(&mut lab, &cases);
}
