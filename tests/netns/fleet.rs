//! Fleet evidence: two Palisade instances (replicas `gw-a` and `gw-b`, one
//! policy) each in front of its own sandbox namespace, each writing its
//! evidence into its own directory of one tree. `probe plan` + `probe run`
//! in each sandbox; one `probe report` over both runs and the whole tree
//! attributes every probe to the replica behind its sandbox; `evidence
//! verify|query` read
//! the tree as a fleet; a record edited in one replica's chain makes verify
//! and the report refuse, naming it, with the other named intact.
//!
//! ```text
//!  sandbox a  c0 198.18.1.2 ---- p0 198.18.1.1  gw-a (proxy :3128, DNS :53, admin :9711)
//!                                   gateway ns (ip_forward=0)       ---- upstream ns
//!  sandbox b  d0 198.18.4.2 ---- p1 198.18.4.1  gw-b (proxy :3128, DNS :53, admin :9711)
//! ```
//!
//! Both replicas run in the lab's proxy namespace, each listening only on
//! its own sandbox's link, with the same policy text.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, palisade_bin, CmdOutput, Lab, DNS_IP};

/// One policy for both replicas: one org, both sandboxes.
const FLEET_POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24", "198.18.4.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [80, 443]

[[org.allow]]
cidr = "198.18.2.30/32"
ports = [80]

[[org.deny]]
host = "blocked.wild.test"
"#;

const RUN_TIMEOUT: Duration = Duration::from_secs(150);
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// A replica: its name, the gateway address its sandbox uses, its config
/// and evidence paths.
struct Replica {
    name: &'static str,
    gateway: &'static str,
    sandbox_ip: &'static str,
    config: PathBuf,
    evidence: PathBuf,
}

/// The two Palisade processes; killed on drop (declared after the lab, so
/// they go before its namespaces do).
struct Gateways {
    children: Vec<(String, Child)>,
}

impl Drop for Gateways {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn palisade(args: &[&str]) -> CmdOutput {
    lab::run_with_timeout(
        Command::new(palisade_bin()).args(args),
        None,
        Duration::from_secs(60),
    )
}

/// The replica's config; `replica_key` adds `[evidence] replica` (when this
/// build knows the key, so the header names the replica).
fn config_text(lab: &Lab, r: &Replica, replica_key: bool) -> String {
    let key = lab.dir.join("keys").join(format!("{}.key", r.name));
    let replica = if replica_key {
        format!("replica = {:?}\n", r.name)
    } else {
        String::new()
    };
    format!(
        "[proxy]\nlisten = [\"{gw}:3128\"]\n\n[dns]\nlisten = [\"{gw}:53\"]\nupstream = [\"{DNS_IP}:53\"]\n\n\
         [admin]\nlisten = \"{gw}:9711\"\n\n[evidence]\ndir = {dir:?}\nkey = {key:?}\n{replica}\n{FLEET_POLICY}",
        gw = r.gateway,
        dir = r.evidence.display().to_string(),
        key = key.display().to_string(),
    )
}

/// Write the replica's config: with `[evidence] replica` when `palisade
/// check` accepts it (a build whose writer names the replica in its
/// headers), else without (the directory's name is the replica's).
fn write_config(lab: &Lab, r: &Replica) {
    std::fs::write(&r.config, config_text(lab, r, true)).unwrap();
    let check = palisade(&["check", "-c", &r.config.display().to_string()]);
    if !check.success() {
        assert!(
            check.stdout.contains("replica") || check.stderr.contains("replica"),
            "the config is invalid for another reason: {}",
            check.describe()
        );
        std::fs::write(&r.config, config_text(lab, r, false)).unwrap();
        let check = palisade(&["check", "-c", &r.config.display().to_string()]);
        assert!(check.success(), "{}", check.describe());
    }
}

fn spawn(lab: &Lab, r: &Replica) -> Child {
    let log = |ext: &str| std::fs::File::create(lab.dir.join(format!("{}.{ext}", r.name))).unwrap();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.ns_proxy, palisade_bin(), "run", "-c"])
        .arg(&r.config)
        .stdin(Stdio::null())
        .stdout(log("stdout"))
        .stderr(log("stderr"));
    lab::sanitize(&mut cmd).spawn().expect("spawn palisade")
}

