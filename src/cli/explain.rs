//! `palisade explain [-c CONFIG] --client IP TARGET [--method M]
//! [--json]`: the decision the policy takes for one client and target
//! ([`explain`]).

use std::net::IpAddr;
use std::path::PathBuf;

use super::{load_config, print_json, runtime, CliError, Status, DEFAULT_CONFIG};
use crate::analysis::explain;
use crate::proto::target::parse_explain_target;

/// Arguments of `palisade explain`.
// The doc comments of fields are `--help` text, not rustdoc: `[v6]` is
// text, not a link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(short, long, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Client source address.
    #[arg(long)]
    pub client: IpAddr,
    /// host:port, http(s)://host[:port]/path, ip:port, [v6]:port, dns:NAME or dns:NAME/TYPE.
    pub target: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// For an https:// target on an intercepted host: the request method
    /// to decide (with the target's path), as sent: methods are case-sensitive.
    #[arg(long)]
    pub method: Option<String>,
}

/// Print the decision, as text or JSON. 0 whatever the decision; 1 on a
/// bad target or config.
pub fn run(args: Args) -> Result<(), CliError> {
    let target = parse_explain_target(&args.target)
        .map_err(|e| CliError::new(Status::Failed, format_args!("bad target: {e}")))?;
    let config = load_config(&args.config, Status::Failed)?;
    let req_path = explain::target_path(&args.target);
    let request = match (&args.method, &req_path) {
        (Some(m), Some(p)) => Some((m.as_str(), p.as_str())),
        (None, Some(p)) => Some(("GET", p.as_str())),
        _ => None,
    };
    let x = runtime()?.block_on(explain::explain_request(
        &config,
        args.client,
        &target,
        request,
    ));
    if args.json {
        print_json(&x)
    } else {
        sayln!("{x}");
        Ok(())
    }
}
