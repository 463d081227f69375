//! Every config file shipped under `config/` loads, and each is rejected,
//! with a located error, when a bogus key is added to any of its tables.

use std::path::{Path, PathBuf};

use palisade::config;

/// Every config file shipped: `config/*.toml` and the recipes' `docker/*.toml`.
fn shipped_configs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = ["config", "docker"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root.join(d)).expect("config dir"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "expected config files, found {files:?}");
    files
}

#[test]
fn shipped_configs_load() {
    for path in shipped_configs() {
        if let Err(e) = config::load(&path) {
            panic!("{} does not load:\n{e}", path.display());
        }
    }
}

#[test]
fn a_bogus_key_in_any_table_is_rejected_with_its_location() {
    for path in shipped_configs() {
        let src = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = src.lines().collect();
        // Positions right after each table header, plus the top of the file.
        let mut positions = vec![0];
        positions.extend(
            lines
                .iter()
                .enumerate()
                .filter(|(_, l)| l.trim_start().starts_with('['))
                .map(|(i, _)| i + 1),
        );
        assert!(
            positions.len() > 4,
            "{}: expected several tables",
            path.display()
        );
        for at in positions {
            let mut edited: Vec<&str> = lines.clone();
            edited.insert(at, "palisade_bogus_key = 1");
            let text = edited.join("\n");
            let errors = config::from_str(&text, &path).err().unwrap_or_else(|| {
                panic!("{}: bogus key at line {} accepted", path.display(), at + 1)
            });
            let first = errors.0[0].to_string();
            let want = format!("{}:{}:", path.display(), at + 1);
            assert!(first.starts_with(&want), "{first} (want {want})");
            assert!(first.contains("palisade_bogus_key"), "{first}");
        }
    }
}
