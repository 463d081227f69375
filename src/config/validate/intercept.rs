//! `[intercept]`: the per-org CAs, upstream trust and handshake bound.

use std::path::PathBuf;

use toml::Spanned;

use super::{count, timeout};
use crate::config::error::Errors;
use crate::config::model::InterceptConfig;
use crate::config::raw::RawIntercept;

pub(super) fn validate_intercept(raw: RawIntercept, errors: &mut Errors<'_>) -> InterceptConfig {
    let RawIntercept {
        ca_dir,
        upstream_ca,
        cert_cache,
        handshake_timeout,
    } = raw;
    let d = InterceptConfig::default();
    let mut path = |v: Option<Spanned<String>>, default: PathBuf, what: &str| match v {
        Some(p) if p.get_ref().trim().is_empty() => {
            errors.at(p.span(), format!("intercept {what} must not be empty"));
            default
        }
        Some(p) => PathBuf::from(p.into_inner()),
        None => default,
    };
    let ca_dir = path(ca_dir, d.ca_dir, "ca_dir");
    let upstream_ca = path(upstream_ca, d.upstream_ca, "upstream_ca");
    InterceptConfig {
        ca_dir,
        upstream_ca,
        cert_cache: count(cert_cache, d.cert_cache, errors),
        handshake_timeout: timeout(handshake_timeout, errors),
    }
}
