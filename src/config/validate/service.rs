//! The service keys of an intercepting allow rule: `service`, `repos`,
//! `push_refs`, `graphql_mutations`, `models` (`policy::service` reads
//! requests by them).

use toml::Spanned;

use super::values::known;
use crate::config::error::Errors;
use crate::config::model::{Service, ServiceRules};
use crate::config::raw::RawList;
use crate::proto::pktline::valid_ref_name;

/// The raw service keys of one rule.
pub(super) struct RawService {
    pub(super) service: Option<Spanned<String>>,
    pub(super) repos: RawList,
    pub(super) push_refs: RawList,
    pub(super) graphql_mutations: RawList,
    pub(super) models: RawList,
}

impl RawService {
    /// The span of the first key given, if any.
    fn first_span(&self) -> Option<std::ops::Range<usize>> {
        self.service.as_ref().map(Spanned::span).or_else(|| {
            [
                &self.repos,
                &self.push_refs,
                &self.graphql_mutations,
                &self.models,
            ]
            .iter()
            .find_map(|k| k.as_ref().map(Spanned::span))
        })
    }
}

/// Validate the service keys: `None` when none is given (or on errors,
/// which are reported). `intercepts`: the rule is an intercepting allow
/// rule with a host; `websocket`: the span of `websocket = true`.
pub(super) fn service_rules(
    raw: RawService,
    intercepts: bool,
    websocket: Option<std::ops::Range<usize>>,
    errors: &mut Errors<'_>,
) -> Option<ServiceRules> {
    let span = raw.first_span()?;
    if !intercepts {
        errors.at(
            span,
            "service, repos, push_refs, graphql_mutations and models need intercept = true \
             on an allow rule with a host (a service cannot be seen without interception)",
        );
        return None;
    }
    if let Some(ws) = websocket {
        errors.at(
            ws,
            "websocket = true cannot go with service rules (nothing inside a WebSocket is read)",
        );
    }
    let RawService {
        service,
        repos,
        push_refs,
        graphql_mutations,
        models,
    } = raw;
    let service = match service {
        None => None,
        Some(s) => {
            let found = Service::parse(s.get_ref().trim());
            Some(known("service", &s, found, &Service::NAMES, errors)?)
        }
    };
    let only_for = |key: &RawList, wanted: Service, errors: &mut Errors<'_>| {
        if let Some(k) = key {
            if service != Some(wanted) {
                errors.at(
                    k.span(),
                    format!("this key needs service = {:?}", wanted.as_str()),
                );
            }
        }
    };
    only_for(&push_refs, Service::Git, errors);
    only_for(&graphql_mutations, Service::Graphql, errors);
    only_for(&models, Service::LlmApi, errors);
    if let (Some(r), Some(s)) = (&repos, service) {
        if s != Service::Git {
            errors.at(
                r.span(),
                "repos is only valid with service = \"git\" or without a service",
            );
        }
    }
    let repos_span = repos.as_ref().map(Spanned::span);
    let repos = list(repos, errors, "repository", valid_repo_pattern);
    if let Some(span) = repos_span.clone().filter(|_| repos.is_empty()) {
        errors.at(span, "repos is empty (name at least one \"owner/name\")");
    }
    if service == Some(Service::Git) && repos_span.is_none() {
        errors.at(
            span.clone(),
            "service = \"git\" needs repos = [\"owner/name\", …]",
        );
    }
    let push_refs = list(push_refs, errors, "ref", valid_ref_pattern);
    let graphql_mutations = graphql_mutations
        .is_some()
        .then(|| list(graphql_mutations, errors, "mutation", valid_graphql_name));
    let models_span = models.as_ref().map(Spanned::span);
    let models = list(models, errors, "model", valid_model_pattern);
    if service == Some(Service::LlmApi) && models.is_empty() {
        errors.at(
            models_span.unwrap_or(span),
            "service = \"llm-api\" needs models = [\"pattern\", …] (not empty)",
        );
    }
    Some(ServiceRules {
        service,
        repos,
        push_refs,
        graphql_mutations,
        models,
    })
}

/// A list of patterns, each checked by `valid` (an error at each bad one).
fn list(
    value: RawList,
    errors: &mut Errors<'_>,
    what: &str,
    valid: fn(&str) -> bool,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for v in value.map(Spanned::into_inner).unwrap_or_default() {
        let text = v.get_ref().trim();
        if !valid(text) {
            errors.at(v.span(), format!("invalid {what} pattern {text:?}"));
        } else if !out.iter().any(|o| o == text) {
            out.push(text.to_string());
        }
    }
    out
}

