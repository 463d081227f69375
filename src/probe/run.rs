//! `palisade probe run`: perform each probe of a plan with real sockets,
//! inside the sandbox, and record what the client observed.
//!
//! Probes run one after another (so each one's evidence falls in its own
//! time window), each within the plan's `timeout` and all within its
//! `deadline`; a probe the deadline leaves no time for is recorded as not
//! run. Nothing here decides anything: the report joins these observations
//! with Palisade's evidence.
//!
//! Markers: every probe gets `pp-<run>-<n>`, `<run>` the plan's nonce
//! (a plan without one: this run's own). It is sent where it is
//! harmless and recorded by Palisade: the request path (plans put
//! `/palisade-probe/{marker}` there) and an `X-Palisade-Probe` header for
//! HTTP, the `X-Palisade-Probe` header of a CONNECT, and any DNS label the
//! plan puts `{marker}` in. Every socket's local address is recorded too,
//! which is how TLS, TCP and DNS probes are matched to evidence, and how
//! denials inside an open tunnel (no 403 to quote a record id) are.
//!
//! In-tunnel probes (plan options `second_host`, `silence`, `ech`,
//! `request`) record what followed the part a plain probe stops at: the
//! reply to the second request, the connection closing during the silence,
//! the response inside a completed handshake.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::timeout;

use super::hello::{self, Hello};
use super::plan::{parse_target, Plan, Probe, Target};
use super::plan::{volume_too_large, volume_total, Flow};
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
/// How long a reply to a ClientHello, or to the second request of a
/// `second_host` probe, is waited for.
const REPLY_WINDOW: Duration = Duration::from_secs(4);

/// What the client saw, in one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeOutcome {
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
    /// `connect_response`, `silence`, `request`, `response`,
    /// `second_request`, `second_response`, `done`.
    pub stage: String,
    pub outcome: ProbeOutcome,
    /// `silence` probes: how long the client stayed silent (ms), and when
    /// the connection was closed during that silence (ms after it opened).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silence_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_in_silence_ms: Option<u64>,
    /// `ech` probes: the ClientHello carried an encrypted_client_hello extension.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ech: bool,
    /// `host_header` probes: the Host header sent instead of the target's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_header: Option<String>,
    /// `second_host` probes: the second request's Host, its response status,
    /// and what followed it: `answered`, `closed`, `reset`, `silent`,
    /// `not_sent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second_host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second_status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second: Option<String>,
    /// `second_host` probes: the first response said `Connection: close`,
    /// or the connection was seen closed before the second request went out
    /// (an upstream that does not keep connections alive cannot answer it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub first_close: bool,
    /// `request` probes: the TLS handshake completed (certificate not verified).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub handshake: bool,
    /// `dns-burst` probes: each name sent, in order, and what the client
    /// saw for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<SentName>,
    /// Volume probes: the direction, the agreed budget, and the bytes the
    /// client moved that way (its count: sent up, or read down).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<Flow>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_moved: Option<u64>,
}

/// One name a `dns-burst` probe sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SentName {
    pub name: String,
    /// `answered` (any reply but a refusal: the lab's upstream knows none
    /// of the names, so NXDOMAIN is the usual answer), `refused` (REFUSED,
    /// or NXDOMAIN with an Extended DNS Error), `timeout`, `error`.
    pub result: String,
    pub rcode: Option<String>,
    /// The record reference the shim quoted in its EDE, if any.
    pub record: Option<String>,
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
pub(crate) async fn run(plan: &Plan, plan_text: &str) -> Observations {
    use sha2::Digest;
    let run_id = data_encoding::HEXLOWER.encode(&random_bytes::<4>());
    let started = now_text();
    let t0 = Instant::now();
    let deadline = t0 + plan.deadline();
    let per_probe = plan.timeout();
    let resolver = plan.resolver.or_else(system_resolver);
    let mut observations = Vec::with_capacity(plan.probes.len());
    for (n, probe) in plan.probes.iter().enumerate() {
        // The plan's own markers when it names its run (the report accepts
        // no others); a plan without one gets this run's.
        let marker = plan
            .marker(n)
            .unwrap_or_else(|| super::plan::marker(&run_id, n));
        let probe = &probe.marked(&marker);
        let left = deadline.saturating_duration_since(Instant::now());
        // A probe's silence (a burst's time per name) is on top of its timeout.
        let budget = (per_probe + probe.extra_time()).min(left);
        let mut obs = Observation::new(probe, &marker, plan);
        if budget < Duration::from_millis(200) {
            obs.fail(
                ProbeOutcome::SetupFailed,
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
                        ProbeOutcome::SetupFailed
                    } else {
                        ProbeOutcome::Failed
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
        plan_sha256: data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(plan_text.as_bytes())),
        plan: plan.clone(),
        started,
        finished: now_text(),
        environment: environment(resolver),
        observations,
    }
}

impl Observation {
    /// The observation of `probe` (its `{marker}`s already replaced by `marker`).
    fn new(probe: &Probe, marker: &str, plan: &Plan) -> Observation {
        let target = probe.target.clone();
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
            outcome: ProbeOutcome::Failed,
            silence_ms: None,
            closed_in_silence_ms: None,
            ech: false,
            host_header: probe.host_header.clone(),
            second_host: None,
            second_status: None,
            second: None,
            first_close: false,
            handshake: false,
            names: Vec::new(),
            volume: probe.volume,
            budget: probe.budget,
            volume_moved: None,
        }
    }

    pub(crate) fn fail(&mut self, outcome: ProbeOutcome, error: &str, detail: &str) {
        self.outcome = outcome;
        self.error = Some(error.into());
        self.error_detail = Some(detail.chars().take(300).collect());
    }

    pub(crate) fn io_fail(&mut self, outcome: ProbeOutcome, e: &io::Error) {
        let kind = error_kind(e);
        self.fail(outcome, kind, &e.to_string());
    }
}

