//! The gateway's own addresses are always denied: under `0.0.0.0/0` and
//! `::/0` on a port, a listener the test starts on each address of the
//! proxy namespace (sandbox and upstream side, IPv4 and IPv6) is refused
//! `denied_address` through CONNECT, absolute-form HTTP and SOCKS5, and
//! nothing arrives at it; an address added while Palisade runs is denied
//! once the addresses are read again; a rule naming exactly one gateway
//! address opens it, and `palisade check` on the gateway lists that opening.
//! An address added while a sandbox CONNECTs to it in a tight loop is
//! denied from the first CONNECT on: the kernel's notice, not the 2 s poll,
//! makes the policy deny it.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::addresses::arrived;
use crate::assert_refused;
use crate::lab::{self, dump, in_netns, wait_until, Lab, PROXY_URL};

const SOCKS: &str = "198.18.1.1:1080";
/// The port every broad rule names, where the test's listeners wait.
const PORT: u16 = 80;
/// The port of the rule naming one gateway address.
const OPEN_PORT: u16 = 8080;
/// The gateway's upstream-side IPv4 address (the lab's `u0`).
const UPSTREAM4: &str = "198.18.2.1";
/// The gateway's side of the second sandbox (`p1`).
const SANDBOX2_4: &str = "198.18.4.1";
/// IPv6 addresses the test gives the gateway before Palisade starts.
const SANDBOX6: &str = "2001:2:0:1::1";
const UPSTREAM6: &str = "2001:2:0:2::1";
/// Added while Palisade runs: only reading the addresses again denies it.
const LATE6: &str = "2001:2:0:2::99";

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "any-v4"
cidr = "0.0.0.0/0"
ports = [80]

[[org.allow]]
id = "any-v6"
cidr = "::/0"
ports = [80]

[[org.allow]]
id = "gateway-8080"
cidr = "198.18.2.1/32"
ports = [8080]
"#;

/// `ip -n NS -6 addr add ADDR/64 dev DEV nodad` (usable at once: no DAD).
fn add_v6(lab: &Lab, addr: &str, dev: &str) {
    let out = lab.proxy_ns_exec(
        "ip",
        &[
            "-6",
            "addr",
            "add",
            &format!("{addr}/64"),
            "dev",
            dev,
            "nodad",
        ],
    );
    assert!(out.success(), "ip addr add {addr}: {}", out.describe());
}

/// A listener on one of the gateway's addresses, polled without blocking.
fn gateway_listener(lab: &Lab, addr: &str, port: u16) -> TcpListener {
    let sa = if addr.contains(':') {
        format!("[{addr}]:{port}")
    } else {
        format!("{addr}:{port}")
    };
    let l = in_netns(&lab.ns_proxy, move || TcpListener::bind(sa.clone()))
        .unwrap_or_else(|e| panic!("bind {addr}:{port} in the proxy namespace: {e}"));
    l.set_nonblocking(true).expect("nonblocking");
    l
}

fn url(addr: &str, port: u16) -> String {
    if addr.contains(':') {
        format!("http://[{addr}]:{port}/")
    } else {
        format!("http://{addr}:{port}/")
    }
}

/// The deny record of `mode`/`kind` to `addr:port`, whose reason must be
/// `denied_address`.
fn denied(lab: &Lab, mode: &str, kind: &str, addr: &str, port: u16) -> Value {
    let bracketed = format!("[{addr}]");
    let rec = lab.wait_evidence(&format!("{mode}/{kind} {addr}:{port} denied"), |v| {
        v["event"] == "decision"
            && v["decision"] == "deny"
            && v["mode"] == mode
            && v["kind"] == kind
            && v["port"] == port
            && (v["host"] == addr || v["host"] == bracketed.as_str() || v["ip"] == addr)
    });
    assert_eq!(rec["reason"], "denied_address", "{rec}");
    assert_eq!(rec["org"], "acme", "{rec}");
    rec
}

