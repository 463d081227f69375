//! WebSocket under interception (`websocket = true` on an intercepting
//! rule), with real clients: python3-websockets over HTTP/1.1 and an
//! HTTP/2 extended CONNECT (RFC 8441) from python3-h2 whose frames
//! python3-websockets builds and parses (tests/fixtures/ws_client.py),
//! against a python3-websockets echo server over TLS in the upstream
//! namespace (tests/fixtures/ws_echo.py), whose log is the witness.

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::lab::{
    ca_pem, certs_dir, dump, fixtures_dir, read_jsonl, scratch_dir, wait_until, Background, Lab,
    ALLOWED_IP, PROXY_ADDR, PROXY_URL,
};
use crate::record_id;
use crate::revoke::CLOSED_WITHIN;

/// Where the echo server listens: `websocket = true`, and not.
const WS_PORT: u16 = 8443;
const NO_WS_PORT: u16 = 8444;
const SECRET: &str = "ws-s3cr3t-5e1b77";

/// Debian's Python, where python3-websockets and python3-h2 are installed.
const PYTHON: &str = "/usr/bin/python3";

fn policy(secret_file: &std::path::Path) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "ws"
host = "allowed.test"
ports = [{WS_PORT}]
intercept = true
websocket = true
deny_paths = ["/ws/internal"]

[[org.allow]]
id = "no-ws"
host = "allowed.test"
ports = [{NO_WS_PORT}]
intercept = true

[[org.credential]]
id = "ws-token"
host = "allowed.test"
header = "Authorization"
prefix = "Bearer "
secret_file = {secret_file:?}
"#
    )
}

/// The echo server, killed on drop.
struct Echo {
    _server: Background,
    log: PathBuf,
}

impl Echo {
    fn log(&self) -> Vec<Value> {
        read_jsonl(&self.log)
    }

    /// Request heads it received for `path`.
    fn requests(&self, path: &str) -> Vec<Value> {
        self.log()
            .into_iter()
            .filter(|v| v["event"] == "request" && v["path"] == path)
            .collect()
    }
}

struct Setup {
    lab: Lab,
    echo: Echo,
    org_ca: PathBuf,
}

fn start() -> Setup {
    let dir = scratch_dir("websocket");
    let secret = dir.join("ws.token");
    fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let ca_dir = dir.join("ca");
    let mut lab = Lab::builder()
        .policy(&policy(&secret))
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .without_proxy()
        .start();
    let log = lab.dir.join("ws-echo.log");
    let certs = certs_dir();
    let (ws, no_ws) = (WS_PORT.to_string(), NO_WS_PORT.to_string());
    let script = fixtures_dir().join("ws_echo.py");
    let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
    let args: [&std::ffi::OsStr; 13] = [
        script.as_ref(),
        "--addr".as_ref(),
        ALLOWED_IP.as_ref(),
        "--port".as_ref(),
        ws.as_ref(),
        "--port".as_ref(),
        no_ws.as_ref(),
        "--cert".as_ref(),
        cert.as_ref(),
        "--key".as_ref(),
        key.as_ref(),
        "--log".as_ref(),
        log.as_ref(),
    ];
    let server = lab.spawn_upstream_server("the WebSocket echo server", PYTHON, args);
    let echo = Echo {
        _server: server,
        log,
    };
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    let org_ca = ca_dir.join("acme.pem");
    assert!(org_ca.exists(), "the org CA was created");
    Setup { lab, echo, org_ca }
}

