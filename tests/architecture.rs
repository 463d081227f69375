//! The crate's modules import each other without cycles, at every depth:
//! for every folder of `src/`, the files and submodules in it (its own
//! `mod.rs`, or `lib.rs` at the top, is the folder itself, not one of them)
//! form a graph by the paths they name, and that graph is acyclic. A cycle is named with its folder
//! and the path that closes it.
//!
//! The scan reads what rustc compiles: comments, string and character
//! literals are skipped, and so is every `#[cfg(test)]` item (the `mod
//! tests` blocks, test-only files). Paths are `crate::a::b`, `super::` and
//! `self::` ones, a child module named from its parent's file, and every
//! leaf of a `use` tree (multi-line groups included), each resolved to the
//! module it names.
//!
//! Two further rules: `dns/` imports nothing from `proxy/`, and inside
//! `proxy/` at most one import runs back up its layers ([`PROXY_LAYERS`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The files of `proxy/`, from the modes down: the trip of one connection
/// reads top to bottom. An import from a file to one in a layer above it
/// runs back up; names on one line are one layer.
const PROXY_LAYERS: &[&[&str]] = &[
    &["explicit", "socks5", "transparent"],
    &["listen"],
    &["connect"],
    &["intercepted"],
    &["forward", "revoke"],
    &["record", "admission"],
    &["failure", "conn"],
    &["decide", "dial"],
    &["ctx"],
    &["pool", "denials"],
    &["verify"],
    &["tunnel"],
    &["splice"],
    &["http"],
];

/// Imports that may run back up inside `proxy/`.
const PROXY_BACK_UP_ALLOWED: usize = 1;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`proxy/conn.rs`: `proxy::conn`;
/// `proxy/http/mod.rs`: `proxy::http`; `lib.rs`: the crate root).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && !(parts.is_empty() && stem == "lib") {
        parts.push(stem.to_string());
    }
    parts
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string, character or number literal, or a lifetime.
    Lit,
}

