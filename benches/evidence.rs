//! The cost of evidence per connection: connections per second through a
//! real `palisade run` (absolute-form HTTP, one new connection per request,
//! so one decision record each, written before the request is forwarded)
//! with `[evidence] durability` = "discard" (the whole pipeline, bytes to
//! /dev/null), "os" and "fsync". Same run, same load, modes interleaved
//! over several rounds; reports the median per mode and the ratio to
//! "discard".
//!
//!     cargo bench --bench evidence
//!     EVIDENCE_DIR=/some/disk cargo bench --bench evidence   # where segments go
//!
//! Under `cargo test` it runs one short round as a smoke test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/mod.rs"]
mod common;

const CONCURRENCY: usize = 32;

async fn upstream() -> SocketAddr {
    common::serve_tcp(|mut s| async move {
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

fn start(root: &Path, mode: &str, up: SocketAddr) -> (Child, SocketAddr) {
    let port = common::free_port();
    let dir = root.join(format!("ev-{mode}"));
    let cfg = root.join(format!("{mode}.toml"));
    let config = common::palisade_config(
        &format!("listen = [\"127.0.0.1:{port}\"]"),
        "127.0.0.1:53",
        &format!("dir = {dir:?}\ndurability = \"{mode}\""),
        &common::loopback_rule(up.port()),
    );
    std::fs::write(&cfg, config).unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    (common::spawn_palisade(&cfg, &[addr]), addr)
}

async fn one(proxy: SocketAddr, req: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(proxy).await else {
        return false;
    };
    if s.write_all(req).await.is_err() {
        return false;
    }
    let mut resp = Vec::with_capacity(256);
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut resp)).await;
    resp.starts_with(b"HTTP/1.1 200")
}

async fn load(proxy: SocketAddr, up: SocketAddr, secs: f64) -> f64 {
    let req = Arc::new(
        format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nConnection: close\r\n\r\n")
            .into_bytes(),
    );
    common::closed_loop(CONCURRENCY, secs, move || {
        let req = req.clone();
        async move { one(proxy, &req).await }
    })
    .await
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, secs) = if full { (3, 4.0) } else { (1, 0.3) };
    let root: PathBuf = std::env::var_os("EVIDENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("palisade-evbench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let rt = common::runtime();
    let up = rt.block_on(upstream());
    let modes = ["discard", "os", "fsync"];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for _ in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            let (child, proxy) = start(&root, mode, up);
            rt.block_on(load(proxy, up, 0.2)); // warm-up
            results[i].push(rt.block_on(load(proxy, up, secs)));
            common::stop(child);
        }
    }
    println!(
        "evidence cost: {CONCURRENCY} concurrent clients, new connection per request, {rounds} rounds of {secs}s, evidence in {}",
        root.display()
    );
    let base = common::median(&results[0]);
    for (i, mode) in modes.iter().enumerate() {
        let m = common::median(&results[i]);
        println!(
            "  durability = {mode:<8} {m:>8.0} conn/s  ({:.2} x discard)",
            m / base
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
