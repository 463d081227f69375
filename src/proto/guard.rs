//! The vocabulary shared by the tunnel verifiers ([`super::tls_stream`],
//! [`super::http_stream`]): sans-IO state machines that judge every byte a
//! client sends through a tunnel before the proxy forwards it.
//!
//! The driver (the tunnel pump) holds the client bytes it has read and not
//! yet forwarded, and asks the verifier about them:
//!
//! - [`Step::Forward`]`(n)`: the first `n` held bytes are verified; forward
//!   them, drop them from the held buffer, and ask again about the rest.
//! - [`Step::NeedMore`]: nothing more can be forwarded until more client
//!   bytes arrive (the held bytes are a valid prefix).
//! - [`Step::Wait`]: nothing more can be forwarded until the upstream's
//!   bytes have been observed (for example the response to an upgrade).
//! - [`Step::Opaque`]: verification of this direction is over; forward the
//!   held bytes and everything after them as they are.
//! - [`Step::Deny`]: close the tunnel; none of the held bytes (nor any later
//!   one) may reach the upstream.
//!
//! Upstream bytes are always forwarded; the verifier only observes them.
//! A verifier never consumes bytes it has not judged: `Forward(n)` is
//! exactly the verified prefix. Calling it again with the same held bytes
//! (nothing forwarded, nothing new) returns the same answer.

use std::fmt;

/// What the driver may do with the client bytes it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Forward(usize),
    NeedMore,
    Wait,
    Opaque,
    Deny(Violation),
}

/// Why a tunnel failed verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// The bytes are not the protocol the rule says the tunnel carries
    /// (not a ClientHello on a TLS tunnel, not an HTTP request on an HTTP
    /// tunnel, a non-handshake record before the ClientHello).
    ProtocolMismatch,
    /// A ClientHello without a server_name.
    SniMissing,
    /// A ClientHello (first or later) naming another host.
    SniMismatch,
    /// A ClientHello with an encrypted_client_hello extension.
    EchNotAllowed,
    /// An HTTP request naming another host (Host header, absolute-form
    /// authority), or naming none.
    HostMismatch,
    /// h2c (prior knowledge preface, `Upgrade: h2c`, `HTTP2-Settings`).
    UpgradeNotAllowed,
    /// Malformed, ambiguous or oversized protocol data.
    Malformed,
}

/// A verification failure: what was wrong, the name actually presented (as
/// sent, when there was one), and a detail for evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub kind: ViolationKind,
    pub seen: Option<String>,
    pub detail: String,
}

impl Violation {
    pub fn new(kind: ViolationKind, seen: Option<String>, detail: impl Into<String>) -> Self {
        Violation {
            kind,
            seen,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.detail)?;
        if let Some(seen) = &self.seen {
            write!(f, " (named {seen})")?;
        }
        Ok(())
    }
}

/// Bounds a verifier enforces on what it must hold to judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Largest request head (request line and headers, including leading
    /// empty lines) of an HTTP tunnel.
    pub max_head_bytes: usize,
    /// Largest number of request headers.
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head_bytes: 64 * 1024,
            max_headers: 100,
        }
    }
}
