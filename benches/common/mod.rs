//! Pieces the whole-process benches share: a bounded closed-loop load,
//! stopping a child process, medians, a loopback DNS server, and a
//! process's CPU time and resident memory.

#![allow(dead_code)]

use std::future::Future;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `clients` tasks each run `op` back to back for `secs`; returns completed
/// operations per second. Panics if any operation failed: a rate with
/// failures in it is not a measurement.
pub(crate) async fn closed_loop<F, Fut>(clients: usize, secs: f64, op: F) -> f64
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (ok, failed, op) = (ok.clone(), failed.clone(), op.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                if op().await {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let t0 = Instant::now();
    for t in tasks {
        let _ = t.await;
    }
    let f = failed.load(Ordering::Relaxed);
    assert!(f == 0, "{f} operations failed");
    ok.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
}

/// SIGTERM, then SIGKILL after 15 s.
pub(crate) fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(15);
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The median of the numbers that are not NaN (NaN if none).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A free TCP port on loopback (bound and released at once).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The config every whole-process bench runs Palisade with: one org
/// `bench` of loopback clients, no DNS shim, the new-connection rate limit
/// out of the way (the benches measure the proxy, not the limiter), the
/// admin listener on a free port. `proxy` holds the `[proxy]` lines (the
/// listeners first), `dns_upstream` the resolver, `evidence` the
/// `[evidence]` lines, `rules` the `[[org.allow]]` tables.
pub(crate) fn palisade_config(
    proxy: &str,
    dns_upstream: &str,
    evidence: &str,
    rules: &str,
) -> String {
    format!(
        "[proxy]\n{proxy}\nmax_new_connections_per_second_per_org = 10000000\n\
         [dns]\nlisten = []\nupstream = [\"{dns_upstream}\"]\n\
         [admin]\nlisten = \"127.0.0.1:{}\"\n\
         [evidence]\n{evidence}\n\
         [[org]]\nname = \"bench\"\nclients = [\"127.0.0.0/8\"]\n{rules}",
        free_port()
    )
}

/// An allow rule for the loopback address on `port` (loopback is
/// always denied unless a rule inside it opens it).
pub(crate) fn loopback_rule(port: u16) -> String {
    format!("[[org.allow]]\ncidr = \"127.0.0.1/32\"\nports = [{port}]\n")
}

/// `palisade run -c CONFIG` (stderr inherited, log level warn), waiting
/// until every address in `listening` accepts connections.
pub(crate) fn spawn_palisade(
    config: &std::path::Path,
    listening: &[std::net::SocketAddr],
) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_palisade"))
        .args(["run", "-c"])
        .arg(config)
        .env("PALISADE_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while listening
        .iter()
        .any(|a| std::net::TcpStream::connect(a).is_err())
    {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("palisade exited at start: {status}");
        }
        assert!(Instant::now() < deadline, "palisade did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// A CONNECT tunnel to `target` (`host:port`) through `proxy`: the stream
/// once the proxy answered 200, or `None` on any failure.
pub(crate) async fn connect_tunnel(
    proxy: std::net::SocketAddr,
    target: &str,
) -> Option<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy).await.ok()?;
    s.set_nodelay(true).ok()?;
    let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut head = Vec::new();
    let mut b = [0u8; 256];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut b).await.ok()?;
        if n == 0 || head.len() > 4096 {
            return None;
        }
        head.extend_from_slice(&b[..n]);
    }
    head.starts_with(b"HTTP/1.1 200").then_some(s)
}

/// A loopback TCP server: every accepted connection is handed to `handle`
/// in a task of its own. Returns the address it listens on.
pub(crate) async fn serve_tcp<F, Fut>(handle: F) -> std::net::SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            if let Ok((s, _)) = l.accept().await {
                tokio::spawn(handle(s));
            }
        }
    });
    addr
}

/// A fresh scratch directory for one bench process (kept after the run).
pub(crate) fn scratch(name: &str) -> std::path::PathBuf {
    tempfile::Builder::new()
        .prefix(&format!("palisade-{name}-"))
        .tempdir()
        .unwrap()
        .into_path()
}

/// The load generator's runtime: one worker thread.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// A loopback DNS server answering every A query with 127.0.0.1 (and
/// anything else with no answer), so that the bench names resolve to the
/// origin.
pub(crate) async fn dns() -> std::net::SocketAddr {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                continue;
            };
            let q = &buf[..n];
            // Header (12) + one question: name, type (2), class (2).
            let Some(end) = q.iter().skip(12).position(|&b| b == 0).map(|p| 12 + p + 5) else {
                continue;
            };
            if end > n {
                continue;
            }
            let qtype = u16::from_be_bytes([q[end - 4], q[end - 3]]);
            let mut r = q[..end].to_vec();
            r[2] = 0x81; // QR, RD
            r[3] = 0x80; // RA, NOERROR
            r[6..8].copy_from_slice(&u16::from(qtype == 1).to_be_bytes());
            r[8..12].fill(0);
            if qtype == 1 {
                r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4, 127, 0, 0, 1]);
            }
            let _ = sock.send_to(&r, peer).await;
        }
    });
    addr
}

/// CPU seconds a process has used so far (utime + stime from
/// `/proc/PID/stat`); NaN when it cannot be read.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3; utime and stime are 14 and 15.
    let ticks = |i: usize| {
        fields
            .get(i - 3)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(14) + ticks(15)) / hz
}

/// Resident memory of a process in KiB (`VmRSS`); NaN when unreadable.
pub(crate) fn rss_kib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(f64::NAN)
}

/// A loopback HTTP upstream answering every request `200 ok` and closing.
pub(crate) async fn http_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    serve_tcp(|mut s| async move {
        let mut buf = [0u8; 4096];
        let mut seen = Vec::new();
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
            if seen.len() > 65536 {
                return;
            }
        }
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            .await;
    })
    .await
}

/// One absolute-form `GET` to `up` through the explicit proxy, on a new
/// connection; whether it got a 200.
async fn absolute_get(proxy: std::net::SocketAddr, req: &[u8]) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(proxy).await else {
        return false;
    };
    if s.write_all(req).await.is_err() {
        return false;
    }
    let mut resp = Vec::with_capacity(256);
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut resp)).await;
    resp.starts_with(b"HTTP/1.1 200")
}

/// `clients` clients sending absolute-form requests to `up` through the
/// proxy, a new connection (so one decision record) each, for `secs`;
/// requests per second.
pub(crate) async fn absolute_get_load(
    proxy: std::net::SocketAddr,
    up: std::net::SocketAddr,
    clients: usize,
    secs: f64,
) -> f64 {
    let req = Arc::new(
        format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nConnection: close\r\n\r\n")
            .into_bytes(),
    );
    closed_loop(clients, secs, move || {
        let req = req.clone();
        async move { absolute_get(proxy, &req).await }
    })
    .await
}
