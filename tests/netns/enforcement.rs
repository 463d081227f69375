//! The enforcement check (`[enforcement]`): the proxy namespace is the
//! gateway and loads the shipped ruleset (`docker/nftables.conf`, its
//! defines set for the lab); Palisade compares the file's tables with what
//! the kernel has loaded. A table deleted from under it (`nft delete
//! table`, as a reboot, a flush or another tool would) fails `/readyz`,
//! is recorded, and in `required` mode refuses new connections, until the
//! ruleset is loaded again. Timings are printed, not asserted beyond the
//! bound a check interval sets.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Lab, DEFAULT_POLICY};
use crate::probe::{assert_classes, probe_report, probe_run};
use crate::transparent::{curl_with, gateway_ruleset, load_ruleset, TRANSPARENT};

/// The check interval of these tests.
const INTERVAL: &str = "200ms";
/// How long a change may take to show: many intervals, for a loaded machine.
const WITHIN: Duration = Duration::from_secs(10);

/// A lab whose config names the gateway ruleset (written to the lab's
/// dir) with `mode`, the ruleset loaded when `loaded`, Palisade started.
fn lab_with(mode: &str, loaded: bool) -> Lab {
    lab_from(Lab::builder().policy(DEFAULT_POLICY), mode, loaded)
}

/// [`lab_with`] from `builder` (a policy of its own, interception).
fn lab_from(builder: lab::LabBuilder, mode: &str, loaded: bool) -> Lab {
    let mut lab = builder
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .without_proxy()
        .start();
    // The sandbox's default route is the gateway (transparent mode).
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["route", "add", "default", "via", "198.18.1.1"],
    );
    assert!(out.success(), "{}", out.describe());
    let ruleset = lab.dir.join("gateway.nft");
    std::fs::write(&ruleset, gateway_ruleset()).unwrap();
    let mut config = std::fs::read_to_string(&lab.config_path).unwrap();
    config.push_str(&format!(
        "\n[enforcement]\nruleset = \"{}\"\nmode = \"{mode}\"\ncheck_interval = \"{INTERVAL}\"\n",
        ruleset.display()
    ));
    std::fs::write(&lab.config_path, config).unwrap();
    if loaded {
        load_ruleset(&lab, &gateway_ruleset());
    }
    lab.spawn_proxy();
    lab
}

fn nft(lab: &Lab, args: &[&str]) {
    let out = lab.proxy_ns_exec("nft", args);
    assert!(out.success(), "nft {args:?}: {}", out.describe());
}

fn enforcement_ok(lab: &Lab) -> Option<String> {
    let out = lab.proxy_ns_exec(
        "curl",
        &[
            "-sS",
            "--max-time",
            "2",
            &format!("http://{}/metrics", lab::ADMIN_ADDR),
        ],
    );
    out.stdout.lines().find_map(|l| {
        l.strip_prefix("palisade_enforcement_ok ")
            .map(str::to_string)
    })
}

fn enforcement_records(lab: &Lab) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "enforcement")
        .collect()
}

