//! Evidence a sandbox cannot erase: retention never removes a segment
//! younger than `retain_min_age`, and a full store refuses the org that
//! filled it, not everyone.
//!
//! Phase 1 is the flood of the issue: no size-based retention yet and the
//! default budget, acme floods allowed requests through one keep-alive
//! connection until the evidence directory holds well over the 4 MiB the
//! next phase retains. Phase 2 restarts Palisade on the same directory
//! with a small store (`rotate_size` 1 MiB, `retain_size` 4 MiB,
//! `retain_min_age` 2 minutes) and budgets that satisfy the load-time
//! check: every segment is younger than the floor, so retention removes
//! none (without the floor it would remove the oldest, and with it the
//! record acme made before its flood) and the store is full. acme floods
//! again and is refused once it holds more than its share; beta's requests
//! during the flood all succeed and each is on record; the chain verifies.
//! Last, a config whose budgets could outrun the store is refused by
//! `palisade check` with the computed figures.
//!
//! The flood's figures are printed for the record, never asserted: the
//! machine is shared.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Lab, CLIENT2_IP, PROXY_URL};

/// acme floods from the first sandbox; beta, in the second, works.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80]

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80]
"#;

/// Phase 1: segments of 1 MiB, nothing removed for size.
const PHASE1: &str = "rotate_size = \"1MiB\"";
/// Phase 2: the small store. Three payers (acme, beta, the clients of no
/// org) x 7 records/s x 1140 bytes x 121 s, a checkpoint a second and one
/// open segment: 3.7 MiB, within 4 MiB (the check passes; 8 would not).
const BUDGET: u64 = 7;
const PHASE2: &str = "rotate_size = \"1MiB\"\nretain_size = \"4MiB\"\nretain_min_age = \"2m\"\n\
                      min_free = \"1MiB\"\nmax_records_per_second_per_org = 7";
const RETAIN_SIZE: u64 = 4 << 20;
/// Phase 1: this many requests (about 1.7 kB of evidence each, with a
/// 256-character path: over 8 MB), within this long.
const PHASE1_REQUESTS: u64 = 5_000;
const PHASE1_SECS: u64 = 60;
/// Phase 2: at most this many requests, within this long.
const PHASE2_REQUESTS: u64 = 20_000;
const PHASE2_SECS: u64 = 12;
/// beta's requests during the second flood.
const BETA_REQUESTS: usize = 30;

fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "jsonl"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn segment_count(dir: &Path) -> usize {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "jsonl"))
                .count()
        })
        .unwrap_or(0)
}

/// acme's flood through one keep-alive connection, for at most `secs` and
/// `max` requests, with 256-character paths; its counts.
fn flood(lab: &Lab, tag: &str, secs: u64, max: u64) -> Value {
    crate::full_store::start_flood(lab, tag, (secs, max, 1), 230, false).counts()
}

fn metrics(lab: &Lab) -> String {
    lab.proxy_ns_exec(
        "curl",
        &[
            "-sS",
            "--max-time",
            "5",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    )
    .stdout
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Stop Palisade cleanly (it seals) and verify the chain; verify's output.
fn stop_and_verify(lab: &mut Lab, ctx: &str) -> String {
    lab.signal_proxy("-TERM");
    let exit = lab.wait_proxy_exit(Duration::from_secs(60));
    assert!(
        exit.is_some_and(|s| s.success()),
        "{ctx}: proxy did not stop cleanly: {exit:?}\n{}",
        lab.proxy_output()
    );
    let dir = lab.evidence_dir.display().to_string();
    let v = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin()).args(["evidence", "verify", &dir]),
        None,
        Duration::from_secs(120),
    );
    assert!(v.success(), "{ctx}: evidence verify:\n{}", v.describe());
    assert!(v.stdout.starts_with("intact: "), "{ctx}: {}", v.stdout);
    v.stdout
}

fn is_acme(r: &Value) -> bool {
    r["org"] == "acme" && r["event"] == "decision"
}

