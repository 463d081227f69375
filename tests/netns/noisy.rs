//! Noisy neighbours: one org floods Palisade from every side at once for a
//! minute (CONNECTs, denials on one keep-alive connection, DNS over UDP and
//! over many TCP connections, name churn under an allowed wildcard, and an
//! unknown client), while another org's HTTPS and DNS requests must all
//! succeed, each within its own time bound, and each be on record. At the
//! end the chain verifies and the proxy's memory stayed under a ceiling.
//!
//! Latencies and A's evidence rate are printed for the record, never
//! asserted: the machine is shared and timing assertions would flake.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Lab, CLIENT2_IP, OTHER_IP, PROXY_URL, SHIM_IP, STRANGER_IP};

/// acme floods from the first sandbox (and its stranger address, which no
/// org owns); beta, in the second sandbox, only wants to get work done.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80, 443]
[[org.allow]]
host = "*.wild.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [443]
[[org.allow]]
host = "other.test"
"#;

/// How long the flood runs.
const FLOOD: Duration = Duration::from_secs(60);
/// beta's requests under attack: at least this many must complete.
const MIN_REQUESTS: usize = 60;
/// The proxy's resident memory must stay under this, flood or not. Its
/// queues are bounded (8192 evidence records, 1024 DNS queries in flight,
/// 16 DNS TCP connections per client); 256 MiB is far above what they
/// hold and far below what an unbounded queue would reach in a minute.
const RSS_CEILING_KIB: u64 = 256 * 1024;

/// The attacker: one thread per kind of flood, each bounded by the end
/// time and by a count. Prints `started`, then the counts as JSON.
const FLOOD_SCRIPT: &str = r#"
import json, random, resource, socket, struct, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
END = time.time() + float(sys.argv[1])
P, D = ("198.18.1.1", 3128), ("198.18.1.1", 53)
A, S = "198.18.1.2", sys.argv[2]
counts, lock = {}, threading.Lock()
def bump(k, n=1):
    with lock:
        counts[k] = counts.get(k, 0) + n
def query(name, qtype=1):
    h = struct.pack(">HHHHHH", random.randrange(65536), 0x0100, 1, 0, 0, 0)
    q = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    return h + q + struct.pack(">HH", qtype, 1)
def conn(src):
    return socket.create_connection(P, timeout=3, source_address=(src, 0))
def head(s):
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
    return h[9:12]
