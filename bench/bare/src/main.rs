//! The least a CONNECT proxy and a DNS responder on tokio do, and nothing
//! else. Bounds for `bench/tunnel-ab.sh` and `bench/dns-c1.sh`, run as a
//! Palisade build is run (`bare run -c FILE`: the first `listen` address
//! of FILE's `[proxy]` and of its `[dns]`, the rest ignored). Loopback
//! bench use only: no policy, no name resolution, no records, no
//! verification, no timeouts, no bounds but the head's 4 KiB.
//!
//! - Proxy: accept, read the head, dial the target's port on 127.0.0.1,
//!   answer `200`, copy both ways (`copy_bidirectional`), close. With
//!   `BARE_RECORD=FILE BARE_CHAIN=1`, a decision record before the `200`
//!   and a close record after, chained in FILE.tunnels ([`chain`]).
//! - DNS: one task on the socket: receive, answer every `A` question with
//!   127.0.0.1 (the question copied, a name pointer, TTL 300), send. With
//!   `BARE_RECORD=FILE` it first appends a line of `BARE_RECORD_BYTES`
//!   (default 520) to FILE with one `write(2)`, as a record before an
//!   answer costs; with `BARE_CHAIN=1` as well, that line is a chained,
//!   hashed record of Palisade's shape built lean ([`chain`]). `BARE_SPIN=N` adds N rounds of register arithmetic to
//!   each answer and `BARE_TOUCH_KB=K` a byte written in each cache line
//!   of K KiB, to see whether a query's CPU follows the instructions run
//!   or the memory touched.
//!
//! They measure how far the runtime and the protocol alone stand from
//! HAProxy as a bare relay and from dnsmasq on the same workloads: what is
//! left of Palisade's distance is its own work.

mod chain;

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const HEAD_MAX: usize = 4096;

/// The first `listen` address of `section` in a Palisade configuration.
fn listen_of(conf: &str, section: &str) -> Option<SocketAddr> {
    let mut current = "";
    for line in conf.lines().map(str::trim) {
        if line.starts_with('[') {
            current = line;
        } else if current == section && line.starts_with("listen") {
            return line.split('"').nth(1)?.parse().ok();
        }
    }
    None
}

/// The target's port of a complete CONNECT head, if it is one.
fn connect_port(head: &[u8]) -> Option<u16> {
    let line = head.split(|&b| b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    if parts.next()? != "CONNECT" {
        return None;
    }
    parts.next()?.rsplit_once(':')?.1.parse().ok()
}

/// The tunnels' records, with `BARE_CHAIN=1`.
type Records = Option<std::sync::Arc<std::sync::Mutex<chain::Chain>>>;

fn chained<T>(records: &Records, f: impl FnOnce(&mut chain::Chain) -> T) -> Option<T> {
    let records = records.as_ref()?;
    let mut chain = records.lock().unwrap_or_else(|p| p.into_inner());
    Some(f(&mut chain))
}

async fn tunnel(mut client: TcpStream, records: Records) -> std::io::Result<()> {
    let mut head = [0u8; HEAD_MAX];
    let mut n = 0;
    let end = loop {
        let got = client.read(&mut head[n..]).await?;
        if got == 0 {
            return Ok(());
        }
        n += got;
        if let Some(at) = head[..n].windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if n == HEAD_MAX {
            return Ok(());
        }
    };
    let Some(port) = connect_port(&head[..end]) else {
        client
            .write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            .await?;
        return Ok(());
    };
    let mut upstream = TcpStream::connect(("127.0.0.1", port)).await?;
    upstream.set_nodelay(true)?;
    let peer = client.peer_addr()?;
    chained(&records, |c| c.record(peer)).transpose()?;
    client
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    if end < n {
        upstream.write_all(&head[end..n]).await?;
    }
    let copied = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    chained(&records, |c| c.close(peer));
    copied.map(|_| ())
}

async fn proxy(addr: SocketAddr, records: Records) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    loop {
        let (client, _) = listener.accept().await?;
        client.set_nodelay(true)?;
        tokio::spawn(tunnel(client, records.clone()));
    }
}

/// The answer to `query` in `out`: `None` for what is not one question.
fn answer(query: &[u8], out: &mut Vec<u8>) -> Option<()> {
    if query.len() < 12 || query[4..6] != [0, 1] {
        return None;
    }
    // The question's name, then its type and class.
    let mut at = 12;
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1 + len;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
    }
    let question_end = at + 4;
    let qtype = query.get(at..at + 2)?;
    let is_a = qtype == [0, 1];
    out.clear();
    out.extend_from_slice(&query[..2]);
    out.push(0x80 | (query[2] & 0x01)); // QR, RD copied
    out.push(0x80); // RA, NOERROR
    out.extend_from_slice(&[0, 1, 0, u8::from(is_a), 0, 0, 0, 0]);
    out.extend_from_slice(query.get(12..question_end)?);
    if is_a {
        out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 1, 44, 0, 4, 127, 0, 0, 1]);
    }
    Some(())
}

