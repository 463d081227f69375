//! Validation: raw structs in, typed values out, every problem located.
//! One file per section; the helpers every section shares are here.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use toml::Spanned;

use super::error::Errors;
use super::model::Config;
use super::raw::RawConfig;
use super::timeout::Timeout;

mod admin;
mod baseline;
mod bypass;
mod credentials;
mod dns;
mod enforcement;
mod evidence;
mod intercept;
mod org;
mod otel;
pub(crate) use otel::endpoint_problem as otel_endpoint_problem;
mod proxy;
mod rules;
mod service;

use admin::validate_admin;
use bypass::validate_bypass;
use dns::validate_dns;
use enforcement::validate_enforcement;
use evidence::{check_capacity, validate_evidence};
use intercept::validate_intercept;
use org::validate_orgs;
use proxy::validate_proxy;

pub(super) fn validate(raw: RawConfig, path: &Path, errors: &mut Errors<'_>) -> Config {
    // Destructure exhaustively: a new field cannot be silently ignored.
    let RawConfig {
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        bypass,
        policy,
        enforcement,
        otel,
        org,
    } = raw;

    // Listen addresses in this order, each unique across all listeners.
    let mut listeners = Listeners::default();
    let proxy = validate_proxy(proxy, &mut listeners, errors);
    let pool_spans = dns::pool_spans(&dns);
    let dns = validate_dns(dns, &mut listeners, errors);
    let admin = validate_admin(admin, &mut listeners, errors);
    let default_budget = super::model::default_max_records_per_second_per_org(&proxy.limits, &dns);
    // The capacity check is located at retain_size, the key it is about.
    let retain_at = evidence.retain_size.as_ref().map(Spanned::span);
    let evidence = validate_evidence(evidence, default_budget, errors);

    let intercept = validate_intercept(intercept, errors);
    let bypass = validate_bypass(bypass, errors);
    let enforcement = validate_enforcement(enforcement, errors);
    let otel = otel.and_then(|o| otel::validate_otel(o, errors));
    let pools_set = dns.synthetic_pool.is_some() || dns.synthetic_pool_v6.is_some();
    let super::raw::RawPolicy { baseline } = policy;
    let baseline = baseline.and_then(|b| baseline::load_baseline(&b, path, errors));
    let orgs = validate_orgs(org, pools_set, baseline.as_ref(), errors);
    if let Some(at) = retain_at {
        check_capacity(&evidence, orgs.len(), at, errors);
    }

    let config = Config {
        path: path.to_path_buf(),
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        bypass,
        policy: super::model::PolicyConfig { baseline },
        enforcement,
        otel,
        orgs,
    };
    dns::check_pools(&config, &pool_spans, errors);
    config
}

/// The listen addresses seen so far, to reject one used twice.
#[derive(Default)]
struct Listeners(HashSet<SocketAddr>);

impl Listeners {
    /// A listen address, unique across all listeners.
    fn claim(&mut self, value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<SocketAddr> {
        let addr = socket_addr(value, None, errors)?;
        if !self.0.insert(addr) {
            errors.at(value.span(), format!("listen address {addr} is used twice"));
            return None;
        }
        Some(addr)
    }
}

fn socket_addr(
    value: &Spanned<String>,
    default_port: Option<u16>,
    errors: &mut Errors<'_>,
) -> Option<SocketAddr> {
    let text = value.get_ref().trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        if addr.port() == 0 {
            errors.at(value.span(), format!("address {text:?} has port 0"));
            return None;
        }
        return Some(addr);
    }
    if let (Some(port), Ok(ip)) = (default_port, text.parse::<IpAddr>()) {
        return Some(SocketAddr::new(ip, port));
    }
    errors.at(
        value.span(),
        format!("invalid socket address {text:?} (expected ip:port or [v6]:port)"),
    );
    None
}

fn count(value: Option<Spanned<i64>>, default: usize, errors: &mut Errors<'_>) -> usize {
    let Some(value) = value else { return default };
    match usize::try_from(*value.get_ref()) {
        Ok(n) if n > 0 => n,
        _ => {
            errors.at(
                value.span(),
                format!("limit {} must be a positive integer", value.get_ref()),
            );
            default
        }
    }
}

/// A path setting, `default` when unset; an empty one is an error naming
/// `what`.
fn path(
    value: Option<Spanned<String>>,
    default: PathBuf,
    what: &str,
    errors: &mut Errors<'_>,
) -> PathBuf {
    match value {
        Some(p) if p.get_ref().trim().is_empty() => {
            errors.at(p.span(), format!("{what} must not be empty"));
            default
        }
        Some(p) => PathBuf::from(p.into_inner()),
        None => default,
    }
}

/// A duration setting, `default` when unset.
fn duration(
    value: Option<Spanned<String>>,
    default: Duration,
    errors: &mut Errors<'_>,
) -> Duration {
    value
        .and_then(|v| positive_duration(&v, errors))
        .unwrap_or(default)
}

/// A timeout setting: a positive duration within the timeout's bound,
/// its default when unset.
fn timeout<T: Timeout>(value: Option<Spanned<String>>, errors: &mut Errors<'_>) -> T {
    let Some(value) = value else {
        return T::DEFAULT;
    };
    let Some(d) = positive_duration(&value, errors) else {
        return T::DEFAULT;
    };
    T::new(d).unwrap_or_else(|e| {
        errors.at(
            value.span(),
            format!("{} {:?} {e}", T::KEY, value.get_ref()),
        );
        T::DEFAULT
    })
}

