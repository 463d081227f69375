//! `palisade evidence summary PATH [--org O] [--since T] [--format
//! table|markdown|json]`: what was denied, per org ([`denials`]).

use std::path::PathBuf;
use std::time::SystemTime;

use super::{print_json, CliError, Status};
use crate::analysis::denials;
use crate::evidence::select::{self, Selection};

/// Arguments of `palisade evidence summary`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Evidence file or directory.
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// Only this org (`unknown` for clients of no org).
    #[arg(long)]
    pub org: Option<String>,
    /// Records at or after this RFC 3339 time.
    #[arg(long, value_name = "T", value_parser = select::parse_time)]
    pub since: Option<SystemTime>,
    /// Output: an aligned table, Markdown (for a ticket or a CI comment)
    /// or JSON.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Formats of `evidence summary --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Markdown,
    Json,
}

/// Print what was denied. 1 on unreadable evidence or an org with no
/// records (a bad `--since` is clap's 2).
pub fn run(args: Args) -> Result<(), CliError> {
    let selection = Selection {
        org: args.org.clone(),
        since: args.since,
        ..Selection::default()
    };
    let records = super::decisions(&args.path, &selection)?;
    let report = denials::report(&records, &selection);
    if let Some(org) = &args.org {
        if !report.orgs.contains_key(org) {
            return Err(CliError::new(
                Status::Failed,
                format_args!("org {org:?} has no decisions in {}", args.path.display()),
            ));
        }
    }
    match args.format {
        Format::Table => say!("{}", report.table()),
        Format::Markdown => say!("{}", report.markdown()),
        Format::Json => print_json(&report)?,
    }
    Ok(())
}
