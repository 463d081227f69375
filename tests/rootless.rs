//! The rootless tier: the whole app built in-process on `127.0.0.1:0`
//! ([`palisade::app::start`]) and stopped by a future of the test's own,
//! no root and no namespaces. Explicit CONNECT, absolute-form HTTP, SOCKS5
//! and an intercepted connection, each allowed and denied, through real
//! sockets; a record is read back for each.
//!
//! The policy always denies loopback, so the allowed upstream address is
//! `198.18.2.10` (benchmarking, left open) and the app dials a server of
//! the test's own on loopback in its place
//! ([`palisade::app::Started::route_upstream`]); the decision and the
//! records name `198.18.2.10`. Names resolve through a tiny DNS server
//! of the test's own that answers every A query with that address.
//! Everything that needs namespaces (transparent mode, the gateway
//! ruleset, DNS seen from a sandbox) stays in the netns suite.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The allowed upstream address every test routes to loopback.
const UPSTREAM: &str = "198.18.2.10";
/// An address no rule allows.
const DENIED: &str = "198.18.2.11";
/// Every read and wait of these tests is bounded by this.
const WITHIN: Duration = Duration::from_secs(10);

/// The app under test: its addresses, its evidence dir, and its stop.
struct App {
    proxy: SocketAddr,
    socks5: SocketAddr,
    evidence: PathBuf,
    dir: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), palisade::app::StartError>>>,
}

impl App {
    /// Start the app with `rules` for the org of 127.0.0.1 (and
    /// `intercept` lines, if any), names resolved by `dns`, and
    /// `routes` from checked addresses to the test's servers.
    async fn start(
        rules: &str,
        intercept: Option<&str>,
        dns: SocketAddr,
        routes: &[(SocketAddr, SocketAddr)],
    ) -> App {
        let dir = tempfile::Builder::new()
            .prefix("palisade-rootless-")
            .tempdir()
            .unwrap()
            .into_path();
        let evidence = dir.join("evidence");
        let intercept = intercept
            .map(|lines| format!("[intercept]\n{lines}\n"))
            .unwrap_or_default();
        let src = format!(
            "[proxy]\nlisten = [\"127.0.0.1:3128\"]\nsocks5 = [\"127.0.0.1:1080\"]\nconnect_timeout = \"2s\"\n\
             [dns]\nlisten = [\"127.0.0.1:5353\"]\nupstream = [\"{dns}\"]\nresolve_timeout = \"2s\"\n\
             [evidence]\ndir = {evidence:?}\n\
             {intercept}\
             [[org]]\nname = \"acme\"\nclients = [\"127.0.0.1/32\"]\n{rules}"
        );
        let path = dir.join("palisade.toml");
        std::fs::write(&path, &src).unwrap();
        let mut config = palisade::config::from_str(&src, &path)
            .unwrap_or_else(|e| panic!("config: {e:?}\n{src}"));
        // Port 0 (the system picks) is refused in a config file, where it
        // would be a mistake; a test asks for it here.
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        config.proxy.listen = vec![any];
        config.proxy.socks5 = vec![any];
        config.dns.listen = vec![any];
        let mut started = palisade::app::start(config).await.expect("start");
        for &(from, to) in routes {
            started = started.route_upstream(from, to);
        }
        let proxy = started.proxy_addrs()[0];
        let socks5 = started.socks5_addrs()[0];
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(started.serve(async {
            let _ = stopped.await;
        }));
        App {
            proxy,
            socks5,
            evidence,
            dir,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Every record written so far.
    fn records(&self) -> Vec<Value> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.evidence)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.retain(|p| p.extension().is_some_and(|x| x == "jsonl"));
        files.sort();
        files
            .iter()
            .flat_map(|f| {
                std::fs::read_to_string(f)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The first record `pred` holds for, waiting for it (bounded).
    async fn record(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WITHIN;
        loop {
            if let Some(v) = self.records().into_iter().find(|v| pred(v)) {
                return v;
            }
            if tokio::time::Instant::now() > deadline {
                panic!("{what}: no such record in {:#?}", self.records());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stop it through its shutdown future, and wait for the drain.
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let task = self.task.take().unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(30), task).await;
        assert!(
            matches!(ended, Ok(Ok(Ok(())))),
            "the app did not stop cleanly: {ended:?}"
        );
    }
}

impl Drop for App {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `addr:port` as a socket address.
fn at(addr: &str, port: u16) -> SocketAddr {
    SocketAddr::new(addr.parse().unwrap(), port)
}

/// A TCP echo server on loopback: its address.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(Ok(n)) = tokio::time::timeout(WITHIN, s.read(&mut buf)).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// An HTTP/1.1 server on loopback answering every request `200 hi` and
/// closing: its address.
async fn http_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(answer_http(s));
        }
    });
    addr
}

/// Read one request head from `s` and answer `200 hi`.
async fn answer_http<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) {
    let head = read_head(&mut s).await;
    if head.is_empty() {
        return;
    }
    let _ = s
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        .await;
    let _ = s.shutdown().await;
}

