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
        /// For an https:// target on an intercepted host: the request method
        /// to decide (with the target's path), as sent: methods are case-sensitive.
        #[arg(long)]
        method: Option<String>,
    },
    /// Per-org interception CAs.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
    /// Re-decide every recorded decision under a candidate policy and print
    /// the flows that would flip.
    Replay {
        /// Evidence file or directory.
        #[arg(long)]
        evidence: PathBuf,
        /// The candidate config.
        #[arg(short, long)]
        config: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evidence files.
    Evidence {
        #[command(subcommand)]
        command: EvidenceCommand,
    },
    /// Containment demonstration: plan, run (in the sandbox), report.
    Probe {
        #[command(subcommand)]
        command: ProbeCommand,
    },
    /// Org tokens (credential identity).
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
}

#[derive(Subcommand)]
enum ProbeCommand {
    /// Print a default probe plan (TOML) for an org of a policy.
    Plan {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
        #[arg(long)]
        org: String,
        /// Explicit proxy address the sandbox uses (default: first [proxy] listen).
        #[arg(long)]
        proxy: Option<std::net::SocketAddr>,
        /// Resolver the sandbox uses (default: first [dns] listen).
        #[arg(long)]
        resolver: Option<std::net::SocketAddr>,
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
        #[arg(long)]
        observations: PathBuf,
        #[arg(long)]
        evidence: PathBuf,
        /// Evidence public key (hex, or a file holding it).
        #[arg(long)]
        key: Option<String>,
        /// Accept an evidence chain whose end is not sealed (a live instance).
        #[arg(long)]
        allow_unsealed: bool,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Print a fresh random token, and the config line holding its hash.
    New {
        /// The org the token is for (shown in the printed line and usage).
        #[arg(long)]
        org: Option<String>,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Print an org's interception CA certificate (PEM), creating the CA if
    /// it does not exist yet: install it in the sandbox's trust store.
    Export {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
        #[arg(long)]
        org: String,
    },
}

#[derive(Subcommand)]
enum EvidenceCommand {
    /// Check an evidence file or directory end to end: hashes, sequence,
    /// segment links, checkpoint signatures and a sealed end.
    Verify {
        path: PathBuf,
        /// Public key (hex, or a file holding it) every checkpoint must be signed with.
        #[arg(long)]
        key: Option<String>,
        /// Accept a chain whose end is not sealed (a live or crashed instance).
        #[arg(long)]
        allow_unsealed: bool,
    },
    /// Print the public key of the checkpoint signing key (hex).
    Pubkey {
        #[arg(short, long, default_value = "config/palisade.toml")]
        config: PathBuf,
    },
    /// Print decision and close records that match every filter given.
    Query {
        path: PathBuf,
        #[command(flatten)]
        filter: FilterArgs,
        /// A tab-separated table instead of JSON Lines.
        #[arg(long)]
        table: bool,
    },
    /// Export decision and close records in another schema.
    Export {
        path: PathBuf,
        /// Output schema: ocsf (OCSF 1.x JSON Lines).
        #[arg(long)]
        format: ExportFormat,
        #[command(flatten)]
        filter: FilterArgs,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ExportFormat {
    Ocsf,
}

#[derive(clap::Args)]
struct FilterArgs {
    /// Org name (`unknown` for clients of no org).
    #[arg(long)]
    org: Option<String>,
    /// allow or deny.
    #[arg(long)]
    decision: Option<String>,
    /// Reason code, e.g. no_matching_rule.
    #[arg(long)]
    reason: Option<String>,
    /// Records at or after this RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// Records at or before this RFC 3339 time.
    #[arg(long)]
    until: Option<String>,
    /// Target host: exact name or *.example.com.
    #[arg(long)]
    host: Option<String>,
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
            method,
        } => explain(config, client, &target, json, method),
        Command::Replay {
            evidence,
            config,
            json,
        } => replay(evidence, config, json),
        Command::Ca {
            command: CaCommand::Export { config, org },
        } => ca_export(config, &org),
        Command::Evidence { command } => match command {
            EvidenceCommand::Verify {
                path,
                key,
                allow_unsealed,
            } => verify(path, key, allow_unsealed),
            EvidenceCommand::Pubkey { config } => pubkey(config),
            EvidenceCommand::Query {
                path,
                filter,
                table,
            } => query(path, filter, Some(table)),
            EvidenceCommand::Export {
                path,
                format: ExportFormat::Ocsf,
                filter,
            } => query(path, filter, None),
        },
        Command::Probe { command } => probe(command),
        Command::Token {
            command: TokenCommand::New { org },
        } => token_new(org.as_deref()),
    }
}

fn token_new(org: Option<&str>) -> ExitCode {
    let (token, digest) = match config::new_token() {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("palisade: no randomness for a token: {e}");
            return ExitCode::from(1);
        }
    };
    let org = org.unwrap_or("ORG");
    println!("token: {token}");
    println!("# give the token to the client only; put this in [[org]] name = {org:?}:");
    println!("tokens = [\"{digest}\"]");
    println!("# client use: Proxy-Authorization Basic (or SOCKS5 username/password) with user {org:?} and the token as password");
    ExitCode::SUCCESS
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
    let openings = policy.openings();
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
        if org.identity.needs_token() {
            println!(
                "      identity {}; {} token(s)",
                org.identity.as_str(),
                org.tokens.len()
            );
        }
        for opening in openings.iter().filter(|o| *o.org == *org.name) {
            println!("      {}", describe_opening(opening));
        }
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
    println!("  socks5: {}", list(&config.proxy.socks5));
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

/// `acme/allow/3 opens 10.0.0.0/8 (private) on ports 5432`, or for a rule
/// opening part of a range, `opens 10.20.0.0/16 of 10.0.0.0/8 (private)`.
fn describe_opening(o: &palisade::policy::Opening) -> String {
    let part = if o.net == o.range {
        o.range.to_string()
    } else {
        format!("{} of {}", o.net, o.range)
    };
    let what: Vec<&str> = o.what.iter().map(|w| &**w).collect();
    let ports = match &o.ports {
        palisade::config::PortSet::All => "all ports".to_string(),
        palisade::config::PortSet::List(ports) => {
            let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
            format!("ports {}", ports.join(", "))
        }
    };
    format!("{} opens {part} ({}) on {ports}", o.rule, what.join(", "))
}

fn ca_export(path: PathBuf, org: &str) -> ExitCode {
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if !config.orgs.iter().any(|o| o.name == org) {
        eprintln!("palisade: no org {org:?} in {}", path.display());
        return ExitCode::from(1);
    }
    match palisade::intercept::ca::OrgCa::load_or_create(&config.intercept.ca_dir, org) {
        Ok(ca) => {
            print!("{}", ca.cert_pem);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("palisade: org {org}: CA: {e}");
            ExitCode::from(1)
        }
    }
}

fn explain(
    path: PathBuf,
    client: IpAddr,
    target_text: &str,
    json: bool,
    method: Option<String>,
) -> ExitCode {
    let target = match parse_explain_target(target_text) {
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
    let req_path = palisade::explain::target_path(target_text);
    let request = match (&method, &req_path) {
        (Some(m), Some(p)) => Some((m.as_str(), p.as_str())),
        (None, Some(p)) => Some(("GET", p.as_str())),
        _ => None,
    };
    let x = runtime().block_on(palisade::explain::explain_request(
        &config, client, &target, request,
    ));
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

fn verify(path: PathBuf, key: Option<String>, allow_unsealed: bool) -> ExitCode {
    use palisade::evidence::{chain, verify};
    let key = match key {
        None => None,
        Some(k) => {
            let text = std::fs::read_to_string(&k).unwrap_or(k);
            match chain::parse_pubkey(&text) {
                Some(k) => Some(k),
                None => {
                    eprintln!("palisade: --key: not an Ed25519 public key (64 hex characters, or a file holding them)");
                    return ExitCode::from(2);
                }
            }
        }
    };
    let opts = verify::Options {
        key,
        allow_unsealed,
    };
    match verify::verify_with(&path, &opts) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("broken: {e}");
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

fn pubkey(path: PathBuf) -> ExitCode {
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match palisade::evidence::key::load(&config.evidence.key) {
        Ok(k) => {
            println!("{}", palisade::evidence::key::public_hex(&k));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("palisade: {e} (palisade run creates it on first start)");
            ExitCode::from(1)
        }
    }
}

fn parse_time(
    flag: &str,
    value: Option<String>,
) -> Result<Option<std::time::SystemTime>, ExitCode> {
    match value {
        None => Ok(None),
        Some(v) => humantime::parse_rfc3339_weak(&v).map(Some).map_err(|e| {
            eprintln!(
                "palisade: --{flag} {v:?}: {e} (expected RFC 3339, e.g. 2026-01-02T03:04:05Z)"
            );
            ExitCode::from(2)
        }),
    }
}

/// `query` (table: Some) or `export --format ocsf` (table: None).
fn query(path: PathBuf, f: FilterArgs, table: Option<bool>) -> ExitCode {
    use palisade::evidence::query;
    let filter = match (parse_time("since", f.since), parse_time("until", f.until)) {
        (Ok(since), Ok(until)) => query::Filter {
            org: f.org,
            decision: f.decision,
            reason: f.reason,
            since,
            until,
            host: f.host.map(|h| h.trim_end_matches('.').to_ascii_lowercase()),
        },
        (Err(code), _) | (_, Err(code)) => return code,
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = match table {
        Some(table) => query::query(&path, &filter, table, &mut out),
        None => query::export_ocsf(&path, &filter, &mut out),
    };
    match result.and_then(|_| std::io::Write::flush(&mut out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("palisade: {}: {e}", path.display());
            ExitCode::from(1)
        }
    }
}

fn replay(evidence: PathBuf, path: PathBuf, json: bool) -> ExitCode {
    let config = match load(&path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let policy = palisade::policy::Policy::new(&config);
    match palisade::replay::replay(&evidence, &policy) {
        Ok(report) if json => match serde_json::to_string_pretty(&report) {
            Ok(s) => {
                println!("{s}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("palisade: {e}");
                ExitCode::from(1)
            }
        },
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("palisade: cannot read evidence {}: {e}", evidence.display());
            ExitCode::from(1)
        }
    }
}

/// `palisade probe ...`: exit 0 all matched, 1 finding/inconclusive/broken evidence, 2 bad input.
fn probe(command: ProbeCommand) -> ExitCode {
    use palisade::probe::{plan, report, run};
    match command {
        ProbeCommand::Plan {
            config,
            org,
            proxy,
            resolver,
            outside,
            transparent,
        } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(_) => return ExitCode::from(2),
            };
            let transparent = transparent || !config.proxy.transparent.is_empty();
            let opts = plan::GenerateOptions {
                org,
                proxy,
                resolver,
                outside,
                transparent,
            };
            match plan::generate(&config, &opts) {
                Ok(p) => {
                    let header = format!(
                        "Palisade probe plan for org {:?}, policy {}\nGenerated from {} by palisade {}. Review every expectation: the plan is the agreement.",
                        opts.org,
                        p.policy.as_deref().unwrap_or("-"),
                        config.path.display(),
                        env!("CARGO_PKG_VERSION")
                    );
                    print!("{}", p.to_toml(&header));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("palisade: {e}");
                    ExitCode::from(2)
                }
            }
        }
        ProbeCommand::Run { plan: path, out } => {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("palisade: {}: {e}", path.display());
                    return ExitCode::from(2);
                }
            };
            let p = match plan::Plan::from_toml(&text) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("palisade: {}: {e}", path.display());
                    return ExitCode::from(2);
                }
            };
            let obs = runtime().block_on(run::run(&p, &text));
            let file = out.join("observations.json");
            let written = std::fs::create_dir_all(&out).and_then(|_| {
                let body = serde_json::to_vec_pretty(&obs).map_err(std::io::Error::other)?;
                std::fs::write(&file, body)
            });
            if let Err(e) = written {
                eprintln!("palisade: {}: {e}", file.display());
                return ExitCode::from(2);
            }
            for o in &obs.observations {
                println!(
                    "{:<24} {:<6} {:<8} {:?} {}",
                    o.id,
                    o.kind,
                    format!("{:?}", o.expect).to_lowercase(),
                    o.outcome,
                    o.error.as_deref().unwrap_or("")
                );
            }
            println!("wrote {}", file.display());
            ExitCode::SUCCESS
        }
        ProbeCommand::Report {
            observations,
            evidence,
            key,
            allow_unsealed,
            out,
        } => {
            let key = match key {
                None => None,
                Some(k) => {
                    let text = std::fs::read_to_string(&k).unwrap_or(k);
                    match palisade::evidence::chain::parse_pubkey(&text) {
                        Some(k) => Some(k),
                        None => {
                            eprintln!("palisade: --key: not an Ed25519 public key (64 hex characters, or a file holding them)");
                            return ExitCode::from(2);
                        }
                    }
                }
            };
            let opts = report::Options {
                observations: &observations,
                evidence: &evidence,
                key,
                allow_unsealed,
            };
            let r = match report::build(&opts) {
                Ok(r) => r,
                Err(report::BadInput(e)) => {
                    eprintln!("palisade: {e}");
                    return ExitCode::from(2);
                }
            };
            let json = serde_json::to_vec_pretty(&r.json).unwrap_or_default();
            let written = std::fs::create_dir_all(&out).and_then(|_| {
                std::fs::write(out.join("report.json"), json)?;
                std::fs::write(out.join("report.md"), &r.markdown)?;
                std::fs::write(out.join("report.html"), &r.html)
            });
            if let Err(e) = written {
                eprintln!("palisade: {}: {e}", out.display());
                return ExitCode::from(2);
            }
            if r.json["verification"]["ok"] != true {
                eprintln!(
                    "palisade: evidence verification failed: {}",
                    r.json["verification"]["error"].as_str().unwrap_or("")
                );
            }
            println!("{}", r.json["verdict"].as_str().unwrap_or(""));
            println!("wrote {}/report.{{json,md,html}}", out.display());
            ExitCode::from(r.exit)
        }
    }
}
