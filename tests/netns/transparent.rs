//! Transparent mode behind the shipped nftables ruleset: the proxy namespace
//! is the sandbox's gateway, loads `docker/nftables.conf` (parameterised for
//! the lab), and Palisade decides every redirected TCP connection. Clients
//! use no proxy settings at all.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, ca_pem, dump, Lab, DEFAULT_POLICY};

pub(crate) const TRANSPARENT: &str = "198.18.1.1:15001";

/// The lab with a transparent listener and the gateway ruleset loaded.
fn gateway_lab() -> Lab {
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .start();
    load_gateway(&lab);
    lab
}

/// Load the shipped gateway ruleset (only its defines changed) into the
/// proxy namespace and route the sandbox through it. The lab needs a
/// transparent listener on [`TRANSPARENT`] (and a DNS shim on port 5353 for
/// DNS through the gateway).
pub(crate) fn load_gateway(lab: &Lab) {
    load_ruleset(lab, &gateway_ruleset());
    // The sandbox's default route is the gateway.
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["route", "add", "default", "via", "198.18.1.1"],
    );
    assert!(out.success(), "{}", out.describe());
}

/// `rules` loaded into the proxy namespace with `nft -f`.
pub(crate) fn load_ruleset(lab: &Lab, rules: &str) {
    let out = lab::run_with_timeout(
        std::process::Command::new("ip").args(["netns", "exec", &lab.ns_proxy, "nft", "-f", "-"]),
        Some(rules.as_bytes()),
        Duration::from_secs(10),
    );
    assert!(out.success(), "nft: {}", out.describe());
}

/// The shipped gateway ruleset with only its defines changed for the lab.
pub(crate) fn gateway_ruleset() -> String {
    let rules = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docker/nftables.conf"),
    )
    .unwrap();
    // Parameterise the shipped ruleset for the lab: only the defines change.
    let rules = rules.replace(
        "define SANDBOX_IF = \"sandbox0\"",
        "define SANDBOX_IF = \"p0\"",
    );
    assert!(
        rules.contains("define SANDBOX_IF = \"p0\""),
        "ruleset defines changed"
    );
    rules
}

/// curl from the sandbox with no proxy, `name` pinned to `addr`.
fn curl(lab: &Lab, url: &str, resolve: &str) -> lab::CmdOutput {
    curl_with(lab, &[], url, resolve)
}

/// [`curl`] with `extra` options first (`-6`: IPv6 only).
pub(crate) fn curl_with(lab: &Lab, extra: &[&str], url: &str, resolve: &str) -> lab::CmdOutput {
    let ca = ca_pem().display().to_string();
    let mut args = extra.to_vec();
    args.extend_from_slice(&[
        "-sS",
        "--noproxy",
        "*",
        "--max-time",
        "8",
        "--cacert",
        &ca,
        "--resolve",
        resolve,
        "-o",
        "/dev/stdout",
        "-w",
        "\nHTTP %{http_code}\n",
        url,
    ]);
    lab.client_exec("curl", &args)
}

pub(crate) fn transparent_records(lab: &Lab) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["mode"] == "transparent")
        .collect()
}

