//! The probe plan: its TOML format, its targets, and its validation. A
//! default plan is generated from a policy by `probe plan` (the `generate`
//! module, which depends on this one).
//!
//! ```toml
//! org = "acme"                    # informational: the org the sandbox belongs to
//! policy = "62f2…"                # informational: the policy hash agreed on
//! run = "1f2e3d4c"                # this plan's nonce (8 hex digits): markers are pp-<run>-<n>
//! issued = "2030-01-01T12:00:00Z" # when the plan was made: no earlier record counts
//! proxy = "198.18.1.1:3128"       # explicit proxy for `via = "proxy"` probes
//! resolver = "198.18.1.1:53"      # DNS server for names of direct probes and for dns: probes
//! timeout = "5s"                  # per probe (default 5s, at most 60s)
//! deadline = "300s"               # whole run (default 300s, at most 1h)
//!
//! [[probe]]
//! id = "allow-api"                # unique; a-z 0-9 - _ (1-48)
//! target = "https://api.example.com/v1"
//! via = "proxy"                   # or "direct"
//! expect = "allow"                # or "deny"
//! layer = "palisade"              # deny probes: who must stop it ("palisade", or "any")
//! # proxy = "..."                 # per-probe proxy
//! # server = "1.1.1.1:53"         # dns: probes: ask this server instead of `resolver`
//! # resolve = "198.18.2.10"       # direct probes: dial this address instead of resolving
//! # host_header = "other.example" # http:// probes: send this Host header
//! # second_host = "other.example" # http:// probes: a second request, same connection, this Host
//! # silence = "1500ms"            # tls:// and https:// probes: stay silent this long first
//! # ech = true                    # tls:// and https:// probes: ClientHello with an ECH extension
//! # request = true                # https:// probes: full handshake, then the HTTP request
//! # note = "why this probe"
//!
//! [[probe]]
//! id = "names-1"                  # the name channel under *.wild.test
//! target = "dns-burst:{random}.{marker}.wild.test/A?count=30&budget=10"
//! via = "direct"                  # dns-burst: direct, expect deny only
//! expect = "deny"
//! ```
//!
//! The in-tunnel probes (what a tunnel carries once it is open):
//!
//! - `second_host`: the first request (Host from the target, or
//!   `host_header`) is sent with `Connection: keep-alive`; after its
//!   response, a second request naming `second_host` goes on the same
//!   connection. Through the proxy this uses a CONNECT tunnel (an
//!   absolute-form request is decided request by request anyway).
//! - `silence`: the client sends nothing for this long once the tunnel (or
//!   the direct connection) is open, then its ClientHello. The probe's time
//!   budget is `timeout` plus `silence`.
//! - `ech`: the ClientHello carries an `encrypted_client_hello` extension
//!   (see [`super::hello`]).
//! - `request`: the TLS handshake is completed (the certificate is **not**
//!   verified: the question is whether the request reaches its target, and
//!   Palisade's answer is checked against its signed evidence) and the HTTP
//!   request is sent inside; needed where Palisade intercepts.
//!
//! Targets: `http://host[:port]/path`, `https://host[:port]/path`,
//! `tcp://host:port`, `tls://host:port[?sni=NAME]`, `dns:NAME[/TYPE]`,
//! `udp://ip:port`, `dns-burst:NAME/TYPE?count=N&budget=B` (NAME with
//! `{random}`: N queries, each for a new name, see [`burst_name`]).
//! `{marker}` in a target, `host_header` or `second_host` is replaced by
//! the probe's marker, `pp-<run>-<n>` (n: the probe's place in the plan,
//! 4 digits), so that a record naming it can only be of this plan's probe
//! ([`Plan::marker`]). `run` and `issued` are what make a plan fresh: the
//! report refuses a plan without them, and counts no record written before
//! `issued` (see `fit`).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Expect, Layer, Via};

