//! Noisy neighbours at the DNS shim: one client or one org can neither take
//! every DNS-over-TCP place, nor evict another org's bindings, nor learn
//! from answer TTLs that another org looked a name up.

use std::time::{Duration, Instant};

use crate::dns::dig2;
use crate::lab::{Dig, Lab, CLIENT2_IP, OTHER_IP, SHIM_IP};

/// Two orgs: acme in the first sandbox, beta in the second; both may reach
/// allowed.test.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "*.wild.test"
[[org.allow]]
host = "wild.test"
[[org.allow]]
host = "untrusted.test"
[[org.allow]]
host = "xn--bcher-kva.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "other.test"
[[org.allow]]
host = "allowed.test"
"#;

fn lab(dns_extra: &str) -> Lab {
    Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra(dns_extra)
        .second_client()
        .start()
}

/// TTLs of the answer records of one type, as dig printed them.
fn ttls(d: &Dig, rtype: &str) -> Vec<u32> {
    d.output
        .lines()
        .filter(|l| !l.starts_with(';'))
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() >= 5 && f[3] == rtype)
        .filter_map(|f| f[1].parse().ok())
        .collect()
}

#[test]
fn one_client_holding_tcp_connections_cannot_stop_another_orgs_tcp_query() {
    // Eight places in all; one client may hold three, one org four.
    let lab = lab(
        "max_tcp_connections = 8\nmax_tcp_connections_per_client = 3\n\
         max_tcp_connections_per_org = 4\nidle_timeout = \"30s\"\n",
    );
    let out = lab.dir.join("holder.out");
    // acme's client opens 20 connections and holds them, silent.
    let script = format!(
        r#"python3 - <<'EOF'
import socket, sys, time
held = []
for _ in range(20):
    s = socket.create_connection(("{SHIM_IP}", 53), timeout=3)
    held.append(s)
time.sleep(0.5)
def closed(s):
    s.settimeout(0.3)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True
shut = sum(1 for s in held if closed(s))
print(f"held={{len(held) - shut}} closed={{shut}}", flush=True)
time.sleep(15)
EOF"#
    );
    let mut holder = lab.client_spawn(&script, &out);
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.starts_with("held=")) {
            break l.to_string();
        }
        assert!(Instant::now() < deadline, "holder printed nothing");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(line, "held=3 closed=17", "{}", lab.proxy_output());

    // While they are held, beta's client is answered over TCP.
    let d = dig2(&lab, &["other.test", "A", "+tcp"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("A"), [OTHER_IP], "{}", d.output);
    let rec = lab.wait_evidence("beta's TCP answer", |v| {
        v["host"] == "other.test" && v["decision"] == "allow"
    });
    crate::assert_client_ip(&rec, CLIENT2_IP);

    // The connections closed at once were recorded, with the limit.
    let rec = lab.wait_evidence("a TCP connection over the per-client cap", |v| {
        v["kind"] == "dns"
            && v["reason"] == "limit_exceeded"
            && v["detail"] == "max_tcp_connections_per_client reached"
    });
    assert_eq!(rec["org"], "acme", "{rec}");
    assert_eq!(rec["decision"], "deny", "{rec}");
    let _ = holder.kill();
    let _ = holder.wait();
}

#[test]
fn an_org_churning_names_does_not_evict_another_orgs_binding() {
    // Room for four bindings, two per org.
    let lab = lab("max_bindings = 4\nmax_bindings_per_org = 2\n");
    let d = dig2(&lab, &["other.test", "A"]);
    assert_eq!(d.of("A"), [OTHER_IP], "{}", d.output);

    // acme asks five names with addresses: over its share, and over all.
    for name in [
        "allowed.test",
        "a.wild.test",
        "wild.test",
        "untrusted.test",
        "xn--bcher-kva.test",
    ] {
        let d = lab.dig(&[name, "A"]);
        assert_eq!(d.status, "NOERROR", "{name}: {}", d.output);
        assert_eq!(d.of("A").len(), 1, "{name}: {}", d.output);
    }

    // beta's binding is intact: its PTR is answered from it.
    let d = dig2(&lab, &["-x", OTHER_IP]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("PTR"), ["other.test."], "{}", d.output);
    // acme lost its own oldest, and kept its newest.
    let d = lab.dig(&["-x", crate::lab::WILD_A_IP]);
    assert_eq!(d.status, "REFUSED", "a.wild.test still bound: {}", d.output);
    let d = lab.dig(&["-x", crate::lab::UNTRUSTED_IP]);
    assert_eq!(d.of("PTR"), ["untrusted.test."], "{}", d.output);
}

