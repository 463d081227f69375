//! The `palisade` command line: parse the arguments, run the command's
//! handler in [`palisade::cli`], and turn its failure into the exit status.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use palisade::cli::{self, CliError};

/// mimalloc, not glibc's malloc: glibc gives a thread heap's free top back
/// to the kernel (`madvise`) as soon as more than 128 KiB lies there and
/// takes it back a page fault at a time, which new tunnels at c=64 paid
/// about 0.5 times each (page faults are dear under virtualisation), and
/// its `malloc`/`free` cost about 19,000 instructions per tunnel. Under
/// mimalloc, callgrind counts 5.7% fewer instructions per tunnel and 4.6%
/// fewer per DNS query, and page faults per tunnel fall from 0.5 to 0.02
/// (docs/performance.md, "Costs of single features").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "palisade",
    version,
    about = "Egress-enforcing forward proxy and DNS filter"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the proxy and admin listeners until SIGTERM/SIGINT.
    Run(cli::run::Args),
    /// Validate the config and print a summary.
    Check(cli::check::Args),
    /// Print the decision the policy takes for a client and target.
    Explain(cli::explain::Args),
    /// Per-org interception CAs.
    Ca {
        #[command(subcommand)]
        command: cli::ca::Command,
    },
    /// Re-decide every recorded decision under a candidate policy and print
    /// the flows that would flip.
    Replay(cli::replay::Args),
    /// Draft an org's allow rules from its evidence (checked against the
    /// config and replayed before they are printed).
    Draft(cli::draft::Args),
    /// Evidence files.
    Evidence {
        #[command(subcommand)]
        command: cli::evidence::Command,
    },
    /// Containment demonstration: plan, run (in the sandbox), report.
    Probe {
        #[command(subcommand)]
        command: cli::probe::Command,
    },
    /// Follow a running instance's decisions live (its admin listener's
    /// `/v1/decisions`).
    Tail(cli::tail::Args),
    /// Pending approvals of a running instance: list them, or answer one.
    Approvals(cli::approvals::ApprovalsArgs),
    /// Grant an org a target for a while (or `grant revoke ID`).
    Grant(cli::approvals::GrantArgs),
    /// The grants a running instance holds.
    Grants(cli::approvals::Admin),
    /// Org tokens (credential identity).
    Token {
        #[command(subcommand)]
        command: cli::token::Command,
    },
}

fn main() -> ExitCode {
    // Not `Cli::parse()`: its `--help` panics on a closed stdout (`palisade
    // --help | head -c 1`); a reader that went away is no error here either.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let result: Result<(), CliError> = match cli.command {
        Command::Run(args) => cli::run::run(args),
        Command::Check(args) => cli::check::run(args),
        Command::Explain(args) => cli::explain::run(args),
        Command::Ca { command } => cli::ca::run(command),
        Command::Replay(args) => cli::replay::run(args),
        Command::Draft(args) => cli::draft::run(args),
        Command::Evidence { command } => cli::evidence::run(command),
        Command::Probe { command } => cli::probe::run(command),
        Command::Tail(args) => cli::tail::run(args),
        Command::Approvals(args) => cli::approvals::approvals(args),
        Command::Grant(args) => cli::approvals::grant(args),
        Command::Grants(admin) => cli::approvals::grants(admin),
        Command::Token { command } => cli::token::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            if let Some(message) = failure.message() {
                eprintln!("{message}");
            }
            ExitCode::from(failure.code())
        }
    }
}