/// Poll `f` until it holds (bounded by [`WITHIN`]); the time it took.
fn until(what: &str, lab: &Lab, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while start.elapsed() < WITHIN {
        if f() {
            return start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("{what}: not within {WITHIN:?}\n{}", lab.proxy_output());
}

/// Plain HTTP to allowed.test from the sandbox, no proxy settings: the
/// gateway redirects it to the transparent listener.
fn transparent(lab: &Lab) -> lab::CmdOutput {
    curl_with(
        lab,
        &[],
        "http://allowed.test/",
        "allowed.test:80:198.18.2.10",
    )
}

fn allowed(lab: &Lab) -> lab::HttpResp {
    lab.proxied_curl("http://allowed.test/", &["--max-time", "5"])
}

#[test]
fn a_deleted_table_fails_readiness_and_refuses_connections_until_it_is_loaded_again() {
    let mut lab = lab_with("required", true);
    lab.wait_proxy_ready();
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("1"));
    let first = lab.wait_evidence("the start's verified record", |v| {
        v["kind"] == "enforcement" && v["event"] == "verified"
    });
    assert_eq!(first["decision"], "allow", "{first}");
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "{ok:?}");

    // The table goes, as a flush or another tool's `nft delete` would
    // take it. Each step is timed from here.
    let deleted = Instant::now();
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    let to_503 = deleted.elapsed();
    let mut refused = None;
    until("a new connection refused", &lab, || {
        let r = allowed(&lab);
        let done = r.status == 503 && r.body.contains("enforcement_missing");
        if done {
            refused = Some(r);
        }
        done
    });
    let to_refused = deleted.elapsed();
    eprintln!(
        "enforcement: nft delete table -> /readyz 503 in {to_503:?}, -> first refused connection in {to_refused:?} (check_interval {INTERVAL})"
    );
    let failed = lab.wait_evidence("the failed record", |v| {
        v["kind"] == "enforcement" && v["event"] == "failed"
    });
    assert_eq!(failed["reason"], "enforcement_missing", "{failed}");
    assert_eq!(failed["decision"], "deny", "{failed}");
    assert_eq!(
        failed["differs"],
        serde_json::json!(["table inet palisade is not loaded"]),
        "{failed}"
    );
    let refusal = lab.wait_evidence("the refused connection's record", |v| {
        v["kind"] == "http" && v["reason"] == "enforcement_missing"
    });
    assert_eq!(refusal["org"], "acme", "{refusal}");
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("0"));
    // Checked again and again while missing, recorded once.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        enforcement_records(&lab)
            .iter()
            .filter(|v| v["event"] == "failed")
            .count(),
        1
    );

    // A changed table (a rule gone from input) is no better than none.
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 after the reload", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    assert_eq!(allowed(&lab).status, 200);
    assert!(transparent(&lab).stdout.contains("HTTP 200"));
    nft(&lab, &["flush", "chain", "inet", "palisade", "forward"]);
    until("/readyz 503 after a flushed chain", &lab, || {
        lab.admin_status("/readyz") == 503
    });
    let flushed = lab.wait_evidence("the flushed chain's record", |v| {
        v["kind"] == "enforcement"
            && v["event"] == "failed"
            && v["differs"][0] != "table inet palisade is not loaded"
    });
    assert_eq!(
        flushed["differs"],
        serde_json::json!([
            "chain inet palisade forward: rule 1 differs (0 rules loaded, the file has 1)"
        ]),
        "{flushed}"
    );
    // The redirect still works, so transparent connections reach Palisade:
    // refused (reset) and recorded, as explicit ones are.
    let reset = transparent(&lab);
    assert!(!reset.stdout.contains("HTTP 200"), "{}", reset.describe());
    let refusal = lab.wait_evidence("the transparent refusal", |v| {
        v["kind"] == "tcp" && v["mode"] == "transparent" && v["reason"] == "enforcement_missing"
    });
    assert_eq!(refusal["host"], "allowed.test", "{refusal}");
    assert_eq!(refusal["ip"], lab::ALLOWED_IP, "{refusal}");

    // Loaded again: ready, recorded, connections let through.
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 again", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("1"));
    let verified = enforcement_records(&lab)
        .into_iter()
        .filter(|v| v["event"] == "verified")
        .count();
    assert_eq!(verified, 3, "{:?}", enforcement_records(&lab));
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "{ok:?}");
}

#[test]
fn advisory_mode_records_and_reports_but_refuses_nothing() {
    // Started without the ruleset: it serves, but is not ready.
    let lab = lab_with("advisory", false);
    until("the admin listener up, not ready", &lab, || {
        lab.admin_status("/readyz") == 503
    });
    assert_eq!(lab.admin_status("/healthz"), 200);
    assert_eq!(enforcement_ok(&lab).as_deref(), Some("0"));
    let failed = lab.wait_evidence("the start's failed record", |v| {
        v["kind"] == "enforcement" && v["event"] == "failed"
    });
    assert_eq!(
        failed["differs"],
        serde_json::json!(["table inet palisade is not loaded"]),
        "{failed}"
    );
    let ok = allowed(&lab);
    assert_eq!(ok.status, 200, "advisory refuses nothing: {ok:?}");

    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200 once loaded", &lab, || {
        lab.admin_status("/readyz") == 200
    });
    lab.wait_evidence("the verified record", |v| {
        v["kind"] == "enforcement" && v["event"] == "verified"
    });
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    assert_eq!(allowed(&lab).status, 200);
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["reason"] == "enforcement_missing" && v["kind"] != "enforcement"),
        "nothing refused in advisory mode"
    );
}

