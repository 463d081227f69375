//! Names as a channel: under an allowed wildcard, every new name that
//! leaves (a DNS query forwarded, a name a connection is decided for)
//! spends its rule's `max_new_names_per_minute`, per org; past it the
//! query is REFUSED and the connection denied (`name_budget_exceeded`),
//! on record. The upstream resolver's own query log is the witness of
//! what left.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, Lab};

/// Budgets of 10 new names a minute under `*.wild.test` for acme and for
/// beta; a label of at most 20 characters under `*.short.test` (and the
/// default budget, 60); no budget under `*.free.test`.
const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
id = "wild"
host = "*.wild.test"
max_new_names_per_minute = 10
[[org.allow]]
id = "short"
host = "*.short.test"
max_label_length = 20
[[org.allow]]
id = "free"
host = "*.free.test"
max_new_names_per_minute = 0

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
id = "beta-wild"
host = "*.wild.test"
max_new_names_per_minute = 10
"#;

fn lab() -> Lab {
    Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .second_client()
        .start()
}

/// Sends one A query (with EDNS) per name given, one after the other, to
/// the shim; prints one line per name: the name, the rcode, and the EDE
/// text of a refusal. Each answer waited for at most 2 s.
const ASK: &str = r#"
import socket, struct, sys
D = ("198.18.1.1", 53)
OPT = b"\x00" + struct.pack(">HHIH", 41, 1232, 0, 0)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2.0)
for qid, name in enumerate(sys.argv[1:]):
    h = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 1)
    q = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
    s.sendto(h + q + struct.pack(">HH", 1, 1) + OPT, D)
    rcode, ede = "timeout", ""
    try:
        while True:
            r = s.recv(4096)
            if struct.unpack(">H", r[:2])[0] == qid:
                break
        rcode = str(struct.unpack(">H", r[2:4])[0] & 0xF)
        i = r.find(b"\x00\x0f")
        if i > 0:
            ede = r[i + 6:].decode("ascii", "replace")
    except OSError:
        pass
    print(name, rcode, repr(ede), flush=True)
"#;

/// Ask `names` from the namespace `ns`: (name, rcode) in order.
fn ask(lab: &Lab, ns: &str, names: &[String]) -> Vec<(String, u32)> {
    let mut args: Vec<&str> = vec!["-c", ASK];
    args.extend(names.iter().map(String::as_str));
    let out = lab.exec(ns, "python3", &args);
    assert!(out.success(), "{}", out.describe());
    let answers: Vec<(String, u32)> = out
        .stdout
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_string(), f.next()?.parse().ok()?))
        })
        .collect();
    assert_eq!(answers.len(), names.len(), "{}", out.stdout);
    answers
}

/// `n` names under `zone` no one has asked before (random labels).
pub(crate) fn random_names(n: usize, zone: &str) -> Vec<String> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut x = seed ^ ((i as u128 + 1) * 0x9e37_79b9_7f4a_7c15);
            let mut label = String::new();
            for _ in 0..16 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                label.push(char::from(b'a' + ((x >> 59) as u8 % 26)));
            }
            format!("{label}{i}.{zone}")
        })
        .collect()
}

/// The distinct names under `zone` the upstream resolver was asked.
fn upstream_names(lab: &Lab, zone: &str) -> BTreeSet<String> {
    lab.dns_log()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .filter(|n| n.ends_with(&format!(".{zone}")))
        .map(str::to_string)
        .collect()
}

/// DNS refusals recorded for `org` with `reason`, one by one or in
/// summaries: how many they stand for.
fn refusals_on_record(evidence: &[Value], org: &str, reason: &str) -> u64 {
    evidence
        .iter()
        .filter(|v| v["kind"] == "dns" && v["org"] == org && v["reason"] == reason)
        .map(|v| v["count"].as_u64().unwrap_or(1))
        .sum()
}

const NXDOMAIN: u32 = 3;
const REFUSED: u32 = 5;

