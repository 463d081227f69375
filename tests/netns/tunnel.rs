//! Tunnel verification: a tunnel carries what its rule says it carries, from
//! the first byte to the last, in explicit CONNECT, SOCKS5 and transparent
//! mode. Every case drives raw bytes through a tunnel to allowed.test and
//! proves two things: the denial was recorded (the evidence record is the
//! positive marker every negative check waits for), and the upstream's own
//! log never shows the other name (no Host, no SNI, often no byte at all).
//!
//! One lab serves all three modes: the explicit and SOCKS5 listeners, and
//! the transparent listener behind the shipped gateway ruleset.

use std::fs;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use palisade::proto::tls_stream::HELLO_RETRY_REQUEST_RANDOM;
use serde_json::Value;

use crate::lab::{self, dump, read_jsonl, Closed, Lab, RawConn, DEFAULT_POLICY};
use crate::record_id;
use crate::transparent::{load_gateway, TRANSPARENT};

const SOCKS_ADDR: &str = "198.18.1.1:1080";
const SOCKS_PORT: u16 = 1080;
const DETECT_TIMEOUT: Duration = Duration::from_millis(300);
const SECS5: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(50);
/// Port of the HelloRetryRequest fixture (tests/fixtures/tlsraw.py).
const HRR_PORT: u16 = 8443;
/// A TLS ChangeCipherSpec record, as clients in middlebox compatibility mode
/// send before their second ClientHello (RFC 8446 §D.4).
const CCS: [u8; 6] = [0x14, 0x03, 0x03, 0x00, 0x01, 0x01];

/// How the client reaches the tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Connect,
    Socks5,
    Transparent,
}

/// Modes in which the client names the tunnel's host before any byte.
const NAMED: [Via; 2] = [Via::Connect, Via::Socks5];
const ALL: [Via; 3] = [Via::Connect, Via::Socks5, Via::Transparent];

impl Via {
    /// The evidence `mode` of connections made this way.
    fn mode(self) -> &'static str {
        match self {
            Via::Connect => "explicit",
            Via::Socks5 => "socks5",
            Via::Transparent => "transparent",
        }
    }
    /// Upstream connections a tunnel denied on its first bytes opens: the
    /// named modes dial before replying, transparent decides first.
    fn dials_before_first_bytes(self) -> usize {
        match self {
            Via::Transparent => 0,
            _ => 1,
        }
    }
}

/// A client's tunnel, and the `client` its evidence records carry.
struct Tunnel {
    via: Via,
    conn: RawConn,
    client: String,
    what: String,
}

impl Tunnel {
    fn send(&mut self, data: &[u8]) {
        self.conn
            .send(data)
            .unwrap_or_else(|e| panic!("{}: send: {e}", self.what));
    }

    /// The proxy cut the tunnel (EOF or reset) within a few seconds.
    fn assert_cut(&mut self, lab: &Lab) {
        let closed = self.conn.wait_closed(Duration::from_secs(3));
        assert!(
            matches!(closed, Closed::After(_)),
            "{}: tunnel still open\n{}",
            self.what,
            lab.proxy_output()
        );
    }
}

/// The lab with all three client paths: explicit, SOCKS5 and, through the
/// gateway ruleset, transparent; a short detect timeout keeps silence cheap.
fn tunnel_lab(policy: &str) -> Lab {
    let lab = Lab::builder()
        .policy(policy)
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .proxy_option(&format!("transparent = [{TRANSPARENT:?}]"))
        .proxy_option(&format!(
            "detect_timeout = \"{}ms\"",
            DETECT_TIMEOUT.as_millis()
        ))
        .start();
    load_gateway(&lab);
    // The gateway ruleset admits only the explicit port; admit SOCKS5 too.
    let port = SOCKS_PORT.to_string();
    let out = lab.proxy_ns_exec(
        "nft",
        &[
            "insert", "rule", "inet", "palisade", "input", "iifname", "\"p0\"", "tcp", "dport",
            &port, "accept",
        ],
    );
    assert!(out.success(), "nft insert: {}", out.describe());
    lab
}

/// The address a test host is served on.
fn ip_of(host: &str) -> String {
    match host {
        "allowed.test" => lab::ALLOWED_IP.to_owned(),
        ip if ip.parse::<Ipv4Addr>().is_ok() => ip.to_owned(),
        other => panic!("no address for {other}"),
    }
}

