//! `palisade evidence verify|pubkey|query|export`.
//!
//! `verify`, `query` and `export` take one chain (a directory of segments
//! or one segment file), as they always have, or a fleet: several paths,
//! or one tree with a directory per replica ([`fleet`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use ed25519_dalek::VerifyingKey;

use super::{load_config, output_failed, CliError, Status, DEFAULT_CONFIG};
use crate::evidence::select::{self, Selection};
use crate::evidence::{chain, export, fleet, key, note, proof, query, verify, witness};
use crate::policy::Reason;

/// `palisade evidence ...`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Check an evidence file or directory end to end: hashes, sequence,
    /// segment links, checkpoint signatures and a sealed end. Several
    /// paths, or a tree with one directory per replica, are a fleet: each
    /// chain is checked on its own and gets one line.
    Verify {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        keys: KeyArgs,
        /// Accept a chain whose end is not sealed (a live or crashed instance).
        #[arg(long)]
        allow_unsealed: bool,
        /// A witness's verifier key (`NAME+KEY_ID+BASE64`, type 0x04) whose
        /// cosignature every checkpoint must carry, on it or on a later
        /// checkpoint (repeatable; one chain only).
        #[arg(long = "witness-key", value_name = "VKEY")]
        witness_keys: Vec<String>,
    },
    /// Print a proof, as JSON, against the store's signed checkpoint
    /// notes: `--record ID` that a record is in the Merkle tree,
    /// `--consistency A B` that the checkpoint of tree size B extends the
    /// one of tree size A. The store is verified first.
    Prove {
        #[arg(value_name = "PATH")]
        path: PathBuf,
        /// The record to prove (its `id`).
        #[arg(long, value_name = "ID", conflicts_with = "consistency")]
        record: Option<String>,
        /// With --record: the checkpoint (by tree size) to prove against;
        /// default the last.
        #[arg(long, value_name = "N", requires = "record")]
        tree_size: Option<u64>,
        /// Two checkpoints' tree sizes, the earlier first.
        #[arg(long, num_args = 2, value_names = ["A", "B"])]
        consistency: Option<Vec<u64>>,
        /// Public key (hex, or a file holding it) the store must be signed with.
        #[arg(long, value_name = "KEY")]
        key: Option<String>,
    },
    /// Check one org's export (`export --proofs`) with the public key alone.
    VerifyExport {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Public key (hex, or a file holding it) of the log.
        #[arg(long, value_name = "KEY")]
        key: String,
        /// A witness's verifier key whose cosignature the export's end
        /// checkpoint must carry (repeatable).
        #[arg(long = "witness-key", value_name = "VKEY")]
        witness_keys: Vec<String>,
    },
    /// Check a proof `prove` printed with the public key alone.
    VerifyProof {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Public key (hex, or a file holding it) of the log.
        #[arg(long, value_name = "KEY")]
        key: String,
    },
    /// Print the public key of the checkpoint signing key (hex).
    Pubkey {
        #[arg(short, long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Print the checkpoint notes' verifier key instead
        /// (`palisade/REPLICA+KEY_ID+BASE64`, c2sp.org/signed-note), the
        /// form a witness is configured with.
        #[arg(long)]
        vkey: bool,
    },
    /// Rotate the checkpoint key of a stopped gateway's store: append a
    /// `key_rotation` record signed by the current key (`[evidence] key`)
    /// naming the new one (created 0600 when missing), and seal with the
    /// new key; then set `[evidence] key` to the new file and start.
    RotateKey {
        #[arg(short, long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// The new key's file.
        #[arg(long, value_name = "FILE")]
        new_key: PathBuf,
    },
    /// Print decision and close records that match every filter given.
    /// A fleet's chains are verified first and merged by time; each record
    /// gains a `replica` field.
    Query {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        filter: FilterArgs,
        /// A tab-separated table instead of JSON Lines.
        #[arg(long)]
        table: bool,
        #[command(flatten)]
        fleet: FleetArgs,
    },
    /// What was denied, per org: each name or address with its counts by
    /// reason, first and last seen, clients, and a hint (the rule that
    /// would allow it, or why none should).
    Summary(super::summary::Args),
    /// Export decision and close records in another schema; or, with
    /// `--org O --proofs --out DIR`, one org's records for a window with
    /// the proofs that they are in the signed log and none is left out.
    Export {
        #[arg(required = true, value_name = "PATH")]
        paths: Vec<PathBuf>,
        /// Output schema: ocsf (OCSF 1.x JSON Lines).
        #[arg(long, required_unless_present = "proofs")]
        format: Option<ExportFormat>,
        /// One org's verifiable export (needs --org and --out).
        #[arg(long, requires_all = ["out"], conflicts_with = "format")]
        proofs: bool,
        /// With --proofs: the directory to write the export into.
        #[arg(long, value_name = "DIR", requires = "proofs")]
        out: Option<PathBuf>,
        #[command(flatten)]
        filter: FilterArgs,
        #[command(flatten)]
        fleet: FleetArgs,
    },
}