fn output_of(lab: &Lab, name: &str) -> String {
    ["stdout", "stderr"]
        .iter()
        .map(|ext| {
            std::fs::read_to_string(lab.dir.join(format!("{name}.{ext}"))).unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Poll the replica's /readyz (bounded), failing if it exits.
fn wait_ready(lab: &Lab, r: &Replica, child: &mut Child) {
    let deadline = Instant::now() + READY_TIMEOUT;
    let url = format!("http://{}:9711/readyz", r.gateway);
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            panic!(
                "{} exited during start-up ({st}):\n{}",
                r.name,
                output_of(lab, r.name)
            );
        }
        if lab.proxy_ns_status(&url) == 200 {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{} not ready within {READY_TIMEOUT:?}:\n{}",
        r.name,
        output_of(lab, r.name)
    );
}

/// SIGTERM (a clean shutdown seals the chain) and wait, bounded.
fn stop(lab: &Lab, name: &str, child: &mut Child) {
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "{name} exit {st}:\n{}", output_of(lab, name));
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} did not stop:\n{}",
            output_of(lab, name)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `probe plan` from the replica's config, run in `ns`; the observations.
fn plan_and_run(lab: &Lab, r: &Replica, ns: &str) -> PathBuf {
    let out = palisade(&[
        "probe",
        "plan",
        "-c",
        &r.config.display().to_string(),
        "--org",
        "acme",
        "--outside",
        "198.18.2.20",
    ]);
    assert!(out.success(), "{}", out.describe());
    assert!(
        out.stdout
            .contains(&format!("proxy = \"{}:3128\"", r.gateway)),
        "{}",
        out.stdout
    );
    let plan = out.stdout.replace("timeout = \"5s\"", "timeout = \"2s\"");
    let plan_path = lab.dir.join(format!("{}.plan.toml", r.name));
    std::fs::write(&plan_path, plan).unwrap();
    let obs_dir = lab.dir.join(format!("{}.obs", r.name));
    let run = lab::run_with_timeout(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                palisade_bin(),
                "probe",
                "run",
                "--plan",
            ])
            .arg(&plan_path)
            .arg("--out")
            .arg(&obs_dir),
        None,
        RUN_TIMEOUT,
    );
    assert!(run.success(), "probe run ({}): {}", r.name, run.describe());
    obs_dir.join("observations.json")
}

struct Reported {
    code: Option<i32>,
    json: Value,
    md: String,
    dir: PathBuf,
    output: String,
}

/// `probe report` over both sandboxes' observations.
fn report(lab: &Lab, tag: &str, obs: &[&Path], evidence: &Path, keys: &Path) -> Reported {
    let dir = lab.dir.join(format!("{tag}.report"));
    let mut cmd = Command::new(palisade_bin());
    cmd.args(["probe", "report"]);
    // The agreed plans: the assessor's copies, one per replica.
    for name in ["gw-a", "gw-b"] {
        cmd.arg("--plan")
            .arg(lab.dir.join(format!("{name}.plan.toml")));
    }
    for o in obs {
        cmd.arg("--observations").arg(o);
    }
    let out = lab::run_with_timeout(
        cmd.arg("--evidence")
            .arg(evidence)
            .arg("--keys")
            .arg(keys)
            .arg("--out")
            .arg(&dir),
        None,
        Duration::from_secs(60),
    );
    let text = std::fs::read_to_string(dir.join("report.json"))
        .unwrap_or_else(|e| panic!("report.json: {e}\n{}", out.describe()));
    Reported {
        code: out.code(),
        json: serde_json::from_str(&text).unwrap(),
        md: std::fs::read_to_string(dir.join("report.md")).unwrap(),
        dir,
        output: out.describe(),
    }
}

/// Keep a report's markdown where the closing note can quote it.
fn keep(r: &Reported, name: &str) -> PathBuf {
    let kept = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::copy(r.dir.join("report.md"), &kept).unwrap();
    let _ = std::fs::copy(r.dir.join("report.md"), Path::new("/tmp").join(name));
    println!("fleet report: {} (also /tmp/{name})", kept.display());
    kept
}

/// The run id of an observations file.
fn run_of(obs: &Path) -> String {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(obs).unwrap()).unwrap();
    v["run"].as_str().unwrap().to_string()
}

