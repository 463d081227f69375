//! `palisade ca export`: an org's interception CA certificate.

use std::path::PathBuf;

use super::{load_config, CliError, Status, DEFAULT_CONFIG};
use crate::intercept::ca::OrgCa;

/// `palisade ca ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print an org's interception CA certificate (PEM), creating the CA if
    /// it does not exist yet: install it in the sandbox's trust store.
    Export {
        #[arg(short, long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long)]
        org: String,
    },
}

/// 1 on a bad config, an unknown org or an unusable CA.
pub fn run(command: Command) -> Result<(), CliError> {
    let Command::Export { config: path, org } = command;
    let config = load_config(&path, Status::Failed)?;
    if !config.orgs.iter().any(|o| o.name == org) {
        return Err(CliError::new(
            Status::Failed,
            format_args!("no org {org:?} in {}", path.display()),
        ));
    }
    let ca = OrgCa::load_or_create(&config.intercept.ca_dir, &org)
        .map_err(|e| CliError::new(Status::Failed, format_args!("org {org}: CA: {e}")))?;
    say!("{}", ca.cert_pem);
    Ok(())
}