/// Open a tunnel to `host:port` the `via` way (transparent: connect to the
/// host's address through the gateway).
fn open(lab: &Lab, via: Via, host: &str, port: u16) -> Tunnel {
    let what = format!("{} tunnel to {host}:{port}", via.mode());
    let conn = match via {
        Via::Connect => {
            let mut c = lab.client_conn();
            let status = c.connect(&format!("{host}:{port}"));
            assert_eq!(status, 200, "{what}: CONNECT\n{}", lab.proxy_output());
            c
        }
        Via::Socks5 => {
            let mut c = lab.client_conn_to(SOCKS_ADDR);
            socks5_connect(lab, &mut c, host, port);
            c
        }
        Via::Transparent => lab.client_conn_to(&format!("{}:{port}", ip_of(host))),
    };
    Tunnel {
        via,
        client: format!("{}:{}", lab::CLIENT_IP, conn.local_port()),
        conn,
        what,
    }
}

/// The SOCKS5 handshake (no authentication, CONNECT) on `c`; panics unless
/// the reply is "succeeded".
fn socks5_connect(lab: &Lab, c: &mut RawConn, host: &str, port: u16) {
    let s = &mut c.stream;
    s.set_read_timeout(Some(SECS5)).expect("read timeout");
    s.write_all(&[5, 1, 0]).expect("socks5 greeting");
    let mut method = [0u8; 2];
    s.read_exact(&mut method).expect("socks5 method");
    assert_eq!(method, [5, 0], "socks5 method");
    let mut req = vec![5, 1, 0];
    match host.parse::<Ipv4Addr>() {
        Ok(ip) => {
            req.push(1);
            req.extend_from_slice(&ip.octets());
        }
        Err(_) => {
            req.extend_from_slice(&[3, host.len() as u8]);
            req.extend_from_slice(host.as_bytes());
        }
    }
    req.extend_from_slice(&port.to_be_bytes());
    s.write_all(&req).expect("socks5 request");
    let mut head = [0u8; 4];
    s.read_exact(&mut head).expect("socks5 reply");
    assert_eq!(
        head[1],
        0,
        "socks5 CONNECT {host}:{port}: reply {head:?}\n{}",
        lab.proxy_output()
    );
    let rest = match head[3] {
        1 => 4 + 2,
        4 => 16 + 2,
        atyp => panic!("socks5 reply address type {atyp}"),
    };
    let mut bound = vec![0u8; rest];
    s.read_exact(&mut bound).expect("socks5 bound address");
}

/// An HTTP/1.1 GET for `host`, kept alive or not.
fn get(host: &str, keep_alive: bool) -> String {
    let conn = if keep_alive {
        "Connection: keep-alive\r\n"
    } else {
        ""
    };
    format!("GET /tunnel HTTP/1.1\r\nHost: {host}\r\n{conn}\r\n")
}

/// A TLS 1.3 ClientHello record naming `sni` (none: no server_name
/// extension), with an encrypted_client_hello extension if `ech`: the
/// probe's hello, with fixed random values.
fn client_hello(sni: Option<&str>, ech: bool) -> Vec<u8> {
    use palisade::probe::hello::{build, Hello, Random};
    build(&Hello { sni, ech }, &Random::from_fn(|b| b.fill(0x5a)))
}

// ---------------------------------------------------------------------------
// Evidence and upstream log

/// The allow decision record of `t`.
fn allow_record(lab: &Lab, t: &Tunnel) -> Value {
    let rec = lab.wait_evidence(&format!("{}: allow", t.what), |v| {
        v["event"] == "decision" && v["decision"] == "allow" && v["client"] == t.client.as_str()
    });
    assert_eq!(rec["mode"], t.via.mode(), "{}: {rec}", t.what);
    rec
}

/// The deny record of `t` with `reason` (any reason if None).
fn deny_record(lab: &Lab, t: &Tunnel, reason: Option<&str>) -> Value {
    let what = format!("{}: deny/{}", t.what, reason.unwrap_or("*"));
    let rec = lab.wait_evidence(&what, |v| {
        v["decision"] == "deny"
            && v["client"] == t.client.as_str()
            && reason.is_none_or(|r| v["reason"] == r)
    });
    assert_eq!(rec["mode"], t.via.mode(), "{what}: {rec}");
    assert!(record_id(&rec).is_some(), "{what}: {rec}");
    rec
}

