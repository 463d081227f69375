//! The decision on one request inside an intercepted connection: pure, no
//! I/O. [`decide`] is the only place it is taken: the live intercepted path
//! (HTTP/1.1 and HTTP/2 alike, through [`Policy::decide_request`]), plain
//! `http://` requests under an intercepting rule, `palisade explain`, and
//! the choice of credentials to add all call it, so none of them can
//! answer differently from the others.
//!
//! # The path, normalised once
//!
//! The request path (without the query) is normalised once by
//! [`NormalPath::parse`]; every rule (`paths`, `deny_paths`) and every
//! credential's `paths` scope matches the normalised form, whether or not
//! the rule has path rules. What upstream servers would resolve differently
//! from a plain reading is refused rather than guessed at:
//!
//! | input | outcome |
//! |---|---|
//! | `%41`-`%5A`, `%61`-`%7A`, `%30`-`%39`, `%2D`, `%5F`, `%7E` (unreserved, hex in either case) | decoded: `/api/%69nternal` is `/api/internal` |
//! | any other valid escape (`%3F`, `%c3%a9`, ...) | kept encoded, hex upper-cased: `?` stays data, never a query |
//! | `%2E` (encoded dot) | refused |
//! | `%2F`, `%5C`, `%3B`, `%25` (encoded `/`, `\`, `;`, `%`) | refused |
//! | `%00`-`%1F`, `%7F`; `%C0`, `%C1` (controls; overlong UTF-8) | refused |
//! | `%` not followed by two hex digits (`%zz`, `%u002e`, `%4`) | refused |
//! | raw `\`, space, control or non-ASCII byte | refused |
//! | a segment `.` or `..`, also with parameters (`..;`, `.;x`, `..;jsessionid=1`) | refused |
//! | an empty segment (`//`) other than a trailing `/` | refused |
//! | any `;` (a path parameter Tomcat, Jetty and Spring strip before matching) | refused |
//! | not starting with `/` (`*`, empty) | refused |
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
//! | R3 | the path is refused by normalisation (table above) | deny | `path_not_allowed` |
//! | R4 | the method is in `deny_methods`, compared ignoring case | deny | `method_not_allowed` |
//! | R5 | a `deny_paths` pattern matches the normalised path | deny | `path_not_allowed` |
//! | R6 | `methods` is set and does not name the method exactly | deny | `method_not_allowed` |
//! | R7 | the method is `TRACE` or `TRACK` (any case) and `methods` does not name it exactly | deny | `method_not_allowed` |
//! | R8 | `paths` is set and none matches the normalised path | deny | `path_not_allowed` |
//! | R9 | otherwise | allow | `rule_match` |
//!
//! Methods are case-sensitive tokens (RFC 9110 §9.1): `get` is not `GET`,
//! so an allow list names exactly what passes. A deny list also catches
//! case variants (`delete` for `DELETE`), since some servers fold case and
//! a deny must not be walked around that way.
//!
//! Credentials, for an allowed request only: each credential of the org, in
//! file order, whose host matches, whose `methods` (if set) names the
//! method exactly and whose `paths` (if set) matches the normalised path;
//! never for `TRACE` or `TRACK` ([`CredentialConfig::applies`]).

use std::sync::Arc;

use crate::config::{CredentialConfig, RequestRules};

use super::{OrgRef, Reason, Verdict};

/// Longest path shown in a refusal's detail.
const MAX_SHOWN_PATH: usize = 200;

/// A request path in normal form: origin-form, only the escapes that are
/// not unreserved characters (upper-case hex), no dot segments, no empty
/// segments, no path parameters. Only [`NormalPath::parse`] makes one, so
/// a rule cannot be matched against a path that skipped normalisation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NormalPath(String);

