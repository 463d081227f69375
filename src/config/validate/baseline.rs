//! `[policy] baseline = "FILE"`: the operator's file, read and validated
//! with the config. Its own strict TOML, its errors located in it.

use std::path::Path;

use sha2::{Digest, Sha256};
use toml::Spanned;

use super::rules::{port_list, rule_target, valid_rule_id};
use crate::config::error::Errors;
use crate::config::model::{Baseline, CeilingEntry, PortSet, RuleConfig, RuleTarget};
use crate::config::raw::{RawBaseline, RawBaselineEntry};

/// Read and validate the baseline named by `value` (relative to the
/// config file `config`'s directory). Problems in it are located in it;
/// a file that cannot be read is an error at `value`.
pub(super) fn load_baseline(
    value: &Spanned<String>,
    config: &Path,
    errors: &mut Errors<'_>,
) -> Option<Baseline> {
    let text = value.get_ref().trim();
    if text.is_empty() {
        errors.at(value.span(), "baseline must not be empty");
        return None;
    }
    let path = config
        .parent()
        .map_or_else(|| Path::new(text).to_path_buf(), |d| d.join(text));
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) => {
            errors.at(
                value.span(),
                format!("cannot read baseline {}: {e}", path.display()),
            );
            return None;
        }
    };
    let display = path.display().to_string();
    let Ok(src) = String::from_utf8(bytes.clone()) else {
        errors.at(value.span(), format!("baseline {display} is not UTF-8"));
        return None;
    };
    let mut own = Errors::new(&display, &src);
    let baseline = parse(&src, &mut own).map(|(deny, ceiling)| Baseline {
        path: path.clone(),
        hash: data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes)),
        deny,
        ceiling,
    });
    match own.finish(baseline) {
        Ok(baseline) => baseline,
        Err(found) => {
            errors.absorb(found);
            None
        }
    }
}

fn parse(src: &str, errors: &mut Errors<'_>) -> Option<(Vec<RuleConfig>, Vec<CeilingEntry>)> {
    let raw: RawBaseline = match toml::from_str(src) {
        Ok(raw) => raw,
        Err(e) => {
            errors.at(e.span().unwrap_or(0..0), e.message().trim().to_string());
            return None;
        }
    };
    let RawBaseline { deny, ceiling } = raw;
    let mut ids = std::collections::HashSet::new();
    let deny = entries(deny, "deny", &mut ids, errors)
        .into_iter()
        .map(|(id, target, ports, _)| RuleConfig {
            id,
            target,
            ports,
            intercept: None,
            tunnel: None,
            names: Default::default(),
            volume: None,
            window: None,
        })
        .collect();
    let ceiling = entries(ceiling, "ceiling", &mut ids, errors)
        .into_iter()
        .map(|(id, target, ports, intercept)| CeilingEntry {
            id,
            target,
            ports,
            intercept,
        })
        .collect();
    Some((deny, ceiling))
}

