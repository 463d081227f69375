//! The policy decision: pure functions over values. No I/O, no clock.
//!
//! A client address maps to an org by longest prefix. A target is either a
//! normalised name or an IP address (see [`crate::proto::target`]). Names are
//! decided in two steps: the name against the org's host rules, then every
//! address the name resolves to against the address checks; the caller dials
//! only addresses that passed.
//!
//! # Which decide is which
//!
//! Every `decide*` function in the crate, from the policy's pure steps up
//! to the callers that do I/O around them:
//!
//! | function | decides | for whom |
//! |---|---|---|
//! | [`Policy::decide`] | client address → org, then [`Policy::decide_for_org`] | `palisade replay`, tests |
//! | [`Policy::decide_for_org`] | one target for a known org: an IP at once, a name's rules (then [`Decision::Resolve`]) | every decision of a target |
//! | `Policy::decide_name`, `decide_name_rules`, `decide_ip` (private) | the name step, its host rules, the address step of an IP target | [`Policy::decide_for_org`] |
//! | [`Policy::decide_name_any_port`] (and private `decide_name_any_port_enforced`) | a name on any port, addresses not considered | the DNS shim |
//! | [`Policy::decide_request`], over [`request::decide`] | one request inside an intercepted connection: method and path rules, credentials | interception, plain `http://` under an intercepting rule |
//! | `dns::decide::decide_query` | one DNS query: org, name, query type | the DNS shim |
//! | [`crate::proxy::decide::decide_with`] | a target with I/O: the name step, resolution (or transparent mode's original destination), the address step | every proxy mode, `palisade explain` |
//! | [`crate::proxy::decide::decide`], [`crate::proxy::decide::decide_in`] | [`crate::proxy::decide::decide_with`] for a view's org (untimed, timed under a mode) | explicit, SOCKS5, transparent without a name |
//! | `proxy::transparent::decide` (private) | a transparent connection: the presented name against the original destination | transparent mode |
//! | `proxy::intercepted::serve::decide_parts` (crate), `decide_and_send` (private) | a request in an intercepted connection: what it addresses, then [`Policy::decide_request`]; then record and send it | interception, `palisade explain` |
//!
//! # Truth table
//!
//! Checks run top to bottom; the first row that applies decides.
//!
//! | # | target | condition | decision | reason | rule |
//! |---|---|---|---|---|---|
//! | 1 | any | client in no org's `clients` | deny | `unknown_client` | – |
//! | 1a | any | a baseline `[[deny]]` entry covers the name, or the address (or one embedded in it), on the port: for every org, never reported | deny | `explicit_deny`, layer `baseline` | baseline entry |
//! | 2 | name | a host deny rule matches the name and its ports include the port | deny | `explicit_deny` | deny rule |
//! | 3 | name | no host allow rule matches the name | deny | `no_matching_rule` | – |
//! | 4 | name | host allow rules match the name, none on this port | deny | `port_not_allowed` | – |
//! | 5 | name | the name does not resolve (caller's step) | deny | `resolution_failed` | allow rule |
//! | 6 | name | no resolved address passes the address checks (rows A-C) | deny | reason of the first address | as row A-C |
//! | 7 | name | otherwise: dial only the addresses that passed | allow | `rule_match` | allow rule |
//! | 8 | IP | the address passes the address checks (rows A-C) and a cidr allow rule covers it on the port | allow | `rule_match` | allow rule (for an always-denied address, the first rule that opens it, row C) |
//! | 9 | IP | a cidr allow rule covers it, none on this port | deny | `port_not_allowed` | – |
//! | 10 | IP | otherwise | deny | `no_matching_rule` | – |
//!
//! Address checks, for the address dialled and every IPv4 address embedded
//! in it (IPv4-compatible `::/96`, SIIT `::ffff:0:0:0/96`, NAT64
//! `64:ff9b::/96` and `64:ff9b:1::/48` (last 32 bits), 6to4, Teredo, and
//! under any prefix an ISATAP interface id `0:5efe:a.b.c.d` or
//! `200:5efe:a.b.c.d`); each must pass on its own:
//!
//! | # | condition | decision | reason |
//! |---|---|---|---|
//! | A0 | a baseline `[[deny]]` cidr covers it on the port (every org, never reported) | deny | `explicit_deny`, layer `baseline` |
//! | A | the address and port are one of Palisade's own listeners (a listener on an unspecified address matches any address on its port) | deny | `denied_address` |
//! | B | a cidr deny rule covers it on the port (a deny wins inside an allowed cidr) | deny | `explicit_deny` |
//! | C | it is in an always-denied range, and no cidr allow rule on the port both covers it and lies inside the most specific always-denied range holding it | deny | `denied_address` |
//!
//! Row C by example, for an org with `cidr = "0.0.0.0/0"`, `"::/0"` and
//! `"10.20.0.0/16"` on ports 80 and 443, another org's `clients =
//! ["10.9.0.0/16"]`, Palisade listening on `10.0.0.5:3128`, on a host whose
//! interfaces hold `198.18.2.1` and `2001:2::1` (besides loopback):
//!
//! | address | opened by | decision |
//! |---|---|---|
//! | 169.254.169.254, 127.0.0.1, 10.1.2.3, fd00:ec2::254 | nothing (`0.0.0.0/0`, `::/0` are broader than the range) | deny |
//! | 10.20.1.1 | `10.20.0.0/16` (inside `10.0.0.0/8`) | allow |
//! | 10.21.0.1 | nothing | deny |
//! | 10.9.0.7 (the other org's sandbox) | nothing: only a rule inside `10.9.0.0/16` opens it | deny |
//! | 10.0.0.5, any port | nothing: only `10.0.0.5/32` opens it (and never on 3128, row A) | deny |
//! | 198.18.2.1, 2001:2::1 (the gateway's own), any port | nothing: only `198.18.2.1/32`, `2001:2::1/128` open them | deny |
//! | 2001:2::5efe:127.0.0.1 (ISATAP) | the v6 address by `::/0`, but not the embedded 127.0.0.1 | deny |
//! | 2001:db8::1, 3fff::1 (IPv6 documentation) | nothing | deny |
//! | 8.8.8.8 | `0.0.0.0/0` (not always-denied) | allow |
//! | 64:ff9b::8.8.8.8 | `::/0`; the embedded 8.8.8.8 is open | allow |
//! | 64:ff9b::127.0.0.1 | the v6 address by `::/0`, but the embedded 127.0.0.1 is not opened: a v6 rule never opens an embedded IPv4 address, only an IPv4 rule inside its range does (`127.0.0.1/32` would) | deny |
//! | 64:ff9b:1::8.8.8.8 | nothing: `64:ff9b:1::/48` is always-denied; a rule inside it opens the v6 side, the embedded address is checked as well | deny |
//!
//! DNS answers take the same rows without a port: an address is stripped
//! if a cidr deny rule covers it on every port, or if row C finds it
//! always-denied and no rule inside its range covers it on any port. A name
//! resolving into an always-denied range is denied (row 6) or stripped from
//! answers exactly as the address itself.
//!
//! Always-denied ([`ALWAYS_DENIED`]): unspecified and "this network"
//! (`0.0.0.0/8`, `::`), loopback (`127.0.0.0/8`, `::1`), RFC 1918, shared
//! address space `100.64.0.0/10`, link-local (`169.254.0.0/16` incl. the
//! metadata address, `fe80::/10`), IETF protocol assignments `192.0.0.0/24`,
//! multicast (`224.0.0.0/4`, `ff00::/8`), reserved and broadcast
//! (`240.0.0.0/4`), SIIT `::ffff:0:0:0/96`, local-use NAT64
//! `64:ff9b:1::/48`, discard-only `100::/64`, SRv6 SIDs `5f00::/16`,
//! unique-local `fc00::/7` (incl. `fd00:ec2::254`) and site-local
//! `fec0::/10`, the IPv6 documentation ranges `2001:db8::/32` and
//! `3fff::/20`; also every org's `clients` networks (whatever its
//! identity), the address of every listener bound to a specific address
//! (every port), and every address of the host's interfaces ("gateway
//! address": IPv4 and IPv6, upstream side included, each as a /32 or
//! /128, every port; enumerated by `crate::host` at start and on every
//! reload and handed in to [`Policy::with_host`]; loopback addresses are
//! left to their fixed range). IPv4-mapped IPv6 is canonicalised to IPv4
//! before any check. Benchmarking (`198.18.0.0/15`, `2001:2::/48`) and the
//! IPv4 documentation ranges stay open: never routed, nothing internal
//! answers there, and test labs and probes use them.
//!
//! # Identity
//!
//! Which org a client belongs to, from its source address C and the
//! credentials it presented (user = org name, password = token), if any:
//!
//! | # | credentials | condition | org | reason |
//! |---|---|---|---|---|
//! | I1 | none | C in the `clients` of an org with identity `address` | that org (longest prefix) | – |
//! | I2 | none | otherwise, and some token org would accept a token from C | none | `auth_required` |
//! | I3 | none | otherwise | none | `unknown_client` (row 1) |
//! | I4 | user, token | the user names an org with identity `token` holding the token | that org | – |
//! | I5 | user, token | the user names an org with identity `address+token` holding the token, C in its `clients` | that org | – |
//! | I6 | user, token | otherwise (no such org, wrong token, address org, C outside) | none | `auth_failed` |
//!
//! Presented credentials are always checked, never ignored; tokens are
//! compared as SHA-256 digests in constant time, and a failure looks the
//! same to the client whatever its cause.
//!
//! Host rules never match an IP target (no reverse lookups), and cidr rules
//! never make a name allowed on their own: a name needs a host allow rule.
//!
//! Cost: a name lookup probes one hash map per label of the name, an address
//! lookup one hash map per distinct prefix length in use; neither grows with
//! the number of rules.

// Pure: no clock, tokio or I/O (clippy.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

mod address;
mod allowed;
mod compile;
mod decide;
mod identity;
pub(crate) mod request;
mod rule;
pub(crate) mod service;
mod table;
mod token;
mod verdict;

pub use crate::config::{ALWAYS_DENIED, GRANT_RULE_PREFIX};
pub use compile::{canonical, Opening, Policy, GATEWAY_ADDRESS, SYNTHETIC_POOL};
pub use identity::{Credential, IdentityError};
pub use service::ServiceFacts;
pub use verdict::{AddressVerdict, Decision, Layer, OrgRef, PendingName, Reason, Verdict};

#[cfg(test)]
mod tests;
