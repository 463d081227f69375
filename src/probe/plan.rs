//! The probe plan (TOML) and a default plan generated from a policy.
//!
//! ```toml
//! org = "acme"                    # informational: the org the sandbox belongs to
//! policy = "62f2…"                # informational: the policy hash agreed on
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
//! # note = "why this probe"
//! ```
//!
//! Targets: `http://host[:port]/path`, `https://host[:port]/path`,
//! `tcp://host:port`, `tls://host:port[?sni=NAME]`, `dns:NAME[/TYPE]`,
//! `udp://ip:port`. `{marker}` in a target is replaced by the probe's marker.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Expect, Layer, Via};
use crate::config::{Config, RuleTarget};

/// Per-probe timeout when the plan names none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// Whole-run deadline when the plan names none.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);
const MAX_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_DEADLINE: Duration = Duration::from_secs(3600);
/// Probes in one plan.
pub const MAX_PROBES: usize = 2000;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub org: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A parsed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
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
    Udp {
        addr: SocketAddr,
    },
}

impl Target {
    pub fn kind(&self) -> &'static str {
        match self {
            Target::Http { tls: false, .. } => "http",
            Target::Http { tls: true, .. } => "https",
            Target::Tcp { .. } => "tcp",
            Target::Tls { .. } => "tls",
            Target::Dns { .. } => "dns",
            Target::Udp { .. } => "udp",
        }
    }

    /// Host and port connected to (None for dns and udp).
    pub fn host_port(&self) -> Option<(&str, u16)> {
        match self {
            Target::Http { host, port, .. }
            | Target::Tcp { host, port }
            | Target::Tls { host, port, .. } => Some((host, *port)),
            _ => None,
        }
    }

    /// Whether the target is an IPv6 address (any spelling Palisade treats as one).
    pub fn is_ipv6(&self) -> bool {
        match self {
            Target::Udp { addr } => addr.is_ipv6(),
            _ => self.host_port().is_some_and(|(h, _)| {
                h.starts_with('[') || h.parse::<std::net::Ipv6Addr>().is_ok()
            }),
        }
    }
}

fn split_authority(auth: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    if auth.is_empty() {
        return Err("empty host".into());
    }
    let (host, port) = if let Some(rest) = auth.strip_prefix('[') {
        let end = rest.find(']').ok_or("unclosed [")?;
        let host = &auth[..end + 2];
        let tail = &rest[end + 1..];
        match tail.strip_prefix(':') {
            Some(p) => (host, Some(p)),
            None if tail.is_empty() => (host, None),
            None => return Err(format!("junk after ]: {tail:?}")),
        }
    } else {
        match auth.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (auth, None),
        }
    };
    let port = match port {
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("bad port {p:?}"))?,
        None => default_port.ok_or("a port is required")?,
    };
    if host.is_empty()
        || host
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"/?#@\"\\".contains(&b))
    {
        return Err(format!("bad host {host:?}"));
    }
    Ok((host.to_string(), port))
}

/// Parse a target (after `{marker}` substitution).
pub fn parse_target(input: &str) -> Result<Target, String> {
    if input.len() > 2048 {
        return Err("target longer than 2048 bytes".into());
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
pub fn parse_duration(s: &str, max: Duration, what: &str) -> Result<Duration, String> {
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

    pub fn deadline(&self) -> Duration {
        self.deadline
            .as_deref()
            .and_then(|t| parse_duration(t, MAX_DEADLINE, "deadline").ok())
            .unwrap_or(DEFAULT_DEADLINE)
    }

    fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.timeout {
            parse_duration(t, MAX_TIMEOUT, "timeout")?;
        }
        if let Some(t) = &self.deadline {
            parse_duration(t, MAX_DEADLINE, "deadline")?;
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
            let target =
                parse_target(&p.target.replace("{marker}", "pp-00000000-0000")).map_err(ctx)?;
            if p.via == Via::Proxy {
                if p.proxy.or(self.proxy).is_none() {
                    return Err(ctx(
                        "via = \"proxy\" needs `proxy` (in the probe or the plan)".into(),
                    ));
                }
                if matches!(target, Target::Dns { .. } | Target::Udp { .. }) {
                    return Err(ctx(format!(
                        "{} targets cannot go through the proxy: use via = \"direct\"",
                        target.kind()
                    )));
                }
            }
            if p.host_header.is_some() && !matches!(target, Target::Http { tls: false, .. }) {
                return Err(ctx("host_header only applies to http:// targets".into()));
            }
            if let Some(h) = &p.host_header {
                if h.is_empty() || h.len() > 255 || h.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                    return Err(ctx("bad host_header".into()));
                }
            }
        }
        Ok(())
    }

    /// The plan as TOML (the format `from_toml` reads).
    pub fn to_toml(&self, header: &str) -> String {
        let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let mut out = String::new();
        for line in header.lines() {
            let _ = writeln!(out, "# {line}");
        }
        let top: [(&str, Option<String>); 6] = [
            ("org", self.org.clone()),
            ("policy", self.policy.clone()),
            ("proxy", self.proxy.map(|a| a.to_string())),
            ("resolver", self.resolver.map(|a| a.to_string())),
            ("timeout", self.timeout.clone()),
            ("deadline", self.deadline.clone()),
        ];
        for (k, v) in top {
            if let Some(v) = v {
                let _ = writeln!(out, "{k} = {}", q(&v));
            }
        }
        for p in &self.probes {
            out.push_str("\n[[probe]]\n");
            let _ = writeln!(out, "id = {}", q(&p.id));
            let _ = writeln!(out, "target = {}", q(&p.target));
            let via = if p.via == Via::Proxy {
                "proxy"
            } else {
                "direct"
            };
            let _ = writeln!(out, "via = {}", q(via));
            let expect = if p.expect == Expect::Allow {
                "allow"
            } else {
                "deny"
            };
            let _ = writeln!(out, "expect = {}", q(expect));
            if p.layer == Layer::Any {
                out.push_str("layer = \"any\"\n");
            }
            let opt: [(&str, Option<String>); 5] = [
                ("proxy", p.proxy.map(|a| a.to_string())),
                ("server", p.server.map(|a| a.to_string())),
                ("resolve", p.resolve.map(|a| a.to_string())),
                ("host_header", p.host_header.clone()),
                ("note", p.note.clone()),
            ];
            for (k, v) in opt {
                if let Some(v) = v {
                    let _ = writeln!(out, "{k} = {}", q(&v));
                }
            }
        }
        out
    }
}

