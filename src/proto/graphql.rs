//! GraphQL requests over HTTP: which operation a request asks the server
//! to execute, and what kind it is. Pure, over bytes.
//!
//! A request is a JSON object `{"query", "operationName", "variables",
//! "extensions"}` (POST), an array of them (a batch, each element its own
//! request), or the same as URL parameters (GET). The document is parsed
//! with `apollo-parser` (the whole GraphQL grammar: comments, strings and
//! block strings, aliases, fragments), bounded in tokens and nesting. The
//! operation executed is the one `operationName` names, or the only one in
//! the document; what [`operation`] cannot pin down to exactly one
//! operation is refused, as is anything it does not know:
//!
//! - a document that does not parse, or holds type-system definitions;
//! - no operation, or several without `operationName`, or several with the
//!   name given, or none with it;
//! - a fragment spread at the top of the operation naming a fragment that
//!   is not defined once (spreads are followed, cycles cut);
//! - a request object with another key than the four above (`id`,
//!   `documentId`: a stored document the server would run unseen), a
//!   repeated key, no `query` (a persisted query by hash alone), a URL
//!   with a parameter given twice.
//!
//! An operation's `fields` are the names (never the aliases) of the fields
//! at its top level, fragments expanded: for a mutation, the mutations it
//! runs.

use std::collections::HashSet;

use apollo_parser::cst;
use apollo_parser::Parser;
use serde::Deserialize;

/// The largest GraphQL request body (or URL query) read; a larger one is
/// refused.
pub(crate) const MAX_GRAPHQL_BYTES: usize = 256 * 1024;
/// The most requests in one batch.
pub(crate) const MAX_BATCH: usize = 100;
/// Tokens and nesting the parser takes before giving up (the document is
/// then refused).
const TOKEN_LIMIT: usize = 100_000;
const RECURSION_LIMIT: usize = 200;

/// The kind of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Query,
    Mutation,
    Subscription,
}

impl OpKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            OpKind::Query => "query",
            OpKind::Mutation => "mutation",
            OpKind::Subscription => "subscription",
        }
    }
}

/// The operation a request executes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Operation {
    pub(crate) kind: OpKind,
    pub(crate) name: Option<String>,
    /// Top-level field names (not aliases), fragments expanded, in order,
    /// each once.
    pub(crate) fields: Vec<String>,
}

/// One GraphQL-over-HTTP request object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestObject {
    query: Option<String>,
    #[serde(rename = "operationName")]
    operation_name: Option<String>,
    #[allow(dead_code)]
    variables: Option<serde::de::IgnoredAny>,
    #[allow(dead_code)]
    extensions: Option<serde::de::IgnoredAny>,
}

/// A POST body: one request object or a batch of them. Returns the
/// operation of each, in order, or why the body is refused.
pub(crate) fn operations_of_body(body: &[u8]) -> Result<Vec<Operation>, String> {
    if body.len() > MAX_GRAPHQL_BYTES {
        return Err("the GraphQL body is larger than 256 KiB".into());
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    let objects: Vec<RequestObject> = match first {
        Some(b'[') => {
            serde_json::from_slice(body).map_err(|e| format!("not a GraphQL batch: {e}"))?
        }
        Some(b'{') => {
            vec![serde_json::from_slice(body).map_err(|e| format!("not a GraphQL request: {e}"))?]
        }
        _ => return Err("not a GraphQL request: the body is not a JSON object or array".into()),
    };
    if objects.is_empty() {
        return Err("an empty GraphQL batch".into());
    }
    if objects.len() > MAX_BATCH {
        return Err(format!("a GraphQL batch of more than {MAX_BATCH} requests"));
    }
    objects
        .iter()
        .map(|o| {
            let Some(query) = o.query.as_deref() else {
                return Err(
                    "a GraphQL request without a query (a persisted query is not seen)".into(),
                );
            };
            operation(query, o.operation_name.as_deref())
        })
        .collect()
}

/// A GET's URL query (`a=b&c=d`, form-encoded): the operation named by its
/// `query` and `operationName` parameters; `None` when it has no `query`
/// parameter (not a GraphQL request).
pub(crate) fn operation_of_url_query(query: &str) -> Option<Result<Operation, String>> {
    if query.len() > MAX_GRAPHQL_BYTES {
        return Some(Err("the GraphQL query string is larger than 256 KiB".into()));
    }
    let mut seen: Vec<(String, String)> = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(k), Some(v)) = (form_decode(k), form_decode(v)) else {
            return Some(Err("a URL parameter is not valid form encoding".into()));
        };
        if seen.iter().any(|(s, _)| *s == k) {
            return Some(Err(format!("the URL parameter {k:?} is given twice")));
        }
        seen.push((k, v));
    }
    let get = |name: &str| {
        seen.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let document = get("query")?;
    Some(operation(
        document,
        get("operationName").filter(|n| !n.is_empty()),
    ))
}