fn positive_duration(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<Duration> {
    match humantime::parse_duration(value.get_ref().trim()) {
        Ok(d) if !d.is_zero() => Some(d),
        Ok(_) => {
            errors.at(
                value.span(),
                format!("duration {:?} must be positive", value.get_ref()),
            );
            None
        }
        Err(e) => {
            errors.at(
                value.span(),
                format!(
                    "invalid duration {:?} ({e}; e.g. \"5s\", \"250ms\")",
                    value.get_ref()
                ),
            );
            None
        }
    }
}

fn cidr(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<IpNet> {
    let text = value.get_ref().trim();
    let net = if text.contains('/') {
        text.parse::<IpNet>().ok()
    } else {
        text.parse::<IpAddr>().ok().map(IpNet::from)
    };
    let Some(net) = net else {
        errors.at(
            value.span(),
            format!("invalid cidr {text:?} (expected e.g. 198.18.7.0/24 or 2001:db8::/32)"),
        );
        return None;
    };
    if net.trunc() != net {
        errors.at(
            value.span(),
            format!(
                "cidr {text:?} has host bits set (did you mean {}?)",
                net.trunc()
            ),
        );
        return None;
    }
    Some(net)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::test_support::{first_error, parse, BASE};
    use crate::config::timeout::short;
    use crate::config::*;

    /// `key = "value"` added at the top of `table` (BASE has `[proxy]` and
    /// `[admin]`; other tables go first): the config and the key's line.
    fn with(table: &str, key: &str, value: &str) -> (String, usize) {
        let line = format!("{key} = \"{value}\"\n");
        match table {
            "proxy" => (BASE.replace("[proxy]\n", &format!("[proxy]\n{line}")), 3),
            _ => (format!("[{table}]\n{line}{BASE}"), 2),
        }
    }

    /// Every timeout: its table, key and bound.
    const TIMEOUTS: [(&str, &str, Duration); 12] = [
        ("proxy", "header_read_timeout", HeaderReadTimeout::MAX),
        ("proxy", "connect_timeout", ConnectTimeout::MAX),
        ("proxy", "idle_timeout", IdleTimeout::MAX),
        ("proxy", "response_timeout", ResponseTimeout::MAX),
        ("proxy", "detect_timeout", DetectTimeout::MAX),
        ("proxy", "drain_timeout", DrainTimeout::MAX),
        ("proxy", "revoke_grace", RevokeGrace::MAX),
        ("proxy", "upstream_idle_timeout", UpstreamIdleTimeout::MAX),
        ("dns", "resolve_timeout", ResolveTimeout::MAX),
        ("dns", "idle_timeout", DnsIdleTimeout::MAX),
        ("dns", "query_timeout", DnsQueryTimeout::MAX),
        ("intercept", "handshake_timeout", HandshakeTimeout::MAX),
    ];

    #[test]
    fn every_timeout_is_bounded_with_a_located_error() {
        for (table, key, max) in TIMEOUTS {
            let at_max = short(max);
            let (src, _) = with(table, key, &at_max);
            assert!(
                parse(&src).is_ok(),
                "{key} = {at_max}: {:?}",
                parse(&src).err()
            );
            let over = humantime::format_duration(max + Duration::from_millis(1)).to_string();
            let (src, line) = with(table, key, &over);
            let e = first_error(&src);
            let want = format!("t.toml:{line}:");
            assert!(e.starts_with(&want), "{key}: {e} (want {want})");
            let want = format!("{key} {over:?} is above the maximum of {at_max}");
            assert!(e.ends_with(&want), "{key}: {e} (want {want})");
            let (src, _) = with(table, key, "0s");
            assert!(first_error(&src).contains("must be positive"), "{key}");
        }
    }

    #[test]
    fn the_configuration_reference_states_every_bound() {
        let reference = include_str!("../../../docs/configuration.md");
        for (table, key, max) in TIMEOUTS {
            let (start, end) = (
                format!("| `[{table}] {key}` |"),
                format!("| {} |", short(max)),
            );
            assert!(
                reference
                    .lines()
                    .any(|l| l.starts_with(&start) && l.ends_with(&end)),
                "docs/configuration.md has no row {start} ... {end}"
            );
        }
    }

    #[test]
    fn detect_timeout_bound_reads_plainly() {
        let (src, _) = with("proxy", "detect_timeout", "2m");
        assert_eq!(
            first_error(&src),
            "t.toml:3:18: detect_timeout \"2m\" is above the maximum of 1m"
        );
    }

    #[test]
    fn response_timeout_is_its_own_key_and_defaults_to_the_idle_timeout() {
        let c = parse(BASE).unwrap().proxy.limits;
        assert_eq!(c.response_timeout, DEFAULT_RESPONSE_TIMEOUT);
        assert_eq!(c.response_timeout.get(), Duration::from_secs(300));
        assert_eq!(c.response_timeout.get(), c.idle_timeout.get());

        let (src, _) = with("proxy", "response_timeout", "30s");
        let c = parse(&src).unwrap().proxy.limits;
        assert_eq!(c.response_timeout.get(), Duration::from_secs(30));
        assert_eq!(c.idle_timeout, DEFAULT_IDLE_TIMEOUT);

        // Unset, it follows idle_timeout, which bounded the wait before.
        let (src, _) = with("proxy", "idle_timeout", "1s");
        let c = parse(&src).unwrap().proxy.limits;
        assert_eq!(c.response_timeout.get(), Duration::from_secs(1));
    }
}