def connect_flood():
    for i in range(200000):
        if time.time() > END:
            return
        target = b"allowed.test:443" if i % 10 == 0 else b"other.test:443"
        try:
            s = conn(A)
            s.sendall(b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n\r\n")
            bump("connect_" + head(s).decode())
            s.close()
        except OSError:
            bump("connect_error")
def denials_keepalive():
    s = None
    for i in range(500000):
        if time.time() > END:
            return
        try:
            if s is None:
                s = conn(A)
            s.sendall(b"GET http://other.test/%d HTTP/1.1\r\nHost: other.test\r\n\r\n" % i)
            bump("keepalive_" + head(s).decode())
        except OSError:
            bump("keepalive_reconnect")
            s = None
def udp_flood(src, names, key):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((src, 0))
    s.settimeout(0.02)
    for i in range(100000):
        if time.time() > END:
            return
        for _ in range(20):
            s.sendto(query(names(i)), D)
        bump(key + "_sent", 20)
        try:
            while True:
                s.recv(4096)
                bump(key + "_answered")
        except OSError:
            pass
def tcp_dns_flood():
    for i in range(100000):
        if time.time() > END:
            return
        held = []
        for _ in range(32):
            try:
                c = socket.create_connection(D, timeout=2, source_address=(A, 0))
                q = query("other.test")
                c.sendall(struct.pack(">H", len(q)) + q)
                held.append(c)
            except OSError:
                bump("tcp_dns_refused")
        for c in held:
            try:
                if len(c.recv(4096)) > 0:
                    bump("tcp_dns_answered")
                else:
                    bump("tcp_dns_closed")
            except OSError:
                bump("tcp_dns_closed")
            c.close()
def stranger_http():
    for i in range(200000):
        if time.time() > END:
            return
        try:
            s = conn(S)
            s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
            bump("stranger_" + head(s).decode())
            s.close()
        except OSError:
            bump("stranger_error")
floods = [
    threading.Thread(target=connect_flood),
    threading.Thread(target=denials_keepalive),
    threading.Thread(target=udp_flood, args=(A, lambda i: "other.test", "udp")),
    threading.Thread(target=udp_flood, args=(A, lambda i: "c%d-%d.wild.test" % (i, random.randrange(1 << 30)), "churn")),
    threading.Thread(target=udp_flood, args=(S, lambda i: "allowed.test", "stranger_udp")),
    threading.Thread(target=tcp_dns_flood),
    threading.Thread(target=stranger_http),
]
for t in floods:
    t.daemon = True
    t.start()
print("started", flush=True)
for t in floods:
    t.join(max(0.1, END - time.time() + 10))
print(json.dumps(counts, sort_keys=True), flush=True)
"#;

fn rss_kib(pid: u32) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One of beta's requests, as it went.
#[derive(Debug)]
struct Done {
    what: &'static str,
    /// The source port, to find its record by.
    port: u16,
    /// The client's own measure of the exchange.
    took: Duration,
}

/// beta's HTTPS request through the proxy; panics unless it got a 200.
fn https(lab: &Lab, ctx: &str) -> Done {
    let ca = lab::ca_pem().display().to_string();
    let out = lab.exec(
        &lab.ns_client2,
        "curl",
        &[
            "-q",
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-x",
            PROXY_URL,
            "--cacert",
            &ca,
            "-w",
            "%{http_code} %{local_port} %{time_total}",
            "https://allowed.test/",
        ],
    );
    let w: Vec<&str> = out.stdout.split_whitespace().collect();
    assert!(
        out.success() && w.first() == Some(&"200"),
        "{ctx}: beta's HTTPS request failed: {}",
        out.describe()
    );
    Done {
        what: "https",
        port: w[1].parse().expect("local port"),
        took: Duration::from_secs_f64(w[2].parse().expect("time_total")),
    }
}

/// beta's DNS query from source port `port`; panics unless answered.
fn dns(lab: &Lab, port: u16, tcp: bool, ctx: &str) -> Done {
    let server = format!("@{SHIM_IP}");
    let source = format!("{CLIENT2_IP}#{port}");
    let mut args = vec![
        "+time=2",
        "+tries=2",
        "+nocookie",
        server.as_str(),
        "-b",
        source.as_str(),
        "other.test",
        "A",
    ];
    if tcp {
        args.push("+tcp");
    }
    let started = Instant::now();
    let out = lab.exec(&lab.ns_client2, "dig", &args);
    let wall = started.elapsed();
    let d = lab::Dig::parse(&out.stdout, out.code());
    assert!(
        d.status == "NOERROR" && d.of("A") == [OTHER_IP],
        "{ctx}: beta's DNS query ({}) failed: {}",
        if tcp { "tcp" } else { "udp" },
        out.describe()
    );
    let took = d
        .output
        .lines()
        .find_map(|l| l.strip_prefix(";; Query time: "))
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .map_or(wall, Duration::from_millis);
    Done {
        what: if tcp { "dns_tcp" } else { "dns_udp" },
        port,
        took,
    }
}

/// p50 and p99 of each kind of request, as one printable line (DNS
/// times are dig's own, in whole milliseconds; HTTPS times are curl's).
fn percentiles(done: &[Done]) -> String {
    let mut by: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    for d in done {
        by.entry(d.what).or_default().push(d.took);
    }
    by.iter_mut()
        .map(|(what, v)| {
            v.sort();
            let at = |p: usize| v[(v.len() * p / 100).min(v.len() - 1)];
            let ms = |d: Duration| d.as_secs_f64() * 1000.0;
            format!(
                "{what} n={} p50={:.1}ms p99={:.1}ms",
                v.len(),
                ms(at(50)),
                ms(at(99))
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every evidence line, read once: beta's records (parsed), and the bytes
/// and count of acme's and the unknown client's.
fn scan(dir: &Path) -> (Vec<Value>, u64, u64) {
    let mut beta = Vec::new();
    let (mut a_bytes, mut a_records) = (0u64, 0u64);
    let mut files: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    for f in files {
        let text = fs::read_to_string(&f).unwrap_or_default();
        for line in text.lines() {
            if line.contains(&format!("\"client\":\"{CLIENT2_IP}:")) {
                beta.push(serde_json::from_str(line).expect("evidence line"));
            } else if line.contains("\"org\":\"acme\"") || line.contains("\"org\":null") {
                a_bytes += line.len() as u64 + 1;
                a_records += 1;
            }
        }
    }
    (beta, a_bytes, a_records)
}

#[test]
fn a_flooding_org_neither_starves_another_nor_breaks_the_evidence() {
    let mut lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .second_client()
        .start();
    let pid = lab.proxy_pid();
    let mut ports = 41000u16..;
    let mut next_port = || ports.next().expect("ports");

    // Quiet: beta alone, for the baseline.
    let mut quiet = Vec::new();
    for i in 0..20 {
        quiet.push(https(&lab, "quiet"));
        quiet.push(dns(&lab, next_port(), i % 2 == 1, "quiet"));
    }
    let rss_quiet = rss_kib(pid);

    // The flood.
    let out = lab.dir.join("flood.out");
    let script = format!(
        "python3 - {} {STRANGER_IP} <<'EOF'\n{FLOOD_SCRIPT}\nEOF",
        FLOOD.as_secs()
    );
    let mut flood = lab.client_spawn(&script, &out);
    let started = Instant::now();
    lab::wait_until("the flood to start", Duration::from_secs(10), || {
        fs::read_to_string(&out).is_ok_and(|t| t.starts_with("started"))
    });

    // beta under attack: every request must succeed within its bound.
    let mut attacked = Vec::new();
    let mut rss_max = rss_quiet;
    let mut i = 0;
    while started.elapsed() + Duration::from_secs(3) < FLOOD && i < 5000 {
        let ctx = format!("request {i} under attack, {:?} in", started.elapsed());
        attacked.push(https(&lab, &ctx));
        attacked.push(dns(&lab, next_port(), i % 2 == 1, &ctx));
        rss_max = rss_max.max(rss_kib(pid));
        assert!(
            rss_max < RSS_CEILING_KIB,
            "proxy RSS {rss_max} KiB over the {RSS_CEILING_KIB} KiB ceiling"
        );
        i += 1;
    }
    assert!(
        attacked.len() >= MIN_REQUESTS,
        "beta completed only {} requests in {:?} of flood",
        attacked.len(),
        started.elapsed()
    );
    // The flood ends on its own (bounded); wait for its counts.
    let deadline = Instant::now() + Duration::from_secs(30);
    while flood.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let flood_secs = started.elapsed().as_secs_f64().min(FLOOD.as_secs_f64());
    let _ = flood.kill();
    let _ = flood.wait();
    let text = fs::read_to_string(&out).unwrap_or_default();
    let counts = text.lines().last().unwrap_or_default().to_string();
    assert_eq!(lab.admin_status("/healthz"), 200, "{}", lab.proxy_output());
    rss_max = rss_max.max(rss_kib(pid));

    // A clean stop seals the chain, and the chain verifies.
    lab.signal_proxy("-TERM");
    let exit = lab.wait_proxy_exit(Duration::from_secs(60));
    assert!(
        exit.is_some_and(|s| s.success()),
        "proxy did not stop cleanly after the flood: {exit:?}\n{}",
        lab.proxy_output()
    );
    let dir = lab.evidence_dir.display().to_string();
    let v = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin()).args(["evidence", "verify", &dir]),
        None,
        Duration::from_secs(120),
    );
    assert!(
        v.success(),
        "evidence verify after the flood:\n{}",
        v.describe()
    );

    // Every one of beta's decisions is on record, as an allow.
    let (beta, a_bytes, a_records) = scan(&lab.evidence_dir);
    for d in quiet.iter().chain(&attacked) {
        let client = format!("{CLIENT2_IP}:{}", d.port);
        let (kind, host) = match d.what {
            "https" => ("tcp", "allowed.test"),
            _ => ("dns", "other.test"),
        };
        assert!(
            beta.iter().any(|r| r["client"] == client.as_str()
                && r["event"] == "decision"
                && r["kind"] == kind
                && r["host"] == host
                && r["decision"] == "allow"),
            "no allow record for beta's {} from {client}",
            d.what
        );
    }

    eprintln!(
        "noisy: flood counts (acme's client side): {}",
        counts.trim()
    );
    eprintln!("noisy: beta quiet:        {}", percentiles(&quiet));
    eprintln!("noisy: beta under attack: {}", percentiles(&attacked));
    eprintln!(
        "noisy: acme+unknown evidence: {a_records} records, {a_bytes} bytes, {:.0} bytes/s over the {flood_secs:.0} s flood",
        a_bytes as f64 / flood_secs
    );
    eprintln!(
        "noisy: proxy RSS quiet {rss_quiet} KiB, max {rss_max} KiB (ceiling {RSS_CEILING_KIB} KiB); verify: {}",
        v.stdout.lines().next().unwrap_or_default()
    );
}
