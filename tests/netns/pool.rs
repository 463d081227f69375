//! Upstream connection reuse for absolute-form HTTP, through real sockets:
//! an upstream of our own in the upstream namespace (allowed.test:8080)
//! that logs every connection it accepts and every request by connection,
//! and answers by path: keep-alive by default, `Connection: close` for
//! `/close`, and for `/idle-close` keep-alive, then closes the idle
//! connection a moment later (and says so in its log); after
//! `/drop-next`, it reads the next request on that connection and closes
//! it without an answer (the race of an upstream closing a kept-alive
//! connection just as a request is sent); `/early` is answered at once
//! and its body never read (what follows its head is the next request);
//! `/unread` is answered once its whole body has arrived, and that body is
//! never read either. Like any HTTP/1.1 server it stops after answering a
//! request marked `Connection: close`.
//!
//! (a) keep-alive requests of one org, over several client connections,
//!     ride one upstream connection;
//! (b) two orgs to the same host never share one;
//! (c) a connection the upstream marked close, or closed while idle, is
//!     not reused, and the next request succeeds on a new connection;
//! (d) every pooled request has its own decision record and its own close
//!     record with the exact bytes;
//! (e) a request lost with a pooled connection is sent again over a new
//!     one when that is safe (idempotent, no body), else answered 502;
//! (f) an idle connection is closed by Palisade after
//!     `upstream_idle_timeout`;
//! (g) a request head planted in a body, behind an upstream that answered
//!     early, or after the whole body yet never read it, never reaches
//!     it, and the next request gets its own response on its own
//!     connection.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use crate::lab::*;
use crate::record_id;

pub(crate) const PORT: u16 = 8080;
/// The same upstream over TLS, intercepted (see [`INTERCEPTED`]).
const TLS_PORT: u16 = 8443;

/// Two orgs, both allowed to allowed.test:8080: acme (the client
/// namespace) and beta (the second client namespace).
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [8080]

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [8080]
"#;

/// The counting upstream (stdlib only). Arguments: address, port, log,
/// then the TLS port, certificate and key of the same server over TLS.
/// Prints "ready" once listening. Every socket wait is bounded (10 s), and
/// so are heads (64 KiB), bodies (1 MiB) and requests per connection (1000).
const UPSTREAM: &str = r#"
import json, socket, ssl, sys, threading, time
addr, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lock = threading.Lock()
ids = [0]
def log(obj):
    with lock:
        with open(path, "a") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")
def serve(conn, cid):
    conn.settimeout(10)
    buf = b""
    drop_next = False
    try:
        for n in range(1000):
            while b"\r\n\r\n" not in buf:
                if len(buf) > 65536:
                    return
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            length = 0
            asked_close = False
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = min(int(v.strip()), 1 << 20)
                if k.strip().lower() == "connection" and "close" in v.lower():
                    asked_close = True
            if target.startswith("/early"):
                # Answers before reading the body, and reads no body: what
                # follows the head is read as the next request.
                length = 0
            if target.startswith("/unread"):
                # Answers only once the whole body has arrived, yet never
                # reads it as a body: it is read as the next request.
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                length = 0
            while len(buf) < length:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            buf = buf[length:]
            log({"event": "request", "id": cid, "n": n, "path": target, "close": asked_close})
            if drop_next:
                log({"event": "dropped", "id": cid, "path": target})
                return
            drop_next = target.startswith("/drop-next")
            body = ("conn=%d n=%d path=%s\n" % (cid, n, target)).encode()
            # Like every HTTP/1.1 server: a request marked close is the last.
            close = target.startswith("/close") or asked_close
            head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(body)
            head += "Connection: close\r\n\r\n" if close else "\r\n"
            conn.sendall(head.encode() + body)
            if close:
                return
            if target.startswith("/idle-close"):
                time.sleep(0.2)
                return
    except (OSError, ValueError, IndexError) as e:
        log({"event": "error", "id": cid, "error": repr(e)})
    finally:
        conn.close()
        log({"event": "closed", "id": cid})
