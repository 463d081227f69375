//! `palisade evidence verify`: read every record of a file or directory and
//! check it is a complete evidence record.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

/// Fields every record carries (null allowed where not known).
const REQUIRED: [&str; 15] = [
    "id", "ts", "kind", "event", "org", "client", "mode", "host", "port", "sni", "ip", "decision",
    "reason", "rule", "policy",
];

/// An intact evidence set.
#[derive(Debug, Default)]
pub struct Summary {
    pub files: usize,
    pub records: u64,
    pub allow: u64,
    pub deny: u64,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "intact: {} records in {} files ({} allow, {} deny decisions)",
            self.records, self.files, self.allow, self.deny
        )
    }
}

/// The first problem found.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct VerifyError {
    pub file: String,
    pub line: u64,
    pub message: String,
}

fn files(path: &Path) -> Result<Vec<PathBuf>, VerifyError> {
    let err = |message: String| VerifyError {
        file: path.display().to_string(),
        line: 0,
        message,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut list: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| err(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    list.sort();
    if list.is_empty() {
        return Err(err("no evidence files (*.jsonl)".into()));
    }
    Ok(list)
}

/// Check every record under `path`.
pub fn verify_path(path: &Path) -> Result<Summary, VerifyError> {
    let mut summary = Summary::default();
    for file in files(path)? {
        summary.files += 1;
        let name = file.display().to_string();
        let f = std::fs::File::open(&file).map_err(|e| VerifyError {
            file: name.clone(),
            line: 0,
            message: e.to_string(),
        })?;
        for (n, line) in BufReader::new(f).lines().enumerate() {
            let lineno = n as u64 + 1;
            let bad = |message: String| VerifyError {
                file: name.clone(),
                line: lineno,
                message,
            };
            let line = line.map_err(|e| bad(e.to_string()))?;
            let value: serde_json::Value =
                serde_json::from_str(&line).map_err(|e| bad(format!("not a JSON record: {e}")))?;
            let obj = value
                .as_object()
                .ok_or_else(|| bad("not a JSON object".into()))?;
            if let Some(missing) = REQUIRED.iter().find(|k| !obj.contains_key(**k)) {
                return Err(bad(format!("record lacks field {missing:?}")));
            }
            summary.records += 1;
            if obj.get("event").and_then(|v| v.as_str()) == Some("decision") {
                match obj.get("decision").and_then(|v| v.as_str()) {
                    Some("allow") => summary.allow += 1,
                    Some("deny") => summary.deny += 1,
                    other => return Err(bad(format!("bad decision {other:?}"))),
                }
            }
        }
    }
    Ok(summary)
}
