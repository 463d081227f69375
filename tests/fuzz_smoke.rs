//! A bounded, stable-Rust fuzz run of every fuzz target's property: the seed
//! corpus, then deterministic random mutations of it, within a fixed count
//! and time per target. Coverage-guided runs are `cargo +nightly fuzz run
//! TARGET` in `fuzz/` (see README).

use std::time::{Duration, Instant};

/// Mutations per target, and the time cap per target.
const RUNS: u64 = 200_000;
const TIME_CAP: Duration = Duration::from_secs(15);

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(data)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/palisade.toml");
    seeds.push(std::fs::read(config).unwrap());
    for text in [
        "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
        "CONNECT [::1]:443 HTTP/1.1\r\n\r\n",
        "0x7f.1",
        "https://u@Bücher.example:8443/x",
        "dns:a.example/TXT",
        "[::ffff:127.0.0.1]:80",
        "SSH-2.0-x\r\n",
        // Pipelined requests through an HTTP tunnel to a.test:80; after a
        // `00 00`, the upstream's responses.
        "GET / HTTP/1.1\r\nHost: a.test\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: b.test\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n\
         3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\nHEAD /h HTTP/1.1\r\nHost: a.test:80\r\n\r\n\
         GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\n\r\nhi\
         GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\
         GET / HTTP/1.1\r\nHost: b.test\r\n\r\n\0\0\
         HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n\
         HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n\
         HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n\
         HTTP/1.1 101 Switching Protocols\r\n\r\nframes",
    ] {
        seeds.push(text.as_bytes().to_vec());
    }
    seeds
}

fn mutate(rng: &mut XorShift, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..=rng.below(4) {
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v.truncate(i);
            }
            2 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, rng.next() as u8);
            }
            3 if v.len() > 2 => {
                let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                v.swap(a, b);
            }
            _ => {
                let i = rng.below(v.len() + 1);
                let byte =
                    [0u8, 0xff, b'.', b':', b'[', b']', b'%', b'*', 0x16, b'\n'][rng.below(10)];
                v.insert(i, byte);
            }
        }
    }
    v
}

fn run(name: &str, check: fn(&[u8])) {
    run_seeds(name, check, seeds());
}

fn run_seeds(name: &str, check: fn(&[u8]), seeds: Vec<Vec<u8>>) {
    for s in &seeds {
        check(s);
    }
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let started = Instant::now();
    let mut runs = 0;
    while runs < RUNS && started.elapsed() < TIME_CAP {
        let seed = &seeds[rng.below(seeds.len())];
        check(&mutate(&mut rng, seed));
        runs += 1;
    }
    eprintln!("{name}: {runs} mutated inputs in {:?}", started.elapsed());
    assert!(runs >= 1000, "{name}: only {runs} runs");
}

#[test]
fn client_hello() {
    run("client_hello", palisade::fuzzing::client_hello);
}

#[test]
fn http_head() {
    run("http_head", palisade::fuzzing::http_head);
}

#[test]
fn target() {
    run("target", palisade::fuzzing::target);
}

#[test]
fn config() {
    run("config", palisade::fuzzing::config);
}

/// TLS tunnel streams: the captures, plus built flows (hello, then
/// change_cipher_spec, early data, a second hello, other handshake
/// messages) so mutations reach the checks after the first hello.
#[test]
fn tls_stream() {
    use palisade::fuzzing::client_hello_bytes;
    let good = client_hello_bytes(Some("api.example.com"), false);
    let evil = client_hello_bytes(Some("evil.example"), false);
    let ccs: &[u8] = &[20, 3, 3, 0, 1, 1];
    let early: &[u8] = &[23, 3, 3, 0, 4, 1, 2, 3, 4];
    let finished: &[u8] = &[22, 3, 3, 0, 8, 20, 0, 0, 4, 1, 2, 3, 4];
    let mut seeds = seeds();
    for flow in [
        [&good[..], ccs, &good, early].concat(),
        [&good[..], early, early, &evil].concat(),
        [&good[..], ccs, finished].concat(),
        client_hello_bytes(Some("api.example.com"), true),
        client_hello_bytes(None, false),
    ] {
        seeds.push(flow);
    }
    run_seeds("tls_stream", palisade::fuzzing::tls_stream, seeds);
}

#[test]
fn http_stream() {
    run("http_stream", palisade::fuzzing::http_stream);
}
