//! `palisade probe run`: perform each probe of a plan with real sockets,
//! inside the sandbox, and record what the client observed.
//!
//! Probes run one after another (so each one's evidence falls in its own
//! time window), each within the plan's `timeout` and all within its
//! `deadline`; a probe the deadline leaves no time for is recorded as not
//! run. Nothing here decides anything: the report joins these observations
//! with Palisade's evidence.
//!
//! Markers: every probe gets `pp-<run>-<n>`. It is sent where it is
//! harmless and recorded by Palisade: the request path (plans put
//! `/palisade-probe/{marker}` there) and an `X-Palisade-Probe` header for
//! HTTP, the `X-Palisade-Probe` header of a CONNECT, and any DNS label the
//! plan puts `{marker}` in. Every socket's local address is recorded too,
//! which is how TLS, TCP and DNS probes are matched to evidence.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::timeout;

use super::plan::{parse_target, Plan, Probe, Target};
use super::{Expect, Layer, Via, MARKER_HEADER, OBSERVATIONS_FORMAT};
use crate::proto::target::{normalize_host, Host};

/// Largest response head read.
const MAX_HEAD: usize = 64 * 1024;
/// Largest body (or TLS/TCP reply) read; the rest is counted, not kept.
const MAX_BODY: usize = 256 * 1024;
/// How long a TCP probe waits for a server-speaks-first banner (longer
/// than Palisade's default `detect_timeout`, so a transparent decision
/// made after that wait is seen).
const TCP_READ_WINDOW: Duration = Duration::from_millis(2500);

/// What the client saw, in one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The target answered: an HTTP response not made by the proxy, a TLS
    /// server reply, TCP bytes or a connection left open, a DNS answer, a
    /// UDP reply.
    Reached,
    /// Something answered in the target's place: a proxy refusal or error
    /// response, a DNS refusal, a connection reset or closed after connect.
    Refused,
    /// Nothing answered: timeout, unreachable, connection refused, no DNS reply.
    Failed,
    /// The probe never got as far as trying its target: the proxy was not
    /// reachable, the name did not resolve for the client, the deadline.
    SetupFailed,
}

/// A socket the probe opened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sock {
    /// `proxy`, `target`, `resolve` (a name lookup), `dns`, `udp`.
    pub purpose: String,
    pub proto: String,
    pub local: Option<String>,
    pub remote: String,
}

/// One probe's observation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Observation {
    pub id: String,
    pub marker: String,
    pub target: String,
    pub kind: String,
    pub via: Via,
    pub expect: Expect,
    #[serde(default)]
    pub layer: Layer,
    pub proxy: Option<String>,
    pub server: Option<String>,
    pub note: Option<String>,
    pub started: String,
    pub finished: String,
    pub elapsed_ms: u64,
    pub sockets: Vec<Sock>,
    pub resolved: Vec<String>,
    pub connected: bool,
    pub connect_status: Option<u16>,
    pub http_status: Option<u16>,
    pub proxy_status: Option<String>,
    /// An evidence record id the proxy or DNS shim quoted back.
    pub palisade_record: Option<String>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// `server_hello`, `alert`, `not_tls`, `closed`, `no_reply`.
    pub tls: Option<String>,
    pub dns_rcode: Option<String>,
    pub dns_answers: Vec<String>,
    pub dns_ede: Option<String>,
    /// `timeout`, `connection_refused`, `unreachable`, `reset`, `closed`,
    /// `resolve_failed`, `proxy_unreachable`, `deadline`, `bad_target`, `io`.
    pub error: Option<String>,
    pub error_detail: Option<String>,
    /// The last step reached: `resolve`, `connect`, `proxy_connect`,
    /// `connect_response`, `request`, `response`, `done`.
    pub stage: String,
    pub outcome: Outcome,
}

/// `observations.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Observations {
    pub format: String,
    pub run: String,
    pub palisade_version: String,
    pub plan_sha256: String,
    pub plan: Plan,
    pub started: String,
    pub finished: String,
    pub environment: serde_json::Value,
    pub observations: Vec<Observation>,
}

fn now_text() -> String {
    humantime::format_rfc3339_micros(SystemTime::now()).to_string()
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // A failing OS RNG leaves zeros: markers stay unique by index, and the
    // ClientHello randoms need no secrecy (nothing is ever encrypted).
    let _ = getrandom::fill(&mut b);
    b
}

