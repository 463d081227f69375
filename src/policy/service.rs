//! Service-aware rules: what a request means to the protocol a rule's
//! `service` names (git smart HTTP, a package registry, GraphQL, a model
//! API), and whether the rule's `repos`, `push_refs`,
//! `graphql_mutations` and `models` allow it. Pure, no I/O: [`check`]
//! decides from the method, the normalised path and the query, and says
//! when the body must be read first; [`check_body`] then decides from the
//! body's first bytes (all of them, but for a push: its command section).
//! Every refusal is `service_denied`, its detail naming what was refused.
//!
//! It runs after the rule's method and path rules allowed the request
//! ([`super::request::decide`]), and before any credential is added or
//! any byte goes upstream.
//!
//! # Truth table
//!
//! | # | service | request | decision |
//! |---|---|---|---|
//! | S1 | `git` or `repos` alone | `GET …/info/refs?service=git-upload-pack`, `POST …/git-upload-pack` | allow if the repository matches `repos` (fetch) |
//! | S2 | `git` or `repos` alone | `GET …/info/refs?service=git-receive-pack`, `POST …/git-receive-pack` | refuse unless the repository matches and `push_refs` is set; the POST then reads its commands ([`crate::proto::pktline`]): every ref updated (created, updated, deleted) must match `push_refs` |
//! | S3 | `git` or `repos` alone | a smart-HTTP path with another method, `info/refs` without `service=` (dumb HTTP) | refuse |
//! | S4 | `git` or `repos` alone | `/repos/{owner}/{name}/…`, `/api/v3/repos/…`, `/api/v1/repos/…` (forge REST) | allow if the repository matches `repos` |
//! | S5 | `git` or `repos` alone | `/repositories/{id}/…` (a repository by number) | refuse |
//! | S6 | `git` | anything else | refuse |
//! | S7 | `repos` alone | anything else | allow (the rule's own rules decided it) |
//! | S8 | `registry` | `GET`, `HEAD` | allow |
//! | S9 | `registry` | any other method | refuse, the detail naming it (publish, unpublish, yank, owner, token, login, write) |
//! | S10 | `graphql` | `GET`/`HEAD` with a `query` parameter; `POST` (JSON body, each element of a batch) | the operation to run ([`crate::proto::graphql`]): a query is allowed, a subscription refused, a mutation allowed only if every top-level field is in `graphql_mutations`; what is ambiguous is refused |
//! | S11 | `graphql` | `GET`/`HEAD` without a `query` parameter | allow |
//! | S12 | `graphql` | `POST` with GraphQL parameters in the URL too, another content type or a content encoding; any other method | refuse |
//! | S13 | `llm-api` | `GET`, `HEAD` | allow |
//! | S14 | `llm-api` | `POST` to a chat or message endpoint (path ending `/chat/completions`, `/completions`, `/responses`, `/embeddings`, `/messages`, `/messages/count_tokens`) | the body's `model` (a JSON string, once) must match `models` |
//! | S15 | `llm-api` | `POST …/models/{model}:{method}` (Gemini), `POST …/model/{model}/{invoke…, converse…}` (Bedrock) | the path's model must match `models` |
//! | S16 | `llm-api` | anything else | refuse |
//!
//! Patterns: `repos` match a repository path segment by segment, ASCII
//! case ignored (forges treat owner and name so), `*` within one segment
//! (`owner/*` is every repository of `owner`, not `owner/a/b`);
//! `push_refs` and `models` match the whole text exactly, `*` any run of
//! characters (`refs/heads/agent/*` covers `refs/heads/agent/a/b`);
//! `graphql_mutations` are field names, matched exactly.

use serde::{Deserialize, Serialize};

use crate::config::{Service, ServiceRules};
use crate::proto::graphql::{self, OpKind};
use crate::proto::http_request::NormalPath;
use crate::proto::pktline::{self, Commands};

use super::request::glob;

/// The largest model-API request body read; a larger one is refused.
pub(crate) const MAX_MODEL_BODY: usize = 8 * 1024 * 1024;
/// Refs and shown text kept in a record.
const MAX_RECORDED_REFS: usize = 32;
const MAX_SHOWN: usize = 200;

/// What a request was to its service: the `service` field of its record.
/// Never a body, never a credential.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceFacts {
    /// `git`, `registry`, `graphql`, `llm-api`, or `repos` (a rule with
    /// `repos` and no service).
    pub name: String,
    /// The repository (`owner/name`, as in the path, without `.git`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    /// A push's ref updates, `create|update|delete refs/…` (at most 32).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refs: Vec<String>,
    /// What was asked: `fetch`, `push`, `push discovery`, `rest`,
    /// `download`, `publish`…, a GraphQL operation (`mutation
    /// createPullRequest`), `chat`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
    /// The model asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl ServiceFacts {
    fn new(name: &str, operation: &str) -> ServiceFacts {
        ServiceFacts {
            name: name.to_string(),
            operation: Some(operation.to_string()),
            ..ServiceFacts::default()
        }
    }
}

