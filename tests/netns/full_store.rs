//! A full evidence store as a hostile sandbox fills it: as fast as it can,
//! and with many tunnels that it closes all at once.
//!
//! Both tests put the evidence dir on a small tmpfs with `min_free =
//! "1MiB"` and two orgs: acme (the first sandbox) fills the store, beta
//! (the second) must still be served and recorded once acme is refused.
//! Free space is accounted per write and the closes of acme's open
//! connections are reserved when they are allowed, so neither a flood
//! faster than `min_free` a second nor 2,000 closes at once can empty the
//! margin kept for beta. The flood's rate and the free space left are
//! printed for the record, never asserted: the machine is shared.

use std::fs;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::lab::{self, Lab, BANNER_PORT, CLIENT2_IP, PROXY_URL};

/// acme floods from the first sandbox; beta, in the second, works. acme
/// may also hold tunnels to the banner port (server speaks first).
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80]
[[org.allow]]
host = "allowed.test"
ports = [2222]
tunnel = "opaque"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
ports = [80]
"#;

const MIN_FREE: &str = "min_free = \"1MiB\"";

/// The flooder: `PROCS` processes, each one keep-alive connection
/// (reopened only when the proxy closes it) sending absolute-form GETs
/// with a path of `PAD` characters and more back to back, bounded by time
/// and count.
/// With `stop` set, each stops at its first store-full refusal. Prints
/// `started`, `refused` at each process's first store-full refusal, then
/// the counts as JSON (`first_refused`: the Unix time of the first).
const FLOOD_SCRIPT: &str = r#"
import http.client, json, multiprocessing as mp, sys, time
SECS, MAX, PROCS, TAG, STOP = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "stop"
PAD = "x" * int(sys.argv[6])
def worker(i, q):
    end = time.time() + SECS
    c = {"sent": 0, "ok": 0, "store_full": 0, "budget_spent": 0, "unavailable": 0, "other": 0, "first_refused": None}
    h = None
    while time.time() < end and c["sent"] < MAX:
        if h is None:
            h = http.client.HTTPConnection("198.18.1.1", 3128, timeout=10)
        path = "/%s-%d-%07d-%s" % (TAG, i, c["sent"], PAD)
        try:
            h.request("GET", "http://allowed.test" + path, headers={"Host": "allowed.test"})
            r = h.getresponse()
            body = r.read().decode("utf-8", "replace")
        except Exception:
            c["other"] += 1
            h.close(); h = None
            time.sleep(0.01)
            continue
        c["sent"] += 1
        if r.status == 200:
            c["ok"] += 1
        elif "evidence store full for this org" in body:
            c["store_full"] += 1
            if c["first_refused"] is None:
                c["first_refused"] = time.time()
                print("refused", c["first_refused"], flush=True)
            if STOP:
                break
        elif "evidence budget spent" in body:
            c["budget_spent"] += 1
        elif "evidence_unavailable" in body:
            c["unavailable"] += 1
        else:
            c["other"] += 1
        if (r.getheader("Connection") or "").lower() == "close":
            h.close(); h = None
    q.put(c)
if __name__ == "__main__":
    q = mp.Queue()
    ps = [mp.Process(target=worker, args=(i, q)) for i in range(PROCS)]
    t0 = time.time()
    for p in ps:
        p.start()
    print("started", flush=True)
    got = [q.get(timeout=SECS + 60) for _ in ps]
    for p in ps:
        p.join(10)
    total = {k: sum(g[k] for g in got) for k in ("sent", "ok", "store_full", "budget_spent", "unavailable", "other")}
    firsts = [g["first_refused"] for g in got if g["first_refused"] is not None]
    total["first_refused"] = min(firsts) if firsts else None
    total["secs"] = round(time.time() - t0, 3)
    total["procs"] = PROCS
    print(json.dumps(total), flush=True)
"#;

/// beta's requests: `N` absolute-form GETs over one keep-alive
/// connection (reopened only when the proxy closes it), paths
/// `/beta-bulk-I-` and 230 characters. Prints the counts as JSON.
const BETA_SCRIPT: &str = r#"
import http.client, json, sys, time
N, END = int(sys.argv[1]), time.time() + float(sys.argv[2])
c = {"sent": 0, "ok": 0, "refused": []}
h = None
while c["sent"] < N and time.time() < END:
    if h is None:
        h = http.client.HTTPConnection("198.18.1.1", 3128, timeout=10)
    try:
        h.request("GET", "http://allowed.test/beta-bulk-%d-%s" % (c["sent"], "y" * 230), headers={"Host": "allowed.test"})
        r = h.getresponse()
        body = r.read().decode("utf-8", "replace")
    except Exception as e:
        c["refused"].append(repr(e)); h.close(); h = None; c["sent"] += 1
        continue
    c["sent"] += 1
    if r.status == 200:
        c["ok"] += 1
    elif len(c["refused"]) < 5:
        c["refused"].append("%d %s" % (r.status, body.strip()))
    if (r.getheader("Connection") or "").lower() == "close":
        h.close(); h = None