/// The records of a JSON Lines log since its first `before` lines, once at
/// least `conns` connections were opened since then and every one of them
/// was logged closed (bounded).
fn log_since(path: &Path, before: usize, conns: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let new: Vec<Value> = read_jsonl(path).into_iter().skip(before).collect();
        let opened: Vec<&Value> = new
            .iter()
            .filter(|v| v["event"] == "open")
            .map(|v| &v["id"])
            .collect();
        let all_closed = opened
            .iter()
            .all(|id| new.iter().any(|v| v["event"] == "close" && v["id"] == **id));
        if opened.len() >= conns && all_closed {
            return new;
        }
        assert!(
            Instant::now() < deadline,
            "{}: wanted {conns} connection(s) opened and closed within 8s:\n{}",
            path.display(),
            dump(&new)
        );
        thread::sleep(POLL);
    }
}

fn upstream_since(lab: &Lab, before: usize, conns: usize) -> Vec<Value> {
    log_since(&lab.upstream_log_path(), before, conns)
}

/// The Hosts of the requests the upstream read, in order.
fn request_hosts(log: &[Value]) -> Vec<String> {
    log.iter()
        .filter(|v| v["event"] == "request")
        .map(|v| v["host"].as_str().unwrap_or("<none>").to_owned())
        .collect()
}

/// No upstream record names `name` as Host or SNI.
fn assert_never_named(log: &[Value], name: &str, what: &str) {
    let hits: Vec<&Value> = log
        .iter()
        .filter(|v| v["host"] == name || v["sni"] == name)
        .collect();
    assert!(
        hits.is_empty(),
        "{what}: {name} reached the upstream:\n{}",
        dump(log)
    );
}

/// Not one byte reached the upstream.
fn assert_no_bytes(log: &[Value], what: &str) {
    assert!(
        log.iter()
            .filter(|v| v["event"] == "close")
            .all(|v| v["bytes_received"] == 0),
        "{what}: bytes reached the upstream:\n{}",
        dump(log)
    );
    assert!(request_hosts(log).is_empty(), "{what}:\n{}", dump(log));
}

// ---------------------------------------------------------------------------
// a. Silence

#[test]
fn silent_tls_tunnel_is_closed_and_a_late_hello_for_another_name_never_arrives() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    for via in ALL {
        let before = lab.upstream_log().len();
        let started = Instant::now();
        let mut t = open(&lab, via, "allowed.test", 443);
        // The record is the marker that the detect timeout passed.
        let rec = if via == Via::Transparent {
            // No byte, no name: nothing to take a rule from.
            deny_record(&lab, &t, None)
        } else {
            let rec = deny_record(&lab, &t, Some("protocol_mismatch"));
            assert_eq!(rec["host"], "allowed.test", "{}: {rec}", t.what);
            rec
        };
        assert!(
            started.elapsed() >= DETECT_TIMEOUT,
            "{}: denied after {:?}, before the detect timeout: {rec}",
            t.what,
            started.elapsed()
        );
        // The late ClientHello for another name finds the tunnel gone (the
        // write itself may or may not fail).
        let _ = t.conn.send(&client_hello(Some("other.test"), false));
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, via.dials_before_first_bytes());
        assert_never_named(&log, "other.test", &t.what);
        assert_no_bytes(&log, &t.what);
    }
}

// ---------------------------------------------------------------------------
// b. An HTTP request after an empty line

#[test]
fn http_tunnel_checks_the_host_of_a_request_after_an_empty_line() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    // Departures from the spec in what was served or recorded, reported
    // together at the end so every mode's forwarding checks still run.
    let mut deviations = Vec::new();
    for via in ALL {
        let before = lab.upstream_log().len();
        // The allowed Host after an empty line (servers skip it): served.
        let mut good = open(&lab, via, "allowed.test", 80);
        good.send(format!("\r\n{}", get("allowed.test", false)).as_bytes());
        let resp = good.conn.read_response(SECS5);
        let served = resp.status == 200;
        if served {
            assert!(
                resp.body.contains("host=allowed.test"),
                "{}: {resp:?}",
                good.what
            );
            let allow = allow_record(&lab, &good);
            assert_eq!(allow["tunnel"], "http", "{}: {allow}", good.what);
        } else {
            let rec = deny_record(&lab, &good, None);
            deviations.push(format!("{}: not served ({resp:?}): {rec}", good.what));
        }
        good.conn.close();

        // Another Host after an empty line: refused before it is forwarded.
        let mut bad = open(&lab, via, "allowed.test", 80);
        bad.send(format!("\r\n{}", get("other.test", false)).as_bytes());
        let rec = if via == Via::Transparent {
            // The name comes from these bytes: other.test at allowed.test's
            // address is refused by the transparent decision itself.
            deny_record(&lab, &bad, None)
        } else {
            deny_record(&lab, &bad, Some("host_mismatch"))
        };
        if rec["host"] != "other.test" {
            deviations.push(format!("{}: host is not the name sent: {rec}", bad.what));
        }
        bad.assert_cut(&lab);

        // Named modes dial both tunnels; transparent only what it allowed.
        let conns = match via {
            Via::Transparent => usize::from(served),
            _ => 2,
        };
        let log = upstream_since(&lab, before, conns);
        let hosts: &[&str] = if served { &["allowed.test"] } else { &[] };
        assert_eq!(request_hosts(&log), hosts, "{}", dump(&log));
        assert_never_named(&log, "other.test", &bad.what);
    }
    assert!(
        deviations.is_empty(),
        "departures from the spec:\n{}",
        deviations.join("\n")
    );
}

