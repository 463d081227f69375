//! A UDP flood faster than the shim answers (`tests/fixtures/udpflood.c`:
//! `sendmmsg`, replies never read), as a hostile sandbox sends it. Its
//! socket's receive buffer is then full most of the time and the kernel
//! drops what reaches it, whoever sent it: the shim cannot be fair about
//! datagrams it never reads. What keeps another org answered is a listen
//! address of its own that only its sandboxes can reach (a gateway rule:
//! docs/dns.md, "Bounds"), whose socket and buffer the flood does not
//! reach. The flooder ignores where it was told to ask and floods both
//! addresses. Checked here: the flood overflows the address it shares
//! (or the test would prove nothing), the rule dropped its datagrams to
//! beta's, and beta, asking on its own address all the while, has every
//! query answered.

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

/// In the shim's namespace, as the gateway would have it: beta's address
/// (port 5353) takes only beta's range; the counter shows what was dropped.
const GATEWAY_RULE: &str = "
table inet dns_per_org {
  chain input {
    type filter hook input priority 0; policy accept;
    udp dport 5353 ip saddr != 198.18.4.0/24 counter drop
  }
}
";

/// Packets the gateway rule dropped so far.
fn rule_drops(lab: &Lab) -> u64 {
    let out = lab.proxy_ns_exec("nft", &["list", "table", "inet", "dns_per_org"]);
    assert!(out.success(), "nft list: {}", out.describe());
    out.stdout
        .split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in: {}", out.stdout))
}

/// Compile the flooder into the lab's directory.
fn flooder(dir: &Path) -> String {
    let src = lab::fixtures_dir().join("udpflood.c");
    let bin = dir.join("udpflood");
    let out = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
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

    let rule = lab.exec_input(
        &lab.ns_proxy,
        "nft",
        &["-f", "-"],
        Some(GATEWAY_RULE.as_bytes()),
    );
    assert!(rule.success(), "nft -f: {}", rule.describe());

    // acme floods both addresses, one flooder each.
    let out = lab.dir.join("udpflood.out");
    let script = format!(
        "for port in 53 5353; do {bin} {CLIENT_IP} {SHIM_IP} $port other.test {FLOOD_SECS} & done; \
         wait"
    );
    let mut flood = lab.client_spawn(&script, &out);
    // Let the flood fill the socket it aims at.
    std::thread::sleep(Duration::from_secs(2));
    let drops_before = lab.shim_rcvbuf_drops();
    let ruled_before = rule_drops(&lab);

    let mut took = Vec::new();
    let mut failed = Vec::new();
    for i in 0..QUERIES {
        match beta_asks(&lab, 5353, 3) {
            Ok(t) => took.push(t),
            Err(e) => failed.push(format!("query {i}: {e}")),
        }
    }
    // For the record, not asserted: beta on the shared address meanwhile,
    // one try each.
    let shared = (0..5).filter(|_| beta_asks(&lab, 53, 1).is_ok()).count();
    let drops = lab.shim_rcvbuf_drops() - drops_before;
    let ruled = rule_drops(&lab) - ruled_before;
    let still_flooding = flood.try_wait().expect("poll the flooder").is_none();
    // SIGTERM to the shell's children: both flooders stop and print their
    // counts, then the shell's `wait` returns.
    let parent = flood.id().to_string();
    let _ = Command::new("pkill")
        .args(["-TERM", "-P", &parent])
        .status();
    let stopped = Instant::now();
    while flood
        .try_wait()
        .expect("poll the flooders' shell")
        .is_none()
    {
        if stopped.elapsed() > Duration::from_secs(5) {
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &parent])
                .status();
            let _ = flood.kill();
            let _ = flood.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = std::fs::read_to_string(&out).unwrap_or_default();

    took.sort();
    eprintln!(
        "dns_flood: the flooders {} ({} when beta was done); while beta asked, the shim's \
         sockets dropped {drops} datagrams and the gateway rule {ruled} of acme's to beta's \
         address; beta on its own address: {} of {QUERIES} answered (three tries each), \
         slowest {:?}; on the shared address: {shared} of 5 (one try each)",
        sent.lines().collect::<Vec<_>>().join(" and "),
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
        ruled >= MIN_DROPS,
        "acme's flood to beta's address was not dropped by the gateway rule: {ruled} packets"
    );
    assert!(
        failed.is_empty(),
        "beta, asking on its own address, was not answered under the flood: {failed:?}"
    );
    assert!(still_flooding, "the flood ended before beta was done");
}
