//! What a tunnel costs to relay and to hold, through one real
//! `palisade run` (evidence "os"), with splice(2) against the user-space
//! copy (`PALISADE_SPLICE=off`) in the same run:
//!
//! - relay CPU per GiB: one CONNECT tunnel to an HTTP origin (a name rule:
//!   HTTP verified), `GET /large` of 1 GiB read to the end; proxy
//!   utime + stime from `/proc`, per GiB moved, and the rate;
//! - RSS per idle tunnel: 1000 tunnels opened and held, VmRSS of the proxy
//!   before and after, per tunnel; once for tunnels that sent nothing (they
//!   wait in detection: `detect_timeout` is raised out of the way) and once
//!   for tunnels that carried one small request and response.
//!
//! ```sh
//! cargo bench --bench splice
//! PALISADE_BIN=/path/to/other/palisade cargo bench --bench splice
//! ```
//!
//! `PALISADE_BIN` measures another build (a baseline) with the same load.
//! Under `cargo test` it runs one small round as a smoke test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/mod.rs"]
mod common;

const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Keep-alive origin: `GET /large` gets `large` bytes, anything else 100.
async fn origin(large: u64) -> SocketAddr {
    common::serve_tcp(move |mut s| async move {
        let block = vec![b'x'; 256 * 1024];
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            while let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head: Vec<u8> = buf.drain(..i + 4).collect();
                let len = if head.starts_with(b"GET /large ") {
                    large
                } else {
                    100
                };
                let h = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
                if s.write_all(h.as_bytes()).await.is_err() {
                    return;
                }
                let mut left = len;
                while left > 0 {
                    let n = usize::try_from(left).unwrap_or(usize::MAX).min(block.len());
                    if s.write_all(&block[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            }
            match tokio::time::timeout(STEP_TIMEOUT, s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        }
    })
    .await
}

/// `palisade run` of `bin`, the user-space copy forced when `no_splice`.
fn start(
    bin: &Path,
    root: &Path,
    origin: SocketAddr,
    dns: SocketAddr,
    no_splice: bool,
) -> (Child, SocketAddr) {
    let port = common::free_port();
    let cfg = root.join("palisade.toml");
    let o = origin.port();
    let config = common::palisade_config(
        &format!("listen = [\"127.0.0.1:{port}\"]\ndetect_timeout = \"60s\""),
        &dns.to_string(),
        &format!("dir = {:?}", root.join("evidence")),
        &format!(
            "[[org.allow]]\nhost = \"http.bench\"\nports = [{o}]\n{}",
            common::loopback_rule(o)
        ),
    );
    std::fs::write(&cfg, config).unwrap();
    let proxy: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(["run", "-c"])
        .arg(&cfg)
        .env("PALISADE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if no_splice {
        cmd.env("PALISADE_SPLICE", "off");
    } else {
        cmd.env_remove("PALISADE_SPLICE");
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(proxy).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("palisade exited at start: {status}");
        }
        assert!(Instant::now() < deadline, "palisade did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, proxy)
}

/// Read one response head and its Content-Length body to the end (the body
/// is counted and dropped); the body's length.
async fn response(s: &mut TcpStream, buf: &mut [u8]) -> Option<u64> {
    let mut head = Vec::new();
    let end = loop {
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut buf[..4096]).await.ok()?;
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    };
    let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
    let len: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())?;
    let mut left = len.checked_sub((head.len() - end) as u64)?;
    while left > 0 {
        let want = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
        let n = s.read(&mut buf[..want]).await.ok()?;
        if n == 0 {
            return None;
        }
        left -= n as u64;
    }
    Some(len)
}

/// (proxy CPU ms per GiB, MiB/s) of one `GET /large` through one tunnel.
fn throughput(rt: &tokio::runtime::Runtime, pid: u32, proxy: SocketAddr, port: u16) -> (f64, f64) {
    let cpu0 = common::cpu_seconds(pid);
    let t0 = Instant::now();
    let moved = rt.block_on(async {
        let mut s = common::connect_tunnel(proxy, &format!("http.bench:{port}")).await?;
        let get = format!("GET /large HTTP/1.1\r\nHost: http.bench:{port}\r\n\r\n");
        s.write_all(get.as_bytes()).await.ok()?;
        let mut buf = vec![0u8; 256 * 1024];
        response(&mut s, &mut buf).await
    });
    let wall = t0.elapsed().as_secs_f64();
    let cpu = common::cpu_seconds(pid) - cpu0;
    let moved = moved.expect("the large GET failed") as f64;
    let gib = moved / f64::from(1u32 << 30);
    (cpu * 1e3 / gib, moved / f64::from(1u32 << 20) / wall)
}

/// RSS growth per tunnel (KiB) with `n` tunnels held idle: silent after
/// the CONNECT (`request` false: waiting in detection), or after one small
/// request and its response.
fn idle_rss(
    rt: &tokio::runtime::Runtime,
    pid: u32,
    proxy: SocketAddr,
    port: u16,
    n: usize,
    request: bool,
) -> f64 {
    std::thread::sleep(Duration::from_millis(300));
    let before = common::rss_kib(pid);
    let held = rt.block_on(async {
        let mut held = Vec::new();
        for _ in 0..n {
            let opened = tokio::time::timeout(STEP_TIMEOUT, async {
                let mut s = common::connect_tunnel(proxy, &format!("http.bench:{port}")).await?;
                if request {
                    let get = format!("GET /small HTTP/1.1\r\nHost: http.bench:{port}\r\n\r\n");
                    s.write_all(get.as_bytes()).await.ok()?;
                    response(&mut s, &mut [0u8; 4096]).await?;
                }
                Some(s)
            })
            .await;
            held.push(
                opened
                    .ok()
                    .flatten()
                    .expect("an idle tunnel failed to open"),
            );
        }
        held
    });
    std::thread::sleep(Duration::from_millis(1000));
    let after = common::rss_kib(pid);
    drop(held);
    (after - before) / n as f64
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (large, rounds, idle) = if full {
        (1u64 << 30, 3, 1000)
    } else {
        (8 << 20, 1, 20)
    };
    let bin: PathBuf = std::env::var_os("PALISADE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_palisade")));
    let root = common::scratch("splicebench");
    let rt = common::runtime();
    let up = rt.block_on(origin(large));
    let resolver = rt.block_on(common::dns());
    let port = up.port();
    let mut rows = Vec::new();
    for (label, no_splice) in [("splice", false), ("user-space copy", true)] {
        let (child, proxy) = start(&bin, &root, up, resolver, no_splice);
        let pid = child.id();
        let runs: Vec<(f64, f64)> = (0..rounds)
            .map(|_| throughput(&rt, pid, proxy, port))
            .collect();
        common::stop(child);
        let cpu = common::median(&runs.iter().map(|r| r.0).collect::<Vec<_>>());
        let rate = common::median(&runs.iter().map(|r| r.1).collect::<Vec<_>>());
        let mut rss = [0.0; 2];
        for (i, request) in [false, true].into_iter().enumerate() {
            let (child, proxy) = start(&bin, &root, up, resolver, no_splice);
            rss[i] = idle_rss(&rt, child.id(), proxy, port, idle, request);
            common::stop(child);
        }
        rows.push((label, cpu, rate, rss));
    }
    println!(
        "{} through one CONNECT tunnel (HTTP verified), {rounds} rounds, median; {idle} idle tunnels; binary {}",
        if full { "1 GiB" } else { "8 MiB" },
        bin.display()
    );
    println!("| relay | proxy CPU per GiB | MiB/s | RSS per idle tunnel (silent, in detection) | RSS per idle tunnel (after one request) |");
    println!("|---|---:|---:|---:|---:|");
    for (label, cpu, rate, rss) in &rows {
        println!(
            "| {label} | {cpu:.0} ms | {rate:.0} | {:.2} KiB | {:.2} KiB |",
            rss[0], rss[1]
        );
    }
    if let [(_, sc, sr, _), (_, uc, ur, _)] = rows.as_slice() {
        println!(
            "| splice / user-space | {:.2}× | {:.2}× | | |",
            sc / uc,
            sr / ur
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