#[test]
fn start_up_with_a_required_ruleset_absent_fails_with_one_line() {
    let mut lab = lab_with("required", false);
    let status = lab
        .wait_proxy_exit(WITHIN)
        .unwrap_or_else(|| panic!("still running\n{}", lab.proxy_output()));
    assert!(!status.success(), "{status}");
    let out = lab.proxy_output();
    let last = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.contains("enforcement: the required ruleset ")
            && last.ends_with(
                "gateway.nft is not loaded as written: table inet palisade is not loaded"
            ),
        "{out}"
    );
    // A ruleset that does not load is a located error, in the file.
    let broken = lab.dir.join("gateway.nft");
    std::fs::write(
        &broken,
        "table inet palisade {\n  chain c {\n    bogus\n  }\n}\n",
    )
    .unwrap();
    let out = lab.proxy_ns_exec(
        crate::lab::palisade_bin(),
        &["check", "-c", &lab.config_path.display().to_string()],
    );
    assert_eq!(out.code(), Some(1), "{}", out.describe());
    assert!(
        out.stderr.starts_with(&format!("{}:3:", broken.display()))
            && out
                .stderr
                .contains(": enforcement ruleset does not load: syntax error"),
        "{}",
        out.describe()
    );
}

/// Probes through the explicit proxy: one allowed, one denied by policy.
const PLAN: &str = r#"
org = "acme"
proxy = "198.18.1.1:3128"
timeout = "3s"
deadline = "60s"

[[probe]]
id = "allow"
target = "http://allowed.test/palisade-probe/{marker}"
via = "proxy"
expect = "allow"

[[probe]]
id = "deny"
target = "http://other.test/palisade-probe/{marker}"
via = "proxy"
expect = "deny"
"#;

#[test]
fn probes_run_while_enforcement_was_not_verified_are_inconclusive() {
    // Advisory: the proxy lets the allowed probe through and denies the
    // other, as it would with the ruleset, but nothing holds the sandbox
    // to the proxy meanwhile.
    let mut lab = lab_with("advisory", true);
    lab.wait_proxy_ready();
    let verified = probe_run(&lab, &lab.ns_client, "verified", PLAN);
    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    let missing = probe_run(&lab, &lab.ns_client, "missing", PLAN);
    load_ruleset(&lab, &gateway_ruleset());
    until("/readyz 200", &lab, || lab.admin_status("/readyz") == 200);
    let again = probe_run(&lab, &lab.ns_client, "again", PLAN);

    let unsealed = ["--allow-unsealed"];
    for (name, obs) in [("verified", &verified), ("again", &again)] {
        let r = probe_report(&lab, name, obs, &lab.evidence_dir, &unsealed);
        assert_classes(
            &r,
            &[("allow", "enforced_allow"), ("deny", "enforced_deny")],
        );
    }
    let r = probe_report(&lab, "missing", &missing, &lab.evidence_dir, &unsealed);
    assert_classes(&r, &[("allow", "inconclusive"), ("deny", "inconclusive")]);
    let why = r.probe("deny")["why"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        why.contains("enforcement was not verified while the probe ran")
            && why.contains("table inet palisade is not loaded"),
        "{why}"
    );
}