/// Per-probe timeout when the plan names none.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// Whole-run deadline when the plan names none.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);
const MAX_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_DEADLINE: Duration = Duration::from_secs(3600);
/// Longest `silence` of a probe.
const MAX_SILENCE: Duration = Duration::from_secs(60);
/// Probes in one plan.
pub(crate) const MAX_PROBES: usize = 2000;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub org: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// The plan's nonce, fresh per plan: 8 lower-case hex digits, the
    /// `<run>` of every probe's marker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// When the plan was made (RFC 3339): a record written before it
    /// (less [`super::fit::SKEW`]) is of an earlier run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolver: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    #[serde(default, rename = "probe")]
    pub probes: Vec<Probe>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Probe {
    pub id: String,
    pub target: String,
    pub via: Via,
    pub expect: Expect,
    #[serde(default, skip_serializing_if = "Layer::is_default")]
    pub layer: Layer,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolve: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_header: Option<String>,
    /// http:// targets: a second request on the same connection naming this Host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second_host: Option<String>,
    /// tls:// and https:// targets: stay silent this long before the ClientHello.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silence: Option<String>,
    /// tls:// and https:// targets: an `encrypted_client_hello` extension.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ech: bool,
    /// https:// targets: complete the handshake and send the request.
    #[serde(default, skip_serializing_if = "is_false")]
    pub request: bool,
    /// A volume probe: move `budget` plus [`VOLUME_MARGIN`] bytes
    /// this way through the target (`up`: sent, `down`: read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<Flow>,
    /// The volume budget (bytes) the plan agrees for that direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Probe {
    /// A probe of `target` with no options.
    pub fn new(id: &str, target: &str, via: Via, expect: Expect) -> Probe {
        Probe {
            id: id.into(),
            target: target.into(),
            via,
            expect,
            layer: Layer::Palisade,
            proxy: None,
            server: None,
            resolve: None,
            host_header: None,
            second_host: None,
            silence: None,
            ech: false,
            request: false,
            volume: None,
            budget: None,
            note: None,
        }
    }

    /// The time a probe gets on top of the plan's `timeout`: its
    /// `silence`, and for a `dns-burst` probe [`BURST_TIME_PER_NAME`] per
    /// name.
    pub fn extra_time(&self) -> Duration {
        let burst = match parse_target(&self.target.replace(MARKER, SAMPLE_MARKER)) {
            Ok(Target::DnsBurst { count, .. }) => BURST_TIME_PER_NAME * count,
            _ => Duration::ZERO,
        };
        self.silence() + burst + volume_time(self)
    }

    /// The probe as run with `marker`: `{marker}` replaced in its target,
    /// `host_header` and `second_host`.
    pub fn marked(&self, marker: &str) -> Probe {
        let sub = |v: &Option<String>| v.as_ref().map(|h| h.replace(MARKER, marker));
        Probe {
            target: self.target.replace(MARKER, marker),
            host_header: sub(&self.host_header),
            second_host: sub(&self.second_host),
            ..self.clone()
        }
    }

    /// The validated `silence` (zero when none).
    pub fn silence(&self) -> Duration {
        self.silence
            .as_deref()
            .and_then(|t| parse_duration(t, MAX_SILENCE, "silence").ok())
            .unwrap_or(Duration::ZERO)
    }
}

/// The placeholder for a probe's marker.
pub(crate) const MARKER: &str = "{marker}";
/// A marker of the shape every marker has, for validating a plan.
pub(crate) const SAMPLE_MARKER: &str = "pp-00000000-0000";

/// Whether `run` is a plan nonce: 8 lower-case hex digits.
pub(crate) fn is_run_nonce(run: &str) -> bool {
    run.len() == 8
        && run
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The marker of the `n`th probe of a run with nonce `run`.
pub(crate) fn marker(run: &str, n: usize) -> String {
    format!("pp-{run}-{n:04}")
}

/// A parsed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `http://` (tls false) or `https://` (tls true). `host` is as written
    /// (IP spellings are kept verbatim for the proxy to judge).
    Http {
        tls: bool,
        host: String,
        port: u16,
        path: String,
    },
    Tcp {
        host: String,
        port: u16,
    },
    Tls {
        host: String,
        port: u16,
        sni: String,
    },
    Dns {
        name: String,
        qtype: String,
    },
    /// `dns-burst:TEMPLATE/TYPE?count=N&budget=B`: N queries, each for
    /// TEMPLATE with `{random}` replaced by a fresh label (see
    /// [`burst_name`]); B is the new-name budget the plan agrees on for
    /// the wildcard (0: none, names leave unbounded).
    DnsBurst {
        template: String,
        qtype: String,
        count: u32,
        budget: u32,
    },
    Udp {
        addr: SocketAddr,
    },
}

impl Target {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Target::Http { tls: false, .. } => "http",
            Target::Http { tls: true, .. } => "https",
            Target::Tcp { .. } => "tcp",
            Target::Tls { .. } => "tls",
            Target::Dns { .. } => "dns",
            Target::DnsBurst { .. } => "dns-burst",
            Target::Udp { .. } => "udp",
        }
    }

    /// Host and port connected to (None for dns and udp).
    pub(crate) fn host_port(&self) -> Option<(&str, u16)> {
        match self {
            Target::Http { host, port, .. }
            | Target::Tcp { host, port }
            | Target::Tls { host, port, .. } => Some((host, *port)),
            _ => None,
        }
    }

    /// Whether the target is an IPv6 address (any spelling Palisade treats as one).
    pub(crate) fn is_ipv6(&self) -> bool {
        match self {
            Target::Udp { addr } => addr.is_ipv6(),
            _ => self.host_port().is_some_and(|(h, _)| {
                h.starts_with('[') || h.parse::<std::net::Ipv6Addr>().is_ok()
            }),
        }
    }
}

