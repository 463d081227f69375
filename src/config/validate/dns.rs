//! `[dns]`: the DNS shim's listeners, upstreams, bounds and TTLs.

use std::ops::Range;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use toml::Spanned;

use super::values::{cidr, count, duration, socket_addr, timeout, Listeners};
use crate::config::error::Errors;
use crate::config::model::{
    dns_org_share, synthetic_per_org, Config, DnsConfig, RuleTarget, ALWAYS_DENIED,
    MAX_SYNTHETIC_MAPPINGS,
};
use crate::config::raw::RawDns;

/// The smallest synthetic pools: 256 addresses (see `crate::handout::synthetic`).
const MIN_POOL_PREFIX_V4: u8 = 24;
const MIN_POOL_PREFIX_V6: u8 = 120;

/// Where the synthetic pools are written, for [`check_pools`].
pub(super) struct PoolSpans {
    v4: Option<Range<usize>>,
    v6: Option<Range<usize>>,
}

pub(super) fn pool_spans(raw: &RawDns) -> PoolSpans {
    PoolSpans {
        v4: raw.synthetic_pool.as_ref().map(Spanned::span),
        v6: raw.synthetic_pool_v6.as_ref().map(Spanned::span),
    }
}

/// A synthetic pool: a network of the key's family, at least 256 addresses.
fn pool(value: Option<&Spanned<String>>, v6: bool, errors: &mut Errors<'_>) -> Option<IpNet> {
    let value = value?;
    let key = if v6 {
        "synthetic_pool_v6"
    } else {
        "synthetic_pool"
    };
    let net = cidr(value, errors)?;
    let (family_ok, min) = match net {
        IpNet::V4(_) => (!v6, MIN_POOL_PREFIX_V4),
        IpNet::V6(_) => (v6, MIN_POOL_PREFIX_V6),
    };
    if !family_ok {
        let want = if v6 { "an IPv6" } else { "an IPv4" };
        errors.at(
            value.span(),
            format!("dns {key} {net} must be {want} network"),
        );
        return None;
    }
    if net.prefix_len() > min {
        errors.at(
            value.span(),
            format!("dns {key} {net} is too small (at least 256 addresses: /{min} or shorter)"),
        );
        return None;
    }
    Some(net)
}

/// The synthetic pools stay clear of every address that means something
/// else: a listener, an org's clients, an always-denied range, an org's
/// cidr allow rule. Each overlap is an error at the pool's key. And the
/// orgs that use them fit: each may hold as many mappings as the smaller
/// pool has addresses (at most 4096), all of them together at most
/// [`MAX_SYNTHETIC_MAPPINGS`].
pub(super) fn check_pools(config: &Config, spans: &PoolSpans, errors: &mut Errors<'_>) {
    check_synthetic_orgs(config, spans, errors);
    let pools = [
        (
            config.dns.synthetic_pool.map(IpNet::V4),
            &spans.v4,
            "synthetic_pool",
        ),
        (
            config.dns.synthetic_pool_v6.map(IpNet::V6),
            &spans.v6,
            "synthetic_pool_v6",
        ),
    ];
    let overlaps = |a: &IpNet, b: &IpNet| a.contains(&b.network()) || b.contains(&a.network());
    for (net, span, key) in pools {
        let (Some(net), Some(span)) = (net, span) else {
            continue;
        };
        let mut clash = |what: String| {
            errors.at(span.clone(), format!("dns {key} {net} overlaps {what}"));
        };
        for (range, what) in ALWAYS_DENIED {
            if let Ok(range) = range.parse::<IpNet>() {
                if overlaps(&net, &range) {
                    clash(format!("the always-denied range {range} ({what})"));
                }
            }
        }
        for org in &config.orgs {
            for c in &org.clients {
                if overlaps(&net, c) {
                    clash(format!("the clients {c} of org {:?}", org.name));
                }
            }
            for rule in &org.allow {
                if let RuleTarget::Cidr(c) = &rule.target {
                    if overlaps(&net, c) {
                        clash(format!("the cidr {c} of rule {:?}", rule.id));
                    }
                }
            }
        }
        for addr in config.own_addresses() {
            let ip = addr.ip().to_canonical();
            if net.contains(&ip) {
                clash(format!("the listen address {addr}"));
            }
        }
    }
}

