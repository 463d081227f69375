//! A UDP flood faster than the shim answers (`tests/fixtures/udpflood.c`:
//! `sendmmsg`, replies never read), as a hostile sandbox sends it. Its
//! socket's receive buffer is then full most of the time and the kernel
//! drops what reaches it, whoever sent it: the shim cannot be fair about
//! datagrams it never reads. What keeps another org answered is a listen
//! address of its own, whose socket and buffer the flood does not reach
//! (docs/dns.md, "Bounds"). Checked here: the flood overflows the socket it
//! aims at (or the test would prove nothing), and beta, asking on its own
//! address all the while, has every query answered.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::lab::{self, Lab, CLIENT2_IP, CLIENT_IP, OTHER_IP, SHIM_IP};

/// acme floods from the first sandbox; beta, in the second, asks.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "other.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "other.test"
"#;

/// The flood's own bound; it is stopped as soon as beta is done.
const FLOOD_SECS: u64 = 120;
/// beta's queries under the flood, one after another.
const QUERIES: usize = 20;
/// The flood must have made the kernel drop at least this many datagrams
/// at the shim's sockets while beta asked: a flood the shim kept up with
/// would not be the case under test.
const MIN_DROPS: u64 = 10_000;

/// Compile the flooder into the lab's directory.
fn flooder(dir: &Path) -> String {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/udpflood.c");
    let bin = dir.join("udpflood");
    let out = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(src)
        .output()
        .expect("run cc (installed by .ci/run)");
    assert!(
        out.status.success(),
        "cc udpflood.c: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    bin.display().to_string()
}

/// beta asks for other.test on `port` of the shim, `tries` times at most,
/// 2 s each: answered as allowed?
fn beta_asks(lab: &Lab, port: u16, tries: u8) -> Result<Duration, String> {
    let server = format!("@{SHIM_IP}");
    let port = port.to_string();
    let tries = format!("+tries={tries}");
    let args = [
        "+time=2",
        &tries,
        "+nocookie",
        &server,
        "-p",
        &port,
        "-b",
        CLIENT2_IP,
        "other.test",
        "A",
    ];
    let started = Instant::now();
    let out = lab.exec(&lab.ns_client2, "dig", &args);
    let d = lab::Dig::parse(&out.stdout, out.code());
    if d.status == "NOERROR" && d.of("A") == [OTHER_IP] {
        Ok(started.elapsed())
    } else {
        Err(out.describe())
    }
}

#[test]
fn a_udp_flood_faster_than_the_shim_leaves_another_orgs_own_address_answered() {
    let _alone = lab::FLOOD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&[&format!("{SHIM_IP}:53"), &format!("{SHIM_IP}:5353")])
        .second_client()
        .evidence_config("max_records_per_second_per_org = 300")
        .start();
    let bin = flooder(&lab.dir);
    // Quiet: both addresses answer beta (and other.test is kept).
    for port in [53, 5353] {
        beta_asks(&lab, port, 3).unwrap_or_else(|e| panic!("quiet, port {port}: {e}"));
    }

    let out = lab.dir.join("udpflood.out");
    let script = format!("exec {bin} {CLIENT_IP} {SHIM_IP} 53 other.test {FLOOD_SECS}");
    let mut flood = lab.client_spawn(&script, &out);
    // Let the flood fill the socket it aims at.
    std::thread::sleep(Duration::from_secs(2));
    let drops_before = lab.shim_rcvbuf_drops();

    let mut took = Vec::new();
    let mut failed = Vec::new();
    for i in 0..QUERIES {
        match beta_asks(&lab, 5353, 3) {
            Ok(t) => took.push(t),
            Err(e) => failed.push(format!("query {i}: {e}")),
        }
    }
    // For the record, not asserted: beta on the flooded address meanwhile,
    // one try each.
    let shared = (0..5).filter(|_| beta_asks(&lab, 53, 1).is_ok()).count();
    let drops = lab.shim_rcvbuf_drops() - drops_before;
    let still_flooding = flood.try_wait().expect("poll the flooder").is_none();
    // SIGTERM: the flooder stops and prints its count.
    let _ = Command::new("kill")
        .args(["-TERM", &flood.id().to_string()])
        .status();
    let stopped = Instant::now();
    while flood.try_wait().expect("poll the flooder").is_none() {
        if stopped.elapsed() > Duration::from_secs(5) {
            let _ = flood.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = std::fs::read_to_string(&out).unwrap_or_default();

    took.sort();
    eprintln!(
        "dns_flood: the flooder {} ({} when beta was done); the shim's sockets dropped \
         {drops} datagrams while beta asked; beta on its own address: {} of {QUERIES} \
         answered (three tries each), slowest {:?}; on the flooded address: {shared} of 5 \
         (one try each)",
        sent.trim(),
        if still_flooding {
            "still running"
        } else {
            "had stopped"
        },
        took.len(),
        took.last()
    );
    assert!(
        drops >= MIN_DROPS,
        "the flood was not faster than the shim: only {drops} datagrams dropped"
    );
    assert!(
        failed.is_empty(),
        "beta, asking on its own address, was not answered under the flood: {failed:?}"
    );
    assert!(still_flooding, "the flood ended before beta was done");
}
