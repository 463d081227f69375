//! `palisade run`: serve until SIGTERM/SIGINT.

use std::path::PathBuf;

use super::{load_config, runtime, CliError, Status, DEFAULT_CONFIG};

/// Arguments of `palisade run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(short, long, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
}

/// Log to stderr (filter from `PALISADE_LOG`), load the config and serve
/// until shutdown. 1 on a bad config or a start-up failure.
pub fn run(args: Args) -> Result<(), CliError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PALISADE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,hickory_server=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = load_config(&args.config, Status::Failed)?;
    let rt = runtime()?;
    let result = rt.block_on(async {
        let shutdown = crate::app::signals()?;
        crate::app::run(config, shutdown).await
    });
    // A signal during the start may leave a read of the evidence running
    // off the runtime: it is not waited for.
    rt.shutdown_timeout(RUNTIME_STOP);
    result.map_err(|e| CliError::new(Status::Failed, e))
}

/// How long the runtime's leftover tasks get once served and drained.
const RUNTIME_STOP: std::time::Duration = std::time::Duration::from_secs(1);