/// One request, as [`check`] sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServiceRequest<'a> {
    pub(crate) method: &'a str,
    /// The normalised path (what the rule's path rules matched).
    pub(crate) path: &'a NormalPath,
    /// The URL query as received, without `?`.
    pub(crate) query: Option<&'a str>,
    pub(crate) content_type: Option<&'a str>,
    pub(crate) content_encoding: Option<&'a str>,
}

/// Which body check a request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyKind {
    /// A push: its command section.
    GitPush,
    /// A GraphQL POST: the whole body.
    Graphql,
    /// A model API call: the whole body's `model`.
    Model,
}

/// A request allowed so far, whose body decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BodyCheck {
    pub(crate) kind: BodyKind,
    pub(crate) facts: ServiceFacts,
}

impl BodyCheck {
    /// The most body bytes the check reads; past them it refuses.
    pub(crate) fn max(&self) -> usize {
        match self.kind {
            BodyKind::GitPush => pktline::MAX_COMMAND_BYTES,
            BodyKind::Graphql => graphql::MAX_GRAPHQL_BYTES,
            BodyKind::Model => MAX_MODEL_BODY,
        }
    }
}

/// What [`check`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Allowed, with what it was (none on a rule without service rules'
    /// concern in it).
    Allow(Option<ServiceFacts>),
    /// Refused (`service_denied`): the detail, and what it was.
    Refuse(String, Option<ServiceFacts>),
    /// Allowed so far: the body decides ([`check_body`]).
    Body(BodyCheck),
}

/// What [`check_body`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyStep {
    /// Read more of the body.
    NeedMore,
    Allow(ServiceFacts),
    Refuse(String, ServiceFacts),
}

/// Decide a request by its method, path and query. See the module's truth
/// table.
pub(crate) fn check(rules: &ServiceRules, req: &ServiceRequest<'_>) -> Step {
    match rules.service {
        None | Some(Service::Git) => forge(rules, req),
        Some(Service::Registry) => registry(req),
        Some(Service::Graphql) => graphql_request(rules, req),
        Some(Service::LlmApi) => llm(rules, req),
    }
}

/// Decide a request from its body's first bytes (`complete`: the whole
/// body). See the module's truth table.
pub(crate) fn check_body(
    rules: &ServiceRules,
    check: &BodyCheck,
    body: &[u8],
    complete: bool,
) -> BodyStep {
    let mut facts = check.facts.clone();
    if body.len() > check.max() && check.kind != BodyKind::GitPush {
        let what = facts.name.clone();
        return BodyStep::Refuse(
            format!("{what} request body larger than {} bytes", check.max()),
            facts,
        );
    }
    match check.kind {
        BodyKind::GitPush => match pktline::read_commands(body) {
            Commands::NeedMore if complete => BodyStep::Refuse(
                "git push: the request ends inside its commands".into(),
                facts,
            ),
            Commands::NeedMore => BodyStep::NeedMore,
            Commands::Malformed(why) => BodyStep::Refuse(format!("git push refused: {why}"), facts),
            Commands::Done { updates, .. } => {
                facts.refs = updates
                    .iter()
                    .take(MAX_RECORDED_REFS)
                    .map(|u| format!("{} {}", u.kind().as_str(), u.name))
                    .collect();
                match updates
                    .iter()
                    .find(|u| !rules.push_refs.iter().any(|p| whole(p, &u.name)))
                {
                    Some(u) => {
                        let shown = shorten(&u.name);
                        let how = match u.kind() {
                            pktline::UpdateKind::Delete => " (delete)",
                            _ => "",
                        };
                        BodyStep::Refuse(format!("git push to {shown}{how}"), facts)
                    }
                    None => BodyStep::Allow(facts),
                }
            }
        },
        _ if !complete => BodyStep::NeedMore,
        BodyKind::Graphql => match graphql::operations_of_body(body) {
            Ok(ops) => graphql_ops(rules, &ops, facts),
            Err(why) => BodyStep::Refuse(format!("graphql request refused: {why}"), facts),
        },
        BodyKind::Model => match model_of_body(body) {
            Ok(model) => {
                let ok = rules.models.iter().any(|p| whole(p, &model));
                let shown = shorten(&model);
                facts.model = Some(shown.clone());
                if ok {
                    BodyStep::Allow(facts)
                } else {
                    BodyStep::Refuse(format!("model {shown}"), facts)
                }
            }
            Err(why) => BodyStep::Refuse(why, facts),
        },
    }
}

