//! `[intercept]`: the per-org CAs, upstream trust and handshake bound.

use super::values::{count, path, timeout};
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
    let ca_dir = path(ca_dir, d.ca_dir, "intercept ca_dir", errors);
    let upstream_ca = path(upstream_ca, d.upstream_ca, "intercept upstream_ca", errors);
    InterceptConfig {
        ca_dir,
        upstream_ca,
        cert_cache: count(cert_cache, d.cert_cache, errors),
        handshake_timeout: timeout(handshake_timeout, errors),
    }
}