fn split_authority(auth: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    let (host, port) =
        crate::proto::target::split_authority(auth, default_port).map_err(|e| e.to_string())?;
    if host.is_empty()
        || host
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"/?#@\"\\".contains(&b))
    {
        return Err(format!("bad host {host:?}"));
    }
    Ok((host.to_string(), port))
}

/// What a `dns-burst` probe gets per name on top of the plan's `timeout`.
pub(crate) const BURST_TIME_PER_NAME: Duration = Duration::from_millis(50);

/// The placeholder a `dns-burst:` template has for each name's own label.
pub(crate) const RANDOM: &str = "{random}";
/// Queries in one `dns-burst:` probe, at most.
pub(crate) const MAX_BURST: u32 = 1000;
/// What each `{random}` becomes: `r`, the name's index (4 digits), and 8
/// characters of base32 (13 in all), so a burst's names are distinct and
/// new to every resolver cache.
pub(crate) const RANDOM_LABEL_LEN: usize = 13;

/// The `index`th name of a burst: `template` with `{random}` replaced by
/// `r`, the index, and `random` (lower-case base32, 8 characters taken).
pub(crate) fn burst_name(template: &str, index: u32, random: &str) -> String {
    let tail: String = random.chars().take(8).collect();
    template.replace(RANDOM, &format!("r{index:04}{tail:0<8}"))
}

/// Whether `name` is one of a burst's names for `template` (with its
/// marker already substituted): the template with each `{random}` a label
/// of the shape [`burst_name`] makes. Case-blind (Palisade records names
/// lower-cased).
pub(crate) fn is_burst_name(template: &str, name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let template = template.to_ascii_lowercase();
    let mut rest = name.as_str();
    let mut parts = template.split(RANDOM).peekable();
    let Some(first) = parts.next() else {
        return false;
    };
    let Some(r) = rest.strip_prefix(first) else {
        return false;
    };
    rest = r;
    while let Some(part) = parts.next() {
        if rest.len() < RANDOM_LABEL_LEN || !rest.is_char_boundary(RANDOM_LABEL_LEN) {
            return false;
        }
        let (label, r) = rest.split_at(RANDOM_LABEL_LEN);
        let ok = label.starts_with('r')
            && label[1..5].bytes().all(|b| b.is_ascii_digit())
            && label[5..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b) || b == b'0');
        if !ok {
            return false;
        }
        let Some(r) = r.strip_prefix(part) else {
            return false;
        };
        rest = r;
        if parts.peek().is_none() {
            return rest.is_empty();
        }
    }
    rest.is_empty()
}

/// `dns-burst:TEMPLATE/TYPE?count=N&budget=B` (after `{marker}` substitution).
fn parse_burst(rest: &str) -> Result<Target, String> {
    let (head, query) = rest
        .split_once('?')
        .ok_or("dns-burst needs ?count=N&budget=B")?;
    let (template, qtype) = match head.split_once('/') {
        Some((n, t)) => (n, t.to_ascii_uppercase()),
        None => (head, "A".to_string()),
    };
    if !template.contains(RANDOM) {
        return Err(format!("dns-burst name {template:?} has no {RANDOM}"));
    }
    let sample = burst_name(template, 0, "aaaaaaaa");
    if sample.len() > 253
        || sample.bytes().any(|b| b <= b' ' || b >= 0x7f)
        || sample.split('.').any(|l| l.is_empty() || l.len() > 63)
    {
        return Err(format!("bad dns-burst name {template:?}"));
    }
    if !matches!(qtype.as_str(), "A" | "AAAA") {
        return Err(format!("dns-burst query type {qtype:?}: only A or AAAA"));
    }
    let (mut count, mut budget) = (None, None);
    for pair in query.split('&') {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("bad query {pair:?}"))?;
        let n: u32 = v
            .parse()
            .map_err(|_| format!("{k} = {v:?}: not a number"))?;
        match k {
            "count" if count.is_none() => count = Some(n),
            "budget" if budget.is_none() => budget = Some(n),
            _ => return Err(format!("bad query {pair:?} (only count=N&budget=B)")),
        }
    }
    let count = count.ok_or("dns-burst needs count=N")?;
    let budget = budget.ok_or("dns-burst needs budget=B (0: no budget)")?;
    if !(1..=MAX_BURST).contains(&count) {
        return Err(format!("count = {count} out of range 1-{MAX_BURST}"));
    }
    Ok(Target::DnsBurst {
        template: template.trim_end_matches('.').to_ascii_lowercase(),
        qtype,
        count,
        budget,
    })
}

