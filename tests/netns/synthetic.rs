//! Synthetic DNS answers (`dns_answers = "synthetic"`): the shim answers
//! an allowed name with an address of the synthetic pool bound to (org,
//! name) and resolves nothing; a connection to that address is decided as
//! a connection to the name, and only an allowed one resolves the name
//! and dials what it resolves to. The upstream resolver's own query log is
//! the witness of what left.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, ca_pem, dump, Lab, ALLOWED_IP, BANNER, BANNER_PORT, PROXY_URL};
use crate::names::random_names;
use crate::transparent::{curl_with, load_gateway, TRANSPARENT};

/// The lab's pools: inside the benchmarking ranges, clear of the lab's
/// hosts; the IPv4 one the smallest accepted (256 addresses), so that a
/// few hundred names churn it.
const POOLS: &str =
    "synthetic_pool = \"198.18.200.0/24\"\nsynthetic_pool_v6 = \"2001:2:0:200::/120\"\n";
const POOL_PREFIX: &str = "198.18.200.";
const POOL_PREFIX6: &str = "2001:2:0:200::";

/// Both orgs answered from the pools.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
dns_answers = "synthetic"
[[org.allow]]
host = "allowed.test"
ports = [80, 443]
[[org.allow]]
id = "banner"
host = "allowed.test"
ports = [2222]
tunnel = "opaque"
[[org.allow]]
id = "wild"
host = "*.wild.test"
max_new_names_per_minute = 0

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
dns_answers = "synthetic"
[[org.allow]]
host = "allowed.test"
ports = [80, 443]
"#;

/// Explicit mode, the shim on the gateway's sandbox address.
fn lab() -> Lab {
    Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra(POOLS)
        .second_client()
        .start()
}

/// Sends one query of type `qtype` (1: A, 28: AAAA) per name to the shim
/// at argv[1]:53, one after the other; prints per name: the name, the
/// rcode, and the first address answered (or "-").
const ASK: &str = r#"
import ipaddress, socket, struct, sys
D = (sys.argv[1], 53)
qtype = int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2.0)
for qid, name in enumerate(sys.argv[3:]):
    h = struct.pack(">HHHHHH", qid & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    s.sendto(h + q + struct.pack(">HH", qtype, 1), D)
    rcode, addr = "timeout", "-"
    try:
        while True:
            r = s.recv(4096)
            if struct.unpack(">H", r[:2])[0] == qid & 0xFFFF:
                break
        rcode = str(struct.unpack(">H", r[2:4])[0] & 0xF)
        ancount = struct.unpack(">H", r[6:8])[0]
        i = 12 + len(q) + 4
        for _ in range(ancount):
            while r[i] != 0 and r[i] < 0xC0:
                i += r[i] + 1
            i += 2 if r[i] >= 0xC0 else 1
            t, _, _, n = struct.unpack(">HHIH", r[i:i + 10])
            i += 10
            if t in (1, 28) and addr == "-":
                addr = str(ipaddress.ip_address(r[i:i + n]))
            i += n
    except OSError:
        pass
    print(name, rcode, addr, flush=True)
"#;

/// Ask `names` (type `qtype`) from `ns` of the shim at `server`:
/// (name, rcode, address) in order.
fn ask(
    lab: &Lab,
    ns: &str,
    server: &str,
    qtype: u16,
    names: &[String],
) -> Vec<(String, u32, String)> {
    let qtype = qtype.to_string();
    let mut args: Vec<&str> = vec!["-c", ASK, server, &qtype];
    args.extend(names.iter().map(String::as_str));
    let out = lab.exec(ns, "python3", &args);
    assert!(out.success(), "{}", out.describe());
    let answers: Vec<(String, u32, String)> = out
        .stdout
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((
                f.next()?.to_string(),
                f.next()?.parse().ok()?,
                f.next()?.to_string(),
            ))
        })
        .collect();
    assert_eq!(answers.len(), names.len(), "{}", out.stdout);
    answers
}

