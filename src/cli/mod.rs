//! The `palisade` command line: one module per command, each with its
//! arguments (clap) and a handler that returns `Result<(), CliError>`;
//! the work itself is done by the library ([`crate::analysis`] for the
//! read side: summary, draft, replay, explain), the command reads its
//! input, calls it and prints.
//! `main` parses, calls the handler and maps a [`CliError`] to the exit
//! status in one place; no handler exits the process itself.
//!
//! Exit statuses, as the README's "Commands" table documents them: 0 the
//! command did its work; 1 ([`Status::Failed`]) it failed or found what it
//! reports (an invalid config, broken evidence, a probe finding); 2
//! ([`Status::BadInput`]) the evidence and probe commands were given input
//! they cannot use (a flag value, plan or observations file).

use std::fmt::Display;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::{self, Config};
use crate::evidence::select::Selection;
use crate::evidence::{query, Record};

/// `print!` to stdout through [`stdout`]: a write that fails is the
/// command's failure (`?`), not a panic.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::stdout(format_args!($($arg)*))?
    };
}

/// `println!` to stdout through [`stdout`].
macro_rules! sayln {
    ($($arg:tt)*) => {
        $crate::cli::stdout(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

pub mod approvals;
pub mod ca;
pub mod check;
pub mod draft;
pub mod evidence;
pub mod explain;
pub mod probe;
pub mod replay;
pub mod run;
pub mod summary;
pub mod tail;
pub mod token;

/// The config file `-c` names when it is not given.
pub const DEFAULT_CONFIG: &str = "config/palisade.toml";

/// The exit status of a command that did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// 1: the command failed, or found what it reports.
    Failed = 1,
    /// 2: input the command cannot use.
    BadInput = 2,
}

/// A command that did not succeed: its exit status and what to say on
/// stderr. Or one whose reader went away ([`CliError::reader_gone`]): it
/// stops there, quietly, with exit status 0.
#[derive(Debug)]
pub struct CliError {
    status: Status,
    message: Option<String>,
    reader_gone: bool,
}

impl CliError {
    /// `palisade: {message}` on stderr.
    pub fn new(status: Status, message: impl Display) -> CliError {
        CliError {
            status,
            message: Some(format!("palisade: {message}")),
            reader_gone: false,
        }
    }

    /// `message` on stderr as it is: for messages that name their own
    /// source (`FILE:LINE:COL: ...`).
    pub fn bare(status: Status, message: impl Display) -> CliError {
        CliError {
            status,
            message: Some(message.to_string()),
            reader_gone: false,
        }
    }

    /// Nothing more on stderr: the command's output has said it.
    pub fn silent(status: Status) -> CliError {
        CliError {
            status,
            message: None,
            reader_gone: false,
        }
    }

    /// The reader of stdout went away (`palisade … | head`): the command
    /// stops where it is, says nothing, and exits 0, as `head` asked for no
    /// more (like a command that dies of SIGPIPE, without the signal).
    pub fn reader_gone() -> CliError {
        CliError {
            status: Status::Failed,
            message: None,
            reader_gone: true,
        }
    }

    /// Whether the command stopped because its reader went away.
    pub fn is_reader_gone(&self) -> bool {
        self.reader_gone
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// The process exit code: 0 for a reader that went away.
    pub fn code(&self) -> u8 {
        if self.reader_gone {
            0
        } else {
            self.status as u8
        }
    }

    /// What to print on stderr, if anything.
    pub fn message(&self) -> Option<&str> {
        self.message.as_deref()
    }
}

/// Load and validate the config at `path`; when it is unusable, every
/// error as `FILE:LINE:COL: message`, with exit status `status`.
pub fn load_config(path: &Path, status: Status) -> Result<Config, CliError> {
    config::load(path).map_err(|errors| CliError::bare(status, errors))
}

/// `value` as pretty JSON on stdout (`--json`).
pub fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::new(Status::Failed, e))?;
    sayln!("{text}");
    Ok(())
}

/// Whether stdout's reader has gone (see [`stdout`]).
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Write to stdout. `print!` panics when the reader has gone (`palisade
/// explain … | head`); here a closed pipe is no error: the rest of the
/// output is dropped and the command ends with the status its work ends
/// with, so `head` never turns a failure (a broken chain `verify` found)
/// into a success, nor a success into a failure. A command that would go on
/// printing for ever (`tail`) asks [`stdout_gone`] and stops. Any other
/// write error is said on stderr, status 1.
pub(crate) fn stdout(args: std::fmt::Arguments<'_>) -> Result<(), CliError> {
    use std::io::Write;
    if stdout_gone() {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_GONE.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(CliError::new(Status::Failed, format_args!("stdout: {e}"))),
    }
}

/// Whether a write to stdout met a closed pipe: its reader has gone.
pub(crate) fn stdout_gone() -> bool {
    STDOUT_GONE.load(Ordering::Relaxed)
}

/// A command whose streamed output (`evidence query`, which writes through
/// its own buffer) could not be written: quietly with status 0 when the
/// reader closed the pipe, else with `message` and status 1.
pub(crate) fn output_failed(e: &std::io::Error, message: impl Display) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CliError::reader_gone()
    } else {
        CliError::new(Status::Failed, message)
    }
}

/// The decision records under `path` that `selection` selects, or 1
/// naming what could not be read.
pub(crate) fn decisions(path: &Path, selection: &Selection) -> Result<Vec<Record>, CliError> {
    if !path.exists() {
        return Err(CliError::new(
            Status::Failed,
            format_args!("{}: no such evidence file or directory", path.display()),
        ));
    }
    query::decisions(path, selection)
        .map_err(|e| CliError::new(Status::Failed, format_args!("cannot read evidence: {e}")))
}

/// The async runtime for the commands that do network work.
pub fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            CliError::new(
                Status::Failed,
                format_args!("cannot start the async runtime: {e}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_codes_and_messages() {
        let f = CliError::new(Status::BadInput, "bad plan");
        assert_eq!((f.code(), f.message()), (2, Some("palisade: bad plan")));
        let f = CliError::bare(Status::Failed, "a.toml:3:1: unknown field");
        assert_eq!(f.message(), Some("a.toml:3:1: unknown field"));
        assert_eq!(f.status(), Status::Failed);
        assert_eq!(CliError::silent(Status::Failed).message(), None);
        let gone = CliError::reader_gone();
        assert_eq!((gone.code(), gone.message()), (0, None));
        assert!(gone.is_reader_gone() && !f.is_reader_gone());
    }

    #[test]
    fn a_closed_pipe_is_a_quiet_end_and_other_write_errors_are_said() {
        let pipe = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let gone = output_failed(&pipe, "stdout: broken pipe");
        assert_eq!((gone.code(), gone.message()), (0, None));
        let full = std::io::Error::other("no space left on device");
        let f = output_failed(&full, "stdout: no space left on device");
        assert_eq!(
            (f.code(), f.message()),
            (1, Some("palisade: stdout: no space left on device"))
        );
    }

    #[test]
    fn unreadable_config_is_reported_at_the_status_given() {
        let f = load_config(Path::new("/nonexistent/palisade.toml"), Status::BadInput)
            .expect_err("no such file");
        assert_eq!(f.code(), 2);
        let m = f.message().unwrap_or_default();
        assert!(
            m.starts_with("/nonexistent/palisade.toml:1:1: cannot read config"),
            "{m}"
        );
    }
}
