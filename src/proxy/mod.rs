//! The proxy, in layers: the trip of one connection reads from the modes
//! down, and no file names one above it.
//!
//! - The modes: [`explicit`] (CONNECT and absolute-form HTTP/1.1, and its
//!   listener's entry, [`explicit::serve_explicit`]), [`socks5`],
//!   [`transparent`]; they accept through [`listen`].
//! - Tunnels of every mode go through [`connect`]: detection and copying in
//!   [`tunnel`] (zero-copy with splice(2) in [`splice`]), verification of
//!   what a tunnel carries in [`verify`], serving an intercepted connection
//!   (opt-in TLS interception) in [`intercepted`].
//! - HTTP (explicit mode, intercepted connections) is served and forwarded
//!   through one layer, [`http`], and a forwarded request ends in
//!   [`forward`], over idle upstream connections of [`pool`].
//! - A live connection is held to every policy a reload serves after its
//!   decision, and closed when one denies it: [`revoke`].
//! - Every allow climbs one fail-closed ladder after its decision
//!   (evidence writable, the org's evidence budget paid): [`admission`].
//! - Records of connections, and the refusals they give, are written in
//!   [`record`]; whatever fails is told to the client from one mapping,
//!   [`failure`].
//! - A connection carries its own state from accept to close
//!   ([`conn`]): a [`conn::Link`] born at accept with its view, mode,
//!   client and permit (a refusal is `link.refuse(…)` plus one write),
//!   which a decided target turns into a [`conn::Conn`] (with its
//!   interception [`conn::Plan`]); evidence records are built from the
//!   state when written.
//! - The decision step every mode takes is [`decide`](mod@decide)
//!   ([`decide::decide`]); dialling exactly a checked address is
//!   [`dial`](mod@dial) ([`dial::dial_checked`]).
//! - Under them all, the services every connection shares ([`Ctx`]) and
//!   one decision's view of what is served: [`ctx`].
//! - Connection caps and rate limits, charged to the org a connection is
//!   decided for (strangers to their own address), and the shares of
//!   detection memory: [`crate::limits`]. Denials over a client's record rate
//!   are written as summaries: [`denials`].

pub(crate) mod admission;
pub(crate) mod conn;
pub(crate) mod connect;
pub(crate) mod ctx;
pub(crate) mod decide;
pub(crate) mod denials;
pub(crate) mod dial;
pub(crate) mod explicit;
pub(crate) mod failure;
pub(crate) mod forward;
pub(crate) mod http;
pub(crate) mod intercepted;
pub(crate) mod listen;
pub(crate) mod pool;
pub(crate) mod record;
pub(crate) mod revoke;
pub(crate) mod socks5;
pub(crate) mod splice;
pub(crate) mod transparent;
pub(crate) mod tunnel;
pub(crate) mod verify;

pub(crate) use self::ctx::Ctx;
pub(crate) use self::explicit::{serve_explicit, MAX_REFUSAL_DRAINS};
