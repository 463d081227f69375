//! `palisade check`: validate the config and print a summary.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use super::{load_config, CliError, Status, DEFAULT_CONFIG};
use crate::config::PortSet;
use crate::policy::{Opening, Policy};

/// Arguments of `palisade check`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(short, long, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
}

/// 1 on an invalid config, each error as `FILE:LINE:COL: message`, or
/// when this host's addresses cannot be listed (`run` would not start).
/// Check runs where Palisade runs: the openings it lists include those of
/// this host's own addresses, always denied like the fixed ranges.
pub fn run(args: Args) -> Result<(), CliError> {
    let path = args.config;
    let config = load_config(&path, Status::Failed)?;
    // The enforcement ruleset must load (checked in a scratch network
    // namespace; the kernel's own ruleset is `run`'s to compare).
    if let Some(e) = &config.enforcement {
        crate::enforcement::defined(e)
            .map_err(|e| CliError::bare(Status::Failed, crate::config::ConfigErrors(vec![e])))?;
    }
    let host = crate::host::addresses().map_err(|e| CliError::new(Status::Failed, e))?;
    let policy = Policy::with_host(&config, &host).at(std::time::SystemTime::now());
    let openings = policy.openings();
    let rules: usize = config
        .orgs
        .iter()
        .map(|o| o.allow.len() + o.deny.len())
        .sum();
    sayln!("{}: ok", path.display());
    if let Some(b) = &config.policy.baseline {
        let ceiling = if b.ceiling.is_empty() {
            "no ceiling".to_string()
        } else {
            format!(
                "{} ceiling entries, every allow rule inside",
                b.ceiling.len()
            )
        };
        sayln!(
            "  baseline: {} (sha256 {}): {} deny, {ceiling}",
            b.path.display(),
            b.hash,
            b.deny.len()
        );
    }
    sayln!("  orgs: {} ({} rules)", config.orgs.len(), rules);
    for org in &config.orgs {
        let clients: Vec<String> = org.clients.iter().map(|c| c.to_string()).collect();
        sayln!(
            "    {}: clients {}; {} allow, {} deny",
            org.name,
            clients.join(", "),
            org.allow.len(),
            org.deny.len()
        );
        if org.identity.needs_token() {
            sayln!(
                "      identity {}; {} token(s)",
                org.identity.as_str(),
                org.tokens.len()
            );
        }
        for opening in openings.iter().filter(|o| *o.org == *org.name) {
            sayln!("      {}", describe_opening(opening));
        }
    }
    sayln!("  proxy listen: {}", list(&config.proxy.listen));
    sayln!("  transparent: {}", list(&config.proxy.transparent));
    sayln!("  socks5: {}", list(&config.proxy.socks5));
    sayln!(
        "  dns listen: {}; upstream: {}",
        list(&config.dns.listen),
        list(&config.dns.upstream)
    );
    sayln!(
        "  admin listen: {}",
        config
            .admin
            .listen
            .map_or("(none)".into(), |a| a.to_string())
    );
    if let Some(d) = &config.decider {
        sayln!(
            "  decider: {} (timeout {}, at most {} at once; asked on a miss only)",
            d.url,
            humantime::format_duration(d.timeout),
            d.max_in_flight
        );
    }
    sayln!("  evidence dir: {}", config.evidence.dir.display());
    sayln!(
        "  gateway addresses (this host's interfaces, always denied; loopback is a fixed range): {}",
        gateway_addresses(policy.host_addresses())
    );
    if let Some(c) = crate::config::capacity(&config.evidence, config.orgs.len()) {
        // What the load-time check computed (it passed, or we would not be here).
        sayln!(
            "  evidence retention: retain_size {} bytes holds {} bytes at worst in retain_min_age {} ({} payers x {} records/s, {:.0} bytes/s, one open segment)",
            c.retain_size,
            c.needed,
            humantime::format_duration(config.evidence.retain_min_age),
            c.payers,
            config.evidence.max_records_per_second_per_org,
            c.bytes_per_second,
        );
    }
    sayln!("  policy: {}", policy.hash());
    for w in window_warnings(&policy) {
        sayln!("warning: {w}");
    }
    if !config.proxy.transparent.is_empty() && config.dns.listen.is_empty() {
        sayln!(
            "warning: transparent listeners without a DNS shim ([dns] listen): there are no \
             DNS bindings, so a connection's original address is accepted for a name only if \
             the name resolves to it when the connection is made; names served by many or \
             rotating addresses may be refused as sni_mismatch"
        );
    }
    Ok(())
}

/// Time-bound rules that will never match again (expired) or have not
/// started yet, at the instant `policy` decides at.
fn window_warnings(policy: &Policy) -> Vec<String> {
    let Some(now) = policy.instant() else {
        return Vec::new();
    };
    policy
        .windows()
        .filter_map(|(org, rule, w)| {
            if w.ended(now) {
                Some(format!(
                    "rule {rule} of org {org} expired ({}): it matches nothing; remove it",
                    w.describe()
                ))
            } else if !w.contains(now) {
                Some(format!(
                    "rule {rule} of org {org} does not match yet ({})",
                    w.describe()
                ))
            } else {
                None
            }
        })
        .collect()
}

/// `a, b`, or `(none)`.
fn list(addrs: &[SocketAddr]) -> String {
    if addrs.is_empty() {
        "(none)".to_string()
    } else {
        addrs
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The non-loopback addresses, `a, b`, or `(none)`.
fn gateway_addresses(host: &[IpAddr]) -> String {
    let listed: Vec<String> = host
        .iter()
        .filter(|a| !a.is_loopback())
        .map(IpAddr::to_string)
        .collect();
    if listed.is_empty() {
        "(none)".to_string()
    } else {
        listed.join(", ")
    }
}

/// `acme/allow/3 opens 10.0.0.0/8 (private) on ports 5432`, or for a rule
/// opening part of a range, `opens 10.20.0.0/16 of 10.0.0.0/8 (private)`.
fn describe_opening(o: &Opening) -> String {
    let part = if o.net == o.range {
        o.range.to_string()
    } else {
        format!("{} of {}", o.net, o.range)
    };
    let what: Vec<&str> = o.what.iter().map(|w| &**w).collect();
    let ports = match &o.ports {
        PortSet::All => "all ports".to_string(),
        PortSet::List(ports) => {
            let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
            format!("ports {}", ports.join(", "))
        }
    };
    format!("{} opens {part} ({}) on {ports}", o.rule, what.join(", "))
}
