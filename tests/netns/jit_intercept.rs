//! Grants naming a method and path, for HTTPS: a CONNECT no rule allows,
//! under a live grant of an org with an interception CA, is intercepted,
//! and each request inside is decided against the grants (allowed, rule
//! `grant:ID`, a use spent per request; any other refused `403` inside
//! TLS, with an approval of its own on an `ask` org). `max_uses = 1`
//! allows exactly one request; a revoke or the TTL's end closes a live
//! intercepted keep-alive connection, recorded `grant_expired`; a reload
//! keeps it unless it denies the host; a grant revoked before the
//! client's TLS hello still closes its tunnel. Transparent mode too.

use std::io::BufRead;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::jit::{digest, json, ALICE};
use crate::lab::{self, ca_pem, HttpResp, Lab, PROXY_URL};

/// acme asks on a miss; one rule of it intercepts (so it has a CA), none
/// names a.wild.test (served over HTTPS by the upstream fixture).
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
on_miss = "ask"

[[org.allow]]
id = "registry"
host = "allowed.test"
ports = [443]
intercept = true
"#;

/// The lab, and the org CA the client trusts.
fn start() -> (Lab, String) {
    start_with(|b| b)
}

/// [`start`], the builder changed by `extra` first.
fn start_with(extra: impl FnOnce(lab::LabBuilder) -> lab::LabBuilder) -> (Lab, String) {
    let dir = lab::scratch_dir("jit-intercept");
    let ca_dir = dir.join("ca");
    let digest = digest(ALICE);
    let lab = extra(Lab::builder())
        .policy(POLICY)
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .admin_config(&format!(
            "approver_tokens = [{{ name = \"alice\", token = \"{digest}\", orgs = [\"acme\"] }}]\n"
        ))
        .start();
    let org_ca = ca_dir.join("acme.pem").display().to_string();
    (lab, org_ca)
}

/// An admin request as alice: status, body.
fn admin(lab: &Lab, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    crate::jit::admin(lab, method, path, Some(ALICE), body)
}

