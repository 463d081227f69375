//! Metrics proven against a real Prometheus: it scrapes Palisade inside the
//! lab, every dashboard panel query and every alert rule evaluates, the
//! denial counters equal the denials driven, and label cardinality does not
//! grow with host names or client ports.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, run_with_timeout, Lab, DEFAULT_POLICY};

const PROM_ADDR: &str = "127.0.0.1:9090";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Prometheus server in the lab's proxy namespace, scraping the admin listener.
pub(crate) struct Prometheus {
    child: Child,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn start_prometheus(lab: &Lab) -> Prometheus {
    let dir = lab.dir.join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: palisade\n    static_configs:\n      - targets: ['{}']\n",
            repo().join("dashboards/alerts.yml").display(),
            lab::ADMIN_ADDR
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new("ip")
        .args(["netns", "exec", &lab.ns_proxy, "prometheus"])
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={PROM_ADDR}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    let prom = Prometheus { child };
    lab::wait_until("prometheus ready", Duration::from_secs(20), || {
        api(lab, "query", "up").is_some()
    });
    prom
}

/// A Prometheus HTTP API call from inside the proxy namespace; None on failure.
pub(crate) fn api(lab: &Lab, endpoint: &str, query: &str) -> Option<Value> {
    let url = format!("http://{PROM_ADDR}/api/v1/{endpoint}");
    let mut args = vec!["-sS", "--max-time", "5", "-G", url.as_str()];
    let q = format!("query={query}");
    if endpoint == "query" {
        args.extend(["--data-urlencode", q.as_str()]);
    }
    let out = lab.proxy_ns_exec("curl", &args);
    if !out.success() {
        return None;
    }
    let v: Value = serde_json::from_str(&out.stdout).ok()?;
    (v["status"] == "success").then_some(v)
}

/// The instant-query result vector of `query`.
fn query(lab: &Lab, query: &str) -> Vec<Value> {
    let v = api(lab, "query", query).unwrap_or_else(|| panic!("query failed: {query}"));
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

fn scalar(lab: &Lab, q: &str) -> f64 {
    query(lab, q)
        .first()
        .and_then(|s| s["value"][1].as_str())
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Grafana variables replaced by what a default dashboard view would use.
fn grafana_to_promql(expr: &str) -> String {
    expr.replace("$__rate_interval", "30s")
        .replace("$__range", "5m")
        .replace("$__interval", "5s")
        .replace("$org", ".*")
        .replace("$replica", ".*")
}

/// Every (dashboard, panel title, expr) of every dashboard JSON.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("dashboards"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "expected two dashboards, found {files:?}");
    for file in files {
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!(
            d["templating"]["list"][0]["type"], "datasource",
            "{name}: datasource variable"
        );
        for panel in d["panels"].as_array().unwrap() {
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{name}: {panel}"
            );
            for t in panel["targets"].as_array().unwrap() {
                out.push((
                    name.clone(),
                    panel["title"].as_str().unwrap().to_string(),
                    t["expr"].as_str().unwrap().to_string(),
                ));
            }
        }
    }
    out
}

/// Series each alert reads, written down here: each must be a sub-expression
/// of the rule (checked) and must return data (a rule over a missing series
/// would never fire).
const ALERT_PROBES: &[(&str, &str)] = &[
    (
        "PalisadeEvidenceWriteErrors",
        "increase(palisade_evidence_write_errors_total[5m])",
    ),
    ("PalisadeNotReady", "palisade_ready"),
    ("PalisadeNotReady", "up{job=\"palisade\"}"),
    (
        "PalisadePolicyReloadFailed",
        "increase(palisade_policy_reloads_total{result=\"error\"}[10m])",
    ),
    (
        "PalisadeDenialSpike",
        "sum by (org) (rate(palisade_connections_total{decision=\"deny\"}[5m]))",
    ),
    (
        "PalisadeUnknownClientTraffic",
        "sum(rate(palisade_connections_total{org=\"unknown\"}[5m]))",
    ),
    (
        "PalisadeUnknownClientTraffic",
        "sum(rate(palisade_dns_queries_total{org=\"unknown\"}[5m]))",
    ),
    (
        "PalisadeResolutionFailures",
        "sum by (org) (rate(palisade_connections_total{reason=\"resolution_failed\"}[5m]))",
    ),
    (
        "PalisadeEvidenceDiskLow",
        "palisade_evidence_disk_free_bytes",
    ),
    (
        "PalisadeEvidenceDiskLow",
        "palisade_evidence_disk_size_bytes",
    ),
    (
        "PalisadeEvidenceSuppressed",
        "sum by (org) (rate(palisade_evidence_suppressed_total[5m]))",
    ),
    (
        "PalisadeFleetPolicyMismatch",
        "count by (job, namespace, policy) (palisade_build_info)",
    ),
    (
        "PalisadeVolumeBudgetExceeded",
        "sum by (org, direction) (increase(palisade_volume_exceeded_total[15m]))",
    ),
];

fn promtool(args: &[&str], stdin: Option<&[u8]>) -> lab::CmdOutput {
    run_with_timeout(
        Command::new("promtool").args(args),
        stdin,
        Duration::from_secs(30),
    )
}

#[test]
fn dashboards_and_alerts_evaluate_against_real_prometheus() {
    let rules = repo().join("dashboards/alerts.yml");
    let check = promtool(&["check", "rules", rules.to_str().unwrap()], None);
    assert!(check.success(), "{}", check.describe());

    let lab = Lab::start(DEFAULT_POLICY);
    let prom = start_prometheus(&lab);

    // Counters must be scraped at zero first, or their first increase is invisible to rate().
    lab::wait_until("first scrapes", Duration::from_secs(20), || {
        scalar(&lab, "count_over_time(up{job=\"palisade\"}[1m])") >= 2.0
    });

    // Drive traffic: allowed, denied by rule, unknown client, resolution failures.
    let mut denied = 0;
    for _ in 0..3 {
        assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    }
    for i in 0..5 {
        let r = lab.proxied_curl(&format!("http://n{i}.other.test/"), &[]);
        assert_eq!(r.status, 403);
        denied += 1;
    }
    for _ in 0..2 {
        let r = lab.raw_request_from(
            lab::STRANGER_IP,
            "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(r.status, 403);
        denied += 1;
    }
    // Enough failures that rate over 5m passes the alert's 0.1/s threshold.
    for _ in 0..60 {
        let r = lab.raw_request_from(
            lab::CLIENT_IP,
            "GET http://nx.test/ HTTP/1.1\r\nHost: nx.test\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(r.status, 502);
        denied += 1;
    }

    // The scrape must show exactly the denials driven.
    let want = f64::from(denied);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = f64::NAN;
    while Instant::now() < deadline {
        seen = scalar(&lab, "sum(palisade_connections_total{decision=\"deny\"})");
        if seen == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(seen, want, "deny counter vs denials driven");
    assert_eq!(
        scalar(
            &lab,
            "sum(palisade_connections_total{decision=\"deny\",reason=\"no_matching_rule\"})"
        ),
        5.0
    );
    assert_eq!(
        scalar(&lab, "sum(palisade_connections_total{org=\"unknown\"})"),
        2.0
    );
    assert_eq!(
        scalar(&lab, "sum(palisade_connections_total{decision=\"allow\"})"),
        3.0
    );
    // Rates need a few scrapes after the traffic.
    lab::wait_until("several scrapes", Duration::from_secs(20), || {
        scalar(&lab, "count_over_time(up{job=\"palisade\"}[1m])") >= 5.0
    });

    let mut empty = Vec::new();
    let queries = dashboard_queries();
    assert!(queries.len() >= 14, "{} panel queries", queries.len());
    for (dash, title, expr) in &queries {
        let q = grafana_to_promql(expr);
        if query(&lab, &q).is_empty() {
            empty.push(format!("{dash} / {title}: {q}"));
        }
    }
    assert!(
        empty.is_empty(),
        "panel queries without data:\n{}",
        empty.join("\n")
    );

    let alerts_text = std::fs::read_to_string(&rules).unwrap();
    for (alert, probe) in ALERT_PROBES {
        assert!(alerts_text.contains(alert), "{alert} not in alerts.yml");
        assert!(
            alerts_text.contains(probe),
            "{alert}: {probe} not in its rule"
        );
        assert!(
            !query(&lab, probe).is_empty(),
            "{alert}: {probe} returns no data"
        );
    }
    // Every rule evaluates without error, and the two conditions driven fire.
    let rule_count = alerts_text.matches("- alert:").count();
    lab::wait_until("rules evaluated", Duration::from_secs(20), || {
        let rules = api(&lab, "rules", "").unwrap();
        let list: Vec<Value> = rules["data"]["groups"][0]["rules"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        list.len() == rule_count && list.iter().all(|r| r["health"] == "ok")
    });
    let alerts = api(&lab, "alerts", "").unwrap();
    let active: BTreeSet<String> = alerts["data"]["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["labels"]["alertname"].as_str().unwrap().to_string())
        .collect();
    for want in ["PalisadeUnknownClientTraffic", "PalisadeResolutionFailures"] {
        assert!(
            active.contains(want),
            "{want} not pending/firing: {active:?}\nrules: {}",
            api(&lab, "rules", "").unwrap()
        );
    }
    assert!(!active.contains("PalisadeNotReady"), "{active:?}");
    // No [enforcement]: no palisade_enforcement_ok, nothing to fire.
    assert!(!active.contains("PalisadeEnforcementMissing"), "{active:?}");
    // No [otel]: no palisade_otel_dropped_total, nothing to fire.
    assert!(!active.contains("PalisadeOtelDropping"), "{active:?}");
    // One replica serves one policy: the fleet alert stays quiet.
    assert!(
        !active.contains("PalisadeFleetPolicyMismatch"),
        "{active:?}"
    );

    // promtool lints a real scrape.
    let scrape = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    assert!(scrape.success(), "{}", scrape.describe());
    let lint = promtool(&["check", "metrics"], Some(scrape.stdout.as_bytes()));
    assert!(lint.success(), "{}", lint.describe());
    drop(prom);
}

/// Series identity of a scrape: every sample line without its value.
fn series(lab: &Lab) -> BTreeSet<String> {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    assert!(out.success(), "{}", out.describe());
    out.stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s.to_string()))
        .collect()
}

#[test]
fn ten_thousand_hosts_and_ports_add_no_series() {
    let lab = Lab::start(DEFAULT_POLICY);
    // Warm up: one denied request creates the latency histogram's series.
    assert_eq!(lab.proxied_curl("http://warm.other.test/", &[]).status, 403);
    let before = series(&lab);

    // 10,000 connections, each from its own client port, each to its own name.
    let script = r#"
import socket, sys, time
deadline = time.monotonic() + 120
n = 0
for i in range(10000):
    if time.monotonic() > deadline:
        break
    s = socket.create_connection(("198.18.1.1", 3128), timeout=5)
    host = "h%d.x%d.other.test" % (i, i % 97)
    s.sendall(("GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (host, host)).encode())
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    if data.startswith(b"HTTP/1.1 403"):
        n += 1
print(n)
"#;
    let out = run_with_timeout(
        Command::new("ip").args(["netns", "exec", &lab.ns_client, "python3", "-c", script]),
        None,
        Duration::from_secs(150),
    );
    assert!(out.success(), "{}", out.describe());
    assert_eq!(out.stdout.trim(), "10000", "denied responses");

    let after = series(&lab);
    let added: Vec<&String> = after.difference(&before).collect();
    assert!(added.is_empty(), "new series: {added:?}");
    assert_eq!(before.len(), after.len());
}

#[test]
fn admin_answers_while_the_proxy_is_flooded() {
    // Held heads must outlive a slow flood on a loaded machine.
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option("header_read_timeout = \"60s\"")
        .start();
    // 3,000 connections that never finish a request head, held open while
    // the admin listener is asked for readiness and metrics.
    let script = r#"
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
held = []
for i in range(3000):
    s = socket.create_connection(("198.18.1.1", 3128), timeout=5)
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allo")
    held.append(s)
print("holding", len(held), flush=True)
time.sleep(float(sys.argv[1]))
"#;
    let mut flood = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.ns_client,
            "python3",
            "-c",
            script,
            "15",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start flood");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(flood.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "holding 3000", "flood did not start");
    // The default per-org cap (2,000) holds; the other 1,000 were refused and recorded.
    // The kernel completes handshakes before Palisade accepts them: wait
    // (bounded) for the accept loop to catch up, then the cap must hold.
    let active = || scalar_from_scrape(&lab, "palisade_active_connections{org=\"acme\"}");
    lab::wait_until("2000 active connections", Duration::from_secs(10), || {
        active() >= 2000.0
    });
    assert_eq!(active(), 2000.0, "active connections");
    lab::wait_until("limit_exceeded counted", Duration::from_secs(5), || {
        scalar_from_scrape(
            &lab,
            "palisade_connections_total{decision=\"deny\",mode=\"explicit\",org=\"acme\",reason=\"limit_exceeded\"}",
        ) == 1000.0
    });
    for path in ["/readyz", "/healthz", "/metrics"] {
        let started = Instant::now();
        let out = lab.proxy_ns_exec(
            "curl",
            &[
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
                &format!("http://{}{path}", lab::ADMIN_ADDR),
            ],
        );
        assert_eq!(out.stdout, "200", "{path}: {}", out.describe());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{path} took {:?}",
            started.elapsed()
        );
    }
    let _ = flood.kill();
    let _ = flood.wait();
}

/// One sample's value from a direct scrape of the admin listener.
pub(crate) fn scalar_from_scrape(lab: &Lab, series: &str) -> f64 {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    out.stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .map(|v| v.trim().parse().unwrap_or(f64::NAN))
        })
        .unwrap_or(f64::NAN)
}

#[test]
fn transparent_decisions_are_timed_once_under_their_own_mode() {
    // No org holds the sandbox: its connections are decided `unknown_client`.
    let lab = Lab::builder()
        .policy(
            "[[org]]\nname = \"acme\"\nclients = [\"198.18.9.0/24\"]\n\n\
             [[org.allow]]\nhost = \"allowed.test\"\n",
        )
        .proxy_option(&format!(
            "transparent = [\"{}\"]",
            crate::transparent::TRANSPARENT
        ))
        .start();
    crate::transparent::load_gateway(&lab);
    let out = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "5",
            &format!("http://{}/", lab::ALLOWED_IP),
        ],
    );
    assert!(!out.success(), "{}", out.describe());
    lab.wait_evidence("transparent unknown client", |v| {
        v["mode"] == "transparent" && v["reason"] == "unknown_client"
    });
    let count = |mode: &str| {
        scalar_from_scrape(
            &lab,
            &format!("palisade_decision_duration_seconds_count{{mode=\"{mode}\"}}"),
        )
    };
    assert_eq!(count("transparent"), 1.0);
    assert!(
        count("explicit").is_nan(),
        "a transparent decision timed as explicit too: {}",
        count("explicit")
    );
}