/// A short, stable name for an I/O error.
pub(crate) fn error_kind(e: &io::Error) -> &'static str {
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

async fn read_reply<S: AsyncRead + Unpin>(
    stream: &mut S,
    window: Duration,
    stop_at_tls_record: bool,
) -> Reply {
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
pub(crate) async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
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

/// `record=REF` or `evidence record REF` in a text from Palisade (a
/// record's reference; older instances quoted its id).
pub(crate) fn quoted_record(text: &str) -> Option<String> {
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

/// How long a `dns-burst` probe waits for each answer.
const BURST_WAIT: Duration = Duration::from_secs(2);

/// Add a socket to the observation, once per local address (a burst
/// opens one per name: the sockets listed are bounded by its count).
fn push_socket(obs: &mut Observation, purpose: &str, local: SocketAddr, remote: SocketAddr) {
    let local = local.to_string();
    if !obs
        .sockets
        .iter()
        .any(|s| s.local.as_deref() == Some(local.as_str()))
    {
        obs.sockets.push(Sock {
            purpose: purpose.into(),
            proto: "udp".into(),
            local: Some(local),
            remote: remote.to_string(),
        });
    }
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

    /// A volume probe's direction and the bytes it moves.
    fn volume(&self) -> Option<(Flow, u64)> {
        Some((self.probe.volume?, volume_total(self.probe.budget?)))
    }

    /// A volume probe once connected (through a tunnel, or direct): raw
    /// bytes for `tcp://`, one request for `http://`, and for `https://`
    /// one request inside a completed TLS handshake.
    async fn move_volume(
        &self,
        obs: &mut Observation,
        stream: &mut TcpStream,
        target: &Target,
        flow: (Flow, u64),
    ) {
        let (tls, host, port, path) = match target {
            Target::Http {
                tls,
                host,
                port,
                path,
            } => (*tls, host, *port, path),
            _ => return move_bytes(obs, stream, Speech::Raw, flow, self.until).await,
        };
        let head = volume_head(
            flow.0,
            path,
            &host_for_request(host, port, tls),
            self.marker,
            flow.1,
        );
        if !tls {
            return move_bytes(obs, stream, Speech::Http { head }, flow, self.until).await;
        }
        if let Some(mut tls) = self.handshake(obs, stream, host).await {
            move_bytes(obs, &mut tls, Speech::Http { head }, flow, self.until).await;
        }
    }

    async fn perform(&self, obs: &mut Observation) {
        let target = match parse_target(&obs.target) {
            Ok(t) => t,
            Err(e) => {
                obs.fail(ProbeOutcome::SetupFailed, "bad_target", &e);
                return;
            }
        };
        if let Some(why) = self.probe.budget.and_then(volume_too_large) {
            return obs.fail(ProbeOutcome::SetupFailed, "not_run", &why);
        }
        match (&target, self.probe.via) {
            (Target::Dns { name, qtype }, _) => {
                let Some(server) = self.probe.server.or(self.resolver) else {
                    obs.fail(
                        ProbeOutcome::SetupFailed,
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
                            ProbeOutcome::Reached
                        } else if refused || r.rcode == "Refused" {
                            ProbeOutcome::Refused
                        } else {
                            // NXDOMAIN/NODATA/SERVFAIL without a refusal: a resolver answered.
                            ProbeOutcome::Reached
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
                        obs.io_fail(ProbeOutcome::Failed, &e);
                    }
                }
            }
            (
                Target::DnsBurst {
                    template,
                    qtype,
                    count,
                    ..
                },
                _,
            ) => self.burst(obs, template, qtype, *count).await,
            (Target::Udp { addr }, _) => self.udp(obs, *addr).await,
            (_, Via::Proxy) => self.via_proxy(obs, &target).await,
            (_, Via::Direct) => self.direct(obs, &target).await,
        }
    }

    /// A `dns-burst` probe: `count` queries, one after the other, each for
    /// a new name of `template`, each waited for at most [`BURST_WAIT`]
    /// (and all within the probe's time); the names the time left no room
    /// for are not sent (and not listed).
    async fn burst(&self, obs: &mut Observation, template: &str, qtype: &str, count: u32) {
        let Some(server) = self.probe.server.or(self.resolver) else {
            obs.fail(
                ProbeOutcome::SetupFailed,
                "resolve_failed",
                "no resolver: set `resolver` in the plan",
            );
            return;
        };
        obs.server = Some(server.to_string());
        obs.stage = "request".into();
        for i in 0..count {
            let left = self.left();
            if left < Duration::from_millis(50) {
                obs.error = Some("timeout".into());
                obs.error_detail =
                    Some(format!("{i} of {count} names sent within the probe's time"));
                break;
            }
            let random = data_encoding::BASE32_NOPAD
                .encode(&random_bytes::<5>())
                .to_ascii_lowercase();
            let name = super::plan::burst_name(template, i, &random);
            // Ends before the probe's own time does, so the last name's
            // fate is still written down.
            let wait = left
                .saturating_sub(Duration::from_millis(20))
                .min(BURST_WAIT);
            let sent = match dns_query(server, &name, qtype, wait).await {
                Ok(r) => {
                    obs.bytes_sent += r.sent;
                    obs.bytes_received += r.received;
                    if let Some(local) = r.local {
                        push_socket(obs, "dns", local, server);
                    }
                    let refused =
                        r.rcode == "Refused" || (r.rcode == "NXDomain" && r.ede.is_some());
                    SentName {
                        name,
                        result: if refused { "refused" } else { "answered" }.into(),
                        record: r.ede.as_deref().and_then(quoted_record),
                        rcode: Some(r.rcode),
                    }
                }
                Err((local, e)) => {
                    if let Some(local) = local {
                        push_socket(obs, "dns", local, server);
                    }
                    let timed_out = e.kind() == io::ErrorKind::TimedOut;
                    if local.is_none() {
                        // Never sent (no socket): not one of the names sent.
                        obs.io_fail(ProbeOutcome::SetupFailed, &e);
                        break;
                    }
                    SentName {
                        name,
                        result: if timed_out { "timeout" } else { "error" }.into(),
                        rcode: None,
                        record: None,
                    }
                }
            };
            obs.names.push(sent);
        }
        let has = |what: &str| obs.names.iter().any(|n| n.result == what);
        if obs.names.is_empty() {
            if obs.error.is_none() {
                obs.fail(ProbeOutcome::SetupFailed, "timeout", "no name sent");
            }
            obs.outcome = ProbeOutcome::SetupFailed;
            return;
        }
        obs.stage = "done".into();
        obs.outcome = if has("answered") {
            ProbeOutcome::Reached
        } else if has("refused") {
            ProbeOutcome::Refused
        } else {
            ProbeOutcome::Failed
        };
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
            Err(e) => return obs.io_fail(ProbeOutcome::SetupFailed, &e),
        };
        let connected = sock.connect(addr).await;
        obs.sockets.push(Sock {
            purpose: "udp".into(),
            proto: "udp".into(),
            local: sock.local_addr().ok().map(|a| a.to_string()),
            remote: addr.to_string(),
        });
        if let Err(e) = connected {
            return obs.io_fail(ProbeOutcome::Failed, &e);
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
            Err(e) => return obs.io_fail(ProbeOutcome::Failed, &e),
        }
        let mut buf = [0u8; 2048];
        match timeout(self.left(), sock.recv(&mut buf)).await {
            Ok(Ok(n)) => {
                obs.bytes_received = n as u64;
                obs.stage = "done".into();
                obs.outcome = ProbeOutcome::Reached;
            }
            Ok(Err(e)) => obs.io_fail(ProbeOutcome::Failed, &e),
            Err(_) => obs.fail(ProbeOutcome::Failed, "timeout", "no UDP reply"),
        }
    }

    async fn via_proxy(&self, obs: &mut Observation, target: &Target) {
        let Some(proxy) = obs
            .proxy
            .as_deref()
            .and_then(|p| p.parse::<SocketAddr>().ok())
        else {
            return obs.fail(ProbeOutcome::SetupFailed, "bad_target", "no proxy address");
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
                return obs.io_fail(ProbeOutcome::SetupFailed, &e);
            }
        };
        obs.sockets.push(Sock {
            purpose: "proxy".into(),
            proto: "tcp".into(),
            local: stream.local_addr().ok().map(|a| a.to_string()),
            remote: proxy.to_string(),
        });
        if let (
            Target::Http {
                tls: false,
                host,
                port,
                path,
            },
            None,
        ) = (target, &self.probe.second_host)
        {
            if let Some(flow) = self.volume() {
                let authority = host_for_request(host, *port, false);
                let absolute = format!("http://{host}:{port}{path}");
                let head = volume_head(flow.0, &absolute, &authority, self.marker, flow.1);
                return move_bytes(obs, &mut stream, Speech::Http { head }, flow, self.until).await;
            }
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
            return obs.io_fail(ProbeOutcome::Failed, &e);
        }
        obs.bytes_sent += req.len() as u64;
        let (status, headers, rest, n) = match read_head(&mut stream).await {
            Ok(v) => v,
            Err(e) => return obs.io_fail(ProbeOutcome::Failed, &e),
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
            obs.outcome = ProbeOutcome::Refused;
            return;
        }
        obs.connected = true;
        self.after_connect(obs, &mut stream, target).await;
    }

    async fn read_body<S: AsyncRead + Unpin>(
        &self,
        stream: &mut S,
        mut already: Vec<u8>,
    ) -> Vec<u8> {
        let window = self.left().min(Duration::from_secs(2));
        let r = read_reply(stream, window, false).await;
        already.extend_from_slice(&r.data);
        already.truncate(MAX_BODY);
        already
    }

    /// Send an HTTP request and read the response.
    async fn http_exchange<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        obs: &mut Observation,
        stream: &mut S,
        req: &[u8],
        from_proxy: bool,
    ) {
        if let Err(e) = stream.write_all(req).await {
            return obs.io_fail(ProbeOutcome::Failed, &e);
        }
        obs.bytes_sent += req.len() as u64;
        obs.stage = "response".into();
        let (status, headers, rest, n) = match read_head(stream).await {
            Ok(v) => v,
            Err(e) => {
                let outcome = if obs.via == Via::Direct {
                    ProbeOutcome::Refused
                } else {
                    ProbeOutcome::Failed
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
            ProbeOutcome::Refused
        } else {
            ProbeOutcome::Reached
        };
    }

    /// After a CONNECT 200 or a direct TCP connect: TLS hello, banner wait,
    /// or an HTTP request.
    async fn after_connect(&self, obs: &mut Observation, stream: &mut TcpStream, target: &Target) {
        if let Some(flow) = self.volume() {
            return self.move_volume(obs, stream, target, flow).await;
        }
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
                if let Some(second) = &self.probe.second_host {
                    return self
                        .second_request(obs, stream, path, &host_header, second)
                        .await;
                }
                let req = format!(
                    "GET {path} HTTP/1.1\r\nHost: {host_header}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
                    self.marker
                );
                obs.stage = "request".into();
                self.http_exchange(obs, stream, req.as_bytes(), false).await
            }
            Target::Http {
                tls: true,
                host,
                port,
                path,
            } if self.probe.request => self.tls_request(obs, stream, host, *port, path).await,
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
                    (n, _) if n > 0 => obs.outcome = ProbeOutcome::Reached,
                    (_, "timeout") => {
                        obs.outcome = ProbeOutcome::Reached;
                        obs.error_detail = Some("connection open and silent".into());
                    }
                    (_, end) => obs.fail(
                        ProbeOutcome::Refused,
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
        let silence = self.probe.silence();
        if !silence.is_zero() {
            self.stay_silent(obs, stream, silence).await;
        }
        obs.ech = self.probe.ech;
        let hello = client_hello(&Hello {
            sni,
            ech: self.probe.ech,
        });
        obs.stage = "request".into();
        if let Err(e) = stream.write_all(&hello).await {
            return obs.io_fail(ProbeOutcome::Refused, &e);
        }
        obs.bytes_sent += hello.len() as u64;
        obs.stage = "response".into();
        let r = read_reply(stream, self.left().min(REPLY_WINDOW), true).await;
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
            "server_hello" | "alert" | "not_tls" => obs.outcome = ProbeOutcome::Reached,
            "no_reply" => obs.fail(
                ProbeOutcome::Failed,
                "timeout",
                "no reply to the ClientHello",
            ),
            _ => obs.fail(
                ProbeOutcome::Refused,
                if r.end == "reset" { "reset" } else { "closed" },
                "closed after the ClientHello, no reply",
            ),
        }
    }

    /// Send nothing for `silence` once the connection is open, watching it:
    /// a close (the proxy giving up on a silent client) ends the wait early
    /// and is recorded; bytes from the far side are counted.
    async fn stay_silent(&self, obs: &mut Observation, stream: &mut TcpStream, silence: Duration) {
        obs.stage = "silence".into();
        obs.silence_ms = Some(silence.as_millis() as u64);
        let start = Instant::now();
        let r = read_reply(stream, silence.min(self.left()), false).await;
        obs.bytes_received += r.total;
        if r.end != "timeout" {
            obs.closed_in_silence_ms = Some(start.elapsed().as_millis() as u64);
        }
    }

    /// `second_host`: a keep-alive request naming the connection's host,
    /// then, on the same connection, one naming `second`. The outcome is
    /// the second request's: `Reached` if anything answered it.
    async fn second_request(
        &self,
        obs: &mut Observation,
        stream: &mut TcpStream,
        path: &str,
        first_host: &str,
        second: &str,
    ) {
        let req = |host: &str, connection: &str| {
            format!(
                "GET {path} HTTP/1.1\r\nHost: {host}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\nAccept: */*\r\nConnection: {connection}\r\n\r\n",
                self.marker
            )
        };
        obs.second_host = Some(second.to_string());
        obs.second = Some("not_sent".into());
        obs.stage = "request".into();
        let first = req(first_host, "keep-alive");
        if let Err(e) = stream.write_all(first.as_bytes()).await {
            return obs.io_fail(ProbeOutcome::Refused, &e);
        }
        obs.bytes_sent += first.len() as u64;
        obs.stage = "response".into();
        let window = self.left().min(REPLY_WINDOW);
        let (status, headers, rest, n) = match timeout(window, read_head(stream)).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return obs.io_fail(ProbeOutcome::Refused, &e),
            Err(_) => {
                return obs.fail(
                    ProbeOutcome::Failed,
                    "timeout",
                    "no response to the first request",
                )
            }
        };
        obs.bytes_received += n;
        obs.http_status = Some(status);
        obs.proxy_status = header(&headers, "proxy-status");
        if obs
            .proxy_status
            .as_deref()
            .is_some_and(|p| p.contains("error="))
        {
            // Palisade refused the first request already: the tunnel's own
            // decision, nothing left to try on it.
            let body = self.read_body(stream, rest).await;
            obs.palisade_record = obs
                .proxy_status
                .as_deref()
                .and_then(quoted_record)
                .or_else(|| quoted_record(&String::from_utf8_lossy(&body)));
            obs.stage = "done".into();
            obs.outcome = ProbeOutcome::Refused;
            return;
        }
        let length = header(&headers, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        obs.first_close = header(&headers, "connection")
            .is_some_and(|v| v.to_ascii_lowercase().contains("close"));
        self.drain_first_body(obs, stream, length, rest.len() as u64)
            .await;
        obs.stage = "second_request".into();
        let second_req = req(second, "close");
        if let Err(e) = stream.write_all(second_req.as_bytes()).await {
            let kind = if error_kind(&e) == "reset" {
                "reset"
            } else {
                "closed"
            };
            obs.second = Some(kind.into());
            obs.stage = "done".into();
            return obs.io_fail(ProbeOutcome::Refused, &e);
        }
        obs.bytes_sent += second_req.len() as u64;
        self.second_response(obs, stream).await;
    }

    /// The rest of the first response's body (by its length), read so that
    /// the second response is not confused with it; marks `first_close`
    /// when the connection ends on the way.
    async fn drain_first_body(
        &self,
        obs: &mut Observation,
        stream: &mut TcpStream,
        length: Option<u64>,
        mut have: u64,
    ) {
        // Read the rest of the first body (by its length), so that the
        // second response is not confused with it.
        match length {
            Some(len) => {
                let mut buf = [0u8; 8192];
                while have < len {
                    match timeout(self.left().min(REPLY_WINDOW), stream.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => {
                            obs.first_close = true;
                            break;
                        }
                        Ok(Ok(k)) => {
                            have += k as u64;
                            obs.bytes_received += k as u64;
                        }
                        Err(_) => break,
                    }
                }
            }
            None => {
                // No length: the body runs to the close (or to a short
                // silence); a second request cannot be told apart from it.
                let r =
                    read_reply(stream, self.left().min(Duration::from_millis(500)), false).await;
                obs.bytes_received += r.total;
                if r.end != "timeout" {
                    obs.first_close = true;
                }
            }
        }
    }

    /// The second request's response, and the outcome it makes.
    async fn second_response(&self, obs: &mut Observation, stream: &mut TcpStream) {
        obs.stage = "second_response".into();
        let window = self.left().min(REPLY_WINDOW);
        match timeout(window, read_head(stream)).await {
            Ok(Ok((status, headers, rest, n))) => {
                obs.bytes_received += n;
                obs.second_status = Some(status);
                obs.second = Some("answered".into());
                let proxy_status = header(&headers, "proxy-status");
                let body = self.read_body(stream, rest).await;
                obs.bytes_received += body.len() as u64;
                obs.stage = "done".into();
                if let Some(p) = proxy_status.filter(|p| p.contains("error=")) {
                    obs.palisade_record = quoted_record(&p)
                        .or_else(|| quoted_record(&String::from_utf8_lossy(&body)));
                    obs.proxy_status = Some(p);
                    obs.outcome = ProbeOutcome::Refused;
                } else {
                    obs.outcome = ProbeOutcome::Reached;
                }
            }
            Ok(Err(e)) => {
                let kind = error_kind(&e);
                let kind = if kind == "reset" { "reset" } else { "closed" };
                obs.second = Some(kind.into());
                obs.stage = "done".into();
                obs.fail(
                    ProbeOutcome::Refused,
                    kind,
                    &format!("no response to the second request: {e}"),
                );
            }
            Err(_) => {
                obs.second = Some("silent".into());
                obs.stage = "done".into();
                obs.fail(
                    ProbeOutcome::Failed,
                    "timeout",
                    "the connection stayed open with no response to the second request",
                );
            }
        }
    }

    /// `request`: complete a TLS handshake over `stream` (whoever answers
    /// it: the upstream, or Palisade intercepting) and send the request.
    async fn tls_request(
        &self,
        obs: &mut Observation,
        stream: &mut TcpStream,
        host: &str,
        port: u16,
        path: &str,
    ) {
        let Some(mut tls) = self.handshake(obs, stream, host).await else {
            return;
        };
        let host_header = self
            .probe
            .host_header
            .clone()
            .unwrap_or_else(|| host_for_request(host, port, true));
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {host_header}\r\n{MARKER_HEADER}: {}\r\nUser-Agent: palisade-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
            self.marker
        );
        self.http_exchange(obs, &mut tls, req.as_bytes(), false)
            .await
    }

    /// A TLS handshake over `stream` with `host`, the certificate not
    /// verified; None (the observation says why) when it did not complete.
    async fn handshake<'s>(
        &self,
        obs: &mut Observation,
        stream: &'s mut TcpStream,
        host: &str,
    ) -> Option<tokio_rustls::client::TlsStream<&'s mut TcpStream>> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let name = match rustls_pki_types::ServerName::try_from(bare.to_string()) {
            Ok(n) => n,
            Err(e) => {
                obs.fail(ProbeOutcome::SetupFailed, "bad_target", &e.to_string());
                return None;
            }
        };
        let config = match insecure_client_config() {
            Ok(c) => c,
            Err(e) => {
                obs.fail(ProbeOutcome::SetupFailed, "io", &e);
                return None;
            }
        };
        obs.stage = "request".into();
        let connector = tokio_rustls::TlsConnector::from(config);
        let tls = match timeout(self.left(), connector.connect(name, stream)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                let alert = e
                    .get_ref()
                    .and_then(|i| i.downcast_ref::<rustls::Error>())
                    .is_some_and(|r| matches!(r, rustls::Error::AlertReceived(_)));
                obs.tls = Some(if alert { "alert" } else { "closed" }.into());
                obs.stage = "done".into();
                // An alert is the far side answering; a close is not.
                let outcome = if alert {
                    ProbeOutcome::Reached
                } else {
                    ProbeOutcome::Refused
                };
                obs.fail(outcome, "tls", &format!("TLS handshake failed: {e}"));
                return None;
            }
            Err(_) => {
                obs.fail(ProbeOutcome::Failed, "timeout", "TLS handshake timed out");
                return None;
            }
        };
        obs.tls = Some("handshake".into());
        obs.handshake = true;
        Some(tls)
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
                Err(e) => return obs.fail(ProbeOutcome::SetupFailed, "bad_target", &e.to_string()),
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
            Err(e) => return obs.io_fail(ProbeOutcome::SetupFailed, &e),
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
                return obs.io_fail(ProbeOutcome::Failed, &e);
            }
            Err(_) => {
                obs.sockets.push(sock);
                return obs.fail(ProbeOutcome::Failed, "timeout", "TCP connect timed out");
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
                ProbeOutcome::SetupFailed,
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
                            ProbeOutcome::Refused,
                            "resolve_failed",
                            &format!("the resolver refused the name: {}", r.rcode),
                        );
                    } else {
                        obs.fail(
                            ProbeOutcome::SetupFailed,
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
                    ProbeOutcome::SetupFailed,
                    "resolve_failed",
                    &format!("no answer from {server}: {e}"),
                );
                None
            }
        }
    }
}

