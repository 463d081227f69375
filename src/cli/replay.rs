//! `palisade replay --evidence PATH -c CANDIDATE [--json]`: the flows that
//! would flip under a candidate config ([`replay`]).

use std::path::PathBuf;

use super::{load_config, print_json, CliError, Status};
use crate::analysis::replay;
use crate::policy::Policy;

/// Arguments of `palisade replay`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Evidence file or directory.
    #[arg(long)]
    pub evidence: PathBuf,
    /// The candidate config.
    #[arg(short, long)]
    pub config: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Print the flows that would flip, as text or JSON. 1 on a bad config or
/// unreadable evidence.
pub fn run(args: Args) -> Result<(), CliError> {
    let config = load_config(&args.config, Status::Failed)?;
    let policy = Policy::new(&config);
    let report = replay::replay(&args.evidence, &policy).map_err(|e| {
        CliError::new(
            Status::Failed,
            format_args!("cannot read evidence {}: {e}", args.evidence.display()),
        )
    })?;
    if args.json {
        print_json(&report)
    } else {
        say!("{report}");
        Ok(())
    }
}