/// Bytes up to the end of a head (`\r\n\r\n`), bounded in size and time.
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        match tokio::time::timeout(WITHIN, s.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Read to the end (bounded in time).
async fn read_all<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(WITHIN, s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A DNS server on loopback that answers every A query with [`UPSTREAM`]
/// (and every other query with no answer): its address.
async fn dns_server() -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            if let Some(reply) = dns_reply(&buf[..n]) {
                let _ = socket.send_to(&reply, from).await;
            }
        }
    });
    addr
}

/// The reply to one query: the question echoed, one A record of
/// [`UPSTREAM`] for an A question (TTL 60), none otherwise.
fn dns_reply(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut end = 12;
    while *query.get(end)? != 0 {
        end += 1 + usize::from(query[end]);
    }
    let question = query.get(12..end + 5)?;
    let is_a = question[question.len() - 4..question.len() - 2] == [0, 1];
    let mut reply = Vec::with_capacity(64);
    reply.extend_from_slice(&query[..2]); // id
    reply.extend_from_slice(&[0x81, 0x80]); // response, RD, RA, NOERROR
    reply.extend_from_slice(&[0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
    reply.extend_from_slice(question);
    if is_a {
        reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        let ip: std::net::Ipv4Addr = UPSTREAM.parse().unwrap();
        reply.extend_from_slice(&ip.octets());
    }
    Some(reply)
}

/// Send `CONNECT target` to the explicit proxy: the stream and the
/// response head.
async fn connect(proxy: SocketAddr, target: &str) -> (TcpStream, String) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await;
    (s, head)
}

/// Send `msg` through `stream` to the echo server and read it back
/// (bounded), then close.
async fn echoes(mut stream: TcpStream, msg: &[u8]) {
    stream.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(WITHIN, stream.read_exact(&mut back))
        .await
        .expect("echo within the bound")
        .unwrap();
    assert_eq!(back, msg);
}

/// The status code of a response head.
fn status(head: &str) -> &str {
    head.split(' ').nth(1).unwrap_or("")
}

/// A rule opening the allowed upstream, any port, any bytes.
const CIDR_RULE: &str =
    "[[org.allow]]\nid = \"up\"\ncidr = \"198.18.2.10/32\"\nports = [7000, 7080]\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_connect_is_allowed_to_its_rule_and_denied_elsewhere() {
    let echo = echo_server().await;
    let app = App::start(CIDR_RULE, None, echo, &[(at(UPSTREAM, 7000), echo)]).await;

    let (tunnel, head) = connect(app.proxy, &format!("{UPSTREAM}:7000")).await;
    assert_eq!(status(&head), "200", "{head}");
    echoes(tunnel, b"ping through the tunnel").await;
    let allow = app
        .record("the tunnel's allow", |v| {
            v["kind"] == "tcp" && v["decision"] == "allow" && v["event"] != "close"
        })
        .await;
    assert_eq!(allow["mode"], "explicit", "{allow}");
    assert_eq!(allow["ip"], UPSTREAM, "{allow}");
    assert_eq!(allow["rule"], "up", "{allow}");
    let close = app
        .record("the tunnel's close", |v| v["conn"] == allow["id"])
        .await;
    assert_eq!(close["bytes_up"], 23, "{close}");
    assert_eq!(close["bytes_down"], 23, "{close}");

    let (_, head) = connect(app.proxy, &format!("{DENIED}:7000")).await;
    assert_eq!(status(&head), "403", "{head}");
    let deny = app
        .record("the denial", |v| v["host"] == DENIED && v["kind"] == "tcp")
        .await;
    assert_eq!(deny["decision"], "deny", "{deny}");
    assert_eq!(deny["reason"], "no_matching_rule", "{deny}");
    assert!(head.contains(deny["ref"].as_str().unwrap()), "{head}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_is_forwarded_when_allowed_and_refused_otherwise() {
    let http = http_server().await;
    let app = App::start(CIDR_RULE, None, http, &[(at(UPSTREAM, 7080), http)]).await;

    let mut s = TcpStream::connect(app.proxy).await.unwrap();
    let req = format!(
        "GET http://{UPSTREAM}:7080/hello HTTP/1.1\r\nHost: {UPSTREAM}:7080\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let resp = read_all(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.ends_with("hi"), "{resp}");
    let allow = app
        .record("the request's allow", |v| {
            v["kind"] == "http" && v["decision"] == "allow" && v["event"] != "close"
        })
        .await;
    assert_eq!(allow["method"], "GET", "{allow}");
    assert_eq!(allow["path"], "/hello", "{allow}");
    assert_eq!(allow["ip"], UPSTREAM, "{allow}");

    let mut s = TcpStream::connect(app.proxy).await.unwrap();
    let req = format!(
        "GET http://{DENIED}:7080/ HTTP/1.1\r\nHost: {DENIED}:7080\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let resp = read_all(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    let deny = app
        .record("the denial", |v| v["host"] == DENIED && v["kind"] == "http")
        .await;
    assert_eq!(deny["decision"], "deny", "{deny}");
    assert_eq!(deny["mode"], "explicit", "{deny}");

    // Origin-form is no proxy request: refused before any target.
    let mut s = TcpStream::connect(app.proxy).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    assert!(read_all(&mut s).await.starts_with("HTTP/1.1 400"));
    let refused = app
        .record("the origin-form refusal", |v| {
            v["reason"] == "bad_request" && v["host"].is_null()
        })
        .await;
    assert_eq!(refused["detail"], "origin-form request: this is a proxy");
    app.stop().await;
}

/// A SOCKS5 CONNECT (no authentication) to `ip:port`: the stream and the
/// reply code.
async fn socks5_connect(proxy: SocketAddr, ip: &str, port: u16) -> (TcpStream, u8) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(&[5, 1, 0]).await.unwrap();
    let mut method = [0u8; 2];
    s.read_exact(&mut method).await.unwrap();
    assert_eq!(method, [5, 0]);
    let ip: std::net::Ipv4Addr = ip.parse().unwrap();
    let mut req = vec![5, 1, 0, 1];
    req.extend_from_slice(&ip.octets());
    req.extend_from_slice(&port.to_be_bytes());
    s.write_all(&req).await.unwrap();
    let mut reply = [0u8; 10];
    tokio::time::timeout(WITHIN, s.read_exact(&mut reply))
        .await
        .expect("a reply within the bound")
        .unwrap();
    (s, reply[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socks5_connect_is_allowed_to_its_rule_and_denied_elsewhere() {
    let echo = echo_server().await;
    let app = App::start(CIDR_RULE, None, echo, &[(at(UPSTREAM, 7000), echo)]).await;

    let (s, code) = socks5_connect(app.socks5, UPSTREAM, 7000).await;
    assert_eq!(code, 0, "succeeded");
    echoes(s, b"socks ping").await;
    let allow = app
        .record("the allow", |v| {
            v["mode"] == "socks5" && v["decision"] == "allow"
        })
        .await;
    assert_eq!(allow["ip"], UPSTREAM, "{allow}");

    let (_, code) = socks5_connect(app.socks5, DENIED, 7000).await;
    assert_eq!(code, 2, "connection not allowed by ruleset");
    let deny = app
        .record("the denial", |v| {
            v["mode"] == "socks5" && v["host"] == DENIED
        })
        .await;
    assert_eq!(deny["decision"], "deny", "{deny}");
    assert_eq!(deny["reason"], "no_matching_rule", "{deny}");
    app.stop().await;
}

/// A CA and a leaf for `allowed.test` signed by it, for the upstream:
/// (CA PEM, leaf certificate, leaf key).
fn upstream_certs() -> (
    String,
    rustls_pki_types::CertificateDer<'static>,
    rustls_pki_types::PrivateKeyDer<'static>,
) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["allowed.test".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    (
        ca.pem(),
        leaf.der().clone(),
        rustls_pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
    )
}

/// A TLS HTTP/1.1 server on loopback for `allowed.test`, answering every
/// request `200 hi`: its address.
async fn tls_server(
    cert: rustls_pki_types::CertificateDer<'static>,
    key: rustls_pki_types::PrivateKeyDer<'static>,
) -> SocketAddr {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(s).await {
                    answer_http(tls).await;
                }
            });
        }
    });
    addr
}

