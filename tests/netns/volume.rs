//! Volume budgets through real sockets, with the upstream's own byte count
//! as the witness (an origin that reads and counts every byte it receives):
//! a tunnel uploading four times its rule's budget is cut within the slack
//! and recorded, the next connection of that org under the rule is refused
//! 429 with `Retry-After` and nothing reaches the upstream, another rule
//! and another org are unaffected, and the window frees the budget; the
//! org-wide total bounds two rules together, through SOCKS5; a reload
//! keeps the spent budget of a rule that stays; an absolute-form request
//! spends its rule's budget and the next is refused 429.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, in_netns, wait_until, Lab, RawConn};
use crate::record_id;

const SINK: &str = "198.18.2.30:7001";
const OTHER: &str = "198.18.2.13:7002";
const SOCKS_ADDR: &str = "198.18.1.1:1080";
/// A rule's budget up in these tests.
const BUDGET: u64 = 256 * 1024;
/// What a tunnel may pass its budget by: the one transfer that crossed
/// it (a splice moves at most 256 KiB; a copy reads at most 64 KiB).
const SLACK: u64 = 256 * 1024;
const STEP: Duration = Duration::from_secs(10);

/// An origin on `addr` in the upstream namespace that reads every byte
/// of each connection until EOF and counts them: how many connections it
/// accepted, and the bytes of each finished one.
struct Origin {
    accepted: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<u64>>>,
}

impl Origin {
    fn start(lab: &Lab, addr: &'static str) -> Origin {
        let listener = in_netns(&lab.ns_upstream, move || TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(Mutex::new(Vec::new()));
        let (a, r) = (accepted.clone(), received.clone());
        thread::spawn(move || {
            for conn in listener.incoming().take(16) {
                let Ok(mut conn) = conn else { return };
                a.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                thread::spawn(move || {
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(20)));
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut n = 0u64;
                    while let Ok(k) = conn.read(&mut buf) {
                        if k == 0 {
                            break;
                        }
                        n += k as u64;
                    }
                    r.lock().unwrap().push(n);
                });
            }
        });
        Origin { accepted, received }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// The byte counts of the first `n` connections, once they finished.
    fn wait_received(&self, n: usize) -> Vec<u64> {
        wait_until("origin connections done", STEP, || {
            self.received.lock().unwrap().len() >= n
        });
        self.received.lock().unwrap().clone()
    }
}

fn policy(org_total: &str) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
{org_total}

[[org.allow]]
id = "sink"
cidr = "198.18.2.30/32"
ports = [7001]
max_bytes_up = "256KiB"
volume_window = "4s"

[[org.allow]]
id = "other"
cidr = "198.18.2.13/32"
ports = [7002]
max_bytes_up = "256KiB"
volume_window = "4s"

[[org.allow]]
id = "web"
cidr = "198.18.2.30/32"
ports = [80]
max_bytes_down = 1
volume_window = "1h"

[[org]]
name = "beta"
clients = ["198.18.3.2/32"]

[[org.allow]]
id = "beta-sink"
cidr = "198.18.2.30/32"
ports = [7001]
max_bytes_up = "256KiB"
volume_window = "4s"
"#
    )
}

fn volume_lab(org_total: &str) -> Lab {
    Lab::builder()
        .policy(&policy(org_total))
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .start()
}

/// A connection from `source` (an address of the client namespace) to
/// `addr`.
fn conn_from(lab: &Lab, source: &str, addr: &str) -> RawConn {
    let source: SocketAddr = format!("{source}:0").parse().unwrap();
    let addr: SocketAddr = addr.parse().unwrap();
    let stream = in_netns(&lab.ns_client, move || {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        s.bind(&source.into())?;
        s.connect_timeout(&addr.into(), Duration::from_secs(3))?;
        Ok::<TcpStream, std::io::Error>(s.into())
    })
    .expect("connect");
    RawConn::new(stream)
}

