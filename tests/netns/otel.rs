//! The OTLP export against a real OTLP/HTTP receiver (tests/fixtures/otlp.py,
//! decoding with the OpenTelemetry protobuf definitions) in the proxy
//! namespace: the log records and spans of an allowed and a denied
//! connection, a client's `traceparent` as the spans' parent, and a dead
//! collector that changes no decision and fills no memory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, read_jsonl, wait_until, Background, Lab, DEFAULT_POLICY};
use crate::metrics::{api, scalar_from_scrape, start_prometheus};

/// The venv .ci/run installs `opentelemetry-proto` into.
const OTLP_PYTHON: &str = "/opt/palisade-ci/otlp/bin/python";
const COLLECTOR: &str = "127.0.0.1:4318";

fn receiver(lab: &Lab) -> (Background, PathBuf) {
    assert!(
        Path::new(OTLP_PYTHON).exists(),
        "{OTLP_PYTHON} missing: .ci/run installs opentelemetry-proto into that venv"
    );
    let out = lab.dir.join("otlp.jsonl");
    let script = lab::fixtures_dir().join("otlp.py");
    let server = lab.spawn_server_in(
        &lab.ns_proxy,
        "OTLP receiver",
        OTLP_PYTHON,
        [
            script.to_str().unwrap(),
            "--listen",
            COLLECTOR,
            "--out",
            out.to_str().unwrap(),
        ],
    );
    (server, out)
}

/// A lab whose config has `otel` (lines of its own tables) before the
/// orgs; Palisade is not started yet (the collector goes first).
fn lab_with(otel: &str) -> Lab {
    Lab::builder()
        // The flood's allows are not held to an evidence budget.
        .evidence_config("max_records_per_second_per_org = 100000")
        .policy(&format!("{otel}\n{DEFAULT_POLICY}"))
        .without_proxy()
        .start()
}

const TRACE_CONNECT: &str = "0af7651916cd43dd8448eb211c80319c";
const TRACE_DENIED: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACE_PLAIN: &str = "5c1a0a9e0b1e4a7c9d3f2b8e6a4c2d10";
const PARENT: &str = "b7ad6b7169203331";

fn traceparent(trace: &str) -> String {
    format!("traceparent: 00-{trace}-{PARENT}-01")
}

fn spans_of<'a>(got: &'a [Value], trace: &str) -> Vec<&'a Value> {
    got.iter()
        .filter(|v| v["signal"] == "traces" && v["trace_id"] == trace)
        .collect()
}

