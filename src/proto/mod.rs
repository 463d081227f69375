//! Pure wire and name parsers: no I/O, no clock. Each answers done, not this
//! protocol, or need more bytes, so callers can peek or buffer and replay.

pub mod client_hello;
pub mod guard;
pub mod http_head;
pub mod http_meter;
pub mod http_request;
pub mod http_stream;
pub mod socks5;
pub mod target;
pub mod tls_stream;
