//! The manual cannot drift from the repository or the parser:
//!
//! - every relative link in `README.md` and `docs/*.md` resolves to a file
//!   (or directory) of the repository, and an `#anchor` to a heading of
//!   that file by GitHub's slug rules; no link leaves the repository (a
//!   `../` above its root, or an absolute path);
//! - every key the config parser accepts ([`palisade::config::accepted_keys`])
//!   is documented in `docs/configuration.md`, and every key documented
//!   there is accepted. The convention: a key is documented by a line
//!   `KEY = ...` (or `# KEY = ...`, commented out) inside a ```` ```toml ````
//!   block, under the `[TABLE]` or `[[TABLE]]` header (or `# [TABLE]`) of
//!   its table, so `org.allow.host` is `host = ...` under `[[org.allow]]`;
//! - no page names a `../` path outside the repository, but for the one
//!   command of the team's bench harness on the performance page;
//! - every `$ palisade evidence SUB ...` command shown in
//!   `docs/evidence.md` names a subcommand and flags that
//!   `palisade evidence SUB --help` lists;
//! - `README.md` is the front door: at most 300 lines, with the two
//!   commands, and a link to every page in `docs/`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md and every page under docs/, as paths relative to the root.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().unwrap()))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds no page");
    pages.extend(docs);
    pages
}

/// The lines of a markdown text outside fenced code blocks, numbered from 1.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = if trimmed.starts_with("```") {
            Some("```")
        } else if trimmed.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// A line without its inline code spans (`...`), which hold no links.
fn without_code(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of the inline links `[text](target)` of a text, with lines.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let line = without_code(line);
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].trim();
            // `[text](target "title")`
            let target = target.split_whitespace().next().unwrap_or_default();
            out.push((n, target.to_string()));
            rest = &rest[end..];
        }
    }
    out
}

/// GitHub's anchor for a heading: lowercase, every character but letters,
/// digits, spaces, `-` and `_` dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    // A link in a heading counts by its text.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(i) = rest.find("](") {
        let Some(end) = rest[i..].find(')') else {
            break;
        };
        text.push_str(&rest[..i]);
        rest = &rest[i + end + 1..];
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a markdown text's headings, repeats numbered `-1`, `-2`
/// as GitHub numbers them.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// Where a relative link from `page` leads, inside the repository; or why
/// it leaves it.
fn resolve(page: &Path, target: &str) -> Result<PathBuf, String> {
    if target.starts_with('/') {
        return Err("an absolute path".into());
    }
    let mut path = PathBuf::new();
    for c in page
        .parent()
        .unwrap_or(Path::new(""))
        .join(target)
        .components()
    {
        match c {
            Component::Normal(part) => path.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !path.pop() {
                    return Err("a path above the repository's root".into());
                }
            }
            _ => return Err("not a relative path".into()),
        }
    }
    Ok(path)
}

/// Every problem with the links of one page.
fn broken_links(page: &Path) -> Vec<String> {
    let text = read(&root().join(page));
    let mut problems = Vec::new();
    for (line, target) in links(&text) {
        let at = format!("{}:{line}: ({target})", page.display());
        if target.contains("://") || target.starts_with("mailto:") {
            continue; // not a file
        }
        let (file, anchor) = match target.split_once('#') {
            Some((file, anchor)) => (file, Some(anchor)),
            None => (target.as_str(), None),
        };
        let path = if file.is_empty() {
            page.to_path_buf()
        } else {
            match resolve(page, file) {
                Ok(path) => path,
                Err(why) => {
                    problems.push(format!("{at} leaves the repository: {why}"));
                    continue;
                }
            }
        };
        let full = root().join(&path);
        if !full.exists() {
            problems.push(format!("{at}: no such file {}", path.display()));
            continue;
        }
        if let Some(anchor) = anchor {
            if full.extension().is_none_or(|e| e != "md") {
                problems.push(format!("{at}: an anchor into a file that is not markdown"));
            } else if !anchors(&read(&full)).contains(anchor) {
                problems.push(format!("{at}: {} has no heading #{anchor}", path.display()));
            }
        }
    }
    problems
}

