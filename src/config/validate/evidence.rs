//! `[evidence]`: where and how decisions are recorded.

use std::path::PathBuf;
use std::time::Duration;

use toml::Spanned;

use super::{count, duration, path};
use crate::config::error::Errors;
use crate::config::model::{replica_problem, Durability, EvidenceConfig, DEFAULT_EVIDENCE_DIR};
use crate::config::raw::{RawEvidence, RawSize};

/// `[evidence]`; `default_budget` is what `max_records_per_second_per_org`
/// is when unset (derived from the proxy's and the DNS shim's rates).
pub(super) fn validate_evidence(
    raw: RawEvidence,
    default_budget: usize,
    errors: &mut Errors<'_>,
) -> EvidenceConfig {
    let RawEvidence {
        dir,
        key,
        durability,
        checkpoint_every,
        checkpoint_interval,
        rotate_size,
        rotate_age,
        retain_size,
        retain_age,
        max_records_per_second_per_org,
        replica,
    } = raw;
    let dir = path(
        dir,
        PathBuf::from(DEFAULT_EVIDENCE_DIR),
        "evidence dir",
        errors,
    );
    let d = EvidenceConfig::for_dir(&dir);
    let key = path(key, d.key, "evidence key", errors);
    let durability = match durability {
        None => d.durability,
        Some(v) => match v.get_ref().as_str() {
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
        },
    };
    let checkpoint_every = count(checkpoint_every, d.checkpoint_every as usize, errors) as u64;
    let checkpoint_interval = duration(checkpoint_interval, d.checkpoint_interval, errors);
    let rotate_size = size(rotate_size, errors).unwrap_or(d.rotate_size);
    let rotate_age = duration(rotate_age, d.rotate_age, errors);
    let retain_size = retain_size.and_then(|r| {
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
    let retain_age = retain_age.map(|v| duration(Some(v), Duration::ZERO, errors));
    let replica = match replica {
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
        max_records_per_second_per_org: count(
            max_records_per_second_per_org,
            default_budget,
            errors,
        ),
        replica,
    }
}

/// A byte size: an integer or a number with a unit (B, kB, MB, GB, KiB,
/// MiB, GiB); must be positive.
fn size(value: Option<Spanned<RawSize>>, errors: &mut Errors<'_>) -> Option<u64> {
    let value = value?;
    let parsed = match value.get_ref() {
        RawSize::Bytes(n) => u64::try_from(*n).ok().filter(|n| *n > 0),
        RawSize::Text(t) => parse_size(t),
    };
    if parsed.is_none() {
        let shown = match value.get_ref() {
            RawSize::Bytes(n) => n.to_string(),
            RawSize::Text(t) => format!("{t:?}"),
        };
        errors.at(
            value.span(),
            format!("size {shown} must be a positive byte count (e.g. 1048576 or \"64MiB\")"),
        );
    }
    parsed
}

fn parse_size(text: &str) -> Option<u64> {
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
    use crate::config::{replica_problem, Durability};

    #[test]
    fn evidence_settings() {
        let src = format!(
            "{BASE}[evidence]\ndir = \"/e\"\ndurability = \"fsync\"\ncheckpoint_every = 10\n\
             checkpoint_interval = \"250ms\"\nrotate_size = \"1MiB\"\nretain_size = 4194304\nretain_age = \"7days\"\n\
             replica = \"eu-1.a_B\"\n"
        );
        let c = parse(&src).unwrap().evidence;
        assert_eq!(c.key, PathBuf::from("/e.key"));
        assert_eq!(c.durability, Durability::Fsync);
        assert_eq!(c.checkpoint_every, 10);
        assert_eq!(c.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(c.rotate_size, 1 << 20);
        assert_eq!(c.retain_size, Some(4 << 20));
        assert_eq!(c.retain_age, Some(Duration::from_secs(7 * 86400)));
        assert_eq!(c.replica, "eu-1.a_B");
        // The default (the host name, made valid) passes its own check.
        let d = parse(BASE).unwrap().evidence.replica;
        assert_eq!(replica_problem(&d), None, "{d:?}");
        for (line, want) in [
            ("durability = \"sometimes\"", "durability \"sometimes\""),
            ("rotate_size = \"12 parsecs\"", "size \"12 parsecs\""),
            ("rotate_size = 0", "size 0"),
            ("retain_size = \"1kB\"", "at least rotate_size"),
            ("checkpoint_every = 0", "positive"),
            ("key = \"\"", "key must not be empty"),
            ("replica = \"\"", "replica \"\" must not be empty"),
            ("replica = \"a b\"", "replica \"a b\" may hold only"),
            ("replica = \"r/1\"", "may hold only"),
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