/// Does a URL query carry GraphQL request parameters (`query`,
/// `operationName`, `variables`, `extensions`)? A POST with them is
/// ambiguous: servers differ on which of URL and body wins.
pub(crate) fn url_has_graphql_params(query: &str) -> bool {
    query.split('&').any(|pair| {
        let k = pair.split_once('=').map_or(pair, |(k, _)| k);
        form_decode(k).is_some_and(|k| {
            matches!(
                k.as_str(),
                "query" | "operationName" | "variables" | "extensions"
            )
        })
    })
}

/// `application/x-www-form-urlencoded` decoding: `+` is a space, `%XX` a
/// byte; the result must be UTF-8.
fn form_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The operation `document` executes, `operation_name` choosing among
/// several. See the module's documentation for what is refused.
pub(crate) fn operation(document: &str, operation_name: Option<&str>) -> Result<Operation, String> {
    if document.len() > MAX_GRAPHQL_BYTES {
        return Err("the GraphQL document is larger than 256 KiB".into());
    }
    let tree = Parser::new(document)
        .token_limit(TOKEN_LIMIT)
        .recursion_limit(RECURSION_LIMIT)
        .parse();
    if let Some(e) = tree.errors().next() {
        let msg: String = e.message().chars().take(120).collect();
        return Err(format!("the GraphQL document does not parse: {msg}"));
    }
    let doc = tree.document();
    let mut ops = Vec::new();
    let mut fragments: Vec<(String, cst::FragmentDefinition)> = Vec::new();
    for def in doc.definitions() {
        match def {
            cst::Definition::OperationDefinition(op) => ops.push(op),
            cst::Definition::FragmentDefinition(f) => {
                let Some(name) = f.fragment_name().and_then(|n| n.name()) else {
                    return Err("a fragment without a name".into());
                };
                fragments.push((name.text().to_string(), f));
            }
            _ => return Err("a type-system definition in an executable document".into()),
        }
    }
    let name_of = |op: &cst::OperationDefinition| op.name().map(|n| n.text().to_string());
    let chosen = match operation_name {
        Some(wanted) => {
            let mut named = ops
                .iter()
                .filter(|op| name_of(op).as_deref() == Some(wanted));
            match (named.next(), named.next()) {
                (Some(op), None) => op,
                (None, _) => return Err(format!("no operation is named {wanted:?}")),
                (Some(_), Some(_)) => {
                    return Err(format!("several operations are named {wanted:?}"))
                }
            }
        }
        None => match ops.as_slice() {
            [op] => op,
            [] => return Err("the GraphQL document has no operation".into()),
            _ => {
                return Err(
                    "several operations and no operationName: which one runs is ambiguous".into(),
                )
            }
        },
    };
    let kind = match chosen.operation_type() {
        None => OpKind::Query,
        Some(t) if t.query_token().is_some() => OpKind::Query,
        Some(t) if t.mutation_token().is_some() => OpKind::Mutation,
        Some(t) if t.subscription_token().is_some() => OpKind::Subscription,
        Some(_) => return Err("an operation of unknown type".into()),
    };
    let Some(selections) = chosen.selection_set() else {
        return Err("an operation without a selection set".into());
    };
    let mut fields = Vec::new();
    let mut followed = HashSet::new();
    top_fields(&selections, &fragments, &mut followed, &mut fields)?;
    Ok(Operation {
        kind,
        name: name_of(chosen),
        fields,
    })
}

