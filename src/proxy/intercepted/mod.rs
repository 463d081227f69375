//! Intercepted connections: which allowed connections are intercepted
//! ([`plan`]), and serving them ([`serve`], WebSocket in [`websocket`]) through the proxy's
//! HTTP layer ([`super::http`]), answering failures through its one mapping
//! ([`super::failure`]). What interception needs per org (CAs, credentials,
//! upstream trust) is [`crate::intercept`], held in the served state.

pub(crate) mod serve;
pub(crate) mod service;
pub(crate) mod websocket;

use std::sync::Arc;

use super::conn::{Conn, Intercepting, Plan};
use super::ctx::View;
use super::tunnel::Detected;
use crate::intercept::Interceptor;

/// Pass-through or interception for the connection `conn` (allowed or
/// not) whose first bytes were `detected`. Only an allow rule the org
/// marked `intercept = true`, or a grant naming a method or path
/// ([`Conn::grant_requests`]), is ever intercepted; either fails closed
/// when the connection cannot be (no TLS, interception not set up).
pub(crate) fn plan(intercept: Option<&Arc<Interceptor>>, conn: &Conn, detected: &Detected) -> Plan {
    let view = &conn.view;
    let (Some(org), Some(rule)) = (&view.org, &conn.verdict.rule) else {
        return Plan::PassThrough;
    };
    let intercepts = conn.grant_requests || view.policy.intercept_rules(org, rule).is_some();
    if !conn.is_allow() || !intercepts {
        return Plan::PassThrough;
    }
    match (detected, intercept) {
        (Detected::Tls(_), Some(ic)) => Plan::Intercept(Intercepting {
            interceptor: ic.clone(),
            org: org.clone(),
            rule: rule.clone(),
        }),
        (Detected::Tls(_), None) => Plan::Refuse("interception is not set up"),
        (Detected::Closed, _) => Plan::PassThrough,
        _ => Plan::Refuse("the host is intercepted: the connection must carry TLS"),
    }
}

/// For a plain `http://` request allowed by an intercepting rule: the
/// refusal and its detail, if the rule's method and path rules refuse it
/// (the same decision, path normalisation included, as inside an
/// intercepted connection; credentials are never added to plain HTTP).
pub(crate) fn plain_request(
    view: &View,
    verdict: &crate::policy::Verdict,
    method: &http::Method,
    uri: &http::Uri,
) -> Option<(crate::policy::Verdict, String)> {
    let (Some(org), Some(rule)) = (&view.org, &verdict.rule) else {
        return None;
    };
    let rules = view.policy.intercept_rules(org, rule)?;
    if rules.service.is_some() {
        // A push's refs, a GraphQL operation, a model are read only
        // inside an intercepted connection: fail closed elsewhere.
        let verdict = crate::policy::Verdict {
            reason: crate::policy::Reason::ServiceDenied,
            would_deny: None,
            ..verdict.clone()
        };
        let why =
            "service rules are enforced only on intercepted (TLS) requests: plain HTTP is refused";
        return Some((verdict, why.to_string()));
    }
    let req = crate::policy::request::RequestFacts {
        host: uri.host().unwrap_or(""),
        method: method.as_str(),
        path: uri.path(),
    };
    let d = view.policy.decide_request(org, rule, req, []);
    (!d.is_allow()).then(|| (d.verdict, d.detail.unwrap_or_default()))
}