/// `pattern` matches all of `text`, `*` any run of bytes, exactly
/// otherwise.
fn whole(pattern: &str, text: &str) -> bool {
    if pattern.contains('*') {
        glob(pattern, text, |a, b| a == b)
    } else {
        pattern == text
    }
}

/// Does a `repos` pattern match the repository path `repo`? Segment by
/// segment, ASCII case ignored, `*` within a segment.
pub(crate) fn repo_matches(pattern: &str, repo: &str) -> bool {
    let (p, r): (Vec<&str>, Vec<&str>) = (pattern.split('/').collect(), repo.split('/').collect());
    p.len() == r.len()
        && p.iter().zip(&r).all(|(p, r)| {
            if p.contains('*') {
                glob(p, r, |a, b| a.eq_ignore_ascii_case(&b))
            } else {
                p.eq_ignore_ascii_case(r)
            }
        })
}

fn shorten(s: &str) -> String {
    s.chars().take(MAX_SHOWN).collect()
}

/// A git smart-HTTP request's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GitOp {
    /// `info/refs` with `service=` the one named (or none: dumb HTTP).
    InfoRefs(Option<bool>),
    UploadPack,
    ReceivePack,
}

/// `…/{repo}/info/refs`, `…/{repo}/git-upload-pack`,
/// `…/{repo}/git-receive-pack`: the repository path (without the
/// leading `/` and one trailing `.git`) and what is asked. For
/// `info/refs`, whether the `service=` parameter names receive-pack.
fn git_request<'p>(path: &'p str, query: Option<&str>) -> Option<(&'p str, GitOp)> {
    let (repo, op) = if let Some(r) = path.strip_suffix("/info/refs") {
        let service = query.and_then(|q| {
            let mut found = q.split('&').filter_map(|p| p.strip_prefix("service="));
            match (found.next(), found.next()) {
                (Some(s), None) => Some(s),
                _ => None,
            }
        });
        let push = match service {
            Some("git-upload-pack") => Some(false),
            Some("git-receive-pack") => Some(true),
            _ => None,
        };
        (r, GitOp::InfoRefs(push))
    } else if let Some(r) = path.strip_suffix("/git-upload-pack") {
        (r, GitOp::UploadPack)
    } else if let Some(r) = path.strip_suffix("/git-receive-pack") {
        (r, GitOp::ReceivePack)
    } else {
        return None;
    };
    let repo = repo.strip_prefix('/')?;
    let repo = match repo.len().checked_sub(4) {
        Some(i) if repo.is_char_boundary(i) && repo[i..].eq_ignore_ascii_case(".git") => &repo[..i],
        _ => repo,
    };
    (!repo.is_empty()).then_some((repo, op))
}

/// A forge REST path naming a repository: `/repos/{owner}/{name}[/…]`,
/// under `/api/v3` (GitHub Enterprise) or `/api/v1` (Gitea, Forgejo)
/// too. `Err` for `/repositories/…` (a repository by number, which
/// `repos` cannot scope).
fn forge_repo(path: &str) -> Option<Result<String, ()>> {
    let rest = ["/api/v3", "/api/v1", ""].iter().find_map(|base| {
        path.strip_prefix(base)
            .filter(|r| *r == "/repos" || r.starts_with("/repos/"))
    });
    let Some(rest) = rest else {
        let numbered = ["/api/v3", ""].iter().any(|base| {
            path.strip_prefix(base)
                .is_some_and(|r| r.starts_with("/repositories/"))
        });
        return numbered.then_some(Err(()));
    };
    let rest = rest.strip_prefix("/repos")?;
    if rest.is_empty() || rest == "/" {
        return None;
    }
    let mut segs = rest.strip_prefix('/')?.split('/');
    match (segs.next(), segs.next()) {
        (Some(o), Some(n)) if !o.is_empty() && !n.is_empty() => Some(Ok(format!("{o}/{n}"))),
        _ => Some(Err(())),
    }
}

