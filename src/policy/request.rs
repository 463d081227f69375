//! The decision on one request inside an intercepted connection: pure, no
//! I/O. [`decide`] is the only place it is taken: the live intercepted path
//! (HTTP/1.1 and HTTP/2 alike, through
//! [`Policy::decide_request`](super::Policy::decide_request)), plain
//! `http://` requests under an intercepting rule, `palisade explain`, and
//! the choice of credentials to add all call it, so none of them can
//! answer differently from the others.
//!
//! # The path, normalised once
//!
//! The request path (without the query) is normalised once by
//! [`NormalPath::parse`] (the table of what it decodes, keeps and refuses
//! is in [`crate::proto::http_request`]); every rule (`paths`,
//! `deny_paths`) and every credential's `paths` scope matches the
//! normalised form, whether or not the rule has path rules.
//!
//! Every refusal is `path_not_allowed` (403), with the rule that was
//! applied and a `detail` naming what was refused. The query string is
//! never matched and never decoded.
//!
//! # Truth table
//!
//! Checks run top to bottom; the first row that applies decides.
//!
//! | # | condition | decision | reason |
//! |---|---|---|---|
//! | R1 | the rule does not (or no longer) intercept | deny | `no_matching_rule` |
//! | R2 | the method is not an RFC 9110 token | deny | `method_not_allowed` |
//! | R3 | the path is refused by normalisation ([`crate::proto::http_request`]) | deny | `path_not_allowed` |
//! | R4 | the method is in `deny_methods`, compared ignoring case | deny | `method_not_allowed` |
//! | R5 | a `deny_paths` pattern matches the normalised path, ASCII letters compared ignoring case | deny | `path_not_allowed` |
//! | R6 | the normalised path has non-ASCII characters and a `deny_paths` pattern would match it were each run of them any text ([`PathPattern::could_deny`]) | deny | `path_not_allowed` |
//! | R7 | `methods` is set and does not name the method exactly | deny | `method_not_allowed` |
//! | R8 | the method is `TRACE` or `TRACK` (any case) and `methods` does not name it exactly | deny | `method_not_allowed` |
//! | R9 | `paths` is set and none matches the normalised path exactly | deny | `path_not_allowed` |
//! | R10 | otherwise | allow | `rule_match` |
//!
//! Methods are case-sensitive tokens (RFC 9110 §9.1): `get` is not `GET`,
//! so an allow list names exactly what passes. A deny list also catches
//! case variants (`delete` for `DELETE`), since some servers fold case and
//! a deny must not be walked around that way.
//!
//! Paths follow the same rule: `deny_paths` catch case variants
//! (`/API/internal`, and `/api/%49nternal`, which decodes to
//! `/api/Internal`), since some backends route paths ignoring case; `paths`
//! and credential scopes match exactly, so a case change can only lose
//! access or a credential, never gain one.
//!
//! Letters outside ASCII (R6): backends that fold case or compatibility
//! forms read some of them as ASCII letters (dotless `ı` U+0131 upper-cases
//! to `I`, long `ſ` U+017F to `S`, the Kelvin sign U+212A folds to `k`,
//! fullwidth `Ｉ` U+FF29 and the other fullwidth, circled, mathematical and
//! ligature forms become ASCII under NFKC, some as several letters or with
//! a `.` or `/`). Rather than keep a table of them, which would be wrong
//! the day a backend folds one more, R6 assumes the worst of every one: a
//! run of non-ASCII characters may stand for any text at all. A path is
//! refused when some such reading of it is one a `deny_paths` pattern
//! denies, so no folding, known or not, walks around a deny; a path whose
//! non-ASCII characters sit where no reading could complete a deny pattern
//! (`/caf%C3%A9` under `deny_paths = ["/api/internal"]`) is unaffected.
//!
//! Credentials, for an allowed request only: each credential of the org, in
//! file order, whose host matches, whose `methods` (if set) names the
//! method exactly and whose `paths` (if set) matches the normalised path
//! exactly;
//! never for `TRACE` or `TRACK` ([`CredentialConfig::applies`]).

use std::sync::Arc;

use crate::config::{CredentialConfig, PathPattern, RequestRules, RuleTarget};
pub(crate) use crate::proto::http_request::{is_method_token, NormalPath};

use super::{OrgRef, Reason, Verdict};

/// Longest path shown in a refusal's detail.
const MAX_SHOWN_PATH: usize = 200;

