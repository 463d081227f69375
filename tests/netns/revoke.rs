//! Revocation: a reload's new policy reaches live connections. A CONNECT
//! tunnel, a SOCKS5 session and a transparent connection carrying data when
//! a reload removes their rule are closed within `revoke_grace`, with a
//! `policy_revoked` record naming each one's decision record, while a
//! tunnel whose rule stays keeps running through the same reload; the
//! next request on a keep-alive connection (absolute-form, or inside an
//! intercepted connection) is decided under the new policy, and an
//! intercepted connection whose rule goes is closed;
//! a report-mode org keeps its tunnel and records `would_deny`, and the
//! same org switched to enforce has the tunnel closed. The upstream's echo
//! (what still flows) and its request log are the witnesses.

use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, dump, Closed, Lab, RawConn, BANNER, BANNER_PORT, DEFAULT_POLICY};
use crate::transparent::{load_gateway, TRANSPARENT};

const SECS5: Duration = Duration::from_secs(5);
const SOCKS_ADDR: &str = "198.18.1.1:1080";
/// Longer than `revoke_grace` (1 s by default) plus the reload itself.
pub(crate) const CLOSED_WITHIN: Duration = Duration::from_secs(4);

/// The rules a reload removes: the banner port on allowed.test (CONNECT and
/// SOCKS5) and on the cidr host (transparent, decided by address).
const REVOKED_RULES: &str = "
[[org.allow]]
id = \"banner\"
host = \"allowed.test\"
ports = [2222]
tunnel = \"opaque\"

[[org.allow]]
id = \"banner-cidr\"
cidr = \"198.18.2.30/32\"
ports = [2222]
";

/// The rule that stays: the banner port on other.test.
const KEPT_RULE: &str = "
[[org.allow]]
id = \"keep\"
host = \"other.test\"
ports = [2222]
tunnel = \"opaque\"
";

fn lab_with(policy: &str) -> Lab {
    let lab = Lab::builder()
        .policy(policy)
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .start();
    load_gateway(&lab);
    // The gateway ruleset admits the explicit port; the SOCKS5 one too here.
    let out = lab.proxy_ns_exec(
        "nft",
        &[
            "insert", "rule", "inet", "palisade", "input", "iifname", "\"p0\"", "tcp", "dport",
            "1080", "accept",
        ],
    );
    assert!(out.success(), "nft insert: {}", out.describe());
    lab
}

pub(crate) fn served_hash(lab: &Lab) -> String {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    let v: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.describe()));
    v["hash"].as_str().unwrap().to_string()
}

/// Rewrite the config with `f` and reload it (SIGHUP); waits until the new
/// policy is served.
pub(crate) fn reload(lab: &Lab, f: impl FnOnce(String) -> String) {
    let before = served_hash(lab);
    let text = std::fs::read_to_string(&lab.config_path).unwrap();
    let changed = f(text.clone());
    assert_ne!(changed, text, "the edit changed nothing");
    let tmp = lab.config_path.with_extension("new");
    std::fs::write(&tmp, changed).unwrap();
    std::fs::rename(&tmp, &lab.config_path).unwrap();
    lab.signal_proxy("-HUP");
    lab::wait_until("new policy served", SECS5, || served_hash(lab) != before);
}

fn echo(c: &mut RawConn, line: &str) -> bool {
    c.send(line.as_bytes()).is_ok() && c.read_until(line.as_bytes(), SECS5).is_some()
}

fn banner(c: &mut RawConn, what: &str) {
    assert!(
        c.read_until(BANNER.as_bytes(), SECS5).is_some(),
        "{what}: no banner"
    );
    assert!(echo(c, &format!("{what}-before\n")), "{what}: no echo");
}

/// A CONNECT tunnel to `target`, carrying data.
fn connect_tunnel(lab: &Lab, target: &str) -> RawConn {
    let mut c = lab.client_conn();
    assert_eq!(c.connect(target), 200, "CONNECT {target}");
    banner(&mut c, target);
    c
}

