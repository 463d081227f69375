//! `not_before` and `expires` on `[[org.allow]]`: RFC 3339 timestamps
//! with a UTC offset, `not_before` strictly before `expires`. A deny rule
//! takes neither: a deny that lapsed would open what it closed, with no
//! reload and no one looking.

use toml::Spanned;

use crate::config::error::Errors;
use crate::config::window::{parse_rfc3339, Window};

/// The interval the keys set, `None` when neither is written (or one is
/// wrong: the error is reported and the rule is not served anyway).
pub(super) fn window(
    (not_before, expires): (Option<Spanned<String>>, Option<Spanned<String>>),
    allow: bool,
    errors: &mut Errors<'_>,
) -> Option<Window> {
    if !allow {
        for (key, value) in [("not_before", &not_before), ("expires", &expires)] {
            if let Some(v) = value {
                errors.at(
                    v.span(),
                    format!(
                        "{key} is only valid on allow rules (a deny that ends would open \
                         what it closed; bound the allow rule instead)"
                    ),
                );
            }
        }
        return None;
    }
    let mut instant = |key: &str, value: &Option<Spanned<String>>| {
        let v = value.as_ref()?;
        match parse_rfc3339(v.get_ref()) {
            Ok(t) => Some(Some(t)),
            Err(why) => {
                errors.at(
                    v.span(),
                    format!(
                        "{key} {:?} is not an RFC 3339 timestamp ({why}; e.g. \
                         \"2026-12-05T18:00:00Z\")",
                        v.get_ref()
                    ),
                );
                None
            }
        }
    };
    let start = instant("not_before", &not_before);
    let end = instant("expires", &expires);
    let (Some(start), Some(end)) = (
        start.or(not_before.is_none().then_some(None)),
        end.or(expires.is_none().then_some(None)),
    ) else {
        return None;
    };
    if let (Some(a), Some(b), Some(v)) = (start, end, &not_before) {
        if a >= b {
            errors.at(
                v.span(),
                format!(
                    "not_before {:?} is not before expires {:?}: the rule would never match",
                    v.get_ref(),
                    expires.as_ref().map(|e| e.get_ref().as_str()).unwrap_or("")
                ),
            );
            return None;
        }
    }
    (start.is_some() || end.is_some()).then_some(Window {
        not_before: start,
        expires: end,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{assert_located, parse, BASE};
    use crate::config::{parse_rfc3339, Window};

    #[test]
    fn an_allow_rule_takes_an_interval() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"a.test\"\nnot_before = \"2026-12-05T08:00:00Z\"\n\
             expires = \"2026-12-05T10:00:00+01:00\"\n\
             [[org.allow]]\nhost = \"b.test\"\nexpires = \"2026-12-05T09:00:00Z\"\n\
             [[org.allow]]\nhost = \"c.test\"\n"
        );
        let c = parse(&src).unwrap();
        let t = |s: &str| Some(parse_rfc3339(s).unwrap());
        let rules = &c.orgs[0].allow;
        assert_eq!(
            rules[0].window,
            Some(Window {
                not_before: t("2026-12-05T08:00:00Z"),
                expires: t("2026-12-05T09:00:00Z"),
            })
        );
        assert_eq!(rules[1].window.and_then(|w| w.not_before), None);
        assert_eq!(rules[2].window, None);
        // The interval is part of the policy hash: a changed end reloads.
        let text = crate::policy::Policy::canonical_text(&c.orgs);
        assert!(
            text.contains(r#""expires":"2026-12-05T09:00:00Z""#),
            "{text}"
        );
    }

    #[test]
    fn bad_intervals_are_located_errors() {
        assert_located(
            "[[org.allow]]\nhost = \"a.test\"\n",
            &[
                (
                    "expires = \"2026-12-05T08:00:00\"",
                    6,
                    11,
                    "expires \"2026-12-05T08:00:00\" is not an RFC 3339 timestamp (no UTC offset",
                ),
                ("not_before = \"soon\"", 6, 14, "not an RFC 3339 timestamp"),
                (
                    "not_before = \"2026-12-05T09:00:00Z\"\nexpires = \"2026-12-05T09:00:00Z\"",
                    6,
                    14,
                    "is not before expires",
                ),
                (
                    "not_before = \"2026-12-05T10:00:00Z\"\nexpires = \"2026-12-05T09:00:00Z\"",
                    6,
                    14,
                    "the rule would never match",
                ),
                ("expires = 2026-12-05T08:00:00Z", 6, 11, "string"),
            ],
        );
    }

    #[test]
    fn an_interval_on_a_deny_rule_is_an_error() {
        let deny = "[[org.deny]]\nhost = \"a.test\"\n";
        let wants = "expires is only valid on allow rules";
        assert_located(
            deny,
            &[("expires = \"2026-12-05T09:00:00Z\"", 6, 11, wants)],
        );
    }
}
