//! `[dns]`: the DNS shim's listeners, upstreams, bounds and TTLs.

use super::{count, duration, socket_addr, timeout, Listeners};
use crate::config::error::Errors;
use crate::config::model::{dns_org_share, DnsConfig};
use crate::config::raw::RawDns;

pub(super) fn validate_dns(
    raw: RawDns,
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> DnsConfig {
    let RawDns {
        listen,
        upstream,
        resolve_timeout,
        idle_timeout,
        query_timeout,
        max_tcp_connections,
        max_tcp_connections_per_client,
        max_tcp_connections_per_org,
        max_queries_in_flight,
        max_queries_in_flight_per_org,
        max_queries_per_second_per_client,
        min_ttl,
        max_ttl,
        binding_grace,
        max_bindings_per_name,
        max_bindings_per_org,
        max_bindings,
    } = raw;
    let d = DnsConfig::default();
    let max_ttl_span = max_ttl.as_ref().map(|m| m.span());
    // Per-org caps default to a share of their global cap, as set.
    let max_tcp = count(max_tcp_connections, d.max_tcp_connections, errors);
    let max_in_flight = count(max_queries_in_flight, d.max_queries_in_flight, errors);
    let max_all_bindings = count(max_bindings, d.max_bindings, errors);
    let config = DnsConfig {
        listen: listen
            .iter()
            .filter_map(|l| listeners.claim(l, errors))
            .collect(),
        upstream: upstream
            .iter()
            .filter_map(|l| socket_addr(l, Some(53), errors))
            .collect(),
        resolve_timeout: timeout(resolve_timeout, errors),
        idle_timeout: timeout(idle_timeout, errors),
        query_timeout: timeout(query_timeout, errors),
        max_tcp_connections: max_tcp,
        max_tcp_connections_per_client: count(
            max_tcp_connections_per_client,
            d.max_tcp_connections_per_client,
            errors,
        ),
        max_tcp_connections_per_org: count(
            max_tcp_connections_per_org,
            dns_org_share(max_tcp),
            errors,
        ),
        max_queries_in_flight: max_in_flight,
        max_queries_in_flight_per_org: count(
            max_queries_in_flight_per_org,
            dns_org_share(max_in_flight),
            errors,
        ),
        max_queries_per_second_per_client: count(
            max_queries_per_second_per_client,
            d.max_queries_per_second_per_client,
            errors,
        ),
        min_ttl: duration(min_ttl, d.min_ttl, errors),
        max_ttl: duration(max_ttl, d.max_ttl, errors),
        binding_grace: duration(binding_grace, d.binding_grace, errors),
        max_bindings_per_name: count(max_bindings_per_name, d.max_bindings_per_name, errors),
        max_bindings_per_org: count(
            max_bindings_per_org,
            dns_org_share(max_all_bindings),
            errors,
        ),
        max_bindings: max_all_bindings,
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

    use crate::config::test_support::{first_error, parse, BASE};
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
        let e = first_error(&format!("{BASE}dns_denied = \"drop\"\n"));
        assert!(
            e.starts_with("t.toml:9:") && e.contains("invalid dns_denied \"drop\""),
            "{e}"
        );
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
}
