//! Connection budgets: a connection counts for the org it is decided for,
//! and a stranger's address can exhaust only its own pre-authentication
//! budget (`max_connections_per_client`), never an org's.

use std::time::Duration;

use crate::lab::{self, Lab};
use crate::metrics::scalar_from_scrape;
use crate::socks5::new_token;

/// Hold N idle connections to the explicit listener from the stranger's
/// address; print how many the proxy kept open and how many it refused.
const HOLD: &str = r#"
import socket, sys, time
P = ("198.18.1.1", 3128)
held = []
for _ in range(int(sys.argv[1])):
    held.append(socket.create_connection(P, timeout=5, source_address=(sys.argv[2], 0)))
time.sleep(1.5)
kept = 0
for s in held:
    s.setblocking(False)
    try:
        s.recv(1)
    except BlockingIOError:
        kept += 1
    except OSError:
        pass
print("kept %d refused %d" % (kept, len(held) - kept), flush=True)
time.sleep(float(sys.argv[3]))
"#;

#[test]
fn a_stranger_holding_idle_connections_leaves_token_clients_served() {
    let (token, token_line) = new_token("tok");
    let policy = format!(
        "[[org]]\nname = \"tok\"\nidentity = \"token\"\n{token_line}\n\
         [[org.allow]]\nhost = \"allowed.test\"\n"
    );
    // Before, clients of no org at accept (strangers and every token
    // client) shared one bucket the size of max_connections_per_org.
    let lab = Lab::builder()
        .policy(&policy)
        .proxy_option("max_connections_per_client = 40")
        .proxy_option("max_connections_per_org = 50")
        .proxy_option("header_read_timeout = \"60s\"")
        .start();
    let (mut stranger, line) = lab.spawn_client_script(HOLD, &["120", lab::STRANGER_IP, "10"]);
    assert_eq!(line, "kept 40 refused 80", "{}", lab.proxy_output());

    // A token client on another address is served, again and again, while
    // the stranger holds its whole budget.
    let proxy = format!("http://tok:{token}@{}", lab::PROXY_ADDR);
    for i in 0..5 {
        let r = lab.client_curl(&["-x", &proxy, "http://allowed.test/"]);
        assert_eq!(
            r.status,
            200,
            "token request {i}: {r:#?}\n{}",
            lab.proxy_output()
        );
    }
    let allow = lab.wait_evidence("token client allowed", |v| {
        v["org"] == "tok" && v["decision"] == "allow"
    });
    assert!(
        allow["client"]
            .as_str()
            .unwrap()
            .starts_with(lab::CLIENT_IP),
        "{allow}"
    );
    // The stranger's refusals name its own budget and no org.
    let refused = lab.wait_evidence("stranger over its budget", |v| {
        v["reason"] == "limit_exceeded"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("max_connections_per_client"))
    });
    assert!(refused["org"].is_null(), "{refused}");
    assert!(
        refused["client"]
            .as_str()
            .unwrap()
            .starts_with(lab::STRANGER_IP),
        "{refused}"
    );
    // 80 refusals in a burst: the first 50 (the default rate's burst) are
    // written one by one, the rest folded into a summary naming the
    // stranger, counted, and never lost.
    let summary = lab.wait_evidence("summary of the stranger's refusals", |v| {
        v["count"].is_u64()
            && v["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(lab::STRANGER_IP))
    });
    assert_eq!(summary["reason"], "limit_exceeded", "{summary}");
    assert!(summary["org"].is_null(), "{summary}");
    let n = summary["count"].as_u64().unwrap();
    assert_eq!(summary["reasons"]["limit_exceeded"], n, "{summary}");
    let suppressed =
        scalar_from_scrape(&lab, "palisade_evidence_suppressed_total{org=\"unknown\"}");
    assert!(
        suppressed >= n as f64 && suppressed <= 30.0,
        "{suppressed} vs {n}"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}

/// An org's refusals written one record each because its evidence budget
/// was spent (not folded into a summary).
pub(crate) fn budget_refusals_one_by_one(ev: &[serde_json::Value], org: &str) -> u64 {
    ev.iter()
        .filter(|v| {
            v["org"] == org
                && v["reason"] == "limit_exceeded"
                && v["count"].is_null()
                && v["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("evidence budget"))
        })
        .count() as u64
}

/// The sum of every sample of metric `name` whose labels include all of
/// `labels` (each `key="value"`), whatever their order.
pub(crate) fn scrape_sum(lab: &Lab, name: &str, labels: &[&str]) -> f64 {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    let prefix = format!("{name}{{");
    out.stdout
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| labels.iter().all(|want| series.contains(want)))
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

/// Sends N absolute-form requests for allowed.test on keep-alive
/// connections as fast as they are answered (bounded to 20 s), then prints
/// one JSON line: the seconds taken, the count per status, and the body of
/// one 503.
const BURST: &str = r#"
import json, socket, sys, time
P = ("198.18.1.1", 3128)
def exchange(s):
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        c = s.recv(65536)
        if not c:
            raise OSError("closed")
        data += c
    h, _, rest = data.partition(b"\r\n\r\n")
    n = 0
    for line in h.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    while len(rest) < n:
        c = s.recv(65536)
        if not c:
            break
        rest += c
    return h[9:12].decode(), rest.decode(errors="replace")
counts, body503, s = {}, "", None
t0 = time.time()
for i in range(int(sys.argv[1])):
    if time.time() - t0 > 20:
        break
    try:
        if s is None:
            s = socket.create_connection(P, timeout=5)
        status, body = exchange(s)
        counts[status] = counts.get(status, 0) + 1
        if status == "503":
            body503 = body
    except OSError:
        counts["error"] = counts.get("error", 0) + 1
        s = None
print(json.dumps({"secs": time.time() - t0, "counts": counts, "body503": body503}), flush=True)
"#;

#[test]
fn an_org_over_its_evidence_budget_is_refused_and_summarised_and_another_is_served() {
    const BUDGET: u64 = 20;
    const SENT: u64 = 400;
    let policy = "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
                  [[org.allow]]\nhost = \"allowed.test\"\n\n\
                  [[org]]\nname = \"beta\"\nclients = [\"198.18.4.0/24\"]\n\
                  [[org.allow]]\nhost = \"allowed.test\"\n";
    let lab = Lab::builder()
        .policy(policy)
        .second_client()
        .evidence_config(&format!("max_records_per_second_per_org = {BUDGET}"))
        .start();
    let (mut burst, line) = lab.spawn_client_script(BURST, &[&SENT.to_string()]);
    let _ = burst.wait();
    let out: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{e}: {line:?}\n{}", lab.proxy_output()));
    let secs = out["secs"].as_f64().unwrap();
    let ok = out["counts"]["200"].as_u64().unwrap_or(0);
    let refused = out["counts"]["503"].as_u64().unwrap_or(0);
    // The burst, plus what refilled while the requests ran, and no more.
    let bound = (BUDGET as f64 * (secs + 1.0)) as u64 + 1;
    assert!(
        ok >= BUDGET && ok <= bound,
        "{ok} allowed, bound {bound}: {out}"
    );
    assert!(refused > 0, "nothing refused in {secs:.1} s: {out}");
    let body = out["body503"].as_str().unwrap();
    for want in ["limit_exceeded", "summarised", "evidence budget"] {
        assert!(body.contains(want), "{want:?} not in {body:?}");
    }

    // Another org has a budget of its own.
    for i in 0..5 {
        let r = lab.curl_in(
            &lab.ns_client2.clone(),
            &["-x", lab::PROXY_URL, "http://allowed.test/"],
        );
        assert_eq!(r.status, 200, "beta's request {i}: {r:#?}");
    }

    // Every allow is on record one by one; every refusal is on record too,
    // in a summary (or one by one, when a record refilled meanwhile), and
    // together they stay within the budget.
    let (mut summarised, mut one_by_one) = (0, 0);
    lab::wait_until("acme's refusals on record", Duration::from_secs(10), || {
        let ev = lab.evidence();
        summarised = ev
            .iter()
            .filter(|v| v["org"] == "acme" && v["count"].is_u64())
            .map(|v| v["reasons"]["limit_exceeded"].as_u64().unwrap_or(0))
            .sum::<u64>();
        one_by_one = budget_refusals_one_by_one(&ev, "acme");
        summarised + one_by_one == refused
    });
    assert!(summarised > 0, "nothing summarised");
    let ev = lab.evidence();
    let allows = ev
        .iter()
        .filter(|v| v["org"] == "acme" && v["event"] == "decision" && v["decision"] == "allow")
        .count() as u64;
    assert_eq!(allows, ok, "one allow record per request let through");
    assert!(
        allows + one_by_one <= bound,
        "{allows} allows and {one_by_one} denials written one by one, over the budget's {bound}"
    );
    let limited = scrape_sum(
        &lab,
        "palisade_connections_total",
        &[
            "org=\"acme\"",
            "reason=\"limit_exceeded\"",
            "decision=\"deny\"",
        ],
    );
    assert_eq!(limited, refused as f64, "counted as limit_exceeded");
    let suppressed = scrape_sum(
        &lab,
        "palisade_evidence_suppressed_total",
        &["org=\"acme\""],
    );
    assert_eq!(suppressed, summarised as f64, "what the summaries absorbed");
    assert_eq!(
        scrape_sum(
            &lab,
            "palisade_evidence_suppressed_total",
            &["org=\"beta\""]
        ),
        0.0
    );
}
