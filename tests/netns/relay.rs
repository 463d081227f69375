//! Forwarded absolute-form HTTP/1.1 against a hostile client and a hostile
//! upstream, through real sockets: whatever either side sends, the bytes
//! of one exchange never reach another. The upstream (ours, in the
//! upstream namespace, allowed.test:8080) logs every connection and every
//! request head exactly as received, and answers by path:
//!
//! - `/ok/..`: 200 with a Content-Length body naming the connection;
//! - `/more/..`: `ok` with Content-Length 2, then a whole second response
//!   nobody asked for, in the same write;
//! - `/late/..`: `ok`, then a moment later a second response nobody
//!   asked for, on the idle connection;
//! - `/short/..`: says Content-Length 100, sends 9 bytes and closes;
//! - `/cut/..`: a chunked body cut half-way by a close;
//! - `/both/..`: Content-Length and Transfer-Encoding at once;
//! - `/trailers/..`: a chunked body with a trailer section (a checksum,
//!   and a Content-Length no trailer may carry).
//!
//! (a) a response that overruns its framing, or bytes sent on an idle
//!     connection, never reach the next request: that connection is
//!     dropped, the next request gets its own response on a new one;
//! (b) a response that lies about its length, or is cut half-way, ends in
//!     a close of the client's connection, never in a response taken as
//!     whole; one with both framings is refused 502 with `Proxy-Status`;
//! (c) pipelined requests are answered in order, each its own response;
//!     smuggling attempts (Content-Length with Transfer-Encoding, two
//!     Content-Lengths, obs-fold) never get a planted request to the
//!     upstream, and a bare-LF head goes on as a clean CRLF one;
//! (d) a request body cut half-way never reaches the upstream as a
//!     request, and its connection is never reused;
//! (e) a chunked response reaches a client that takes trailers
//!     (`TE: trailers`) with its trailer fields (those a trailer may
//!     carry), and its connection is reused after it.

use std::time::Duration;

use serde_json::Value;

use crate::lab::*;

const PORT: u16 = 8080;

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [8080]
"#;

