//! `[admin]`: the admin listener.

use super::Listeners;
use crate::config::error::Errors;
use crate::config::model::AdminConfig;
use crate::config::raw::RawAdmin;

pub(super) fn validate_admin(
    raw: RawAdmin,
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> AdminConfig {
    let RawAdmin { listen } = raw;
    AdminConfig {
        listen: listen.and_then(|l| listeners.claim(&l, errors)),
    }
}
