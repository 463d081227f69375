//! `[evidence]`: where and how decisions are recorded.

use std::path::PathBuf;
use std::time::Duration;

use toml::Spanned;

use super::values::{count, duration, path};
use crate::config::error::Errors;
use crate::config::model::{
    capacity, replica_problem, Durability, EvidenceConfig, MinFree, WitnessConfig,
    DEFAULT_EVIDENCE_DIR, MIN_RETAIN_MIN_AGE, WORST_BYTES_PER_RECORD,
};
use crate::config::raw::{RawEvidence, RawSize, RawWitness};

/// `[evidence]`; `default_budget` is what `max_records_per_second_per_org`
/// is when unset (derived from the proxy's and the DNS shim's rates).
pub(super) fn validate_evidence(
    raw: RawEvidence,
    default_budget: usize,
    errors: &mut Errors<'_>,
) -> EvidenceConfig {
    // Every key of `RawEvidence` is read below (one read nowhere is a
    // dead-code warning, an error under `clippy -D warnings`).
    let dir = path(
        raw.dir,
        PathBuf::from(DEFAULT_EVIDENCE_DIR),
        "evidence dir",
        errors,
    );
    let d = EvidenceConfig::for_dir(&dir);
    let key = path(raw.key, d.key, "evidence key", errors);
    let durability = raw
        .durability
        .map_or(d.durability, |v| durability_of(&v, errors));
    let checkpoint_every = count(raw.checkpoint_every, d.checkpoint_every as usize, errors) as u64;
    let checkpoint_interval = duration(raw.checkpoint_interval, d.checkpoint_interval, errors);
    let rotate_size = size(raw.rotate_size, errors).unwrap_or(d.rotate_size);
    let rotate_age = duration(raw.rotate_age, d.rotate_age, errors);
    let retain_size = raw.retain_size.and_then(|r| {
        let span = r.span();
        let n = size(Some(r), errors)?;
        if n < rotate_size {
            errors.at(
                span,
                format!("retain_size must be at least rotate_size ({rotate_size} bytes)"),
            );
        }
        Some(n)
    });
    let raw_age_span = raw.retain_age.as_ref().map(Spanned::span);
    let retain_age = raw
        .retain_age
        .map(|v| duration(Some(v), Duration::ZERO, errors));
    let retain_min_age = retain_floor(
        raw.retain_min_age,
        retain_age,
        raw_age_span,
        d.retain_min_age,
        errors,
    );
    let min_free = raw
        .min_free
        .map_or(d.min_free, |v| free(v, errors).unwrap_or(d.min_free));
    let replica = match raw.replica {
        None => d.replica,
        Some(v) => {
            if let Some(problem) = replica_problem(v.get_ref()) {
                errors.at(v.span(), format!("replica {:?} {problem}", v.get_ref()));
            }
            v.into_inner()
        }
    };
    EvidenceConfig {
        dir,
        key,
        durability,
        checkpoint_every,
        checkpoint_interval,
        rotate_size,
        rotate_age,
        retain_size,
        retain_age,
        retain_min_age,
        min_free,
        max_records_per_second_per_org: count(
            raw.max_records_per_second_per_org,
            default_budget,
            errors,
        ),
        replica,
        witnesses: raw
            .witnesses
            .into_iter()
            .filter_map(|w| witness(w.into_inner(), errors))
            .collect(),
    }
}

/// `durability`: `"os"`, `"fsync"` or `"discard"`.
fn durability_of(v: &Spanned<String>, errors: &mut Errors<'_>) -> Durability {
    match v.get_ref().as_str() {
        "os" => Durability::Os,
        "fsync" => Durability::Fsync,
        "discard" => Durability::Discard,
        other => {
            errors.at(
                v.span(),
                format!("durability {other:?} must be \"os\", \"fsync\" or \"discard\""),
            );
            Durability::Os
        }
    }
}

