//! Evidence: one JSON object per decision or close, written as JSON Lines and
//! handed to the operating system (a completed `write(2)`) before the caller
//! lets any allowed byte flow. A failed write makes the writer unhealthy and
//! the caller denies `evidence_unavailable`: nothing is allowed unrecorded.

pub mod verify;

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::policy::{Reason, Verdict};

/// `kind` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Tcp,
    Http,
    Dns,
}

/// `mode` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Explicit,
    Transparent,
    Dns,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Explicit => "explicit",
            Mode::Transparent => "transparent",
            Mode::Dns => "dns",
        }
    }
}

/// `event` of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    Decision,
    Close,
}

/// One evidence record. The CONTRACT fields are always present (null where
/// unknown); the others appear only on the records they belong to.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub id: String,
    pub ts: String,
    pub kind: Kind,
    pub event: Event,
    pub org: Option<Arc<str>>,
    pub client: Option<SocketAddr>,
    pub mode: Mode,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub sni: Option<String>,
    pub ip: Option<IpAddr>,
    pub decision: &'static str,
    pub reason: Reason,
    pub rule: Option<Arc<str>>,
    pub policy: Arc<str>,
    /// HTTP method and path of an absolute-form request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// What went wrong after an allow (upstream connect failure, ...), or the detail of a deny.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Close records: the decision record's id and the connection's totals.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_up: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_down: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// DNS records: the query type, the answers given (as text), and whether
    /// anything was sent upstream for this query.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qtype: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answers: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<bool>,
}

impl Record {
    /// A decision record from a verdict; `id` and `ts` are set when written.
    pub fn decision(
        kind: Kind,
        mode: Mode,
        client: SocketAddr,
        verdict: &Verdict,
        policy: &Arc<str>,
    ) -> Record {
        // `policy` is the hash of the policy that decided.
        Record {
            id: String::new(),
            ts: String::new(),
            kind,
            event: Event::Decision,
            org: verdict.org.as_ref().map(|o| o.name.clone()),
            client: Some(client),
            mode,
            host: None,
            port: None,
            sni: None,
            ip: None,
            decision: verdict.reason.decision(),
            reason: verdict.reason,
            rule: verdict.rule.clone(),
            policy: policy.clone(),
            method: None,
            path: None,
            detail: None,
            conn: None,
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            qtype: None,
            answers: None,
            upstream: None,
        }
    }

    /// The close record of the connection this decision record opened.
    pub fn close(&self, bytes_up: u64, bytes_down: u64, duration_ms: u64) -> Record {
        Record {
            id: String::new(),
            ts: String::new(),
            event: Event::Close,
            conn: Some(self.id.clone()),
            bytes_up: Some(bytes_up),
            bytes_down: Some(bytes_down),
            duration_ms: Some(duration_ms),
            detail: None,
            ..self.clone()
        }
    }
}

/// Evidence could not be written.
#[derive(Debug, thiserror::Error)]
#[error("evidence unavailable: {0}")]
pub struct EvidenceError(#[from] io::Error);

/// The evidence writer shared by every listener.
#[derive(Debug)]
pub struct Evidence {
    file: Mutex<File>,
    path: PathBuf,
    id_prefix: String,
    seq: AtomicU64,
    healthy: AtomicBool,
}

impl Evidence {
    /// Create `dir` if needed and open a new segment file in it.
    pub fn open(dir: &Path) -> io::Result<Evidence> {
        std::fs::create_dir_all(dir)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let id_prefix = format!("{:x}{:05x}", now.as_secs(), now.subsec_micros());
        let stamp = humantime::format_rfc3339_seconds(SystemTime::now())
            .to_string()
            .replace(':', "");
        let path = dir.join(format!("palisade-{stamp}-{id_prefix}.jsonl"));
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)?;
        Ok(Evidence {
            file: Mutex::new(file),
            path,
            id_prefix,
            seq: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the last write succeeded.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Assign `id` and `ts` and write the record. When this returns `Ok`
    /// the bytes are with the operating system.
    pub async fn write(&self, record: &mut Record) -> Result<(), EvidenceError> {
        self.write_now(record)
    }

    /// Assign `id` and `ts` and queue the record without waiting for it to
    /// be written; it is never dropped. For records that let nothing through
    /// (close records, refusals under load).
    pub fn submit(&self, record: &mut Record) {
        let _ = self.write_now(record);
    }

    fn write_now(&self, record: &mut Record) -> Result<(), EvidenceError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        record.id = format!("{}-{seq}", self.id_prefix);
        record.ts = humantime::format_rfc3339_micros(SystemTime::now()).to_string();
        let mut line = serde_json::to_vec(record).map_err(io::Error::other)?;
        line.push(b'\n');
        let result = match self.file.lock() {
            Ok(mut file) => file.write_all(&line),
            Err(_) => Err(io::Error::other("evidence writer poisoned")),
        };
        self.healthy.store(result.is_ok(), Ordering::Relaxed);
        let m = crate::metrics::metrics();
        match result {
            Ok(()) => m.evidence_records_total.inc(),
            Err(_) => m.evidence_write_errors_total.inc(),
        }
        result.map_err(EvidenceError)
    }
}
