//! The engine of `palisade explain`: the decision the policy takes for
//! one client and target, through the same code the proxy runs.

use std::net::IpAddr;

use serde::Serialize;

use hickory_server::proto::rr::RecordType;

use crate::config::Config;
use crate::config::ServiceRules;
use crate::dns::decide::{decide_query, OrgDns};
use crate::policy::request::{NormalPath, RequestFacts};
use crate::policy::service::{self, BodyKind, BodyStep, ServiceFacts, ServiceRequest, Step};
use crate::policy::{Layer, OrgRef, Policy, Reason, Verdict};
use crate::proto::target::{ExplainTarget, Host};
use crate::proxy::decide::{decide_with, Addresses};
use crate::resolve::Resolver;

/// What `explain` reports.
#[derive(Debug, Serialize)]
pub struct Explanation {
    pub client: IpAddr,
    pub kind: &'static str,
    pub host: String,
    pub port: Option<u16>,
    pub qtype: Option<String>,
    pub decision: &'static str,
    pub reason: Reason,
    pub org: Option<String>,
    pub rule: Option<String>,
    /// The layer of the deciding rule: `baseline` (the operator's
    /// `[policy] baseline`) or `org`; null where no rule decided.
    pub layer: Option<Layer>,
    /// Addresses that would be dialled (names resolved only when the decision depends on them).
    pub dial: Vec<IpAddr>,
    pub detail: Option<String>,
    pub policy: String,
    /// SHA-256 of the baseline file, null without one.
    pub baseline: Option<String>,
    /// For `https://host/path` targets whose rule intercepts: the decision
    /// the proxy takes on that request inside the intercepted connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestExplanation>,
}

/// A request-level decision inside an intercepted connection.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct RequestExplanation {
    pub method: String,
    /// The path as given.
    pub path: String,
    /// The path the rules matched (`None`: normalisation refused it).
    pub normalised_path: Option<String>,
    pub decision: &'static str,
    pub reason: Reason,
    pub rule: Option<String>,
    /// Why a refusal refused (the evidence record's `detail`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Ids of the credentials that would be added (never their values).
    pub credentials: Vec<String>,
    /// Under service rules: what the request was to its service (as the
    /// record would carry it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceFacts>,
}

/// What `explain` is told of a request beyond its method and path, for a
/// rule's service rules: the query, and what the body would say.
#[derive(Debug, Clone, Default)]
pub struct ServiceAsk {
    /// The target URL's query (without `?`).
    pub query: Option<String>,
    /// The refs a push updates (`:REF`: deletes it).
    pub git_push: Vec<String>,
    /// A GraphQL document, sent as `{"query": …}`.
    pub graphql: Option<String>,
    /// Its `operationName`.
    pub operation_name: Option<String>,
    /// A model API call's `model`.
    pub model: Option<String>,
}

/// The query of an `http(s)://host/path?query` target, if it has one.
pub fn target_query(target: &str) -> Option<String> {
    let (_, rest) = target.split_once('?')?;
    Some(rest.split('#').next().unwrap_or("").to_string())
}

/// The body `ask` describes for the body check `kind`, as a client would
/// send it; `None` if `ask` says nothing of it.
fn body_of(kind: BodyKind, ask: &ServiceAsk) -> Option<Vec<u8>> {
    match kind {
        BodyKind::GitPush => {
            if ask.git_push.is_empty() {
                return None;
            }
            let (old, new, zero) = ("1".repeat(40), "2".repeat(40), "0".repeat(40));
            let mut body = Vec::new();
            for (i, r) in ask.git_push.iter().enumerate() {
                let (to, name) = match r.strip_prefix(':') {
                    Some(name) => (&zero, name),
                    None => (&new, r.as_str()),
                };
                let caps = if i == 0 { "\0report-status" } else { "" };
                let line = format!("{old} {to} {name}{caps}\n");
                body.extend_from_slice(format!("{:04x}", line.len() + 4).as_bytes());
                body.extend_from_slice(line.as_bytes());
            }
            body.extend_from_slice(b"0000");
            Some(body)
        }
        BodyKind::Graphql => {
            let query = ask.graphql.as_ref()?;
            let v = serde_json::json!({"query": query, "operationName": ask.operation_name});
            Some(v.to_string().into_bytes())
        }
        BodyKind::Model => {
            let model = ask.model.as_ref()?;
            Some(
                serde_json::json!({ "model": model })
                    .to_string()
                    .into_bytes(),
            )
        }
    }
}