/// `retain_min_age`, the floor under age and size retention: at least
/// `MIN_RETAIN_MIN_AGE` and at most `retain_age`; unset, the default
/// floor or `retain_age` if shorter (which must then be at least
/// `MIN_RETAIN_MIN_AGE` itself, `age_span` naming it).
fn retain_floor(
    retain_min_age: Option<Spanned<String>>,
    retain_age: Option<Duration>,
    age_span: Option<std::ops::Range<usize>>,
    default: Duration,
    errors: &mut Errors<'_>,
) -> Duration {
    let retain_min_age = match retain_min_age {
        None => default.min(retain_age.unwrap_or(Duration::MAX)),
        Some(v) => {
            let age = duration(Some(v.clone()), default, errors);
            let shown = v.get_ref();
            if age < MIN_RETAIN_MIN_AGE {
                errors.at(
                    v.span(),
                    format!(
                        "retain_min_age {shown:?} is below {}, the least time a shipper is given to copy a closed segment",
                        humantime::format_duration(MIN_RETAIN_MIN_AGE)
                    ),
                );
            } else if let Some(max) = retain_age.filter(|max| age > *max) {
                errors.at(
                    v.span(),
                    format!(
                        "retain_min_age {shown:?} exceeds retain_age ({}): age-based retention would remove segments the floor keeps",
                        humantime::format_duration(max)
                    ),
                );
            }
            age
        }
    };
    if retain_min_age < MIN_RETAIN_MIN_AGE {
        // Unset, under a retain_age shorter than the least floor.
        if let Some(age) = &age_span {
            errors.at(
                age.clone(),
                format!(
                    "retain_age must be at least {} (the least retain_min_age)",
                    humantime::format_duration(MIN_RETAIN_MIN_AGE)
                ),
            );
        }
    }
    retain_min_age
}

/// One `[evidence] witnesses` entry: an `http://` submission prefix and a
/// witness verifier key.
fn witness(raw: RawWitness, errors: &mut Errors<'_>) -> Option<WitnessConfig> {
    let RawWitness { url, key } = raw;
    let uri = match url.get_ref().parse::<http::Uri>() {
        Ok(u) if u.scheme_str() == Some("http") && u.host().is_some() && u.query().is_none() => {
            Some(u)
        }
        Ok(u) if u.scheme_str() == Some("https") => {
            errors.at(
                url.span(),
                format!(
                    "witness url {:?}: https is not supported yet; reach the witness over http:// (a cosignature is verified with its key, whatever carried it)",
                    url.get_ref()
                ),
            );
            None
        }
        _ => {
            errors.at(
                url.span(),
                format!(
                    "witness url {:?} must be http://HOST[:PORT][/PATH] (the witness's submission prefix)",
                    url.get_ref()
                ),
            );
            None
        }
    };
    if let Err(e) =
        crate::proto::vkey::Vkey::parse(key.get_ref(), crate::proto::vkey::COSIGNATURE_V1)
    {
        errors.at(key.span(), format!("witness key {:?} {e}", key.get_ref()));
        return None;
    }
    Some(WitnessConfig {
        url: uri?,
        key: key.into_inner(),
    })
}

/// `min_free`: a byte size, or a percentage of the file system (`"5%"`).
fn free(value: Spanned<RawSize>, errors: &mut Errors<'_>) -> Option<MinFree> {
    if let RawSize::Text(t) = value.get_ref() {
        if let Some(p) = t.trim().strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(p) if p > 0.0 && p < 100.0 => Some(MinFree::Percent(p)),
                _ => {
                    errors.at(
                        value.span(),
                        format!("min_free {t:?} must be a percentage above 0 and below 100, or a byte size"),
                    );
                    None
                }
            };
        }
    }
    size(Some(value), errors).map(MinFree::Bytes)
}

/// The load-time check of `[evidence]` against the budgets: with
/// size-based retention, what `orgs` orgs and the clients of no org may
/// write at worst in `retain_min_age` must fit in `retain_size` (see
/// [`capacity`]); else an error at `at` naming the figures and the ways
/// out.
pub(super) fn check_capacity(
    e: &EvidenceConfig,
    orgs: usize,
    at: std::ops::Range<usize>,
    errors: &mut Errors<'_>,
) {
    let Some(c) = capacity(e, orgs) else { return };
    if c.fits() {
        return;
    }
    let min_age = humantime::format_duration(e.retain_min_age);
    let shorter = match c.max_min_age {
        Some(d) => format!(
            "shorten retain_min_age to at most {}",
            humantime::format_duration(d)
        ),
        None => format!(
            "(no retain_min_age of at least {} fits)",
            humantime::format_duration(MIN_RETAIN_MIN_AGE)
        ),
    };
    errors.at(
        at,
        format!(
            "retain_size {} can be filled faster than retain_min_age {min_age}: {} payers ({orgs} org{} and the clients of no org) x {} records/s x {WORST_BYTES_PER_RECORD} bytes (an allow and its close) = {}/s at worst, {} in {min_age} with one open segment of {}; {}, raise retain_size to at least {}, or {shorter}",
            bytes(c.retain_size),
            c.payers,
            if orgs == 1 { "" } else { "s" },
            e.max_records_per_second_per_org,
            bytes(c.bytes_per_second as u64),
            bytes(c.needed),
            bytes(e.rotate_size),
            match c.max_budget {
                0 => "no max_records_per_second_per_org fits".to_string(),
                n => format!("lower max_records_per_second_per_org to at most {n}"),
            },
            bytes(c.needed),
        ),
    );
}

