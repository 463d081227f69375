//! Palisade: an egress-enforcing forward proxy and DNS filter.
//!
//! The path of one explicit-proxy connection through the modules:
//!
//! 1. [`proxy`] accepts it (a connection permit from [`proxy::limits`]) and
//!    hyper parses the request head within bounded size and time.
//! 2. [`proto::target`] normalises the target (names, every IP spelling).
//! 3. [`policy`] decides, purely: client → org, name rules, then the
//!    addresses [`resolve`] found, each checked before it may be dialled.
//! 4. [`evidence`] writes the decision; only then does a byte flow.
//! 5. [`proxy`] dials exactly a checked address, checks a tunnel's TLS
//!    ClientHello ([`proto::client_hello`]) against the CONNECT host, and
//!    copies bytes until close, which is recorded too.
//!
//! A DNS query takes the same steps in [`dns`]: org by source address, the
//! policy's name decision ([`dns::decide`]), upstream through [`resolve`],
//! answers filtered by the policy's address checks and bound to the name in
//! [`dns::Bindings`], evidence, then the answer.
//!
//! Transparent connections ([`proxy::transparent`]) and SOCKS5
//! ([`proxy::socks5`]) join the same path at step 3 with the name the
//! client presented; all tunnels share [`proxy::connect`], where opt-in TLS
//! interception ([`proxy::intercept`]) hooks in. A decided connection
//! carries its state ([`proxy::conn`]) to its close; explicit mode and
//! interception serve HTTP through one layer ([`proxy::http`]); whatever
//! fails is told to the client from one mapping ([`proxy::failure`]).
//!
//! [`config`] loads and validates the TOML file; [`reload`] swaps the policy
//! whole on SIGHUP or a file change; [`replay`] re-decides recorded
//! decisions under a candidate policy; [`app`] wires listeners,
//! the admin endpoints and shutdown; [`explain`] runs the same decision for
//! one target from the command line; [`probe`] demonstrates containment
//! (a probe plan run in the sandbox, joined with verified evidence).

pub mod admin;
pub mod app;
pub mod config;
pub mod dns;
pub mod evidence;
pub mod explain;
#[doc(hidden)]
pub mod fuzzing;
pub mod metrics;
pub mod policy;
pub mod probe;
pub mod proto;
pub mod proxy;
pub mod reload;
pub mod replay;
pub mod resolve;

/// TLS interception is a part of the proxy ([`proxy::intercept`]); this
/// path stays for callers that name it from the crate root.
pub use proxy::intercept;