/// Send `total` bytes up `c` in chunks, stopping at the first failed
/// write (the proxy cut the tunnel); then wait for the close.
fn upload(c: &mut RawConn, total: u64) {
    c.stream.set_write_timeout(Some(STEP)).unwrap();
    let chunk = vec![0x5au8; 16 * 1024];
    let mut sent = 0u64;
    while sent < total {
        let n = usize::try_from(total - sent)
            .unwrap_or(usize::MAX)
            .min(chunk.len());
        if c.stream.write_all(&chunk[..n]).is_err() {
            break;
        }
        sent += n as u64;
    }
    let _ = c.stream.shutdown(Shutdown::Write);
}

/// The allow record of the client connection from local `port`.
fn allow_of(lab: &Lab, port: u16) -> Value {
    lab.wait_evidence(&format!("allow for port {port}"), |v| {
        v["event"] == "decision"
            && v["decision"] == "allow"
            && v["client"]
                .as_str()
                .is_some_and(|c| c.ends_with(&format!(":{port}")))
    })
}

/// The header `name` of a response head.
fn header<'a>(head: &'a [(String, String)], name: &str) -> Option<&'a str> {
    head.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// A CONNECT from `source` to `target`: the status and the head.
fn connect_from(lab: &Lab, source: &str, target: &str) -> (RawConn, u16, Vec<(String, String)>) {
    let mut c = conn_from(lab, source, lab::PROXY_ADDR);
    c.send(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .unwrap();
    let (status, head) = c.read_head(Duration::from_secs(5));
    (c, status, head)
}

fn admin_json(lab: &Lab, path: &str) -> Value {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}{path}", lab::ADMIN_ADDR)],
    );
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.describe()))
}

fn metric(lab: &Lab, series: &str) -> f64 {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    out.stdout
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{}", out.stdout))
}