/// `TRACE` and `TRACK` (any case): they echo the request, headers and all,
/// so they get no credential and are refused unless a rule names them.
pub(crate) fn is_trace(method: &str) -> bool {
    method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK")
}

// Config holds the validated rules and credentials; how they match a
// request is decided here.

impl PathPattern {
    /// Does `path` match, byte for byte? Allow `paths` and credential
    /// scopes ask this. Only a normalised path can be asked, never the raw
    /// one.
    pub fn matches(&self, path: &NormalPath) -> bool {
        pattern_matches(&self.0, path.as_str())
    }

    /// Does `path` match, ASCII letters compared ignoring case? `deny_paths`
    /// ask this: a backend that routes paths case-insensitively reads
    /// `/API/internal` as `/api/internal`, so a deny must catch it. (Allow
    /// rules stay exact: a case change can only lose access, never gain
    /// it.)
    pub fn denies(&self, path: &NormalPath) -> bool {
        glob(&self.0, path.as_str(), |a, b| a.eq_ignore_ascii_case(&b))
    }

    /// Could a backend that folds characters outside ASCII into ASCII
    /// (case mapping, compatibility normalisation) read `path` as one this
    /// pattern [`denies`](Self::denies)? Each run of non-ASCII characters
    /// (escapes `%80`-`%FF` in the normal form) stands for any text, of
    /// any length; the rest must match as for `denies`. Returns the first
    /// such run, for the refusal's detail; `None` for a path without one.
    pub fn could_deny<'p>(&self, path: &'p NormalPath) -> Option<&'p str> {
        let (tokens, first) = fold_holes(path.as_str());
        let first = first?;
        let mut pat = self.0.as_bytes().to_vec();
        if !pat.contains(&b'*') {
            // A prefix, as `glob` reads it.
            pat.push(b'*');
        }
        glob_with_holes(&pat, &tokens).then_some(first)
    }
}

/// One byte of a normalised path, or a run of non-ASCII characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Byte(u8),
    /// Any text: what a folding backend may read the run as.
    Any,
}

/// `path` as [`Tok`]s (each run of escapes `%80`-`%FF` one [`Tok::Any`]),
/// and the first such run as written.
fn fold_holes(path: &str) -> (Vec<Tok>, Option<&str>) {
    let bytes = path.as_bytes();
    let high = |i: usize| {
        bytes.get(i) == Some(&b'%')
            && bytes
                .get(i + 1)
                .is_some_and(|&h| matches!(h, b'8'..=b'9' | b'A'..=b'F'))
    };
    let (mut out, mut first) = (Vec::with_capacity(bytes.len()), None);
    let mut i = 0;
    while i < bytes.len() {
        if high(i) {
            let start = i;
            while high(i) {
                i += 3;
            }
            first = first.or(path.get(start..i.min(path.len())));
            out.push(Tok::Any);
        } else {
            out.push(Tok::Byte(bytes[i]));
            i += 1;
        }
    }
    (out, first)
}

/// Does `pattern` (a glob: `*` any run of bytes, else bytes matched
/// ignoring ASCII case, over the whole text) match some reading of `text`,
/// each [`Tok::Any`] read as any text? Dynamic programming over (pattern
/// prefix, text prefix), one row at a time: time `O(|pattern| x |text|)`,
/// memory two rows.
fn glob_with_holes(pattern: &[u8], text: &[Tok]) -> bool {
    // row[j]: the pattern so far matches some reading of text[..j].
    let mut row = vec![false; text.len() + 1];
    row[0] = true;
    for j in 1..=text.len() {
        row[j] = row[j - 1] && text[j - 1] == Tok::Any;
    }
    for &p in pattern {
        let mut next = vec![false; text.len() + 1];
        next[0] = row[0] && p == b'*';
        for j in 1..=text.len() {
            next[j] = match text[j - 1] {
                // `*` read as nothing more, or taking in one more token; a
                // run read as text ending in `p`, or as nothing more.
                Tok::Byte(b) if p != b'*' => row[j - 1] && p.eq_ignore_ascii_case(&b),
                _ => row[j] || next[j - 1],
            };
        }
        row = next;
    }
    row[text.len()]
}

/// A path rule's `pattern` against `text`, as written: a prefix (no `*`),
/// or a glob over the whole text in which `*` matches any run of bytes
/// and everything else matches literally. The policy asks it only of
/// normalised paths ([`PathPattern::matches`]). The two-pointer
/// algorithm: linear-ish, no exponential backtracking.
pub(crate) fn pattern_matches(pattern: &str, text: &str) -> bool {
    glob(pattern, text, |a, b| a == b)
}

