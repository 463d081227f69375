//! The DNS shim, driven with `dig` (UDP and `+tcp`) and raw bytes from the
//! sandbox namespaces. The upstream DNS fixture logs every query it
//! receives: that log proves what never left.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, Dig, Lab, CLIENT2_IP, SHIM_IP, STRANGER_IP};
use crate::record_ref;

const SHIM: &str = "198.18.1.1:53";

const POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "*.wild.test"
[[org.allow]]
host = "chain.test"
[[org.allow]]
host = "rebind.test"
[[org.allow]]
host = "private.test"
[[org.allow]]
host = "svc.test"
[[org.allow]]
host = "printer.local"
[[org.allow]]
host = "localhost"
[[org.allow]]
host = "use-application-dns.net"
[[org.deny]]
host = "blocked.wild.test"
[[org.deny]]
host = "*.blocked.wild.test"

[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
dns_denied = "nxdomain"
dns_types = ["TXT"]
[[org.allow]]
host = "other.test"
[[org.allow]]
host = "private.test"
[[org.allow]]
cidr = "169.254.169.254/32"
ports = [80]
"#;

fn dns_lab() -> Lab {
    Lab::builder()
        .policy(POLICY)
        .dns_listen(&[SHIM])
        .second_client()
        .start()
}

/// `dig` from the second sandbox (org beta).
pub(crate) fn dig2(lab: &Lab, args: &[&str]) -> Dig {
    let server = format!("@{SHIM_IP}");
    let mut full = vec![server.as_str()];
    full.extend_from_slice(args);
    lab.dig_in(&lab.ns_client2.clone(), &full)
}

/// The evidence record a client was shown as `shown` (its reference).
fn record(lab: &Lab, shown: &str) -> Value {
    lab.wait_evidence(&format!("record {shown}"), |v| {
        record_ref(v).as_deref() == Some(shown)
    })
}

/// A denial as a client sees it (rcode, EDE 15 naming the record) and as
/// evidence records it (a dns deny record that sent nothing upstream).
fn assert_blocked(lab: &Lab, d: &Dig, status: &str, reason: &str, ctx: &str) -> Value {
    assert_eq!(
        d.status,
        status,
        "{ctx}: {}\n{}",
        d.output,
        lab.proxy_output()
    );
    assert!(d.answers.is_empty(), "{ctx}: answers {:?}", d.answers);
    let ede = d.ede.as_deref().unwrap_or_default();
    assert!(
        ede.starts_with("15 (Blocked)") && ede.contains(reason),
        "{ctx}: EDE {ede:?}\n{}",
        d.output
    );
    let id = d
        .record_id()
        .unwrap_or_else(|| panic!("{ctx}: no record id in {ede:?}"));
    let rec = record(lab, &id);
    assert_eq!(rec["kind"], "dns", "{ctx}: {rec}");
    assert_eq!(rec["mode"], "dns", "{ctx}: {rec}");
    assert_eq!(rec["decision"], "deny", "{ctx}: {rec}");
    assert_eq!(rec["reason"], reason, "{ctx}: {rec}");
    assert_eq!(rec["upstream"], false, "{ctx}: {rec}");
    rec
}

/// Every name the upstream server saw, as sent.
fn upstream_names(lab: &Lab) -> Vec<String> {
    lab.dns_log()
        .iter()
        .filter_map(|v| v["raw"].as_str().map(str::to_owned))
        .collect()
}

/// Nothing reached upstream but these names (exactly as spelled).
fn assert_upstream_only(lab: &Lab, allowed: &[&str]) {
    std::thread::sleep(Duration::from_millis(200));
    let allowed: HashSet<&str> = allowed.iter().copied().collect();
    for name in upstream_names(lab) {
        assert!(
            allowed.contains(name.as_str()),
            "{name:?} reached the upstream DNS server:\n{}",
            lab::dump(&lab.dns_log())
        );
    }
}

#[test]
fn allowed_names_answered_denied_names_refused_and_never_sent_upstream() {
    let lab = dns_lab();
    for tcp in [false, true] {
        let mut args = vec!["allowed.test", "A"];
        if tcp {
            args.push("+tcp");
        }
        let d = lab.dig(&args);
        assert_eq!(d.status, "NOERROR", "tcp={tcp}: {}", d.output);
        assert_eq!(d.of("A"), ["198.18.2.10"], "tcp={tcp}");
    }
    let allowed = lab.wait_evidence("allowed dns record", |v| {
        v["kind"] == "dns" && v["decision"] == "allow" && v["host"] == "allowed.test"
    });
    assert_eq!(allowed["reason"], "rule_match", "{allowed}");
    assert_eq!(allowed["rule"], "acme/allow/0", "{allowed}");
    assert_eq!(allowed["upstream"], true, "{allowed}");
    assert_eq!(allowed["qtype"], "A", "{allowed}");
    assert_eq!(allowed["org"], "acme", "{allowed}");
    assert!(
        allowed["answers"].to_string().contains("198.18.2.10"),
        "{allowed}"
    );
    crate::assert_client_ip(&allowed, lab::CLIENT_IP);
    // Any case spelling is the same name, and goes upstream lowercased.
    let d = lab.dig(&["AlLoWeD.TeSt", "A"]);
    assert_eq!(d.of("A"), ["198.18.2.10"], "{}", d.output);
    let d = lab.dig(&["NEW.Wild.TEST", "A"]);
    assert_eq!(d.status, "NXDOMAIN", "{}", d.output);

    let denied = [
        ("nope.test", "no_matching_rule"),
        ("NOPE.Test", "no_matching_rule"),
        ("blocked.wild.test", "explicit_deny"),
        ("BLOCKED.wild.TEST", "explicit_deny"),
        ("c2VjcmV0LWRhdGE.blocked.wild.test", "explicit_deny"),
        ("aGVsbG8td29ybGQ.x.nope.test", "no_matching_rule"),
        ("ZXhmaWw.other.test", "no_matching_rule"),
        ("wild.test", "no_matching_rule"),
        ("allowed.test.nope.test", "no_matching_rule"),
        ("nope", "no_matching_rule"),
        ("x.onion", "no_matching_rule"),
        ("other.local", "no_matching_rule"),
        ("home.arpa", "no_matching_rule"),
        ("other.test", "no_matching_rule"),
    ];
    for (name, reason) in denied {
        for tcp in [false, true] {
            let mut args = vec![name, "A"];
            if tcp {
                args.push("+tcp");
            }
            let d = lab.dig(&args);
            let rec = assert_blocked(&lab, &d, "REFUSED", reason, &format!("{name} tcp={tcp}"));
            assert_eq!(rec["host"], name.to_ascii_lowercase(), "{rec}");
            assert_eq!(rec["qtype"], "A", "{rec}");
        }
    }
    // Reverse lookups of addresses never handed to this org.
    for addr in ["198.18.2.13", "198.18.1.1", "127.0.0.1", "2001:db8::1"] {
        let d = lab.dig(&["-x", addr]);
        assert_blocked(
            &lab,
            &d,
            "REFUSED",
            "no_matching_rule",
            &format!("PTR {addr}"),
        );
    }
    // Special-use names an allow rule names are still never forwarded.
    for name in ["localhost", "printer.local", "use-application-dns.net"] {
        let d = lab.dig(&[name, "A"]);
        assert_eq!(d.status, "NXDOMAIN", "{name}: {}", d.output);
        let rec = lab.wait_evidence(name, |v| v["host"] == name);
        assert_eq!(rec["reason"], "special_name", "{rec}");
        assert_eq!(rec["upstream"], false, "{rec}");
    }
    let d = lab.dig(&["_dns.resolver.arpa", "SVCB"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert!(d.answers.is_empty(), "{}", d.output);

    assert_upstream_only(&lab, &["allowed.test", "new.wild.test"]);
    assert!(
        upstream_names(&lab).iter().any(|n| n == "new.wild.test"),
        "the allowed wildcard name was forwarded lowercased"
    );

    // The same decision offline.
    let config = lab.config_path.display().to_string();
    for (target, reason) in [
        ("dns:nope.test", "no_matching_rule"),
        ("dns:localhost/A", "special_name"),
        ("dns:allowed.test/TXT", "qtype_not_allowed"),
        ("dns:allowed.test/AAAA", "rule_match"),
    ] {
        let out = lab::must(std::process::Command::new(lab::palisade_bin()).args([
            "explain",
            "-c",
            &config,
            "--client",
            lab::CLIENT_IP,
            target,
        ]));
        assert!(
            out.stdout.contains(&format!("reason:   {reason}")),
            "{target}: {}",
            out.stdout
        );
    }
}

#[test]
fn orgs_are_isolated_and_ptr_answers_come_from_own_bindings() {
    let lab = dns_lab();
    let d = lab.dig(&["allowed.test", "A"]);
    assert_eq!(d.of("A"), ["198.18.2.10"], "{}", d.output);
    let d = lab.dig(&["-x", "198.18.2.10"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("PTR"), ["allowed.test."], "{}", d.output);

    // beta never received that address: its PTR guess and the name are
    // denied, beta's way (NXDOMAIN with EDE).
    let d = dig2(&lab, &["-x", "198.18.2.10"]);
    let rec = assert_blocked(&lab, &d, "NXDOMAIN", "no_matching_rule", "beta PTR");
    assert_eq!(rec["org"], "beta", "{rec}");
    crate::assert_client_ip(&rec, CLIENT2_IP);
    let d = dig2(&lab, &["allowed.test", "A", "+tcp"]);
    assert_blocked(
        &lab,
        &d,
        "NXDOMAIN",
        "no_matching_rule",
        "beta allowed.test",
    );

    // beta's own name and enabled type; acme may not ask TXT.
    let d = dig2(&lab, &["other.test", "A"]);
    assert_eq!(d.of("A"), ["198.18.2.13"], "{}", d.output);
    let d = dig2(&lab, &["other.test", "TXT"]);
    assert_eq!(d.of("TXT"), ["\"other-txt\""], "{}", d.output);
    let d = lab.dig(&["allowed.test", "TXT"]);
    assert_blocked(&lab, &d, "REFUSED", "qtype_not_allowed", "acme TXT");
    let d = lab.dig(&["-x", "198.18.2.13"]);
    assert_blocked(
        &lab,
        &d,
        "REFUSED",
        "no_matching_rule",
        "acme PTR of beta's address",
    );

    // ANY gets the RFC 8482 answer, locally.
    let d = lab.dig(&["allowed.test", "ANY"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);
    assert_eq!(d.of("HINFO"), ["\"RFC8482\" \"\""], "{}", d.output);

    // A client in no org.
    let d = lab.dig(&["-b", STRANGER_IP, "allowed.test", "A"]);
    assert_eq!(d.status, "REFUSED", "{}", d.output);
    let ede = d.ede.clone().unwrap_or_default();
    assert!(ede.starts_with("18 (Prohibited)"), "{ede}");
    let rec = record(&lab, &d.record_id().expect("record id"));
    assert_eq!(rec["reason"], "unknown_client", "{rec}");
    assert!(rec["org"].is_null(), "{rec}");

    let log = lab.dns_log();
    assert!(
        !log.iter().any(|v| v["qtype"] == 12 || v["qtype"] == 255),
        "PTR or ANY went upstream:\n{}",
        lab::dump(&log)
    );
    assert_upstream_only(&lab, &["allowed.test", "other.test"]);
}

#[test]
fn answers_are_filtered_and_chains_followed() {
    let lab = dns_lab();
    // Rebinding: the loopback address goes, the public one stays.
    let d = lab.dig(&["rebind.test", "A"]);
    assert_eq!(d.of("A"), ["198.18.2.10"], "{}", d.output);
    // Only denied addresses (loopback, metadata; IPv4-mapped, NAT64, ::1):
    // NODATA with EDE, recorded as denied_address.
    for qtype in ["A", "AAAA"] {
        let d = lab.dig(&["private.test", qtype, "+tcp"]);
        assert_eq!(d.status, "NOERROR", "{qtype}: {}", d.output);
        assert!(d.answers.is_empty(), "{qtype}: {}", d.output);
        let id = d.record_id().expect("EDE with record id");
        let rec = record(&lab, &id);
        assert_eq!(rec["reason"], "denied_address", "{rec}");
        assert_eq!(rec["upstream"], true, "{rec}");
        assert!(
            rec["detail"].as_str().unwrap_or("").contains("stripped"),
            "{rec}"
        );
    }
    // A cidr rule of the org lets its address through.
    let d = dig2(&lab, &["private.test", "A"]);
    assert_eq!(d.of("A"), ["169.254.169.254"], "{}", d.output);

    // CNAME chain: the targets need no rule; the address is bound to the name asked.
    let d = lab.dig(&["chain.test", "A"]);
    assert_eq!(
        d.of("CNAME"),
        ["c1.elsewhere.test.", "c2.far.test."],
        "{}",
        d.output
    );
    assert_eq!(d.of("A"), ["198.18.2.11"], "{}", d.output);
    let rec = lab.wait_evidence("chain record", |v| v["host"] == "chain.test");
    assert!(rec["answers"].to_string().contains("c2.far.test"), "{rec}");
    let d = lab.dig(&["-x", "198.18.2.11"]);
    assert_eq!(d.of("PTR"), ["chain.test."], "{}", d.output);

    // HTTPS: no ech, no hint outside the allowed set.
    let d = lab.dig(&["svc.test", "HTTPS"]);
    let https = d.of("HTTPS");
    assert_eq!(https.len(), 1, "{}", d.output);
    assert!(https[0].contains("ipv4hint=198.18.2.10"), "{}", https[0]);
    assert!(!https[0].contains("127.0.0.1"), "{}", https[0]);
    assert!(!https[0].contains("ech"), "{}", https[0]);
    assert!(https[0].contains("alpn=\"h2\""), "{}", https[0]);
}

/// A DNS message as hex: header fields, then the given questions.
pub(crate) fn message(id: u16, flags: u16, qdcount: u16, questions: &[(&str, u16)]) -> String {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&qdcount.to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    for (name, qtype) in questions {
        for label in name.split('.') {
            m.push(label.len() as u8);
            m.extend_from_slice(label.as_bytes());
        }
        m.push(0);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
    }
    data_encoding::HEXLOWER.encode(&m)
}

/// Send each case's message (hex) over UDP, then over TCP: each gets the
/// answer it names (see tests/fixtures/dnsraw.py), palisade keeps running
/// and still answers allowed.test.
pub(crate) fn raw_cases_then_allowed(lab: &mut Lab, cases: &[(&str, String, &str)]) {
    let hex: Vec<&str> = cases.iter().map(|(_, h, _)| h.as_str()).collect();
    for proto in ["udp", "tcp"] {
        let got = lab.dns_raw(proto, &hex);
        assert_eq!(got.len(), cases.len(), "{proto}: {got:?}");
        for ((what, _, want), got) in cases.iter().zip(&got) {
            assert_eq!(got, want, "{proto}: {what}\n{}", lab.proxy_output());
        }
        assert!(
            lab.wait_proxy_exit(Duration::from_millis(1)).is_none(),
            "palisade exited\n{}",
            lab.proxy_output()
        );
        let d = lab.dig(&["allowed.test", "A"]);
        assert_eq!(d.of("A"), ["198.18.2.10"], "{proto}: {}", d.output);
    }
}

#[test]
fn malformed_messages_get_formerr_or_notimp_and_the_shim_keeps_answering() {
    let mut lab = dns_lab();
    let long_label = format!("{}.test", "a".repeat(64));
    let long_name = vec!["b".repeat(63); 5].join(".");
    let cases: Vec<(&str, String, &str)> = vec![
        ("short", "0001".into(), "none"),
        (
            "no question",
            message(0x1101, 0x0100, 0, &[]),
            "rcode=1 id=4353",
        ),
        (
            "two questions",
            message(0x1102, 0x0100, 2, &[("allowed.test", 1), ("nope.test", 1)]),
            "rcode=1 id=4354",
        ),
        (
            "label over 63",
            message(0x1103, 0x0100, 1, &[(&long_label, 1)]),
            "rcode=1 id=4355",
        ),
        (
            "name over 255",
            message(0x1104, 0x0100, 1, &[(&long_name, 1)]),
            "rcode=1 id=4356",
        ),
        (
            "response as query",
            message(0x1105, 0x8180, 1, &[("nope.test", 1)]),
            "none",
        ),
        (
            "opcode STATUS",
            message(0x1106, 0x1100, 1, &[("nope.test", 1)]),
            "rcode=4 id=4358",
        ),
        (
            "opcode NOTIFY",
            message(0x1107, 0x2000, 1, &[("nope.test", 6)]),
            "rcode=4 id=4359",
        ),
        (
            "compression loop",
            format!("{}c00c00010001", &message(0x1108, 0x0100, 1, &[])),
            "rcode=1 id=4360",
        ),
        (
            "garbage after header",
            format!("{}ffffffffffffffff", &message(0x1109, 0x0100, 1, &[])),
            "rcode=1 id=4361",
        ),
    ];
    raw_cases_then_allowed(&mut lab, &cases);

    // Client subnet and unknown EDNS options are neither forwarded nor identity.
    let d = lab.dig(&[
        "+subnet=198.18.4.0/24",
        "+ednsopt=65001:abcd",
        "ecs.wild.test",
        "A",
    ]);
    assert_eq!(d.status, "NXDOMAIN", "{}", d.output);
    let log = lab.dns_log();
    let ecs = log
        .iter()
        .find(|v| v["name"] == "ecs.wild.test")
        .unwrap_or_else(|| panic!("ecs.wild.test not forwarded:\n{}", lab::dump(&log)));
    let opts = ecs["edns_options"].to_string();
    assert!(!opts.contains('8') && !opts.contains("65001"), "{ecs}");
    let rec = lab.wait_evidence("ecs record", |v| v["host"] == "ecs.wild.test");
    assert_eq!(rec["org"], "acme", "{rec}");

    assert_upstream_only(&lab, &["allowed.test", "ecs.wild.test"]);
}

#[test]
fn tcp_connections_are_capped_and_idle_ones_closed() {
    let lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&[SHIM])
        // The global cap, with room for it in the client's and org's own.
        .dns_extra(
            "max_tcp_connections = 2\nmax_tcp_connections_per_client = 2\n\
             max_tcp_connections_per_org = 2\nidle_timeout = \"1s\"\n",
        )
        .start();
    let q = message(0x2201, 0x0100, 1, &[("allowed.test", 1)]);
    let script = format!(
        r#"
import socket, struct, time
q = bytes.fromhex("{q}")
def ask():
    try:
        s = socket.create_connection(("{SHIM_IP}", 53), timeout=2)
        s.sendall(struct.pack("!H", len(q)) + q)
        d = s.recv(2)
        return "answer" if len(d) == 2 else "closed"
    except (ConnectionResetError, socket.timeout, BrokenPipeError):
        return "closed"
held = [socket.create_connection(("{SHIM_IP}", 53), timeout=3) for _ in range(2)]
time.sleep(0.3)
print(ask())
time.sleep(1.5)
def closed(h):
    try:
        return h.recv(1) == b""
    except (ConnectionResetError, socket.timeout):
        return False
print("held-closed" if all(closed(h) for h in held) else "held-open")
print(ask())
"#
    );
    let out = lab.client_exec("python3", &["-c", &script]);
    assert!(out.success(), "{}", out.describe());
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines,
        ["closed", "held-closed", "answer"],
        "{}",
        out.describe()
    );
}
