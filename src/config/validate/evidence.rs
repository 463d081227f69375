//! `[evidence]`: where and how decisions are recorded.

use std::path::PathBuf;
use std::time::Duration;

use toml::Spanned;

use super::{count, duration};
use crate::config::error::Errors;
use crate::config::model::{Durability, EvidenceConfig};
use crate::config::raw::{RawEvidence, RawSize};

pub(super) fn validate_evidence(raw: RawEvidence, errors: &mut Errors<'_>) -> EvidenceConfig {
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
    } = raw;
    let dir = match dir {
        Some(d) if d.get_ref().trim().is_empty() => {
            errors.at(d.span(), "evidence dir must not be empty");
            PathBuf::from("evidence")
        }
        Some(d) => PathBuf::from(d.into_inner()),
        None => PathBuf::from("evidence"),
    };
    let mut c = EvidenceConfig::for_dir(&dir);
    match key {
        Some(k) if k.get_ref().trim().is_empty() => {
            errors.at(k.span(), "evidence key must not be empty")
        }
        Some(k) => c.key = PathBuf::from(k.into_inner()),
        None => {}
    }
    if let Some(d) = durability {
        c.durability = match d.get_ref().as_str() {
            "os" => Durability::Os,
            "fsync" => Durability::Fsync,
            "discard" => Durability::Discard,
            other => {
                errors.at(
                    d.span(),
                    format!("durability {other:?} must be \"os\", \"fsync\" or \"discard\""),
                );
                Durability::Os
            }
        };
    }
    c.checkpoint_every = count(checkpoint_every, c.checkpoint_every as usize, errors) as u64;
    c.checkpoint_interval = duration(checkpoint_interval, c.checkpoint_interval, errors);
    c.rotate_size = size(rotate_size, errors).unwrap_or(c.rotate_size);
    c.rotate_age = duration(rotate_age, c.rotate_age, errors);
    if let Some(r) = &retain_size {
        let span = r.span();
        c.retain_size = size(retain_size, errors);
        if c.retain_size.is_some_and(|n| n < c.rotate_size) {
            errors.at(
                span,
                format!(
                    "retain_size must be at least rotate_size ({} bytes)",
                    c.rotate_size
                ),
            );
        }
    }
    if retain_age.is_some() {
        c.retain_age = Some(duration(retain_age, Duration::ZERO, errors));
    }
    c
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
    use crate::config::Durability;

    #[test]
    fn evidence_settings() {
        let src = format!(
            "{BASE}[evidence]\ndir = \"/e\"\ndurability = \"fsync\"\ncheckpoint_every = 10\n\
             checkpoint_interval = \"250ms\"\nrotate_size = \"1MiB\"\nretain_size = 4194304\nretain_age = \"7days\"\n"
        );
        let c = parse(&src).unwrap().evidence;
        assert_eq!(c.key, PathBuf::from("/e.key"));
        assert_eq!(c.durability, Durability::Fsync);
        assert_eq!(c.checkpoint_every, 10);
        assert_eq!(c.checkpoint_interval, Duration::from_millis(250));
        assert_eq!(c.rotate_size, 1 << 20);
        assert_eq!(c.retain_size, Some(4 << 20));
        assert_eq!(c.retain_age, Some(Duration::from_secs(7 * 86400)));
        for (line, want) in [
            ("durability = \"sometimes\"", "durability \"sometimes\""),
            ("rotate_size = \"12 parsecs\"", "size \"12 parsecs\""),
            ("rotate_size = 0", "size 0"),
            ("retain_size = \"1kB\"", "at least rotate_size"),
            ("checkpoint_every = 0", "positive"),
            ("key = \"\"", "key must not be empty"),
        ] {
            let e = first_error(&format!("{BASE}[evidence]\n{line}\n"));
            assert!(e.contains(want), "{line}: {e}");
            assert!(e.starts_with("t.toml:10:"), "{line}: {e}");
        }
    }
}
