//! Always-denied addresses through real sockets: a broad `0.0.0.0/0` rule on
//! the web ports opens neither the metadata service, nor the proxy's own
//! loopback (its canary), nor another org's sandbox network; only a rule
//! inside a range opens it. Each denial is proved twice: the evidence
//! record, and nothing arriving where the connection would have gone. Also
//! the close record's `bytes_up` of an absolute-form request, the DNS record
//! of an unknown client, and what `palisade check` says about openings.

use std::fs;
use std::io::ErrorKind;
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::lab::{
    self, dump, in_netns, run_with_timeout, scratch_dir, Lab, CLIENT2_IP, OTHER_IP, STRANGER_IP,
};
use crate::transparent::{load_gateway, TRANSPARENT};
use crate::{assert_refused, record_id, record_ref};

const SHIM: &str = "198.18.1.1:53";

/// acme may reach any address on the web ports, and one port of the
/// sibling sandbox by a rule inside its network. beta is that sibling: the
/// second client namespace, and (standing in for a sandbox a name resolves
/// into) `other.test`'s address.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "web-any"
cidr = "0.0.0.0/0"
ports = [80, 443]

[[org.allow]]
id = "sibling-8080"
cidr = "198.18.4.2/32"
ports = [8080]

[[org.allow]]
host = "allowed.test"

[[org.allow]]
host = "meta.test"

[[org.allow]]
host = "loop.test"

[[org.allow]]
host = "other.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24", "198.18.2.13/32"]
"#;

fn lab() -> Lab {
    Lab::builder()
        .policy(POLICY)
        .second_client()
        .dns_listen(&[SHIM])
        .start()
}

/// A listener in the second sandbox, polled without blocking.
fn sibling_listener(lab: &Lab, port: u16) -> TcpListener {
    let addr = format!("{CLIENT2_IP}:{port}");
    let l = in_netns(&lab.ns_client2, move || TcpListener::bind(addr)).expect("bind in sandbox 2");
    l.set_nonblocking(true).expect("nonblocking");
    l
}

/// Has anything connected to `l`? (A dialled connection sits in the
/// backlog whether or not anyone accepted it.)
pub(crate) fn arrived(l: &TcpListener) -> bool {
    match l.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept: {e}"),
    }
}