def listen(port, wrap):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(128)
    def accept():
        while True:
            conn, peer = s.accept()
            with lock:
                ids[0] += 1
                cid = ids[0]
            log({"event": "open", "id": cid, "peer": "%s:%d" % peer})
            def run(conn=conn, cid=cid):
                try:
                    conn = wrap(conn)
                except (OSError, ssl.SSLError) as e:
                    log({"event": "error", "id": cid, "error": repr(e)})
                    conn.close()
                    return
                serve(conn, cid)
            threading.Thread(target=run, daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
listen(port, lambda c: c)
if len(sys.argv) > 4:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[5], sys.argv[6])
    ctx.set_alpn_protocols(["http/1.1"])
    listen(int(sys.argv[4]), lambda c: ctx.wrap_socket(c, server_side=True))
print("ready", flush=True)
while True:
    time.sleep(60)
"#;

/// The counting upstream, killed on drop.
pub(crate) struct Upstream {
    _server: Background,
    log: std::path::PathBuf,
}

impl Upstream {
    fn start(lab: &Lab) -> Upstream {
        let log = lab.dir.join("pool-upstream.log");
        let (port, tls_port) = (PORT.to_string(), TLS_PORT.to_string());
        let certs = certs_dir();
        let (cert, key) = (certs.join("server.pem"), certs.join("server.key"));
        let args = [
            std::ffi::OsStr::new("-c"),
            UPSTREAM.as_ref(),
            ALLOWED_IP.as_ref(),
            port.as_ref(),
            log.as_os_str(),
            tls_port.as_ref(),
            cert.as_ref(),
            key.as_ref(),
        ];
        let server = lab.spawn_upstream_server("the counting upstream", "python3", args);
        Upstream {
            _server: server,
            log,
        }
    }

    pub(crate) fn log(&self) -> Vec<Value> {
        read_jsonl(&self.log)
    }

    /// Connections accepted so far.
    pub(crate) fn opens(&self) -> usize {
        self.log().iter().filter(|v| v["event"] == "open").count()
    }

    /// The connection each request path arrived on (a path occurs once).
    pub(crate) fn conn_of(&self, path: &str) -> u64 {
        let log = self.log();
        let hits: Vec<&Value> = log
            .iter()
            .filter(|v| v["event"] == "request" && v["path"] == path)
            .collect();
        assert_eq!(hits.len(), 1, "request {path} upstream: {}", dump(&log));
        hits[0]["id"].as_u64().expect("connection id")
    }

    /// Wait until the upstream logs that connection `id` is closed.
    fn wait_closed(&self, id: u64) {
        wait_until(
            &format!("upstream connection {id} closed"),
            Duration::from_secs(10),
            || {
                self.log()
                    .iter()
                    .any(|v| v["event"] == "closed" && v["id"] == id)
            },
        );
    }
}

fn lab() -> (Lab, Upstream) {
    lab_with(&[])
}

/// The lab with extra `[proxy]` lines.
pub(crate) fn lab_with(options: &[&str]) -> (Lab, Upstream) {
    let mut builder = Lab::builder().policy(POLICY).second_client();
    for line in options {
        builder = builder.proxy_option(line);
    }
    lab_of(builder)
}

/// The lab `builder` makes, with the counting upstream.
fn lab_of(builder: LabBuilder) -> (Lab, Upstream) {
    // The lab's own fixtures start first; ours binds port 8080 beside them.
    let mut lab = builder.without_proxy().start();
    let up = Upstream::start(&lab);
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    (lab, up)
}

pub(crate) fn url(path: &str) -> String {
    format!("http://allowed.test:{PORT}{path}")
}

/// A keep-alive absolute-form GET of `path` on `c`; the response body.
pub(crate) fn get(lab: &Lab, c: &mut RawConn, path: &str) -> String {
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n",
        url(path)
    );
    c.send(req.as_bytes()).expect("send request");
    let resp = c.read_response(Duration::from_secs(10));
    assert_eq!(
        resp.status,
        200,
        "GET {path}: {resp:?}\n{}",
        lab.proxy_output()
    );
    assert!(resp.body.contains(&format!("path={path}")), "{resp:?}");
    resp.body
}

/// GET `path` through the proxy from the second org's namespace (curl, a
/// new client connection each time).
fn get_as_beta(lab: &Lab, path: &str) -> String {
    let resp = lab.curl_in(&lab.ns_client2, &["-x", PROXY_URL, &url(path)]);
    assert_eq!(
        resp.status,
        200,
        "beta GET {path}: {resp:?}\n{}",
        lab.proxy_output()
    );
    resp.body
}

