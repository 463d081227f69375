//! Evidence under stress, with a real process and real files: a crash
//! mid-load, a full disk and an unwritable directory.

use crate::lab::{self, run_with_timeout, wait_until, Lab, DEFAULT_POLICY, PROXY_URL};
use std::collections::HashSet;
use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

fn palisade(args: &[&str]) -> lab::CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        Duration::from_secs(60),
    )
}

/// A bash loop of `n` proxied GETs, one connection each, printing
/// "STATUS LOCAL_PORT" per request.
fn load_script(n: u32) -> String {
    format!(
        "for i in $(seq 1 {n}); do curl -q -s -o /dev/null --max-time 5 -w '%{{http_code}} %{{local_port}}\\n' \
         -x {PROXY_URL} http://allowed.test/; done"
    )
}

/// Client ports of requests that got 200 from the outputs.
fn allowed_ports(outputs: &[std::path::PathBuf]) -> Vec<u16> {
    outputs
        .iter()
        .flat_map(|p| {
            fs::read_to_string(p)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.strip_prefix("200 ").and_then(|p| p.trim().parse().ok()))
                .collect::<Vec<u16>>()
        })
        .collect()
}

#[test]
fn kill_9_mid_load_then_restart_keeps_every_allowed_decision() {
    let mut lab = Lab::builder()
        .evidence_config("checkpoint_interval = \"200ms\"")
        .start();
    let cfg = lab.config_path.display().to_string();
    let key = palisade(&["evidence", "pubkey", "-c", &cfg]);
    assert!(key.success(), "{}", key.describe());
    let key = key.stdout.trim().to_string();
    assert_eq!(key.len(), 64, "{key}");

    // Two parallel clients; Palisade is killed while they run.
    let outs: Vec<_> = (0..2)
        .map(|i| lab.dir.join(format!("load-{i}.out")))
        .collect();
    let mut clients: Vec<_> = outs
        .iter()
        .map(|o| lab.client_spawn(&load_script(150), o))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    while allowed_ports(&outs).len() < 40 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        allowed_ports(&outs).len() >= 40,
        "load did not get going\n{}",
        lab.proxy_output()
    );
    lab.kill_proxy_hard();
    for c in &mut clients {
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "load client did not finish");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let before_crash = allowed_ports(&outs).len();

    // Between runs, the chain is intact but unsealed.
    let dir = lab.evidence_dir.display().to_string();
    let v = palisade(&["evidence", "verify", &dir, "--key", &key]);
    assert_eq!(
        v.code(),
        Some(1),
        "unsealed chain accepted:\n{}",
        v.describe()
    );
    assert!(v.stdout.contains("not sealed"), "{}", v.describe());
    let v = palisade(&[
        "evidence",
        "verify",
        &dir,
        "--key",
        &key,
        "--allow-unsealed",
    ]);
    assert!(v.success(), "{}", v.describe());

    lab.restart_proxy();
    let out2 = lab.dir.join("load-after.out");
    let mut c = lab.client_spawn(&load_script(40), &out2);
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "second load did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    lab.signal_proxy("-TERM");
    let st = lab.wait_proxy_exit(Duration::from_secs(10)).expect("exit");
    assert_eq!(st.code(), Some(0), "{}", lab.proxy_output());

    let v = palisade(&["evidence", "verify", &dir, "--key", &key]);
    assert!(
        v.success(),
        "verify after crash + restart:\n{}",
        v.describe()
    );
    assert!(v.stdout.contains("end: sealed"), "{}", v.stdout);

    // Every connection a client saw allowed has its decision record.
    let mut all = outs.clone();
    all.push(out2);
    let ports = allowed_ports(&all);
    assert!(ports.len() >= before_crash + 30, "{} allowed", ports.len());
    let recorded: HashSet<String> = lab
        .evidence()
        .iter()
        .filter(|r| r["event"] == "decision" && r["decision"] == "allow")
        .filter_map(|r| r["client"].as_str().map(String::from))
        .collect();
    for p in &ports {
        let client = format!("{}:{p}", lab::CLIENT_IP);
        assert!(
            recorded.contains(&client),
            "client saw 200 on port {p} but no allow record"
        );
    }
    // The restart recorded the crashed predecessor.
    let headers: Vec<_> = lab
        .evidence()
        .into_iter()
        .filter(|r| r["event"] == "segment_start")
        .collect();
    assert_eq!(headers.len(), 2, "{}", lab::dump(&headers));
    assert_eq!(headers[1]["start"], "recover", "{}", headers[1]);
    // `crash` if records followed the last checkpoint when it died,
    // `checkpoint` if the load had gone quiet and a timed checkpoint was last.
    let end = headers[1]["predecessor"]["end"].as_str();
    assert!(
        matches!(end, Some("crash" | "checkpoint")),
        "{}",
        headers[1]
    );
}