/// A client in the client namespace holding one intercepted connection
/// (CONNECT allowed.test:443, TLS trusting the org CA, HTTP/1.1): it sends
/// one request and prints `first STATUS`, waits for the go file (at most
/// 30 s), sends another on the same connection and prints `second STATUS
/// BODY`. Arguments: proxy host, port, CA file, go file.
const HELD_CLIENT: &str = r#"
import os, socket, ssl, sys, time
host, port, ca, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = socket.create_connection((host, port), timeout=10)
s.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
head = b""
while b"\r\n\r\n" not in head:
    d = s.recv(4096)
    if not d:
        break
    head += d
if b" 200" not in head.split(b"\r\n")[0]:
    print("connect", head[:200], flush=True)
    sys.exit(0)
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["http/1.1"])
t = ctx.wrap_socket(s, server_hostname="allowed.test")
def get():
    t.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = t.recv(65536)
        if not d:
            return "closed", ""
        buf += d
    h, _, body = buf.partition(b"\r\n\r\n")
    lines = h.decode("latin-1").split("\r\n")
    n, chunked = 0, False
    for l in lines[1:]:
        k, _, v = l.partition(":")
        if k.strip().lower() == "content-length":
            n = int(v)
        if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
            chunked = True
    while (len(body) < n and not chunked) or (chunked and not body.endswith(b"0\r\n\r\n")):
        d = t.recv(65536)
        if not d:
            break
        body += d
    return lines[0].split(" ")[1], body.decode("latin-1").replace("\n", " ")[:400]
status, _ = get()
print("first", status, flush=True)
deadline = time.time() + 30
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.02)
status, body = get()
print("second", status, body, flush=True)
"#;

/// An intercepted connection opened while the ruleset was loaded forwards
/// no further request once it is missing: each request inside is admitted
/// like a new connection (`enforcement_missing`, recorded, linked to the
/// connection's own record).
#[test]
fn an_intercepted_connection_forwards_no_request_once_the_ruleset_is_missing() {
    let dir = lab::scratch_dir("enforcement-intercept");
    let ca_dir = dir.join("ca");
    let builder = Lab::builder()
        .policy(
            "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
             [[org.allow]]\nid = \"registry\"\nhost = \"allowed.test\"\nports = [443]\nintercept = true\n\
             [[org.allow]]\nid = \"plain\"\nhost = \"allowed.test\"\nports = [80]\n",
        )
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}\n",
            ca_dir.display().to_string(),
            lab::ca_pem().display().to_string()
        ));
    let mut lab = lab_from(builder, "required", true);
    lab.wait_proxy_ready();
    let ca = ca_dir.join("acme.pem").display().to_string();
    let go = dir.join("go");
    let (proxy_host, proxy_port) = lab::PROXY_ADDR.split_once(':').unwrap();
    let go_arg = go.display().to_string();
    let (child, first) =
        lab.spawn_client_script(HELD_CLIENT, &[proxy_host, proxy_port, &ca, &go_arg]);
    let mut child = lab::Background(child);
    assert_eq!(first, "first 200", "{}", lab.proxy_output());

    nft(&lab, &["delete", "table", "inet", "palisade"]);
    until("/readyz 503", &lab, || lab.admin_status("/readyz") == 503);
    until("a new connection refused", &lab, || {
        allowed(&lab).body.contains("enforcement_missing")
    });
    std::fs::write(&go, "").unwrap();
    let mut second = String::new();
    if let Some(out) = child.0.stdout.as_mut() {
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut second);
    }
    assert!(
        second.starts_with("second 503") && second.contains("enforcement_missing"),
        "the held connection's next request: {second:?}"
    );
    let tunnel = lab.wait_evidence("the connection's allow record", |v| {
        v["kind"] == "tcp" && v["host"] == "allowed.test" && v["decision"] == "allow"
    });
    let refusal = lab.wait_evidence("the request's refusal", |v| {
        v["kind"] == "http" && v["reason"] == "enforcement_missing" && v["conn"].is_string()
    });
    assert_eq!(refusal["conn"], tunnel["id"], "{refusal}");
    assert_eq!(refusal["decision"], "deny", "{refusal}");
    assert_eq!(refusal["org"], "acme", "{refusal}");
}
