//! Whole-process load: the same scenarios, in one run, over three paths:
//! direct (client → origin, no proxy: the physical limit), Palisade
//! (`palisade run`, evidence on) and squid (Debian's package, an equivalent
//! allowlist, access log on). The load generator and the origin share this
//! process, pinned to core 0; the proxies are pinned to core 1.
//!
//!     cargo bench --bench load                  # needs squid on PATH
//!     LOAD_OUT=bench/load.md cargo bench --bench load
//!
//! `bench/run.sh` installs squid and dnsmasq, runs this, the policy bench and
//! the DNS bench, and writes `bench/results.md`. Under `cargo test` this runs
//! a tiny smoke round (direct and Palisade only) and writes nothing.
//!
//! Scenarios (each bounded in count and time; every socket wait has a
//! timeout): new CONNECT tunnels (connect, CONNECT, 200, one small request
//! and response inside, close) at concurrency 1 and 64 with latency
//! p50/p99 and proxy CPU per tunnel; tunnel throughput of an endless body
//! over 1 and 8 streams; absolute-form GETs with and without keep-alive at
//! concurrency 64; proxy RSS per idle tunnel with many tunnels open.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[path = "common/mod.rs"]
mod common;

/// Every single socket operation of the generator finishes within this.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest response head the generator accepts.
const MAX_HEAD: usize = 16 * 1024;
/// Chunk the origin writes for the endless body.
static BIG: [u8; 256 * 1024] = [b'x'; 256 * 1024];

// ---------------------------------------------------------------------------
// Origin: tiny HTTP/1.1 server. `GET /big` streams forever (until the reader
// goes away); anything else is answered with a 2-byte body, keep-alive unless
// the request says `Connection: close` (then the origin closes first, so
// TIME_WAIT lands on the server side and the client's port pool stays free).

async fn origin() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            match l.accept().await {
                Ok((s, _)) => {
                    tokio::spawn(origin_conn(s));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    });
    addr
}

async fn origin_conn(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(1024);
    loop {
        let end = loop {
            if let Some(p) = find(&buf, b"\r\n\r\n") {
                break p + 4;
            }
            if buf.len() > MAX_HEAD {
                return;
            }
            let mut chunk = [0u8; 2048];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let big = buf.starts_with(b"GET /big ");
        let close = find_ci(&buf[..end], b"connection: close").is_some();
        buf.drain(..end);
        if big {
            let head = b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n";
            if s.write_all(head).await.is_err() {
                return;
            }
            while s.write_all(&BIG).await.is_ok() {}
            return;
        }
        let resp: &[u8] = if close {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        } else {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        };
        if s.write_all(resp).await.is_err() || close {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn find_ci(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len())
        .position(|w| w.eq_ignore_ascii_case(needle))
}

// ---------------------------------------------------------------------------
// Client side.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Direct,
    Palisade,
    Squid,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Direct => "direct",
            Via::Palisade => "palisade",
            Via::Squid => "squid",
        }
    }
}

/// Where a path's client connects, and the proxy process to watch.
#[derive(Clone, Copy)]
struct PathTo {
    via: Via,
    proxy: Option<SocketAddr>,
    pid: Option<u32>,
    origin: SocketAddr,
}