/// The hostile upstream (stdlib only). Arguments: address, port, log.
/// Every socket wait is bounded (10 s), and so are heads (64 KiB), bodies
/// (1 MiB) and requests per connection (100).
const UPSTREAM: &str = r#"
import json, socket, sys, threading, time
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
    try:
        for n in range(100):
            while b"\r\n\r\n" not in buf:
                if len(buf) > 65536:
                    return
                data = conn.recv(65536)
                if not data:
                    if buf:
                        log({"event": "partial", "id": cid, "raw": buf.decode("latin-1")})
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            length = 0
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = min(int(v.strip()), 1 << 20)
            while len(buf) < length:
                data = conn.recv(65536)
                if not data:
                    log({"event": "partial", "id": cid, "raw": (head + b"\r\n\r\n" + buf).decode("latin-1")})
                    return
                buf += data
            body, buf = buf[:length], buf[length:]
            log({"event": "request", "id": cid, "n": n, "path": target,
                 "head": head.decode("latin-1"), "body": body.decode("latin-1")})
            ok = ("conn=%d n=%d path=%s\n" % (cid, n, target)).encode()
            extra = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nplanted"
            if target.startswith("/more/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + extra)
            elif target.startswith("/late/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                time.sleep(0.2)
                conn.sendall(extra)
            elif target.startswith("/short/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
                return
            elif target.startswith("/cut/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nab")
                return
            elif target.startswith("/trailers/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
                             b"5\r\nhello\r\n0\r\nX-Checksum: abc123\r\nContent-Length: 99\r\n\r\n")
            elif target.startswith("/both/"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok)
    except (OSError, ValueError, IndexError) as e:
        log({"event": "error", "id": cid, "error": repr(e)})
    finally:
        conn.close()
        log({"event": "closed", "id": cid})
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port))
s.listen(128)
print("ready", flush=True)
while True:
    conn, peer = s.accept()
    with lock:
        ids[0] += 1
        cid = ids[0]
    log({"event": "open", "id": cid})
    threading.Thread(target=serve, args=(conn, cid), daemon=True).start()
"#;

struct Upstream {
    _server: Background,
    log: std::path::PathBuf,
}

impl Upstream {
    fn log(&self) -> Vec<Value> {
        read_jsonl(&self.log)
    }

    fn requests(&self) -> Vec<Value> {
        self.log()
            .into_iter()
            .filter(|v| v["event"] == "request")
            .collect()
    }

    /// The connection `path` arrived on (it arrives once).
    fn conn_of(&self, path: &str) -> u64 {
        let hits: Vec<Value> = self
            .requests()
            .into_iter()
            .filter(|v| v["path"] == path)
            .collect();
        assert_eq!(hits.len(), 1, "{path}: {}", dump(&self.log()));
        hits[0]["id"].as_u64().expect("id")
    }

    /// Nothing planted ever reached the upstream as a request of its own.
    fn never_planted(&self) {
        let log = self.log();
        for v in &log {
            let path = v["path"].as_str().unwrap_or_default();
            assert!(!path.contains("planted"), "{}", dump(&log));
        }
    }
}

fn lab() -> (Lab, Upstream) {
    let mut lab = Lab::builder().policy(POLICY).without_proxy().start();
    let log = lab.dir.join("relay-upstream.log");
    let port = PORT.to_string();
    let args = [
        std::ffi::OsStr::new("-c"),
        UPSTREAM.as_ref(),
        ALLOWED_IP.as_ref(),
        port.as_ref(),
        log.as_os_str(),
    ];
    let server = lab.spawn_upstream_server("the hostile upstream", "python3", args);
    lab.spawn_proxy();
    lab.wait_proxy_ready();
    (
        lab,
        Upstream {
            _server: server,
            log,
        },
    )
}

fn get_req(path: &str) -> String {
    format!("GET http://allowed.test:{PORT}{path} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n")
}

/// A keep-alive GET of `path` on `c`: the response.
fn get(c: &mut RawConn, path: &str) -> HttpResp {
    c.send(get_req(path).as_bytes()).expect("send");
    c.read_response(Duration::from_secs(10))
}

/// GET `path` on a connection of its own: every byte that came before
/// Palisade closed it (it must close it).
fn cut_short(lab: &Lab, path: &str) -> String {
    let mut c = lab.client_conn();
    c.send(get_req(path).as_bytes()).expect("send");
    let mut seen = Vec::new();
    while let Some(more) = c.read_until(b"\n", WAIT) {
        seen.extend_from_slice(&more);
    }
    seen.extend_from_slice(&c.take_buffered());
    assert!(
        matches!(c.wait_closed(WAIT), Closed::After(_)),
        "{path}: still open"
    );
    String::from_utf8_lossy(&seen).into_owned()
}

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn a_response_that_overruns_lies_or_is_cut_never_reaches_another_exchange() {
    let (lab, up) = lab();
    // (a) Overrun in the same write: the client sees `ok` only, and the
    // next request its own response over a new upstream connection.
    let mut c = lab.client_conn();
    let resp = get(&mut c, "/more/1");
    assert_eq!((resp.status, resp.body.as_str()), (200, "ok"), "{resp:?}");
    let resp = get(&mut c, "/ok/2");
    assert!(resp.body.contains("path=/ok/2"), "{resp:?}");
    assert_ne!(up.conn_of("/ok/2"), up.conn_of("/more/1"));
    // Bytes sent on the idle connection: the same.
    let resp = get(&mut c, "/late/3");
    assert_eq!(resp.body, "ok", "{resp:?}");
    std::thread::sleep(Duration::from_millis(600));
    let resp = get(&mut c, "/ok/4");
    assert!(resp.body.contains("path=/ok/4"), "{resp:?}");
    assert_ne!(up.conn_of("/ok/4"), up.conn_of("/late/3"));
    // An in-order exchange keeps its connection: /ok/5 rides /ok/4's.
    let resp = get(&mut c, "/ok/5");
    assert!(resp.body.contains("path=/ok/5"), "{resp:?}");
    assert_eq!(up.conn_of("/ok/5"), up.conn_of("/ok/4"));

    // (b) A length that lies, and a chunked body cut half-way: the
    // client's connection is cut, never a response ended as if whole
    // (hyper may have flushed the head and part of the body, or nothing).
    let seen = cut_short(&lab, "/short/6");
    if let Some(i) = seen.find("\r\n\r\n") {
        assert!(seen.starts_with("HTTP/1.1 200"), "{seen:?}");
        assert!(seen.len() - i - 4 < 100, "{seen:?}");
    }
    let seen = cut_short(&lab, "/cut/7");
    assert!(!seen.contains("0\r\n\r\n"), "ended as whole: {seen:?}");
    // Both framings: refused.
    let mut c = lab.client_conn();
    let resp = get(&mut c, "/both/8");
    assert_eq!(resp.status, 502, "{resp:?}");
    let status = resp.header("proxy-status").unwrap_or_default();
    assert!(status.contains("http_response_incomplete"), "{resp:?}");
    assert!(resp.body.contains("Transfer-Encoding"), "{resp:?}");
    // The next request still gets its own response, on a connection of
    // its own.
    let resp = get(&mut c, "/ok/9");
    assert!(resp.body.contains("path=/ok/9"), "{resp:?}");
    assert_ne!(up.conn_of("/ok/9"), up.conn_of("/both/8"));
    up.never_planted();
}

#[test]
fn pipelined_and_smuggling_requests_never_cross_exchanges() {
    let (lab, up) = lab();
    // (c) Pipelined in one write: answered in order, over one upstream
    // connection, each head exactly once and clean.
    let mut c = lab.client_conn();
    let both = format!("{}{}", get_req("/ok/p1"), get_req("/ok/p2"));
    c.send(both.as_bytes()).expect("send");
    let first = c.read_response(WAIT);
    let second = c.read_response(WAIT);
    assert!(first.body.contains("path=/ok/p1"), "{first:?}");
    assert!(second.body.contains("path=/ok/p2"), "{second:?}");
    assert_eq!(up.conn_of("/ok/p1"), up.conn_of("/ok/p2"));

    let planted = format!("GET /planted HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n");
    let url = |p: &str| format!("http://allowed.test:{PORT}{p}");
    let attempts = [
        format!(
            "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: {}\r\n\
             Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n{planted}",
            url("/ok/te-cl"),
            planted.len() + 5
        ),
        format!(
            "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: 0\r\n\
             Content-Length: {}\r\n\r\n{planted}",
            url("/ok/cl-cl"),
            planted.len()
        ),
        format!(
            "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nX-A: 1\r\n {planted}",
            url("/ok/fold")
        ),
    ];
    for attempt in &attempts {
        let mut c = lab.client_conn();
        c.send(attempt.as_bytes()).expect("send");
        // Whatever the answers, the connection ends or idles; read them all.
        let _ = c.wait_closed(Duration::from_secs(2));
    }
    // A bare-LF head goes on as a clean CRLF one.
    let mut c = lab.client_conn();
    let lf = format!(
        "GET {} HTTP/1.1\nHost: allowed.test:{PORT}\n\n",
        url("/ok/lf")
    );
    c.send(lf.as_bytes()).expect("send");
    let resp = c.read_response(WAIT);
    assert!(resp.body.contains("path=/ok/lf"), "{resp:?}");
    for v in up.requests() {
        let head = v["head"].as_str().unwrap_or_default();
        assert!(
            !head.replace("\r\n", "").contains('\n') && !head.contains("\r\n "),
            "{v}"
        );
        let lower = head.to_ascii_lowercase();
        assert!(
            !(lower.contains("content-length") && lower.contains("transfer-encoding")),
            "{v}"
        );
    }
    up.never_planted();

    // (d) A request body cut half-way: never a request upstream, and its
    // connection is never reused.
    // The proxy may see the client's end before it dials (then no upstream
    // connection at all), or after (then that connection ends partial).
    let opens = |log: &[Value]| log.iter().filter(|v| v["event"] == "open").count();
    let opened_before = opens(&up.log());
    let mut c = lab.client_conn();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nContent-Length: 100\r\n\r\n",
        url("/ok/halfbody")
    );
    c.send(head.as_bytes()).expect("send");
    c.send(&[b'x'; 50]).expect("send half");
    c.close();
    lab.wait_evidence("the half body's close", |v| {
        v["event"] == "close" && v["path"] == "/ok/halfbody"
    });
    if opens(&up.log()) > opened_before {
        wait_until("the half body's upstream connection closed", WAIT, || {
            up.log().iter().any(|v| v["event"] == "partial")
        });
    }
    let mut c = lab.client_conn();
    let resp = get(&mut c, "/ok/after");
    assert!(resp.body.contains("path=/ok/after"), "{resp:?}");
    let log = up.log();
    assert!(
        !log.iter()
            .any(|v| v["event"] == "request" && v["path"] == "/ok/halfbody"),
        "{}",
        dump(&log)
    );
    if let Some(partial) = log.iter().find(|v| v["event"] == "partial") {
        assert_ne!(partial["id"].as_u64(), Some(up.conn_of("/ok/after")));
    }
    up.never_planted();
}