#[test]
fn a_tunnel_over_its_budget_is_cut_and_the_next_is_refused_until_the_window_frees() {
    let lab = volume_lab("");
    let sink = Origin::start(&lab, SINK);
    let other = Origin::start(&lab, OTHER);

    // Four times the budget up one tunnel: cut within the slack.
    let (mut c, status, _) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(status, 200, "{}", lab.proxy_output());
    let port = c.local_port();
    upload(&mut c, 4 * BUDGET);
    c.wait_closed(STEP);
    let got = sink.wait_received(1)[0];
    eprintln!("volume: tunnel budget {BUDGET} B, upstream received {got} B");
    assert!(
        (BUDGET..=BUDGET + SLACK).contains(&got),
        "upstream received {got} bytes under a budget of {BUDGET}"
    );
    let allow = allow_of(&lab, port);
    let id = record_id(&allow).unwrap();
    let cut = lab.wait_evidence("volume_exceeded of the tunnel", |v| {
        v["event"] == "decision" && v["reason"] == "volume_exceeded" && v["conn"] == id.as_str()
    });
    assert_eq!(cut["decision"], "deny", "{cut}");
    assert_eq!(cut["rule"], "sink", "{cut}");
    let close = lab.wait_evidence("close of the tunnel", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(close["bytes_up"], got, "{close}");
    let order: Vec<&str> = lab
        .evidence()
        .iter()
        .filter(|v| v["conn"] == id.as_str())
        .map(|v| {
            if v["event"] == "close" {
                "close"
            } else {
                "cut"
            }
        })
        .collect();
    assert_eq!(
        order,
        ["cut", "close"],
        "the cut is on record before the close"
    );

    // The next one of acme under the rule: 429, Retry-After, never dialled.
    let (_c, status, head) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(status, 429, "{head:?}");
    let retry: u64 = header(&head, "retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After in {head:?}"));
    assert!((1..=5).contains(&retry), "Retry-After {retry}");
    let ps = header(&head, "proxy-status").unwrap_or_default();
    assert!(ps.contains("volume_exceeded"), "{ps}");
    lab.wait_evidence("the refusal on record", |v| {
        v["event"] == "decision" && v["reason"] == "volume_exceeded" && v["conn"].is_null()
    });

    // Another rule of acme, and another org under the same destination.
    let (mut o, status, _) = connect_from(&lab, lab::CLIENT_IP, OTHER);
    assert_eq!(status, 200);
    upload(&mut o, 1000);
    o.wait_closed(STEP);
    assert_eq!(other.wait_received(1), [1000]);
    let (mut b, status, _) = connect_from(&lab, lab::STRANGER_IP, SINK);
    assert_eq!(status, 200, "beta has a budget of its own");
    upload(&mut b, 1000);
    b.wait_closed(STEP);
    assert_eq!(sink.wait_received(2)[1], 1000);
    assert_eq!(sink.accepted(), 2, "the refused CONNECT was never dialled");

    // The admin port shows each budget's live state.
    let state = admin_json(&lab, "/v1/volume");
    let row = state["budgets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["org"] == "acme" && b["rule"] == "sink")
        .cloned()
        .unwrap_or_else(|| panic!("{state}"));
    assert_eq!(row["up"]["limit"], BUDGET, "{row}");
    assert_eq!(row["up"]["left"], 0, "{row}");
    assert!(row["up"]["used"].as_u64().unwrap() >= BUDGET, "{row}");
    assert!(
        metric(
            &lab,
            "palisade_volume_exceeded_total{direction=\"up\",org=\"acme\"}"
        ) >= 2.0,
        "a cut and a refusal counted"
    );

    // The window frees it (4 s, plus a slot): a bounded wait.
    let start = Instant::now();
    let mut reopened = false;
    while start.elapsed() < Duration::from_secs(8) {
        let (mut c, status, _) = connect_from(&lab, lab::CLIENT_IP, SINK);
        if status == 200 {
            upload(&mut c, 1000);
            c.wait_closed(STEP);
            reopened = true;
            break;
        }
        assert_eq!(status, 429);
        thread::sleep(Duration::from_millis(500));
    }
    assert!(reopened, "the budget was never freed");
    assert_eq!(sink.wait_received(3)[2], 1000);
}

/// A raw SOCKS5 CONNECT to `target` (an IPv4 address): the reply code.
fn socks_connect(c: &mut RawConn, target: &str) -> u8 {
    let addr: SocketAddr = target.parse().unwrap();
    let SocketAddr::V4(v4) = addr else { panic!() };
    c.send(&[5, 1, 0]).unwrap();
    let mut hello = [0u8; 2];
    c.stream.set_read_timeout(Some(STEP)).unwrap();
    c.stream.read_exact(&mut hello).unwrap();
    assert_eq!(hello, [5, 0]);
    let mut req = vec![5, 1, 0, 1];
    req.extend_from_slice(&v4.ip().octets());
    req.extend_from_slice(&v4.port().to_be_bytes());
    c.send(&req).unwrap();
    let mut reply = [0u8; 10];
    c.stream.read_exact(&mut reply).unwrap();
    reply[1]
}

#[test]
fn the_org_total_bounds_two_rules_together_through_socks5() {
    let lab = volume_lab("max_bytes_up = \"300KiB\"\nvolume_window = \"1h\"");
    let sink = Origin::start(&lab, SINK);
    let other = Origin::start(&lab, OTHER);
    // 200 KiB under one rule: within both budgets.
    let mut c = lab.client_conn_to(SOCKS_ADDR);
    assert_eq!(socks_connect(&mut c, SINK), 0, "{}", lab.proxy_output());
    upload(&mut c, 200 * 1024);
    c.wait_closed(STEP);
    assert_eq!(sink.wait_received(1), [200 * 1024]);
    // Four times the rule's budget under the other: the org's 300 KiB
    // cut it first.
    let mut c = lab.client_conn_to(SOCKS_ADDR);
    assert_eq!(socks_connect(&mut c, OTHER), 0);
    upload(&mut c, 4 * BUDGET);
    c.wait_closed(STEP);
    let second = other.wait_received(1)[0];
    let total = 200 * 1024 + second;
    eprintln!("volume: org total 307200 B, upstreams received {total} B over two rules");
    assert!(
        (300 * 1024..=300 * 1024 + SLACK).contains(&total),
        "{total} bytes up under an org total of 300 KiB"
    );
    let cut = lab.wait_evidence("the cut under the org total", |v| {
        v["reason"] == "volume_exceeded" && v["mode"] == "socks5" && !v["conn"].is_null()
    });
    assert!(
        cut["detail"]
            .as_str()
            .unwrap_or("")
            .contains("the org's total"),
        "{cut}"
    );
    // Both rules refused now, SOCKS5 "not allowed", nothing dialled.
    for target in [SINK, OTHER] {
        let mut c = lab.client_conn_to(SOCKS_ADDR);
        assert_eq!(socks_connect(&mut c, target), 2, "{target}");
    }
    assert_eq!((sink.accepted(), other.accepted()), (1, 1));
}

#[test]
fn a_reload_keeps_the_spent_budget_and_requests_spend_it_too() {
    let lab = volume_lab("");
    let sink = Origin::start(&lab, SINK);
    let (mut c, status, _) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(status, 200);
    upload(&mut c, 4 * BUDGET);
    c.wait_closed(STEP);
    sink.wait_received(1);
    // A reload that keeps the rule (same id), with a longer window.
    let before = crate::reload::served_hash(&lab);
    crate::reload::edit_config(&lab, |t| {
        t.replacen("volume_window = \"4s\"", "volume_window = \"1h\"", 1)
    });
    lab.signal_proxy("-HUP");
    wait_until("the reload", STEP, || {
        crate::reload::served_hash(&lab) != before
    });
    thread::sleep(Duration::from_secs(5));
    let (_c, status, head) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(
        status, 429,
        "the spent budget survives the reload: {head:?}"
    );
    assert_eq!(sink.accepted(), 1);

    // Absolute-form: the first request spends the rule's one byte down,
    // the next is refused 429 before anything is sent.
    let url = format!("http://{}/", lab::CIDR_IP);
    let first = lab.proxied_curl(&url, &[]);
    assert_eq!(first.status, 200, "{first:#?}");
    let before = lab.upstream_log().len();
    let second = lab.proxied_curl(&url, &["-i"]);
    assert_eq!(second.status, 429, "{second:#?}");
    assert!(second.header("retry-after").is_some(), "{second:#?}");
    lab.upstream_settled();
    assert_eq!(
        lab.upstream_log().len(),
        before,
        "nothing reached the upstream"
    );
}

#[test]
fn transparent_connections_spend_the_same_budget_and_are_reset_past_it() {
    let lab = Lab::builder()
        .policy(&policy(""))
        .proxy_option(&format!(
            "transparent = [\"{}\"]",
            crate::transparent::TRANSPARENT
        ))
        .start();
    crate::transparent::load_gateway(&lab);
    let sink = Origin::start(&lab, SINK);
    // Straight to the destination: the gateway redirects it to Palisade.
    let mut c = lab.client_conn_to(SINK);
    upload(&mut c, 4 * BUDGET);
    c.wait_closed(STEP);
    let got = sink.wait_received(1)[0];
    eprintln!("volume: transparent, budget {BUDGET} B, upstream received {got} B");
    assert!(
        (BUDGET..=BUDGET + SLACK).contains(&got),
        "upstream received {got} bytes under a budget of {BUDGET}"
    );
    lab.wait_evidence("the cut of the transparent connection", |v| {
        v["mode"] == "transparent" && v["reason"] == "volume_exceeded" && !v["conn"].is_null()
    });
    // The next one is reset, never dialled.
    let mut c = lab.client_conn_to(SINK);
    let _ = c.send(b"more");
    c.wait_closed(STEP);
    lab.wait_evidence("the transparent refusal", |v| {
        v["mode"] == "transparent" && v["reason"] == "volume_exceeded" && v["conn"].is_null()
    });
    assert_eq!(
        sink.accepted(),
        1,
        "the refused connection was never dialled"
    );
}

#[test]
fn a_report_mode_org_is_let_through_and_told_what_enforcement_would_do() {
    let lab = volume_lab("mode = \"report\"");
    let sink = Origin::start(&lab, SINK);
    let (mut c, status, _) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(status, 200);
    let port = c.local_port();
    upload(&mut c, 4 * BUDGET);
    c.wait_closed(STEP);
    assert_eq!(
        sink.wait_received(1),
        [4 * BUDGET],
        "not cut in report mode"
    );
    let id = record_id(&allow_of(&lab, port)).unwrap();
    let noted = lab.wait_evidence("the report of the spent budget", |v| {
        v["event"] == "decision" && v["conn"] == id.as_str() && v["would_deny"] == "volume_exceeded"
    });
    assert_eq!(noted["decision"], "allow", "{noted}");
    // The next connection goes through too, with the same would_deny.
    let (mut c, status, _) = connect_from(&lab, lab::CLIENT_IP, SINK);
    assert_eq!(status, 200);
    let port = c.local_port();
    upload(&mut c, 1000);
    c.wait_closed(STEP);
    assert_eq!(sink.wait_received(2)[1], 1000);
    let next = allow_of(&lab, port);
    assert_eq!(next["would_deny"], "volume_exceeded", "{next}");
}

#[test]
fn intercepted_requests_spend_their_rule_budget_and_the_next_is_refused_429() {
    let dir = lab::scratch_dir("volume-intercept");
    let ca_dir = dir.join("ca");
    let lab = Lab::builder()
        .policy(
            r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "registry"
host = "allowed.test"
ports = [443]
intercept = true
max_bytes_up = 4000
volume_window = "1h"
"#,
        )
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            lab::ca_pem().display().to_string()
        ))
        .start();
    let out = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin())
            .args(["ca", "export", "--org", "acme", "-c"])
            .arg(&lab.config_path),
        None,
        lab::CMD_TIMEOUT,
    );
    assert!(out.success(), "ca export: {}", out.describe());
    let org_ca = dir.join("acme-ca.pem");
    std::fs::write(&org_ca, &out.stdout).unwrap();
    let ca = org_ca.display().to_string();
    let body = "x".repeat(6000);
    let post = |path: &str| {
        lab.client_curl(&[
            "-x",
            lab::PROXY_URL,
            "--cacert",
            &ca,
            "-i",
            "--data-binary",
            &body,
            &format!("https://allowed.test{path}"),
        ])
    };
    // The first request is within the budget when it starts: it goes
    // through whole and spends it (6000 bytes of body), charged when it
    // closes.
    let first = post("/first");
    assert_eq!(first.status, 200, "{first:#?}\n{}", lab.proxy_output());
    lab.wait_upstream("the first request", |v| {
        v["request_line"]
            .as_str()
            .is_some_and(|l| l.starts_with("POST /first "))
    });
    let second = post("/second");
    assert_eq!(second.status, 429, "{second:#?}");
    assert!(second.header("retry-after").is_some(), "{second:#?}");
    // A new connection under the spent rule: its CONNECT is refused
    // before the tunnel opens (a request inside a live intercepted
    // connection is refused the same way, per request).
    let refusal = lab.wait_evidence("the refusal", |v| v["reason"] == "volume_exceeded");
    assert_eq!(refusal["rule"], "registry", "{refusal}");
    lab.upstream_settled();
    assert!(
        !lab.upstream_log().iter().any(|v| v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains("/second"))),
        "the refused request reached the upstream"
    );
}