// ---------------------------------------------------------------------------
// c. Bytes that are not TLS on a TLS tunnel

#[test]
fn bytes_that_are_not_a_client_hello_on_a_tls_tunnel_are_refused() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    let cases: [(&str, Vec<u8>); 3] = [
        ("an ssh banner", b"SSH-2.0-OpenSSH_9.6\r\n".to_vec()),
        (
            "an application_data record",
            b"\x17\x03\x03\x00\x05hello".to_vec(),
        ),
        (
            "a plain HTTP request",
            get("allowed.test", false).into_bytes(),
        ),
    ];
    for via in ALL {
        for (name, bytes) in &cases {
            let before = lab.upstream_log().len();
            let mut t = open(&lab, via, "allowed.test", 443);
            t.what = format!("{}, {name}", t.what);
            t.send(bytes);
            // In transparent mode only the HTTP request names a host (and
            // so a rule: allowed.test:443 carries TLS); the others name none.
            let named = via != Via::Transparent || name.contains("HTTP");
            let rec = deny_record(&lab, &t, named.then_some("protocol_mismatch"));
            if named {
                assert_eq!(rec["host"], "allowed.test", "{}: {rec}", t.what);
            }
            t.assert_cut(&lab);
            let log = upstream_since(&lab, before, via.dials_before_first_bytes());
            assert_no_bytes(&log, &t.what);
        }
    }
}

// ---------------------------------------------------------------------------
// d. A second request for another host

#[test]
fn second_http_request_for_another_host_cuts_the_tunnel() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    for via in ALL {
        // Kept alive: the first response is read, then the second request.
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 80);
        t.what = format!("{}, keep-alive", t.what);
        t.send(get("allowed.test", true).as_bytes());
        let resp = t.conn.read_response(SECS5);
        assert_eq!(resp.status, 200, "{}: {resp:?}", t.what);
        assert!(resp.body.contains("host=allowed.test"), "{resp:?}");
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "http", "{}: {allow}", t.what);
        t.send(get("other.test", true).as_bytes());
        let deny = deny_record(&lab, &t, Some("host_mismatch"));
        assert_eq!(deny["host"], "other.test", "{}: {deny}", t.what);
        assert_eq!(deny["conn"], allow["id"], "{}: {deny}", t.what);
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, 1);
        assert_eq!(request_hosts(&log), ["allowed.test"], "{}", dump(&log));
        assert_never_named(&log, "other.test", &t.what);

        // Pipelined: both requests in one write.
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 80);
        t.what = format!("{}, pipelined", t.what);
        t.send(format!("{}{}", get("allowed.test", true), get("other.test", true)).as_bytes());
        let deny = deny_record(&lab, &t, Some("host_mismatch"));
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "http", "{}: {allow}", t.what);
        assert_eq!(deny["host"], "other.test", "{}: {deny}", t.what);
        assert_eq!(deny["conn"], allow["id"], "{}: {deny}", t.what);
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, 1);
        assert_eq!(request_hosts(&log), ["allowed.test"], "{}", dump(&log));
        assert_never_named(&log, "other.test", &t.what);
    }
}

// ---------------------------------------------------------------------------
// e. ECH and a missing SNI

