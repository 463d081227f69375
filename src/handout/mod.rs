//! Addresses handed to an (org, name): what the DNS shim answered an org
//! for a name, kept so that the proxy can tell what a connection to that
//! address stands for. Written by the shim ([`crate::dns`]), read by the
//! proxy ([`crate::proxy`]); pure bookkeeping, `now` passed in.
//!
//! | what | file | read by |
//! |---|---|---|
//! | resolved addresses bound to (org, name) until their TTL runs out | [`bindings`] | transparent mode, PTR answers |
//! | synthetic pool addresses bound to (org, name), pinned while a connection uses them | [`synthetic`] | every proxy mode (the name of a synthetic address) |
//!
//! Both are bounded by [`crate::limits::table::FairTable`]: one org's
//! churn evicts its own entries, never another's below its share.

// Pure: no clock, tokio or I/O (clippy.toml), in both files.
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

pub(crate) mod bindings;
pub(crate) mod synthetic;
