//! Checks of the lab itself: isolation of the namespaces and the fixtures.

use crate::lab::{self, ca_pem, dump, Lab};
use std::process::Command;
use std::time::Duration;

/// The lab without Palisade: namespaces are isolated, the proxy namespace
/// does not forward, and every fixture answers.
#[test]
fn lab_is_isolated_and_fixtures_answer() {
    let lab = Lab::builder().without_proxy().start();

    // The proxy namespace must not route between client and upstream.
    let fwd = lab.proxy_ns_exec("cat", &["/proc/sys/net/ipv4/ip_forward"]);
    assert_eq!(
        fwd.stdout.trim(),
        "0",
        "ip_forward in proxy ns: {}",
        fwd.describe()
    );

    // Nothing of the lab is visible in the root namespace.
    let root = lab::must(Command::new("ip").args(["-o", "addr", "show"]));
    assert!(
        !root.stdout.contains("198.18."),
        "198.18.0.0/15 address leaked into the root namespace:\n{}",
        root.stdout
    );

    // The client namespace only knows its own link.
    let routes = lab.client_exec("ip", &["route", "show"]);
    assert!(routes.success(), "{}", routes.describe());
    assert!(
        !routes.stdout.contains("198.18.2.") && !routes.stdout.contains("default"),
        "client ns must have no route to upstream:\n{}",
        routes.stdout
    );
    let direct = lab.client_curl(&["http://198.18.2.10/"]);
    assert_ne!(
        direct.exit,
        Some(0),
        "direct access from client worked: {direct:?}"
    );
    assert_eq!(direct.status, 0, "{direct:?}");

    // The stranger address has a working return path to the proxy ns
    // (connection refused on an unused port, not a timeout).
    let probe = "import socket\ns = socket.socket()\ns.settimeout(3)\ns.bind(('198.18.3.2', 0))\n\
                 try:\n    s.connect(('198.18.1.1', 9))\nexcept ConnectionRefusedError:\n    print('refused')\n";
    let stranger = lab.client_exec("python3", &["-c", probe]);
    assert_eq!(stranger.stdout.trim(), "refused", "{}", stranger.describe());

    // Web fixture, plain and TLS, reached from the proxy namespace.
    let ns_p = lab.ns_proxy.clone();
    let plain = lab.curl_in(&ns_p, &["http://198.18.2.30/"]);
    assert_eq!(plain.status, 200, "{plain:?}");
    assert!(plain.body.contains("upstream=198.18.2.30"), "{plain:?}");
    let ca = ca_pem().display().to_string();
    let tls = lab.curl_in(
        &ns_p,
        &[
            "--cacert",
            &ca,
            "--resolve",
            "a.wild.test:443:198.18.2.11",
            "https://a.wild.test/",
        ],
    );
    assert_eq!(tls.status, 200, "{tls:?}");
    assert!(
        tls.body
            .contains("upstream=198.18.2.11 host=a.wild.test tls=yes"),
        "{tls:?}"
    );
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 2, "{}", dump(&closes));
    assert_eq!(closes[0]["local"], "198.18.2.30:80");
    assert_eq!(closes[0]["request_line"], "GET / HTTP/1.1");
    let tls_rec = closes
        .iter()
        .find(|v| v["local"] == "198.18.2.11:443")
        .expect("tls record");
    assert_eq!(tls_rec["sni"], "a.wild.test", "{tls_rec}");
    assert_eq!(tls_rec["host"], "a.wild.test", "{tls_rec}");
    assert!(tls_rec["bytes_received"].as_u64().unwrap() > 0, "{tls_rec}");

    // A TLS connection that sends nothing is logged with zero bytes.
    let silent = lab.proxy_ns_exec(
        "bash",
        &["-c", "exec 3<>/dev/tcp/198.18.2.10/443; exec 3>&-"],
    );
    assert!(silent.success(), "{}", silent.describe());
    // bash does not wait for the fixture, which may not even have logged the
    // "open" yet: wait for this connection's own close record.
    let silent_rec = lab.wait_upstream("close of the silent connection", |v| {
        v["event"] == "close" && v["local"] == "198.18.2.10:443"
    });
    assert_eq!(silent_rec["bytes_received"], 0, "{silent_rec}");

    // DNS fixture.
    let dns = lab::fixtures_dir().join("dns.py").display().to_string();
    for (name, want) in [
        ("allowed.test", "NOERROR 198.18.2.10"),
        ("Loop.Test", "NOERROR 127.0.0.1"),
        ("meta.test", "NOERROR 169.254.169.254"),
        ("nx.test", "NXDOMAIN"),
        ("wild.test", "NOERROR 198.18.2.14"),
        ("zzz.wild.test", "NXDOMAIN"),
    ] {
        let q = lab.proxy_ns_exec("python3", &[&dns, "query", "--server", lab::DNS_IP, name]);
        assert_eq!(q.stdout.trim(), want, "query {name}: {}", q.describe());
    }
    let queries = lab.dns_queries();
    assert_eq!(
        queries,
        [
            "allowed.test",
            "loop.test",
            "meta.test",
            "nx.test",
            "wild.test",
            "zzz.wild.test"
        ],
        "dns query log"
    );

    // The canary on the proxy namespace's loopback works (so an empty canary
    // log in other tests means something).
    let canary = lab.curl_in(&ns_p, &["http://127.0.0.1/"]);
    assert_eq!(canary.status, 200, "{canary:?}");
    lab::wait_until("canary close record", Duration::from_secs(5), || {
        lab.canary_log().iter().any(|v| v["event"] == "close")
    });
    // One connection: open, its request, close.
    let events: Vec<String> = lab
        .canary_log()
        .iter()
        .map(|v| v["event"].as_str().unwrap_or("?").to_string())
        .collect();
    assert_eq!(
        events,
        ["open", "request", "close"],
        "{}",
        dump(&lab.canary_log())
    );
}

/// The client cannot reach upstream directly, but can through Palisade.
#[test]
fn direct_access_fails_but_proxy_succeeds() {
    let lab = Lab::start(lab::DEFAULT_POLICY);
    let direct = lab.client_curl(&["http://198.18.2.30/"]);
    assert_ne!(
        direct.exit,
        Some(0),
        "direct access from client worked: {direct:?}"
    );
    assert_eq!(direct.status, 0, "{direct:?}");
    assert!(
        lab.upstream_log().is_empty(),
        "{}",
        dump(&lab.upstream_log())
    );

    let via = lab.proxied_curl("http://198.18.2.30/", &[]);
    assert_eq!(via.status, 200, "{via:?}\n{}", lab.proxy_output());
    assert!(via.body.contains("upstream=198.18.2.30"), "{via:?}");
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    // The upstream sees the proxy's address, never the client's.
    let peer = closes[0]["peer"].as_str().unwrap();
    assert!(peer.starts_with("198.18.2.1:"), "upstream peer {peer}");
}