pub(crate) fn header(headers: &[(String, String)], name: &str) -> Option<String> {
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

/// The ClientHello a probe sends (see [`super::hello`]), with fresh random values.
pub(crate) fn client_hello(h: &Hello<'_>) -> Vec<u8> {
    // A failing OS RNG leaves zeros: nothing is ever encrypted with them.
    hello::build(
        h,
        &hello::Random::from_fn(|b| {
            let _ = getrandom::fill(b);
        }),
    )
}

/// Accepts any server certificate: `request` probes ask whether a request
/// reaches its target, not whom it reaches (an intercepting Palisade
/// answers with its own CA's leaf); Palisade's answer is checked against
/// its signed evidence instead.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls_pki_types::CertificateDer<'_>,
        _intermediates: &[rustls_pki_types::CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &rustls_pki_types::CertificateDer<'_>,
        _dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &rustls_pki_types::CertificateDer<'_>,
        _dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// TLS client settings of `request` probes: HTTP/1.1 only, any certificate.
fn insecure_client_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
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

// ---------------------------------------------------------------------
// Volume probes: the budget plus a margin, moved one way

/// How a volume probe speaks over its connection: raw bytes (`tcp://`),
/// or one HTTP request whose head is given (origin- or absolute-form).
enum Speech {
    Raw,
    Http { head: String },
}

/// The HTTP request head of a volume probe: a POST of `total` bytes up,
/// or a GET down; `target` is the request target (a path, or absolute).
fn volume_head(flow: Flow, target: &str, host: &str, marker: &str, total: u64) -> String {
    let method = match flow {
        Flow::Up => format!(
            "POST {target} HTTP/1.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {total}\r\n"
        ),
        Flow::Down => format!("GET {target} HTTP/1.1\r\nAccept: */*\r\n"),
    };
    format!(
        "{method}Host: {host}\r\n{}: {marker}\r\nUser-Agent: palisade-probe\r\nConnection: close\r\n\r\n",
        MARKER_HEADER
    )
}

/// The size of each write up, and each read down.
const VOLUME_CHUNK: usize = 16 * 1024;

/// Move `total` bytes `flow`'s way over `stream` until done, cut, or
/// `until`; what the client moved goes to `obs.volume_moved`, and the
/// outcome: `Reached` when all of it moved (and an HTTP answer was not
/// Palisade's), `Refused` when the connection was cut or Palisade
/// answered, `Failed` when time ran out first.
async fn move_bytes<S: AsyncRead + AsyncWrite + Unpin>(
    obs: &mut Observation,
    stream: &mut S,
    speech: Speech,
    (flow, total): (Flow, u64),
    until: Instant,
) {
    obs.stage = "request".into();
    let http = matches!(speech, Speech::Http { .. });
    if let Speech::Http { head } = &speech {
        if let Err(e) = stream.write_all(head.as_bytes()).await {
            return obs.io_fail(ProbeOutcome::Refused, &e);
        }
        obs.bytes_sent += head.len() as u64;
    }
    let mut error = None;
    let moved = match flow {
        Flow::Up => {
            let sent = send(stream, total, until, &mut error).await;
            obs.bytes_sent += sent;
            if !http {
                let _ = stream.shutdown().await;
            }
            sent
        }
        Flow::Down if http => 0,
        Flow::Down => {
            let got = receive(stream, total, until, &mut error).await;
            obs.bytes_received += got;
            got
        }
    };
    obs.volume_moved = Some(moved);
    obs.stage = "response".into();
    if http {
        return answer(obs, stream, (flow, total), until, error).await;
    }
    finish(obs, moved >= total, error);
}

/// `op`, unless `until` comes first (then `TimedOut`).
async fn by<T>(
    until: Instant,
    op: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    let left = until.saturating_duration_since(Instant::now());
    timeout(left, op)
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// Bytes up: chunks of filler until `total`, a failed write, or `until`.
async fn send<S: AsyncWrite + Unpin>(
    stream: &mut S,
    total: u64,
    until: Instant,
    error: &mut Option<io::Error>,
) -> u64 {
    let chunk = [0x5a_u8; VOLUME_CHUNK];
    let mut sent = 0u64;
    while sent < total {
        let n = usize::try_from(total - sent)
            .unwrap_or(VOLUME_CHUNK)
            .min(VOLUME_CHUNK);
        if let Err(e) = by(until, stream.write_all(&chunk[..n])).await {
            *error = Some(e);
            return sent;
        }
        sent += n as u64;
    }
    if let Err(e) = by(until, stream.flush()).await {
        *error = Some(e);
    }
    sent
}

/// Bytes down: read and count (not keep) until `total`, the end, or `until`.
async fn receive<S: AsyncRead + Unpin>(
    stream: &mut S,
    total: u64,
    until: Instant,
    error: &mut Option<io::Error>,
) -> u64 {
    let mut buf = vec![0u8; VOLUME_CHUNK];
    let mut got = 0u64;
    while got < total {
        match by(until, stream.read(&mut buf)).await {
            Ok(0) => {
                *error = Some(io::ErrorKind::UnexpectedEof.into());
                break;
            }
            Ok(n) => got += n as u64,
            Err(e) => {
                *error = Some(e);
                break;
            }
        }
    }
    got
}

/// An HTTP volume probe's answer: Palisade's refusal (429, with the
/// record it quotes), or the target's (a GET's body is then counted).
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    obs: &mut Observation,
    stream: &mut S,
    (flow, total): (Flow, u64),
    until: Instant,
    error: Option<io::Error>,
) {
    let window = until
        .saturating_duration_since(Instant::now())
        .min(Duration::from_secs(4));
    let (status, headers, rest, n) = match timeout(window, read_head(stream)).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return finish(obs, false, error.or(Some(e))),
        Err(_) => return finish(obs, false, error.or(Some(io::ErrorKind::TimedOut.into()))),
    };
    obs.bytes_received += n;
    obs.http_status = Some(status);
    obs.proxy_status = header(&headers, "proxy-status");
    if let Some(p) = obs.proxy_status.clone().filter(|p| p.contains("error=")) {
        obs.palisade_record = quoted_record(&p);
        obs.stage = "done".into();
        obs.outcome = ProbeOutcome::Refused;
        return;
    }
    if flow == Flow::Down {
        let mut error = None;
        let rest = rest.len() as u64;
        let got = rest + receive(stream, total.saturating_sub(rest), until, &mut error).await;
        obs.bytes_received += got;
        obs.volume_moved = Some(got);
        return finish(obs, got >= total, error);
    }
    finish(obs, error.is_none(), error);
}

/// The outcome once the bytes moved: all of them (`Reached`), cut
/// (`Refused`: closed or reset), or out of time (`Failed`).
fn finish(obs: &mut Observation, all: bool, error: Option<io::Error>) {
    obs.stage = "done".into();
    match error {
        _ if all => obs.outcome = ProbeOutcome::Reached,
        Some(e) if e.kind() == io::ErrorKind::TimedOut => obs.fail(
            ProbeOutcome::Failed,
            "timeout",
            "the probe's time ran out before its bytes moved",
        ),
        Some(e) => obs.io_fail(ProbeOutcome::Refused, &e),
        None => obs.fail(
            ProbeOutcome::Refused,
            "closed",
            "closed before all bytes moved",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst against a resolver that answers the first three names
    /// (NXDOMAIN), refuses the next three and then stays silent: each
    /// name sent is listed with what the client saw, distinct and of the
    /// template, and the time left ends the burst with the last name's
    /// timeout written down.
    #[tokio::test]
    async fn a_burst_lists_each_name_and_its_fate() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            for n in 0u32.. {
                let Ok((len, from)) = server.recv_from(&mut buf).await else {
                    return;
                };
                let mut reply = buf[..len].to_vec();
                if let Ok(m) = hickory_server::proto::op::Message::from_vec(&reply) {
                    log.lock().unwrap().push(m.queries[0].name().to_ascii());
                }
                if n >= 6 {
                    continue;
                }
                reply[2] |= 0x80;
                reply[3] = (reply[3] & 0xf0) | if n < 3 { 3 } else { 5 };
                let _ = server.send_to(&reply, from).await;
            }
        });
        let text = format!(
            "resolver = \"{addr}\"\ntimeout = \"1s\"\n[[probe]]\nid = \"n\"\n\
             target = \"dns-burst:{{random}}.{{marker}}.wild.test/A?count=40&budget=2\"\n\
             via = \"direct\"\nexpect = \"deny\"\n"
        );
        let plan = Plan::from_toml(&text).unwrap();
        let obs = run(&plan, &text).await.observations.remove(0);
        let results: Vec<&str> = obs.names.iter().map(|n| n.result.as_str()).collect();
        assert_eq!(
            results[..7],
            ["answered", "answered", "answered", "refused", "refused", "refused", "timeout"],
            "{:?}",
            obs.names
        );
        assert!(results[7..].iter().all(|r| *r == "timeout"), "{results:?}");
        // 1 s plus 50 ms a name: not all 40 (2 s a silent name at most).
        assert!(results.len() < 40, "{results:?}");
        assert_eq!(obs.outcome, ProbeOutcome::Reached);
        assert_eq!(obs.names[0].rcode.as_deref(), Some("NXDomain"));
        let template = format!("{{random}}.{}.wild.test", obs.marker);
        let names: std::collections::BTreeSet<&str> =
            obs.names.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names.len(), obs.names.len());
        assert!(names
            .iter()
            .all(|n| crate::probe::plan::is_burst_name(&template, n)));
        // What the resolver was asked is what the observation lists.
        let asked: Vec<String> = asked.lock().unwrap().clone();
        let listed: Vec<String> = obs.names.iter().map(|n| format!("{}.", n.name)).collect();
        assert_eq!(asked, listed);
        assert_eq!(
            crate::probe::classify::observed_text(&obs),
            format!(
                "{} names sent: 3 answered, 3 refused, {} no reply, error timeout",
                listed.len(),
                listed.len() - 6
            )
        );
    }

    #[test]
    fn client_hello_carries_the_sni_palisade_reads() {
        use crate::proto::client_hello::parse;
        use crate::proto::Parse;
        let hello = client_hello(&Hello {
            sni: Some("allowed.test"),
            ech: false,
        });
        match parse(&hello) {
            Parse::Done { value: h, len } => {
                assert_eq!(h.sni.as_deref(), Some("allowed.test"));
                assert_eq!(len, hello.len());
            }
            other => panic!("{other:?}"),
        }
        match parse(&client_hello(&Hello::default())) {
            Parse::Done { value: h, .. } => assert_eq!(h.sni, None),
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

    /// A stand-in proxy on loopback: accepts one CONNECT, answers 200, then
    /// plays `tunnel` on the client stream.
    async fn fake_proxy<F, Fut>(tunnel: F) -> SocketAddr
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let head = read_request_head(&mut s).await;
            assert!(head.starts_with("CONNECT "), "{head}");
            s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .unwrap();
            tunnel(s).await;
        });
        addr
    }

    async fn read_request_head(s: &mut TcpStream) -> String {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(1) => head.push(b[0]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }

    async fn run_one(proxy: SocketAddr, probe: &str) -> Observation {
        let text = format!(
            "proxy = \"{proxy}\"\ntimeout = \"2s\"\n[[probe]]\nid = \"p\"\nvia = \"proxy\"\nexpect = \"deny\"\n{probe}\n"
        );
        let plan = Plan::from_toml(&text).unwrap();
        run(&plan, &text).await.observations.remove(0)
    }

    const SECOND: &str =
        "target = \"http://allowed.test/palisade-probe/{marker}\"\nsecond_host = \"other.test\"";

    #[tokio::test]
    async fn second_request_closed_by_the_proxy() {
        let proxy = fake_proxy(|mut s| async move {
            let first = read_request_head(&mut s).await;
            assert!(first.contains("Host: allowed.test\r\n") && first.contains("keep-alive"));
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            let second = read_request_head(&mut s).await;
            assert!(second.contains("Host: other.test\r\n"), "{second}");
            // Dropped: closed before anything answers it.
        })
        .await;
        let o = run_one(proxy, SECOND).await;
        assert_eq!(o.http_status, Some(200));
        assert_eq!(o.second_host.as_deref(), Some("other.test"));
        assert_eq!(o.second.as_deref(), Some("closed"), "{o:?}");
        assert_eq!(o.outcome, ProbeOutcome::Refused);
        assert!(!o.first_close);
    }

    #[tokio::test]
    async fn second_request_answered_is_reached() {
        let proxy = fake_proxy(|mut s| async move {
            for body in ["one", "two"] {
                read_request_head(&mut s).await;
                let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{body}");
                s.write_all(resp.as_bytes()).await.unwrap();
            }
        })
        .await;
        let o = run_one(proxy, SECOND).await;
        assert_eq!(o.second.as_deref(), Some("answered"), "{o:?}");
        assert_eq!(o.second_status, Some(200));
        assert_eq!(o.outcome, ProbeOutcome::Reached);
    }

    #[tokio::test]
    async fn second_request_after_an_announced_close() {
        let proxy = fake_proxy(|mut s| async move {
            read_request_head(&mut s).await;
            s.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            let _ = s.shutdown().await;
            // Keep reading what the client still sends, as a proxy does.
            read_request_head(&mut s).await;
        })
        .await;
        let o = run_one(proxy, SECOND).await;
        assert!(o.first_close, "{o:?}");
        assert_eq!(o.second.as_deref(), Some("closed"));
        assert_eq!(o.outcome, ProbeOutcome::Refused);
    }

    #[tokio::test]
    async fn silence_is_kept_and_a_close_during_it_recorded() {
        let proxy = fake_proxy(|s| async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(s);
        })
        .await;
        let o = run_one(
            proxy,
            "target = \"tls://allowed.test:443?sni=other.test\"\nsilence = \"1500ms\"",
        )
        .await;
        assert_eq!(o.silence_ms, Some(1500));
        let closed = o.closed_in_silence_ms.expect("closed during the silence");
        assert!((250..1500).contains(&closed), "{closed}");
        assert_eq!(o.tls.as_deref(), Some("closed"));
        assert_eq!(o.outcome, ProbeOutcome::Refused);
    }

    #[tokio::test]
    async fn the_ech_hello_follows_the_silence() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let proxy = fake_proxy(|mut s| async move {
            let start = Instant::now();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            let _ = tx.send((start.elapsed(), buf[..n].to_vec()));
            // A ServerHello-looking record: the far side answered.
            s.write_all(&[0x16, 3, 3, 0, 0]).await.unwrap();
        })
        .await;
        let o = run_one(
            proxy,
            "target = \"tls://allowed.test:443\"\nsilence = \"400ms\"\nech = true",
        )
        .await;
        let (waited, hello) = rx.await.unwrap();
        assert!(waited >= Duration::from_millis(390), "{waited:?}");
        match crate::proto::client_hello::parse(&hello) {
            crate::proto::Parse::Done { value: hello, .. } => {
                assert!(hello.ech);
                assert_eq!(hello.sni.as_deref(), Some("allowed.test"));
            }
            other => panic!("{other:?}"),
        }
        assert!(o.ech && o.closed_in_silence_ms.is_none());
        assert_eq!(o.tls.as_deref(), Some("server_hello"));
        assert_eq!(o.outcome, ProbeOutcome::Reached);
    }

    /// A `request` probe completes the handshake with whatever certificate
    /// answers (here a self-signed one, as an intercepting Palisade's would
    /// be to the probe) and reads Palisade's refusal inside.
    #[tokio::test]
    async fn request_probes_complete_the_handshake_and_read_the_refusal() {
        use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let key = rcgen::generate_simple_self_signed(vec!["reg.test".to_string()]).unwrap();
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.signing_key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![key.cert.der().clone()], der)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let proxy = fake_proxy(|s| async move {
            let mut tls = acceptor.accept(s).await.unwrap();
            let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && tls.read(&mut b).await.unwrap_or(0) == 1 {
                head.push(b[0]);
            }
            let _ = tx.send((alpn, String::from_utf8_lossy(&head).into_owned()));
            let body = "palisade: denied: path_not_allowed (evidence record ab-7)\n";
            let resp = format!(
                "HTTP/1.1 403 Forbidden\r\nProxy-Status: palisade; error=http_request_denied; details=\"path_not_allowed; record=ab-7\"\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            tls.write_all(resp.as_bytes()).await.unwrap();
            let _ = tls.shutdown().await;
        })
        .await;
        let o = run_one(
            proxy,
            "target = \"https://reg.test/api/%69nternal\"\nrequest = true",
        )
        .await;
        let (alpn, head) = rx.await.unwrap();
        assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
        assert!(
            head.starts_with("GET /api/%69nternal HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("Host: reg.test\r\n"), "{head}");
        assert!(
            o.handshake && o.tls.as_deref() == Some("handshake"),
            "{o:?}"
        );
        assert_eq!(o.http_status, Some(403));
        assert_eq!(o.palisade_record.as_deref(), Some("ab-7"));
        assert_eq!(o.outcome, ProbeOutcome::Refused);
    }
}
