//! Transparent mode for an IPv6 sandbox behind the shipped nftables
//! ruleset: the lab's IPv6 side (`2001:2::/48`), the gateway loading
//! `docker/nftables.conf` as [`crate::transparent`] does, Palisade's
//! transparent listener and DNS shim on the gateway's IPv6 address. The
//! sandbox uses no proxy settings; every connection below is IPv6.

use std::path::PathBuf;

use serde_json::Value;

use crate::lab::{self, ca_pem, dump, Lab, ALLOWED_IP6, DNS_IP6, OTHER_IP6, ULA_IP6, UNLISTED_IP6};
use crate::transparent::{load_gateway, transparent_records, NetnsResolvConf, TRANSPARENT};

/// The v6 listeners: the addresses REDIRECT sends the sandbox's IPv6 to
/// (the sandbox interface's first global address).
const TRANSPARENT6: &str = "[2001:2:1::1]:15001";
const SHIM6: &str = "[2001:2:1::1]:5353";

/// The sandbox's v4 and v6 networks; allowed.test on 80 and 443; ula.test
/// (whose AAAA is unique-local) on 80; every IPv6 address on 80, which
/// still never opens an always-denied one.
const V6_POLICY: &str = r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24", "2001:2:1::/64"]

[[org.allow]]
host = "allowed.test"
ports = [80, 443]

[[org.allow]]
host = "ula.test"
ports = [80]

[[org.allow]]
cidr = "::/0"
ports = [80]
"#;

/// The lab with its IPv6 side, transparent listeners and a DNS shim on both
/// families, the gateway ruleset loaded and the sandbox's IPv6 default
/// route through the gateway.
fn gateway_lab_v6(transparent: &[&str], dns: &[&str]) -> Lab {
    let listeners: Vec<String> = transparent.iter().map(|a| format!("{a:?}")).collect();
    let lab = Lab::builder()
        .ipv6()
        .policy(V6_POLICY)
        .proxy_option(&format!("transparent = [{}]", listeners.join(", ")))
        .dns_listen(dns)
        .start();
    let rules = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docker/nftables.conf"),
    )
    .unwrap();
    // The shipped default prefix is the lab's: only the interface changes.
    assert!(
        rules.contains("define SANDBOX_NET6 = 2001:2:1::/64"),
        "ruleset defines changed"
    );
    load_gateway(&lab);
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["-6", "route", "add", "default", "via", lab::GATEWAY_IP6],
    );
    assert!(out.success(), "{}", out.describe());
    lab
}

fn default_lab() -> Lab {
    gateway_lab_v6(&[TRANSPARENT, TRANSPARENT6], &["198.18.1.1:5353", SHIM6])
}

/// curl -6 from the sandbox with no proxy, `name` pinned to `addr`.
fn curl6(lab: &Lab, url: &str, resolve: &str) -> lab::CmdOutput {
    crate::transparent::curl_with(lab, &["-6"], url, resolve)
}