/// A SOCKS5 session (no auth, CONNECT by name) to `host:port`, carrying data.
fn socks_tunnel(lab: &Lab, host: &str, port: u16) -> RawConn {
    let mut c = lab.client_conn_to(SOCKS_ADDR);
    c.send(&[5, 1, 0]).unwrap();
    let mut req = vec![5, 1, 0, 3, host.len() as u8];
    req.extend_from_slice(host.as_bytes());
    req.extend_from_slice(&port.to_be_bytes());
    c.send(&req).unwrap();
    let got = c
        .read_until(BANNER.as_bytes(), SECS5)
        .expect("SOCKS5 banner");
    // Method reply [5, 0], then the CONNECT reply [5, 0 (succeeded), ...].
    assert_eq!(&got[..4], &[5, 0, 5, 0], "SOCKS5 replies: {got:?}");
    assert!(echo(&mut c, "socks-before\n"), "socks: no echo");
    c
}

/// A transparent connection from the sandbox to `addr` (no proxy settings).
fn transparent_conn(lab: &Lab, addr: &str) -> RawConn {
    let mut c = lab.client_conn_to(addr);
    banner(&mut c, addr);
    c
}

/// The decision record of a live connection: `mode`, `host`, allowed.
fn decision(lab: &Lab, mode: &str, host: &str) -> Value {
    lab.wait_evidence(&format!("{mode} decision for {host}"), |v| {
        v["event"] == "decision"
            && v["mode"] == mode
            && v["host"] == host
            && v["port"] == BANNER_PORT
            && v["decision"] == "allow"
            && v["conn"].is_null()
    })
}

/// The record that revoked (or reported) the connection recorded as `id`.
fn revocation(lab: &Lab, id: &str) -> Value {
    lab.wait_evidence(&format!("revocation of {id}"), |v| {
        v["event"] == "decision" && v["kind"] == "tcp" && v["conn"] == id
    })
}

fn revoked_metric(lab: &Lab, mode: &str) -> f64 {
    crate::metrics::scalar_from_scrape(
        lab,
        &format!("palisade_connections_revoked_total{{mode=\"{mode}\",org=\"acme\"}}"),
    )
}

#[test]
fn a_reload_closes_live_connections_it_denies_and_keeps_the_rest() {
    let lab = lab_with(&format!("{DEFAULT_POLICY}{REVOKED_RULES}{KEPT_RULE}"));
    let mut explicit = connect_tunnel(&lab, &format!("allowed.test:{BANNER_PORT}"));
    let mut socks = socks_tunnel(&lab, "allowed.test", BANNER_PORT);
    let mut transparent = transparent_conn(&lab, &format!("{}:{BANNER_PORT}", lab::CIDR_IP));
    let mut kept = connect_tunnel(&lab, &format!("other.test:{BANNER_PORT}"));
    // A keep-alive connection of absolute-form requests, one answered.
    let mut keep_alive = lab.client_conn();
    let get = "GET http://allowed.test/revoke-1 HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
    keep_alive.send(get.as_bytes()).unwrap();
    assert_eq!(keep_alive.read_response(SECS5).status, 200);

    let ids: Vec<(&str, String)> = [
        ("explicit", "allowed.test"),
        ("socks5", "allowed.test"),
        ("transparent", lab::CIDR_IP),
    ]
    .into_iter()
    .map(|(mode, host)| {
        (
            mode,
            decision(&lab, mode, host)["id"]
                .as_str()
                .unwrap()
                .to_string(),
        )
    })
    .collect();
    let kept_id = decision(&lab, "explicit", "other.test")["id"]
        .as_str()
        .unwrap()
        .to_string();

    // Remove the banner rules and allowed.test's web ports.
    reload(&lab, |t| {
        t.replace(REVOKED_RULES, "").replace(
            "[[org.allow]]\nhost = \"allowed.test\"\nports = [80, 443]\n",
            "",
        )
    });
    let after = served_hash(&lab);

    for (what, conn) in [
        ("CONNECT", &mut explicit),
        ("SOCKS5", &mut socks),
        ("transparent", &mut transparent),
    ] {
        let _ = conn.send(b"after-reload\n");
        assert!(
            matches!(conn.wait_closed(CLOSED_WITHIN), Closed::After(_)),
            "{what} tunnel still open after its rule was removed"
        );
    }
    for (mode, id) in &ids {
        let r = revocation(&lab, id);
        assert_eq!(
            (&r["decision"], &r["reason"], &r["mode"]),
            (
                &Value::from("deny"),
                &Value::from("policy_revoked"),
                &Value::from(*mode)
            ),
            "{r}"
        );
        assert_eq!(r["policy"], after.as_str(), "{r}");
        assert_eq!(r["org"], "acme", "{r}");
        // The new policy's own reason: no rule left for the name; the
        // cidr host keeps a rule for port 80 only.
        let why = if *mode == "transparent" {
            "now port_not_allowed"
        } else {
            "now no_matching_rule"
        };
        assert_eq!(r["detail"], why, "{r}");
        // The close record follows, naming the same decision.
        lab.wait_evidence(&format!("close of {id}"), |v| {
            v["event"] == "close" && v["conn"] == id.as_str()
        });
    }
    for mode in ["explicit", "socks5", "transparent"] {
        assert_eq!(revoked_metric(&lab, mode), 1.0, "{mode}");
    }

    // The tunnel whose rule stayed runs on, untouched.
    assert!(echo(&mut kept, "kept-after\n"), "kept tunnel dropped");
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["event"] == "decision" && v["conn"] == kept_id.as_str()),
        "{}",
        dump(&lab.evidence())
    );

    // The keep-alive connection's next request is decided under the new
    // policy, and never reaches the upstream.
    let get = "GET http://allowed.test/revoke-2 HTTP/1.1\r\nHost: allowed.test\r\n\r\n";
    keep_alive.send(get.as_bytes()).unwrap();
    let r = keep_alive.read_response(SECS5);
    assert_eq!(r.status, 403, "{r:?}");
    let denied = lab.wait_evidence("the second request denied", |v| {
        v["kind"] == "http" && v["decision"] == "deny" && v["host"] == "allowed.test"
    });
    assert_eq!(denied["policy"], after.as_str(), "{denied}");
    let upstream = lab.upstream_log();
    assert!(
        upstream
            .iter()
            .any(|v| v["request_line"] == "GET /revoke-1 HTTP/1.1"),
        "{}",
        dump(&upstream)
    );
    assert!(
        !upstream.iter().any(|v| v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains("/revoke-2"))),
        "{}",
        dump(&upstream)
    );
}

