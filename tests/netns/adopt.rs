//! Adoption tools on real evidence: `palisade evidence summary` (what was
//! denied), the live decision tail, `palisade draft`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::lab::{self, run_with_timeout, sanitize, wait_until, CmdOutput, Lab, DEFAULT_POLICY};

fn palisade(args: &[&str]) -> CmdOutput {
    run_with_timeout(
        Command::new(lab::palisade_bin()).args(args),
        None,
        lab::CMD_TIMEOUT,
    )
}

#[test]
fn evidence_summary_lists_what_was_denied_with_counts_and_hints() {
    let lab = Lab::start(DEFAULT_POLICY);
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    for _ in 0..2 {
        assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    }
    assert_eq!(lab.proxied_curl("http://meta.test/", &[]).status, 403);
    assert_eq!(lab.proxied_curl("http://169.254.169.254/", &[]).status, 403);
    lab.wait_evidence("the metadata literal's denial", |v| {
        v["host"] == "169.254.169.254"
    });
    let dir = lab.evidence_dir.to_str().unwrap();

    let out = palisade(&["evidence", "summary", dir, "--format", "json"]);
    assert!(out.success(), "{}", out.describe());
    let s: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let acme = &s["orgs"]["acme"];
    assert_eq!(acme["denied"], 4, "{s}");
    let target = |name: &str| {
        acme["targets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["target"] == name)
            .unwrap_or_else(|| panic!("no {name} in {s}"))
            .clone()
    };
    let other = target("other.test");
    assert_eq!(other["count"], 2);
    assert_eq!(other["reasons"]["no_matching_rule"], 2);
    assert_eq!(other["clients"], 1);
    assert_eq!(
        other["hint"],
        "allow with: host = \"other.test\", ports = [80]"
    );
    let meta = target("meta.test");
    assert_eq!(meta["reasons"]["denied_address"], 1, "{s}");
    assert!(
        meta["hint"]
            .as_str()
            .unwrap()
            .starts_with("resolves to an always-denied address: no rule should allow it"),
        "{meta}"
    );
    let literal = target("169.254.169.254");
    assert!(
        literal["hint"]
            .as_str()
            .unwrap()
            .contains("no rule should allow it"),
        "{literal}"
    );
    assert!(acme["targets"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["target"] != "allowed.test"));

    let md = palisade(&[
        "evidence", "summary", dir, "--org", "acme", "--format", "markdown",
    ]);
    assert!(md.success(), "{}", md.describe());
    println!("{}", md.stdout);
    assert!(
        md.stdout.contains("### Org `acme`: 4 denied"),
        "{}",
        md.stdout
    );
    assert!(
        md.stdout
            .contains("| `other.test` | 80 | 2 | no_matching_rule=2 |"),
        "{}",
        md.stdout
    );

    let table = palisade(&["evidence", "summary", dir]);
    assert!(table.success(), "{}", table.describe());
    assert!(
        table.stdout.contains("org acme: 4 denied"),
        "{}",
        table.stdout
    );

    // A window after everything: nothing.
    let later = palisade(&[
        "evidence",
        "summary",
        dir,
        "--since",
        "2999-01-01T00:00:00Z",
    ]);
    assert!(later.success(), "{}", later.describe());
    assert!(later.stdout.contains("no decisions"), "{}", later.stdout);

    // Bad input: one line each, non-zero, nothing on stdout.
    for (args, code) in [
        (vec!["evidence", "summary", dir, "--org", "nosuch"], 1),
        (vec!["evidence", "summary", dir, "--since", "yesterday"], 2),
        (vec!["evidence", "summary", "/nonexistent/evidence"], 1),
        (vec!["evidence", "summary", dir, "--format", "xml"], 2),
    ] {
        let out = palisade(&args);
        assert_eq!(out.code(), Some(code), "{args:?}: {}", out.describe());
        assert!(out.stdout.is_empty(), "{args:?}: {}", out.describe());
        assert!(!out.stderr.trim().is_empty(), "{}", out.describe());
        if code == 1 {
            assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.describe());
        }
    }
}

