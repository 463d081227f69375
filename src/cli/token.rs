//! `palisade token new`: a fresh org token and its config line.

use super::{CliError, Status};
use crate::config;

/// `palisade token ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print a fresh random token, and the config line holding its hash.
    New {
        /// The org the token is for (shown in the printed line and usage).
        #[arg(long)]
        org: Option<String>,
    },
}

/// 1 if there is no randomness for a token.
pub fn run(command: Command) -> Result<(), CliError> {
    let Command::New { org } = command;
    let (token, digest) = config::new_token().map_err(|e| {
        CliError::new(
            Status::Failed,
            format_args!("no randomness for a token: {e}"),
        )
    })?;
    let org = org.as_deref().unwrap_or("ORG");
    sayln!("token: {token}");
    sayln!("# give the token to the client only; put this in [[org]] name = {org:?}:");
    sayln!("tokens = [\"{digest}\"]");
    sayln!("# client use: Proxy-Authorization Basic (or SOCKS5 username/password) with user {org:?} and the token as password");
    Ok(())
}
