//! Pure wire and name parsers: no I/O, no clock. Each answers done, not this
//! protocol, or need more bytes, so callers can peek or buffer and replay.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

pub(crate) mod client_hello;
pub(crate) mod graphql;
pub(crate) mod guard;
pub(crate) mod http_head;
pub(crate) mod http_meter;
pub(crate) mod http_request;
pub(crate) mod http_stream;
pub(crate) mod http_upstream;
pub(crate) mod pktline;
pub(crate) mod socks5;
pub mod target;
pub mod tls_stream;
pub(crate) mod vkey;

/// What a parser handed the bytes read so far makes of them: the one answer
/// of the HTTP head, ClientHello and SOCKS5 parsers. `M` says why a message
/// is malformed (a reason, or for SOCKS5 the reply its sender gets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parse<T, M = &'static str> {
    /// A complete message, `len` bytes from the start of the buffer.
    Done { value: T, len: usize },
    /// A valid prefix: read more.
    NeedMore,
    /// Not this protocol at all.
    NotThis,
    /// This protocol, but malformed, ambiguous or too large.
    Malformed(M),
}