/// Every org with `dns_answers = "synthetic"` has the whole pool to
/// itself (`crate::handout::synthetic`), so the pools bound each org, and the
/// number of such orgs bounds the table: over [`MAX_SYNTHETIC_MAPPINGS`]
/// in all is an error at the smaller pool's key.
fn check_synthetic_orgs(config: &Config, spans: &PoolSpans, errors: &mut Errors<'_>) {
    let (v4, v6) = (config.dns.synthetic_pool, config.dns.synthetic_pool_v6);
    let per_org = synthetic_per_org(v4, v6);
    let orgs = config
        .orgs
        .iter()
        .filter(|o| o.dns_answers == crate::config::DnsAnswers::Synthetic)
        .count();
    if per_org == 0 || orgs.saturating_mul(per_org) <= MAX_SYNTHETIC_MAPPINGS {
        return;
    }
    // The smaller pool sets the share; name it.
    let v4_smaller = match (v4, v6) {
        (Some(a), Some(b)) => u32::from(32 - a.prefix_len()) <= u32::from(128 - b.prefix_len()),
        (a, _) => a.is_some(),
    };
    let (span, key, net) = if v4_smaller {
        (&spans.v4, "synthetic_pool", v4.map(IpNet::V4))
    } else {
        (&spans.v6, "synthetic_pool_v6", v6.map(IpNet::V6))
    };
    let (Some(span), Some(net)) = (span, net) else {
        return;
    };
    errors.at(
        span.clone(),
        format!(
            "dns {key} {net}: {orgs} orgs with dns_answers = \"synthetic\" may hold {per_org} \
             synthetic mappings each ({} in all), over the {MAX_SYNTHETIC_MAPPINGS} kept in all; \
             at most {} synthetic orgs with this pool (a smaller pool gives each org fewer)",
            orgs * per_org,
            MAX_SYNTHETIC_MAPPINGS / per_org
        ),
    );
}