/// Parse a target (after `{marker}` substitution).
pub(crate) fn parse_target(input: &str) -> Result<Target, String> {
    if input.len() > 2048 {
        return Err("target longer than 2048 bytes".into());
    }
    if let Some(rest) = input.strip_prefix("dns-burst:") {
        return parse_burst(rest);
    }
    if let Some(rest) = input.strip_prefix("dns:") {
        let (name, qtype) = match rest.split_once('/') {
            Some((n, t)) => (n, t.to_ascii_uppercase()),
            None => (rest, "A".to_string()),
        };
        if name.is_empty() || name.len() > 253 || name.bytes().any(|b| b <= b' ' || b >= 0x7f) {
            return Err(format!("bad DNS name {name:?}"));
        }
        if !matches!(
            qtype.as_str(),
            "A" | "AAAA" | "TXT" | "MX" | "CNAME" | "HTTPS" | "SVCB" | "NS" | "ANY" | "NULL"
        ) {
            return Err(format!("unsupported query type {qtype:?}"));
        }
        return Ok(Target::Dns {
            name: name.trim_end_matches('.').to_string(),
            qtype,
        });
    }
    let (scheme, rest) = input
        .split_once("://")
        .ok_or_else(|| format!("{input:?}: expected SCHEME://... or dns:NAME"))?;
    match scheme {
        "http" | "https" => {
            let tls = scheme == "https";
            let (auth, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, "/"),
            };
            let (host, port) = split_authority(auth, Some(if tls { 443 } else { 80 }))?;
            if path.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                return Err("path must be printable ASCII without spaces".into());
            }
            Ok(Target::Http {
                tls,
                host,
                port,
                path: path.to_string(),
            })
        }
        "tcp" => {
            let (host, port) = split_authority(rest.trim_end_matches('/'), None)?;
            Ok(Target::Tcp { host, port })
        }
        "tls" => {
            let (auth, query) = match rest.split_once('?') {
                Some((a, q)) => (a, Some(q)),
                None => (rest, None),
            };
            let (host, port) = split_authority(auth.trim_end_matches('/'), Some(443))?;
            let sni = match query {
                None => host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
                Some(q) => q
                    .strip_prefix("sni=")
                    .filter(|s| {
                        !s.is_empty() && s.len() <= 253 && s.bytes().all(|b| b > b' ' && b < 0x7f)
                    })
                    .ok_or_else(|| format!("bad query {q:?} (only sni=NAME)"))?
                    .to_string(),
            };
            Ok(Target::Tls { host, port, sni })
        }
        "udp" => {
            let addr: SocketAddr = rest
                .trim_end_matches('/')
                .parse()
                .map_err(|_| format!("udp target needs ip:port, got {rest:?}"))?;
            Ok(Target::Udp { addr })
        }
        other => Err(format!("unknown scheme {other:?}")),
    }
}

/// A duration in the plan ("5s", "300ms", "2m").
pub(crate) fn parse_duration(s: &str, max: Duration, what: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{what} {s:?}: {e}"))?;
    if d.is_zero() || d > max {
        return Err(format!("{what} {s:?}: must be above 0 and at most {max:?}"));
    }
    Ok(d)
}

impl Plan {
    /// Parse and validate a plan.
    pub fn from_toml(src: &str) -> Result<Plan, String> {
        let plan: Plan = toml::from_str(src).map_err(|e| e.to_string())?;
        plan.validate()?;
        Ok(plan)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
            .as_deref()
            .and_then(|t| parse_duration(t, MAX_TIMEOUT, "timeout").ok())
            .unwrap_or(DEFAULT_TIMEOUT)
    }

    /// The marker of the plan's `n`th probe: `pp-<run>-<n>`; none when the
    /// plan names no `run` (the runner then picks one, which the report
    /// does not accept).
    pub fn marker(&self, n: usize) -> Option<String> {
        self.run.as_deref().map(|run| marker(run, n))
    }

    /// When the plan was issued, if it says.
    pub fn issued_at(&self) -> Option<std::time::SystemTime> {
        self.issued
            .as_deref()
            .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
            .as_deref()
            .and_then(|t| parse_duration(t, MAX_DEADLINE, "deadline").ok())
            .unwrap_or(DEFAULT_DEADLINE)
    }

