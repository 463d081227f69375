//! Zero-copy tunnels: what moves with splice(2) arrives intact and is
//! counted exactly, in an opaque (cidr rule) tunnel, in a TLS tunnel after
//! its ServerHello, and for HTTP bodies of known length, whose end hands the
//! tunnel back to the verifier; the user-space fallback
//! (`PALISADE_SPLICE=off`) counts the same.
//!
//! The upstream servers are threads of this test bound in the upstream
//! namespace, so that they can hash what they receive and count the raw
//! bytes on their sockets.

use std::hash::{DefaultHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, in_netns, Closed, Lab, RawConn};
use crate::record_id;

/// The cidr-allowed host of the lab (opaque tunnels).
const SINK: &str = "198.18.2.30:7001";
/// allowed.test's TLS server (tunnel = "tls").
const TLS_PORT: u16 = 7443;
/// allowed.test's HTTP server (the default: HTTP verified).
const HTTP_PORT: u16 = 7080;
/// Bytes each way of a large transfer.
const LARGE: u64 = 16 << 20;
const STEP: Duration = Duration::from_secs(20);

fn policy() -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
cidr = "198.18.2.30/32"
ports = [7001]

[[org.allow]]
host = "allowed.test"
ports = [{TLS_PORT}]
tunnel = "tls"

[[org.allow]]
host = "allowed.test"
ports = [{HTTP_PORT}]
"#
    )
}

fn splice_lab() -> Lab {
    Lab::builder()
        .policy(&policy())
        .proxy_option("detect_timeout = \"2s\"")
        .start()
}

/// A lab whose proxy copies in user space only.
fn fallback_lab() -> Lab {
    // Only the proxy started now reads it; another test's proxy started
    // meanwhile would just copy in user space too.
    std::env::set_var("PALISADE_SPLICE", "off");
    let lab = splice_lab();
    std::env::remove_var("PALISADE_SPLICE");
    lab
}

/// Deterministic bytes: `len` of them from `seed`, fed to `out` in chunks.
fn pattern(seed: u64, len: u64, mut out: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
    let mut x = seed | 1;
    let mut chunk = vec![0u8; 64 * 1024];
    let mut left = len;
    while left > 0 {
        for word in chunk.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes()[..word.len()]);
        }
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
        out(&chunk[..n])?;
        left -= n as u64;
    }
    Ok(())
}

fn pattern_hash(seed: u64, len: u64) -> u64 {
    let mut h = DefaultHasher::new();
    pattern(seed, len, |b| {
        h.write(b);
        Ok(())
    })
    .unwrap();
    h.finish()
}

/// Read exactly `len` bytes, hashing them.
fn read_hashed(r: &mut impl Read, len: u64) -> io::Result<u64> {
    let mut h = DefaultHasher::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut left = len;
    while left > 0 {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        let n = r.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        h.write(&buf[..n]);
        left -= n as u64;
    }
    Ok(h.finish())
}

/// A socket that counts the raw bytes through it.
struct Counted {
    inner: TcpStream,
    read: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
}

impl Counted {
    fn new(inner: TcpStream) -> Self {
        Counted {
            inner,
            read: Arc::default(),
            written: Arc::default(),
        }
    }
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Listen on `addr` in the upstream namespace; each connection is handed
/// to `serve` on its own thread (at most `conns` connections).
fn upstream_server(
    lab: &Lab,
    addr: &'static str,
    conns: usize,
    serve: impl Fn(TcpStream) + Send + Sync + 'static,
) {
    let listener = in_netns(&lab.ns_upstream, move || TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    let serve = Arc::new(serve);
    thread::spawn(move || {
        for conn in listener.incoming().take(conns) {
            let Ok(conn) = conn else { return };
            let _ = conn.set_read_timeout(Some(STEP));
            let _ = conn.set_write_timeout(Some(STEP));
            let serve = serve.clone();
            thread::spawn(move || serve(conn));
        }
    });
}

/// The sink/source protocol of the opaque test: the client sends the
/// length it wants back (8 bytes, big endian), then its payload, then
/// shuts its write side; the server answers with the hash of all it
/// received after the length (8 bytes), then that many pattern bytes.
fn sink(conn: TcpStream) {
    let mut conn = conn;
    let mut len = [0u8; 8];
    if conn.read_exact(&mut len).is_err() {
        return;
    }
    let mut h = DefaultHasher::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => h.write(&buf[..n]),
            Err(_) => return,
        }
    }
    let _ = conn.write_all(&h.finish().to_be_bytes());
    let _ = pattern(2, u64::from_be_bytes(len), |b| conn.write_all(b));
    let _ = conn.shutdown(Shutdown::Write);
}

