//! The engine of `palisade draft`: an org's proposed allow rules, drafted
//! from what it did, as `[[org.allow]]` tables to place under its
//! `[[org]]` block (or the whole config with them inserted there).
//!
//! In order: the command verifies the evidence (unverifiable evidence is
//! refused, the first bad record named) and reads the org's decision
//! records; [`draft`] gathers them (allowed, denied, or let through as
//! `would_deny`) per name (or address) with their ports, counts, times, references and what their tunnels carried;
//! then [`plan`] decides, purely, what becomes a rule:
//!
//! - a name the current config allows already is left out; one it denies
//!   explicitly is listed as a comment, never allowed;
//! - a wildcard `*.P` only where at least `--wildcard-min` distinct names
//!   under P were seen, P is no public suffix and has none below it (the
//!   Public Suffix List, through the `psl` crate: `*.github.io`, `*.co.uk`,
//!   `*.com`, `*.amazonaws.com` are never proposed; [`has_suffix_below`])
//!   and no deny rule of the org lies under or over P;
//! - an IP literal becomes a `cidr` rule for that one address, with a
//!   warning; one the policy holds always denied (a fixed range, another
//!   org's clients, the gateway's own address, a synthetic pool: what
//!   `check` would list as opened) or that was recorded `denied_address`
//!   is only a comment;
//! - a rule's `tunnel` is what its flows were verified to carry, never
//!   `opaque`: a tunnel that report mode let on unverified after a
//!   violation is listed in the rule's comment instead.
//!
//! The sandbox chooses every flow the draft is made from, so none of them
//! may widen a proposal beyond what the flows themselves needed and the
//! policy allows anyone to have.
//!
//! Nothing is resolved and nothing is dialled. [`draft`] checks its own
//! work: the config with the rules inserted must pass `check`, and under
//! it every flow the draft was built from must be allowed while every
//! flow the current config denies explicitly stays denied
//! ([`Draft::replays`]); the command prints the counts on stderr and
//! refuses a draft that fails.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;

use toml_edit::{value, Array, ArrayOfTables, DocumentMut, Item, Table};

use super::TUNNEL_REASONS;
use crate::config::{Carry, Config, RuleTarget};
use crate::evidence::select::Selection;
use crate::evidence::{Event, Kind, Record};
use crate::policy::{Decision, Policy, Reason};
use crate::proto::target::{normalize_host, Host};

/// What the org did with one target.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Seen {
    pub ports: BTreeSet<u16>,
    pub allowed: u64,
    pub denied: u64,
    pub would_deny: u64,
    pub first: String,
    pub last: String,
    /// Up to two record references.
    pub refs: Vec<String>,
    /// What the tunnels were verified to carry (never `opaque`: see
    /// [`Seen::add`]).
    pub carries: HashSet<Carry>,
    /// Tunnels to a name that report mode let on unverified after a
    /// violation (not TLS on 443, ECH, another SNI, ...), and the first
    /// one's detail.
    pub unverified: u64,
    pub violation: Option<String>,
    /// Decisions recorded `denied_address`: the address was always denied
    /// (or Palisade's own) where and when it was decided.
    pub denied_address: u64,
    /// The most bytes (up, down) the org's closed connections and
    /// requests to the target moved within one hour: what a suggested
    /// volume budget starts from.
    pub peak: (u64, u64),
}

/// The busiest hour of each host of `org`'s close records: bytes up and
/// down of the connections and requests that closed within any one hour
/// (each direction on its own).
fn peaks(records: &[Record], org: &str) -> HashMap<String, (u64, u64)> {
    let mut by_host: HashMap<String, Vec<(std::time::SystemTime, u64, u64)>> = HashMap::new();
    for r in records {
        let (Event::Close, Some(host), Some(true)) =
            (r.event, &r.host, r.org.as_deref().map(|o| o == org))
        else {
            continue;
        };
        let Ok(at) = humantime::parse_rfc3339_weak(r.ts.trim_end_matches('Z')) else {
            continue;
        };
        let (up, down) = (r.bytes_up.unwrap_or(0), r.bytes_down.unwrap_or(0));
        by_host
            .entry(host.clone())
            .or_default()
            .push((at, up, down));
    }
    let hour = std::time::Duration::from_secs(3600);
    by_host
        .into_iter()
        .map(|(host, mut closes)| {
            closes.sort_by_key(|c| c.0);
            let (mut start, mut up, mut down, mut peak) = (0, 0u64, 0u64, (0u64, 0u64));
            for &(at, u, d) in &closes {
                up += u;
                down += d;
                while closes[start].0 + hour <= at {
                    up -= closes[start].1;
                    down -= closes[start].2;
                    start += 1;
                }
                peak = (peak.0.max(up), peak.1.max(down));
            }
            (host, peak)
        })
        .collect()
}

/// A suggested budget: twice `peak`, rounded up to a whole MiB.
fn suggested(peak: u64) -> String {
    let mib = peak.saturating_mul(2).div_ceil(1 << 20).max(1);
    format!("\"{mib}MiB\"")
}

impl Seen {
    fn count(&self) -> u64 {
        self.allowed + self.denied + self.would_deny
    }

    fn add(&mut self, r: &Record) {
        if let Some(p) = r.port {
            self.ports.insert(p);
        }
        match (r.would_deny, r.reason.is_allow()) {
            (Some(_), _) => self.would_deny += 1,
            (None, true) => self.allowed += 1,
            (None, false) => self.denied += 1,
        }
        if self.first.is_empty() || r.ts < self.first {
            self.first = r.ts.clone();
        }
        if r.ts > self.last {
            self.last = r.ts.clone();
        }
        if self.refs.len() < 2 {
            self.refs.push(r.shown().to_string());
        }
        if r.would_deny.unwrap_or(r.reason) == Reason::DeniedAddress {
            self.denied_address += 1;
        }
        // A tunnel recorded `opaque` was not verified: by its rule's choice
        // (a reviewed rule), or because report mode let it on after a
        // violation. Neither makes the draft loosen verification: it
        // proposes what the port verifies, and lists the violations.
        let carry = match (r.kind, r.tunnel, r.port) {
            (Kind::Http, _, _) => Some(Carry::Http),
            (_, Some(Carry::Opaque), Some(p)) => {
                if r.reason != Reason::RuleMatch {
                    self.violated(r, r.detail.as_deref());
                }
                Some(Carry::default_for_port(p))
            }
            (_, Some(c), _) => Some(c),
            (_, None, Some(p)) => Some(Carry::default_for_port(p)),
            _ => None,
        };
        self.carries.extend(carry);
    }

    /// Count a violation of the tunnel `r` decided (on its first bytes, or
    /// later), with its detail: for a name only (a `cidr` rule's tunnels
    /// are opaque by nature).
    fn violated(&mut self, r: &Record, detail: Option<&str>) {
        if r.host
            .as_deref()
            .is_none_or(|h| h.parse::<IpAddr>().is_ok())
        {
            return;
        }
        self.unverified += 1;
        if self.violation.is_none() {
            self.violation = detail.map(printable);
        }
    }