#[test]
fn new_names_under_a_wildcard_past_the_budget_are_refused_and_never_leave() {
    let lab = lab();
    let names = random_names(40, "wild.test");
    let answers = ask(&lab, &lab.ns_client.clone(), &names);
    // The first ten reach the upstream (which knows none of them), the
    // rest are refused at the shim.
    let forwarded: Vec<&String> = answers
        .iter()
        .filter(|(_, rcode)| *rcode == NXDOMAIN)
        .map(|(n, _)| n)
        .collect();
    let refused = answers.iter().filter(|(_, r)| *r == REFUSED).count();
    assert_eq!(forwarded.len(), 10, "{answers:?}");
    assert_eq!(refused, 30, "{answers:?}");
    assert_eq!(forwarded, names.iter().take(10).collect::<Vec<_>>());
    // The witness: the upstream saw exactly those ten names, no more.
    let seen = upstream_names(&lab, "wild.test");
    let expected: BTreeSet<String> = names.iter().take(10).cloned().collect();
    assert_eq!(seen, expected, "{}", lab::dump(&lab.dns_log()));
    // Every refusal is on record, one by one or summarised.
    lab::wait_until("30 refusals on record", Duration::from_secs(8), || {
        refusals_on_record(&lab.evidence(), "acme", "name_budget_exceeded") == 30
    });
    let rec = lab.wait_evidence("a budget refusal, one by one", |v| {
        v["kind"] == "dns" && v["reason"] == "name_budget_exceeded" && v["count"].is_null()
    });
    assert_eq!(rec["rule"], "wild", "{rec}");
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert!(
        names[10..].iter().any(|n| rec["host"] == n.as_str()),
        "{rec}"
    );

    // Without a budget (0, written), all forty leave.
    let free = random_names(40, "free.test");
    let answers = ask(&lab, &lab.ns_client.clone(), &free);
    assert!(answers.iter().all(|(_, r)| *r == NXDOMAIN), "{answers:?}");
    assert_eq!(upstream_names(&lab, "free.test").len(), 40);
    eprintln!(
        "names: of 40 new names, 10 reached the upstream with max_new_names_per_minute = 10, \
         40 with 0 (unlimited)"
    );

    // A name seen in the window is not refused: asked again, it is
    // answered as before.
    let again = ask(&lab, &lab.ns_client.clone(), &names[..3]);
    assert!(again.iter().all(|(_, r)| *r == NXDOMAIN), "{again:?}");
    // An exact allowed name is untouched by the wildcard's spent budget.
    let d = lab.dig(&["allowed.test", "A"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("A"), [lab::ALLOWED_IP], "{}", d.output);
    // beta's budget is its own.
    let theirs = random_names(12, "wild.test");
    let answers = ask(&lab, &lab.ns_client2.clone(), &theirs);
    let forwarded = answers.iter().filter(|(_, r)| *r == NXDOMAIN).count();
    assert_eq!(forwarded, 10, "{answers:?}");
    let seen = upstream_names(&lab, "wild.test");
    assert!(theirs[..10].iter().all(|n| seen.contains(n)), "{seen:?}");
    assert!(!theirs[10..].iter().any(|n| seen.contains(n)), "{seen:?}");
    lab::wait_until(
        "beta's two refusals on record",
        Duration::from_secs(8),
        || refusals_on_record(&lab.evidence(), "beta", "name_budget_exceeded") == 2,
    );

    // A CONNECT to a new name under the wildcard is denied too, and the
    // name never reaches the resolver.
    let fresh = random_names(1, "wild.test").remove(0);
    let resp = lab.raw_connect(&format!("{fresh}:443"));
    assert_eq!(resp.status, 403, "{resp:?}");
    assert!(resp.body.contains("name_budget_exceeded"), "{resp:?}");
    let rec = lab.wait_evidence("the denied CONNECT", |v| {
        v["kind"] == "tcp" && v["host"] == fresh.as_str()
    });
    assert_eq!(rec["reason"], "name_budget_exceeded", "{rec}");
    assert_eq!(rec["rule"], "wild", "{rec}");
    assert!(!upstream_names(&lab, "wild.test").contains(&fresh));
}

#[test]
fn connections_and_queries_spend_one_budget() {
    let lab = lab();
    // Five CONNECTs to new names under the wildcard: each one's name
    // leaves (resolved upstream: no such name there).
    let by_connect = random_names(5, "wild.test");
    for name in &by_connect {
        let resp = lab.raw_connect(&format!("{name}:443"));
        assert_eq!(resp.status, 502, "{name}: {resp:?}");
        assert!(resp.body.contains("resolution_failed"), "{resp:?}");
    }
    // Then DNS: five more new names leave, the rest are refused; a name
    // a CONNECT used is seen, not new.
    let by_dns = random_names(10, "wild.test");
    let answers = ask(&lab, &lab.ns_client.clone(), &by_dns);
    let forwarded = answers.iter().filter(|(_, r)| *r == NXDOMAIN).count();
    assert_eq!(forwarded, 5, "{answers:?}");
    let again = ask(&lab, &lab.ns_client.clone(), &by_connect[..2]);
    assert!(again.iter().all(|(_, r)| *r == NXDOMAIN), "{again:?}");
    // A connection to a name the shim answered is seen too: allowed by
    // name, then failing only on resolution.
    let resp = lab.raw_connect(&format!("{}:443", by_dns[0]));
    assert_eq!(resp.status, 502, "{resp:?}");
    // And past the budget a CONNECT is denied.
    let resp = lab.raw_connect(&format!("{}:443", by_dns[9]));
    assert_eq!(resp.status, 403, "{resp:?}");
    assert!(resp.body.contains("name_budget_exceeded"), "{resp:?}");
    // Ten distinct names reached the upstream, no more.
    let seen = upstream_names(&lab, "wild.test");
    assert_eq!(seen.len(), 10, "{seen:?}");
    assert!(by_connect.iter().all(|n| seen.contains(n)), "{seen:?}");
    assert!(by_dns[..5].iter().all(|n| seen.contains(n)), "{seen:?}");
}

#[test]
fn a_label_longer_than_the_rule_allows_is_refused_and_never_leaves() {
    let lab = lab();
    let long = format!("{}.short.test", "x".repeat(21));
    let fits = format!("{}.short.test", "y".repeat(20));
    let answers = ask(&lab, &lab.ns_client.clone(), &[long.clone(), fits.clone()]);
    assert_eq!(answers[0].1, REFUSED, "{answers:?}");
    assert_eq!(answers[1].1, NXDOMAIN, "{answers:?}");
    let rec = lab.wait_evidence("the long label's refusal", |v| {
        v["kind"] == "dns" && v["host"] == long.as_str()
    });
    assert_eq!(rec["reason"], "name_budget_exceeded", "{rec}");
    assert_eq!(rec["rule"], "short", "{rec}");
    let resp = lab.raw_connect(&format!("{long}:443"));
    assert_eq!(resp.status, 403, "{resp:?}");
    assert!(resp.body.contains("name_budget_exceeded"), "{resp:?}");
    let seen = upstream_names(&lab, "short.test");
    assert!(!seen.contains(&long), "{seen:?}");
    assert!(seen.contains(&fits), "{seen:?}");
    // The default budget: 60 new names a minute (one spent above).
    let many = random_names(70, "short.test");
    let answers = ask(&lab, &lab.ns_client.clone(), &many);
    let forwarded = answers.iter().filter(|(_, r)| *r == NXDOMAIN).count();
    assert_eq!(forwarded, 59, "{answers:?}");
    assert_eq!(upstream_names(&lab, "short.test").len(), 60);
}

/// Sends one A query for the name given to the shim's own port from the
/// address given (which the sender holds on its loopback: the kernel puts
/// it on the wire as the source), three times, answers not awaited.
const SPOOF: &str = r#"
import socket, struct, sys
src, name = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((src, 0))
h = struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0)
q = b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0"
for port in (5353, 53, 5353):
    s.sendto(h + q + struct.pack(">HH", 1, 1), ("198.18.1.1", port))