#[test]
fn ech_and_missing_sni_are_refused_before_any_byte_reaches_the_upstream() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    for via in ALL {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 443);
        t.what = format!("{}, ECH", t.what);
        t.send(&client_hello(Some("allowed.test"), true));
        deny_record(&lab, &t, Some("ech_not_allowed"));
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, via.dials_before_first_bytes());
        assert_no_bytes(&log, &t.what);

        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 443);
        t.what = format!("{}, no SNI", t.what);
        t.send(&client_hello(None, false));
        // Transparent: a hello without a name names no rule to check.
        let reason = (via != Via::Transparent).then_some("sni_missing");
        deny_record(&lab, &t, reason);
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, via.dials_before_first_bytes());
        assert_no_bytes(&log, &t.what);
    }
}

// ---------------------------------------------------------------------------
// f. A second ClientHello for another name

#[test]
fn second_client_hello_for_another_name_never_reaches_the_upstream() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    let good = client_hello(Some("allowed.test"), false);
    let other = client_hello(Some("other.test"), false);
    for via in ALL {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 443);
        // Back to back, before any ServerHello could arrive.
        t.send(&[good.as_slice(), other.as_slice()].concat());
        let rec = deny_record(&lab, &t, Some("sni_mismatch"));
        assert!(
            rec.to_string().contains("other.test"),
            "{}: the record does not name what was presented: {rec}",
            t.what
        );
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, 1);
        assert_never_named(&log, "other.test", &t.what);
        for close in log.iter().filter(|v| v["event"] == "close") {
            let got = close["bytes_received"].as_u64().unwrap_or(u64::MAX);
            assert!(
                got <= good.len() as u64,
                "{}: {got} bytes reached the upstream, more than the first hello ({}): {close}",
                t.what,
                good.len()
            );
        }
    }
}

/// The HelloRetryRequest fixture on allowed.test:8443, killed on drop.
struct TlsRaw {
    child: Child,
    log: PathBuf,
}

impl TlsRaw {
    fn start(lab: &Lab) -> TlsRaw {
        let log = lab.dir.join("tlsraw.jsonl");
        let ready = lab.dir.join("tlsraw.ready");
        let script = lab::fixtures_dir().join("tlsraw.py");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &lab.ns_upstream, "python3"])
            .arg(&script)
            .args(["--addr", lab::ALLOWED_IP, "--port", &HRR_PORT.to_string()])
            .arg("--log")
            .arg(&log)
            .arg("--ready")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(fs::File::create(lab.dir.join("tlsraw.stdout")).unwrap())
            .stderr(fs::File::create(lab.dir.join("tlsraw.stderr")).unwrap())
            .spawn()
            .expect("spawn tlsraw.py");
        lab::wait_until("tlsraw.py ready", SECS5, || {
            if let Ok(Some(st)) = child.try_wait() {
                panic!(
                    "tlsraw.py exited ({st}): {}",
                    fs::read_to_string(lab.dir.join("tlsraw.stderr")).unwrap_or_default()
                );
            }
            ready.exists()
        });
        TlsRaw { child, log }
    }
    fn len(&self) -> usize {
        read_jsonl(&self.log).len()
    }
}

impl Drop for TlsRaw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn hello_retry_then_a_hello_for_another_name_is_cut() {
    // Port 8443 carries TLS or HTTP (the rule's default), told by the first byte.
    let policy = format!(
        "{DEFAULT_POLICY}
[[org.allow]]
host = \"allowed.test\"
ports = [{HRR_PORT}]
"
    );
    let lab = tunnel_lab(&policy);
    let raw = TlsRaw::start(&lab);
    for via in ALL {
        // The control: the retried hello names the same host and arrives.
        let before = raw.len();
        let mut t = open(&lab, via, "allowed.test", HRR_PORT);
        t.what = format!("{}, retry for the same name", t.what);
        t.send(&client_hello(Some("allowed.test"), false));
        assert!(
            t.conn
                .read_until(&HELLO_RETRY_REQUEST_RANDOM, SECS5)
                .is_some(),
            "{}: no HelloRetryRequest\n{}",
            t.what,
            lab.proxy_output()
        );
        t.send(&[CCS.as_slice(), &client_hello(Some("allowed.test"), false)].concat());
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "tls", "{}: {allow}", t.what);
        let deadline = Instant::now() + SECS5;
        while read_jsonl(&raw.log)
            .iter()
            .skip(before)
            .all(|v| v["event"] != "client_hello" || v["index"] != 1)
        {
            assert!(
                Instant::now() < deadline,
                "{}: the second hello never arrived:\n{}\n{}",
                t.what,
                dump(&read_jsonl(&raw.log)),
                lab.proxy_output()
            );
            thread::sleep(POLL);
        }
        t.conn.close();
        let log = log_since(&raw.log, before, 1);
        let close = log.iter().find(|v| v["event"] == "close").unwrap();
        assert_eq!(
            close["snis"],
            serde_json::json!(["allowed.test", "allowed.test"]),
            "{close}"
        );

