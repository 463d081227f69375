//! `palisade check` and `palisade explain`, and every command's documented exit
//! status on failure (no namespaces needed).

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

/// Every command's failure paths end with the exit status and message the
/// README's "Commands" table documents: 1 failed (or found something), 2
/// bad input to the evidence and probe commands.
#[test]
fn failures_exit_with_the_documented_status_and_message() {
    let dir = scratch_dir("cli-status");
    let cfg = write_config(&dir, "");
    let cfg = cfg.display();
    let missing = dir.join("missing.toml");
    let missing = missing.display();
    let ev = dir.join("evidence");
    let ev = ev.display();
    let nothing = dir.join("nothing");
    let nothing = nothing.display();
    let bad_plan = dir.join("plan.toml");
    fs::write(&bad_plan, "not toml [").unwrap();
    let bad_plan = bad_plan.display();
    let obs = dir.join("observations.json");
    fs::write(&obs, "{}").unwrap();
    let obs = obs.display();
    let out = dir.join("out");
    let out = out.display();
    // A report on evidence that fails verification needs real observations.
    let plan = dir.join("small.toml");
    fs::write(
        &plan,
        "org = \"acme\"\nrun = \"0a1b2c3d\"\nissued = \"2020-01-01T00:00:00Z\"\n\
         proxy = \"127.0.0.1:9\"\ntimeout = \"1s\"\ndeadline = \"10s\"\n\n\
         [[probe]]\nid = \"x\"\ntarget = \"tcp://127.0.0.3:9\"\nvia = \"proxy\"\n\
         expect = \"deny\"\nnote = \"n\"\n",
    )
    .unwrap();
    // The same plan as written by hand without its nonce: it runs, and no
    // report is made from it.
    let stale = dir.join("stale.toml");
    fs::write(
        &stale,
        fs::read_to_string(&plan)
            .unwrap()
            .replace("run = \"0a1b2c3d\"\n", ""),
    )
    .unwrap();
    let stale = stale.display();
    let observed = dir.join("run");
    let run = format!(
        "probe run --plan {} --out {}",
        plan.display(),
        observed.display()
    );
    let ran = palisade(&run.split(' ').collect::<Vec<_>>());
    assert_eq!(ran.code(), Some(0), "{run}:\n{}", ran.describe());
    let observed = observed.join("observations.json");
    let observed = observed.display();
    let plan = plan.display();

    let unreadable = format!("{missing}:1:1: cannot read config");
    let bad_key =
        "palisade: --key: not an Ed25519 public key (64 hex characters, or a file holding them)";
    // (arguments split at spaces, exit status, stream, text it holds)
    let cases = [
        (format!("run -c {missing}"), 1, "stderr", unreadable.clone()),
        (
            format!("check -c {missing}"),
            1,
            "stderr",
            unreadable.clone(),
        ),
        (
            format!("explain -c {cfg} --client 198.18.1.2 a.test"),
            1,
            "stderr",
            "palisade: bad target: ".into(),
        ),
        (
            format!("explain -c {missing} --client 198.18.1.2 a.test:1"),
            1,
            "stderr",
            unreadable.clone(),
        ),
        (
            format!("ca export -c {cfg} --org nope"),
            1,
            "stderr",
            format!("palisade: no org \"nope\" in {cfg}"),
        ),
        (
            format!("evidence verify {ev} --key zz"),
            2,
            "stderr",
            bad_key.into(),
        ),
        (
            format!("evidence verify {ev}"),
            1,
            "stdout",
            format!("broken: {ev}:0: no evidence segments"),
        ),
        (
            format!("evidence pubkey -c {cfg}"),
            1,
            "stderr",
            "(palisade run creates it on first start)".into(),
        ),
        (
            format!("evidence query {ev} --since x --until y"),
            2,
            "stderr",
            // Typed at the edge (clap's `value_parser`): the first bad
            // time is named, with what was expected.
            "invalid value 'x' for '--since <T>': timestamp format is invalid \
             (expected RFC 3339, e.g. 2026-01-02T03:04:05Z)"
                .into(),
        ),
        (
            format!("evidence query {nothing}"),
            1,
            "stderr",
            format!("palisade: {nothing}: "),
        ),
        (
            format!("evidence export {nothing} --format ocsf"),
            1,
            "stderr",
            format!("palisade: {nothing}: "),
        ),
        (
            format!("replay --evidence {nothing} -c {cfg}"),
            1,
            "stderr",
            format!("palisade: cannot read evidence {nothing}: "),
        ),
        (
            format!("replay --evidence {ev} -c {missing}"),
            1,
            "stderr",
            unreadable.clone(),
        ),
        (
            format!("probe plan -c {missing} --org acme"),
            2,
            "stderr",
            unreadable.clone(),
        ),
        (
            format!("probe plan -c {cfg} --org nope"),
            2,
            "stderr",
            "palisade: no org \"nope\"".into(),
        ),
        (
            format!("probe run --plan {missing} --out {out}"),
            2,
            "stderr",
            format!("palisade: {missing}: "),
        ),
        (
            format!("probe run --plan {bad_plan} --out {out}"),
            2,
            "stderr",
            format!("palisade: {bad_plan}: "),
        ),
        (
            format!("probe report --plan {plan} --observations {obs} --evidence {ev} --key zz --out {out}"),
            2,
            "stderr",
            bad_key.into(),
        ),
        (
            format!("probe report --plan {plan} --observations {obs} --evidence {ev} --out {out}"),
            2,
            "stderr",
            format!("palisade: {obs}: not an observations file"),
        ),
        (
            format!(
                "probe report --plan {bad_plan} --observations {observed} --evidence {ev} --out {out}"
            ),
            2,
            "stderr",
            format!("palisade: {bad_plan}: "),
        ),
        (
            format!("probe report --plan {stale} --observations {observed} --evidence {ev} --out {out}"),
            2,
            "stderr",
            format!("palisade: {stale}: the plan names no `run`"),
        ),
        (
            format!("probe report --plan {plan} --observations {observed} --evidence {ev} --out {out}"),
            1,
            "stderr",
            format!("palisade: evidence verification failed: {ev}:0: no evidence segments"),
        ),
        (
            "token new --org acme".into(),
            0,
            "stdout",
            "tokens = [\"sha256:".into(),
        ),
    ];
    for (args, code, stream, needle) in cases {
        let got = palisade(&args.split(' ').collect::<Vec<_>>());
        let text = if stream == "stdout" {
            &got.stdout
        } else {
            &got.stderr
        };
        assert_eq!(
            got.code(),
            Some(code),
            "palisade {args}:\n{}",
            got.describe()
        );
        assert!(
            text.contains(&needle),
            "palisade {args}: {stream} lacks {needle:?}:\n{}",
            got.describe()
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A reader that goes away (`palisade … | head`) ends a command quietly
/// with status 0: no panic, whatever it was printing. The read end of the
/// pipe is closed before the command starts, so every write it makes meets
/// a closed pipe (closed after the spawn, it raced with a command quick
/// enough to write all it had first).
#[test]
fn a_closed_stdout_ends_a_command_without_a_panic() {
    let dir = scratch_dir("closed-stdout");
    let config = write_config(&dir, "");
    let config = config.to_str().unwrap();
    // Commands whose output goes through `cli::stdout`, one of each kind.
    for args in [
        vec!["check", "-c", config],
        vec![
            "explain",
            "-c",
            config,
            "--client",
            "198.18.1.2",
            "evil.example:443",
        ],
        vec!["token", "new"],
        // clap's own output (`Cli::parse` panicked here).
        vec!["--help"],
    ] {
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        drop(reader);
        let child = Command::new(lab::palisade_bin())
            .args(&args)
            .stdout(std::process::Stdio::from(writer))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?} said: {stderr}");
    }
}

/// `--host` is one glob in every command that takes it: `evidence query`
/// reads `*` and `?` as the tail does, and finds a denial summary record
/// by the hosts it names (before, query took `?` literally and never
/// matched a summary, while the tail did both).
#[test]
fn query_host_is_the_tails_glob() {
    let dir = scratch_dir("query-host");
    let record = |id: &str, host: serde_json::Value, extra: serde_json::Value| {
        let mut v = serde_json::json!({
            "id": id, "ts": "2026-01-02T03:04:05.000000Z", "kind": "http",
            "event": "decision", "org": "acme", "client": "198.18.1.2:40000",
            "mode": "explicit", "host": host, "port": 80, "sni": null, "ip": null,
            "decision": "deny", "reason": "no_matching_rule", "rule": null, "policy": "p"
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v.to_string()
    };
    let lines = [
        record("r1", "api.test".into(), serde_json::json!({})),
        record("r2", "other.test".into(), serde_json::json!({})),
        record(
            "r3",
            serde_json::Value::Null,
            serde_json::json!({"client": null, "port": null, "count": 9,
                               "hosts": {"a.wild.test": 7, "other": 2}}),
        ),
    ];
    let file = dir.join("palisade-00000000000000000000.jsonl");
    fs::write(&file, lines.join("\n") + "\n").unwrap();
    let file = file.to_str().unwrap();
    for (glob, want) in [
        ("a?i.test", vec!["r1"]),
        ("*.wild.test", vec!["r3"]),
        ("*.test", vec!["r1", "r2", "r3"]),
        ("API.test.", vec!["r1"]),
        ("wild.test", vec![]),
    ] {
        let out = palisade(&["evidence", "query", file, "--host", glob]);
        assert!(out.success(), "--host {glob}: {}", out.describe());
        let ids: Vec<String> = out
            .stdout
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["id"].to_string())
            .map(|id| id.trim_matches('"').to_string())
            .collect();
        assert_eq!(ids, want, "--host {glob}: {}", out.describe());
    }
    let _ = fs::remove_dir_all(&dir);
}
