//! `palisade evidence verify|pubkey|query|export`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use ed25519_dalek::VerifyingKey;

use super::{load_config, Failure, Status, DEFAULT_CONFIG};
use crate::evidence::{chain, key, query, verify};

/// `palisade evidence ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
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
        #[arg(short, long, default_value = DEFAULT_CONFIG)]
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

/// Schemas of `evidence export --format`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    Ocsf,
}

/// The record filters of `evidence query` and `evidence export`.
#[derive(clap::Args, Debug)]
pub struct FilterArgs {
    /// Org name (`unknown` for clients of no org).
    #[arg(long)]
    pub org: Option<String>,
    /// allow or deny.
    #[arg(long)]
    pub decision: Option<String>,
    /// Reason code, e.g. no_matching_rule.
    #[arg(long)]
    pub reason: Option<String>,
    /// Records at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Records at or before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,
    /// Target host: exact name or *.example.com.
    #[arg(long)]
    pub host: Option<String>,
    /// The record a client was shown (`record=REF` in a 403 body,
    /// `Proxy-Status` or DNS error text), or a record id; also matches
    /// that decision's close record.
    #[arg(long = "ref", visible_alias = "id", value_name = "REF")]
    pub reference: Option<String>,
}

impl FilterArgs {
    /// The filter, or 2 with every unparseable time named.
    fn filter(self) -> Result<query::Filter, Failure> {
        let (since, until) = match (
            parse_time("since", self.since),
            parse_time("until", self.until),
        ) {
            (Ok(since), Ok(until)) => (since, until),
            (since, until) => {
                let errors: Vec<String> =
                    [since.err(), until.err()].into_iter().flatten().collect();
                return Err(Failure::bare(Status::BadInput, errors.join("\n")));
            }
        };
        Ok(query::Filter {
            org: self.org,
            decision: self.decision,
            reason: self.reason,
            since,
            until,
            host: self
                .host
                .map(|h| h.trim_end_matches('.').to_ascii_lowercase()),
            record: self.reference.map(|r| r.trim().to_ascii_lowercase()),
        })
    }
}

/// `--since`/`--until`: RFC 3339, or the line that says why not.
fn parse_time(flag: &str, value: Option<String>) -> Result<Option<SystemTime>, String> {
    let Some(v) = value else { return Ok(None) };
    humantime::parse_rfc3339_weak(&v).map(Some).map_err(|e| {
        format!("palisade: --{flag} {v:?}: {e} (expected RFC 3339, e.g. 2026-01-02T03:04:05Z)")
    })
}

/// `--key`: an Ed25519 public key in hex, or a file holding it; 2 when it
/// is neither.
pub fn parse_key(arg: &str) -> Result<VerifyingKey, Failure> {
    let text = std::fs::read_to_string(arg).unwrap_or_else(|_| arg.to_string());
    chain::parse_pubkey(&text).ok_or_else(|| {
        Failure::new(
            Status::BadInput,
            "--key: not an Ed25519 public key (64 hex characters, or a file holding them)",
        )
    })
}

/// What `query`/`export` print.
enum Output {
    JsonLines,
    Table,
    Ocsf,
}

/// `verify`: 0 intact, 1 broken, 2 bad key. `pubkey`: 1 without a key.
/// `query`/`export`: 1 on an unreadable path, 2 on a bad time.
pub fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Verify {
            path,
            key,
            allow_unsealed,
        } => verify(&path, key.as_deref(), allow_unsealed),
        Command::Pubkey { config } => pubkey(&config),
        Command::Query {
            path,
            filter,
            table,
        } => {
            let output = if table {
                Output::Table
            } else {
                Output::JsonLines
            };
            records(&path, filter, output)
        }
        Command::Export {
            path,
            format: ExportFormat::Ocsf,
            filter,
        } => records(&path, filter, Output::Ocsf),
    }
}

fn verify(path: &Path, key: Option<&str>, allow_unsealed: bool) -> Result<(), Failure> {
    let opts = verify::Options {
        key: key.map(parse_key).transpose()?,
        allow_unsealed,
    };
    match verify::verify_with(path, &opts) {
        Ok(summary) => {
            println!("{summary}");
            Ok(())
        }
        Err(e) => {
            println!("broken: {e}");
            Err(Failure::bare(Status::Failed, e))
        }
    }
}

fn pubkey(config: &Path) -> Result<(), Failure> {
    let config = load_config(config, Status::Failed)?;
    let k = key::load(&config.evidence.key).map_err(|e| {
        Failure::new(
            Status::Failed,
            format_args!("{e} (palisade run creates it on first start)"),
        )
    })?;
    println!("{}", key::public_hex(&k));
    Ok(())
}

fn records(path: &Path, filter: FilterArgs, output: Output) -> Result<(), Failure> {
    let filter = filter.filter()?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let result = match output {
        Output::JsonLines => query::query(path, &filter, false, &mut out),
        Output::Table => query::query(path, &filter, true, &mut out),
        Output::Ocsf => query::export_ocsf(path, &filter, &mut out),
    };
    result
        .and_then(|_| out.flush())
        .map_err(|e| Failure::new(Status::Failed, format_args!("{}: {e}", path.display())))
}