/// A fresh tail token from `palisade token new`: (token, its `sha256:` digest).
fn tail_token() -> (String, String) {
    let out = palisade(&["token", "new"]);
    assert!(out.success(), "{}", out.describe());
    let token = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("token: "))
        .expect("a token line")
        .to_string();
    let digest = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("tokens = [\""))
        .and_then(|l| l.strip_suffix("\"]"))
        .expect("a digest line")
        .to_string();
    (token, digest)
}

/// A lab whose admin listener accepts the token in `dir/tail.token`.
fn tail_lab() -> (Lab, PathBuf, String) {
    let (token, digest) = tail_token();
    let lab = Lab::builder()
        .admin_config(&format!("tail_tokens = [\"{digest}\"]"))
        .start();
    let file = lab.dir.join("tail.token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    (lab, file, token)
}

/// `palisade tail ARGS` in the proxy namespace, output to `dir/NAME.out`
/// and `.err`; returns once it says it is tailing.
fn spawn_tail(lab: &Lab, name: &str, args: &[&str]) -> (Child, PathBuf, PathBuf) {
    let out = lab.dir.join(format!("{name}.out"));
    let err = lab.dir.join(format!("{name}.err"));
    let mut child = sanitize(
        Command::new("ip")
            .args(["netns", "exec", &lab.ns_proxy, lab::palisade_bin(), "tail"])
            .args(["--admin", lab::ADMIN_ADDR])
            .args(args),
    )
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&out).unwrap())
    .stderr(std::fs::File::create(&err).unwrap())
    .spawn()
    .unwrap();
    let started = Instant::now();
    while !read(&err).contains("tailing decisions") {
        assert!(
            started.elapsed() < Duration::from_secs(10) && child.try_wait().unwrap().is_none(),
            "tail {name} did not start: {}",
            read(&err)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, out, err)
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// `curl` in the proxy namespace against the admin listener: (status, body).
fn admin_get(lab: &Lab, path: &str, auth: Option<&str>) -> (u16, String) {
    let url = format!("http://{}{path}", lab::ADMIN_ADDR);
    let mut args = vec!["-q", "-s", "--max-time", "2", "-w", "\n%{http_code}"];
    let header;
    if let Some(a) = auth {
        header = format!("Authorization: {a}");
        args.extend(["-H", &header]);
    }
    args.push(&url);
    let out = lab.proxy_ns_exec("curl", &args);
    let (body, code) = out.stdout.rsplit_once('\n').unwrap_or(("", &out.stdout));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[test]
fn a_tail_shows_denials_live_and_needs_its_token() {
    let (mut lab, token_file, token) = tail_lab();
    let token_file = token_file.to_str().unwrap();

    // Without the token, or with another: 401 and not a record.
    for auth in [
        None,
        Some("Bearer not-the-token"),
        Some(&format!("Basic {token}") as &str),
    ] {
        let (code, body) = admin_get(&lab, "/v1/decisions", auth);
        assert_eq!(code, 401, "{auth:?}: {body}");
        assert!(!body.contains("\"event\""), "{body}");
    }
    // A filter that does not parse: 400 naming it.
    let bearer = format!("Bearer {token}");
    let (code, body) = admin_get(&lab, "/v1/decisions?decision=maybe", Some(&bearer));
    assert_eq!((code, body.contains("decision")), (400, true), "{body}");
    let (code, body) = admin_get(&lab, "/v1/decisions?colour=red", Some(&bearer));
    assert_eq!((code, body.contains("colour")), (400, true), "{body}");
    // A filter given twice is refused, not settled by its last value.
    let (code, body) = admin_get(&lab, "/v1/decisions?org=acme&o%72g=beta", Some(&bearer));
    assert_eq!(
        (code, body.contains("org given more")),
        (400, true),
        "{body}"
    );
    // The other endpoints stay open.
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(lab.admin_status(path), 200, "{path}");
    }
    // The CLI says the same in one line, with its exit status.
    let wrong = lab.dir.join("wrong.token");
    std::fs::write(&wrong, "nope").unwrap();
    for (args, code) in [
        (vec!["--token-file", wrong.to_str().unwrap()], 1),
        (vec![], 1),
        (vec!["--token-file", token_file, "--kind", "udp"], 2),
    ] {
        let out = lab.proxy_ns_exec(
            lab::palisade_bin(),
            &[&["tail", "--admin", lab::ADMIN_ADDR][..], &args[..]].concat(),
        );
        assert_eq!(out.code(), Some(code), "{args:?}: {}", out.describe());
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.describe());
        assert!(out.stdout.is_empty(), "{}", out.describe());
    }

    let (mut json_tail, json_out, _) = spawn_tail(
        &lab,
        "tail-json",
        &["--token-file", token_file, "--json", "--decision", "deny"],
    );
    let (mut text_tail, text_out, text_err) = spawn_tail(
        &lab,
        "tail-text",
        &["--token-file", token_file, "--org", "acme"],
    );

    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    let denied_at = Instant::now();
    let r = lab.proxied_curl("http://other.test/", &[]);
    assert_eq!(r.status, 403, "{r:?}");
    // Generous bound; the elapsed time is printed, not asserted.
    wait_until("the denial on the tail", Duration::from_secs(5), || {
        read(&json_out).contains("other.test")
    });
    println!(
        "the denial reached the tail after {:?}",
        denied_at.elapsed()
    );
    let lines: Vec<serde_json::Value> = read(&json_out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "only the denial: {lines:?}");
    assert_eq!(lines[0]["reason"], "no_matching_rule");
    assert_eq!(lines[0]["decision"], "deny");
    let reference = lines[0]["ref"].as_str().unwrap().to_string();
    assert!(
        r.body.contains(&reference),
        "the 403 names the record the tail shows: {r:?}"
    );

    wait_until(
        "both decisions on the text tail",
        Duration::from_secs(5),
        || read(&text_out).contains("other.test"),
    );
    let text = read(&text_out);
    println!("{text}");
    let mut rows = text.lines();
    let head = rows.next().unwrap();
    assert!(head.starts_with("TIME"), "{text}");
    let allowed = rows.next().unwrap();
    let denied = rows.next().unwrap();
    assert!(
        allowed.contains("allowed.test:80") && allowed.contains(" allow "),
        "{text}"
    );
    for cell in [
        "acme",
        lab::CLIENT_IP,
        "explicit",
        "other.test:80",
        " deny ",
        "no_matching_rule",
        &reference,
    ] {
        assert!(denied.contains(cell), "{cell:?} in {denied:?}");
    }
    assert_eq!(
        denied.find("other.test"),
        head.find("TARGET"),
        "aligned:\n{text}"
    );
    assert!(!text.contains("\x1b["), "no colour into a file");

    // SIGTERM: the tails end cleanly, and so does the proxy.
    lab.signal_proxy("-TERM");
    assert!(lab
        .wait_proxy_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    for (name, child) in [("json", &mut json_tail), ("text", &mut text_tail)] {
        let status = wait_exit(child, Duration::from_secs(10));
        assert!(
            status.is_some_and(|s| s.success()),
            "{name} tail: {status:?}"
        );
    }
    assert!(
        read(&text_err).contains("the tail ended"),
        "{}",
        read(&text_err)
    );
}

/// Times of `n` allowed and `n` denied requests through one curl each:
/// (statuses, median seconds of the allowed).
fn answers(lab: &Lab, n: usize) -> (Vec<String>, f64) {
    let mut args = vec!["-q", "-s", "--max-time", "30", "-x", lab::PROXY_URL];
    let fmt = "%{http_code} %{time_total}\n";
    for _ in 0..n {
        args.extend(["-o", "/dev/null", "-w", fmt, "http://allowed.test/"]);
        args.extend(["-o", "/dev/null", "-w", fmt, "http://other.test/"]);
    }
    let out = lab.client_exec("curl", &args);
    let mut codes = Vec::new();
    let mut times = Vec::new();
    for (i, line) in out.stdout.lines().enumerate() {
        let (code, t) = line.split_once(' ').unwrap();
        codes.push(code.to_string());
        if i % 2 == 0 {
            times.push(t.parse::<f64>().unwrap());
        }
    }
    times.sort_by(f64::total_cmp);
    (codes, times.get(times.len() / 2).copied().unwrap_or(0.0))
}

#[test]
fn a_tail_that_never_reads_does_not_change_the_proxys_answers() {
    let (lab, _, token) = tail_lab();
    let (before, before_median) = answers(&lab, 50);
    assert_eq!(before.len(), 100);
    // A reader that asks for every record and never reads one, with the
    // smallest receive buffer (bounded: it exits after 60 s).
    let script = format!(
        "import socket,time\n\
         s=socket.socket()\n\
         s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)\n\
         s.connect(('{}', {}))\n\
         s.sendall(b'GET /v1/decisions HTTP/1.1\\r\\nHost: a\\r\\nAuthorization: Bearer {token}\\r\\n\\r\\n')\n\
         print('sent', flush=True)\n\
         time.sleep(60)\n",
        lab::ADMIN_ADDR.split(':').next().unwrap(),
        lab::ADMIN_ADDR.split(':').nth(1).unwrap(),
    );
    let mut stalled = sanitize(Command::new("ip").args([
        "netns",
        "exec",
        &lab.ns_proxy,
        "python3",
        "-c",
        &script,
    ]))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    {
        use std::io::BufRead;
        let mut first = String::new();
        std::io::BufReader::new(stalled.stdout.as_mut().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert_eq!(first.trim(), "sent");
    }
    // Enough records to fill the stalled tail's buffers several times.
    let (during, during_median) = answers(&lab, 300);
    let (after, after_median) = answers(&lab, 50);
    println!(
        "median allowed request: {:.1} ms without a tail, {:.1} ms with a stalled tail (600 records), {:.1} ms after",
        before_median * 1e3,
        during_median * 1e3,
        after_median * 1e3
    );
    let expect = |n: usize| -> Vec<String> {
        (0..n)
            .flat_map(|_| ["200".to_string(), "403".to_string()])
            .collect()
    };
    assert_eq!(before, expect(50));
    assert_eq!(during, expect(300));
    assert_eq!(after, expect(50));
    assert_eq!(lab.admin_status("/healthz"), 200);
    let _ = stalled.kill();
    let _ = stalled.wait();
}

fn policy_hash(lab: &Lab) -> String {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_default();
    v["hash"].as_str().unwrap_or_default().to_string()
}

/// `palisade draft` for acme from the lab's live (unsealed) evidence.
fn draft_args<'a>(dir: &'a str, config: &'a str) -> Vec<&'a str> {
    vec![
        "draft",
        "--evidence",
        dir,
        "--org",
        "acme",
        "-c",
        config,
        "--allow-unsealed",
    ]
}

#[test]
fn draft_proposes_rules_from_evidence_that_then_let_the_same_traffic_through() {
    let lab = Lab::start(DEFAULT_POLICY);
    let denied = [
        "http://other.test/".to_string(),
        "http://n1.svc.test/".into(),
        "http://n2.svc.test/".into(),
        "http://n3.svc.test/".into(),
        "http://a.github.io/".into(),
        "http://b.github.io/".into(),
        "http://c.github.io/".into(),
        format!("http://{}/", lab::UNLISTED_IP),
        "http://169.254.169.254/".into(),
        "http://blocked.wild.test/".into(),
    ];
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    for url in &denied {
        assert_eq!(lab.proxied_curl(url, &[]).status, 403, "{url}");
    }
    lab.wait_evidence("the last denial", |v| v["host"] == "blocked.wild.test");
    let dir = lab.evidence_dir.to_str().unwrap();
    let config = lab.config_path.to_str().unwrap();

    // A live chain is not sealed: refused unless told.
    let out = palisade(&["draft", "--evidence", dir, "--org", "acme", "-c", config]);
    assert_eq!(out.code(), Some(1), "{}", out.describe());
    assert!(
        out.stderr.contains("fails verification"),
        "{}",
        out.describe()
    );
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.describe());
    assert!(out.stdout.is_empty());
    // An unknown org: one line, nothing printed.
    let out = palisade(&[
        "draft",
        "--evidence",
        dir,
        "--org",
        "nosuch",
        "-c",
        config,
        "--allow-unsealed",
    ]);
    assert_eq!(out.code(), Some(1), "{}", out.describe());
    assert!(
        out.stdout.is_empty() && out.stderr.contains("no org \"nosuch\""),
        "{}",
        out.describe()
    );

    let out = palisade(&draft_args(dir, config));
    assert!(out.success(), "{}", out.describe());
    let draft = out.stdout.clone();
    println!("{draft}\n{}", out.stderr);
    for want in [
        "[[org.allow]]\n",
        "host = \"*.svc.test\"",
        "# wildcard over 3 names seen: n1.svc.test, n2.svc.test, n3.svc.test",
        "host = \"a.github.io\"",
        "host = \"other.test\"",
        &format!("cidr = \"{}/32\"", lab::UNLISTED_IP),
        "# WARNING: an IP literal",
        "169.254.169.254 (ports 80) seen 1 times: always denied",
        "blocked.wild.test (ports 80) seen 1 times: denied explicitly",
        "tunnel = \"http\"",
    ] {
        assert!(draft.contains(want), "{want:?} in:\n{draft}");
    }
    for never in [
        "*.github.io",
        "allowed.test\"",
        "[[org]]",
        "*.test\"",
        "*.wild.test",
    ] {
        assert!(!draft.contains(never), "{never:?} in:\n{draft}");
    }
    assert!(out.stderr.contains("self-check: the config with the draft passes check; replay: 8 of 8 drafted flows now allowed, 1 of 1 explicitly denied flows still denied"), "{}", out.stderr);

    // --write: the whole config, which `check` accepts; then served.
    let written = lab.dir.join("drafted.toml");
    let out = palisade(
        &[
            &draft_args(dir, config)[..],
            &["--write", written.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(out.success(), "{}", out.describe());
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    let check = palisade(&["check", "-c", written.to_str().unwrap()]);
    assert!(check.success(), "{}", check.describe());
    let before = policy_hash(&lab);
    std::fs::copy(&written, &lab.config_path).unwrap();
    lab.signal_proxy("-HUP");
    wait_until("the drafted policy served", Duration::from_secs(5), || {
        policy_hash(&lab) != before
    });
    // The same traffic passes (by name: those that resolve answer 200).
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 200);
    assert_eq!(
        lab.proxied_curl(&format!("http://{}/", lab::UNLISTED_IP), &[])
            .status,
        200
    );
    for url in ["http://n1.svc.test/", "http://a.github.io/"] {
        let r = lab.proxied_curl(url, &[]);
        assert!(!r.body.contains("no_matching_rule"), "{url}: {r:?}");
    }
    // What stays denied stays denied; an unlisted name is denied.
    for (url, reason) in [
        ("http://169.254.169.254/", "denied_address"),
        ("http://blocked.wild.test/", "explicit_deny"),
        ("http://d.github.io/", "no_matching_rule"),
        ("http://unlisted.test/", "no_matching_rule"),
    ] {
        let r = lab.proxied_curl(url, &[]);
        assert_eq!(r.status, 403, "{url}: {r:?}");
        assert!(r.body.contains(reason), "{url}: {r:?}");
    }
}

/// How `palisade ARGS` ends with stdout into a pipe whose reader is gone:
/// `closed` (the read end closed before it starts, so its first write meets
/// a closed pipe) or through `bash -o pipefail` into `| head -c 1`. In the
/// proxy namespace; `traffic` runs between looks until it ends (bounded).
/// Returns (exit code, stderr).
fn into_gone_reader(
    lab: &Lab,
    closed: bool,
    args: &[&str],
    traffic: &dyn Fn(),
) -> (Option<i32>, String) {
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let n = lab.dir.join(format!("gone-reader-{run}.err"));
    let mut cmd = Command::new("ip");
    sanitize(&mut cmd)
        .args(["netns", "exec", &lab.ns_proxy])
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(&n).unwrap());
    let mut child = if closed {
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        drop(reader);
        cmd.arg(lab::palisade_bin())
            .args(args)
            .stdout(Stdio::from(writer))
            .spawn()
            .unwrap()
    } else {
        cmd.args([
            "bash",
            "-c",
            "set -o pipefail; \"$@\" | head -c 1 >/dev/null",
            "bash",
            lab::palisade_bin(),
        ])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
    };
    for _ in 0..100 {
        if let Some(status) = child.try_wait().unwrap() {
            return (status.code(), read(&n));
        }
        traffic();
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "palisade {args:?} did not end with its reader gone: {}",
        read(&n)
    );
}

#[test]
fn a_reader_that_goes_away_ends_a_command_quietly_and_keeps_its_verdict() {
    let (lab, token_file, _) = tail_lab();
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    lab.wait_evidence("the denial", |v| v["host"] == "other.test");
    let dir = lab.evidence_dir.to_str().unwrap();
    let config = lab.config_path.to_str().unwrap();
    let token_file = token_file.to_str().unwrap();
    let nothing = || {};
    let deny = || {
        let _ = lab.proxied_curl("http://other.test/", &[]);
    };
    // (name, arguments, whether it needs traffic to write anything)
    let commands: [(&str, Vec<&str>, bool); 4] = [
        (
            "explain",
            vec![
                "explain",
                "-c",
                config,
                "--client",
                lab::CLIENT_IP,
                "http://other.test/",
            ],
            false,
        ),
        ("summary", vec!["evidence", "summary", dir], false),
        ("draft", draft_args(dir, config), false),
        (
            "tail --json",
            vec![
                "tail",
                "--admin",
                lab::ADMIN_ADDR,
                "--token-file",
                token_file,
                "--json",
            ],
            true,
        ),
    ];
    for (name, args, needs_traffic) in &commands {
        let traffic: &dyn Fn() = if *needs_traffic { &deny } else { &nothing };
        for closed in [true, false] {
            let (code, stderr) = into_gone_reader(&lab, closed, args, traffic);
            assert!(!stderr.contains("panicked"), "{name}: {stderr}");
            assert_eq!(code, Some(0), "{name} (closed {closed}): {stderr}");
            assert!(!stderr.contains("stdout"), "{name}: {stderr}");
        }
    }
    // A verdict stands: the live chain is not sealed, so verify fails, and
    // a reader that went away does not make it a success.
    let (code, stderr) = into_gone_reader(&lab, true, &["evidence", "verify", dir], &nothing);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        !stderr.contains("panicked") && stderr.contains("seal"),
        "{stderr}"
    );
}

/// The sandbox chooses every flow a draft is made from. A report-mode acme
/// reaches for what it must never be given (another org's sandbox, the
/// gateway's own address), uses three names right under `amazonaws.com`
/// (a parent with public suffixes below it: `s3.amazonaws.com` holds other
/// tenants' buckets) and sends plain bytes on 443. The draft, made on the
/// gateway and again away from it, proposes none of that; applied and
/// enforced, the same reach is denied live, and what the draft did propose
/// still works.
#[test]
fn a_report_mode_sandbox_cannot_steer_its_draft() {
    use std::net::TcpListener;

    use crate::addresses::arrived;
    use crate::lab::in_netns;

    const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
mode = "report"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
"#;
    const PORT: u16 = 8080;
    let beta = lab::CLIENT2_IP;
    // The gateway's upstream-side address (the lab's `u0`).
    let gateway = "198.18.2.1";
    let names = ["a.amazonaws.com", "b.amazonaws.com", "c.amazonaws.com"];
    // Another tenant's bucket: a name under s3.amazonaws.com, a public
    // suffix below the parent the sandbox used.
    let bucket = "victim.s3.amazonaws.com";
    // Served by the lab's web host (its certificate names *.wild.test).
    let shell = "shell.wild.test";
    // An HTTP tunnel whose second request names another host.
    let web = "web.wild.test";
    let lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .dns_records(&[
            (names[0], lab::ALLOWED_IP),
            (names[1], lab::ALLOWED_IP),
            (names[2], lab::ALLOWED_IP),
            (bucket, lab::OTHER_IP),
            (shell, lab::ALLOWED_IP),
            (web, lab::ALLOWED_IP),
        ])
        .start();
    let listen = |ns: &str, addr: &str| {
        let sa = format!("{addr}:{PORT}");
        let l = in_netns(ns, move || TcpListener::bind(sa))
            .unwrap_or_else(|e| panic!("bind {addr}:{PORT}: {e}"));
        l.set_nonblocking(true).unwrap();
        l
    };
    let beta_listener = listen(&lab.ns_client2, beta);
    let gateway_listener = listen(&lab.ns_proxy, gateway);

    // Report mode: the addresses stay denied (safety denials are
    // enforced in every mode), the rest is let through.
    for addr in [beta, gateway] {
        let r = lab.proxied_curl(&format!("http://{addr}:{PORT}/"), &[]);
        assert_eq!(r.status, 403, "{addr}: {r:?}");
        assert!(r.body.contains("denied_address"), "{addr}: {r:?}");
    }
    for name in names {
        assert_eq!(
            lab.proxied_curl(&format!("http://{name}/"), &[]).status,
            200,
            "{name}"
        );
    }
    let mut c = lab.client_conn();
    assert_eq!(c.connect(&format!("{shell}:443")), 200);
    c.send(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
    let rec = lab.wait_evidence("the plain bytes on 443", |v| {
        v["host"] == shell && v["event"] == "decision"
    });
    assert_eq!(
        (&rec["reason"], &rec["tunnel"]),
        (&"report_only".into(), &"opaque".into()),
        "{rec}"
    );
    c.close();
    let get = |host: &str| format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
    let mut c = lab.client_conn();
    assert_eq!(c.connect(&format!("{web}:80")), 200);
    c.send(get(web).as_bytes()).unwrap();
    assert_eq!(c.read_response(Duration::from_secs(5)).status, 200);
    c.send(get("other.test").as_bytes()).unwrap();
    let rec = lab.wait_evidence("the second request's violation", |v| {
        v["host"] == "other.test" && v["would_deny"] == "host_mismatch"
    });
    assert!(rec["conn"].is_string(), "{rec}");
    c.close();
    lab.wait_evidence("the last name", |v| v["host"] == names[2]);

    let dir = lab.evidence_dir.to_str().unwrap();
    let config = lab.config_path.to_str().unwrap();
    let written = lab.dir.join("drafted.toml");
    let args = draft_args(dir, config);
    // On the gateway (where `check` runs too: its addresses are known),
    // and away from it (only the record says the address was denied).
    let on_gateway = lab.proxy_ns_exec(lab::palisade_bin(), &args);
    let away = palisade(&args);
    for (where_, out) in [("on the gateway", &on_gateway), ("away", &away)] {
        assert!(out.success(), "{where_}: {}", out.describe());
        let d = &out.stdout;
        println!("--- draft {where_} ---\n{d}\n{}", out.stderr);
        for never in [
            format!("cidr = \"{beta}/32\""),
            format!("cidr = \"{gateway}/32\""),
            "*.amazonaws.com\"".into(),
            "host = \"other.test\"".into(),
            "tunnel = \"opaque\"".into(),
        ] {
            assert!(!d.contains(&never), "{where_}: {never:?} in:\n{d}");
        }
        let gateway_why = if where_ == "away" {
            "recorded denied_address".to_string()
        } else {
            format!("always denied (gateway address: {gateway}/32); not proposed")
        };
        for want in [
            format!(
                "# {beta} (ports {PORT}) seen 1 times: always denied (clients of beta: 198.18.4.0/24); not proposed"
            ),
            format!("# {gateway} (ports {PORT}) seen 1 times: {gateway_why}"),
            "# *.amazonaws.com over 3 names seen: the Public Suffix List has public suffixes below amazonaws.com".into(),
            "host = \"a.amazonaws.com\"".into(),
            format!("host = \"{shell}\"\nports = [443]\ntunnel = \"tls\""),
            "# VIOLATION: 1 tunnel(s) failed verification (".into(),
            "proposed verified as tunnel = \"http\", not \"opaque\"; review\n".into(),
            format!("host = \"{web}\"\nports = [80]\ntunnel = \"http\""),
            // What report mode let through closed with bytes: a budget
            // is suggested from the busiest hour.
            "# the busiest hour seen moved ".into(),
            "to bound it, add to this rule: max_bytes_up = ".into(),
        ] {
            assert!(d.contains(&want), "{where_}: {want:?} in:\n{d}");
        }
    }

    // Applied and enforced.
    let out = lab.proxy_ns_exec(
        lab::palisade_bin(),
        &[&args[..], &["--write", written.to_str().unwrap()]].concat(),
    );
    assert!(out.success(), "{}", out.describe());
    let text = std::fs::read_to_string(&written)
        .unwrap()
        .replace("mode = \"report\"", "mode = \"enforce\"");
    let before = policy_hash(&lab);
    std::fs::write(&lab.config_path, text).unwrap();
    lab.signal_proxy("-HUP");
    wait_until("the drafted policy served", Duration::from_secs(5), || {
        policy_hash(&lab) != before
    });

    // What the draft proposed works.
    for name in names {
        assert_eq!(
            lab.proxied_curl(&format!("http://{name}/"), &[]).status,
            200,
            "{name}"
        );
    }
    let r = lab.proxied_curl(&format!("https://{shell}/"), &[]);
    assert_eq!(r.status, 200, "TLS to {shell}: {r:?}");
    // Another org's sandbox and the gateway stay denied, and nothing
    // arrived at either.
    for addr in [beta, gateway] {
        let r = lab.proxied_curl(&format!("http://{addr}:{PORT}/"), &[]);
        crate::assert_refused(&lab, &r, 403, "denied_address", addr);
        let r = lab.client_curl(&[
            "-p",
            "-x",
            lab::PROXY_URL,
            &format!("http://{addr}:{PORT}/"),
        ]);
        assert_eq!(r.connect_status, 403, "CONNECT {addr}: {r:?}");
    }
    assert!(!arrived(&beta_listener), "acme reached beta's sandbox");
    assert!(!arrived(&gateway_listener), "acme reached the gateway");
    // A name under another public suffix below amazonaws.com: denied.
    let r = lab.proxied_curl(&format!("http://{bucket}/"), &[]);
    crate::assert_refused(&lab, &r, 403, "no_matching_rule", bucket);
    // On 443, SSH bytes and an ECH ClientHello: cut, recorded.
    let hello = palisade::probe::hello::build(
        &palisade::probe::hello::Hello {
            sni: Some(shell),
            ech: true,
        },
        &palisade::probe::hello::Random::from_fn(|b| b.fill(0x5a)),
    );
    // The HTTP tunnel's second request for another host: cut.
    let mut c = lab.client_conn();
    let client = format!("{}:{}", lab::CLIENT_IP, c.local_port());
    assert_eq!(c.connect(&format!("{web}:80")), 200);
    c.send(get(web).as_bytes()).unwrap();
    assert_eq!(c.read_response(Duration::from_secs(5)).status, 200);
    c.send(get("other.test").as_bytes()).unwrap();
    let rec = lab.wait_evidence("the second request denied", |v| {
        v["client"] == client.as_str() && v["decision"] == "deny"
    });
    assert_eq!(rec["reason"], "host_mismatch", "{rec}");
    for (what, bytes, reason) in [
        (
            "SSH bytes",
            b"SSH-2.0-OpenSSH_9.6\r\n".to_vec(),
            "protocol_mismatch",
        ),
        ("an ECH ClientHello", hello, "ech_not_allowed"),
    ] {
        let mut c = lab.client_conn();
        let client = format!("{}:{}", lab::CLIENT_IP, c.local_port());
        assert_eq!(c.connect(&format!("{shell}:443")), 200, "{what}");
        c.send(&bytes).unwrap();
        let rec = lab.wait_evidence(&format!("{what} denied"), |v| {
            v["client"] == client.as_str() && v["decision"] == "deny"
        });
        assert_eq!(rec["reason"], reason, "{what}: {rec}");
        assert!(
            matches!(
                c.wait_closed(Duration::from_secs(3)),
                crate::lab::Closed::After(_)
            ),
            "{what}: the tunnel stayed open"
        );
    }
}