/// Refused three ways, each on record.
fn refused_every_way(lab: &Lab, addr: &str) {
    let u = url(addr, PORT);
    // CONNECT (curl's proxy tunnel).
    let r = lab.client_curl(&["-p", "-x", PROXY_URL, &u]);
    assert_eq!(
        r.connect_status,
        403,
        "CONNECT {addr}: {r:?}\n{}",
        lab.proxy_output()
    );
    denied(lab, "explicit", "tcp", addr, PORT);
    // Absolute-form HTTP through the proxy.
    let r = lab.client_curl(&["-x", PROXY_URL, &u]);
    let rec = assert_refused(lab, &r, 403, "denied_address", &format!("GET {u}"));
    assert_eq!(rec["kind"], "http", "{rec}");
    // SOCKS5 (curl resolves nothing: the address goes as an address).
    let r = lab.client_curl(&["--socks5", SOCKS, &u]);
    assert_ne!(r.exit, Some(0), "socks5 {addr}: {r:?}");
    assert_eq!(r.status, 0, "socks5 {addr} got an HTTP answer: {r:?}");
    denied(lab, "socks5", "tcp", addr, PORT);
}

#[test]
fn every_gateway_address_is_refused_under_the_widest_rules() {
    let mut lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .proxy_option(&format!("socks5 = [{SOCKS:?}]"))
        .without_proxy()
        .start();
    add_v6(&lab, SANDBOX6, "p0");
    add_v6(&lab, UPSTREAM6, "u0");
    lab.spawn_proxy();
    lab.wait_proxy_ready();

    let addrs = [UPSTREAM4, SANDBOX2_4, UPSTREAM6, SANDBOX6];
    let listeners: Vec<(&str, TcpListener)> = addrs
        .iter()
        .map(|a| (*a, gateway_listener(&lab, a, PORT)))
        .collect();
    for addr in addrs {
        refused_every_way(&lab, addr);
    }

    // An address the gateway gains while Palisade runs (DHCP, a new pod
    // IP) is denied once the addresses are read again.
    add_v6(&lab, LATE6, "u0");
    let late = gateway_listener(&lab, LATE6, PORT);
    wait_until(
        "a reload for the host addresses with the new one",
        Duration::from_secs(15),
        || {
            let out = lab.proxy_output();
            let lines: Vec<&str> = out.lines().collect();
            let seen = lines
                .iter()
                .position(|l| l.contains("host addresses changed") && l.contains(LATE6));
            seen.is_some_and(|i| {
                lines[i..]
                    .iter()
                    .any(|l| l.contains("policy reloaded") && l.contains("host addresses changed"))
            })
        },
    );
    refused_every_way(&lab, LATE6);

    // The rule naming exactly one gateway address opens it, on its port:
    // the positive marker (recorded after every denial above) and the
    // proof that the listeners would have seen a connection.
    let open = gateway_listener(&lab, UPSTREAM4, OPEN_PORT);
    let mut conn = lab.client_conn();
    assert_eq!(
        conn.connect(&format!("{UPSTREAM4}:{OPEN_PORT}")),
        200,
        "{}",
        lab.proxy_output()
    );
    let rec = lab.wait_evidence("allow gateway-8080", |v| {
        v["decision"] == "allow" && v["rule"] == "gateway-8080"
    });
    assert_eq!(rec["ip"], UPSTREAM4, "{rec}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !arrived(&open) {
        assert!(
            Instant::now() < deadline,
            "the opened gateway address was never dialled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    conn.close();

    // Nothing arrived at any listener on the broad rules' port.
    for (addr, l) in listeners.iter().chain([(LATE6, late)].iter()) {
        assert!(
            !arrived(l),
            "the proxy dialled the gateway's own {addr}:{PORT}\n{}",
            dump(&lab.evidence())
        );
    }

    // `palisade check`, run on the gateway, lists its addresses and the
    // opening of one of them, and not the broad rules.
    let config = lab.config_path.display().to_string();
    let out = lab.proxy_ns_exec(lab::palisade_bin(), &["check", "-c", &config]);
    assert!(out.success(), "check: {}", out.describe());
    let text = &out.stdout;
    let line = text
        .lines()
        .find(|l| l.contains("gateway addresses"))
        .unwrap_or_else(|| panic!("no gateway addresses line:\n{text}"));
    for addr in [
        "198.18.1.1",
        UPSTREAM4,
        SANDBOX2_4,
        SANDBOX6,
        UPSTREAM6,
        LATE6,
    ] {
        assert!(
            line.split([' ', ',']).any(|w| w == addr),
            "{addr} not listed: {line}"
        );
    }
    assert!(
        text.contains("gateway-8080 opens 198.18.2.1/32 (gateway address) on ports 8080"),
        "{text}"
    );
    for rule in ["any-v4 ", "any-v6 "] {
        assert!(!text.contains(rule), "{rule} listed:\n{text}");
    }
}

/// Add `ADDR/32` to the gateway's upstream side (`ip -n NS`), then CONNECT
/// to `ADDR:PORT` through the proxy as fast as one client can, one
/// connection after another, for at most 2,000 tries or 3 s (longer than
/// the config poll's 2 s), and print how each was answered.
const ADD_THEN_CONNECT: &str = r#"
import socket, subprocess, sys, time
ns, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
add = subprocess.run(["ip", "-n", ns, "addr", "add", addr + "/32", "dev", "u0"],
                     capture_output=True, text=True)
if add.returncode != 0:
    print("add failed", add.stderr.strip(), flush=True)
    sys.exit(1)
start = time.monotonic()
answers, tries, last_through = {}, 0, None
while tries < 2000 and time.monotonic() - start < 3.0:
    s = socket.create_connection(("198.18.1.1", 3128), timeout=5,
                                 source_address=("198.18.1.2", 0))
    s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (addr, port, addr, port)).encode())
    head = b""
    while b"\r\n" not in head:
        chunk = s.recv(512)
        if not chunk:
            break
        head += chunk
    s.close()
    parts = head.split(b" ")
    status = parts[1].decode() if len(parts) > 1 else "none"
    answers[status] = answers.get(status, 0) + 1
    if status != "403":
        last_through = time.monotonic() - start
    tries += 1
