//! One org's export of a gateway's evidence for two orgs written under
//! load: acme's export verifies with the key alone (and with the
//! independent verifier, tests/fixtures/verify_proof.py), holds nothing
//! of beta, and a copy with a record removed or a beta record spliced in
//! fails.

use crate::lab::{self, run_with_timeout, Lab, CLIENT2_IP, OTHER_IP, PROXY_URL};
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

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
host = "other.test"
ports = [80]
"#;

fn palisade(args: &[&str]) -> lab::CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        Duration::from_secs(60),
    )
}

/// `PAR` loops of `n` proxied GETs each, in parallel, bounded by count
/// and each request by time.
fn load(host: &str, n: u32) -> String {
    format!(
        "for p in 1 2 3 4; do (for i in $(seq 1 {n}); do curl -q -s -o /dev/null --max-time 5 \
         -x {PROXY_URL} http://{host}/ ; curl -q -s -o /dev/null --max-time 5 -x {PROXY_URL} \
         http://{host}.denied.test/; done) & done; wait"
    )
}

/// `verify-export` and the independent verifier on `dir`: they agree;
/// returns `verify-export`'s output.
fn check(dir: &Path, key: &str) -> lab::CmdOutput {
    let d = dir.to_str().unwrap();
    let ours = palisade(&["evidence", "verify-export", d, "--key", key]);
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/verify_proof.py"
    );
    let theirs = Command::new("/usr/bin/python3")
        .args([fixture, "--export", d, key])
        .output()
        .expect("run tests/fixtures/verify_proof.py");
    let out = String::from_utf8_lossy(&theirs.stdout);
    assert_eq!(
        theirs.status.success(),
        ours.success(),
        "{d}: the independent verifier disagrees: {out}{}\nverify-export: {}",
        String::from_utf8_lossy(&theirs.stderr),
        ours.describe()
    );
    ours
}

fn copy(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for f in ["records.jsonl", "proofs.json", "manifest.json"] {
        fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

#[test]
fn an_orgs_export_is_complete_holds_nothing_of_another_and_tampered_copies_fail() {
    let mut lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .evidence_config("checkpoint_every = 16")
        .start();
    let cfg = lab.config_path.display().to_string();
    let key = palisade(&["evidence", "pubkey", "-c", &cfg]);
    assert!(key.success(), "{}", key.describe());
    let key = key.stdout.trim().to_string();
    std::thread::scope(|s| {
        let a = s.spawn(|| lab.exec(&lab.ns_client, "bash", &["-c", &load("allowed.test", 25)]));
        let b = s.spawn(|| lab.exec(&lab.ns_client2, "bash", &["-c", &load("other.test", 25)]));
        a.join().unwrap();
        b.join().unwrap();
    });
    lab.signal_proxy("-TERM");
    let st = lab.wait_proxy_exit(Duration::from_secs(10)).expect("exit");
    assert_eq!(st.code(), Some(0), "{}", lab.proxy_output());
    let records = lab.evidence();
    let of = |org: &str| records.iter().filter(|r| r["org"] == org).count();
    assert!(
        of("acme") >= 150 && of("beta") >= 150,
        "acme {} beta {}",
        of("acme"),
        of("beta")
    );

    let dir = lab.evidence_dir.display().to_string();
    let out = lab.dir.join("acme-export");
    let e = palisade(&[
        "evidence",
        "export",
        &dir,
        "--org",
        "acme",
        "--proofs",
        "--out",
        out.to_str().unwrap(),
        "--key",
        &key,
    ]);
    assert!(e.success(), "{}", e.describe());
    let ok = check(&out, &key);
    assert!(ok.success(), "{}", ok.describe());
    // Every acme record is in the export (the store is sealed: the seal
    // signs them all).
    assert!(
        ok.stdout
            .contains(&format!("export of org acme: {} records", of("acme"))),
        "{}",
        ok.stdout
    );
    // What the proofs cost (for the closing note): bytes per export
    // file and per checkpoint line.
    let size = |f: &str| fs::metadata(out.join(f)).map(|m| m.len()).unwrap_or(0);
    let ckpt: Vec<usize> = records
        .iter()
        .filter(|r| r["event"] == "checkpoint")
        .map(|r| r.to_string().len() + 1)
        .collect();
    eprintln!(
        "cost: export of {} records: records.jsonl {} B, proofs.json {} B, manifest.json {} B; {} checkpoints of {}..{} B",
        of("acme"),
        size("records.jsonl"),
        size("proofs.json"),
        size("manifest.json"),
        ckpt.len(),
        ckpt.iter().min().unwrap_or(&0),
        ckpt.iter().max().unwrap_or(&0)
    );
    // Nothing of beta: its name, its sandbox's address, its target's name
    // and address.
    for f in ["records.jsonl", "proofs.json", "manifest.json"] {
        let text = fs::read_to_string(out.join(f)).unwrap();
        for beta in ["beta", CLIENT2_IP, "other.test", OTHER_IP] {
            assert!(!text.contains(beta), "{f} holds {beta:?}");
        }
    }

    // A copy with one acme record removed fails, naming where.
    let lines: Vec<String> = fs::read_to_string(out.join("records.jsonl"))
        .unwrap()
        .lines()
        .map(|l| format!("{l}\n"))
        .collect();
    let removed = lab.dir.join("removed");
    copy(&out, &removed);
    let mut l = lines.clone();
    l.remove(40);
    fs::write(removed.join("records.jsonl"), l.concat()).unwrap();
    let bad = check(&removed, &key);
    assert_eq!(bad.code(), Some(1), "{}", bad.describe());
    assert!(bad.stdout.contains("record removed"), "{}", bad.stdout);
    // A copy with a beta record spliced in fails, naming it.
    let beta = records
        .iter()
        .find(|r| r["org"] == "beta" && r["event"] == "decision")
        .unwrap();
    let spliced = lab.dir.join("spliced");
    copy(&out, &spliced);
    let mut l = lines.clone();
    l.insert(20, format!("{}\n", canonical(beta)));
    fs::write(spliced.join("records.jsonl"), l.concat()).unwrap();
    let bad = check(&spliced, &key);
    assert_eq!(bad.code(), Some(1), "{}", bad.describe());
    assert!(
        bad.stdout.contains("a record of another org"),
        "{}",
        bad.stdout
    );
    // A manifest that disagrees with its records fails.
    let manifest = lab.dir.join("manifest");
    copy(&out, &manifest);
    let p = manifest.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    m["records"] = (lines.len() + 1).into();
    fs::write(&p, m.to_string()).unwrap();
    let bad = check(&manifest, &key);
    assert_eq!(bad.code(), Some(1), "{}", bad.describe());
    assert!(bad.stdout.contains("manifest"), "{}", bad.stdout);
}

/// A record's line as the chain writes it: keys sorted, no whitespace.
fn canonical(v: &serde_json::Value) -> String {
    // serde_json's map is sorted (no preserve_order): to_string is the
    // canonical form for the ASCII records of the lab.
    v.to_string()
}
