//! `[enforcement]`: the nftables ruleset the gateway must have loaded,
//! what its absence does, and how often it is checked. That the file
//! itself parses is checked where `nft` can be run (`palisade check`,
//! start-up: `crate::enforcement`), located in the file.

use toml::Spanned;

use super::values::positive_duration;
use crate::config::error::Errors;
use crate::config::model::{
    EnforcementConfig, EnforcementMode, DEFAULT_ENFORCEMENT_CHECK_INTERVAL,
    MAX_ENFORCEMENT_CHECK_INTERVAL, MIN_ENFORCEMENT_CHECK_INTERVAL,
};
use crate::config::raw::RawEnforcement;
use crate::config::timeout::short;

pub(super) fn validate_enforcement(
    raw: RawEnforcement,
    errors: &mut Errors<'_>,
) -> Option<EnforcementConfig> {
    let RawEnforcement {
        ruleset,
        mode,
        check_interval,
    } = raw;
    let mode = mode.and_then(|m| mode_of(&m, errors).map(|v| (v, m.span())));
    let interval = check_interval.and_then(|i| interval_of(&i, errors).map(|v| (v, i.span())));
    let Some(ruleset) = ruleset else {
        // A setting without the ruleset it is about would check nothing:
        // the operator meant something to be enforced.
        for (key, span) in [
            ("mode", mode.map(|m| m.1)),
            ("check_interval", interval.map(|i| i.1)),
        ] {
            if let Some(span) = span {
                errors.at(
                    span,
                    format!("enforcement.{key} is set but enforcement.ruleset is not: nothing would be checked"),
                );
            }
        }
        return None;
    };
    let at = errors.locate(ruleset.span().start);
    if ruleset.get_ref().trim().is_empty() {
        errors.at(ruleset.span(), "enforcement.ruleset must not be empty");
        return None;
    }
    Some(EnforcementConfig {
        ruleset: ruleset.into_inner().into(),
        mode: mode.map_or(EnforcementMode::Required, |m| m.0),
        check_interval: interval.map_or(DEFAULT_ENFORCEMENT_CHECK_INTERVAL, |i| i.0),
        at,
    })
}

fn mode_of(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<EnforcementMode> {
    match value.get_ref().as_str() {
        "required" => Some(EnforcementMode::Required),
        "advisory" => Some(EnforcementMode::Advisory),
        other => {
            errors.at(
                value.span(),
                format!(
                    "enforcement.mode {other:?} is not one of {}",
                    EnforcementMode::NAMES.join(", ")
                ),
            );
            None
        }
    }
}

fn interval_of(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<std::time::Duration> {
    let d = positive_duration(value, errors)?;
    let (min, max) = (
        MIN_ENFORCEMENT_CHECK_INTERVAL,
        MAX_ENFORCEMENT_CHECK_INTERVAL,
    );
    if d < min || d > max {
        errors.at(
            value.span(),
            format!(
                "check_interval {:?} is outside {} to {}",
                value.get_ref(),
                humantime::format_duration(min),
                short(max)
            ),
        );
        return None;
    }
    Some(d)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::model::EnforcementMode;
    use crate::config::test_support::{first_error_in, parse, BASE};

    #[test]
    fn unset_checks_nothing_and_set_defaults_to_required_every_10s() {
        assert_eq!(parse(BASE).unwrap().enforcement, None);
        let c = parse(&format!("[enforcement]\nruleset = \"gw.nft\"\n{BASE}")).unwrap();
        let e = c.enforcement.unwrap();
        assert_eq!(e.ruleset, std::path::PathBuf::from("gw.nft"));
        assert_eq!(e.mode, EnforcementMode::Required);
        assert_eq!(e.check_interval, Duration::from_secs(10));
        assert_eq!((e.at.path.as_str(), e.at.line, e.at.col), ("t.toml", 2, 11));
        let c = parse(&format!(
            "[enforcement]\nruleset = \"gw.nft\"\nmode = \"advisory\"\ncheck_interval = \"250ms\"\n{BASE}"
        ))
        .unwrap();
        let e = c.enforcement.unwrap();
        assert_eq!(e.mode, EnforcementMode::Advisory);
        assert_eq!(e.check_interval, Duration::from_millis(250));
    }

    #[test]
    fn bad_values_are_located_errors() {
        let cases = [
            ("ruleset = \"\"\n", "t.toml:2:11: enforcement.ruleset must not be empty"),
            (
                "ruleset = \"a\"\nmode = \"strict\"\n",
                "t.toml:3:8: enforcement.mode \"strict\" is not one of required, advisory",
            ),
            (
                "ruleset = \"a\"\ncheck_interval = \"50ms\"\n",
                "t.toml:3:18: check_interval \"50ms\" is outside 100ms to 10m",
            ),
            (
                "ruleset = \"a\"\ncheck_interval = \"11m\"\n",
                "t.toml:3:18: check_interval \"11m\" is outside 100ms to 10m",
            ),
            ("ruleset = \"a\"\ncheck_interval = \"0s\"\n", "must be positive"),
            (
                "mode = \"advisory\"\n",
                "t.toml:2:8: enforcement.mode is set but enforcement.ruleset is not: nothing would be checked",
            ),
            (
                "check_interval = \"1s\"\n",
                "t.toml:2:18: enforcement.check_interval is set but enforcement.ruleset is not",
            ),
            ("ruleset = 1\n", "t.toml:2:11: invalid type"),
            ("rules = \"a\"\n", "t.toml:2:1: unknown field `rules`"),
        ];
        for (extra, want) in cases {
            let e = first_error_in("enforcement", extra);
            assert!(
                e.starts_with(want) || e.contains(want),
                "{extra}: {e} (want {want})"
            );
        }
    }
}