/// The WebSocket client's command line (`h1` or `h2`, to allowed.test:`port`).
fn client_args(s: &Setup, mode: &str, port: u16, path: &str, extra: &[&str]) -> Vec<String> {
    let script = fixtures_dir().join("ws_client.py").display().to_string();
    let ca = s.org_ca.display().to_string();
    let mut args: Vec<String> = vec![script, mode.into(), "--proxy".into(), PROXY_ADDR.into()];
    args.extend(["--host".into(), "allowed.test".into()]);
    args.extend([
        "--port".into(),
        port.to_string(),
        "--path".into(),
        path.into(),
    ]);
    args.extend(["--ca".into(), ca]);
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// Run the WebSocket client (`h1` or `h2`) in the client namespace.
fn client(s: &Setup, mode: &str, port: u16, path: &str, extra: &[&str]) -> Value {
    let args = client_args(s, mode, port, path, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = s.lab.client_exec(PYTHON, &args);
    let line = out.stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("client output {e}: {}", out.describe()))
}

fn header<'a>(v: &'a Value, name: &str) -> Vec<&'a str> {
    v["headers"]
        .as_array()
        .map(|hs| {
            hs.iter()
                .filter(|h| h[0] == name)
                .filter_map(|h| h[1].as_str())
                .collect()
        })
        .unwrap_or_default()
}

/// The handshake's decision record for `path`, and its close record.
fn records(lab: &Lab, path: &str) -> (Value, Value) {
    let decision = lab.wait_evidence(&format!("decision of {path}"), |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == path
    });
    let id = record_id(&decision).unwrap();
    let close = lab.wait_evidence(&format!("close of {path}"), |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    (decision, close)
}

