//! Fixture logs and evidence: reading, waiting for a positive marker, asserting quiet.

use super::*;

impl Lab {
    /// Every query the upstream DNS fixture received, as logged.
    pub fn dns_log(&self) -> Vec<Value> {
        read_jsonl(&self.dns_log_path())
    }

    pub fn upstream_log_path(&self) -> PathBuf {
        self.dir.join("upstream.jsonl")
    }
    pub fn canary_log_path(&self) -> PathBuf {
        self.dir.join("canary.jsonl")
    }
    pub fn dns_log_path(&self) -> PathBuf {
        self.dir.join("dns.jsonl")
    }

    /// Connection events logged by the upstream web servers.
    pub fn upstream_log(&self) -> Vec<Value> {
        without_markers(read_jsonl(&self.upstream_log_path()))
    }
    /// Connection events logged by the loopback canary in the proxy ns.
    pub fn canary_log(&self) -> Vec<Value> {
        without_markers(read_jsonl(&self.canary_log_path()))
    }
    /// Names queried at the upstream DNS server (lower case, no trailing dot).
    pub fn dns_queries(&self) -> Vec<String> {
        read_jsonl(&self.dns_log_path())
            .iter()
            .filter_map(|v| v["name"].as_str().map(str::to_owned))
            .collect()
    }

    /// All evidence records from every *.jsonl file in the evidence dir.
    pub fn evidence(&self) -> Vec<Value> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.evidence_dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files.iter().flat_map(|f| read_jsonl(f)).collect()
    }

    /// Poll (bounded) until an evidence record satisfies `pred`.
    pub fn wait_evidence(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let ev = self.evidence();
            if let Some(v) = ev.iter().find(|v| pred(v)) {
                return v.clone();
            }
            if Instant::now() >= deadline {
                panic!(
                    "no evidence record matching {what} within 5s; records:\n{}\n{}",
                    dump(&ev),
                    self.proxy_output()
                );
            }
            thread::sleep(POLL);
        }
    }

    /// Poll (bounded) until an upstream log record satisfies `pred`.  Use
    /// this, not [`Lab::upstream_settled`], for a connection the client did
    /// not wait on (the fixture may not even have logged its `open` yet).
    pub fn wait_upstream(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(8);
        loop {
            let log = self.upstream_log();
            if let Some(v) = log.iter().find(|v| pred(v)) {
                return v.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no upstream record matching {what} within 8s:\n{}",
                dump(&log)
            );
            thread::sleep(POLL);
        }
    }

    /// Poll (bounded) until every upstream connection that was opened has
    /// also been logged as closed; returns the close records.
    pub fn upstream_settled(&self) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(8);
        loop {
            let log = self.upstream_log();
            let opens = log.iter().filter(|v| v["event"] == "open").count();
            let closes: Vec<Value> = log.into_iter().filter(|v| v["event"] == "close").collect();
            if closes.len() >= opens {
                return closes;
            }
            assert!(
                Instant::now() < deadline,
                "upstream connections still open after 8s:\n{}",
                dump(&self.upstream_log())
            );
            thread::sleep(POLL);
        }
    }

    /// Assert that no upstream (or canary) connection was made by anything
    /// the test did so far. Not a grace period: a marker request is sent
    /// straight from the proxy namespace (not through Palisade) to the
    /// upstream and to the canary, and once both have logged it, their logs
    /// are complete up to now; anything in them besides the marker fails.
    pub fn assert_nothing_reached_upstream(&self, context: &str) {
        self.assert_quiet(context, true);
    }

    /// [`Lab::assert_nothing_reached_upstream`] for the loopback canary
    /// alone: Palisade never dialled its own loopback.
    pub fn assert_canary_untouched(&self, context: &str) {
        self.assert_quiet(context, false);
    }

    pub(super) fn assert_quiet(&self, context: &str, upstream_too: bool) {
        let n = MARKERS.fetch_add(1, Ordering::Relaxed);
        let path = format!("{MARKER_PATH}{n}");
        let mut fixtures = vec![(self.canary_log_path(), format!("http://127.0.0.1{path}"))];
        if upstream_too {
            fixtures.push((
                self.upstream_log_path(),
                format!("http://{ALLOWED_IP}{path}"),
            ));
        }
        for (log, url) in fixtures {
            let out =
                self.proxy_ns_exec("curl", &["-sS", "-o", "/dev/null", "--max-time", "5", &url]);
            assert!(out.success(), "{context}: marker {url}: {}", out.describe());
            let mut seen = Vec::new();
            wait_until(
                &format!("{context}: marker {url} logged"),
                CMD_TIMEOUT,
                || {
                    seen = read_jsonl(&log);
                    seen.iter().any(|v| {
                        v["event"] == "close"
                            && v["request_line"]
                                .as_str()
                                .is_some_and(|l| l.contains(&path))
                    })
                },
            );
            let marker_ids: Vec<&Value> = seen
                .iter()
                .filter(|v| {
                    v["request_line"]
                        .as_str()
                        .is_some_and(|l| l.contains(&path))
                })
                .map(|v| &v["id"])
                .collect();
            let others: Vec<Value> = seen
                .iter()
                .filter(|v| !marker_ids.contains(&&v["id"]))
                .cloned()
                .collect();
            assert!(
                others.is_empty(),
                "{context}: connections reached {}:\n{}",
                log.display(),
                dump(&others)
            );
        }
    }
}
/// Poll `cond` every 50 ms until it holds; panic after `timeout`.
pub(crate) fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        thread::sleep(POLL);
    }
}

/// Parse a JSON Lines file.  A missing file is empty; an incomplete last line
/// (being written) is ignored; any other malformed line fails the test.
pub(crate) fn read_jsonl(path: &Path) -> Vec<Value> {
    let Ok(text) = fs::read_to_string(path) else {
        return Vec::new();
    };
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v) => out.push(v),
            Err(_) if i + 1 == lines.len() && !complete => {}
            Err(e) => panic!(
                "{}:{}: invalid JSON line ({e}): {line}",
                path.display(),
                i + 1
            ),
        }
    }
    out
}

/// Path prefix of the marker requests of [`Lab::assert_nothing_reached_upstream`].
pub(super) const MARKER_PATH: &str = "/palisade-test-marker-";

/// A fixture log without the connections that carried marker requests.
pub(super) fn without_markers(log: Vec<Value>) -> Vec<Value> {
    let is_marker = |v: &Value| {
        v["request_line"]
            .as_str()
            .is_some_and(|l| l.contains(MARKER_PATH))
    };
    let ids: Vec<Value> = log
        .iter()
        .filter(|v| is_marker(v))
        .map(|v| v["id"].clone())
        .collect();
    log.into_iter()
        .filter(|v| !ids.contains(&v["id"]))
        .collect()
}

pub(crate) fn dump(v: &[Value]) -> String {
    v.iter().map(|x| format!("{x}\n")).collect()
}