/// The synthetic address `ns` is answered for `name` (A, or AAAA for `v6`).
fn synthetic_addr(lab: &Lab, ns: &str, name: &str, v6: bool) -> String {
    let (qtype, prefix) = if v6 {
        (28, POOL_PREFIX6)
    } else {
        (1, POOL_PREFIX)
    };
    let got = ask(lab, ns, lab::SHIM_IP, qtype, &[name.to_string()]);
    let (_, rcode, addr) = &got[0];
    assert_eq!(*rcode, 0, "{got:?}");
    assert!(addr.starts_with(prefix), "{name}: {got:?}");
    addr.clone()
}

/// The distinct names the upstream resolver was asked.
fn upstream_names(lab: &Lab) -> BTreeSet<String> {
    lab.dns_queries().into_iter().collect()
}

/// curl from `ns` through the explicit proxy to https://`name`/, the
/// CONNECT going to `addr` (a synthetic address) with `name` as SNI.
fn curl_via(lab: &Lab, ns: &str, name: &str, addr: &str) -> lab::HttpResp {
    curl_through(lab, ns, PROXY_URL, name, addr)
}

/// [`curl_via`] through the proxy at `proxy` (an http:// or socks5:// URL).
fn curl_through(lab: &Lab, ns: &str, proxy: &str, name: &str, addr: &str) -> lab::HttpResp {
    let ca = ca_pem().display().to_string();
    let host = if addr.contains(':') {
        format!("[{addr}]")
    } else {
        addr.to_string()
    };
    let to = format!("{name}:443:{host}:443");
    let url = format!("https://{name}/");
    lab.curl_in(
        ns,
        &["-x", proxy, "--cacert", &ca, "--connect-to", &to, &url],
    )
}

fn tcp_decision(lab: &Lab, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    lab.wait_evidence(what, |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && pred(v)
    })
}

