//! Network-namespace lab for Palisade integration tests.
//!
//! Each [`Lab`] owns three fresh network namespaces that have no link to the
//! root namespace (veth pairs are created directly inside the lab
//! namespaces):
//!
//! ```text
//!  client ns                 proxy ns (ip_forward=0)            upstream ns
//!  c0 198.18.1.2/24  <---->  p0 198.18.1.1/24
//!     198.18.3.2/32 (not in any org)
//!                            u0 198.18.2.1/24  <---------->  u1 198.18.2.2/24 (DNS :53)
//!                            lo 127.0.0.1 (canary web)          198.18.2.10-.30 (web :80/:443,
//!                                                                banner+echo :2222)
//! ```
//!
//! Palisade runs in the proxy namespace.  Everything is torn down on drop
//! (also when a test panics); the lab directory is kept for post-mortem when
//! the test failed.

use serde_json::Value;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

pub const PROXY_ADDR: &str = "198.18.1.1:3128";
pub const PROXY_URL: &str = "http://198.18.1.1:3128";
pub const ADMIN_ADDR: &str = "198.18.1.1:9711";
pub const CLIENT_IP: &str = "198.18.1.2";
/// Second client address, not covered by any org's `clients`.
pub const STRANGER_IP: &str = "198.18.3.2";
pub const DNS_IP: &str = "198.18.2.2";
/// Where the DNS shim listens in labs that run it (the proxy's client-side address).
pub const SHIM_IP: &str = "198.18.1.1";
/// Second sandbox namespace (see [`LabBuilder::second_client`]).
pub const CLIENT2_IP: &str = "198.18.4.2";

/// Test web hosts and DNS records served in the upstream namespace.
pub const ALLOWED_IP: &str = "198.18.2.10";
pub const WILD_A_IP: &str = "198.18.2.11";
pub const BLOCKED_IP: &str = "198.18.2.12";
pub const OTHER_IP: &str = "198.18.2.13";
pub const WILD_APEX_IP: &str = "198.18.2.14";
/// A web host with no rule at all (used for IP-literal spellings).
pub const UNLISTED_IP: &str = "198.18.2.20";
/// A web host allowed by a cidr rule.
pub const CIDR_IP: &str = "198.18.2.30";
/// `untrusted.test`: an HTTPS upstream whose certificate comes from a CA no
/// one trusts (see [`LabBuilder::untrusted_upstream`]).
pub const UNTRUSTED_IP: &str = "198.18.2.21";
/// Every web host also serves a server-speaks-first protocol on this port:
/// it sends [`BANNER`] on accept, then echoes what it receives (30 s idle).
pub const BANNER_PORT: u16 = 2222;
pub const BANNER: &str = "SSH-2.0-test\r\n";

const WEB_IPS: &[&str] = &[
    ALLOWED_IP,
    WILD_A_IP,
    BLOCKED_IP,
    OTHER_IP,
    WILD_APEX_IP,
    UNLISTED_IP,
    CIDR_IP,
];

const DNS_RECORDS: &[(&str, &str)] = &[
    ("allowed.test", ALLOWED_IP),
    ("a.wild.test", WILD_A_IP),
    ("blocked.wild.test", BLOCKED_IP),
    ("other.test", OTHER_IP),
    ("wild.test", WILD_APEX_IP),
    ("meta.test", "169.254.169.254"),
    ("loop.test", "127.0.0.1"),
    // One always-denied and one good address, in that order.
    ("mixed.test", "127.0.0.1"),
    ("mixed.test", ALLOWED_IP),
    // bücher.test in its ASCII (punycode) form.
    ("xn--bcher-kva.test", ALLOWED_IP),
    ("untrusted.test", UNTRUSTED_IP),
    // nx.test (and every other name) -> NXDOMAIN
];

/// Further upstream DNS records: (fixture flag, "name=value").
const DNS_EXTRA: &[(&str, &str)] = &[
    // A CNAME chain leaving the allowed names: chain.test -> c1.elsewhere.test -> c2.far.test.
    ("--cname", "chain.test=c1.elsewhere.test"),
    ("--cname", "c1.elsewhere.test=c2.far.test"),
    ("--a", "c2.far.test=198.18.2.11"),
    // Rebinding: one public and one loopback address; only private ones.
    ("--a", "rebind.test=127.0.0.1"),
    ("--a", "rebind.test=198.18.2.10"),
    ("--a", "private.test=127.0.0.2"),
    ("--a", "private.test=169.254.169.254"),
    ("--aaaa", "private.test=::ffff:127.0.0.1"),
    ("--aaaa", "private.test=64:ff9b::a9fe:a9fe"),
    ("--aaaa", "private.test=::1"),
    ("--txt", "allowed.test=allowed-txt"),
    ("--txt", "other.test=other-txt"),
    ("--https", "svc.test=198.18.2.10,127.0.0.1"),
];

/// The policy most tests run with.
pub const DEFAULT_POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
host = "allowed.test"
ports = [80, 443]

[[org.allow]]
host = "*.wild.test"

[[org.allow]]
host = "meta.test"

[[org.allow]]
host = "loop.test"

[[org.allow]]
host = "nx.test"

[[org.allow]]
cidr = "198.18.2.30/32"
ports = [80]

[[org.deny]]
host = "blocked.wild.test"
"#;