fn forge(rules: &ServiceRules, req: &ServiceRequest<'_>) -> Step {
    let name = match rules.service {
        Some(Service::Git) => "git",
        _ => "repos",
    };
    let path = req.path.as_str();
    let listed = |repo: &str| rules.repos.iter().any(|p| repo_matches(p, repo));
    if let Some((repo, op)) = git_request(path, req.query) {
        let read = matches!(req.method, "GET" | "HEAD");
        let (push, method_ok, what) = match op {
            GitOp::InfoRefs(None) => {
                let facts = ServiceFacts {
                    repo: Some(shorten(repo)),
                    ..ServiceFacts::new(name, "dumb http")
                };
                return Step::Refuse(
                    format!(
                        "git dumb HTTP to {} (only smart HTTP is served)",
                        shorten(repo)
                    ),
                    Some(facts),
                );
            }
            GitOp::InfoRefs(Some(push)) => (
                push,
                read,
                if push {
                    "push discovery"
                } else {
                    "fetch discovery"
                },
            ),
            GitOp::UploadPack => (false, req.method == "POST", "fetch"),
            GitOp::ReceivePack => (true, req.method == "POST", "push"),
        };
        let facts = ServiceFacts {
            repo: Some(shorten(repo)),
            ..ServiceFacts::new(name, what)
        };
        let shown = shorten(repo);
        if !method_ok {
            return Step::Refuse(
                format!("git {what} of {shown} with method {}", req.method),
                Some(facts),
            );
        }
        if !listed(repo) {
            let verb = if push { "push to" } else { "fetch of" };
            return Step::Refuse(format!("git {verb} {shown} (not in repos)"), Some(facts));
        }
        if push && rules.push_refs.is_empty() {
            return Step::Refuse(
                format!("git push to {shown} (no push_refs: fetch only)"),
                Some(facts),
            );
        }
        if op == GitOp::ReceivePack {
            if let Some(enc) = req
                .content_encoding
                .filter(|e| !e.eq_ignore_ascii_case("identity"))
            {
                return Step::Refuse(
                    format!(
                        "git push with Content-Encoding {} (its commands cannot be read)",
                        shorten(enc)
                    ),
                    Some(facts),
                );
            }
            return Step::Body(BodyCheck {
                kind: BodyKind::GitPush,
                facts,
            });
        }
        return Step::Allow(Some(facts));
    }
    match forge_repo(path) {
        Some(Ok(repo)) => {
            let facts = ServiceFacts {
                repo: Some(shorten(&repo)),
                ..ServiceFacts::new(name, "rest")
            };
            if listed(&repo) {
                Step::Allow(Some(facts))
            } else {
                Step::Refuse(
                    format!("forge request to {} (not in repos)", shorten(&repo)),
                    Some(facts),
                )
            }
        }
        Some(Err(())) => Step::Refuse(
            format!(
                "forge path {} names no repository repos can scope",
                shorten(path)
            ),
            Some(ServiceFacts::new(name, "rest")),
        ),
        None if rules.service == Some(Service::Git) => Step::Refuse(
            format!(
                "git: {} {} is neither git smart HTTP nor a forge /repos/ path",
                req.method,
                shorten(path)
            ),
            Some(ServiceFacts::new(name, "other")),
        ),
        None => Step::Allow(None),
    }
}

/// What a registry write is, by its method and path (npm, PyPI, crates
/// and the rest): for the refusal's detail.
fn registry_write(method: &str, path: &str) -> &'static str {
    let p = path;
    if p.starts_with("/api/v1/crates/") {
        if p == "/api/v1/crates/new" {
            return "publish";
        }
        if p.ends_with("/yank") || p.ends_with("/unyank") {
            return "yank";
        }
        if p.ends_with("/owners") {
            return "owner change";
        }
    }
    if p.starts_with("/api/v1/me/tokens") || p.starts_with("/-/npm/v1/tokens") {
        return "token change";
    }
    if p.starts_with("/-/user/") || p.starts_with("/-/v1/login") {
        return "login";
    }
    if p.contains("/dist-tags/") || p.contains("/-rev/") && method != "DELETE" {
        return "owner or tag change";
    }
    if p == "/legacy/" || p == "/legacy" || p.ends_with("/upload") || p.ends_with("/upload/") {
        return "publish";
    }
    match method {
        "PUT" => "publish",
        "DELETE" => "unpublish",
        _ => "write",
    }
}

fn registry(req: &ServiceRequest<'_>) -> Step {
    if matches!(req.method, "GET" | "HEAD") {
        return Step::Allow(Some(ServiceFacts::new("registry", "download")));
    }
    let what = registry_write(req.method, req.path.as_str());
    Step::Refuse(
        format!(
            "registry {what} ({} {})",
            req.method,
            shorten(req.path.as_str())
        ),
        Some(ServiceFacts::new("registry", what)),
    )
}

/// A content type is JSON (or absent).
fn json_or_none(content_type: Option<&str>) -> bool {
    content_type.is_none_or(|t| {
        let base = t.split(';').next().unwrap_or("").trim();
        base.eq_ignore_ascii_case("application/json")
    })
}