/// Run every probe of `plan`.
pub async fn run(plan: &Plan, plan_text: &str) -> Observations {
    use sha2::Digest;
    let run_id: String = random_bytes::<4>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let started = now_text();
    let t0 = Instant::now();
    let deadline = t0 + plan.deadline();
    let per_probe = plan.timeout();
    let resolver = plan.resolver.or_else(system_resolver);
    let mut observations = Vec::with_capacity(plan.probes.len());
    for (n, probe) in plan.probes.iter().enumerate() {
        let marker = format!("pp-{run_id}-{n:04}");
        let left = deadline.saturating_duration_since(Instant::now());
        let budget = per_probe.min(left);
        let mut obs = Observation::new(probe, &marker, plan);
        if budget < Duration::from_millis(200) {
            obs.fail(
                Outcome::SetupFailed,
                "deadline",
                "the run's deadline left no time for this probe",
            );
        } else {
            let start = Instant::now();
            let ctx = Ctx {
                probe,
                marker: &marker,
                resolver,
                until: start + budget,
            };
            if timeout(budget, ctx.perform(&mut obs)).await.is_err() {
                obs.fail(
                    if obs.stage == "proxy_connect" {
                        Outcome::SetupFailed
                    } else {
                        Outcome::Failed
                    },
                    "timeout",
                    &format!("no result within {budget:?} (at stage {})", obs.stage),
                );
            }
            obs.elapsed_ms = start.elapsed().as_millis() as u64;
        }
        obs.finished = now_text();
        observations.push(obs);
    }
    Observations {
        format: OBSERVATIONS_FORMAT.into(),
        run: run_id,
        palisade_version: env!("CARGO_PKG_VERSION").into(),
        plan_sha256: sha2::Sha256::digest(plan_text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        plan: plan.clone(),
        started,
        finished: now_text(),
        environment: environment(resolver),
        observations,
    }
}

impl Observation {
    fn new(probe: &Probe, marker: &str, plan: &Plan) -> Observation {
        let target = probe.target.replace("{marker}", marker);
        let kind = parse_target(&target).map(|t| t.kind()).unwrap_or("invalid");
        let now = now_text();
        Observation {
            id: probe.id.clone(),
            marker: marker.into(),
            target,
            kind: kind.into(),
            via: probe.via,
            expect: probe.expect,
            layer: probe.layer,
            proxy: (probe.via == Via::Proxy)
                .then(|| probe.proxy.or(plan.proxy).map(|a| a.to_string()))
                .flatten(),
            server: None,
            note: probe.note.clone(),
            started: now.clone(),
            finished: now,
            elapsed_ms: 0,
            sockets: Vec::new(),
            resolved: Vec::new(),
            connected: false,
            connect_status: None,
            http_status: None,
            proxy_status: None,
            palisade_record: None,
            bytes_sent: 0,
            bytes_received: 0,
            tls: None,
            dns_rcode: None,
            dns_answers: Vec::new(),
            dns_ede: None,
            error: None,
            error_detail: None,
            stage: "start".into(),
            outcome: Outcome::Failed,
        }
    }

    fn fail(&mut self, outcome: Outcome, error: &str, detail: &str) {
        self.outcome = outcome;
        self.error = Some(error.into());
        self.error_detail = Some(detail.chars().take(300).collect());
    }

    fn io_fail(&mut self, outcome: Outcome, e: &io::Error) {
        let kind = error_kind(e);
        self.fail(outcome, kind, &e.to_string());
    }
}

/// A short, stable name for an I/O error.
pub fn error_kind(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection_refused",
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => "reset",
        io::ErrorKind::TimedOut => "timeout",
        io::ErrorKind::UnexpectedEof => "closed",
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => "unreachable",
        _ => match e.raw_os_error() {
            Some(101) | Some(113) | Some(99) => "unreachable",
            _ => "io",
        },
    }
}

struct Ctx<'a> {
    probe: &'a Probe,
    marker: &'a str,
    resolver: Option<SocketAddr>,
    until: Instant,
}

/// What came back on a TCP stream after our bytes were sent.
struct Reply {
    data: Vec<u8>,
    total: u64,
    /// `eof`, `reset`, `timeout` (still open when the window ended).
    end: &'static str,
}