print("sent", flush=True)
"#;

#[test]
fn a_query_with_another_orgs_source_address_is_dropped_by_the_gateway_ruleset() {
    let lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:5353"])
        .proxy_option(&format!(
            "transparent = [\"{}\"]",
            crate::transparent::TRANSPARENT
        ))
        .second_client()
        .start();
    crate::transparent::load_gateway(&lab);
    // The kernel's own reverse-path filter off: what drops the spoofed
    // query must be the ruleset.
    let out = lab.proxy_ns_exec(
        "sysctl",
        &[
            "-w",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.conf.p1.rp_filter=0",
        ],
    );
    assert!(out.success(), "{}", out.describe());
    // beta's sandbox, on another interface of the gateway, takes acme's
    // address and asks, as acme, for a name under acme's wildcard.
    let ns2 = lab.ns_client2.clone();
    let out = lab.exec(&ns2, "ip", &["addr", "add", "198.18.1.2/32", "dev", "lo"]);
    assert!(out.success(), "{}", out.describe());
    let spoofed = random_names(1, "wild.test").remove(0);
    let out = lab.exec(&ns2, "python3", &["-c", SPOOF, "198.18.1.2", &spoofed]);
    assert!(out.stdout.contains("sent"), "{}", out.describe());

    // A positive end, along the path the spoofed query would take (the
    // shim, its records, the upstream): acme's own query through the
    // gateway, after it.
    let marker = random_names(1, "wild.test").remove(0);
    let d = lab.dig(&["-p", "53", &marker, "A"]);
    assert_eq!(d.status, "NXDOMAIN", "{}", d.output);
    lab.wait_evidence("the marker's record", |v| {
        v["kind"] == "dns" && v["host"] == marker.as_str()
    });
    let seen = upstream_names(&lab, "wild.test");
    assert!(seen.contains(&marker), "{seen:?}");
    assert!(
        !seen.contains(&spoofed),
        "spoofed query forwarded: {seen:?}"
    );
    let recorded: Vec<Value> = lab
        .evidence()
        .into_iter()
        .filter(|v| v["host"] == spoofed.as_str())
        .collect();
    assert!(
        recorded.is_empty(),
        "spoofed query on record:\n{}",
        lab::dump(&recorded)
    );
}

