//! `palisade draft --evidence DIR --org ORG [-c CONFIG] [--since T]
//! [--until T] [--min-count N] [--wildcard-min N] [--write FILE]
//! [--allow-unsealed]`: the org's proposed allow rules, drafted from what
//! it did ([`draft`]), as `[[org.allow]]` tables to place under its
//! `[[org]]` block (or, with `--write`, the whole config with them
//! inserted there). The evidence is verified first; the draft's counts
//! and self-check go to stderr.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::{load_config, CliError, Status, DEFAULT_CONFIG};
use crate::analysis::draft::{self, Draft, Input};
use crate::evidence::select::{self, Selection};
use crate::evidence::{query, verify, Event, Kind, Record};

/// Arguments of `palisade draft`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The org's evidence (a directory of segments, or one file).
    #[arg(long, value_name = "DIR")]
    pub evidence: PathBuf,
    /// The org to draft for.
    #[arg(long, value_name = "ORG")]
    pub org: String,
    /// The current config: what it allows is left out, what it denies is
    /// never proposed, and the draft is checked inserted into it.
    #[arg(short, long, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Decisions at or after this RFC 3339 time.
    #[arg(long, value_name = "T", value_parser = select::parse_time)]
    pub since: Option<SystemTime>,
    /// Decisions at or before this RFC 3339 time.
    #[arg(long, value_name = "T", value_parser = select::parse_time)]
    pub until: Option<SystemTime>,
    /// Propose a name only when it was seen at least this often.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub min_count: u64,
    /// Propose `*.parent` only for at least this many distinct names below it.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub wildcard_min: usize,
    /// Write the whole config with the rules inserted under the org here
    /// (comments of the original kept) instead of printing the rules.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
    /// Accept evidence whose chain is not sealed (a live instance).
    #[arg(long)]
    pub allow_unsealed: bool,
}

/// Draft, check, print or write. 1 on a bad config, an unknown org,
/// unverifiable or unreadable evidence, host addresses that cannot be
/// listed or a draft that fails its own check; 2 on a bad time (clap).
pub fn run(args: Args) -> Result<(), CliError> {
    let failed = |m: String| CliError::new(Status::Failed, m);
    let config = load_config(&args.config, Status::Failed)?;
    if !config.orgs.iter().any(|o| o.name == args.org) {
        return Err(failed(format!(
            "{}: no org {:?} in the config",
            args.config.display(),
            args.org
        )));
    }
    let opts = verify::Options {
        key: None,
        allow_unsealed: args.allow_unsealed,
    };
    let verified = verify::verify_with(&args.evidence, &opts).map_err(|e| {
        failed(format!(
            "refusing to draft from evidence that fails verification: {e}"
        ))
    })?;
    let host = crate::host::addresses().map_err(|e| failed(e.to_string()))?;
    let window = Selection {
        since: args.since,
        until: args.until,
        ..Selection::default()
    };
    let mut records = super::decisions(&args.evidence, &Selection::org(&args.org))?;
    // Close records: what a suggested volume budget starts from (the
    // busiest hour's bytes of each proposed target).
    records.extend(org_records(
        &args.evidence,
        &args.org,
        &[Event::Close],
        None,
    )?);
    let grants = org_records(&args.evidence, &args.org, GRANT_EVENTS, Some(Kind::Grant))?;
    let original = std::fs::read_to_string(&args.config)
        .map_err(|e| failed(format!("{}: {e}", args.config.display())))?;
    let d = draft::draft(Input {
        config: &config,
        config_path: &args.config,
        config_text: &original,
        org: &args.org,
        host: &host,
        records,
        grants,
        window: &window,
        min_count: args.min_count,
        wildcard_min: args.wildcard_min,
    })
    .map_err(failed)?;
    report(&args, &d, &verified);
    if !d.replays() {
        return Err(failed(
            "the draft failed its own replay (a bug; nothing written)".into(),
        ));
    }
    match &args.write {
        Some(path) => {
            write_file(path, &d.config_text).map_err(|e| failed(format!("{}: {e}", path.display())))
        }
        None => {
            say!("{}", d.fragment);
            Ok(())
        }
    }
}

/// The org's grant records (granted, expired, revoked, used up), in the
/// order written: each is proposed as a commented rule for review.
const GRANT_EVENTS: &[Event] = &[
    Event::Granted,
    Event::Expired,
    Event::Revoked,
    Event::UsedUp,
];

/// The org's records of `events` of `kind`, in the order written.
fn org_records(
    evidence: &Path,
    org: &str,
    events: &'static [Event],
    kind: Option<Kind>,
) -> Result<Vec<Record>, CliError> {
    let mut out = Vec::new();
    for stored in query::read_events(evidence, events) {
        let r = stored
            .map_err(|e| CliError::new(Status::Failed, format_args!("cannot read evidence: {e}")))?
            .record;
        if kind.is_none_or(|k| r.kind == k) && r.org.as_deref() == Some(org) {
            out.push(r);
        }
    }
    Ok(out)
}

/// The draft's counts and its self-check, on stderr.
fn report(args: &Args, d: &Draft, verified: &verify::Findings) {
    eprintln!(
        "palisade: draft for org {:?} from {} decisions ({} records verified{}): {} rules ({} wildcards, {} cidr), {} comments, {} names already allowed, {} below --min-count {}",
        args.org,
        d.counts.decisions,
        verified.records,
        if verified.sealed { "" } else { ", unsealed" },
        d.rules,
        d.wildcards(),
        d.cidrs(),
        d.comments,
        d.counts.already_allowed,
        d.counts.below_min,
        args.min_count
    );
    if d.from_grants > 0 {
        eprintln!(
            "palisade: {} grant(s) proposed as commented rules, for review (the flows they allowed are not drafted from)",
            d.from_grants
        );
    }
    eprintln!(
        "palisade: self-check: the config with the draft passes check; replay: {} of {} drafted flows now allowed, {} of {} explicitly denied flows still denied",
        d.covered.1, d.covered.0, d.kept_denied.1, d.kept_denied.0
    );
}

/// Write `text` to `path` whole (a temporary file renamed over it).
fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("draft-tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}
