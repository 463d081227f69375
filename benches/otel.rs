//! The OTLP export's cost per decision: a real `palisade run` without
//! `[otel]` and with it (sending to a loopback sink that answers every
//! export `200` at once), the same load (absolute-form HTTP, a new
//! connection per request: one decision record, one log record, a
//! connection span with its request, decide and dial spans), the two
//! interleaved over several rounds. Reports requests per second and
//! Palisade's CPU time per request (utime + stime of the process), median
//! per configuration, and the difference: what the export costs a
//! decision. Also what reached the sink, and what was dropped.
//!
//!     cargo bench --bench otel
//!
//! Under `cargo test` it runs one short round as a smoke test.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "common/mod.rs"]
mod common;

const CONCURRENCY: usize = 32;

/// A collector that takes everything: each POST read whole and answered
/// `200` with an empty (valid) OTLP response, keep-alive. Counts requests.
async fn sink(requests: Arc<AtomicU64>) -> SocketAddr {
    common::serve_tcp(move |mut s| {
        let requests = requests.clone();
        async move {
            let mut buf = Vec::with_capacity(64 * 1024);
            let mut chunk = [0u8; 16 * 1024];
            loop {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while buf.len() < end + 4 + len {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                buf.drain(..end + 4 + len);
                requests.fetch_add(1, Ordering::Relaxed);
                let ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
                if s.write_all(ok).await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

fn start(root: &Path, name: &str, otel: &str, up: SocketAddr) -> (Child, SocketAddr) {
    let port = common::free_port();
    let dir = root.join(format!("ev-{name}"));
    let cfg = root.join(format!("{name}.toml"));
    let config = common::palisade_config(
        &format!("listen = [\"127.0.0.1:{port}\"]"),
        "127.0.0.1:53",
        // The evidence as the default writes it; [otel] (a table of its
        // own) before the orgs.
        &format!("dir = {dir:?}\nmax_records_per_second_per_org = 1000000\n{otel}"),
        &common::loopback_rule(up.port()),
    );
    std::fs::write(&cfg, config).unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    (common::spawn_palisade(&cfg, &[addr]), addr)
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, secs) = if full { (5, 4.0) } else { (1, 0.3) };
    let root = common::scratch("otelbench");
    let rt = common::runtime();
    let up = rt.block_on(common::http_upstream());
    let exports = Arc::new(AtomicU64::new(0));
    let collector = rt.block_on(sink(exports.clone()));
    let configs = [
        ("off", String::new()),
        ("on", format!("[otel]\nendpoint = \"http://{collector}\"\n")),
    ];
    let mut rate: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut cpu_us: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (i, (name, otel)) in configs.iter().enumerate() {
            let (child, proxy) = start(&root, name, otel, up);
            rt.block_on(common::absolute_get_load(proxy, up, CONCURRENCY, 0.2)); // warm-up
            let cpu0 = common::cpu_seconds(child.id());
            let t0 = std::time::Instant::now();
            let r = rt.block_on(common::absolute_get_load(proxy, up, CONCURRENCY, secs));
            let requests = r * t0.elapsed().as_secs_f64();
            let cpu = common::cpu_seconds(child.id()) - cpu0;
            rate[i].push(r);
            cpu_us[i].push(cpu * 1e6 / requests);
            common::stop(child);
        }
    }
    println!(
        "OTLP export cost: {CONCURRENCY} concurrent clients, new connection per request, {rounds} rounds of {secs}s, off and on interleaved"
    );
    for (i, (name, _)) in configs.iter().enumerate() {
        println!(
            "  otel {name:<3} {:>8.0} req/s  {:>7.1} us CPU/request",
            common::median(&rate[i]),
            common::median(&cpu_us[i])
        );
    }
    let (off, on) = (common::median(&cpu_us[0]), common::median(&cpu_us[1]));
    println!(
        "  export cost: {:.1} us CPU per decision ({:+.0}%), {:.2} x the requests/s; {} export requests reached the sink",
        on - off,
        (on / off - 1.0) * 100.0,
        common::median(&rate[1]) / common::median(&rate[0]),
        exports.load(Ordering::Relaxed)
    );
    let _ = std::fs::remove_dir_all(&root);
}
