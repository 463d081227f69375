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
//! [`config`] loads and validates the TOML file; [`served`] holds what is
//! served (policy, DNS settings, interception, credentials), read once per
//! decision; [`reload`] rebuilds it and swaps it whole on SIGHUP or a file
//! change; [`app`] wires listeners, the metrics, the admin endpoints and
//! shutdown; [`probe`] demonstrates containment
//! (a probe plan run in the sandbox, joined with verified evidence).
//! [`cli`] holds the commands of the `palisade` binary, among them
//! [`cli::explain`], which runs the same decision for one target from the
//! command line, and [`cli::replay`], which re-decides recorded decisions
//! under a candidate policy.

#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod dns;
pub mod evidence;
#[doc(hidden)]
pub mod fuzzing;
pub mod intercept;
pub mod metrics;
pub mod policy;
pub mod probe;
pub mod proto;
pub mod proxy;
pub mod reload;
pub mod resolve;
pub mod served;