#[test]
fn report_mode_keeps_the_tunnel_on_record_and_enforce_closes_it() {
    let report =
        DEFAULT_POLICY.replace("name = \"acme\"\n", "name = \"acme\"\nmode = \"report\"\n");
    assert_ne!(report, DEFAULT_POLICY);
    let lab = lab_with(&format!("{report}{REVOKED_RULES}"));
    let mut tunnel = connect_tunnel(&lab, &format!("allowed.test:{BANNER_PORT}"));
    let id = decision(&lab, "explicit", "allowed.test")["id"]
        .as_str()
        .unwrap()
        .to_string();

    // Narrowed, still in report mode: kept, with what enforcement would do.
    reload(&lab, |t| t.replace(REVOKED_RULES, ""));
    let reported = revocation(&lab, &id);
    assert_eq!(
        (
            &reported["decision"],
            &reported["reason"],
            &reported["would_deny"]
        ),
        (
            &Value::from("allow"),
            &Value::from("report_only"),
            &Value::from("policy_revoked")
        ),
        "{reported}"
    );
    assert!(
        echo(&mut tunnel, "report-after\n"),
        "report-mode tunnel dropped"
    );
    assert_eq!(revoked_metric(&lab, "explicit"), 0.0);

    // The same org now enforces: the tunnel is closed.
    reload(&lab, |t| t.replace("mode = \"report\"\n", ""));
    let _ = tunnel.send(b"enforce-after\n");
    assert!(
        matches!(tunnel.wait_closed(CLOSED_WITHIN), Closed::After(_)),
        "tunnel kept after the org turned to enforce"
    );
    let revoked = lab.wait_evidence("revocation under enforce", |v| {
        v["conn"] == id.as_str() && v["reason"] == "policy_revoked"
    });
    assert_eq!(revoked["decision"], "deny", "{revoked}");
    assert_eq!(revoked_metric(&lab, "explicit"), 1.0);
}

/// A client holding one intercepted keep-alive connection (CONNECT to
/// allowed.test:443, TLS trusting the org CA): it prints the status of its
/// first request, waits for the file `go`, sends its second request and
/// prints that status (or how the connection ended).
const KEEP_ALIVE_CLIENT: &str = r#"
import os, socket, ssl, sys, time
proxy, ca, go, first, second = sys.argv[1:6]
host, port = proxy.split(":")
s = socket.create_connection((host, int(port)), timeout=8, source_address=("198.18.1.2", 0))
s.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
t = ssl.create_default_context(cafile=ca).wrap_socket(s, server_hostname="allowed.test")
f = t.makefile("rb")
def request(path):
    t.sendall(("GET %s HTTP/1.1\r\nHost: allowed.test\r\n\r\n" % path).encode())
    status = f.readline().split()[1].decode()
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        if k.lower() == "content-length":
            length = int(v)
    f.read(length)
    return status