#[test]
fn allowed_names_pass_through_the_gateway_without_proxy_settings() {
    let lab = gateway_lab();
    let ok = curl(
        &lab,
        "https://allowed.test/",
        "allowed.test:443:198.18.2.10",
    );
    assert!(
        ok.success() && ok.stdout.contains("HTTP 200"),
        "{}",
        ok.describe()
    );
    let rec = lab.wait_evidence("transparent allow over TLS", |v| {
        v["mode"] == "transparent" && v["event"] == "decision" && v["sni"] == "allowed.test"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    assert_eq!(rec["port"], 443, "{rec}");
    lab.wait_evidence("close record of the TLS connection", |v| {
        v["event"] == "close" && v["conn"] == rec["id"] && v["bytes_down"].as_u64() > Some(0)
    });

    let plain = curl(&lab, "http://allowed.test/", "allowed.test:80:198.18.2.10");
    assert!(
        plain.success() && plain.stdout.contains("HTTP 200"),
        "{}",
        plain.describe()
    );
    lab.wait_evidence("transparent allow over HTTP", |v| {
        v["mode"] == "transparent" && v["decision"] == "allow" && v["port"] == 80
    });
}

#[test]
fn denied_and_inconsistent_connections_are_reset_and_reach_nothing() {
    let lab = gateway_lab();
    // A name with no rule.
    let r = curl(&lab, "https://other.test/", "other.test:443:198.18.2.13");
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = lab.wait_evidence("other.test denied", |v| {
        v["mode"] == "transparent" && v["host"] == "other.test"
    });
    assert_eq!(rec["reason"], "no_matching_rule", "{rec}");

    // An allowed SNI sent to another name's address.
    let r = curl(
        &lab,
        "https://allowed.test/",
        "allowed.test:443:198.18.2.13",
    );
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = lab.wait_evidence("allowed SNI at a foreign address", |v| {
        v["mode"] == "transparent" && v["sni"] == "allowed.test" && v["ip"] == lab::OTHER_IP
    });
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");
    assert_eq!(rec["decision"], "deny", "{rec}");

    // Plain HTTP with a forged Host.
    let forged = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "-H",
            "Host: allowed.test",
            "http://198.18.2.13/",
        ],
    );
    assert!(
        !forged.stdout.contains("upstream="),
        "{}",
        forged.describe()
    );
    let rec = lab.wait_evidence("forged Host", |v| {
        v["mode"] == "transparent"
            && v["host"] == "allowed.test"
            && v["port"] == 80
            && v["ip"] == lab::OTHER_IP
    });
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");

    // An IP with no cidr rule, and a port outside every rule.
    let r = curl(&lab, "http://198.18.2.20/", "x:80:198.18.2.20");
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let banner = lab.client_exec(
        "bash",
        &[
            "-c",
            &format!(
                "exec 3<>/dev/tcp/198.18.2.10/{}; timeout 3 cat <&3",
                lab::BANNER_PORT
            ),
        ],
    );
    assert!(!banner.stdout.contains("SSH-2.0"), "{}", banner.describe());

    lab.assert_nothing_reached_upstream("transparent denials");
    let denied: Vec<Value> = transparent_records(&lab)
        .into_iter()
        .filter(|v| v["decision"] == "deny")
        .collect();
    assert!(denied.len() >= 5, "{}", dump(&denied));
}

#[test]
fn udp_quic_direct_listener_and_spoofed_sources_go_nowhere() {
    let lab = gateway_lab();
    // UDP to an outside resolver and QUIC to an allowed host: no DNS shim
    // listens, nothing is forwarded, nothing arrives.
    let dns = lab::fixtures_dir().join("dns.py").display().to_string();
    let q = lab.client_exec(
        "timeout",
        &[
            "5",
            "python3",
            &dns,
            "query",
            "--server",
            lab::DNS_IP,
            "allowed.test",
        ],
    );
    assert!(!q.stdout.contains("NOERROR"), "{}", q.describe());
    assert!(lab.dns_queries().is_empty(), "{:?}", lab.dns_queries());
    let quic = lab.client_exec(
        "python3",
        &["-c", "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); [s.sendto(b'\\xc0quic', ('198.18.2.10', 443)) for _ in range(3)]"],
    );
    assert!(quic.success(), "{}", quic.describe());

    // A direct connection to the transparent listener (not redirected) is dropped.
    let direct = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "3",
            "http://198.18.1.1:15001/",
        ],
    );
    assert!(!direct.success(), "{}", direct.describe());

    // A source address that routes via another interface is dropped by the
    // reverse-path filter before anything sees it.
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["addr", "add", "198.18.2.50/32", "dev", "lo"],
    );
    assert!(out.success(), "{}", out.describe());
    let spoof = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "3",
            "--interface",
            "198.18.2.50",
            "--resolve",
            "allowed.test:80:198.18.2.10",
            "http://allowed.test/",
        ],
    );
    assert!(!spoof.stdout.contains("upstream="), "{}", spoof.describe());

    // A positive end: an allowed request through the gateway, sent after
    // all of the above along the same path. Once it is logged at the
    // upstream (and every upstream connection logged closed) and recorded,
    // anything the others reached would be logged and recorded too.
    let marker = "/marker-after-udp-quic-direct-spoofed";
    let m = curl(
        &lab,
        &format!("http://allowed.test{marker}"),
        "allowed.test:80:198.18.2.10",
    );
    assert!(m.stdout.contains("HTTP 200"), "{}", m.describe());
    let seen = lab.wait_upstream(marker, |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {marker} ")))
    });
    lab.wait_evidence("the marker's allow", |v| {
        v["mode"] == "transparent" && v["decision"] == "allow" && v["port"] == 80
    });
    lab.upstream_settled();
    let reached: Vec<Value> = lab
        .upstream_log()
        .into_iter()
        .filter(|v| v["id"] != seen["id"])
        .collect();
    assert!(
        reached.is_empty(),
        "udp, quic, direct, spoofed: upstream received connections:\n{}",
        dump(&reached)
    );
    assert!(lab.canary_log().is_empty(), "{}", dump(&lab.canary_log()));
    let records = transparent_records(&lab);
    assert!(
        records.iter().all(|v| v["client"]
            .as_str()
            .is_none_or(|c| !c.starts_with("198.18.2.50"))),
        "{}",
        dump(&records)
    );
}

