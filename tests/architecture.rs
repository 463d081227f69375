//! The crate's top-level modules import each other without cycles: each
//! module's `crate::X` references (outside comments and its `#[cfg(test)]
//! mod tests`) form a graph, and that graph is acyclic. A cycle is named
//! with the path that closes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `crate::NAME` references in code (not comments) before any test module.
fn references(text: &str) -> BTreeSet<String> {
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    let mut refs = BTreeSet::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() {
                refs.insert(name);
            }
        }
    }
    refs
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let refs = references(&std::fs::read_to_string(&file).unwrap());
        let deps = graph.entry(top.clone()).or_default();
        deps.extend(refs.into_iter().filter(|r| *r != top));
    }
    graph
}

/// A path from `from` back to `to`, if there is one.
fn path_back(
    graph: &BTreeMap<String, BTreeSet<String>>,
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

#[test]
fn top_level_modules_import_each_other_without_cycles() {
    let graph = graph();
    assert!(
        graph.len() >= 10 && graph["proxy"].contains("policy"),
        "the scan found too little: {graph:?}"
    );
    let mut cycles = Vec::new();
    for (module, deps) in &graph {
        for dep in deps {
            if let Some(path) = path_back(&graph, dep, module, &mut BTreeSet::new()) {
                cycles.push(format!("{module} -> {}", path.join(" -> ")));
            }
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_scan_sees_a_cycle_when_there_is_one() {
    let mut graph = BTreeMap::new();
    graph.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    graph.insert("b".to_string(), BTreeSet::from(["a".to_string()]));
    assert!(path_back(&graph, "b", "a", &mut BTreeSet::new()).is_some());
    assert_eq!(
        references("use crate::policy::X;\n// crate::proxy\nfn f() { crate::evidence::g() }"),
        BTreeSet::from(["policy".to_string(), "evidence".to_string()])
    );
}