/// Work added to each answer, to see what a query's CPU follows: `spin`
/// rounds of arithmetic on registers (about ten instructions a round, no
/// memory), and one byte read and written in each of `lines` cache lines,
/// the same lines every query, in a shuffled order.
struct Extra {
    spin: u64,
    lines: Vec<u8>,
    order: Vec<u32>,
}

impl Extra {
    fn from_env() -> Extra {
        let var = |name: &str| -> usize {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let lines = var("BARE_TOUCH_KB") * 1024 / 64;
        let mut order: Vec<u32> = (0..lines as u32).collect();
        // A fixed shuffle (xorshift), so the prefetcher cannot follow.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in (1..order.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        Extra {
            spin: var("BARE_SPIN") as u64,
            lines: vec![0; lines * 64],
            order,
        }
    }

    fn run(&mut self) -> u64 {
        let (mut a, mut b, mut c, mut d) = (1u64, 2u64, 3u64, 4u64);
        for _ in 0..std::hint::black_box(self.spin) {
            a = a.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            b = b.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(3);
            c = c.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(5);
            d = d.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(7);
        }
        for &i in &self.order {
            let at = i as usize * 64;
            self.lines[at] = self.lines[at].wrapping_add(1);
        }
        std::hint::black_box(a ^ b ^ c ^ d)
    }
}

/// What is written before each answer.
enum Record {
    /// The same line every time.
    Line(File, Vec<u8>),
    /// A chained, hashed record ([`chain`]).
    Chained(Box<chain::Chain>),
}

async fn dns(addr: SocketAddr, mut record: Option<Record>) -> std::io::Result<()> {
    let socket = UdpSocket::bind(addr).await?;
    let mut buf = [0u8; 1500];
    let mut out = Vec::with_capacity(512);
    let mut extra = Extra::from_env();
    loop {
        let (n, from) = socket.recv_from(&mut buf).await?;
        if answer(&buf[..n], &mut out).is_none() {
            continue;
        }
        extra.run();
        match &mut record {
            Some(Record::Line(file, line)) => file.write_all(line)?,
            Some(Record::Chained(chain)) => chain.record(from)?,
            None => {}
        }
        socket.send_to(&out, from).await?;
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = match args.as_slice() {
        [_, run, c, path] if run == "run" && c == "-c" => path,
        _ => {
            eprintln!("usage: bare run -c FILE");
            std::process::exit(2);
        }
    };
    let conf = std::fs::read_to_string(path)?;
    let record = match std::env::var_os("BARE_RECORD") {
        Some(file) => {
            let bytes: usize = std::env::var("BARE_RECORD_BYTES")
                .ok()
                .and_then(|b| b.parse().ok())
                .unwrap_or(520);
            let mut line = vec![b'x'; bytes.max(1)];
            line[bytes.max(1) - 1] = b'\n';
            let file = File::options().create(true).append(true).open(file)?;
            if std::env::var("BARE_CHAIN").as_deref() == Ok("1") {
                Some(Record::Chained(Box::new(chain::Chain::new(file))))
            } else {
                Some(Record::Line(file, line))
            }
        }
        None => None,
    };
    // BARE_CHAIN=1 with BARE_RECORD: tunnels record too, in a file of
    // their own beside it (FILE.tunnels).
    let tunnel_records: Records = match (&record, std::env::var_os("BARE_RECORD")) {
        (Some(Record::Chained(_)), Some(file)) => {
            let mut path = file;
            path.push(".tunnels");
            let file = File::options().create(true).append(true).open(path)?;
            Some(std::sync::Arc::new(std::sync::Mutex::new(
                chain::Chain::new(file),
            )))
        }
        _ => None,
    };
    let proxy_at = listen_of(&conf, "[proxy]");
    let dns_at = listen_of(&conf, "[dns]");
    if proxy_at.is_none() && dns_at.is_none() {
        eprintln!("bare: no [proxy] or [dns] listen address in {path}");
        std::process::exit(2);
    }
    // BARE_RT=current: the current-thread scheduler (default: the
    // multi-threaded one, one worker per CPU of the affinity, as Palisade's).
    let mut runtime = match std::env::var("BARE_RT").as_deref() {
        Ok("current") => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    runtime.enable_io().build()?.block_on(async move {
        if let Some(addr) = dns_at {
            tokio::spawn(async move {
                if let Err(e) = dns(addr, record).await {
                    eprintln!("bare: dns: {e}");
                    std::process::exit(1);
                }
            });
        }
        // On a worker, as Palisade's listeners are: a multi-threaded
        // runtime's `block_on` runs on a thread of its own, and a task it
        // spawns reaches the worker across threads (a wake-up per tunnel).
        match proxy_at {
            Some(addr) => tokio::spawn(proxy(addr, tunnel_records)).await?,
            None => std::future::pending().await,
        }
    })
}
