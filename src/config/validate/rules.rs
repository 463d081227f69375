//! `[[org.allow]]` and `[[org.deny]]`: targets, ports, tunnels and the
//! request rules of intercepting allow rules.

use std::collections::HashSet;

use toml::Spanned;

use super::service::{service_rules, RawService};
use super::values::{cidr, known};
use super::volume::volume;
use super::window::window;
use crate::config::ceiling;
use crate::config::error::Errors;
use crate::config::model::{
    Baseline, Carry, NameLimits, PathPattern, PortSet, RequestRules, RuleConfig, RuleTarget,
    DEFAULT_ALLOW_PORTS, MAX_NEW_NAMES_PER_MINUTE,
};
use crate::config::raw::{RawList, RawRule};
use crate::proto::http_request::{is_method_token, NormalPath};
use crate::proto::target::{normalize_host, Host};

/// Registered methods: a case variant of one (`get`) is refused in config,
/// since matching is exact and it would only ever match that odd spelling.
const REGISTERED_METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "TRACK", "PATCH",
];

/// HTTP methods: RFC 9110 tokens, matched exactly (methods are
/// case-sensitive), so a case variant of a registered method is refused.
pub(super) fn methods(value: RawList, errors: &mut Errors<'_>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in value.map(Spanned::into_inner).unwrap_or_default() {
        let text = m.get_ref().trim();
        let variant = REGISTERED_METHODS
            .iter()
            .find(|r| r.eq_ignore_ascii_case(text) && **r != text);
        if !is_method_token(text) {
            errors.at(
                m.span(),
                format!("invalid method {text:?} (an RFC 9110 token, e.g. \"GET\")"),
            );
        } else if let Some(r) = variant {
            errors.at(
                m.span(),
                format!("invalid method {text:?}: methods are case-sensitive, write {r:?}"),
            );
        } else if !out.iter().any(|o| o == text) {
            out.push(text.to_string());
        }
    }
    out
}

/// Path rules: start with `/`, printable ASCII, no `%` escapes, and in the
/// normal form requests are matched in (no `.`/`..` or empty segments, no
/// `;`, no `\\`): a rule that no normalised path can match is a mistake.
pub(super) fn paths(value: RawList, errors: &mut Errors<'_>) -> Vec<PathPattern> {
    let mut out = Vec::new();
    for p in value.map(Spanned::into_inner).unwrap_or_default() {
        let text = p.get_ref().trim();
        let printable = text.bytes().all(|b| b.is_ascii_graphic());
        if !text.starts_with('/') || !printable || text.len() > 1024 || text.contains('%') {
            errors.at(
                p.span(),
                format!(
                    "invalid path rule {text:?} (starts with '/', printable ASCII, no '%'; \
                     '*' matches anything)"
                ),
            );
        } else if let Err(why) = NormalPath::parse(text) {
            errors.at(
                p.span(),
                format!("invalid path rule {text:?}: requests are matched normalised, and {why}"),
            );
        } else {
            out.push(PathPattern(text.to_string()));
        }
    }
    out
}