    /// Check every probe (what `from_toml` does after parsing).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.timeout {
            parse_duration(t, MAX_TIMEOUT, "timeout")?;
        }
        if let Some(t) = &self.deadline {
            parse_duration(t, MAX_DEADLINE, "deadline")?;
        }
        if let Some(run) = &self.run {
            if !is_run_nonce(run) {
                return Err(format!("run = {run:?}: must be 8 lower-case hex digits"));
            }
        }
        if let Some(t) = &self.issued {
            humantime::parse_rfc3339_weak(t)
                .map_err(|e| format!("issued = {t:?}: not an RFC 3339 time: {e}"))?;
        }
        if self.probes.is_empty() {
            return Err("the plan has no [[probe]]".into());
        }
        if self.probes.len() > MAX_PROBES {
            return Err(format!("more than {MAX_PROBES} probes"));
        }
        let mut seen = std::collections::HashSet::new();
        for p in &self.probes {
            let ctx = |e: String| format!("probe {:?}: {e}", p.id);
            if p.id.is_empty()
                || p.id.len() > 48
                || !p
                    .id
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            {
                return Err(ctx("id must be 1-48 of a-z 0-9 - _".into()));
            }
            if !seen.insert(p.id.as_str()) {
                return Err(ctx("duplicate id".into()));
            }
            let target = parse_target(&p.target.replace(MARKER, SAMPLE_MARKER)).map_err(ctx)?;
            if p.via == Via::Proxy {
                if p.proxy.or(self.proxy).is_none() {
                    return Err(ctx(
                        "via = \"proxy\" needs `proxy` (in the probe or the plan)".into(),
                    ));
                }
                if matches!(
                    target,
                    Target::Dns { .. } | Target::DnsBurst { .. } | Target::Udp { .. }
                ) {
                    return Err(ctx(format!(
                        "{} targets cannot go through the proxy: use via = \"direct\"",
                        target.kind()
                    )));
                }
            }
            if p.host_header.is_some() && !matches!(target, Target::Http { tls: false, .. }) {
                return Err(ctx("host_header only applies to http:// targets".into()));
            }
            for (what, h) in [
                ("host_header", &p.host_header),
                ("second_host", &p.second_host),
            ] {
                if let Some(h) = h {
                    let h = h.replace(MARKER, SAMPLE_MARKER);
                    if h.is_empty() || h.len() > 255 || h.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                        return Err(ctx(format!("bad {what}")));
                    }
                }
            }
            if p.second_host.is_some() && !matches!(target, Target::Http { tls: false, .. }) {
                return Err(ctx("second_host only applies to http:// targets".into()));
            }
            let hello = matches!(target, Target::Tls { .. })
                || matches!(target, Target::Http { tls: true, .. }) && !p.request;
            if let Some(t) = &p.silence {
                parse_duration(t, MAX_SILENCE, "silence").map_err(ctx)?;
                if !hello {
                    return Err(ctx(
                        "silence only applies to tls:// and https:// targets (without request)"
                            .into(),
                    ));
                }
            }
            if p.ech && !hello {
                return Err(ctx(
                    "ech only applies to tls:// and https:// targets (without request)".into(),
                ));
            }
            if p.request && !matches!(target, Target::Http { tls: true, .. }) {
                return Err(ctx("request only applies to https:// targets".into()));
            }
            validate_volume(p, &target).map_err(ctx)?;
            if matches!(target, Target::DnsBurst { .. }) && p.expect != Expect::Deny {
                return Err(ctx(
                    "dns-burst probes expect \"deny\" (names past the budget refused)".into(),
                ));
            }
        }
        Ok(())
    }

    /// The plan as TOML (the format `from_toml` reads), through its serde
    /// form; each line of `header` becomes a comment above it.
    pub fn to_toml(&self, header: &str) -> Result<String, toml::ser::Error> {
        let body = toml::to_string(self)?;
        let mut out: String = header.lines().map(|l| format!("# {l}\n")).collect();
        out.push_str(&body);
        Ok(out)
    }
}

/// Which way a volume probe moves its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flow {
    /// Client to upstream (`max_bytes_up`).
    Up,
    /// Upstream to client (`max_bytes_down`).
    Down,
}

impl Flow {
    pub fn as_str(self) -> &'static str {
        match self {
            Flow::Up => "up",
            Flow::Down => "down",
        }
    }
}

/// What a budget may be passed by, as documented in
/// `docs/decisions.md` ("The slack"): one transfer of a tunnel, at most
/// one splice of 256 KiB (a copy reads at most 64 KiB; a request body
/// never passes its budget).
pub(crate) const VOLUME_SLACK: u64 = 256 * 1024;

/// What a volume probe tries to move past its budget: twice the slack,
/// so that a budget not enforced shows as more than budget plus slack.
pub(crate) const VOLUME_MARGIN: u64 = 2 * VOLUME_SLACK;

/// The largest budget a probe sends through: a larger one is not run
/// (the probe reports why), so that a run stays within minutes.
pub(crate) const MAX_VOLUME_BUDGET: u64 = 256 * 1024 * 1024;

/// The rate a volume probe's time is planned for, on top of the plan's
/// `timeout`: 16 MiB a second (256 MiB in 16 s).
const PLANNED_RATE: u64 = 16 * 1024 * 1024;

/// The bytes a volume probe moves: its budget plus [`VOLUME_MARGIN`].
pub(crate) fn volume_total(budget: u64) -> u64 {
    budget.saturating_add(VOLUME_MARGIN)
}