/// Options for [`generate`].
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub org: String,
    /// Explicit proxy address; default: the config's first `[proxy] listen`.
    pub proxy: Option<SocketAddr>,
    /// Resolver the sandbox uses; default: the config's first `[dns] listen`
    /// (port 53 when the shim is reached through the gateway redirect).
    pub resolver: Option<SocketAddr>,
    /// Addresses standing for "somewhere outside" (outside resolvers, QUIC,
    /// direct egress). Default: 1.1.1.1 and 8.8.8.8.
    pub outside: Vec<IpAddr>,
    /// Transparent deployment: direct TCP is judged by Palisade too.
    pub transparent: bool,
}

/// Canary name that no policy should allow (RFC 2606 `.example`).
pub const CANARY_DOMAIN: &str = "canary.palisade-probe.example";

/// A default plan: one probe per allow rule, canaries, standard bypass attempts.
pub fn generate(config: &Config, opts: &GenerateOptions) -> Result<Plan, String> {
    let org = config
        .orgs
        .iter()
        .find(|o| o.name == opts.org)
        .ok_or_else(|| format!("no org {:?} in {}", opts.org, config.path.display()))?;
    let policy = crate::policy::Policy::new(config);
    let proxy = opts.proxy.or_else(|| config.proxy.listen.first().copied());
    let resolver = opts.resolver.or_else(|| config.dns.listen.first().copied());
    let outside: Vec<IpAddr> = if opts.outside.is_empty() {
        vec![
            IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)),
            IpAddr::V4(Ipv4Addr::new(8, 8, 8, 8)),
        ]
    } else {
        opts.outside.clone()
    };
    let mut probes: Vec<Probe> = Vec::new();
    let mut add =
        |id: String, target: String, via: Via, expect: Expect, layer: Layer, note: &str| {
            probes.push(Probe {
                id,
                target,
                via,
                expect,
                layer,
                proxy: None,
                server: None,
                resolve: None,
                host_header: None,
                note: Some(note.to_string()),
            });
        };
    let via_default = if proxy.is_some() {
        Via::Proxy
    } else {
        Via::Direct
    };
    let mut allowed_name: Option<(String, u16)> = None;
    let url_for = |host: &str, port: u16| -> String {
        match port {
            443 => format!("https://{host}{}{{marker}}", super::MARKER_PATH),
            80 => format!("http://{host}{}{{marker}}", super::MARKER_PATH),
            p => format!("tcp://{host}:{p}"),
        }
    };
    for (i, rule) in org.allow.iter().enumerate() {
        let ports: Vec<u16> = match &rule.ports {
            crate::config::PortSet::All => vec![443],
            crate::config::PortSet::List(l) => l.iter().copied().take(4).collect(),
        };
        for port in ports {
            let (host, note) = match &rule.target {
                RuleTarget::Exact(name) => (name.clone(), format!("allow rule {}", rule.id)),
                RuleTarget::Below(suffix) => (
                    format!("www.{suffix}"),
                    format!(
                        "allow rule {} (*.{suffix}): replace www.{suffix} with a name that exists",
                        rule.id
                    ),
                ),
                RuleTarget::Cidr(net) => {
                    let ip = match net.hosts().next() {
                        Some(ip) => ip,
                        None => net.addr(),
                    };
                    let host = if ip.is_ipv6() {
                        format!("[{ip}]")
                    } else {
                        ip.to_string()
                    };
                    (host, format!("allow rule {} ({net})", rule.id))
                }
            };
            if allowed_name.is_none() && !matches!(rule.target, RuleTarget::Cidr(_)) && port == 443
            {
                allowed_name = Some((host.clone(), port));
            }
            add(
                format!("allow-{i}-{port}"),
                url_for(&host, port),
                via_default,
                Expect::Allow,
                Layer::Palisade,
                &note,
            );
            if opts.transparent {
                add(
                    format!("allow-{i}-{port}-direct"),
                    url_for(&host, port),
                    Via::Direct,
                    Expect::Allow,
                    Layer::Palisade,
                    &format!("{note}, without proxy settings (transparent mode)"),
                );
            }
        }
    }
    for (i, rule) in org.deny.iter().enumerate() {
        let host = match &rule.target {
            RuleTarget::Exact(name) => name.clone(),
            RuleTarget::Below(suffix) => format!("www.{suffix}"),
            RuleTarget::Cidr(net) => {
                let ip = net.hosts().next().unwrap_or(net.addr());
                if ip.is_ipv6() {
                    format!("[{ip}]")
                } else {
                    ip.to_string()
                }
            }
        };
        add(
            format!("deny-{i}"),
            url_for(&host, 443),
            via_default,
            Expect::Deny,
            Layer::Palisade,
            &format!("deny rule {}", rule.id),
        );
    }
    let deny = Expect::Deny;
    let p = Layer::Palisade;
    let v = via_default;
    // Canaries: names and an address no rule names.
    add(
        "canary-https".into(),
        format!("https://{CANARY_DOMAIN}/palisade-probe/{{marker}}"),
        v,
        deny,
        p,
        "canary name",
    );
    add(
        "canary-http".into(),
        format!("http://{CANARY_DOMAIN}/palisade-probe/{{marker}}"),
        v,
        deny,
        p,
        "canary name, plain HTTP",
    );
    add(
        "canary-ip".into(),
        "tcp://192.0.2.1:443".into(),
        v,
        deny,
        p,
        "canary address (TEST-NET-1)",
    );
    // Metadata and private ranges.
    add(
        "metadata".into(),
        "http://169.254.169.254/latest/meta-data/".into(),
        v,
        deny,
        p,
        "cloud metadata address",
    );
    for (id, t) in [
        ("private-10", "tcp://10.0.0.1:443"),
        ("private-172", "tcp://172.16.0.1:443"),
        ("private-192", "tcp://192.168.0.1:80"),
        ("loopback", "tcp://127.0.0.1:22"),
    ] {
        add(id.into(), t.into(), v, deny, p, "private or loopback range");
    }
    // IP-literal spellings of the metadata address.
    for (id, t) in [
        ("spelling-decimal", "http://2852039166/"),
        ("spelling-octal", "http://0251.0376.0251.0376/"),
        ("spelling-hex", "http://0xa9fea9fe/"),
        ("spelling-short", "http://127.1/"),
        ("spelling-mapped-v6", "http://[::ffff:169.254.169.254]/"),
    ] {
        add(id.into(), t.into(), v, deny, p, "IP-literal spelling");
    }
    if let Some((name, port)) = &allowed_name {
        add(
            "sni-mismatch".into(),
            format!("tls://{name}:{port}?sni={CANARY_DOMAIN}"),
            v,
            deny,
            p,
            "TLS SNI other than the connected name",
        );
        add(
            "host-mismatch".into(),
            format!("http://{name}:80/palisade-probe/{{marker}}"),
            v,
            deny,
            p,
            "Host header other than the request target",
        );
    }
    // Egress that skips the proxy.
    let out0 = outside[0];
    let out_host = |ip: IpAddr| {
        if ip.is_ipv6() {
            format!("[{ip}]")
        } else {
            ip.to_string()
        }
    };
    if opts.transparent {
        add(
            "direct-canary".into(),
            format!("https://{CANARY_DOMAIN}/"),
            Via::Direct,
            deny,
            p,
            "direct connection to a canary name (redirected to Palisade)",
        );
    }
    add(
        "direct-egress".into(),
        format!("tcp://{}:443", out_host(out0)),
        Via::Direct,
        deny,
        if opts.transparent { p } else { Layer::Any },
        "direct TCP that skips the proxy",
    );
    // DNS: the sandbox resolver, outside resolvers, DoH/DoT, exfil labels.
    add(
        "dns-canary".into(),
        format!("dns:{CANARY_DOMAIN}/A"),
        Via::Direct,
        deny,
        p,
        "canary name through the sandbox resolver",
    );
    add(
        "dns-exfil".into(),
        format!("dns:{{marker}}.6a6f686e2d646f65.{CANARY_DOMAIN}/TXT"),
        Via::Direct,
        deny,
        p,
        "exfil-looking labels",
    );
    for (n, ip) in outside.iter().enumerate() {
        add(
            format!("dns-outside-{n}"),
            format!("dns:{CANARY_DOMAIN}/A"),
            Via::Direct,
            deny,
            Layer::Any,
            &format!("DNS to an outside resolver ({ip})"),
        );
    }
    add(
        "doh-google".into(),
        "https://dns.google/dns-query".into(),
        v,
        deny,
        p,
        "DNS-over-HTTPS endpoint",
    );
    add(
        "doh-cloudflare".into(),
        "https://cloudflare-dns.com/dns-query".into(),
        v,
        deny,
        p,
        "DNS-over-HTTPS endpoint",
    );
    add(
        "dot".into(),
        format!("tls://{}:853", out_host(out0)),
        v,
        deny,
        p,
        "DNS-over-TLS endpoint",
    );
    // UDP, QUIC and IPv6: not Palisade's to see.
    add(
        "udp-quic".into(),
        format!("udp://{}", SocketAddr::new(out0, 443)),
        Via::Direct,
        deny,
        Layer::Any,
        "QUIC (UDP 443)",
    );
    add(
        "udp-ntp".into(),
        format!("udp://{}", SocketAddr::new(out0, 123)),
        Via::Direct,
        deny,
        Layer::Any,
        "UDP other than DNS",
    );
    add(
        "ipv6-direct".into(),
        "tcp://[2001:db8::1]:443".into(),
        Via::Direct,
        deny,
        Layer::Any,
        "IPv6 egress (documentation address)",
    );
    if proxy.is_some() {
        add(
            "ipv6-proxy".into(),
            "http://[2001:db8::1]/".into(),
            Via::Proxy,
            deny,
            p,
            "IPv6 literal through the proxy",
        );
    }
    for probe in &mut probes {
        if probe.id == "host-mismatch" {
            probe.host_header = Some(CANARY_DOMAIN.into());
        }
        if let Some(n) = probe.id.strip_prefix("dns-outside-") {
            probe.server = n
                .parse::<usize>()
                .ok()
                .and_then(|n| outside.get(n))
                .map(|ip| SocketAddr::new(*ip, 53));
        }
    }
    let plan = Plan {
        org: Some(org.name.clone()),
        policy: Some(policy.hash().to_string()),
        proxy,
        resolver,
        timeout: Some("5s".into()),
        deadline: Some("300s".into()),
        probes,
    };
    plan.validate()?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn generated_plan_round_trips() {
        let src = "[proxy]\nlisten = [\"198.18.1.1:3128\"]\n[dns]\nlisten = [\"198.18.1.1:53\"]\nupstream = [\"198.18.2.2:53\"]\n\
                   [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n[[org.allow]]\nhost = \"allowed.test\"\n\
                   [[org.allow]]\nhost = \"*.wild.test\"\n[[org.allow]]\ncidr = \"198.18.2.30/32\"\nports = [80]\n\
                   [[org.deny]]\nhost = \"blocked.wild.test\"\n";
        let config = crate::config::from_str(src, std::path::Path::new("t.toml")).unwrap();
        let opts = GenerateOptions {
            org: "acme".into(),
            proxy: None,
            resolver: None,
            outside: vec!["198.18.9.9".parse().unwrap()],
            transparent: false,
        };
        let plan = generate(&config, &opts).unwrap();
        let text = plan.to_toml("generated");
        let back = Plan::from_toml(&text).unwrap();
        assert_eq!(back.probes.len(), plan.probes.len());
        let t = |id: &str| {
            back.probes
                .iter()
                .find(|p| p.id == id)
                .unwrap()
                .target
                .clone()
        };
        assert_eq!(
            t("allow-0-80"),
            "http://allowed.test/palisade-probe/{marker}"
        );
        assert_eq!(
            t("allow-2-80"),
            "http://198.18.2.30/palisade-probe/{marker}"
        );
        assert_eq!(
            t("sni-mismatch"),
            format!("tls://allowed.test:443?sni={CANARY_DOMAIN}")
        );
        assert_eq!(t("udp-quic"), "udp://198.18.9.9:443");
        assert!(back.probes.iter().all(|p| p.id != "direct-canary"));
        assert!(generate(
            &config,
            &GenerateOptions {
                org: "nope".into(),
                ..opts
            }
        )
        .is_err());
    }
}
