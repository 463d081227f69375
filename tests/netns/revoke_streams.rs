//! Revocation of what runs inside a connection: a response still
//! streaming when a reload denies its request. An upstream of our own in
//! the upstream namespace streams a chunked body without end (16 KiB every
//! 20 ms, at most 30 s) to an absolute-form request through the explicit
//! proxy, and to a request inside an intercepted connection. A client in
//! the client namespace reads it and notes, with the wall clock, how many
//! bytes it had at each read and how the stream ended.
//!
//! (a) absolute-form, across a reload that removes its rule;
//! (b) intercepted, across a reload that puts its path under `deny_paths`
//!     (the connection itself stays allowed);
//! (c) an absolute-form request whose body is still going up, across a
//!     reload that removes its rule.
//!
//! Each time: the client stops receiving within the revocation bound (the
//! bytes that still arrived after the reload are measured), the body never
//! ends cleanly (no last chunk), a `policy_revoked` record names the
//! request's own decision record, and its close record follows.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::lab::{self, ca_pem, certs_dir, dump, Background, Lab, ALLOWED_IP, PROXY_ADDR};
use crate::record_id;
use crate::revoke::{reload, served_hash, CLOSED_WITHIN};

const PLAIN_PORT: u16 = 8090;
const TLS_PORT: u16 = 8453;

const PLAIN_RULE: &str = "
[[org.allow]]
id = \"plain\"
host = \"allowed.test\"
ports = [8090]
";

const DENY_PATHS: &str = "deny_paths = [\"/never\"]";

fn policy() -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
{PLAIN_RULE}
[[org.allow]]
id = "intercepted"
host = "allowed.test"
ports = [{TLS_PORT}]
intercept = true
{DENY_PATHS}
"#
    )
}

/// The streaming upstream (stdlib only). Arguments: address, plain port,
/// TLS port, certificate, key, log. Prints "ready" once listening.
/// `/sink` reads a request body as it comes and never answers; it logs
/// what it received, and when, once the connection ends.
const STREAMER: &str = r#"
import json, socket, ssl, sys, threading, time
addr, plain, tls_port, cert, key, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
lock = threading.Lock()
def log(obj):
    with lock:
        with open(path, "a") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")
CHUNK = b"x" * 16384
def serve(conn):
    conn.settimeout(10)
    target, sent, how = None, 0, "complete"
    try:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = conn.recv(65536)
            if not data or len(buf) > 65536:
                return
            buf += data
        target = buf.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")
        log({"event": "request", "path": target})
        if target.startswith("/sink"):
            # Reads the body as it comes, never answers (at most 30 s).
            received = len(buf.split(b"\r\n\r\n", 1)[1])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                data = conn.recv(65536)
                if not data:
                    break
                received += len(data)
            log({"event": "sink", "path": target, "received": received, "at": time.time()})
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conn.sendall(b"4000\r\n" + CHUNK + b"\r\n")
            sent += len(CHUNK)
            time.sleep(0.02)
        conn.sendall(b"0\r\n\r\n")
    except (OSError, ValueError, IndexError) as e:
        how = repr(e)
    finally:
        conn.close()
        if target is not None:
            log({"event": "ended", "path": target, "sent": sent, "how": how})
def listen(port, wrap):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(16)
    def loop():
        while True:
            conn, _ = s.accept()
            def run(conn=conn):
                try:
                    c = wrap(conn)
                except (OSError, ssl.SSLError):
                    conn.close()
                    return
                serve(c)
            threading.Thread(target=run, daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
ctx.set_alpn_protocols(["http/1.1"])
listen(plain, lambda c: c)
listen(tls_port, lambda c: ctx.wrap_socket(c, server_side=True))
print("ready", flush=True)
while True:
    time.sleep(60)
"#;

/// The client: `abs` (an absolute-form GET through the proxy) or `tls` (a
/// GET inside an intercepted connection, trusting CA). Prints "ready" once
/// 64 KiB of the body came, then reads on (at most 15 s after that) and
/// prints one JSON line: how it ended, the wall-clock time of each read
/// with the body bytes so far, and whether the last chunk came.
const CLIENT: &str = r#"
import json, socket, ssl, sys, time
proxy, mode, target, path, ca = sys.argv[1:6]
host, port = proxy.split(":")
s = socket.create_connection((host, int(port)), timeout=8, source_address=("198.18.1.2", 0))
if mode == "tls":
    s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    s = ssl.create_default_context(cafile=ca).wrap_socket(s, server_hostname=target.split(":")[0])
    s.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (path, target)).encode())