print("first", request(first), flush=True)
deadline = time.time() + 20
while not os.path.exists(go) and time.time() < deadline:
    time.sleep(0.05)
try:
    print("second", request(second), flush=True)
except Exception as e:
    print("second ended", type(e).__name__, flush=True)
"#;

/// Run [`KEEP_ALIVE_CLIENT`]: its first line, then (after `between` and
/// the go file) the rest of what it printed.
pub(crate) fn keep_alive_across(
    setup: &crate::intercept::Setup,
    (first, second): (&str, &str),
    between: impl FnOnce(),
) -> (String, String) {
    let lab = &setup.lab;
    let go = lab::scratch_dir("revoke-go").join("go");
    let ca = setup.org_ca.display().to_string();
    let go_arg = go.display().to_string();
    let (child, line) = lab.spawn_client_script(
        KEEP_ALIVE_CLIENT,
        &[lab::PROXY_ADDR, &ca, &go_arg, first, second],
    );
    between();
    std::fs::write(&go, "").unwrap();
    let out = child.wait_with_output().expect("keep-alive client");
    (
        line,
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    )
}

/// The id of the intercepted connection's `tcp` decision record.
fn intercepted_id(lab: &Lab) -> String {
    lab.wait_evidence("the intercepted connection", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["intercepted"] == true
    })["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn an_intercepted_connection_decides_its_next_request_under_the_new_policy() {
    let setup = crate::intercept::start();
    let lab = &setup.lab;
    let (first, second) = keep_alive_across(&setup, ("/keep-1", "/keep-2"), || {
        reload(lab, |t| {
            t.replace(
                "deny_paths = [\"/upload\", \"/api/internal*\"]",
                "deny_paths = [\"/upload\", \"/api/internal*\", \"/keep-2\"]",
            )
        })
    });
    assert_eq!(first, "first 200");
    assert_eq!(second, "second 403", "{}", lab.proxy_output());
    let after = served_hash(lab);
    let id = intercepted_id(lab);
    let denied = lab.wait_evidence("the second request", |v| {
        v["kind"] == "http" && v["path"] == "/keep-2"
    });
    assert_eq!(
        (&denied["decision"], &denied["reason"], &denied["conn"]),
        (
            &Value::from("deny"),
            &Value::from("path_not_allowed"),
            &Value::from(id.as_str())
        ),
        "{denied}"
    );
    assert_eq!(denied["policy"], after.as_str(), "{denied}");
    // The connection itself stayed allowed: no revocation of it.
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["conn"] == id.as_str() && v["reason"] == "policy_revoked"),
        "{}",
        dump(&lab.evidence())
    );
    let upstream = lab.upstream_log();
    assert!(
        !upstream.iter().any(|v| v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains("/keep-2"))),
        "{}",
        dump(&upstream)
    );
}

#[test]
fn an_intercepted_connection_whose_rule_goes_is_closed() {
    let setup = crate::intercept::start();
    let lab = &setup.lab;
    let rule = "[[org.allow]]\nid = \"registry\"\nhost = \"allowed.test\"\nports = [443]\nintercept = true\n";
    let (first, second) = keep_alive_across(&setup, ("/keep-1", "/keep-3"), || {
        reload(lab, |t| {
            assert!(t.contains(rule), "{t}");
            // Its port goes: allowed.test:443 is no longer allowed.
            t.replace(rule, &rule.replace("[443]", "[8443]"))
        });
        let id = intercepted_id(lab);
        let r = revocation(lab, &id);
        assert_eq!(
            (&r["decision"], &r["reason"]),
            (&Value::from("deny"), &Value::from("policy_revoked")),
            "{r}"
        );
    });
    assert_eq!(first, "first 200");
    assert_ne!(second, "second 200", "{}", lab.proxy_output());
    assert_eq!(revoked_metric(lab, "explicit"), 1.0);
    let upstream = lab.upstream_log();
    assert!(
        !upstream.iter().any(|v| v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains("/keep-3"))),
        "{}",
        dump(&upstream)
    );
}