/// A proxied GET; returns (status, body).
fn get(lab: &Lab) -> (u16, String) {
    let r = lab.proxied_curl("http://allowed.test/", &[]);
    (r.status, r.body)
}

fn assert_evidence_unavailable(lab: &Lab, what: &str) {
    let (status, body) = get(lab);
    assert_eq!(status, 503, "{what}: {body}\n{}", lab.proxy_output());
    assert!(body.contains("evidence_unavailable"), "{what}: {body}");
    assert_eq!(lab.admin_status("/readyz"), 503, "{what}: still ready");
    // SREs see it too: the write-error counter has risen and readiness is 0.
    let errors = crate::metrics::scalar_from_scrape(lab, "palisade_evidence_write_errors_total");
    assert!(
        errors >= 1.0,
        "{what}: palisade_evidence_write_errors_total = {errors}"
    );
    assert_eq!(
        crate::metrics::scalar_from_scrape(lab, "palisade_ready"),
        0.0,
        "{what}"
    );
    // Nothing reached the upstream for the refused request.
}

fn wait_recovered(lab: &Lab, what: &str) {
    wait_until(
        &format!("{what}: /readyz 200 again"),
        Duration::from_secs(10),
        || lab.admin_status("/readyz") == 200,
    );
    let (status, body) = get(lab);
    assert_eq!(
        status,
        200,
        "{what}: after recovery: {body}\n{}",
        lab.proxy_output()
    );
}

/// Verify the evidence inside Palisade's mount namespace (tmpfs).
pub(crate) fn verify_inside(lab: &Lab) -> lab::CmdOutput {
    let dir = lab.evidence_dir.display().to_string();
    lab.proxy_mnt_exec(
        lab::palisade_bin(),
        &["evidence", "verify", &dir, "--allow-unsealed"],
    )
}

/// Fill the lab's evidence tmpfs (dd stops at ENOSPC); the file that
/// fills it, to be removed to free it again.
pub(crate) fn fill_evidence_tmpfs(lab: &Lab) -> String {
    let fill = format!("{}/fill", lab.evidence_dir.display());
    let dd = lab.proxy_mnt_exec("dd", &["if=/dev/zero", &format!("of={fill}"), "bs=4k"]);
    assert!(dd.stderr.contains("No space left"), "{}", dd.describe());
    fill
}

#[test]
fn full_disk_denies_fails_readiness_and_recovers() {
    let lab = Lab::builder().evidence_tmpfs("512k").start();
    assert_eq!(get(&lab).0, 200, "{}", lab.proxy_output());
    let dir = lab.evidence_dir.display().to_string();
    let fill = fill_evidence_tmpfs(&lab);
    // tmpfs allocates whole pages: records still fit in the segment's last
    // page for a few requests, then a write fails.
    let mut served = 0;
    loop {
        let (status, body) = get(&lab);
        if status == 503 {
            assert!(body.contains("evidence_unavailable"), "{body}");
            break;
        }
        assert_eq!(status, 200, "{body}");
        served += 1;
        assert!(served < 40, "writes kept succeeding on a full disk");
    }
    // The last served request's close line may still be on its way.
    lab.upstream_settled();
    let upstream_before = lab.upstream_log().len();
    assert_evidence_unavailable(&lab, "disk full");
    assert_eq!(
        lab.upstream_log().len(),
        upstream_before,
        "a request reached the upstream while evidence was unavailable"
    );

    let rm = lab.proxy_mnt_exec("rm", &["-f", &fill]);
    assert!(rm.success(), "{}", rm.describe());
    wait_recovered(&lab, "disk freed");

    let v = verify_inside(&lab);
    assert!(v.success(), "verify after outage:\n{}", v.describe());
    let outage = lab.proxy_mnt_exec("grep", &["-rh", "\"event\":\"outage\"", &dir]);
    assert!(outage.success(), "no outage record:\n{}", outage.describe());
    assert!(
        outage.stdout.contains("\"failed_writes\":"),
        "{}",
        outage.stdout
    );
}

