//! `[decider]`: the endpoint consulted on a miss, its timeout, how many
//! consultations run at once, and what an error is (`on_error = "deny"`,
//! the only value).

use toml::Spanned;

use super::otel::endpoint_problem;
use super::values::positive_duration;
use crate::config::error::Errors;
use crate::config::model::{
    DeciderConfig, DEFAULT_DECIDER_IN_FLIGHT, DEFAULT_DECIDER_TIMEOUT, MAX_DECIDER_IN_FLIGHT,
    MAX_DECIDER_TIMEOUT,
};
use crate::config::raw::RawDecider;

pub(super) fn validate_decider(
    raw: Spanned<RawDecider>,
    errors: &mut Errors<'_>,
) -> Option<DeciderConfig> {
    let table = raw.span();
    let RawDecider {
        url,
        timeout,
        on_error,
        max_in_flight,
    } = raw.into_inner();
    if let Some(v) = &on_error {
        if v.get_ref() != "deny" {
            errors.at(
                v.span(),
                format!(
                    "decider.on_error {:?}: the only value is \"deny\" (an unanswered miss is never let through)",
                    v.get_ref()
                ),
            );
        }
    }
    let timeout = match &timeout {
        None => Some(DEFAULT_DECIDER_TIMEOUT),
        Some(t) => positive_duration(t, errors).and_then(|d| {
            if d > MAX_DECIDER_TIMEOUT {
                errors.at(
                    t.span(),
                    format!(
                        "decider.timeout {:?} is over the maximum of 10s (a miss waits for it)",
                        t.get_ref()
                    ),
                );
                return None;
            }
            Some(d)
        }),
    };
    let max_in_flight = match &max_in_flight {
        None => Some(DEFAULT_DECIDER_IN_FLIGHT),
        Some(n) => match usize::try_from(*n.get_ref()) {
            Ok(n) if (1..=MAX_DECIDER_IN_FLIGHT).contains(&n) => Some(n),
            _ => {
                errors.at(
                    n.span(),
                    format!("decider.max_in_flight must be 1 to {MAX_DECIDER_IN_FLIGHT}"),
                );
                None
            }
        },
    };
    let url = match &url {
        None => {
            errors.at(
                table,
                "[decider] needs url (the endpoint asked about a miss)",
            );
            None
        }
        Some(u) => {
            let text = u.get_ref().trim();
            match endpoint_problem(text) {
                None => Some(text.to_owned()),
                Some(why) => {
                    errors.at(
                        u.span(),
                        format!("decider.url {text:?} is not an http:// URL: {why}"),
                    );
                    None
                }
            }
        }
    };
    Some(DeciderConfig {
        url: url?,
        timeout: timeout?,
        max_in_flight: max_in_flight?,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::test_support::{first_error, parse, BASE};

    #[test]
    fn a_decider_takes_a_url_and_defaults() {
        let c = parse(&format!(
            "{BASE}[decider]\nurl = \"http://198.18.5.1:8080/decide\"\n"
        ))
        .unwrap();
        let d = c.decider.unwrap();
        assert_eq!(d.url, "http://198.18.5.1:8080/decide");
        assert_eq!(d.timeout, Duration::from_millis(500));
        assert_eq!(d.max_in_flight, 64);
        assert!(parse(BASE).unwrap().decider.is_none());
    }

    #[test]
    fn bad_decider_keys_are_located_errors() {
        for (extra, wants) in [
            ("url = \"https://d.test/\"", "is not an http:// URL"),
            (
                "url = \"http://d.test/\"\ntimeout = \"20s\"",
                "over the maximum",
            ),
            (
                "url = \"http://d.test/\"\ntimeout = \"soon\"",
                "invalid duration",
            ),
            (
                "url = \"http://d.test/\"\non_error = \"allow\"",
                "the only value is \"deny\"",
            ),
            (
                "url = \"http://d.test/\"\nmax_in_flight = 0",
                "must be 1 to 4096",
            ),
            ("timeout = \"1s\"", "[decider] needs url"),
        ] {
            let e = first_error(&format!("{BASE}[decider]\n{extra}\n"));
            assert!(e.starts_with("t.toml:"), "{extra}: {e}");
            assert!(e.contains(wants), "{extra}: {e}");
        }
    }
}