#[test]
fn ipv6_allowed_tls_and_http_pass_to_the_original_destination() {
    let lab = default_lab();
    let ok = curl6(
        &lab,
        "https://allowed.test/tls6",
        &format!("allowed.test:443:[{ALLOWED_IP6}]"),
    );
    assert!(
        ok.success() && ok.stdout.contains("HTTP 200"),
        "{}",
        ok.describe()
    );
    // The upstream answered on its IPv6 address, to the name the client sent.
    assert!(
        ok.stdout.contains(&format!("upstream={ALLOWED_IP6}")),
        "{}",
        ok.describe()
    );
    let rec = lab.wait_evidence("transparent allow over TLS, IPv6", |v| {
        v["mode"] == "transparent" && v["event"] == "decision" && v["sni"] == "allowed.test"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["org"], "acme", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP6, "{rec}");
    assert_eq!(rec["port"], 443, "{rec}");
    assert!(
        rec["client"]
            .as_str()
            .is_some_and(|c| c.contains(lab::CLIENT_IP6)),
        "{rec}"
    );
    lab.wait_evidence("close record of the TLS connection", |v| {
        v["event"] == "close" && v["conn"] == rec["id"] && v["bytes_down"].as_u64() > Some(0)
    });
    let seen = lab.wait_upstream("the TLS request at the v6 upstream", |v| {
        v["event"] == "close" && v["request_line"] == "GET /tls6 HTTP/1.1"
    });
    assert_eq!(seen["sni"], "allowed.test", "{seen}");
    assert_eq!(seen["local"], format!("[{ALLOWED_IP6}]:443"), "{seen}");

    let plain = curl6(
        &lab,
        "http://allowed.test/http6",
        &format!("allowed.test:80:[{ALLOWED_IP6}]"),
    );
    assert!(
        plain.success() && plain.stdout.contains("HTTP 200"),
        "{}",
        plain.describe()
    );
    let rec = lab.wait_evidence("transparent allow over HTTP, IPv6", |v| {
        v["mode"] == "transparent" && v["decision"] == "allow" && v["port"] == 80
    });
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], ALLOWED_IP6, "{rec}");
    let seen = lab.wait_upstream("the HTTP request at the v6 upstream", |v| {
        v["event"] == "close" && v["request_line"] == "GET /http6 HTTP/1.1"
    });
    assert_eq!(seen["local"], format!("[{ALLOWED_IP6}]:80"), "{seen}");
    assert_eq!(seen["host"], "allowed.test", "{seen}");

    // An IPv6 literal (`Host: [2001:2:2::20]`) names the address itself:
    // decided by the cidr rule alone.
    let literal = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            &format!("http://[{UNLISTED_IP6}]/literal6"),
        ],
    );
    assert!(
        literal.stdout.contains(&format!("upstream={UNLISTED_IP6}")),
        "{}",
        literal.describe()
    );
    let rec = lab.wait_evidence("transparent allow of an IPv6 literal", |v| {
        v["mode"] == "transparent" && v["ip"] == UNLISTED_IP6
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["host"], UNLISTED_IP6, "{rec}");
    assert_eq!(rec["rule"], "acme/allow/2", "{rec}");
    lab.wait_upstream("the literal's request", |v| {
        v["event"] == "close" && v["request_line"] == "GET /literal6 HTTP/1.1"
    });
}

#[test]
fn ipv6_unlisted_foreign_sni_denied_address_and_spoofed_source_reach_nothing() {
    let lab = default_lab();
    // A name with no rule.
    let r = curl6(
        &lab,
        "https://other.test/",
        &format!("other.test:443:[{OTHER_IP6}]"),
    );
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = lab.wait_evidence("other.test denied", |v| {
        v["mode"] == "transparent" && v["host"] == "other.test"
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "no_matching_rule", "{rec}");
    assert_eq!(rec["ip"], OTHER_IP6, "{rec}");

    // An allowed SNI sent to another name's address.
    let r = curl6(
        &lab,
        "https://allowed.test/",
        &format!("allowed.test:443:[{OTHER_IP6}]"),
    );
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = lab.wait_evidence("allowed SNI at a foreign v6 address", |v| {
        v["mode"] == "transparent" && v["sni"] == "allowed.test" && v["ip"] == OTHER_IP6
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");

    // Plain HTTP with a forged Host at a v6 address.
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
            &format!("http://[{OTHER_IP6}]/"),
        ],
    );
    assert!(
        !forged.stdout.contains("upstream="),
        "{}",
        forged.describe()
    );
    let rec = lab.wait_evidence("forged Host at a v6 address", |v| {
        v["mode"] == "transparent"
            && v["host"] == "allowed.test"
            && v["port"] == 80
            && v["ip"] == OTHER_IP6
    });
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");
    // ... and an IPv6 literal Host naming another address.
    let forged = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "-H",
            &format!("Host: [{ALLOWED_IP6}]"),
            &format!("http://[{UNLISTED_IP6}]/"),
        ],
    );
    assert!(
        !forged.stdout.contains("upstream="),
        "{}",
        forged.describe()
    );
    let rec = lab.wait_evidence("forged literal Host", |v| {
        v["mode"] == "transparent" && v["host"] == ALLOWED_IP6 && v["ip"] == UNLISTED_IP6
    });
    assert_eq!(rec["reason"], "sni_mismatch", "{rec}");

    // A unique-local address: by address under `::/0`, and by an allowed
    // name that resolves there. Both always denied.
    let r = lab.client_exec(
        "curl",
        &[
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            &format!("http://[{ULA_IP6}]/"),
        ],
    );
    assert!(!r.stdout.contains("upstream="), "{}", r.describe());
    let rec = lab.wait_evidence("unique-local address denied", |v| {
        v["mode"] == "transparent" && v["ip"] == ULA_IP6 && v["host"] == ULA_IP6
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "denied_address", "{rec}");
    let r = curl6(
        &lab,
        "http://ula.test/",
        &format!("ula.test:80:[{ULA_IP6}]"),
    );
    assert!(!r.stdout.contains("HTTP 200"), "{}", r.describe());
    let rec = lab.wait_evidence("ula.test at its unique-local address denied", |v| {
        v["mode"] == "transparent" && v["host"] == "ula.test"
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "denied_address", "{rec}");

    // A source outside the sandbox's prefix is dropped by the ruleset's
    // anti-spoofing before anything sees it, even one the gateway routes
    // back over the sandbox interface (so that reverse-path filtering
    // alone would let it in).
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["addr", "add", "2001:2:1:ff::50/128", "dev", "lo", "nodad"],
    );
    assert!(out.success(), "{}", out.describe());
    let out = lab.proxy_ns_exec(
        "ip",
        &[
            "-6",
            "route",
            "add",
            "2001:2:1:ff::/64",
            "via",
            lab::CLIENT_IP6,
            "dev",
            "p0",
        ],
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
            "2001:2:1:ff::50",
            "--resolve",
            &format!("allowed.test:80:[{ALLOWED_IP6}]"),
            "http://allowed.test/",
        ],
    );
    assert!(!spoof.stdout.contains("upstream="), "{}", spoof.describe());

    lab.assert_nothing_reached_upstream("IPv6 transparent denials");
    let records = transparent_records(&lab);
    let denied: Vec<&Value> = records.iter().filter(|v| v["decision"] == "deny").collect();
    assert!(denied.len() >= 5, "{}", dump(&records));
    assert!(
        records.iter().all(|v| v["client"]
            .as_str()
            .is_none_or(|c| !c.contains("2001:2:1:ff::50"))),
        "{}",
        dump(&records)
    );
}