async fn read_reply(stream: &mut TcpStream, window: Duration, stop_at_tls_record: bool) -> Reply {
    let mut data = Vec::new();
    let mut total = 0u64;
    let mut buf = [0u8; 8192];
    let end_at = Instant::now() + window;
    loop {
        let left = end_at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Reply {
                data,
                total,
                end: "timeout",
            };
        }
        match timeout(left, stream.read(&mut buf)).await {
            Err(_) => {
                return Reply {
                    data,
                    total,
                    end: "timeout",
                }
            }
            Ok(Ok(0)) => {
                return Reply {
                    data,
                    total,
                    end: "eof",
                }
            }
            Ok(Ok(n)) => {
                total += n as u64;
                let room = MAX_BODY.saturating_sub(data.len());
                data.extend_from_slice(&buf[..n.min(room)]);
                if stop_at_tls_record && data.len() >= 5 {
                    return Reply {
                        data,
                        total,
                        end: "timeout",
                    };
                }
            }
            Ok(Err(e)) => {
                let end = if error_kind(&e) == "reset" {
                    "reset"
                } else {
                    "eof"
                };
                return Reply { data, total, end };
            }
        }
    }
}

/// Read an HTTP response head (bounded); returns (status, headers, rest of bytes read).
async fn read_head(
    stream: &mut TcpStream,
) -> io::Result<(u16, Vec<(String, String)>, Vec<u8>, u64)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before a response head",
            ));
        }
        data.extend_from_slice(&buf[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&data) {
            Ok(httparse::Status::Complete(len)) => {
                let status = resp.code.unwrap_or(0);
                let hs = resp
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                let total = data.len() as u64;
                return Ok((status, hs, data[len..].to_vec(), total));
            }
            Ok(httparse::Status::Partial) if data.len() < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "response head too large",
                ))
            }
            Err(e) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("not an HTTP response: {e}"),
                ))
            }
        }
    }
}