#[test]
fn log_records_and_spans_of_allowed_and_denied_connections_reach_a_real_collector() {
    lab::require_root();
    let mut lab = lab_with(&format!(
        "[otel]\nendpoint = \"http://{COLLECTOR}\"\nservice_name = \"gw-test\"\n"
    ));
    let (_collector, out) = receiver(&lab);
    lab.spawn_proxy();
    lab.wait_proxy_ready();

    // Allowed CONNECT, a traceparent on the CONNECT request itself.
    let tp = traceparent(TRACE_CONNECT);
    let ok = lab.proxied_curl("https://allowed.test/", &["--proxy-header", &tp]);
    assert_eq!(ok.status, 200, "{ok:?}");
    // Denied CONNECT (no rule), with its own traceparent.
    let tp = traceparent(TRACE_DENIED);
    let denied = lab.proxied_curl("https://other.test/", &["--proxy-header", &tp]);
    assert_eq!(denied.connect_status, 403, "{denied:?}");
    // Plain HTTP forwarded, the traceparent on the request.
    let tp = traceparent(TRACE_PLAIN);
    let plain = lab.proxied_curl("http://allowed.test/", &["-H", &tp]);
    assert_eq!(plain.status, 200, "{plain:?}");

    let allow = lab.wait_evidence("allowed CONNECT", |r| {
        r["event"] == "decision" && r["kind"] == "tcp" && r["host"] == "allowed.test"
    });
    let deny = lab.wait_evidence("denied CONNECT", |r| {
        r["event"] == "decision" && r["host"] == "other.test"
    });
    let http = lab.wait_evidence("forwarded request", |r| {
        r["event"] == "decision" && r["kind"] == "http"
    });

    // Every decision record arrives as a log record (within the export
    // interval), with its fields as the body.
    let log_of = |rec: &Value| {
        let id = rec["id"].as_str().unwrap().to_owned();
        let mut found = None;
        wait_until(
            &format!("the log record of {id}"),
            Duration::from_secs(15),
            || {
                found = read_jsonl(&out).into_iter().find(|v| {
                    v["signal"] == "logs" && v["attributes"]["palisade.record.id"] == id.as_str()
                });
                found.is_some()
            },
        );
        found.unwrap()
    };
    for (rec, decision, reason) in [
        (&allow, "allow", "rule_match"),
        (&deny, "deny", "no_matching_rule"),
        (&http, "allow", "rule_match"),
    ] {
        let log = log_of(rec);
        let a = &log["attributes"];
        assert_eq!(log["resource"]["service.name"], "gw-test", "{log}");
        assert_eq!(log["event_name"], "palisade.decision");
        assert_eq!(log["content_type"], "application/x-protobuf");
        assert_eq!(a["palisade.decision"], decision, "{log}");
        assert_eq!(a["palisade.reason"], reason, "{log}");
        assert_eq!(a["palisade.reason"], rec["reason"]);
        assert_eq!(a["palisade.org"], "acme");
        assert_eq!(a["palisade.policy"], rec["policy"]);
        assert_eq!(a["palisade.rule"], rec["rule"], "{log}");
        assert_eq!(a["server.address"], rec["host"]);
        assert_eq!(a["server.port"], rec["port"]);
        assert_eq!(a["client.address"], lab::CLIENT_IP);
        assert_eq!(a["network.transport"], "tcp");
        assert_eq!(
            log["body"]["id"], rec["id"],
            "the record's fields are the body"
        );
        assert_eq!(log["body"]["client"], rec["client"]);
        assert_eq!(
            log["severity"],
            if decision == "deny" { "WARN" } else { "INFO" }
        );
    }
    assert_eq!(log_of(&http)["attributes"]["http.request.method"], "GET");

    // The spans: the client's traceparent is the connection span's parent,
    // and resolve, decide and dial are its children.
    let mut got = Vec::new();
    wait_until(
        "the spans of all three traces",
        Duration::from_secs(15),
        || {
            got = read_jsonl(&out);
            [TRACE_CONNECT, TRACE_DENIED, TRACE_PLAIN].iter().all(|t| {
                spans_of(&got, t)
                    .iter()
                    .any(|s| s["name"] == "palisade.connection")
            }) && spans_of(&got, TRACE_CONNECT)
                .iter()
                .any(|s| s["name"] == "dial")
        },
    );
    let named = |trace: &str, name: &str| -> Value {
        spans_of(&got, trace)
            .into_iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no {name} span in {trace}: {}", lab::dump(&got)))
            .clone()
    };
    let conn = named(TRACE_CONNECT, "palisade.connection");
    assert_eq!(
        conn["parent_span_id"], PARENT,
        "the client's span is the parent"
    );
    assert_eq!(conn["resource"]["service.name"], "gw-test");
    assert_eq!(conn["attributes"]["palisade.mode"], "explicit");
    assert_eq!(conn["attributes"]["palisade.record.id"], allow["id"]);
    assert_eq!(conn["attributes"]["palisade.decision"], "allow");
    assert_eq!(conn["attributes"]["server.address"], "allowed.test");
    assert_eq!(conn["attributes"]["client.address"], lab::CLIENT_IP);
    let decide = named(TRACE_CONNECT, "decide");
    assert_eq!(decide["parent_span_id"], conn["span_id"]);
    assert_eq!(
        named(TRACE_CONNECT, "resolve")["parent_span_id"],
        decide["span_id"]
    );
    assert_eq!(
        named(TRACE_CONNECT, "dial")["parent_span_id"],
        conn["span_id"]
    );

    let conn = named(TRACE_DENIED, "palisade.connection");
    assert_eq!(conn["parent_span_id"], PARENT);
    assert_eq!(conn["attributes"]["palisade.decision"], "deny");
    assert_eq!(conn["attributes"]["palisade.reason"], "no_matching_rule");
    assert_eq!(conn["attributes"]["palisade.record.id"], deny["id"]);
    assert!(
        !spans_of(&got, TRACE_DENIED)
            .iter()
            .any(|s| s["name"] == "dial"),
        "a denied connection dials nothing: {}",
        lab::dump(&got)
    );

    // Plain HTTP: the request's span under the client's, linked to the
    // connection's; the decision is on the request's span.
    let req = named(TRACE_PLAIN, "palisade.request");
    assert_eq!(req["parent_span_id"], PARENT);
    assert_eq!(req["attributes"]["http.request.method"], "GET");
    assert_eq!(req["attributes"]["palisade.record.id"], http["id"]);
    let conn = named(TRACE_PLAIN, "palisade.connection");
    assert_eq!(req["links"][0]["span_id"], conn["span_id"], "{req}");
    assert_eq!(named(TRACE_PLAIN, "dial")["parent_span_id"], req["span_id"]);
    assert_eq!(
        scalar_from_scrape(&lab, "palisade_otel_dropped_total{signal=\"logs\"}"),
        0.0
    );
}

