//! `palisade probe plan`: a default plan generated from a policy, for the
//! assessor to review: one probe per allow and deny rule, canaries, the
//! standard bypass attempts (metadata and private addresses, IP-literal
//! spellings, SNI and Host mismatches, DNS exfil and outside resolvers,
//! DoH/DoT, UDP, IPv6; with `[bypass]` in a transparent deployment, a
//! direct connection to the gateway), and the in-tunnel probes the rules
//! make applicable.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use super::plan::{volume_total, Flow, Plan, Probe};
use super::{Expect, Layer, Via};
use crate::config::{Config, PathPattern, RuleTarget};
use crate::policy::request::NormalPath;

/// What a generated `silence` probe waits beyond the proxy's `detect_timeout`.
pub(crate) const SILENCE_MARGIN: Duration = Duration::from_millis(500);

/// Options for [`generate`].
#[derive(Debug, Clone)]
pub(crate) struct GenerateOptions {
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
    /// The plan's nonce (8 lower-case hex digits, fresh per plan) and the
    /// time it is issued: what keeps an earlier run from passing for it.
    pub run: String,
    pub issued: std::time::SystemTime,
}

/// Canary name that no policy should allow (RFC 2606 `.example`).
pub(crate) const CANARY_DOMAIN: &str = "canary.palisade-probe.example";
/// The canary name with the probe's marker as its first label: a record
/// naming it is of that probe's own request, in this plan.
pub(crate) const CANARY_MARKED: &str = "{marker}.canary.palisade-probe.example";

/// A default plan: one probe per allow rule, canaries, standard bypass attempts.
pub(crate) fn generate(config: &Config, opts: &GenerateOptions) -> Result<Plan, String> {
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
    let via_default = if proxy.is_some() {
        Via::Proxy
    } else {
        Via::Direct
    };
    let mut out = Probes(Vec::new());
    let allowed_name = rule_probes(&mut out, org, via_default, opts.transparent);
    standard_probes(&mut out, allowed_name.as_ref(), via_default);
    egress_probes(&mut out, opts, &outside, via_default);
    udp_and_ipv6_probes(&mut out, config, opts, outside[0], proxy.is_some());
    let mut probes = out.0;
    probes.extend(tunnel_probes(
        org,
        config.proxy.limits.detect_timeout.get(),
        via_default,
        opts.transparent,
    ));
    // Last: they spend each wildcard's budget for a minute, and each
    // rule's volume budget for its window.
    probes.extend(name_probes(org));
    probes.extend(volume_probes(org, via_default));
    for probe in &mut probes {
        if probe.id == "host-mismatch" {
            probe.host_header = Some(CANARY_MARKED.into());
        }
        if let Some(n) = probe.id.strip_prefix("dns-outside-") {
            probe.server = n
                .parse::<usize>()
                .ok()
                .and_then(|n| outside.get(n))
                .map(|ip| SocketAddr::new(*ip, 53));
        }
    }
    if !super::plan::is_run_nonce(&opts.run) {
        return Err(format!(
            "run {:?}: a plan's nonce is 8 lower-case hex digits",
            opts.run
        ));
    }
    let plan = Plan {
        org: Some(org.name.clone()),
        policy: Some(policy.hash().to_string()),
        run: Some(opts.run.clone()),
        issued: Some(humantime::format_rfc3339_micros(opts.issued).to_string()),
        proxy,
        resolver,
        timeout: Some("5s".into()),
        deadline: Some("300s".into()),
        probes,
    };
    plan.validate()?;
    Ok(plan)
}

/// The probes of a plan as they are added, in order.
struct Probes(Vec<Probe>);

impl Probes {
    /// Add one probe with its note.
    fn add(
        &mut self,
        id: String,
        target: String,
        via: Via,
        expect: Expect,
        layer: Layer,
        note: &str,
    ) {
        self.0.push(Probe {
            layer,
            note: Some(note.to_string()),
            ..Probe::new(&id, &target, via, expect)
        });
    }
}