/// `record=ID` or `evidence record ID` in a text from Palisade.
pub fn quoted_record(text: &str) -> Option<String> {
    for key in ["record=", "evidence record "] {
        if let Some(i) = text.find(key) {
            let id: String = text[i + key.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .take(64)
                .collect();
            if !id.is_empty() {
                return Some(id);
            }
        }
    }
    None
}

fn host_for_request(host: &str, port: u16, tls: bool) -> String {
    if (tls && port == 443) || (!tls && port == 80) {
        host.to_string()
    } else {
        format!("{host}:{port}")
    }
}

impl Ctx<'_> {
    fn left(&self) -> Duration {
        self.until.saturating_duration_since(Instant::now())
    }

    async fn perform(&self, obs: &mut Observation) {
        let target = match parse_target(&obs.target) {
            Ok(t) => t,
            Err(e) => {
                obs.fail(Outcome::SetupFailed, "bad_target", &e);
                return;
            }
        };
        match (&target, self.probe.via) {
            (Target::Dns { name, qtype }, _) => {
                let Some(server) = self.probe.server.or(self.resolver) else {
                    obs.fail(
                        Outcome::SetupFailed,
                        "resolve_failed",
                        "no resolver: set `resolver` in the plan",
                    );
                    return;
                };
                obs.server = Some(server.to_string());
                obs.stage = "request".into();
                match dns_query(server, name, qtype, self.left()).await {
                    Ok(r) => {
                        obs.sockets.push(Sock {
                            purpose: "dns".into(),
                            proto: "udp".into(),
                            local: r.local.map(|a| a.to_string()),
                            remote: server.to_string(),
                        });
                        obs.stage = "done".into();
                        obs.bytes_sent = r.sent;
                        obs.bytes_received = r.received;
                        obs.palisade_record = r.ede.as_deref().and_then(quoted_record);
                        let refused =
                            matches!(r.rcode.as_str(), "Refused" | "NXDomain") && r.ede.is_some();
                        obs.outcome = if r.rcode == "NoError" && !r.answers.is_empty() {
                            Outcome::Reached
                        } else if refused || r.rcode == "Refused" {
                            Outcome::Refused
                        } else {
                            // NXDOMAIN/NODATA/SERVFAIL without a refusal: a resolver answered.
                            Outcome::Reached
                        };
                        obs.dns_rcode = Some(r.rcode);
                        obs.dns_answers = r.answers;
                        obs.dns_ede = r.ede;
                    }
                    Err((local, e)) => {
                        obs.sockets.push(Sock {
                            purpose: "dns".into(),
                            proto: "udp".into(),
                            local: local.map(|a| a.to_string()),
                            remote: server.to_string(),
                        });
                        obs.io_fail(Outcome::Failed, &e);
                    }
                }
            }
            (Target::Udp { addr }, _) => self.udp(obs, *addr).await,
            (_, Via::Proxy) => self.via_proxy(obs, &target).await,
            (_, Via::Direct) => self.direct(obs, &target).await,
        }
    }

    async fn udp(&self, obs: &mut Observation, addr: SocketAddr) {
        let bind: SocketAddr = if addr.is_ipv6() {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        };
        obs.stage = "connect".into();
        let sock = match UdpSocket::bind(bind).await {
            Ok(s) => s,
            Err(e) => return obs.io_fail(Outcome::SetupFailed, &e),
        };
        let connected = sock.connect(addr).await;
        obs.sockets.push(Sock {
            purpose: "udp".into(),
            proto: "udp".into(),
            local: sock.local_addr().ok().map(|a| a.to_string()),
            remote: addr.to_string(),
        });
        if let Err(e) = connected {
            return obs.io_fail(Outcome::Failed, &e);
        }
        // A QUIC long-header Initial look-alike (version 1), padded to 1200 bytes.
        let mut payload = vec![0u8; 1200];
        payload[0] = 0xc3;
        payload[1..5].copy_from_slice(&[0, 0, 0, 1]);
        payload[5] = 8;
        payload[6..14].copy_from_slice(&random_bytes::<8>());
        payload[14..14 + self.marker.len()].copy_from_slice(self.marker.as_bytes());
        obs.stage = "request".into();
        match sock.send(&payload).await {
            Ok(n) => obs.bytes_sent = n as u64,
            Err(e) => return obs.io_fail(Outcome::Failed, &e),
        }
        let mut buf = [0u8; 2048];
        match timeout(self.left(), sock.recv(&mut buf)).await {
            Ok(Ok(n)) => {
                obs.bytes_received = n as u64;
                obs.stage = "done".into();
                obs.outcome = Outcome::Reached;
            }
            Ok(Err(e)) => obs.io_fail(Outcome::Failed, &e),
            Err(_) => obs.fail(Outcome::Failed, "timeout", "no UDP reply"),
        }
    }

    async fn via_proxy(&self, obs: &mut Observation, target: &Target) {
        let Some(proxy) = obs
            .proxy
            .as_deref()
            .and_then(|p| p.parse::<SocketAddr>().ok())
        else {
            return obs.fail(Outcome::SetupFailed, "bad_target", "no proxy address");
        };
        obs.stage = "proxy_connect".into();
        let mut stream = match TcpStream::connect(proxy).await {
            Ok(s) => s,
            Err(e) => {
                obs.sockets.push(Sock {
                    purpose: "proxy".into(),
                    proto: "tcp".into(),
                    local: None,
                    remote: proxy.to_string(),
                });
                return obs.io_fail(Outcome::SetupFailed, &e);
            }
        };
        obs.sockets.push(Sock {
            purpose: "proxy".into(),
            proto: "tcp".into(),
            local: stream.local_addr().ok().map(|a| a.to_string()),
            remote: proxy.to_string(),
        });
        if let Target::Http {
            tls: false,
            host,
            port,
            path,
        } = target
        {
            let host_header = self
                .probe
                .host_header
                .clone()
                .unwrap_or_else(|| host_for_request(host, *port, false));
            let req = format!(
                "GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host_header}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
                self.marker
            );
            obs.stage = "request".into();
            return self
                .http_exchange(obs, &mut stream, req.as_bytes(), true)
                .await;
        }
        let Some((host, port)) = target.host_port() else {
            return;
        };
        let req = format!(
            "CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\n\r\n",
            self.marker
        );
        obs.stage = "connect_response".into();
        if let Err(e) = stream.write_all(req.as_bytes()).await {
            return obs.io_fail(Outcome::Failed, &e);
        }
        obs.bytes_sent += req.len() as u64;
        let (status, headers, rest, n) = match read_head(&mut stream).await {
            Ok(v) => v,
            Err(e) => return obs.io_fail(Outcome::Failed, &e),
        };
        obs.bytes_received += n;
        obs.connect_status = Some(status);
        if status != 200 {
            obs.proxy_status = header(&headers, "proxy-status");
            let body = self.read_body(&mut stream, rest).await;
            obs.palisade_record = obs
                .proxy_status
                .as_deref()
                .and_then(quoted_record)
                .or_else(|| quoted_record(&String::from_utf8_lossy(&body)));
            obs.stage = "done".into();
            obs.outcome = Outcome::Refused;
            return;
        }
        obs.connected = true;
        self.after_connect(obs, &mut stream, target).await;
    }

    async fn read_body(&self, stream: &mut TcpStream, mut already: Vec<u8>) -> Vec<u8> {
        let window = self.left().min(Duration::from_secs(2));
        let r = read_reply(stream, window, false).await;
        already.extend_from_slice(&r.data);
        already.truncate(MAX_BODY);
        already
    }

    /// Send an HTTP request and read the response.
    async fn http_exchange(
        &self,
        obs: &mut Observation,
        stream: &mut TcpStream,
        req: &[u8],
        from_proxy: bool,
    ) {
        if let Err(e) = stream.write_all(req).await {
            return obs.io_fail(Outcome::Failed, &e);
        }
        obs.bytes_sent += req.len() as u64;
        obs.stage = "response".into();
        let (status, headers, rest, n) = match read_head(stream).await {
            Ok(v) => v,
            Err(e) => {
                let outcome = if obs.via == Via::Direct {
                    Outcome::Refused
                } else {
                    Outcome::Failed
                };
                return obs.io_fail(outcome, &e);
            }
        };
        obs.bytes_received += n;
        obs.http_status = Some(status);
        obs.proxy_status = header(&headers, "proxy-status");
        let body = self.read_body(stream, rest).await;
        obs.bytes_received += body.len() as u64;
        let from_palisade = obs
            .proxy_status
            .as_deref()
            .is_some_and(|p| p.contains("error="));
        if from_palisade {
            obs.palisade_record = obs
                .proxy_status
                .as_deref()
                .and_then(quoted_record)
                .or_else(|| quoted_record(&String::from_utf8_lossy(&body)));
        }
        obs.stage = "done".into();
        obs.outcome = if from_palisade || (from_proxy && status == 403) {
            Outcome::Refused
        } else {
            Outcome::Reached
        };
    }

    /// After a CONNECT 200 or a direct TCP connect: TLS hello, banner wait,
    /// or an HTTP request.
    async fn after_connect(&self, obs: &mut Observation, stream: &mut TcpStream, target: &Target) {
        match target {
            Target::Http {
                tls: false,
                host,
                port,
                path,
            } => {
                let host_header = self
                    .probe
                    .host_header
                    .clone()
                    .unwrap_or_else(|| host_for_request(host, *port, false));
                let req = format!(
                    "GET {path} HTTP/1.1\r\nHost: {host_header}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
                    self.marker
                );
                obs.stage = "request".into();
                self.http_exchange(obs, stream, req.as_bytes(), false).await
            }
            Target::Http {
                tls: true, host, ..
            } => self.tls_hello(obs, stream, host).await,
            Target::Tls { sni, .. } => self.tls_hello(obs, stream, sni).await,
            Target::Tcp { .. } => {
                obs.stage = "response".into();
                let window = self.left().min(TCP_READ_WINDOW);
                let r = read_reply(stream, window, false).await;
                obs.bytes_received += r.total;
                obs.stage = "done".into();
                match (r.total, r.end) {
                    (n, _) if n > 0 => obs.outcome = Outcome::Reached,
                    (_, "timeout") => {
                        obs.outcome = Outcome::Reached;
                        obs.error_detail = Some("connection open and silent".into());
                    }
                    (_, end) => obs.fail(
                        Outcome::Refused,
                        if end == "reset" { "reset" } else { "closed" },
                        "closed with no bytes",
                    ),
                }
            }
            _ => {}
        }
    }

    async fn tls_hello(&self, obs: &mut Observation, stream: &mut TcpStream, sni: &str) {
        let sni = sni.trim_start_matches('[').trim_end_matches(']');
        let sni = (sni.parse::<IpAddr>().is_err()).then_some(sni);
        let hello = client_hello(sni);
        obs.stage = "request".into();
        if let Err(e) = stream.write_all(&hello).await {
            return obs.io_fail(Outcome::Refused, &e);
        }
        obs.bytes_sent += hello.len() as u64;
        obs.stage = "response".into();
        let r = read_reply(stream, self.left().min(Duration::from_secs(4)), true).await;
        obs.bytes_received += r.total;
        let tls = match r.data.first() {
            Some(0x16) => "server_hello",
            Some(0x15) => "alert",
            Some(_) => "not_tls",
            None if r.end == "timeout" => "no_reply",
            None => "closed",
        };
        obs.tls = Some(tls.into());
        obs.stage = "done".into();
        match tls {
            "server_hello" | "alert" | "not_tls" => obs.outcome = Outcome::Reached,
            "no_reply" => obs.fail(Outcome::Failed, "timeout", "no reply to the ClientHello"),
            _ => obs.fail(
                Outcome::Refused,
                if r.end == "reset" { "reset" } else { "closed" },
                "closed after the ClientHello, no reply",
            ),
        }
    }

    async fn direct(&self, obs: &mut Observation, target: &Target) {
        let Some((host, port)) = target.host_port() else {
            return;
        };
        obs.stage = "resolve".into();
        let ip = match self.probe.resolve {
            Some(ip) => ip,
            None => match normalize_host(host.trim_start_matches('[').trim_end_matches(']')) {
                Ok(Host::Ip(ip)) => ip,
                Ok(Host::Name(name)) => match self.resolve_name(obs, &name).await {
                    Some(ip) => ip,
                    None => return,
                },
                Err(e) => return obs.fail(Outcome::SetupFailed, "bad_target", &e.to_string()),
            },
        };
        obs.resolved.push(ip.to_string());
        let addr = SocketAddr::new(ip, port);
        obs.stage = "connect".into();
        let socket = match if ip.is_ipv6() {
            tokio::net::TcpSocket::new_v6()
        } else {
            tokio::net::TcpSocket::new_v4()
        } {
            Ok(s) => s,
            Err(e) => return obs.io_fail(Outcome::SetupFailed, &e),
        };
        // Bind first so the local port is known even when the connect fails.
        let any: SocketAddr = if ip.is_ipv6() {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let _ = socket.bind(any);
        let mut sock = Sock {
            purpose: "target".into(),
            proto: "tcp".into(),
            local: None,
            remote: addr.to_string(),
        };
        let connecting = socket.connect(addr);
        let connected = timeout(self.left(), connecting).await;
        let mut stream = match connected {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                obs.sockets.push(sock);
                return obs.io_fail(Outcome::Failed, &e);
            }
            Err(_) => {
                obs.sockets.push(sock);
                return obs.fail(Outcome::Failed, "timeout", "TCP connect timed out");
            }
        };
        sock.local = stream.local_addr().ok().map(|a| a.to_string());
        obs.sockets.push(sock);
        obs.connected = true;
        self.after_connect(obs, &mut stream, target).await;
    }

    /// Resolve a name for a direct probe through the plan's resolver.
    async fn resolve_name(&self, obs: &mut Observation, name: &str) -> Option<IpAddr> {
        let Some(server) = self.resolver else {
            obs.fail(
                Outcome::SetupFailed,
                "resolve_failed",
                "no resolver: set `resolver` or `resolve` in the plan",
            );
            return None;
        };
        let budget = self.left().min(Duration::from_secs(3));
        match dns_query(server, name, "A", budget).await {
            Ok(r) => {
                obs.sockets.push(Sock {
                    purpose: "resolve".into(),
                    proto: "udp".into(),
                    local: r.local.map(|a| a.to_string()),
                    remote: server.to_string(),
                });
                obs.dns_rcode = Some(r.rcode.clone());
                obs.dns_ede = r.ede.clone();
                let ip = r
                    .answers
                    .iter()
                    .find_map(|a| a.strip_prefix("A ").and_then(|ip| ip.parse().ok()));
                if ip.is_none() {
                    obs.palisade_record = r.ede.as_deref().and_then(quoted_record);
                    if obs.palisade_record.is_some() {
                        obs.fail(
                            Outcome::Refused,
                            "resolve_failed",
                            &format!("the resolver refused the name: {}", r.rcode),
                        );
                    } else {
                        obs.fail(
                            Outcome::SetupFailed,
                            "resolve_failed",
                            &format!("the name did not resolve: {}", r.rcode),
                        );
                    }
                }
                obs.dns_answers = r.answers;
                ip
            }
            Err((local, e)) => {
                obs.sockets.push(Sock {
                    purpose: "resolve".into(),
                    proto: "udp".into(),
                    local: local.map(|a| a.to_string()),
                    remote: server.to_string(),
                });
                obs.fail(
                    Outcome::SetupFailed,
                    "resolve_failed",
                    &format!("no answer from {server}: {e}"),
                );
                None
            }
        }
    }
}

