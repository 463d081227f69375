//! The edge: `nft` run as a child process, off the async runtime, within
//! a timeout, its output bounded.
//!
//! - What the kernel has loaded: `nft -j list ruleset`.
//! - What the file defines: the file loaded into a scratch network
//!   namespace of its own (`unshare --net`, or, where that is not
//!   permitted, `unshare --user --map-root-user --net`) and listed there
//!   with the same `nft -j list ruleset`. Both sides are then in the one
//!   form the kernel prints (sets merged, priorities as numbers, prefixes
//!   and ranges as the kernel stores them), so that they compare equal
//!   exactly when the kernel holds what the file says; `nft --check`
//!   validates a file but prints nothing of it, and the file's own JSON
//!   (`nft -j -f`) is the input as written, which the kernel's listing
//!   does not repeat. The scratch namespace is gone when the command ends.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::compare::Ruleset;

/// How long one `nft` (or scratch namespace) run may take.
pub(crate) const NFT_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a listing read (a larger ruleset is an error, not a truncation).
const MAX_OUTPUT: u64 = 32 * 1024 * 1024;
/// How often a running child is polled for its exit.
const POLL: Duration = Duration::from_millis(5);

/// `nft` could not say what is loaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NftError {
    #[error("cannot run {what}: {source}")]
    Spawn {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{what} took longer than {timeout:?}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    #[error("{what} printed more than {MAX_OUTPUT} bytes")]
    TooLarge { what: &'static str },
    #[error("{what} failed: {stderr}")]
    Failed { what: &'static str, stderr: String },
    #[error("{what}: {source}")]
    Listing {
        what: &'static str,
        source: super::compare::NotARuleset,
    },
}

/// The ruleset the kernel has loaded now (blocking).
pub(crate) fn loaded(timeout: Duration) -> Result<Ruleset, NftError> {
    let what = "nft -j list ruleset";
    let out = run(
        Command::new("nft").args(["-j", "list", "ruleset"]),
        what,
        timeout,
    )?;
    Ruleset::from_json(&out).map_err(|source| NftError::Listing { what, source })
}

/// The ruleset `file` defines, as the kernel would list it (blocking).
/// `Failed` carries nft's own message, which locates a syntax error in
/// the file (`FILE:LINE:COL-COL: Error: ...`).
pub(crate) fn defined(file: &Path, timeout: Duration) -> Result<Ruleset, NftError> {
    let what = "nft -f (in a scratch network namespace)";
    // `nft -f FILE && nft -j list ruleset`, both in the one new namespace;
    // the file's path is an argument, never part of the script.
    let script = "nft -f \"$1\" && exec nft -j list ruleset";
    let mut last = None;
    for ns in [&["--net"][..], &["--user", "--map-root-user", "--net"][..]] {
        let mut cmd = Command::new("unshare");
        cmd.args(ns)
            .args(["--", "sh", "-c", script, "sh"])
            .arg(file);
        match run(&mut cmd, what, timeout) {
            Ok(out) => {
                return Ruleset::from_json(&out)
                    .map_err(|source| NftError::Listing { what, source })
            }
            // The namespace could not be made this way: try the next.
            Err(NftError::Failed { stderr, .. }) if stderr.starts_with("unshare:") => {
                last = Some(NftError::Failed { what, stderr });
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or(NftError::Failed {
        what,
        stderr: "no way to make a network namespace".into(),
    }))
}

/// Run `cmd`, its stdout read to the end (at most [`MAX_OUTPUT`]), killed
/// past `timeout`.
fn run(cmd: &mut Command, what: &'static str, timeout: Duration) -> Result<Vec<u8>, NftError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| NftError::Spawn { what, source })?;
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(pipe) = pipe {
                let _ = pipe.take(MAX_OUTPUT + 1).read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = reader(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = reader(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(NftError::Timeout { what, timeout });
            }
        }
    };
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    if !status.success() {
        let stderr = String::from_utf8_lossy(&err);
        let stderr = stderr.trim();
        return Err(NftError::Failed {
            what,
            stderr: if stderr.is_empty() {
                status.to_string()
            } else {
                stderr.to_string()
            },
        });
    }
    if out.len() as u64 > MAX_OUTPUT {
        return Err(NftError::TooLarge { what });
    }
    Ok(out)
}

/// nft's first located error, `(FILE, LINE, COL, message)`, from its
/// stderr (`FILE:LINE:COL-COL: Error: message`).
pub(crate) fn located(stderr: &str) -> Option<(String, usize, usize, String)> {
    stderr.lines().find_map(|l| {
        let (at, message) = l.split_once(": Error: ")?;
        let mut parts = at.rsplitn(3, ':');
        let cols = parts.next()?;
        let line = parts.next()?.parse().ok()?;
        let file = parts.next()?;
        let col = cols.split('-').next()?.parse().ok()?;
        Some((file.to_string(), line, col, message.trim().to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nft_errors_are_located_in_the_file() {
        let stderr = "/etc/gw.nft:12:5-9: Error: syntax error, unexpected string\n    bogus rule\n    ^^^^^\n";
        assert_eq!(
            located(stderr),
            Some((
                "/etc/gw.nft".into(),
                12,
                5,
                "syntax error, unexpected string".into()
            ))
        );
        assert_eq!(
            located("Error: Could not process rule: Operation not permitted"),
            None
        );
        assert_eq!(located("a:b: Error: x"), None);
    }
}