/// The time a volume probe gets on top of the plan's timeout.
pub(crate) fn volume_time(p: &Probe) -> std::time::Duration {
    match (p.volume, p.budget) {
        (Some(_), Some(b)) if b <= MAX_VOLUME_BUDGET => {
            std::time::Duration::from_millis(volume_total(b) * 1000 / PLANNED_RATE)
        }
        _ => std::time::Duration::ZERO,
    }
}

/// Why a budget is not sent, if it is not: over [`MAX_VOLUME_BUDGET`].
pub(crate) fn volume_too_large(budget: u64) -> Option<String> {
    (budget > MAX_VOLUME_BUDGET).then(|| {
        format!(
            "a budget of {budget} bytes is over the {} MiB a volume probe sends: not sent",
            MAX_VOLUME_BUDGET >> 20
        )
    })
}

/// The plan's rules for `volume` and `budget`.
pub(crate) fn validate_volume(p: &Probe, target: &Target) -> Result<(), String> {
    match (p.volume, p.budget) {
        (None, None) => return Ok(()),
        (None, Some(_)) => return Err("budget needs volume = \"up\" or \"down\"".into()),
        (Some(_), None) => return Err("volume needs budget (bytes)".into()),
        (Some(_), Some(0)) => return Err("budget must be at least 1 byte".into()),
        (Some(_), Some(_)) => {}
    }
    if !matches!(target, Target::Http { .. } | Target::Tcp { .. }) {
        return Err("volume only applies to http://, https:// and tcp:// targets".into());
    }
    if p.expect != Expect::Deny {
        return Err("volume probes expect \"deny\" (what passes the budget refused)".into());
    }
    if p.second_host.is_some() || p.silence.is_some() || p.ech || p.host_header.is_some() {
        return Err("volume does not combine with second_host, silence, ech or host_header".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field, and text that needs escaping, comes back as it was
    /// written; the header lines are comments. (Every option at once is no
    /// valid plan, so this reads the text back without validating it; the
    /// generated plans' tests read theirs through `from_toml`.)
    #[test]
    fn to_toml_parses_back_to_the_same_plan() {
        let mut full = Probe::new("a \"b\" \\ c", "https://a.test/x", Via::Proxy, Expect::Deny);
        full.layer = Layer::Any;
        full.proxy = Some("198.18.1.1:3128".parse().unwrap());
        full.server = Some("[2001:db8::1]:443".parse().unwrap());
        full.resolve = Some("198.18.2.2".parse().unwrap());
        full.host_header = Some("b.test".into());
        full.second_host = Some("c.test".into());
        full.silence = Some("2s".into());
        full.ech = true;
        full.request = true;
        full.note = Some("line one\nline 'two'\t\u{e9}".into());
        let plan = Plan {
            org: Some("acme".into()),
            policy: Some("sha256:00".into()),
            run: Some("0a1b2c3d".into()),
            issued: Some("2030-01-01T12:00:00Z".into()),
            proxy: Some("198.18.1.1:3128".parse().unwrap()),
            resolver: Some("198.18.1.1:53".parse().unwrap()),
            timeout: Some("5s".into()),
            deadline: Some("5m".into()),
            probes: vec![
                full,
                Probe::new("plain", "dns:a.test/A", Via::Direct, Expect::Allow),
            ],
        };
        let text = plan.to_toml("first\nsecond").unwrap();
        assert!(text.starts_with("# first\n# second\n"), "{text}");
        let back: Plan = toml::from_str(&text).unwrap();
        assert_eq!(
            serde_json::to_value(&back).unwrap(),
            serde_json::to_value(&plan).unwrap(),
            "{text}"
        );
        // Options left out are not written.
        let bare = Plan {
            probes: vec![Probe::new("p", "dns:a.test/A", Via::Direct, Expect::Allow)],
            ..plan
        };
        let text = bare.to_toml("").unwrap();
        for key in ["layer", "server", "ech", "request", "note", "silence"] {
            assert!(!text.contains(key), "{key} in {text}");
        }
    }

    #[test]
    fn targets_parse() {
        assert_eq!(
            parse_target("https://a.test/x").unwrap(),
            Target::Http {
                tls: true,
                host: "a.test".into(),
                port: 443,
                path: "/x".into()
            }
        );
        assert_eq!(
            parse_target("tls://a.test:8443?sni=b.test").unwrap(),
            Target::Tls {
                host: "a.test".into(),
                port: 8443,
                sni: "b.test".into()
            }
        );
        assert_eq!(
            parse_target("tcp://[::1]:22").unwrap(),
            Target::Tcp {
                host: "[::1]".into(),
                port: 22
            }
        );
        assert_eq!(
            parse_target("dns:x.test/txt").unwrap(),
            Target::Dns {
                name: "x.test".into(),
                qtype: "TXT".into()
            }
        );
        assert!(parse_target("udp://1.2.3.4:53").is_ok());
        for bad in [
            "tcp://a.test",
            "ftp://x/",
            "http://a b/",
            "tls://a:1?x=y",
            "dns:",
            "udp://name:1",
            "http://:80/",
        ] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
        assert!(parse_target("http://[::ffff:1.2.3.4]/").unwrap().is_ipv6());
    }

    #[test]
    fn burst_targets_parse_and_their_names_are_recognised() {
        let t =
            parse_target("dns-burst:{random}.pp-1-0003.Wild.test/A?count=30&budget=10").unwrap();
        assert_eq!(
            t,
            Target::DnsBurst {
                template: "{random}.pp-1-0003.wild.test".into(),
                qtype: "A".into(),
                count: 30,
                budget: 10
            }
        );
        assert_eq!(t.kind(), "dns-burst");
        let tpl = "{random}.pp-1-0003.wild.test";
        let a = burst_name(tpl, 7, "abcd2345xyz");
        assert_eq!(a, "r0007abcd2345.pp-1-0003.wild.test");
        assert_eq!(a.split('.').next().unwrap().len(), RANDOM_LABEL_LEN);
        assert!(is_burst_name(tpl, &a));
        assert!(is_burst_name(tpl, &format!("{}.", a.to_uppercase())));
        for other in [
            "r0007abcd2345.pp-1-0004.wild.test",
            "www.wild.test",
            "r0007abcd2345.pp-1-0003.wild.test.evil",
            "r000xabcd2345.pp-1-0003.wild.test",
            "r0007abcd234.pp-1-0003.wild.test",
            "x.r0007abcd2345.pp-1-0003.wild.test",
            "r0007abcd2345x.pp-1-0003.wild.test",
        ] {
            assert!(!is_burst_name(tpl, other), "{other}");
        }
        // Two placeholders, and one with text around it in its label.
        let two = "{random}.x{random}.w.test";
        assert!(is_burst_name(two, "r0001aaaaaaaa.xr0002bbbbbbbb.w.test"));
        assert!(!is_burst_name(two, "r0001aaaaaaaa.r0002bbbbbbbb.w.test"));
        assert_eq!(
            parse_target("dns-burst:{random}.w.test?budget=0&count=1").unwrap(),
            Target::DnsBurst {
                template: "{random}.w.test".into(),
                qtype: "A".into(),
                count: 1,
                budget: 0
            }
        );
        for bad in [
            "dns-burst:{random}.w.test/A",
            "dns-burst:x.w.test/A?count=3&budget=1",
            "dns-burst:{random}.w.test/TXT?count=3&budget=1",
            "dns-burst:{random}.w.test/A?count=0&budget=1",
            "dns-burst:{random}.w.test/A?count=1001&budget=1",
            "dns-burst:{random}.w.test/A?count=3",
            "dns-burst:{random}.w.test/A?count=3&budget=-1",
            "dns-burst:{random}.w.test/A?count=3&budget=1&count=4",
            "dns-burst:{random}.w.test/A?count=3&budget=1&sni=x",
            "dns-burst:{random}..w.test/A?count=3&budget=1",
            "dns-burst:{random}.w test/A?count=3&budget=1",
        ] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
        // A burst is direct, expected denied past its budget, and its
        // names get time on top of the timeout.
        let with = |via: &str, expect: &str| {
            Plan::from_toml(&format!(
                "proxy = \"198.18.1.1:3128\"\n[[probe]]\nid = \"n\"\n\
                 target = \"dns-burst:{{random}}.{{marker}}.w.test/A?count=40&budget=10\"\n\
                 via = \"{via}\"\nexpect = \"{expect}\"\n"
            ))
        };
        let plan = with("direct", "deny").unwrap();
        assert_eq!(plan.probes[0].extra_time(), BURST_TIME_PER_NAME * 40);
        assert!(with("proxy", "deny").is_err());
        assert!(with("direct", "allow").is_err());
    }

    #[test]
    fn a_plan_names_its_run_and_its_markers() {
        let head = "proxy = \"198.18.1.1:3128\"\n";
        let probes = "[[probe]]\nid = \"a\"\ntarget = \"http://{marker}.c.test/p/{marker}\"\nvia = \"proxy\"\nexpect = \"deny\"\n\
                      host_header = \"h.{marker}.test\"\n\
                      [[probe]]\nid = \"b\"\ntarget = \"http://a.test/\"\nvia = \"proxy\"\nexpect = \"deny\"\n\
                      second_host = \"{marker}.c.test\"\n";
        let plan = Plan::from_toml(&format!(
            "{head}run = \"0a1b2c3d\"\nissued = \"2030-01-01T12:00:00Z\"\n{probes}"
        ))
        .unwrap();
        assert_eq!(plan.marker(1).as_deref(), Some("pp-0a1b2c3d-0001"));
        assert_eq!(
            plan.issued_at(),
            humantime::parse_rfc3339_weak("2030-01-01T12:00:00Z").ok()
        );
        let a = plan.probes[0].marked("pp-0a1b2c3d-0000");
        assert_eq!(
            a.target,
            "http://pp-0a1b2c3d-0000.c.test/p/pp-0a1b2c3d-0000"
        );
        assert_eq!(a.host_header.as_deref(), Some("h.pp-0a1b2c3d-0000.test"));
        let b = plan.probes[1].marked("pp-0a1b2c3d-0001");
        assert_eq!(b.second_host.as_deref(), Some("pp-0a1b2c3d-0001.c.test"));
        // Without them the plan still runs (the report refuses it).
        let bare = Plan::from_toml(&format!("{head}{probes}")).unwrap();
        assert_eq!(bare.marker(0), None);
        for bad in [
            "run = \"0A1B2C3D\"\n",
            "run = \"0a1b2c3\"\n",
            "run = \"0a1b2c3d0\"\n",
            "run = \"pp-0a1b\"\n",
            "issued = \"yesterday\"\n",
        ] {
            assert!(
                Plan::from_toml(&format!("{head}{bad}{probes}")).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn plans_validate() {
        let ok = "proxy = \"198.18.1.1:3128\"\n[[probe]]\nid = \"a\"\ntarget = \"https://x.test/\"\nvia = \"proxy\"\nexpect = \"allow\"\n";
        assert!(Plan::from_toml(ok).is_ok());
        assert!(Plan::from_toml(&ok.replace("proxy = \"198.18.1.1:3128\"\n", "")).is_err());
        assert!(Plan::from_toml(&format!("{ok}bogus = 1\n")).is_err());
        assert!(Plan::from_toml(&format!(
            "{ok}[[probe]]\nid = \"a\"\ntarget = \"dns:x\"\nvia = \"direct\"\nexpect = \"deny\"\n"
        ))
        .is_err());
        assert!(Plan::from_toml("").is_err());
        // The in-tunnel options, each on the targets it applies to.
        let with = |target: &str, extra: &str| {
            Plan::from_toml(&format!(
                "proxy = \"198.18.1.1:3128\"\n[[probe]]\nid = \"a\"\ntarget = \"{target}\"\nvia = \"proxy\"\nexpect = \"deny\"\n{extra}\n"
            ))
        };
        for (target, extra) in [
            ("tls://a.test:443?sni=b.test", "silence = \"1500ms\""),
            ("https://a.test/", "silence = \"2s\"\nech = true"),
            ("tls://a.test:443", "ech = true"),
            ("http://a.test/x", "second_host = \"b.test\""),
            (
                "http://a.test/x",
                "second_host = \"b.test\"\nhost_header = \"a.test\"",
            ),
            ("https://a.test/api/%69nternal", "request = true"),
        ] {
            assert!(with(target, extra).is_ok(), "{target} {extra}");
        }
        for (target, extra) in [
            ("http://a.test/", "silence = \"1s\""),
            ("https://a.test/", "silence = \"1s\"\nrequest = true"),
            ("tls://a.test:443", "silence = \"61s\""),
            ("tls://a.test:443", "silence = \"soon\""),
            ("tcp://a.test:22", "ech = true"),
            ("https://a.test/", "ech = true\nrequest = true"),
            ("https://a.test/", "second_host = \"b.test\""),
            ("http://a.test/", "second_host = \"b test\""),
            ("http://a.test/", "request = true"),
            ("tls://a.test:443", "request = true"),
        ] {
            assert!(with(target, extra).is_err(), "{target} {extra}");
        }
    }

    #[test]
    fn plans_validate_volume_probes() {
        let t = |s: &str| parse_target(s).unwrap();
        let mut p = Probe::new("v", "tcp://h:7001", crate::probe::Via::Proxy, Expect::Deny);
        assert!(validate_volume(&p, &t(&p.target)).is_ok());
        p.volume = Some(Flow::Up);
        assert!(validate_volume(&p, &t(&p.target))
            .unwrap_err()
            .contains("budget"));
        p.budget = Some(0);
        assert!(validate_volume(&p, &t(&p.target)).is_err());
        p.budget = Some(1024);
        assert!(validate_volume(&p, &t(&p.target)).is_ok());
        assert!(validate_volume(&p, &t("tls://h:443?sni=x")).is_err());
        assert!(validate_volume(&p, &t("dns:h/A")).is_err());
        p.expect = Expect::Allow;
        assert!(validate_volume(&p, &t(&p.target)).is_err());
        p.expect = Expect::Deny;
        p.second_host = Some("x".into());
        assert!(validate_volume(&p, &t(&p.target)).is_err());
        p.second_host = None;
        assert_eq!(
            volume_time(&p),
            std::time::Duration::from_millis(volume_total(1024) * 1000 / PLANNED_RATE)
        );
        p.budget = Some(MAX_VOLUME_BUDGET + 1);
        assert_eq!(volume_time(&p), std::time::Duration::ZERO);
    }
}
