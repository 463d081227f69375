//! Witnesses: a gateway with `[evidence] witnesses` submits each new
//! checkpoint to a witness written from the tlog-witness spec
//! (tests/fixtures/witness.py); the witness cosigns, and `verify
//! --witness-key` and `verify-export --witness-key` pass (the independent
//! verifier agrees on the export). Then the store is rewritten (cut back
//! to an earlier checkpoint, and continued by the gateway restarted on it,
//! which signs the new history with the same key): the chain still
//! verifies with the key alone, the witness refuses the next checkpoint,
//! the refusal is recorded and counted, and `verify --witness-key` fails
//! naming the checkpoint.

use crate::lab::{self, run_with_timeout, Background, Lab, DNS_IP, PROXY_URL};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80]
"#;

const WITNESS_NAME: &str = "witness.test/w1";
const WITNESS_SEED: &str = "0707070707070707070707070707070707070707070707070707070707070707";
const WITNESS_PORT: u16 = 8099;

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn palisade(args: &[&str]) -> lab::CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        Duration::from_secs(60),
    )
}

fn witness_vkey(name: &str, seed: &str) -> String {
    let out = Command::new("/usr/bin/python3")
        .args([
            &fixture("witness.py"),
            "--print-vkey",
            "--name",
            name,
            "--seed",
            seed,
        ])
        .output()
        .expect("run witness.py");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn start_witness(lab: &Lab, log_key: &str) -> Background {
    let state = lab.dir.join("witness-state.json");
    lab.spawn_upstream_server(
        "witness.py",
        "/usr/bin/python3",
        [
            fixture("witness.py"),
            "--listen".into(),
            format!("{DNS_IP}:{WITNESS_PORT}"),
            "--state".into(),
            state.display().to_string(),
            "--name".into(),
            WITNESS_NAME.into(),
            "--seed".into(),
            WITNESS_SEED.into(),
            "--log-origin".into(),
            "palisade/gw-w".into(),
            "--log-key".into(),
            log_key.into(),
        ],
    )
}

/// `n` proxied GETs, bounded by count and each by time.
fn traffic(lab: &Lab, n: u32) {
    let script = format!(
        "for i in $(seq 1 {n}); do curl -q -s -o /dev/null --max-time 5 -x {PROXY_URL} http://allowed.test/; done"
    );
    lab.exec(&lab.ns_client, "bash", &["-c", &script]);
}

fn witness_lines(dir: &Path, event: &str) -> Vec<serde_json::Value> {
    fs::read_to_string(dir.join("witness/cosignatures.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

/// Poll (bounded) until the cosignatures file holds a line of `event`.
fn wait_for(dir: &Path, event: &str, lab: &Lab) -> Vec<serde_json::Value> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let l = witness_lines(dir, event);
        if !l.is_empty() {
            return l;
        }
        assert!(
            Instant::now() < end,
            "no {event:?} witness line after 60 s\n{}",
            lab.proxy_output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn metrics(lab: &Lab) -> String {
    lab.proxy_ns_exec(
        "curl",
        &[
            "-s",
            "--max-time",
            "5",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    )
    .stdout
}

fn stop(lab: &mut Lab) {
    lab.signal_proxy("-TERM");
    let st = lab.wait_proxy_exit(Duration::from_secs(30)).expect("exit");
    assert_eq!(st.code(), Some(0), "{}", lab.proxy_output());
}

/// Cut the store back to its checkpoint line of tree size `size`: every
/// line after it, and every later segment, removed.
fn cut_back(dir: &Path, size: u64) {
    let mut segs: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    segs.sort();
    let mut found = false;
    for seg in segs {
        if found {
            fs::remove_file(&seg).unwrap();
            continue;
        }
        let text = fs::read_to_string(&seg).unwrap();
        let mut kept = String::new();
        for line in text.lines() {
            kept.push_str(line);
            kept.push('\n');
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["tree_size"].as_u64() == Some(size) && v["note"].is_string() {
                found = true;
                break;
            }
        }
        if found {
            fs::write(&seg, kept).unwrap();
        }
    }
    assert!(found, "no checkpoint of tree size {size}");
}

#[test]
fn a_witness_cosigns_and_refuses_a_rewritten_history() {
    let vkey = witness_vkey(WITNESS_NAME, WITNESS_SEED);
    // A second witness nobody runs: unreachable all along.
    let down = witness_vkey("witness.test/down", &"09".repeat(32));
    let mut lab = Lab::builder()
        .policy(POLICY)
        .evidence_config(&format!(
            "checkpoint_every = 16\nreplica = \"gw-w\"\nwitnesses = [{{ url = \"http://{DNS_IP}:{WITNESS_PORT}\", key = \"{vkey}\" }}, {{ url = \"http://{DNS_IP}:{}/down\", key = \"{down}\" }}]",
            WITNESS_PORT - 1
        ))
        .start();
    let cfg = lab.config_path.display().to_string();
    let key = palisade(&["evidence", "pubkey", "-c", &cfg]);
    assert!(key.success(), "{}", key.describe());
    let key = key.stdout.trim().to_string();
    // The witness comes up after the gateway: until then it is unreachable
    // (a metric, not an outage: the traffic below is served).
    let _witness = start_witness(&lab, &key);
    traffic(&lab, 60);
    let cosigned = wait_for(&lab.evidence_dir, "cosigned", &lab);
    assert!(cosigned[0]["cosignature"]
        .as_str()
        .unwrap()
        .starts_with("\u{2014} witness.test/w1 "));
    let text = metrics(&lab);
    assert!(
        text.contains("palisade_witness_cosigned_total{witness=\"witness.test/w1\"}"),
        "{text}"
    );
    // The witness that is down is a metric, not an outage: every request
    // was served.
    let unreachable = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "palisade_witness_failures_total{reason=\"unreachable\",witness=\"witness.test/down\"} ",
            )
        })
        .and_then(|v| v.parse::<f64>().ok());
    assert!(unreachable.is_some_and(|n| n >= 1.0), "{text}");
    let served = lab
        .evidence()
        .iter()
        .filter(|r| r["event"] == "decision" && r["decision"] == "allow")
        .count();
    assert_eq!(served, 60, "every request served with a witness down");
    stop(&mut lab);

    let dir = lab.evidence_dir.display().to_string();
    let ok = palisade(&[
        "evidence",
        "verify",
        &dir,
        "--key",
        &key,
        "--witness-key",
        &vkey,
    ]);
    assert!(ok.success(), "{}\n{}", ok.describe(), lab.proxy_output());
    assert!(
        ok.stdout.contains("witness witness.test/w1"),
        "{}",
        ok.stdout
    );
    // Another witness's key: not witnessed, naming the first checkpoint.
    let other = vkey.replace(WITNESS_NAME, "witness.test/w2");
    let bad = palisade(&[
        "evidence",
        "verify",
        &dir,
        "--key",
        &key,
        "--witness-key",
        &other,
    ]);
    assert_eq!(
        bad.code(),
        Some(2),
        "a key whose ID does not fit: {}",
        bad.describe()
    );
    // The export carries the cosignature; both verifiers check it.
    let out = lab.dir.join("acme-export");
    let o = out.to_str().unwrap();
    let e = palisade(&[
        "evidence", "export", &dir, "--org", "acme", "--proofs", "--out", o, "--key", &key,
    ]);
    assert!(e.success(), "{}", e.describe());
    let ve = palisade(&[
        "evidence",
        "verify-export",
        o,
        "--key",
        &key,
        "--witness-key",
        &vkey,
    ]);
    assert!(ve.success(), "{}", ve.describe());
    let py = Command::new("/usr/bin/python3")
        .args([
            &fixture("verify_proof.py"),
            "--export",
            o,
            &key,
            "--witness-key",
            &vkey,
        ])
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stdout)
    );
    let cost = fs::metadata(out.join("witness.json"))
        .map(|m| m.len())
        .unwrap_or(0);
    let line = witness_lines(&lab.evidence_dir, "cosigned")[0]
        .to_string()
        .len()
        + 1;
    eprintln!("cost: witness.json {cost} B in the export; one kept cosignature line {line} B");
    // An edited cosignature in the export fails in both.
    let wj = out.join("witness.json");
    let t = fs::read_to_string(&wj).unwrap();
    let edited = lab.dir.join("edited-export");
    fs::create_dir_all(&edited).unwrap();
    for f in ["records.jsonl", "proofs.json", "manifest.json"] {
        fs::copy(out.join(f), edited.join(f)).unwrap();
    }
    let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
    let sig = v["cosignatures"][0]["cosignature"]
        .as_str()
        .unwrap()
        .to_string();
    let flipped = {
        let mut b = sig.clone().into_bytes();
        let i = b.len() - 6;
        b[i] = if b[i] == b'A' { b'B' } else { b'A' };
        String::from_utf8(b).unwrap()
    };
    assert_ne!(sig, flipped);
    v["cosignatures"][0]["cosignature"] = flipped.into();
    fs::write(edited.join("witness.json"), v.to_string()).unwrap();
    let ed = edited.to_str().unwrap();
    let bad = palisade(&[
        "evidence",
        "verify-export",
        ed,
        "--key",
        &key,
        "--witness-key",
        &vkey,
    ]);
    assert_eq!(bad.code(), Some(1), "{}", bad.describe());
    assert!(bad.stdout.contains("end checkpoint"), "{}", bad.stdout);
    let py = Command::new("/usr/bin/python3")
        .args([
            &fixture("verify_proof.py"),
            "--export",
            ed,
            &key,
            "--witness-key",
            &vkey,
        ])
        .output()
        .unwrap();
    assert!(
        !py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stdout)
    );

    // Rewrite: back to an early checkpoint the witness cosigned past,
    // then the gateway, restarted on the cut store, signs a new history.
    let records = lab.evidence();
    let sizes: Vec<u64> = records
        .iter()
        .filter_map(|r| r["tree_size"].as_u64().filter(|_| r["note"].is_string()))
        .collect();
    assert!(sizes.len() >= 4, "{sizes:?}");
    let cut = sizes[sizes.len() / 3];
    cut_back(&lab.evidence_dir, cut);
    lab.restart_proxy();
    traffic(&lab, 20);
    let refused = wait_for(&lab.evidence_dir, "refused", &lab);
    assert!(
        refused[0]["note"]
            .as_str()
            .unwrap()
            .starts_with("palisade/gw-w\n"),
        "{:?}",
        refused[0]
    );
    let text = metrics(&lab);
    let conflicts = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("palisade_witness_conflicts_total{witness=\"witness.test/w1\"} ")
        })
        .and_then(|v| v.parse::<f64>().ok());
    assert!(conflicts.is_some_and(|c| c >= 1.0), "{text}");
    stop(&mut lab);
    // The rewritten chain verifies with the key alone: only the witness
    // tells.
    let chain = palisade(&["evidence", "verify", &dir, "--key", &key]);
    assert!(chain.success(), "{}", chain.describe());
    let bad = palisade(&[
        "evidence",
        "verify",
        &dir,
        "--key",
        &key,
        "--witness-key",
        &vkey,
    ]);
    assert_eq!(bad.code(), Some(1), "{}", bad.describe());
    assert!(bad.stdout.contains("checkpoint seq"), "{}", bad.stdout);
}
