//! STUB until the real module lands.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    Name(String),
    Ip(IpAddr),
}
impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("invalid target {0:?}")]
    Invalid(String),
}
pub fn normalize_host(input: &str) -> Result<Host, TargetError> {
    let s = input.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(Host::Ip(match ip {
            IpAddr::V6(v) => v.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v)),
            v => v,
        }));
    }
    let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    if s.is_empty() || s.contains('*') || s.split('.').any(|l| l.is_empty()) {
        return Err(TargetError::Invalid(input.into()));
    }
    Ok(Host::Name(s))
}
pub fn parse_authority(input: &str, default_port: Option<u16>) -> Result<(Host, u16), TargetError> {
    let (h, p) = match input.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') => (h, p.parse::<u16>().ok()),
        _ => (input, default_port),
    };
    let p = p
        .filter(|p| *p > 0)
        .ok_or_else(|| TargetError::Invalid(input.into()))?;
    Ok((normalize_host(h)?, p))
}
pub fn embedded_ipv4(addr: &Ipv6Addr) -> Option<Ipv4Addr> {
    addr.to_ipv4_mapped()
}
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExplainTarget {
    Tcp {
        host: Host,
        port: u16,
        scheme: Option<Scheme>,
    },
    Dns {
        name: Host,
        qtype: String,
    },
}
pub fn parse_explain_target(input: &str) -> Result<ExplainTarget, TargetError> {
    let (host, port) = parse_authority(input, None)?;
    Ok(ExplainTarget::Tcp {
        host,
        port,
        scheme: None,
    })
}