#[test]
fn unwritable_dir_denies_fails_readiness_and_recovers() {
    // Rotation by age makes the writer create a new segment every second.
    let lab = Lab::builder()
        .evidence_tmpfs("4m")
        .evidence_config("rotate_age = \"1s\"")
        .start();
    assert_eq!(get(&lab).0, 200, "{}", lab.proxy_output());
    let dir = lab.evidence_dir.display().to_string();
    // A read-only bind mount over the dir, in Palisade's private namespace.
    let ro = lab.proxy_mnt_exec(
        "sh",
        &[
            "-c",
            &format!("mount --bind {dir} {dir} && mount -o remount,bind,ro {dir}"),
        ],
    );
    assert!(ro.success(), "{}", ro.describe());
    wait_until("readiness to fail", Duration::from_secs(5), || {
        lab.admin_status("/readyz") == 503
    });
    assert_evidence_unavailable(&lab, "read-only dir");

    let um = lab.proxy_mnt_exec("umount", &[&dir]);
    assert!(um.success(), "{}", um.describe());
    wait_recovered(&lab, "dir writable again");
    let v = verify_inside(&lab);
    assert!(v.success(), "verify after outage:\n{}", v.describe());
}

#[test]
fn query_and_export_read_the_live_evidence() {
    let lab = Lab::start(DEFAULT_POLICY);
    assert_eq!(get(&lab).0, 200);
    let denied = lab.proxied_curl("http://other.test/", &[]);
    assert_eq!(denied.status, 403, "{denied:?}");
    lab.wait_evidence("deny other.test", |v| v["host"] == "other.test");
    let dir = lab.evidence_dir.display().to_string();
    let q = palisade(&[
        "evidence",
        "query",
        &dir,
        "--decision",
        "deny",
        "--host",
        "other.test",
    ]);
    assert!(q.success(), "{}", q.describe());
    let rows: Vec<serde_json::Value> = q
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{}", q.stdout);
    assert_eq!(rows[0]["reason"], "no_matching_rule");
    // What the client was shown finds the record (`--ref`, or `--id`).
    let shown = denied
        .body
        .split("evidence record ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no reference in {:?}", denied.body));
    assert_eq!(rows[0]["ref"], shown, "{}", q.stdout);
    assert_ne!(rows[0]["id"], shown);
    for flag in ["--ref", "--id"] {
        let by = palisade(&["evidence", "query", &dir, flag, shown]);
        assert!(by.success(), "{}", by.describe());
        assert_eq!(by.stdout.trim(), q.stdout.trim(), "{flag}");
    }
    let t = palisade(&["evidence", "query", &dir, "--org", "acme", "--table"]);
    assert!(t.stdout.lines().count() >= 3, "{}", t.stdout);
    let x = palisade(&["evidence", "export", &dir, "--format", "ocsf"]);
    assert!(x.success(), "{}", x.describe());
    let events: Vec<serde_json::Value> = x
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(events
        .iter()
        .any(|e| e["class_uid"] == 4002 && e["disposition_id"] == 2));
    assert!(events
        .iter()
        .any(|e| e["class_uid"] == 4002 && e["disposition_id"] == 1));
    assert!(events.iter().all(|e| e["metadata"]["version"].is_string()));
}