/// The service rules' decision on an allowed request, through the pure
/// checks the live path runs ([`service::check`], [`service::check_body`]),
/// the body made from `ask`: `None` when the rule has none; else the
/// refusal's detail (if refused) and the facts.
fn service_explanation(
    rules: &ServiceRules,
    method: &str,
    path: &NormalPath,
    ask: &ServiceAsk,
) -> (Option<String>, Option<ServiceFacts>) {
    let req = ServiceRequest {
        method,
        path,
        query: ask.query.as_deref(),
        content_type: None,
        content_encoding: None,
    };
    match service::check(rules, &req) {
        Step::Allow(facts) => (None, facts),
        Step::Refuse(why, facts) => (Some(why), facts),
        Step::Body(check) => match body_of(check.kind, ask) {
            None => {
                let flag = match check.kind {
                    BodyKind::GitPush => "--git-push REF",
                    BodyKind::Graphql => "--graphql DOCUMENT",
                    BodyKind::Model => "--model NAME",
                };
                let why = format!("the decision depends on the request body: give {flag}");
                (Some(why), Some(check.facts))
            }
            Some(body) => match service::check_body(rules, &check, &body, true) {
                BodyStep::Allow(facts) => (None, Some(facts)),
                BodyStep::Refuse(why, facts) => (Some(why), Some(facts)),
                BodyStep::NeedMore => (Some("the body is incomplete".into()), Some(check.facts)),
            },
        },
    }
}

/// The path of an `http(s)://host/path` target (no query), if it has one,
/// as a client would send it (the authority ends where
/// [`crate::proto::target::parse_explain_target`] ends it).
pub fn target_path(target: &str) -> Option<String> {
    let lower = target.get(..8).unwrap_or(target).to_ascii_lowercase();
    let rest = if lower.starts_with("https://") {
        target.get(8..)?
    } else if lower.starts_with("http://") {
        target.get(7..)?
    } else {
        return None;
    };
    let path = match rest.find(['/', '?', '#', '\\']) {
        Some(i) if !rest[i..].starts_with(['?', '#']) => rest.get(i..)?,
        _ => "/",
    };
    let end = path.find(['?', '#']).unwrap_or(path.len());
    Some(path.get(..end).unwrap_or(path).to_string())
}

/// The decision the proxy takes on `method path` inside a connection to
/// `name` that `rule` of `org` intercepts: [`Policy::decide_request`], the
/// call the live path makes, with the org's credentials from `config`.
pub fn request_explanation(
    policy: &Policy,
    config: &Config,
    org: &OrgRef,
    rule: &str,
    name: &str,
    (method, path): (&str, &str),
    ask: &ServiceAsk,
) -> RequestExplanation {
    let credentials = config
        .orgs
        .get(org.index)
        .map_or(&[][..], |o| o.credentials.as_slice());
    let req = RequestFacts {
        host: name,
        method,
        path,
    };
    let mut d = policy.decide_request(org, rule, req, credentials);
    let mut service = None;
    let rules = policy.intercept_rules(org, rule);
    if let (true, Some(p), Some(rules)) = (
        d.is_allow(),
        d.path.as_ref(),
        rules.as_deref().and_then(|r| r.service.as_ref()),
    ) {
        let (refused, facts) = service_explanation(rules, method, p, ask);
        service = facts;
        if let Some(why) = refused {
            d.verdict.reason = Reason::ServiceDenied;
            d.detail = Some(why);
            d.credentials.clear();
        }
    }
    RequestExplanation {
        service,
        method: method.to_string(),
        path: path.to_string(),
        normalised_path: d.path.as_ref().map(|p| p.to_string()),
        decision: d.verdict.reason.decision(),
        reason: d.verdict.reason,
        rule: d.verdict.rule.as_ref().map(|r| r.to_string()),
        detail: d.detail,
        credentials: d
            .credentials
            .iter()
            .filter_map(|&i| credentials.get(i))
            .map(|c| c.id.clone())
            .collect(),
    }
}