fn graphql_request(rules: &ServiceRules, req: &ServiceRequest<'_>) -> Step {
    let facts = ServiceFacts::new("graphql", "request");
    match req.method {
        "GET" | "HEAD" => match req.query.and_then(graphql::operation_of_url_query) {
            None => Step::Allow(None),
            Some(Ok(op)) => match graphql_ops(rules, &[op], facts) {
                BodyStep::Allow(f) => Step::Allow(Some(f)),
                BodyStep::Refuse(d, f) => Step::Refuse(d, Some(f)),
                BodyStep::NeedMore => Step::Refuse("graphql".into(), None),
            },
            Some(Err(why)) => Step::Refuse(format!("graphql request refused: {why}"), Some(facts)),
        },
        "POST" => {
            if req.query.is_some_and(graphql::url_has_graphql_params) {
                return Step::Refuse(
                    "graphql request refused: GraphQL parameters in both URL and body".into(),
                    Some(facts),
                );
            }
            if !json_or_none(req.content_type) || req.content_encoding.is_some() {
                return Step::Refuse(
                    "graphql request refused: only an unencoded application/json body is read"
                        .into(),
                    Some(facts),
                );
            }
            Step::Body(BodyCheck {
                kind: BodyKind::Graphql,
                facts,
            })
        }
        m => Step::Refuse(
            format!("graphql: {m} is not a GraphQL request"),
            Some(facts),
        ),
    }
}

/// Every operation of a request (a batch: each element) against the
/// rule: the first refused names the refusal.
fn graphql_ops(
    rules: &ServiceRules,
    ops: &[graphql::Operation],
    mut facts: ServiceFacts,
) -> BodyStep {
    let shown: Vec<String> = ops
        .iter()
        .map(|o| match o.kind {
            OpKind::Mutation => format!("mutation {}", o.fields.join(",")),
            k => match &o.name {
                Some(n) => format!("{} {n}", k.as_str()),
                None => k.as_str().to_string(),
            },
        })
        .collect();
    facts.operation = Some(shorten(&shown.join("; ")));
    for op in ops {
        match op.kind {
            OpKind::Query => {}
            OpKind::Subscription => {
                return BodyStep::Refuse("graphql subscription".into(), facts);
            }
            OpKind::Mutation => {
                let allowed = rules.graphql_mutations.as_deref().unwrap_or(&[]);
                if let Some(f) = op.fields.iter().find(|f| !allowed.contains(f)) {
                    return BodyStep::Refuse(format!("graphql mutation {}", shorten(f)), facts);
                }
            }
        }
    }
    BodyStep::Allow(facts)
}

/// Endpoints whose JSON body names the model.
const MODEL_BODY_ENDPOINTS: [&str; 6] = [
    "/chat/completions",
    "/completions",
    "/responses",
    "/embeddings",
    "/messages",
    "/messages/count_tokens",
];

/// A model named in the path: Gemini's `…/models/{model}:{method}`,
/// Bedrock's `…/model/{model}/{invoke|invoke-with-response-stream|converse|converse-stream}`.
fn model_in_path(path: &str) -> Option<&str> {
    let last = path.rsplit('/').next()?;
    if let Some((model, _)) = last.split_once(':') {
        let parent = path.strip_suffix(last)?.strip_suffix('/')?;
        if parent.ends_with("/models") && !model.is_empty() {
            return Some(model);
        }
    }
    if matches!(
        last,
        "invoke" | "invoke-with-response-stream" | "converse" | "converse-stream"
    ) {
        let rest = path.strip_suffix(last)?.strip_suffix('/')?;
        let (parent, model) = rest.rsplit_once('/')?;
        if parent.ends_with("/model") && !model.is_empty() {
            return Some(model);
        }
    }
    None
}

fn llm(rules: &ServiceRules, req: &ServiceRequest<'_>) -> Step {
    let path = req.path.as_str();
    if matches!(req.method, "GET" | "HEAD") {
        return Step::Allow(None);
    }
    let mut facts = ServiceFacts::new("llm-api", "call");
    if req.method != "POST" {
        return Step::Refuse(
            format!(
                "llm-api: {} {} is not a model call",
                req.method,
                shorten(path)
            ),
            Some(facts),
        );
    }
    if let Some(model) = model_in_path(path) {
        let shown = shorten(model);
        facts.model = Some(shown.clone());
        return if rules.models.iter().any(|p| whole(p, model)) {
            Step::Allow(Some(facts))
        } else {
            Step::Refuse(format!("model {shown}"), Some(facts))
        };
    }
    if !MODEL_BODY_ENDPOINTS.iter().any(|e| path.ends_with(e)) {
        return Step::Refuse(
            format!(
                "llm-api: POST {} is not a recognised model endpoint",
                shorten(path)
            ),
            Some(facts),
        );
    }
    if !json_or_none(req.content_type) || req.content_encoding.is_some() {
        return Step::Refuse(
            "llm-api: only an unencoded application/json body is read".into(),
            Some(facts),
        );
    }
    Step::Body(BodyCheck {
        kind: BodyKind::Model,
        facts,
    })
}

