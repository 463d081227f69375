//! Volume budgets through real sockets, with the upstream's own byte count
//! as the witness (an origin that reads and counts every byte it receives):
//! a tunnel uploading four times its rule's budget is cut within the slack
//! and recorded, the next connection of that org under the rule is refused
//! 429 with `Retry-After` and nothing reaches the upstream, another rule
//! and another org are unaffected, and the window frees the budget; the
//! org-wide total bounds two rules together, through SOCKS5; a reload
//! keeps the spent budget of a rule that stays; an absolute-form request
//! spends its rule's budget and the next is refused 429; a forwarded or
//! intercepted POST is cut mid-body at its budget (429 when no response
//! head was sent) and the next request is refused 429; report mode relays
//! it whole and records `would_deny`.

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
pub(crate) struct Origin {
    accepted: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<u64>>>,
}

impl Origin {
    pub(crate) fn start(lab: &Lab, addr: &'static str) -> Origin {
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
    pub(crate) fn wait_received(&self, n: usize) -> Vec<u64> {
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

    // Absolute-form: the first request's response does not fit in the
    // rule's one byte down: not a byte of it is relayed, the client is
    // told 429 (the budget spent); the next is refused 429 before
    // anything is sent.
    let url = format!("http://{}/", lab::CIDR_IP);
    let first = lab.proxied_curl(&url, &["-i"]);
    assert_eq!(first.status, 429, "{first:#?}");
    lab.wait_upstream("the first request", |v| v["event"] == "request");
    refused_before_the_upstream(&lab, &url);
}

/// A request to `url` through the proxy is refused 429 with
/// `Retry-After`, and nothing reaches the upstream.
fn refused_before_the_upstream(lab: &Lab, url: &str) {
    let before = lab.upstream_log().len();
    let refused = lab.proxied_curl(url, &["-i"]);
    assert_eq!(refused.status, 429, "{refused:#?}");
    assert!(refused.header("retry-after").is_some(), "{refused:#?}");
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

/// A rule's budget up for the request tests.
const BODY_BUDGET: u64 = 64 * 1024;
/// What a request sent over the request tests' budgets.
const HUGE: u64 = 10 * 1024 * 1024;
/// What the upstream may count past a body budget: the request heads
/// (charged as estimated, and the upstream counts them as sent) and, for
/// an intercepted request, its TLS (handshake and record framing). The
/// bodies themselves never pass their budget.
const HEAD_SLACK: u64 = 2 * 1024;
const TLS_SLACK: u64 = 8 * 1024;

/// acme (mode `mode`) may send `BODY_BUDGET` an hour up to the web
/// upstream at CIDR_IP:80.
fn body_policy(mode: &str) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
{mode}

[[org.allow]]
id = "upload"
cidr = "198.18.2.30/32"
ports = [80]
max_bytes_up = {BODY_BUDGET}
volume_window = "1h"
"#
    )
}

/// Send `POST url` with a body of `len` bytes over `c` (an absolute-form
/// request to the proxy), the body from a thread that stops at the first
/// failed write; read the response. The response, and how much of the
/// body the client could send.
fn post_over(c: &mut RawConn, url: &str, len: u64) -> (lab::HttpResp, u64) {
    let host = url.split('/').nth(2).unwrap_or_default().to_string();
    c.send(
        format!("POST {url} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len}\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut writer = c.stream.try_clone().unwrap();
    writer.set_write_timeout(Some(STEP)).unwrap();
    let sender = thread::spawn(move || {
        let chunk = vec![0x5au8; 16 * 1024];
        let mut sent = 0u64;
        while sent < len {
            let n = usize::try_from(len - sent)
                .unwrap_or(usize::MAX)
                .min(chunk.len());
            if writer.write_all(&chunk[..n]).is_err() {
                break;
            }
            sent += n as u64;
        }
        sent
    });
    let resp = c.read_response(Duration::from_secs(20));
    (resp, sender.join().unwrap())
}

/// The bytes the web upstream received on the connections whose first
/// request line starts with each of `lines`, once all have closed.
fn upstream_received(lab: &Lab, lines: &[&str]) -> u64 {
    lines
        .iter()
        .map(|line| {
            let close = lab.wait_upstream(&format!("close of {line}"), |v| {
                v["event"] == "close"
                    && v["request_line"]
                        .as_str()
                        .is_some_and(|l| l.starts_with(line))
            });
            close["bytes_received"].as_u64().unwrap()
        })
        .sum()
}

/// The records linked to `id` by `conn`, in order: what each is.
fn linked(lab: &Lab, id: &str) -> Vec<String> {
    lab.evidence()
        .iter()
        .filter(|v| v["conn"] == id)
        .map(|v| match v["event"].as_str() {
            Some("close") => "close".to_string(),
            _ => v["would_deny"]
                .as_str()
                .or(v["reason"].as_str())
                .unwrap_or_default()
                .to_string(),
        })
        .collect()
}

#[test]
fn a_forwarded_post_is_cut_at_its_budget_mid_body_and_the_next_request_refused() {
    let lab = Lab::builder().policy(&body_policy("")).start();
    let url = |path: &str| format!("http://{}{path}", lab::CIDR_IP);
    let mut c = lab.client_conn();
    let (first, _) = post_over(&mut c, &url("/one"), 1000);
    assert_eq!(first.status, 200, "{first:#?}\n{}", lab.proxy_output());
    // The second request on the same keep-alive connection: ten MiB
    // against what is left. Cut mid-body; no response head was sent yet,
    // so the client gets 429 with Retry-After.
    let (second, sent) = post_over(&mut c, &url("/two"), HUGE);
    assert_eq!(second.status, 429, "{second:#?}");
    let retry: u64 = second
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After in {second:#?}"));
    assert!((1..=3700).contains(&retry), "Retry-After {retry}");
    assert!(
        second
            .header("proxy-status")
            .is_some_and(|p| p.contains("volume_exceeded")),
        "{second:#?}"
    );
    assert!(sent < HUGE, "the client could send all of it");
    c.wait_closed(STEP);
    let first_got = upstream_received(&lab, &["POST /one "]);
    assert!(first_got > 1000, "/one arrived whole: {first_got} B");
    // Every upstream connection, /two's included: the cut ends the
    // exchange, and what the proxy still held for the upstream (/two's
    // head and the part of the body the budget let through) may die in
    // its write buffer, so /two's connection may even have carried
    // nothing (no request line to find it by).
    let got: u64 = lab
        .upstream_settled()
        .iter()
        .map(|v| v["bytes_received"].as_u64().unwrap_or(0))
        .sum();
    eprintln!(
        "volume: absolute-form, budget {BODY_BUDGET} B, client sent {sent} B, upstream received {got} B"
    );
    // Up to the budget, never past it.
    assert!(
        got <= BODY_BUDGET + HEAD_SLACK,
        "upstream received {got} bytes under a budget of {BODY_BUDGET}"
    );
    // On record: the request's allow, its cut (linked by conn), its close.
    let allow = lab.wait_evidence("the allow of /two", |v| {
        v["event"] == "decision" && v["decision"] == "allow" && v["path"] == "/two"
    });
    let id = record_id(&allow).unwrap();
    let close = lab.wait_evidence("the close of /two", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(linked(&lab, &id), ["volume_exceeded", "close"], "{close}");
    let cut = lab.wait_evidence("the cut", |v| {
        v["reason"] == "volume_exceeded" && v["conn"] == id.as_str()
    });
    assert_eq!(
        (&cut["decision"], &cut["rule"]),
        (&"deny".into(), &"upload".into())
    );

    // The next request, on a new connection: refused before anything is
    // sent.
    refused_before_the_upstream(&lab, &url("/three"));
}

#[test]
fn a_report_mode_org_relays_a_post_past_its_budget_and_is_told_would_deny() {
    let lab = Lab::builder()
        .policy(&body_policy("mode = \"report\""))
        .start();
    let mut c = lab.client_conn();
    let len = 4 * BODY_BUDGET;
    let (resp, sent) = post_over(&mut c, &format!("http://{}/big", lab::CIDR_IP), len);
    assert_eq!((resp.status, sent), (200, len), "{resp:#?}");
    let got = upstream_received(&lab, &["POST /big "]);
    eprintln!("volume: report mode, budget {BODY_BUDGET} B, upstream received {got} B");
    assert!(got > len, "relayed whole: {got}");
    let allow = lab.wait_evidence("the allow of /big", |v| {
        v["event"] == "decision" && v["decision"] == "allow" && v["path"] == "/big"
    });
    let id = record_id(&allow).unwrap();
    let noted = lab.wait_evidence("the report of the spent budget", |v| {
        v["event"] == "decision" && v["conn"] == id.as_str() && v["would_deny"] == "volume_exceeded"
    });
    assert_eq!(noted["decision"], "allow", "{noted}");
    lab.wait_evidence("the close of /big", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(linked(&lab, &id), ["volume_exceeded", "close"]);
}

#[test]
fn intercepted_posts_are_cut_at_their_budget_and_the_next_request_refused_429() {
    let dir = lab::scratch_dir("volume-intercept");
    let ca_dir = dir.join("ca");
    let lab = Lab::builder()
        .policy(&format!(
            r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "registry"
host = "allowed.test"
ports = [443]
intercept = true
max_bytes_up = {BODY_BUDGET}
volume_window = "1h"
"#
        ))
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
    let big = dir.join("big");
    std::fs::write(&big, vec![b'x'; usize::try_from(HUGE).unwrap()]).unwrap();
    let big = format!("@{}", big.display());
    let (head2, head3) = (dir.join("second.head"), dir.join("third.head"));
    let (h2, h3) = (head2.display().to_string(), head3.display().to_string());
    // Three requests, the first two over one intercepted HTTP/1.1
    // connection (curl keeps it): a small one, ten MiB, and one more
    // (a new connection: the cut closed the first). HTTP/1.1: over
    // HTTP/2 the 429 is answered the same, then the stream reset
    // NO_ERROR (RFC 9113 §8.1), which curl 7.88 takes for a failure.
    let mut args: Vec<&str> = vec![
        "--http1.1",
        "-x",
        lab::PROXY_URL,
        "--cacert",
        &ca,
        "--data-binary",
        "small",
        "https://allowed.test/first",
    ];
    for (head, extra) in [(&h2, big.as_str()), (&h3, "after")] {
        args.extend([
            "--next",
            "-sS",
            "--max-time",
            "20",
            "-x",
            lab::PROXY_URL,
            "--cacert",
            &ca,
            "--http1.1",
            "-o",
            "/dev/null",
            "-D",
            head,
            "--data-binary",
            extra,
        ]);
        args.push(if head == &h2 {
            "https://allowed.test/second"
        } else {
            "https://allowed.test/third"
        });
    }
    let first = lab.client_curl(&args);
    assert_eq!(first.status, 200, "{first:#?}\n{}", lab.proxy_output());
    let heads =
        |p: &std::path::Path| lab::parse_heads(&std::fs::read_to_string(p).unwrap_or_default());
    let (second, second_head) = heads(&head2);
    assert_eq!(second, 429, "{second_head:?}\n{first:#?}");
    let (third, third_head) = heads(&head3);
    assert_eq!(third, 429, "{third_head:?}");
    assert!(
        header(&third_head, "retry-after").is_some(),
        "{third_head:?}"
    );
    // The upstream's own count of the connection /second went over.
    let got = upstream_received(&lab, &["POST /second "]);
    let first_got = upstream_received(&lab, &["POST /first "]);
    eprintln!(
        "volume: intercepted, budget {BODY_BUDGET} B, upstream received {got} B (TLS included) for the cut request"
    );
    assert!(
        got + first_got <= BODY_BUDGET + TLS_SLACK + HEAD_SLACK,
        "upstream received {got} + {first_got} bytes under a budget of {BODY_BUDGET}"
    );
    let allow = lab.wait_evidence("the allow of /second", |v| {
        v["event"] == "decision" && v["decision"] == "allow" && v["path"] == "/second"
    });
    let id = record_id(&allow).unwrap();
    lab.wait_evidence("the close of /second", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(linked(&lab, &id), ["volume_exceeded", "close"]);
    let refusal = lab.wait_evidence("the refusal of /third", |v| {
        v["reason"] == "volume_exceeded" && v["conn"] != id.as_str() && v["event"] == "decision"
    });
    assert_eq!(refusal["rule"], "registry", "{refusal}");
    lab.upstream_settled();
    assert!(
        !lab.upstream_log().iter().any(|v| v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains("/third"))),
        "the refused request reached the upstream"
    );
}