/// The entries of one table: id (`baseline:ID`, or `baseline:KIND/N`),
/// target, ports (default all) and `intercept` (ceilings only).
fn entries(
    raw: Vec<Spanned<RawBaselineEntry>>,
    kind: &str,
    ids: &mut std::collections::HashSet<String>,
    errors: &mut Errors<'_>,
) -> Vec<(String, RuleTarget, PortSet, bool)> {
    let mut out = Vec::new();
    for (n, spanned) in raw.into_iter().enumerate() {
        let span = spanned.span();
        let RawBaselineEntry {
            id,
            host,
            cidr: cidr_value,
            ports,
            intercept,
        } = spanned.into_inner();
        let id = match id {
            Some(id) => {
                let text = id.get_ref().trim();
                if !valid_rule_id(text) {
                    errors.at(id.span(), format!("invalid id {text:?}"));
                }
                let full = format!("baseline:{text}");
                if !ids.insert(full.clone()) {
                    errors.at(id.span(), format!("id {text:?} is used twice"));
                }
                full
            }
            None => format!("baseline:{kind}/{n}"),
        };
        let intercept = match intercept {
            Some(flag) if kind != "ceiling" => {
                errors.at(
                    flag.span(),
                    "intercept is only valid on [[ceiling]] entries",
                );
                false
            }
            Some(flag) => *flag.get_ref(),
            None => false,
        };
        let target = rule_target(
            (host, cidr_value),
            false,
            (span, &format!("[[{kind}]] entry")),
            errors,
        );
        let ports = ports.map_or(PortSet::All, |list| port_list(&list, errors));
        if let Some(target) = target {
            out.push((id, target, ports, intercept));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{from_str, Config, ConfigErrors, PortSet, RuleTarget};

    /// `baseline` written beside a config holding `orgs`; the config's
    /// path, and the outcome.
    fn load(baseline: &str, orgs: &str) -> (tempfile::TempDir, Result<Config, ConfigErrors>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), baseline).unwrap();
        let src = format!("[policy]\nbaseline = \"base.toml\"\n[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n{orgs}");
        let result = from_str(&src, &dir.path().join("t.toml"));
        (dir, result)
    }

    fn errors(baseline: &str, orgs: &str) -> Vec<String> {
        let (dir, result) = load(baseline, orgs);
        let prefix = format!("{}/", dir.path().display());
        result
            .unwrap_err()
            .0
            .iter()
            .map(|e| e.to_string().replace(&prefix, ""))
            .collect()
    }

    #[test]
    fn a_baseline_is_read_relative_to_the_config_and_hashed() {
        let text = "[[deny]]\nhost = \"*.evil.test\"\n[[deny]]\nid = \"meta\"\ncidr = \"198.18.9.0/24\"\nports = [80]\n[[ceiling]]\nhost = \"*.test\"\n";
        let (dir, result) = load(text, "");
        let b = result.unwrap().policy.baseline.unwrap();
        assert_eq!(b.path, dir.path().join("base.toml"));
        let want: String = <sha2::Sha256 as sha2::Digest>::digest(text.as_bytes())
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        assert_eq!(b.hash, want);
        let ids: Vec<&str> = b.deny.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["baseline:deny/0", "baseline:meta"]);
        assert_eq!(b.deny[0].ports, PortSet::All);
        assert_eq!(b.deny[1].ports, PortSet::List(vec![80]));
        assert_eq!(b.ceiling[0].id, "baseline:ceiling/0");
        assert_eq!(b.ceiling[0].target, RuleTarget::Below("test".into()));
        assert!(!b.ceiling[0].intercept);
    }

    #[test]
    fn baseline_errors_are_located_in_the_baseline() {
        let cases = [
            ("[[deny]]\nhost = \"a.test\"\nbogus = 1\n", "base.toml:3:1: ", "bogus"),
            ("[[ceiling]]\nhost = \"a.test\"\nport = [1]\n", "base.toml:3:1: ", "port"),
            ("[[deny]]\nhost = \"a.test\"\nintercept = true\n", "base.toml:3:13: ", "only valid on [[ceiling]]"),
            ("[[deny]]\nports = [1]\n", "base.toml:1:1: ", "needs host or cidr"),
            ("[[deny]]\nhost = \"a.test\"\ncidr = \"198.18.0.0/15\"\n", "base.toml:3:8: ", "not both"),
            ("[[ceiling]]\ncidr = \"198.18.0.1/15\"\n", "base.toml:2:8: ", "host bits"),
            ("[[deny]]\nhost = \"a.test\"\nports = [0]\n", "base.toml:3:10: ", "out of range"),
            ("[[deny]]\nid = \"x\"\nhost = \"a.test\"\n[[deny]]\nid = \"x\"\nhost = \"b.test\"\n", "base.toml:5:6: ", "used twice"),
            ("deny = 1\n", "base.toml:1:8: ", "invalid type"),
        ];
        for (text, at, what) in cases {
            let e = errors(text, "");
            assert!(
                e[0].starts_with(at) && e[0].contains(what),
                "{text:?}: {e:?}"
            );
        }
    }

    #[test]
    fn a_missing_baseline_is_an_error_at_its_key() {
        let src = "[policy]\nbaseline = \"/nonexistent/base.toml\"\n";
        let e = from_str(src, Path::new("t.toml")).unwrap_err().0[0].to_string();
        assert!(
            e.starts_with("t.toml:2:12: cannot read baseline /nonexistent/base.toml"),
            "{e}"
        );
    }

    #[test]
    fn an_org_allow_rule_outside_the_ceiling_is_located_at_the_rule() {
        let ceiling = "[[ceiling]]\nid = \"apis\"\nhost = \"*.partner.test\"\nports = [443]\n";
        let e = errors(
            ceiling,
            "[[org.allow]]\nhost = \"evil.test\"\nports = [443]\n",
        );
        assert_eq!(
            e,
            ["t.toml:6:1: rule \"acme/allow/0\" (host evil.test) escapes the baseline's ceiling: \
              ceiling \"baseline:apis\" (host *.partner.test, ports 443) in base.toml: \
              its target is not inside it"]
        );
        // Deny rules are never held to it; rules inside pass.
        let (_dir, ok) = load(
            ceiling,
            "[[org.allow]]\nhost = \"a.partner.test\"\nports = [443]\n[[org.deny]]\nhost = \"evil.test\"\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
        // No [[ceiling]] entries: no ceiling.
        let (_dir, ok) = load(
            "[[deny]]\nhost = \"x.test\"\n",
            "[[org.allow]]\nhost = \"evil.test\"\nintercept = true\n",
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn an_org_rule_cannot_take_a_baseline_id() {
        let e = errors(
            "[[deny]]\nid = \"x\"\nhost = \"x.test\"\n",
            "[[org.deny]]\nid = \"baseline:x\"\nhost = \"y.test\"\n",
        );
        assert!(
            e[0].starts_with("t.toml:7:6: ") && e[0].contains("used twice"),
            "{e:?}"
        );
    }
}