#[test]
fn queried_names_never_leave_and_a_connect_to_one_resolves_only_its_name() {
    let lab = lab();
    let client = lab.ns_client.clone();
    // Forty new names under the wildcard (no budget): every one answered
    // from the pool, none reaching the upstream.
    let names = random_names(40, "wild.test");
    let answers = ask(&lab, &client, lab::SHIM_IP, 1, &names);
    assert!(
        answers
            .iter()
            .all(|(_, rcode, a)| *rcode == 0 && a.starts_with(POOL_PREFIX)),
        "{answers:?}"
    );
    let distinct: BTreeSet<&String> = answers.iter().map(|(_, _, a)| a).collect();
    assert_eq!(
        distinct.len(),
        names.len(),
        "one address per name: {answers:?}"
    );
    let allowed = synthetic_addr(&lab, &client, "allowed.test", false);
    // Asked again: the same address.
    assert_eq!(
        synthetic_addr(&lab, &client, "Allowed.Test", false),
        allowed
    );
    // Other types: NODATA, nothing upstream; denied names: REFUSED.
    let d = lab.dig(&["allowed.test", "HTTPS"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert!(d.of("HTTPS").is_empty(), "{}", d.output);
    let d = lab.dig(&["other.test", "A"]);
    assert_eq!(d.status, "REFUSED", "{}", d.output);
    let seen = upstream_names(&lab);
    assert!(seen.is_empty(), "nothing may leave: {seen:?}");
    eprintln!(
        "synthetic: of {} new names queried, {} reached the upstream",
        names.len(),
        seen.len()
    );
    // The DNS record lists the synthetic address, nothing sent upstream.
    let rec = lab.wait_evidence("a synthetic answer", |v| {
        v["kind"] == "dns" && v["host"] == "allowed.test" && v["qtype"] == "A"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["upstream"], false, "{rec}");
    assert_eq!(
        rec["answers"],
        serde_json::json!([format!("A {allowed}")]),
        "{rec}"
    );

    // An explicit CONNECT to allowed.test's synthetic address, SNI
    // allowed.test: decided as allowed.test, which now (only now) is
    // resolved; the real address is dialled.
    let r = curl_via(&lab, &client, "allowed.test", &allowed);
    assert_eq!(r.status, 200, "{r:?}");
    let rec = tcp_decision(&lab, "the CONNECT to the synthetic address", |v| {
        v["synthetic"] == allowed.as_str()
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP, "{rec}");
    assert_eq!(rec["mode"], "explicit", "{rec}");
    let seen = upstream_names(&lab);
    assert_eq!(
        seen,
        BTreeSet::from(["allowed.test".to_string()]),
        "{}",
        dump(&lab.dns_log())
    );
    eprintln!(
        "synthetic: after one CONNECT to a synthetic address, the upstream saw {} name(s): {seen:?}",
        seen.len()
    );

    // An absolute-form request to the address: decided as the name too.
    let r = lab.proxied_curl(&format!("http://{allowed}/"), &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let rec = lab.wait_evidence("an absolute-form request to the synthetic address", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["synthetic"] == allowed.as_str()
    });
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP, "{rec}");
    assert_eq!(upstream_names(&lab).len(), 1);

    // Beta using acme's address: bound to no name of beta's.
    let r = curl_via(&lab, &lab.ns_client2.clone(), "allowed.test", &allowed);
    assert_eq!(r.connect_status, 403, "{r:?}");
    let rec = tcp_decision(&lab, "beta at acme's synthetic address", |v| {
        v["org"] == "beta" && v["synthetic"] == allowed.as_str()
    });
    assert_eq!(rec["reason"], "synthetic_unbound", "{rec}");
    assert!(rec["ip"].is_null(), "never dialled: {rec}");
    // An address of the pool never handed out: the same.
    let resp = lab.raw_connect(&format!("{POOL_PREFIX}250:443"));
    assert_eq!(resp.status, 403, "{resp:?}");
    assert!(resp.body.contains("synthetic_unbound"), "{resp:?}");
    // Beta's own answer for the same name is another address.
    let theirs = synthetic_addr(&lab, &lab.ns_client2.clone(), "allowed.test", false);
    assert_ne!(theirs, allowed);
    assert!(
        !upstream_names(&lab)
            .iter()
            .any(|n| n.ends_with(".wild.test")),
        "no wildcard name left: {:?}",
        upstream_names(&lab)
    );
}

#[test]
fn an_ipv6_synthetic_address_stands_for_its_name_too() {
    let lab = lab();
    let client = lab.ns_client.clone();
    let v6 = synthetic_addr(&lab, &client, "allowed.test", true);
    let v4 = synthetic_addr(&lab, &client, "allowed.test", false);
    assert!(upstream_names(&lab).is_empty());
    // A CONNECT to the IPv6 synthetic address, dialled over IPv4: what
    // the name resolves to.
    let r = curl_via(&lab, &client, "allowed.test", &v6);
    assert_eq!(r.status, 200, "{r:?}");
    let rec = tcp_decision(&lab, "the CONNECT to the IPv6 synthetic address", |v| {
        v["synthetic"] == v6.as_str()
    });
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP, "{rec}");
    assert_eq!(rec["decision"], "allow", "{rec}");
    // Both families of one name are one mapping: the IPv4 one still stands.
    assert_eq!(synthetic_addr(&lab, &client, "allowed.test", false), v4);
}

#[test]
fn eviction_under_churn_never_breaks_an_open_connection() {
    let lab = lab();
    let client = lab.ns_client.clone();
    let held = synthetic_addr(&lab, &client, "allowed.test", false);
    // An opaque tunnel to the banner port of the name held open.
    let mut conn = lab.client_conn();
    assert_eq!(conn.connect(&format!("{held}:{BANNER_PORT}")), 200);
    let banner = conn.read_until(BANNER.as_bytes(), Duration::from_secs(5));
    assert!(banner.is_some(), "no banner through the tunnel");
    // Churn: three times the pool's 256 addresses in new names.
    let names = random_names(768, "wild.test");
    for chunk in names.chunks(256) {
        let answers = ask(&lab, &client, lab::SHIM_IP, 1, chunk);
        assert!(
            answers
                .iter()
                .all(|(_, r, a)| *r == 0 && a.starts_with(POOL_PREFIX) && *a != held),
            "the held address is never handed to another name: {answers:?}"
        );
    }
    // The tunnel still carries bytes both ways.
    conn.send(b"still-here\n").expect("send through the tunnel");
    let echoed = conn.read_until(b"still-here", Duration::from_secs(5));
    assert!(echoed.is_some(), "the open connection broke under churn");
    // Its mapping was never evicted: the same address for the name.
    assert_eq!(synthetic_addr(&lab, &client, "allowed.test", false), held);
    // The first churned names were evicted: their old addresses are
    // another name's now, or no one's.
    let first = ask(&lab, &client, lab::SHIM_IP, 1, &names[..1]);
    let rec_first = lab.wait_evidence("the first churned name's first answer", |v| {
        v["kind"] == "dns" && v["host"] == names[0].as_str()
    });
    assert_ne!(
        rec_first["answers"],
        serde_json::json!([format!("A {}", first[0].2)]),
        "evicted and re-made: {first:?} vs {rec_first}"
    );
    conn.close();
}

#[test]
fn a_transparent_connection_to_a_synthetic_address_is_its_name() {
    let lab = Lab::builder()
        .policy(POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .dns_listen(&["198.18.1.1:5353"])
        .dns_extra(POOLS)
        .start();
    load_gateway(&lab);
    let client = lab.ns_client.clone();
    // Through the gateway: DNS to port 53 goes to the shim.
    let allowed = synthetic_addr(&lab, &client, "allowed.test", false);
    let wild = synthetic_addr(&lab, &client, "x.wild.test", false);
    let curl = |name: &str, addr: &str| {
        curl_with(
            &lab,
            &[],
            &format!("https://{name}/"),
            &format!("{name}:443:{addr}"),
        )
    };
    // A wrong SNI at a synthetic address: denied, nothing resolved.
    let r = curl("allowed.test", &wild);
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = tcp_decision(&lab, "a wrong SNI at a synthetic address", |v| {
        v["mode"] == "transparent" && v["synthetic"] == wild.as_str()
    });
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");
    assert!(rec["ip"].is_null(), "{rec}");
    assert!(
        upstream_names(&lab).is_empty(),
        "nothing resolved: {}",
        dump(&lab.dns_log())
    );
    // The matching SNI: decided as allowed.test, resolved, the real
    // address dialled.
    let r = curl("allowed.test", &allowed);
    assert!(r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = tcp_decision(
        &lab,
        "a transparent connection to a synthetic address",
        |v| v["mode"] == "transparent" && v["synthetic"] == allowed.as_str(),
    );
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP, "{rec}");
    assert_eq!(
        upstream_names(&lab),
        BTreeSet::from(["allowed.test".to_string()]),
        "{}",
        dump(&lab.dns_log())
    );
    // An address of the pool no one was handed: denied, never dialled.
    let r = curl("allowed.test", &format!("{POOL_PREFIX}250"));
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = tcp_decision(&lab, "an unbound synthetic address", |v| {
        v["mode"] == "transparent" && v["synthetic"] == format!("{POOL_PREFIX}250").as_str()
    });
    assert_eq!(rec["reason"], "synthetic_unbound", "{rec}");
}

#[test]
fn mappings_survive_a_reload_unless_their_name_or_org_no_longer_is_synthetic() {
    let lab = lab();
    let (acme, beta) = (lab.ns_client.clone(), lab.ns_client2.clone());
    let allowed = synthetic_addr(&lab, &acme, "allowed.test", false);
    let wild = synthetic_addr(&lab, &acme, "x.wild.test", false);
    let theirs = synthetic_addr(&lab, &beta, "allowed.test", false);
    // The wildcard goes from acme's policy, and beta resolves again.
    let text = std::fs::read_to_string(&lab.config_path).unwrap();
    let edited = text
        .replacen("host = \"*.wild.test\"", "host = \"*.elsewhere.test\"", 1)
        .replacen(
            "clients = [\"198.18.4.0/24\"]\ndns_answers = \"synthetic\"",
            "clients = [\"198.18.4.0/24\"]",
            1,
        );
    assert_ne!(edited, text);
    let tmp = lab.config_path.with_extension("new");
    std::fs::write(&tmp, edited).unwrap();
    std::fs::rename(&tmp, &lab.config_path).unwrap();
    lab.signal_proxy("-HUP");
    lab::wait_until("the reload applied", Duration::from_secs(5), || {
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"ok\"}")
            == 1.0
    });
    // Still allowed, still synthetic: the same address, and it still
    // stands for its name.
    assert_eq!(synthetic_addr(&lab, &acme, "allowed.test", false), allowed);
    let r = curl_via(&lab, &acme, "allowed.test", &allowed);
    assert_eq!(r.status, 200, "{r:?}");
    // A name no longer allowed: its address is bound to nothing.
    let resp = lab.raw_connect(&format!("{wild}:443"));
    assert_eq!(resp.status, 403, "{resp:?}");
    assert!(resp.body.contains("synthetic_unbound"), "{resp:?}");
    // An org no longer synthetic: real answers, and its old address is
    // bound to nothing.
    let d = lab.dig_in(&beta, &[&format!("@{}", lab::SHIM_IP), "allowed.test", "A"]);
    assert_eq!(d.of("A"), [ALLOWED_IP], "{}", d.output);
    let r = curl_via(&lab, &beta, "allowed.test", &theirs);
    assert_eq!(r.connect_status, 403, "{r:?}");
    let rec = tcp_decision(&lab, "beta at its old synthetic address", |v| {
        v["org"] == "beta" && v["synthetic"] == theirs.as_str()
    });
    assert_eq!(rec["reason"], "synthetic_unbound", "{rec}");
}

#[test]
fn a_socks5_connection_to_a_synthetic_address_is_its_name() {
    const SOCKS_ADDR: &str = "198.18.1.1:1080";
    let lab = Lab::builder()
        .policy(POLICY)
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra(POOLS)
        .start();
    let client = lab.ns_client.clone();
    let allowed = synthetic_addr(&lab, &client, "allowed.test", false);
    // socks5:// (not socks5h): the client sends the address, not the name.
    let proxy = format!("socks5://{SOCKS_ADDR}");
    let r = curl_through(&lab, &client, &proxy, "allowed.test", &allowed);
    assert_eq!(r.status, 200, "{r:?}");
    let rec = tcp_decision(
        &lab,
        "the SOCKS5 connection to the synthetic address",
        |v| v["mode"] == "socks5" && v["synthetic"] == allowed.as_str(),
    );
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP, "{rec}");
    assert_eq!(rec["decision"], "allow", "{rec}");
    // An address of the pool never handed out: refused, never dialled.
    let r = curl_through(
        &lab,
        &client,
        &proxy,
        "allowed.test",
        &format!("{POOL_PREFIX}250"),
    );
    assert_ne!(r.status, 200, "{r:?}");
    let rec = tcp_decision(&lab, "SOCKS5 to an unbound synthetic address", |v| {
        v["mode"] == "socks5" && v["synthetic"] == format!("{POOL_PREFIX}250").as_str()
    });
    assert_eq!(rec["reason"], "synthetic_unbound", "{rec}");
    assert_eq!(
        upstream_names(&lab),
        BTreeSet::from(["allowed.test".to_string()])
    );
}

/// [`POLICY`] with a wildcard for beta too, so both orgs can churn.
fn two_churning_orgs() -> Lab {
    let policy = format!(
        "{POLICY}[[org.allow]]\nid = \"beta-wild\"\nhost = \"*.wild.test\"\nmax_new_names_per_minute = 0\n"
    );
    Lab::builder()
        .policy(&policy)
        .dns_listen(&["198.18.1.1:53"])
        .dns_extra(POOLS)
        .second_client()
        .start()
}

#[test]
fn one_orgs_churn_never_evicts_another_orgs_live_answer() {
    let lab = two_churning_orgs();
    let (acme, beta) = (lab.ns_client.clone(), lab.ns_client2.clone());
    // Beta is answered for allowed.test and holds the answer, well within
    // its 10 s TTL, without connecting yet (nothing pins it).
    let theirs = ask(&lab, &beta, lab::SHIM_IP, 1, &["allowed.test".to_string()]);
    let (_, rcode, held) = theirs[0].clone();
    assert!(rcode == 0 && held.starts_with(POOL_PREFIX), "{theirs:?}");
    let asked = std::time::Instant::now();
    // Acme churns the whole pool with new names, as fast as one client
    // asks: more than the 256 addresses there are.
    let names = random_names(300, "wild.test");
    let answers = ask(&lab, &acme, lab::SHIM_IP, 1, &names);
    let answered = answers.iter().filter(|(_, r, _)| *r == 0).count();
    let churned = asked.elapsed();
    eprintln!(
        "synthetic: acme had {answered} of {} new names answered in {churned:?}",
        names.len()
    );
    // Beta connects to its answer: still allowed.test for beta.
    let r = curl_via(&lab, &beta, "allowed.test", &held);
    let elapsed = asked.elapsed();
    let rec = tcp_decision(&lab, "beta's CONNECT to its synthetic address", |v| {
        v["org"] == "beta" && v["synthetic"] == held.as_str()
    });
    eprintln!(
        "synthetic: beta connected {elapsed:?} after its answer (TTL 10 s): {} {}",
        rec["decision"], rec["reason"]
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "inside the TTL: {elapsed:?}"
    );
    assert_eq!(rec["reason"], "rule_match", "{rec}");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(answered, names.len(), "acme is answered from its own share");
}

#[test]
fn one_orgs_addresses_show_no_gap_for_another_orgs_names() {
    let lab = two_churning_orgs();
    let (acme, beta) = (lab.ns_client.clone(), lab.ns_client2.clone());
    // Acme asks five new names, beta twenty, acme five more: were the
    // addresses handed out on one cursor, acme's second five would start
    // twenty after its first, and acme would have counted beta's names.
    let names = random_names(30, "wild.test");
    let mut mine = ask(&lab, &acme, lab::SHIM_IP, 1, &names[..5]);
    let theirs = ask(&lab, &beta, lab::SHIM_IP, 1, &names[5..25]);
    assert!(theirs.iter().all(|(_, r, _)| *r == 0), "{theirs:?}");
    mine.extend(ask(&lab, &acme, lab::SHIM_IP, 1, &names[25..]));
    let offsets: Vec<u32> = mine
        .iter()
        .map(|(_, r, a)| {
            assert_eq!(*r, 0, "{mine:?}");
            a.strip_prefix(POOL_PREFIX)
                .and_then(|o| o.parse().ok())
                .unwrap_or_else(|| panic!("not a pool address: {mine:?}"))
        })
        .collect();
    let gaps: Vec<u32> = offsets
        .windows(2)
        .map(|w| w[1].wrapping_sub(w[0]))
        .collect();
    eprintln!("synthetic: acme's offsets {offsets:?}, steps {gaps:?}");
    assert!(
        gaps.iter().all(|&g| g == 1),
        "acme's addresses step over beta's names: {offsets:?}"
    );
}
