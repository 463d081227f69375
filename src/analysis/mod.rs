//! The read side, as a library: what the evidence and the policy say,
//! for an operator. The commands of [`crate::cli`] read their input, call
//! these and print; nothing here parses arguments or writes to stdout.
//!
//! - [`denials`]: what was denied, per org and target, with a hint each
//!   (`palisade evidence summary`);
//! - [`draft`]: an org's allow rules drafted from its evidence, checked
//!   against the config and replayed (`palisade draft`);
//! - [`replay`]: every recorded decision re-decided under a candidate
//!   policy, and the flows that would flip (`palisade replay`);
//! - [`explain`]: the decision the policy takes for one client and target,
//!   through the code the proxy and the DNS shim run (`palisade explain`).
//!
//! Which records they read is one [`Selection`](crate::evidence::select::Selection)
//! (org, decision, reason, a time window, a host glob, ...), the same the
//! commands `evidence query`, `evidence export` and `tail` take.

use crate::policy::Reason;

pub mod denials;
pub mod draft;
pub mod explain;
pub mod replay;

/// Reasons Palisade gives when it closes a tunnel for what it carried:
/// their records name the tunnel's decision record in `conn`.
pub(crate) const TUNNEL_REASONS: [Reason; 7] = [
    Reason::ProtocolMismatch,
    Reason::SniMismatch,
    Reason::SniMissing,
    Reason::EchNotAllowed,
    Reason::HostMismatch,
    Reason::UpgradeNotAllowed,
    Reason::BadRequest,
];