    /// Fold another target's flows in (the names under a wildcard).
    fn merge(&mut self, x: &Seen) {
        self.ports.extend(&x.ports);
        self.allowed += x.allowed;
        self.denied += x.denied;
        self.would_deny += x.would_deny;
        self.carries.extend(&x.carries);
        if self.first.is_empty() || x.first < self.first {
            self.first = x.first.clone();
        }
        if x.last > self.last {
            self.last = x.last.clone();
        }
        for r in &x.refs {
            if self.refs.len() < 2 {
                self.refs.push(r.clone());
            }
        }
        self.unverified += x.unverified;
        if self.violation.is_none() {
            self.violation = x.violation.clone();
        }
        self.denied_address += x.denied_address;
        self.peak = (self.peak.0.max(x.peak.0), self.peak.1.max(x.peak.1));
    }

    /// The `tunnel` a rule for these flows needs: one verified kind, or
    /// `tls-or-http` for both; never `opaque`.
    fn carry(&self) -> Carry {
        let mut verified = self.carries.iter().filter(|c| **c != Carry::Opaque);
        match (verified.next(), verified.next()) {
            (Some(c), None) => *c,
            _ => Carry::TlsOrHttp,
        }
    }

    fn comment(&self) -> String {
        format!(
            "# seen {} times ({} allowed, {} denied, {} would_deny), first {}, last {}; records {}\n",
            self.count(),
            self.allowed,
            self.denied,
            self.would_deny,
            self.first,
            self.last,
            self.refs.join(", ")
        )
    }
}

/// How the current config treats a name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Current {
    /// Allowed by name on every port seen.
    Allowed,
    /// Denied by a deny rule (its id).
    Denied(String),
    /// An IP literal in an always-denied range of the policy (what it is
    /// and the range): another org's clients, the gateway's own address,
    /// a synthetic pool, a fixed range.
    Closed(String),
    /// Not allowed: a candidate.
    Open,
}

/// One proposal of the draft.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Proposal {
    /// `host = NAME` (or `*.PARENT` with the names it covers).
    Host {
        host: String,
        covers: Vec<String>,
        seen: Seen,
    },
    /// `cidr = IP/32` for an IP literal.
    Cidr { ip: IpAddr, seen: Seen },
    /// Only a comment: why not.
    Comment(String),
}

/// What the draft found, for stderr.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Counts {
    pub decisions: u64,
    pub already_allowed: usize,
    pub below_min: usize,
}

/// The pure step: targets seen (with how the current config treats each)
/// in, proposals out.
pub(crate) fn plan(
    seen: &BTreeMap<String, (Seen, Current)>,
    deny_targets: &[RuleTarget],
    min_count: u64,
    wildcard_min: usize,
    counts: &mut Counts,
) -> Vec<Proposal> {
    let mut out = Vec::new();
    let mut names: BTreeMap<&str, &Seen> = BTreeMap::new();
    for (target, (s, current)) in seen {
        let not_proposed = |why: &str| {
            Proposal::Comment(format!(
                "# {target} (ports {}) seen {} times: {why}; not proposed\n",
                ports_text(&s.ports),
                s.count()
            ))
        };
        let ip = target.parse::<IpAddr>().ok();
        match current {
            Current::Allowed => counts.already_allowed += 1,
            Current::Closed(what) => out.push(not_proposed(&format!("always denied ({what})"))),
            _ if ip.is_some() && s.denied_address > 0 => out.push(not_proposed(
                "recorded denied_address (always denied where it was decided: the gateway's own address, another org's clients, ...)",
            )),
            Current::Denied(rule) => {
                out.push(not_proposed(&format!("denied explicitly by rule {rule}")))
            }
            Current::Open if s.count() < min_count => counts.below_min += 1,
            Current::Open => match ip {
                Some(ip) => out.push(Proposal::Cidr { ip, seen: s.clone() }),
                None => {
                    names.insert(target, s);
                }
            },
        }
    }
    // Wildcards: parents with enough distinct names below them.
    let mut below: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for name in names.keys() {
        if let Some((_, parent)) = name.split_once('.') {
            below.entry(parent.to_string()).or_default().push(name);
        }
    }
    let mut covered: BTreeSet<&str> = BTreeSet::new();
    for (parent, list) in &below {
        if list.len() < wildcard_min.max(2)
            || is_public_suffix(parent)
            || deny_targets.iter().any(|d| conflicts(d, parent))
        {
            continue;
        }
        if has_suffix_below(parent) {
            out.push(Proposal::Comment(format!(
                "# *.{parent} over {} names seen: the Public Suffix List has public suffixes below {parent} (names anyone may register under); not proposed, its names one by one\n",
                list.len()
            )));
            continue;
        }
        let mut s = Seen::default();
        for n in list {
            s.merge(names[n]);
        }
        covered.extend(list.iter().copied());
        out.push(Proposal::Host {
            host: format!("*.{parent}"),
            covers: list.iter().map(|n| n.to_string()).collect(),
            seen: s,
        });
    }
    for (name, s) in names {
        if !covered.contains(name) {
            out.push(Proposal::Host {
                host: name.to_string(),
                covers: Vec::new(),
                seen: s.clone(),
            });
        }
    }
    out
}

/// Whether `name` is itself a public suffix (`com`, `co.uk`, `github.io`;
/// an unlisted top-level name too, by the list's default rule).
pub(crate) fn is_public_suffix(name: &str) -> bool {
    psl::suffix(name.as_bytes()).is_none_or(|s| s.as_bytes().eq_ignore_ascii_case(name.as_bytes()))
}

/// Whether the Public Suffix List has any rule strictly below `name`
/// (`amazonaws.com`: `s3.amazonaws.com`, `*.compute.amazonaws.com`, ...),
/// so that `*.name` would cover public suffixes. The `psl` crate cannot
/// list rules, but its lookup walks the list as a tree of labels, read
/// from the right, and reads a label past `name` only where the tree
/// holds rules below it: the lookup is given `name`'s labels and counted.
/// Pinned by a unit test both ways: a crate that read further everywhere
/// would only make the draft propose no wildcard.
pub(crate) fn has_suffix_below(name: &str) -> bool {
    use psl::Psl;
    struct Counted<'a> {
        labels: std::str::RSplit<'a, char>,
        asked: usize,
    }
    impl<'a> Iterator for Counted<'a> {
        type Item = &'a [u8];
        fn next(&mut self) -> Option<&'a [u8]> {
            self.asked += 1;
            self.labels.next().map(str::as_bytes)
        }
    }
    let mut labels = Counted {
        labels: name.rsplit('.'),
        asked: 0,
    };
    let _ = psl::List.find(&mut labels);
    labels.asked > name.split('.').count()
}

/// `text` with anything but printable ASCII as `?`, at most 200
/// characters: record text that goes into a comment of the config (a
/// newline there would start a line of TOML).
fn printable(text: &str) -> String {
    text.chars()
        .take(200)
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect()
}

