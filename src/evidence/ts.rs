//! Record timestamps: RFC 3339 in UTC with microseconds
//! (`2026-12-05T18:00:00.123456Z`), written digit by digit into a fixed
//! buffer, the very text `humantime::format_rfc3339_micros` gives, without
//! `fmt` per record.

use std::cell::Cell;
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds from the epoch to 10000-01-01: the first time with a year of
/// five digits.
const YEAR_10000: u64 = 253_402_300_800;

/// Characters of a timestamp: `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`.
const LEN: usize = 27;

/// `t` as a record's `ts`.
pub(crate) fn rfc3339_micros(t: SystemTime) -> String {
    let since = match t.duration_since(UNIX_EPOCH) {
        Ok(d) if d.as_secs() < YEAR_10000 => d,
        // Before the epoch or after year 9999: as humantime writes it.
        _ => return humantime::format_rfc3339_micros(t).to_string(),
    };
    let secs = since.as_secs();
    let mut b: [u8; LEN] = *b"0000-00-00T00:00:00.000000Z";
    // Records come many a second: the date and time of day are written
    // once a second per thread, the microseconds every time.
    let (last, mut whole) = SECOND.get();
    if last != secs {
        whole.copy_from_slice(&b[..WHOLE]);
        seconds_into(&mut whole, secs);
        SECOND.set((secs, whole));
    }
    b[..WHOLE].copy_from_slice(&whole);
    digits(&mut b[WHOLE..LEN - 1], u64::from(since.subsec_micros()));
    // Every byte is an ASCII digit or one of `-T:.Z`: the check cannot fail.
    String::from_utf8(b.to_vec()).unwrap_or_default()
}

/// Characters up to the fraction: `YYYY-MM-DDTHH:MM:SS.`.
const WHOLE: usize = 20;

thread_local! {
    /// The second last written on this thread, and its text up to the
    /// fraction.
    static SECOND: Cell<(u64, [u8; WHOLE])> = const { Cell::new((u64::MAX, [0; WHOLE])) };
}

/// The date and time of day of `secs` (from the epoch, before year 10000)
/// into `b`, a timestamp's text up to the fraction.
fn seconds_into(b: &mut [u8; WHOLE], secs: u64) {
    let (year, month, day) = civil(secs / 86_400);
    let of_day = secs % 86_400;
    digits(&mut b[0..4], year);
    digits(&mut b[5..7], month);
    digits(&mut b[8..10], day);
    digits(&mut b[11..13], of_day / 3600);
    digits(&mut b[14..16], of_day / 60 % 60);
    digits(&mut b[17..19], of_day % 60);
}

/// `n`'s last `out.len()` decimal digits, zero-padded.
fn digits(out: &mut [u8], mut n: u64) {
    for d in out.iter_mut().rev() {
        // A digit: n % 10 < 10.
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// The proleptic Gregorian date of day `days` after 1970-01-01 (the
/// civil-from-days algorithm, eras of 400 years from 0000-03-01).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn same(t: SystemTime) {
        assert_eq!(
            rfc3339_micros(t),
            humantime::format_rfc3339_micros(t).to_string(),
            "{t:?}"
        );
    }

    /// The text is humantime's at the edges of days, months, leap years
    /// and centuries, and at times drawn across the whole range.
    #[test]
    fn timestamps_are_humantimes() {
        let at = |s: u64, n: u32| UNIX_EPOCH + Duration::new(s, n);
        for s in [
            0,
            1,
            59,
            86_399,
            86_400,
            951_782_400,   // 2000-02-29
            951_868_800,   // 2000-03-01
            4_107_456_000, // 2100-02-28
            4_107_542_400, // 2100-03-01
            1_798_761_599, // 2026-12-31T23:59:59
            YEAR_10000 - 1,
        ] {
            for n in [0, 999, 1_000, 999_999_999, 123_456_789] {
                same(at(s, n));
            }
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            same(at(state % YEAR_10000, (state >> 33) as u32 % 1_000_000_000));
        }
        // Every day of four years around a leap day, at noon.
        for d in 10_956..10_956 + 4 * 366 {
            same(at(d * 86_400 + 43_200, 5_000));
        }
    }

    /// The second kept per thread is the one asked for: times within a
    /// second, across its edge and back again are written right.
    #[test]
    fn a_kept_second_is_used_only_for_its_own_times() {
        let at = |s: u64, n: u32| UNIX_EPOCH + Duration::new(s, n);
        for (s, n) in [
            (1_798_761_599, 1),
            (1_798_761_599, 999_999_000),
            (1_798_761_600, 0),
            (1_798_761_599, 500_000_000),
            (1_798_761_600, 7_000),
            (0, 0),
        ] {
            same(at(s, n));
        }
    }
}
