//! Validation: raw structs in, typed values out, every problem located.
//! One file per section; the helpers every section shares are here.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use toml::Spanned;

use super::error::Errors;
use super::model::Config;
use super::raw::RawConfig;

mod admin;
mod credentials;
mod dns;
mod evidence;
mod intercept;
mod org;
mod proxy;
mod rules;

use admin::validate_admin;
use dns::validate_dns;
use evidence::validate_evidence;
use intercept::validate_intercept;
use org::validate_orgs;
use proxy::validate_proxy;

pub(super) fn validate(raw: RawConfig, path: &Path, errors: &mut Errors<'_>) -> Config {
    // Destructure exhaustively: a new field cannot be silently ignored.
    let RawConfig {
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        org,
    } = raw;

    // Listen addresses in this order, each unique across all listeners.
    let mut listeners = Listeners::default();
    let proxy = validate_proxy(proxy, &mut listeners, errors);
    let dns = validate_dns(dns, &mut listeners, errors);
    let admin = validate_admin(admin, &mut listeners, errors);
    let evidence = validate_evidence(evidence, errors);

    let intercept = validate_intercept(intercept, errors);
    let orgs = validate_orgs(org, errors);

    Config {
        path: path.to_path_buf(),
        proxy,
        dns,
        admin,
        evidence,
        intercept,
        orgs,
    }
}

/// The listen addresses seen so far, to reject one used twice.
#[derive(Default)]
struct Listeners(HashSet<SocketAddr>);

impl Listeners {
    /// A listen address, unique across all listeners.
    fn claim(&mut self, value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<SocketAddr> {
        let addr = socket_addr(value, None, errors)?;
        if !self.0.insert(addr) {
            errors.at(value.span(), format!("listen address {addr} is used twice"));
            return None;
        }
        Some(addr)
    }
}

fn socket_addr(
    value: &Spanned<String>,
    default_port: Option<u16>,
    errors: &mut Errors<'_>,
) -> Option<SocketAddr> {
    let text = value.get_ref().trim();
    if let Ok(addr) = text.parse::<SocketAddr>() {
        if addr.port() == 0 {
            errors.at(value.span(), format!("address {text:?} has port 0"));
            return None;
        }
        return Some(addr);
    }
    if let (Some(port), Ok(ip)) = (default_port, text.parse::<IpAddr>()) {
        return Some(SocketAddr::new(ip, port));
    }
    errors.at(
        value.span(),
        format!("invalid socket address {text:?} (expected ip:port or [v6]:port)"),
    );
    None
}

fn count(value: Option<Spanned<i64>>, default: usize, errors: &mut Errors<'_>) -> usize {
    let Some(value) = value else { return default };
    match usize::try_from(*value.get_ref()) {
        Ok(n) if n > 0 => n,
        _ => {
            errors.at(
                value.span(),
                format!("limit {} must be a positive integer", value.get_ref()),
            );
            default
        }
    }
}

fn duration(
    value: Option<Spanned<String>>,
    default: Duration,
    errors: &mut Errors<'_>,
) -> Duration {
    let Some(value) = value else { return default };
    match humantime::parse_duration(value.get_ref().trim()) {
        Ok(d) if !d.is_zero() => d,
        Ok(_) => {
            errors.at(
                value.span(),
                format!("duration {:?} must be positive", value.get_ref()),
            );
            default
        }
        Err(e) => {
            errors.at(
                value.span(),
                format!(
                    "invalid duration {:?} ({e}; e.g. \"5s\", \"250ms\")",
                    value.get_ref()
                ),
            );
            default
        }
    }
}

fn cidr(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<IpNet> {
    let text = value.get_ref().trim();
    let net = if text.contains('/') {
        text.parse::<IpNet>().ok()
    } else {
        text.parse::<IpAddr>().ok().map(IpNet::from)
    };
    let Some(net) = net else {
        errors.at(
            value.span(),
            format!("invalid cidr {text:?} (expected e.g. 198.18.7.0/24 or 2001:db8::/32)"),
        );
        return None;
    };
    if net.trunc() != net {
        errors.at(
            value.span(),
            format!(
                "cidr {text:?} has host bits set (did you mean {}?)",
                net.trunc()
            ),
        );
        return None;
    }
    Some(net)
}
