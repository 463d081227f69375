//! Configuration, loaded in three steps: [`load`] reads the file,
//! [`from_str`] parses the TOML into the raw serde structs (`raw`,
//! `deny_unknown_fields` everywhere), and validation (`validate`, one file
//! per section) turns them into the typed values of `model`, which are
//! re-exported here.
//!
//! Every problem is reported as `FILE:LINE:COL: message`, naming the bad
//! value; validation collects all problems instead of stopping at the first.
//! Config holds validated data only: how rules, credentials and tokens
//! match traffic is the policy's. It depends on no other module but
//! `proto` (name and path normalisation).

use std::path::Path;

mod ceiling;
mod error;
mod keys;
mod model;
mod raw;
mod timeout;
mod validate;
mod window;

pub use error::{ConfigError, ConfigErrors};
pub use keys::accepted_keys;
pub use model::*;
pub use timeout::*;
pub(crate) use validate::otel_endpoint_problem;
pub use window::{parse_rfc3339, rfc3339, Window};

use error::Errors;
use raw::RawConfig;

/// Read, parse and validate the file at `path`.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let display = path.display().to_string();
    let src = std::fs::read_to_string(path).map_err(|e| {
        ConfigErrors(vec![ConfigError {
            path: display.clone(),
            line: 1,
            col: 1,
            message: format!("cannot read config: {e}"),
        }])
    })?;
    from_str(&src, path)
}

/// Parse and validate configuration text; `path` names it in errors and
/// anchors relative paths.
pub fn from_str(src: &str, path: &Path) -> Result<Config, ConfigErrors> {
    let display = path.display().to_string();
    let mut errors = Errors::new(&display, src);
    let raw: RawConfig = match toml::from_str(src) {
        Ok(raw) => raw,
        Err(e) => {
            let span = e.span().unwrap_or(0..0);
            let mut message = e.message().trim().to_string();
            // Name the offending text when the parser's message does not.
            if let Some(text) = src.get(span.clone()).map(str::trim) {
                if !text.is_empty()
                    && text.len() <= 64
                    && !text.contains('\n')
                    && !message.contains(text)
                {
                    message = format!("{message}: `{text}`");
                }
            }
            errors.at(span, message);
            return Err(errors.into_errors());
        }
    };
    let config = validate::validate(raw, path, &mut errors);
    errors.finish(config)
}

#[cfg(test)]
mod test_support {
    use std::path::Path;

    use super::{from_str, Config, ConfigErrors};

    pub(super) fn parse(src: &str) -> Result<Config, ConfigErrors> {
        from_str(src, Path::new("t.toml"))
    }

    pub(super) fn first_error(src: &str) -> String {
        parse(src).unwrap_err().0[0].to_string()
    }

    /// The first error of `src` is located at `at` (`t.toml:LINE:`, or
    /// with the column) and contains `wants`.
    pub(super) fn assert_first_error(src: &str, at: &str, wants: &str) {
        let e = first_error(src);
        assert!(e.starts_with(at) && e.contains(wants), "{e}");
    }

    /// The first error of `BASE` under a `[table]` holding `extra`.
    pub(super) fn first_error_in(table: &str, extra: &str) -> String {
        first_error(&format!("[{table}]\n{extra}{BASE}"))
    }

    pub(super) const BASE: &str = r#"
[proxy]
listen = ["127.0.0.1:3128"]
[admin]
listen = "127.0.0.1:9711"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]
"#;

    /// An org with no listeners, for the interception tests.
    pub(super) const ORG: &str = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n";

    /// Every error message for `ORG` followed by `extra`.
    pub(super) fn errors(extra: &str) -> Vec<String> {
        match from_str(&format!("{ORG}{extra}"), Path::new("t.toml")) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
        }
    }

    /// Each `(extra, line, col, wants)`: `rule` then `extra` under `ORG`
    /// is exactly one error, at `t.toml:LINE:COL`, containing `wants`.
    pub(super) fn assert_located(rule: &str, cases: &[(&str, usize, usize, &str)]) {
        for (extra, line, col, wants) in cases {
            let e = errors(&format!("{rule}{extra}\n"));
            assert_eq!(e.len(), 1, "{extra}: {e:?}");
            assert!(
                e[0].starts_with(&format!("t.toml:{line}:{col}: ")),
                "{extra}: {}",
                e[0]
            );
            assert!(e[0].contains(wants), "{extra}: {}", e[0]);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::test_support::{assert_first_error, first_error, parse, BASE};
    use super::*;

    #[test]
    fn minimal_config_loads_with_defaults() {
        let src = format!("{BASE}[[org.allow]]\nhost = \"api.example.com\"\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].allow[0].id, "acme/allow/0");
        assert_eq!(c.orgs[0].allow[0].ports, PortSet::List(vec![80, 443]));
        assert_eq!(c.proxy.limits.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(c.evidence.dir, PathBuf::from("evidence"));
    }

    #[test]
    fn unknown_key_is_located() {
        assert_first_error(&format!("{BASE}bogus = 1\n"), "t.toml:9:1: ", "bogus");
    }

    #[test]
    fn all_errors_are_collected() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"*\"\n[[org.allow]]\ncidr = \"x\"\n[[org.allow]]\nhost = \"a.com\"\nports = [70000]\n"
        );
        assert_eq!(parse(&src).unwrap_err().0.len(), 3);
    }

    #[test]
    fn parse_errors_name_the_offending_text() {
        // The parser says only "duplicate key": the text it means is
        // added, quoted, and located at the table's name.
        let e = first_error(&format!("{BASE}[proxy]\n"));
        assert!(
            e.starts_with("t.toml:9:2: ") && e.ends_with(": `proxy`"),
            "{e}"
        );
        let src = BASE.replace("[proxy]\n", "[proxy]\ntransparent = []\ntransparent = []\n");
        let e = first_error(&src);
        assert!(
            e.contains("duplicate key") && e.contains("transparent"),
            "{e}"
        );
    }
}
