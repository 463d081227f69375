//! Abuse from inside the sandbox: garbage, huge heads, many headers,
//! slowloris, half-open connections and a CONNECT flood from one org. The
//! proxy stays up, another org's requests still succeed in bounded time,
//! memory stays bounded, and the rejections are recorded. Also the rate
//! limits: new connections per org, DNS queries per client.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::lab::{self, Lab, DEFAULT_POLICY};

/// acme (the flooding sandbox) plus beta, a second org on the stranger address.
fn policy() -> String {
    format!(
        "{DEFAULT_POLICY}
[[org]]
name = \"beta\"
clients = [\"{}/32\"]

[[org.allow]]
host = \"allowed.test\"
",
        lab::STRANGER_IP
    )
}

fn rss_kib(lab: &Lab) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", lab.proxy_pid())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

const ABUSE: &str = r#"
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
P = ("198.18.1.1", 3128)
def conn():
    return socket.create_connection(P, timeout=5)
held = []
# garbage bytes
for _ in range(50):
    s = conn(); s.sendall(bytes(range(256)) * 4); held.append(s)
# a 1 MiB request head and 10,000 headers
s = conn()
try:
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nX: " + b"a" * (1 << 20) + b"\r\n\r\n")
except OSError:
    pass
held.append(s)
s = conn()
try:
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(10000)) + b"\r\n")
except OSError:
    pass
held.append(s)
# 1,000 half-open connections: connected, nothing sent
for _ in range(1000):
    held.append(conn())
# a CONNECT flood
for _ in range(800):
    s = conn(); s.sendall(b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"); held.append(s)
# slowloris: one byte a second for a few seconds
s = conn()
for b in b"GET http://allowed.test/ HTTP/1.1\r\n"[:4]:
    try:
        s.sendall(bytes([b])); time.sleep(1)
    except OSError:
        break
print("abused", len(held), flush=True)
time.sleep(float(sys.argv[1]))
"#;

#[test]
fn abuse_from_one_org_leaves_the_proxy_serving_others() {
    let lab = Lab::builder()
        .policy(&policy())
        .proxy_option("header_read_timeout = \"3s\"")
        .start();
    let rss_before = rss_kib(&lab);
    let mut abuser = Command::new("ip")
        .args(["netns", "exec", &lab.ns_client, "python3", "-c", ABUSE, "6"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(abuser.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("abused"), "abuse script: {line:?}");

    // Another org is served, promptly, while the abuse holds its connections.
    for _ in 0..3 {
        let started = Instant::now();
        let r = lab.raw_request_from(
            lab::STRANGER_IP,
            "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(r.status, 200, "beta's request during the abuse: {r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "took {:?}",
            started.elapsed()
        );
    }
    // Memory stays bounded: ~1,900 connections in header reads or detection
    // cost hyper's read buffer and a detection buffer at most each; 192 MiB
    // over the start is far above that and far below an unbounded buffer.
    let rss = rss_kib(&lab);
    eprintln!("RSS during the abuse: {rss} KiB (at start {rss_before} KiB)");
    assert!(
        rss < rss_before + 192 * 1024,
        "RSS {rss} KiB (from {rss_before} KiB)"
    );
    let _ = abuser.wait();
    assert_eq!(lab.admin_status("/healthz"), 200);

    // The refusals are recorded: the oversized head, the garbage.
    let ev = lab.evidence();
    let bad: Vec<_> = ev
        .iter()
        .filter(|v| v["reason"] == "bad_request" && v["org"] == "acme")
        .collect();
    assert!(bad.len() >= 2, "bad_request records: {}", bad.len());
}

#[test]
fn new_connection_rate_and_dns_query_rate_are_limited_and_recorded() {
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option("max_new_connections_per_second_per_org = 10")
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra("max_queries_per_second_per_client = 5")
        .start();
    let script = r#"
import socket
codes = []
for _ in range(40):
    s = socket.create_connection(("198.18.1.1", 3128), timeout=5)
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        c = s.recv(4096)
        if not c:
            break
        data += c
    codes.append(data[9:12].decode())
print(" ".join(codes))
"#;
    let out = lab.client_exec("python3", &["-c", script]);
    let codes: Vec<&str> = out.stdout.split_whitespace().collect();
    assert_eq!(codes.len(), 40, "{}", out.describe());
    let limited = codes.iter().filter(|c| **c == "503").count();
    assert!(limited >= 20, "503s: {limited} of 40: {codes:?}");
    assert!(
        codes.iter().filter(|c| **c == "200").count() >= 10,
        "{codes:?}"
    );
    let rec = lab.wait_evidence("rate limit record", |v| {
        v["reason"] == "limit_exceeded"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("max_new_connections_per_second_per_org"))
    });
    assert_eq!(rec["org"], "acme", "{rec}");
    // After a second the bucket has refilled.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);

    // DNS: a burst of 20 queries from one client, 5 a second allowed.
    let statuses: Vec<String> = (0..20)
        .map(|i| lab.dig(&[&format!("q{i}.other.test"), "A"]).status)
        .collect();
    // Refusal records ride the next batch: wait for one (bounded).
    let rec = lab.wait_evidence(&format!("a per-client rate refusal ({statuses:?})"), |v| {
        v["kind"] == "dns"
            && v["reason"] == "limit_exceeded"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("max_queries_per_second_per_client"))
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
}

#[test]
fn detection_memory_is_bounded_and_its_limit_recorded() {
    // Room for one detection buffer; a tunnel holds it while its client
    // stays silent (up to detect_timeout).
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option("max_detect_memory_bytes = 20480")
        .proxy_option("detect_timeout = \"2s\"")
        .start();
    let mut a = lab.client_conn();
    assert_eq!(a.connect("allowed.test:80"), 200);
    let mut b = lab.client_conn();
    assert_eq!(b.connect("allowed.test:80"), 200);
    let rec = lab.wait_evidence("detection budget refusal", |v| {
        v["reason"] == "limit_exceeded"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("max_detect_memory_bytes"))
    });
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    // Whichever tunnel reached detection second was refused and closed.
    let refused_port = rec["client"]
        .as_str()
        .and_then(|c| c.rsplit(':').next())
        .and_then(|p| p.parse::<u16>().ok());
    let (holder, mut refused) = if refused_port == Some(b.local_port()) {
        (a, b)
    } else {
        assert_eq!(refused_port, Some(a.local_port()), "{rec}");
        (b, a)
    };
    assert!(
        matches!(
            refused.wait_closed(Duration::from_secs(3)),
            lab::Closed::After(_)
        ),
        "the refused tunnel stays open"
    );
    // Once the holder's detection is over (it stays open as a tunnel), the
    // budget is free again: it bounds bytes held before decisions, not
    // open tunnels.
    std::thread::sleep(Duration::from_millis(2500));
    let mut third = lab.client_conn();
    assert_eq!(third.connect("allowed.test:80"), 200);
    third
        .send(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        .unwrap();
    assert!(
        third
            .read_until(b"200 OK", Duration::from_secs(5))
            .is_some(),
        "a tunnel after the holder's detection did not pass"
    );
    drop(holder);
}
