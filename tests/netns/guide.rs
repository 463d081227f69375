//! The guide "Your first allowlist" (docs/first-allowlist.md), run as
//! written: its marked blocks are the policy and the commands of this test,
//! against real traffic from the sandbox through the proxy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::lab::{self, run_with_timeout, sanitize, wait_until, Background, CmdOutput, Lab};

const GUIDE: &str = "docs/first-allowlist.md";
const MARKER: &str = "<!-- guide-test: ";

/// The guide's steps, in the order the page has them.
const STEPS: &[&str] = &[
    "report-config",
    "check-report",
    "tail",
    "summary",
    "summary-markdown",
    "draft",
    "merge",
    "enforce",
    "replay",
    "install",
    "served",
    "explain",
];

/// One marked block of the guide.
struct Block {
    step: String,
    lang: String,
    text: String,
}

/// The marked `sh` and `toml` blocks of a page, in order. Every such block
/// must follow its marker line, and every marker must be followed by one;
/// otherwise the line that is wrong.
fn blocks(page: &str) -> Result<Vec<Block>, String> {
    let mut out = Vec::new();
    let mut marker: Option<(usize, String)> = None;
    let mut open: Option<Block> = None;
    for (i, line) in page.lines().enumerate() {
        let n = i + 1;
        if let Some(block) = open.as_mut() {
            if line.trim_start().starts_with("```") {
                out.push(open.take().unwrap());
            } else {
                block.text.push_str(line);
                block.text.push('\n');
            }
            continue;
        }
        if let Some(rest) = line.trim().strip_prefix(MARKER) {
            let Some(step) = rest.strip_suffix("-->") else {
                return Err(format!("{GUIDE}:{n}: a marker that is not closed"));
            };
            if marker.is_some() {
                return Err(format!("{GUIDE}:{n}: two markers in a row"));
            }
            let step = step.trim();
            marker = Some((n, step.to_string()));
            continue;
        }
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            let lang = lang.split_whitespace().next().unwrap_or_default();
            let executed = matches!(lang, "sh" | "bash" | "toml");
            match (marker.take(), executed) {
                (Some((_, step)), true) => {
                    open = Some(Block {
                        step,
                        lang: lang.to_string(),
                        text: String::new(),
                    })
                }
                (None, true) => {
                    return Err(format!("{GUIDE}:{n}: a ```{lang} block without its marker"))
                }
                (Some((m, _)), false) => {
                    return Err(format!(
                        "{GUIDE}:{m}: a marker before a ```{lang} block, which is not run"
                    ))
                }
                (None, false) => {
                    // An unmarked example (```text): skip to its end.
                    open = Some(Block {
                        step: String::new(),
                        lang: lang.to_string(),
                        text: String::new(),
                    });
                }
            }
            continue;
        }
        if let Some((m, _)) = &marker {
            if !line.trim().is_empty() {
                return Err(format!("{GUIDE}:{m}: a marker not followed by its block"));
            }
        }
    }
    if open.is_some() {
        return Err(format!("{GUIDE}: a block that does not end"));
    }
    if let Some((m, _)) = marker {
        return Err(format!("{GUIDE}:{m}: a marker at the end"));
    }
    out.retain(|b| !b.step.is_empty());
    Ok(out)
}

#[test]
fn the_guides_blocks_are_found_and_unmarked_ones_refused() {
    let page = "text\n<!-- guide-test: a -->\n```toml\nx = 1\n```\n\n```text\nout\n```\n\
                <!-- guide-test: b -->\n\n```sh\necho \"$X\"\nls\n```\n";
    let b = blocks(page).unwrap();
    let got: Vec<(&str, &str, &str)> = b
        .iter()
        .map(|b| (b.step.as_str(), b.lang.as_str(), b.text.as_str()))
        .collect();
    assert_eq!(
        got,
        [("a", "toml", "x = 1\n"), ("b", "sh", "echo \"$X\"\nls\n")]
    );
    for bad in [
        "```sh\nls\n```\n",
        "<!-- guide-test: a -->\n```text\nls\n```\n",
        "<!-- guide-test: a -->\nprose\n```sh\nls\n```\n",
    ] {
        assert!(blocks(bad).is_err(), "accepted: {bad:?}");
    }
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(GUIDE)).unwrap();
    let steps: Vec<String> = blocks(&page).unwrap().into_iter().map(|b| b.step).collect();
    assert_eq!(steps, STEPS, "the guide's steps");
}