fn header(headers: &[(String, String)], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

struct DnsReply {
    local: Option<SocketAddr>,
    rcode: String,
    answers: Vec<String>,
    ede: Option<String>,
    sent: u64,
    received: u64,
}

/// One DNS query over UDP, EDNS on (so an Extended DNS Error comes back).
async fn dns_query(
    server: SocketAddr,
    name: &str,
    qtype: &str,
    wait: Duration,
) -> Result<DnsReply, (Option<SocketAddr>, io::Error)> {
    use hickory_server::proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_server::proto::rr::{Name, RData, RecordType};
    use std::str::FromStr;
    let bad = |e: String| (None, io::Error::new(io::ErrorKind::InvalidInput, e));
    let qname = Name::from_ascii(format!("{name}.")).map_err(|e| bad(e.to_string()))?;
    let rtype = RecordType::from_str(qtype).map_err(|e| bad(e.to_string()))?;
    let id = u16::from_be_bytes(random_bytes::<2>());
    let mut msg = Message::new(id, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = true;
    msg.add_query(Query::query(qname, rtype));
    let mut edns = Edns::new();
    edns.set_max_payload(1232);
    msg.set_edns(edns);
    let bytes = msg.to_vec().map_err(|e| bad(e.to_string()))?;
    let bind: SocketAddr = if server.is_ipv6() {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(bind).await.map_err(|e| (None, e))?;
    sock.connect(server).await.map_err(|e| (None, e))?;
    let local = sock.local_addr().ok();
    sock.send(&bytes).await.map_err(|e| (local, e))?;
    let mut buf = vec![0u8; 4096];
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let n = match timeout(left, sock.recv(&mut buf)).await {
            Err(_) => {
                return Err((
                    local,
                    io::Error::new(io::ErrorKind::TimedOut, "no DNS reply"),
                ))
            }
            Ok(Err(e)) => return Err((local, e)),
            Ok(Ok(n)) => n,
        };
        let Ok(reply) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        if reply.metadata.id != id || reply.metadata.message_type != MessageType::Response {
            continue;
        }
        let answers = reply
            .answers
            .iter()
            .map(|r| match &r.data {
                RData::A(a) => format!("A {}", a.0),
                RData::AAAA(a) => format!("AAAA {}", a.0),
                other => format!("{} {}", r.record_type(), other),
            })
            .collect();
        let ede = reply.edns.as_ref().and_then(|e| {
            e.options().options.iter().find_map(|(_, o)| match o {
                hickory_server::proto::rr::rdata::opt::EdnsOption::Unknown(15, data)
                    if data.len() >= 2 =>
                {
                    Some(format!(
                        "{}: {}",
                        u16::from_be_bytes([data[0], data[1]]),
                        String::from_utf8_lossy(&data[2..])
                    ))
                }
                _ => None,
            })
        });
        return Ok(DnsReply {
            local,
            rcode: format!("{:?}", reply.metadata.response_code),
            answers,
            ede,
            sent: bytes.len() as u64,
            received: n as u64,
        });
    }
}

/// A TLS 1.3 (and 1.2) ClientHello with `sni` (none when None). Enough for
/// a TLS server to answer with a ServerHello, and for Palisade to read the
/// SNI; nothing after it is ever sent.
pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
    fn ext(out: &mut Vec<u8>, typ: u16, data: &[u8]) {
        out.extend_from_slice(&typ.to_be_bytes());
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(data);
    }
    let mut exts = Vec::new();
    if let Some(name) = sni {
        let n = name.as_bytes();
        let mut d = Vec::new();
        d.extend_from_slice(&((n.len() + 3) as u16).to_be_bytes());
        d.push(0);
        d.extend_from_slice(&(n.len() as u16).to_be_bytes());
        d.extend_from_slice(n);
        ext(&mut exts, 0, &d);
    }
    ext(&mut exts, 10, &[0, 4, 0, 0x1d, 0, 0x17]); // supported_groups: x25519, secp256r1
    ext(&mut exts, 11, &[1, 0]); // ec_point_formats: uncompressed
    ext(
        &mut exts,
        13,
        &[0, 16, 4, 3, 8, 4, 4, 1, 5, 3, 8, 5, 5, 1, 8, 6, 6, 1], // signature_algorithms
    );
    ext(
        &mut exts,
        16,
        &[0, 9, 8, b'h', b't', b't', b'p', b'/', b'1', b'.', b'1'],
    ); // ALPN
    ext(&mut exts, 43, &[4, 3, 4, 3, 3]); // supported_versions: 1.3, 1.2
    ext(&mut exts, 45, &[1, 1]); // psk_key_exchange_modes: psk_dhe_ke
    let mut ks = vec![0, 36, 0, 0x1d, 0, 32];
    ks.extend_from_slice(&random_bytes::<32>());
    ext(&mut exts, 51, &ks); // key_share: x25519
    let mut body = vec![3, 3];
    body.extend_from_slice(&random_bytes::<32>());
    body.push(32);
    body.extend_from_slice(&random_bytes::<32>());
    let suites: [u16; 7] = [0x1301, 0x1302, 0x1303, 0xc02f, 0xc02b, 0xc030, 0xc02c];
    body.extend_from_slice(&((suites.len() * 2) as u16).to_be_bytes());
    for s in suites {
        body.extend_from_slice(&s.to_be_bytes());
    }
    body.extend_from_slice(&[1, 0]);
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(&exts);
    let mut hs = vec![1];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

/// The first `nameserver` of /etc/resolv.conf.
fn system_resolver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver")).then(|| {
            w.next()?
                .parse::<IpAddr>()
                .ok()
                .map(|ip| SocketAddr::new(ip, 53))
        })?
    })
}