#[test]
fn transparent_connections_to_new_names_spend_the_budget_too() {
    let policy = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
id = "wild"
host = "*.wild.test"
max_new_names_per_minute = 2
"#;
    let lab = Lab::builder()
        .policy(policy)
        .proxy_option(&format!(
            "transparent = [\"{}\"]",
            crate::transparent::TRANSPARENT
        ))
        .start();
    crate::transparent::load_gateway(&lab);
    // Three new names, each presented as the Host of a plain HTTP
    // connection to a.wild.test's address (no proxy settings: the
    // gateway redirects it).
    let names = random_names(3, "wild.test");
    for name in &names {
        let out = lab.client_exec(
            "curl",
            &[
                "-sS",
                "--noproxy",
                "*",
                "--max-time",
                "5",
                "--resolve",
                &format!("{name}:80:{}", lab::WILD_A_IP),
                &format!("http://{name}/"),
            ],
        );
        assert!(!out.stdout.contains("upstream="), "{}", out.describe());
    }
    let reason = |name: &str| {
        lab.wait_evidence(&format!("the transparent decision for {name}"), |v| {
            v["mode"] == "transparent" && v["host"] == name
        })["reason"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // The first two spend the budget (and, owning no address, fail on
    // their resolution); the third is denied before it is resolved.
    assert_eq!(reason(&names[0]), "resolution_failed");
    assert_eq!(reason(&names[1]), "resolution_failed");
    assert_eq!(reason(&names[2]), "name_budget_exceeded");
    let seen = upstream_names(&lab, "wild.test");
    assert!(names[..2].iter().all(|n| seen.contains(n)), "{seen:?}");
    assert!(!seen.contains(&names[2]), "{seen:?}");
}