/// `prove` a record and two checkpoints of a gateway's evidence; each
/// proof holds with the public key alone (`verify-proof`), and an edited
/// note, a proof for another tree size, an edited record or a proof with
/// a hash cut off is refused as broken (exit 1, never a panic).
#[test]
fn proofs_of_a_gateways_records_hold_with_the_key_alone_and_tampered_ones_fail() {
    let mut lab = Lab::builder()
        .evidence_config("checkpoint_every = 4")
        .start();
    let cfg = lab.config_path.display().to_string();
    let key = palisade(&["evidence", "pubkey", "-c", &cfg]);
    assert!(key.success(), "{}", key.describe());
    let key = key.stdout.trim().to_string();
    for _ in 0..5 {
        assert_eq!(get(&lab).0, 200);
        let denied = lab.proxied_curl("http://other.test/", &[]);
        assert_eq!(denied.status, 403, "{denied:?}");
    }
    let denied = lab.wait_evidence("deny other.test", |v| v["host"] == "other.test");
    lab.signal_proxy("-TERM");
    let st = lab.wait_proxy_exit(Duration::from_secs(10)).expect("exit");
    assert_eq!(st.code(), Some(0), "{}", lab.proxy_output());

    let dir = lab.evidence_dir.display().to_string();
    let v = palisade(&["evidence", "verify", &dir, "--key", &key]);
    assert!(v.success(), "{}", v.describe());
    assert!(
        v.stdout.contains("checkpoint roots match the records"),
        "{}",
        v.stdout
    );
    assert!(v.stdout.contains("palisade-evidence/3"), "{}", v.stdout);

    let id = denied["id"].as_str().unwrap();
    let p = palisade(&["evidence", "prove", &dir, "--record", id, "--key", &key]);
    assert!(p.success(), "{}", p.describe());
    let inclusion: serde_json::Value = serde_json::from_str(&p.stdout).unwrap();
    assert_eq!(inclusion["record"]["id"], id);
    let sizes: Vec<u64> = lab
        .evidence()
        .iter()
        .filter_map(|r| r["tree_size"].as_u64())
        .collect();
    assert!(sizes.len() >= 3, "{sizes:?}");
    let (a, b) = (sizes[0].to_string(), sizes[sizes.len() - 1].to_string());
    let c = palisade(&["evidence", "prove", &dir, "--consistency", &a, &b]);
    assert!(c.success(), "{}", c.describe());
    let consistency: serde_json::Value = serde_json::from_str(&c.stdout).unwrap();

    // Every proof is checked twice: by `verify-proof` (returned) and by
    // the independent verifier written from docs/evidence.md alone
    // (tests/fixtures/verify_proof.py), which must reach the same verdict.
    let check = |what: &str, proof: &serde_json::Value| {
        let file = lab.dir.join(format!("{}.json", what.replace(' ', "-")));
        fs::write(&file, proof.to_string()).unwrap();
        let ours = palisade(&[
            "evidence",
            "verify-proof",
            file.to_str().unwrap(),
            "--key",
            &key,
        ]);
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/verify_proof.py"
        );
        let theirs = Command::new("/usr/bin/python3")
            .args([fixture, file.to_str().unwrap(), &key])
            .output()
            .expect("run tests/fixtures/verify_proof.py");
        let out = String::from_utf8_lossy(&theirs.stdout);
        assert_eq!(
            theirs.status.success(),
            ours.success(),
            "{what}: the independent verifier disagrees: {out}{}\nverify-proof: {}",
            String::from_utf8_lossy(&theirs.stderr),
            ours.describe()
        );
        assert!(
            out.starts_with(if ours.success() { "ok: " } else { "broken: " }),
            "{what}: {out}"
        );
        ours
    };
    let ok = check("inclusion", &inclusion);
    assert!(ok.success(), "{}", ok.describe());
    assert!(
        ok.stdout.contains(&format!("record {id} is leaf")),
        "{}",
        ok.stdout
    );
    let ok = check("consistency", &consistency);
    assert!(ok.success(), "{}", ok.describe());
    assert!(
        ok.stdout.contains(&format!("extends the tree of {a}")),
        "{}",
        ok.stdout
    );

    let mut bad: Vec<(&str, serde_json::Value)> = Vec::new();
    let mut p = inclusion.clone();
    let n = p["note"].as_str().unwrap().to_string();
    p["note"] = n[..n.len() - 30].into();
    bad.push(("truncated note", p));
    let mut p = inclusion.clone();
    p["note"] = n
        .replacen(&format!("\n{}\n", inclusion["tree_size"]), "\n1\n", 1)
        .into();
    bad.push(("edited note", p));
    let mut p = inclusion.clone();
    p["tree_size"] = (inclusion["tree_size"].as_u64().unwrap() + 4).into();
    bad.push(("proof for another tree size", p));
    let mut p = inclusion.clone();
    p["record"]["host"] = "api.test".into();
    bad.push(("edited record", p));
    let mut p = consistency.clone();
    p["hashes"].as_array_mut().unwrap().pop();
    bad.push(("consistency hash cut off", p));
    let mut p = consistency.clone();
    p["new"] = consistency["old"].clone();
    p["old"] = consistency["new"].clone();
    bad.push(("consistency swapped", p));
    for (what, proof) in &bad {
        let out = check(what, proof);
        assert_eq!(out.code(), Some(1), "{what}: {}", out.describe());
        assert!(out.stdout.starts_with("broken: "), "{what}: {}", out.stdout);
    }
    // Another key proves nothing.
    let other = "11".repeat(32);
    let out = palisade(&[
        "evidence",
        "verify-proof",
        lab.dir.join("inclusion.json").to_str().unwrap(),
        "--key",
        &other,
    ]);
    assert_eq!(out.code(), Some(1), "{}", out.describe());
}

/// Tunnels opened in one burst.
const BURST: u32 = 64;