#[test]
fn every_relative_link_resolves_inside_the_repository() {
    let problems: Vec<String> = pages().iter().flat_map(|p| broken_links(p)).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_link_check_catches_what_it_should() {
    let page = Path::new("docs/x.md");
    assert_eq!(
        resolve(page, "../src/lib.rs"),
        Ok(PathBuf::from("src/lib.rs"))
    );
    assert!(resolve(page, "../../elsewhere/run.sh").is_err());
    assert!(resolve(page, "/etc/passwd").is_err());
    assert_eq!(
        links("a [b](c.md#d) `[e](f)` [g](h \"t\")\n```\n[i](j)\n```\n"),
        vec![(1, "c.md#d".to_string()), (1, "h".to_string())]
    );
    assert_eq!(
        slug("Record references: what a client is shown"),
        "record-references-what-a-client-is-shown"
    );
    assert_eq!(slug("1. Agree a plan"), "1-agree-a-plan");
    assert_eq!(
        slug("`[dns] upstream` and `max_ttl`"),
        "dns-upstream-and-max_ttl"
    );
    let a = anchors("# Cost\n## Cost\n```\n# not\n```\n## What it costs?\n");
    let want: BTreeSet<String> = ["cost", "cost-1", "what-it-costs"].map(String::from).into();
    assert_eq!(a, want);
}

/// The one command outside the repository the manual may name: the team's
/// reference bench harness, kept beside the checkout (run from the root).
const HARNESS: &str = "../shared/bench/run-palisade.sh";

/// Every `../` path written anywhere in a page (links, code, prose) that
/// climbs out of the repository, from the page's folder.
fn paths_leaving(page: &Path, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    let mut offset = 0;
    while let Some(i) = rest.find("../") {
        let start = offset + i;
        // Back to the start of the path (a link target may begin `./`).
        let head = text[..start]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "._/-".contains(c)))
            .map_or(0, |j| j + 1);
        let len = text[head..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || "._/-".contains(c)))
            .unwrap_or(text.len() - head);
        let path = &text[head..head + len];
        // `/a/../b` (a request path, say) is no relative file path.
        let relative = path.starts_with("../") || path.starts_with("./");
        let allowed = path == HARNESS && page == Path::new("docs/performance.md");
        if relative && !allowed && resolve(page, path).is_err() {
            out.push(format!("{}: {path}", page.display()));
        }
        offset = head + len.max(start + 3 - head);
        rest = &text[offset..];
    }
    // An absolute path of a development machine's checkout is no file a
    // reader has either.
    for (n, line) in text.lines().enumerate() {
        if WORKSTATION.iter().any(|w| line.contains(w)) {
            out.push(format!("{}:{}: a workstation path", page.display(), n + 1));
        }
    }
    out
}

/// Where checkouts and scratch scripts live on the team's machines.
const WORKSTATION: [&str; 2] = ["/work/", "/home/"];

#[test]
fn no_page_names_a_file_outside_the_repository() {
    let mut problems = Vec::new();
    for page in pages() {
        problems.extend(paths_leaving(&page, &read(&root().join(&page))));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let page = Path::new("docs/x.md");
    assert!(paths_leaving(page, "see [a](../src/lib.rs) and `../../x/y.sh`").len() == 1);
    assert!(paths_leaving(page, "run `/work/helpers/x.sh`").len() == 1);
    assert!(
        paths_leaving(
            Path::new("README.md"),
            "run ../shared/bench/run-palisade.sh"
        )
        .len()
            == 1
    );
}

/// The keys `docs/configuration.md` documents, by the convention of the
/// module doc, each with its line; and the table headers it uses.
fn documented_keys(text: &str) -> (BTreeMap<String, usize>, BTreeMap<String, usize>) {
    let mut keys = BTreeMap::new();
    let mut tables = BTreeMap::new();
    let mut in_toml = false;
    let mut table = String::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if !in_toml {
            if trimmed == "```toml" {
                in_toml = true;
                table.clear();
            }
            continue;
        }
        if trimmed.starts_with("```") {
            in_toml = false;
            continue;
        }
        let code = trimmed.strip_prefix('#').unwrap_or(trimmed).trim_start();
        if let Some(header) = code.strip_prefix('[') {
            let name: String = header
                .trim_start_matches('[')
                .chars()
                .take_while(|&c| c != ']')
                .collect();
            table = name.trim().to_string();
            tables.entry(table.clone()).or_insert(i + 1);
            continue;
        }
        let key: String = code
            .chars()
            .take_while(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            .collect();
        if key.is_empty() || !code[key.len()..].trim_start().starts_with('=') {
            continue;
        }
        let dotted = if table.is_empty() {
            key
        } else {
            format!("{table}.{key}")
        };
        keys.entry(dotted).or_insert(i + 1);
    }
    (keys, tables)
}

#[test]
fn the_configuration_reference_documents_exactly_the_accepted_keys() {
    let page = "docs/configuration.md";
    let text = read(&root().join(page));
    let (documented, tables) = documented_keys(&text);
    let accepted: BTreeSet<String> = palisade::config::accepted_keys().into_iter().collect();
    assert!(accepted.contains("proxy.listen") && accepted.contains("org.allow.host"));

    let missing: Vec<&String> = accepted
        .iter()
        .filter(|k| !documented.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "{page} does not document (as `KEY = ...` under its `[TABLE]` in a toml block): {missing:?}"
    );
    let stale: Vec<String> = documented
        .iter()
        .filter(|(k, _)| !accepted.contains(*k))
        .map(|(k, line)| format!("{page}:{line}: {k}"))
        .collect();
    assert!(
        stale.is_empty(),
        "documented but not accepted by the parser:\n{}",
        stale.join("\n")
    );
    let not_tables: Vec<String> = tables
        .iter()
        .filter(|(t, _)| !accepted.iter().any(|k| k.starts_with(&format!("{t}."))))
        .map(|(t, line)| format!("{page}:{line}: [{t}]"))
        .collect();
    assert!(
        not_tables.is_empty(),
        "headers of no table:\n{}",
        not_tables.join("\n")
    );
}

#[test]
fn the_key_convention_reads_what_it_should() {
    let text = "x = 1\n```toml\n[proxy]\nlisten = []   # a = b\n# idle_timeout = \"1s\"\n                # \"fsync\": x\n[[org.allow]]\nhost = \"a\"\n# [[org.credential]]\n# methods = [\"GET\"], paths = []\n```\nnot = 2\n";
    let (keys, tables) = documented_keys(text);
    let keys: Vec<&str> = keys.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "org.allow.host",
            "org.credential.methods",
            "proxy.idle_timeout",
            "proxy.listen"
        ]
    );
    assert_eq!(tables.len(), 3);
}

