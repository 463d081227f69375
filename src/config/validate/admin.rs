//! `[admin]`: the admin listener.

use super::values::Listeners;
use crate::config::error::Errors;
use crate::config::model::{AdminConfig, TokenDigest};
use crate::config::raw::RawAdmin;

pub(super) fn validate_admin(
    raw: RawAdmin,
    listeners: &mut Listeners,
    errors: &mut Errors<'_>,
) -> AdminConfig {
    let RawAdmin {
        listen,
        tail_tokens,
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
    }
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
}
