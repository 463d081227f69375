//! The limits layer under the proxy and the DNS shim: what one client or
//! one org may take of what all share, and the evidence it may cause.
//!
//! | what | file | used by |
//! |---|---|---|
//! | who pays (org, else source address; IPv6 by /64) and the keyed shares they hold | [`share`] | connection caps, detection memory, DNS budgets |
//! | token buckets per key (rates, bounded tables) | [`rate`] | new connections, DNS queries, denial records |
//! | connection caps and permits | [`conns`] | the proxy |
//! | detection memory (first bytes held before a decision) | [`detect`] | the proxy |
//! | the evidence budget, per org, proxy and DNS together, and the share of a full store | [`evidence`] | the proxy, the DNS shim |
//! | flood summaries (denials, refusals) | [`summary`] | the proxy, the DNS shim |
//! | the new-name budgets of wildcard rules, per org and rule | [`names`] | the proxy, the DNS shim |
//! | one fair bounded table: caps per org and overall, the org holding the most evicted from, pinning | [`table`] | the DNS answer cache and TTL memo, the bindings and synthetic mappings |
//! | volume budgets (bytes per sliding window), per org and rule and per org | [`volume`] | the proxy |
//!
//! Nothing here knows the proxy or DNS: each passes its own specifics
//! (keys, caps, the shape of its summaries) as parameters.

pub(crate) mod conns;
pub(crate) mod detect;
pub(crate) mod evidence;
#[cfg(test)]
mod measure;
pub(crate) mod names;
pub(crate) mod rate;
pub(crate) mod share;
pub(crate) mod summary;
pub(crate) mod table;
pub(crate) mod volume;
pub(crate) mod watch;

pub(crate) use conns::{ConnLimits, LimitHit, Permit};
pub(crate) use detect::{DetectHold, DetectMemory, DetectScope};
pub(crate) use evidence::EvidenceBudget;
pub(crate) use names::{NameBudgets, NameUse};
pub(crate) use rate::RateLimiter;
pub(crate) use share::{client_key, Payer, Share, Shares};
pub(crate) use volume::{Lease, Volumes};
pub(crate) use watch::Watch;