/// Whether a deny rule lies under or over `*.parent`.
fn conflicts(deny: &RuleTarget, parent: &str) -> bool {
    let under = |n: &str| n == parent || n.ends_with(&format!(".{parent}"));
    match deny {
        RuleTarget::Exact(n) => under(n),
        RuleTarget::Below(q) => under(q) || parent.ends_with(&format!(".{q}")),
        RuleTarget::Cidr(_) => false,
    }
}

fn ports_text(ports: &BTreeSet<u16>) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The proposals as `[[org.allow]]` tables (comments only at the end).
fn tables(proposals: &[Proposal]) -> (Vec<Table>, String) {
    let mut out = Vec::new();
    let mut notes = String::new();
    for p in proposals {
        let mut t = Table::new();
        let (comment, seen) = match p {
            Proposal::Comment(c) => {
                notes.push_str(c);
                continue;
            }
            Proposal::Host { host, covers, seen } => {
                t.insert("host", value(host.as_str()));
                let mut c = String::new();
                if !covers.is_empty() {
                    c.push_str(&format!(
                        "# wildcard over {} names seen: {}\n",
                        covers.len(),
                        covers.join(", ")
                    ));
                }
                if seen.unverified > 0 {
                    c.push_str(&format!(
                        "# VIOLATION: {} tunnel(s) failed verification ({}); proposed verified as tunnel = \"{}\", not \"opaque\"; review\n",
                        seen.unverified,
                        seen.violation.as_deref().unwrap_or("no detail"),
                        seen.carry().as_str()
                    ));
                }
                (c, seen)
            }
            Proposal::Cidr { ip, seen } => {
                let bits = if ip.is_ipv4() { 32 } else { 128 };
                t.insert("cidr", value(format!("{ip}/{bits}")));
                (
                    "# WARNING: an IP literal: this allows one address whatever name it has; review\n"
                        .to_string(),
                    seen,
                )
            }
        };
        let mut ports = Array::new();
        for p in &seen.ports {
            ports.push(i64::from(*p));
        }
        t.insert("ports", value(ports));
        if matches!(p, Proposal::Host { .. }) {
            t.insert("tunnel", value(seen.carry().as_str()));
        }
        let budget = if seen.peak == (0, 0) {
            String::new()
        } else {
            format!(
                "# the busiest hour seen moved {} bytes up and {} down; to bound it, add to this \
                 rule: max_bytes_up = {}, max_bytes_down = {}, volume_window = \"1h\" (twice \
                 that; see Volume budgets in docs/decisions.md)\n",
                seen.peak.0,
                seen.peak.1,
                suggested(seen.peak.0),
                suggested(seen.peak.1)
            )
        };
        t.decor_mut()
            .set_prefix(format!("\n{comment}{}{budget}", seen.comment()));
        out.push(t);
    }
    (out, notes)
}

/// The fragment printed without `--write`: the rules, then what was not
/// proposed, then the commented rules from grants (`reviewed`).
fn fragment(tables: &[Table], notes: &str, reviewed: &str) -> String {
    let mut doc = DocumentMut::new();
    let mut org = Table::new();
    org.set_implicit(true);
    let mut allow = ArrayOfTables::new();
    for t in tables {
        allow.push(t.clone());
    }
    org.insert("allow", Item::ArrayOfTables(allow));
    doc.insert("org", Item::Table(org));
    let mut text = doc.to_string();
    if !notes.is_empty() {
        text.push_str("\n# not proposed:\n");
        text.push_str(notes);
    }
    text.push_str(reviewed);
    text
}

/// The config text with the tables appended to ORG's allow rules, and
/// the commented rules from grants (`reviewed`) at its end.
fn inserted(
    original: &str,
    org: &str,
    tables: &[Table],
    notes: &str,
    reviewed: &str,
) -> Result<String, String> {
    let mut doc: DocumentMut = original.parse().map_err(|e| format!("{e}"))?;
    let orgs = doc
        .get_mut("org")
        .and_then(Item::as_array_of_tables_mut)
        .ok_or("the config has no [[org]] tables")?;
    let block = orgs
        .iter_mut()
        .find(|t| t.get("name").and_then(Item::as_str) == Some(org))
        .ok_or_else(|| format!("the config has no org {org:?}"))?;
    if block.get("allow").is_none() {
        block.insert("allow", Item::ArrayOfTables(ArrayOfTables::new()));
    }
    let allow = block
        .get_mut("allow")
        .and_then(Item::as_array_of_tables_mut)
        .ok_or("the org's allow is not an array of tables")?;
    for (i, t) in tables.iter().enumerate() {
        let mut t = t.clone();
        if i == 0 && !notes.is_empty() {
            let prefix = t
                .decor()
                .prefix()
                .and_then(|p| p.as_str())
                .unwrap_or("")
                .to_string();
            t.decor_mut().set_prefix(format!(
                "\n# palisade draft: not proposed:\n{notes}{prefix}"
            ));
        }
        allow.push(t);
    }
    let mut text = doc.to_string();
    text.push_str(reviewed);
    Ok(text)
}

/// The grant a decision record's rule names (`grant:ID`), if one allowed it.
fn granted_by(r: &Record) -> Option<&str> {
    r.rule
        .as_deref()
        .and_then(|rule| rule.strip_prefix(crate::policy::GRANT_RULE_PREFIX))
}

/// The first line of each commented rule proposed from a grant.
const GRANT_HEAD: &str = "# from grant ";

/// One grant of the org as its records tell it.
#[derive(Default)]
struct GrantSeen {
    facts: Option<crate::evidence::GrantFacts>,
    port: Option<u16>,
    /// How it ended, if it did.
    end: Option<&'static str>,
    /// Connections it allowed (decision records naming it).
    used: u64,
}