/// A connection with the bytes read past the last parsed message.
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> io::Result<Conn> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Conn {
            s,
            buf: Vec::with_capacity(512),
        })
    }

    async fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.s.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// A response head: its status and Content-Length (if any); the head is
    /// consumed.
    async fn head(&mut self) -> io::Result<(u16, Option<u64>)> {
        let end = loop {
            if let Some(p) = find(&self.buf, b"\r\n\r\n") {
                break p + 4;
            }
            if self.buf.len() > MAX_HEAD {
                return Err(io::Error::other("response head too large"));
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..end]).map_err(io::Error::other)?;
        let status = head
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::other("bad status line"))?;
        let len = head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        });
        self.buf.drain(..end);
        Ok((status, len))
    }

    /// A whole 200 response with a Content-Length body.
    async fn response(&mut self) -> io::Result<()> {
        let (status, len) = self.head().await?;
        if status != 200 {
            return Err(io::Error::other(format!("status {status}")));
        }
        let len = len.ok_or_else(|| io::Error::other("no content-length"))? as usize;
        while self.buf.len() < len {
            self.fill().await?;
        }
        self.buf.drain(..len);
        Ok(())
    }

    /// Read until the peer closes (bounded by the caller's timeout).
    async fn until_eof(&mut self) {
        let mut chunk = [0u8; 1024];
        while matches!(self.s.read(&mut chunk).await, Ok(n) if n > 0) {}
    }

    /// CONNECT through a proxy and expect 200.
    async fn connect_to(&mut self, origin: SocketAddr) -> io::Result<()> {
        let req = format!("CONNECT {origin} HTTP/1.1\r\nHost: {origin}\r\n\r\n");
        self.s.write_all(req.as_bytes()).await?;
        let (status, _) = self.head().await?;
        if status != 200 {
            return Err(io::Error::other(format!("CONNECT status {status}")));
        }
        Ok(())
    }
}

fn get(origin: SocketAddr, path: &str, close: bool) -> String {
    let conn = if close { "Connection: close\r\n" } else { "" };
    format!("GET {path} HTTP/1.1\r\nHost: {origin}\r\n{conn}\r\n")
}

/// A tunnel (or for direct, a plain connection) to the origin, ready for
/// origin-form requests.
async fn tunnel(p: &PathTo) -> io::Result<Conn> {
    match p.proxy {
        None => Conn::open(p.origin).await,
        Some(proxy) => {
            let mut c = Conn::open(proxy).await?;
            c.connect_to(p.origin).await?;
            Ok(c)
        }
    }
}

/// One new tunnel: connect, CONNECT, 200, one request and response, close.
async fn tunnel_once(p: PathTo) -> io::Result<()> {
    let mut c = tunnel(&p).await?;
    c.s.write_all(get(p.origin, "/", true).as_bytes()).await?;
    c.response().await?;
    c.until_eof().await;
    Ok(())
}

/// The request line target for an absolute-form (proxy) or origin-form GET.
fn http_target(p: &PathTo) -> String {
    match p.proxy {
        None => "/".into(),
        Some(_) => format!("http://{}/", p.origin),
    }
}

fn http_addr(p: &PathTo) -> SocketAddr {
    p.proxy.unwrap_or(p.origin)
}

/// One absolute-form GET on a new connection, `Connection: close`.
async fn http_once(p: PathTo) -> io::Result<()> {
    let mut c = Conn::open(http_addr(&p)).await?;
    c.s.write_all(get(p.origin, &http_target(&p), true).as_bytes())
        .await?;
    c.response().await?;
    c.until_eof().await;
    Ok(())
}

/// Results of one bounded run of one operation.
#[derive(Default)]
struct Run {
    ok: u64,
    failed: u64,
    secs: f64,
    /// Per-operation latency, µs (sorted).
    lat: Vec<f64>,
    /// Proxy CPU (user + system) over the run, seconds.
    cpu: f64,
    first_error: Option<String>,
}

