//! Bursts of UDP queries sent at once from one socket, as a hostile
//! client sends them (`tests/fixtures/dnsburst.py`): the shim takes what
//! is queued in rounds and writes their records as one batch
//! (`src/dns/round.rs`), and still answers every query it received
//! exactly once, with its own id and question, as it would answer the
//! query alone, each with its own decision record before its answer; a
//! burst while the evidence store fails gets no allowed answer.
//!
//! Datagrams the kernel drops because the shim's receive buffer is full
//! never reach it: each test counts them (`RcvbufErrors` of the shim's
//! namespace) and holds the shim to every datagram it was given.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Lab, SHIM_IP};

const ALLOWED_IP: &str = "198.18.2.10";

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
"#;

/// One query as sent: its id, its name as spelled.
struct Sent {
    id: u16,
    name: String,
}

/// `allowed.test` in the case pattern of `i` (0x20).
fn cased(i: usize) -> String {
    "allowed.test"
        .chars()
        .enumerate()
        .map(|(k, c)| {
            if (i >> (k % 12)) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect()
}

/// Send `queries` (type A) at once from one socket; the source port and
/// every answer received, and how many of the queries the kernel dropped
/// before the shim could read them.
fn burst(lab: &Lab, queries: &[Sent]) -> (u16, Vec<Value>, u64) {
    let script = lab::fixtures_dir()
        .join("dnsburst.py")
        .display()
        .to_string();
    let specs: Vec<String> = queries
        .iter()
        .map(|q| format!("{}:{}:1", q.id, q.name))
        .collect();
    let mut args = vec![script.as_str(), "--server", SHIM_IP, "--wait", "3"];
    args.extend(specs.iter().map(String::as_str));
    let before = lab.shim_rcvbuf_drops();
    let out = lab.client_exec("python3", &args);
    let dropped = lab.shim_rcvbuf_drops() - before;
    assert!(out.success(), "dnsburst.py failed\n{}", out.describe());
    let v: Value = serde_json::from_str(out.stdout.trim()).expect("dnsburst.py output");
    let port = u16::try_from(v["port"].as_u64().unwrap()).unwrap();
    (port, v["answers"].as_array().unwrap().clone(), dropped)
}

/// Every answer belongs to exactly one query, echoes its id and its
/// question as sent; every query the shim was given has its answer.
/// Returns the answers by id.
fn one_answer_each<'a>(
    lab: &Lab,
    queries: &[Sent],
    answers: &'a [Value],
    dropped: u64,
) -> HashMap<u16, &'a Value> {
    let sent: HashMap<u16, &str> = queries.iter().map(|q| (q.id, q.name.as_str())).collect();
    let mut by_id = HashMap::new();
    for a in answers {
        let id = u16::try_from(a["id"].as_u64().unwrap_or(u64::MAX))
            .unwrap_or_else(|_| panic!("undecodable answer {a}"));
        let name = sent
            .get(&id)
            .unwrap_or_else(|| panic!("answer with an id never sent: {a}"));
        assert_eq!(a["qname"], *name, "question not echoed as sent: {a}");
        assert_eq!(a["qtype"], 1, "{a}");
        assert!(by_id.insert(id, a).is_none(), "id {id} answered twice");
    }
    assert_eq!(
        by_id.len() as u64 + dropped,
        queries.len() as u64,
        "{} answered, {dropped} dropped by the kernel, of {} sent\n{}",
        by_id.len(),
        queries.len(),
        lab.proxy_output()
    );
    by_id
}

/// The DNS records of queries from `port`.
fn records_from(lab: &Lab, port: u16) -> Vec<Value> {
    let from = format!("{}:{port}", lab::CLIENT_IP);
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "dns" && v["client"] == from.as_str())
        .collect()
}

/// Poll (bounded) until `n` records of queries from `port` are in the
/// evidence (refusals ride the next batch), then hold it to exactly `n`.
fn wait_records(lab: &Lab, port: u16, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let recs = records_from(lab, port);
        if recs.len() >= n || Instant::now() >= deadline {
            assert_eq!(
                recs.len(),
                n,
                "records of the burst\n{}",
                lab.proxy_output()
            );
            return recs;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn verify(lab: &Lab) {
    let v = crate::evidence::verify_inside(lab);
    assert!(v.success(), "evidence verify:\n{}", v.describe());
}

/// A lab whose shim has answered `allowed.test` once (so the bursts are
/// answered from the kept answer), with `builder`'s settings.
fn warm_lab(builder: lab::LabBuilder) -> Lab {
    let lab = builder
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .start();
    let d = lab.dig(&["allowed.test", "A"]);
    assert_eq!(d.of("A"), [ALLOWED_IP], "{}", d.output);
    lab
}

#[test]
fn a_burst_from_one_socket_is_answered_and_recorded_once_per_query() {
    let lab = warm_lab(Lab::builder());
    let queries: Vec<Sent> = (0..500)
        .map(|i| Sent {
            id: 1000 + i as u16,
            name: cased(i),
        })
        .collect();
    let (port, answers, dropped) = burst(&lab, &queries);
    let by_id = one_answer_each(&lab, &queries, &answers, dropped);
    assert!(
        by_id.len() >= 100,
        "only {} of 500 reached the shim",
        by_id.len()
    );
    for a in by_id.values() {
        assert_eq!(a["rcode"], 0, "{a}");
        assert_eq!(a["a"], serde_json::json!([ALLOWED_IP]), "{a}");
    }
    // One decision record per answered query, each its own.
    let recs = wait_records(&lab, port, by_id.len());
    let mut ids: Vec<&str> = recs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), recs.len());
    for r in &recs {
        assert_eq!(r["decision"], "allow", "{r}");
        assert_eq!(r["host"], "allowed.test", "{r}");
    }
    verify(&lab);
}