/// The field names at the top of `set`, through inline fragments and
/// fragment spreads (each fragment followed once).
fn top_fields(
    set: &cst::SelectionSet,
    fragments: &[(String, cst::FragmentDefinition)],
    followed: &mut HashSet<String>,
    out: &mut Vec<String>,
) -> Result<(), String> {
    for sel in set.selections() {
        match sel {
            cst::Selection::Field(f) => {
                let Some(name) = f.name() else {
                    return Err("a field without a name".into());
                };
                let name = name.text().to_string();
                if !out.contains(&name) {
                    out.push(name);
                }
            }
            cst::Selection::InlineFragment(inline) => {
                let Some(inner) = inline.selection_set() else {
                    return Err("an inline fragment without a selection set".into());
                };
                top_fields(&inner, fragments, followed, out)?;
            }
            cst::Selection::FragmentSpread(spread) => {
                let Some(name) = spread.fragment_name().and_then(|n| n.name()) else {
                    return Err("a fragment spread without a name".into());
                };
                let name = name.text().to_string();
                let mut defs = fragments.iter().filter(|(n, _)| *n == name);
                let def = match (defs.next(), defs.next()) {
                    (Some((_, d)), None) => d,
                    (None, _) => return Err(format!("the fragment {name:?} is not defined")),
                    (Some(_), Some(_)) => {
                        return Err(format!("the fragment {name:?} is defined twice"))
                    }
                };
                if !followed.insert(name) {
                    continue;
                }
                let Some(inner) = def.selection_set() else {
                    return Err("a fragment without a selection set".into());
                };
                top_fields(&inner, fragments, followed, out)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(doc: &str, name: Option<&str>) -> Result<(OpKind, Vec<String>), String> {
        operation(doc, name).map(|o| (o.kind, o.fields))
    }

    fn fields(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kinds_names_and_aliases() {
        assert_eq!(
            op("{ viewer { login } }", None).unwrap(),
            (OpKind::Query, fields(&["viewer"]))
        );
        assert_eq!(
            op(
                "query Q { repository(owner: \"a\", name: \"b\") { id } }",
                None
            )
            .unwrap(),
            (OpKind::Query, fields(&["repository"]))
        );
        // An alias is not the field: the name counts.
        assert_eq!(
            op(
                "mutation { createPullRequest: deleteRepository(input: {}) { id } }",
                None
            )
            .unwrap(),
            (OpKind::Mutation, fields(&["deleteRepository"]))
        );
        assert_eq!(
            op("subscription { x }", None).unwrap().0,
            OpKind::Subscription
        );
    }

    #[test]
    fn comments_and_strings_are_not_operations() {
        let doc =
            "# mutation { deleteRepository }\nquery { a(s: \"mutation { deleteRepository }\") \
                   b(t: \"\"\"\nmutation { x }\n\"\"\") }";
        assert_eq!(op(doc, None).unwrap(), (OpKind::Query, fields(&["a", "b"])));
        // And a mutation hidden behind a comment still parses as one.
        let doc = "# query {\nmutation { deleteRepository(input: {}) { id } }";
        assert_eq!(op(doc, None).unwrap().0, OpKind::Mutation);
    }

    #[test]
    fn fragments_are_expanded_at_the_top() {
        let doc = "mutation M { ...F ... on Mutation { addComment(input: {}) { id } } }\n\
                   fragment F on Mutation { deleteRepository(input: {}) { id } ...G }\n\
                   fragment G on Mutation { ...F createIssue(input: {}) { id } }";
        assert_eq!(
            op(doc, None).unwrap().1,
            fields(&["deleteRepository", "createIssue", "addComment"])
        );
        assert!(op("mutation { ...Missing }", None).is_err());
        let twice = "mutation { ...F } fragment F on M { a } fragment F on M { b }";
        assert!(op(twice, None).is_err());
    }

    #[test]
    fn the_operation_to_run_must_be_unambiguous() {
        let doc = "query A { a } mutation B { deleteRepository(input: {}) { id } }";
        assert!(op(doc, None).is_err());
        assert_eq!(op(doc, Some("A")).unwrap().0, OpKind::Query);
        assert_eq!(op(doc, Some("B")).unwrap().0, OpKind::Mutation);
        assert!(op(doc, Some("C")).is_err());
        assert!(op("query A { a } mutation A { b }", Some("A")).is_err());
        assert!(op("{ a } mutation B { b }", None).is_err());
        assert!(op("fragment F on Q { a }", None).is_err());
        assert!(op("", None).is_err());
        assert!(op("type Query { a: Int }", None).is_err());
        assert!(op("mutation { a", None).is_err());
        assert!(op("query { a } }", None).is_err());
    }

    #[test]
    fn bodies_and_batches() {
        let ops = operations_of_body(br#"{"query":"mutation { a }","variables":{"x":1}}"#).unwrap();
        assert_eq!(ops[0].kind, OpKind::Mutation);
        let ops = operations_of_body(
            br#"[{"query":"{ a }"},{"query":"mutation M { b } query Q { c }","operationName":"M"}]"#,
        )
        .unwrap();
        assert_eq!(
            ops.iter().map(|o| o.kind).collect::<Vec<_>>(),
            [OpKind::Query, OpKind::Mutation]
        );
        // operationName null is no name.
        assert!(operations_of_body(br#"{"query":"{ a }","operationName":null}"#).is_ok());
        for bad in [
            &br#"{"query":"{ a }","query":"mutation { b }"}"#[..],
            br#"{"query":"{ a }","id":"abc"}"#,
            br#"{"extensions":{"persistedQuery":{"sha256Hash":"00"}}}"#,
            br#"[]"#,
            br#"{"query":5}"#,
            b"query=mutation",
            b"mutation { a }",
            b"",
        ] {
            assert!(
                operations_of_body(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let batch = format!("[{}]", vec![r#"{"query":"{a}"}"#; MAX_BATCH + 1].join(","));
        assert!(operations_of_body(batch.as_bytes()).is_err());
        let big = format!(
            r#"{{"query":"{{ a }} # {}"}}"#,
            "x".repeat(MAX_GRAPHQL_BYTES)
        );
        assert!(operations_of_body(big.as_bytes()).is_err());
    }

    #[test]
    fn url_queries() {
        let q = |s: &str| operation_of_url_query(s).map(|r| r.map(|o| o.kind));
        assert_eq!(q("query=%7B+a+%7D"), Some(Ok(OpKind::Query)));
        assert_eq!(q("query=mutation+%7B+a+%7D"), Some(Ok(OpKind::Mutation)));
        assert_eq!(q("page=2"), None);
        assert!(matches!(
            q("query=%7Ba%7D&query=mutation%7Bb%7D"),
            Some(Err(_))
        ));
        assert!(matches!(q("query=%7Ba%7D&operationName=X"), Some(Err(_))));
        assert!(matches!(q("query=%zz"), Some(Err(_))));
        assert!(url_has_graphql_params("a=1&query=x"));
        assert!(url_has_graphql_params("%71uery=x"));
        assert!(!url_has_graphql_params("a=1&queryx=2"));
    }

    #[test]
    fn deep_and_long_documents_are_bounded() {
        let deep = format!("{}{}", "{ a ".repeat(5000), "}".repeat(5000));
        assert!(op(&deep, None).is_err());
        let wide = format!("{{ {} }}", "a ".repeat(120_000));
        assert!(op(&wide, None).is_err());
    }
}