impl Run {
    fn rate(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    fn pct(&self, q: f64) -> f64 {
        if self.lat.is_empty() {
            return f64::NAN;
        }
        self.lat[((self.lat.len() - 1) as f64 * q).round() as usize]
    }
    fn cpu_per_op_us(&self) -> f64 {
        self.cpu * 1e6 / self.ok.max(1) as f64
    }
}

/// Run `op` from `conc` workers until `secs` pass or `max` operations started.
async fn drive<F, Fut>(p: PathTo, conc: usize, secs: f64, max: u64, op: F) -> Run
where
    F: Fn(PathTo) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = io::Result<()>> + Send,
{
    let started = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let errors: Arc<Mutex<Option<String>>> = Arc::default();
    let cpu0 = p.pid.map(common::cpu_seconds);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (op, started, errors) = (op.clone(), started.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut lat) = (0u64, 0u64, Vec::new());
            while Instant::now() < end && started.fetch_add(1, Ordering::Relaxed) < max {
                let t = Instant::now();
                match tokio::time::timeout(OP_TIMEOUT, op(p)).await {
                    Ok(Ok(())) => {
                        ok += 1;
                        lat.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    Ok(Err(e)) => {
                        failed += 1;
                        errors.lock().unwrap().get_or_insert(e.to_string());
                    }
                    Err(_) => {
                        failed += 1;
                        errors.lock().unwrap().get_or_insert("timeout".into());
                    }
                }
            }
            (ok, failed, lat)
        }));
    }
    let mut run = Run::default();
    for t in tasks {
        let (ok, failed, lat) = t.await.unwrap();
        run.ok += ok;
        run.failed += failed;
        run.lat.extend(lat);
    }
    run.secs = t0.elapsed().as_secs_f64();
    run.cpu = match (p.pid, cpu0) {
        (Some(pid), Some(c0)) => common::cpu_seconds(pid) - c0,
        _ => f64::NAN,
    };
    run.lat.sort_by(|a, b| a.total_cmp(b));
    run.first_error = errors.lock().unwrap().take();
    run
}

/// Keep-alive absolute-form GETs: `conc` persistent connections.
async fn keepalive(p: PathTo, conc: usize, secs: f64, max: u64) -> Run {
    let started = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let cpu0 = p.pid.map(common::cpu_seconds);
    let t0 = Instant::now();
    let req = Arc::new(get(p.origin, &http_target(&p), false).into_bytes());
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (started, req) = (started.clone(), req.clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed, mut lat) = (0u64, 0u64, Vec::new());
            let mut conn: Option<Conn> = None;
            let mut err = None;
            while Instant::now() < end && started.fetch_add(1, Ordering::Relaxed) < max {
                let t = Instant::now();
                let one = async {
                    if conn.is_none() {
                        conn = Some(Conn::open(http_addr(&p)).await?);
                    }
                    let c = conn.as_mut().unwrap();
                    c.s.write_all(&req).await?;
                    c.response().await
                };
                match tokio::time::timeout(OP_TIMEOUT, one).await {
                    Ok(Ok(())) => {
                        ok += 1;
                        lat.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    Ok(Err(e)) => {
                        failed += 1;
                        conn = None;
                        err.get_or_insert(e.to_string());
                    }
                    Err(_) => {
                        failed += 1;
                        conn = None;
                        err.get_or_insert("timeout".to_string());
                    }
                }
            }
            (ok, failed, lat, err)
        }));
    }
    let mut run = Run::default();
    for t in tasks {
        let (ok, failed, lat, err) = t.await.unwrap();
        run.ok += ok;
        run.failed += failed;
        run.lat.extend(lat);
        if run.first_error.is_none() {
            run.first_error = err;
        }
    }
    run.secs = t0.elapsed().as_secs_f64();
    run.cpu = match (p.pid, cpu0) {
        (Some(pid), Some(c0)) => common::cpu_seconds(pid) - c0,
        _ => f64::NAN,
    };
    run.lat.sort_by(|a, b| a.total_cmp(b));
    run
}

/// Throughput of `streams` tunnels each reading the endless body for `secs`;
/// `ok` is the bytes read.
async fn throughput(p: PathTo, streams: usize, secs: f64) -> Run {
    let cpu0 = p.pid.map(common::cpu_seconds);
    let mut tasks = Vec::new();
    // Open every stream first, then measure them together.
    let mut conns = Vec::new();
    for _ in 0..streams {
        let opened = tokio::time::timeout(OP_TIMEOUT, async {
            let mut c = tunnel(&p).await?;
            c.s.write_all(get(p.origin, "/big", false).as_bytes())
                .await?;
            let (status, _) = c.head().await?;
            if status != 200 {
                return Err(io::Error::other(format!("status {status}")));
            }
            Ok::<_, io::Error>(c)
        })
        .await;
        match opened {
            Ok(Ok(c)) => conns.push(c),
            Ok(Err(e)) => {
                return Run {
                    failed: 1,
                    first_error: Some(e.to_string()),
                    secs: 1.0,
                    ..Run::default()
                }
            }
            Err(_) => {
                return Run {
                    failed: 1,
                    first_error: Some("timeout".into()),
                    secs: 1.0,
                    ..Run::default()
                }
            }
        }
    }
    let t0 = Instant::now();
    let end = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    for mut c in conns {
        tasks.push(tokio::spawn(async move {
            let mut n = c.buf.len() as u64;
            let mut buf = vec![0u8; 256 * 1024];
            while let Ok(Ok(k)) = tokio::time::timeout_at(end, c.s.read(&mut buf)).await {
                if k == 0 {
                    break;
                }
                n += k as u64;
            }
            n
        }));
    }
    let mut run = Run::default();
    for t in tasks {
        run.ok += t.await.unwrap();
    }
    run.secs = t0.elapsed().as_secs_f64();
    run.cpu = match (p.pid, cpu0) {
        (Some(pid), Some(c0)) => common::cpu_seconds(pid) - c0,
        _ => f64::NAN,
    };
    run
}

