//! Validation: raw structs in, typed values out, every problem located.
//! One file per section; reading one value, what every section shares,
//! in `values.rs`.

use std::path::Path;

use toml::Spanned;

use super::error::Errors;
use super::model::Config;
use super::raw::RawConfig;

mod admin;
mod baseline;
mod bypass;
mod credentials;
mod decider;
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
mod values;
mod volume;
mod window;

use admin::validate_admin;
use bypass::validate_bypass;
use dns::validate_dns;
use enforcement::validate_enforcement;
use evidence::{check_capacity, validate_evidence};
use intercept::validate_intercept;
use org::validate_orgs;
use proxy::validate_proxy;
use values::Listeners;

pub(super) fn validate(raw: RawConfig, path: &Path, errors: &mut Errors<'_>) -> Config {
    // Every table of `RawConfig` is read here (one read nowhere is a
    // dead-code warning, an error under `clippy -D warnings`).
    // Listen addresses in this order, each unique across all listeners.
    let mut listeners = Listeners::default();
    let proxy = validate_proxy(raw.proxy, &mut listeners, errors);
    let pool_spans = dns::pool_spans(&raw.dns);
    let dns = validate_dns(raw.dns, &mut listeners, errors);
    let org_names: Vec<&str> = raw.org.iter().map(|o| o.name.get_ref().as_str()).collect();
    let admin = validate_admin(raw.admin, &org_names, &mut listeners, errors);
    let default_budget = super::model::default_max_records_per_second_per_org(&proxy.limits, &dns);
    // The capacity check is located at retain_size, the key it is about.
    let retain_at = raw.evidence.retain_size.as_ref().map(Spanned::span);
    let evidence = validate_evidence(raw.evidence, default_budget, errors);

    let intercept = validate_intercept(raw.intercept, errors);
    let bypass = validate_bypass(raw.bypass, errors);
    let enforcement = validate_enforcement(raw.enforcement, errors);
    let otel = raw.otel.and_then(|o| otel::validate_otel(o, errors));
    let decider = raw
        .decider
        .and_then(|d| decider::validate_decider(d, errors));
    let pools_set = dns.synthetic_pool.is_some() || dns.synthetic_pool_v6.is_some();
    let super::raw::RawPolicy { baseline } = raw.policy;
    let baseline = baseline.and_then(|b| baseline::load_baseline(&b, path, errors));
    let orgs = validate_orgs(raw.org, pools_set, baseline.as_ref(), errors);
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
        decider,
        orgs,
    };
    dns::check_pools(&config, &pool_spans, errors);
    config
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
