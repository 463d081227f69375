//! SOCKS5 tunnels per second against CONNECT tunnels per second, through
//! one real `palisade run` (both listeners, same policy, evidence "os"),
//! in the same run: a new client connection per tunnel, which opens the
//! tunnel, sends one byte (not TLS, so detection decides at once), reads
//! the upstream's reply to its close. Listeners interleaved over several
//! rounds; median per listener and the SOCKS5/CONNECT ratio.
//!
//!     cargo bench --bench socks5
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

const CONCURRENCY: usize = 32;
const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads one byte, answers "ok", closes.
async fn upstream() -> SocketAddr {
    common::serve_tcp(|mut s| async move {
        let mut b = [0u8; 1];
        if let Ok(Ok(1)) = tokio::time::timeout(STEP_TIMEOUT, s.read(&mut b)).await {
            let _ = s.write_all(b"ok").await;
        }
    })
    .await
}

fn start(root: &Path, up: SocketAddr) -> (Child, SocketAddr, SocketAddr) {
    let (http, socks) = (common::free_port(), common::free_port());
    let cfg = root.join("palisade.toml");
    let config = common::palisade_config(
        &format!("listen = [\"127.0.0.1:{http}\"]\nsocks5 = [\"127.0.0.1:{socks}\"]"),
        "127.0.0.1:53",
        &format!("dir = {:?}", root.join("evidence")),
        &common::loopback_rule(up.port()),
    );
    std::fs::write(&cfg, config).unwrap();
    let http: SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    let socks: SocketAddr = format!("127.0.0.1:{socks}").parse().unwrap();
    (common::spawn_palisade(&cfg, &[http, socks]), http, socks)
}

#[derive(Clone, Copy)]
enum Via {
    Connect,
    Socks5,
}

/// Open one tunnel, send a byte, expect "ok" and the close.
async fn one(via: Via, proxy: SocketAddr, up: SocketAddr) -> bool {
    let steps = async {
        let mut s = match via {
            Via::Connect => common::connect_tunnel(proxy, &up.to_string()).await?,
            Via::Socks5 => {
                let mut s = TcpStream::connect(proxy).await.ok()?;
                s.set_nodelay(true).ok()?;
                s.write_all(&[5, 1, 0]).await.ok()?;
                let mut m = [0u8; 2];
                s.read_exact(&mut m).await.ok()?;
                let SocketAddr::V4(v4) = up else { return None };
                let mut req = vec![5, 1, 0, 1];
                req.extend_from_slice(&v4.ip().octets());
                req.extend_from_slice(&v4.port().to_be_bytes());
                s.write_all(&req).await.ok()?;
                let mut r = [0u8; 10];
                s.read_exact(&mut r).await.ok()?;
                if m != [5, 0] || r[1] != 0 {
                    return None;
                }
                s
            }
        };
        s.write_all(b"x").await.ok()?;
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.ok()?;
        Some(rest == b"ok")
    };
    matches!(
        tokio::time::timeout(STEP_TIMEOUT, steps).await,
        Ok(Some(true))
    )
}

async fn load(via: Via, proxy: SocketAddr, up: SocketAddr, secs: f64) -> f64 {
    common::closed_loop(CONCURRENCY, secs, move || one(via, proxy, up)).await
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, secs) = if full { (3, 4.0) } else { (1, 0.3) };
    let root = common::scratch("socksbench");
    let rt = common::runtime();
    let up = rt.block_on(upstream());
    let (child, http, socks) = start(&root, up);
    let (mut connect, mut socks5) = (Vec::new(), Vec::new());
    rt.block_on(load(Via::Connect, http, up, 0.2)); // warm-up
    rt.block_on(load(Via::Socks5, socks, up, 0.2));
    for _ in 0..rounds {
        connect.push(rt.block_on(load(Via::Connect, http, up, secs)));
        socks5.push(rt.block_on(load(Via::Socks5, socks, up, secs)));
    }
    common::stop(child);
    let (c, s) = (common::median(&connect), common::median(&socks5));
    println!(
        "tunnels/s: {CONCURRENCY} concurrent clients, new connection per tunnel, {rounds} rounds of {secs}s, evidence os"
    );
    println!("  CONNECT  {c:>8.0} tunnels/s");
    println!("  SOCKS5   {s:>8.0} tunnels/s  ({:.2} x CONNECT)", s / c);
    let _ = std::fs::remove_dir_all(&root);
}