/// The decision record of the client connection on `port` and its close.
fn records(lab: &Lab, port: u16) -> (Value, Value) {
    let client = format!("{}:{port}", lab::CLIENT_IP);
    let rec = lab.wait_evidence(&format!("allow for {client}"), |v| {
        v["event"] == "decision" && v["client"] == client.as_str() && v["decision"] == "allow"
    });
    let id = record_id(&rec).expect("record id");
    let close = lab.wait_evidence(&format!("close of {id}"), |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    (rec, close)
}

/// A large transfer each way through an opaque tunnel, the client
/// half-closing before it receives: intact, and counted exactly.
fn opaque_transfer(lab: &Lab) {
    upstream_server(lab, SINK, 1, sink);
    let mut c = lab.client_conn();
    assert_eq!(c.connect(SINK), 200, "{}", lab.proxy_output());
    let port = c.local_port();
    let s = &mut c.stream;
    s.set_write_timeout(Some(STEP)).unwrap();
    s.set_read_timeout(Some(STEP)).unwrap();
    s.write_all(&LARGE.to_be_bytes()).unwrap();
    pattern(1, LARGE, |b| s.write_all(b)).unwrap();
    // Half-close: the answer still comes back.
    s.shutdown(Shutdown::Write).unwrap();
    let mut got = [0u8; 8];
    s.read_exact(&mut got).unwrap();
    assert_eq!(
        u64::from_be_bytes(got),
        pattern_hash(1, LARGE),
        "upstream received other bytes"
    );
    let down = read_hashed(s, LARGE).unwrap();
    assert_eq!(down, pattern_hash(2, LARGE), "client received other bytes");
    assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0, "EOF after the answer");
    let (rec, close) = records(lab, port);
    assert_eq!(rec["tunnel"], "opaque", "{rec}");
    assert_eq!(close["bytes_up"], 8 + LARGE, "{close}");
    assert_eq!(close["bytes_down"], 8 + LARGE, "{close}");
}

#[test]
fn opaque_tunnel_moves_large_transfers_intact_and_counted() {
    let lab = splice_lab();
    opaque_transfer(&lab);
}

#[test]
fn user_space_fallback_counts_the_same() {
    let lab = fallback_lab();
    opaque_transfer(&lab);
}

// ---------------------------------------------------------------------------
// TLS

fn tls_configs() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    let cert = rcgen::generate_simple_self_signed(vec!["allowed.test".to_string()]).unwrap();
    let der = cert.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let server = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).unwrap();
    let client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}

