//! Palisade: an egress-enforcing forward proxy and DNS filter.
//!
//! The path of one explicit-proxy connection through the modules:
//!
//! 1. [`proxy::explicit`] accepts it through [`proxy::listen`] (a
//!    connection permit from [`limits`]) and the HTTP layer
//!    ([`proxy::http`]) reads the request head within bounded size and
//!    time.
//! 2. [`proto::target`] normalises the target (names, every IP spelling).
//! 3. [`policy`] decides, purely, under one version of the served state
//!    ([`served`], loaded once as the connection's [`proxy::ctx::View`]),
//!    in the proxy's one decision step ([`proxy::decide`]): client → org,
//!    name rules, then the addresses [`resolve`] found, each checked
//!    before it may be dialled. The decided connection carries its state
//!    ([`proxy::conn::Conn`]) from here to its close.
//! 4. [`proxy::dial`](mod@proxy::dial) dials exactly a checked address.
//!    A CONNECT tunnel ([`proxy::connect`]) then answers `200` and judges
//!    the client's first unit (a ClientHello, a request head) against the
//!    rule's `tunnel` ([`proxy::verify`], over the pure
//!    [`proto::tls_stream`] and [`proto::http_stream`]).
//! 5. [`evidence`] writes the decision record ([`proxy::record`]); only
//!    then does a byte reach the upstream. A tunnel keeps being verified
//!    until it is opaque, and a violation on the way is a denial record of
//!    its own.
//! 6. Bytes are copied until close, which is recorded too; a reload's
//!    new policy reaches the live connection ([`proxy::revoke`]). Whatever fails
//!    is told to the client from one mapping ([`proxy::failure`]).
//!
//! A DNS query takes the same steps in [`dns`]: org by source address, the
//! policy's name decision ([`dns::decide`]), upstream through [`resolve`],
//! answers filtered by the policy's address checks ([`dns::filter`]) and
//! bound to the name in [`handout::bindings`], then the record, built from the
//! query's typed state ([`dns::query`]) when written, then the answer.
//!
//! Transparent connections ([`proxy::transparent`]) and SOCKS5
//! ([`proxy::socks5`]) join the same path at step 3 with the name the
//! client presented; all tunnels share [`proxy::connect`], where an
//! intercepted connection (opt-in TLS interception, [`proxy::intercepted`],
//! with the per-org CAs and credentials of [`intercept`]) is served HTTP
//! through the same layer as explicit mode. The proxy's files are layered
//! from the modes down to the shared context ([`proxy::ctx`]); its module
//! doc has the map.
//!
//! Below the proxy and DNS, shared by both and importing neither:
//! [`limits`] (rate limiters, the keyed shares charged to an org or else a
//! source address, connection caps, detection memory, the evidence budget,
//! the one summary engine for denials, refusals and bypass attempts, the
//! new-name budgets of wildcard rules, and the one fair bounded table the
//! bounded tables stand on); [`handout`] (the addresses handed to an
//! (org, name): the name-address bindings the shim hands out and
//! transparent mode checks, and the synthetic answers of orgs that resolve
//! nothing before a decided connection);
//! [`serve`] (the one accept loop and the one HTTP/1 server of every
//! listener: proxy, DNS over TCP, admin).
//!
//! [`config`] loads and validates the TOML file; [`served`] holds what is
//! served (policy, DNS settings, interception, credentials), read once per
//! decision; [`reload`] rebuilds it and swaps it whole on SIGHUP, a file
//! change or a change of the host's own addresses (read by [`host`], always
//! denied by the policy); [`metrics`] is one value handed to whoever counts;
//! [`app`] wires listeners, the metrics, the admin endpoints ([`admin`],
//! with the live decision tail of [`admin::tail`]) and shutdown;
//! [`bypass`] reads the packets the gateway ruleset rejected (its NFLOG
//! group) and records them as `kind = "bypass"`; [`enforcement`] checks
//! that the kernel holds the gateway ruleset as its file defines it
//! (`/readyz`, `kind = "enforcement"` records, `enforcement_missing`);
//! [`decider`] asks an operator's HTTP endpoint about a miss;
//! [`probe`] demonstrates containment (a probe plan run in the sandbox,
//! joined with verified evidence). [`cli`] holds the commands of the
//! `palisade` binary: arguments and printing over the library; the read
//! side is [`analysis`], among them [`analysis::explain`], which runs the
//! same decision for one target from the command line, and
//! [`analysis::replay`], which re-decides recorded decisions under a
//! candidate policy.
//!
//! Visibility says what is internal: items are `pub(crate)` unless the
//! binary, the integration tests, the benches or the fuzz targets use them
//! (the `unreachable_pub` lint in `Cargo.toml` holds it), and
//! `tests/architecture.rs` forbids import cycles among the files of any
//! folder.

// One place needs it, with its proof of soundness beside it: the
// SO_RCVLOWAT setsockopt in `proxy::splice`.
#![deny(unsafe_code)]
// The map above names internal modules: read it with
// `cargo doc --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

pub(crate) mod admin;
pub mod analysis;
pub mod app;
pub(crate) mod bypass;
pub mod cli;
pub mod config;
pub(crate) mod decider;
pub(crate) mod dns;
pub(crate) mod enforcement;
pub mod evidence;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod handout;
pub(crate) mod host;
pub(crate) mod intercept;
pub(crate) mod jit;
pub(crate) mod limits;
pub(crate) mod metrics;
pub(crate) mod otel;
pub mod policy;
pub mod probe;
pub mod proto;
pub(crate) mod proxy;
pub(crate) mod reload;
pub(crate) mod resolve;
pub(crate) mod serve;
pub(crate) mod served;
pub(crate) mod sockopt;
#[cfg(test)]
mod testing;