        // The retried hello names another host: cut, never delivered.
        let before = raw.len();
        let mut t = open(&lab, via, "allowed.test", HRR_PORT);
        t.what = format!("{}, retry for another name", t.what);
        t.send(&client_hello(Some("allowed.test"), false));
        assert!(
            t.conn
                .read_until(&HELLO_RETRY_REQUEST_RANDOM, SECS5)
                .is_some(),
            "{}: no HelloRetryRequest\n{}",
            t.what,
            lab.proxy_output()
        );
        t.send(&[CCS.as_slice(), &client_hello(Some("other.test"), false)].concat());
        let allow = allow_record(&lab, &t);
        let rec = deny_record(&lab, &t, Some("sni_mismatch"));
        assert_eq!(rec["conn"], allow["id"], "{}: {rec}", t.what);
        assert!(rec.to_string().contains("other.test"), "{}: {rec}", t.what);
        t.assert_cut(&lab);
        let log = log_since(&raw.log, before, 1);
        let close = log.iter().find(|v| v["event"] == "close").unwrap();
        assert_eq!(
            close["snis"],
            serde_json::json!(["allowed.test"]),
            "{}: {}",
            t.what,
            dump(&log)
        );
    }
}

// ---------------------------------------------------------------------------
// g. h2c, and the websocket upgrade that is allowed

#[test]
fn h2c_upgrade_and_preface_are_refused_in_http_tunnels() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    let upgrade = "GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade, HTTP2-Settings\r\n\
                   Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n";
    for via in ALL {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 80);
        t.what = format!("{}, Upgrade: h2c", t.what);
        t.send(upgrade.as_bytes());
        deny_record(&lab, &t, Some("upgrade_not_allowed"));
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, via.dials_before_first_bytes());
        assert_no_bytes(&log, &t.what);
    }
    // The prior-knowledge preface names no host: only where the tunnel does.
    for via in NAMED {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 80);
        t.what = format!("{}, h2c preface", t.what);
        t.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00");
        deny_record(&lab, &t, Some("upgrade_not_allowed"));
        t.assert_cut(&lab);
        let log = upstream_since(&lab, before, 1);
        assert_no_bytes(&log, &t.what);
    }
}

#[test]
fn websocket_upgrade_answered_101_continues_opaque() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    // After the 101 the bytes are the new protocol's, even ones that look
    // like a request for another host.
    let frames: &[u8] = b"\x81\x05hello GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
    for via in ALL {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 80);
        t.send(
            b"GET /ws HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\n\
              Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
              Sec-WebSocket-Version: 13\r\n\r\n",
        );
        let (status, _) = t.conn.read_head(SECS5);
        assert_eq!(status, 101, "{}\n{}", t.what, lab.proxy_output());
        t.send(frames);
        let echoed = t.conn.read_until(b"other.test\r\n\r\n", SECS5);
        assert_eq!(
            echoed.as_deref(),
            Some(frames),
            "{}: echo after the upgrade\n{}",
            t.what,
            lab.proxy_output()
        );
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "http", "{}: {allow}", t.what);
        t.conn.close();
        let log = upstream_since(&lab, before, 1);
        let close = log.iter().find(|v| v["event"] == "close").unwrap();
        assert_eq!(close["upgraded"], true, "{close}");
        let denied: Vec<Value> = lab
            .evidence()
            .into_iter()
            .filter(|v| v["decision"] == "deny" && v["client"] == t.client.as_str())
            .collect();
        assert!(denied.is_empty(), "{}: {}", t.what, dump(&denied));
    }
}

// ---------------------------------------------------------------------------
// h. tunnel = "opaque"