/// The agent's traffic: (URL, extra curl arguments). Three names under one
/// domain (a wildcard), three under a public suffix (never one), an IP
/// literal, the metadata address.
const TRAFFIC: &[(&str, &[&str])] = &[
    ("http://api.build.test/", &[]),
    ("http://ci.build.test/v1/jobs", &[]),
    // Through a CONNECT tunnel, TLS inside (the lab's certificate does not
    // name it: this is about the tunnel, not the certificate).
    ("https://cache.build.test/", &["-k"]),
    ("http://alpha.github.io/", &[]),
    ("http://beta.github.io/", &[]),
    ("http://gamma.github.io/", &[]),
    ("http://198.18.2.20/", &[]),
];
const METADATA_URL: &str = "http://169.254.169.254/latest/meta-data/";

/// Every name the guide's traffic uses resolves in the lab (an unresolvable
/// one would be recorded `resolution_failed`, never drafted).
const NAMES: &[(&str, &str)] = &[
    ("api.build.test", lab::WILD_APEX_IP),
    ("ci.build.test", lab::WILD_APEX_IP),
    ("cache.build.test", lab::WILD_APEX_IP),
    ("alpha.github.io", lab::OTHER_IP),
    ("beta.github.io", lab::OTHER_IP),
    ("gamma.github.io", lab::OTHER_IP),
    // Not on the list after the switch (denied by policy, not by DNS).
    ("delta.github.io", lab::OTHER_IP),
];

/// The guide's shell: `bash -e` in the gateway namespace, the lab's paths
/// in the guide's variables, `palisade` on the PATH.
struct Shell {
    ns: String,
    dir: PathBuf,
    env: HashMap<&'static str, String>,
}

impl Shell {
    fn command(&self, script: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, "bash", "-euo", "pipefail", "-c"])
            .arg(script)
            .current_dir(&self.dir)
            .envs(&self.env);
        cmd
    }

    /// Run a block to its end; it must succeed.
    fn run(&self, block: &Block) -> CmdOutput {
        assert_eq!(block.lang, "sh", "{}", block.step);
        let out = run_with_timeout(&mut self.command(&block.text), None, lab::CMD_TIMEOUT);
        println!(
            "--- guide step {} ---\n$ {}{}{}",
            block.step,
            block.text.trim_end().replace('\n', "\n$ "),
            if out.stdout.is_empty() { "" } else { "\n" },
            out.stdout.trim_end()
        );
        assert!(
            out.success(),
            "guide step {}:\n{}\n{}",
            block.step,
            block.text,
            out.describe()
        );
        out
    }
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn policy(lab: &Lab) -> serde_json::Value {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    serde_json::from_str(&out.stdout).unwrap_or_default()
}

/// A fresh tail token from `palisade token new`: (token, its digest).
fn tail_token() -> (String, String) {
    let out = run_with_timeout(
        Command::new(lab::palisade_bin()).args(["token", "new"]),
        None,
        lab::CMD_TIMEOUT,
    );
    assert!(out.success(), "{}", out.describe());
    let line = |prefix: &str| {
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no {prefix:?} in {}", out.stdout))
    };
    let digest = line("tokens = [\"");
    (line("token: "), digest.trim_end_matches("\"]").to_string())
}

fn agent_traffic(lab: &Lab, phase: &str) {
    for (url, extra) in TRAFFIC {
        let r = lab.proxied_curl(url, extra);
        assert_eq!(r.status, 200, "{phase}: {url}: {r:?}");
    }
    let r = lab.proxied_curl(METADATA_URL, &[]);
    assert_eq!(r.status, 403, "{phase}: the metadata address: {r:?}");
    assert!(r.body.contains("denied_address"), "{phase}: {r:?}");
}