/// Schemas of `evidence export --format`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExportFormat {
    Ocsf,
}

/// Checkpoint keys: one chain's, or each replica's.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct KeyArgs {
    /// Public key (hex, or a file holding it) every checkpoint must be
    /// signed with; REPLICA=KEY pins one replica's (repeatable).
    #[arg(long, value_name = "[REPLICA=]KEY")]
    pub key: Vec<String>,
    /// A file of `REPLICA HEX` lines pinning each replica's key.
    #[arg(long, value_name = "FILE")]
    pub keys: Option<PathBuf>,
    /// Accept a replica with no pinned key while others have one (its
    /// headers' key is used: consistency, not origin).
    #[arg(long)]
    pub allow_unpinned: bool,
}

impl KeyArgs {
    /// The pins, or 2 naming the bad key, file or line.
    pub fn pins(&self) -> Result<fleet::Pins, CliError> {
        let mut pins = fleet::Pins {
            allow_unpinned: self.allow_unpinned,
            ..fleet::Pins::default()
        };
        let bad = |m: String| CliError::new(Status::BadInput, m);
        for arg in &self.key {
            match fleet::split_pin(arg) {
                (Some(name), text) => {
                    let k = parse_key(text)
                        .map_err(|_| bad(format!("--key {name}=...: not an Ed25519 public key (64 hex characters, or a file holding them)")))?;
                    if pins.by_replica.insert(name.to_string(), k).is_some() {
                        return Err(bad(format!("--key: replica {name:?} pinned twice")));
                    }
                }
                (None, text) => {
                    if pins.single.replace(parse_key(text)?).is_some() {
                        return Err(bad(
                            "--key given twice without a replica: pin each with --key REPLICA=HEX"
                                .into(),
                        ));
                    }
                }
            }
        }
        if let Some(file) = &self.keys {
            let name = file.display().to_string();
            let text = std::fs::read_to_string(file).map_err(|e| bad(format!("{name}: {e}")))?;
            let lines = fleet::parse_keys_file(&text, &name).map_err(|e| bad(e.0))?;
            for (replica, hex, line) in lines {
                let k = chain::parse_pubkey(&hex).ok_or_else(|| {
                    bad(format!(
                        "{name}:{line}: not an Ed25519 public key (64 hex characters)"
                    ))
                })?;
                if pins.by_replica.insert(replica.clone(), k).is_some() {
                    return Err(bad(format!(
                        "{name}:{line}: replica {replica:?} is also pinned with --key"
                    )));
                }
            }
        }
        Ok(pins)
    }
}

/// What `query`/`export` accept of a fleet.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct FleetArgs {
    #[command(flatten)]
    pub keys: KeyArgs,
    /// Print a fleet's records even when a chain is broken or missing
    /// (each named on stderr); without it such a fleet is refused.
    #[arg(long)]
    pub include_broken: bool,
}

