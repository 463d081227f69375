//! Serving connections, the same way on every listener.
//!
//! - [`accept`](fn@accept): the one accept loop of every TCP listener (the proxy's
//!   explicit, transparent and SOCKS5 listeners, DNS over TCP, admin):
//!   stop on the shutdown token, back off on accept errors, let the
//!   listener's [`Admission`] take (or refuse) a place for the connection,
//!   then serve it in a tracked task under a span of its own.
//! - [`http`]: one HTTP/1 connection server (header read timeout,
//!   keep-alive, graceful close on shutdown and a cut at the hard stop),
//!   with a response body type that can stream ([`http::Body`],
//!   [`http::channel`]), and a bound on clients that stop reading
//!   ([`http::WriteStall`]).
//!
//! Nothing here knows policy, evidence or limits: each listener brings its
//! own cap as its [`Admission`].

pub(crate) mod accept;
pub(crate) mod http;

pub(crate) use accept::{accept, Admission, Listener};