fn explanation(
    client: IpAddr,
    kind: &'static str,
    host: &Host,
    port: Option<u16>,
    verdict: Verdict,
    policy: &Policy,
) -> Explanation {
    Explanation {
        client,
        kind,
        host: host.to_string(),
        port,
        qtype: None,
        decision: verdict.reason.decision(),
        reason: verdict.reason,
        layer: policy.layer_of(&verdict),
        org: verdict.org.map(|o| o.name.to_string()),
        rule: verdict.rule.map(|r| r.to_string()),
        dial: Vec::new(),
        detail: None,
        policy: policy.hash().to_string(),
        baseline: policy.baseline_hash().map(|h| h.to_string()),
        request: None,
    }
}

/// What an allowed name under a wildcard rule with a budget spends (an
/// explanation spends nothing itself).
fn budget_note(policy: &Policy, verdict: &Verdict) -> Option<String> {
    let (Some(org), Some(rule), true) = (&verdict.org, &verdict.rule, verdict.is_allow()) else {
        return None;
    };
    policy.name_budget(org, rule).map(|budget| {
        format!(
            "a name new to {} within a minute spends one of rule {rule}'s \
             {budget} new names a minute (past them: name_budget_exceeded)",
            org.name
        )
    })
}

/// The interval of a time-bound rule: the allowing rule's, or those of
/// the rules that would match but are outside theirs now.
fn window_note(
    policy: &Policy,
    org: &OrgRef,
    (host, port): (&Host, u16),
    verdict: &Verdict,
) -> Option<String> {
    if verdict.is_allow() {
        let rule = verdict.rule.as_deref()?;
        let w = policy.window_of(org, rule)?;
        return Some(format!(
            "rule {rule} is time-bound: it matches {} (outside it, it does not)",
            w.describe()
        ));
    }
    let dormant: Vec<String> = policy
        .dormant(org, host, port)
        .into_iter()
        .map(|(rule, w)| format!("rule {rule} matches only {}", w.describe()))
        .collect();
    (!dormant.is_empty()).then(|| format!("{}, not now", dormant.join("; ")))
}

/// The volume budgets an allowed connection spends from: the rule's and
/// the org's, each with its limits and window.
fn volume_note(policy: &Policy, verdict: &Verdict) -> Option<String> {
    let (Some(org), true) = (&verdict.org, verdict.is_allow()) else {
        return None;
    };
    let rule = verdict.rule.as_deref().unwrap_or("");
    let (by_rule, by_org) = policy.volume(org, rule);
    let describe = |v: crate::config::Volume, whose: String| {
        let dirs: Vec<String> = [("up", v.up), ("down", v.down)]
            .into_iter()
            .filter_map(|(d, n)| n.map(|n| format!("{n} bytes {d}")))
            .collect();
        format!(
            "{whose} volume budget of {} per {}",
            dirs.join(" and "),
            humantime::format_duration(v.window)
        )
    };
    let parts: Vec<String> = [
        by_rule.map(|v| describe(v, format!("rule {rule}'s"))),
        by_org.map(|v| describe(v, format!("org {}'s", org.name))),
    ]
    .into_iter()
    .flatten()
    .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "its bytes spend from {} (past it: volume_exceeded)",
            parts.join(" and from ")
        )
    })
}

/// The synthetic pool `ip` is in, if any.
fn synthetic_pool(config: &Config, ip: IpAddr) -> Option<ipnet::IpNet> {
    let ip = crate::policy::canonical(ip);
    [
        config.dns.synthetic_pool.map(ipnet::IpNet::V4),
        config.dns.synthetic_pool_v6.map(ipnet::IpNet::V6),
    ]
    .into_iter()
    .flatten()
    .find(|net| net.contains(&ip))
}