#[test]
fn a_flood_cannot_erase_earlier_evidence_and_a_full_store_refuses_only_the_org_that_filled_it() {
    let mut lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .evidence_config(PHASE1)
        .start();

    // A request made before any flood, and its record.
    let before = lab.proxied_curl("http://allowed.test/before-the-flood", &[]);
    assert_eq!(before.status, 200, "{before:?}");
    let before_id = lab.wait_evidence("the record made before the flood", |r| {
        r["path"] == "/before-the-flood" && r["event"] == "decision"
    })["id"]
        .as_str()
        .expect("id")
        .to_string();

    // Phase 1: the flood fills the directory well past what phase 2 keeps.
    let dir = lab.evidence_dir.clone();
    let started = Instant::now();
    let first = flood(&lab, "fill", PHASE1_SECS, PHASE1_REQUESTS);
    let fill_secs = started.elapsed().as_secs_f64();
    stop_and_verify(&mut lab, "phase 1");
    let filled = dir_bytes(&dir);
    assert!(
        filled > RETAIN_SIZE + (1 << 20),
        "phase 1 wrote only {filled} bytes in {fill_secs:.1} s: {first}"
    );
    let segments_before = segment_count(&dir);

    // A config whose budgets could outrun the small store is refused by
    // `palisade check`, with the figures.
    let base = fs::read_to_string(&lab.config_path).expect("config");
    assert!(base.contains(PHASE1), "{base}");
    let small = base.replace(PHASE1, PHASE2);
    let too_much = lab.dir.join("too-much.toml");
    fs::write(
        &too_much,
        small.replace(
            &format!("max_records_per_second_per_org = {BUDGET}"),
            &format!("max_records_per_second_per_org = {}", BUDGET + 1),
        ),
    )
    .unwrap();
    let check = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin())
            .args(["check", "-c"])
            .arg(&too_much),
        None,
        Duration::from_secs(30),
    );
    let said = format!("{}{}", check.stdout, check.stderr);
    assert!(
        !check.success(),
        "check accepted budgets that outrun the store: {said}"
    );
    for want in [
        "retain_size 4.0MiB can be filled faster than retain_min_age 2m",
        "3 payers (2 orgs and the clients of no org) x 8 records/s x 1140 bytes",
        "lower max_records_per_second_per_org to at most 7",
        "raise retain_size to at least",
        "shorten retain_min_age to at most",
    ] {
        assert!(said.contains(want), "{want}:\n{said}");
    }
    let line = said
        .lines()
        .find(|l| l.contains("retain_size 4.0MiB"))
        .unwrap_or("");
    assert!(
        line.starts_with(&format!("{}:", too_much.display())),
        "located: {line}"
    );

    // Phase 2: the small store, over retain_size and all of it younger
    // than the floor: nothing is removed, and the store is full.
    fs::write(&lab.config_path, &small).unwrap();
    lab.restart_proxy();
    let m = metrics(&lab);
    assert_eq!(metric(&m, "palisade_evidence_store_full"), Some(1.0), "{m}");
    assert_eq!(
        segment_count(&dir),
        segments_before + 1,
        "a segment was removed"
    );

    let dir2 = dir.clone();
    let flooding = std::thread::scope(|s| {
        let flooder = s.spawn(|| flood(&lab, "full", PHASE2_SECS, PHASE2_REQUESTS));
        // beta, meanwhile: every request succeeds (its budget, 7 a second,
        // is not what is tested: a request every 250 ms stays within it).
        let mut beta = Vec::new();
        std::thread::sleep(Duration::from_secs(1));
        for i in 0..BETA_REQUESTS {
            let path = format!("/beta-{i}");
            let r = lab.curl_in(
                &lab.ns_client2,
                &["-x", PROXY_URL, &format!("http://allowed.test{path}")],
            );
            assert_eq!(r.status, 200, "beta request {i} during the flood: {r:?}");
            beta.push((path, r.local_port));
            std::thread::sleep(Duration::from_millis(250));
        }
        (flooder.join().expect("flooder"), beta)
    });
    let (second, beta) = flooding;
    let m = metrics(&lab);
    assert_eq!(
        metric(&m, "palisade_evidence_over_share{org=\"acme\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "palisade_evidence_over_share{org=\"beta\"}"),
        Some(0.0),
        "{m}"
    );
    let shown = stop_and_verify(&mut lab, "phase 2");
    assert!(!shown.contains("removed by retention"), "{shown}");
    let kept = dir_bytes(&dir2);
    assert!(kept > RETAIN_SIZE, "{kept}");

    // The record made before the flood is still there.
    let records = lab.evidence();
    assert!(
        records.iter().any(|r| r["id"] == before_id.as_str()),
        "the record {before_id} made before the flood is gone"
    );

    // acme was refused once over its share: on record one by one while it
    // could be, and summarised.
    assert!(second["store_full"].as_u64().unwrap_or(0) > 0, "{second}");
    let full = "evidence store full for this org";
    let refused = |r: &&Value| {
        is_acme(r)
            && r["reason"] == "limit_exceeded"
            && r["detail"].as_str().is_some_and(|d| d.ends_with(full))
    };
    let one_by_one = records
        .iter()
        .filter(refused)
        .filter(|r| r["count"].is_null())
        .count();
    // A summary names the first refusal's detail.
    let summarised: u64 = records
        .iter()
        .filter(refused)
        .filter_map(|r| r["count"].as_u64())
        .sum();
    assert!(summarised > 0, "no summary of acme's store-full refusals");

    // beta: every request on record (its decision names its path and port).
    for (path, port) in &beta {
        let client = format!("{CLIENT2_IP}:{}", port.expect("curl's local port"));
        assert!(
            records.iter().any(|r| r["org"] == "beta"
                && r["event"] == "decision"
                && r["decision"] == "allow"
                && r["path"] == path.as_str()
                && r["client"] == client.as_str()),
            "beta's {path} from {client} is not on record"
        );
    }

    let acme_allowed = records
        .iter()
        .filter(|r| is_acme(r) && r["decision"] == "allow")
        .count();
    println!(
        "retention flood figures:\n  phase 1 (no size retention, default budget): {first}; the directory grew to {filled} bytes in {} segments in {fill_secs:.1} s\n  \
         phase 2 (rotate_size 1MiB, retain_size 4MiB, retain_min_age 2m, {BUDGET} records/s per org): store full at start ({} segments kept, none removed); acme {second}; \
         store-full refusals on record: {one_by_one} one by one, {summarised} in summaries; beta {} of {} requests served and on record; {kept} bytes kept; \
         acme allows on record over both phases: {acme_allowed}",
        segments_before,
        segments_before + 1,
        beta.len(),
        BETA_REQUESTS,
    );
}