/// One probe per allow rule and port (and its direct twin in a
/// transparent deployment), one per deny rule; returns the first allowed
/// name on 443, the base of the mismatch probes.
fn rule_probes(
    out: &mut Probes,
    org: &crate::config::OrgConfig,
    via_default: Via,
    transparent: bool,
) -> Option<(String, u16)> {
    let mut allowed_name: Option<(String, u16)> = None;
    let url_for = probe_url;
    for (i, rule) in org.allow.iter().enumerate() {
        for port in rule_ports(rule) {
            let (host, note) = allow_host(rule);
            if allowed_name.is_none() && !matches!(rule.target, RuleTarget::Cidr(_)) && port == 443
            {
                allowed_name = Some((host.clone(), port));
            }
            out.add(
                format!("allow-{i}-{port}"),
                url_for(&host, port),
                via_default,
                Expect::Allow,
                Layer::Palisade,
                &note,
            );
            if transparent {
                out.add(
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
        out.add(
            format!("deny-{i}"),
            url_for(&host, 443),
            via_default,
            Expect::Deny,
            Layer::Palisade,
            &format!("deny rule {}", rule.id),
        );
    }
    allowed_name
}

/// Canaries, metadata and private ranges, IP-literal spellings, and the
/// SNI and Host mismatches on the first allowed name.
fn standard_probes(out: &mut Probes, allowed_name: Option<&(String, u16)>, via_default: Via) {
    let deny = Expect::Deny;
    let p = Layer::Palisade;
    let v = via_default;
    // Canaries: names and an address no rule names.
    out.add(
        "canary-https".into(),
        format!("https://{CANARY_MARKED}/palisade-probe/{{marker}}"),
        v,
        deny,
        p,
        "canary name",
    );
    out.add(
        "canary-http".into(),
        format!("http://{CANARY_MARKED}/palisade-probe/{{marker}}"),
        v,
        deny,
        p,
        "canary name, plain HTTP",
    );
    out.add(
        "canary-ip".into(),
        "tcp://192.0.2.1:443".into(),
        v,
        deny,
        p,
        "canary address (TEST-NET-1)",
    );
    // Metadata and private ranges.
    out.add(
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
        out.add(id.into(), t.into(), v, deny, p, "private or loopback range");
    }
    // IP-literal spellings of the metadata address.
    for (id, t) in [
        ("spelling-decimal", "http://2852039166/"),
        ("spelling-octal", "http://0251.0376.0251.0376/"),
        ("spelling-hex", "http://0xa9fea9fe/"),
        ("spelling-short", "http://127.1/"),
        ("spelling-mapped-v6", "http://[::ffff:169.254.169.254]/"),
    ] {
        out.add(id.into(), t.into(), v, deny, p, "IP-literal spelling");
    }
    if let Some((name, port)) = allowed_name {
        out.add(
            "sni-mismatch".into(),
            format!("tls://{name}:{port}?sni={CANARY_MARKED}"),
            v,
            deny,
            p,
            "TLS SNI other than the connected name",
        );
        out.add(
            "host-mismatch".into(),
            format!("http://{name}:80/palisade-probe/{{marker}}"),
            v,
            deny,
            p,
            "Host header other than the request target",
        );
    }
}

/// Egress that skips the proxy, and DNS: the sandbox resolver, outside
/// resolvers, DoH/DoT, exfil labels.
fn egress_probes(out: &mut Probes, opts: &GenerateOptions, outside: &[IpAddr], via_default: Via) {
    let (deny, p, v) = (Expect::Deny, Layer::Palisade, via_default);
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
        out.add(
            "direct-canary".into(),
            format!("https://{CANARY_MARKED}/palisade-probe/{{marker}}"),
            Via::Direct,
            deny,
            p,
            "direct connection to a canary name (redirected to Palisade)",
        );
    }
    out.add(
        "direct-egress".into(),
        format!("tcp://{}:443", out_host(out0)),
        Via::Direct,
        deny,
        if opts.transparent { p } else { Layer::Any },
        "direct TCP that skips the proxy",
    );
    // DNS: the sandbox resolver, outside resolvers, DoH/DoT, exfil labels.
    out.add(
        "dns-canary".into(),
        format!("dns:{CANARY_MARKED}/A"),
        Via::Direct,
        deny,
        p,
        "canary name through the sandbox resolver",
    );
    out.add(
        "dns-exfil".into(),
        format!("dns:{{marker}}.6a6f686e2d646f65.{CANARY_DOMAIN}/TXT"),
        Via::Direct,
        deny,
        p,
        "exfil-looking labels",
    );
    for (n, ip) in outside.iter().enumerate() {
        out.add(
            format!("dns-outside-{n}"),
            format!("dns:{CANARY_MARKED}/A"),
            Via::Direct,
            deny,
            Layer::Any,
            &format!("DNS to an outside resolver ({ip})"),
        );
    }
    out.add(
        "doh-google".into(),
        "https://dns.google/dns-query".into(),
        v,
        deny,
        p,
        "DNS-over-HTTPS endpoint",
    );
    out.add(
        "doh-cloudflare".into(),
        "https://cloudflare-dns.com/dns-query".into(),
        v,
        deny,
        p,
        "DNS-over-HTTPS endpoint",
    );
    out.add(
        "dot".into(),
        format!("tls://{}:853", out_host(out0)),
        v,
        deny,
        p,
        "DNS-over-TLS endpoint",
    );
}

/// UDP and QUIC, a direct connection to the gateway, IPv6.
fn udp_and_ipv6_probes(
    out: &mut Probes,
    config: &Config,
    opts: &GenerateOptions,
    out0: IpAddr,
    proxy: bool,
) {
    let (deny, p) = (Expect::Deny, Layer::Palisade);
    // UDP and QUIC: not Palisade's to see, unless the gateway ruleset
    // rejects them and Palisade records what it logged ([bypass]).
    let bypass = opts.transparent && config.bypass.nflog_group.is_some();
    let (udp_layer, udp_note) = if bypass {
        (p, " (rejected and logged by the gateway: a bypass record)")
    } else {
        (Layer::Any, "")
    };
    out.add(
        "udp-quic".into(),
        format!("udp://{}", SocketAddr::new(out0, 443)),
        Via::Direct,
        deny,
        udp_layer,
        &format!("QUIC (UDP 443){udp_note}"),
    );
    out.add(
        "udp-ntp".into(),
        format!("udp://{}", SocketAddr::new(out0, 123)),
        Via::Direct,
        deny,
        udp_layer,
        &format!("UDP other than DNS{udp_note}"),
    );
    if let Some(gateway) = bypass.then(|| gateway_address(config)).flatten() {
        out.add(
            "direct-gateway".into(),
            format!("tcp://{gateway}"),
            Via::Direct,
            deny,
            p,
            "direct TCP to the gateway itself, not redirected (rejected and logged by the gateway: a bypass record)",
        );
    }
    out.add(
        "ipv6-direct".into(),
        "tcp://[2001:db8::1]:443".into(),
        Via::Direct,
        deny,
        Layer::Any,
        "IPv6 egress (documentation address)",
    );
    if proxy {
        out.add(
            "ipv6-proxy".into(),
            "http://[2001:db8::1]/".into(),
            Via::Proxy,
            deny,
            p,
            "IPv6 literal through the proxy",
        );
    }
}

/// The target a probe of `host:port` uses: an HTTPS or HTTP request
/// carrying the marker in its path on 443 and 80, else a TCP connection.
pub(crate) fn probe_url(host: &str, port: u16) -> String {
    match port {
        443 => format!("https://{host}{}{{marker}}", super::MARKER_PATH),
        80 => format!("http://{host}{}{{marker}}", super::MARKER_PATH),
        p => format!("tcp://{host}:{p}"),
    }
}

/// The ports an allow rule's probes use: the first four it lists, or 443
/// for a rule on every port.
pub(crate) fn rule_ports(rule: &crate::config::RuleConfig) -> Vec<u16> {
    match &rule.ports {
        crate::config::PortSet::All => vec![443],
        crate::config::PortSet::List(l) => l.iter().copied().take(4).collect(),
    }
}

/// The host an allow rule's probes name, and the note saying which rule
/// (a wildcard's placeholder name is the assessor's to replace).
pub(crate) fn allow_host(rule: &crate::config::RuleConfig) -> (String, String) {
    match &rule.target {
        RuleTarget::Exact(name) => (name.clone(), format!("allow rule {}", rule.id)),
        RuleTarget::Below(suffix) => (
            format!("www.{suffix}"),
            format!(
                "allow rule {} (*.{suffix}): replace www.{suffix} with a name that exists",
                rule.id
            ),
        ),
        RuleTarget::Cidr(net) => {
            let ip = net.hosts().next().unwrap_or(net.addr());
            let host = if ip.is_ipv6() {
                format!("[{ip}]")
            } else {
                ip.to_string()
            };
            (host, format!("allow rule {} ({net})", rule.id))
        }
    }
}

/// Names a `names-N` probe sends past its rule's budget.
pub(crate) const BURST_PAST_BUDGET: u32 = 20;
/// Names a `names-N` probe sends under a wildcard with no budget.
pub(crate) const BURST_UNBUDGETED: u32 = 40;

/// The name-channel probes: per allowed wildcard, a `dns-burst` of new
/// names through the sandbox's resolver, `BURST_PAST_BUDGET` more than the
/// rule's `max_new_names_per_minute` (`BURST_UNBUDGETED` without one),
/// expected refused past the budget. Each name is a fresh label, then the
/// run's marker where the rule's `max_label_length` leaves room for it.
fn name_probes(org: &crate::config::OrgConfig) -> Vec<Probe> {
    use super::plan::{MAX_BURST, RANDOM, RANDOM_LABEL_LEN};
    let mut out = Vec::new();
    for (i, rule) in org.allow.iter().enumerate() {
        let RuleTarget::Below(suffix) = &rule.target else {
            continue;
        };
        let budget = rule.names.new_per_minute.unwrap_or(0);
        let count = if budget == 0 {
            BURST_UNBUDGETED
        } else {
            budget.saturating_add(BURST_PAST_BUDGET).min(MAX_BURST)
        };
        let marker_len = super::plan::SAMPLE_MARKER.len();
        let max_label = usize::from(rule.names.max_label_length);
        let template = if marker_len <= max_label {
            format!("{RANDOM}.{{marker}}.{suffix}")
        } else {
            format!("{RANDOM}.{suffix}")
        };
        let mut note = format!(
            "name channel under allow rule {} (*.{suffix}): {count} new names through the sandbox's resolver; ",
            rule.id
        );
        if budget == 0 {
            note.push_str(
                "the rule has no max_new_names_per_minute (0): every name that leaves is a finding",
            );
        } else {
            note.push_str(&format!(
                "at most {budget} may reach the upstream, the rest refused name_budget_exceeded and on record"
            ));
        }
        if budget >= MAX_BURST {
            note.push_str(&format!(
                " (a budget of {MAX_BURST} or more is not exceeded by one probe)"
            ));
        }
        if RANDOM_LABEL_LEN > max_label {
            note.push_str(
                " (max_label_length refuses every name's first label: the budget is not exercised)",
            );
        }
        note.push_str(". The names reach the zone's authoritative servers, and spend the rule's budget for a minute");
        out.push(Probe {
            note: Some(note),
            ..Probe::new(
                &format!("names-{i}"),
                &format!("dns-burst:{template}/A?count={count}&budget={budget}"),
                Via::Direct,
                Expect::Deny,
            )
        });
    }
    out
}

/// Where a direct connection to the gateway itself is tried: its first
/// transparent listener with a specific address (connecting to it
/// straight, with no redirect, is what the ruleset rejects).
fn gateway_address(config: &Config) -> Option<SocketAddr> {
    config
        .proxy
        .transparent
        .iter()
        .find(|a| !a.ip().is_unspecified())
        .copied()
}

/// The host a name rule is probed with (a placeholder below a wildcard);
/// None for cidr rules.
fn rule_host(target: &RuleTarget) -> Option<String> {
    match target {
        RuleTarget::Exact(name) => Some(name.clone()),
        RuleTarget::Below(suffix) => Some(format!("www.{suffix}")),
        RuleTarget::Cidr(_) => None,
    }
}

/// How a proxy that does not decode escapes would match the raw `path`
/// against a path rule: a prefix (no `*`), or a glob in which `*` matches
/// any run of bytes. (Palisade's own matcher takes only normalised paths;
/// this one is the probe's, to tell which spellings would slip past.)
fn matches_as_written(pattern: &str, path: &str) -> bool {
    crate::policy::request::pattern_matches(pattern, path)
}

/// A path `pattern` (a `deny_paths` entry) denies, with one unreserved
/// character percent-encoded (`/api/internal*` gives `/api/%69nternal`).
/// The path: the pattern with a trailing `*` matching nothing and any
/// other `*` matching `x`. The character: a letter or digit written in the
/// pattern (not one standing for a `*`), from the last segment that has
/// one, such that the encoded spelling no longer matches the pattern as
/// written (else the probe would test nothing) while normalising to the
/// same path (so Palisade, decoding it, must deny it). Letters and digits
/// only: an encoded `.`, `/` or `\` is refused outright by Palisade.
pub(crate) fn encoded_denied_path(pattern: &str) -> Option<String> {
    let stem = pattern.trim_end_matches('*');
    // (byte, written in the pattern?)
    let path: Vec<(u8, bool)> = stem
        .bytes()
        .map(|b| if b == b'*' { (b'x', false) } else { (b, true) })
        .collect();
    let plain: String = path.iter().map(|&(b, _)| b as char).collect();
    let rule = PathPattern(pattern.to_string());
    let normal = NormalPath::parse(&plain).ok()?;
    if !rule.matches(&normal) {
        return None;
    }
    let segment_of = |i: usize| path[..i].iter().filter(|(b, _)| *b == b'/').count();
    let mut candidates: Vec<usize> = (0..path.len())
        .filter(|&i| path[i].1 && path[i].0.is_ascii_alphanumeric())
        .collect();
    // Last segment first; within a segment, left to right.
    candidates.sort_by_key(|&i| (std::cmp::Reverse(segment_of(i)), i));
    candidates.into_iter().find_map(|i| {
        let encoded = format!("{}%{:02X}{}", &plain[..i], path[i].0, &plain[i + 1..]);
        let same = NormalPath::parse(&encoded).is_ok_and(|n| n == normal);
        (same && !matches_as_written(pattern, &encoded)).then_some(encoded)
    })
}

/// A probe per intercepting rule on 443 with service rules, each a GET
/// the rule's service rules must refuse (`service_denied`): under `git`
/// (or `repos` alone) a fetch of a repository outside `repos`, and, with
/// no `push_refs`, a push discovery of a listed one; under `graphql` a
/// mutation outside `graphql_mutations`. (A push to a ref, a publish and
/// a model call carry a body or another method, which probes do not
/// send: they are left to the netns tests.) Rules whose `methods` refuse
/// GET are skipped: their probe would test those instead.
fn service_probes(org: &crate::config::OrgConfig, via: Via) -> Vec<Probe> {
    use crate::config::Service;
    let mut out = Vec::new();
    for (n, r) in org.allow.iter().enumerate() {
        let Some(rules) = r.intercept.as_ref() else {
            continue;
        };
        let Some(service) = rules.service.as_ref() else {
            continue;
        };
        let get = (rules.methods.is_empty() || rules.methods.iter().any(|m| m == "GET"))
            && !rules.deny_methods.iter().any(|m| m == "GET");
        let Some(host) = rule_host(&r.target).filter(|_| get && r.ports.contains(443)) else {
            continue;
        };
        let mut add = |kind: &str, path: String, what: String| {
            out.push(Probe {
                request: true,
                note: Some(format!("intercepted rule {}: {what}", r.id)),
                ..Probe::new(
                    &format!("service-{n}-{kind}"),
                    &format!("https://{host}{path}"),
                    via,
                    Expect::Deny,
                )
            })
        };
        match service.service {
            None | Some(Service::Git) => {
                add(
                    "git-unlisted-repo",
                    "/palisade-probe/unlisted.git/info/refs?service=git-upload-pack".into(),
                    "a git fetch of a repository outside repos".into(),
                );
                let listed = service.repos.first().map(|p| p.replace('*', "x"));
                if let (true, Some(repo)) = (service.push_refs.is_empty(), listed) {
                    add(
                        "git-push",
                        format!("/{repo}.git/info/refs?service=git-receive-pack"),
                        format!("a git push to {repo}, which has no push_refs (fetch only)"),
                    );
                }
            }
            Some(Service::Graphql) => add(
                "graphql-mutation",
                "/graphql?query=mutation%7BpalisadeProbe%7D".into(),
                "a GraphQL mutation outside graphql_mutations (palisadeProbe)".into(),
            ),
            Some(Service::Registry | Service::LlmApi) => {}
        }
    }
    out
}

/// The in-tunnel probes the org's rules make applicable: what an allowed
/// tunnel carries once it is open. Names come from the first name rule
/// (not intercepting) on 443 and on 80; the path probe from the first
/// intercepting rule on 443 with a `deny_paths` entry that can be encoded
/// and that GET and its `paths` otherwise allow. Through the proxy (or
/// direct when there is none); in transparent deployments also direct.
fn tunnel_probes(
    org: &crate::config::OrgConfig,
    detect_timeout: Duration,
    via: Via,
    transparent: bool,
) -> Vec<Probe> {
    let plain = |port: u16| {
        org.allow.iter().find_map(|r| {
            (r.intercept.is_none() && r.ports.contains(port))
                .then(|| rule_host(&r.target))
                .flatten()
        })
    };
    let mut out = Vec::new();
    if let Some(name) = plain(443) {
        let silence = detect_timeout + SILENCE_MARGIN;
        out.push(Probe {
            silence: Some(format!("{}ms", silence.as_millis())),
            note: Some(format!(
                "tunnel to {name} left silent past detect_timeout ({} ms), then a ClientHello for another name",
                detect_timeout.as_millis()
            )),
            ..Probe::new(
                "silence-then-sni",
                &format!("tls://{name}:443?sni={CANARY_MARKED}"),
                via,
                Expect::Deny,
            )
        });
        out.push(Probe {
            ech: true,
            note: Some(format!(
                "ClientHello for {name} with an encrypted_client_hello extension (the real name would be hidden)"
            )),
            ..Probe::new(
                "ech-client-hello",
                &format!("tls://{name}:443"),
                via,
                Expect::Deny,
            )
        });
    }
    if let Some(name) = plain(80) {
        out.push(Probe {
            second_host: Some(CANARY_MARKED.into()),
            note: Some(format!(
                "second request on a connection to {name}:80 naming another Host"
            )),
            ..Probe::new(
                "second-request-other-host",
                &format!("http://{name}{}{{marker}}", super::MARKER_PATH),
                via,
                Expect::Deny,
            )
        });
    }
    let encoded = org.allow.iter().find_map(|r| {
        let rules = r.intercept.as_ref()?;
        let get = (rules.methods.is_empty() || rules.methods.iter().any(|m| m == "GET"))
            && !rules.deny_methods.iter().any(|m| m == "GET");
        if !get || !r.ports.contains(443) {
            return None;
        }
        let host = rule_host(&r.target)?;
        rules.deny_paths.iter().find_map(|p| {
            let decoded = p.0.trim_end_matches('*').replace('*', "x");
            // With `paths` set, the decoded path must be one they allow, or
            // the probe would be refused for that and test nothing.
            let allowed = rules.paths.is_empty()
                || NormalPath::parse(&decoded)
                    .is_ok_and(|n| rules.paths.iter().any(|a| a.matches(&n)));
            let path = encoded_denied_path(&p.0).filter(|_| allowed)?;
            Some((host.clone(), path, p.0.clone(), r.id.clone()))
        })
    });
    if let Some((host, path, pattern, rule)) = encoded {
        out.push(Probe {
            request: true,
            note: Some(format!(
                "intercepted rule {rule}: a percent-encoded spelling of a path deny_paths refuses ({pattern})"
            )),
            ..Probe::new(
                "encoded-path",
                &format!("https://{host}{path}"),
                via,
                Expect::Deny,
            )
        });
    }
    out.extend(service_probes(org, via));
    if transparent && via == Via::Proxy {
        let direct: Vec<Probe> = out
            .iter()
            .map(|p| Probe {
                id: format!("{}-direct", p.id),
                via: Via::Direct,
                note: p
                    .note
                    .as_ref()
                    .map(|n| format!("{n}, without proxy settings (transparent mode)")),
                ..p.clone()
            })
            .collect();
        out.extend(direct);
    }
    out
}

/// The volume probes of `org`'s plan: for each allow rule with a budget
/// (its own `max_bytes_up`/`max_bytes_down`, or the org's, the smaller
/// one when both), one per direction, through the target of the rule's
/// first port (as its allow probe), `via`.
fn volume_probes(org: &crate::config::OrgConfig, via: Via) -> Vec<Probe> {
    let mut out = Vec::new();
    for (i, rule) in org.allow.iter().enumerate() {
        let Some(port) = rule_ports(rule).first().copied() else {
            continue;
        };
        let (host, note) = allow_host(rule);
        for flow in [Flow::Up, Flow::Down] {
            let of = |v: &Option<crate::config::Volume>| {
                v.and_then(|v| match flow {
                    Flow::Up => v.up,
                    Flow::Down => v.down,
                })
            };
            let (budget, whose) = match (of(&rule.volume), of(&org.volume)) {
                (Some(r), Some(o)) if o < r => (o, "the org's total"),
                (Some(r), _) => (r, "the rule's"),
                (None, Some(o)) => (o, "the org's total"),
                (None, None) => continue,
            };
            let serves = match (flow, port) {
                (Flow::Up, _) => String::new(),
                (Flow::Down, 80 | 443) => format!(
                    "; point the path at something that serves at least {} bytes",
                    volume_total(budget)
                ),
                (Flow::Down, _) => format!(
                    "; the target must send at least {} bytes unasked",
                    volume_total(budget)
                ),
            };
            out.push(Probe {
                volume: Some(flow),
                budget: Some(budget),
                note: Some(format!(
                    "{note}: {} bytes {} past {whose} budget of {budget}{serves}",
                    volume_total(budget),
                    flow.as_str()
                )),
                ..Probe::new(
                    &format!("volume-{i}-{}", flow.as_str()),
                    &probe_url(&host, port),
                    via,
                    Expect::Deny,
                )
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_plan_round_trips() {
        let src = "[proxy]\nlisten = [\"198.18.1.1:3128\"]\n[dns]\nlisten = [\"198.18.1.1:53\"]\nupstream = [\"198.18.2.2:53\"]\n\
                   [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n[[org.allow]]\nhost = \"allowed.test\"\n\
                   [[org.allow]]\nhost = \"*.wild.test\"\n[[org.allow]]\ncidr = \"198.18.2.30/32\"\nports = [80]\n\
                   [[org.deny]]\nhost = \"blocked.wild.test\"\n";
        let config = crate::config::from_str(src, std::path::Path::new("t.toml")).unwrap();
        let opts = options(false);
        let plan = generate(&config, &opts).unwrap();
        let text = plan.to_toml("generated").unwrap();
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
            format!("tls://allowed.test:443?sni={CANARY_MARKED}")
        );
        assert_eq!(t("udp-quic"), "udp://198.18.9.9:443");
        // Fresh per plan, and the canaries carry each probe's marker in
        // their names, where a denial of them records it.
        assert_eq!(back.run.as_deref(), Some("0a1b2c3d"));
        assert_eq!(
            back.issued_at(),
            Some(std::time::UNIX_EPOCH + Duration::from_secs(1_900_000_000))
        );
        assert_eq!(
            t("canary-https"),
            format!("https://{CANARY_MARKED}/palisade-probe/{{marker}}")
        );
        assert_eq!(t("dns-canary"), format!("dns:{CANARY_MARKED}/A"));
        let host_mismatch = back.probes.iter().find(|p| p.id == "host-mismatch");
        assert_eq!(
            host_mismatch.and_then(|p| p.host_header.as_deref()),
            Some(CANARY_MARKED)
        );
        let mut stale = opts.clone();
        stale.run = "not-hex!".into();
        assert!(generate(&config, &stale).is_err());
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

    fn options(transparent: bool) -> GenerateOptions {
        GenerateOptions {
            org: "acme".into(),
            proxy: None,
            resolver: None,
            outside: vec!["198.18.9.9".parse().unwrap()],
            transparent,
            run: "0a1b2c3d".into(),
            issued: std::time::UNIX_EPOCH + Duration::from_secs(1_900_000_000),
        }
    }

    /// The note of probe `id` among `probes`.
    fn note_of<'a>(probes: impl IntoIterator<Item = &'a Probe>, id: &str) -> String {
        probes
            .into_iter()
            .find(|p| p.id == id)
            .and_then(|p| p.note.clone())
            .unwrap_or_else(|| panic!("no note of {id}"))
    }

    fn generate_from(src: &str, transparent: bool) -> Plan {
        let config = crate::config::from_str(src, std::path::Path::new("t.toml")).unwrap();
        let plan = generate(&config, &options(transparent)).unwrap();
        // What is printed is what is run.
        let back = Plan::from_toml(&plan.to_toml("generated").unwrap()).unwrap();
        assert_eq!(
            serde_json::to_value(&back.probes).unwrap(),
            serde_json::to_value(&plan.probes).unwrap()
        );
        back
    }

    #[test]
    fn with_bypass_records_the_udp_and_gateway_probes_are_palisades() {
        let base = "[proxy]\ntransparent = [\"198.18.1.1:15001\"]\n\
                    [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
                    [[org.allow]]\nhost = \"allowed.test\"\n";
        let without = generate_from(base, true);
        let layer =
            |plan: &Plan, id: &str| plan.probes.iter().find(|p| p.id == id).map(|p| p.layer);
        assert_eq!(layer(&without, "udp-quic"), Some(Layer::Any));
        assert_eq!(layer(&without, "direct-gateway"), None);
        let with = generate_from(&format!("[bypass]\nnflog_group = 100\n{base}"), true);
        assert_eq!(layer(&with, "udp-quic"), Some(Layer::Palisade));
        assert_eq!(layer(&with, "udp-ntp"), Some(Layer::Palisade));
        let gw = with
            .probes
            .iter()
            .find(|p| p.id == "direct-gateway")
            .unwrap();
        assert_eq!(gw.target, "tcp://198.18.1.1:15001");
        assert_eq!(
            (gw.via, gw.expect, gw.layer),
            (Via::Direct, Expect::Deny, Layer::Palisade)
        );
        // Explicit-proxy deployments have no gateway ruleset to record it.
        let explicit = generate_from(&format!("[bypass]\nnflog_group = 100\n{base}"), false);
        assert_eq!(layer(&explicit, "udp-quic"), Some(Layer::Any));
        assert_eq!(layer(&explicit, "direct-gateway"), None);
    }

    const TUNNEL_POLICY: &str =
        "[proxy]\nlisten = [\"198.18.1.1:3128\"]\ndetect_timeout = \"2s\"\n\
        [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
        [[org.allow]]\nid = \"registry\"\nhost = \"reg.test\"\nports = [443]\nintercept = true\n\
        paths = [\"/api/*\"]\ndeny_paths = [\"/api/internal*\"]\n\
        [[org.allow]]\nhost = \"allowed.test\"\nports = [80, 443]\n";

    #[test]
    fn tunnel_probes_follow_the_policy() {
        let plan = generate_from(TUNNEL_POLICY, false);
        let p = |id: &str| {
            plan.probes
                .iter()
                .find(|p| p.id == id)
                .unwrap_or_else(|| panic!("no probe {id}"))
        };
        // TLS probes use the first name on 443 that is not intercepted.
        let silence = p("silence-then-sni");
        assert_eq!(
            silence.target,
            format!("tls://allowed.test:443?sni={CANARY_MARKED}")
        );
        assert_eq!(
            silence.silence.as_deref(),
            Some("2500ms"),
            "detect_timeout + margin"
        );
        assert_eq!(silence.silence(), Duration::from_millis(2500));
        assert_eq!((silence.via, silence.expect), (Via::Proxy, Expect::Deny));
        let ech = p("ech-client-hello");
        assert_eq!(ech.target, "tls://allowed.test:443");
        assert!(ech.ech && ech.silence.is_none());
        let second = p("second-request-other-host");
        assert_eq!(second.target, "http://allowed.test/palisade-probe/{marker}");
        assert_eq!(second.second_host.as_deref(), Some(CANARY_MARKED));
        let path = p("encoded-path");
        assert_eq!(path.target, "https://reg.test/api/%69nternal");
        assert!(path.request);
        assert!(path.note.as_deref().unwrap().contains("registry"));
        assert!(plan
            .probes
            .iter()
            .all(|p| p.id != "silence-then-sni-direct"));

        // Transparent deployments also get them without the proxy.
        let plan = generate_from(TUNNEL_POLICY, true);
        for id in [
            "silence-then-sni",
            "ech-client-hello",
            "second-request-other-host",
            "encoded-path",
        ] {
            let direct = plan
                .probes
                .iter()
                .find(|p| p.id == format!("{id}-direct"))
                .unwrap_or_else(|| panic!("no {id}-direct"));
            assert_eq!(direct.via, Via::Direct);
        }
    }

    /// A probe per service rule, refused by its service rules.
    #[test]
    fn service_rules_get_probes() {
        let src = "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
                   [[org.allow]]\nid = \"forge\"\nhost = \"git.test\"\nports = [443]\nintercept = true\n\
                   service = \"git\"\nrepos = [\"acme/*\"]\n\
                   [[org.allow]]\nid = \"gql\"\nhost = \"gql.test\"\nports = [443]\nintercept = true\n\
                   service = \"graphql\"\ngraphql_mutations = [\"createPullRequest\"]\n\
                   [[org.allow]]\nhost = \"reg.test\"\nports = [443]\nintercept = true\nservice = \"registry\"\n";
        let plan = generate_from(src, false);
        let target = |id: &str| {
            plan.probes
                .iter()
                .find(|p| p.id == id)
                .map(|p| (p.target.clone(), p.expect, p.request))
        };
        assert_eq!(
            target("service-0-git-unlisted-repo"),
            Some((
                "https://git.test/palisade-probe/unlisted.git/info/refs?service=git-upload-pack"
                    .into(),
                Expect::Deny,
                true
            ))
        );
        assert_eq!(
            target("service-0-git-push").map(|t| t.0),
            Some("https://git.test/acme/x.git/info/refs?service=git-receive-pack".into())
        );
        assert_eq!(
            target("service-1-graphql-mutation").map(|t| t.0),
            Some("https://gql.test/graphql?query=mutation%7BpalisadeProbe%7D".into())
        );
        assert!(plan.probes.iter().all(|p| !p.id.starts_with("service-2")));
        // Each is refused by the rule it probes, through the live checks.
        let config = crate::config::from_str(src, std::path::Path::new("t.toml")).unwrap();
        let rules = |i: usize| {
            config.orgs[0].allow[i]
                .intercept
                .clone()
                .unwrap()
                .service
                .unwrap()
        };
        for (i, path, query) in [
            (
                0,
                "/palisade-probe/unlisted.git/info/refs",
                "service=git-upload-pack",
            ),
            (0, "/acme/x.git/info/refs", "service=git-receive-pack"),
            (1, "/graphql", "query=mutation%7BpalisadeProbe%7D"),
        ] {
            let path = NormalPath::parse(path).unwrap();
            let req = crate::policy::service::ServiceRequest {
                method: "GET",
                path: &path,
                query: Some(query),
                content_type: None,
                content_encoding: None,
            };
            assert!(
                matches!(
                    crate::policy::service::check(&rules(i), &req),
                    crate::policy::service::Step::Refuse(..)
                ),
                "{path}?{query}"
            );
        }
    }

    #[test]
    fn tunnel_probes_only_where_applicable() {
        let ids = |src: &str| -> Vec<String> {
            generate_from(src, false)
                .probes
                .into_iter()
                .map(|p| p.id)
                .filter(|id| {
                    ["silence", "ech", "second-request", "encoded"]
                        .iter()
                        .any(|k| id.starts_with(k))
                })
                .collect()
        };
        let head = "[proxy]\nlisten = [\"198.18.1.1:3128\"]\n[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n";
        // Only 443 (default detect_timeout): TLS probes, no HTTP one.
        let only_tls = ids(&format!(
            "{head}[[org.allow]]\nhost = \"*.w.test\"\nports = [443]\n"
        ));
        assert_eq!(only_tls, ["silence-then-sni", "ech-client-hello"]);
        let plan = generate_from(&format!("{head}[[org.allow]]\nhost = \"a.test\"\n"), false);
        let silence = plan
            .probes
            .iter()
            .find(|p| p.id == "silence-then-sni")
            .unwrap();
        assert_eq!(silence.silence.as_deref(), Some("1500ms"));
        // Only 80: the HTTP probe.
        assert_eq!(
            ids(&format!(
                "{head}[[org.allow]]\nhost = \"a.test\"\nports = [80]\n"
            )),
            ["second-request-other-host"]
        );
        // Addresses only, or only an intercepted name without deny_paths:
        // nothing to tunnel a name through, no path to encode.
        assert!(ids(&format!("{head}[[org.allow]]\ncidr = \"198.18.2.0/24\"\n")).is_empty());
        assert!(ids(&format!(
            "{head}[[org.allow]]\nhost = \"a.test\"\nports = [443]\nintercept = true\n"
        ))
        .is_empty());
        // GET refused by the rule: the path probe would test the method.
        assert!(ids(&format!(
            "{head}[[org.allow]]\nhost = \"a.test\"\nports = [443]\nintercept = true\n\
             deny_methods = [\"GET\"]\ndeny_paths = [\"/x\"]\n"
        ))
        .is_empty());
        // `paths` that would refuse the decoded path anyway: no probe.
        assert!(ids(&format!(
            "{head}[[org.allow]]\nhost = \"a.test\"\nports = [443]\nintercept = true\n\
             paths = [\"/pub/*\"]\ndeny_paths = [\"/api/internal*\"]\n"
        ))
        .is_empty());
    }

    #[test]
    fn each_budget_gets_a_volume_probe_the_smaller_of_rule_and_org_last_in_the_plan() {
        let plan = generate_from(
            "[proxy]\nlisten = [\"198.18.1.1:3128\"]\n\
             [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\nmax_bytes_down = \"1MiB\"\n\
             [[org.allow]]\nid = \"gh\"\nhost = \"github.test\"\nmax_bytes_up = \"100KiB\"\n\
             [[org.allow]]\nid = \"sink\"\ncidr = \"198.18.2.30/32\"\nports = [7001]\n\
             max_bytes_up = \"300MiB\"\nmax_bytes_down = \"2MiB\"\n\
             [[org.allow]]\nid = \"web\"\nhost = \"web.test\"\nports = [80]\n",
            false,
        );
        let volume: Vec<(&str, &str, Option<Flow>, Option<u64>)> = plan
            .probes
            .iter()
            .filter(|p| p.volume.is_some())
            .map(|p| (p.id.as_str(), p.target.as_str(), p.volume, p.budget))
            .collect();
        let (up, down) = (Some(Flow::Up), Some(Flow::Down));
        assert_eq!(
            volume,
            [
                (
                    "volume-0-up",
                    "http://github.test/palisade-probe/{marker}",
                    up,
                    Some(100 * 1024)
                ),
                (
                    "volume-0-down",
                    "http://github.test/palisade-probe/{marker}",
                    down,
                    Some(1 << 20)
                ),
                ("volume-1-up", "tcp://198.18.2.30:7001", up, Some(300 << 20)),
                (
                    "volume-1-down",
                    "tcp://198.18.2.30:7001",
                    down,
                    Some(1 << 20)
                ),
                (
                    "volume-2-down",
                    "http://web.test/palisade-probe/{marker}",
                    down,
                    Some(1 << 20)
                ),
            ]
        );
        assert!(plan
            .probes
            .iter()
            .all(|p| p.volume.is_none() || p.expect == Expect::Deny));
        let n = plan.probes.len();
        assert!(
            plan.probes[n - 5..].iter().all(|p| p.volume.is_some()),
            "last in the plan"
        );
        let note = |id: &str| note_of(&plan.probes, id);
        assert!(
            note("volume-0-down").contains("the org's total budget"),
            "{}",
            note("volume-0-down")
        );
        assert!(note("volume-1-up").contains("the rule's budget"));
        assert!(note("volume-2-down").contains("serves at least"));
        // The 300 MiB one stays in the plan; the run reports it not run.
        assert!(crate::probe::plan::volume_too_large(300 << 20).is_some());
    }

    #[test]
    fn each_allowed_wildcard_gets_a_name_burst_past_its_budget() {
        let plan = generate_from(
            "[dns]\nlisten = [\"198.18.1.1:53\"]\n\
             [[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
             [[org.allow]]\nhost = \"allowed.test\"\n\
             [[org.allow]]\nid = \"wild\"\nhost = \"*.wild.test\"\nmax_new_names_per_minute = 10\n\
             [[org.allow]]\nid = \"dflt\"\nhost = \"*.cdn.test\"\n\
             [[org.allow]]\nid = \"free\"\nhost = \"*.free.test\"\nmax_new_names_per_minute = 0\n\
             [[org.allow]]\nid = \"short\"\nhost = \"*.short.test\"\nmax_label_length = 12\n\
             [[org.allow]]\nid = \"big\"\nhost = \"*.big.test\"\nmax_new_names_per_minute = 5000\n\
             [[org.allow]]\ncidr = \"198.18.2.0/24\"\n\
             [[org.deny]]\nhost = \"*.blocked.test\"\n",
            false,
        );
        let bursts: Vec<&Probe> = plan
            .probes
            .iter()
            .filter(|p| p.target.starts_with("dns-burst:"))
            .collect();
        let targets: Vec<(&str, &str)> = bursts
            .iter()
            .map(|p| (p.id.as_str(), p.target.as_str()))
            .collect();
        assert_eq!(
            targets,
            [
                (
                    "names-1",
                    "dns-burst:{random}.{marker}.wild.test/A?count=30&budget=10"
                ),
                (
                    "names-2",
                    "dns-burst:{random}.{marker}.cdn.test/A?count=80&budget=60"
                ),
                (
                    "names-3",
                    "dns-burst:{random}.{marker}.free.test/A?count=40&budget=0"
                ),
                // No room for the marker's label: the random one alone.
                (
                    "names-4",
                    "dns-burst:{random}.short.test/A?count=80&budget=60"
                ),
                (
                    "names-5",
                    "dns-burst:{random}.{marker}.big.test/A?count=1000&budget=5000"
                ),
            ]
        );
        for p in &bursts {
            assert_eq!(
                (p.via, p.expect, p.layer),
                (Via::Direct, Expect::Deny, Layer::Palisade)
            );
        }
        let note = |id: &str| note_of(bursts.iter().copied(), id);
        assert!(
            note("names-1").contains("at most 10"),
            "{}",
            note("names-1")
        );
        assert!(note("names-3").contains("every name that leaves is a finding"));
        assert!(note("names-4").contains("budget is not exercised"));
        assert!(note("names-5").contains("not exceeded by one probe"));
        // They come last: they spend the budgets the other probes use.
        let first = plan.probes.iter().position(|p| p.id == "names-1").unwrap();
        assert!(plan.probes[first..]
            .iter()
            .all(|p| p.id.starts_with("names-")));
    }

    #[test]
    fn denied_paths_are_encoded_where_the_pattern_is_literal() {
        for (pattern, want) in [
            ("/api/internal*", Some("/api/%69nternal")),
            ("/upload", Some("/%75pload")),
            // The `*` stands for `x`; the encoded letter is one written in
            // the pattern, so the spelling no longer matches it as written.
            ("/p/*.whl", Some("/p/x.%77hl")),
            ("/v1/*", Some("/%761/")),
            ("/*", None),
            ("*", None),
            ("/.../", None),
        ] {
            assert_eq!(encoded_denied_path(pattern).as_deref(), want, "{pattern}");
            if let Some(enc) = encoded_denied_path(pattern) {
                assert!(!matches_as_written(pattern, &enc), "{pattern}: {enc}");
                let normal = NormalPath::parse(&enc).unwrap();
                assert!(
                    PathPattern(pattern.into()).matches(&normal),
                    "{pattern}: {enc}"
                );
            }
        }
    }
}