#[test]
fn a_mixed_burst_is_answered_each_as_when_sent_alone() {
    let lab = warm_lab(Lab::builder().dns_extra("max_queries_per_second_per_client = 50"));
    // The client's bucket fills up again.
    std::thread::sleep(Duration::from_millis(1200));
    let queries: Vec<Sent> = (0..200)
        .map(|i| Sent {
            id: 2000 + i as u16,
            name: if i % 2 == 0 {
                cased(i)
            } else {
                format!("n{i}.nope.test")
            },
        })
        .collect();
    let (port, answers, dropped) = burst(&lab, &queries);
    let by_id = one_answer_each(&lab, &queries, &answers, dropped);
    let (mut allowed, mut denied, mut over) = (0, 0, 0);
    for q in &queries {
        let Some(a) = by_id.get(&q.id) else { continue };
        let ede = a["ede"].as_str().unwrap_or_default();
        if ede.contains("limit_exceeded") {
            // Over the client's rate: refused, whatever it asked.
            assert_eq!(a["rcode"], 5, "{a}");
            assert!(ede.starts_with("15 "), "{a}");
            assert_eq!(a["a"], serde_json::json!([]), "{a}");
            over += 1;
        } else if q.name.eq_ignore_ascii_case("allowed.test") {
            assert_eq!(a["rcode"], 0, "{a}");
            assert_eq!(a["a"], serde_json::json!([ALLOWED_IP]), "{a}");
            assert!(a["ede"].is_null(), "{a}");
            allowed += 1;
        } else {
            assert_eq!(a["rcode"], 5, "{a}");
            assert!(
                ede.starts_with("15 ") && ede.contains("no_matching_rule"),
                "{a}"
            );
            assert_eq!(a["a"], serde_json::json!([]), "{a}");
            denied += 1;
        }
    }
    assert!(
        allowed > 0 && denied > 0,
        "{allowed} allowed, {denied} denied"
    );
    assert!(over >= 50, "only {over} over the rate of 50/s");
    // Every query answered has its record: allowed ones written before
    // their answers, refusals queued (none was summarised: the queue has
    // room).
    let recs = wait_records(&lab, port, by_id.len());
    let reasons = |r: &str| recs.iter().filter(|v| v["reason"] == r).count();
    assert_eq!(reasons("limit_exceeded"), over);
    assert_eq!(reasons("no_matching_rule"), denied);
    assert_eq!(
        recs.iter().filter(|v| v["decision"] == "allow").count(),
        allowed
    );
    verify(&lab);
}

#[test]
fn a_burst_while_the_evidence_store_fails_gets_no_allowed_answer() {
    let lab = warm_lab(Lab::builder().evidence_tmpfs("512k"));
    let fill = crate::evidence::fill_evidence_tmpfs(&lab);
    // Records still fit in the segment's last page for a few queries.
    let mut served = 0;
    loop {
        let d = lab.dig(&["allowed.test", "A"]);
        if d.status == "SERVFAIL" {
            break;
        }
        assert_eq!(d.of("A"), [ALLOWED_IP], "{}", d.output);
        served += 1;
        assert!(served < 60, "writes kept succeeding on a full disk");
    }
    let queries: Vec<Sent> = (0..200)
        .map(|i| Sent {
            id: 3000 + i as u16,
            name: cased(i),
        })
        .collect();
    let (_, answers, dropped) = burst(&lab, &queries);
    let by_id = one_answer_each(&lab, &queries, &answers, dropped);
    assert!(!by_id.is_empty());
    // SERVFAIL (the record could not be written), or REFUSED once the
    // org's share of the full store is spent: never an answer.
    for a in by_id.values() {
        let refused = a["rcode"] == 5
            && a["ede"]
                .as_str()
                .is_some_and(|e| e.contains("limit_exceeded"));
        assert!(
            a["rcode"] == 2 || refused,
            "an answer left without its record: {a}"
        );
        assert_eq!(a["a"], serde_json::json!([]), "{a}");
    }
    // Once the disk has room again, answers come back and the chain holds.
    let rm = lab.proxy_mnt_exec("rm", &["-f", &fill]);
    assert!(rm.success(), "{}", rm.describe());
    lab::wait_until("an answer again", Duration::from_secs(10), || {
        lab.dig(&["allowed.test", "A"]).of("A") == [ALLOWED_IP]
    });
    verify(&lab);
}
