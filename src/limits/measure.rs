//! What the bounded tables cost: bytes held per entry and time per
//! operation over a bounded loop, for each table built on
//! [`super::table::FairTable`]. Printed, never asserted (no timing
//! assertions); compare two runs as ratios:
//! `cargo test --lib limits::measure -- --ignored --nocapture --test-threads=1`.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dns::ttl::TtlMemo;
use crate::handout::bindings::Bindings;
use crate::handout::synthetic::{Answer, Family, Synthetic};
use crate::limits::rate::RateLimiter;
use crate::proxy::pool::{Bounds, Pool};

/// Bytes resident now (`/proc/self/statm`, pages of 4 KiB): run one
/// measurement per process for a clean figure.
fn live() -> isize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<isize>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Fill with `fill` (which returns how many entries it left), then run
/// `ops` operations of `work`; prints bytes per entry and ns per op.
fn measure(name: &str, fill: impl FnOnce() -> (usize, Box<dyn FnMut(u32)>), ops: u32) {
    let before = live();
    let (entries, mut work) = fill();
    let bytes = live() - before;
    let start = Instant::now();
    for i in 0..ops {
        work(i);
    }
    let ns = start.elapsed().as_nanos() / u128::from(ops.max(1));
    let per = bytes / isize::try_from(entries.max(1)).unwrap_or(1);
    println!("table {name}: {entries} entries, {per} bytes/entry, {ns} ns/op");
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4((0xC612_0000 | (i & 0xffff)).into())
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_bindings() {
    let t0 = Instant::now();
    measure(
        "bindings",
        || {
            let b = Arc::new(Bindings::new(8, 4096, 16_384));
            let orgs: Vec<Arc<str>> = (0..16).map(|o| Arc::from(format!("org{o}"))).collect();
            for i in 0..16_384u32 {
                let org = &orgs[(i % 16) as usize];
                b.bind(
                    org,
                    &format!("n{i}.test"),
                    ip(i),
                    Duration::from_secs(60),
                    t0,
                );
            }
            let n = b.len();
            (
                n,
                Box::new(move |i| {
                    let org = &orgs[(i % 16) as usize];
                    let name = format!("m{i}.test");
                    b.bind(org, &name, ip(i), Duration::from_secs(60), t0);
                    assert!(b.is_bound(&org[..], &name, ip(i), t0));
                }),
            )
        },
        50_000,
    );
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_synthetic() {
    measure(
        "synthetic",
        || {
            let s = Arc::new(Synthetic::new(
                Some("198.18.0.0/15".parse().unwrap()),
                None,
                4096,
            ));
            let orgs: Vec<Arc<str>> = (0..4).map(|o| Arc::from(format!("org{o}"))).collect();
            for i in 0..16_384u32 {
                let org = &orgs[(i % 4) as usize];
                s.answer(org, &format!("n{i}.test"), Family::V4);
            }
            let n = s.len();
            (
                n,
                Box::new(move |i| {
                    let org = &orgs[(i % 4) as usize];
                    if let Answer::Addr(a) = s.answer(org, &format!("m{i}.test"), Family::V4) {
                        drop(s.pin(&org[..], a));
                    }
                }),
            )
        },
        50_000,
    );
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_ttl() {
    let t0 = Instant::now();
    measure(
        "ttl",
        || {
            use hickory_server::proto::rr::rdata::A;
            use hickory_server::proto::rr::{Name, RData, Record, RecordType};
            let m = Arc::new(TtlMemo::new(16_384));
            let rec = |i: u32| {
                vec![Record::from_rdata(
                    Name::from_ascii("a.test.").unwrap(),
                    300,
                    RData::A(A::from(std::net::Ipv4Addr::from(i))),
                )]
            };
            for i in 0..16_384u32 {
                m.apply(&format!("n{i}.test"), RecordType::A, &mut rec(i), t0);
            }
            let n = m.len();
            (
                n,
                Box::new(move |i| {
                    m.apply(&format!("m{i}.test"), RecordType::A, &mut rec(i), t0);
                }),
            )
        },
        50_000,
    );
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_pool() {
    let t0 = Instant::now();
    measure(
        "pool",
        || {
            let bounds = Bounds {
                max_total: 4096,
                max_per_key: 4,
                idle_timeout: Duration::from_secs(90),
            };
            let mut p: Pool<u32, u64> = Pool::new(bounds);
            for i in 0..4096u32 {
                p.checkin(i % 2048, u64::from(i), t0);
            }
            let n = p.len();
            (
                n,
                Box::new(move |i| {
                    p.checkin(i % 3000, u64::from(i), t0);
                    let _ = p.checkout(&((i * 7) % 3000), t0, |_| true);
                }),
            )
        },
        50_000,
    );
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_rate() {
    let t0 = Instant::now();
    measure(
        "rate",
        || {
            let r: RateLimiter<u32> = RateLimiter::new(10, 16_384);
            for i in 0..16_384u32 {
                r.allow(&i, t0);
            }
            let n = r.len();
            let mut t = t0;
            (
                n,
                Box::new(move |i| {
                    t += Duration::from_micros(50);
                    r.allow(&(i % 20_000), t);
                }),
            )
        },
        50_000,
    );
}

#[test]
#[ignore = "a measurement: run one per process with --ignored --exact --nocapture"]
fn cost_cache() {
    let t0 = Instant::now();
    measure(
        "cache",
        || {
            use crate::dns::cache::{AnswerCache, Key};
            use hickory_server::proto::rr::RecordType;
            let c: Arc<AnswerCache<(), u32>> = Arc::new(AnswerCache::new(16_384, 4096));
            let v = Arc::new(());
            let key = |i: u32| Key {
                org: (i % 8) as usize,
                name: format!("n{i}.test.").into_bytes().into(),
                qtype: RecordType::A,
            };
            for i in 0..16_384u32 {
                c.insert(&v, key(i), Arc::new(i), t0 + Duration::from_secs(60), t0);
            }
            let n = c.len();
            (
                n,
                Box::new(move |i| {
                    let k = key(100_000 + i);
                    c.insert(&v, k.clone(), Arc::new(i), t0 + Duration::from_secs(60), t0);
                    assert!(c.get(&v, &k, t0).is_some());
                }),
            )
        },
        50_000,
    );
}
