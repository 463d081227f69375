//! The `palisade` command line.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use palisade::config;
use palisade::proto::target::parse_explain_target;

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
    Run {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
    },
    /// Validate the config and print a summary.
    Check {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
    },
    /// Print the decision the policy takes for a client and target.
    Explain {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
        /// Client source address.
        #[arg(long)]
        client: IpAddr,
        /// host:port, http(s)://host[:port]/path, ip:port, [v6]:port, dns:NAME or dns:NAME/TYPE.
        target: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evidence files.
    Evidence {
        #[command(subcommand)]
        command: EvidenceCommand,
    },
}

#[derive(Subcommand)]
enum EvidenceCommand {
    /// Check an evidence file or directory end to end.
    Verify { path: PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run { config } => run(config),
        Command::Check { config } => check(config),
        Command::Explain {
            config,
            client,
            target,
            json,
        } => explain(config, client, &target, json),
        Command::Evidence {
            command: EvidenceCommand::Verify { path },
        } => verify(path),
    }
}

fn load(path: &std::path::Path) -> Result<config::Config, ExitCode> {
    config::load(path).map_err(|errors| {
        eprintln!("{errors}");
        ExitCode::from(1)
    })
}

fn runtime() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("palisade: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    }
}

fn run(path: PathBuf) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PALISADE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,hickory_server=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match runtime().block_on(palisade::app::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("palisade: {e}");
            ExitCode::from(1)
        }
    }
}

fn check(path: PathBuf) -> ExitCode {
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let policy = palisade::policy::Policy::new(&config);
    let rules: usize = config
        .orgs
        .iter()
        .map(|o| o.allow.len() + o.deny.len())
        .sum();
    println!("{}: ok", path.display());
    println!("  orgs: {} ({} rules)", config.orgs.len(), rules);
    for org in &config.orgs {
        let clients: Vec<String> = org.clients.iter().map(|c| c.to_string()).collect();
        println!(
            "    {}: clients {}; {} allow, {} deny",
            org.name,
            clients.join(", "),
            org.allow.len(),
            org.deny.len()
        );
    }
    let list = |v: &[std::net::SocketAddr]| {
        if v.is_empty() {
            "(none)".to_string()
        } else {
            v.iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    println!("  proxy listen: {}", list(&config.proxy.listen));
    println!("  transparent: {}", list(&config.proxy.transparent));
    println!(
        "  dns listen: {}; upstream: {}",
        list(&config.dns.listen),
        list(&config.dns.upstream)
    );
    println!(
        "  admin listen: {}",
        config
            .admin
            .listen
            .map_or("(none)".into(), |a| a.to_string())
    );
    println!("  evidence dir: {}", config.evidence.dir.display());
    println!("  policy: {}", policy.hash());
    if !config.proxy.transparent.is_empty() && config.dns.listen.is_empty() {
        println!(
            "warning: transparent listeners without a DNS shim ([dns] listen): there are no \
             DNS bindings, so a connection's original address is accepted for a name only if \
             the name resolves to it when the connection is made; names served by many or \
             rotating addresses may be refused as sni_mismatch"
        );
    }
    ExitCode::SUCCESS
}

fn explain(path: PathBuf, client: IpAddr, target: &str, json: bool) -> ExitCode {
    let target = match parse_explain_target(target) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("palisade: bad target: {e}");
            return ExitCode::from(1);
        }
    };
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let x = runtime().block_on(palisade::explain::explain(&config, client, &target));
    if json {
        match serde_json::to_string_pretty(&x) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("palisade: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        println!("{x}");
    }
    ExitCode::SUCCESS
}

fn verify(path: PathBuf) -> ExitCode {
    match palisade::evidence::verify::verify_path(&path) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}