/// The tokens rustc sees, comments and literal contents dropped.
fn tokens(text: &str) -> Vec<Tok> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            // Block comments nest.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (ch == 'r' || ch == 'b')
            && matches!(next, Some('"') | Some('#'))
            && raw_string_end(&c, i).is_some()
        {
            i = raw_string_end(&c, i).unwrap();
            out.push(Tok::Lit);
        } else if ch == '"' || (ch == 'b' && next == Some('"')) {
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(Tok::Lit);
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
            out.push(Tok::Lit);
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                if c[i] == '.' && !c.get(i + 1).is_some_and(|d| d.is_ascii_digit()) {
                    break;
                }
                i += 1;
            }
            out.push(Tok::Lit);
        } else if ch == ':' && next == Some(':') {
            out.push(Tok::Path);
            i += 2;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

/// Where a raw string starting at `i` (`r"`, `r#"`, `br#"`) ends, if it is one.
fn raw_string_end(c: &[char], mut i: usize) -> Option<usize> {
    if c[i] == 'b' {
        i += 1;
    }
    if c.get(i) != Some(&'r') {
        return None;
    }
    i += 1;
    let mut hashes = 0;
    while c.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if c.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < c.len() {
        if c[i] == '"' && (1..=hashes).all(|h| c.get(i + h) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    Some(c.len())
}

/// The tokens without `#[cfg(test)]` items (an attribute, then the item up
/// to its `;` or through its braces).
fn without_test_items(toks: Vec<Tok>) -> Vec<Tok> {
    let is = |t: &Tok, s: &str| matches!(t, Tok::Ident(x) if x == s);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let cfg_test = toks[i] == Tok::Punct('#')
            && toks.get(i + 1) == Some(&Tok::Punct('['))
            && toks.get(i + 2).is_some_and(|t| is(t, "cfg"))
            && toks.get(i + 3) == Some(&Tok::Punct('('))
            && toks.get(i + 4).is_some_and(|t| is(t, "test"))
            && toks.get(i + 5) == Some(&Tok::Punct(')'))
            && toks.get(i + 6) == Some(&Tok::Punct(']'));
        if !cfg_test {
            out.push(toks[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        let mut depth = 0i32;
        while i < toks.len() {
            match &toks[i] {
                Tok::Punct('{') | Tok::Punct('(') | Tok::Punct('[') => depth += 1,
                Tok::Punct('}') | Tok::Punct(')') | Tok::Punct(']') => {
                    depth -= 1;
                    if depth < 0 {
                        break; // the end of what holds the item: kept
                    }
                    if depth == 0 && toks[i] == Tok::Punct('}') {
                        i += 1;
                        break;
                    }
                }
                Tok::Punct(';') | Tok::Punct(',') if depth == 0 => {
                    i += 1;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

/// What one file names: the paths it uses (each as written, with the
/// module it was written in), and the child modules it declares.
#[derive(Debug, Default)]
struct Scan {
    /// `(module the path is written in, path)`.
    paths: Vec<(Vec<String>, Vec<String>)>,
    /// `mod x;` declarations (file modules), and whether each is test-only.
    children: Vec<(String, bool)>,
}

fn scan(text: &str, module: &[String]) -> Scan {
    let all = tokens(text);
    let mut scan = Scan::default();
    // Test-only file modules: `#[cfg(test)] mod x;`.
    for w in all.windows(10) {
        if let [Tok::Punct('#'), Tok::Punct('['), Tok::Ident(cfg), Tok::Punct('('), Tok::Ident(test), Tok::Punct(')'), Tok::Punct(']'), Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] =
            w
        {
            if cfg == "cfg" && test == "test" && m == "mod" {
                scan.children.push((name.clone(), true));
            }
        }
    }
    let toks = without_test_items(all);
    // Inline modules (`mod imp { .. }`): paths in them are written there.
    let mut inline: Vec<(String, i32)> = Vec::new();
    let mut depth = 0i32;
    let mut i = 0;
    while i < toks.len() {
        let here: Vec<String> = module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(m, _)| m.clone()))
            .collect();
        match &toks[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let (Some(Tok::Ident(name)), Some(next)) = (toks.get(i + 1), toks.get(i + 2)) {
                    if *next == Tok::Punct(';') {
                        scan.children.push((name.clone(), false));
                    } else if *next == Tok::Punct('{') {
                        inline.push((name.clone(), depth));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
            }
            Tok::Ident(kw) if kw == "use" => {
                let mut leaves = Vec::new();
                i = use_tree(&toks, i + 1, &[], &mut leaves);
                for leaf in leaves {
                    scan.paths.push((here.clone(), leaf));
                }
                continue;
            }
            Tok::Ident(first)
                if (i == 0 || toks[i - 1] != Tok::Path) && toks.get(i + 1) == Some(&Tok::Path) =>
            {
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(seg)) => path.push(seg.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                scan.paths.push((here, path));
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    scan
}

/// Parse a `use` tree from `i` under `prefix`, pushing each leaf's path;
/// returns the index past it (past the `;` at the top).
fn use_tree(toks: &[Tok], mut i: usize, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix.to_vec();
    if toks.get(i) == Some(&Tok::Path) {
        i += 1; // `use ::std::..`
    }
    loop {
        match toks.get(i) {
            Some(Tok::Ident(seg)) if seg == "self" && !path.is_empty() => i += 1,
            Some(Tok::Ident(seg)) => {
                path.push(seg.clone());
                i += 1;
            }
            Some(Tok::Punct('*')) => i += 1,
            Some(Tok::Punct('{')) => {
                i += 1;
                while i < toks.len() && toks[i] != Tok::Punct('}') {
                    i = use_tree(toks, i, &path, out);
                    if toks.get(i) == Some(&Tok::Punct(',')) {
                        i += 1;
                    }
                }
                i += 1;
                // The group's leaves were pushed; the group itself is none.
                return finish_use(toks, i, prefix);
            }
            _ => break,
        }
        if toks.get(i) == Some(&Tok::Path) {
            i += 1;
        } else {
            break;
        }
    }
    // `as name`
    if matches!(toks.get(i), Some(Tok::Ident(a)) if a == "as") {
        i += 2;
    }
    if !path.is_empty() {
        out.push(path);
    }
    finish_use(toks, i, prefix)
}

/// At the top of a `use`, skip its `;`.
fn finish_use(toks: &[Tok], i: usize, prefix: &[String]) -> usize {
    if prefix.is_empty() && toks.get(i) == Some(&Tok::Punct(';')) {
        i + 1
    } else {
        i
    }
}

/// The module path `path`, written in `here`, names (as far as modules
/// go), given the crate's modules; `None` for another crate's.
fn resolve(
    here: &[String],
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut at: Vec<String>;
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            at = Vec::new();
            rest = &path[1..];
        }
        Some("super") | Some("self") => {
            at = here.to_vec();
            while let Some(seg) = rest.first() {
                match seg.as_str() {
                    "super" => {
                        at.pop()?;
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        Some(first) => {
            // A child module of the module it is written in.
            let mut child = here.to_vec();
            child.push(first.to_string());
            if !modules.contains(&child) {
                return None;
            }
            at = here.to_vec();
        }
        None => return None,
    }
    // As deep as the path names modules; the rest is an item in the last.
    for seg in rest {
        let mut next = at.clone();
        next.push(seg.clone());
        if modules.contains(&next) {
            at = next;
        } else {
            break;
        }
    }
    Some(at)
}

/// Every module of the crate, and each file's references (module path of
/// the file, modules it names), test-only files left out.
struct Crate {
    modules: BTreeSet<Vec<String>>,
    refs: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

fn read_crate() -> Crate {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut texts = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap().to_path_buf();
        if rel == Path::new("main.rs") {
            continue; // the binary: a crate of its own
        }
        let text = std::fs::read_to_string(&file).unwrap();
        texts.insert(module_of(&rel), text);
    }
    let mut modules: BTreeSet<Vec<String>> = texts.keys().cloned().collect();
    let mut scans = BTreeMap::new();
    let mut test_only = BTreeSet::new();
    for (module, text) in &texts {
        let scan = scan(text, module);
        for (child, test) in &scan.children {
            let mut m = module.clone();
            m.push(child.clone());
            if *test {
                test_only.insert(m);
            }
        }
        // Inline modules are modules too.
        for (written_in, _) in &scan.paths {
            modules.insert(written_in.clone());
        }
        scans.insert(module.clone(), scan);
    }
    let in_test = |m: &Vec<String>| test_only.iter().any(|t| m.starts_with(t));
    modules.retain(|m| !in_test(m));
    let mut refs = BTreeMap::new();
    for (module, scan) in scans {
        if in_test(&module) {
            continue;
        }
        let named: &mut BTreeSet<Vec<String>> = refs.entry(module).or_default();
        for (here, path) in &scan.paths {
            if let Some(target) = resolve(here, path, &modules) {
                named.insert(target);
            }
        }
    }
    Crate { modules, refs }
}

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The graph of the folder `folder`: its children and its own file.
fn folder_graph(krate: &Crate, folder: &[String]) -> Graph {
    let k = folder.len();
    let node = |m: &[String]| -> Option<String> {
        if !m.starts_with(folder) {
            return None;
        }
        // The folder's own file is the folder: what it names of its
        // children, and what they name of it, are no edges among them.
        m.get(k).cloned()
    };
    let mut graph = Graph::new();
    for (file, named) in &krate.refs {
        let Some(from) = node(file) else { continue };
        let deps = graph.entry(from.clone()).or_default();
        for target in named {
            if let Some(to) = node(target) {
                if to != from {
                    deps.insert(to);
                }
            }
        }
    }
    graph
}

/// Folders: modules with children.
fn folders(krate: &Crate) -> Vec<Vec<String>> {
    let mut out: BTreeSet<Vec<String>> = BTreeSet::new();
    for m in &krate.modules {
        if let Some((_, parent)) = m.split_last() {
            out.insert(parent.to_vec());
        }
    }
    out.into_iter().collect()
}

/// A path from `from` back to `to`, if there is one.
fn path_back(
    graph: &Graph,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in graph.get(from).into_iter().flatten() {
        if let Some(mut rest) = path_back(graph, next, to, seen) {
            rest.insert(0, from.to_string());
            return Some(rest);
        }
    }
    None
}

/// Each cycle of `graph` once, as `a -> b -> a` starting at its least node.
fn cycles(graph: &Graph) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (module, deps) in graph {
        for dep in deps {
            if let Some(path) = path_back(graph, dep, module, &mut BTreeSet::new()) {
                let mut ring: Vec<String> = std::iter::once(module.clone()).chain(path).collect();
                ring.pop();
                let least = (0..ring.len()).min_by_key(|i| &ring[*i]).unwrap();
                ring.rotate_left(least);
                ring.push(ring[0].clone());
                out.insert(ring.join(" -> "));
            }
        }
    }
    out
}

fn folder_name(folder: &[String]) -> String {
    format!("src/{}", folder.join("/"))
}

#[test]
fn top_level_modules_import_each_other_without_cycles() {
    let krate = read_crate();
    let graph = folder_graph(&krate, &[]);
    assert!(
        graph.len() >= 10 && graph["proxy"].contains("policy"),
        "the scan found too little: {graph:?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "import cycles in src:\n{}",
        found.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn no_folder_has_an_import_cycle() {
    let krate = read_crate();
    let proxy = folder_graph(&krate, &["proxy".to_string()]);
    assert!(
        proxy.len() >= 10 && proxy["connect"].contains("verify"),
        "the scan found too little in src/proxy: {proxy:?}"
    );
    let mut found = Vec::new();
    for folder in folders(&krate) {
        for cycle in cycles(&folder_graph(&krate, &folder)) {
            found.push(format!("{}: {cycle}", folder_name(&folder)));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn dns_imports_nothing_from_proxy() {
    let krate = read_crate();
    let dns = "dns".to_string();
    let proxy = ["proxy".to_string()];
    let mut found = Vec::new();
    for (file, named) in &krate.refs {
        if file.first() != Some(&dns) {
            continue;
        }
        for target in named.iter().filter(|t| t.starts_with(&proxy)) {
            found.push(format!("{} -> {}", file.join("::"), target.join("::")));
        }
    }
    assert!(
        found.is_empty(),
        "dns/ imports from proxy/:\n{}",
        found.join("\n")
    );
}

#[test]
fn proxy_imports_run_down_its_layers() {
    let krate = read_crate();
    let graph = folder_graph(&krate, &["proxy".to_string()]);
    let layer = |name: &str| PROXY_LAYERS.iter().position(|l| l.contains(&name));
    let unplaced: Vec<&String> = graph.keys().filter(|n| layer(n).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "place these files of src/proxy in PROXY_LAYERS: {unplaced:?}"
    );
    let mut back_up = Vec::new();
    for (from, deps) in &graph {
        let Some(at) = layer(from) else { continue };
        for to in deps {
            if layer(to).is_some_and(|l| l < at) {
                back_up.push(format!("{from} -> {to}"));
            }
        }
    }
    assert!(
        back_up.len() <= PROXY_BACK_UP_ALLOWED,
        "imports running back up inside src/proxy (at most {PROXY_BACK_UP_ALLOWED}):\n{}",
        back_up.join("\n")
    );
}

/// `proxy/mod.rs` only declares and re-exports: a file of `proxy/` that
/// named something through it would hide an edge of the graph above.
#[test]
fn proxy_files_name_each_other_not_the_re_exports() {
    let krate = read_crate();
    let proxy = vec!["proxy".to_string()];
    let through: Vec<String> = krate
        .refs
        .iter()
        .filter(|(file, named)| {
            file.len() > 1 && file.starts_with(&proxy) && named.contains(&proxy)
        })
        .map(|(file, _)| file.join("::"))
        .collect();
    assert!(
        through.is_empty(),
        "these name an item of src/proxy/mod.rs (a re-export) instead of the file that defines it: {through:?}"
    );
}

#[test]
fn the_scan_reads_what_rustc_sees() {
    let text = r##"
//! crate::doc::comment
use crate::policy::X;
use super::{
    conn,
    verify::{self, First}, // crate::not_this
    http as layer,
};
use super::super::up;
pub(crate) use self::kid::Item;
/* crate::block /* nested */ crate::still */
fn f<'a>(x: &'a str) -> char {
    let _ = "crate::in_a_string \" crate::still";
    let _ = r#"crate::raw"#;
    crate::evidence::g();
    kid::h();
    '"'
}
#[cfg(test)]
fn only_in_tests() { crate::testonly::x(); }
mod inline {
    use super::sibling;
}
#[cfg(test)]
mod tests {
    use crate::tested::Y;
}
"##;
    let module = vec!["a".to_string(), "b".to_string()];
    let s = scan(text, &module);
    let mut modules = BTreeSet::new();
    for m in [
        "policy",
        "evidence",
        "a",
        "a::b",
        "a::conn",
        "a::verify",
        "a::http",
        "up",
        "a::b::kid",
        "a::b::inline",
        "a::b::sibling",
        "doc",
        "block",
        "still",
        "testonly",
        "tested",
        "raw",
        "in_a_string",
    ] {
        modules.insert(m.split("::").map(str::to_string).collect::<Vec<_>>());
    }
    let named: BTreeSet<String> = s
        .paths
        .iter()
        .filter_map(|(here, p)| resolve(here, p, &modules))
        .map(|m| m.join("::"))
        .collect();
    let want: BTreeSet<String> = [
        "policy",
        "a::conn",
        "a::verify",
        "a::http",
        "up",
        "a::b::kid",
        "evidence",
        "a::b::sibling",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    assert_eq!(named, want);

    let mut graph = Graph::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(cycles(&graph), BTreeSet::from(["a -> b -> a".to_string()]));
}

/// The crate's only `unsafe` is the one block `lib.rs` names (the
/// SO_RCVLOWAT setsockopt in `proxy/splice.rs`), and it carries its proof:
/// a `SAFETY:` comment right above it. Any other `unsafe` (outside comments
/// and strings) fails here, as `#![deny(unsafe_code)]` fails the build
/// unless allowed.
#[test]
fn the_one_unsafe_block_is_where_lib_rs_says_and_proved_sound() {
    let mut files = Vec::new();
    rust_files(Path::new("src"), &mut files);
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let n = tokens(&text)
            .iter()
            .filter(|t| matches!(t, Tok::Ident(i) if i == "unsafe"))
            .count();
        if n > 0 {
            found.push((f.clone(), n, text));
        }
    }
    assert_eq!(
        found
            .iter()
            .map(|(f, n, _)| (f.clone(), *n))
            .collect::<Vec<_>>(),
        vec![(PathBuf::from("src/proxy/splice.rs"), 1)],
        "unsafe outside the one place src/lib.rs names"
    );
    let text = &found[0].2;
    let at = text.find("unsafe {").expect("the unsafe block");
    let before = &text[..at];
    let comment = before.rfind("// SAFETY:").expect("a SAFETY: comment");
    assert!(
        before[comment..].lines().count() <= 8,
        "the SAFETY: comment is not right above the block"
    );
}