#[test]
fn opaque_rule_lets_silence_then_another_name_through_and_says_so() {
    let policy = format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [443]
tunnel = "opaque"

[[org.allow]]
cidr = "{}/32"
ports = [80]
"#,
        lab::CIDR_IP
    );
    let lab = tunnel_lab(&policy);
    for via in NAMED {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, "allowed.test", 443);
        // Silent well past the detect timeout (checked positively below).
        thread::sleep(DETECT_TIMEOUT * 2);
        t.send(&client_hello(Some("other.test"), false));
        // The upstream answers (a ServerHello record) through the tunnel.
        assert!(
            t.conn.read_until(&[0x16, 0x03, 0x03], SECS5).is_some(),
            "{}: no answer from the upstream\n{}",
            t.what,
            lab.proxy_output()
        );
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "opaque", "{}: {allow}", t.what);
        t.conn.close();
        let log = upstream_since(&lab, before, 1);
        assert!(
            log.iter()
                .any(|v| v["event"] == "close" && v["sni"] == "other.test"),
            "{}: the hello did not arrive:\n{}",
            t.what,
            dump(&log)
        );
        let denied: Vec<Value> = lab
            .evidence()
            .into_iter()
            .filter(|v| v["decision"] == "deny" && v["client"] == t.client.as_str())
            .collect();
        assert!(denied.is_empty(), "{}: {}", t.what, dump(&denied));
    }
    // A cidr rule's tunnel is opaque: any bytes pass.
    for via in ALL {
        let before = lab.upstream_log().len();
        let mut t = open(&lab, via, lab::CIDR_IP, 80);
        t.send(b"\x00\x01 neither tls nor http\r\n\r\n");
        let allow = allow_record(&lab, &t);
        assert_eq!(allow["tunnel"], "opaque", "{}: {allow}", t.what);
        assert!(
            t.conn.read_until(b"\r\n\r\n", SECS5).is_some(),
            "{}: no answer\n{}",
            t.what,
            lab.proxy_output()
        );
        t.conn.close();
        let log = upstream_since(&lab, before, 1);
        assert!(
            log.iter().any(|v| v["event"] == "request"
                && v["request_line"]
                    .as_str()
                    .is_some_and(|l| l.contains("neither tls nor http"))),
            "{}:\n{}",
            t.what,
            dump(&log)
        );
    }
}

// ---------------------------------------------------------------------------
// i. Metrics

/// Sum of `palisade_connections_total` deny samples for `reason` and `mode`.
fn deny_count(lab: &Lab, reason: &str, mode: &str) -> f64 {
    let scrape = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    assert!(scrape.success(), "{}", scrape.describe());
    let (r, m) = (format!("reason=\"{reason}\""), format!("mode=\"{mode}\""));
    scrape
        .stdout
        .lines()
        .filter(|l| {
            l.starts_with("palisade_connections_total{")
                && l.contains("decision=\"deny\"")
                && l.contains(&r)
                && l.contains(&m)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn in_tunnel_denials_are_counted_by_reason() {
    let lab = tunnel_lab(DEFAULT_POLICY);
    let good = client_hello(Some("allowed.test"), false);
    let other = client_hello(Some("other.test"), false);
    let h2c = "GET / HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n";
    let keep = get("allowed.test", true);
    // (reason, port, bytes, applies in transparent mode)
    let cases: Vec<(&str, u16, Vec<u8>, bool)> = vec![
        (
            "protocol_mismatch",
            443,
            get("allowed.test", false).into_bytes(),
            true,
        ),
        ("sni_missing", 443, client_hello(None, false), false),
        (
            "ech_not_allowed",
            443,
            client_hello(Some("allowed.test"), true),
            true,
        ),
        ("sni_mismatch", 443, [good, other].concat(), true),
        (
            "host_mismatch",
            80,
            format!("{keep}{}", get("other.test", true)).into_bytes(),
            true,
        ),
        ("upgrade_not_allowed", 80, h2c.as_bytes().to_vec(), true),
    ];
    for via in ALL {
        for (reason, port, bytes, in_transparent) in &cases {
            if via == Via::Transparent && !in_transparent {
                continue;
            }
            let before = deny_count(&lab, reason, via.mode());
            let mut t = open(&lab, via, "allowed.test", *port);
            t.send(bytes);
            deny_record(&lab, &t, Some(reason));
            let mut now = before;
            lab::wait_until(
                &format!("{}: deny/{reason} counted (was {before})", t.what),
                SECS5,
                || {
                    now = deny_count(&lab, reason, via.mode());
                    now >= before + 1.0
                },
            );
            assert_eq!(now, before + 1.0, "{}: deny/{reason}", t.what);
            t.assert_cut(&lab);
        }
    }
}