#[test]
fn shipped_rulesets_parse() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docker");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "conf") {
            let out = lab::run_with_timeout(
                std::process::Command::new("nft")
                    .args(["-c", "-f"])
                    .arg(&path),
                None,
                Duration::from_secs(10),
            );
            assert!(out.success(), "{}: {}", path.display(), out.describe());
            checked += 1;
        }
    }
    assert!(checked >= 2, "rulesets checked: {checked}");
}

/// `/etc/netns/NS/resolv.conf`, which `ip netns exec NS` shows the
/// namespace's programs as `/etc/resolv.conf`; removed on drop.
pub(crate) struct NetnsResolvConf(PathBuf);

impl NetnsResolvConf {
    pub(crate) fn new(ns: &str, nameserver: &str) -> NetnsResolvConf {
        let dir = PathBuf::from("/etc/netns").join(ns);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("resolv.conf"),
            format!("nameserver {nameserver}\n"),
        )
        .unwrap();
        NetnsResolvConf(dir)
    }
}

impl Drop for NetnsResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn sandbox_dns_is_redirected_to_the_shim_and_its_bindings_admit_the_connection() {
    // The sandbox believes its resolver is the outside one (198.18.2.2);
    // the gateway redirects port 53 to the shim, which hands out bindings
    // that the transparent listener then checks.
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .proxy_option(&format!("transparent = [\"{TRANSPARENT}\"]"))
        .dns_listen(&["198.18.1.1:5353"])
        .start();
    load_gateway(&lab);
    let _resolv = NetnsResolvConf::new(&lab.ns_client, lab::DNS_IP);

    let ca = ca_pem().display().to_string();
    let ok = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "--cacert",
            &ca,
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "https://allowed.test/",
        ],
    );
    assert_eq!(ok.stdout, "200", "{}", ok.describe());
    let dns = lab.wait_evidence("the shim answered the sandbox's lookup", |v| {
        v["kind"] == "dns" && v["host"] == "allowed.test" && v["decision"] == "allow"
    });
    assert_eq!(dns["mode"], "dns", "{dns}");
    let tcp = lab.wait_evidence("the transparent connection", |v| {
        v["mode"] == "transparent" && v["host"] == "allowed.test" && v["event"] == "decision"
    });
    assert_eq!(tcp["decision"], "allow", "{tcp}");
    assert_eq!(tcp["ip"], lab::ALLOWED_IP, "{tcp}");

    // A denied name is refused by the shim and never reaches the real resolver.
    let denied = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "https://other.test/",
        ],
    );
    assert!(!denied.success(), "{}", denied.describe());
    lab.wait_evidence("the shim refused other.test", |v| {
        v["kind"] == "dns" && v["host"] == "other.test" && v["decision"] == "deny"
    });
    assert!(
        !lab.dns_queries().iter().any(|q| q.contains("other.test")),
        "{:?}",
        lab.dns_queries()
    );
}