/// Inside TLS: the client sends 16 bytes (its payload length, the length it
/// wants back), its payload; the server answers with the payload's hash and
/// that many pattern bytes; both close with close_notify.
fn tls_transfer(lab: &Lab) {
    let (server_config, client_config) = tls_configs();
    let server_raw: Arc<Mutex<Option<(u64, u64)>>> = Arc::default();
    let raw = server_raw.clone();
    let addr: &'static str = Box::leak(format!("{}:{TLS_PORT}", lab::ALLOWED_IP).into_boxed_str());
    upstream_server(lab, addr, 1, move |conn| {
        let sock = Counted::new(conn);
        let (read, written) = (sock.read.clone(), sock.written.clone());
        let tls = rustls::ServerConnection::new(server_config.clone()).unwrap();
        let mut s = rustls::StreamOwned::new(tls, sock);
        let mut lens = [0u8; 16];
        if s.read_exact(&mut lens).is_err() {
            return;
        }
        let up = u64::from_be_bytes(lens[..8].try_into().unwrap());
        let down = u64::from_be_bytes(lens[8..].try_into().unwrap());
        let Ok(hash) = read_hashed(&mut s, up) else {
            return;
        };
        let _ = s.write_all(&hash.to_be_bytes());
        let _ = pattern(4, down, |b| s.write_all(b));
        let _ = s.flush();
        // Until the client's close_notify, then ours.
        let _ = s.read(&mut [0u8; 1]);
        s.conn.send_close_notify();
        let _ = s.flush();
        // Counted before the client can see our EOF.
        *raw.lock().unwrap() = Some((
            read.load(Ordering::Relaxed),
            written.load(Ordering::Relaxed),
        ));
        let _ = s.sock.inner.shutdown(Shutdown::Write);
    });

    let mut c = lab.client_conn();
    let target = format!("allowed.test:{TLS_PORT}");
    assert_eq!(c.connect(&target), 200, "{}", lab.proxy_output());
    let port = c.local_port();
    let RawConn { stream, .. } = c;
    stream.set_write_timeout(Some(STEP)).unwrap();
    stream.set_read_timeout(Some(STEP)).unwrap();
    let sock = Counted::new(stream);
    let (read, written) = (sock.read.clone(), sock.written.clone());
    let name = rustls::pki_types::ServerName::try_from("allowed.test").unwrap();
    let tls = rustls::ClientConnection::new(client_config, name).unwrap();
    let mut s = rustls::StreamOwned::new(tls, sock);
    let mut lens = [0u8; 16];
    lens[..8].copy_from_slice(&LARGE.to_be_bytes());
    lens[8..].copy_from_slice(&LARGE.to_be_bytes());
    s.write_all(&lens).unwrap();
    pattern(3, LARGE, |b| s.write_all(b)).unwrap();
    s.flush().unwrap();
    let mut hash = [0u8; 8];
    s.read_exact(&mut hash).unwrap();
    assert_eq!(
        u64::from_be_bytes(hash),
        pattern_hash(3, LARGE),
        "upstream got other bytes"
    );
    assert_eq!(
        read_hashed(&mut s, LARGE).unwrap(),
        pattern_hash(4, LARGE),
        "client got other bytes"
    );
    s.conn.send_close_notify();
    s.flush().unwrap();
    s.sock.inner.shutdown(Shutdown::Write).unwrap();
    // Everything the server sends, to its EOF.
    let mut rest = Vec::new();
    let _ = s.sock.read_to_end(&mut rest);
    let (client_read, client_written) = (
        read.load(Ordering::Relaxed),
        written.load(Ordering::Relaxed),
    );

    let (rec, close) = records(lab, port);
    assert_eq!(rec["tunnel"], "tls", "{rec}");
    assert_eq!(rec["sni"], "allowed.test", "{rec}");
    let (server_read, server_written) = server_raw.lock().unwrap().expect("server finished");
    assert_eq!(client_written, server_read, "raw bytes up");
    assert_eq!(server_written, client_read, "raw bytes down");
    assert_eq!(close["bytes_up"], client_written, "{close}");
    assert_eq!(close["bytes_down"], client_read, "{close}");
    assert!(client_written > LARGE && client_read > LARGE);
}

#[test]
fn tls_tunnel_after_server_hello_moves_large_transfers_intact_and_counted() {
    let lab = splice_lab();
    tls_transfer(&lab);
}

// ---------------------------------------------------------------------------
// HTTP verified: bodies of known length, then judging again.

/// An HTTP/1.1 keep-alive server: a request body (Content-Length) is read
/// and hashed; the answer carries `LARGE` pattern bytes, with the request
/// body's hash in an `X-Body-Hash` header. Every Host seen is logged.
fn http_server(lab: &Lab, hosts: Arc<Mutex<Vec<String>>>) {
    let addr: &'static str = Box::leak(format!("{}:{HTTP_PORT}", lab::ALLOWED_IP).into_boxed_str());
    upstream_server(lab, addr, 1, move |conn| {
        let mut conn = conn;
        let mut buf = Vec::new();
        for _ in 0..10 {
            // One head.
            let end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let mut chunk = [0u8; 4096];
                match conn.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            };
            let head: Vec<u8> = buf.drain(..end).collect();
            let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
            let field = |name: &str| {
                head.lines()
                    .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            };
            hosts
                .lock()
                .unwrap()
                .push(field("host:").unwrap_or_default());
            let len: u64 = field("content-length:")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            // The body: what is buffered, then the socket.
            let buffered = buf.len().min(len as usize);
            let mut h = DefaultHasher::new();
            h.write(&buf[..buffered]);
            buf.drain(..buffered);
            let mut left = len - buffered as u64;
            let mut chunk = vec![0u8; 64 * 1024];
            while left > 0 {
                let want = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
                match conn.read(&mut chunk[..want]) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        h.write(&chunk[..n]);
                        left -= n as u64;
                    }
                }
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {LARGE}\r\nX-Body-Hash: {}\r\n\r\n",
                h.finish()
            );
            if conn.write_all(head.as_bytes()).is_err()
                || pattern(6, LARGE, |b| conn.write_all(b)).is_err()
            {
                return;
            }
        }
    });
}