/// Requests of the flood: more than the queue (2048) and a batch (512)
/// hold, so most must be dropped and counted.
const FLOOD: usize = 6000;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

#[test]
fn a_collector_that_never_answers_changes_no_decision_and_the_queue_stays_bounded() {
    lab::require_root();
    // A collector that accepts connections and never answers: every export
    // waits its whole timeout, the worst a collector can do.
    let mut lab = lab_with(&format!("[otel]\nendpoint = \"http://{COLLECTOR}\"\n"));
    let (host, port) = COLLECTOR.split_once(':').unwrap();
    let _silent = lab.spawn_server_in(
        &lab.ns_proxy,
        "silent collector",
        "python3",
        [
            "-c",
            "import socket,sys,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind((sys.argv[1],int(sys.argv[2])))\ns.listen(1024)\nprint('ready',flush=True)\nconns=[]\nwhile True:\n    c,_=s.accept()\n    conns.append(c)\n",
            host,
            port,
        ],
    );
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    let pid = lab.proxy_pid();
    let _prometheus = start_prometheus(&lab);

    // Warm up (the first connections grow the pools), then measure.
    let warm = lab.proxied_curl(
        "http://allowed.test/warm[1-200]",
        &["-sS", "-o", "/dev/null"],
    );
    assert_eq!(warm.exit, Some(0), "{warm:?}");
    let before = rss_kib(pid);

    // The flood: one keep-alive connection, FLOOD requests, each its own
    // decision record and log record. Bounded in count, and in time by
    // curl's own limit.
    let url = format!("http://allowed.test/flood[1-{FLOOD}]");
    let flood = lab::run_with_timeout(
        std::process::Command::new("ip").args([
            "netns",
            "exec",
            &lab.ns_client,
            "curl",
            "-sS",
            "-x",
            lab::PROXY_URL,
            "--max-time",
            "150",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}\n",
            &url,
        ]),
        None,
        Duration::from_secs(160),
    );
    assert!(flood.success(), "{}", flood.describe());
    let codes: Vec<&str> = flood.stdout.lines().collect();
    assert_eq!(codes.len(), FLOOD);
    assert!(
        codes.iter().all(|c| *c == "200"),
        "every request is decided and served as without the export"
    );
    let records = lab
        .evidence()
        .iter()
        .filter(|r| r["event"] == "decision" && r["kind"] == "http" && r["decision"] == "allow")
        .count();
    assert_eq!(records, FLOOD + 200, "the evidence holds every decision");

    // Every log record is queued (at most the queue), in the export that
    // waits on the silent collector (at most a batch), or dropped and
    // counted: the queue does not grow with the flood.
    let bound = (FLOOD + 200 - 2048 - 512) as f64;
    let series = "palisade_otel_dropped_total{signal=\"logs\"}";
    let mut dropped = 0.0;
    wait_until(
        "the dropped log records counted",
        Duration::from_secs(10),
        || {
            dropped = scalar_from_scrape(&lab, series);
            dropped >= bound
        },
    );
    let after = rss_kib(pid);
    eprintln!("flood of {FLOOD}: {dropped} log records dropped, RSS {before} KiB -> {after} KiB");
    assert!(
        after < before + 64 * 1024,
        "RSS grew from {before} KiB to {after} KiB under the flood"
    );
    // The alert reads the counter: pending in a real Prometheus (it fires
    // after ten minutes of drops).
    wait_until(
        "PalisadeOtelDropping pending",
        Duration::from_secs(30),
        || {
            api(&lab, "alerts", "").is_some_and(|v| {
                v["data"]["alerts"].as_array().is_some_and(|a| {
                    a.iter().any(|a| {
                        a["labels"]["alertname"] == "PalisadeOtelDropping"
                            && a["labels"]["signal"] == "logs"
                    })
                })
            })
        },
    );
    // And the proxy still decides at once.
    let again = lab.proxied_curl("http://allowed.test/after", &[]);
    assert_eq!(again.status, 200, "{again:?}");
    let denied = lab.proxied_curl("http://other.test/", &[]);
    assert_eq!(denied.status, 403, "{denied:?}");
}

