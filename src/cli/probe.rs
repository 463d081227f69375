//! `palisade probe plan|run|report`: the containment demonstration.
//!
//! Exit statuses: 0 all matched (or the step did its work); 1 a finding
//! (including a missing probe or an observation that does not fit the
//! evidence), an inconclusive or unenforced probe, or evidence that fails
//! verification; 2 bad input (config, org, plan, observations of another
//! plan, a plan for another org or policy than the evidence, an
//! unwritable output directory).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use super::evidence::KeyArgs;
use super::{load_config, runtime, CliError, Status, DEFAULT_CONFIG};
use crate::probe::report::Checked;
use crate::probe::{generate, plan, render, report, run as probe_run};

/// `palisade probe ...`.
// The doc comments of fields are `--help` text, not rustdoc: `[dns]` is
// a config section, not a link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print a default probe plan (TOML) for an org of a policy.
    Plan {
        #[arg(short, long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long)]
        org: String,
        /// Explicit proxy address the sandbox uses (default: first [proxy] listen).
        #[arg(long)]
        proxy: Option<SocketAddr>,
        /// Resolver the sandbox uses (default: first [dns] listen).
        #[arg(long)]
        resolver: Option<SocketAddr>,
        /// Address standing for "outside" (repeatable; default 1.1.1.1, 8.8.8.8).
        #[arg(long)]
        outside: Vec<IpAddr>,
        /// Plan for a transparent deployment (default: when [proxy] transparent is set).
        #[arg(long)]
        transparent: bool,
    },
    /// Perform every probe of a plan and write DIR/observations.json.
    Run {
        #[arg(long)]
        plan: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify evidence, classify observations, write report.json/.md/.html.
    Report {
        /// The agreed plan, from the assessor's side (never the sandbox's
        /// copy); repeat it when the runs used different plans.
        #[arg(long, required = true)]
        plan: Vec<PathBuf>,
        /// observations.json of a run; repeat it for one run per sandbox
        /// (probe ids then carry `@RUN`).
        #[arg(long, required = true)]
        observations: Vec<PathBuf>,
        /// An evidence directory; repeat it, or give a tree with one
        /// directory per replica, for a fleet.
        #[arg(long, required = true)]
        evidence: Vec<PathBuf>,
        #[command(flatten)]
        keys: KeyArgs,
        /// Accept an evidence chain whose end is not sealed (a live instance).
        #[arg(long)]
        allow_unsealed: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(command: Command) -> Result<(), CliError> {
    match command {
        Command::Plan {
            config,
            org,
            proxy,
            resolver,
            outside,
            transparent,
        } => {
            let config = load_config(&config, Status::BadInput)?;
            let transparent = transparent || !config.proxy.transparent.is_empty();
            // Fresh per plan: a run of an earlier plan cannot pass for it.
            let mut nonce = [0u8; 4];
            getrandom::fill(&mut nonce).map_err(|e| {
                CliError::new(Status::Failed, format_args!("no random plan nonce: {e}"))
            })?;
            let opts = generate::GenerateOptions {
                org,
                proxy,
                resolver,
                outside,
                transparent,
                run: data_encoding::HEXLOWER.encode(&nonce),
                issued: std::time::SystemTime::now(),
            };
            print_plan(&config, &opts)
        }
        Command::Run { plan, out } => run_plan(&plan, &out),
        Command::Report {
            plan,
            observations,
            evidence,
            keys,
            allow_unsealed,
            out,
        } => {
            let opts = report::Options {
                plans: &plan,
                observations: &observations,
                evidence: &evidence,
                pins: keys.pins()?,
                allow_unsealed,
            };
            write_report(&opts, &out)
        }
    }
}

fn bad_input(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError::new(Status::BadInput, format_args!("{}: {e}", path.display()))
}

fn print_plan(
    config: &crate::config::Config,
    opts: &generate::GenerateOptions,
) -> Result<(), CliError> {
    let p = generate::generate(config, opts).map_err(|e| CliError::new(Status::BadInput, e))?;
    let header = format!(
        "Palisade probe plan for org {:?}, policy {}\nGenerated from {} by palisade {}. Review every expectation: the plan is the agreement.",
        opts.org,
        p.policy.as_deref().unwrap_or("-"),
        config.path.display(),
        env!("CARGO_PKG_VERSION")
    );
    let text = p
        .to_toml(&header)
        .map_err(|e| CliError::new(Status::Failed, format_args!("plan as TOML: {e}")))?;
    say!("{text}");
    Ok(())
}

fn run_plan(path: &Path, out: &Path) -> Result<(), CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| bad_input(path, e))?;
    let p = plan::Plan::from_toml(&text).map_err(|e| bad_input(path, e))?;
    let obs = runtime()?.block_on(probe_run::run(&p, &text));
    let file = out.join("observations.json");
    std::fs::create_dir_all(out)
        .and_then(|_| {
            let body = serde_json::to_vec_pretty(&obs).map_err(std::io::Error::other)?;
            std::fs::write(&file, body)
        })
        .map_err(|e| bad_input(&file, e))?;
    for o in &obs.observations {
        sayln!(
            "{:<24} {:<6} {:<8} {:?} {}",
            o.id,
            o.kind,
            format!("{:?}", o.expect).to_lowercase(),
            o.outcome,
            o.error.as_deref().unwrap_or("")
        );
    }
    sayln!("wrote {}", file.display());
    Ok(())
}

fn write_report(opts: &report::Options<'_>, out: &Path) -> Result<(), CliError> {
    let report =
        report::build(opts).map_err(|report::BadInput(e)| CliError::new(Status::BadInput, e))?;
    let r = render::outputs(report);
    let json = serde_json::to_vec_pretty(&r.json).unwrap_or_default();
    std::fs::create_dir_all(out)
        .and_then(|_| {
            std::fs::write(out.join("report.json"), json)?;
            std::fs::write(out.join("report.md"), &r.markdown)?;
            std::fs::write(out.join("report.html"), &r.html)
        })
        .map_err(|e| bad_input(out, e))?;
    sayln!("{}", r.report.verdict);
    for replica in &r.report.verification.replicas {
        sayln!("{}", replica.text);
    }
    sayln!("wrote {}/report.{{json,md,html}}", out.display());
    if let Checked::Failed { error, .. } = &r.report.verification.checked {
        return Err(CliError::new(
            Status::Failed,
            format_args!("evidence verification failed: {error}"),
        ));
    }
    match r.exit {
        0 => Ok(()),
        _ => Err(CliError::silent(Status::Failed)),
    }
}