/// The org's grants (`grants`: their records) as commented `[[org.allow]]`
/// rules for review, each naming the grant, its approver, the reason given
/// and its uses (the larger of the decisions naming it in `records` and
/// the count its last record gives). A grant is never made a rule
/// silently: the flows it allowed are not drafted from ([`gather`]), an
/// approver's "allow" becomes policy only once someone uncomments it.
fn from_grants(grants: &[Record], records: &[Record], org: &str, window: &Selection) -> String {
    let mut by_id: BTreeMap<String, GrantSeen> = BTreeMap::new();
    for r in grants {
        let Some(f) = r.grant.as_deref() else {
            continue;
        };
        if r.kind != Kind::Grant || r.org.as_deref() != Some(org) || !window.in_window(r) {
            continue;
        }
        let g = by_id.entry(f.id.clone()).or_default();
        g.port = r.port;
        match r.event {
            Event::Expired => g.end = Some("expired"),
            Event::Revoked => g.end = Some("revoked"),
            Event::UsedUp => g.end = g.end.or(Some("used up")),
            _ => {}
        }
        let uses = g.facts.as_ref().map_or(0, |old| old.uses).max(f.uses);
        if r.event == Event::Granted || g.facts.is_none() {
            g.facts = Some(f.clone());
        }
        if let Some(kept) = &mut g.facts {
            kept.uses = uses;
        }
    }
    for r in records {
        let granted = granted_by(r);
        if let (Some(id), true) = (
            granted,
            r.event == Event::Decision && r.reason.is_allow() && r.org.as_deref() == Some(org),
        ) {
            if let Some(g) = by_id.get_mut(id) {
                g.used += 1;
            }
        }
    }
    let mut out = String::new();
    for (id, g) in &by_id {
        let Some(f) = &g.facts else { continue };
        let uses = g.used.max(u64::from(f.uses));
        let reason = f.reason.as_deref().map_or_else(
            || "none given".to_string(),
            |r| format!("{:?}", printable(r)),
        );
        out.push_str(&format!(
            "\n{GRANT_HEAD}{id} (approver {}, reason {reason}, {uses} use{}, granted {}{}): review before adopting\n",
            printable(&f.approver),
            if uses == 1 { "" } else { "s" },
            f.granted_at,
            g.end.map(|e| format!(", {e}")).unwrap_or_default(),
        ));
        out.push_str("# [[org.allow]]\n");
        let target = printable(&f.target);
        match f.target.parse::<ipnet::IpNet>() {
            Ok(_) => out.push_str(&format!("# cidr = \"{target}\"\n")),
            Err(_) => out.push_str(&format!("# host = \"{target}\"\n")),
        }
        match g.port {
            Some(p) => out.push_str(&format!("# ports = [{p}]\n")),
            None => out.push_str(
                "# ports = [] (granted from a DNS answer, any port: name the ones it needs)\n",
            ),
        }
        if f.method.is_some() || f.path.is_some() {
            // Request rules bind under interception (and plain http://).
            out.push_str("# intercept = true\n");
        }
        if let Some(m) = &f.method {
            out.push_str(&format!("# methods = [\"{}\"]\n", printable(m)));
        }
        if let Some(p) = &f.path {
            out.push_str(&format!("# paths = [\"{}\"]\n", printable(p)));
        }
    }
    if out.is_empty() {
        return out;
    }
    format!("\n# proposed from grants, for review (uncomment to adopt):{out}")
}

/// Reasons a policy decided (others are the client's traffic, not a rule's).
const POLICY_REASONS: [Reason; 6] = [
    Reason::RuleMatch,
    Reason::ReportOnly,
    Reason::NoMatchingRule,
    Reason::PortNotAllowed,
    Reason::ExplicitDeny,
    Reason::DeniedAddress,
];

/// Whether `policy` allows the recorded flow (by name and, where the
/// record has it, by the address dialled); never resolves.
fn allows(policy: &Policy, r: &Record) -> Option<bool> {
    let client = r.client?.ip();
    let target = normalize_host(r.host.as_deref()?).ok()?;
    Some(match policy.decide(client, &target, r.port?) {
        Decision::Final(v) => v.reason.is_allow() && v.would_deny.is_none(),
        Decision::Resolve(p) if p.would_deny.is_some() => false,
        Decision::Resolve(p) => match r.ip {
            Some(ip) => {
                let v = policy.check_addresses(&p, &[ip]).verdict;
                v.reason.is_allow() && v.would_deny.is_none()
            }
            None => true,
        },
    })
}

/// How `policy` treats a name on the ports seen.
fn current(policy: &Policy, org: &str, r: &Record, ports: &BTreeSet<u16>) -> Current {
    let (Some(client), Some(host)) = (r.client, r.host.as_deref()) else {
        return Current::Open;
    };
    let Ok(target) = normalize_host(host) else {
        return Current::Open;
    };
    let mut all = true;
    for &port in ports {
        let (reason, rule) = match policy.decide(client.ip(), &target, port) {
            Decision::Final(v) => (v.would_deny.unwrap_or(v.reason), v.rule),
            Decision::Resolve(p) => (p.would_deny.unwrap_or(Reason::RuleMatch), p.rule),
        };
        if reason == Reason::ExplicitDeny {
            let rule = rule.map_or_else(|| format!("{org}/deny"), |r| r.to_string());
            return Current::Denied(rule);
        }
        all &= reason.is_allow();
    }
    if all {
        return Current::Allowed;
    }
    let closing = match target {
        Host::Ip(ip) => policy.closing(ip),
        Host::Name(_) => Vec::new(),
    };
    match closing.first() {
        Some((net, what)) => Current::Closed(format!("{}: {net}", what.join(", "))),
        None => Current::Open,
    }
}

/// What a draft is made from.
pub(crate) struct Input<'a> {
    /// The current config, its file (named in errors) and its text (the
    /// draft is inserted into it, comments kept).
    pub config: &'a Config,
    pub config_path: &'a Path,
    pub config_text: &'a str,
    /// The org to draft for.
    pub org: &'a str,
    /// This host's own addresses (always denied, never proposed).
    pub host: &'a [IpAddr],
    /// The org's decision records, in the order written, and its close
    /// records (what suggested budgets start from).
    pub records: Vec<Record>,
    /// The org's grant records (`kind = "grant"`: granted, expired,
    /// revoked, used up), in the order written.
    pub grants: Vec<Record>,
    /// The window the rules are drafted from (its `since`/`until`).
    pub window: &'a Selection,
    /// Propose a name only when it was seen at least this often.
    pub min_count: u64,
    /// Propose `*.parent` only for at least this many distinct names.
    pub wildcard_min: usize,
}

/// A draft, checked.
pub(crate) struct Draft {
    pub proposals: Vec<Proposal>,
    pub counts: Counts,
    /// The rules as a fragment to place under the org.
    pub fragment: String,
    /// The whole config with the rules inserted under the org.
    pub config_text: String,
    /// Rules, and comments on what was not proposed.
    pub rules: usize,
    pub comments: usize,
    /// Grants proposed as commented rules, for review.
    pub from_grants: usize,
    /// The self-check's replay: (drafted flows, of them now allowed) and
    /// (explicitly denied flows, of them still denied).
    pub covered: (u64, u64),
    pub kept_denied: (u64, u64),
}

impl Draft {
    /// Whether the replay of the evidence under the drafted config allows
    /// every drafted flow and keeps every explicit denial.
    pub(crate) fn replays(&self) -> bool {
        self.covered.1 == self.covered.0 && self.kept_denied.1 == self.kept_denied.0
    }

    /// Rules that are wildcards.
    pub(crate) fn wildcards(&self) -> usize {
        self.proposals
            .iter()
            .filter(|p| matches!(p, Proposal::Host { covers, .. } if !covers.is_empty()))
            .count()
    }

    /// Rules that are one address.
    pub(crate) fn cidrs(&self) -> usize {
        self.proposals
            .iter()
            .filter(|p| matches!(p, Proposal::Cidr { .. }))
            .count()
    }
}