#[test]
fn ipv6_sandbox_dns_is_redirected_to_the_shim_and_its_aaaa_bindings_admit_the_connection() {
    let lab = default_lab();
    // The sandbox believes its resolver is the outside one's IPv6 address;
    // the gateway redirects port 53 to the shim's IPv6 listener.
    let _resolv = NetnsResolvConf::new(&lab.ns_client, DNS_IP6);
    let server = format!("@{DNS_IP6}");
    for transport in ["+notcp", "+tcp"] {
        let d = lab.dig_in(
            &lab.ns_client.clone(),
            &[&server, transport, "AAAA", "allowed.test"],
        );
        assert_eq!(d.status, "NOERROR", "{transport}: {}", d.output);
        assert_eq!(
            d.of("AAAA"),
            vec![ALLOWED_IP6.to_string()],
            "{transport}: {}",
            d.output
        );
    }
    let dns = lab.wait_evidence("the shim answered the sandbox's AAAA lookup", |v| {
        v["kind"] == "dns" && v["host"] == "allowed.test" && v["decision"] == "allow"
    });
    assert_eq!(dns["mode"], "dns", "{dns}");
    assert_eq!(dns["org"], "acme", "{dns}");
    // Nothing the sandbox sent reached the resolver's IPv6 address: only
    // the shim's own forwarded queries, at its IPv4 one.
    let at_v6: Vec<Value> = lab
        .dns_log()
        .into_iter()
        .filter(|q| q["local"] == DNS_IP6)
        .collect();
    assert!(at_v6.is_empty(), "{}", dump(&at_v6));

    // The address the shim handed out admits the connection under its name.
    let ca = ca_pem().display().to_string();
    let ok = lab.client_exec(
        "curl",
        &[
            "-6",
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
    let tcp = lab.wait_evidence("the transparent IPv6 connection", |v| {
        v["mode"] == "transparent" && v["host"] == "allowed.test" && v["event"] == "decision"
    });
    assert_eq!(tcp["decision"], "allow", "{tcp}");
    assert_eq!(tcp["ip"], ALLOWED_IP6, "{tcp}");

    // A denied name is refused by the shim and never reaches the resolver.
    let d = lab.dig_in(&lab.ns_client.clone(), &[&server, "AAAA", "other.test"]);
    assert_ne!(d.status, "NOERROR", "{}", d.output);
    lab.wait_evidence("the shim refused other.test", |v| {
        v["kind"] == "dns" && v["host"] == "other.test" && v["decision"] == "deny"
    });
    assert!(
        !lab.dns_queries().iter().any(|q| q.contains("other.test")),
        "{:?}",
        lab.dns_queries()
    );
}

#[test]
fn one_dual_stack_listener_serves_both_families() {
    // `[::]:15001` and `[::]:5353` take the sandbox's IPv4 (as IPv4-mapped
    // addresses) and IPv6 alike; each is decided by its own original
    // destination.
    let lab = gateway_lab_v6(&["[::]:15001"], &["[::]:5353"]);
    // The sandbox routes via the gateway's link-local address, as a host
    // configured by router advertisements does.
    // (Once past duplicate address detection: a tentative address is not
    // answered for.)
    let mut link_local = String::new();
    lab::wait_until("the gateway's link-local address", lab::CMD_TIMEOUT, || {
        let show = lab.proxy_ns_exec(
            "ip",
            &[
                "-6",
                "-o",
                "addr",
                "show",
                "dev",
                "p0",
                "scope",
                "link",
                "-tentative",
            ],
        );
        link_local = show
            .stdout
            .split_whitespace()
            .skip_while(|w| *w != "inet6")
            .nth(1)
            .and_then(|a| a.split('/').next())
            .unwrap_or_default()
            .to_string();
        !link_local.is_empty()
    });
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &[
            "-6",
            "route",
            "replace",
            "default",
            "via",
            &link_local,
            "dev",
            "c0",
        ],
    );
    assert!(out.success(), "{}", out.describe());
    // Neighbour discovery from the sandbox's link-local address (a
    // datagram between link-local addresses solicits from one) is
    // answered.
    let script = format!(
        "import socket, time\n\
         s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         for _ in range(3):\n    s.sendto(b'x', ('{link_local}%c0', 9)); time.sleep(0.3)\n"
    );
    let sent = lab.client_exec("python3", &["-c", &script]);
    assert!(sent.success(), "{}", sent.describe());
    let neigh = lab.client_exec("ip", &["-6", "neigh", "show", &link_local, "dev", "c0"]);
    assert!(neigh.stdout.contains("lladdr"), "{}", neigh.describe());
    let v6 = curl6(
        &lab,
        "https://allowed.test/",
        &format!("allowed.test:443:[{ALLOWED_IP6}]"),
    );
    assert!(v6.stdout.contains("HTTP 200"), "{}", v6.describe());
    let ca = ca_pem().display().to_string();
    let v4 = lab.client_exec(
        "curl",
        &[
            "-4",
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "--cacert",
            &ca,
            "--resolve",
            &format!("allowed.test:443:{}", lab::ALLOWED_IP),
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "https://allowed.test/",
        ],
    );
    assert_eq!(v4.stdout, "200", "{}", v4.describe());
    for ip in [ALLOWED_IP6, lab::ALLOWED_IP] {
        let rec = lab.wait_evidence(&format!("transparent allow to {ip}"), |v| {
            v["mode"] == "transparent" && v["event"] == "decision" && v["ip"] == ip
        });
        assert_eq!(rec["decision"], "allow", "{rec}");
        assert_eq!(rec["org"], "acme", "{rec}");
    }
    for (server, rtype, want) in [
        (format!("@{DNS_IP6}"), "AAAA", ALLOWED_IP6),
        (format!("@{}", lab::DNS_IP), "A", lab::ALLOWED_IP),
    ] {
        for transport in ["+notcp", "+tcp"] {
            let d = lab.dig_in(
                &lab.ns_client.clone(),
                &[&server, transport, rtype, "allowed.test"],
            );
            assert_eq!(d.of(rtype), vec![want.to_string()], "{}", d.output);
        }
    }
    let v4_query = lab.wait_evidence("the shim's record of the IPv4 query", |v| {
        v["kind"] == "dns" && v["decision"] == "allow" && v["qtype"] == "A"
    });
    assert_eq!(v4_query["org"], "acme", "{v4_query}");
    // IPv4 clients are recorded as IPv4, not as IPv4-mapped IPv6.
    let all = lab.evidence();
    let clients: Vec<&str> = all.iter().filter_map(|v| v["client"].as_str()).collect();
    assert!(
        clients.iter().any(|c| c.starts_with(lab::CLIENT_IP))
            && clients.iter().all(|c| !c.contains("::ffff:")),
        "{}",
        dump(&all)
    );
}

/// A silent connection from `source` to `dest`, both "[ip]:port", made in
/// the sandbox namespace and held open by the caller.
fn hold_from(lab: &Lab, source: &str, dest: &str) -> std::net::TcpStream {
    let src: std::net::SocketAddr = source.parse().unwrap();
    let dst: std::net::SocketAddr = dest.parse().unwrap();
    lab::in_netns(&lab.ns_client, move || {
        let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
        s.bind(&src.into())?;
        s.connect_timeout(&dst.into(), std::time::Duration::from_secs(3))?;
        Ok::<_, std::io::Error>(std::net::TcpStream::from(s))
    })
    .unwrap_or_else(|e| panic!("connect {source} -> {dest}: {e}\n{}", lab.proxy_output()))
}

#[test]
fn ipv6_clients_of_no_org_pay_by_their_64() {
    // Only ::2 is the org's; ::100 and ::101 are strangers in one /64.
    let policy = V6_POLICY.replace("\"2001:2:1::/64\"", "\"2001:2:1::2/128\"");
    assert_ne!(policy, V6_POLICY);
    let lab = Lab::builder()
        .ipv6()
        .policy(&policy)
        .proxy_option(&format!(
            "transparent = [\"{TRANSPARENT}\", \"{TRANSPARENT6}\"]"
        ))
        .proxy_option("max_connections_per_client = 1")
        .proxy_option("detect_timeout = \"30s\"")
        .start();
    load_gateway(&lab);
    let out = lab.exec(
        &lab.ns_client,
        "ip",
        &["-6", "route", "add", "default", "via", lab::GATEWAY_IP6],
    );
    assert!(out.success(), "{}", out.describe());
    for a in ["2001:2:1::100/64", "2001:2:1::101/64"] {
        let out = lab.exec(
            &lab.ns_client,
            "ip",
            &["addr", "add", a, "dev", "c0", "nodad"],
        );
        assert!(out.success(), "{}", out.describe());
    }
    let dest = format!("[{ALLOWED_IP6}]:443");
    // ::100 holds its /64's one connection (silent: detection waits).
    let held = hold_from(&lab, "[2001:2:1::100]:0", &dest);
    let second = |what: &str| {
        let r = lab.client_exec(
            "curl",
            &[
                "-sS",
                "--noproxy",
                "*",
                "--max-time",
                "5",
                "--interface",
                "2001:2:1::101",
                &format!("http://[{ALLOWED_IP6}]/{what}"),
            ],
        );
        assert!(!r.stdout.contains("upstream="), "{}", r.describe());
    };
    second("while-held");
    let rec = lab.wait_evidence("::101 refused while ::100 holds the /64's share", |v| {
        v["mode"] == "transparent"
            && v["client"]
                .as_str()
                .is_some_and(|c| c.contains("2001:2:1::101"))
    });
    assert_eq!(rec["reason"], "limit_exceeded", "{rec}");
    // The org's own client is charged to the org, not to the /64.
    let ca = ca_pem().display().to_string();
    let org = lab.client_exec(
        "curl",
        &[
            "-6",
            "-sS",
            "--noproxy",
            "*",
            "--max-time",
            "8",
            "--cacert",
            &ca,
            "--interface",
            lab::CLIENT_IP6,
            "--resolve",
            &format!("allowed.test:443:[{ALLOWED_IP6}]"),
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "https://allowed.test/",
        ],
    );
    assert_eq!(org.stdout, "200", "{}", org.describe());
    // Once ::100 lets go, ::101 is decided (and denied: it is in no org).
    drop(held);
    lab.wait_evidence("::100's connection ended", |v| {
        v["mode"] == "transparent"
            && v["client"]
                .as_str()
                .is_some_and(|c| c.contains("2001:2:1::100"))
    });
    second("after-release");
    let rec = lab.wait_evidence("::101 decided after the release", |v| {
        v["mode"] == "transparent"
            && v["reason"] != "limit_exceeded"
            && v["client"]
                .as_str()
                .is_some_and(|c| c.contains("2001:2:1::101"))
    });
    assert_eq!(rec["reason"], "unknown_client", "{rec}");
    // Only the org's request reached the upstream.
    let closes = lab.upstream_settled();
    assert!(
        closes.len() == 1 && closes[0]["sni"] == "allowed.test",
        "{}",
        dump(&lab.upstream_log())
    );
}