/// The `[[org.allow]]` (`kind` "allow") or `[[org.deny]]` rules of `org`,
/// each checked against `baseline`'s ceiling; rule ids are unique in `ids`.
pub(super) fn validate_rules(
    org: &str,
    kind: &str,
    raw: Vec<Spanned<RawRule>>,
    ids: &mut HashSet<String>,
    baseline: Option<&Baseline>,
    errors: &mut Errors<'_>,
) -> Vec<RuleConfig> {
    let mut rules = Vec::new();
    for (n, spanned) in raw.into_iter().enumerate() {
        let span = spanned.span();
        let RawRule {
            id,
            host,
            cidr: cidr_value,
            ports,
            intercept,
            tunnel,
            methods,
            paths,
            deny_methods,
            deny_paths,
            max_new_names_per_minute,
            max_label_length,
            websocket,
            max_bytes_up,
            max_bytes_down,
            volume_window,
            service,
            repos,
            push_refs,
            graphql_mutations,
            models,
            not_before,
            expires,
        } = spanned.into_inner();
        let allow = kind == "allow";
        let window = window((not_before, expires), allow, errors);
        let volume = volume(
            (max_bytes_up, max_bytes_down, volume_window),
            (!allow).then_some(
                "is only valid on allow rules (a deny rule lets nothing through to budget)",
            ),
            errors,
        );
        let request = RawRequest {
            intercept,
            websocket,
            methods,
            paths,
            deny_methods,
            deny_paths,
            service: RawService {
                service,
                repos,
                push_refs,
                graphql_mutations,
                models,
            },
        };
        let intercept = request_rules(request, allow && host.is_some(), errors);
        let tunnel =
            tunnel.and_then(|t| tunnel_of(t, allow && host.is_some(), intercept.is_some(), errors));
        let id = rule_id(id, (org, kind, n), ids, errors);
        let target = rule_target(
            (host, cidr_value),
            allow,
            (span.clone(), &format!("rule {id:?}")),
            errors,
        );
        let ports = match ports {
            None if allow => PortSet::List(DEFAULT_ALLOW_PORTS.to_vec()),
            None => PortSet::All,
            Some(list) => port_list(&list, errors),
        };
        let wildcard = allow && matches!(target, Some(RuleTarget::Below(_)));
        let names = name_limits(wildcard, max_new_names_per_minute, max_label_length, errors);

        if let Some(target) = target {
            let rule = RuleConfig {
                id,
                target,
                ports,
                intercept,
                tunnel,
                names,
                volume,
                window,
            };
            if let (Some(baseline), true) = (baseline, allow) {
                check_ceiling(&rule, baseline, span, errors);
            }
            rules.push(rule);
        }
    }
    rules
}

/// The keys of a rule that say what is done with the requests inside an
/// intercepted connection.
struct RawRequest {
    intercept: Option<Spanned<bool>>,
    websocket: Option<Spanned<bool>>,
    methods: RawList,
    paths: RawList,
    deny_methods: RawList,
    deny_paths: RawList,
    service: RawService,
}

/// The request rules of an intercepting rule (`None` without `intercept
/// = true`); interception and its keys are valid only on an allow rule
/// with a host (`allow_with_host`).
fn request_rules(
    raw: RawRequest,
    allow_with_host: bool,
    errors: &mut Errors<'_>,
) -> Option<RequestRules> {
    let request_span = [&raw.methods, &raw.paths, &raw.deny_methods, &raw.deny_paths]
        .iter()
        .find_map(|k| k.as_ref().map(|k| k.span()));
    let intercepts = raw.intercept.as_ref().is_some_and(|f| *f.get_ref());
    let websocket_on = raw
        .websocket
        .as_ref()
        .filter(|w| *w.get_ref())
        .map(Spanned::span);
    let service = service_rules(
        raw.service,
        intercepts && allow_with_host,
        websocket_on,
        errors,
    );
    let websocket = match raw.websocket {
        Some(flag) if !intercepts || !allow_with_host => {
            errors.at(
                flag.span(),
                "websocket is only valid on intercepting allow rules with a host \
                 (intercept = true)",
            );
            false
        }
        Some(flag) => *flag.get_ref(),
        None => false,
    };
    match raw.intercept {
        Some(flag) if *flag.get_ref() => {
            if !allow_with_host {
                errors.at(
                    flag.span(),
                    "intercept is only valid on allow rules with a host",
                );
            }
            Some(RequestRules {
                methods: methods(raw.methods, errors),
                paths: paths(raw.paths, errors),
                deny_methods: methods(raw.deny_methods, errors),
                deny_paths: paths(raw.deny_paths, errors),
                websocket,
                service,
            })
        }
        _ => {
            if let Some(span) = request_span {
                errors.at(
                    span,
                    "methods, paths, deny_methods and deny_paths need intercept = true",
                );
            }
            None
        }
    }
}