/// `owner/name`, `owner/*`, `group/sub/name`: two or more segments of
/// letters, digits, `.`, `-`, `_` and `*`, none `.` or `..`.
fn valid_repo_pattern(p: &str) -> bool {
    let segs: Vec<&str> = p.split('/').collect();
    p.len() <= 256
        && segs.len() >= 2
        && segs.iter().all(|s| {
            !s.is_empty()
                && *s != "."
                && *s != ".."
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'*'))
        })
}

/// A full ref name (`refs/…`), `*` standing for any run.
fn valid_ref_pattern(p: &str) -> bool {
    valid_ref_name(&p.replace('*', "x"))
}

/// A GraphQL name: `[_A-Za-z][_0-9A-Za-z]*`.
fn valid_graphql_name(p: &str) -> bool {
    let mut b = p.bytes();
    b.next()
        .is_some_and(|c| c == b'_' || c.is_ascii_alphabetic())
        && b.all(|c| c == b'_' || c.is_ascii_alphanumeric())
        && p.len() <= 256
}

/// A model pattern: printable ASCII without spaces, 1-200 characters.
fn valid_model_pattern(p: &str) -> bool {
    !p.is_empty() && p.len() <= 200 && p.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use crate::config::{from_str, Service};

    const BASE: &str = "[[org]]\nname = \"acme\"\nclients = [\"198.18.1.0/24\"]\n";

    fn load(rule: &str) -> Result<crate::config::Config, String> {
        from_str(
            &format!("{BASE}[[org.allow]]\nhost = \"a.com\"\n{rule}\n"),
            std::path::Path::new("p.toml"),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn valid_service_rules_load() {
        let c = load(
            "intercept = true\nservice = \"git\"\nrepos = [\"acme/app\", \"acme/*\"]\n\
             push_refs = [\"refs/heads/agent/*\"]",
        )
        .unwrap();
        let s = c.orgs[0].allow[0]
            .intercept
            .as_ref()
            .unwrap()
            .service
            .clone()
            .unwrap();
        assert_eq!(s.service, Some(Service::Git));
        assert_eq!(s.push_refs, ["refs/heads/agent/*"]);
        load("intercept = true\nservice = \"registry\"").unwrap();
        load(
            "intercept = true\nservice = \"graphql\"\ngraphql_mutations = [\"createPullRequest\"]",
        )
        .unwrap();
        load("intercept = true\nservice = \"llm-api\"\nmodels = [\"claude-*\"]").unwrap();
        load("intercept = true\nrepos = [\"acme/app\"]").unwrap();
    }

    #[test]
    fn mistakes_are_located_errors() {
        for (rule, want) in [
            ("service = \"git\"\nrepos = [\"a/b\"]", "need intercept = true"),
            ("intercept = false\nservice = \"registry\"", "need intercept = true"),
            ("intercept = true\nservice = \"svn\"", "unknown service \"svn\""),
            ("intercept = true\nservice = \"git\"", "needs repos"),
            ("intercept = true\nservice = \"git\"\nrepos = []", "repos is empty"),
            ("intercept = true\nservice = \"git\"\nrepos = [\"noslash\"]", "invalid repository pattern"),
            ("intercept = true\nservice = \"git\"\nrepos = [\"a/../b\"]", "invalid repository pattern"),
            ("intercept = true\nservice = \"git\"\nrepos = [\"a/b\"]\npush_refs = [\"main\"]", "invalid ref pattern"),
            ("intercept = true\nservice = \"git\"\nrepos = [\"a/b\"]\npush_refs = [\"refs/heads/a..b\"]", "invalid ref pattern"),
            ("intercept = true\nservice = \"registry\"\npush_refs = [\"refs/heads/x\"]", "needs service = \"git\""),
            ("intercept = true\nservice = \"registry\"\nrepos = [\"a/b\"]", "repos is only valid"),
            ("intercept = true\nservice = \"graphql\"\ngraphql_mutations = [\"bad name\"]", "invalid mutation pattern"),
            ("intercept = true\nservice = \"llm-api\"", "needs models"),
            ("intercept = true\nservice = \"llm-api\"\nmodels = []", "needs models"),
            ("intercept = true\nservice = \"llm-api\"\nmodels = [\"a b\"]", "invalid model pattern"),
            ("intercept = true\nwebsocket = true\nservice = \"registry\"", "websocket = true cannot go with service"),
        ] {
            let e = load(rule).unwrap_err();
            assert!(e.contains(want), "{rule}: {e}");
            assert!(e.starts_with("p.toml:"), "{rule}: {e}");
        }
    }
}