/// The `model` of a JSON object body: a string, given once (serde refuses
/// a repeated field, escapes decoded).
fn model_of_body(body: &[u8]) -> Result<String, String> {
    #[derive(Deserialize)]
    struct Call {
        model: Option<String>,
    }
    let call: Call = serde_json::from_slice(body).map_err(|e| {
        format!("model call refused: the body is not a JSON object with one string model: {e}")
    })?;
    call.model.ok_or_else(|| "model missing".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(service: Option<Service>) -> ServiceRules {
        ServiceRules {
            service,
            repos: vec!["acme/app".into(), "tools/*".into()],
            push_refs: vec!["refs/heads/agent/*".into()],
            graphql_mutations: Some(vec!["createPullRequest".into(), "addComment".into()]),
            models: vec!["claude-*".into(), "gpt-4o-mini".into()],
        }
    }

    fn step(r: &ServiceRules, method: &str, target: &str) -> Step {
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        let path = NormalPath::parse(path).unwrap();
        check(
            r,
            &ServiceRequest {
                method,
                path: &path,
                query,
                content_type: None,
                content_encoding: None,
            },
        )
    }

    fn detail(s: &Step) -> Option<&str> {
        match s {
            Step::Refuse(d, _) => Some(d),
            _ => None,
        }
    }

    const A: &str = "1111111111111111111111111111111111111111";
    const B: &str = "2222222222222222222222222222222222222222";
    const Z: &str = "0000000000000000000000000000000000000000";

    fn push_body(refs: &[(&str, &str, &str)]) -> Vec<u8> {
        let mut s = String::new();
        for (i, (o, n, r)) in refs.iter().enumerate() {
            let line = format!(
                "{o} {n} {r}{}\n",
                if i == 0 { "\0report-status" } else { "" }
            );
            s += &format!("{:04x}{line}", line.len() + 4);
        }
        s += "0000PACK";
        s.into_bytes()
    }

    #[test]
    fn git_fetch_is_scoped_to_repos() {
        let r = rules(Some(Service::Git));
        for ok in [
            "/acme/app.git/info/refs?service=git-upload-pack",
            "/acme/app/info/refs?service=git-upload-pack",
            "/ACME/App.GIT/info/refs?service=git-upload-pack",
            "/tools/anything.git/info/refs?service=git-upload-pack",
        ] {
            assert!(matches!(step(&r, "GET", ok), Step::Allow(Some(_))), "{ok}");
        }
        assert!(matches!(
            step(&r, "POST", "/acme/app.git/git-upload-pack"),
            Step::Allow(_)
        ));
        for (m, bad) in [
            ("GET", "/acme/other.git/info/refs?service=git-upload-pack"),
            ("POST", "/acme/other/git-upload-pack"),
            ("POST", "/acme/app/x/git-upload-pack"),
            ("POST", "/tools/a/b.git/git-upload-pack"),
            ("POST", "/acme/app.git.git/git-upload-pack"),
            ("GET", "/acme/app.git/info/refs"),
            (
                "GET",
                "/acme/app.git/info/refs?service=git-upload-pack&service=x",
            ),
            ("GET", "/acme/app.git/git-upload-pack"),
            ("GET", "/acme/app.git/HEAD"),
            ("GET", "/acme/other"),
            ("GET", "/git-upload-pack"),
        ] {
            assert!(detail(&step(&r, m, bad)).is_some(), "{m} {bad}");
        }
        assert_eq!(
            detail(&step(&r, "POST", "/acme/other/git-upload-pack")),
            Some("git fetch of acme/other (not in repos)")
        );
    }

    #[test]
    fn git_push_reads_every_ref() {
        let r = rules(Some(Service::Git));
        let Step::Body(check) = step(&r, "POST", "/acme/app.git/git-receive-pack") else {
            panic!()
        };
        let body = |refs: &[(&str, &str, &str)]| check_body(&r, &check, &push_body(refs), false);
        assert!(matches!(
            body(&[(A, B, "refs/heads/agent/x")]),
            BodyStep::Allow(_)
        ));
        assert!(matches!(
            body(&[
                (Z, B, "refs/heads/agent/a/b"),
                (A, Z, "refs/heads/agent/old")
            ]),
            BodyStep::Allow(_)
        ));
        let BodyStep::Refuse(d, f) =
            body(&[(A, B, "refs/heads/agent/x"), (A, B, "refs/heads/main")])
        else {
            panic!()
        };
        assert_eq!(d, "git push to refs/heads/main");
        assert_eq!(
            f.refs,
            ["update refs/heads/agent/x", "update refs/heads/main"]
        );
        let BodyStep::Refuse(d, _) = body(&[(A, Z, "refs/heads/main")]) else {
            panic!()
        };
        assert_eq!(d, "git push to refs/heads/main (delete)");
        assert!(matches!(
            body(&[(A, B, "refs/heads/agentx")]),
            BodyStep::Refuse(..)
        ));
        assert!(matches!(
            body(&[(A, B, "refs/tags/agent/x")]),
            BodyStep::Refuse(..)
        ));
        // Not yet complete; then cut short.
        let full = push_body(&[(A, B, "refs/heads/agent/x")]);
        assert_eq!(
            check_body(&r, &check, &full[..10], false),
            BodyStep::NeedMore
        );
        assert!(matches!(
            check_body(&r, &check, &full[..10], true),
            BodyStep::Refuse(..)
        ));
        // Discovery for push needs push_refs too; without them, fetch only.
        let target = "/acme/app.git/info/refs?service=git-receive-pack";
        assert!(matches!(step(&r, "GET", target), Step::Allow(_)));
        let fetch_only = ServiceRules {
            push_refs: vec![],
            ..r.clone()
        };
        assert!(detail(&step(&fetch_only, "GET", target))
            .unwrap()
            .contains("fetch only"));
        assert!(detail(&step(&fetch_only, "POST", "/acme/app/git-receive-pack")).is_some());
        assert!(detail(&step(&r, "POST", "/acme/other/git-receive-pack")).is_some());
        // A compressed push cannot be read: refused.
        let path = NormalPath::parse("/acme/app/git-receive-pack").unwrap();
        let gz = ServiceRequest {
            method: "POST",
            path: &path,
            query: None,
            content_type: None,
            content_encoding: Some("gzip"),
        };
        assert!(matches!(super::check(&r, &gz), Step::Refuse(..)));
    }

    #[test]
    fn forge_rest_paths() {
        let git = rules(Some(Service::Git));
        let plain = rules(None);
        for r in [&git, &plain] {
            assert!(matches!(
                step(r, "POST", "/repos/acme/app/pulls"),
                Step::Allow(Some(_))
            ));
            assert!(matches!(
                step(r, "GET", "/api/v3/repos/ACME/app"),
                Step::Allow(Some(_))
            ));
            assert!(matches!(
                step(r, "GET", "/api/v1/repos/tools/x/issues"),
                Step::Allow(Some(_))
            ));
            assert!(detail(&step(r, "DELETE", "/repos/acme/other")).is_some());
            assert!(detail(&step(r, "GET", "/repositories/123/contents/x")).is_some());
            assert!(detail(&step(r, "GET", "/repos/acme")).is_some());
        }
        assert!(detail(&step(&git, "GET", "/user")).is_some());
        assert_eq!(step(&plain, "GET", "/user"), Step::Allow(None));
    }

    #[test]
    fn registry_downloads_only() {
        let r = rules(Some(Service::Registry));
        assert!(matches!(
            step(&r, "GET", "/simple/requests/"),
            Step::Allow(_)
        ));
        assert!(matches!(step(&r, "HEAD", "/left-pad"), Step::Allow(_)));
        for (m, p, what) in [
            ("PUT", "/left-pad", "registry publish"),
            ("PUT", "/@scope%2Fpkg", "registry publish"),
            ("DELETE", "/left-pad/-rev/3-abc", "registry unpublish"),
            (
                "PUT",
                "/left-pad/-rev/3-abc",
                "registry owner or tag change",
            ),
            ("POST", "/legacy/", "registry publish"),
            ("PUT", "/api/v1/crates/new", "registry publish"),
            ("DELETE", "/api/v1/crates/x/1.0.0/yank", "registry yank"),
            ("PUT", "/api/v1/crates/x/owners", "registry owner change"),
            ("POST", "/-/npm/v1/tokens", "registry token change"),
            ("PUT", "/-/user/org.couchdb.user:x", "registry login"),
            ("PATCH", "/x", "registry write"),
            (
                "POST",
                "/-/npm/v1/security/advisories/bulk",
                "registry write",
            ),
        ] {
            let Ok(path) = NormalPath::parse(p) else {
                continue;
            };
            let s = super::check(
                &r,
                &ServiceRequest {
                    method: m,
                    path: &path,
                    query: None,
                    content_type: None,
                    content_encoding: None,
                },
            );
            assert!(detail(&s).unwrap().starts_with(what), "{m} {p}: {s:?}");
        }
    }

    #[test]
    fn graphql_operations() {
        let r = rules(Some(Service::Graphql));
        let Step::Body(check) = step(&r, "POST", "/graphql") else {
            panic!()
        };
        let body = |b: &str| check_body(&r, &check, b.as_bytes(), true);
        let refused = |b: &str| match body(b) {
            BodyStep::Refuse(d, _) => d,
            other => panic!("{b}: {other:?}"),
        };
        assert!(matches!(
            body(r#"{"query":"{ viewer { login } }"}"#),
            BodyStep::Allow(_)
        ));
        assert!(matches!(
            body(r#"{"query":"mutation { createPullRequest(input: {}) { id } }"}"#),
            BodyStep::Allow(_)
        ));
        assert_eq!(
            refused(r#"{"query":"mutation { deleteRepository(input: {}) { id } }"}"#),
            "graphql mutation deleteRepository"
        );
        // An alias named like an allowed mutation.
        assert_eq!(
            refused(
                r#"{"query":"mutation { createPullRequest: deleteRepository(input: {}) { id } }"}"#
            ),
            "graphql mutation deleteRepository"
        );
        // A batch: each element.
        assert_eq!(
            refused(r#"[{"query":"{ a }"},{"query":"mutation { deleteRepository { id } }"}]"#),
            "graphql mutation deleteRepository"
        );
        assert_eq!(
            refused(r#"{"query":"subscription { x }"}"#),
            "graphql subscription"
        );
        assert!(
            refused(r#"{"query":"query A { a } mutation B { deleteRepository }"}"#)
                .contains("ambiguous")
        );
        assert!(matches!(
            check_body(&r, &check, b"{", false),
            BodyStep::NeedMore
        ));
        // GET
        assert!(matches!(
            step(&r, "GET", "/graphql?query=%7Ba%7D"),
            Step::Allow(Some(_))
        ));
        assert_eq!(
            detail(&step(
                &r,
                "GET",
                "/graphql?query=mutation%7BdeleteRepository%7D"
            )),
            Some("graphql mutation deleteRepository")
        );
        assert_eq!(step(&r, "GET", "/"), Step::Allow(None));
        assert!(detail(&step(&r, "POST", "/graphql?query=%7Ba%7D")).is_some());
        assert!(detail(&step(&r, "PUT", "/graphql")).is_some());
        // Queries only without graphql_mutations.
        let queries = ServiceRules {
            graphql_mutations: None,
            ..r.clone()
        };
        assert!(matches!(
            check_body(
                &queries,
                &check,
                br#"{"query":"mutation { createPullRequest { id } }"}"#,
                true
            ),
            BodyStep::Refuse(..)
        ));
    }

    #[test]
    fn model_calls() {
        let r = rules(Some(Service::LlmApi));
        let Step::Body(check) = step(&r, "POST", "/v1/messages") else {
            panic!()
        };
        let body = |b: &str| check_body(&r, &check, b.as_bytes(), true);
        assert!(matches!(
            body(r#"{"model":"claude-sonnet-4","stream":true}"#),
            BodyStep::Allow(_)
        ));
        assert!(matches!(
            body(r#"{"model":"gpt-4o-mini"}"#),
            BodyStep::Allow(_)
        ));
        for (b, d) in [
            (r#"{"model":"gpt-x"}"#, "model gpt-x"),
            (r#"{"messages":[]}"#, "model missing"),
            (r#"{"model":"gpt-4o-mini-2"}"#, "model gpt-4o-mini-2"),
        ] {
            assert_eq!(
                body(b),
                BodyStep::Refuse(
                    d.into(),
                    ServiceFacts {
                        model: d
                            .strip_prefix("model ")
                            .filter(|_| d != "model missing")
                            .map(str::to_string),
                        ..check.facts.clone()
                    }
                )
            );
        }
        for b in [
            r#"{"model":"claude-x","model":"gpt-x"}"#,
            r#"{"model":"claude-x","mod\u0065l":"gpt-x"}"#,
            r#"{"model":["claude-x"]}"#,
            r#"[{"model":"claude-x"}]"#,
            "model=claude-x",
        ] {
            assert!(matches!(body(b), BodyStep::Refuse(..)), "{b}");
        }
        assert!(matches!(
            step(&r, "POST", "/v1/chat/completions"),
            Step::Body(_)
        ));
        assert!(matches!(
            step(&r, "POST", "/openai/v1/responses"),
            Step::Body(_)
        ));
        assert!(matches!(step(&r, "GET", "/v1/models"), Step::Allow(None)));
        assert!(detail(&step(&r, "POST", "/v1/files")).is_some());
        assert!(detail(&step(&r, "DELETE", "/v1/messages")).is_some());
        assert!(matches!(
            step(&r, "POST", "/v1beta/models/claude-x:generateContent"),
            Step::Allow(Some(_))
        ));
        assert_eq!(
            detail(&step(
                &r,
                "POST",
                "/v1beta/models/gemini-pro:streamGenerateContent"
            )),
            Some("model gemini-pro")
        );
        assert_eq!(
            detail(&step(&r, "POST", "/model/gpt-x/invoke")),
            Some("model gpt-x")
        );
    }

    #[test]
    fn repo_patterns() {
        assert!(repo_matches("acme/app", "ACME/App"));
        assert!(repo_matches("acme/*", "acme/x"));
        assert!(!repo_matches("acme/*", "acme/x/y"));
        assert!(!repo_matches("acme/app", "acme/app2"));
        assert!(repo_matches("acme/app-*", "acme/app-1"));
        assert!(repo_matches("group/sub/*", "group/sub/x"));
    }
}