/// `name value` of a metric without labels, from the admin listener.
fn metric(lab: &Lab, name: &str) -> f64 {
    let out = lab.proxy_ns_exec(
        "curl",
        &[
            "-q",
            "-s",
            "--max-time",
            "5",
            &format!("http://{ADMIN_ADDR}/metrics"),
        ],
    );
    out.stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{}", out.stdout))
}

#[test]
fn keep_alive_requests_of_one_org_ride_one_upstream_connection() {
    let (lab, up) = lab();
    // Two client connections of the same org, taking turns, one request
    // at a time: after the first, every request finds the connection idle.
    let mut c1 = lab.client_conn();
    let mut c2 = lab.client_conn();
    for i in 0..3 {
        get(&lab, &mut c1, &format!("/a/c1/{i}"));
        get(&lab, &mut c2, &format!("/a/c2/{i}"));
    }
    let first = up.conn_of("/a/c1/0");
    for i in 0..3 {
        for c in ["c1", "c2"] {
            let path = format!("/a/{c}/{i}");
            assert_eq!(up.conn_of(&path), first, "{path}: {}", dump(&up.log()));
        }
    }
    assert_eq!(up.opens(), 1, "{}", dump(&up.log()));
    assert_eq!(metric(&lab, "palisade_upstream_reused_total"), 5.0);
    assert_eq!(metric(&lab, "palisade_upstream_idle_connections"), 1.0);
}

#[test]
fn two_orgs_never_share_an_upstream_connection() {
    let (lab, up) = lab();
    let mut c = lab.client_conn();
    get(&lab, &mut c, "/b/acme/0");
    get_as_beta(&lab, "/b/beta/0");
    get(&lab, &mut c, "/b/acme/1");
    get_as_beta(&lab, "/b/beta/1");
    get_as_beta(&lab, "/b/beta/2");
    get(&lab, &mut c, "/b/acme/2");
    let conns = |org: &str| -> BTreeSet<u64> {
        (0..3)
            .map(|i| up.conn_of(&format!("/b/{org}/{i}")))
            .collect()
    };
    let (acme, beta) = (conns("acme"), conns("beta"));
    assert!(
        acme.is_disjoint(&beta),
        "acme {acme:?} and beta {beta:?} shared a connection: {}",
        dump(&up.log())
    );
    // Each org still reused its own.
    assert_eq!(acme.len(), 1, "{}", dump(&up.log()));
    assert_eq!(beta.len(), 1, "{}", dump(&up.log()));
    assert_eq!(up.opens(), 2, "{}", dump(&up.log()));
}

#[test]
fn a_connection_marked_close_or_closed_while_idle_is_not_reused() {
    let (lab, up) = lab();
    let mut c = lab.client_conn();
    // `Connection: close` from the upstream: the next request dials.
    get(&lab, &mut c, "/close/0");
    get(&lab, &mut c, "/c/after-close");
    let closed = up.conn_of("/close/0");
    let next = up.conn_of("/c/after-close");
    assert_ne!(closed, next, "{}", dump(&up.log()));

    // Kept alive, then closed by the upstream while idle in the pool.
    get(&lab, &mut c, "/idle-close/0");
    let idle = up.conn_of("/idle-close/0");
    assert_eq!(
        idle,
        next,
        "kept-alive connection reused: {}",
        dump(&up.log())
    );
    up.wait_closed(idle);
    get(&lab, &mut c, "/c/after-idle-close");
    let after = up.conn_of("/c/after-idle-close");
    assert_ne!(after, idle, "{}", dump(&up.log()));
    assert_eq!(up.opens(), 3, "{}", dump(&up.log()));

    // A closed connection that was still pooled never surfaced as an error.
    let failures: Vec<Value> = lab
        .evidence()
        .into_iter()
        .filter(|v| v["event"] == "close" && v["detail"].is_string())
        .collect();
    assert!(failures.is_empty(), "{}", dump(&failures));
}