/// With `websocket = true`: frames relayed both ways over HTTP/1.1 and
/// over an HTTP/2 extended CONNECT, the credential on the handshake only,
/// the close record counting both directions; a handshake under
/// `deny_paths` refused, without a credential, never reaching the
/// upstream.
#[test]
fn websocket_is_decided_then_relayed_both_ways_over_http1_and_http2() {
    let s = start();
    let lab = &s.lab;
    const BIG: usize = 200_000;
    let big = BIG.to_string();

    // HTTP/1.1: the library's own handshake and frames.
    let got = client(
        &s,
        "h1",
        WS_PORT,
        "/ws/echo-h1",
        &[
            "--message",
            "hello",
            "--message",
            "again",
            "--binary-size",
            &big,
        ],
    );
    assert_eq!(got["error"], Value::Null, "{got}\n{}", lab.proxy_output());
    assert_eq!(got["status"], 101, "{got}");
    assert_eq!(
        got["echoed"],
        serde_json::json!(["hello", "again"]),
        "{got}"
    );
    assert_eq!(got["binary_echoed"], BIG, "{got}");
    let seen = s.echo.requests("/ws/echo-h1");
    assert_eq!(seen.len(), 1, "{}", dump(&s.echo.log()));
    assert_eq!(
        header(&seen[0], "authorization"),
        [format!("Bearer {SECRET}")],
        "the upstream got the credential on the handshake: {}",
        seen[0]
    );
    assert_eq!(header(&seen[0], "upgrade"), ["websocket"], "{}", seen[0]);
    let (decision, close) = records(lab, "/ws/echo-h1");
    assert_eq!(decision["decision"], "allow", "{decision}");
    assert_eq!(decision["rule"], "ws", "{decision}");
    assert_eq!(decision["credential"], "ws-token", "{decision}");
    assert!(
        decision["detail"]
            .as_str()
            .is_some_and(|d| d.contains("WebSocket (HTTP/1.1 upgrade)")),
        "{decision}"
    );
    assert_eq!(close["status"], 101, "{close}");
    // Both directions, frames and all: at least the payloads.
    for dir in ["bytes_up", "bytes_down"] {
        let n = close[dir].as_u64().unwrap_or(0);
        assert!(n > (BIG + 10) as u64, "{dir}: {close}");
    }
    let evidence = serde_json::to_string(&lab.evidence()).unwrap();
    assert!(!evidence.contains(SECRET), "the secret is never recorded");

    // HTTP/2 extended CONNECT (RFC 8441): the same, translated upstream,
    // a message past the client's initial 64 KiB window included.
    const H2_BIG: usize = 200_000;
    let h2_big = H2_BIG.to_string();
    let got = client(
        &s,
        "h2",
        WS_PORT,
        "/ws/echo-h2",
        &["--message", "over-h2", "--binary-size", &h2_big],
    );
    assert_eq!(got["error"], Value::Null, "{got}\n{}", lab.proxy_output());
    assert_eq!(got["settings_connect_protocol"], true, "{got}");
    assert_eq!(got["status"], 200, "{got}");
    assert_eq!(got["echoed"], serde_json::json!(["over-h2"]), "{got}");
    assert_eq!(got["binary_echoed"], H2_BIG, "{got}");
    let seen = s.echo.requests("/ws/echo-h2");
    assert_eq!(seen.len(), 1, "{}", dump(&s.echo.log()));
    assert_eq!(
        header(&seen[0], "authorization"),
        [format!("Bearer {SECRET}")],
        "{}",
        seen[0]
    );
    let (decision, close) = records(lab, "/ws/echo-h2");
    assert_eq!(decision["decision"], "allow", "{decision}");
    assert!(
        decision["detail"]
            .as_str()
            .is_some_and(|d| d.contains("HTTP/2 extended CONNECT")),
        "{decision}"
    );
    assert_eq!(close["status"], 200, "{close}");
    for dir in ["bytes_up", "bytes_down"] {
        let n = close[dir].as_u64().unwrap_or(0);
        assert!(n > H2_BIG as u64, "{dir}: {close}");
    }

    // Under deny_paths: refused, no credential, never upstream.
    for (mode, path) in [("h1", "/ws/internal"), ("h2", "/WS/Internal/x")] {
        let got = client(&s, mode, WS_PORT, path, &["--message", "x"]);
        assert_eq!(got["status"], 403, "{mode} {path}: {got}");
        let rec = lab.wait_evidence(&format!("deny {path}"), |v| {
            v["kind"] == "http"
                && v["decision"] == "deny"
                && v["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains(&format!(" {path} refused")))
        });
        assert_eq!(rec["reason"], "path_not_allowed", "{rec}");
        assert!(rec["credential"].is_null(), "{rec}");
        assert!(s.echo.requests(path).is_empty(), "{}", dump(&s.echo.log()));
    }
    // The upstream never saw a denied path in any spelling.
    assert!(
        s.echo.log().iter().all(|v| !v["path"]
            .as_str()
            .unwrap_or("")
            .to_ascii_lowercase()
            .contains("internal")),
        "{}",
        dump(&s.echo.log())
    );
}

/// Without `websocket = true`: an immediate 403 `upgrade_not_allowed` with
/// the record reference (never a hang, never `bad_request`), over HTTP/1.1
/// and HTTP/2, and the upstream never sees the upgrade; another
/// `:protocol` (`connect-udp`) is refused too, even where WebSocket is
/// allowed.
#[test]
fn websocket_off_is_refused_at_once_and_other_protocols_always() {
    let s = start();
    let lab = &s.lab;
    for mode in ["h1", "h2"] {
        let path = format!("/ws/off-{mode}");
        let got = client(&s, mode, NO_WS_PORT, &path, &["--message", "x"]);
        assert_eq!(got["status"], 403, "{mode}: {got}\n{}", lab.proxy_output());
        let rec = lab.wait_evidence(&format!("deny {path}"), |v| {
            v["kind"] == "http" && v["decision"] == "deny" && v["path"] == path.as_str()
        });
        assert_eq!(rec["reason"], "upgrade_not_allowed", "{rec}");
        assert_eq!(rec["rule"], "no-ws", "{rec}");
        assert!(rec["credential"].is_null(), "{rec}");
    }
    // The body and Proxy-Status name the reason and the record (curl's own
    // upgrade request; it does not wait for an upgrade that is refused).
    let ca = s.org_ca.display().to_string();
    let url = format!("https://allowed.test:{NO_WS_PORT}/ws/off-curl");
    let resp = lab.client_curl(&[
        "-x",
        PROXY_URL,
        "--cacert",
        &ca,
        "--http1.1",
        "-H",
        "Connection: Upgrade",
        "-H",
        "Upgrade: websocket",
        "-H",
        "Sec-WebSocket-Version: 13",
        "-H",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        &url,
    ]);
    crate::assert_refused(lab, &resp, 403, "upgrade_not_allowed", "websocket off");
    let off: Vec<Value> = s
        .echo
        .log()
        .into_iter()
        .filter(|v| v["path"].as_str().is_some_and(|p| p.starts_with("/ws/off")))
        .collect();
    assert!(
        off.is_empty(),
        "the upstream saw the upgrade: {}",
        dump(&off)
    );

    // Another protocol: refused, documented reason, whatever the rule.
    let h2c = lab.client_curl(&[
        "-x",
        PROXY_URL,
        "--cacert",
        &ca,
        "--http1.1",
        "-H",
        "Connection: Upgrade",
        "-H",
        "Upgrade: h2c",
        &format!("https://allowed.test:{WS_PORT}/ws/h2c"),
    ]);
    crate::assert_refused(lab, &h2c, 403, "upgrade_not_allowed", "h2c upgrade");
    assert!(s.echo.requests("/ws/h2c").is_empty());
    let udp = client(&s, "h2", WS_PORT, "/ws/udp", &["--protocol", "connect-udp"]);
    assert_eq!(udp["status"], 403, "{udp}");
    let rec = lab.wait_evidence("deny connect-udp", |v| {
        v["kind"] == "http" && v["decision"] == "deny" && v["path"] == "/ws/udp"
    });
    assert_eq!(rec["reason"], "upgrade_not_allowed", "{rec}");
    assert!(
        rec["detail"]
            .as_str()
            .is_some_and(|d| d.contains("connect-udp")),
        "{rec}"
    );
    assert!(s.echo.requests("/ws/udp").is_empty());
}

/// A WebSocket over HTTP/1.1 on `path`, relaying, across the reload
/// `edit` of the config: once `revoked` finds the revocation record (given
/// the ids of the connection's and the handshake's decision records), the
/// message sent after the reload gets no echo, and the upstream saw only
/// the one before. Returns the revocation record.
fn relay_across(
    s: &Setup,
    path: &str,
    edit: impl FnOnce(String) -> String,
    revoked: impl Fn(&Value, &str, &str) -> bool,
) -> Value {
    let lab = &s.lab;
    let go = scratch_dir("ws-revoke").join("go");
    let go_arg = go.display().to_string();
    let then = [
        "--message",
        "before",
        "--then-after",
        &go_arg,
        "--then",
        "after-reload",
    ];
    let args = client_args(s, "h1", WS_PORT, path, &then);
    let mut child = Command::new("ip")
        .args(["netns", "exec", &lab.ns_client, PYTHON])
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the WebSocket client");
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(&mut out, &mut line);
    assert!(line.contains("\"ready\""), "client: {line}");
    let tcp = lab.wait_evidence("the intercepted connection", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["port"] == WS_PORT
    });
    let conn = record_id(&tcp).unwrap();
    let handshake = lab.wait_evidence("the handshake", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == path
    });
    let handshake = record_id(&handshake).unwrap();

    let before = fs::read_to_string(&lab.config_path).unwrap();
    let tmp = lab.config_path.with_extension("new");
    let changed = edit(before.clone());
    assert_ne!(changed, before, "the edit changed nothing");
    fs::write(&tmp, changed).unwrap();
    fs::rename(&tmp, &lab.config_path).unwrap();
    let asked = std::time::Instant::now();
    lab.signal_proxy("-HUP");
    let revocation = lab.wait_evidence("the revocation", |v| {
        v["event"] == "decision" && revoked(v, &conn, &handshake)
    });
    assert_eq!(revocation["reason"], "policy_revoked", "{revocation}");
    assert_eq!(revocation["decision"], "deny", "{revocation}");
    // The stream is closed at the upstream too, within the bound.
    wait_until("the upstream's stream closed", CLOSED_WITHIN, || {
        s.echo
            .log()
            .iter()
            .any(|e| e["event"] == "closed" && e["path"] == path)
    });
    eprintln!(
        "{path}: closed {:.2} s after the reload was asked",
        asked.elapsed().as_secs_f64()
    );
    fs::write(&go, "").unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    let _ = child.wait();
    let v: Value = serde_json::from_str(rest.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("client output {e}: {rest}"));
    assert_eq!(v["echoed"], serde_json::json!(["before"]), "{v}");
    assert_eq!(v["then_echoed"], false, "{v}");
    let closed: Vec<Value> = s
        .echo
        .log()
        .into_iter()
        .filter(|e| e["event"] == "closed" && e["path"] == path)
        .collect();
    assert!(
        closed.iter().all(|e| e["messages"] == 1),
        "{}",
        dump(&closed)
    );
    // The handshake's close record follows, counting what did flow.
    lab.wait_evidence("the handshake's close", |v| {
        v["event"] == "close" && v["conn"] == handshake.as_str()
    });
    revocation
}

