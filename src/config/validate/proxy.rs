//! `[proxy]`: listeners, connection limits and timeouts.

use super::values::{count, timeout, Listeners};
use crate::config::error::Errors;
use crate::config::model::{Limits, ProxyConfig};
use crate::config::raw::RawProxy;
use crate::config::timeout::{IdleTimeout, ResponseTimeout};

pub(super) fn validate_proxy(
    raw: RawProxy,
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> ProxyConfig {
    // Every key of `RawProxy` is read below (one read nowhere is a dead-code
    // warning, an error under `clippy -D warnings`).
    let d = Limits::default();
    let idle_timeout: IdleTimeout = timeout(raw.idle_timeout, errors);
    // Unset, the response wait is what bounded it before it had its own key.
    let response_timeout = match raw.response_timeout {
        Some(value) => timeout(Some(value), errors),
        None => ResponseTimeout::from(idle_timeout),
    };
    let max_detect_memory_bytes = count(
        raw.max_detect_memory_bytes,
        d.max_detect_memory_bytes,
        errors,
    );
    let limits = Limits {
        max_connections: count(raw.max_connections, d.max_connections, errors),
        max_connections_per_org: count(
            raw.max_connections_per_org,
            d.max_connections_per_org,
            errors,
        ),
        max_new_connections_per_second_per_org: count(
            raw.max_new_connections_per_second_per_org,
            d.max_new_connections_per_second_per_org,
            errors,
        ),
        max_detect_memory_bytes,
        // Unset, an org's share follows the global: a quarter of it.
        max_detect_memory_bytes_per_org: count(
            raw.max_detect_memory_bytes_per_org,
            max_detect_memory_bytes / crate::config::model::DETECT_MEMORY_ORG_SHARE,
            errors,
        ),
        max_connections_per_client: count(
            raw.max_connections_per_client,
            d.max_connections_per_client,
            errors,
        ),
        max_new_connections_per_second_per_client: count(
            raw.max_new_connections_per_second_per_client,
            d.max_new_connections_per_second_per_client,
            errors,
        ),
        max_denial_records_per_second_per_client: count(
            raw.max_denial_records_per_second_per_client,
            d.max_denial_records_per_second_per_client,
            errors,
        ),
        max_denial_records_per_second_per_org: count(
            raw.max_denial_records_per_second_per_org,
            d.max_denial_records_per_second_per_org,
            errors,
        ),
        max_request_head_bytes: count(raw.max_request_head_bytes, d.max_request_head_bytes, errors),
        max_headers: count(raw.max_headers, d.max_headers, errors),
        header_read_timeout: timeout(raw.header_read_timeout, errors),
        connect_timeout: timeout(raw.connect_timeout, errors),
        idle_timeout,
        response_timeout,
        detect_timeout: timeout(raw.detect_timeout, errors),
        drain_timeout: timeout(raw.drain_timeout, errors),
        revoke_grace: timeout(raw.revoke_grace, errors),
        upstream_idle_timeout: timeout(raw.upstream_idle_timeout, errors),
        // 0 keeps no idle upstream connection: reuse off.
        max_idle_upstream_connections: count_or_zero(
            raw.max_idle_upstream_connections,
            d.max_idle_upstream_connections,
            errors,
        ),
        max_idle_upstream_connections_per_target: count(
            raw.max_idle_upstream_connections_per_target,
            d.max_idle_upstream_connections_per_target,
            errors,
        ),
    };
    ProxyConfig {
        listen: raw
            .listen
            .iter()
            .filter_map(|l| listeners.claim(l, errors))
            .collect(),
        transparent: raw
            .transparent
            .iter()
            .filter_map(|l| listeners.claim(l, errors))
            .collect(),
        socks5: raw
            .socks5
            .iter()
            .filter_map(|l| listeners.claim(l, errors))
            .collect(),
        limits,
    }
}

/// A count where 0 means "none": `default` when unset.
fn count_or_zero(
    value: Option<toml::Spanned<i64>>,
    default: usize,
    errors: &mut Errors<'_>,
) -> usize {
    let Some(value) = value else { return default };
    usize::try_from(*value.get_ref()).unwrap_or_else(|_| {
        errors.at(
            value.span(),
            format!("limit {} must be 0 or a positive integer", value.get_ref()),
        );
        default
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::test_support::{first_error, parse, BASE};

    #[test]
    fn durations_and_limits() {
        let src = BASE.replace(
            "[proxy]\n",
            "[proxy]\nconnect_timeout = \"250ms\"\nmax_connections = 7\n",
        );
        let c = parse(&src).unwrap();
        assert_eq!(
            c.proxy.limits.connect_timeout.get(),
            Duration::from_millis(250)
        );
        assert_eq!(c.proxy.limits.max_connections, 7);
        let bad = BASE.replace("[proxy]\n", "[proxy]\nidle_timeout = \"soon\"\n");
        assert!(first_error(&bad).contains("invalid duration \"soon\""));
        let zero = BASE.replace("[proxy]\n", "[proxy]\nmax_headers = 0\n");
        assert!(first_error(&zero).contains("positive"));
    }

    #[test]
    fn budgets_have_defaults_and_the_org_share_follows_the_global() {
        let d = parse(BASE).unwrap().proxy.limits;
        assert_eq!(d.max_connections_per_client, 256);
        assert_eq!(d.max_new_connections_per_second_per_client, 200);
        assert_eq!(d.max_denial_records_per_second_per_client, 50);
        assert_eq!(d.max_detect_memory_bytes_per_org, 16 * 1024 * 1024);
        let src = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_detect_memory_bytes = 4000000\nmax_connections_per_client = 9\n",
        );
        let c = parse(&src).unwrap().proxy.limits;
        assert_eq!(c.max_detect_memory_bytes_per_org, 1_000_000, "a quarter");
        assert_eq!(c.max_connections_per_client, 9);
        let set = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_detect_memory_bytes_per_org = 5\n",
        );
        assert_eq!(
            parse(&set)
                .unwrap()
                .proxy
                .limits
                .max_detect_memory_bytes_per_org,
            5
        );
        let zero = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_denial_records_per_second_per_client = 0\n",
        );
        assert!(first_error(&zero).contains("positive"));
    }

    #[test]
    fn the_evidence_budget_defaults_to_what_the_rates_allow_and_an_explicit_value_wins() {
        let budget = |src: &str| parse(src).unwrap().evidence.max_records_per_second_per_org;
        // 2 x 20000 new connections + 2000 queries, per second.
        assert_eq!(budget(BASE), 42_000);
        assert_eq!(
            crate::config::EvidenceConfig::for_dir(std::path::Path::new("e"))
                .max_records_per_second_per_org,
            42_000
        );
        // The benchmark's settings: far above, never throttled by default.
        let bench = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_new_connections_per_second_per_org = 100000000\n",
        ) + "[dns]\nmax_queries_per_second_per_client = 100000000\n";
        assert_eq!(budget(&bench), 300_000_000);
        // Small rates: the floor.
        let small = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_new_connections_per_second_per_org = 100\n",
        ) + "[dns]\nmax_queries_per_second_per_client = 10\n";
        assert_eq!(budget(&small), 10_000);
        // No overflow, whatever the rates.
        let huge = BASE.replace(
            "[proxy]\n",
            &format!(
                "[proxy]\nmax_new_connections_per_second_per_org = {}\n",
                i64::MAX
            ),
        );
        assert_eq!(budget(&huge), usize::MAX);
        // An explicit value wins over the derived one.
        let set = format!("{bench}[evidence]\nmax_records_per_second_per_org = 300\n");
        assert_eq!(budget(&set), 300);
        let zero = format!("{BASE}[evidence]\nmax_records_per_second_per_org = 0\n");
        let e = first_error(&zero);
        assert!(e.contains("positive") && e.starts_with("t.toml:10:"), "{e}");
    }

    #[test]
    fn upstream_reuse_keys_have_defaults_zero_turns_it_off_and_errors_are_located() {
        let d = parse(BASE).unwrap().proxy.limits;
        assert_eq!(d.max_idle_upstream_connections, 256);
        assert_eq!(d.max_idle_upstream_connections_per_target, 64);
        assert_eq!(d.upstream_idle_timeout.get(), Duration::from_secs(30));
        let src = BASE.replace(
            "[proxy]\n",
            "[proxy]\nmax_idle_upstream_connections = 0\nupstream_idle_timeout = \"10m\"\n",
        );
        let c = parse(&src).unwrap().proxy.limits;
        assert_eq!(c.max_idle_upstream_connections, 0);
        assert_eq!(c.upstream_idle_timeout.get(), Duration::from_secs(600));
        for (line, want) in [
            (
                "max_idle_upstream_connections = -1",
                "t.toml:3:33: limit -1 must be 0 or a positive integer",
            ),
            (
                "max_idle_upstream_connections_per_target = 0",
                "t.toml:3:44: limit 0 must be a positive integer",
            ),
            (
                "upstream_idle_timeout = \"11m\"",
                "t.toml:3:25: upstream_idle_timeout \"11m\" is above the maximum of 10m",
            ),
            (
                "upstream_idle_timeout = \"0s\"",
                "t.toml:3:25: duration \"0s\" must be positive",
            ),
        ] {
            let src = BASE.replace("[proxy]\n", &format!("[proxy]\n{line}\n"));
            assert_eq!(first_error(&src), want, "{line}");
        }
    }

    #[test]
    fn socks5_listeners_are_own_addresses_and_unique() {
        let src = BASE.replace("[proxy]\n", "[proxy]\nsocks5 = [\"127.0.0.1:1080\"]\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.proxy.socks5, vec!["127.0.0.1:1080".parse().unwrap()]);
        assert!(c
            .own_addresses()
            .contains(&"127.0.0.1:1080".parse().unwrap()));
        let dup = BASE.replace("[proxy]\n", "[proxy]\nsocks5 = [\"127.0.0.1:3128\"]\n");
        assert!(first_error(&dup).contains("used twice"));
    }
}