print(json.dumps(c), flush=True)
"#;

/// Holds `N` tunnels of acme to the banner port: each CONNECT is sent
/// with its first bytes, then every tunnel is read until the banner came
/// through. Prints `holding K`; keeps them alive (a byte every 5 s) until
/// the file `TRIGGER` exists, then closes them all at once and prints
/// `closed`. Bounded by `LIMIT` seconds.
const HOLD_SCRIPT: &str = r#"
import os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
N, TRIGGER, LIMIT = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
end = time.time() + LIMIT
req = b"CONNECT allowed.test:2222 HTTP/1.1\r\nHost: allowed.test:2222\r\n\r\nhello\n"
socks = []
for i in range(N):
    try:
        s = socket.create_connection(("198.18.1.1", 3128), timeout=10)
        s.sendall(req)
        socks.append(s)
    except Exception:
        break
held = 0
for s in socks:
    data = b""
    while b"SSH-2.0-test" not in data and time.time() < end:
        try:
            chunk = s.recv(4096)
        except Exception:
            break
        if not chunk:
            break
        data += chunk
    if data.startswith(b"HTTP/1.1 200") and b"SSH-2.0-test" in data:
        held += 1
print("holding", held, flush=True)
last = time.time()
while not os.path.exists(TRIGGER) and time.time() < end:
    time.sleep(0.05)
    if time.time() - last > 5:
        for s in socks:
            try:
                s.send(b".")
                s.recv(65536, socket.MSG_DONTWAIT)
            except Exception:
                pass
        last = time.time()
t = time.time()
for s in socks:
    s.close()
print("closed", len(socks), round(time.time() - t, 3), flush=True)
"#;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Free bytes on the evidence tmpfs (inside Palisade's mount namespace).
fn free_bytes(lab: &Lab) -> Option<u64> {
    let dir = lab.evidence_dir.display().to_string();
    let out = lab.proxy_mnt_exec("stat", &["-f", "-c", "%a %S", &dir]);
    let mut w = out.stdout.split_whitespace();
    let avail: u64 = w.next()?.parse().ok()?;
    let block: u64 = w.next()?.parse().ok()?;
    Some(avail * block)
}

