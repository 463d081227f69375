//! Compiling a validated config into a [`Policy`]: the orgs, their rule
//! tables, the baseline, the always-denied table, and the canonical
//! address forms every lookup is keyed by.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::{IpNet, Ipv4Net};
use sha2::{Digest, Sha256};

use crate::config::{Config, Identity, OrgConfig, PortSet, TokenDigest, Window, ALWAYS_DENIED};
use crate::proto::target::embedded_ipv4s;

use super::rule::{compile_rules, Rule};
use super::table::{NameTable, PrefixTable};
use super::verdict::{Layer, OrgRef, Verdict};

#[derive(Debug)]
pub(super) struct Org {
    pub(super) r#ref: OrgRef,
    pub(super) report: bool,
    /// `on_miss = "ask"`: a miss becomes an approval (`crate::jit`).
    pub(super) ask: bool,
    pub(super) identity: Identity,
    pub(super) tokens: Vec<TokenDigest>,
    /// The org's own networks (checked for `address+token`).
    pub(super) networks: Vec<IpNet>,
    pub(super) allow: Vec<Rule>,
    pub(super) deny: Vec<Rule>,
    /// Allow rules by id (ids are unique within a config), looked up a few
    /// times per allowed connection.
    pub(super) allow_ids: HashMap<Arc<str>, usize, RuleIds>,
    pub(super) allow_names: NameTable,
    pub(super) deny_names: NameTable,
    pub(super) allow_cidrs: PrefixTable<Vec<usize>>,
    pub(super) deny_cidrs: PrefixTable<Vec<usize>>,
    /// The org's volume budget over all its rules.
    pub(super) volume: Option<crate::config::Volume>,
}

/// The hasher of [`Org::allow_ids`]: FNV-1a. Rule ids come from the
/// config and are looked up from the policy's own verdicts, never from
/// what a client sent, so the keyed hash a table of chosen keys needs
/// (std's SipHash, against flooding) buys nothing there; this costs a few
/// instructions per byte of the id.
pub(super) type RuleIds = std::hash::BuildHasherDefault<Fnv>;

/// FNV-1a, 64 bits.
#[derive(Debug)]
pub(super) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A compiled policy.
#[derive(Debug)]
pub struct Policy {
    pub(super) orgs: Vec<Org>,
    /// Networks of orgs identified by address alone.
    pub(super) clients: PrefixTable<Option<usize>>,
    pub(super) by_name: HashMap<Arc<str>, usize>,
    pub(super) own: Vec<SocketAddr>,
    /// The host's interface addresses it was compiled with (canonical,
    /// sorted, unique).
    host: Vec<IpAddr>,
    /// Always-denied ranges with what each one is (see [`ALWAYS_DENIED`]),
    /// plus every org's `clients`, Palisade's own listen addresses and the
    /// host's addresses.
    pub(super) always_denied: PrefixTable<Vec<Arc<str>>>,
    hash: Arc<str>,
    rule_count: usize,
    /// The baseline's `[[deny]]` entries, decided before any org rule.
    pub(super) baseline: Option<BaselineRules>,
    /// The instant this policy decides at ([`Policy::at`]): time-bound
    /// rules match only inside their interval at it, never while it is
    /// unknown.
    pub(super) at: Option<SystemTime>,
}

/// The baseline's denials, compiled like an org's deny rules.
#[derive(Debug)]
pub(super) struct BaselineRules {
    /// SHA-256 (hex) of the baseline file.
    hash: Arc<str>,
    pub(super) deny: Vec<Rule>,
    ids: std::collections::HashSet<Arc<str>>,
    pub(super) names: NameTable,
    pub(super) cidrs: PrefixTable<Vec<usize>>,
}

impl BaselineRules {
    fn compile(baseline: &crate::config::Baseline) -> BaselineRules {
        let mut b = BaselineRules {
            hash: Arc::from(baseline.hash.as_str()),
            deny: Vec::new(),
            ids: Default::default(),
            names: NameTable::default(),
            cidrs: PrefixTable::default(),
        };
        compile_rules(&baseline.deny, &mut b.deny, &mut b.names, &mut b.cidrs);
        b.ids = b.deny.iter().map(|r| r.id.clone()).collect();
        b
    }
}

/// A cidr allow rule that opens (part of) an always-denied range: what
/// `palisade check` lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub org: Arc<str>,
    pub rule: Arc<str>,
    /// The rule's network: the part of `range` that is opened.
    pub net: IpNet,
    /// The always-denied range the rule lies inside.
    pub range: IpNet,
    /// What the range is ("private", "clients of acme", ...).
    pub what: Vec<Arc<str>>,
    pub ports: PortSet,
}

/// What the always-denied table calls a synthetic pool (`[dns] synthetic_pool`).
pub const SYNTHETIC_POOL: &str = "synthetic pool";

/// What `closed_ranges` calls an address of the host Palisade runs on.
pub const GATEWAY_ADDRESS: &str = "gateway address";

