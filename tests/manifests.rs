//! The deployment artefacts shipped beside the code are checked like code:
//! every Kubernetes manifest against the Kubernetes schemas (offline,
//! strict, a pinned version), the promises the manifests make (probes,
//! non-root, no capabilities, per-replica evidence and keys, a shipper that
//! only copies, a NetworkPolicy that leaves nothing but Palisade's ports,
//! requests sized for the configured capacity), the policy in their
//! ConfigMap through Palisade's own config loader, the compose file through
//! `docker-compose config`, the alert rules through `promtool check rules`
//! and `promtool test rules`, and the dashboards' per-replica queries
//! through promtool on series of two replicas.
//!
//! The tools are installed by `.ci/run`; a missing tool fails these tests
//! (it never skips them).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The Kubernetes version the manifests are validated against. Native
/// sidecars (`restartPolicy: Always` on an init container) need 1.29+.
const KUBERNETES_VERSION: &str = "1.33.0";

/// Measured resident memory of one idle tunnel (docs/deployment.md, "What
/// each replica needs").
const RSS_PER_TUNNEL: u64 = 13 * 1024;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Output {
    status: Option<i32>,
    stdout: String,
    stderr: String,
    desc: String,
}

impl Output {
    fn success(&self) -> bool {
        self.status == Some(0)
    }

    fn describe(&self) -> String {
        format!(
            "{} -> {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.desc, self.status, self.stdout, self.stderr
        )
    }
}

/// Run a tool to completion within `timeout` (killed past it). A tool that
/// cannot be started fails the test, naming what installs it.
fn run(cmd: &mut Command, timeout: Duration, install: &str) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e}\ninstall it: {install}"));
    let mut out = child.stdout.take().expect("stdout pipe");
    let mut err = child.stderr.take().expect("stderr pipe");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.code(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
        desc,
    }
}

const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// A fresh scratch directory (kept after the test, for a look at what a
/// failing tool left).
fn scratch(name: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("palisade-manifests-{name}-"))
        .tempdir()
        .unwrap()
        .into_path()
}

fn k8s_files() -> Vec<PathBuf> {
    let dir = repo().join("docker/k8s");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 2,
        "expected the manifests in {dir:?}, found {files:?}"
    );
    files
}

/// Debian's interpreter with python3-yaml (installed by .ci/run).
fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// Every YAML document of `path`, as JSON (through PyYAML's safe loader).
fn yaml_documents(path: &Path) -> Vec<Value> {
    let out = run(
        Command::new(python()).args([
            "-c",
            "import json, sys, yaml\n\
             json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None], sys.stdout)",
            path.to_str().unwrap(),
        ]),
        TOOL_TIMEOUT,
        "apt-get install python3 python3-yaml",
    );
    assert!(out.success(), "{}", out.describe());
    match serde_json::from_str(&out.stdout) {
        Ok(Value::Array(docs)) => docs,
        other => panic!("{}: not a list of documents: {other:?}", path.display()),
    }
}

