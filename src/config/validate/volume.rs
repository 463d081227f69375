//! Volume budgets, on `[[org.allow]]` and on `[[org]]`: `max_bytes_up`,
//! `max_bytes_down` (sizes) over `volume_window` (a duration within
//! [`MIN_VOLUME_WINDOW`] and [`MAX_VOLUME_WINDOW`], [`DEFAULT_VOLUME_WINDOW`]
//! when unset).

use toml::Spanned;

use super::evidence::positive_size;
use super::values::positive_duration;
use crate::config::error::Errors;
use crate::config::model::{Volume, DEFAULT_VOLUME_WINDOW, MAX_VOLUME_WINDOW, MIN_VOLUME_WINDOW};
use crate::config::raw::RawSize;

/// The three keys as written.
pub(super) type RawVolume = (
    Option<Spanned<RawSize>>,
    Option<Spanned<RawSize>>,
    Option<Spanned<String>>,
);

/// The budget the keys set, `None` when none is written. `refused`: why
/// these keys cannot be on this table (a deny rule), when they cannot.
pub(super) fn volume(
    (up, down, window): RawVolume,
    refused: Option<&str>,
    errors: &mut Errors<'_>,
) -> Option<Volume> {
    if let Some(why) = refused {
        for (key, span) in [
            ("max_bytes_up", up.as_ref().map(Spanned::span)),
            ("max_bytes_down", down.as_ref().map(Spanned::span)),
            ("volume_window", window.as_ref().map(Spanned::span)),
        ] {
            if let Some(span) = span {
                errors.at(span, format!("{key} {why}"));
            }
        }
        return None;
    }
    if up.is_none() && down.is_none() {
        if let Some(w) = window {
            errors.at(
                w.span(),
                "volume_window needs max_bytes_up or max_bytes_down (the budget it is the window of)",
            );
        }
        return None;
    }
    let up = up.and_then(|v| bytes("max_bytes_up", v, errors));
    let down = down.and_then(|v| bytes("max_bytes_down", v, errors));
    let window = match window {
        None => DEFAULT_VOLUME_WINDOW,
        Some(w) => {
            let d = positive_duration(&w, errors)?;
            if !(MIN_VOLUME_WINDOW..=MAX_VOLUME_WINDOW).contains(&d) {
                errors.at(
                    w.span(),
                    format!("volume_window {:?} out of range 1s-7days", w.get_ref()),
                );
                return None;
            }
            d
        }
    };
    if up.is_none() && down.is_none() {
        return None;
    }
    Some(Volume { up, down, window })
}

/// One budget: a positive byte count or size (`"10MiB"`).
fn bytes(key: &str, value: Spanned<RawSize>, errors: &mut Errors<'_>) -> Option<u64> {
    positive_size(value.get_ref())
        .map_err(|shown| {
            errors.at(
                value.span(),
                format!(
                    "{key} = {shown}: a budget is a positive byte count or size \
                     (e.g. 1048576 or \"10MiB\"; units B, kB, MB, GB, KiB, MiB, GiB)"
                ),
            )
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::test_support::{assert_located, errors, parse, BASE};
    use crate::config::Volume;

    #[test]
    fn budgets_on_allow_rules_and_orgs() {
        let src = format!(
            "{BASE}max_bytes_up = \"1GiB\"\n\
             [[org.allow]]\nid = \"gh\"\nhost = \"github.test\"\nmax_bytes_up = \"10MiB\"\n\
             max_bytes_down = 5000\nvolume_window = \"10m\"\n\
             [[org.allow]]\nid = \"free\"\nhost = \"free.test\"\n"
        );
        let c = parse(&src).unwrap();
        let org = &c.orgs[0];
        assert_eq!(
            org.volume,
            Some(Volume {
                up: Some(1 << 30),
                down: None,
                window: Duration::from_secs(3600)
            })
        );
        assert_eq!(
            org.allow[0].volume,
            Some(Volume {
                up: Some(10 << 20),
                down: Some(5000),
                window: Duration::from_secs(600)
            })
        );
        assert_eq!(org.allow[1].volume, None);
    }

    #[test]
    fn bad_budgets_are_located_errors() {
        assert_located(
            "[[org.allow]]\nhost = \"a.test\"\n",
            &[
                (
                    "max_bytes_up = 0",
                    6,
                    16,
                    "max_bytes_up = 0: a budget is a positive",
                ),
                ("max_bytes_down = -5", 6, 18, "max_bytes_down = -5"),
                (
                    "max_bytes_up = \"10 lots\"",
                    6,
                    16,
                    "max_bytes_up = \"10 lots\"",
                ),
                ("max_bytes_up = \"0MiB\"", 6, 16, "positive"),
                (
                    "max_bytes_up = 1\nvolume_window = \"500ms\"",
                    7,
                    17,
                    "out of range 1s-7days",
                ),
                (
                    "max_bytes_up = 1\nvolume_window = \"8days\"",
                    7,
                    17,
                    "out of range 1s-7days",
                ),
                (
                    "max_bytes_up = 1\nvolume_window = \"soon\"",
                    7,
                    17,
                    "invalid duration",
                ),
                (
                    "max_bytes_up = 1\nvolume_window = \"0s\"",
                    7,
                    17,
                    "must be positive",
                ),
                (
                    "volume_window = \"1h\"",
                    6,
                    17,
                    "needs max_bytes_up or max_bytes_down",
                ),
            ],
        );
    }

    #[test]
    fn a_budget_on_a_deny_rule_is_an_error() {
        let deny = "[[org.deny]]\nhost = \"a.test\"\n";
        let wants = "max_bytes_down is only valid on allow rules";
        assert_located(deny, &[("max_bytes_down = \"1MiB\"", 6, 18, wants)]);
    }

    #[test]
    fn an_org_budget_with_a_bad_window_is_located() {
        let e = errors("max_bytes_up = 10\nvolume_window = \"9days\"\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("t.toml:5:17: "), "{}", e[0]);
    }
}
