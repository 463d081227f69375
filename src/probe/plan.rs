//! The probe plan: its TOML format, its targets, and its validation. A
//! default plan is generated from a policy by `probe plan` (the `generate`
//! module, which depends on this one).
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
//! # second_host = "other.example" # http:// probes: a second request, same connection, this Host
//! # silence = "1500ms"            # tls:// and https:// probes: stay silent this long first
//! # ech = true                    # tls:// and https:// probes: ClientHello with an ECH extension
//! # request = true                # https:// probes: full handshake, then the HTTP request
//! # note = "why this probe"
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
//! `udp://ip:port`. `{marker}` in a target is replaced by the probe's marker.

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
            note: None,
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

/// Parse a target (after `{marker}` substitution).
pub(crate) fn parse_target(input: &str) -> Result<Target, String> {
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
            for (what, h) in [
                ("host_header", &p.host_header),
                ("second_host", &p.second_host),
            ] {
                if let Some(h) = h {
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
}