#[test]
fn every_pooled_request_has_its_own_decision_and_exact_close_record() {
    let (lab, up) = lab();
    let mut c = lab.client_conn();
    let mut sent = BTreeMap::new();
    for i in 0..4 {
        let path = format!("/d/{i}");
        // Heads of different lengths, one with a body.
        let pad = "p".repeat(10 * i);
        let req = if i == 2 {
            format!(
                "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nX-Pad: {pad}\r\n\
                 Content-Length: 5\r\n\r\nhello",
                url(&path)
            )
        } else {
            format!(
                "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nX-Pad: {pad}\r\n\r\n",
                url(&path)
            )
        };
        c.send(req.as_bytes()).expect("send");
        let resp = c.read_response(Duration::from_secs(10));
        assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
        sent.insert(path, (req.len() as u64, resp.body.len() as u64));
    }
    // The POST's connection ends with it (a body: never reused).
    assert_eq!(up.opens(), 2, "{}", dump(&up.log()));
    assert_eq!(
        up.conn_of("/d/0"),
        up.conn_of("/d/2"),
        "{}",
        dump(&up.log())
    );
    let mut ids = BTreeSet::new();
    for (path, (up_bytes, down_bytes)) in &sent {
        let decision = lab.wait_evidence(&format!("decision of {path}"), |v| {
            v["event"] == "decision" && v["kind"] == "http" && v["path"] == path.as_str()
        });
        assert_eq!(decision["decision"], "allow", "{decision}");
        assert_eq!(decision["org"], "acme", "{decision}");
        assert_eq!(decision["ip"], ALLOWED_IP, "{decision}");
        assert_eq!(decision["port"], PORT, "{decision}");
        let id = record_id(&decision).expect("id");
        assert!(ids.insert(id.clone()), "{path}: record {id} twice");
        let close = lab.wait_evidence(&format!("close of {path}"), |v| {
            v["event"] == "close" && v["conn"].as_str() == Some(id.as_str())
        });
        assert_eq!(close["bytes_up"], *up_bytes, "{path}: {close}");
        assert_eq!(close["bytes_down"], *down_bytes, "{path}: {close}");
    }
    // One decision record per request, no more.
    let decisions = lab
        .evidence()
        .into_iter()
        .filter(|v| v["event"] == "decision" && v["kind"] == "http")
        .count();
    assert_eq!(decisions, sent.len());
}

#[test]
fn a_request_lost_with_a_pooled_connection_is_retried_only_when_safe() {
    let (lab, up) = lab();
    let mut c = lab.client_conn();
    // The upstream will drop the next request on this connection.
    get(&lab, &mut c, "/drop-next/0");
    let first = up.conn_of("/drop-next/0");
    // A GET without a body: sent again over a new connection, answered.
    get(&lab, &mut c, "/e/get");
    let log = up.log();
    let arrivals: Vec<u64> = log
        .iter()
        .filter(|v| v["event"] == "request" && v["path"] == "/e/get")
        .filter_map(|v| v["id"].as_u64())
        .collect();
    assert_eq!(arrivals.len(), 2, "{}", dump(&log));
    assert_eq!(arrivals[0], first, "it rode the pooled connection first");
    assert_ne!(arrivals[1], first, "then a new one: {}", dump(&log));
    let decision = lab.wait_evidence("decision of /e/get", |v| {
        v["event"] == "decision" && v["path"] == "/e/get"
    });
    let id = record_id(&decision).expect("id");
    let close = lab.wait_evidence("close of /e/get", |v| {
        v["event"] == "close" && v["conn"].as_str() == Some(id.as_str())
    });
    assert!(close["detail"].is_null(), "{close}");
    assert_eq!(decision["ip"], ALLOWED_IP, "{decision}");

    // A POST with a body on a connection about to be dropped: not replayed.
    get(&lab, &mut c, "/drop-next/1");
    let req = format!(
        "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: 5\r\n\r\nhello",
        url("/e/post")
    );
    c.send(req.as_bytes()).expect("send");
    let resp = c.read_response(Duration::from_secs(10));
    assert_eq!(resp.status, 502, "{resp:?}");
    let log = up.log();
    let posts = log
        .iter()
        .filter(|v| v["event"] == "request" && v["path"] == "/e/post")
        .count();
    assert_eq!(posts, 1, "sent once: {}", dump(&log));
    let decision = lab.wait_evidence("decision of /e/post", |v| {
        v["event"] == "decision" && v["path"] == "/e/post"
    });
    let id = record_id(&decision).expect("id");
    let close = lab.wait_evidence("close of /e/post", |v| {
        v["event"] == "close" && v["conn"].as_str() == Some(id.as_str())
    });
    assert!(
        close["detail"].is_string(),
        "the cause is recorded: {close}"
    );
    assert_eq!(close["bytes_up"], req.len(), "{close}");
}

