//! `[admin]`: the admin listener.

use super::values::Listeners;
use crate::config::error::Errors;
use crate::config::model::{AdminConfig, ApproverToken, TokenDigest};
use crate::config::raw::{RawAdmin, RawApprover};
use toml::Spanned;

pub(super) fn validate_admin(
    raw: RawAdmin,
    org_names: &[&str],
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> AdminConfig {
    let RawAdmin {
        listen,
        tail_tokens,
        approver_tokens,
    } = raw;
    let mut digests: Vec<TokenDigest> = Vec::new();
    for t in &tail_tokens {
        // Never echo the value: it may be a plain token pasted by mistake.
        match TokenDigest::parse(t.get_ref().trim()) {
            Some(d) if digests.contains(&d) => {
                errors.at(t.span(), "admin.tail_tokens: token listed twice");
            }
            Some(d) => digests.push(d),
            None => errors.at(
                t.span(),
                "admin.tail_tokens: a token must be stored hashed as \"sha256:<64 hex digits>\", never plain (`palisade token new` prints one)",
            ),
        }
    }
    AdminConfig {
        listen: listen.and_then(|l| listeners.claim(&l, errors)),
        tail_tokens: digests,
        approver_tokens: validate_approvers(approver_tokens, org_names, errors),
    }
}

/// `approver_tokens`: each `{ name, token, orgs }`, the token stored
/// hashed, names and tokens listed once, `orgs` naming orgs (or `["*"]`).
/// Each org named must be an `[[org]]` of the config (`org_names`): a
/// token for an org that does not exist answers for nothing, and is most
/// likely a typo of one that does.
fn validate_approvers(
    raw: Vec<Spanned<RawApprover>>,
    org_names: &[&str],
    errors: &mut Errors<'_>,
) -> Vec<ApproverToken> {
    let mut out: Vec<ApproverToken> = Vec::new();
    for entry in raw {
        let RawApprover { name, token, orgs } = entry.into_inner();
        let Some(digest) = TokenDigest::parse(token.get_ref().trim()) else {
            errors.at(
                token.span(),
                "admin.approver_tokens: a token must be stored hashed as \"sha256:<64 hex digits>\", never plain (`palisade token new` prints one)",
            );
            continue;
        };
        let n = name.get_ref().trim().to_string();
        if n.is_empty()
            || n.len() > 64
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
        {
            errors.at(
                name.span(),
                format!("admin.approver_tokens: invalid name {n:?} (use 1-64 of a-z, A-Z, 0-9, '-', '_', '.', '@')"),
            );
            continue;
        }
        if out.iter().any(|a| a.name == n) {
            errors.at(
                name.span(),
                format!("admin.approver_tokens: name {n:?} listed twice"),
            );
            continue;
        }
        if out.iter().any(|a| a.digest == digest) {
            errors.at(token.span(), "admin.approver_tokens: token listed twice");
            continue;
        }
        let names: Vec<String> = orgs.get_ref().iter().map(|o| o.get_ref().clone()).collect();
        let orgs = if names.is_empty() {
            errors.at(
                orgs.span(),
                "admin.approver_tokens: orgs is empty (name the orgs this token answers for, or [\"*\"] for every org)",
            );
            continue;
        } else if names.iter().any(|o| o == "*") {
            if names.len() > 1 {
                errors.at(
                    orgs.span(),
                    "admin.approver_tokens: \"*\" stands alone in orgs",
                );
                continue;
            }
            None
        } else {
            let unknown = orgs
                .get_ref()
                .iter()
                .find(|o| !org_names.contains(&o.get_ref().as_str()));
            if let Some(o) = unknown {
                errors.at(
                    o.span(),
                    format!(
                        "admin.approver_tokens: no org {:?} in this config (orgs: {})",
                        o.get_ref(),
                        org_names.join(", ")
                    ),
                );
                continue;
            }
            Some(names)
        };
        out.push(ApproverToken {
            name: n,
            digest,
            orgs,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::model::TokenDigest;

    fn errors(extra: &str) -> Vec<String> {
        super::super::super::test_support::errors(extra)
    }

    #[test]
    fn tail_tokens_are_stored_hashed_and_listed_once() {
        let d = TokenDigest::of(b"tail-secret").to_string();
        let src = format!(
            "{}[admin]\ntail_tokens = [\"{d}\"]\n",
            super::super::super::test_support::ORG
        );
        let c = super::super::super::test_support::parse(&src).unwrap();
        assert_eq!(c.admin.tail_tokens, vec![TokenDigest::of(b"tail-secret")]);
        let e = errors("[admin]\ntail_tokens = [\"tail-secret\"]\n").join("\n");
        assert!(
            e.contains(":5:16: admin.tail_tokens: a token must be stored hashed"),
            "{e}"
        );
        assert!(!e.contains("tail-secret\""), "{e}");
        let e = errors(&format!("[admin]\ntail_tokens = [\"{d}\", \"{d}\"]\n")).join("\n");
        assert!(e.contains("token listed twice"), "{e}");
    }

    #[test]
    fn approver_tokens_name_orgs_of_the_config() {
        let d = TokenDigest::of(b"approver-secret").to_string();
        let src = |orgs: &str| {
            format!("[admin]\napprover_tokens = [{{ name = \"alice\", token = \"{d}\", orgs = {orgs} }}]\n")
        };
        let e = errors(&src(r#"["acme", "acmee"]"#)).join("\n");
        assert!(
            e.contains(":5:137: admin.approver_tokens: no org \"acmee\" in this config"),
            "{e}"
        );
        for fine in [r#"["*"]"#, r#"["acme"]"#] {
            let c = super::super::super::test_support::parse(&format!(
                "{}{}",
                super::super::super::test_support::ORG,
                src(fine)
            ));
            assert!(c.is_ok(), "{fine}: {:?}", c.err());
        }
    }
}
