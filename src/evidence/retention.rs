//! Which old segments retention removes: a pure plan over a listing of
//! the evidence dir, oldest first. The writer lists and stats the files,
//! asks for the plan, reads the tails of the segments it names and
//! unlinks them once the next header has recorded their removal.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

use std::path::PathBuf;
use std::time::Duration;

/// One segment file as retention sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Listed {
    pub(super) path: PathBuf,
    pub(super) len: u64,
    /// Since it was last written; `None` when its mtime is unknown or in
    /// the future (it counts as just written).
    pub(super) age: Option<Duration>,
}

/// The caps of `[evidence]`: `retain_size`, `retain_age`, `retain_min_age`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Caps {
    pub(super) size: Option<u64>,
    pub(super) age: Option<Duration>,
    pub(super) min_age: Duration,
}

/// What retention does with a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    /// Remove the oldest `remove` segments of the listing.
    pub(super) remove: usize,
    /// Retention stopped at a segment too young to remove for size: the
    /// store is over `retain_size` and stays full for this long, until
    /// that segment is `retain_min_age` old.
    pub(super) floor_in: Option<Duration>,
}

/// Plan retention over `listing` (oldest first). Segments go oldest first
/// while the store is over the size cap or the segment is over the age
/// cap; never the newest (the chain head), nor `keep` or anything after
/// it, nor, for size alone, a segment younger than the minimum age.
pub(super) fn plan(listing: &[Listed], caps: Caps, keep: Option<&str>) -> Plan {
    let mut total: u64 = listing.iter().map(|s| s.len).sum();
    let mut remove = 0;
    // The newest segment always stays: it is the chain head.
    for seg in listing.iter().take(listing.len().saturating_sub(1)) {
        let name = seg.path.file_name().map(|n| n.to_string_lossy());
        if name.as_deref() == keep {
            break;
        }
        let too_big = caps.size.is_some_and(|cap| total > cap);
        let too_old = caps.age.is_some_and(|cap| seg.age.is_some_and(|e| e > cap));
        if !too_big && !too_old {
            break;
        }
        let young = seg.age.unwrap_or(Duration::ZERO);
        if !too_old && young < caps.min_age {
            return Plan {
                remove,
                floor_in: Some(caps.min_age - young),
            };
        }
        remove += 1;
        total -= seg.len;
    }
    Plan {
        remove,
        floor_in: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn listed(name: &str, len: u64, age_secs: Option<u64>) -> Listed {
        Listed {
            path: PathBuf::from("/e").join(name),
            len,
            age: age_secs.map(Duration::from_secs),
        }
    }

    fn caps(size: Option<u64>, age: Option<u64>) -> Caps {
        Caps {
            size,
            age: age.map(Duration::from_secs),
            min_age: MIN,
        }
    }

    fn removes(remove: usize) -> Plan {
        Plan {
            remove,
            floor_in: None,
        }
    }

    #[test]
    fn size_cap_removes_oldest_first_until_under_it_and_never_the_head() {
        let l = [
            listed("a", 100, Some(500)),
            listed("b", 100, Some(400)),
            listed("c", 100, Some(300)),
        ];
        assert_eq!(plan(&l, caps(Some(250), None), None), removes(1));
        assert_eq!(plan(&l, caps(Some(100), None), None), removes(2));
        // Even a cap of nothing keeps the newest segment.
        assert_eq!(plan(&l, caps(Some(0), None), None), removes(2));
        assert_eq!(plan(&l, caps(Some(300), None), None), removes(0));
        assert_eq!(plan(&[], caps(Some(0), None), None), removes(0));
    }

    #[test]
    fn age_cap_removes_the_old_prefix_and_stops_at_the_first_young_one() {
        let l = [
            listed("a", 1, Some(500)),
            listed("b", 1, Some(100)),
            listed("c", 1, Some(900)),
            listed("d", 1, Some(0)),
        ];
        assert_eq!(plan(&l, caps(None, Some(200)), None), removes(1));
        // An unknown (or future) mtime is never too old.
        let l = [listed("a", 1, None), listed("b", 1, Some(900))];
        assert_eq!(plan(&l, caps(None, Some(200)), None), removes(0));
    }

    #[test]
    fn a_segment_younger_than_the_minimum_age_holds_size_retention_at_the_floor() {
        let l = [
            listed("a", 100, Some(120)),
            listed("b", 100, Some(20)),
            listed("c", 100, Some(0)),
        ];
        assert_eq!(
            plan(&l, caps(Some(50), None), None),
            Plan {
                remove: 1,
                floor_in: Some(Duration::from_secs(40)),
            }
        );
        // No mtime counts as just written: the whole minimum age to wait.
        let l = [listed("a", 100, None), listed("b", 100, Some(0))];
        assert_eq!(
            plan(&l, caps(Some(50), None), None).floor_in,
            Some(MIN),
            "unknown age"
        );
        // Too old goes regardless of the minimum age.
        let l = [listed("a", 100, Some(30)), listed("b", 100, Some(0))];
        assert_eq!(
            plan(
                &l,
                Caps {
                    min_age: Duration::from_secs(3600),
                    ..caps(Some(50), Some(10))
                },
                None
            ),
            removes(1)
        );
    }

    #[test]
    fn retention_stops_at_the_segment_to_keep() {
        let l = [
            listed("a", 100, Some(500)),
            listed("b", 100, Some(400)),
            listed("c", 100, Some(300)),
        ];
        assert_eq!(plan(&l, caps(Some(0), None), Some("b")), removes(1));
        assert_eq!(plan(&l, caps(Some(0), None), Some("a")), removes(0));
    }
}