#[test]
fn a_broad_rule_opens_no_always_denied_address() {
    let lab = lab();
    let sibling80 = sibling_listener(&lab, 80);
    let sibling8080 = sibling_listener(&lab, 8080);

    // The broad rule does its job for an ordinary address.
    let ok = lab.proxied_curl(&format!("http://{}/", lab::ALLOWED_IP), &[]);
    assert_eq!(ok.status, 200, "{ok:?}\n{}", lab.proxy_output());

    // CONNECT and absolute-form to the metadata address, the proxy's own
    // loopback, the second sandbox and the proxy's own address.
    for target in [
        "169.254.169.254:80",
        "127.0.0.1:80",
        "127.0.0.1:443",
        &format!("{CLIENT2_IP}:80"),
        "198.18.1.1:80",
    ] {
        let resp = lab.raw_connect(target);
        let rec = assert_refused(
            &lab,
            &resp,
            403,
            "denied_address",
            &format!("CONNECT {target}"),
        );
        assert_eq!(rec["kind"], "tcp", "{rec}");
        assert_eq!(rec["org"], "acme", "{rec}");
    }
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://127.0.0.1/",
        &format!("http://{CLIENT2_IP}/"),
    ] {
        let host = url.split('/').nth(2).unwrap_or_default();
        let resp = lab.raw_request(&format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n\r\n"));
        let rec = assert_refused(&lab, &resp, 403, "denied_address", url);
        assert_eq!(rec["kind"], "http", "{rec}");
    }
    // Names resolving into those ranges, and into another org's sandbox.
    for (name, ip) in [
        ("meta.test", "169.254.169.254"),
        ("loop.test", "127.0.0.1"),
        ("other.test", OTHER_IP),
    ] {
        let resp = lab.raw_connect(&format!("{name}:80"));
        let rec = assert_refused(&lab, &resp, 403, "denied_address", name);
        assert_eq!(rec["host"], name, "{rec}");
        let resp = lab.raw_request(&format!(
            "GET http://{name}/ HTTP/1.1\r\nHost: {name}\r\n\r\n"
        ));
        assert_refused(
            &lab,
            &resp,
            403,
            "denied_address",
            &format!("{name} ({ip})"),
        );
    }

    // A rule inside the sibling's network opens exactly that port.
    let mut conn = lab.client_conn();
    assert_eq!(conn.connect(&format!("{CLIENT2_IP}:8080")), 200);
    let rec = lab.wait_evidence("allow sibling 8080", |v| {
        v["decision"] == "allow" && v["rule"] == "sibling-8080"
    });
    assert_eq!(rec["ip"], CLIENT2_IP, "{rec}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !arrived(&sibling8080) {
        assert!(
            Instant::now() < deadline,
            "the opened port was never dialled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    conn.close();

    // Every denial above was recorded before this allow, so nothing can be
    // in flight: no connection reached the sandbox, the canary or other.test.
    assert!(!arrived(&sibling80), "the proxy dialled the second sandbox");
    assert!(
        lab.canary_log().is_empty(),
        "the proxy dialled its own loopback:\n{}",
        dump(&lab.canary_log())
    );
    let up = lab.upstream_log();
    assert!(
        !up.iter()
            .any(|v| v["local"].as_str().unwrap_or("").starts_with(OTHER_IP)),
        "other.test (another org's sandbox) was dialled:\n{}",
        dump(&up)
    );

    // DNS: the same addresses are stripped from answers.
    let d = lab.dig(&["allowed.test", "A"]);
    assert_eq!(d.of("A"), [lab::ALLOWED_IP], "{}", d.output);
    for name in ["loop.test", "meta.test", "other.test"] {
        let d = lab.dig(&[name, "A"]);
        assert_eq!(d.status, "NOERROR", "{name}: {}", d.output);
        assert!(d.answers.is_empty(), "{name}: {}", d.output);
        let id = d.record_id().expect("EDE with record id");
        let rec = lab.wait_evidence(name, |v| record_ref(v).as_deref() == Some(id.as_str()));
        assert_eq!(rec["reason"], "denied_address", "{rec}");
    }

    // An unknown client's query is recorded under the normalised name.
    let d = lab.dig(&["-b", STRANGER_IP, "Allowed.TEST.", "A"]);
    assert_eq!(d.status, "REFUSED", "{}", d.output);
    let id = d.record_id().expect("EDE with record id");
    let rec = lab.wait_evidence("unknown client", |v| {
        record_ref(v).as_deref() == Some(id.as_str())
    });
    assert_eq!(rec["reason"], "unknown_client", "{rec}");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
}

/// `bytes_up` of an absolute-form request counts its request line and
/// headers as sent, not only the body.
/// The same rules hold in the other modes: a SOCKS5 CONNECT and a
/// transparent (REDIRECTed) connection to the metadata address or to the
/// sibling sandbox under the broad rule are denied `denied_address`, and
/// nothing arrives at the sibling.
#[test]
fn a_broad_rule_opens_nothing_through_socks5_or_the_gateway() {
    const SOCKS: &str = "198.18.1.1:1080";
    let lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .proxy_option(&format!("socks5 = [{SOCKS:?}]"))
        .proxy_option(&format!("transparent = [{TRANSPARENT:?}]"))
        .start();
    load_gateway(&lab);
    let out = lab.proxy_ns_exec(
        "nft",
        &[
            "insert", "rule", "inet", "palisade", "input", "iifname", "\"p0\"", "tcp", "dport",
            "1080", "accept",
        ],
    );
    assert!(out.success(), "nft insert: {}", out.describe());
    let sibling80 = sibling_listener(&lab, 80);

    for (ip, port) in [([169, 254, 169, 254], 80u16), ([198, 18, 4, 2], 80)] {
        let target = format!("{}.{}.{}.{}:{port}", ip[0], ip[1], ip[2], ip[3]);
        // SOCKS5: no authentication, CONNECT to the IPv4 address.
        let mut c = lab.client_conn_to(SOCKS);
        let mut req = vec![5, 1, 0, 5, 1, 0, 1];
        req.extend_from_slice(&ip);
        req.extend_from_slice(&port.to_be_bytes());
        c.send(&req).expect("socks5 request");
        let method = c.read_until(&[5, 0], Duration::from_secs(5));
        assert!(method.is_some(), "socks5 {target}: no method reply");
        let reply = c
            .read_until(&[0, 1], Duration::from_secs(5))
            .unwrap_or_else(|| panic!("socks5 {target}: no reply\n{}", lab.proxy_output()));
        assert_ne!(
            reply.get(1),
            Some(&0),
            "socks5 {target}: succeeded {reply:?}"
        );
        let rec = lab.wait_evidence(&format!("socks5 {target} denied"), |v| {
            v["mode"] == "socks5"
                && v["decision"] == "deny"
                && v["host"] == target.split(':').next().unwrap_or_default()
        });
        assert_eq!(rec["reason"], "denied_address", "{rec}");
        assert_eq!(rec["port"], port, "{rec}");

        // Transparent: the client connects straight to the address and the
        // gateway redirects it to Palisade.
        let mut t = lab.client_conn_to(&target);
        // Bytes that name no host: the address alone decides.
        let _ = t.send(b"SSH-2.0-probe\r\n");
        let rec = lab.wait_evidence(&format!("transparent {target} denied"), |v| {
            v["mode"] == "transparent"
                && v["decision"] == "deny"
                && v["ip"] == target.split(':').next().unwrap_or_default()
        });
        assert_eq!(rec["reason"], "denied_address", "{rec}");
    }
    // Both denials were recorded before this check (the positive marker):
    // nothing was dialled to the sibling.
    assert!(
        !arrived(&sibling80),
        "the sibling sandbox received a connection"
    );
}

#[test]
fn http_close_record_counts_the_request_head() {
    let lab = lab();
    let path = "p".repeat(3000);
    let request = format!(
        "GET http://allowed.test/{path} HTTP/1.1\r\nHost: allowed.test\r\n\
         X-Spacing:    kept   \r\nConnection: close\r\n\r\n"
    );
    let resp = lab.raw_request(&request);
    assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
    let decision = lab.wait_evidence("allow http", |v| {
        v["event"] == "decision" && v["kind"] == "http" && v["host"] == "allowed.test"
    });
    let id = record_id(&decision).expect("id");
    let close = lab.wait_evidence("close", |v| {
        v["event"] == "close" && v["conn"].as_str() == Some(id.as_str())
    });
    let up = close["bytes_up"].as_u64().expect("bytes_up");
    assert!(
        up >= request.len() as u64,
        "{up} < head {}: {close}",
        request.len()
    );
    // No body, one request on the connection: exactly the bytes sent.
    assert_eq!(up, request.len() as u64, "{close}");
}

/// `palisade check` names each rule that opens an always-denied range.
#[test]
fn check_lists_rules_that_open_always_denied_ranges() {
    let dir = scratch_dir("check-openings");
    let evidence = dir.join("evidence");
    fs::create_dir_all(&evidence).unwrap();
    let cfg = dir.join("palisade.toml");
    fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = [\"10.0.0.5:3128\"]\n\n[dns]\nlisten = []\n\
             upstream = [\"198.18.2.2:53\"]\n\n[admin]\nlisten = \"127.0.0.1:9711\"\n\n\
             [evidence]\ndir = {:?}\n{}",
            evidence.display().to_string(),
            r#"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]
[[org.allow]]
cidr = "0.0.0.0/0"
[[org.allow]]
host = "db.example.com"
[[org.allow]]
cidr = "8.0.0.0/5"
[[org.allow]]
cidr = "10.0.0.0/8"
ports = [5432]
[[org.allow]]
id = "sibling"
cidr = "10.9.1.0/24"
ports = [80, 8080]
[[org.allow]]
cidr = "fd00:ec2::254/128"
ports = [80]

[[org]]
name = "beta"
clients = ["10.9.0.0/16"]
"#
        ),
    )
    .unwrap();
    let out = run_with_timeout(
        Command::new(lab::palisade_bin()).args(["check", "-c", cfg.to_str().unwrap()]),
        None,
        lab::CMD_TIMEOUT,
    );
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let text = out.stdout;
    for line in [
        "acme/allow/3 opens 10.0.0.0/8 (private) on ports 5432",
        "sibling opens 10.9.1.0/24 of 10.9.0.0/16 (clients of beta) on ports 80, 8080",
        "sibling opens 10.9.1.0/24 of 10.0.0.0/8 (private) on ports 80, 8080",
        "acme/allow/5 opens fd00:ec2::254/128 of fc00::/7 (unique-local) on ports 80",
        // the existing summary stays
        "  orgs: 2 (6 rules)",
        "  proxy listen: 10.0.0.5:3128",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    // Broad rules open nothing, so they are not listed.
    for rule in ["acme/allow/0 ", "acme/allow/2 "] {
        assert!(!text.contains(rule), "{rule} listed:\n{text}");
    }
    let _ = fs::remove_dir_all(&dir);
}