/// What a synthetic answer to `name` would be (explain binds nothing).
fn synthetic_note(
    config: &Config,
    verdict: &Verdict,
    name: &str,
    family: crate::handout::synthetic::Family,
) -> Option<String> {
    let org = verdict.org.as_ref()?;
    let pool = match family {
        crate::handout::synthetic::Family::V4 => config.dns.synthetic_pool.map(ipnet::IpNet::V4),
        crate::handout::synthetic::Family::V6 => config.dns.synthetic_pool_v6.map(ipnet::IpNet::V6),
    };
    let shown = crate::dns::decide::shown_name(name).unwrap_or_else(|| name.to_string());
    Some(match pool {
        Some(pool) => format!(
            "the answer: one address of {pool} bound to ({}, {shown}) (the one bound already, \
             else the next free one), TTL {} s; a connection to it is decided as {shown}, \
             which is resolved only then",
            org.name,
            crate::handout::synthetic::SYNTHETIC_TTL
        ),
        None => "no synthetic pool of this family: NODATA".to_string(),
    })
}

fn join_detail(detail: Option<String>, note: Option<String>) -> Option<String> {
    match (detail, note) {
        (Some(d), Some(n)) => Some(format!("{d}; {n}")),
        (d, n) => d.or(n),
    }
}

/// Decide `target` for `client` under `config`.
pub async fn explain(config: &Config, client: IpAddr, target: &ExplainTarget) -> Explanation {
    explain_request(config, client, target, None, &ServiceAsk::default()).await
}

/// [`explain`], plus the request-level decision for `(method, path)` when
/// the deciding rule intercepts.
pub async fn explain_request(
    config: &Config,
    client: IpAddr,
    target: &ExplainTarget,
    request: Option<(&str, &str)>,
    ask: &ServiceAsk,
) -> Explanation {
    // As `run` would decide here: this host's own addresses are denied too
    // (a host whose interfaces cannot be listed would not start `run`;
    // explain then decides without them).
    let host = crate::host::addresses().unwrap_or_default();
    let policy = Policy::with_host(config, &host).at(std::time::SystemTime::now());
    match target {
        ExplainTarget::Tcp { host, port, .. } => {
            explain_tcp(config, &policy, client, (host, *port), request, ask).await
        }
        ExplainTarget::Dns { name, qtype } => explain_dns(config, &policy, client, name, qtype),
    }
}

/// A verdict no rule gave: `reason`, for `org`.
fn unruled(org: Option<OrgRef>, reason: Reason) -> Verdict {
    Verdict {
        org,
        reason,
        rule: None,
        would_deny: None,
    }
}

/// A connection to `(host, port)`: the proxy's decision step, resolution
/// included, and the request-level decision when the rule intercepts.
async fn explain_tcp(
    config: &Config,
    policy: &Policy,
    client: IpAddr,
    (host, port): (&Host, u16),
    request: Option<(&str, &str)>,
    ask: &ServiceAsk,
) -> Explanation {
    let tcp = |verdict| explanation(client, "tcp", host, Some(port), verdict, policy);
    let Some(org) = policy.org_for(client) else {
        return tcp(unruled(None, Reason::UnknownClient));
    };
    if let Host::Ip(ip) = host {
        if let Some(pool) = synthetic_pool(config, *ip) {
            let mut x = tcp(unruled(Some(org), Reason::SyntheticUnbound));
            x.detail = Some(format!(
                "{ip} is in the synthetic pool {pool}: at run time it stands for the name \
                 the DNS shim has bound it to for this org at that moment, and a connection \
                 to it is decided as a connection to that name (explain the name as \
                 HOST:{port}; its SNI or Host must match it); bound to no name of this org \
                 it is denied synthetic_unbound; it is never dialled itself"
            ));
            return x;
        }
    }
    let resolver = match Resolver::new(&config.dns.upstream, config.dns.resolve_timeout.get()) {
        Ok(resolver) => resolver,
        Err(e) => {
            let mut x = tcp(unruled(Some(org), Reason::ResolutionFailed));
            x.detail = Some(e.to_string());
            return x;
        }
    };
    let outcome = decide_with(
        policy,
        (&resolver, None, None),
        &org,
        (host, port),
        Addresses::Resolved,
    )
    .await;
    let rule = outcome.verdict.rule.clone();
    let allowed = outcome.verdict.is_allow();
    let note = join_detail(
        budget_note(policy, &outcome.verdict),
        volume_note(policy, &outcome.verdict),
    );
    let note = join_detail(
        note,
        window_note(policy, &org, (host, port), &outcome.verdict),
    );
    let mut x = tcp(outcome.verdict);
    x.dial = outcome.dial;
    x.detail = join_detail(outcome.detail, note);
    if let (true, Some(rule), Some((method, path)), Host::Name(name)) =
        (allowed, rule, request, host)
    {
        if policy.intercept_rules(&org, &rule).is_some() {
            x.request = Some(request_explanation(
                policy,
                config,
                &org,
                &rule,
                name,
                (method, path),
                ask,
            ));
        }
    }
    x
}

