//! Reading one value of the config: a listen address, a socket address,
//! a count, a path, a duration, a timeout, a cidr; each error located.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use toml::Spanned;

use crate::config::error::Errors;
use crate::config::timeout::Timeout;

/// The listen addresses seen so far, to reject one used twice.
#[derive(Default)]
pub(super) struct Listeners(HashSet<SocketAddr>);

impl Listeners {
    /// A listen address, unique across all listeners.
    pub(super) fn claim(
        &mut self,
        value: &Spanned<String>,
        errors: &mut Errors<'_>,
    ) -> Option<SocketAddr> {
        let addr = socket_addr(value, None, errors)?;
        if !self.0.insert(addr) {
            errors.at(value.span(), format!("listen address {addr} is used twice"));
            return None;
        }
        Some(addr)
    }
}

pub(super) fn socket_addr(
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

pub(super) fn count(value: Option<Spanned<i64>>, default: usize, errors: &mut Errors<'_>) -> usize {
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

/// A path setting, `default` when unset; an empty one is an error naming
/// `what`.
pub(super) fn path(
    value: Option<Spanned<String>>,
    default: PathBuf,
    what: &str,
    errors: &mut Errors<'_>,
) -> PathBuf {
    match value {
        Some(p) if p.get_ref().trim().is_empty() => {
            errors.at(p.span(), format!("{what} must not be empty"));
            default
        }
        Some(p) => PathBuf::from(p.into_inner()),
        None => default,
    }
}

/// A duration setting, `default` when unset.
pub(super) fn duration(
    value: Option<Spanned<String>>,
    default: Duration,
    errors: &mut Errors<'_>,
) -> Duration {
    value
        .and_then(|v| positive_duration(&v, errors))
        .unwrap_or(default)
}

/// A timeout setting: a positive duration within the timeout's bound,
/// its default when unset.
pub(super) fn timeout<T: Timeout>(value: Option<Spanned<String>>, errors: &mut Errors<'_>) -> T {
    let Some(value) = value else {
        return T::DEFAULT;
    };
    let Some(d) = positive_duration(&value, errors) else {
        return T::DEFAULT;
    };
    T::new(d).unwrap_or_else(|e| {
        errors.at(
            value.span(),
            format!("{} {:?} {e}", T::KEY, value.get_ref()),
        );
        T::DEFAULT
    })
}

pub(super) fn positive_duration(
    value: &Spanned<String>,
    errors: &mut Errors<'_>,
) -> Option<Duration> {
    match humantime::parse_duration(value.get_ref().trim()) {
        Ok(d) if !d.is_zero() => Some(d),
        Ok(_) => {
            errors.at(
                value.span(),
                format!("duration {:?} must be positive", value.get_ref()),
            );
            None
        }
        Err(e) => {
            errors.at(
                value.span(),
                format!(
                    "invalid duration {:?} ({e}; e.g. \"5s\", \"250ms\")",
                    value.get_ref()
                ),
            );
            None
        }
    }
}

/// `found`, what `v` was read as; `None` is an error naming what `v`
/// could be (`names`).
pub(super) fn known<T>(
    what: &str,
    v: &Spanned<String>,
    found: Option<T>,
    names: &[&str],
    errors: &mut Errors<'_>,
) -> Option<T> {
    if found.is_none() {
        errors.at(
            v.span(),
            format!(
                "unknown {what} {:?} (one of {})",
                v.get_ref(),
                names.join(", ")
            ),
        );
    }
    found
}

/// The value of `choices` that `v` names, else an error naming `key` and
/// the choices, and the default.
pub(super) fn one_of<T: Copy + Default>(
    key: &str,
    v: &Spanned<String>,
    choices: &[(&str, T)],
    errors: &mut Errors<'_>,
) -> T {
    one_of_text(key, (v.get_ref(), v.span()), choices, errors)
}

/// [`one_of`] for a text and its span (a value trimmed first).
pub(super) fn one_of_text<T: Copy + Default>(
    key: &str,
    (text, span): (&str, std::ops::Range<usize>),
    choices: &[(&str, T)],
    errors: &mut Errors<'_>,
) -> T {
    if let Some((_, value)) = choices.iter().find(|(name, _)| *name == text) {
        return *value;
    }
    let names: Vec<String> = choices
        .iter()
        .map(|(name, _)| format!("{name:?}"))
        .collect();
    let expected = match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    errors.at(
        span,
        format!("invalid {key} {text:?} (expected {expected})"),
    );
    T::default()
}

pub(super) fn cidr(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<IpNet> {
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