/// The rule `ws` of the policy, as written.
const WS_RULE_HEAD: &str = "id = \"ws\"\nhost = \"allowed.test\"\nports = [8443]";

/// A WebSocket relaying when a reload takes its rule away: the connection
/// and the stream it carries are both denied by the new policy, and both
/// are watched; whichever watch sees the reload first cuts the relay and
/// records `policy_revoked` on its own record (the connection's, or the
/// handshake's), and the other then has nothing left to cut.
#[test]
fn a_relaying_websocket_is_closed_when_a_reload_revokes_its_rule() {
    let s = start();
    let r = relay_across(
        &s,
        "/ws/revoked",
        |t| {
            // Its port goes from the rule: allowed.test:8443 is no longer allowed.
            assert!(t.contains(WS_RULE_HEAD), "{t}");
            t.replace(WS_RULE_HEAD, &WS_RULE_HEAD.replace("8443", "9443"))
        },
        |v, conn, handshake| (v["kind"] == "tcp" && v["conn"] == conn) || v["conn"] == handshake,
    );
    let detail = r["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("port_not_allowed"), "{r}");
}

/// A WebSocket relaying when a reload puts its path under `deny_paths`:
/// the connection stays allowed, the stream itself is revoked (a record
/// naming the handshake's decision record) and cut.
#[test]
fn a_relaying_websocket_is_closed_when_a_reload_denies_its_path() {
    let s = start();
    let r = relay_across(
        &s,
        "/ws/then-denied",
        |t| {
            t.replace(
                "deny_paths = [\"/ws/internal\"]",
                "deny_paths = [\"/ws/internal\", \"/ws/then-denied\"]",
            )
        },
        |v, _, handshake| v["conn"] == handshake,
    );
    assert_eq!(r["kind"], "http", "{r}");
    assert_eq!(r["path"], "/ws/then-denied", "{r}");
    let detail = r["detail"].as_str().unwrap_or_default();
    assert!(detail.starts_with("now path_not_allowed"), "{r}");
    no_connection_revoked(&s.lab);
}

/// A WebSocket relaying when a reload removes `websocket = true` from its
/// rule: the stream is revoked and cut, the connection stays allowed.
#[test]
fn a_relaying_websocket_is_closed_when_a_reload_turns_websocket_off() {
    let s = start();
    let r = relay_across(
        &s,
        "/ws/then-off",
        |t| {
            let on = format!("{WS_RULE_HEAD}\nintercept = true\nwebsocket = true\n");
            assert!(t.contains(&on), "{t}");
            t.replace(&on, &on.replace("websocket = true\n", ""))
        },
        |v, _, handshake| v["conn"] == handshake,
    );
    assert_eq!(r["kind"], "http", "{r}");
    assert_eq!(r["detail"], "rule ws no longer has websocket = true", "{r}");
    no_connection_revoked(&s.lab);
}

/// No intercepted connection was revoked.
fn no_connection_revoked(lab: &Lab) {
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["kind"] == "tcp" && v["reason"] == "policy_revoked"),
        "{}",
        dump(&lab.evidence())
    );
}
