//! The interval of a time-bound allow rule (`not_before`, `expires`) and
//! the RFC 3339 timestamps it is written in. Pure: whether a rule is live
//! is asked with the instant passed in.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// When a time-bound allow rule matches: from `not_before` (inclusive,
/// `None`: always did) until `expires` (exclusive, `None`: never ends).
/// At the instant `expires` the rule no longer matches; at the instant
/// `not_before` it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "instant_text"
    )]
    pub not_before: Option<SystemTime>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "instant_text"
    )]
    pub expires: Option<SystemTime>,
}

impl Window {
    /// Does the rule match at `now`?
    pub fn contains(&self, now: SystemTime) -> bool {
        self.not_before.is_none_or(|start| now >= start) && self.expires.is_none_or(|end| now < end)
    }

    /// The first instant after `now` at which [`Window::contains`] changes,
    /// if one is still to come.
    pub fn next_change(&self, now: SystemTime) -> Option<SystemTime> {
        [self.not_before, self.expires]
            .into_iter()
            .flatten()
            .filter(|t| *t > now)
            .min()
    }

    /// Has the rule ended for good at `now` (past `expires`)?
    pub fn ended(&self, now: SystemTime) -> bool {
        self.expires.is_some_and(|end| now >= end)
    }

    /// The interval in words: `from T`, `until T`, `from T until T`.
    pub fn describe(&self) -> String {
        match (self.not_before, self.expires) {
            (Some(a), Some(b)) => format!("from {} until {}", rfc3339(a), rfc3339(b)),
            (Some(a), None) => format!("from {}", rfc3339(a)),
            (None, Some(b)) => format!("until {}", rfc3339(b)),
            (None, None) => "always".to_string(),
        }
    }
}

/// `t` as RFC 3339 UTC text (seconds, with fractions when it has them).
pub fn rfc3339(t: SystemTime) -> String {
    if t.duration_since(UNIX_EPOCH)
        .is_ok_and(|d| d.subsec_nanos() == 0)
    {
        humantime::format_rfc3339_seconds(t).to_string()
    } else {
        humantime::format_rfc3339_nanos(t).to_string()
    }
}

fn instant_text<S: serde::Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&rfc3339(*t)),
        None => s.serialize_none(),
    }
}

/// Parse an RFC 3339 timestamp with its offset (`Z` or `±HH:MM`): a
/// date, `T` (or a space), a time with optional fractional seconds. A
/// time without an offset is refused: it names no instant.
pub fn parse_rfc3339(text: &str) -> Result<SystemTime, &'static str> {
    let text = text.trim();
    let (local, offset) = if let Some(rest) = text.strip_suffix(['Z', 'z']) {
        (rest, 0i64)
    } else {
        let cut = text.len().checked_sub(6).ok_or("too short")?;
        let (rest, off) = text.split_at_checked(cut).ok_or("not ASCII")?;
        let sign = match off.as_bytes().first() {
            Some(b'+') => 1,
            Some(b'-') => -1,
            _ => return Err("no UTC offset (end it with Z or +HH:MM)"),
        };
        let (h, m) = off[1..].split_once(':').ok_or("bad UTC offset")?;
        let (h, m): (i64, i64) = match (h.parse(), m.parse()) {
            (Ok(h), Ok(m)) if h < 24 && m < 60 && off[1..].len() == 5 => (h, m),
            _ => return Err("bad UTC offset"),
        };
        (rest, sign * (h * 3600 + m * 60))
    };
    if local.len() < 19 || !matches!(local.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return Err("expected YYYY-MM-DDTHH:MM:SS");
    }
    let at = humantime::parse_rfc3339_weak(local).map_err(|_| "not a valid date and time")?;
    let shift = Duration::from_secs(offset.unsigned_abs());
    // Local time = UTC + offset, so UTC = local - offset.
    let utc = if offset >= 0 {
        at.checked_sub(shift)
    } else {
        at.checked_add(shift)
    };
    utc.ok_or("out of range")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> SystemTime {
        parse_rfc3339(text).unwrap()
    }

    #[test]
    fn offsets_and_fractions_name_the_same_instant() {
        let z = at("2026-12-05T08:00:00Z");
        assert_eq!(at("2026-12-05T10:00:00+02:00"), z);
        assert_eq!(at("2026-12-05T07:30:00-00:30"), z);
        assert_eq!(at("2026-12-05 08:00:00z"), z);
        assert_eq!(
            at("2026-12-05T08:00:00.250Z"),
            z + Duration::from_millis(250)
        );
        assert_eq!(rfc3339(z), "2026-12-05T08:00:00Z");
    }

    #[test]
    fn a_time_that_names_no_instant_is_refused() {
        for bad in [
            "2026-12-05T08:00:00",
            "2026-12-05",
            "tomorrow",
            "2026-13-05T08:00:00Z",
            "2026-12-05T08:00:00+2:00",
            "2026-12-05T08:00:00+02:60",
            "",
            "2026-12-05T08:00:00Ω",
        ] {
            assert!(parse_rfc3339(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_interval_holds_its_start_and_not_its_end() {
        let (a, b) = (at("2026-12-05T08:00:00Z"), at("2026-12-05T09:00:00Z"));
        let w = Window {
            not_before: Some(a),
            expires: Some(b),
        };
        let ns = Duration::from_nanos(1);
        assert!(!w.contains(a - ns));
        assert!(w.contains(a));
        assert!(w.contains(b - ns));
        assert!(!w.contains(b));
        assert!(!w.contains(b + ns));
        assert_eq!(w.next_change(a - ns), Some(a));
        assert_eq!(w.next_change(a), Some(b));
        assert_eq!(w.next_change(b), None);
        assert!(!w.ended(b - ns) && w.ended(b));
        assert_eq!(
            w.describe(),
            "from 2026-12-05T08:00:00Z until 2026-12-05T09:00:00Z"
        );
    }
}