/// RSS growth of the proxy per tunnel with `n` idle tunnels open (each has
/// carried one request and response), KiB. Opened `conc` at a time.
async fn idle_rss(p: PathTo, n: usize, deadline_secs: f64) -> (f64, usize, Option<String>) {
    let Some(pid) = p.pid else {
        return (f64::NAN, 0, None);
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = common::rss_kib(pid);
    let end = Instant::now() + Duration::from_secs_f64(deadline_secs);
    let conns: Arc<Mutex<Vec<Conn>>> = Arc::default();
    let next = Arc::new(AtomicU64::new(0));
    let err: Arc<Mutex<Option<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (conns, next, err) = (conns.clone(), next.clone(), err.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end && next.fetch_add(1, Ordering::Relaxed) < n as u64 {
                let opened = tokio::time::timeout(OP_TIMEOUT, async {
                    let mut c = tunnel(&p).await?;
                    c.s.write_all(get(p.origin, "/", false).as_bytes()).await?;
                    c.response().await?;
                    Ok::<_, io::Error>(c)
                })
                .await;
                match opened {
                    Ok(Ok(c)) => conns.lock().unwrap().push(c),
                    Ok(Err(e)) => {
                        err.lock().unwrap().get_or_insert(e.to_string());
                    }
                    Err(_) => {
                        err.lock().unwrap().get_or_insert("timeout".into());
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = common::rss_kib(pid);
    let open = conns.lock().unwrap().len();
    let per = (after - before) / open.max(1) as f64;
    drop(conns);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let e = err.lock().unwrap().take();
    (per, open, e)
}

// ---------------------------------------------------------------------------
// Processes.

/// The 1-minute load average, to show what else ran on the machine.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(String::from))
        .unwrap_or_else(|| "?".into())
}

fn wait_listening(addr: SocketAddr, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(addr).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited during start-up: {status}");
        }
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `taskset -c CORE cmd...` when there are two cores or more.
fn pinned(core: usize, program: &str) -> Command {
    if cores() >= 2 && which("taskset").is_some() {
        let mut c = Command::new("taskset");
        c.args(["-c", &core.to_string(), program]);
        c
    } else {
        Command::new(program)
    }
}

/// Online cores of the machine (not of this process's affinity mask).
fn cores() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as usize
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn start_palisade(root: &Path, origin: SocketAddr) -> (Child, SocketAddr) {
    let port = common::free_port();
    let cfg = root.join("palisade.toml");
    // LOAD_PALISADE_PROXY="max_idle_upstream_connections = 0" (say) adds
    // lines to its [proxy] table: to compare upstream reuse off and on.
    let extra = std::env::var("LOAD_PALISADE_PROXY").unwrap_or_default();
    let config = common::palisade_config(
        &format!(
            "listen = [\"127.0.0.1:{port}\"]\n\
             max_connections = 100000\nmax_connections_per_org = 100000\n{extra}"
        ),
        "127.0.0.1:53",
        &format!("dir = {:?}", root.join("evidence")),
        &format!(
            "{}{}",
            common::loopback_rule(origin.port()),
            // LOAD_PALISADE_RULE="max_bytes_up = ..." (say) adds lines to
            // the rule: to compare the proxy with a volume budget and without.
            std::env::var("LOAD_PALISADE_RULE").unwrap_or_default()
        ),
    );
    std::fs::write(&cfg, config).unwrap();
    // LOAD_PALISADE_PREFIX="valgrind --tool=callgrind" (say) wraps the proxy
    // for profiling; its CPU figures are then the wrapper's.
    let prefix = std::env::var("LOAD_PALISADE_PREFIX").unwrap_or_default();
    let mut words: Vec<String> = prefix.split_whitespace().map(String::from).collect();
    words.push(env!("CARGO_BIN_EXE_palisade").into());
    let mut child = pinned(1, &words[0])
        .args(&words[1..])
        .args(["run", "-c"])
        .arg(&cfg)
        .env("PALISADE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr, &mut child, "palisade");
    (child, addr)
}

/// squid in the foreground with its own config, pid file, logs and no
/// cache dir: the same allowlist (clients 127.0.0.0/8 to the origin's
/// address and port only), access log on.
fn start_squid(root: &Path, squid: &Path, origin: SocketAddr) -> (Child, SocketAddr) {
    let port = common::free_port();
    let dir = root.join("squid");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("squid.conf");
    let d = dir.display();
    std::fs::write(
        &cfg,
        format!(
            "http_port 127.0.0.1:{port}\n\
             visible_hostname palisade-bench\n\
             pid_filename {d}/squid.pid\n\
             cache_log {d}/cache.log\n\
             access_log stdio:{d}/access.log\n\
             coredump_dir {d}\n\
             cache deny all\n\
             cache_mem 8 MB\n\
             max_filedescriptors 65536\n\
             shutdown_lifetime 1 seconds\n\
             dns_nameservers 127.0.0.1\n\
             acl clients src 127.0.0.0/8\n\
             acl origin dst {}/32\n\
             acl origin_port port {}\n\
             http_access allow clients origin origin_port\n\
             http_access deny all\n",
            origin.ip(),
            origin.port()
        ),
    )
    .unwrap();
    // squid started as root drops to the `proxy` user: let it write its files.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let _ = Command::new("chown")
            .args(["-R", "proxy:proxy"])
            .arg(&dir)
            .status();
    }
    let mut child = pinned(1, &squid.to_string_lossy())
        .args(["-N", "-f"])
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr, &mut child, "squid");
    (child, addr)
}

/// Pin this process (generator and origin) to core 0 and allow many sockets
/// (children inherit the limit); returns the file descriptor limit.
fn prepare_self() -> u64 {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside
    // it; sched_setaffinity reads `size_of` bytes of it.
    unsafe {
        if cores() >= 2 {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    let want: libc::rlim_t = 200_000;
    // SAFETY: getrlimit/setrlimit read and write the struct passed.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: want.max(lim.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur
    }
}

// ---------------------------------------------------------------------------
// The table.

/// One row: a metric for each path (NaN = not applicable / not run).
struct Row {
    metric: &'static str,
    unit: &'static str,
    vals: [Vec<f64>; 3],
    target: &'static str,
}

fn fmt_num(x: f64) -> String {
    if x.is_nan() {
        "–".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn fmt_ratio(a: f64, b: f64) -> String {
    if a.is_nan() || b.is_nan() || b == 0.0 {
        "–".into()
    } else {
        format!("{:.2}×", a / b)
    }
}

fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| scenario | unit | direct | Palisade | squid | Palisade/direct | Palisade/squid | goal |\n\
         |---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        let [d, p, q] = [0, 1, 2].map(|i| common::median(&r.vals[i]));
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.metric,
            r.unit,
            fmt_num(d),
            fmt_num(p),
            fmt_num(q),
            fmt_ratio(p, d),
            fmt_ratio(p, q),
            r.target
        ));
    }
    s
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let secs: f64 = std::env::var("LOAD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if full { 2.0 } else { 0.2 });
    let rounds: usize = std::env::var("LOAD_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if full { 3 } else { 1 });
    let idle_n: usize = std::env::var("LOAD_IDLE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if full { 10_000 } else { 50 });
    let max_ops: u64 = 5_000_000;
    let fd_limit = prepare_self();
    // A tunnel holds two sockets in the proxy (and two here: client and
    // origin side); without CAP_SYS_RESOURCE the hard limit caps the count.
    let idle_n = idle_n.min((fd_limit.saturating_sub(1000) / 2) as usize);
    let only = |var: &str, name: &str| {
        std::env::var(var).map_or(true, |v| v.split(',').any(|x| x.trim() == name))
    };
    let scenario = |name: &str| only("LOAD_SCENARIOS", name);

    let load_before = loadavg();
    let root = common::scratch("load");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let origin = rt.block_on(origin());

    let (pal, pal_addr) = start_palisade(&root, origin);
    let squid_bin = if full { which("squid") } else { None };
    if full && squid_bin.is_none() {
        eprintln!("squid not found on PATH: its column stays empty (bench/run.sh installs it)");
    }
    let squid = squid_bin.as_deref().map(|b| start_squid(&root, b, origin));
    let mut paths = vec![
        PathTo {
            via: Via::Direct,
            proxy: None,
            pid: None,
            origin,
        },
        PathTo {
            via: Via::Palisade,
            proxy: Some(pal_addr),
            pid: Some(pal.id()),
            origin,
        },
    ];
    if let Some((child, addr)) = &squid {
        paths.push(PathTo {
            via: Via::Squid,
            proxy: Some(*addr),
            pid: Some(child.id()),
            origin,
        });
    }
    // LOAD_PATHS=palisade and LOAD_SCENARIOS=tunnel64,... narrow a run (profiling).
    paths.retain(|p| only("LOAD_PATHS", p.via.name()));

    let idx = |v: Via| match v {
        Via::Direct => 0,
        Via::Palisade => 1,
        Via::Squid => 2,
    };
    let row = |metric, unit, _higher_better: bool, target| Row {
        metric,
        unit,
        vals: Default::default(),
        target,
    };
    let mut rows = vec![
        row("new tunnels/s, 1 concurrent", "tunnels/s", true, ""),
        row(
            "tunnel latency p50, 1 concurrent",
            "µs",
            false,
            "≤ 1.5× direct",
        ),
        row("tunnel latency p99, 1 concurrent", "µs", false, ""),
        row(
            "new tunnels/s, 64 concurrent",
            "tunnels/s",
            true,
            "≥ 0.85× direct, ≥ 2.3× squid",
        ),
        row("tunnel latency p50, 64 concurrent", "µs", false, ""),
        row("tunnel latency p99, 64 concurrent", "µs", false, ""),
        row(
            "proxy CPU per tunnel, 64 concurrent",
            "µs",
            false,
            "≤ 50 µs",
        ),
        row(
            "tunnel throughput, 1 stream",
            "MiB/s",
            true,
            "≥ 0.9× direct",
        ),
        row("proxy CPU per MiB, 1 stream", "ms", false, ""),
        row("tunnel throughput, 8 streams", "MiB/s", true, ""),
        row(
            "absolute-form GET keep-alive, 64 concurrent",
            "req/s",
            true,
            "≥ 0.7× direct",
        ),
        row("proxy CPU per keep-alive GET", "µs", false, ""),
        row(
            "absolute-form GET new connection each, 64 concurrent",
            "req/s",
            true,
            "",
        ),
        row("proxy CPU per new-connection GET", "µs", false, ""),
        row("proxy RSS per idle tunnel", "KiB", false, "≤ 2 KiB"),
    ];
    let mut notes = Vec::new();
    let mut check = |what: &str, via: Via, r: &Run| {
        eprintln!(
            "  {:<8} {what:<20} ok {:>8} failed {:>4} in {:.2} s, proxy cpu {:.3} s",
            via.name(),
            r.ok,
            r.failed,
            r.secs,
            r.cpu
        );
        if r.failed > 0 {
            let line = format!(
                "{what} via {}: {} of {} failed (first: {})",
                via.name(),
                r.failed,
                r.ok + r.failed,
                r.first_error.as_deref().unwrap_or("?")
            );
            eprintln!("{line}");
            notes.push(line);
        }
    };

    for round in 0..rounds {
        for p in &paths {
            let i = idx(p.via);
            // Warm-up.
            let r = rt.block_on(drive(*p, 8, secs.min(0.3), max_ops, tunnel_once));
            check("warm-up tunnels", p.via, &r);

            if scenario("tunnel1") {
                let r = rt.block_on(drive(*p, 1, secs, max_ops, tunnel_once));
                check("tunnels c=1", p.via, &r);
                rows[0].vals[i].push(r.rate());
                rows[1].vals[i].push(r.pct(0.5));
                rows[2].vals[i].push(r.pct(0.99));
            }
            if scenario("tunnel64") {
                let r = rt.block_on(drive(*p, 64, secs, max_ops, tunnel_once));
                check("tunnels c=64", p.via, &r);
                rows[3].vals[i].push(r.rate());
                rows[4].vals[i].push(r.pct(0.5));
                rows[5].vals[i].push(r.pct(0.99));
                rows[6].vals[i].push(r.cpu_per_op_us());
            }
            if scenario("tput1") {
                let r = rt.block_on(throughput(*p, 1, secs));
                check("throughput 1", p.via, &r);
                rows[7].vals[i].push(r.ok as f64 / r.secs / 1048576.0);
                rows[8].vals[i].push(r.cpu * 1e3 / (r.ok as f64 / 1048576.0));
            }
            if scenario("tput8") {
                let r = rt.block_on(throughput(*p, 8, secs));
                check("throughput 8", p.via, &r);
                rows[9].vals[i].push(r.ok as f64 / r.secs / 1048576.0);
            }
            if scenario("ka") {
                let r = rt.block_on(keepalive(*p, 64, secs, max_ops));
                check("keep-alive", p.via, &r);
                rows[10].vals[i].push(r.rate());
                rows[11].vals[i].push(r.cpu_per_op_us());
            }
            if scenario("nka") {
                let r = rt.block_on(drive(*p, 64, secs, max_ops, http_once));
                check("new-connection GET", p.via, &r);
                rows[12].vals[i].push(r.rate());
                rows[13].vals[i].push(r.cpu_per_op_us());
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    // Idle tunnels once per proxy, after the rate runs.
    for p in paths.iter().filter(|p| p.pid.is_some() && scenario("idle")) {
        let (per, open, err) = rt.block_on(idle_rss(*p, idle_n, 120.0));
        if open < idle_n {
            let line = format!(
                "idle tunnels via {}: {open} of {idle_n} opened (first error: {})",
                p.via.name(),
                err.as_deref().unwrap_or("time bound")
            );
            eprintln!("{line}");
            notes.push(line);
        }
        rows[14].vals[idx(p.via)].push(per);
    }

    common::stop(pal);
    if let Some((child, _)) = squid {
        common::stop(child);
    }
    let _ = std::fs::remove_dir_all(&root);

    let mut out = format!(
        "Load average before the run {load_before}, after it {}.\n\n\
         {rounds} rounds of {secs} s per scenario and path, median shown; {idle_n} idle tunnels \
         (fd limit {fd_limit}); \
         {} cores, generator and origin on core 0, proxies on core 1; loopback; plain HTTP \
         inside the tunnels; Palisade evidence durability \"os\", squid access log on.\n\n",
        loadavg(),
        cores()
    );
    out.push_str(&table(&rows));
    if !notes.is_empty() {
        out.push_str("\nFailures during the run:\n\n");
        for n in &notes {
            out.push_str(&format!("- {n}\n"));
        }
    }
    println!("{out}");
    // The smoke run (under `cargo test`) proves every scenario works end to end.
    assert!(full || notes.is_empty(), "smoke run failed: {notes:?}");
    if full {
        let path = std::env::var("LOAD_OUT").unwrap_or_else(|_| "target/load.md".into());
        std::fs::write(&path, &out).unwrap();
        eprintln!("table written to {path}");
    }
}
