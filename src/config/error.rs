//! Configuration errors, each located as `FILE:LINE:COL: message`.

use std::fmt;
use std::ops::Range;

/// One configuration problem, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.path, self.line, self.col, self.message
        )
    }
}

/// All problems found in one configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(src.len());
    let before = src.get(..offset).unwrap_or(src);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let col = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (line, col)
}

/// The problems found so far in one file, each located from a span.
pub(super) struct Errors<'a> {
    path: &'a str,
    src: &'a str,
    list: Vec<ConfigError>,
}

impl<'a> Errors<'a> {
    pub(super) fn new(path: &'a str, src: &'a str) -> Errors<'a> {
        Errors {
            path,
            src,
            list: Vec::new(),
        }
    }

    /// `value` if nothing was found, else every problem.
    pub(super) fn finish<T>(self, value: T) -> Result<T, ConfigErrors> {
        if self.list.is_empty() {
            Ok(value)
        } else {
            Err(self.into_errors())
        }
    }

    pub(super) fn into_errors(self) -> ConfigErrors {
        ConfigErrors(self.list)
    }

    /// Problems found in another file (the baseline), located there.
    pub(super) fn absorb(&mut self, other: ConfigErrors) {
        self.list.extend(other.0);
    }

    /// Where the byte at `offset` is, as `FILE:LINE:COL`.
    pub(super) fn locate(&self, offset: usize) -> super::model::ConfigLocation {
        let (line, col) = line_col(self.src, offset);
        super::model::ConfigLocation {
            path: self.path.to_string(),
            line,
            col,
        }
    }

    pub(super) fn at(&mut self, span: Range<usize>, message: impl Into<String>) {
        let (line, col) = line_col(self.src, span.start);
        self.list.push(ConfigError {
            path: self.path.to_string(),
            line,
            col,
            message: message.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_chars() {
        assert_eq!(line_col("ab\ncdé\nx", 0), (1, 1));
        assert_eq!(line_col("ab\ncdé\nx", 3), (2, 1));
        assert_eq!(line_col("ab\ncdé\nx", 8), (3, 1));
        assert_eq!(line_col("ab\ncdé\nx", 7), (2, 4));
    }
}
