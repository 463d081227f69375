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
//!
//! A second part measures the append path in-process, without the proxy:
//! tasks each writing a decision record (`write`, acknowledged) and its close
//! record (`submit`), as a tunnel does, at concurrency 1 and 64, on a
//! two-worker runtime as `palisade run` uses on this machine. It reports
//! records/s, CPU per record and context switches per record (getrusage over
//! the whole process: workers, writer and blocking threads).
//!
//! A third part takes a record's steps apart (`steps`): for the same
//! records, the time per record of its id, its reference (HMAC-SHA256 of
//! the id), its timestamp, its canonical serialisation and its chaining
//! (SHA-256 over the line, copied into the batch), each step timed over all
//! records in a row. Beside the append part's CPU per record, the rest is
//! the batch's lock, its write(2) and the wake-ups.
//!
//!     cargo bench --bench evidence -- append     # only the in-process part
//!     cargo bench --bench evidence -- steps      # only the steps of a record
//!     cargo bench --bench evidence -- proxy      # only the whole-process part

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;

use std::sync::Arc;
use std::time::Duration;

#[path = "common/mod.rs"]
mod common;

const CONCURRENCY: usize = 32;

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

/// CPU time (user + system) and context switches (voluntary and not) of
/// the whole process so far, threads that ended included.
fn usage() -> (f64, u64) {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is valid.
    let ru = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
        ru.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (
        secs(ru.ru_utime) + secs(ru.ru_stime),
        (ru.ru_nvcsw + ru.ru_nivcsw) as u64,
    )
}

fn tunnel_record(i: u64) -> palisade::evidence::Record {
    use palisade::evidence::{Kind, Mode, Record};
    use palisade::policy::{Reason, Verdict};
    let verdict = Verdict {
        org: None,
        reason: Reason::RuleMatch,
        rule: Some(Arc::from("acme/allow/0")),
        would_deny: None,
    };
    let client: SocketAddr = format!("198.18.1.2:{}", 1024 + i % 60_000).parse().unwrap();
    let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &Arc::from("p"));
    r.host = Some(format!("h{}.example.com", i % 1000));
    r.port = Some(443);
    r.sni = r.host.clone();
    r.ip = Some("198.18.7.7".parse().unwrap());
    r
}

struct Append {
    records_per_s: f64,
    cpu_us_per_record: f64,
    switches_per_record: f64,
}