/// A DNS query: the shim's own decision (special names, query types),
/// which asks the policy the name question.
fn explain_dns(
    config: &Config,
    policy: &Policy,
    client: IpAddr,
    name: &Host,
    qtype: &str,
) -> Explanation {
    let orgs: Vec<OrgDns> = config.orgs.iter().map(OrgDns::from_config).collect();
    let rtype = qtype
        .parse::<RecordType>()
        .unwrap_or(RecordType::Unknown(0));
    let (verdict, detail) = match name {
        Host::Name(n) => {
            let d = decide_query(policy, &orgs, client, n, rtype);
            let note = match d.action {
                crate::dns::decide::Action::Forward => budget_note(policy, &d.verdict),
                crate::dns::decide::Action::Synthetic(family) => {
                    synthetic_note(config, &d.verdict, n, family)
                }
                _ => None,
            };
            let detail = join_detail(Some(d.action.describe().to_string()), note);
            (d.verdict, detail)
        }
        Host::Ip(_) => (unruled(policy.org_for(client), Reason::BadRequest), None),
    };
    let mut x = explanation(client, "dns", name, None, verdict, policy);
    x.qtype = Some(qtype.to_string());
    x.detail = detail;
    x
}

impl std::fmt::Display for Explanation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let target = match (self.port, &self.qtype) {
            (Some(port), _) => format!("{}:{port}", self.host),
            (None, Some(q)) => format!("dns:{}/{q}", self.host),
            (None, None) => self.host.clone(),
        };
        writeln!(f, "decision: {}", self.decision)?;
        writeln!(f, "reason:   {}", self.reason)?;
        writeln!(f, "org:      {}", self.org.as_deref().unwrap_or("(none)"))?;
        writeln!(f, "rule:     {}", self.rule.as_deref().unwrap_or("(none)"))?;
        if let Some(layer) = self.layer {
            writeln!(f, "layer:    {}", layer.as_str())?;
        }
        writeln!(f, "client:   {}", self.client)?;
        writeln!(f, "target:   {target} ({})", self.kind)?;
        if !self.dial.is_empty() {
            let list: Vec<String> = self.dial.iter().map(|a| a.to_string()).collect();
            writeln!(f, "dial:     {}", list.join(", "))?;
        }
        if let Some(d) = &self.detail {
            writeln!(f, "detail:   {d}")?;
        }
        if let Some(r) = &self.request {
            writeln!(f, "intercepted request: {} {}", r.method, r.path)?;
            match &r.normalised_path {
                Some(p) if *p != r.path => writeln!(f, "  path:     {p} (normalised)")?,
                _ => {}
            }
            writeln!(f, "  decision: {}", r.decision)?;
            writeln!(f, "  reason:   {}", r.reason)?;
            writeln!(f, "  rule:     {}", r.rule.as_deref().unwrap_or("(none)"))?;
            if let Some(d) = &r.detail {
                writeln!(f, "  detail:   {d}")?;
            }
            if !r.credentials.is_empty() {
                writeln!(f, "  adds credential: {}", r.credentials.join(", "))?;
            }
            if let Some(s) = &r.service {
                let mut parts = vec![s.name.clone()];
                parts.extend(s.operation.clone());
                parts.extend(s.repo.clone());
                parts.extend(s.model.clone().map(|m| format!("model {m}")));
                if !s.refs.is_empty() {
                    parts.push(format!("refs: {}", s.refs.join(", ")));
                }
                writeln!(f, "  service:  {}", parts.join(" "))?;
            }
        }
        if let Some(b) = &self.baseline {
            writeln!(f, "baseline: {b}")?;
        }
        write!(f, "policy:   {}", self.policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::target::parse_explain_target;
    use std::path::Path;

    const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]