/// The record selection of `evidence query` and `evidence export`
/// ([`Selection`]).
#[derive(clap::Args, Debug)]
pub struct FilterArgs {
    /// Org name (`unknown` for clients of no org).
    #[arg(long)]
    pub org: Option<String>,
    /// allow or deny.
    #[arg(long, value_parser = select::parse_decision)]
    pub decision: Option<&'static str>,
    /// Reason code, e.g. no_matching_rule.
    #[arg(long, value_parser = select::parse_reason)]
    pub reason: Option<Reason>,
    /// Records at or after this RFC 3339 time.
    #[arg(long, value_name = "T", value_parser = select::parse_time)]
    pub since: Option<SystemTime>,
    /// Records at or before this RFC 3339 time.
    #[arg(long, value_name = "T", value_parser = select::parse_time)]
    pub until: Option<SystemTime>,
    /// Target host glob: a name, or '*.example.com' for the names below it
    /// (`*` any run of characters, `?` one).
    #[arg(long, value_parser = select::parse_host)]
    pub host: Option<String>,
    /// The record a client was shown (`record=REF` in a 403 body,
    /// `Proxy-Status` or DNS error text), or a record id; also matches
    /// that decision's close record.
    #[arg(long = "ref", visible_alias = "id", value_name = "REF")]
    pub reference: Option<String>,
}

impl FilterArgs {
    /// The selection the flags ask for.
    fn selection(self) -> Selection {
        Selection {
            org: self.org,
            decision: self.decision,
            reason: self.reason,
            since: self.since,
            until: self.until,
            host: self.host,
            record: self.reference.map(|r| r.trim().to_ascii_lowercase()),
            ..Selection::default()
        }
    }
}

/// `--key`: an Ed25519 public key in hex, or a file holding it; 2 when it
/// is neither.
pub fn parse_key(arg: &str) -> Result<VerifyingKey, CliError> {
    let text = std::fs::read_to_string(arg).unwrap_or_else(|_| arg.to_string());
    chain::parse_pubkey(&text).ok_or_else(|| {
        CliError::new(
            Status::BadInput,
            "--key: not an Ed25519 public key (64 hex characters, or a file holding them)",
        )
    })
}

/// `verify`: 0 intact, 1 broken (any replica of a fleet), 2 bad key or
/// fleet. `pubkey`: 1 without a key. `query`/`export`: 1 on an unreadable
/// path or a fleet with a broken or missing chain, 2 on a bad time, key or
/// fleet.
pub fn run(command: Command) -> Result<(), CliError> {
    match command {
        Command::Verify {
            paths,
            keys,
            allow_unsealed,
            witness_keys,
        } => {
            let witnesses = parse_witness_keys(&witness_keys)?;
            verify(&paths, &keys, allow_unsealed)?;
            verify_witnessed(&paths, &witnesses)
        }
        Command::Pubkey { config, vkey } => pubkey(&config, vkey),
        Command::RotateKey { config, new_key } => rotate_key(&config, &new_key),
        Command::Prove {
            path,
            record,
            tree_size,
            consistency,
            key,
        } => prove(&path, record, tree_size, consistency, key),
        Command::VerifyProof { file, key } => verify_proof(&file, &key),
        Command::Query {
            paths,
            filter,
            table,
            fleet,
        } => {
            let output = if table {
                query::Output::Table
            } else {
                query::Output::JsonLines
            };
            records(&paths, filter, output, &fleet)
        }
        Command::Summary(args) => super::summary::run(args),
        Command::Export {
            paths,
            proofs: true,
            out: Some(out),
            filter,
            fleet,
            ..
        } => org_export(&paths, filter, &out, &fleet),
        Command::Export {
            paths,
            filter,
            fleet,
            ..
        } => records(&paths, filter, query::Output::Ocsf, &fleet),
        Command::VerifyExport {
            dir,
            key,
            witness_keys,
        } => {
            let witnesses = parse_witness_keys(&witness_keys)?;
            verify_export(&dir, &key)?;
            if witnesses.is_empty() {
                return Ok(());
            }
            verdict(&dir.display(), witness::check_export(&dir, &witnesses))
        }
    }
}

