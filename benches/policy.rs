//! Decision cost per call at 10 and at 10,000 rules, measured side by side in
//! one run. Reports ns per call and the 10,000/10 ratio (about 1 means the
//! cost does not grow with the rule count).
//!
//!     cargo bench --bench policy

use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;
use std::time::Instant;

use palisade::config;
use palisade::policy::{Decision, Policy};
use palisade::proto::target::{normalize_host, Host};

fn policy_with(rules: usize) -> Policy {
    let mut src = String::from(
        "[proxy]\nlisten = [\"127.0.0.1:3128\"]\n[[org]]\nname = \"acme\"\nclients = [\"198.19.0.0/16\"]\n",
    );
    for i in 0..rules {
        match i % 3 {
            0 => src.push_str(&format!("[[org.allow]]\nhost = \"h{i}.example.com\"\n")),
            1 => src.push_str(&format!("[[org.allow]]\nhost = \"*.w{i}.example.net\"\n")),
            _ => src.push_str(&format!(
                "[[org.allow]]\ncidr = \"198.{}.{}.0/24\"\nports = [443]\n",
                18 + (i / 256) % 2,
                i % 256
            )),
        }
    }
    Policy::new(&config::from_str(&src, Path::new("bench.toml")).expect("bench config"))
}

/// The decision for one target, including the address step.
fn decide(p: &Policy, client: IpAddr, host: &Host, port: u16, addrs: &[IpAddr]) -> bool {
    match p.decide(client, host, port) {
        Decision::Final(v) => v.is_allow(),
        Decision::Resolve(pending) => p.check_addresses(&pending, addrs).verdict.is_allow(),
    }
}

fn ns_per_call(p: &Policy, host: &Host, port: u16, calls: u32) -> f64 {
    let client: IpAddr = "198.19.4.4".parse().unwrap();
    let addrs: Vec<IpAddr> = vec!["198.18.200.1".parse().unwrap()];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..calls {
            black_box(decide(p, black_box(client), black_box(host), port, &addrs));
        }
        best = best.min(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    best
}

fn main() {
    // `cargo bench` passes --bench; under `cargo test` this only smoke-runs.
    let calls = if std::env::args().any(|a| a == "--bench") {
        200_000
    } else {
        10
    };
    let small = policy_with(10);
    let large = policy_with(10_000);
    let cases = [
        ("exact name allowed", "h9.example.com", 443),
        ("wildcard name allowed", "a.b.w7.example.net", 443),
        ("name denied (no rule)", "deep.sub.domain.example.org", 443),
        ("ip allowed by cidr", "198.18.5.9", 443),
        ("ip denied", "198.20.1.1", 443),
    ];
    println!(
        "{:<26} {:>12} {:>14} {:>8}",
        "case", "10 rules", "10,000 rules", "ratio"
    );
    for (name, target, port) in cases {
        let host = normalize_host(target).unwrap();
        let a = ns_per_call(&small, &host, port, calls);
        let b = ns_per_call(&large, &host, port, calls);
        println!("{name:<26} {a:>9.0} ns {b:>11.0} ns {:>8.2}", b / a);
    }
}