#[test]
fn the_first_allowlist_guide_runs_as_written() {
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(GUIDE)).unwrap();
    let steps = blocks(&page).unwrap_or_else(|e| panic!("{e}"));
    let step = |name: &str| {
        steps
            .iter()
            .find(|b| b.step == name)
            .unwrap_or_else(|| panic!("no step {name} in {GUIDE}"))
    };
    assert_eq!(
        steps.iter().map(|b| b.step.as_str()).collect::<Vec<_>>(),
        STEPS
    );

    // Step 1: the guide's org block is the lab's policy.
    let org = step("report-config");
    assert_eq!(org.lang, "toml");
    assert!(org.text.contains("mode = \"report\""), "{}", org.text);
    let (token, digest) = tail_token();
    let mut lab = Lab::builder()
        .policy(&org.text)
        .admin_config(&format!("tail_tokens = [\"{digest}\"]"))
        .dns_records(NAMES)
        .start();
    let token_file = lab.dir.join("tail.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let bin_dir = Path::new(lab::palisade_bin()).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let config = lab.config_path.display().to_string();
    let sh = Shell {
        ns: lab.ns_proxy.clone(),
        dir: lab.dir.clone(),
        env: HashMap::from([
            ("PATH", path),
            ("CONFIG", config.clone()),
            ("EVIDENCE", lab.evidence_dir.display().to_string()),
            ("ADMIN", lab::ADMIN_ADDR.to_string()),
            ("TOKEN_FILE", token_file.display().to_string()),
            ("PALISADE_PID", lab.proxy_pid().to_string()),
        ]),
    };
    let check = sh.run(step("check-report"));
    assert!(check.stdout.contains("agents"), "{}", check.stdout);

    // Step 2: the tail, in the background until the end.
    let tail_out = lab.dir.join("guide-tail.out");
    let tail_err = lab.dir.join("guide-tail.err");
    let mut tail = Background(
        sanitize(&mut sh.command(&step("tail").text))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&tail_out).unwrap())
            .stderr(std::fs::File::create(&tail_err).unwrap())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    while !read(&tail_err).contains("tailing decisions") {
        assert!(
            started.elapsed() < Duration::from_secs(10) && tail.0.try_wait().unwrap().is_none(),
            "the guide's tail did not start: {}",
            read(&tail_err)
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Step 3: the agent, in report mode: all through but the metadata address.
    agent_traffic(&lab, "report mode");
    lab.wait_evidence("the metadata address's denial", |v| {
        v["host"] == "169.254.169.254"
    });
    wait_until("the report run on the tail", Duration::from_secs(5), || {
        read(&tail_out).contains("169.254.169.254")
    });
    let text = read(&tail_out);
    println!("--- the tail, report mode ---\n{text}");
    for target in [
        "api.build.test:80",
        "ci.build.test:80",
        "cache.build.test:443",
        "alpha.github.io:80",
        "beta.github.io:80",
        "gamma.github.io:80",
        "198.18.2.20:80",
    ] {
        let line = text
            .lines()
            .find(|l| l.contains(target))
            .unwrap_or_else(|| panic!("no {target} on the tail:\n{text}"));
        assert!(
            line.contains(" would_deny ") && line.contains("no_matching_rule"),
            "{line}"
        );
    }
    let meta = text
        .lines()
        .find(|l| l.contains("169.254.169.254:80"))
        .unwrap();
    assert!(
        meta.contains(" deny ") && meta.contains("denied_address"),
        "{meta}"
    );

    // Step 4: the summary, as a table and as Markdown.
    let summary = sh.run(step("summary")).stdout;
    assert!(summary.contains("org agents"), "{summary}");
    for target in [
        "api.build.test",
        "alpha.github.io",
        "198.18.2.20",
        "169.254.169.254",
    ] {
        assert!(summary.contains(target), "{target} in:\n{summary}");
    }
    let markdown = sh.run(step("summary-markdown")).stdout;
    assert!(markdown.contains("### Org `agents`"), "{markdown}");
    for row in [
        "| `api.build.test` | 80 | 1 |",
        "| `cache.build.test` | 443 | 1 |",
        "| `169.254.169.254` | 80 | 1 | denied_address=1 |",
    ] {
        assert!(markdown.contains(row), "{row:?} in:\n{markdown}");
    }

    // Step 5: the draft.
    let draft_step = step("draft");
    let draft = run_with_timeout(&mut sh.command(&draft_step.text), None, lab::CMD_TIMEOUT);
    assert!(draft.success(), "{}", draft.describe());
    println!("--- the draft ---\n{}\n{}", draft.stdout, draft.stderr);
    let d = &draft.stdout;
    for want in [
        "[[org.allow]]\n",
        "host = \"*.build.test\"",
        "# wildcard over 3 names seen: api.build.test, cache.build.test, ci.build.test",
        "host = \"alpha.github.io\"",
        "host = \"beta.github.io\"",
        "host = \"gamma.github.io\"",
        "cidr = \"198.18.2.20/32\"",
        "# WARNING: an IP literal",
        "169.254.169.254 (ports 80) seen 1 times: always denied",
    ] {
        assert!(d.contains(want), "{want:?} in:\n{d}");
    }
    for never in [
        "*.github.io",
        "[[org]]",
        "cidr = \"169.254",
        "host = \"169.254",
    ] {
        assert!(!d.contains(never), "{never:?} in:\n{d}");
    }
    assert!(
        draft.stderr.contains(
            "self-check: the config with the draft passes check; replay: 7 of 7 drafted flows now allowed"
        ),
        "{}",
        draft.stderr
    );

    // Steps 7 and 8: merge, switch to enforce, check, replay.
    sh.run(step("merge"));
    let drafted = PathBuf::from(format!("{config}.draft"));
    assert!(read(&drafted).contains("host = \"*.build.test\""));
    sh.run(step("enforce"));
    let drafted_text = read(&drafted);
    assert!(
        drafted_text.contains("mode = \"enforce\"") && !drafted_text.contains("mode = \"report\""),
        "{drafted_text}"
    );
    let replay = sh.run(step("replay")).stdout;
    assert!(replay.contains(" 0 would flip"), "{replay}");
    assert!(!replay.contains("allow->deny"), "{replay}");

    // Step 9: install and reload; the served policy says enforce.
    let before = policy(&lab)["hash"].clone();
    sh.run(step("install"));
    wait_until("the drafted policy served", Duration::from_secs(10), || {
        policy(&lab)["hash"] != before
    });
    let served = sh.run(step("served")).stdout;
    assert!(served.contains("\"mode\": \"enforce\""), "{served}");

    // The same traffic passes; a name not on the list is denied.
    let tail_mark = read(&tail_out).len();
    agent_traffic(&lab, "enforced");
    for url in ["http://delta.github.io/", "http://other.test/"] {
        let r = lab.proxied_curl(url, &[]);
        assert_eq!(r.status, 403, "{url}: {r:?}");
        assert!(r.body.contains("no_matching_rule"), "{url}: {r:?}");
    }
    wait_until(
        "the enforced denials on the tail",
        Duration::from_secs(5),
        || read(&tail_out)[tail_mark..].contains("other.test:80"),
    );
    let enforced = read(&tail_out)[tail_mark..].to_string();
    println!("--- the tail, enforced ---\n{enforced}");
    assert!(!enforced.contains("would_deny"), "{enforced}");
    for target in ["api.build.test:80", "alpha.github.io:80", "198.18.2.20:80"] {
        let line = enforced.lines().find(|l| l.contains(target)).unwrap();
        assert!(
            line.contains(" allow ") && line.contains("rule_match"),
            "{line}"
        );
    }
    for target in ["delta.github.io:80", "other.test:80"] {
        let line = enforced.lines().find(|l| l.contains(target)).unwrap();
        assert!(
            line.contains(" deny ") && line.contains("no_matching_rule"),
            "{line}"
        );
    }
    let explain = sh.run(step("explain")).stdout;
    assert!(
        explain.contains("decision: deny") && explain.contains("no_matching_rule"),
        "{explain}"
    );

    // The instance ends; so does the guide's tail, cleanly.
    lab.signal_proxy("-TERM");
    assert!(lab
        .wait_proxy_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = tail.0.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.is_some_and(|s| s.success()),
        "the guide's tail: {status:?} {}",
        read(&tail_err)
    );
}

/// What the guide says of a name that does not resolve in report mode: it
/// is recorded `resolution_failed` with no `would_deny`, and the draft
/// proposes nothing for it (so the lab above resolves every name).
#[test]
fn in_report_mode_a_name_that_does_not_resolve_is_recorded_but_never_drafted() {
    let page = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(GUIDE)).unwrap();
    let steps = blocks(&page).unwrap_or_else(|e| panic!("{e}"));
    let org = steps.iter().find(|b| b.step == "report-config").unwrap();
    let lab = Lab::start(&org.text);
    let r = lab.proxied_curl("http://nowhere.build.test/", &[]);
    assert_eq!(r.status, 502, "{r:?}");
    let rec = lab.wait_evidence("the unresolvable name", |v| {
        v["host"] == "nowhere.build.test" && v["event"] == "decision"
    });
    assert_eq!(
        (&rec["decision"], &rec["reason"], &rec["would_deny"]),
        (
            &serde_json::json!("deny"),
            &serde_json::json!("resolution_failed"),
            &serde_json::Value::Null
        ),
        "{rec}"
    );
    let out = run_with_timeout(
        Command::new(lab::palisade_bin()).args([
            "draft",
            "--evidence",
            lab.evidence_dir.to_str().unwrap(),
            "--org",
            "agents",
            "-c",
            lab.config_path.to_str().unwrap(),
            "--allow-unsealed",
        ]),
        None,
        lab::CMD_TIMEOUT,
    );
    assert!(out.success(), "{}", out.describe());
    assert!(
        out.stdout.trim().is_empty()
            && out.stderr.contains("from 0 decisions")
            && out.stderr.contains(": 0 rules"),
        "{}",
        out.describe()
    );
}