/// [`pattern_matches`] with `eq` deciding whether a pattern byte matches a
/// text byte.
pub(crate) fn glob(pattern: &str, text: &str, eq: impl Fn(u8, u8) -> bool) -> bool {
    let (pat, text) = (pattern.as_bytes(), text.as_bytes());
    if !pattern.contains('*') {
        return text.len() >= pat.len() && pat.iter().zip(text).all(|(&a, &b)| eq(a, b));
    }
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if pat.get(p) == Some(&b'*') {
            star = Some((p, t));
            p += 1;
        } else if pat.get(p).is_some_and(|&a| eq(a, text[t])) {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pat.get(p..).unwrap_or(&[]).iter().all(|&b| b == b'*')
}

impl CredentialConfig {
    /// Does this credential apply to a request for `host` (normalised name)
    /// with this `method` (compared exactly) and normalised `path`? Never to
    /// `TRACE` or `TRACK`, which echo the request back.
    pub fn applies(&self, host: &str, method: &str, path: &NormalPath) -> bool {
        if is_trace(method) {
            return false;
        }
        let host_ok = match &self.host {
            RuleTarget::Exact(n) => n == host,
            RuleTarget::Below(s) => host
                .strip_suffix(s.as_str())
                .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
            RuleTarget::Cidr(_) => false,
        };
        host_ok
            && (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && (self.paths.is_empty() || self.paths.iter().any(|p| p.matches(path)))
    }
}

/// One request, as [`decide`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// The normalised name of the intercepted host (credentials match it).
    pub host: &'a str,
    pub method: &'a str,
    /// The request path as received, without the query.
    pub path: &'a str,
}

/// What [`decide`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDecision {
    pub verdict: Verdict,
    /// For a refusal: why, naming the method, the path and what refused it.
    pub detail: Option<String>,
    /// The normalised path (what the rules matched, and what is forwarded);
    /// `None` when normalisation refused the path.
    pub path: Option<NormalPath>,
    /// For an allowed request: indices, into the credentials offered, of
    /// those to add, in order.
    pub credentials: Vec<usize>,
}

impl RequestDecision {
    pub fn is_allow(&self) -> bool {
        self.verdict.is_allow()
    }
}