/// `--witness-key` values, or 2.
fn parse_witness_keys(keys: &[String]) -> Result<Vec<note::Vkey>, CliError> {
    keys.iter()
        .map(|k| {
            note::Vkey::parse(k, note::COSIGNATURE_V1).map_err(|e| {
                CliError::new(Status::BadInput, format_args!("--witness-key {k:?} {e}"))
            })
        })
        .collect()
}

/// `verify --witness-key`: after the chain verified, every checkpoint is
/// covered by each witness's cosignature (1 naming the checkpoint if not).
fn verify_witnessed(paths: &[PathBuf], witnesses: &[note::Vkey]) -> Result<(), CliError> {
    if witnesses.is_empty() {
        return Ok(());
    }
    let [path] = paths else {
        return Err(CliError::new(
            Status::BadInput,
            "--witness-key: give one chain (a replica's directory)",
        ));
    };
    verdict(&path.display(), witness::check_store(path, witnesses))
}

/// The fleet `paths` name, or 2.
fn resolve(paths: &[PathBuf]) -> Result<fleet::Fleet, CliError> {
    fleet::resolve(paths).map_err(|e| CliError::new(Status::BadInput, e))
}

fn verify(paths: &[PathBuf], keys: &KeyArgs, allow_unsealed: bool) -> Result<(), CliError> {
    let pins = keys.pins()?;
    if !fleet::is_fleet(paths) && pins.by_replica.is_empty() {
        // One chain: what `evidence verify PATH` has always printed.
        let opts = verify::Options {
            key: pins.single,
            allow_unsealed,
        };
        return match verify::verify_with(&paths[0], &opts) {
            Ok(verified) => {
                sayln!("{verified}");
                Ok(())
            }
            Err(e) => {
                sayln!("broken: {e}");
                Err(CliError::bare(Status::Failed, e))
            }
        };
    }
    let fleet = resolve(paths)?;
    let opts = fleet::Options {
        pins,
        allow_unsealed,
    };
    let checked = fleet::check(&fleet, &opts).map_err(|e| CliError::new(Status::BadInput, e))?;
    sayln!("{}", checked.text());
    if checked.ok() {
        Ok(())
    } else {
        Err(CliError::silent(Status::Failed))
    }
}

/// `prove`: 0 with the proof on stdout; 1 on a broken store or a record
/// or checkpoint it does not hold; 2 on bad arguments.
fn prove(
    path: &Path,
    record: Option<String>,
    tree_size: Option<u64>,
    consistency: Option<Vec<u64>>,
    key: Option<String>,
) -> Result<(), CliError> {
    let key = key.as_deref().map(parse_key).transpose()?;
    let opts = verify::Options {
        key,
        allow_unsealed: true,
    };
    if let Err(e) = verify::verify_with(path, &opts) {
        return Err(CliError::new(
            Status::Failed,
            format_args!("refusing to prove from a store that fails verify: {e}"),
        ));
    }
    let made = match (record, consistency.as_deref()) {
        (Some(id), None) => proof::prove_inclusion(path, id.trim(), tree_size),
        (None, Some([a, b])) => proof::prove_consistency(path, *a, *b),
        _ => {
            return Err(CliError::new(
                Status::BadInput,
                "prove: give --record ID or --consistency A B",
            ))
        }
    };
    let p = made.map_err(|e| CliError::new(Status::Failed, e))?;
    sayln!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
    Ok(())
}

