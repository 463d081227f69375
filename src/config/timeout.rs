//! Timeouts: one newtype per network wait, so that one cannot be passed
//! where another is meant. Each has a `DEFAULT_*` constant and an upper
//! bound; `new` is the only way to make one, and refuses zero and anything
//! above the bound (validation reports it located in the file).

use std::time::Duration;

/// Why a duration is not a valid timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimeoutError {
    #[error("must be positive")]
    Zero,
    #[error("is above the maximum of {}", short(*max))]
    TooLong { max: Duration },
}

/// What validation needs to know of every timeout.
pub(super) trait Timeout: Copy {
    /// The key that sets it (in its table).
    const KEY: &'static str;
    const DEFAULT: Self;
    fn new(d: Duration) -> Result<Self, TimeoutError>;
}

/// A duration as a config would write it: "24h", "2m", "90s" (whole hours,
/// minutes or seconds where it is one), else humantime's spelling.
pub(super) fn short(d: Duration) -> String {
    let secs = d.as_secs();
    match (secs, d.subsec_nanos()) {
        (1.., 0) if secs % HOUR == 0 => format!("{}h", secs / HOUR),
        (1.., 0) if secs % MINUTE == 0 => format!("{}m", secs / MINUTE),
        (1.., 0) => format!("{secs}s"),
        _ => humantime::format_duration(d).to_string(),
    }
}

/// Positive and at most `max`.
fn check(d: Duration, max: Duration) -> Result<Duration, TimeoutError> {
    if d.is_zero() {
        Err(TimeoutError::Zero)
    } else if d > max {
        Err(TimeoutError::TooLong { max })
    } else {
        Ok(d)
    }
}