/// The always-denied table: the fixed ranges, every org's `clients` (no
/// hairpin into a sandbox network), the address of every listener bound
/// to a specific address (on every port; an unspecified listen address is
/// only its port, row A) and every address of the host's interfaces
/// (`host`, loopback aside: it is a fixed range already, which a rule
/// inside `127.0.0.0/8` or `::1` opens as before).
fn closed_ranges(
    orgs: &[OrgConfig],
    own: &[SocketAddr],
    host: &[IpAddr],
) -> PrefixTable<Vec<Arc<str>>> {
    let mut table: PrefixTable<Vec<Arc<str>>> = PrefixTable::default();
    let mut add = |net: IpNet, what: Arc<str>| {
        let entry = table.entry(net);
        if !entry.contains(&what) {
            entry.push(what);
        }
    };
    for (net, what) in ALWAYS_DENIED {
        if let Ok(net) = net.parse::<IpNet>() {
            add(net, Arc::from(*what));
        }
    }
    for org in orgs {
        let what: Arc<str> = Arc::from(format!("clients of {}", org.name));
        for net in &org.clients {
            add(canonical_net(*net), what.clone());
        }
    }
    let listener: Arc<str> = Arc::from("Palisade listener");
    for addr in own.iter().map(|a| canonical(a.ip())) {
        if !addr.is_unspecified() {
            add(IpNet::from(addr), listener.clone());
        }
    }
    let gateway: Arc<str> = Arc::from(GATEWAY_ADDRESS);
    for addr in host.iter().map(|a| canonical(*a)) {
        if !addr.is_unspecified() && !addr.is_loopback() {
            add(IpNet::from(addr), gateway.clone());
        }
    }
    table
}

/// An IPv4-mapped network (`::ffff:a.b.c.d/104+`) is the IPv4 network.
fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(n) if n.prefix_len() >= 96 => match n.network().to_ipv4_mapped() {
            Some(v4) => Ipv4Net::new(v4, n.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        _ => net,
    }
}

impl Policy {
    /// Compile a validated config, knowing no host addresses: for
    /// decisions made away from the gateway (`palisade replay`, probe
    /// plans, tests). What serves traffic uses [`Policy::with_host`].
    pub fn new(config: &Config) -> Policy {
        Policy::with_host(config, &[])
    }

    /// Compile a validated config for the host whose interface addresses
    /// are `host` (each always-denied, row C; see `crate::host`).
    pub fn with_host(config: &Config, host: &[IpAddr]) -> Policy {
        let mut policy = Policy::compile(&config.orgs, config.own_addresses(), host);
        policy.baseline = config.policy.baseline.as_ref().map(BaselineRules::compile);
        // The synthetic pools are never dialled: always-denied, and no
        // cidr rule may overlap them (config validation).
        let pool: Arc<str> = Arc::from(SYNTHETIC_POOL);
        let pools = [
            config.dns.synthetic_pool.map(IpNet::V4),
            config.dns.synthetic_pool_v6.map(IpNet::V6),
        ];
        for net in pools.into_iter().flatten() {
            let entry = policy.always_denied.entry(net.trunc());
            if !entry.contains(&pool) {
                entry.push(pool.clone());
            }
        }
        policy
    }

    /// Compile orgs; `own` are Palisade's own listen addresses, `host` the
    /// addresses of the host's interfaces.
    pub fn compile(orgs: &[OrgConfig], own: Vec<SocketAddr>, host: &[IpAddr]) -> Policy {
        let mut clients: PrefixTable<Option<usize>> = PrefixTable::default();
        let mut compiled = Vec::with_capacity(orgs.len());
        let mut rule_count = 0;
        let mut by_name = HashMap::new();
        for (index, org) in orgs.iter().enumerate() {
            if org.identity == Identity::Address {
                for net in &org.clients {
                    *clients.entry(*net) = Some(index);
                }
            }
            let name: Arc<str> = Arc::from(org.name.as_str());
            by_name.insert(name.clone(), index);
            let mut o = Org {
                r#ref: OrgRef { index, name },
                report: org.mode == crate::config::OrgMode::Report,
                ask: org.on_miss == crate::config::OnMiss::Ask,
                identity: org.identity,
                tokens: org.tokens.clone(),
                networks: org.clients.iter().map(|n| n.trunc()).collect(),
                allow: Vec::new(),
                deny: Vec::new(),
                allow_ids: HashMap::default(),
                allow_names: NameTable::default(),
                deny_names: NameTable::default(),
                allow_cidrs: PrefixTable::default(),
                deny_cidrs: PrefixTable::default(),
                volume: org.volume,
            };
            compile_rules(
                &org.allow,
                &mut o.allow,
                &mut o.allow_names,
                &mut o.allow_cidrs,
            );
            compile_rules(&org.deny, &mut o.deny, &mut o.deny_names, &mut o.deny_cidrs);
            o.allow_ids = o
                .allow
                .iter()
                .enumerate()
                .map(|(i, r)| (r.id.clone(), i))
                .collect();
            rule_count += org.allow.len() + org.deny.len();
            compiled.push(o);
        }
        let always_denied = closed_ranges(orgs, &own, host);
        let mut host: Vec<IpAddr> = host.iter().map(|a| canonical(*a)).collect();
        host.sort_unstable();
        host.dedup();
        let canonical = Policy::canonical_text(orgs);
        let hash = Arc::from(data_encoding::HEXLOWER.encode(&Sha256::digest(canonical.as_bytes())));
        Policy {
            orgs: compiled,
            clients,
            by_name,
            own,
            host,
            always_denied,
            hash,
            rule_count,
            baseline: None,
            at: None,
        }
    }