#[test]
fn the_readme_is_a_front_door_to_every_page() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines, at most 300");
    for command in [
        "cargo run --release -- run",
        "cargo test --all-targets -- --test-threads=2",
    ] {
        assert!(readme.contains(command), "README.md lacks `{command}`");
    }
    let linked: BTreeSet<PathBuf> = links(&readme)
        .into_iter()
        .filter_map(|(_, t)| {
            let file = t.split('#').next().unwrap_or_default().to_string();
            resolve(Path::new("README.md"), &file).ok()
        })
        .collect();
    let unlinked: Vec<PathBuf> = pages()
        .into_iter()
        .skip(1)
        .filter(|p| !linked.contains(p))
        .collect();
    assert!(unlinked.is_empty(), "README.md links no {unlinked:?}");
}

#[test]
fn every_page_says_whom_it_is_for_and_what_it_holds() {
    for page in pages().into_iter().skip(1) {
        let text = read(&root().join(&page));
        let head: String = text.lines().take(12).collect::<Vec<_>>().join("\n");
        assert!(
            head.starts_with("# ") && head.contains("For ") && head.contains("\nContents:\n"),
            "{} should start with its title, whom it is for and its contents",
            page.display()
        );
    }
}

/// The metric names `src/metrics.rs` registers: its `"palisade_…"` strings.
fn registered_metrics() -> BTreeSet<String> {
    let text = read(&root().join("src/metrics.rs"));
    let mut out = BTreeSet::new();
    for piece in text.split('"').skip(1).step_by(2) {
        if piece.starts_with("palisade_")
            && piece.len() > "palisade_".len()
            && piece
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            out.insert(piece.to_string());
        }
    }
    out
}

#[test]
fn every_metric_is_documented() {
    let metrics = registered_metrics();
    // Names every release has had: the scan cannot come back empty.
    for known in ["palisade_connections_total", "palisade_evidence_store_full"] {
        assert!(
            metrics.contains(known),
            "{known} not found in src/metrics.rs"
        );
    }
    let docs: String = pages().iter().map(|p| read(p)).collect();
    let missing: Vec<&String> = metrics
        .iter()
        .filter(|m| !docs.contains(&format!("`{m}")))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics registered in src/metrics.rs but named in no docs page: {missing:?}"
    );
}

/// The `$ palisade evidence ...` commands of the console blocks of
/// `text`, continuation lines joined: (line, tokens after `palisade`).
fn evidence_commands(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some((n, mut cmd)) = open.take() {
            let part = line.trim();
            cmd.push(' ');
            cmd.push_str(part.trim_end_matches('\\'));
            if part.ends_with('\\') {
                open = Some((n, cmd));
            } else {
                out.push((n, cmd));
            }
            continue;
        }
        if let Some(cmd) = line.strip_prefix("$ palisade evidence ") {
            let cmd = cmd.split("   #").next().unwrap_or(cmd).trim();
            if cmd.ends_with('\\') {
                open = Some((i + 1, cmd.trim_end_matches('\\').to_string()));
            } else {
                out.push((i + 1, cmd.to_string()));
            }
        }
    }
    out.into_iter()
        .map(|(n, c)| (n, c.split_whitespace().map(String::from).collect()))
        .collect()
}

#[test]
fn every_evidence_command_shown_is_one_the_cli_accepts() {
    let page = root().join("docs/evidence.md");
    let commands = evidence_commands(&read(&page));
    assert!(
        commands.iter().any(|(_, c)| c[0] == "verify-export"),
        "the worked example of an export is gone: {commands:?}"
    );
    let mut wrong = Vec::new();
    for (line, tokens) in &commands {
        let help = std::process::Command::new(env!("CARGO_BIN_EXE_palisade"))
            .args(["evidence", &tokens[0], "--help"])
            .output()
            .expect("run palisade");
        let text = String::from_utf8_lossy(&help.stdout);
        if !help.status.success() {
            wrong.push(format!(
                "docs/evidence.md:{line}: no subcommand {:?}",
                tokens[0]
            ));
            continue;
        }
        for flag in tokens.iter().filter(|t| t.starts_with("--")) {
            let flag = flag.split('=').next().unwrap_or(flag);
            if !text.contains(&format!("{flag} ")) && !text.contains(&format!("{flag}\n")) {
                wrong.push(format!(
                    "docs/evidence.md:{line}: evidence {} has no {flag}",
                    tokens[0]
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