macro_rules! timeouts {
    ($(
        $(#[$doc:meta])*
        $name:ident, $key:literal, $default_name:ident = $default:expr, max $max:expr;
    )*) => {$(
        $(#[$doc])*
        #[doc = ""]
        #[doc = concat!("Set by `", $key, "`; default [`", stringify!($default_name), "`].")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Duration);

        #[doc = concat!("Default [`", stringify!($name), "`].")]
        pub const $default_name: $name = $name($default);

        // The default must be a value `new` accepts.
        const _: () = assert!($default.as_nanos() > 0 && $default.as_nanos() <= $max.as_nanos());

        impl $name {
            /// The longest value accepted.
            pub const MAX: Duration = $max;

            /// A positive duration no longer than [`Self::MAX`].
            pub fn new(d: Duration) -> Result<Self, TimeoutError> {
                check(d, Self::MAX).map(Self)
            }

            pub const fn get(self) -> Duration {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                $default_name
            }
        }

        impl Timeout for $name {
            const KEY: &'static str = $key;
            const DEFAULT: Self = $default_name;
            fn new(d: Duration) -> Result<Self, TimeoutError> {
                $name::new(d)
            }
        }
    )*};
}

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;

timeouts! {
    /// `[proxy]`: the time a client has to send a complete request head
    /// (slowloris bound); also each SOCKS5 handshake step.
    HeaderReadTimeout, "header_read_timeout",
        DEFAULT_HEADER_READ_TIMEOUT = Duration::from_secs(10), max Duration::from_secs(5 * MINUTE);
    /// `[proxy]`: the time to establish a TCP connection to one upstream address.
    ConnectTimeout, "connect_timeout",
        DEFAULT_CONNECT_TIMEOUT = Duration::from_secs(5), max Duration::from_secs(2 * MINUTE);
    /// `[proxy]`: the time a tunnel may stay silent both ways.
    IdleTimeout, "idle_timeout",
        DEFAULT_IDLE_TIMEOUT = Duration::from_secs(300), max Duration::from_secs(24 * HOUR);
    /// `[proxy]`: the time to wait for an upstream's response head to a
    /// forwarded HTTP request (explicit and intercepted). Unset, it is the
    /// `idle_timeout`, which bounded this wait before it had its own key.
    ResponseTimeout, "response_timeout",
        DEFAULT_RESPONSE_TIMEOUT = Duration::from_secs(300), max Duration::from_secs(24 * HOUR);
    /// `[proxy]`: the time to wait for a tunnel client's first bytes
    /// (ClientHello or request head detection).
    DetectTimeout, "detect_timeout",
        DEFAULT_DETECT_TIMEOUT = Duration::from_millis(1000), max Duration::from_secs(MINUTE);
    /// `[proxy]`: the time an upstream connection of forwarded absolute-form
    /// HTTP requests is kept open, idle, for the next request of its org
    /// to the same host, port and address.
    UpstreamIdleTimeout, "upstream_idle_timeout",
        DEFAULT_UPSTREAM_IDLE_TIMEOUT = Duration::from_secs(30), max Duration::from_secs(10 * MINUTE);
    /// `[proxy]`: the longest a live connection that a reload's new policy
    /// denies keeps running after that policy is served.
    RevokeGrace, "revoke_grace",
        DEFAULT_REVOKE_GRACE = Duration::from_secs(1), max Duration::from_secs(MINUTE);
    /// `[proxy]`: the grace period for open connections after SIGTERM/SIGINT.
    DrainTimeout, "drain_timeout",
        DEFAULT_DRAIN_TIMEOUT = Duration::from_secs(10), max Duration::from_secs(HOUR);
    /// `[dns]`: the time for one upstream name resolution.
    ResolveTimeout, "resolve_timeout",
        DEFAULT_RESOLVE_TIMEOUT = Duration::from_secs(3), max Duration::from_secs(MINUTE);
    /// `[dns]`: the time a DNS-over-TCP client may stay silent between queries.
    DnsIdleTimeout, "idle_timeout",
        DEFAULT_DNS_IDLE_TIMEOUT = Duration::from_secs(10), max Duration::from_secs(10 * MINUTE);
    /// `[dns]`: the time one DNS query may take end to end (including upstream).
    DnsQueryTimeout, "query_timeout",
        DEFAULT_DNS_QUERY_TIMEOUT = Duration::from_secs(5), max Duration::from_secs(MINUTE);
    /// `[intercept]`: the time for a TLS handshake of an intercepted
    /// connection (either side).
    HandshakeTimeout, "handshake_timeout",
        DEFAULT_HANDSHAKE_TIMEOUT = Duration::from_secs(10), max Duration::from_secs(2 * MINUTE);
}

// An unset response_timeout takes the idle_timeout: every idle value must fit.
const _: () = assert!(IdleTimeout::MAX.as_nanos() <= ResponseTimeout::MAX.as_nanos());

impl From<IdleTimeout> for ResponseTimeout {
    fn from(idle: IdleTimeout) -> Self {
        ResponseTimeout(idle.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_refuses_zero_and_above_the_bound() {
        assert_eq!(DetectTimeout::new(Duration::ZERO), Err(TimeoutError::Zero));
        assert_eq!(
            DetectTimeout::new(Duration::from_secs(61)),
            Err(TimeoutError::TooLong {
                max: Duration::from_secs(60)
            })
        );
        let at_max = DetectTimeout::new(DetectTimeout::MAX).unwrap();
        assert_eq!(at_max.get(), Duration::from_secs(60));
        assert_eq!(DetectTimeout::default(), DEFAULT_DETECT_TIMEOUT);
        assert_eq!(DEFAULT_DETECT_TIMEOUT.get(), Duration::from_secs(1));
    }

    #[test]
    fn bounds_are_shown_as_written() {
        let show = |secs| short(Duration::from_secs(secs));
        assert_eq!(show(86_400), "24h");
        assert_eq!(show(3_600), "1h");
        assert_eq!(show(600), "10m");
        assert_eq!(show(60), "1m");
        assert_eq!(show(90), "90s");
        assert_eq!(short(Duration::from_millis(1500)), "1s 500ms");
    }

    #[test]
    fn an_unset_response_timeout_is_the_idle_timeout() {
        let idle = IdleTimeout::new(IdleTimeout::MAX).unwrap();
        assert_eq!(ResponseTimeout::from(idle).get(), IdleTimeout::MAX);
        assert_eq!(
            ResponseTimeout::from(DEFAULT_IDLE_TIMEOUT),
            DEFAULT_RESPONSE_TIMEOUT
        );
    }
}