through = tries - answers.get("403", 0)
print("tries %d through %d last_through_ms %s answers %s" % (
    tries, through,
    "none" if last_through is None else "%.0f" % (last_through * 1000),
    " ".join("%s=%d" % kv for kv in sorted(answers.items()))), flush=True)
"#;

#[test]
fn an_address_added_at_runtime_is_denied_from_the_first_connect() {
    const ADDED: &str = "198.18.2.77";
    let lab = Lab::start(POLICY);
    let (child, ready) =
        lab.spawn_client_script(ADD_THEN_CONNECT, &[&lab.ns_proxy, ADDED, &PORT.to_string()]);
    assert_eq!(ready, "ready");
    let out = child.wait_with_output().expect("the CONNECT loop");
    let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .skip_while(|w| *w != name)
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    let (tries, through) = (field("tries"), field("through"));
    eprintln!("added {ADDED} and CONNECTed at once: {line}");
    assert!(tries >= 20, "too few tries to tell: {line}");
    // The kernel's notice and the policy's swap race the client's first
    // CONNECTs after `ip addr add` returns: usually 0 of 2,000 get through,
    // and a few may within the first milliseconds (3, the last 4 ms in, in
    // one clean-clone run). The 2 s poll alone let ~1,800 through, the last
    // ~1.7 s in. What is held here is the window: nothing after it closes.
    let last_ms = line
        .split_whitespace()
        .skip_while(|w| *w != "last_through_ms")
        .nth(1)
        .map_or(0, |v| v.parse::<u64>().unwrap_or(0));
    assert!(
        through <= 10 && last_ms <= 100,
        "CONNECTs to the gateway's new address let through before the policy denied it: {line}\n{}",
        lab.proxy_output()
    );
    // Denied for what it is, on record, and the notice's reload logged.
    denied(&lab, "explicit", "tcp", ADDED, PORT);
    let log = lab.proxy_output();
    assert!(
        log.lines()
            .any(|l| l.contains("host addresses changed") && l.contains(ADDED)),
        "{log}"
    );
}