/// A byte count for a message: exact below 1 KiB, else in KiB, MiB or GiB
/// to one decimal (rounded up, so that a figure to raise to is enough).
pub(super) fn bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if n >= size {
            let tenths = (n as u128 * 10).div_ceil(size as u128);
            return format!("{}.{}{unit}", tenths / 10, tenths % 10);
        }
    }
    format!("{n}B")
}

/// A byte size: an integer or a number with a unit (B, kB, MB, GB, KiB,
/// MiB, GiB); must be positive.
fn size(value: Option<Spanned<RawSize>>, errors: &mut Errors<'_>) -> Option<u64> {
    let value = value?;
    positive_size(value.get_ref())
        .map_err(|shown| {
            errors.at(
                value.span(),
                format!("size {shown} must be a positive byte count (e.g. 1048576 or \"64MiB\")"),
            )
        })
        .ok()
}

/// A positive byte count, or the value as written to show in an error.
pub(super) fn positive_size(value: &RawSize) -> Result<u64, String> {
    let parsed = match value {
        RawSize::Bytes(n) => u64::try_from(*n).ok().filter(|n| *n > 0),
        RawSize::Text(t) => parse_size(t),
    };
    parsed.ok_or_else(|| match value {
        RawSize::Bytes(n) => n.to_string(),
        RawSize::Text(t) => format!("{t:?}"),
    })
}

pub(super) fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" => 1000,
        "MB" => 1000 * 1000,
        "GB" => 1000 * 1000 * 1000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult).filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use crate::config::test_support::{first_error, parse, BASE};
    use crate::config::{
        replica_problem, Durability, MinFree, DEFAULT_MIN_FREE, DEFAULT_RETAIN_MIN_AGE,
    };

    #[test]
    fn evidence_settings() {
        let src = format!(
            "{BASE}[evidence]\ndir = \"/e\"\ndurability = \"fsync\"\ncheckpoint_every = 10\n\
             checkpoint_interval = \"250ms\"\nrotate_size = \"1MiB\"\nretain_size = 4194304\nretain_age = \"7days\"\n\
             retain_min_age = \"2m\"\nmin_free = \"2%\"\nmax_records_per_second_per_org = 5\n\
             replica = \"eu-1.a_B\"\n\
             witnesses = [{{ url = \"http://198.18.2.2:8099/w\", key = \"w.test/w1+a9894ebf+BOpKbGPinFIKvvVQexMuxfmVR3auvr57kkIe6mkURtIs\" }}]\n"
        );
        let c = parse(&src).unwrap().evidence;
        assert_eq!(c.witnesses.len(), 1);
        assert_eq!(c.witnesses[0].url.path(), "/w");
        assert_eq!(c.key, PathBuf::from("/e.key"));
        assert_eq!(c.durability, Durability::Fsync);
        assert_eq!(c.checkpoint_every, 10);
        assert_eq!(c.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(c.rotate_size, 1 << 20);
        assert_eq!(c.retain_size, Some(4 << 20));
        assert_eq!(c.retain_age, Some(Duration::from_secs(7 * 86400)));
        assert_eq!(c.replica, "eu-1.a_B");
        assert_eq!(c.retain_min_age, Duration::from_secs(120));
        assert_eq!(c.min_free, MinFree::Percent(2.0));
        let d = parse(BASE).unwrap().evidence;
        assert_eq!(
            (d.retain_min_age, d.min_free),
            (DEFAULT_RETAIN_MIN_AGE, DEFAULT_MIN_FREE)
        );
        // The default (the host name, made valid) passes its own check.
        let d = parse(BASE).unwrap().evidence.replica;
        assert_eq!(replica_problem(&d), None, "{d:?}");
        for (line, want) in [
            ("durability = \"sometimes\"", "durability \"sometimes\""),
            ("rotate_size = \"12 parsecs\"", "size \"12 parsecs\""),
            ("rotate_size = 0", "size 0"),
            ("retain_size = \"1kB\"", "at least rotate_size"),
            (
                "retain_min_age = \"30s\"",
                "retain_min_age \"30s\" is below 1m",
            ),
            ("retain_min_age = \"soon\"", "invalid duration \"soon\""),
            (
                "min_free = \"150%\"",
                "min_free \"150%\" must be a percentage",
            ),
            ("min_free = \"0%\"", "above 0 and below 100"),
            ("min_free = \"lots\"", "size \"lots\""),
            ("min_free = 0", "size 0"),
            ("retain_age = \"30s\"", "retain_age must be at least 1m"),
            ("checkpoint_every = 0", "positive"),
            ("key = \"\"", "key must not be empty"),
            ("replica = \"\"", "replica \"\" must not be empty"),
            ("replica = \"a b\"", "replica \"a b\" may hold only"),
            ("replica = \"r/1\"", "may hold only"),
            (
                "witnesses = [{ url = \"https://w.test\", key = \"w+00000000+AA==\" }]",
                "https is not supported yet",
            ),
            (
                "witnesses = [{ url = \"ftp://w.test\", key = \"w+00000000+AA==\" }]",
                "must be http://HOST",
            ),
            (
                "witnesses = [{ url = \"http://w.test\", key = \"w.test/w1+00000000+BOpKbGPinFIKvvVQexMuxfmVR3auvr57kkIe6mkURtIs\" }]",
                "key ID \"00000000\" is not the one",
            ),
            (
                "witnesses = [{ url = \"http://w.test\", key = \"palisade/gw-a+efac922a+AepKbGPinFIKvvVQexMuxfmVR3auvr57kkIe6mkURtIs\" }]",
                "type 0x04",
            ),
            (
                "witnesses = [{ url = \"http://w.test\", key = \"k\", extra = 1 }]",
                "unknown field",
            ),
            (
                format!("replica = \"{}\"", "r".repeat(64)).as_str(),
                "at most 63",
            ),
        ] {
            let e = first_error(&format!("{BASE}[evidence]\n{line}\n"));
            assert!(e.contains(want), "{line}: {e}");
            assert!(e.starts_with("t.toml:10:"), "{line}: {e}");
        }
    }
}