/// A rule's `tunnel`: valid only on an allow rule with a host, and `tls`
/// on an intercepting one.
fn tunnel_of(
    t: Spanned<String>,
    allow_with_host: bool,
    intercepts: bool,
    errors: &mut Errors<'_>,
) -> Option<Carry> {
    let carry = known(
        "tunnel",
        &t,
        Carry::parse(t.get_ref()),
        &Carry::NAMES,
        errors,
    )?;
    if !allow_with_host {
        errors.at(
            t.span(),
            "tunnel is only valid on allow rules with a host \
             (a cidr rule's address is its identity: its tunnels are opaque)",
        );
    } else if intercepts && carry != Carry::Tls {
        errors.at(
            t.span(),
            "an intercepting rule carries TLS: tunnel must be \"tls\" or omitted",
        );
    }
    Some(carry)
}

/// A rule's id: the one given (valid, not a grant's, unique in `ids`), or
/// `ORG/KIND/N` for the `n`th rule of its kind.
fn rule_id(
    id: Option<Spanned<String>>,
    (org, kind, n): (&str, &str, usize),
    ids: &mut HashSet<String>,
    errors: &mut Errors<'_>,
) -> String {
    let Some(id) = id else {
        let text = format!("{org}/{kind}/{n}");
        ids.insert(text.clone());
        return text;
    };
    let text = id.get_ref().trim().to_string();
    if !valid_rule_id(&text) {
        errors.at(id.span(), format!("invalid rule id {text:?}"));
    } else if text.starts_with(crate::config::GRANT_RULE_PREFIX) {
        errors.at(
            id.span(),
            format!("rule id {text:?}: ids starting with \"grant:\" name grants"),
        );
    }
    if !ids.insert(text.clone()) {
        errors.at(id.span(), format!("rule id {text:?} is used twice"));
    }
    text
}

/// An allow rule outside the baseline's ceiling: an error at the rule,
/// naming the entry it escapes and why.
fn check_ceiling(
    rule: &RuleConfig,
    baseline: &Baseline,
    span: std::ops::Range<usize>,
    errors: &mut Errors<'_>,
) {
    if let Err((entry, why)) = ceiling::check(rule, &baseline.ceiling) {
        let ports = match &entry.ports {
            PortSet::All => "all ports".to_string(),
            PortSet::List(list) => {
                let list: Vec<String> = list.iter().map(u16::to_string).collect();
                format!("ports {}", list.join(", "))
            }
        };
        errors.at(
            span,
            format!(
                "rule {:?} ({}) escapes the baseline's ceiling: ceiling {:?} ({}, {ports}) in {}: {why}",
                rule.id,
                rule.target,
                entry.id,
                entry.target,
                baseline.path.display()
            ),
        );
    }
}

/// A rule id: 1-128 characters, none a control character.
pub(super) fn valid_rule_id(text: &str) -> bool {
    !text.is_empty() && text.len() <= 128 && !text.chars().any(char::is_control)
}

/// What a rule (or baseline entry, `what` at `span`) matches: exactly one
/// of `host` and `cidr`.
pub(super) fn rule_target(
    (host, cidr_value): (Option<Spanned<String>>, Option<Spanned<String>>),
    is_allow: bool,
    (span, what): (std::ops::Range<usize>, &str),
    errors: &mut Errors<'_>,
) -> Option<RuleTarget> {
    match (host, cidr_value) {
        (Some(_), Some(c)) => {
            errors.at(c.span(), "a rule has either host or cidr, not both");
            None
        }
        (None, None) => {
            errors.at(span, format!("{what} needs host or cidr"));
            None
        }
        (Some(h), None) => host_rule(&h, is_allow, errors),
        (None, Some(c)) => cidr(&c, errors).map(RuleTarget::Cidr),
    }
}