/// The flows a draft is built from, and violations inside tunnels report
/// mode let go on (the tunnel's decision record id, and the first one's
/// detail).
fn gather(
    records: Vec<Record>,
    org: &str,
    window: &Selection,
) -> (Vec<Record>, HashMap<String, Option<String>>) {
    let mut flows = Vec::new();
    let mut later: HashMap<String, Option<String>> = HashMap::new();
    for r in records {
        if r.event != Event::Decision || r.org.as_deref() != Some(org) {
            continue;
        }
        if let (Some(conn), Some(w)) = (&r.conn, r.would_deny) {
            if TUNNEL_REASONS.contains(&w) {
                later.entry(conn.clone()).or_insert(r.detail);
                continue;
            }
        }
        // What a grant allowed is proposed from the grant, for review
        // ([`from_grants`]), never drafted silently.
        if granted_by(&r).is_some() {
            continue;
        }
        if r.kind != Kind::Dns
            && r.kind != Kind::Bypass
            && r.host.is_some()
            && r.count.is_none()
            && POLICY_REASONS.contains(&r.reason)
            && r.would_deny.is_none_or(|w| POLICY_REASONS.contains(&w))
            && window.in_window(&r)
        {
            flows.push(r);
        }
    }
    (flows, later)
}

/// Each target the flows went to, what the org did with it and how
/// `policy` treats it now.
fn seen_targets(
    flows: &[Record],
    later: &HashMap<String, Option<String>>,
    policy: &Policy,
    org: &str,
) -> BTreeMap<String, (Seen, Current)> {
    let mut by_target: BTreeMap<String, (Seen, Option<&Record>)> = BTreeMap::new();
    for r in flows {
        let e = by_target
            .entry(r.host.clone().unwrap_or_default())
            .or_default();
        e.0.add(r);
        if let Some(detail) = later.get(&r.id) {
            e.0.violated(r, detail.as_deref());
        }
        e.1.get_or_insert(r);
    }
    by_target
        .into_iter()
        .map(|(t, (s, r))| {
            let c = r.map_or(Current::Open, |r| current(policy, org, r, &s.ports));
            (t, (s, c))
        })
        .collect()
}

/// The self-check's replay of `flows` under the drafted policy: (drafted
/// flows, of them allowed) and (explicitly denied flows, of them still
/// denied).
fn replay_flows(
    flows: &[Record],
    proposals: &[Proposal],
    drafted: &Policy,
) -> ((u64, u64), (u64, u64)) {
    let proposed: BTreeSet<&str> = proposals
        .iter()
        .flat_map(|p| match p {
            Proposal::Host { host, covers, .. } if covers.is_empty() => vec![host.as_str()],
            Proposal::Host { covers, .. } => covers.iter().map(String::as_str).collect(),
            _ => Vec::new(),
        })
        .collect();
    let cidrs: BTreeSet<IpAddr> = proposals
        .iter()
        .filter_map(|p| match p {
            Proposal::Cidr { ip, .. } => Some(*ip),
            _ => None,
        })
        .collect();
    let (mut covered, mut kept_denied) = ((0, 0), (0, 0));
    for r in flows {
        let host = r.host.as_deref().unwrap_or_default();
        let from_draft =
            proposed.contains(host) || host.parse::<IpAddr>().is_ok_and(|ip| cidrs.contains(&ip));
        if from_draft {
            covered.0 += 1;
            covered.1 += u64::from(allows(drafted, r) == Some(true));
        }
        if r.would_deny.unwrap_or(r.reason) == Reason::ExplicitDeny {
            kept_denied.0 += 1;
            kept_denied.1 += u64::from(allows(drafted, r) == Some(false));
        }
    }
    (covered, kept_denied)
}