/// `export --proofs`: 0 with the export written and checked; 1 on a
/// broken store or nothing to prove; 2 on bad arguments.
fn org_export(
    paths: &[PathBuf],
    filter: FilterArgs,
    out: &Path,
    fleet: &FleetArgs,
) -> Result<(), CliError> {
    let [path] = paths else {
        return Err(CliError::new(
            Status::BadInput,
            "export --proofs: give one chain (a replica's directory)",
        ));
    };
    let key = fleet.keys.pins()?.single;
    let f = filter.selection();
    let org = f
        .org
        .clone()
        .ok_or_else(|| CliError::new(Status::BadInput, "export --proofs: give --org ORG"))?;
    let opts = verify::Options {
        key,
        allow_unsealed: true,
    };
    let summary = verify::verify_with(path, &opts).map_err(|e| {
        CliError::new(
            Status::Failed,
            format_args!("refusing to export from a store that fails verify: {e}"),
        )
    })?;
    let window = export::Window {
        since: f.since,
        until: f.until,
    };
    let made = export::export(path, &org, &window).map_err(|e| CliError::new(Status::Failed, e))?;
    export::write(out, &made)
        .map_err(|e| CliError::new(Status::Failed, format_args!("{}: {e}", out.display())))?;
    witness::export_cosignatures(path, out).map_err(|e| {
        CliError::new(
            Status::Failed,
            format_args!("{}: witness cosignatures: {e}", out.display()),
        )
    })?;
    // The export is checked as an assessor will, with the store's key.
    let k = key.or_else(|| summary.key.as_deref().and_then(chain::parse_pubkey));
    let checked = k
        .ok_or_else(|| "no key to check it with".to_string())
        .and_then(|k| export::check(out, &k));
    match checked {
        Ok(what) => {
            sayln!("{what}");
            if made.unsigned > 0 {
                sayln!("note: {} records of org {org} after the last checkpoint are not in the export (no checkpoint signs them yet)", made.unsigned);
            }
            Ok(())
        }
        Err(e) => Err(CliError::new(
            Status::Failed,
            format_args!(
                "the export written to {} does not verify: {e}",
                out.display()
            ),
        )),
    }
}

/// `verify-export`: 0 when the export holds (and what it proves), 1 when
/// it does not (and why), 2 on a bad key.
fn verify_export(dir: &Path, key: &str) -> Result<(), CliError> {
    let key = parse_key(key)?;
    verdict(&dir.display(), export::check(dir, &key))
}

/// A check's verdict: what it proves (0), or `broken: NAME: why` (1).
fn verdict(name: &dyn std::fmt::Display, checked: Result<String, String>) -> Result<(), CliError> {
    match checked {
        Ok(what) => {
            sayln!("{what}");
            Ok(())
        }
        Err(e) => {
            sayln!("broken: {name}: {e}");
            Err(CliError::bare(Status::Failed, format!("{name}: {e}")))
        }
    }
}

/// `verify-proof`: 0 when the proof holds (and what it proves), 1 when it
/// does not (and why), 2 on a bad key or an unreadable file.
fn verify_proof(file: &Path, key: &str) -> Result<(), CliError> {
    let key = parse_key(key)?;
    let name = file.display();
    let bad = |m: String| CliError::new(Status::BadInput, m);
    let len = std::fs::metadata(file)
        .map_err(|e| bad(format!("{name}: {e}")))?
        .len();
    if len > proof::MAX_PROOF {
        return Err(CliError::new(
            Status::Failed,
            format_args!("broken: {name}: {len} bytes is no proof Palisade writes"),
        ));
    }
    let text = std::fs::read(file).map_err(|e| bad(format!("{name}: {e}")))?;
    let checked = serde_json::from_slice(&text)
        .map_err(|e| format!("not JSON: {e}"))
        .and_then(|v| proof::check(&v, &key));
    verdict(&name, checked)
}