/// Grant acme `extra` (JSON members) on a.wild.test:443: the grant's id.
fn grant(lab: &Lab, extra: &str) -> String {
    let body = format!(r#"{{"org":"acme","target":"a.wild.test","port":443{extra}}}"#);
    let (code, body) = admin(lab, "POST", "/v1/grants", Some(&body));
    assert_eq!(code, 201, "{body}");
    json(&body)["id"].as_str().unwrap().to_string()
}

/// The grant `id` as listed (`None`: no longer held).
fn listed(lab: &Lab, id: &str) -> Option<Value> {
    let (code, body) = admin(lab, "GET", "/v1/grants", None);
    assert_eq!(code, 200, "{body}");
    json(&body)["grants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == id)
        .cloned()
}

/// curl through the proxy, trusting only the org CA.
fn curl(lab: &Lab, ca: &str, url: &str, extra: &[&str]) -> HttpResp {
    let mut args: Vec<&str> = vec!["-x", PROXY_URL, "--cacert", ca];
    args.extend_from_slice(extra);
    args.push(url);
    lab.client_curl(&args)
}

fn proxy_status(r: &HttpResp) -> String {
    r.headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("proxy-status"))
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// One intercepted keep-alive connection to a.wild.test:443: the
/// requests of argv[5..] (`METHOD:PATH`) in order, their statuses (or
/// `closed`) printed on one line; then it waits (bounded) for the proxy to close
/// the connection and prints `closed EPOCH_SECONDS`, or `open`.
const KEEPALIVE: &str = r#"
import socket, ssl, sys, time
host, port, ca, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
s = socket.create_connection((host, port), timeout=10)
s.sendall(b"CONNECT a.wild.test:443 HTTP/1.1\r\nHost: a.wild.test:443\r\n\r\n")
head = b""
while b"\r\n\r\n" not in head:
    d = s.recv(4096)
    if not d:
        break
    head += d
if b" 200" not in head.split(b"\r\n")[0]:
    print("connect", head.split(b"\r\n")[0].decode("latin-1"), flush=True)
    sys.exit(0)
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["http/1.1"])
t = ctx.wrap_socket(s, server_hostname="a.wild.test")
def ask(method, path):
    t.sendall(("%s %s HTTP/1.1\r\nHost: a.wild.test\r\nContent-Length: 0\r\n\r\n" % (method, path)).encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = t.recv(65536)
        if not d:
            return "closed"
        buf += d
    h, _, body = buf.partition(b"\r\n\r\n")
    lines = h.decode("latin-1").split("\r\n")
    n = 0
    for l in lines[1:]:
        k, _, v = l.partition(":")
        if k.strip().lower() == "content-length":
            n = int(v)
    while len(body) < n:
        d = t.recv(65536)
        if not d:
            break
        body += d
    return lines[0].split(" ")[1]
got = []
for r in sys.argv[5:]:
    m, _, p = r.partition(":")
    got.append(ask(m, p))
print(" ".join(got), flush=True)
t.settimeout(wait)
try:
    while t.recv(65536):
        pass
    print("closed %.3f" % time.time(), flush=True)
except (socket.timeout, TimeoutError):
    print("open", flush=True)
except OSError:
    print("closed %.3f" % time.time(), flush=True)
"#;

/// Run [`KEEPALIVE`] with `requests` (waiting `wait` seconds for the
/// close): the child and the statuses it printed.
fn keepalive(lab: &Lab, ca: &str, wait: &str, requests: &[&str]) -> (lab::Background, String) {
    let (host, port) = PROXY_URL
        .trim_start_matches("http://")
        .rsplit_once(':')
        .unwrap();
    let mut args = vec![host, port, ca, wait];
    args.extend_from_slice(requests);
    let (child, statuses) = lab.spawn_client_script(KEEPALIVE, &args);
    (lab::Background(child), statuses)
}

/// The next line [`KEEPALIVE`] prints.
fn next_line(child: &mut lab::Background) -> String {
    let mut line = String::new();
    if let Some(out) = child.0.stdout.as_mut() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    line.trim().to_string()
}

#[test]
fn a_method_and_path_grant_intercepts_https_and_decides_each_request() {
    let (lab, ca) = start();
    let gid = grant(&lab, r#","ttl":"10m","method":"GET","path":"/api/x""#);
    let rule = format!("grant:{gid}");

    let ok = curl(&lab, &ca, "https://a.wild.test/api/x", &[]);
    assert_eq!(
        ok.status,
        200,
        "GET /api/x under its grant: {} {}",
        ok.stderr,
        lab.proxy_output()
    );
    let tcp = lab.wait_evidence("the intercepted tunnel", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["host"] == "a.wild.test"
    });
    assert_eq!(tcp["rule"], rule, "{tcp}");
    assert_eq!(tcp["intercepted"], true, "{tcp}");
    let req = lab.wait_evidence("the granted request", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == "/api/x"
    });
    assert_eq!(req["decision"], "allow", "{req}");
    assert_eq!(req["rule"], rule, "{req}");
    assert_eq!(req["method"], "GET", "{req}");
    assert_eq!(req["conn"], tcp["id"], "{req}");

    // Anything else is refused inside TLS, and asks on its own; a path
    // with a dot segment is refused as under any intercepting rule.
    for (url, extra, asked, reason) in [
        (
            "https://a.wild.test/api/y",
            &[][..],
            "GET /api/y",
            "approval_pending",
        ),
        (
            "https://a.wild.test/api/x",
            &["--data", "x"][..],
            "POST /api/x",
            "approval_pending",
        ),
        (
            "https://a.wild.test/api/x/../y",
            &["--path-as-is"][..],
            "GET /api/x/../y",
            "path_not_allowed",
        ),
    ] {
        let r = curl(&lab, &ca, url, extra);
        assert_eq!(r.connect_status, 200, "{asked}: the tunnel opens");
        assert_eq!(r.status, 403, "{asked} passed under a GET /api/x grant");
        let ps = proxy_status(&r);
        assert!(ps.contains(reason), "{asked}: {ps}");
        let (method, path) = asked.split_once(' ').unwrap();
        let refusal = lab.wait_evidence(asked, |v| {
            v["kind"] == "http" && v["method"] == method && v["path"] == path
        });
        assert_eq!(refusal["reason"], reason, "{refusal}");
        assert_eq!(refusal["decision"], "deny", "{refusal}");
        if reason != "approval_pending" {
            continue;
        }
        let destination = format!("a.wild.test:443 {asked}");
        let (_, body) = admin(&lab, "GET", "/v1/approvals", None);
        assert!(
            json(&body)["approvals"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a["destination"] == destination),
            "no approval for {destination}: {body}"
        );
    }
    // The tunnels spent nothing: one use, the one GET.
    let g = listed(&lab, &gid).expect("the grant is held");
    assert_eq!(g["uses"], 1, "{g}");
    // Another port is not granted.
    let other = curl(&lab, &ca, "https://a.wild.test:8443/api/x", &[]);
    assert_eq!(other.connect_status, 403, "{}", other.stderr);
}

#[test]
fn a_single_use_request_grant_allows_one_request_and_a_revoke_or_ttl_closes_a_live_one() {
    let (lab, ca) = start();
    let once = grant(&lab, r#","max_uses":1,"method":"GET","path":"/api/x""#);
    let (_child, got) = keepalive(&lab, &ca, "1", &["GET:/api/x", "GET:/api/x"]);
    assert_eq!(
        got,
        "200 403",
        "one use, two requests on one connection: {}",
        lab.proxy_output()
    );
    lab.wait_evidence("used_up", |v| {
        v["kind"] == "grant" && v["event"] == "used_up" && v["grant"]["id"] == once
    });
    let again = curl(&lab, &ca, "https://a.wild.test/api/x", &[]);
    assert_ne!(
        again.status, 200,
        "a used-up grant let a new connection's request through"
    );
    let allowed: Vec<Value> = lab
        .evidence()
        .into_iter()
        .filter(|v| v["kind"] == "http" && v["event"] == "decision" && v["decision"] == "allow")
        .collect();
    assert_eq!(allowed.len(), 1, "{allowed:?}");

    // A revoke closes a live intercepted keep-alive connection.
    let gid = grant(&lab, r#","ttl":"10m","method":"GET","path":"/api/*""#);
    let (mut live, got) = keepalive(&lab, &ca, "10", &["GET:/api/z"]);
    assert_eq!(got, "200", "{}", lab.proxy_output());
    let revoked_at = SystemTime::now();
    let (code, body) = admin(&lab, "DELETE", &format!("/v1/grants/{gid}"), None);
    assert_eq!(code, 200, "{body}");
    let closed = next_line(&mut live);
    let at = closed
        .strip_prefix("closed ")
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("the revoked grant's connection stayed open: {closed:?}"));
    let took =
        Duration::from_secs_f64(at).saturating_sub(revoked_at.duration_since(UNIX_EPOCH).unwrap());
    assert!(
        took < Duration::from_secs(1),
        "closed {took:?} after the revoke"
    );
    let cut = lab.wait_evidence("grant_expired", |v| {
        v["reason"] == "grant_expired" && v["kind"] == "tcp"
    });
    let opened = lab.wait_evidence("the revoked grant's tunnel", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["rule"] == format!("grant:{gid}")
    });
    assert_eq!(cut["conn"], opened["id"], "{cut}");
    assert_eq!(opened["intercepted"], true, "{opened}");
    eprintln!("jit_intercept timings: revoke to closed intercepted connection {took:?}");

    // So does its TTL's end.
    let granted_at = SystemTime::now();
    let short = grant(&lab, r#","ttl":"2s","method":"GET","path":"/api/*""#);
    let (mut live, got) = keepalive(&lab, &ca, "8", &["GET:/api/t"]);
    assert_eq!(got, "200", "{}", lab.proxy_output());
    let closed = next_line(&mut live);
    let at = closed
        .strip_prefix("closed ")
        .and_then(|t| t.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("the expired grant's connection stayed open: {closed:?}"));
    let after_ttl = Duration::from_secs_f64(at)
        .saturating_sub(granted_at.duration_since(UNIX_EPOCH).unwrap() + Duration::from_secs(2));
    assert!(
        after_ttl < Duration::from_secs(1),
        "closed {after_ttl:?} after the TTL"
    );
    lab.wait_evidence("the expired grant's connection", |v| {
        v["reason"] == "grant_expired"
            && v["kind"] == "tcp"
            && v["detail"] == format!("grant {short} ended")
    });
    eprintln!("jit_intercept timings: TTL end to closed intercepted connection <= {after_ttl:?}");
}

/// Transparent mode: a TLS connection to the grant's host (its SNI) is
/// intercepted the same way, each request decided against the grants; and
/// so is a SOCKS5 connection.
#[test]
fn a_transparent_or_socks5_tls_connection_under_a_request_grant_is_intercepted() {
    use crate::transparent::{load_gateway, TRANSPARENT};
    const SOCKS: &str = "198.18.1.1:1080";
    let (lab, ca) = start_with(|b| {
        b.proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
            .proxy_option(&format!("socks5 = [{SOCKS:?}]"))
    });
    let gid = grant(&lab, r#","ttl":"10m","method":"GET","path":"/api/x""#);
    let socks = |path: &str| {
        let url = format!("https://a.wild.test{path}");
        let r = lab.client_curl(&["--socks5-hostname", SOCKS, "--cacert", &ca, &url]);
        (r.status, r.stderr)
    };
    assert_eq!(socks("/api/x").0, 200, "{:?}", socks("/api/x"));
    assert_eq!(socks("/api/z").0, 403);
    let through = lab.wait_evidence("the SOCKS5 request", |v| {
        v["kind"] == "http"
            && v["event"] == "decision"
            && v["mode"] == "socks5"
            && v["path"] == "/api/x"
    });
    assert_eq!(through["rule"], format!("grant:{gid}"), "{through}");

    // (The gateway ruleset leaves the sandbox only the redirect.)
    load_gateway(&lab);
    let resolve = format!("a.wild.test:443:{}", lab::WILD_A_IP);
    let get = |path: &str| {
        let url = format!("https://a.wild.test{path}");
        let args = [
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "--cacert",
            &ca,
            "--resolve",
            &resolve,
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &url,
        ];
        let out = lab.client_exec("curl", &args);
        format!("{} {}", out.stdout.trim(), out.stderr.trim())
    };
    assert_eq!(get("/api/x").trim(), "200", "{}", lab.proxy_output());
    assert_eq!(get("/api/y").trim(), "403");
    let allowed = lab.wait_evidence("the granted transparent request", |v| {
        v["kind"] == "http"
            && v["event"] == "decision"
            && v["path"] == "/api/x"
            && v["mode"] == "transparent"
    });
    assert_eq!(allowed["rule"], format!("grant:{gid}"), "{allowed}");
    let refused = lab.wait_evidence("the other request", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == "/api/y"
    });
    assert_eq!(refused["reason"], "approval_pending", "{refused}");
}

/// A reload that leaves the grant's host a miss keeps its intercepted
/// connection (the grant, not a rule, decides its requests); one that
/// denies the host closes it at once.
#[test]
fn a_reload_keeps_a_grants_intercepted_connection_until_one_denies_its_host() {
    use crate::reload::{edit_config, served_hash};
    let (lab, ca) = start();
    grant(&lab, r#","ttl":"10m","method":"GET","path":"/api/*""#);
    let reload = |add: &str| {
        let before = served_hash(&lab);
        edit_config(&lab, |t| format!("{t}\n{add}"));
        lab.signal_proxy("-HUP");
        lab::wait_until("the new policy served", Duration::from_secs(5), || {
            served_hash(&lab) != before
        });
    };
    let (mut kept, got) = keepalive(&lab, &ca, "3", &["GET:/api/a"]);
    assert_eq!(got, "200", "{}", lab.proxy_output());
    reload("[[org.allow]]\nid = \"other\"\nhost = \"other.test\"\n");
    assert_eq!(
        next_line(&mut kept),
        "open",
        "a reload that denies nothing closed the grant's intercepted connection"
    );

    let (mut cut, got) = keepalive(&lab, &ca, "10", &["GET:/api/b"]);
    assert_eq!(got, "200", "{}", lab.proxy_output());
    reload("[[org.deny]]\nid = \"no-a\"\nhost = \"a.wild.test\"\n");
    let closed = next_line(&mut cut);
    assert!(
        closed.starts_with("closed "),
        "a denying reload left it open: {closed}"
    );
    let ended = lab.wait_evidence("the grant's end by the policy", |v| {
        v["kind"] == "grant" && v["event"] == "expired"
    });
    assert_eq!(ended["grant"]["ended_by"], "policy", "{ended}");
    let why = lab.wait_evidence("the connection's end", |v| {
        v["kind"] == "tcp"
            && v["event"] == "decision"
            && v["decision"] == "deny"
            && v["conn"].is_string()
    });
    let reason = why["reason"].as_str().unwrap_or_default();
    assert!(
        ["grant_expired", "policy_revoked"].contains(&reason),
        "{why}"
    );
    eprintln!("jit_intercept: a denying reload closed the connection as {reason}");
}

/// A CONNECT to a.wild.test:443; prints `tunnel STATUS-LINE`, waits
/// argv[4] seconds, then says its TLS hello and sends `GET /api/x`, and
/// prints `closed` once the proxy ends the connection (within 5 s of
/// the request), or `open`.
const LATE_HELLO: &str = r#"
import socket, ssl, sys, time
host, port, ca, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
s = socket.create_connection((host, port), timeout=10)
s.sendall(b"CONNECT a.wild.test:443 HTTP/1.1\r\nHost: a.wild.test:443\r\n\r\n")
head = b""
while b"\r\n\r\n" not in head:
    d = s.recv(4096)
    if not d:
        break
    head += d
print("tunnel " + head.split(b"\r\n")[0].decode("latin-1"), flush=True)
time.sleep(pause)
try:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    t = ctx.wrap_socket(s, server_hostname="a.wild.test")
    t.settimeout(5)
    t.sendall(b"GET /api/x HTTP/1.1\r\nHost: a.wild.test\r\n\r\n")
    while t.recv(65536):
        pass
    print("closed", flush=True)
except (socket.timeout, TimeoutError):
    print("open", flush=True)
except OSError:
    print("closed", flush=True)
"#;

/// A tunnel opened under a grant that is revoked before the client says
/// its TLS hello: the connection's watch starts only with the hello, and
/// still finds the grant ended, so the connection is closed, recorded
/// `grant_expired` (it found no end, and ran on, refusing requests).
#[test]
fn a_grant_revoked_before_the_clients_hello_closes_its_tunnel() {
    let (lab, ca) = start();
    let gid = grant(&lab, r#","ttl":"10m","method":"GET","path":"/api/x""#);
    let (host, port) = PROXY_URL
        .trim_start_matches("http://")
        .rsplit_once(':')
        .unwrap();
    let (child, first) = lab.spawn_client_script(LATE_HELLO, &[host, port, &ca, "0.6"]);
    let mut child = lab::Background(child);
    assert!(first.contains(" 200"), "{first}");
    let (code, body) = admin(&lab, "DELETE", &format!("/v1/grants/{gid}"), None);
    assert_eq!(code, 200, "{body}");
    let last = next_line(&mut child);
    assert_eq!(
        last,
        "closed",
        "a tunnel of a grant revoked before its hello ran on\n{}",
        lab.proxy_output()
    );
    let opened = lab.wait_evidence("the grant's tunnel", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["rule"] == format!("grant:{gid}")
    });
    let cut = lab.wait_evidence("grant_expired", |v| {
        v["reason"] == "grant_expired" && v["conn"] == opened["id"]
    });
    assert_eq!(cut["kind"], "tcp", "{cut}");
}