/// `clients` tasks each recording tunnels (a written decision record and a
/// submitted close record) for `secs`, at most `max` tunnels each.
fn append(root: &Path, durability: &str, clients: usize, secs: f64, max: u64) -> Append {
    let dir = root.join(format!("append-{durability}-{clients}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = palisade::config::EvidenceConfig::for_dir(&dir);
    cfg.durability = match durability {
        "fsync" => palisade::config::Durability::Fsync,
        _ => palisade::config::Durability::Os,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ev = Arc::new(palisade::evidence::Evidence::start(&cfg).unwrap());
    let (cpu0, t0) = (usage(), std::time::Instant::now());
    let tunnels: u64 = rt.block_on(async {
        let end = std::time::Instant::now() + Duration::from_secs_f64(secs);
        let mut tasks = Vec::new();
        for c in 0..clients as u64 {
            let ev = ev.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while n < max && std::time::Instant::now() < end {
                    let mut r = tunnel_record(c * max + n);
                    ev.write(&mut r).await.unwrap();
                    ev.submit(&mut r.close(100, 200, 3));
                    n += 1;
                }
                n
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        total
    });
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu1 = usage();
    rt.block_on(ev.seal());
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
    let records = (tunnels * 2) as f64;
    Append {
        records_per_s: records / elapsed,
        cpu_us_per_record: (cpu1.0 - cpu0.0) * 1e6 / records,
        switches_per_record: (cpu1.1 - cpu0.1) as f64 / records,
    }
}

fn append_part(root: &Path, full: bool) {
    let (rounds, secs) = if full { (3, 2.0) } else { (1, 0.2) };
    println!(
        "evidence append path (in-process, 2 workers; a tunnel = write(decision) + submit(close)), median of {rounds} rounds of {secs}s:"
    );
    for durability in ["os", "fsync"] {
        for clients in [1usize, 64] {
            let mut rps = Vec::new();
            let mut cpu = Vec::new();
            let mut sw = Vec::new();
            for _ in 0..rounds {
                let a = append(root, durability, clients, secs, 1_000_000);
                rps.push(a.records_per_s);
                cpu.push(a.cpu_us_per_record);
                sw.push(a.switches_per_record);
            }
            println!(
                "  durability = {durability:<5} c = {clients:>2}: {:>8.0} records/s  {:>6.2} us CPU/record  {:>5.2} context switches/record",
                common::median(&rps),
                common::median(&cpu),
                common::median(&sw)
            );
        }
    }
}

/// Nanoseconds per record of each step of [`palisade::evidence::costs::Steps`],
/// over `n` tunnel decision records.
fn steps_part(full: bool) {
    use std::hint::black_box;
    use std::time::Instant;
    let n: u64 = if full { 200_000 } else { 2_000 };
    let steps = palisade::evidence::costs::Steps::default();
    let mut records: Vec<_> = (0..n).map(tunnel_record).collect();
    let per = |t: Instant| t.elapsed().as_nanos() as f64 / n as f64;
    let t = Instant::now();
    let ids: Vec<String> = (0..n).map(|_| steps.id()).collect();
    let id_ns = per(t);
    let t = Instant::now();
    for id in &ids {
        black_box(steps.reference(id));
    }
    let ref_ns = per(t);
    let t = Instant::now();
    for _ in 0..n {
        black_box(steps.ts());
    }
    let ts_ns = per(t);
    for (r, id) in records.iter_mut().zip(&ids) {
        r.id.clone_from(id);
        r.reference = Some(steps.reference(id));
        r.ts = steps.ts();
    }
    // Each serialised and dropped, as the writer drops it once written
    // (keeping 200,000 of them would time page faults, not the step).
    let t = Instant::now();
    for r in &records {
        black_box(steps.serialise(r));
    }
    let ser_ns = per(t);
    let lines: Vec<_> = records.iter().map(|r| steps.serialise(r)).collect();
    let mut batch = Vec::with_capacity(1 << 20);
    let mut prev = "0".repeat(64);
    let mut bytes = 0usize;
    let mut hashes = Vec::with_capacity(n as usize);
    let t = Instant::now();
    for (seq, line) in lines.iter().enumerate() {
        prev = steps.chain(line, seq as u64, &prev, &mut batch);
        hashes.push(prev.clone());
        if batch.len() > (1 << 20) - 4096 {
            bytes += batch.len();
            batch.clear();
        }
    }
    let chain_ns = per(t);
    bytes += batch.len();
    let mut tree = palisade::evidence::costs::Tree::default();
    let t = Instant::now();
    for h in &hashes {
        steps.leaf(h, &mut tree);
    }
    let leaf_ns = per(t);
    // The org trees: records of 8 orgs in turn (the leaf is the one the
    // global tree computed; timed here with it, as a bench cannot share it).
    let org_names: Vec<String> = (0..8).map(|i| format!("org-{i}")).collect();
    let mut orgs = palisade::evidence::costs::Orgs::default();
    let t = Instant::now();
    for (i, h) in hashes.iter().enumerate() {
        steps.org_leaf(&org_names[i % 8], h, &mut orgs);
    }
    let org_ns = per(t);
    let notes = 1000u32;
    let t = Instant::now();
    for _ in 0..notes {
        black_box(steps.checkpoint_note(&tree));
    }
    let note_ns = t.elapsed().as_nanos() as f64 / f64::from(notes);
    let t = Instant::now();
    for _ in 0..notes {
        black_box(steps.org_commitment(&orgs));
    }
    let orgs_ns = t.elapsed().as_nanos() as f64 / f64::from(notes);
    // Witnesses: each leaf copied into the write's feed; per checkpoint
    // and witness, a consistency proof over the last 1000 leaves, the
    // request body and the check of the cosignature.
    let mut feed = Vec::with_capacity(hashes.len());
    let t = Instant::now();
    for h in &hashes {
        steps.witness_leaf(h, &mut feed);
    }
    let feed_ns = per(t);
    let cut = feed.len().saturating_sub(1000);
    let before = steps.grown(&palisade::evidence::costs::Tree::default(), &feed[..cut]);
    let note = steps.checkpoint_note(&tree);
    let t = Instant::now();
    for _ in 0..notes {
        black_box(steps.witness_round(&before, &feed[cut..], &note));
    }
    let witness_ns = t.elapsed().as_nanos() as f64 / f64::from(notes);
    let total = id_ns + ref_ns + ts_ns + ser_ns + chain_ns + leaf_ns + org_ns + feed_ns;
    println!(
        "a record's steps ({n} tunnel decision records, {} bytes per line):",
        bytes as u64 / n
    );
    for (what, ns) in [
        ("id", id_ns),
        ("reference (HMAC-SHA256 of the id)", ref_ns),
        ("timestamp", ts_ns),
        ("canonical serialisation", ser_ns),
        ("chaining (SHA-256, copy into the batch)", chain_ns),
        ("Merkle leaf (SHA-256 of the hash, frontier)", leaf_ns),
        ("org tree (leaf again, org's frontier)", org_ns),
        ("witness feed (leaf again, copied)", feed_ns),
    ] {
        println!("  {what:<42} {ns:>7.0} ns  ({:>4.1}%)", ns * 100.0 / total);
    }
    println!("  {:<42} {total:>7.0} ns", "all steps");
    println!(
        "  {:<42} {note_ns:>7.0} ns  (once per checkpoint)",
        "checkpoint note (root, Ed25519 signature)"
    );
    println!(
        "  {:<42} {orgs_ns:>7.0} ns  (once per checkpoint, 8 orgs)",
        "org commitment (8 org roots, orgs_root)"
    );
    println!(
        "  {:<42} {witness_ns:>7.0} ns  (once per checkpoint and witness)",
        "witness round (proof, body, cosignature)"
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let only = |part: &str| {
        let named: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        named.is_empty() || named.iter().any(|a| a == part)
    };
    let (rounds, secs) = if full { (3, 4.0) } else { (1, 0.3) };
    let base: PathBuf = std::env::var_os("EVIDENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let root = tempfile::Builder::new()
        .prefix("palisade-evbench-")
        .tempdir_in(&base)
        .unwrap()
        .into_path();
    if only("steps") {
        steps_part(full);
    }
    if only("append") {
        append_part(&root, full);
    }
    if !only("proxy") {
        let _ = std::fs::remove_dir_all(&root);
        return;
    }
    let rt = common::runtime();
    let up = rt.block_on(common::http_upstream());
    let modes = ["discard", "os", "fsync"];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for _ in 0..rounds {
        for (i, mode) in modes.iter().enumerate() {
            let (child, proxy) = start(&root, mode, up);
            rt.block_on(common::absolute_get_load(proxy, up, CONCURRENCY, 0.2)); // warm-up
            results[i].push(rt.block_on(common::absolute_get_load(proxy, up, CONCURRENCY, secs)));
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