/// Decide one request inside a connection that allow rule `rule` of `org`
/// intercepts (`rules`: its request rules, `None` if it does not
/// intercept), and choose the `credentials` to add. See the module's
/// truth table.
pub(crate) fn decide<'a>(
    org: &OrgRef,
    rule: &str,
    rules: Option<&RequestRules>,
    req: RequestFacts<'_>,
    credentials: impl IntoIterator<Item = &'a CredentialConfig>,
) -> RequestDecision {
    let method = req.method;
    let shown: String = req.path.chars().take(MAX_SHOWN_PATH).collect();
    let refuse = |reason, path: Option<NormalPath>, why: String| RequestDecision {
        verdict: Verdict {
            org: Some(org.clone()),
            reason,
            rule: Some(Arc::from(rule)),
            would_deny: None,
        },
        detail: Some(format!("{method} {shown} refused by rule {rule}: {why}")),
        path,
        credentials: Vec::new(),
    };
    let Some(r) = rules else {
        return RequestDecision {
            verdict: Verdict {
                org: Some(org.clone()),
                reason: Reason::NoMatchingRule,
                rule: None,
                would_deny: None,
            },
            detail: Some(format!("rule {rule} does not intercept")),
            path: None,
            credentials: Vec::new(),
        };
    };
    if !is_method_token(method) {
        let why = "the method is not an RFC 9110 token".to_string();
        return refuse(Reason::MethodNotAllowed, None, why);
    }
    let path = match NormalPath::parse(req.path) {
        Ok(p) => p,
        Err(e) => return refuse(Reason::PathNotAllowed, None, e.to_string()),
    };
    if let Some(m) = r
        .deny_methods
        .iter()
        .find(|m| m.eq_ignore_ascii_case(method))
    {
        let why = format!("deny_methods names {m:?}");
        return refuse(Reason::MethodNotAllowed, Some(path), why);
    }
    if let Some(p) = r.deny_paths.iter().find(|p| p.denies(&path)) {
        let why = format!("deny_paths {:?} matches {path} (ignoring case)", p.0);
        return refuse(Reason::PathNotAllowed, Some(path), why);
    }
    if let Some((p, run)) = r
        .deny_paths
        .iter()
        .find_map(|p| p.could_deny(&path).map(|run| (p, run)))
    {
        let why = format!(
            "deny_paths {:?} could match {path}: a backend that folds case or compatibility \
             forms may read the non-ASCII {run} as ASCII letters",
            p.0
        );
        return refuse(Reason::PathNotAllowed, Some(path), why);
    }
    let named = r.methods.iter().any(|m| m == method);
    if !r.methods.is_empty() && !named {
        let why = format!("methods does not name {method:?} (methods are case-sensitive)");
        return refuse(Reason::MethodNotAllowed, Some(path), why);
    }
    if is_trace(method) && !named {
        let why = format!("{method} is refused unless the rule's methods names it");
        return refuse(Reason::MethodNotAllowed, Some(path), why);
    }
    if !r.paths.is_empty() && !r.paths.iter().any(|p| p.matches(&path)) {
        let why = format!("no pattern of paths matches {path}");
        return refuse(Reason::PathNotAllowed, Some(path), why);
    }
    let credentials = credentials
        .into_iter()
        .enumerate()
        .filter(|(_, c)| c.applies(req.host, method, &path))
        .map(|(i, _)| i)
        .collect();
    RequestDecision {
        verdict: Verdict {
            org: Some(org.clone()),
            reason: Reason::RuleMatch,
            rule: Some(Arc::from(rule)),
            would_deny: None,
        },
        detail: None,
        path: Some(path),
        credentials,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SecretSource;

    #[test]
    fn trace_methods() {
        assert!(is_trace("TRACE") && is_trace("trace") && is_trace("TrAcK"));
        assert!(!is_trace("TRACES"));
    }

    #[test]
    fn path_patterns() {
        let p = |s: &str| PathPattern(s.to_string());
        let n = |s: &str| NormalPath::parse(s).unwrap();
        assert!(p("/simple/").matches(&n("/simple/x/")));
        assert!(!p("/simple/").matches(&n("/simplex")));
        assert!(p("/p/*.whl").matches(&n("/p/a/b-1.0.whl")));
        assert!(!p("/p/*.whl").matches(&n("/p/a.whl.tar")));
        assert!(p("*").matches(&n("/anything")));
        assert!(p("/a*b*c").matches(&n("/a--b--c")));
        assert!(!p("/a*b*c").matches(&n("/a--c--b")));
        // Exact for allows, ignoring ASCII case for denies.
        assert!(!p("/api/internal").matches(&n("/API/internal")));
        assert!(p("/api/internal").denies(&n("/API/internal/x")));
        assert!(p("/api/*/keys").denies(&n("/api/V1/KEYS")));
        assert!(!p("/api/*/keys").denies(&n("/api/v1/key")));
        assert!(!p("/api/internal").denies(&n("/api/intern")));
        // Escapes kept encoded are not letters: `%C3%A9` is not `%c3%a9`
        // text, and normalisation upper-cases them anyway.
        assert!(p("/caf%C3%A9").denies(&n("/CAF%c3%a9")));
        // Matched after decoding unreserved escapes.
        assert!(p("/api/internal*").matches(&n("/api/%69nternal")));
    }

    #[test]
    fn could_deny_reads_each_non_ascii_run_as_any_text() {
        let p = |s: &str| PathPattern(s.to_string());
        let n = |s: &str| NormalPath::parse(s).unwrap();
        let could = |pat: &str, path: &str| p(pat).could_deny(&n(path)).map(str::to_string);
        // The run that could fold is named.
        assert_eq!(
            could("/api/internal", "/api/%C4%B1nternal/keys").as_deref(),
            Some("%C4%B1")
        );
        // No non-ASCII: not this check's (R5 decides).
        assert_eq!(could("/api/internal", "/api/internal"), None);
        assert_eq!(could("/api/internal", "/api/%3Finternal"), None);
        // A run may stand for several letters, a `/`, or nothing.
        assert!(could("/api/internal", "/api/%EF%AC%81").is_some());
        assert!(could("/api/internal", "/%C3%A9").is_some());
        assert!(could("/api/internal", "/api%C3%A9internal").is_some());
        assert!(could("/api/internal", "/api/inter%C3%A9nal").is_some());
        // Globs: the rest must still fit, ignoring ASCII case.
        assert!(could("/api/*/keys", "/api/v1/%EF%BC%ABEYS").is_some());
        assert!(could("/api/*/keys", "/API/%C3%A9/KEYS").is_some());
        assert!(could("/api/*/keys", "/api/v1/key%C3%A9/x").is_none());
        assert!(could("*.php", "/x/%C3%A9").is_some());
        assert!(could("*.php", "/x/%C3%A9.txt").is_none());
        // A fixed letter the run cannot change: no reading matches.
        assert!(could("/api/internal", "/apx/%C4%B1nternal").is_none());
        assert!(could("/api/internal", "/api/x%C4%B1nternal").is_none());
        // A long path against a long pattern: no blow-up.
        let long = format!("/{}", "a%C3%A9".repeat(2000));
        assert!(could(&format!("/{}b", "a*".repeat(100)), &long).is_some());
        assert!(could("/zzz", &long).is_none());
    }

    fn pats(v: &[&str]) -> Vec<PathPattern> {
        v.iter().map(|s| PathPattern(s.to_string())).collect()
    }

    fn cred(id: &str, methods: &[&str], paths: &[&str]) -> CredentialConfig {
        CredentialConfig {
            id: id.into(),
            host: RuleTarget::Exact("reg.test".into()),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            paths: pats(paths),
            header: "authorization".into(),
            prefix: String::new(),
            source: SecretSource::Env("T".into()),
        }
    }

    fn org() -> OrgRef {
        OrgRef {
            index: 0,
            name: Arc::from("acme"),
        }
    }

    fn run(rules: &RequestRules, creds: &[CredentialConfig], m: &str, p: &str) -> RequestDecision {
        let req = RequestFacts {
            host: "reg.test",
            method: m,
            path: p,
        };
        decide(&org(), "r", Some(rules), req, creds)
    }

    #[test]
    fn truth_table() {
        let rules = RequestRules {
            methods: vec!["GET".into(), "HEAD".into(), "POST".into()],
            paths: pats(&["/simple/", "/api/*"]),
            deny_methods: vec!["PUT".into()],
            deny_paths: pats(&["/api/internal*"]),
            websocket: false,
            service: None,
        };
        let r = |m: &str, p: &str| run(&rules, &[], m, p).verdict.reason;
        use Reason::*;
        // R1
        let req = RequestFacts {
            host: "reg.test",
            method: "GET",
            path: "/",
        };
        let none = decide(&org(), "r", None, req, &[]);
        assert_eq!(none.verdict.reason, NoMatchingRule);
        assert_eq!(none.verdict.rule, None);
        // R2
        assert_eq!(r("G T", "/simple/"), MethodNotAllowed);
        // R3: whatever the method.
        assert_eq!(r("PUT", "/simple/..;/x"), PathNotAllowed);
        assert_eq!(r("GET", "/simple/%2e%2e/x"), PathNotAllowed);
        // R4: case variants of a denied method are denied.
        assert_eq!(r("PUT", "/simple/"), MethodNotAllowed);
        assert_eq!(r("put", "/simple/"), MethodNotAllowed);
        // R5: on the normalised path.
        assert_eq!(r("GET", "/api/internal/x"), PathNotAllowed);
        assert_eq!(r("GET", "/api/%69nternal"), PathNotAllowed);
        // R5 ignores case: `%49` decodes to `I`, and backends that route
        // paths ignoring case would serve these as `/api/internal`.
        assert_eq!(r("GET", "/api/%49nternal/keys"), PathNotAllowed);
        assert_eq!(r("GET", "/API/internal/keys"), PathNotAllowed);
        assert_eq!(r("GET", "/api/INTERNAL/keys"), PathNotAllowed);
        assert_eq!(r("GET", "/Api/InTeRnAl"), PathNotAllowed);
        assert_eq!(r("GET", "/api/internak"), RuleMatch);
        // R6: letters outside ASCII that a backend may fold to ASCII.
        // Dotless i (U+0131, upper-cases to I), long s, Kelvin sign;
        // fullwidth I (U+FF29) and i (U+FF49), which NFKC makes ASCII.
        for p in [
            "/api/%C4%B1nternal/keys",
            "/api/%c4%b1nternal",
            "/api/%EF%BC%A9nternal/keys",
            "/api/%EF%BD%89%EF%BD%8E%EF%BD%94%EF%BD%85%EF%BD%92%EF%BD%8E%EF%BD%81%EF%BD%8C",
            "/%EF%BC%A1PI/internal/x",
            "/api/intern%EF%BD%81l",
            "/api/%E2%84%AAnternal",
        ] {
            assert_eq!(r("GET", p), PathNotAllowed, "{p}");
        }
        // Where no reading could complete a deny pattern: unaffected.
        assert_eq!(r("GET", "/api/caf%C3%A9"), RuleMatch);
        assert_eq!(r("GET", "/api/x%C4%B1nternal"), RuleMatch);
        assert_eq!(r("POST", "/simple/%C4%B1nternal"), RuleMatch);
        // R6: exact.
        assert_eq!(r("get", "/simple/"), MethodNotAllowed);
        assert_eq!(r("DELETE", "/simple/"), MethodNotAllowed);
        // R8
        assert_eq!(r("GET", "/other"), PathNotAllowed);
        assert_eq!(r("GET", "/%73imple/x"), RuleMatch);
        // ... exactly: a case change loses access, never gains it.
        assert_eq!(r("GET", "/SIMPLE/x"), PathNotAllowed);
        assert_eq!(r("GET", "/%53imple/x"), PathNotAllowed);
        // R9
        assert_eq!(r("HEAD", "/simple/x"), RuleMatch);
        let d = run(&rules, &[], "GET", "/api/%69nternal");
        assert_eq!(d.verdict.rule.as_deref(), Some("r"));
        let detail = d.detail.unwrap();
        assert!(
            detail.contains("/api/%69nternal") && detail.contains("deny_paths"),
            "{detail}"
        );
    }

    #[test]
    fn normalisation_applies_without_path_rules_and_trace_needs_naming() {
        let open = RequestRules::default();
        let r = |m: &str, p: &str| run(&open, &[], m, p).verdict.reason;
        assert_eq!(r("GET", "/anything/%7Eu"), Reason::RuleMatch);
        assert_eq!(r("get", "/"), Reason::RuleMatch);
        for p in ["/a/..;/b", "/a/../b", "/a//b", "/a;x", "/a%2fb", "/a%zz"] {
            assert_eq!(r("GET", p), Reason::PathNotAllowed, "{p}");
        }
        for m in ["TRACE", "TRACK", "trace"] {
            assert_eq!(r(m, "/"), Reason::MethodNotAllowed, "{m}");
        }
        let named = RequestRules {
            methods: vec!["TRACE".into()],
            ..RequestRules::default()
        };
        assert_eq!(
            run(&named, &[], "TRACE", "/").verdict.reason,
            Reason::RuleMatch
        );
        assert_eq!(
            run(&named, &[], "trace", "/").verdict.reason,
            Reason::MethodNotAllowed
        );
    }

    #[test]
    fn credentials_match_the_normalised_path() {
        let open = RequestRules {
            methods: vec!["GET".into(), "get".into(), "TRACE".into()],
            ..RequestRules::default()
        };
        let creds = [
            cred("any", &[], &[]),
            cred("scoped", &[], &["/scoped/"]),
            cred("get-only", &["GET"], &[]),
        ];
        let ids = |m: &str, p: &str| {
            let d = run(&open, &creds, m, p);
            d.credentials
                .iter()
                .map(|&i| creds[i].id.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids("GET", "/scoped/x"), ["any", "scoped", "get-only"]);
        assert_eq!(ids("GET", "/%73coped/x"), ["any", "scoped", "get-only"]);
        assert_eq!(ids("GET", "/other"), ["any", "get-only"]);
        // Scopes are exact: a case change never gains a credential.
        assert_eq!(ids("GET", "/SCOPED/x"), ["any", "get-only"]);
        assert_eq!(ids("GET", "/%53coped/x"), ["any", "get-only"]);
        // Refused paths get nothing (the raw path would have matched).
        assert!(ids("GET", "/scoped/../admin").is_empty());
        assert!(ids("GET", "/scoped/..;/admin").is_empty());
        // Methods exactly; never TRACE, even where the rule allows it.
        assert_eq!(ids("get", "/x"), ["any"]);
        assert!(ids("TRACE", "/scoped/").is_empty());
        // Another host: none.
        let req = RequestFacts {
            host: "other.test",
            method: "GET",
            path: "/scoped/",
        };
        assert!(decide(&org(), "r", Some(&open), req, &creds)
            .credentials
            .is_empty());
    }
}