const TRACE_INTERCEPTED: &str = "9e3b1c2d4f5a60718293a4b5c6d7e8f9";

#[test]
fn an_intercepted_request_s_span_continues_the_traceparent_it_carries() {
    lab::require_root();
    let dir = lab::scratch_dir("otel-intercept");
    let ca_dir = dir.join("ca");
    let mut lab = Lab::builder()
        .policy(&format!(
            "[otel]\nendpoint = \"http://{COLLECTOR}\"\n\n[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\n\
             [[org.allow]]\nid = \"registry\"\nhost = \"allowed.test\"\nports = [443]\nintercept = true\n"
        ))
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            lab::ca_pem().display().to_string()
        ))
        .without_proxy()
        .start();
    let (_collector, out) = receiver(&lab);
    lab.spawn_proxy();
    lab.wait_proxy_ready();

    // The traceparent rides inside the tunnel, on the request itself: only
    // interception sees it.
    let org_ca = ca_dir.join("acme.pem").display().to_string();
    let tp = traceparent(TRACE_INTERCEPTED);
    let resp = lab.client_curl(&[
        "-x",
        lab::PROXY_URL,
        "--cacert",
        &org_ca,
        "-H",
        &tp,
        "https://allowed.test/api",
    ]);
    assert_eq!(resp.status, 200, "{resp:?}");
    let decided = lab.wait_evidence("the intercepted request", |r| {
        r["event"] == "decision" && r["kind"] == "http" && r["path"] == "/api"
    });

    let mut got = Vec::new();
    wait_until(
        "the intercepted request's spans",
        Duration::from_secs(15),
        || {
            got = read_jsonl(&out);
            let names: Vec<&Value> = spans_of(&got, TRACE_INTERCEPTED)
                .into_iter()
                .map(|s| &s["name"])
                .collect();
            names.contains(&&Value::from("palisade.request"))
                && names.contains(&&Value::from("upstream_tls"))
                && got.iter().any(|s| s["name"] == "palisade.connection")
        },
    );
    let named = |name: &str| -> Value {
        spans_of(&got, TRACE_INTERCEPTED)
            .into_iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no {name} span: {}", lab::dump(&got)))
            .clone()
    };
    let req = named("palisade.request");
    assert_eq!(
        req["parent_span_id"], PARENT,
        "the client's span is the parent"
    );
    assert_eq!(req["attributes"]["http.request.method"], "GET");
    assert_eq!(req["attributes"]["palisade.record.id"], decided["id"]);
    assert_eq!(req["attributes"]["palisade.decision"], "allow");
    // The connection (its CONNECT carried no traceparent) is a trace of its
    // own, linked from the request.
    let conn = got
        .iter()
        .find(|s| s["name"] == "palisade.connection")
        .unwrap();
    assert_eq!(conn["parent_span_id"], "", "{conn}");
    assert_eq!(req["links"][0]["span_id"], conn["span_id"], "{req}");
    assert_eq!(named("upstream_tls")["parent_span_id"], req["span_id"]);
}
