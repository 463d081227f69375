//! What verifying every request of a plain-HTTP tunnel costs, against the
//! previous behaviour (only the first bytes checked, the rest copied blind:
//! today's `tunnel = "opaque"`), in the same run, through one real
//! `palisade run` (evidence "os"):
//!
//! - `http`: a name rule with the default `tunnel` (HTTP verified: every
//!   request head parsed and its Host checked, every response followed);
//! - `opaque`: the same name and port under `tunnel = "opaque"`.
//!
//! Each client opens a CONNECT tunnel and sends `REQUESTS_PER_TUNNEL`
//! keep-alive GETs one after another, reading each response. Rounds are
//! interleaved; the median per rule of requests per second and of proxy
//! CPU per request (utime + stime of the proxy from `/proc`), and the
//! ratios.
//!
//!     cargo bench --bench verify
//!
//! Under `cargo test` it runs one short round as a smoke test.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/mod.rs"]
mod common;

const CONCURRENCY: usize = 16;
const REQUESTS_PER_TUNNEL: usize = 50;
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

/// Keep-alive origin: answers every request head with [`RESPONSE`].
async fn origin() -> SocketAddr {
    common::serve_tcp(|mut s| async move {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            while let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                buf.drain(..i + 4);
                if s.write_all(RESPONSE).await.is_err() {
                    return;
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

fn start(root: &Path, origin: SocketAddr, dns: SocketAddr) -> (Child, SocketAddr) {
    let port = common::free_port();
    let cfg = root.join("palisade.toml");
    let o = origin.port();
    let config = common::palisade_config(
        &format!("listen = [\"127.0.0.1:{port}\"]"),
        &dns.to_string(),
        &format!("dir = {:?}", root.join("evidence")),
        &format!(
            "[[org.allow]]\nhost = \"http.bench\"\nports = [{o}]\n\
             [[org.allow]]\nhost = \"opaque.bench\"\nports = [{o}]\ntunnel = \"opaque\"\n{}",
            common::loopback_rule(o)
        ),
    );
    std::fs::write(&cfg, config).unwrap();
    let proxy: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    (common::spawn_palisade(&cfg, &[proxy]), proxy)
}

/// Read until `buf` ends a response of the fixed size.
async fn read_response(s: &mut TcpStream) -> Option<()> {
    let mut got = 0;
    let mut b = [0u8; 256];
    while got < RESPONSE.len() {
        let n = s.read(&mut b).await.ok()?;
        if n == 0 {
            return None;
        }
        got += n;
    }
    (got == RESPONSE.len()).then_some(())
}

/// One tunnel to `host:port` carrying [`REQUESTS_PER_TUNNEL`] keep-alive GETs.
async fn one(proxy: SocketAddr, host: &'static str, port: u16) -> bool {
    let steps = async {
        let mut s = common::connect_tunnel(proxy, &format!("{host}:{port}")).await?;
        let get = format!(
            "GET /item?id=12345 HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: bench/1.0\r\n\
             Accept: */*\r\nAccept-Encoding: gzip\r\n\r\n"
        );
        for _ in 0..REQUESTS_PER_TUNNEL {
            s.write_all(get.as_bytes()).await.ok()?;
            read_response(&mut s).await?;
        }
        Some(true)
    };
    matches!(
        tokio::time::timeout(STEP_TIMEOUT * 4, steps).await,
        Ok(Some(true))
    )
}

/// (requests per second, proxy CPU µs per request) of one round.
fn round(
    rt: &tokio::runtime::Runtime,
    pid: u32,
    proxy: SocketAddr,
    host: &'static str,
    port: u16,
    secs: f64,
) -> (f64, f64) {
    let cpu0 = common::cpu_seconds(pid);
    let tunnels = rt.block_on(common::closed_loop(CONCURRENCY, secs, move || {
        one(proxy, host, port)
    }));
    let cpu = common::cpu_seconds(pid) - cpu0;
    let requests = tunnels * REQUESTS_PER_TUNNEL as f64;
    (requests, cpu / (requests * secs) * 1e6)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, secs) = if full { (5, 3.0) } else { (1, 0.3) };
    let root = common::scratch("verifybench");
    let rt = common::runtime();
    let up = rt.block_on(origin());
    let resolver = rt.block_on(common::dns());
    let (child, proxy) = start(&root, up, resolver);
    let pid = child.id();
    let port = up.port();
    round(&rt, pid, proxy, "http.bench", port, 0.2); // warm-up
    round(&rt, pid, proxy, "opaque.bench", port, 0.2);
    let (mut http, mut opaque) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        http.push(round(&rt, pid, proxy, "http.bench", port, secs));
        opaque.push(round(&rt, pid, proxy, "opaque.bench", port, secs));
    }
    common::stop(child);
    let med = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        common::median(&v.iter().map(f).collect::<Vec<_>>())
    };
    let (hr, hc) = (med(&http, |x| x.0), med(&http, |x| x.1));
    let (or, oc) = (med(&opaque, |x| x.0), med(&opaque, |x| x.1));
    println!(
        "keep-alive GETs in CONNECT tunnels: {CONCURRENCY} concurrent tunnels of {REQUESTS_PER_TUNNEL} requests, \
         {rounds} interleaved rounds of {secs}s, evidence os, median"
    );
    println!("| tunnel | requests/s | proxy CPU per request |");
    println!("|---|---:|---:|");
    println!("| `opaque` (first bytes only, as before) | {or:.0} | {oc:.1} µs |");
    println!("| `http` (every request verified) | {hr:.0} | {hc:.1} µs |");
    println!("| http / opaque | {:.2}× | {:.2}× |", hr / or, hc / oc);
    let _ = std::fs::remove_dir_all(&root);
}
