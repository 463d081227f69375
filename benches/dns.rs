//! The DNS shim on its fast path: one allowed name, answered from cache,
//! evidence on. Per server, in one run: the server's CPU per query under
//! dnsperf (`-c 4 -q 200`, server alone on core 0, dnsperf on core 1) and
//! the latency of one query at a time (p50/p99, server and client both on
//! core 1, so the latency is the sum of the work on the path).
//!
//! Servers: this build's `palisade`, optionally a baseline binary
//! (`DNS_BENCH_BASELINE=/path/to/palisade`, same config) and dnsmasq (a
//! caching forwarder, the bench harness's config) when installed. All
//! forward to one loopback upstream in this process; only the first query
//! of each server reaches it.
//!
//!     cargo bench --bench dns
//!     DNS_BENCH_BASELINE=old/palisade DNS_SECS=5 DNS_REPS=3 cargo bench --bench dns
//!
//! `DNS_BENCH_PALISADE=path` measures that binary instead of this build's
//! (e.g. a release binary, with the bench itself built by `cargo test`:
//! `target/debug/deps/dns-HASH --bench`).
//!
//! Under `cargo test` a tiny smoke round checks that every server answers
//! and writes nothing. Every load is bounded in time and count; every
//! socket wait has a timeout.

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/mod.rs"]
mod common;

const QNAME: &str = "allowed.bench";
/// Queries one latency run sends at most.
const MAX_C1_QUERIES: usize = 500_000;
/// Client core and server core of the throughput runs.
const CLIENT_CPU: usize = 1;
const SERVER_CPU: usize = 0;

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pin every thread of `pid` to `core` (no-op on one core or without taskset).
fn pin(pid: u32, core: usize) {
    if cores() >= 2 && which("taskset").is_some() {
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", &core.to_string(), &pid.to_string()])
            .stdout(Stdio::null())
            .status();
    }
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// utime + stime of `pid` (all its threads), in seconds.
fn cpu_secs(pid: u32, hz: f64) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return f64::NAN;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 =
        f[11].parse::<f64>().unwrap_or(f64::NAN) + f[12].parse::<f64>().unwrap_or(f64::NAN);
    ticks / hz
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A query for `name` A with id `id`, RD set, no EDNS (as dnsperf sends).
fn query(id: u16, name: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(32);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.') {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.extend_from_slice(&[0, 0, 1, 0, 1]);
    m
}

/// The upstream: `allowed.bench` A 127.0.0.1 TTL 3600, NXDOMAIN otherwise.
fn upstream() -> SocketAddr {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        let want = query(0, QNAME);
        loop {
            let Ok((n, from)) = sock.recv_from(&mut buf) else {
                continue;
            };
            if n < 12 {
                continue;
            }
            let q = &buf[..n];
            // Question end: the header, the name, type and class.
            let mut off = 12;
            while off < n && q[off] != 0 {
                off += 1 + usize::from(q[off]);
            }
            let qend = (off + 5).min(n);
            let mut r = Vec::with_capacity(qend + 16);
            r.extend_from_slice(&q[..2]);
            let known = q[12..qend].eq_ignore_ascii_case(&want[12..]);
            let rcode = if known { 0 } else { 3 };
            r.extend_from_slice(&[0x85, 0x80 | rcode, 0, 1, 0, u8::from(known), 0, 0, 0, 0]);
            r.extend_from_slice(&q[12..qend]);
            if known {
                r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
                r.extend_from_slice(&3600u32.to_be_bytes());
                r.extend_from_slice(&[0, 4, 127, 0, 0, 1]);
            }
            let _ = sock.send_to(&r, from);
        }
    });
    addr
}

/// One query, its answer within `timeout`: true if it answered NOERROR with an answer.
fn ask(sock: &UdpSocket, id: u16, q: &mut [u8], buf: &mut [u8]) -> bool {
    q[..2].copy_from_slice(&id.to_be_bytes());
    if sock.send(q).is_err() {
        return false;
    }
    loop {
        match sock.recv(buf) {
            Ok(n) if n >= 12 && buf[..2] == id.to_be_bytes() => {
                return buf[3] & 0x0f == 0 && u16::from_be_bytes([buf[6], buf[7]]) > 0;
            }
            Ok(_) => continue,
            Err(_) => return false,
        }
    }
}

