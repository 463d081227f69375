//! `[[org.credential]]`: headers Palisade adds to intercepted requests,
//! each covered by an intercepting allow rule of its org.

use std::collections::HashSet;
use std::path::PathBuf;

use toml::Spanned;

use super::rules::{host_rule, methods, paths};
use crate::config::error::Errors;
use crate::config::model::{CredentialConfig, RuleConfig, RuleTarget, SecretSource};
use crate::config::raw::RawCredential;

/// Header names a credential must not set: framing, routing and hop-by-hop.
const CREDENTIAL_FORBIDDEN_HEADERS: [&str; 10] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
];

/// Does `rule` (an intercepting allow rule's target) cover every name `t` matches?
fn target_covers(rule: &RuleTarget, t: &RuleTarget) -> bool {
    match (rule, t) {
        (RuleTarget::Exact(a), RuleTarget::Exact(b)) => a == b,
        (RuleTarget::Below(s), RuleTarget::Exact(b)) => b.ends_with(&format!(".{s}")),
        (RuleTarget::Below(s), RuleTarget::Below(b)) => b == s || b.ends_with(&format!(".{s}")),
        _ => false,
    }
}

pub(super) fn validate_credentials(
    org: &str,
    raw: Vec<Spanned<RawCredential>>,
    allow: &[RuleConfig],
    ids: &mut HashSet<String>,
    errors: &mut Errors<'_>,
) -> Vec<CredentialConfig> {
    let mut out = Vec::new();
    for spanned in raw {
        let span = spanned.span();
        let RawCredential {
            id,
            host,
            header,
            prefix,
            secret_file,
            secret_env,
            methods: m,
            paths: p,
        } = spanned.into_inner();
        let id_text = id.get_ref().trim().to_string();
        if id_text.is_empty() || id_text.len() > 128 || id_text.chars().any(char::is_control) {
            errors.at(id.span(), format!("invalid credential id {id_text:?}"));
        } else if !ids.insert(format!("credential:{id_text}")) {
            errors.at(
                id.span(),
                format!("credential id {id_text:?} is used twice"),
            );
        }
        let target = host_rule(&host, true, errors);
        if let Some(t) = &target {
            let covered = allow
                .iter()
                .any(|r| r.intercept.is_some() && target_covers(&r.target, t));
            if !covered {
                errors.at(
                    host.span(),
                    format!(
                        "credential {id_text:?}: no allow rule of org {org:?} intercepts {t} \
                         (add intercept = true to its allow rule)"
                    ),
                );
            }
        }
        let header_text = header.get_ref().trim().to_ascii_lowercase();
        if http::HeaderName::from_bytes(header_text.as_bytes()).is_err()
            || CREDENTIAL_FORBIDDEN_HEADERS.contains(&header_text.as_str())
        {
            errors.at(
                header.span(),
                format!("credential header {header_text:?} is not a header Palisade may set"),
            );
        }
        let prefix_text = prefix
            .as_ref()
            .map(|p| p.get_ref().clone())
            .unwrap_or_default();
        if let Some(p) = &prefix {
            if http::HeaderValue::from_str(&prefix_text).is_err() {
                errors.at(p.span(), "credential prefix must be printable text");
            }
        }
        let source = match (secret_file, secret_env) {
            (Some(f), None) if !f.get_ref().trim().is_empty() => {
                Some(SecretSource::File(PathBuf::from(f.into_inner())))
            }
            (None, Some(e)) if !e.get_ref().trim().is_empty() => {
                Some(SecretSource::Env(e.into_inner()))
            }
            (Some(_), Some(e)) => {
                errors.at(
                    e.span(),
                    "a credential has secret_file or secret_env, not both",
                );
                None
            }
            _ => {
                errors.at(
                    span.clone(),
                    format!(
                        "credential {id_text:?} needs secret_file or secret_env \
                         (the secret never goes in the policy file)"
                    ),
                );
                None
            }
        };
        let m = methods(m, errors);
        let p = paths(p, errors);
        if let (Some(host), Some(source)) = (target, source) {
            out.push(CredentialConfig {
                id: id_text,
                host,
                methods: m,
                paths: p,
                header: header_text,
                prefix: prefix_text,
                source,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::test_support::{errors, ORG};
    use crate::config::*;

    #[test]
    fn intercept_rules_and_credentials_validate_with_locations() {
        let ok = "[[org.allow]]\nhost = \"*.reg.test\"\nintercept = true\nmethods = [\"GET\"]\n\
                  paths = [\"/simple/\", \"/p/*.whl\"]\ndeny_paths = [\"/upload\"]\n\
                  [[org.credential]]\nid = \"t\"\nhost = \"api.reg.test\"\nheader = \"Authorization\"\n\
                  prefix = \"Bearer \"\nsecret_env = \"TOKEN\"\n";
        assert!(errors(ok).is_empty(), "{:?}", errors(ok));
        let c = from_str(&format!("{ORG}{ok}"), Path::new("t.toml")).unwrap();
        assert_eq!(c.orgs[0].credentials[0].header, "authorization");
        assert!(c.orgs[0].intercepts());

        let cases = [
            ("[[org.deny]]\nhost = \"x.test\"\nintercept = true\n", "t.toml:6:", "only valid on allow rules"),
            ("[[org.allow]]\ncidr = \"198.18.0.0/24\"\nintercept = true\n", "t.toml:6:", "only valid on allow rules"),
            ("[[org.allow]]\nhost = \"x.test\"\nmethods = [\"GET\"]\n", "t.toml:6:", "need intercept = true"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\nmethods = [\"get\"]\n", "t.toml:7:", "invalid method"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\npaths = [\"simple\"]\n", "t.toml:7:", "invalid path rule"),
            ("[[org.allow]]\nhost = \"x.test\"\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"authorization\"\nsecret_env = \"T\"\n", "t.toml:8:", "no allow rule"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"host\"\nsecret_env = \"T\"\n", "t.toml:10:", "not a header"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\n", "t.toml:", "needs secret_file or secret_env"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\nsecret_env = \"A\"\nsecret_file = \"/f\"\n", "t.toml:11:", "not both"),
            ("[[org.allow]]\nhost = \"x.test\"\nintercept = true\n[[org.credential]]\nid = \"t\"\nhost = \"x.test\"\nheader = \"a\"\nsecret = \"inline\"\n", "t.toml:", "unknown field"),
        ];
        for (src, at, want) in cases {
            let e = errors(src);
            assert!(
                e.iter().any(|e| e.starts_with(at) && e.contains(want)) || { false },
                "{src}: want {at} {want}, got {e:?}"
            );
        }
    }
}