/// Every probe of run `run` that cites records names `replica`, as do its
/// records (all from the sandbox's address); the probes `must` of that run
/// are classified as given.
fn assert_attributed(
    r: &Reported,
    run: &str,
    replica: &str,
    sandbox_ip: &str,
    must: &[(&str, &str)],
) {
    assert_eq!(r.json["verification"]["ok"], true, "{}\n{}", r.output, r.md);
    let suffix = format!("@{run}");
    let probes: Vec<&Value> = r.json["probes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| id.ends_with(&suffix)))
        .collect();
    assert!(
        probes.len() >= 10,
        "{} probes of run {run}:\n{}",
        probes.len(),
        r.md
    );
    let mut cited = 0;
    for p in probes {
        let records = p["records"].as_array().unwrap();
        if records.is_empty() {
            assert!(p["replica"].is_null(), "{p:#}");
            continue;
        }
        cited += 1;
        assert_eq!(p["replica"], replica, "probe {}: {p:#}", p["id"]);
        for rec in records {
            assert_eq!(rec["replica"], replica, "{rec:#}");
            if let Some(client) = rec["client"].as_str() {
                assert!(client.starts_with(&format!("{sandbox_ip}:")), "{rec:#}");
            }
        }
    }
    assert!(
        cited >= 5,
        "only {cited} probes of run {run} cite records:\n{}",
        r.md
    );
    let classes: BTreeMap<String, String> = palisade::probe::report::classes(&r.json);
    for (id, class) in must {
        let id = format!("{id}{suffix}");
        assert_eq!(
            classes.get(&id).map(String::as_str),
            Some(*class),
            "{id} ({replica}):\n{}",
            r.md
        );
    }
    assert!(
        r.json["findings"].as_array().unwrap().is_empty(),
        "{}",
        r.md
    );
    let statuses: Vec<(&str, &str)> = r.json["verification"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["replica"].as_str().unwrap(),
                c["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(statuses, [("gw-a", "intact"), ("gw-b", "intact")]);
    assert!(
        r.md.contains("| gw-a | intact |") && r.md.contains("| gw-b | intact |"),
        "{}",
        r.md
    );
    assert!(
        r.md.contains("| matches plan | replica | Palisade records |"),
        "{}",
        r.md
    );
}

/// Copy a replica directory's segment files.
fn copy_segments(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// Turn the first deny decision of the replica's chain into an allow.
fn tamper(dir: &Path) -> PathBuf {
    let mut segments: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    segments.sort();
    for seg in segments {
        let text = std::fs::read_to_string(&seg).unwrap();
        let mut done = false;
        let edited: Vec<String> = text
            .lines()
            .map(|l| {
                if !done
                    && l.contains("\"event\":\"decision\"")
                    && l.contains("\"decision\":\"deny\"")
                {
                    done = true;
                    l.replace("\"decision\":\"deny\"", "\"decision\":\"allow\"")
                } else {
                    l.to_string()
                }
            })
            .collect();
        if done {
            std::fs::write(&seg, edited.join("\n") + "\n").unwrap();
            return seg;
        }
    }
    panic!("no deny decision to tamper with in {}", dir.display());
}

#[test]
fn two_replicas_one_report_every_probe_attributed_and_tampering_named() {
    let lab = Lab::builder()
        .policy(FLEET_POLICY)
        .second_client()
        .without_proxy()
        .start();
    let tree = lab.dir.join("fleet");
    std::fs::create_dir_all(lab.dir.join("keys")).unwrap();
    let replicas = [
        Replica {
            name: "gw-a",
            gateway: "198.18.1.1",
            sandbox_ip: lab::CLIENT_IP,
            config: lab.dir.join("gw-a.toml"),
            evidence: tree.join("gw-a"),
        },
        Replica {
            name: "gw-b",
            gateway: "198.18.4.1",
            sandbox_ip: lab::CLIENT2_IP,
            config: lab.dir.join("gw-b.toml"),
            evidence: tree.join("gw-b"),
        },
    ];
    let mut gateways = Gateways {
        children: Vec::new(),
    };
    for r in &replicas {
        write_config(&lab, r);
        let mut child = spawn(&lab, r);
        wait_ready(&lab, r, &mut child);
        gateways.children.push((r.name.to_string(), child));
    }
    // The public keys, pinned per replica in a keys file.
    let mut keys_text = String::from("# replica  public key\n");
    let mut keys = BTreeMap::new();
    for r in &replicas {
        let out = palisade(&["evidence", "pubkey", "-c", &r.config.display().to_string()]);
        assert!(out.success(), "{}", out.describe());
        let k = out.stdout.trim().to_string();
        keys_text.push_str(&format!("{} {k}\n", r.name));
        keys.insert(r.name, k);
    }
    assert_ne!(keys["gw-a"], keys["gw-b"]);
    let keys_file = lab.dir.join("fleet.keys");
    std::fs::write(&keys_file, keys_text).unwrap();

    // Both sandboxes probe at once, each through its own gateway.
    let (ns_a, ns_b) = (lab.ns_client.clone(), lab.ns_client2.clone());
    let (obs_a, obs_b) = std::thread::scope(|s| {
        let a = s.spawn(|| plan_and_run(&lab, &replicas[0], &ns_a));
        let b = s.spawn(|| plan_and_run(&lab, &replicas[1], &ns_b));
        (a.join().unwrap(), b.join().unwrap())
    });
    for (name, child) in &mut gateways.children {
        stop(&lab, name, child);
    }
    let tree_arg = tree.display().to_string();
    let keys_arg = keys_file.display().to_string();

    // verify: one line per replica, both intact; one directory as before.
    let v = palisade(&["evidence", "verify", &tree_arg, "--keys", &keys_arg]);
    assert_eq!(v.code(), Some(0), "{}", v.describe());
    let lines: Vec<&str> = v.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", v.stdout);
    assert!(
        lines[0].starts_with("gw-a: intact: ") && lines[0].contains("sealed, key pinned"),
        "{}",
        v.stdout
    );
    assert!(lines[1].starts_with("gw-b: intact: "), "{}", v.stdout);
    assert!(
        lines[2].starts_with("fleet intact: 2 replicas (gw-a, gw-b)"),
        "{}",
        v.stdout
    );
    let one = palisade(&[
        "evidence",
        "verify",
        &replicas[0].evidence.display().to_string(),
        "--key",
        &keys["gw-a"],
    ]);
    assert_eq!(one.code(), Some(0), "{}", one.describe());
    assert!(one.stdout.starts_with("intact: "), "{}", one.stdout);
    // Both directories named one by one: the same fleet.
    let both = palisade(&[
        "evidence",
        "verify",
        &replicas[1].evidence.display().to_string(),
        &replicas[0].evidence.display().to_string(),
        "--key",
        &format!("gw-a={}", keys["gw-a"]),
        "--key",
        &format!("gw-b={}", keys["gw-b"]),
    ]);
    assert_eq!(both.code(), Some(0), "{}", both.describe());
    // Key pinning: one replica unpinned, a key for a replica not there.
    let a_only = format!("gw-a={}", keys["gw-a"]);
    let unpinned = palisade(&["evidence", "verify", &tree_arg, "--key", &a_only]);
    assert_eq!(unpinned.code(), Some(1), "{}", unpinned.describe());
    assert!(
        unpinned.stdout.contains("gw-b: UNPINNED: "),
        "{}",
        unpinned.stdout
    );
    let allowed = palisade(&[
        "evidence",
        "verify",
        &tree_arg,
        "--key",
        &a_only,
        "--allow-unpinned",
    ]);
    assert_eq!(allowed.code(), Some(0), "{}", allowed.describe());
    let ghost = format!("gw-c={}", keys["gw-a"]);
    let absent = palisade(&[
        "evidence", "verify", &tree_arg, "--keys", &keys_arg, "--key", &ghost,
    ]);
    assert_eq!(absent.code(), Some(1), "{}", absent.describe());
    assert!(
        absent.stdout.contains("gw-c: MISSING: a key is pinned"),
        "{}",
        absent.stdout
    );
    assert!(
        absent.stdout.contains("gw-a: intact: ") && absent.stdout.contains("gw-b: intact: "),
        "{}",
        absent.stdout
    );

    // query: merged, every record names the replica that wrote it.
    let q = palisade(&["evidence", "query", &tree_arg, "--keys", &keys_arg]);
    assert_eq!(q.code(), Some(0), "{}", q.describe());
    let records: Vec<Value> = q
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut per_replica: BTreeMap<String, usize> = BTreeMap::new();
    let mut switches = 0;
    for pair in records.windows(2) {
        // Merged by time: where the stream passes from one replica to the
        // other, time does not go back (each chain keeps its own order).
        if pair[0]["replica"] != pair[1]["replica"] {
            switches += 1;
            let (a, b) = (
                pair[0]["ts"].as_str().unwrap(),
                pair[1]["ts"].as_str().unwrap(),
            );
            assert!(a <= b, "{} then {}", pair[0], pair[1]);
        }
    }
    assert!(
        switches >= 2,
        "the replicas ran at once, their records interleave: {switches}"
    );
    for rec in &records {
        let replica = rec["replica"]
            .as_str()
            .unwrap_or_else(|| panic!("no replica: {rec}"));
        *per_replica.entry(replica.to_string()).or_default() += 1;
        if let Some(client) = rec["client"].as_str() {
            let ip = if replica == "gw-a" {
                lab::CLIENT_IP
            } else {
                lab::CLIENT2_IP
            };
            assert!(client.starts_with(&format!("{ip}:")), "{rec}");
        }
    }
    assert!(
        per_replica.get("gw-a").is_some_and(|n| *n > 5),
        "{per_replica:?}"
    );
    assert!(
        per_replica.get("gw-b").is_some_and(|n| *n > 5),
        "{per_replica:?}"
    );

    // One report: both sandboxes' runs, the whole tree.
    let must = [
        ("allow-0-80", "enforced_allow"),
        ("allow-0-443", "enforced_allow"),
        ("deny-0", "enforced_deny"),
        ("canary-https", "enforced_deny"),
        ("udp-quic", "blocked_elsewhere"),
    ];
    let r = report(&lab, "fleet", &[&obs_a, &obs_b], &tree, &keys_file);
    assert_eq!(r.code, Some(0), "{}\n{}", r.output, r.md);
    let (run_a, run_b) = (run_of(&obs_a), run_of(&obs_b));
    assert_attributed(&r, &run_a, replicas[0].name, replicas[0].sandbox_ip, &must);
    assert_attributed(&r, &run_b, replicas[1].name, replicas[1].sandbox_ip, &must);
    assert_eq!(r.json["scope"]["probe_run"], format!("{run_a}, {run_b}"));
    assert_eq!(
        r.json["scope"]["replicas"],
        serde_json::json!(["gw-a", "gw-b"])
    );
    assert_eq!(r.json["scope"]["evidence_key_pinned"], true);
    assert_eq!(r.json["scope"]["evidence_sealed"], true);
    assert!(
        r.md.contains(&format!("| allow-0-80@{run_b} | "))
            && r.md.contains("| enforced_allow | yes | gw-b |"),
        "{}",
        r.md
    );
    let kept = keep(&r, "fleet-report.md");
    assert!(kept.is_file());

    // Tamper with one record of gw-b, in a copy of the tree.
    let tampered = lab.dir.join("tampered");
    copy_segments(&replicas[0].evidence, &tampered.join("gw-a"));
    copy_segments(&replicas[1].evidence, &tampered.join("gw-b"));
    let edited = tamper(&tampered.join("gw-b"));
    let tampered_arg = tampered.display().to_string();
    let v = palisade(&["evidence", "verify", &tampered_arg, "--keys", &keys_arg]);
    assert_eq!(v.code(), Some(1), "{}", v.describe());
    assert!(v.stdout.contains("gw-a: intact: "), "{}", v.stdout);
    let broken = format!("gw-b: BROKEN at {}:", edited.display());
    assert!(v.stdout.contains(&broken), "{}", v.stdout);
    assert!(
        v.stdout
            .contains("hash does not match the record: record edited"),
        "{}",
        v.stdout
    );
    assert!(
        v.stdout
            .trim_end()
            .ends_with("fleet NOT intact: 1 of 2 replicas failed (gw-b broken); intact: gw-a"),
        "{}",
        v.stdout
    );
    let q = palisade(&["evidence", "query", &tampered_arg, "--keys", &keys_arg]);
    assert_eq!(q.code(), Some(1), "{}", q.describe());
    assert!(q.stdout.is_empty(), "{}", q.stdout);
    assert!(
        q.stderr.contains("replica gw-b failed verification"),
        "{}",
        q.stderr
    );
    let q = palisade(&["evidence", "query", &tampered_arg, "--include-broken"]);
    assert_eq!(q.code(), Some(0), "{}", q.describe());
    assert!(q.stderr.contains(&broken), "{}", q.stderr);

    let t = report(
        &lab,
        "fleet-tampered",
        &[&obs_a, &obs_b],
        &tampered,
        &keys_file,
    );
    assert_eq!(t.code, Some(1), "{}", t.output);
    assert_eq!(t.json["verification"]["ok"], false);
    assert_eq!(t.json["probes"].as_array().unwrap().len(), 0);
    let error = t.json["verification"]["error"].as_str().unwrap();
    assert!(error.starts_with(&format!("replica {broken}")), "{error}");
    assert!(error.ends_with("intact: gw-a"), "{error}");
    assert!(
        t.md.contains("**FAILED:** replica gw-b: BROKEN at "),
        "{}",
        t.md
    );
    assert!(
        t.md.contains("| gw-b | **BROKEN** |") && t.md.contains("| gw-a | intact |"),
        "{}",
        t.md
    );
    assert!(
        t.output.contains("gw-a: intact: ") && t.output.contains(&broken),
        "{}",
        t.output
    );
    keep(&t, "fleet-report-tampered.md");
}