fn client(server: SocketAddr) -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.connect(server).unwrap();
    s
}

/// Until the server answers the bench name (at most 20 s).
fn wait_answering(server: SocketAddr, child: &mut Child, what: &str) {
    let sock = client(server);
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let (mut q, mut buf) = (query(1, QNAME), [0u8; 1500]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut id = 1u16;
    while !ask(&sock, id, &mut q, &mut buf) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} exited during start-up: {status}");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} does not answer {QNAME}");
        }
        id = id.wrapping_add(1);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// p50 and p99 of one query at a time for `secs`, in µs.
fn latency_c1(server: SocketAddr, secs: f64) -> (f64, f64, usize) {
    let sock = client(server);
    let (mut q, mut buf) = (query(0, QNAME), [0u8; 1500]);
    let mut lat = Vec::with_capacity(64 * 1024);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut id = 0u16;
    while Instant::now() < end && lat.len() < MAX_C1_QUERIES {
        id = id.wrapping_add(1);
        let t = Instant::now();
        assert!(ask(&sock, id, &mut q, &mut buf), "query {id} failed");
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    (at(0.50), at(0.99), lat.len())
}

/// dnsperf against `server` for `secs`: (queries completed, q/s).
fn dnsperf(server: SocketAddr, secs: f64, qfile: &Path) -> (f64, f64) {
    let mut c = Command::new("taskset");
    if cores() < 2 {
        c = Command::new("dnsperf");
    } else {
        c.args(["-c", &CLIENT_CPU.to_string(), "dnsperf"]);
    }
    let out = c
        .args(["-s", "127.0.0.1", "-p", &server.port().to_string(), "-d"])
        .arg(qfile)
        .args(["-l", &format!("{}", secs.ceil() as u64)])
        .args(["-c", "4", "-q", "200", "-T", "1", "-t", "2"])
        .output()
        .expect("dnsperf");
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    // A few lost datagrams (socket buffers full at -q 200) are normal;
    // CPU is counted per completed query.
    let completed = field("Queries completed:");
    assert!(completed > 0.0, "dnsperf completed nothing\n{text}");
    (completed, field("Queries per second:"))
}

/// A server process, stopped when dropped (also when a check panics).
struct Server(Option<Child>);

impl Server {
    fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = self.0.take() {
            common::stop(child);
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Figures {
    cpu_us: Vec<f64>,
    qps: Vec<f64>,
    p50: Vec<f64>,
    p99: Vec<f64>,
}

/// One server's run: CPU per query under dnsperf, then c=1 latency.
fn measure(pid: u32, server: SocketAddr, secs: f64, qfile: &Path, hz: f64, f: &mut Figures) {
    if which("dnsperf").is_some() {
        pin(pid, SERVER_CPU);
        std::thread::sleep(Duration::from_millis(100));
        let c0 = cpu_secs(pid, hz);
        let (done, qps) = dnsperf(server, secs, qfile);
        let c1 = cpu_secs(pid, hz);
        f.cpu_us.push((c1 - c0) / done * 1e6);
        f.qps.push(qps);
    }
    pin(pid, CLIENT_CPU);
    pin(std::process::id(), CLIENT_CPU);
    std::thread::sleep(Duration::from_millis(100));
    let (p50, p99, _) = latency_c1(server, secs);
    f.p50.push(p50);
    f.p99.push(p99);
}

fn palisade_config(root: &Path, dns: SocketAddr, upstream: SocketAddr) -> PathBuf {
    let cfg = root.join("palisade.toml");
    let text = format!(
        "[proxy]\nlisten = [\"127.0.0.1:{}\"]\n\
         [dns]\nlisten = [\"{dns}\"]\nupstream = [\"{upstream}\"]\n\
         max_queries_per_second_per_client = 100000000\nmax_queries_in_flight = 100000\n\
         [admin]\nlisten = \"127.0.0.1:{}\"\n\
         [evidence]\ndir = {:?}\n\
         [[org]]\nname = \"bench\"\nclients = [\"127.0.0.0/8\"]\n\
         [[org.allow]]\nhost = \"{QNAME}\"\n\
         [[org.allow]]\ncidr = \"127.0.0.1/32\"\nports = [80, 443]\n",
        common::free_port(),
        common::free_port(),
        root.join("evidence"),
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

fn start_palisade(bin: &Path, root: &Path, upstream: SocketAddr) -> (Child, SocketAddr) {
    let dns = SocketAddr::from(([127, 0, 0, 1], free_udp_port()));
    let cfg = palisade_config(root, dns, upstream);
    let mut child = Command::new(bin)
        .args(["run", "-c"])
        .arg(&cfg)
        .env("PALISADE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    wait_answering(dns, &mut child, "palisade");
    (child, dns)
}

fn start_dnsmasq(dnsmasq: &Path, upstream: SocketAddr) -> (Child, SocketAddr) {
    let port = free_udp_port();
    let mut child = Command::new(dnsmasq)
        .args([
            "-k",
            &format!("--port={port}"),
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--cache-size=10000",
            &format!("--server=127.0.0.1#{}", upstream.port()),
            "--pid-file=",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_answering(addr, &mut child, "dnsmasq");
    (child, addr)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let env = |k: &str, d: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let secs = env("DNS_SECS", if full { 5.0 } else { 0.3 });
    let reps = env("DNS_REPS", if full { 3.0 } else { 1.0 }) as usize;
    let hz = clk_tck();
    let root = common::scratch("dns-bench");
    let qfile = root.join("queries.txt");
    std::fs::write(&qfile, format!("{QNAME} A\n")).unwrap();
    let up = upstream();

    // DNS_BENCH_PALISADE: another binary under test than this build's
    // (say, a release binary while the bench itself runs unoptimised).
    let under_test = std::env::var("DNS_BENCH_PALISADE")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_palisade").to_string());
    let mut servers: Vec<(String, Option<PathBuf>)> =
        vec![("palisade".into(), Some(PathBuf::from(under_test)))];
    if let Ok(b) = std::env::var("DNS_BENCH_BASELINE") {
        servers.insert(0, ("baseline".into(), Some(PathBuf::from(b))));
    }
    if which("dnsmasq").is_some() {
        servers.push(("dnsmasq".into(), None));
    }
    let mut figures = vec![Figures::default(); servers.len()];
    for rep in 0..reps {
        for (i, (name, bin)) in servers.iter().enumerate() {
            let dir = root.join(format!("{name}-{rep}"));
            std::fs::create_dir_all(&dir).unwrap();
            let (child, addr) = match bin {
                Some(bin) => start_palisade(bin, &dir, up),
                None => start_dnsmasq(&which("dnsmasq").unwrap(), up),
            };
            let server = Server(Some(child));
            let pid = server.pid();
            if full {
                measure(pid, addr, secs, &qfile, hz, &mut figures[i]);
            } else {
                let (p50, _, n) = latency_c1(addr, secs);
                assert!(n > 0 && p50 > 0.0, "{name}: no answers");
            }
            drop(server);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    if !full {
        println!("dns bench smoke round: every server answered");
        return;
    }
    let m = |v: &[f64]| common::median(v);
    let base = figures
        .iter()
        .zip(&servers)
        .find(|(_, (n, _))| n == "baseline");
    let base = base.map(|(f, _)| (m(&f.cpu_us), m(&f.p50)));
    println!(
        "\n| server | CPU µs/query (dnsperf c=4) | q/s | c=1 p50 µs | c=1 p99 µs | CPU vs baseline | p50 vs baseline |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (f, (name, _)) in figures.iter().zip(&servers) {
        let (cpu, p50) = (m(&f.cpu_us), m(&f.p50));
        let ratio = |x: f64, b: Option<f64>| b.map_or("-".into(), |b| format!("{:.2}", x / b));
        println!(
            "| {name} | {cpu:.2} | {:.0} | {p50:.1} | {:.1} | {} | {} |",
            m(&f.qps),
            m(&f.p99),
            ratio(cpu, base.map(|b| b.0)),
            ratio(p50, base.map(|b| b.1)),
        );
    }
    println!(
        "\n{reps} repetitions of {secs} s each, medians; load average {:?}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}