    /// This policy deciding at `now`: what serves traffic is compiled with
    /// the instant it serves from, and served again at each
    /// [`Policy::next_change`] (`crate::reload`). The clock is read by the
    /// caller, never here.
    pub fn at(mut self, now: SystemTime) -> Policy {
        self.at = Some(now);
        self
    }

    /// The instant this policy decides at, if it was given one.
    pub fn instant(&self) -> Option<SystemTime> {
        self.at
    }

    /// The next instant after [`Policy::instant`] at which a time-bound
    /// rule starts or stops matching (`None`: none ever will, or the
    /// instant is unknown).
    pub fn next_change(&self) -> Option<SystemTime> {
        let now = self.at?;
        self.windows()
            .filter_map(|(_, _, w)| w.next_change(now))
            .min()
    }

    /// Every time-bound allow rule: its org, its id and its interval, in
    /// file order.
    pub fn windows(&self) -> impl Iterator<Item = (&Arc<str>, &Arc<str>, Window)> {
        self.orgs.iter().flat_map(|o| {
            o.allow
                .iter()
                .filter_map(move |r| Some((&o.r#ref.name, &r.id, r.window?)))
        })
    }

    /// The interval of allow rule `rule` of `org`, if it has one.
    pub fn window_of(&self, org: &OrgRef, rule: &str) -> Option<Window> {
        let o = self.orgs.get(org.index)?;
        o.allow_ids.get(rule).and_then(|&i| o.allow.get(i)?.window)
    }

    /// SHA-256 (hex) of the canonical JSON form of the orgs and their rules.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The hash, shared into every record this policy decides.
    pub fn hash_arc(&self) -> &Arc<str> {
        &self.hash
    }

    /// SHA-256 (hex) of the baseline file, if there is one: what every
    /// record carries as `baseline`.
    pub fn baseline_hash(&self) -> Option<&Arc<str>> {
        self.baseline.as_ref().map(|b| &b.hash)
    }

    /// The layer of the rule that decided `verdict`, if a rule did.
    pub fn layer_of(&self, verdict: &Verdict) -> Option<Layer> {
        let rule = verdict.rule.as_ref()?;
        if rule.starts_with(crate::config::GRANT_RULE_PREFIX) {
            return Some(Layer::Grant);
        }
        let baseline = self.baseline.as_ref().is_some_and(|b| b.ids.contains(rule));
        Some(if baseline {
            Layer::Baseline
        } else {
            Layer::Org
        })
    }

    /// The canonical JSON text the hash is taken over: stored beside the
    /// evidence so any record can be re-explained later.
    pub fn canonical_text(orgs: &[OrgConfig]) -> String {
        serde_json::to_string(orgs).unwrap_or_default()
    }

    /// The host addresses this policy was compiled with (canonical,
    /// sorted, unique; loopback among them but left to its fixed range): a
    /// reload compares them with a fresh enumeration.
    pub fn host_addresses(&self) -> &[IpAddr] {
        &self.host
    }

    pub fn org_count(&self) -> usize {
        self.orgs.len()
    }

    pub fn rule_count(&self) -> usize {
        self.rule_count
    }

    /// The index of org `name` (its place in the config), if there is one.
    pub fn org_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Org `name`, if the policy has it.
    pub fn org_named(&self, name: &str) -> Option<OrgRef> {
        let i = self.org_index(name)?;
        self.orgs.get(i).map(|o| o.r#ref.clone())
    }
}

/// The IPv4 addresses an IPv6 address reaches (prefix forms and ISATAP,
/// [`embedded_ipv4s`]); none for IPv4.
pub(super) fn embedded(ip: IpAddr) -> impl Iterator<Item = IpAddr> + Clone {
    let v6 = match ip {
        IpAddr::V6(v6) => Some(v6),
        IpAddr::V4(_) => None,
    };
    v6.into_iter()
        .flat_map(|v6| embedded_ipv4s(&v6).map(IpAddr::V4))
}

/// IPv4-mapped IPv6 is the IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use std::hash::Hasher;

    use super::Fnv;

    #[test]
    fn rule_ids_hash_with_fnv_1a() {
        let hash = |bytes: &[u8]| {
            let mut h = Fnv::default();
            h.write(bytes);
            h.finish()
        };
        // The published FNV-1a 64-bit test vectors.
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