const NS_PREFIX: &str = "pltest-";
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
/// Upper bound for any external command the harness runs.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(20);

static COUNTER: AtomicU32 = AtomicU32::new(0);
/// Marker requests of [`Lab::assert_nothing_reached_upstream`].
static MARKERS: AtomicU32 = AtomicU32::new(0);
static SETUP_LOCK: Mutex<()> = Mutex::new(());
static CERTS: OnceLock<PathBuf> = OnceLock::new();

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn palisade_bin() -> &'static str {
    env!("CARGO_BIN_EXE_palisade")
}

/// Per-process scratch directory under the system temp dir.
pub fn scratch_root() -> PathBuf {
    std::env::temp_dir().join(format!("palisade-netns-{}", std::process::id()))
}

/// Fresh empty directory for one test.
pub fn scratch_dir(tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = scratch_root().join(format!("{tag}-{n}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// These tests need CAP_NET_ADMIN and CAP_SYS_ADMIN: fail loudly, never skip.
pub fn require_root() {
    let status = fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .expect("Uid line in /proc/self/status");
    assert_eq!(
        euid, "0",
        "the netns integration tests must run as root (they create network namespaces); \
         run them via .ci/run or `sudo -E cargo test --test netns`"
    );
}

/// Output of a command that was run with a deadline.
#[derive(Debug)]
pub struct CmdOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOutput {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
    pub fn success(&self) -> bool {
        self.status.success()
    }
    pub fn describe(&self) -> String {
        format!(
            "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

fn sanitize(cmd: &mut Command) -> &mut Command {
    for var in [
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "no_proxy",
        "NO_PROXY",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Run `cmd` with `stdin` fed to it, killing it after `timeout`.
pub fn run_with_timeout(cmd: &mut Command, stdin: Option<&[u8]>, timeout: Duration) -> CmdOutput {
    sanitize(cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {desc}: {e}"));
    if let Some(input) = stdin {
        use std::io::Write;
        let mut pipe = child.stdin.take().expect("stdin pipe");
        let input = input.to_vec();
        // Written from a thread so a child that does not read cannot block us.
        thread::spawn(move || {
            let _ = pipe.write_all(&input);
        });
    }
    let mut out_pipe = child.stdout.take().expect("stdout pipe");
    let mut err_pipe = child.stderr.take().expect("stderr pipe");
    let out_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_t = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait().expect("try_wait") {
            Some(st) => break st,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("command timed out after {timeout:?}: {desc}");
            }
            None => thread::sleep(Duration::from_millis(10)),
        }
    };
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap_or_default()).into_owned();
    CmdOutput {
        status,
        stdout,
        stderr,
    }
}

/// Run a command that must succeed (harness plumbing).
pub fn must(cmd: &mut Command) -> CmdOutput {
    let desc = format!("{cmd:?}");
    let out = run_with_timeout(cmd, None, CMD_TIMEOUT);
    assert!(out.success(), "{desc} failed\n{}", out.describe());
    out
}

fn ip(args: &[&str]) -> CmdOutput {
    must(Command::new("ip").args(args))
}

fn netns_list() -> Vec<String> {
    let out = must(Command::new("ip").args(["netns", "list"]));
    out.stdout
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Kill every process inside `ns` and delete it.  Never panics.
fn destroy_ns(ns: &str) {
    for sig in ["-TERM", "-KILL"] {
        let pids = Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let pids: Vec<&str> = pids.split_whitespace().collect();
        if pids.is_empty() {
            break;
        }
        let _ = Command::new("kill").arg(sig).args(&pids).output();
        for _ in 0..40 {
            if pids
                .iter()
                .all(|p| !Path::new(&format!("/proc/{p}")).exists())
            {
                break;
            }
            thread::sleep(Duration::from_millis(25));
        }
    }
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
}

/// Remove namespaces left behind by earlier test processes that died.
fn clean_stale_namespaces() {
    for ns in netns_list() {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let owner = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        match owner {
            Some(pid) if pid == std::process::id() || pid_alive(pid) => {}
            _ => destroy_ns(&ns),
        }
    }
}

/// Remove scratch directories of earlier test processes that are gone.
fn clean_stale_scratch() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("palisade-netns-") else {
            continue;
        };
        match pid.parse::<u32>() {
            Ok(pid) if pid != std::process::id() && !pid_alive(pid) => {
                let _ = fs::remove_dir_all(e.path());
            }
            _ => {}
        }
    }
}

/// Test CA + server certificate, generated once per test process.
pub fn certs_dir() -> &'static Path {
    CERTS.get_or_init(|| {
        clean_stale_scratch();
        let dir = scratch_root().join("certs");
        let _ = fs::remove_dir_all(&dir);
        must(
            Command::new("bash")
                .arg(fixtures_dir().join("gen-certs.sh"))
                .arg(&dir),
        );
        dir
    })
}

pub fn ca_pem() -> PathBuf {
    certs_dir().join("ca.pem")
}

fn wait_for_file(path: &Path, child: &mut Child, what: &str, logs: &[PathBuf]) {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        if path.exists() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited during start-up ({st}):\n{}", read_logs(logs));
        }
        thread::sleep(POLL);
    }
    panic!(
        "{what} not ready within {READY_TIMEOUT:?}:\n{}",
        read_logs(logs)
    );
}

fn read_logs(paths: &[PathBuf]) -> String {
    let mut s = String::new();
    for p in paths {
        let _ = writeln!(
            s,
            "--- {} ---\n{}",
            p.display(),
            fs::read_to_string(p).unwrap_or_default()
        );
    }
    s
}

/// A parsed HTTP response (from curl or the raw client).
#[derive(Debug, Default, Clone)]
pub struct HttpResp {
    /// Status of the last response head seen (0 if none).
    pub status: u16,
    /// Headers of that response head, names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Exit status of the client tool.
    pub exit: Option<i32>,
    pub stderr: String,
    /// curl only: status of the CONNECT response (0 if no CONNECT).
    pub connect_status: u16,
    /// curl only: local port of the connection to the proxy.
    pub local_port: Option<u16>,
}

impl HttpResp {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parse one or more HTTP response heads; returns (status, headers) of the last.
pub fn parse_heads(text: &str) -> (u16, Vec<(String, String)>) {
    let mut status = 0;
    let mut headers = Vec::new();
    for line in text.split('\n') {
        let line = line.trim_end_matches('\r');
        if line.starts_with("HTTP/") {
            status = line
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            headers.clear();
        } else if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

/// Configuration knobs for a lab; build with [`Lab::builder`].
pub struct LabBuilder {
    policy: String,
    proxy_listen: Vec<String>,
    admin_listen: String,
    proxy_options: Vec<String>,
    start_proxy: bool,
    dns_listen: Vec<String>,
    dns_extra: String,
    second_client: bool,
    evidence_lines: String,
    evidence_tmpfs: Option<String>,
    intercept_lines: String,
    untrusted_upstream: bool,
}

impl LabBuilder {
    /// Lines for the `[intercept]` table (e.g. `ca_dir = "..."`).
    pub fn intercept_config(mut self, lines: &str) -> Self {
        self.intercept_lines = lines.to_owned();
        self
    }
    /// Serve `untrusted.test` ([`UNTRUSTED_IP`], HTTPS on 443) with a
    /// certificate from a CA nobody trusts; its log is `untrusted.log`.
    pub fn untrusted_upstream(mut self) -> Self {
        self.untrusted_upstream = true;
        self
    }
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy = policy.to_owned();
        self
    }
    pub fn proxy_listen(mut self, addrs: &[&str]) -> Self {
        self.proxy_listen = addrs.iter().map(|s| s.to_string()).collect();
        self
    }
    /// Add a `key = value` line to the `[proxy]` table, e.g.
    /// `.proxy_option("max_connections = 2")`.
    pub fn proxy_option(mut self, line: &str) -> Self {
        self.proxy_options.push(line.to_owned());
        self
    }
    /// Run the DNS shim on these addresses (default: none).
    pub fn dns_listen(mut self, addrs: &[&str]) -> Self {
        self.dns_listen = addrs.iter().map(|s| s.to_string()).collect();
        self
    }
    /// Extra `key = value` lines for the `[dns]` table.
    pub fn dns_extra(mut self, lines: &str) -> Self {
        self.dns_extra = lines.to_owned();
        self
    }
    /// A second sandbox namespace (`ns_client2`, address [`CLIENT2_IP`],
    /// default route to the proxy namespace).
    pub fn second_client(mut self) -> Self {
        self.second_client = true;
        self
    }
    /// Extra `key = value` lines for the `[evidence]` table.
    pub fn evidence_config(mut self, lines: &str) -> Self {
        self.evidence_lines = lines.to_owned();
        self
    }
    /// Run Palisade in a private mount namespace in which the evidence dir
    /// is a tmpfs of `size` (e.g. "1m"); it vanishes with the process.
    pub fn evidence_tmpfs(mut self, size: &str) -> Self {
        self.evidence_tmpfs = Some(size.to_owned());
        self
    }
    /// Set up namespaces and fixtures but do not launch Palisade.
    pub fn without_proxy(mut self) -> Self {
        self.start_proxy = false;
        self
    }
    pub fn start(self) -> Lab {
        Lab::create(self)
    }
}

pub struct Lab {
    pub id: String,
    pub dir: PathBuf,
    pub ns_client: String,
    /// Empty unless the lab was built with [`LabBuilder::second_client`].
    pub ns_client2: String,
    pub ns_proxy: String,
    pub ns_upstream: String,
    pub config_path: PathBuf,
    pub evidence_dir: PathBuf,
    fixtures: Vec<(String, Child)>,
    proxy: Option<Child>,
    namespaces: Vec<String>,
    seq: AtomicU32,
    evidence_tmpfs: Option<String>,
}

impl Lab {
    pub fn builder() -> LabBuilder {
        LabBuilder {
            policy: DEFAULT_POLICY.to_owned(),
            proxy_listen: vec![PROXY_ADDR.to_owned()],
            admin_listen: ADMIN_ADDR.to_owned(),
            proxy_options: Vec::new(),
            start_proxy: true,
            dns_listen: Vec::new(),
            dns_extra: String::new(),
            second_client: false,
            evidence_lines: String::new(),
            evidence_tmpfs: None,
            intercept_lines: String::new(),
            untrusted_upstream: false,
        }
    }

    /// Lab with the given policy fragment (`[[org]]` tables) and a running,
    /// ready Palisade.
    pub fn start(policy: &str) -> Lab {
        Lab::builder().policy(policy).start()
    }

    fn create(b: LabBuilder) -> Lab {
        require_root();
        let certs = certs_dir().to_path_buf();
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let id = format!("{NS_PREFIX}{}-{n}", std::process::id());
        let dir = scratch_dir("lab");
        let evidence_dir = dir.join("evidence");
        fs::create_dir_all(&evidence_dir).expect("create evidence dir");
        let mut lab = Lab {
            ns_client: format!("{id}-c"),
            ns_client2: if b.second_client {
                format!("{id}-d")
            } else {
                String::new()
            },
            ns_proxy: format!("{id}-p"),
            ns_upstream: format!("{id}-u"),
            config_path: dir.join("palisade.toml"),
            id,
            dir,
            evidence_dir,
            fixtures: Vec::new(),
            proxy: None,
            namespaces: Vec::new(),
            seq: AtomicU32::new(0),
            evidence_tmpfs: b.evidence_tmpfs.clone(),
        };
        {
            // `ip netns add` mounts /run/netns on first use; serialise the
            // plumbing so parallel tests do not race on it.
            let _guard = SETUP_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            static CLEANED: OnceLock<()> = OnceLock::new();
            CLEANED.get_or_init(clean_stale_namespaces);
            lab.build_network();
        }
        lab.start_fixtures(&certs);
        if b.untrusted_upstream {
            lab.start_untrusted_upstream(&certs);
        }
        let cfg = lab.config_toml(&b);
        fs::write(&lab.config_path, cfg).expect("write config");
        if b.start_proxy {
            lab.spawn_proxy();
            lab.wait_proxy_ready();
        }
        lab
    }

    fn build_network(&mut self) {
        let (c, p, u) = (
            self.ns_client.clone(),
            self.ns_proxy.clone(),
            self.ns_upstream.clone(),
        );
        for ns in [&c, &p, &u] {
            ip(&["netns", "add", ns]);
            self.namespaces.push(ns.clone());
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        // veths are created inside the lab namespaces: nothing ever appears
        // in the root namespace.
        ip(&[
            "-n", &p, "link", "add", "p0", "type", "veth", "peer", "name", "c0", "netns", &c,
        ]);
        ip(&[
            "-n", &p, "link", "add", "u0", "type", "veth", "peer", "name", "u1", "netns", &u,
        ]);
        ip(&["-n", &c, "addr", "add", "198.18.1.2/24", "dev", "c0"]);
        ip(&["-n", &c, "addr", "add", "198.18.3.2/32", "dev", "c0"]);
        ip(&["-n", &p, "addr", "add", "198.18.1.1/24", "dev", "p0"]);
        ip(&["-n", &p, "addr", "add", "198.18.2.1/24", "dev", "u0"]);
        ip(&["-n", &u, "addr", "add", "198.18.2.2/24", "dev", "u1"]);
        for a in WEB_IPS {
            ip(&["-n", &u, "addr", "add", &format!("{a}/32"), "dev", "u1"]);
        }
        ip(&["-n", &c, "link", "set", "c0", "up"]);
        ip(&["-n", &p, "link", "set", "p0", "up"]);
        ip(&["-n", &p, "link", "set", "u0", "up"]);
        ip(&["-n", &u, "link", "set", "u1", "up"]);
        // Replies to the stranger address go back over the same link.
        ip(&["-n", &p, "route", "add", "198.18.3.2/32", "dev", "p0"]);
        if !self.ns_client2.is_empty() {
            let d = self.ns_client2.clone();
            ip(&["netns", "add", &d]);
            self.namespaces.push(d.clone());
            ip(&["-n", &d, "link", "set", "lo", "up"]);
            ip(&[
                "-n", &p, "link", "add", "p1", "type", "veth", "peer", "name", "d0", "netns", &d,
            ]);
            ip(&["-n", &p, "addr", "add", "198.18.4.1/24", "dev", "p1"]);
            ip(&["-n", &d, "addr", "add", "198.18.4.2/24", "dev", "d0"]);
            ip(&["-n", &p, "link", "set", "p1", "up"]);
            ip(&["-n", &d, "link", "set", "d0", "up"]);
            ip(&["-n", &d, "route", "add", "default", "via", "198.18.4.1"]);
        }
        // New namespaces may inherit ip_forward from the root namespace.
        self.exec_must(&p, "sh", &["-c", "echo 0 > /proc/sys/net/ipv4/ip_forward"]);
    }

    fn start_fixtures(&mut self, certs: &Path) {
        let fx = fixtures_dir();
        let mut dns_args: Vec<String> = vec![
            fx.join("dns.py").display().to_string(),
            "serve".into(),
            "--listen".into(),
            DNS_IP.into(),
            "--log".into(),
            self.dns_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("dns.ready").display().to_string(),
        ];
        for (name, addr) in DNS_RECORDS {
            dns_args.push("--a".into());
            dns_args.push(format!("{name}={addr}"));
        }
        for (flag, spec) in DNS_EXTRA {
            dns_args.push((*flag).into());
            dns_args.push((*spec).into());
        }
        let ns_u = self.ns_upstream.clone();
        self.spawn_fixture("dns", &ns_u, &dns_args);

        let mut web_args: Vec<String> = vec![
            fx.join("upstream.py").display().to_string(),
            "--cert".into(),
            certs.join("server.pem").display().to_string(),
            "--key".into(),
            certs.join("server.key").display().to_string(),
            "--log".into(),
            self.upstream_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("web.ready").display().to_string(),
            "--banner-port".into(),
            BANNER_PORT.to_string(),
        ];
        for a in WEB_IPS {
            web_args.push("--addr".into());
            web_args.push((*a).into());
        }
        self.spawn_fixture("web", &ns_u, &web_args);

        // Canary on the proxy namespace's loopback: Palisade must never dial it.
        let canary_args: Vec<String> = vec![
            fx.join("upstream.py").display().to_string(),
            "--addr".into(),
            "127.0.0.1".into(),
            "--cert".into(),
            certs.join("server.pem").display().to_string(),
            "--key".into(),
            certs.join("server.key").display().to_string(),
            "--log".into(),
            self.canary_log_path().display().to_string(),
            "--ready".into(),
            self.dir.join("canary.ready").display().to_string(),
        ];
        let ns_p = self.ns_proxy.clone();
        self.spawn_fixture("canary", &ns_p, &canary_args);

        for name in ["dns", "web", "canary"] {
            let ready = self.dir.join(format!("{name}.ready"));
            let logs = [
                self.dir.join(format!("{name}.stdout")),
                self.dir.join(format!("{name}.stderr")),
            ];
            let child = &mut self
                .fixtures
                .iter_mut()
                .find(|(n, _)| n == name)
                .expect("fixture")
                .1;
            wait_for_file(&ready, child, name, &logs);
        }
    }

    fn start_untrusted_upstream(&mut self, certs: &Path) {
        let ns_u = self.ns_upstream.clone();
        ip(&[
            "-n",
            &ns_u,
            "addr",
            "add",
            &format!("{UNTRUSTED_IP}/32"),
            "dev",
            "u1",
        ]);
        let args: Vec<String> = vec![
            fixtures_dir().join("upstream.py").display().to_string(),
            "--addr".into(),
            UNTRUSTED_IP.into(),
            "--cert".into(),
            certs.join("rogue.pem").display().to_string(),
            "--key".into(),
            certs.join("rogue.key").display().to_string(),
            "--log".into(),
            self.dir.join("untrusted.log").display().to_string(),
            "--ready".into(),
            self.dir.join("untrusted.ready").display().to_string(),
        ];
        self.spawn_fixture("untrusted", &ns_u, &args);
        let ready = self.dir.join("untrusted.ready");
        let logs = [
            self.dir.join("untrusted.stdout"),
            self.dir.join("untrusted.stderr"),
        ];
        let child = &mut self
            .fixtures
            .iter_mut()
            .find(|(n, _)| n == "untrusted")
            .expect("fixture")
            .1;
        wait_for_file(&ready, child, "untrusted", &logs);
    }

    fn spawn_fixture(&mut self, name: &str, ns: &str, args: &[String]) {
        let stdout = fs::File::create(self.dir.join(format!("{name}.stdout"))).unwrap();
        let stderr = fs::File::create(self.dir.join(format!("{name}.stderr"))).unwrap();
        let child = sanitize(
            Command::new("ip")
                .args(["netns", "exec", ns, "python3"])
                .args(args),
        )
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn fixture {name}: {e}"));
        self.fixtures.push((name.to_owned(), child));
    }

    fn config_toml(&self, b: &LabBuilder) -> String {
        let listen: Vec<String> = b.proxy_listen.iter().map(|a| format!("{a:?}")).collect();
        let options: String = b.proxy_options.iter().map(|l| format!("{l}\n")).collect();
        let dns_listen: Vec<String> = b.dns_listen.iter().map(|a| format!("{a:?}")).collect();
        let intercept = if b.intercept_lines.is_empty() {
            String::new()
        } else {
            format!("[intercept]\n{}\n", b.intercept_lines)
        };
        format!(
            "[proxy]\nlisten = [{}]\n{options}\n[dns]\nlisten = [{}]\nupstream = [\"{DNS_IP}:53\"]\n{}\n\
             [admin]\nlisten = {:?}\n\n{intercept}[evidence]\ndir = {:?}\n{}\n{}\n",
            listen.join(", "),
            dns_listen.join(", "),
            b.dns_extra,
            b.admin_listen,
            self.evidence_dir.display().to_string(),
            b.evidence_lines,
            b.policy
        )
    }

    /// Launch `palisade run -c CONFIG` in the proxy namespace (not waiting).
    pub fn spawn_proxy(&mut self) {
        assert!(self.proxy.is_none(), "proxy already running");
        let stdout = fs::File::create(self.dir.join("palisade.stdout")).unwrap();
        let stderr = fs::File::create(self.dir.join("palisade.stderr")).unwrap();
        // `ip netns exec` execs the command, so the child pid is Palisade's.
        let mut cmd = match &self.evidence_tmpfs {
            None => Command::new("ip"),
            Some(size) => {
                // unshare and sh exec in place: the child pid stays Palisade's.
                let mut c = Command::new("unshare");
                c.args(["-m", "--propagation", "private", "sh", "-c"])
                    .arg(format!(
                        "mount -t tmpfs -o size={size},mode=0700 palisade-test \"$0\" && exec ip \"$@\""
                    ))
                    .arg(&self.evidence_dir);
                c
            }
        };
        let child = sanitize(
            cmd.args(["netns", "exec", &self.ns_proxy, palisade_bin(), "run", "-c"])
                .arg(&self.config_path),
        )
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("spawn palisade");
        self.proxy = Some(child);
    }

    pub fn proxy_output(&self) -> String {
        read_logs(&[
            self.dir.join("palisade.stdout"),
            self.dir.join("palisade.stderr"),
        ])
    }

    /// HTTP status of GET http://ADMIN/path from inside the proxy namespace
    /// (0 when the connection failed).
    pub fn admin_status(&self, path: &str) -> u16 {
        let out = self.exec(
            &self.ns_proxy.clone(),
            "curl",
            &[
                "-q",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
                &format!("http://{ADMIN_ADDR}{path}"),
            ],
        );
        out.stdout.trim().parse().unwrap_or(0)
    }

    /// Poll /readyz until 200 (bounded), failing if Palisade exits.
    pub fn wait_proxy_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(st) = self.proxy.as_mut().expect("proxy").try_wait().unwrap() {
                panic!(
                    "palisade exited during start-up ({st})\n{}",
                    self.proxy_output()
                );
            }
            if self.admin_status("/readyz") == 200 {
                return;
            }
            thread::sleep(POLL);
        }
        panic!(
            "palisade /readyz not 200 within {READY_TIMEOUT:?}\n{}",
            self.proxy_output()
        );
    }

    /// Run a command in Palisade's own mount namespace (where a tmpfs
    /// evidence dir is visible), via nsenter.
    pub fn proxy_mnt_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        let pid = self.proxy_pid().to_string();
        run_with_timeout(
            Command::new("nsenter")
                .args(["-t", &pid, "-m", "--", prog])
                .args(args),
            None,
            CMD_TIMEOUT,
        )
    }

    /// SIGKILL Palisade and reap it (a crash).
    pub fn kill_proxy_hard(&mut self) {
        let mut p = self.proxy.take().expect("proxy running");
        let _ = p.kill();
        let _ = p.wait();
    }

    /// Start Palisade again after it exited, and wait until it is ready.
    pub fn restart_proxy(&mut self) {
        if let Some(mut p) = self.proxy.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
        self.spawn_proxy();
        self.wait_proxy_ready();
    }

    /// Start a shell script in the client namespace in the background,
    /// its stdout going to `out`.
    pub fn client_spawn(&self, script: &str, out: &Path) -> Child {
        let stdout = fs::File::create(out).expect("create output");
        sanitize(Command::new("ip").args(["netns", "exec", &self.ns_client, "bash", "-c", script]))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn client script")
    }

    pub fn proxy_pid(&self) -> u32 {
        self.proxy.as_ref().expect("proxy running").id()
    }

    /// Wait (bounded) for Palisade to exit; None if it is still running.
    pub fn wait_proxy_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.proxy.as_mut().expect("proxy spawned");
        loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal_proxy(&self, sig: &str) {
        must(
            Command::new("kill")
                .arg(sig)
                .arg(self.proxy_pid().to_string()),
        );
    }

    /// Run a program inside a namespace with the default timeout.
    pub fn exec(&self, ns: &str, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec_input(ns, prog, args, None)
    }

    pub fn exec_input(
        &self,
        ns: &str,
        prog: &str,
        args: &[&str],
        input: Option<&[u8]>,
    ) -> CmdOutput {
        run_with_timeout(
            Command::new("ip")
                .args(["netns", "exec", ns, prog])
                .args(args),
            input,
            CMD_TIMEOUT,
        )
    }

    fn exec_must(&self, ns: &str, prog: &str, args: &[&str]) -> CmdOutput {
        let out = self.exec(ns, prog, args);
        assert!(
            out.success(),
            "{prog} {args:?} in {ns} failed\n{}",
            out.describe()
        );
        out
    }

    pub fn client_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec(&self.ns_client, prog, args)
    }

    pub fn proxy_ns_exec(&self, prog: &str, args: &[&str]) -> CmdOutput {
        self.exec(&self.ns_proxy, prog, args)
    }

    /// Run curl in the client namespace (`-q -sS --max-time 10` plus `args`).
    pub fn client_curl(&self, args: &[&str]) -> HttpResp {
        self.curl_in(&self.ns_client.clone(), args)
    }

    pub fn curl_in(&self, ns: &str, args: &[&str]) -> HttpResp {
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        let body = self.dir.join(format!("curl-{n}.body"));
        let head = self.dir.join(format!("curl-{n}.head"));
        let body_s = body.display().to_string();
        let head_s = head.display().to_string();
        let mut full: Vec<&str> = vec![
            "-q",
            "-sS",
            "--max-time",
            "10",
            "-o",
            &body_s,
            "-D",
            &head_s,
            "-w",
            "%{http_connect} %{local_port}",
        ];
        full.extend_from_slice(args);
        let out = self.exec(ns, "curl", &full);
        let head_text = fs::read_to_string(&head).unwrap_or_default();
        let (status, headers) = parse_heads(&head_text);
        let mut w = out.stdout.split_whitespace();
        let connect_status = w.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let local_port = w.next().and_then(|s| s.parse().ok()).filter(|p| *p != 0);
        HttpResp {
            status,
            headers,
            body: fs::read_to_string(&body).unwrap_or_default(),
            exit: out.code(),
            stderr: out.stderr,
            connect_status,
            local_port,
        }
    }

    /// curl through the proxy from the org client address.
    pub fn proxied_curl(&self, url: &str, extra: &[&str]) -> HttpResp {
        let ca = ca_pem().display().to_string();
        let mut args: Vec<&str> = vec!["-x", PROXY_URL, "--cacert", &ca];
        args.extend_from_slice(extra);
        args.push(url);
        self.client_curl(&args)
    }

    /// Send raw bytes to the proxy from `source` (client namespace) and parse
    /// the response.
    pub fn raw_request_from(&self, source: &str, request: &str) -> HttpResp {
        let script = fixtures_dir().join("rawhttp.py").display().to_string();
        let out = self.exec_input(
            &self.ns_client.clone(),
            "python3",
            &[&script, "--connect", PROXY_ADDR, "--source", source],
            Some(request.as_bytes()),
        );
        let (head, body) = out
            .stdout
            .split_once("\r\n\r\n")
            .unwrap_or((out.stdout.as_str(), ""));
        let (status, headers) = parse_heads(head);
        HttpResp {
            status,
            headers,
            body: body.to_owned(),
            exit: out.code(),
            stderr: out.stderr,
            connect_status: 0,
            local_port: None,
        }
    }

    pub fn raw_request(&self, request: &str) -> HttpResp {
        self.raw_request_from(CLIENT_IP, request)
    }

    /// `CONNECT target HTTP/1.1` sent raw, so the refusal body can be read.
    pub fn raw_connect(&self, target: &str) -> HttpResp {
        self.raw_request(&format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n"
        ))
    }

    /// Run `dig +time=2 +tries=1 ARGS` in a namespace and parse its output.
    pub fn dig_in(&self, ns: &str, args: &[&str]) -> Dig {
        let mut full: Vec<&str> = vec!["+time=2", "+tries=1", "+nocookie"];
        full.extend_from_slice(args);
        let out = self.exec(ns, "dig", &full);
        Dig::parse(&out.stdout, out.code())
    }

    /// `dig @SHIM_IP ARGS` from the org client namespace.
    pub fn dig(&self, args: &[&str]) -> Dig {
        let server = format!("@{SHIM_IP}");
        let mut full: Vec<&str> = vec![&server];
        full.extend_from_slice(args);
        self.dig_in(&self.ns_client.clone(), &full)
    }

    /// Raw DNS messages (hex) sent to the shim from the client namespace;
    /// one result line per message (see tests/fixtures/dnsraw.py).
    pub fn dns_raw(&self, proto: &str, hex: &[&str]) -> Vec<String> {
        let script = fixtures_dir().join("dnsraw.py").display().to_string();
        let mut args: Vec<&str> = vec![&script, "--server", SHIM_IP, "--proto", proto];
        args.extend_from_slice(hex);
        let out = self.exec(&self.ns_client.clone(), "python3", &args);
        assert!(out.success(), "dnsraw.py failed\n{}", out.describe());
        out.stdout.lines().map(str::to_owned).collect()
    }

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

    /// Open a TCP connection to the proxy from the client namespace (source
    /// CLIENT_IP), held by the test itself for tests that need timing or
    /// several requests on one connection.
    pub fn client_conn(&self) -> RawConn {
        self.try_client_conn()
            .unwrap_or_else(|e| panic!("connect to {PROXY_ADDR}: {e}\n{}", self.proxy_output()))
    }

    /// Like [`Lab::client_conn`], but a failure to connect is returned.
    pub fn try_client_conn(&self) -> io::Result<RawConn> {
        self.try_client_conn_to(PROXY_ADDR)
    }

    /// A connection from the client namespace to `addr` ("ip:port"): another
    /// listener of the proxy (SOCKS5), or any address when the client's
    /// traffic goes through the transparent gateway.
    pub fn client_conn_to(&self, addr: &str) -> RawConn {
        self.try_client_conn_to(addr)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}\n{}", self.proxy_output()))
    }

    /// Like [`Lab::client_conn_to`], but a failure to connect is returned.
    pub fn try_client_conn_to(&self, addr: &str) -> io::Result<RawConn> {
        let addr: SocketAddr = addr.parse().expect("ip:port");
        let stream = in_netns(&self.ns_client, move || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        })?;
        stream.set_nodelay(true)?;
        Ok(RawConn {
            stream,
            buf: Vec::new(),
        })
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

    fn assert_quiet(&self, context: &str, upstream_too: bool) {
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

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut p) = self.proxy.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
        for (_, mut c) in self.fixtures.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.namespaces.drain(..) {
            destroy_ns(&ns);
        }
        if thread::panicking() {
            eprintln!(
                "lab {} failed; logs and evidence kept in {}",
                self.id,
                self.dir.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// What `dig` printed, parsed.
#[derive(Debug, Clone, Default)]
pub struct Dig {
    /// `NOERROR`, `NXDOMAIN`, `REFUSED`, ... (empty when no reply arrived).
    pub status: String,
    /// Answer section: (type, rdata), e.g. ("A", "198.18.2.10").
    pub answers: Vec<(String, String)>,
    /// The Extended DNS Error line, e.g. `15 (Blocked): (palisade: ...)`.
    pub ede: Option<String>,
    pub output: String,
    pub exit: Option<i32>,
}

impl Dig {
    pub fn parse(text: &str, exit: Option<i32>) -> Dig {
        let mut d = Dig {
            output: text.to_owned(),
            exit,
            ..Dig::default()
        };
        let mut in_answer = false;
        for line in text.lines() {
            if let Some(rest) = line.split("status: ").nth(1) {
                d.status = rest.split(',').next().unwrap_or("").trim().to_owned();
            }
            if let Some(rest) = line.strip_prefix("; EDE: ") {
                d.ede = Some(rest.to_owned());
            }
            if line.starts_with(";; ANSWER SECTION:") {
                in_answer = true;
                continue;
            }
            if in_answer {
                if line.trim().is_empty() || line.starts_with(';') {
                    in_answer = false;
                    continue;
                }
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() >= 5 {
                    d.answers.push((f[3].to_owned(), f[4..].join(" ")));
                }
            }
        }
        d
    }

    /// rdata of the answers of one type.
    pub fn of(&self, rtype: &str) -> Vec<String> {
        self.answers
            .iter()
            .filter(|(t, _)| t == rtype)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The evidence record id named in the EDE text (`record=ID`).
    pub fn record_id(&self) -> Option<String> {
        let ede = self.ede.as_deref()?;
        let rest = ede.split("record=").nth(1)?;
        Some(
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect(),
        )
    }
}

/// Poll `cond` every 50 ms until it holds; panic after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
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
pub fn read_jsonl(path: &Path) -> Vec<Value> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(_) => return Vec::new(),
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
const MARKER_PATH: &str = "/palisade-test-marker-";

/// A fixture log without the connections that carried marker requests.
fn without_markers(log: Vec<Value>) -> Vec<Value> {
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

pub fn dump(v: &[Value]) -> String {
    v.iter().map(|x| format!("{x}\n")).collect()
}

/// Run `f` on a fresh thread inside network namespace `ns`.  Sockets created
/// there stay in that namespace when handed back to other threads.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    let file = fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
    thread::spawn(move || {
        // SAFETY: setns(2) takes a file descriptor and a flag; `file` is an
        // open namespace file that outlives the call, so the fd is valid.
        // CLONE_NEWNET only switches the calling thread's network namespace
        // (allowed in a multi-threaded process), and this thread is ours
        // alone and ends when `f` returns.  No memory is shared or aliased.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread panicked")
}

/// A client connection to the proxy driven byte by byte by the test.
pub struct RawConn {
    pub stream: TcpStream,
    /// Received but not yet consumed.
    buf: Vec<u8>,
}

/// How a wait for the peer to close ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// EOF or reset after this long.
    After(Duration),
    /// Still open when the wait ended.
    StillOpen,
}

impl RawConn {
    pub fn local_port(&self) -> u16 {
        self.stream.local_addr().expect("local addr").port()
    }

    pub fn send(&mut self, data: &[u8]) -> io::Result<()> {
        self.stream.write_all(data)?;
        self.stream.flush()
    }

    /// Read more bytes into the buffer before `deadline`.  Ok(0) on EOF;
    /// Err(TimedOut) at the deadline.
    fn fill(&mut self, deadline: Instant) -> io::Result<usize> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 16 * 1024];
        match self.stream.read(&mut chunk) {
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(n)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(io::ErrorKind::TimedOut.into())
            }
            Err(e) => Err(e),
        }
    }

    /// Bytes up to and including `needle`, read within `timeout`; None on
    /// timeout or close (what was read stays buffered).
    pub fn read_until(&mut self, needle: &[u8], timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.buf.windows(needle.len()).position(|w| w == needle) {
                return Some(self.buf.drain(..i + needle.len()).collect());
            }
            match self.fill(deadline) {
                Ok(n) if n > 0 => {}
                _ => return None,
            }
        }
    }

    /// Everything buffered so far (consumed).
    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Read one response head (status 0 if none arrives within `timeout`).
    pub fn read_head(&mut self, timeout: Duration) -> (u16, Vec<(String, String)>) {
        match self.read_until(b"\r\n\r\n", timeout) {
            Some(head) => parse_heads(&String::from_utf8_lossy(&head)),
            None => (0, Vec::new()),
        }
    }

    /// Read one response: head plus a Content-Length body.
    pub fn read_response(&mut self, timeout: Duration) -> HttpResp {
        let deadline = Instant::now() + timeout;
        let (status, headers) = self.read_head(timeout);
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while self.buf.len() < len {
            match self.fill(deadline) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let body: Vec<u8> = self.buf.drain(..len.min(self.buf.len())).collect();
        HttpResp {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            exit: Some(0),
            ..HttpResp::default()
        }
    }

    /// Send `CONNECT target` and read the response head; the status.
    pub fn connect(&mut self, target: &str) -> u16 {
        self.send(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .expect("send CONNECT");
        self.read_head(Duration::from_secs(5)).0
    }

    /// Wait up to `timeout` for the peer to close (EOF or reset), discarding
    /// anything it sends meanwhile.
    pub fn wait_closed(&mut self, timeout: Duration) -> Closed {
        let start = Instant::now();
        let deadline = start + timeout;
        loop {
            self.buf.clear();
            match self.fill(deadline) {
                Ok(0) => return Closed::After(start.elapsed()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::TimedOut => return Closed::StillOpen,
                Err(_) => return Closed::After(start.elapsed()),
            }
        }
    }

    /// Close the connection (both directions).
    pub fn close(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}
