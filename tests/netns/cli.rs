//! `palisade check` and `palisade explain` (no namespaces needed).

use crate::find_path_line_col;
use crate::lab::{self, run_with_timeout, scratch_dir, CmdOutput, DEFAULT_POLICY};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn write_config(dir: &Path, extra_proxy_line: &str) -> PathBuf {
    let evidence = dir.join("evidence");
    fs::create_dir_all(&evidence).unwrap();
    let cfg = format!(
        "[proxy]\nlisten = [\"198.18.1.1:3128\"]\ntransparent = []\n{extra_proxy_line}\n\
         [dns]\nlisten = []\nupstream = [\"198.18.2.2:53\"]\n\n\
         [admin]\nlisten = \"198.18.1.1:9711\"\n\n[evidence]\ndir = {:?}\n{DEFAULT_POLICY}",
        evidence.display().to_string()
    );
    let path = dir.join("palisade.toml");
    fs::write(&path, cfg).unwrap();
    path
}

fn palisade(args: &[&str]) -> CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        lab::CMD_TIMEOUT,
    )
}

#[test]
fn check_accepts_valid_and_rejects_unknown_key_with_location() {
    let dir = scratch_dir("check");
    let good = write_config(&dir.join("good"), "");
    let out = palisade(&["check", "-c", good.to_str().unwrap()]);
    assert_eq!(
        out.code(),
        Some(0),
        "valid config rejected:\n{}",
        out.describe()
    );

    let bad = write_config(&dir.join("bad"), "listen_backlog_typo = 5");
    // Line 4 of the file holds the unknown key.
    let text = fs::read_to_string(&bad).unwrap();
    assert_eq!(text.lines().nth(3), Some("listen_backlog_typo = 5"));
    let bad_s = bad.to_str().unwrap();
    let out = palisade(&["check", "-c", bad_s]);
    assert_eq!(
        out.code(),
        Some(1),
        "unknown key accepted:\n{}",
        out.describe()
    );
    let all = format!("{}{}", out.stdout, out.stderr);
    let line = find_path_line_col(&all, bad_s)
        .unwrap_or_else(|| panic!("no `{bad_s}:LINE:COL:` in output:\n{all}"));
    assert_eq!(line, 4, "wrong line reported:\n{all}");
    assert!(all.contains("listen_backlog_typo"), "key not named:\n{all}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn explain_reports_decisions_made_before_resolution() {
    let dir = scratch_dir("explain");
    let cfg = write_config(&dir, "");
    let cfg = cfg.to_str().unwrap();
    for (client, target, reason) in [
        ("198.18.1.2", "other.test:443", "no_matching_rule"),
        ("198.18.1.2", "blocked.wild.test:443", "explicit_deny"),
        ("198.18.1.2", "wild.test:443", "no_matching_rule"),
        ("198.18.1.2", "198.18.2.10:443", "no_matching_rule"),
        ("198.18.3.2", "allowed.test:443", "unknown_client"),
    ] {
        let out = palisade(&["explain", "-c", cfg, "--client", client, target]);
        assert_eq!(
            out.code(),
            Some(0),
            "explain {client} {target}:\n{}",
            out.describe()
        );
        assert!(
            out.stdout.contains(reason),
            "explain {client} {target}: expected {reason}:\n{}",
            out.describe()
        );
        let out = palisade(&["explain", "-c", cfg, "--client", client, target, "--json"]);
        assert_eq!(out.code(), Some(0), "explain --json:\n{}", out.describe());
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("explain --json is not JSON ({e}):\n{}", out.stdout));
        let flat = v.to_string();
        assert!(flat.contains(&format!("\"{reason}\"")), "{target}: {flat}");
        assert!(flat.contains("\"deny\""), "{target}: {flat}");
    }
    // explain must not have written evidence.
    let written = fs::read_dir(dir.join("evidence")).unwrap().count();
    assert_eq!(written, 0, "explain wrote evidence files");
    let _ = fs::remove_dir_all(&dir);
}