#[test]
fn http_bodies_pass_then_the_next_head_is_judged() {
    let lab = splice_lab();
    let hosts: Arc<Mutex<Vec<String>>> = Arc::default();
    http_server(&lab, hosts.clone());
    let mut c = lab.client_conn();
    let target = format!("allowed.test:{HTTP_PORT}");
    assert_eq!(c.connect(&target), 200, "{}", lab.proxy_output());
    let port = c.local_port();
    c.stream.set_write_timeout(Some(STEP)).unwrap();
    let mut sent = 0u64;
    let mut received = 0u64;
    // A GET, then a POST with a large body: each answered with a large body.
    let get = format!("GET / HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let post = format!("POST /up HTTP/1.1\r\nHost: {target}\r\nContent-Length: {LARGE}\r\n\r\n");
    for (head, body) in [(&get, 0), (&post, LARGE)] {
        c.send(head.as_bytes()).unwrap();
        let s = &mut c.stream;
        pattern(5, body, |b| s.write_all(b)).unwrap();
        sent += head.len() as u64 + body;
        let resp_head = c
            .read_until(b"\r\n\r\n", STEP)
            .unwrap_or_else(|| panic!("no response\n{}", lab.proxy_output()));
        received += resp_head.len() as u64;
        let text = String::from_utf8_lossy(&resp_head).to_ascii_lowercase();
        assert!(text.starts_with("http/1.1 200"), "{text}");
        let want_hash = {
            let mut h = DefaultHasher::new();
            if body > 0 {
                pattern(5, body, |b| {
                    h.write(b);
                    Ok(())
                })
                .unwrap();
            }
            h.finish()
        };
        assert!(
            text.contains(&format!("x-body-hash: {want_hash}")),
            "upstream got another request body: {text}"
        );
        // The response body: what was read past the head, then the socket.
        let early = c.take_buffered();
        let mut h = DefaultHasher::new();
        h.write(&early);
        c.stream.set_read_timeout(Some(STEP)).unwrap();
        let rest = LARGE - early.len() as u64;
        let mut buf = vec![0u8; 64 * 1024];
        let mut left = rest;
        while left > 0 {
            let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
            let n = c.stream.read(&mut buf[..want]).unwrap();
            assert!(n > 0, "EOF in the response body");
            h.write(&buf[..n]);
            left -= n as u64;
        }
        assert_eq!(
            h.finish(),
            pattern_hash(6, LARGE),
            "client got another response body"
        );
        received += LARGE;
    }
    // After the bodies the verifier judges again: another host is refused,
    // and nothing of that request reaches the upstream.
    c.send(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")
        .unwrap();
    assert!(
        matches!(c.wait_closed(Duration::from_secs(5)), Closed::After(_)),
        "the tunnel carried a request for another host\n{}",
        lab.proxy_output()
    );
    let client = format!("{}:{port}", lab::CLIENT_IP);
    let deny = lab.wait_evidence("host_mismatch after the bodies", |v| {
        v["decision"] == "deny" && v["client"] == client.as_str() && v["reason"] == "host_mismatch"
    });
    assert_eq!(deny["host"], "other.test", "{deny}");
    let (rec, close) = records(&lab, port);
    assert_eq!(rec["tunnel"], "http", "{rec}");
    assert_eq!(close["bytes_up"], sent, "{close}");
    assert_eq!(close["bytes_down"], received, "{close}");
    assert_eq!(
        *hosts.lock().unwrap(),
        vec![target.clone(), target],
        "the upstream saw another request"
    );
}