/// A `ports` list: each in 1-65535, sorted, duplicates dropped; an empty
/// list is an error.
pub(super) fn port_list(list: &Spanned<Vec<Spanned<i64>>>, errors: &mut Errors<'_>) -> PortSet {
    if list.get_ref().is_empty() {
        errors.at(
            list.span(),
            "ports must not be empty (omit it for the default)",
        );
    }
    let mut ports = Vec::new();
    for p in list.get_ref() {
        match u16::try_from(*p.get_ref()) {
            Ok(port) if port > 0 => {
                if !ports.contains(&port) {
                    ports.push(port)
                }
            }
            _ => errors.at(
                p.span(),
                format!("port {} out of range 1-65535", p.get_ref()),
            ),
        }
    }
    ports.sort_unstable();
    PortSet::List(ports)
}

/// `max_new_names_per_minute` (0: unlimited, written explicitly) and
/// `max_label_length`: only on an allow rule with a wildcard host, where
/// a name can carry data; on any other rule a located error.
fn name_limits(
    wildcard: bool,
    per_minute: Option<Spanned<i64>>,
    label: Option<Spanned<i64>>,
    errors: &mut Errors<'_>,
) -> NameLimits {
    let mut limits = NameLimits::default();
    for (key, value) in [
        ("max_new_names_per_minute", &per_minute),
        ("max_label_length", &label),
    ] {
        if let (Some(v), false) = (value, wildcard) {
            errors.at(
                v.span(),
                format!(
                    "{key} is only valid on allow rules with a wildcard host (\"*.example.com\"): \
                     an exact name or a cidr carries no data in its name"
                ),
            );
        }
    }
    if let Some(v) = per_minute {
        match u32::try_from(*v.get_ref()) {
            Ok(0) => limits.new_per_minute = None,
            Ok(n) if n <= MAX_NEW_NAMES_PER_MINUTE => limits.new_per_minute = Some(n),
            _ => errors.at(
                v.span(),
                format!(
                    "max_new_names_per_minute = {} out of range 0-{MAX_NEW_NAMES_PER_MINUTE} \
                     (0: unlimited)",
                    v.get_ref()
                ),
            ),
        }
    }
    if let Some(v) = label {
        match u8::try_from(*v.get_ref()) {
            Ok(n) if (1..=63).contains(&n) => limits.max_label_length = n,
            _ => errors.at(
                v.span(),
                format!("max_label_length = {} out of range 1-63", v.get_ref()),
            ),
        }
    }
    limits
}