#[test]
fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let (lab, up) = lab_with(&["upstream_idle_timeout = \"1s\""]);
    let mut c = lab.client_conn();
    get(&lab, &mut c, "/f/0");
    let first = up.conn_of("/f/0");
    // Palisade closes it (the upstream would keep it 10 s, then time out).
    up.wait_closed(first);
    let log = up.log();
    assert!(
        !log.iter()
            .any(|v| v["event"] == "error" && v["id"] == first),
        "the upstream timed out first: {}",
        dump(&log)
    );
    assert_eq!(metric(&lab, "palisade_upstream_idle_connections"), 0.0);
    get(&lab, &mut c, "/f/1");
    assert_ne!(up.conn_of("/f/1"), first, "{}", dump(&up.log()));
    assert_eq!(metric(&lab, "palisade_upstream_reused_total"), 0.0);
}

/// (g) A POST whose body holds a request head, to an upstream that answers
/// at once (before the body) and keeps the connection: Palisade writes no
/// more of the body, closes that connection instead of pooling it, and the
/// next request of the same org gets its own response on a connection of
/// its own. The upstream's log is the witness: every request it served has
/// a decision record, and the planted one is not among them.
#[test]
fn a_request_head_planted_in_a_body_never_reaches_the_upstream() {
    let (lab, up) = lab();
    let planted = format!("GET /planted HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n");
    let mut c = lab.client_conn();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: {}\r\n\r\n",
        url("/early"),
        planted.len()
    );
    c.send(head.as_bytes()).expect("send the head");
    // The answer comes before the body was sent.
    let resp = c.read_response(Duration::from_secs(10));
    assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
    assert!(resp.body.contains("path=/early"), "{resp:?}");
    // Then the body: a request head. (Palisade may have closed the client
    // connection already, its request body unread.)
    let _ = c.send(planted.as_bytes());
    let early = up.conn_of("/early");
    up.wait_closed(early);

    // The next request of the same org: its own response, its own connection.
    let mut next = lab.client_conn();
    get(&lab, &mut next, "/after-early");
    assert_ne!(
        up.conn_of("/after-early"),
        early,
        "glued to the early connection: {}",
        dump(&up.log())
    );
    served_only(&lab, &up, &["/early", "/after-early"]);
    assert_eq!(metric(&lab, "palisade_upstream_reused_total"), 0.0);
}

/// (g) A POST whose body holds request heads, to an upstream that answers
/// only after the whole body arrived yet never reads it (so the exchange
/// looks in order): the request goes upstream marked `Connection: close`,
/// the upstream stops after its answer, and the planted heads are never
/// served; the next requests of the same org (on the same client
/// connection) get their own responses over connections of their own.
#[test]
fn a_head_planted_in_a_body_the_upstream_answered_after_is_never_served() {
    let (lab, up) = lab();
    let planted: String = (0..3)
        .map(|i| format!("GET /planted/{i} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n"))
        .collect();
    let mut c = lab.client_conn();
    let req = format!(
        "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: {}\r\n\r\n{planted}",
        url("/unread"),
        planted.len()
    );
    c.send(req.as_bytes()).expect("send");
    let resp = c.read_response(Duration::from_secs(10));
    assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
    assert!(resp.body.contains("path=/unread"), "{resp:?}");
    let unread = up.conn_of("/unread");
    up.wait_closed(unread);
    // The same client connection, then another: each its own response.
    get(&lab, &mut c, "/after-unread/0");
    let mut next = lab.client_conn();
    get(&lab, &mut next, "/after-unread/1");
    for path in ["/after-unread/0", "/after-unread/1"] {
        assert_ne!(up.conn_of(path), unread, "{}", dump(&up.log()));
    }
    let log = served_only(
        &lab,
        &up,
        &["/unread", "/after-unread/0", "/after-unread/1"],
    );
    let asked = log
        .iter()
        .find(|v| v["event"] == "request" && v["path"] == "/unread")
        .expect("logged");
    assert_eq!(asked["close"], true, "sent marked close: {asked}");
    // The bodiless requests after it still share a connection.
    assert_eq!(
        up.conn_of("/after-unread/0"),
        up.conn_of("/after-unread/1"),
        "{}",
        dump(&log)
    );
}