/// TLS to `allowed.test` over `tunnel`, trusting only the CA in `ca`.
async fn client_tls(tunnel: TcpStream, ca: &Path) -> tokio_rustls::client::TlsStream<TcpStream> {
    let pem = std::fs::read(ca).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::pem::PemObject::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let name = rustls_pki_types::ServerName::try_from("allowed.test").unwrap();
    tokio::time::timeout(
        WITHIN,
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tunnel),
    )
    .await
    .expect("TLS within the bound")
    .expect("the org CA's leaf")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intercepted_requests_are_decided_one_by_one() {
    let (upstream_ca, cert, key) = upstream_certs();
    let upstream = tls_server(cert, key).await;
    let dns = dns_server().await;
    let scratch = tempfile::tempdir().unwrap();
    let ca_dir = scratch.path().join("ca");
    let upstream_ca_file = scratch.path().join("upstream-ca.pem");
    std::fs::write(&upstream_ca_file, upstream_ca).unwrap();
    let rules = "[[org.allow]]\nid = \"registry\"\nhost = \"allowed.test\"\nports = [443]\n\
                 intercept = true\nmethods = [\"GET\"]\n";
    let intercept = format!("ca_dir = {ca_dir:?}\nupstream_ca = {upstream_ca_file:?}");
    let app = App::start(
        rules,
        Some(&intercept),
        dns,
        &[(at(UPSTREAM, 443), upstream)],
    )
    .await;
    let org_ca = ca_dir.join("acme.pem");

    for (method, want) in [("GET", "200"), ("POST", "403")] {
        let (tunnel, head) = connect(app.proxy, "allowed.test:443").await;
        assert_eq!(status(&head), "200", "{head}");
        let mut tls = client_tls(tunnel, &org_ca).await;
        let req = format!(
            "{method} /v1 HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        tls.write_all(req.as_bytes()).await.unwrap();
        let resp = read_all(&mut tls).await;
        assert_eq!(status(&resp), want, "{method}: {resp}");
    }
    let tunnel = app
        .record("the connection's allow", |v| {
            v["kind"] == "tcp" && v["decision"] == "allow" && v["intercepted"] == true
        })
        .await;
    assert_eq!(tunnel["host"], "allowed.test", "{tunnel}");
    assert_eq!(tunnel["ip"], UPSTREAM, "{tunnel}");
    let get = app
        .record("the GET's allow", |v| {
            v["kind"] == "http" && v["method"] == "GET" && v["event"] != "close"
        })
        .await;
    assert_eq!(get["decision"], "allow", "{get}");
    assert_eq!(get["path"], "/v1", "{get}");
    let post = app
        .record("the POST's denial", |v| {
            v["kind"] == "http" && v["method"] == "POST"
        })
        .await;
    assert_eq!(post["decision"], "deny", "{post}");
    assert_eq!(post["reason"], "method_not_allowed", "{post}");
    assert!(post["conn"].is_string(), "linked to its connection: {post}");
    app.stop().await;
}