/// Why a request path was refused by normalisation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathRefusal {
    /// Not origin-form (`*`, empty, or no leading `/`).
    #[error("the request path must start with '/'")]
    NotOrigin,
    /// `%` not followed by two hex digits.
    #[error("invalid percent escape {0:?}")]
    BadEscape(String),
    /// An escape for a character servers decode into structure or worse.
    #[error("encoded {what} ({escape}) in the request path")]
    Encoded { escape: String, what: &'static str },
    /// A byte that has no place unencoded in a path.
    #[error("raw {0} in the request path")]
    Raw(&'static str),
    /// `.` or `..`, with or without `;` parameters.
    #[error("dot segment {0:?} in the request path (servers resolve it)")]
    DotSegment(String),
    /// `//` inside the path.
    #[error("empty segment ('//') in the request path")]
    EmptySegment,
    /// A `;` path parameter, which servers strip before matching.
    #[error("path parameter in segment {0:?} (';' is refused: servers strip it)")]
    Parameter(String),
}

impl NormalPath {
    /// Normalise `raw` (a request path without its query), or say why it
    /// is refused. See the module's table.
    pub fn parse(raw: &str) -> Result<NormalPath, PathRefusal> {
        let bytes = raw.as_bytes();
        if bytes.first() != Some(&b'/') {
            return Err(PathRefusal::NotOrigin);
        }
        let mut out = String::with_capacity(raw.len());
        let mut i = 0;
        while let Some(&b) = bytes.get(i) {
            if b == b'%' {
                let escape = raw.get(i..(i + 3).min(raw.len())).unwrap_or("%");
                let byte = match (
                    bytes.get(i + 1).and_then(|&h| hex(h)),
                    bytes.get(i + 2).and_then(|&l| hex(l)),
                ) {
                    (Some(h), Some(l)) => h << 4 | l,
                    _ => {
                        let shown = raw.get(i..).unwrap_or("%").chars().take(3).collect();
                        return Err(PathRefusal::BadEscape(shown));
                    }
                };
                let refuse = |what| {
                    Err(PathRefusal::Encoded {
                        escape: escape.to_string(),
                        what,
                    })
                };
                match byte {
                    b'.' => return refuse("'.'"),
                    b'/' => return refuse("'/'"),
                    b'\\' => return refuse("'\\'"),
                    b';' => return refuse("';'"),
                    b'%' => return refuse("'%' (double encoding)"),
                    0x00..=0x1F | 0x7F => return refuse("control byte"),
                    0xC0 | 0xC1 => return refuse("overlong UTF-8 lead byte"),
                    b'-' | b'_' | b'~' => out.push(byte as char),
                    _ if byte.is_ascii_alphanumeric() => out.push(byte as char),
                    _ => {
                        out.push('%');
                        out.push(HEX[usize::from(byte >> 4)] as char);
                        out.push(HEX[usize::from(byte & 0xF)] as char);
                    }
                }
                i += 3;
                continue;
            }
            match b {
                b'\\' => return Err(PathRefusal::Raw("'\\'")),
                b' ' => return Err(PathRefusal::Raw("space")),
                0x00..=0x1F | 0x7F => return Err(PathRefusal::Raw("control byte")),
                0x80..=0xFF => return Err(PathRefusal::Raw("non-ASCII byte (send it encoded)")),
                b'?' | b'#' => return Err(PathRefusal::Raw("'?' or '#' (not part of a path)")),
                _ => out.push(b as char),
            }
            i += 1;
        }
        // Segment checks run on the decoded form; encoded dots and slashes
        // were refused above, so what is left is what a server would see.
        let segments: Vec<&str> = out.get(1..).unwrap_or("").split('/').collect();
        let last = segments.len().saturating_sub(1);
        for (n, seg) in segments.iter().enumerate() {
            let base = seg.split(';').next().unwrap_or(seg);
            if base == "." || base == ".." {
                return Err(PathRefusal::DotSegment(seg.to_string()));
            }
            if seg.contains(';') {
                return Err(PathRefusal::Parameter(seg.to_string()));
            }
            if seg.is_empty() && n != last {
                return Err(PathRefusal::EmptySegment);
            }
        }
        Ok(NormalPath(out))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for NormalPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// An RFC 9110 method token (`tchar`s, at most 32 of them).
pub fn is_method_token(method: &str) -> bool {
    !method.is_empty()
        && method.len() <= 32
        && method
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// `TRACE` and `TRACK` (any case): they echo the request, headers and all,
/// so they get no credential and are refused unless a rule names them.
pub fn is_trace(method: &str) -> bool {
    method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK")
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
pub fn decide<'a>(
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
    if let Some(p) = r.deny_paths.iter().find(|p| p.matches(&path)) {
        let why = format!("deny_paths {:?} matches {path}", p.0);
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
    use crate::config::{PathPattern, RuleTarget, SecretSource};

    fn norm(p: &str) -> Result<String, PathRefusal> {
        NormalPath::parse(p).map(|p| p.0)
    }

    #[test]
    fn unreserved_escapes_are_decoded_others_kept() {
        for (raw, want) in [
            ("/", "/"),
            ("/simple/requests/", "/simple/requests/"),
            ("/a/b.c/d", "/a/b.c/d"),
            ("/api/%69nternal", "/api/internal"),
            ("/api/%49%4E%74%65rnal", "/api/INternal"),
            ("/%41%5a%61%7A%30%39%2d%5F%7e", "/AZaz09-_~"),
            ("/a%3fb", "/a%3Fb"),
            ("/a%23b", "/a%23b"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/x/...", "/x/..."),
            ("/x/.hidden", "/x/.hidden"),
            ("/x*y", "/x*y"),
        ] {
            assert_eq!(norm(raw).as_deref(), Ok(want), "{raw}");
        }
        // Normal form is a fixed point.
        for raw in ["/api/%69nternal", "/a%3fb", "/caf%c3%a9"] {
            let once = norm(raw).unwrap();
            assert_eq!(norm(&once), Ok(once.clone()));
        }
    }

    #[test]
    fn what_servers_would_resolve_differently_is_refused() {
        use PathRefusal as R;
        let enc = |e: &str| matches!(norm(e), Err(R::Encoded { .. }));
        for raw in [
            "/simple/%2e%2e/upload",
            "/a/%2E/b",
            "/a%2fb",
            "/a%2Fb",
            "/a%5cb",
            "/a%3bx=1/b",
            "/api/%2569nternal",
            "/a%00b",
            "/a%0ab",
            "/a%7fb",
            "/a%c0%aeb",
            "/a%C1%9Cb",
        ] {
            assert!(enc(raw), "{raw}: {:?}", norm(raw));
        }
        for raw in ["/a%zz", "/a%4", "/a%", "/a%u002e", "/a%g1"] {
            assert!(matches!(norm(raw), Err(R::BadEscape(_))), "{raw}");
        }
        for raw in ["/a\\b", "/a b", "/a\tb", "/caf\u{e9}", "/a?b", "/a#b"] {
            assert!(matches!(norm(raw), Err(R::Raw(_))), "{raw}");
        }
        for raw in [
            "/simple/../upload",
            "/simple/./x",
            "/x/..",
            "/x/.",
            "/..",
            "/simple/..;/upload",
            "/simple/..;jsessionid=1/upload",
            "/simple/.;x/upload",
            "/x/..;",
        ] {
            assert!(matches!(norm(raw), Err(R::DotSegment(_))), "{raw}");
        }
        for raw in ["//x", "/a//b", "/a/b//"] {
            assert_eq!(norm(raw), Err(R::EmptySegment), "{raw}");
        }
        for raw in ["/a;b/c", "/a/b;jsessionid=1", "/a/;", "/api/internal;x"] {
            assert!(matches!(norm(raw), Err(R::Parameter(_))), "{raw}");
        }
        for raw in ["", "*", "a/b", "%2fa"] {
            assert_eq!(norm(raw), Err(R::NotOrigin), "{raw}");
        }
    }

    #[test]
    fn method_tokens() {
        for ok in ["GET", "get", "M-SEARCH", "PROPFIND", "X!#$%&'*+.^_`|~1"] {
            assert!(is_method_token(ok), "{ok}");
        }
        for bad in ["", "GE T", "GET\r", "G(T", "\u{e9}", &"A".repeat(33)] {
            assert!(!is_method_token(bad), "{bad:?}");
        }
        assert!(is_trace("TRACE") && is_trace("trace") && is_trace("TrAcK"));
        assert!(!is_trace("TRACES"));
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
        assert_eq!(r("GET", "/api/%49nternal"), RuleMatch);
        // R6: exact.
        assert_eq!(r("get", "/simple/"), MethodNotAllowed);
        assert_eq!(r("DELETE", "/simple/"), MethodNotAllowed);
        // R8
        assert_eq!(r("GET", "/other"), PathNotAllowed);
        assert_eq!(r("GET", "/%73imple/x"), RuleMatch);
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