#[test]
fn ttl_seen_by_another_org_equals_the_first_orgs() {
    let lab = lab("");
    let first = lab.dig(&["allowed.test", "A"]);
    let a = ttls(&first, "A");
    // The fixture's TTL, as fetched.
    assert_eq!(a, [60], "{}", first.output);
    // Later, from the other org, through the same cache.
    std::thread::sleep(Duration::from_millis(2500));
    let second = dig2(&lab, &["allowed.test", "A"]);
    assert_eq!(ttls(&second, "A"), a, "{}", second.output);
    // The cache did serve it: it went upstream once.
    let asked = lab
        .dns_log()
        .iter()
        .filter(|v| v["name"] == "allowed.test" && v["qtype"] == 1)
        .count();
    assert_eq!(asked, 1, "{}", crate::lab::dump(&lab.dns_log()));
}

/// Sends N A queries for allowed.test over UDP (with EDNS, so refusals
/// carry their Extended DNS Error), as fast as it can, reading answers as
/// they come (bounded to 20 s), then prints one JSON line: the seconds
/// taken, the count per rcode, and the raw EDE text of one REFUSED.
const DNS_BURST: &str = r#"
import json, socket, struct, sys, time
D = ("198.18.1.1", 53)
OPT = b"\x00" + struct.pack(">HHIH", 41, 1232, 0, 0)
def query(qid):
    h = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 1)
    q = b"".join(bytes([len(l)]) + l.encode() for l in "allowed.test".split(".")) + b"\0"
    return h + q + struct.pack(">HH", 1, 1) + OPT
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.0)
names = {0: "NOERROR", 5: "REFUSED"}
counts, ede, seen = {}, "", set()
t0 = time.time()
n = int(sys.argv[1])
sent = 0
while (sent < n or len(seen) < sent) and time.time() - t0 < 20:
    if sent < n and sent - len(seen) < 32:
        s.sendto(query(sent), D)
        sent += 1
        continue
    try:
        r = s.recv(4096)
    except OSError:
        break
    qid, flags = struct.unpack(">HH", r[:4])
    if qid in seen:
        continue
    seen.add(qid)
    rcode = names.get(flags & 0xF, str(flags & 0xF))
    counts[rcode] = counts.get(rcode, 0) + 1
    if rcode == "REFUSED" and b"palisade" in r:
        ede = r[r.index(b"palisade"):].decode(errors="replace")
print(json.dumps({"secs": time.time() - t0, "counts": counts, "ede": ede}), flush=True)
"#;

#[test]
fn an_orgs_answers_over_its_evidence_budget_are_refused_and_summarised() {
    const BUDGET: u64 = 20;
    let lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .second_client()
        .evidence_config(&format!("max_records_per_second_per_org = {BUDGET}"))
        .start();
    let (mut burst, line) = lab.spawn_client_script(DNS_BURST, &["400"]);
    let _ = burst.wait();
    let out: serde_json::Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("{e}: {line:?}\n{}", lab.proxy_output()));
    let secs = out["secs"].as_f64().unwrap();
    let answered = out["counts"]["NOERROR"].as_u64().unwrap_or(0);
    let refused = out["counts"]["REFUSED"].as_u64().unwrap_or(0);
    let bound = (BUDGET as f64 * (secs + 1.0)) as u64 + 1;
    assert!(
        answered >= BUDGET && answered <= bound,
        "{answered} answered, bound {bound}: {out}"
    );
    assert!(refused > 0, "nothing refused in {secs:.1} s: {out}");
    let ede = out["ede"].as_str().unwrap();
    assert!(
        ede.starts_with("palisade: limit_exceeded; summarised"),
        "{ede:?}"
    );

    // Another org's answers come out of its own budget.
    let d = dig2(&lab, &["other.test", "A"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("A"), [OTHER_IP], "{}", d.output);

    // Each answer is on record one by one; the refusals are summarised (or
    // on record one by one when a record refilled meanwhile).
    let (mut summarised, mut one_by_one) = (0, 0);
    crate::lab::wait_until("acme's refusals on record", Duration::from_secs(10), || {
        let ev = lab.evidence();
        summarised = ev
            .iter()
            .filter(|v| {
                v["org"] == "acme" && v["reason"] == "limit_exceeded" && v["count"].is_u64()
            })
            .map(|v| v["count"].as_u64().unwrap())
            .sum::<u64>();
        one_by_one = crate::conn_budgets::budget_refusals_one_by_one(&ev, "acme");
        summarised + one_by_one == refused
    });
    assert!(summarised > 0, "nothing summarised");
    let ev = lab.evidence();
    let allows = ev
        .iter()
        .filter(|v| v["org"] == "acme" && v["kind"] == "dns" && v["decision"] == "allow")
        .count() as u64;
    assert_eq!(allows, answered, "one record per answer");
    assert!(allows + one_by_one <= bound, "over the budget's {bound}");
    let limited = crate::conn_budgets::scrape_sum(
        &lab,
        "palisade_dns_queries_total",
        &["org=\"acme\"", "reason=\"limit_exceeded\""],
    );
    assert_eq!(limited, refused as f64, "counted as limit_exceeded");
    let suppressed = crate::conn_budgets::scrape_sum(
        &lab,
        "palisade_evidence_suppressed_total",
        &["org=\"acme\""],
    );
    assert_eq!(suppressed, summarised as f64);
}