else:
    s.sendall(("GET http://%s%s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, path, target)).encode())
buf = b""
while b"\r\n\r\n" not in buf:
    buf += s.recv(65536)
head, _, body = buf.partition(b"\r\n\r\n")
total, tail = len(body), body[-16:]
while total < 65536:
    data = s.recv(65536)
    total += len(data)
    tail = (tail + data)[-16:]
reads, how = [[time.time(), total]], "timeout"
print("ready", flush=True)
deadline = time.monotonic() + 15
s.settimeout(1)
while time.monotonic() < deadline:
    try:
        data = s.recv(65536)
    except socket.timeout:
        continue
    except (OSError, ssl.SSLError) as e:
        how = "error: " + repr(e)
        break
    if not data:
        how = "eof"
        break
    total += len(data)
    tail = (tail + data)[-16:]
    reads.append([time.time(), total])
print(json.dumps({"ended": how, "ended_at": time.time(), "reads": reads,
                  "last_chunk": tail.endswith(b"0\r\n\r\n")}), flush=True)
"#;

/// The uploading client: an absolute-form POST of a chunked body without
/// end (16 KiB every 20 ms) to `target` `path`. Prints "ready" once 64 KiB
/// are sent, then sends on (at most 15 s after that) until the proxy
/// answers or closes, and prints one JSON line: the status of any answer,
/// how it ended, and when.
const UPLOADER: &str = r#"
import json, select, socket, sys, time
proxy, target, path = sys.argv[1:4]
host, port = proxy.split(":")
s = socket.create_connection((host, int(port)), timeout=8, source_address=("198.18.1.2", 0))
s.sendall(("POST http://%s%s HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (target, path, target)).encode())
chunk = b"4000\r\n" + b"u" * 16384 + b"\r\n"
sent, how, answer = 0, "timeout", b""
for _ in range(4):
    s.sendall(chunk)
    sent += 16384
print("ready", flush=True)
deadline = time.monotonic() + 15
while time.monotonic() < deadline:
    readable, _, _ = select.select([s], [], [], 0.02)
    if readable:
        try:
            data = s.recv(65536)
        except OSError as e:
            how = "error: " + repr(e)
            break
        if not data:
            how = "eof"
            break
        answer += data
        if b"\r\n\r\n" in answer:
            how = "answered"
            break
        continue
    try:
        s.sendall(chunk)
        sent += 16384
    except OSError as e:
        how = "error: " + repr(e)
        break
line = answer.split(b"\r\n", 1)[0].decode("latin-1")
print(json.dumps({"ended": how, "ended_at": time.time(), "status_line": line, "answer": answer.decode("latin-1")}), flush=True)
"#;

/// The streaming upstream, killed on drop.
struct Streamer {
    _server: Background,
    log: std::path::PathBuf,
}

struct Setup {
    lab: Lab,
    streamer: Streamer,
    org_ca: std::path::PathBuf,
}

fn start() -> Setup {
    let ca_dir = lab::scratch_dir("revoke-streams").join("ca");
    let mut lab = Lab::builder()
        .policy(&policy())
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .without_proxy()
        .start();
    let log = lab.dir.join("streamer.log");
    let certs = certs_dir();
    let (plain, tls) = (PLAIN_PORT.to_string(), TLS_PORT.to_string());
    let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
    let args: [&std::ffi::OsStr; 8] = [
        "-c".as_ref(),
        STREAMER.as_ref(),
        ALLOWED_IP.as_ref(),
        plain.as_ref(),
        tls.as_ref(),
        cert.as_ref(),
        key.as_ref(),
        log.as_ref(),
    ];
    let server = lab.spawn_upstream_server("the streaming upstream", "python3", args);
    let streamer = Streamer {
        _server: server,
        log,
    };
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    Setup {
        lab,
        streamer,
        org_ca: ca_dir.join("acme.pem"),
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Stream `path` (`mode` `abs` or `tls`) across the reload `edit`; then
/// check the stream was cut within the bound, and return the revocation
/// record of the request.
fn stream_across(s: &Setup, mode: &str, port: u16, edit: impl FnOnce(String) -> String) -> Value {
    let lab = &s.lab;
    let path = format!("/stream/{mode}");
    let target = format!("allowed.test:{port}");
    let ca = s.org_ca.display().to_string();
    let (child, line) = lab.spawn_client_script(CLIENT, &[PROXY_ADDR, mode, &target, &path, &ca]);
    // The client ends by itself: every wait of it is bounded.
    assert_eq!(line, "ready", "{}", lab.proxy_output());
    let decision = lab.wait_evidence(&format!("decision of {path}"), |v| {
        v["event"] == "decision" && v["kind"] == "http" && v["path"] == path.as_str()
    });
    assert_eq!(decision["decision"], "allow", "{decision}");
    let id = record_id(&decision).unwrap();

    // From the moment the reload is asked for (it is served a little later).
    let reloaded = now();
    reload(lab, edit);
    let after = served_hash(lab);
    let out = child.wait_with_output().expect("client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("client output {e}: {stdout}"));
    let reads = v["reads"].as_array().expect("reads");
    let at = |r: &Value| (r[0].as_f64().unwrap(), r[1].as_u64().unwrap());
    let total = reads.last().map_or(0, |r| at(r).1);
    let at_reload = reads
        .iter()
        .map(at)
        .take_while(|&(t, _)| t <= reloaded)
        .last()
        .map_or(0, |(_, n)| n);
    let ended_after = v["ended_at"].as_f64().unwrap() - reloaded;
    eprintln!(
        "{mode}: {total} body bytes, {} after the reload; the stream ended {ended_after:.2} s \
         after it ({})",
        total - at_reload,
        v["ended"]
    );
    assert_ne!(
        v["ended"],
        "timeout",
        "{mode}: still streaming 15 s later ({} bytes after the reload)\n{}",
        total - at_reload,
        dump(&s.streamer_log())
    );
    assert!(
        ended_after < CLOSED_WITHIN.as_secs_f64(),
        "{mode}: ended {ended_after:.2} s after the reload"
    );
    assert_eq!(
        v["last_chunk"], false,
        "{mode}: the body ended cleanly: {v}"
    );

    let revoked = lab.wait_evidence(&format!("revocation of {path}"), |v| {
        v["event"] == "decision" && v["conn"] == id.as_str() && v["reason"] == "policy_revoked"
    });
    assert_eq!(
        (&revoked["decision"], &revoked["kind"], &revoked["org"]),
        (
            &Value::from("deny"),
            &Value::from("http"),
            &Value::from("acme")
        ),
        "{revoked}"
    );
    assert_eq!(revoked["policy"], after.as_str(), "{revoked}");
    assert_eq!(revoked["path"], path.as_str(), "{revoked}");
    lab.wait_evidence(&format!("close of {path}"), |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    // The upstream saw its stream cut, not finished.
    lab::wait_until(
        "the upstream's stream ended",
        Duration::from_secs(5),
        || {
            s.streamer_log()
                .iter()
                .any(|e| e["event"] == "ended" && e["path"] == path.as_str())
        },
    );
    let ended = s
        .streamer_log()
        .into_iter()
        .find(|e| e["event"] == "ended" && e["path"] == path.as_str())
        .unwrap();
    assert_ne!(ended["how"], "complete", "{ended}");
    revoked
}

impl Setup {
    fn streamer_log(&self) -> Vec<Value> {
        lab::read_jsonl(&self.streamer.log)
    }
}

/// (a) An absolute-form request whose response is streaming when a reload
/// removes its rule.
#[test]
fn an_absolute_form_streaming_response_is_cut_when_its_rule_goes() {
    let s = start();
    let revoked = stream_across(&s, "abs", PLAIN_PORT, |t| t.replace(PLAIN_RULE, ""));
    // allowed.test keeps a rule, for another port.
    assert_eq!(revoked["detail"], "now port_not_allowed", "{revoked}");
    assert_eq!(revoked["mode"], "explicit", "{revoked}");
}

/// (b) A request inside an intercepted connection whose response is
/// streaming when a reload puts its path under `deny_paths`: the request
/// is cut, while the connection itself is not revoked.
#[test]
fn an_intercepted_streaming_response_is_cut_when_its_path_is_denied() {
    let s = start();
    let revoked = stream_across(&s, "tls", TLS_PORT, |t| {
        t.replace(DENY_PATHS, "deny_paths = [\"/never\", \"/stream\"]")
    });
    let detail = revoked["detail"].as_str().unwrap_or_default();
    assert!(detail.starts_with("now path_not_allowed"), "{revoked}");
    let lab = &s.lab;
    let conn = lab.wait_evidence("the intercepted connection", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["intercepted"] == true
    });
    let conn = record_id(&conn).unwrap();
    assert!(
        !lab.evidence()
            .iter()
            .any(|v| v["conn"] == conn.as_str() && v["reason"] == "policy_revoked"),
        "{}",
        dump(&lab.evidence())
    );
}

/// (c) An absolute-form request whose body is still going up (the
/// upstream has not answered) when a reload removes its rule: the upload
/// stops at once (the upstream's connection ends), and the client is
/// answered 403 `policy_revoked`.
#[test]
fn an_absolute_form_upload_is_cut_when_its_rule_goes() {
    let s = start();
    let lab = &s.lab;
    let target = format!("allowed.test:{PLAIN_PORT}");
    let (child, line) = lab.spawn_client_script(UPLOADER, &[PROXY_ADDR, &target, "/sink"]);
    assert_eq!(line, "ready", "{}", lab.proxy_output());
    let decision = lab.wait_evidence("decision of /sink", |v| {
        v["event"] == "decision" && v["kind"] == "http" && v["path"] == "/sink"
    });
    let id = record_id(&decision).unwrap();
    let reloaded = now();
    reload(lab, |t| t.replace(PLAIN_RULE, ""));
    let out = child.wait_with_output().expect("uploader");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("uploader output {e}: {stdout}"));
    let ended_after = v["ended_at"].as_f64().unwrap() - reloaded;
    lab::wait_until("the upstream's sink ended", Duration::from_secs(20), || {
        s.streamer_log().iter().any(|e| e["event"] == "sink")
    });
    let sink = s
        .streamer_log()
        .into_iter()
        .find(|e| e["event"] == "sink")
        .unwrap();
    let sink_after = sink["at"].as_f64().unwrap() - reloaded;
    eprintln!(
        "upload: answered {:?} {ended_after:.2} s after the reload; the upstream received {} \
         bytes, its connection ended {sink_after:.2} s after the reload",
        v["status_line"], sink["received"]
    );
    assert_eq!(v["ended"], "answered", "{v}");
    assert!(
        v["status_line"]
            .as_str()
            .unwrap_or_default()
            .contains(" 403"),
        "{v}"
    );
    assert!(
        v["answer"]
            .as_str()
            .unwrap_or_default()
            .contains("policy_revoked"),
        "{v}"
    );
    assert!(
        sink_after < CLOSED_WITHIN.as_secs_f64(),
        "the upload went on {sink_after:.2} s after the reload: {sink}"
    );
    let revoked = lab.wait_evidence("revocation of /sink", |v| {
        v["event"] == "decision" && v["conn"] == id.as_str() && v["reason"] == "policy_revoked"
    });
    assert_eq!(revoked["decision"], "deny", "{revoked}");
    let close = lab.wait_evidence("close of /sink", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(close["detail"], "revoked before the response", "{close}");
}
