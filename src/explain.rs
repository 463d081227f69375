//! `palisade explain`: the decision the policy takes for one client and
//! target, through the same code the proxy runs.

use std::net::IpAddr;

use serde::Serialize;

use hickory_server::proto::rr::RecordType;

use crate::config::Config;
use crate::dns::decide::{decide_query, OrgDns};
use crate::policy::{Policy, Reason, Verdict};
use crate::proto::target::{ExplainTarget, Host};
use crate::proxy::decide_with;
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
    /// Addresses that would be dialled (names resolved only when the decision depends on them).
    pub dial: Vec<IpAddr>,
    pub detail: Option<String>,
    pub policy: String,
    /// For `https://host/path` targets whose rule intercepts: the decision
    /// the proxy takes on that request inside the intercepted connection.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestExplanation>,
}

/// A request-level decision inside an intercepted connection.
#[derive(Debug, Serialize)]
pub struct RequestExplanation {
    pub method: String,
    pub path: String,
    pub decision: &'static str,
    pub reason: Reason,
    pub rule: Option<String>,
    /// Ids of the credentials that would be added (never their values).
    pub credentials: Vec<String>,
}

/// The path of an `http(s)://host/path` target (no query), if it has one.
pub fn target_path(target: &str) -> Option<String> {
    let lower = target.get(..8).unwrap_or(target).to_ascii_lowercase();
    let rest = if lower.starts_with("https://") {
        target.get(8..)?
    } else if lower.starts_with("http://") {
        target.get(7..)?
    } else {
        return None;
    };
    let path = match rest.find('/') {
        Some(i) => rest.get(i..)?,
        None => "/",
    };
    let end = path.find(['?', '#']).unwrap_or(path.len());
    Some(path.get(..end).unwrap_or(path).to_string())
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
        org: verdict.org.map(|o| o.name.to_string()),
        rule: verdict.rule.map(|r| r.to_string()),
        dial: Vec::new(),
        detail: None,
        policy: policy.hash().to_string(),
        request: None,
    }
}

/// Decide `target` for `client` under `config`.
pub async fn explain(config: &Config, client: IpAddr, target: &ExplainTarget) -> Explanation {
    explain_request(config, client, target, None).await
}

/// [`explain`], plus the request-level decision for `(method, path)` when
/// the deciding rule intercepts.
pub async fn explain_request(
    config: &Config,
    client: IpAddr,
    target: &ExplainTarget,
    request: Option<(&str, &str)>,
) -> Explanation {
    let policy = Policy::new(config);
    match target {
        ExplainTarget::Tcp { host, port, .. } => {
            let Some(org) = policy.org_for(client) else {
                let verdict = Verdict {
                    org: None,
                    reason: Reason::UnknownClient,
                    rule: None,
                    would_deny: None,
                };
                return explanation(client, "tcp", host, Some(*port), verdict, &policy);
            };
            let resolver = Resolver::new(&config.dns.upstream, config.dns.resolve_timeout);
            let outcome = match resolver {
                Ok(resolver) => decide_with(&policy, &resolver, &org, host, *port).await,
                Err(e) => {
                    let mut x = explanation(
                        client,
                        "tcp",
                        host,
                        Some(*port),
                        Verdict {
                            org: Some(org),
                            reason: Reason::ResolutionFailed,
                            rule: None,
                            would_deny: None,
                        },
                        &policy,
                    );
                    x.detail = Some(e.to_string());
                    return x;
                }
            };
            let rule = outcome.verdict.rule.clone();
            let allowed = outcome.verdict.is_allow();
            let mut x = explanation(client, "tcp", host, Some(*port), outcome.verdict, &policy);
            x.dial = outcome.dial;
            x.detail = outcome.detail;
            if let (true, Some(rule), Some((method, path)), Host::Name(name)) =
                (allowed, rule, request, host)
            {
                if policy.intercept_rules(&org, &rule).is_some() {
                    let v = policy.decide_request(&org, &rule, method, path);
                    let credentials = config
                        .orgs
                        .get(org.index)
                        .map(|o| {
                            o.credentials
                                .iter()
                                .filter(|c| c.applies(name, method, path))
                                .map(|c| c.id.clone())
                                .collect()
                        })
                        .unwrap_or_default();
                    x.request = Some(RequestExplanation {
                        method: method.to_string(),
                        path: path.to_string(),
                        decision: v.reason.decision(),
                        reason: v.reason,
                        rule: v.rule.as_ref().map(|r| r.to_string()),
                        credentials: if v.is_allow() {
                            credentials
                        } else {
                            Vec::new()
                        },
                    });
                }
            }
            x
        }
        ExplainTarget::Dns { name, qtype } => {
            // The DNS shim's own decision (special names, query types), which
            // asks the policy the name question.
            let orgs: Vec<OrgDns> = config.orgs.iter().map(OrgDns::from_config).collect();
            let rtype = qtype
                .parse::<RecordType>()
                .unwrap_or(RecordType::Unknown(0));
            let (verdict, detail) = match name {
                Host::Name(n) => {
                    let d = decide_query(&policy, &orgs, client, n, rtype);
                    (d.verdict, Some(d.action.describe().to_string()))
                }
                Host::Ip(_) => (
                    Verdict {
                        org: policy.org_for(client),
                        reason: Reason::BadRequest,
                        rule: None,
                        would_deny: None,
                    },
                    None,
                ),
            };
            let mut x = explanation(client, "dns", name, None, verdict, &policy);
            x.qtype = Some(qtype.clone());
            x.detail = detail;
            x
        }
    }
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
            writeln!(f, "  decision: {}", r.decision)?;
            writeln!(f, "  reason:   {}", r.reason)?;
            writeln!(f, "  rule:     {}", r.rule.as_deref().unwrap_or("(none)"))?;
            if !r.credentials.is_empty() {
                writeln!(f, "  adds credential: {}", r.credentials.join(", "))?;
            }
        }
        write!(f, "policy:   {}", self.policy)
    }
}