/// For each intercepting allow rule of the org without service rules,
/// what its allowed requests show of the services of
/// [`crate::policy::service`]: comment lines proposing `service` (and
/// `repos`) to narrow it. The bodies (a push's refs, a GraphQL
/// operation, a model) are not in evidence: `push_refs`,
/// `graphql_mutations` and `models` are left for the operator to name.
fn service_notes(records: &[Record], org: &crate::config::OrgConfig, window: &Selection) -> String {
    use crate::config::Service;
    use crate::policy::service::recognise;
    /// What one rule's requests showed.
    #[derive(Default)]
    struct RuleSeen {
        /// Requests per service.
        services: BTreeMap<&'static str, u64>,
        repos: BTreeSet<String>,
        pushed: bool,
    }
    let mut seen: BTreeMap<&str, RuleSeen> = BTreeMap::new();
    for r in records {
        let (Some(rule), Some(method), Some(path)) = (r.rule.as_deref(), &r.method, &r.path) else {
            continue;
        };
        if r.kind != Kind::Http
            || r.event != Event::Decision
            || r.org.as_deref() != Some(org.name.as_str())
            || !r.reason.is_allow()
            || !window.in_window(r)
        {
            continue;
        }
        let Some(cfg) = org.allow.iter().find(|a| a.id == rule) else {
            continue;
        };
        if cfg.intercept.as_ref().is_none_or(|i| i.service.is_some()) {
            continue;
        }
        let Some((service, repo, push)) = recognise(method, path) else {
            continue;
        };
        let e = seen.entry(&cfg.id).or_default();
        *e.services.entry(service.as_str()).or_default() += 1;
        if service == Service::Git {
            e.repos.extend(repo.map(|r| printable(&r)));
            e.pushed |= push;
        }
    }
    let mut out = String::new();
    for (
        rule,
        RuleSeen {
            services,
            repos,
            pushed,
        },
    ) in seen
    {
        let Some((service, n)) = services.iter().max_by_key(|(_, n)| **n) else {
            continue;
        };
        let mut line = format!(
            "# rule {rule:?} carried {service} requests ({n} seen): narrow it with service = {service:?}"
        );
        match *service {
            "git" => {
                let list: Vec<String> = repos.iter().take(20).map(|r| format!("{r:?}")).collect();
                line.push_str(&format!(", repos = [{}]", list.join(", ")));
                if pushed {
                    line.push_str(", push_refs = [the refs the agent may push]");
                }
            }
            "graphql" => line.push_str(", graphql_mutations = [the mutations it may run]"),
            "llm-api" => line.push_str(", models = [the models it may call]"),
            _ => {}
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Draft the org's rules and check them: the config with them inserted
/// must pass `check`, and its replay is in [`Draft::replays`]. An error
/// says why no draft could be made (an org the config lacks, or a bug).
pub(crate) fn draft(input: Input<'_>) -> Result<Draft, String> {
    let Input {
        config,
        config_path,
        config_text,
        org,
        host,
        records,
        grants,
        window,
        min_count,
        wildcard_min,
    } = input;
    let name = config_path.display();
    let Some(org_cfg) = config.orgs.iter().find(|o| o.name == org) else {
        return Err(format!("{name}: no org {org:?} in the config"));
    };
    let deny_targets: Vec<RuleTarget> = org_cfg.deny.iter().map(|d| d.target.clone()).collect();
    // Compiled as `check` compiles it where Palisade runs: this host's
    // addresses are always denied too (and never proposed).
    let policy = Policy::with_host(config, host);
    let busiest = peaks(&records, org);
    let service = service_notes(&records, org_cfg, window);
    let reviewed = from_grants(&grants, &records, org, window);
    let (flows, later) = gather(records, org, window);
    let mut counts = Counts {
        decisions: flows.len() as u64,
        ..Counts::default()
    };
    let mut seen = seen_targets(&flows, &later, &policy, org);
    for (target, (s, _)) in &mut seen {
        s.peak = busiest.get(target).copied().unwrap_or_default();
    }
    let proposals = plan(&seen, &deny_targets, min_count, wildcard_min, &mut counts);
    let (tables, mut notes) = tables(&proposals);
    notes.push_str(&service);
    let candidate_text = inserted(config_text, org, &tables, &notes, &reviewed)
        .map_err(|e| format!("{name}: {e}"))?;
    // Self-check: `check`, then a replay of the same evidence.
    let candidate = crate::config::from_str(&candidate_text, config_path).map_err(|e| {
        format!("the drafted config does not pass check (a bug; nothing written):\n{e}")
    })?;
    let drafted = Policy::with_host(&candidate, host);
    let (covered, kept_denied) = replay_flows(&flows, &proposals, &drafted);
    Ok(Draft {
        fragment: fragment(&tables, &notes, &reviewed),
        from_grants: reviewed.matches(GRANT_HEAD).count(),
        config_text: candidate_text,
        rules: tables.len(),
        comments: notes.lines().count(),
        proposals,
        counts,
        covered,
        kept_denied,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(ports: &[u16], n: u64) -> Seen {
        Seen {
            ports: ports.iter().copied().collect(),
            denied: n,
            first: "2026-01-02T03:04:05Z".into(),
            last: "2026-01-02T03:04:06Z".into(),
            refs: vec!["r1".into()],
            carries: HashSet::from([Carry::Tls]),
            ..Seen::default()
        }
    }

    fn run_plan(
        names: &[(&str, u64, Current)],
        denies: &[RuleTarget],
        min: u64,
        wmin: usize,
    ) -> (Vec<Proposal>, Counts) {
        let m: BTreeMap<String, (Seen, Current)> = names
            .iter()
            .map(|(n, c, cur)| (n.to_string(), (seen(&[443], *c), cur.clone())))
            .collect();
        let mut counts = Counts::default();
        (plan(&m, denies, min, wmin, &mut counts), counts)
    }

    fn hosts(p: &[Proposal]) -> Vec<String> {
        p.iter()
            .filter_map(|p| match p {
                Proposal::Host { host, .. } => Some(host.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn public_suffixes_and_suffixes_below_a_name_are_known() {
        // (name, is a public suffix, has public suffixes below it): below
        // amazonaws.com lie s3.amazonaws.com and *.compute.amazonaws.com,
        // below appspot.com *.r.appspot.com, below ck *.ck; an unlisted
        // top-level name is a suffix by the list's default rule.
        for (name, is, below) in [
            ("com", true, true),
            ("uk", true, true),
            ("ck", true, true),
            ("co.uk", true, true),
            ("github.io", true, false),
            ("test", true, false),
            ("amazonaws.com", false, true),
            ("compute.amazonaws.com", false, true),
            ("appspot.com", true, true),
            ("herokuapp.com", true, true),
            ("example.com", false, false),
            ("example.co.uk", false, false),
            ("alice.github.io", false, false),
            ("wild.test", false, false),
            ("corp.example.com", false, false),
            ("a.b.c.example.net", false, false),
        ] {
            assert_eq!(
                (is_public_suffix(name), has_suffix_below(name)),
                (is, below),
                "{name}"
            );
        }
    }

    #[test]
    fn a_wildcard_needs_enough_names_under_one_parent() {
        let o = Current::Open;
        let (p, _) = run_plan(
            &[
                ("a.example.com", 1, o.clone()),
                ("b.example.com", 1, o.clone()),
                ("c.example.com", 1, o.clone()),
                ("api.other.com", 1, o.clone()),
            ],
            &[],
            1,
            3,
        );
        assert_eq!(hosts(&p), ["*.example.com", "api.other.com"]);
        match &p[0] {
            Proposal::Host { covers, .. } => {
                assert_eq!(covers, &["a.example.com", "b.example.com", "c.example.com"])
            }
            other => panic!("{other:?}"),
        }
        // Two names are not enough at the default; they are at 2.
        let two = [
            ("a.example.com", 1, o.clone()),
            ("b.example.com", 1, o.clone()),
        ];
        assert_eq!(
            hosts(&run_plan(&two, &[], 1, 3).0),
            ["a.example.com", "b.example.com"]
        );
        assert_eq!(hosts(&run_plan(&two, &[], 1, 2).0), ["*.example.com"]);
    }

    #[test]
    fn never_a_wildcard_over_a_public_suffix() {
        let o = Current::Open;
        for parent in ["github.io", "co.uk", "com"] {
            let names: Vec<(String, u64, Current)> = ["a", "b", "c", "d"]
                .iter()
                .map(|l| (format!("{l}.{parent}"), 1, o.clone()))
                .collect();
            let names: Vec<(&str, u64, Current)> = names
                .iter()
                .map(|(n, c, x)| (n.as_str(), *c, x.clone()))
                .collect();
            let h = hosts(&run_plan(&names, &[], 1, 3).0);
            assert_eq!(h.len(), 4, "{parent}: {h:?}");
            assert!(h.iter().all(|h| !h.starts_with('*')), "{parent}: {h:?}");
        }
    }

    #[test]
    fn never_a_wildcard_over_a_denied_name_and_denied_names_are_comments() {
        let o = Current::Open;
        let names = [
            ("a.wild.test", 1, o.clone()),
            ("b.wild.test", 1, o.clone()),
            ("c.wild.test", 1, o.clone()),
            (
                "blocked.wild.test",
                2,
                Current::Denied("acme/deny/0".into()),
            ),
        ];
        for deny in [
            RuleTarget::Exact("blocked.wild.test".into()),
            RuleTarget::Below("x.wild.test".into()),
            RuleTarget::Below("test".into()),
        ] {
            let (p, _) = run_plan(&names, std::slice::from_ref(&deny), 1, 3);
            assert_eq!(
                hosts(&p),
                ["a.wild.test", "b.wild.test", "c.wild.test"],
                "{deny:?}"
            );
            assert!(p.iter().any(|x| matches!(x, Proposal::Comment(c) if c.contains("blocked.wild.test") && c.contains("denied explicitly by rule acme/deny/0"))), "{p:?}");
        }
        // A deny elsewhere does not stop it.
        let (p, _) = run_plan(&names, &[RuleTarget::Exact("x.other.test".into())], 1, 3);
        assert_eq!(hosts(&p), ["*.wild.test"]);
    }

    #[test]
    fn the_minimum_count_and_what_is_allowed_already_leave_names_out() {
        let (p, counts) = run_plan(
            &[
                ("rare.test", 1, Current::Open),
                ("often.test", 5, Current::Open),
                ("ok.test", 9, Current::Allowed),
            ],
            &[],
            2,
            3,
        );
        assert_eq!(hosts(&p), ["often.test"]);
        assert_eq!((counts.below_min, counts.already_allowed), (1, 1));
    }

    #[test]
    fn ip_literals_are_single_address_cidrs_or_comments_when_always_denied() {
        let (p, _) = run_plan(
            &[
                ("198.18.2.30", 1, Current::Open),
                (
                    "169.254.169.254",
                    3,
                    Current::Closed("link-local incl. cloud metadata: 169.254.0.0/16".into()),
                ),
            ],
            &[],
            1,
            3,
        );
        assert!(p
            .iter()
            .any(|x| matches!(x, Proposal::Cidr { ip, .. } if ip.to_string() == "198.18.2.30")));
        assert!(p.iter().any(|x| matches!(x, Proposal::Comment(c) if c.contains("169.254.169.254") && c.contains("always denied (link-local incl. cloud metadata: 169.254.0.0/16); not proposed"))));
        let (tables, notes) = tables(&p);
        let text = fragment(&tables, &notes, "");
        assert!(text.contains("cidr = \"198.18.2.30/32\""), "{text}");
        assert!(text.contains("# WARNING: an IP literal"), "{text}");
        assert!(!text.contains("[[org]]"), "{text}");
        assert!(text.contains("[[org.allow]]"), "{text}");
    }

    #[test]
    fn never_a_wildcard_over_a_parent_with_public_suffixes_below_it() {
        let o = Current::Open;
        // Three names right under amazonaws.com: none of them a public
        // suffix, yet *.amazonaws.com would cover s3.amazonaws.com's
        // buckets (other tenants').
        let names = [
            ("a.amazonaws.com", 1, o.clone()),
            ("b.amazonaws.com", 1, o.clone()),
            ("c.amazonaws.com", 1, o.clone()),
            ("n1.build.test", 1, o.clone()),
            ("n2.build.test", 1, o.clone()),
            ("n3.build.test", 1, o.clone()),
        ];
        let (p, _) = run_plan(&names, &[], 1, 3);
        assert_eq!(
            hosts(&p),
            [
                "*.build.test",
                "a.amazonaws.com",
                "b.amazonaws.com",
                "c.amazonaws.com"
            ]
        );
        assert!(p.iter().any(|x| matches!(x, Proposal::Comment(c) if c.starts_with("# *.amazonaws.com over 3 names seen: the Public Suffix List has public suffixes below amazonaws.com"))), "{p:?}");
    }

    #[test]
    fn an_always_denied_or_recorded_denied_address_is_never_proposed() {
        let mut m: BTreeMap<String, (Seen, Current)> = BTreeMap::new();
        let closed = |what: &str| Current::Closed(what.to_string());
        m.insert(
            "198.18.4.2".into(),
            (seen(&[80], 2), closed("clients of beta: 198.18.4.0/24")),
        );
        m.insert(
            "198.18.1.1".into(),
            (seen(&[80], 1), closed("gateway address: 198.18.1.1/32")),
        );
        let mut recorded = seen(&[8080], 1);
        recorded.denied_address = 1;
        m.insert("198.18.2.1".into(), (recorded, Current::Open));
        m.insert("198.18.2.20".into(), (seen(&[80], 1), Current::Open));
        m.insert("198.18.2.30".into(), (seen(&[80], 1), Current::Allowed));
        m.insert(
            "198.18.2.40".into(),
            (seen(&[80], 1), Current::Denied("acme/deny/1".into())),
        );
        let mut counts = Counts::default();
        let p = plan(&m, &[], 1, 3, &mut counts);
        let cidrs: Vec<String> = p
            .iter()
            .filter_map(|x| match x {
                Proposal::Cidr { ip, .. } => Some(ip.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(cidrs, ["198.18.2.20"]);
        assert_eq!(counts.already_allowed, 1);
        let notes: Vec<&str> = p
            .iter()
            .filter_map(|x| match x {
                Proposal::Comment(c) => Some(c.as_str()),
                _ => None,
            })
            .collect();
        for want in [
            "# 198.18.4.2 (ports 80) seen 2 times: always denied (clients of beta: 198.18.4.0/24); not proposed\n",
            "# 198.18.1.1 (ports 80) seen 1 times: always denied (gateway address: 198.18.1.1/32); not proposed\n",
            "# 198.18.2.1 (ports 8080) seen 1 times: recorded denied_address",
            "# 198.18.2.40 (ports 80) seen 1 times: denied explicitly by rule acme/deny/1; not proposed\n",
        ] {
            assert!(notes.iter().any(|n| n.starts_with(want)), "{want:?} in {notes:?}");
        }
    }

    /// The busiest hour of each host: closes an hour or more apart never
    /// add up; another org's never count.
    #[test]
    fn the_busiest_hour_of_each_host_is_what_a_budget_is_suggested_from() {
        let close = |org: &str, host: &str, ts: &str, up: u64, down: u64| -> Record {
            serde_json::from_value(serde_json::json!({
                "id": "1", "ts": ts, "kind": "tcp", "event": "close",
                "org": org, "client": "198.18.1.2:4000", "mode": "explicit",
                "host": host, "port": 443, "sni": null, "ip": null, "decision": "allow",
                "reason": "rule_match", "rule": null, "policy": "p",
                "bytes_up": up, "bytes_down": down,
            }))
            .unwrap()
        };
        let records = [
            close("acme", "gh.test", "2026-01-02T03:00:00Z", 100, 1),
            close("acme", "gh.test", "2026-01-02T03:30:00Z", 200, 2),
            close("acme", "gh.test", "2026-01-02T04:10:00Z", 250, 4),
            close("acme", "gh.test", "2026-01-02T05:20:00Z", 300, 8),
            close("beta", "gh.test", "2026-01-02T03:31:00Z", 10_000, 0),
        ];
        let p = peaks(&records, "acme");
        assert_eq!(p["gh.test"], (450, 8));
        assert_eq!(suggested(450), "\"1MiB\"");
        assert_eq!(suggested(3 << 20), "\"6MiB\"");
    }

    /// A report-mode CONNECT record of acme's to `host:port`.
    fn record(host: &str, port: u16, tunnel: &str, reason: &str, detail: &str) -> Record {
        serde_json::from_value(serde_json::json!({
            "id": "1", "ts": "2026-01-02T03:04:05Z", "kind": "tcp", "event": "decision",
            "org": "acme", "client": "198.18.1.2:4000", "mode": "explicit",
            "host": host, "port": port, "sni": null, "ip": null, "decision": "allow",
            "reason": reason, "rule": null, "policy": "p",
            "would_deny": if reason == "report_only" { Some("no_matching_rule") } else { None },
            "tunnel": tunnel, "detail": detail,
        }))
        .unwrap()
    }

    /// A grant record of `event` for grant `id` on `host:port` (`uses` so far).
    fn grant_rec(id: &str, event: Event, host: &str, port: Option<u16>, uses: u32) -> Record {
        let mut r = record(host, port.unwrap_or(0), "tls", "rule_match", "");
        (r.kind, r.event, r.port, r.client) = (Kind::Grant, event, port, None);
        r.rule = Some(format!("grant:{id}").into());
        r.grant = Some(Box::new(crate::evidence::GrantFacts {
            id: id.into(),
            target: host.into(),
            granted_at: "2026-01-02T03:00:00Z".into(),
            expires: Some("2026-01-02T04:00:00Z".into()),
            max_uses: None,
            uses,
            approver: "alice".into(),
            method: (host == "other.test").then(|| "GET".into()),
            path: (host == "other.test").then(|| "/api/".into()),
            reason: Some("the build needs\nit".into()),
            approval: None,
            ended_by: None,
        }));
        r
    }

    #[test]
    fn grants_are_proposed_as_commented_rules_never_silently() {
        let mut used = record("other.test", 80, "http", "rule_match", "");
        used.rule = Some("grant:g-1".into());
        let grants = vec![
            grant_rec("g-1", Event::Granted, "other.test", Some(80), 0),
            grant_rec("g-1", Event::Expired, "other.test", Some(80), 1),
            grant_rec("g-2", Event::Granted, "198.18.7.0/24", Some(443), 0),
            grant_rec("g-3", Event::Granted, "dns.test", None, 0),
        ];
        let all = Selection::default();
        let text = from_grants(&grants, &[used.clone(), used.clone()], "acme", &all);
        assert_eq!(text.matches(GRANT_HEAD).count(), 3, "{text}");
        assert!(
            text.contains("# from grant g-1 (approver alice, reason \"the build needs?it\", 2 uses, granted 2026-01-02T03:00:00Z, expired): review"),
            "{text}"
        );
        assert!(
            text.contains(
                "# host = \"other.test\"\n# ports = [80]\n# intercept = true\n# methods = [\"GET\"]\n# paths = [\"/api/\"]\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("# cidr = \"198.18.7.0/24\"\n# ports = [443]\n"),
            "{text}"
        );
        assert!(
            text.contains("# host = \"dns.test\"\n# ports = [] (granted from a DNS answer"),
            "{text}"
        );
        // Every proposal is a comment: nothing of it is policy.
        assert!(
            text.lines().all(|l| l.is_empty() || l.starts_with('#')),
            "{text}"
        );
        assert!(from_grants(&grants, &[], "beta", &all).is_empty());
        // The flows a grant allowed are not drafted from.
        let (flows, _) = gather(vec![used], "acme", &all);
        assert!(flows.is_empty());
    }

    #[test]
    fn a_tunnel_let_on_unverified_never_makes_an_opaque_rule() {
        // Plain bytes on 443 in report mode: recorded opaque, with the
        // violation's detail (a newline in it must not start a TOML line).
        let mut s = Seen::default();
        s.add(&record(
            "shell.test",
            443,
            "opaque",
            "report_only",
            "not TLS\n[[org.allow]]",
        ));
        s.add(&record("shell.test", 443, "tls", "report_only", ""));
        assert_eq!((s.carry(), s.unverified), (Carry::Tls, 1));
        let mut only = Seen::default();
        only.add(&record("ssh.test", 443, "opaque", "report_only", "SSH"));
        assert_eq!((only.carry(), only.unverified), (Carry::Tls, 1));
        let mut both = Seen::default();
        both.add(&record("mixed.test", 80, "opaque", "report_only", ""));
        both.add(&record("mixed.test", 443, "opaque", "report_only", ""));
        assert_eq!(both.carry(), Carry::TlsOrHttp);
        // An IP literal's tunnels are opaque by nature (cidr rules): no violation.
        let mut ip = Seen::default();
        ip.add(&record("198.18.2.20", 443, "opaque", "report_only", ""));
        assert_eq!(ip.unverified, 0);

        let p = vec![Proposal::Host {
            host: "shell.test".into(),
            covers: Vec::new(),
            seen: s,
        }];
        let (t, notes) = tables(&p);
        let text = fragment(&t, &notes, "");
        assert!(text.contains("tunnel = \"tls\""), "{text}");
        assert!(!text.contains("opaque\"\n"), "{text}");
        assert!(
            text.contains("# VIOLATION: 1 tunnel(s) failed verification (not TLS?[[org.allow]]); proposed verified as tunnel = \"tls\", not \"opaque\"; review\n"),
            "{text}"
        );
        let doc: DocumentMut = text.parse().unwrap();
        assert_eq!(
            doc["org"]["allow"].as_array_of_tables().unwrap().len(),
            1,
            "{text}"
        );
    }

    #[test]
    fn written_rules_land_under_the_org_with_comments_kept() {
        let original = "# my config\n[[org]]\nname = \"beta\"\nclients = [\"198.19.2.0/24\"]\n\n[[org]]\nname = \"acme\" # the agents\nclients = [\"198.19.1.0/24\"]\n\n[[org.allow]]\nhost = \"allowed.test\"\n\n[[org]]\nname = \"gamma\"\nclients = [\"198.19.3.0/24\"]\n";
        let (p, _) = run_plan(&[("new.test", 1, Current::Open)], &[], 1, 3);
        let (t, notes) = tables(&p);
        let text = inserted(original, "acme", &t, &notes, "").unwrap();
        assert!(
            text.contains("# my config") && text.contains("# the agents"),
            "{text}"
        );
        let c = crate::config::from_str(&text, Path::new("t.toml"))
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        let acme = c.orgs.iter().find(|o| o.name == "acme").unwrap();
        assert_eq!(acme.allow.len(), 2, "{text}");
        assert_eq!(acme.allow[1].target, RuleTarget::Exact("new.test".into()));
        assert!(
            c.orgs
                .iter()
                .filter(|o| o.name != "acme")
                .all(|o| o.allow.is_empty()),
            "{text}"
        );
        assert!(inserted(original, "nosuch", &t, &notes, "").is_err());
    }

    /// Intercepting rules without service rules whose requests show a
    /// service: a proposal to narrow them, as comments.
    #[test]
    fn service_rules_are_proposed_where_the_evidence_shows_them() {
        let config = crate::config::from_str(
            "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n\
             [[org.allow]]\nid = \"forge\"\nhost = \"git.test\"\nintercept = true\n\
             [[org.allow]]\nid = \"llm\"\nhost = \"llm.test\"\nintercept = true\n\
             [[org.allow]]\nid = \"done\"\nhost = \"reg.test\"\nintercept = true\nservice = \"registry\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        let http = |rule: &str, method: &str, path: &str| -> Record {
            serde_json::from_value(serde_json::json!({
                "id": "1", "ts": "2026-01-02T03:04:05Z", "kind": "http", "event": "decision",
                "org": "acme", "client": "198.18.1.2:4000", "mode": "explicit",
                "host": "h", "port": 443, "sni": null, "ip": null, "decision": "allow",
                "reason": "rule_match", "rule": rule, "policy": "p",
                "method": method, "path": path,
            }))
            .unwrap()
        };
        let records = [
            http("forge", "GET", "/acme/app.git/info/refs"),
            http("forge", "POST", "/acme/app.git/git-upload-pack"),
            http("forge", "POST", "/acme/tools/git-receive-pack"),
            http("llm", "POST", "/v1/messages"),
            http("done", "GET", "/simple/x/"),
        ];
        let notes = service_notes(&records, &config.orgs[0], &Selection::default());
        assert_eq!(
            notes,
            "# rule \"forge\" carried git requests (3 seen): narrow it with service = \"git\", \
             repos = [\"acme/app\", \"acme/tools\"], push_refs = [the refs the agent may push]\n\
             # rule \"llm\" carried llm-api requests (1 seen): narrow it with service = \"llm-api\", \
             models = [the models it may call]\n"
        );
    }
}