#[cfg(test)]
mod capacity_tests {
    use crate::config::test_support::{first_error, parse, BASE};

    fn evidence(lines: &str) -> String {
        format!(
            "{BASE}[evidence]\nrotate_size = \"1MiB\"\nretain_size = \"4MiB\"\nretain_min_age = \"2m\"\n{lines}"
        )
    }

    #[test]
    fn a_floor_above_retain_age_is_refused_where_it_is_set() {
        let e = first_error(&format!(
            "{BASE}[evidence]\nretain_age = \"1h\"\nretain_min_age = \"2h\"\n"
        ));
        assert!(e.starts_with("t.toml:11:"), "{e}");
        assert!(e.contains("exceeds retain_age (1h)"), "{e}");
        // Unset, the floor follows a shorter retain_age.
        let c = parse(&format!("{BASE}[evidence]\nretain_age = \"10m\"\n")).unwrap();
        assert_eq!(c.evidence.retain_min_age.as_secs(), 600);
    }

    #[test]
    fn budgets_that_could_outrun_the_store_are_refused_with_the_figures() {
        // 2 payers x 10 records/s x 1140 bytes for 2 minutes and a second,
        // a checkpoint a second, and one open segment: 3.7 MiB of 4.
        assert!(parse(&evidence("max_records_per_second_per_org = 10\n")).is_ok());
        let e = first_error(&evidence("max_records_per_second_per_org = 20\n"));
        assert!(e.starts_with("t.toml:11:15: retain_size 4.0MiB"), "{e}");
        for want in [
            "2 payers (1 org and the clients of no org) x 20 records/s x 1140 bytes",
            "lower max_records_per_second_per_org to at most 11",
            "raise retain_size to at least 6.4MiB",
            "shorten retain_min_age to at most 1m 6s",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        // More orgs, more payers: the same budget no longer fits.
        let two = evidence("max_records_per_second_per_org = 10\n")
            + "[[org]]\nname = \"beta\"\nclients = [\"198.19.2.0/24\"]\n";
        let e = first_error(&two);
        assert!(e.contains("3 payers (2 orgs and"), "{e}");
        // The defaults (42000 records/s) and no retain_size: nothing is
        // removed by size, nothing to check.
        assert!(parse(BASE).is_ok());
    }
}