fn name_of(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn kubernetes_validate(files: &[PathBuf]) -> Output {
    run(
        Command::new("kubernetes-validate")
            .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
            .args(files),
        TOOL_TIMEOUT,
        "see .ci/run (a venv with `pip install kubernetes-validate`)",
    )
}

#[test]
fn every_manifest_validates_against_the_pinned_kubernetes_schemas() {
    let files = k8s_files();
    let out = kubernetes_validate(&files);
    assert!(out.success(), "{}", out.describe());
    // Every document was looked at, not only the first of each file.
    let docs: usize = files.iter().map(|f| yaml_documents(f).len()).sum();
    let passed = out
        .stdout
        .lines()
        .chain(out.stderr.lines())
        .filter(|l| l.contains("passed"))
        .count();
    assert_eq!(passed, docs, "documents validated\n{}", out.describe());

    // Strict mode is what catches a misspelt field: a manifest with one must
    // fail, or the check above proves nothing.
    let dir = scratch("strict");
    let bad = dir.join("bad.yaml");
    let text = std::fs::read_to_string(&files[0]).unwrap();
    let text = text.replacen("readinessProbe:", "readinesProbe:", 1);
    assert!(text.contains("readinesProbe:"));
    std::fs::write(&bad, text).unwrap();
    let out = kubernetes_validate(&[bad]);
    assert!(
        !out.success(),
        "a misspelt field passed: {}",
        out.describe()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Byte sizes written the Kubernetes way ("256Mi", "2Gi", "512M").
fn quantity_bytes(q: &str) -> u64 {
    let units: [(&str, u64); 6] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().expect("quantity") * mult;
        }
    }
    q.parse().expect("quantity")
}

/// The policy in a ConfigMap document, loaded by Palisade's own loader.
fn configmap_config(doc: &Value) -> palisade::config::Config {
    let text = doc["data"]["palisade.toml"]
        .as_str()
        .expect("palisade.toml in the ConfigMap");
    palisade::config::from_str(text, Path::new("configmap/palisade.toml"))
        .unwrap_or_else(|e| panic!("the ConfigMap's palisade.toml does not load:\n{e}"))
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

fn port_set(ports: &Value) -> BTreeSet<(u64, String)> {
    ports
        .as_array()
        .unwrap_or_else(|| panic!("ports: {ports}"))
        .iter()
        .map(|p| {
            (
                p["port"].as_u64().expect("numeric port"),
                p["protocol"].as_str().unwrap_or("TCP").to_string(),
            )
        })
        .collect()
}

#[test]
fn the_manifests_keep_their_promises() {
    let mut shared: BTreeMap<String, (PathBuf, Value)> = BTreeMap::new();
    let mut workloads = 0;
    for file in k8s_files() {
        let docs = yaml_documents(&file);
        let at = |what: &str| format!("{}: {what}", file.display());

        // The parts every variant shares are the same objects in every file.
        for doc in &docs {
            if ["Namespace", "ConfigMap", "NetworkPolicy"]
                .contains(&doc["kind"].as_str().unwrap_or(""))
            {
                match shared.get(&name_of(doc)) {
                    Some((first, d)) => assert_eq!(
                        d,
                        doc,
                        "{} differs from the one in {}",
                        at(&name_of(doc)),
                        first.display()
                    ),
                    None => {
                        shared.insert(name_of(doc), (file.clone(), doc.clone()));
                    }
                }
            }
        }

        let maps = find(&docs, "ConfigMap");
        assert_eq!(maps.len(), 1, "{}", at("one ConfigMap"));
        let text = maps[0]["data"]["palisade.toml"].as_str().unwrap();
        let config = configmap_config(maps[0]);
        // One ConfigMap for every replica: the replica id must not be in it.
        assert!(
            !text.lines().any(|l| l.trim_start().starts_with("replica")),
            "{}",
            at("the shared ConfigMap sets a replica id")
        );
        let proxy_port = u64::from(config.proxy.listen[0].port());
        let dns_port = u64::from(config.dns.listen[0].port());
        let admin_port = u64::from(config.admin.listen.expect("admin listener").port());

        // Sandbox egress: Palisade's proxy and DNS ports, nothing else.
        let sandbox: Vec<&Value> = find(&docs, "NetworkPolicy")
            .into_iter()
            .filter(|p| p["metadata"]["namespace"] == "sandbox")
            .collect();
        assert_eq!(sandbox.len(), 1, "{}", at("one sandbox NetworkPolicy"));
        let spec = &sandbox[0]["spec"];
        assert_eq!(
            spec["podSelector"],
            serde_json::json!({}),
            "{}",
            at("all sandbox pods")
        );
        let types: Vec<&str> = spec["policyTypes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(types.contains(&"Egress"), "{}", at("policyTypes"));
        let egress = spec["egress"].as_array().expect("egress rules");
        assert!(!egress.is_empty());
        for rule in egress {
            let to = rule["to"]
                .as_array()
                .expect("egress rule without `to` allows anywhere");
            for peer in to {
                assert_eq!(
                    peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
                    "palisade",
                    "{}",
                    at("egress peer outside Palisade's namespace")
                );
                assert_eq!(
                    peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
                    "palisade",
                    "{}",
                    at("egress peer other than Palisade's pods")
                );
                assert!(peer.get("ipBlock").is_none());
            }
            let want: BTreeSet<(u64, String)> = [
                (proxy_port, "TCP".to_string()),
                (dns_port, "UDP".to_string()),
                (dns_port, "TCP".to_string()),
            ]
            .into();
            assert_eq!(
                port_set(&rule["ports"]),
                want,
                "{}",
                at("sandbox egress ports")
            );
        }

        for doc in docs
            .iter()
            .filter(|d| d["kind"] == "Deployment" || d["kind"] == "DaemonSet")
        {
            workloads += 1;
            let what = at(&name_of(doc));
            let pod = &doc["spec"]["template"]["spec"];
            let labels = &doc["spec"]["template"]["metadata"]["labels"];
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{what}");
            assert_eq!(
                pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "{what}"
            );
            assert_eq!(pod["automountServiceAccountToken"], false, "{what}");
            assert!(pod.get("hostNetwork").is_none(), "{what}: hostNetwork");

            let containers = pod["containers"].as_array().unwrap();
            let inits = pod["initContainers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for c in containers.iter().chain(inits.iter()) {
                let what = format!("{what} container {}", c["name"]);
                let sc = &c["securityContext"];
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
                assert_eq!(
                    sc["capabilities"]["drop"],
                    serde_json::json!(["ALL"]),
                    "{what}"
                );
                // Explicit mode only: no capability at all (NET_ADMIN would
                // belong to a transparent-mode variant alone).
                assert!(
                    sc["capabilities"].get("add").is_none(),
                    "{what}: capabilities added"
                );
                assert!(sc.get("privileged").is_none(), "{what}");
                for key in ["cpu", "memory"] {
                    assert!(
                        c["resources"]["requests"][key].is_string(),
                        "{what}: request {key}"
                    );
                }
                assert!(
                    c["resources"]["limits"]["memory"].is_string(),
                    "{what}: memory limit"
                );
                let image = c["image"].as_str().unwrap();
                assert!(
                    image.contains(':') && !image.ends_with(":latest"),
                    "{what}: image {image} not pinned"
                );
            }

            let palisade = containers
                .iter()
                .find(|c| c["name"] == "palisade")
                .unwrap_or_else(|| panic!("{what}: no palisade container"));
            assert_eq!(
                palisade["args"],
                serde_json::json!(["run", "-c", "/etc/palisade/palisade.toml"]),
                "{what}"
            );
            assert_eq!(
                palisade["livenessProbe"]["httpGet"]["path"], "/healthz",
                "{what}"
            );
            assert_eq!(
                palisade["readinessProbe"]["httpGet"]["path"], "/readyz",
                "{what}"
            );
            let named = |name: &str| {
                palisade["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|p| p["name"] == name)
                    .and_then(|p| p["containerPort"].as_u64())
            };
            for probe in ["livenessProbe", "readinessProbe"] {
                let port = palisade[probe]["httpGet"]["port"].as_str().unwrap();
                assert_eq!(named(port), Some(admin_port), "{what}: {probe} port");
            }
            assert_eq!(named("proxy"), Some(proxy_port), "{what}");
            assert_eq!(named("dns-udp"), Some(dns_port), "{what}");

            // Requests sized for the configured capacity: every connection an
            // idle tunnel, plus the detection memory bound.
            let request = quantity_bytes(
                palisade["resources"]["requests"]["memory"]
                    .as_str()
                    .unwrap(),
            );
            let need = config.proxy.limits.max_connections as u64 * RSS_PER_TUNNEL
                + config.proxy.limits.max_detect_memory_bytes as u64;
            assert!(request >= need, "{what}: memory request {request} < {need}");

            // Volumes: the policy from the ConfigMap, evidence and key per
            // replica (emptyDir, never a shared claim).
            let volumes = pod["volumes"].as_array().unwrap();
            let volume = |name: &str| {
                volumes
                    .iter()
                    .find(|v| v["name"] == name)
                    .unwrap_or_else(|| panic!("{what}: no volume {name}"))
            };
            assert_eq!(
                volume("policy")["configMap"]["name"],
                maps[0]["metadata"]["name"],
                "{what}"
            );
            let mount_of = |c: &Value, vol: &str| -> Option<Value> {
                c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["name"] == vol)
                    .cloned()
            };
            let under =
                |path: &Path, mount: &Value| path.starts_with(mount["mountPath"].as_str().unwrap());
            let evidence_mount = mount_of(palisade, "evidence").expect("evidence mount");
            let keys_mount = mount_of(palisade, "keys").expect("keys mount");
            assert!(
                under(&config.evidence.dir, &evidence_mount),
                "{what}: evidence dir not on its volume"
            );
            assert!(
                under(&config.evidence.key, &keys_mount),
                "{what}: key not on its volume"
            );
            assert!(
                !under(&config.evidence.key, &evidence_mount),
                "{what}: key inside the shipped dir"
            );
            for v in ["evidence", "keys"] {
                assert!(
                    volume(v)["emptyDir"].is_object(),
                    "{what}: {v} is not per replica"
                );
            }
            // Retention keeps the evidence under its volume's limit (past it
            // the kubelet evicts the pod).
            let limit = quantity_bytes(
                volume("evidence")["emptyDir"]["sizeLimit"]
                    .as_str()
                    .unwrap(),
            );
            let retain = config.evidence.retain_size.expect("[evidence] retain_size");
            assert!(
                retain + config.evidence.rotate_size < limit,
                "{what}: retain_size {retain} + a segment outgrows the evidence volume {limit}"
            );
            assert_eq!(
                mount_of(palisade, "policy").unwrap()["readOnly"],
                true,
                "{what}"
            );

            // The shipper: a native sidecar running rclone copy (never sync or
            // move), of closed segments only, with read-only evidence and no key.
            let shipper = inits
                .iter()
                .find(|c| c["name"] == "evidence-shipper")
                .unwrap_or_else(|| panic!("{what}: no evidence-shipper"));
            assert_eq!(
                shipper["restartPolicy"], "Always",
                "{what}: not a native sidecar"
            );
            assert!(
                shipper["image"]
                    .as_str()
                    .unwrap()
                    .starts_with("rclone/rclone:"),
                "{what}"
            );
            let script = shipper["args"][0].as_str().unwrap();
            assert!(
                script.contains("rclone copy /evidence "),
                "{what}: {script}"
            );
            for banned in [
                "rclone sync",
                "rclone move",
                "--delete",
                "--compress",
                "--s3-disable-checksum",
            ] {
                assert!(!script.contains(banned), "{what}: shipper uses {banned}");
            }
            assert!(script.contains("--checksum"), "{what}");
            assert!(script.contains("--include \"/palisade-*.jsonl\""), "{what}");
            let min_age = script
                .split("--min-age ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .unwrap_or_else(|| panic!("{what}: no --min-age"));
            let min_age = humantime::parse_duration(min_age).unwrap();
            assert!(
                min_age > config.evidence.rotate_age,
                "{what}: --min-age {min_age:?} does not exceed rotate_age {:?}: an open segment could be shipped",
                config.evidence.rotate_age
            );
            // Size-based retention never removes a segment the shipper has
            // not had its chance at: one is copied at the latest a pass
            // (the loop's sleep) after it is --min-age old.
            let pass: u64 = script
                .split("sleep ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("{what}: no sleep between passes"));
            let shipped_within = min_age + std::time::Duration::from_secs(pass);
            assert!(
                config.evidence.retain_min_age > shipped_within,
                "{what}: retain_min_age {:?} does not exceed --min-age plus a pass ({shipped_within:?}): retention could remove a segment before it is shipped",
                config.evidence.retain_min_age
            );
            let cutoff = script
                .split("--s3-upload-cutoff ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .expect("--s3-upload-cutoff");
            assert!(
                quantity_bytes(cutoff) > config.evidence.rotate_size,
                "{what}: segments would go up in parts"
            );
            let m = mount_of(shipper, "evidence").expect("shipper evidence mount");
            assert_eq!(m["readOnly"], true, "{what}: shipper may write evidence");
            assert_eq!(m["mountPath"], "/evidence", "{what}");
            assert!(
                mount_of(shipper, "keys").is_none(),
                "{what}: shipper sees the key"
            );
            assert!(mount_of(shipper, "policy").is_none(), "{what}");
            assert_eq!(
                env_value(shipper, "POD_NAME").map(|e| &e["valueFrom"]["fieldRef"]["fieldPath"]),
                Some(&Value::from("metadata.name")),
                "{what}: the replica id comes from the downward API"
            );
            assert!(
                script.contains("$POD_NAME\""),
                "{what}: one directory per replica"
            );

            // Palisade drains and seals before the shipper's last pass.
            let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
            assert!(
                Duration::from_secs(grace)
                    > config.proxy.limits.drain_timeout.get() + Duration::from_secs(20),
                "{what}: grace {grace}s leaves no time after the drain"
            );

            // Services and disruption budgets select these pods.
            let selects = |selector: &Value| {
                selector
                    .as_object()
                    .unwrap()
                    .iter()
                    .all(|(k, v)| labels[k] == *v)
            };
            let services: Vec<&Value> = find(&docs, "Service")
                .into_iter()
                .filter(|s| selects(&s["spec"]["selector"]))
                .collect();
            assert_eq!(services.len(), 1, "{what}: one Service");
            for p in services[0]["spec"]["ports"].as_array().unwrap() {
                let target = p["targetPort"].as_str().unwrap();
                assert!(named(target).is_some(), "{what}: Service targets {target}");
            }
            if doc["kind"] == "DaemonSet" {
                assert_eq!(
                    services[0]["spec"]["internalTrafficPolicy"], "Local",
                    "{what}: node-local"
                );
            } else {
                let pdbs: Vec<&Value> = find(&docs, "PodDisruptionBudget")
                    .into_iter()
                    .filter(|p| selects(&p["spec"]["selector"]["matchLabels"]))
                    .collect();
                assert_eq!(pdbs.len(), 1, "{what}: one PodDisruptionBudget");
                let min = pdbs[0]["spec"]["minAvailable"].as_u64().unwrap();
                let replicas = doc["spec"]["replicas"].as_u64().unwrap();
                assert!(
                    min >= 1 && min < replicas,
                    "{what}: minAvailable {min} of {replicas}"
                );
            }
        }
    }
    assert_eq!(workloads, 2, "a Deployment and a DaemonSet variant");
}

#[test]
fn the_compose_file_parses() {
    let file = repo().join("docker/docker-compose.yml");
    let out = run(
        Command::new("docker-compose")
            .arg("-f")
            .arg(&file)
            .args(["config", "--quiet"]),
        TOOL_TIMEOUT,
        "apt-get install --no-install-recommends docker-compose",
    );
    assert!(out.success(), "{}", out.describe());
    // docker-compose rejects what its schema does not know: a bogus key must fail.
    let dir = scratch("compose");
    let bad = dir.join("docker-compose.yml");
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&bad, text.replacen("    sysctls:", "    sysctl:", 1)).unwrap();
    let out = run(
        Command::new("docker-compose")
            .arg("-f")
            .arg(&bad)
            .args(["config", "--quiet"]),
        TOOL_TIMEOUT,
        "apt-get install --no-install-recommends docker-compose",
    );
    assert!(!out.success(), "a bogus key passed: {}", out.describe());
    assert!(out.stderr.contains("'sysctl'"), "{}", out.describe());
    let _ = std::fs::remove_dir_all(&dir);
}

fn promtool(args: &[&str], dir: &Path) -> Output {
    run(
        Command::new("promtool").args(args).current_dir(dir),
        TOOL_TIMEOUT,
        "apt-get install prometheus",
    )
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let dir = repo().join("dashboards");
    let check = promtool(&["check", "rules", "alerts.yml"], &dir);
    assert!(check.success(), "{}", check.describe());
    let test = promtool(&["test", "rules", "alerts_test.yml"], &dir);
    assert!(test.success(), "{}", test.describe());
    // The fleet alert's tests cover both sides: fires, and does not.
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).unwrap();
    assert!(tests.contains(
        "alertname: PalisadeFleetPolicyMismatch\n        exp_alerts:\n          - exp_labels:"
    ));
    assert!(tests.contains("alertname: PalisadeFleetPolicyMismatch\n        exp_alerts: []"));
}

/// Every (file, panel, expr) of every dashboard.
fn dashboards() -> Vec<(String, Value)> {
    let dir = repo().join("dashboards");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "{files:?}");
    files
        .into_iter()
        .map(|f| {
            let d = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
            (f.file_name().unwrap().to_string_lossy().to_string(), d)
        })
        .collect()
}

/// The panel of `d` whose target aggregates `metric` by replica
/// (`max by (replica...) (METRIC ...`), filtered by the replica variable.
fn per_replica_panel<'a>(d: &'a Value, metric: &str) -> Option<&'a Value> {
    d["panels"].as_array().unwrap().iter().find(|p| {
        p["targets"].as_array().unwrap().iter().any(|t| {
            let e = t["expr"].as_str().unwrap_or("");
            e.starts_with("max by (replica")
                && e.contains("replica=~\"$replica\"")
                && e.split_once(") (")
                    .is_some_and(|(_, rest)| rest.starts_with(metric))
        })
    })
}

#[test]
fn dashboards_show_each_replica_and_their_queries_join_correctly() {
    // Two replicas: a ready with 3 queued records on policy aaaa; b not
    // ready with 7 queued on policy bbbb. Each per-replica query must give
    // each replica its own value.
    let series = [
        ("palisade_build_info{job=\"palisade\",instance=\"198.18.0.1:9711\",replica=\"palisade-a\",policy=\"aaaa\",version=\"0.1.0\"}", "1x10"),
        ("palisade_build_info{job=\"palisade\",instance=\"198.18.0.2:9711\",replica=\"palisade-b\",policy=\"bbbb\",version=\"0.1.0\"}", "1x10"),
        ("palisade_ready{job=\"palisade\",instance=\"198.18.0.1:9711\"}", "1x10"),
        ("palisade_ready{job=\"palisade\",instance=\"198.18.0.2:9711\"}", "0x10"),
        ("palisade_evidence_queue_depth{job=\"palisade\",instance=\"198.18.0.1:9711\"}", "3x10"),
        ("palisade_evidence_queue_depth{job=\"palisade\",instance=\"198.18.0.2:9711\"}", "7x10"),
    ];
    let expect: [(&str, &[(&str, &str)]); 3] = [
        (
            "palisade_ready",
            &[
                ("{replica=\"palisade-a\"}", "1"),
                ("{replica=\"palisade-b\"}", "0"),
            ],
        ),
        (
            "palisade_evidence_queue_depth",
            &[
                ("{replica=\"palisade-a\"}", "3"),
                ("{replica=\"palisade-b\"}", "7"),
            ],
        ),
        (
            "palisade_build_info",
            &[
                (
                    "{replica=\"palisade-a\",policy=\"aaaa\",version=\"0.1.0\"}",
                    "1",
                ),
                (
                    "{replica=\"palisade-b\",policy=\"bbbb\",version=\"0.1.0\"}",
                    "1",
                ),
            ],
        ),
    ];
    let mut yaml = String::from(
        "rule_files: []\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n",
    );
    for (s, v) in series {
        yaml.push_str(&format!("      - series: '{s}'\n        values: '{v}'\n"));
    }
    yaml.push_str("    promql_expr_test:\n");
    let mut checked = 0;
    for (file, d) in dashboards() {
        let vars: Vec<&str> = d["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        assert!(vars.contains(&"replica"), "{file}: no replica variable");
        for (metric, samples) in expect {
            let panel = per_replica_panel(&d, metric)
                .unwrap_or_else(|| panic!("{file}: no per-replica panel of {metric}"));
            for t in panel["targets"].as_array().unwrap() {
                let expr = t["expr"].as_str().unwrap().replace("$replica", ".*");
                yaml.push_str(&format!(
                    "      - expr: '{expr}'\n        eval_time: 5m\n        exp_samples:\n"
                ));
                for (labels, value) in samples {
                    yaml.push_str(&format!(
                        "          - labels: '{labels}'\n            value: {value}\n"
                    ));
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 6, "per-replica queries: three per dashboard");
    let dir = scratch("dashboards");
    std::fs::write(dir.join("replicas_test.yml"), &yaml).unwrap();
    let out = promtool(&["test", "rules", "replicas_test.yml"], &dir);
    assert!(out.success(), "{}\n--- test file\n{yaml}", out.describe());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dashboards_and_alerts_name_only_metrics_palisade_exports() {
    let source = std::fs::read_to_string(repo().join("src/metrics.rs")).unwrap();
    let names = |text: &str| -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut rest = text;
        while let Some(i) = rest.find("palisade_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            out.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
        out
    };
    let exported: BTreeSet<String> = names(&source)
        .into_iter()
        .flat_map(|n| {
            ["", "_bucket", "_count", "_sum"]
                .into_iter()
                .map(move |s| format!("{n}{s}"))
        })
        .collect();
    let mut used = BTreeSet::new();
    for (_, d) in dashboards() {
        for p in d["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                used.extend(names(t["expr"].as_str().unwrap()));
            }
        }
        for v in d["templating"]["list"].as_array().unwrap() {
            used.extend(names(v["definition"].as_str().unwrap_or("")));
        }
    }
    // The rules and their descriptions (which name series to look at).
    used.extend(names(
        &std::fs::read_to_string(repo().join("dashboards/alerts.yml")).unwrap(),
    ));
    assert!(used.contains("palisade_build_info"));
    let unknown: Vec<&String> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "not exported by src/metrics.rs: {unknown:?}"
    );
}

/// The compose healthcheck is readiness: run as written (its address
/// pointed at a local stand-in for the admin listener), it asks for
/// `GET /readyz` and passes on a 200 only.
#[test]
fn the_compose_healthcheck_asks_readyz() {
    use std::io::Write;
    let docs = yaml_documents(&repo().join("docker/docker-compose.yml"));
    let test = &docs[0]["services"]["palisade"]["healthcheck"]["test"];
    let argv: Vec<String> = test
        .as_array()
        .unwrap_or_else(|| panic!("healthcheck test: {test}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(argv[0], "CMD", "{argv:?}");
    assert!(argv[3].contains("127.0.0.1/9711"), "{argv:?}");
    for (status, passes) in [("200 OK", true), ("503 Service Unavailable", false)] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 512];
            while !head.ends_with(b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n");
            String::from_utf8_lossy(&head).to_string()
        });
        let script = argv[3].replace("127.0.0.1/9711", &format!("127.0.0.1/{port}"));
        let out = run(
            Command::new(&argv[1]).arg(&argv[2]).arg(&script),
            TOOL_TIMEOUT,
            "bash",
        );
        let head = server.join().unwrap();
        assert!(head.starts_with("GET /readyz HTTP/1.0\r\n"), "{head:?}");
        assert_eq!(out.success(), passes, "{status}: {}", out.describe());
    }
}