/// The subdirectories of a fleet tree (one per replica).
fn replica_dirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// `rotate-key`: 0 once the rotation is recorded and sealed; 1 otherwise.
fn rotate_key(config: &Path, new_key: &Path) -> Result<(), CliError> {
    let config = load_config(config, Status::Failed)?;
    let failed = |e: std::io::Error| CliError::new(Status::Failed, e);
    let next = key::load_or_create(new_key).map_err(failed)?;
    if config.evidence.key == new_key {
        return Err(CliError::new(
            Status::BadInput,
            "--new-key is the key in use ([evidence] key)",
        ));
    }
    let ev = crate::evidence::Evidence::start(&config.evidence).map_err(failed)?;
    let old = ev.public_key().to_string();
    let rotated = ev.rotate_key(next.clone());
    let sealed = super::runtime()?.block_on(ev.seal());
    rotated.map_err(failed)?;
    if !sealed {
        return Err(CliError::new(
            Status::Failed,
            "the rotation is written but the store could not be sealed",
        ));
    }
    sayln!(
        "rotated: key {old} -> {} (a key_rotation record signed by the old key, sealed by the new one) in {}; now set [evidence] key = {:?} and start the gateway",
        key::public_hex(&next),
        config.evidence.dir.display(),
        new_key.display().to_string()
    );
    Ok(())
}

fn pubkey(config: &Path, vkey: bool) -> Result<(), CliError> {
    let config = load_config(config, Status::Failed)?;
    let k = key::load(&config.evidence.key).map_err(|e| {
        CliError::new(
            Status::Failed,
            format_args!("{e} (palisade run creates it on first start)"),
        )
    })?;
    if vkey {
        let origin = note::origin(&config.evidence.replica);
        sayln!("{}", note::vkey(&origin, &k.verifying_key()));
    } else {
        sayln!("{}", key::public_hex(&k));
    }
    Ok(())
}

fn records(
    paths: &[PathBuf],
    filter: FilterArgs,
    output: query::Output,
    args: &FleetArgs,
) -> Result<(), CliError> {
    let filter = filter.selection();
    let pins = args.keys.pins()?;
    // A window that retention cut: say so, and where the rest is.
    if filter.since.is_some() || filter.until.is_some() {
        for dir in paths.iter().filter(|p| p.is_dir()) {
            for sub in std::iter::once(dir.clone()).chain(replica_dirs(dir)) {
                if let Some(note) = verify::retention_cut(&sub, filter.since, filter.until) {
                    eprintln!("palisade: {note}");
                }
            }
        }
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if !fleet::is_fleet(paths) && pins.by_replica.is_empty() {
        // One chain: read as it is, as always (run `verify` first).
        let path = &paths[0];
        let records = query::read_records(path).map(|r| r.map(|s| (None, s)));
        return query::print(records, false, &filter, output, &mut out)
            .and_then(|_| out.flush())
            .map_err(|e| output_failed(&e, format_args!("{}: {e}", path.display())));
    }
    let fleet = resolve(paths)?;
    // A live fleet is not sealed: only what verify calls broken (or a
    // missing chain, or an unpinned one) stops a query.
    let opts = fleet::Options {
        pins,
        allow_unsealed: true,
    };
    let checked = fleet::check(&fleet, &opts).map_err(|e| CliError::new(Status::BadInput, e))?;
    if !checked.ok() {
        for c in checked.failing() {
            eprintln!("palisade: {}", c.line());
        }
        if !args.include_broken {
            let names: Vec<&str> = checked.failing().map(|c| c.name.as_str()).collect();
            return Err(CliError::new(
                Status::Failed,
                format_args!(
                    "refusing to print the fleet's records: replica {} failed verification (--include-broken prints the records anyway)",
                    names.join(", ")
                ),
            ));
        }
        eprintln!(
            "palisade: --include-broken: printing the records of every chain that could be read"
        );
    }
    let records = fleet::read_merged(&fleet.chains).map(|r| r.map(|t| (Some(t.replica), t.stored)));
    query::print(records, true, &filter, output, &mut out)
        .and_then(|_| out.flush())
        .map_err(|e| output_failed(&e, &e))
}