/// `BURST` CONNECT tunnels at once, each with one GET of `/burst-TAG-I`;
/// prints "I CONNECT_CODE HTTP_CODE LOCAL_PORT" per tunnel.
fn burst_script(tag: &str) -> String {
    format!(
        "for i in $(seq 1 {BURST}); do curl -q -s -o /dev/null -p --max-time 10 \
         -w \"$i %{{http_connect}} %{{http_code}} %{{local_port}}\\n\" \
         -x {PROXY_URL} http://allowed.test/burst-{tag}-$i & done; wait"
    )
}

/// Runs a burst to its end (bounded): its lines as (I, CONNECT code, GET
/// code, client port).
fn burst(lab: &Lab, tag: &str) -> Vec<(u32, u16, u16, u16)> {
    let out = lab.dir.join(format!("burst-{tag}.out"));
    let mut c = lab.client_spawn(&burst_script(tag), &out);
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "burst {tag} did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    let lines: Vec<_> = fs::read_to_string(&out)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let f: Vec<u32> = l.split(' ').filter_map(|x| x.parse().ok()).collect();
            match f[..] {
                [i, connect, code, port] => Some((i, connect as u16, code as u16, port as u16)),
                _ => None,
            }
        })
        .collect();
    assert_eq!(lines.len(), BURST as usize, "burst {tag}: {lines:?}");
    lines
}

/// The paths of the burst `tag` whose request reached the upstream.
fn reached(lab: &Lab, tag: &str) -> Vec<String> {
    lab.upstream_log()
        .into_iter()
        .filter(|v| v["event"] == "request")
        .filter_map(|v| v["request_line"].as_str().map(str::to_string))
        .filter(|l| l.contains(&format!("/burst-{tag}-")))
        .collect()
}

/// Tunnels that open at once are decided in batches (one write for the
/// decisions of a runtime tick): each still has its allow record before its
/// first byte goes on, and a batch the store cannot take refuses every
/// tunnel in it: none of their requests reaches the upstream, and the chain
/// holds no allow for them.
#[test]
fn a_burst_of_tunnels_is_recorded_before_bytes_and_a_full_store_refuses_it() {
    let lab = Lab::builder().evidence_tmpfs("512k").start();
    let ok = burst(&lab, "ok");
    assert!(
        ok.iter()
            .all(|&(_, connect, code, _)| connect == 200 && code == 200),
        "{ok:?}\n{}",
        lab.proxy_output()
    );
    // The clients of the allow records, read inside Palisade's mount
    // namespace (the tmpfs).
    let allows = |lab: &Lab| -> HashSet<String> {
        let dir = lab.evidence_dir.display().to_string();
        let cat = lab.proxy_mnt_exec("sh", &["-c", &format!("cat {dir}/*.jsonl")]);
        assert!(cat.success(), "{}", cat.describe());
        cat.stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|r| r["event"] == "decision" && r["decision"] == "allow")
            .filter_map(|r| r["client"].as_str().map(String::from))
            .collect()
    };
    let recorded = allows(&lab);
    for (i, _, _, port) in &ok {
        let client = format!("{}:{port}", lab::CLIENT_IP);
        assert!(
            recorded.contains(&client),
            "tunnel {i} ({client}) has no allow record"
        );
    }
    assert_eq!(reached(&lab, "ok").len(), BURST as usize);

    // A full store: the next burst's batch cannot be written.
    let dir = lab.evidence_dir.display().to_string();
    let fill = format!("{dir}/fill");
    let dd = lab.proxy_mnt_exec("dd", &["if=/dev/zero", &format!("of={fill}"), "bs=4k"]);
    assert!(dd.stderr.contains("No space left"), "{}", dd.describe());
    let full = burst(&lab, "full");
    lab.upstream_settled();
    let through = reached(&lab, "full");
    // What fit in the segment's last page may have been written; the
    // rest was refused, whole batches at a time.
    let refused = full.iter().filter(|&&(_, _, code, _)| code != 200).count();
    assert!(
        refused >= BURST as usize * 3 / 4,
        "{refused} of {BURST} refused on a full store: {full:?}"
    );
    assert_eq!(
        through.len(),
        BURST as usize - refused,
        "requests reached the upstream for refused tunnels: {through:?}"
    );
    let recorded = allows(&lab);
    for (i, _, code, port) in &full {
        let client = format!("{}:{port}", lab::CLIENT_IP);
        assert_eq!(
            recorded.contains(&client),
            *code == 200,
            "tunnel {i} ({client}): GET {code}, allow record {}",
            recorded.contains(&client)
        );
    }
    let rm = lab.proxy_mnt_exec("rm", &["-f", &fill]);
    assert!(rm.success(), "{}", rm.describe());
    let v = verify_inside(&lab);
    assert!(v.success(), "verify after the burst:\n{}", v.describe());
}