/// Run a command for at most 2 s; its stdout (bounded), or why not.
fn command_output(prog: &str, args: &[&str]) -> String {
    use std::process::{Command, Stdio};
    let child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return format!("({prog} unavailable: {e})"),
    };
    let end = Instant::now() + Duration::from_secs(2);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return format!("({prog} did not finish within 2 s)");
            }
        }
    }
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        let mut buf = Vec::new();
        let _ = io::Read::read_to_end(&mut io::Read::take(&mut s, 16 * 1024), &mut buf);
        out = String::from_utf8_lossy(&buf).into_owned();
    }
    out
}

fn read_small(path: &str) -> String {
    match std::fs::read(path) {
        Ok(mut b) => {
            b.truncate(16 * 1024);
            String::from_utf8_lossy(&b).into_owned()
        }
        Err(e) => format!("(unreadable: {e})"),
    }
}

/// Facts about the sandbox the probes ran in.
fn environment(resolver: Option<SocketAddr>) -> serde_json::Value {
    let lines = |s: String| -> Vec<String> {
        s.lines()
            .map(str::to_string)
            .filter(|l| !l.trim().is_empty())
            .collect()
    };
    let proxy_env: serde_json::Map<String, serde_json::Value> = [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
    ]
    .iter()
    .filter_map(|k| {
        std::env::var(k)
            .ok()
            .map(|v| (k.to_string(), serde_json::Value::String(v)))
    })
    .collect();
    serde_json::json!({
        "hostname": read_small("/proc/sys/kernel/hostname").trim(),
        "kernel": read_small("/proc/sys/kernel/osrelease").trim(),
        "uid": read_small("/proc/self/status").lines().find(|l| l.starts_with("Uid:")).unwrap_or("").to_string(),
        "addresses": lines(command_output("ip", &["-o", "addr", "show"]))
            .into_iter()
            .map(|l| l.split('\\').next().unwrap_or("").split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>(),
        "routes_v4": lines(command_output("ip", &["-4", "route", "show", "table", "all"])),
        "routes_v6": lines(command_output("ip", &["-6", "route", "show", "table", "all"])),
        "resolv_conf": lines(read_small("/etc/resolv.conf")).into_iter().filter(|l| !l.starts_with('#')).collect::<Vec<_>>(),
        "resolver_used": resolver.map(|r| r.to_string()),
        "proxy_env": proxy_env,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_hello_carries_the_sni_palisade_reads() {
        use crate::proto::client_hello::{parse, Parse};
        let hello = client_hello(Some("allowed.test"));
        match parse(&hello) {
            Parse::Done { hello: h, len } => {
                assert_eq!(h.sni.as_deref(), Some("allowed.test"));
                assert_eq!(len, hello.len());
            }
            other => panic!("{other:?}"),
        }
        match parse(&client_hello(None)) {
            Parse::Done { hello: h, .. } => assert_eq!(h.sni, None),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn record_ids_are_found_in_replies() {
        assert_eq!(
            quoted_record(
                "palisade; error=http_request_denied; details=\"no_matching_rule; record=6b0d-0\""
            )
            .as_deref(),
            Some("6b0d-0")
        );
        assert_eq!(
            quoted_record("palisade: denied: x (evidence record ab-12)\n").as_deref(),
            Some("ab-12")
        );
        assert_eq!(
            quoted_record("15: palisade: no_matching_rule; record=ff-3").as_deref(),
            Some("ff-3")
        );
        assert_eq!(quoted_record("nothing"), None);
    }
}