#[test]
fn a_chunked_response_arrives_with_its_trailers() {
    let (lab, up) = lab();
    let mut c = lab.client_conn();
    let req = format!(
        "GET http://allowed.test:{PORT}/trailers/1 HTTP/1.1\r\n\
         Host: allowed.test:{PORT}\r\nTE: trailers\r\n\r\n"
    );
    c.send(req.as_bytes()).expect("send");
    let head = c.read_until(b"\r\n\r\n", WAIT).expect("a response head");
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    let body = c.read_until(b"\r\n0\r\n", WAIT).expect("the chunked body");
    assert_eq!(
        body,
        b"5\r\nhello\r\n0\r\n",
        "{:?}",
        String::from_utf8_lossy(&body)
    );
    // Without trailers the body ends with a bare CRLF and nothing more
    // comes: this wait then runs out.
    let section = c
        .read_until(b"\r\n\r\n", WAIT)
        .unwrap_or_else(|| c.take_buffered());
    let section = String::from_utf8_lossy(&section).to_ascii_lowercase();
    assert_eq!(
        section,
        "x-checksum: abc123\r\n\r\n",
        "the trailer section relayed (no content-length in it)\n{}",
        lab.proxy_output()
    );
    // In order: the connection goes on, over the same upstream connection.
    let resp = get(&mut c, "/ok/2");
    assert!(resp.body.contains("path=/ok/2"), "{resp:?}");
    assert_eq!(up.conn_of("/ok/2"), up.conn_of("/trailers/1"));
}
