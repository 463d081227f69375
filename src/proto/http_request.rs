//! An HTTP request's method and path, checked purely: the RFC 9110
//! method token, and the one normal form request paths are matched in
//! (by the policy's `paths`/`deny_paths` and credential scopes, and by
//! config validation of those rules).
//!
//! [`NormalPath::parse`] decides, for each input:
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
//! The query string is never part of the path handed in.

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
pub(crate) fn is_method_token(method: &str) -> bool {
    !method.is_empty()
        && method.len() <= 32
        && method
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
