//! One record selection for every reader of the evidence: `evidence
//! query` and `export`, `evidence summary`, `draft`, the live tail
//! (`GET /v1/decisions`) and the probe report.
//!
//! A [`Selection`] is a set of optional conditions, all of which a record
//! must meet; `None` matches everything. Its parts have one meaning
//! wherever they are given:
//!
//! - `host` is a glob over the record's target name or address ([`glob`]:
//!   `*` any run of characters, dots included, `?` exactly one, anything
//!   else itself, ASCII case-folded): `api.example.com` is that name,
//!   `*.example.com` every name below it (not `example.com` itself). A
//!   summary record (a flood of denials counted as one) matches when one
//!   of the busiest hosts it names does.
//! - `since` and `until` are RFC 3339 times, inclusive, parsed at the edge
//!   by [`parse_time`] (the one time parser, a clap `value_parser`).
//! - `reason` is a reason code, `decision` `allow` or `deny`, `org` an org
//!   name (`unknown` for clients of no org).

use std::time::SystemTime;

use super::Record;
use crate::policy::Reason;

/// What a reader of the evidence wants of it; `None` matches everything.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Selection {
    /// Org name (`unknown` for clients of no org).
    pub org: Option<String>,
    /// `allow` or `deny` ([`parse_decision`]).
    pub decision: Option<&'static str>,
    pub reason: Option<Reason>,
    pub since: Option<SystemTime>,
    pub until: Option<SystemTime>,
    /// A glob over the target ([`glob`]), lower case, no trailing dot.
    pub host: Option<String>,
    /// A record's reference (what its client was shown) or its `id`; a
    /// close record matches too when it closes that decision.
    pub record: Option<String>,
    /// `tcp`, `http`, `dns` or `bypass`.
    pub kind: Option<String>,
    /// `explicit`, `transparent`, `dns` or `socks5`.
    pub mode: Option<String>,
}

/// The kinds a selection may name.
pub(crate) const KINDS: [&str; 4] = ["tcp", "http", "dns", "bypass"];
/// The modes a selection may name.
pub(crate) const MODES: [&str; 4] = ["explicit", "transparent", "dns", "socks5"];

impl Selection {
    /// Only `org`'s records.
    pub(crate) fn org(org: &str) -> Selection {
        Selection {
            org: Some(org.to_string()),
            ..Selection::default()
        }
    }

    /// Whether the selection has a time window.
    pub(crate) fn has_window(&self) -> bool {
        self.since.is_some() || self.until.is_some()
    }

    /// Whether `r` meets every condition given.
    pub(crate) fn matches(&self, r: &Record) -> bool {
        self.record
            .as_deref()
            .is_none_or(|x| r.is_named(x) || r.conn.as_deref() == Some(x))
            && self
                .org
                .as_deref()
                .is_none_or(|o| r.org.as_deref().unwrap_or("unknown") == o)
            && self.decision.is_none_or(|d| r.decision_str() == d)
            && self.reason.is_none_or(|x| r.reason == x)
            && self.kind.as_deref().is_none_or(|k| r.kind.as_str() == k)
            && self.mode.as_deref().is_none_or(|m| r.mode.as_str() == m)
            && self.host.as_deref().is_none_or(|g| host_matches(g, r))
            && self.in_window(r)
    }

    /// Whether `r`'s time lies in the window (a record whose time does
    /// not parse lies in none).
    pub(crate) fn in_window(&self, r: &Record) -> bool {
        if !self.has_window() {
            return true;
        }
        let Ok(t) = humantime::parse_rfc3339(&r.ts) else {
            return false;
        };
        self.since.is_none_or(|s| t >= s) && self.until.is_none_or(|u| t <= u)
    }
}

/// Whether the glob `g` matches `r`'s target: its host, or for a summary
/// record one of the busiest hosts it names.
fn host_matches(g: &str, r: &Record) -> bool {
    match (&r.host, &r.hosts) {
        (Some(h), _) => glob(g.as_bytes(), h.as_bytes()),
        (None, Some(hosts)) => hosts.keys().any(|h| glob(g.as_bytes(), h.as_bytes())),
        (None, None) => false,
    }
}

/// Whether `text` matches `pattern` whole: `*` any run of bytes (`.`
/// included), `?` exactly one, anything else itself (ASCII case-folded).
/// Iterative with one backtrack point: linear in practice, never
/// exponential.
pub(crate) fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c.eq_ignore_ascii_case(&text[t]) => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// `--since`/`--until` (a clap `value_parser`): an RFC 3339 time, or why
/// not.
pub fn parse_time(text: &str) -> Result<SystemTime, String> {
    humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("{e} (expected RFC 3339, e.g. 2026-01-02T03:04:05Z)"))
}

/// `--host` (a clap `value_parser`) and the tail's `host` filter: a name
/// glob, lower case, without a trailing dot.
pub fn parse_host(text: &str) -> Result<String, String> {
    let text = text.trim();
    let glob = text.strip_suffix('.').unwrap_or(text);
    let ok = !glob.is_empty()
        && glob.len() <= 253
        && glob.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'*' | b'?')
        });
    if !ok {
        return Err("expected a name glob (letters, digits, . - _ : and * ?)".into());
    }
    Ok(glob.to_ascii_lowercase())
}

/// `--reason` (a clap `value_parser`): a reason code.
pub fn parse_reason(text: &str) -> Result<Reason, String> {
    Reason::ALL
        .into_iter()
        .find(|r| r.as_str() == text)
        .ok_or_else(|| "not a reason code".to_string())
}

/// `--decision` (a clap `value_parser`): `allow` or `deny`.
pub fn parse_decision(text: &str) -> Result<&'static str, String> {
    match text {
        "allow" => Ok("allow"),
        "deny" => Ok("deny"),
        _ => Err("expected allow or deny".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_names() {
        for (p, t, want) in [
            ("*.example.com", "api.example.com", true),
            ("*.example.com", "a.b.example.com", true),
            ("*.example.com", "example.com", false),
            ("api.*", "api.example.com", true),
            ("a?i.test", "api.test", true),
            ("a?i.test", "apii.test", false),
            ("*", "", true),
            ("", "x", false),
            (
                "*x*y*z*",
                "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaxaaaaaay",
                false,
            ),
            ("OTHER.test", "other.TEST", true),
        ] {
            assert_eq!(glob(p.as_bytes(), t.as_bytes()), want, "{p} ~ {t}");
        }
    }

    #[test]
    fn the_edge_parsers_name_what_they_expect() {
        assert!(parse_time("2026-01-02T03:04:05Z").is_ok());
        let e = parse_time("yesterday").unwrap_err();
        assert!(e.contains("expected RFC 3339"), "{e}");
        assert_eq!(parse_host("*.Example.COM.").unwrap(), "*.example.com");
        assert!(parse_host("a b").is_err());
        assert!(parse_host("").is_err());
        assert_eq!(parse_reason("no_matching_rule"), Ok(Reason::NoMatchingRule));
        assert!(parse_reason("nope").is_err());
        assert_eq!(parse_decision("deny"), Ok("deny"));
        assert!(parse_decision("maybe").is_err());
    }
}