[[org.allow]]
id = "registry"
host = "reg.test"
intercept = true
methods = ["GET", "HEAD", "POST", "TRACE"]
paths = ["/simple/", "/api/*"]
deny_paths = ["/api/internal*"]

[[org.allow]]
id = "open"
host = "open.test"
intercept = true

[[org.credential]]
id = "all"
host = "reg.test"
header = "Authorization"
secret_env = "T1"

[[org.credential]]
id = "scoped"
host = "reg.test"
header = "X-Scoped"
paths = ["/api/public/"]
secret_env = "T2"

[[org.credential]]
id = "open-scoped"
host = "open.test"
header = "X-Open"
methods = ["GET"]
paths = ["/scoped/"]
secret_env = "T3"
"#;

    /// `explain`'s request decision is the live path's, for encoded,
    /// dot-segment and parameter paths, odd methods, HTTP/1.1 and HTTP/2.
    #[test]
    fn explain_decides_requests_as_the_live_path_does() {
        let config = crate::config::from_str(POLICY, Path::new("p.toml")).unwrap();
        let policy = Policy::new(&config);
        let org = policy.org_for("198.19.1.5".parse().unwrap()).unwrap();
        let creds = &config.orgs[0].credentials;
        let methods = ["GET", "get", "POST", "DELETE", "TRACE", "trace", "TRACK"];
        let paths = [
            "/",
            "/simple/x",
            "/%73imple/x",
            "/api/internal",
            "/api/%69nternal",
            "/api/%49nternal",
            "/api/%49nternal/keys",
            "/API/internal/keys",
            "/api/INTERNAL/keys",
            "/api/public/x",
            "/api/%70ublic/x",
            "/api/public/../internal",
            "/api/public/..;/internal",
            "/api/public/.;x/internal",
            "/api/public/..;jsessionid=1/internal",
            "/simple/%2e%2e/api/internal",
            "/simple/%2fapi",
            "/simple/a%5cb",
            "/simple//x",
            "/simple/x;jsessionid=1",
            "/simple/%zz",
            "/simple/%00",
            "/simple/%2569",
            "/simple/a\\b",
            "/simple/%3F/x",
            "/scoped/x",
            "/%73coped/x",
            "/SCOPED/x",
            "/scoped/../x",
        ];
        let mut seen = std::collections::HashSet::new();
        for (rule, name) in [("registry", "reg.test"), ("open", "open.test")] {
            for method in methods {
                for path in paths {
                    let explained = request_explanation(
                        &policy,
                        &config,
                        &org,
                        rule,
                        name,
                        (method, path),
                        &ServiceAsk::default(),
                    );
                    for h2 in [false, true] {
                        let mut b = http::Request::builder()
                            .method(http::Method::from_bytes(method.as_bytes()).unwrap());
                        b = if h2 {
                            b.version(http::Version::HTTP_2)
                                .uri(format!("https://{name}{path}"))
                        } else {
                            b.uri(path).header(http::header::HOST, name)
                        };
                        let parts = b.body(()).unwrap().into_parts().0;
                        let live = crate::proxy::intercepted::serve::decide_parts(
                            &policy,
                            &org,
                            rule,
                            (name, 443),
                            &parts,
                            creds,
                        );
                        let ctx = format!("{rule} {method} {path} h2={h2}");
                        assert_eq!(explained.reason, live.verdict.reason, "{ctx}");
                        assert_eq!(
                            explained.rule.as_deref(),
                            live.verdict.rule.as_deref(),
                            "{ctx}"
                        );
                        assert_eq!(explained.detail, live.detail, "{ctx}");
                        assert_eq!(
                            explained.normalised_path,
                            live.path.as_ref().map(|p| p.to_string()),
                            "{ctx}"
                        );
                        let ids: Vec<String> = live
                            .credentials
                            .iter()
                            .map(|&i| creds[i].id.clone())
                            .collect();
                        assert_eq!(explained.credentials, ids, "{ctx}");
                    }
                    seen.insert((explained.reason, explained.credentials.join(",")));
                }
            }
        }
        // The sample exercises every outcome, credentials included.
        for want in [
            (Reason::RuleMatch, "all"),
            (Reason::RuleMatch, "all,scoped"),
            (Reason::RuleMatch, "open-scoped"),
            (Reason::RuleMatch, ""),
            (Reason::PathNotAllowed, ""),
            (Reason::MethodNotAllowed, ""),
        ] {
            assert!(
                seen.contains(&(want.0, want.1.to_string())),
                "{want:?} not in {seen:?}"
            );
        }
    }

    #[tokio::test]
    async fn explain_says_what_a_wildcard_name_spends() {
        let src = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n\
                   [[org.allow]]\nid = \"w\"\nhost = \"*.wild.test\"\nmax_new_names_per_minute = 7\n\
                   [[org.allow]]\nhost = \"exact.test\"\n";
        let config = crate::config::from_str(src, Path::new("p.toml")).unwrap();
        let client = "198.19.1.5".parse().unwrap();
        let dns = |name: &str| ExplainTarget::Dns {
            name: Host::Name(name.into()),
            qtype: "A".into(),
        };
        let x = explain(&config, client, &dns("x.wild.test")).await;
        let detail = x.detail.unwrap_or_default();
        assert!(detail.starts_with("forwarded upstream"), "{detail}");
        assert!(detail.contains("rule w's 7 new names a minute"), "{detail}");
        let x = explain(&config, client, &dns("exact.test")).await;
        assert!(!x.detail.unwrap_or_default().contains("new names"));
    }

    #[tokio::test]
    async fn explain_names_the_volume_budgets_a_connection_spends_from() {
        let src = "[[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n\
                   max_bytes_up = \"1GiB\"\n\
                   [[org.allow]]\nid = \"gh\"\ncidr = \"198.18.9.0/24\"\nports = [443]\n\
                   max_bytes_up = 1000\nmax_bytes_down = 2000\nvolume_window = \"10m\"\n";
        let config = crate::config::from_str(src, Path::new("p.toml")).unwrap();
        let client = "198.19.1.5".parse().unwrap();
        let target = ExplainTarget::Tcp {
            host: Host::Ip("198.18.9.1".parse().unwrap()),
            port: 443,
            scheme: None,
        };
        let x = explain(&config, client, &target).await;
        let detail = x.detail.unwrap_or_default();
        assert!(
            detail.contains(
                "rule gh's volume budget of 1000 bytes up and 2000 bytes down per 10m \
                 and from org acme's volume budget of 1073741824 bytes up per 1h"
            ),
            "{detail}"
        );
        assert!(detail.contains("volume_exceeded"), "{detail}");
    }

    #[tokio::test]
    async fn explain_says_what_a_synthetic_answer_and_address_are() {
        let src = "[dns]\nsynthetic_pool = \"198.18.128.0/24\"\n\
                   [[org]]\nname = \"acme\"\nclients = [\"198.19.1.0/24\"]\n\
                   dns_answers = \"synthetic\"\n[[org.allow]]\nhost = \"*.wild.test\"\n";
        let config = crate::config::from_str(src, Path::new("p.toml")).unwrap();
        let client = "198.19.1.5".parse().unwrap();
        let dns = |qtype: &str| ExplainTarget::Dns {
            name: Host::Name("x.wild.test".into()),
            qtype: qtype.into(),
        };
        let x = explain(&config, client, &dns("A")).await;
        let detail = x.detail.unwrap_or_default();
        assert_eq!(x.reason, Reason::RuleMatch);
        assert!(detail.contains("nothing sent upstream"), "{detail}");
        assert!(
            detail.contains("198.18.128.0/24 bound to (acme, x.wild.test)"),
            "{detail}"
        );
        assert!(detail.contains("TTL 10 s"), "{detail}");
        let x = explain(&config, client, &dns("AAAA")).await;
        assert!(x.detail.unwrap_or_default().contains("NODATA"));
        let target = parse_explain_target("198.18.128.7:443").unwrap();
        let x = explain(&config, client, &target).await;
        assert_eq!(x.reason, Reason::SyntheticUnbound);
        assert!(x.dial.is_empty());
        let detail = x.detail.unwrap_or_default();
        assert!(detail.contains("stands for the name"), "{detail}");
    }

    #[test]
    fn target_paths() {
        for (target, want) in [
            (
                "https://reg.test/api/%69nternal?x=1",
                Some("/api/%69nternal"),
            ),
            ("https://reg.test", Some("/")),
            ("https://reg.test?x=/a", Some("/")),
            ("HTTPS://reg.test/a/..;/b#f", Some("/a/..;/b")),
            ("https://reg.test\\..\\x", Some("\\..\\x")),
            ("reg.test:443", None),
        ] {
            assert_eq!(target_path(target).as_deref(), want, "{target}");
        }
    }

    /// Service rules in `explain`: the pure checks the live path runs, the
    /// body made from the flags.
    #[test]
    fn explain_takes_service_requests() {
        let src = r#"
[[org]]
name = "acme"
clients = ["198.19.1.0/24"]

[[org.allow]]
id = "forge"
host = "git.test"
intercept = true
service = "git"
repos = ["acme/app"]
push_refs = ["refs/heads/agent/*"]

[[org.allow]]
id = "gql"
host = "gql.test"
intercept = true
service = "graphql"
graphql_mutations = ["createPullRequest"]

[[org.allow]]
id = "models"
host = "llm.test"
intercept = true
service = "llm-api"
models = ["claude-*"]
"#;
        let config = crate::config::from_str(src, Path::new("p.toml")).unwrap();
        let policy = Policy::new(&config);
        let org = policy.org_for("198.19.1.5".parse().unwrap()).unwrap();
        let ask = |f: &dyn Fn(&mut ServiceAsk)| {
            let mut a = ServiceAsk::default();
            f(&mut a);
            a
        };
        let x = |rule: &str, host: &str, req: (&str, &str), a: &ServiceAsk| {
            let r = request_explanation(&policy, &config, &org, rule, host, req, a);
            (r.reason, r.detail.unwrap_or_default())
        };
        let push = ("POST", "/acme/app.git/git-receive-pack");
        let main = ask(&|a| a.git_push = vec!["refs/heads/main".into()]);
        assert_eq!(
            x("forge", "git.test", push, &main),
            (Reason::ServiceDenied, "git push to refs/heads/main".into())
        );
        let agent = ask(&|a| a.git_push = vec!["refs/heads/agent/x".into()]);
        assert_eq!(x("forge", "git.test", push, &agent).0, Reason::RuleMatch);
        let del = ask(&|a| a.git_push = vec![":refs/heads/main".into()]);
        assert!(x("forge", "git.test", push, &del).1.contains("(delete)"));
        let none = ServiceAsk::default();
        assert!(x("forge", "git.test", push, &none).1.contains("--git-push"));
        let fetch = ("POST", "/acme/other/git-upload-pack");
        assert_eq!(
            x("forge", "git.test", fetch, &none).0,
            Reason::ServiceDenied
        );
        let m = ask(&|a| a.graphql = Some("mutation { deleteRepository { id } }".into()));
        assert_eq!(
            x("gql", "gql.test", ("POST", "/graphql"), &m),
            (
                Reason::ServiceDenied,
                "graphql mutation deleteRepository".into()
            )
        );
        let q = ask(&|a| a.graphql = Some("{ viewer { login } }".into()));
        assert_eq!(
            x("gql", "gql.test", ("POST", "/graphql"), &q).0,
            Reason::RuleMatch
        );
        let gpt = ask(&|a| a.model = Some("gpt-x".into()));
        assert_eq!(
            x("models", "llm.test", ("POST", "/v1/messages"), &gpt),
            (Reason::ServiceDenied, "model gpt-x".into())
        );
        assert_eq!(
            target_query("https://gql.test/graphql?query=%7Ba%7D#f").as_deref(),
            Some("query=%7Ba%7D")
        );
    }
}