/// Evidence lines inside Palisade's mount namespace containing `needle`.
fn records_with(lab: &Lab, needle: &str) -> Vec<Value> {
    let dir = lab.evidence_dir.display().to_string();
    let out = lab.proxy_mnt_exec(
        "sh",
        &[
            "-c",
            "cat \"$0\"/palisade-*.jsonl | grep -F \"$1\"",
            &dir,
            needle,
        ],
    );
    out.stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Start the flooder of acme (`procs` processes, for at most `secs` and
/// `max` requests each, paths of `pad` characters and more; with `stop`,
/// each stops at its first store-full refusal); wait (bounded) for it to
/// start.
pub(crate) fn start_flood(
    lab: &Lab,
    tag: &str,
    (secs, max, procs): (u64, u64, u32),
    pad: usize,
    stop: bool,
) -> Flood {
    let out = lab.dir.join(format!("flood-{tag}.out"));
    let stop = if stop { "stop" } else { "go" };
    let script =
        format!("python3 - {secs} {max} {procs} {tag} {stop} {pad} <<'EOF'\n{FLOOD_SCRIPT}\nEOF");
    let child = lab.client_spawn(&script, &out);
    lab::wait_until("the flood to start", Duration::from_secs(10), || {
        fs::read_to_string(&out).is_ok_and(|t| t.starts_with("started"))
    });
    Flood {
        child,
        out,
        deadline: Instant::now() + Duration::from_secs(secs + 60),
    }
}

pub(crate) struct Flood {
    child: std::process::Child,
    out: std::path::PathBuf,
    deadline: Instant,
}

impl Flood {
    /// Its counts, once it ended on its own (bounded).
    pub(crate) fn counts(mut self) -> Value {
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < self.deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let text = fs::read_to_string(&self.out).unwrap_or_default();
        let last = text.lines().last().unwrap_or_default();
        serde_json::from_str(last).unwrap_or_else(|e| panic!("flood counts {last:?}: {e}"))
    }
}

/// One request of beta's, from the second sandbox: its status, and its
/// path and local port to find its record by.
fn beta_request(lab: &Lab, path: &str) -> (u16, String, String) {
    let r = lab.curl_in(
        &lab.ns_client2,
        &["-x", PROXY_URL, &format!("http://allowed.test{path}")],
    );
    let client = format!("{CLIENT2_IP}:{}", r.local_port.unwrap_or(0));
    (r.status, r.body, client)
}

/// Every one of beta's requests is on record as allowed, by path and
/// client.
fn assert_beta_on_record(lab: &Lab, served: &[(String, String)]) {
    let records = records_with(lab, "\"org\":\"beta\"");
    for (path, client) in served {
        assert!(
            records.iter().any(|r| r["event"] == "decision"
                && r["decision"] == "allow"
                && r["path"] == path.as_str()
                && r["client"] == client.as_str()),
            "beta's {path} from {client} is not on record"
        );
    }
}

fn verify_inside(lab: &Lab, ctx: &str) {
    let dir = lab.evidence_dir.display().to_string();
    let v = lab.proxy_mnt_exec(
        lab::palisade_bin(),
        &["evidence", "verify", &dir, "--allow-unsealed"],
    );
    assert!(v.success(), "{ctx}: evidence verify:\n{}", v.describe());
}

#[test]
fn a_flood_as_fast_as_the_sandbox_can_send_leaves_the_margin_to_the_other_org() {
    const MARGIN: u64 = 1 << 20;
    const BETA_BULK: u64 = 300;
    let lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .evidence_tmpfs("4m")
        .evidence_config(MIN_FREE)
        .start();
    let (status, body, _) = beta_request(&lab, "/beta-before");
    assert_eq!(status, 200, "{body}");

    // Free space, sampled while acme floods (bounded by the flag and time).
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (flood, bulk, beta, samples) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut v = Vec::new();
            let end = Instant::now() + Duration::from_secs(90);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < end {
                if let Some(f) = free_bytes(&lab) {
                    v.push((unix_now(), f));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            v
        });
        // Four processes, one keep-alive connection each, back to back
        // for 15 s.
        let flood = start_flood(&lab, "flood", (15, 1_000_000, 4), 230, false);
        lab::wait_until("acme to be refused", Duration::from_secs(30), || {
            fs::read_to_string(&flood.out).is_ok_and(|t| t.contains("refused"))
        });
        // beta, while acme goes on flooding: 300 requests (about 0.5 MB
        // of evidence, half the margin).
        let bulk = lab.exec(
            &lab.ns_client2,
            "python3",
            &["-c", BETA_SCRIPT, &BETA_BULK.to_string(), "18"],
        );
        let counts = flood.counts();
        let mut beta = Vec::new();
        for i in 0..5 {
            let path = format!("/beta-after-{i}");
            beta.push((path.clone(), beta_request(&lab, &path)));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (counts, bulk, beta, sampler.join().expect("sampler"))
    });

    let first_refused = flood["first_refused"].as_f64();
    let free_at_refusal =
        first_refused.and_then(|t| samples.iter().find(|(at, _)| *at >= t).map(|(_, f)| *f));
    let free_end = free_bytes(&lab);
    let rate = flood["sent"].as_f64().unwrap_or(0.0) / flood["secs"].as_f64().unwrap_or(1.0);
    println!(
        "full store flood figures: acme {flood}; {rate:.0} requests/s; free space when acme was first refused: {free_at_refusal:?} bytes; \
         beta {}; at the end: {free_end:?} bytes; lowest sampled: {:?} bytes",
        bulk.stdout.trim(),
        samples.iter().map(|s| s.1).min()
    );

    let bulk: Value = serde_json::from_str(bulk.stdout.trim())
        .unwrap_or_else(|e| panic!("beta's counts: {e}: {}", bulk.describe()));
    assert_eq!(
        bulk["ok"], BETA_BULK,
        "beta refused while acme floods a full store (acme {flood}): {bulk}"
    );
    let failed: Vec<_> = beta
        .iter()
        .filter(|(_, (status, _, _))| *status != 200)
        .map(|(path, (status, body, _))| format!("{path}: {status} {body}"))
        .collect();
    assert!(
        failed.is_empty(),
        "beta refused after acme's flood ({flood}):\n{}",
        failed.join("\n")
    );
    assert!(
        flood["store_full"].as_u64().unwrap_or(0) > 0,
        "acme's flood never filled the store: {flood}"
    );
    assert_eq!(
        flood["unavailable"], 0,
        "nobody fails closed while acme alone is over its share: {flood}"
    );
    // The margin was kept for the others when acme was refused: what
    // crossed it is at most the few requests already decided (4 in
    // flight) and the tmpfs's pages.
    let at_refusal = free_at_refusal.expect("free space sampled after acme's first refusal");
    assert!(
        at_refusal + (128 << 10) >= MARGIN,
        "acme was refused with {at_refusal} bytes left of a margin of {MARGIN}"
    );
    // beta: every request on record.
    let bulk_recorded = records_with(&lab, "/beta-bulk-")
        .iter()
        .filter(|r| r["org"] == "beta" && r["event"] == "decision" && r["decision"] == "allow")
        .count();
    assert_eq!(bulk_recorded as u64, BETA_BULK, "beta's requests on record");
    let served: Vec<(String, String)> = beta
        .iter()
        .map(|(path, (_, _, client))| (path.clone(), client.clone()))
        .collect();
    assert_beta_on_record(&lab, &served);
    verify_inside(&lab, "after the flood");
}

#[test]
fn an_org_closing_2000_tunnels_at_once_into_a_full_store_leaves_the_margin_to_the_other_org() {
    const TUNNELS: usize = 2000;
    let lab = Lab::builder()
        .policy(POLICY)
        .second_client()
        .proxy_option("max_connections_per_org = 2100")
        .evidence_tmpfs("8m")
        .evidence_config(MIN_FREE)
        .start();
    let (status, body, _) = beta_request(&lab, "/beta-before");
    assert_eq!(status, 200, "{body}");

    // acme opens its tunnels while the store has room.
    let trigger = lab.dir.join("close-now");
    let out = lab.dir.join("hold.out");
    let script = format!(
        "python3 - {TUNNELS} {} 120 <<'EOF'\n{HOLD_SCRIPT}\nEOF",
        trigger.display()
    );
    let mut holder = lab.client_spawn(&script, &out);
    lab::wait_until("the tunnels to open", Duration::from_secs(90), || {
        fs::read_to_string(&out).is_ok_and(|t| t.contains("holding"))
    });
    let said = fs::read_to_string(&out).unwrap_or_default();
    assert!(
        said.contains(&format!("holding {TUNNELS}")),
        "acme could not open {TUNNELS} tunnels: {said}\n{}",
        lab.proxy_output()
    );
    let free_open = free_bytes(&lab).expect("free space");

    // Something else fills the file system, leaving 2.5 MiB: room for
    // acme's closes, but not for them and the margin both.
    let leave = 5 << 19;
    let dir = lab.evidence_dir.display().to_string();
    let blocks = free_open.saturating_sub(leave) / 4096;
    let dd = lab.proxy_mnt_exec(
        "dd",
        &[
            "if=/dev/zero",
            &format!("of={dir}/fill"),
            "bs=4096",
            &format!("count={blocks}"),
        ],
    );
    assert!(dd.success(), "{}", dd.describe());
    let free_filled = free_bytes(&lab).expect("free space");

    // acme writes until it is refused (one connection, stopping at its
    // first store-full refusal): the store is full.
    let fill = start_flood(&lab, "fill", (30, 20_000, 1), 230, true).counts();
    assert!(
        fill["store_full"].as_u64().unwrap_or(0) > 0,
        "acme was never refused: {fill}"
    );
    let free_refused = free_bytes(&lab);

    // acme closes every tunnel at once.
    fs::write(&trigger, b"").unwrap();
    lab::wait_until("the tunnels to close", Duration::from_secs(30), || {
        fs::read_to_string(&out).is_ok_and(|t| t.contains("closed"))
    });
    let _ = holder.wait();
    // Their closes reach the writer (bounded wait: on a full disk they
    // cannot all be written).
    let closes = || {
        records_with(&lab, "\"event\":\"close\"")
            .iter()
            .filter(|r| r["port"] == BANNER_PORT && r["org"] == "acme")
            .count()
    };
    let end = Instant::now() + Duration::from_secs(15);
    while closes() < TUNNELS && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
    }
    let free_closed = free_bytes(&lab);

    // beta is still served, and recorded.
    let mut served = Vec::new();
    let mut failed = Vec::new();
    for i in 0..10 {
        let path = format!("/beta-after-closes-{i}");
        let (status, body, client) = beta_request(&lab, &path);
        if status == 200 {
            served.push((path, client));
        } else {
            failed.push(format!("{path}: {status} {body}"));
        }
    }
    let recorded = closes();
    println!(
        "full store closes figures: {TUNNELS} tunnels held; free space with them open {free_open} bytes, after the fill {free_filled}, \
         when acme was refused {free_refused:?} (acme {fill}), after the closes {free_closed:?}; closes on record {recorded}"
    );
    assert!(
        failed.is_empty(),
        "beta refused after acme closed {TUNNELS} tunnels:\n{}",
        failed.join("\n")
    );
    assert_beta_on_record(&lab, &served);
    assert_eq!(recorded, TUNNELS, "every close is on record");
    verify_inside(&lab, "after the closes");
}