/// The upstream served exactly `paths`, in order, each with an allow
/// record of its own; the upstream's log.
fn served_only(lab: &Lab, up: &Upstream, paths: &[&str]) -> Vec<Value> {
    let log = up.log();
    let served: Vec<&str> = log
        .iter()
        .filter(|v| v["event"] == "request")
        .filter_map(|v| v["path"].as_str())
        .collect();
    assert_eq!(served, paths, "{}", dump(&log));
    for path in served {
        let decision = lab.wait_evidence(&format!("decision of {path}"), |v| {
            v["event"] == "decision" && v["kind"] == "http" && v["path"] == path
        });
        assert_eq!(decision["decision"], "allow", "{decision}");
    }
    log
}

/// acme, its allowed.test:8443 intercepted.
const INTERCEPTED: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [8443]
intercept = true
"#;

/// Inside one intercepted connection (CONNECT allowed.test:8443, TLS
/// trusting CA): a POST of `/unread` with BODY, then a GET of
/// `/after-unread`; prints one JSON line with each response's status line
/// and body (or how the connection ended).
const INTERCEPTED_CLIENT: &str = r#"
import json, socket, ssl, sys
proxy, ca, body = sys.argv[1], sys.argv[2], sys.argv[3].encode()
host, port = proxy.split(":")
s = socket.create_connection((host, int(port)), timeout=10, source_address=("198.18.1.2", 0))
s.sendall(b"CONNECT allowed.test:8443 HTTP/1.1\r\nHost: allowed.test:8443\r\n\r\n")
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["http/1.1"])
t = ctx.wrap_socket(s, server_hostname="allowed.test")
f = t.makefile("rb")
def response():
    status = f.readline().decode("latin-1").strip()
    length = 0
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        if k.lower() == "content-length":
            length = int(v)
    return [status, f.read(length).decode("latin-1")]
out = {}
t.sendall(b"POST /unread HTTP/1.1\r\nHost: allowed.test:8443\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
out["first"] = response()
try:
    t.sendall(b"GET /after-unread HTTP/1.1\r\nHost: allowed.test:8443\r\n\r\n")
    out["second"] = response()
except Exception as e:
    out["second"] = ["ended", repr(e)]
print(json.dumps(out), flush=True)
"#;

/// (g) Inside an intercepted connection, whose HTTP/1.1 upstream
/// connection carries its requests one after another: a POST whose body
/// holds request heads, to an upstream that answers after the whole body
/// yet never reads it. The POST goes upstream marked `Connection: close`,
/// the planted heads are never served, and the next request inside the
/// same client connection gets its own response over a new upstream
/// connection.
#[test]
fn a_head_planted_in_an_intercepted_body_is_never_served() {
    let ca_dir = scratch_dir("pool-intercept").join("ca");
    let builder = Lab::builder()
        .policy(INTERCEPTED)
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ));
    let (lab, up) = lab_of(builder);
    let planted: String = (0..3)
        .map(|i| format!("GET /planted/{i} HTTP/1.1\r\nHost: allowed.test:{TLS_PORT}\r\n\r\n"))
        .collect();
    let ca = ca_dir.join("acme.pem").display().to_string();
    let out = lab.client_exec(
        "python3",
        &["-c", INTERCEPTED_CLIENT, PROXY_ADDR, &ca, &planted],
    );
    let v: Value = serde_json::from_str(out.stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("client output {e}: {}", out.describe()));
    assert!(
        v["first"][0].as_str().unwrap_or_default().contains(" 200"),
        "{v}"
    );
    assert!(
        v["first"][1]
            .as_str()
            .unwrap_or_default()
            .contains("path=/unread"),
        "{v}"
    );
    assert!(
        v["second"][0].as_str().unwrap_or_default().contains(" 200"),
        "{v}"
    );
    assert!(
        v["second"][1]
            .as_str()
            .unwrap_or_default()
            .contains("path=/after-unread"),
        "the next request got another's response: {v}"
    );
    let log = served_only(&lab, &up, &["/unread", "/after-unread"]);
    let asked = log
        .iter()
        .find(|v| v["event"] == "request" && v["path"] == "/unread")
        .expect("logged");
    assert_eq!(asked["close"], true, "sent marked close: {asked}");
    assert_ne!(
        up.conn_of("/after-unread"),
        up.conn_of("/unread"),
        "{}",
        dump(&log)
    );
}