pub(super) fn host_rule(
    value: &Spanned<String>,
    is_allow: bool,
    errors: &mut Errors<'_>,
) -> Option<RuleTarget> {
    let text = value.get_ref().trim();
    let (wildcard, rest) = match text.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    if text == "*" {
        errors.at(
            value.span(),
            "host \"*\" would match every name; list the names instead",
        );
        return None;
    }
    if rest.contains('*') {
        errors.at(
            value.span(),
            format!("invalid host {text:?}: '*' is only allowed as the whole leftmost label (\"*.example.com\")"),
        );
        return None;
    }
    let name = match normalize_host(rest) {
        Ok(Host::Name(name)) => name,
        Ok(Host::Ip(ip)) => {
            errors.at(
                value.span(),
                format!("host {text:?} is an IP address; use cidr = \"{ip}\" for addresses"),
            );
            return None;
        }
        Err(e) => {
            errors.at(value.span(), format!("invalid host {text:?}: {e}"));
            return None;
        }
    };
    if wildcard {
        if is_allow && !name.contains('.') {
            errors.at(
                value.span(),
                format!("wildcard {text:?} would allow a whole top-level domain"),
            );
            return None;
        }
        Some(RuleTarget::Below(name))
    } else {
        Some(RuleTarget::Exact(name))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{errors, first_error, parse, BASE};
    use crate::config::*;

    #[test]
    fn bad_values_are_named_and_located() {
        let cases = [
            ("host = \"*.com\"", "top-level domain"),
            ("host = \"*\"", "every name"),
            ("host = \"login.*.x.com\"", "leftmost label"),
            ("host = \"1.2.3.4\"", "use cidr"),
            ("cidr = \"198.18.7.0/33\"", "invalid cidr"),
            ("cidr = \"198.18.7.1/24\"", "host bits"),
            ("host = \"a.com\"\nports = [0]", "port 0 out of range"),
            (
                "host = \"a.com\"\nports = [65536]",
                "port 65536 out of range",
            ),
            ("host = \"a.com\"\ncidr = \"198.18.0.0/15\"", "not both"),
            ("ports = [1]", "needs host or cidr"),
        ];
        refused_at_the_rule("[[org.allow]]\n", &cases, 9..=11);
    }

    #[test]
    fn tunnel_key_is_checked_and_located() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"a.com\"\nports = [22]\ntunnel = \"opaque\"\n\
             [[org.allow]]\nhost = \"b.com\"\n"
        );
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].allow[0].tunnel, Some(Carry::Opaque));
        assert_eq!(c.orgs[0].allow[1].tunnel, None);
        let cases = [
            (
                "[[org.allow]]\nhost = \"a.com\"\ntunnel = \"ssh\"",
                "unknown tunnel \"ssh\"",
            ),
            (
                "[[org.allow]]\ncidr = \"198.18.0.0/15\"\ntunnel = \"tls\"",
                "a cidr rule's address is its identity",
            ),
            (
                "[[org.deny]]\nhost = \"a.com\"\ntunnel = \"tls\"",
                "only valid on allow rules",
            ),
            (
                "[[org.allow]]\nhost = \"a.com\"\nintercept = true\ntunnel = \"opaque\"",
                "intercepting rule carries TLS",
            ),
        ];
        refused_at_the_rule("", &cases, 10..=12);
    }

    /// Each rule (after `BASE` and `head`) is refused with an error
    /// containing its message, located on one of `lines`.
    fn refused_at_the_rule(
        head: &str,
        cases: &[(&str, &str)],
        lines: std::ops::RangeInclusive<usize>,
    ) {
        for (rule, want) in cases {
            let src = format!("{BASE}{head}{rule}\n");
            let e = first_error(&src);
            assert!(e.contains(want), "{rule}: {e}");
            let line: usize = e.split(':').nth(1).unwrap().parse().unwrap();
            assert!(lines.contains(&line), "{rule}: {e}");
        }
    }

    #[test]
    fn name_limits_only_on_wildcard_allow_rules() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"*.a.test\"\n\
             [[org.allow]]\nhost = \"*.b.test\"\nmax_new_names_per_minute = 0\n\
             [[org.allow]]\nhost = \"*.c.test\"\nmax_new_names_per_minute = 5\nmax_label_length = 8\n"
        );
        let c = parse(&src).unwrap();
        let limits: Vec<NameLimits> = c.orgs[0].allow.iter().map(|r| r.names).collect();
        assert_eq!(limits[0], NameLimits::default());
        assert_eq!(
            limits[0].new_per_minute,
            Some(DEFAULT_MAX_NEW_NAMES_PER_MINUTE)
        );
        assert_eq!(limits[0].max_label_length, 63);
        assert_eq!(limits[1].new_per_minute, None);
        assert_eq!(
            limits[2],
            NameLimits {
                new_per_minute: Some(5),
                max_label_length: 8
            }
        );
        let cases = [
            (
                "[[org.allow]]\nhost = \"a.test\"\nmax_new_names_per_minute = 5",
                "only valid on allow rules with a wildcard host",
            ),
            (
                "[[org.allow]]\ncidr = \"198.18.0.0/15\"\nmax_label_length = 5",
                "only valid on allow rules with a wildcard host",
            ),
            (
                "[[org.deny]]\nhost = \"*.a.test\"\nmax_new_names_per_minute = 5",
                "only valid on allow rules with a wildcard host",
            ),
            (
                "[[org.allow]]\nhost = \"*.a.test\"\nmax_new_names_per_minute = -1",
                "out of range 0-100000",
            ),
            (
                "[[org.allow]]\nhost = \"*.a.test\"\nmax_new_names_per_minute = 100001",
                "out of range 0-100000",
            ),
            (
                "[[org.allow]]\nhost = \"*.a.test\"\nmax_label_length = 64",
                "out of range 1-63",
            ),
            (
                "[[org.allow]]\nhost = \"*.a.test\"\nmax_label_length = 0",
                "out of range 1-63",
            ),
        ];
        refused_at_the_rule("", &cases, 10..=12);
    }

    #[test]
    fn websocket_needs_an_intercepting_host_rule() {
        let src = format!(
            "{BASE}[[org.allow]]\nhost = \"a.com\"\nintercept = true\nwebsocket = true\n\
             [[org.allow]]\nhost = \"b.com\"\nintercept = true\n"
        );
        let c = parse(&src).unwrap();
        let ws = |i: usize| c.orgs[0].allow[i].intercept.as_ref().unwrap().websocket;
        assert!(ws(0) && !ws(1), "off by default");
        let cases = [
            "[[org.allow]]\nhost = \"a.com\"\nwebsocket = true",
            "[[org.allow]]\nhost = \"a.com\"\nintercept = false\nwebsocket = true",
            "[[org.allow]]\ncidr = \"198.18.0.0/15\"\nwebsocket = true",
            "[[org.deny]]\nhost = \"a.com\"\nwebsocket = true",
        ];
        for rule in cases {
            let src = format!("{BASE}{rule}\n");
            let e = first_error(&src);
            assert!(
                e.contains("websocket is only valid on intercepting allow rules"),
                "{rule}: {e}"
            );
            let line: usize = e.split(':').nth(1).unwrap().parse().unwrap();
            assert!((10..=13).contains(&line), "{rule}: {e}");
            assert!(e.contains("websocket"), "{rule}: {e}");
        }
    }

    #[test]
    fn wildcard_tld_is_fine_in_deny() {
        let src = format!("{BASE}[[org.deny]]\nhost = \"*.com\"\n");
        let c = parse(&src).unwrap();
        assert_eq!(c.orgs[0].deny[0].target, RuleTarget::Below("com".into()));
        assert_eq!(c.orgs[0].deny[0].ports, PortSet::All);
    }

    #[test]
    fn methods_are_tokens_and_path_rules_are_normal() {
        let rule = |k: &str, v: &str| {
            errors(&format!(
                "[[org.allow]]\nhost = \"x.test\"\nintercept = true\n{k} = [{v}]\n"
            ))
        };
        for ok in ["\"GET\"", "\"PROPFIND\"", "\"M-SEARCH\"", "\"TRACE\""] {
            assert!(
                rule("methods", ok).is_empty(),
                "{ok}: {:?}",
                rule("methods", ok)
            );
        }
        for (bad, want) in [
            ("\"get\"", "case-sensitive, write \"GET\""),
            ("\"Delete\"", "case-sensitive"),
            ("\"GE T\"", "RFC 9110 token"),
            ("\"\"", "RFC 9110 token"),
        ] {
            let e = rule("deny_methods", bad);
            assert!(e.iter().any(|e| e.contains(want)), "{bad}: {e:?}");
        }
        for bad in ["/a/../b", "/a//b", "/a;x", "/a\\b", "/./x"] {
            let e = rule("paths", &format!("{bad:?}"));
            assert!(
                e.iter()
                    .any(|e| e.contains("requests are matched normalised")),
                "{bad}: {e:?}"
            );
        }
        assert!(rule("deny_paths", "\"/api/internal*\", \"/x/...\"").is_empty());
    }
}