pub(super) fn validate_dns(
    raw: RawDns,
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> DnsConfig {
    // Every key of `RawDns` is read below (one read nowhere is a dead-code
    // warning, an error under `clippy -D warnings`).
    let d = DnsConfig::default();
    let max_ttl_span = raw.max_ttl.as_ref().map(|m| m.span());
    // Per-org caps default to a share of their global cap, as set.
    let max_tcp = count(raw.max_tcp_connections, d.max_tcp_connections, errors);
    let max_in_flight = count(raw.max_queries_in_flight, d.max_queries_in_flight, errors);
    let max_all_bindings = count(raw.max_bindings, d.max_bindings, errors);
    let config = DnsConfig {
        listen: raw
            .listen
            .iter()
            .filter_map(|l| listeners.claim(l, errors))
            .collect(),
        upstream: raw
            .upstream
            .iter()
            .filter_map(|l| socket_addr(l, Some(53), errors))
            .collect(),
        resolve_timeout: timeout(raw.resolve_timeout, errors),
        idle_timeout: timeout(raw.idle_timeout, errors),
        query_timeout: timeout(raw.query_timeout, errors),
        max_tcp_connections: max_tcp,
        max_tcp_connections_per_client: count(
            raw.max_tcp_connections_per_client,
            d.max_tcp_connections_per_client,
            errors,
        ),
        max_tcp_connections_per_org: count(
            raw.max_tcp_connections_per_org,
            dns_org_share(max_tcp),
            errors,
        ),
        max_queries_in_flight: max_in_flight,
        max_queries_in_flight_per_org: count(
            raw.max_queries_in_flight_per_org,
            dns_org_share(max_in_flight),
            errors,
        ),
        max_queries_per_second_per_client: count(
            raw.max_queries_per_second_per_client,
            d.max_queries_per_second_per_client,
            errors,
        ),
        min_ttl: duration(raw.min_ttl, d.min_ttl, errors),
        max_ttl: duration(raw.max_ttl, d.max_ttl, errors),
        binding_grace: duration(raw.binding_grace, d.binding_grace, errors),
        max_bindings_per_name: count(raw.max_bindings_per_name, d.max_bindings_per_name, errors),
        max_bindings_per_org: count(
            raw.max_bindings_per_org,
            dns_org_share(max_all_bindings),
            errors,
        ),
        max_bindings: max_all_bindings,
        synthetic_pool: match pool(raw.synthetic_pool.as_ref(), false, errors) {
            Some(IpNet::V4(n)) => Some(n),
            _ => None::<Ipv4Net>,
        },
        synthetic_pool_v6: match pool(raw.synthetic_pool_v6.as_ref(), true, errors) {
            Some(IpNet::V6(n)) => Some(n),
            _ => None::<Ipv6Net>,
        },
    };
    if config.min_ttl > config.max_ttl {
        errors.at(
            max_ttl_span.unwrap_or(0..0),
            format!(
                "dns max_ttl {:?} is below min_ttl {:?}",
                config.max_ttl, config.min_ttl
            ),
        );
    }
    config
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::test_support::{assert_first_error, first_error, parse, BASE};
    use crate::config::*;

    #[test]
    fn dns_keys_parse_and_validate() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.dns.query_timeout, DEFAULT_DNS_QUERY_TIMEOUT);
        assert_eq!(
            c.dns.max_bindings_per_name,
            DEFAULT_DNS_MAX_BINDINGS_PER_NAME
        );
        assert_eq!(c.orgs[0].dns_denied, DnsDenied::Refused);
        assert!(c.orgs[0].dns_types.is_empty());
        // Per-org caps: a quarter of the global ones.
        assert_eq!(c.dns.max_tcp_connections_per_client, 16);
        assert_eq!(c.dns.max_tcp_connections_per_org, 64);
        assert_eq!(c.dns.max_queries_in_flight_per_org, 256);
        assert_eq!(c.dns.max_bindings_per_org, 25_000);

        let src = format!(
            "[dns]\nidle_timeout = \"2s\"\nquery_timeout = \"1s\"\nmax_tcp_connections = 3\n\
             max_queries_in_flight = 9\nmin_ttl = \"1s\"\nmax_ttl = \"60s\"\nbinding_grace = \"5s\"\n\
             max_bindings_per_name = 4\nmax_bindings = 10\n{BASE}dns_denied = \"nxdomain\"\n\
             dns_types = [\"txt\", \"MX\", \"TXT\"]\n"
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.dns.idle_timeout.get(), Duration::from_secs(2));
        assert_eq!(c.dns.query_timeout.get(), Duration::from_secs(1));
        assert_eq!(c.dns.max_tcp_connections, 3);
        assert_eq!(c.dns.max_queries_in_flight, 9);
        assert_eq!(c.dns.min_ttl, Duration::from_secs(1));
        assert_eq!(c.dns.max_ttl, Duration::from_secs(60));
        assert_eq!(c.dns.binding_grace, Duration::from_secs(5));
        assert_eq!(c.dns.max_bindings_per_name, 4);
        assert_eq!(c.dns.max_bindings, 10);
        // Unset per-org caps follow the global ones as set.
        assert_eq!(c.dns.max_tcp_connections_per_org, 1);
        assert_eq!(c.dns.max_queries_in_flight_per_org, 3);
        assert_eq!(c.dns.max_bindings_per_org, 3);
        assert_eq!(c.orgs[0].dns_denied, DnsDenied::Nxdomain);
        assert_eq!(
            c.orgs[0].dns_types,
            vec!["TXT".to_string(), "MX".to_string()]
        );
    }

    #[test]
    fn bad_dns_keys_are_located() {
        let drop = format!("{BASE}dns_denied = \"drop\"\n");
        assert_first_error(&drop, "t.toml:9:", "invalid dns_denied \"drop\"");
        let e = first_error(&format!("{BASE}dns_types = [\"AXFR\"]\n"));
        assert!(e.contains("never answered"), "{e}");
        let e = first_error(&format!("{BASE}dns_types = [\"BOGUS\"]\n"));
        assert!(e.contains("unknown dns type \"BOGUS\""), "{e}");
        let e = first_error(&format!("[dns]\nmin_ttl = \"2h\"\n{BASE}"));
        assert!(e.contains("below min_ttl"), "{e}");
        let e = first_error(&format!("[dns]\nmax_tcp_connections = 0\n{BASE}"));
        assert!(e.starts_with("t.toml:2:") && e.contains("positive"), "{e}");
        for key in [
            "max_tcp_connections_per_client",
            "max_tcp_connections_per_org",
            "max_queries_in_flight_per_org",
            "max_bindings_per_org",
        ] {
            let e = first_error(&format!("[dns]\n{key} = 0\n{BASE}"));
            assert!(
                e.starts_with("t.toml:2:") && e.contains("positive"),
                "{key}: {e}"
            );
        }
    }

    #[test]
    fn per_org_dns_caps_parse() {
        let src = format!(
            "[dns]\nmax_tcp_connections_per_client = 2\nmax_tcp_connections_per_org = 5\n\
             max_queries_in_flight_per_org = 7\nmax_bindings_per_org = 11\n{BASE}"
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.dns.max_tcp_connections_per_client, 2);
        assert_eq!(c.dns.max_tcp_connections_per_org, 5);
        assert_eq!(c.dns.max_queries_in_flight_per_org, 7);
        assert_eq!(c.dns.max_bindings_per_org, 11);
    }

    #[test]
    fn synthetic_pools_and_answers_parse() {
        let src = format!(
            "[dns]\nsynthetic_pool = \"198.18.128.0/17\"\nsynthetic_pool_v6 = \"2001:2:0:8000::/96\"\n\
             {BASE}dns_answers = \"synthetic\"\n"
        );
        let c = parse(&src).unwrap();
        assert_eq!(
            c.dns.synthetic_pool,
            Some("198.18.128.0/17".parse().unwrap())
        );
        assert_eq!(
            c.dns.synthetic_pool_v6,
            Some("2001:2:0:8000::/96".parse().unwrap())
        );
        assert_eq!(c.orgs[0].dns_answers, DnsAnswers::Synthetic);
        // Either pool alone will do.
        let v6 = format!(
            "[dns]\nsynthetic_pool_v6 = \"2001:2:0:8000::/120\"\n{BASE}dns_answers = \"synthetic\"\n"
        );
        assert!(parse(&v6).is_ok());
        let c = parse(&format!("{BASE}dns_answers = \"resolved\"\n")).unwrap();
        assert_eq!(c.orgs[0].dns_answers, DnsAnswers::Resolved);
        // The default keeps the policy hash.
        let json = serde_json::to_string(&c.orgs).unwrap();
        assert!(!json.contains("dns_answers"), "{json}");
    }

    #[test]
    fn bad_synthetic_settings_are_located() {
        let cases: &[(&str, &str, &str)] = &[
            // (config, where, what)
            (
                "{BASE}dns_answers = \"synthetic\"\n",
                "t.toml:9:",
                "needs [dns] synthetic_pool",
            ),
            (
                "{BASE}dns_answers = \"fake\"\n",
                "t.toml:9:",
                "invalid dns_answers \"fake\"",
            ),
            (
                "[dns]\nsynthetic_pool = \"2001:2::/64\"\n{BASE}",
                "t.toml:2:",
                "synthetic_pool 2001:2::/64 must be an IPv4 network",
            ),
            (
                "[dns]\nsynthetic_pool_v6 = \"198.18.128.0/17\"\n{BASE}",
                "t.toml:2:",
                "synthetic_pool_v6 198.18.128.0/17 must be an IPv6 network",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.18.128.0/25\"\n{BASE}",
                "t.toml:2:",
                "too small",
            ),
            (
                "[dns]\nsynthetic_pool_v6 = \"2001:2::/121\"\n{BASE}",
                "t.toml:2:",
                "too small",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.18.128.1/17\"\n{BASE}",
                "t.toml:2:",
                "host bits",
            ),
            (
                "[dns]\nsynthetic_pool = \"127.0.0.0/24\"\n{BASE}",
                "t.toml:2:",
                "overlaps the always-denied range 127.0.0.0/8",
            ),
            (
                "[dns]\nsynthetic_pool = \"10.0.0.0/7\"\n{BASE}",
                "t.toml:2:",
                "overlaps the always-denied range 10.0.0.0/8",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.19.0.0/16\"\n{BASE}",
                "t.toml:2:",
                "overlaps the clients 198.19.1.0/24 of org \"acme\"",
            ),
            (
                "[dns]\nlisten = [\"198.18.128.1:53\"]\nsynthetic_pool = \"198.18.128.0/24\"\n{BASE}",
                "t.toml:3:",
                "overlaps the listen address 198.18.128.1:53",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.18.128.0/24\"\n{BASE}[[org.allow]]\ncidr = \"198.18.0.0/16\"\n",
                "t.toml:2:",
                "overlaps the cidr 198.18.0.0/16 of rule",
            ),
            (
                "[dns]\nsynthetic_pool_v6 = \"fd00::/120\"\n{BASE}",
                "t.toml:2:",
                "overlaps the always-denied range fc00::/7",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.18.128.0/17\"\nsynthetic_pool_v6 = \"2001:2::/96\"\n{MANY}",
                "t.toml:2:",
                "65 orgs with dns_answers = \"synthetic\" may hold 4096 synthetic mappings each (266240 in all), over the 262144",
            ),
            (
                "[dns]\nsynthetic_pool = \"198.18.128.0/17\"\nsynthetic_pool_v6 = \"2001:2::/116\"\n{MANY}",
                "t.toml:3:",
                "65 orgs",
            ),
        ];
        // 65 synthetic orgs.
        let many: String = (0..65)
            .map(|i| {
                format!(
                    "[[org]]\nname = \"o{i}\"\nclients = [\"198.19.{i}.0/24\"]\n\
                     dns_answers = \"synthetic\"\n[[org.allow]]\nhost = \"a.test\"\n"
                )
            })
            .collect();
        for (src, at, what) in cases {
            let src = src.replace("{BASE}", BASE).replace("{MANY}", &many);
            let e = first_error(&src);
            assert!(e.starts_with(at) && e.contains(what), "{src}\n=> {e}");
        }
    }
}
