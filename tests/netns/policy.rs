//! Allow/deny decisions of the explicit proxy, checked end to end.

use crate::lab::{self, dump, Lab, DEFAULT_POLICY};
use crate::{assert_client_ip, assert_refused, record_id, record_ref};
use serde_json::Value;

/// Port number of a record, accepting 443 or "443".
fn port_of(v: &Value) -> Option<u64> {
    v["port"]
        .as_u64()
        .or_else(|| v["port"].as_str().and_then(|s| s.parse().ok()))
}

/// Allowed decision record for a connection from CLIENT_IP:`local_port`.
fn allow_record(lab: &Lab, kind: &str, host: &str, port: u64, local_port: Option<u16>) -> Value {
    let client = local_port.map(|p| format!("{}:{p}", lab::CLIENT_IP));
    let rec = lab.wait_evidence(&format!("allow {kind} {host}:{port}"), |v| {
        v["event"] == "decision"
            && v["decision"] == "allow"
            && v["kind"] == kind
            && v["host"] == host
            && port_of(v) == Some(port)
            && client.as_ref().is_none_or(|c| v["client"] == c.as_str())
    });
    assert_eq!(rec["reason"], "rule_match", "{rec}");
    assert_eq!(rec["mode"], "explicit", "{rec}");
    assert_eq!(rec["org"], "acme", "{rec}");
    assert!(record_id(&rec).is_some(), "record without id: {rec}");
    assert_client_ip(&rec, lab::CLIENT_IP);
    rec
}

/// Close record for decision `rec`.
fn close_record(lab: &Lab, rec: &Value) -> Value {
    let id = record_id(rec).expect("id");
    let close = lab.wait_evidence(&format!("close for {id}"), |v| {
        v["event"] == "close" && record_id_of(&v["conn"]).as_deref() == Some(id.as_str())
    });
    for f in ["bytes_up", "bytes_down", "duration_ms"] {
        assert!(
            close[f].is_u64(),
            "close record field {f} not a count: {close}"
        );
    }
    close
}

fn record_id_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

#[test]
fn connect_allow_records_decision_and_close() {
    let lab = Lab::start(DEFAULT_POLICY);
    let resp = lab.proxied_curl("https://allowed.test/", &[]);
    assert_eq!(resp.exit, Some(0), "{resp:?}\n{}", lab.proxy_output());
    assert_eq!(resp.connect_status, 200, "{resp:?}");
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(
        resp.body
            .contains("upstream=198.18.2.10 host=allowed.test tls=yes"),
        "{resp:?}"
    );

    let rec = allow_record(&lab, "tcp", "allowed.test", 443, resp.local_port);
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    assert_eq!(rec["sni"], "allowed.test", "{rec}");
    let close = close_record(&lab, &rec);
    assert!(close["bytes_down"].as_u64().unwrap() > 0, "{close}");
    assert!(close["bytes_up"].as_u64().unwrap() > 0, "{close}");

    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    assert_eq!(closes[0]["sni"], "allowed.test");
    assert_eq!(closes[0]["local"], "198.18.2.10:443");
}

#[test]
fn plain_http_allow_records_http_decision() {
    let lab = Lab::start(DEFAULT_POLICY);
    let resp = lab.proxied_curl("http://allowed.test/hello?x=1", &[]);
    assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
    assert!(
        resp.body
            .contains("upstream=198.18.2.10 host=allowed.test tls=no"),
        "{resp:?}"
    );
    let rec = allow_record(&lab, "http", "allowed.test", 80, resp.local_port);
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    assert!(rec["sni"].is_null(), "plain HTTP has no SNI: {rec}");
    // curl has closed its connection, so the allowed connection is closed.
    let close = close_record(&lab, &rec);
    assert!(close["bytes_down"].as_u64().unwrap() > 0, "{close}");

    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    // Forwarded in origin form with the right Host.
    assert_eq!(
        closes[0]["request_line"], "GET /hello?x=1 HTTP/1.1",
        "{}",
        closes[0]
    );
    assert_eq!(closes[0]["host"], "allowed.test", "{}", closes[0]);
}

/// Name-based denials, over plain HTTP and CONNECT; none reaches upstream
/// and none of the denied names is ever resolved.
#[test]
fn name_denials_never_reach_upstream_or_dns() {
    let lab = Lab::start(DEFAULT_POLICY);
    let cases = [
        ("other.test", "no_matching_rule"),
        ("blocked.wild.test", "explicit_deny"),
        ("BLOCKED.Wild.Test", "explicit_deny"),
        ("wild.test", "no_matching_rule"),
    ];
    for (host, reason) in cases {
        let r = lab.proxied_curl(&format!("http://{host}/"), &[]);
        let rec = assert_refused(&lab, &r, 403, reason, &format!("http://{host}/"));
        assert_eq!(rec["kind"], "http", "{rec}");
        assert_eq!(rec["org"], "acme", "{rec}");
        assert_client_ip(&rec, lab::CLIENT_IP);
        assert_eq!(port_of(&rec), Some(80), "{rec}");

        let r = lab.raw_connect(&format!("{host}:443"));
        let rec = assert_refused(&lab, &r, 403, reason, &format!("CONNECT {host}:443"));
        assert_eq!(rec["kind"], "tcp", "{rec}");
        assert_eq!(port_of(&rec), Some(443), "{rec}");
        assert_eq!(
            rec["host"].as_str().map(str::to_ascii_lowercase).as_deref(),
            Some(host.to_ascii_lowercase().as_str()),
            "{rec}"
        );
    }
    // curl's own view of a refused CONNECT.
    let r = lab.proxied_curl("https://other.test/", &[]);
    assert_ne!(r.exit, Some(0), "{r:?}");
    assert_eq!(r.connect_status, 403, "{r:?}");
    assert!(r.header("proxy-status").is_some(), "{r:?}");

    lab.assert_nothing_reached_upstream("name denials");
    let q = lab.dns_queries();
    for name in ["other.test", "blocked.wild.test", "wild.test"] {
        assert!(
            !q.iter()
                .any(|n| n == name || n.starts_with(&format!("{name}."))),
            "denied name {name} was resolved upstream: {q:?}"
        );
    }

    // Contrast: an allowed name is resolved through the same resolver.
    let ok = lab.proxied_curl("http://allowed.test/", &[]);
    assert_eq!(ok.status, 200, "{ok:?}");
    assert!(
        lab.dns_queries().iter().any(|n| n == "allowed.test"),
        "{:?}",
        lab.dns_queries()
    );
}

#[test]
fn port_not_allowed() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.raw_connect("allowed.test:8443");
    let rec = assert_refused(
        &lab,
        &r,
        403,
        "port_not_allowed",
        "CONNECT allowed.test:8443",
    );
    assert_eq!(port_of(&rec), Some(8443), "{rec}");
    assert_eq!(rec["kind"], "tcp", "{rec}");

    let r = lab.proxied_curl("http://allowed.test:8080/", &[]);
    let rec = assert_refused(
        &lab,
        &r,
        403,
        "port_not_allowed",
        "http://allowed.test:8080/",
    );
    assert_eq!(port_of(&rec), Some(8080), "{rec}");

    // cidr rule allows only port 80.
    let r = lab.raw_connect("198.18.2.30:443");
    assert_eq!(r.status, 403, "{r:?}");
    let body = r.body.clone();
    let rec = lab.wait_evidence("deny for CONNECT 198.18.2.30:443", |v| {
        v["decision"] == "deny"
            && record_ref(v).is_some_and(|r| body.contains(&format!("record {r})")))
    });
    assert!(
        rec["reason"] == "port_not_allowed" || rec["reason"] == "no_matching_rule",
        "{rec}"
    );
    lab.assert_nothing_reached_upstream("port denials");
}

/// Allowlisted names resolving to always-denied addresses.
#[test]
fn denied_addresses_are_never_dialled() {
    let lab = Lab::start(DEFAULT_POLICY);
    for (host, addr) in [("meta.test", "169.254.169.254"), ("loop.test", "127.0.0.1")] {
        let r = lab.proxied_curl(&format!("http://{host}/"), &[]);
        let rec = assert_refused(&lab, &r, 403, "denied_address", &format!("http://{host}/"));
        assert_eq!(rec["host"], host, "{rec}");
        let r = lab.raw_connect(&format!("{host}:443"));
        let rec = assert_refused(
            &lab,
            &r,
            403,
            "denied_address",
            &format!("CONNECT {host}:443"),
        );
        assert_eq!(rec["host"], host, "{rec}");
        // If an ip is recorded it must be the refused address.
        if !rec["ip"].is_null() {
            assert_eq!(rec["ip"], addr, "{rec}");
        }
        assert!(
            lab.dns_queries().iter().any(|n| n == host),
            "{host} not resolved"
        );
    }
    // Literal forms need a cidr rule anyway.
    let r = lab.raw_connect("127.0.0.1:443");
    assert_eq!(r.status, 403, "{r:?}");
    lab.assert_nothing_reached_upstream("denied addresses");
}

/// IP-literal targets: allowed only by a cidr rule, whatever the spelling.
#[test]
fn ip_literals_need_cidr_rules() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.raw_connect("198.18.2.10:443");
    let rec = assert_refused(&lab, &r, 403, "no_matching_rule", "CONNECT 198.18.2.10:443");
    assert_eq!(port_of(&rec), Some(443), "{rec}");

    // 198.18.2.20 spelled as hex, decimal and octal.
    assert_eq!(
        0xC612_0214_u32,
        u32::from(std::net::Ipv4Addr::new(198, 18, 2, 20))
    );
    assert_eq!(
        3_323_068_948_u32,
        u32::from(std::net::Ipv4Addr::new(198, 18, 2, 20))
    );
    // Each is that address (inet_aton, as curl and browsers read them),
    // decided and recorded as the canonical IP.
    for spelled in ["0xC6120214", "3323068948", "0306.022.02.024"] {
        let r = lab.raw_request(&format!(
            "GET http://{spelled}/ HTTP/1.1\r\nHost: {spelled}\r\n\r\n"
        ));
        let rec = assert_refused(&lab, &r, 403, "no_matching_rule", spelled);
        assert_eq!(rec["host"], "198.18.2.20", "{spelled}: {rec}");
    }
    lab.assert_nothing_reached_upstream("IP literal denials");
    let q = lab.dns_queries();
    assert!(q.is_empty(), "IP literals must not be resolved: {q:?}");

    // The cidr rule admits its address.
    let r = lab.proxied_curl("http://198.18.2.30/", &[]);
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(r.body.contains("upstream=198.18.2.30"), "{r:?}");
    let rec = lab.wait_evidence("allow 198.18.2.30", |v| {
        v["decision"] == "allow" && v["ip"] == lab::CIDR_IP && v["event"] == "decision"
    });
    assert_eq!(rec["reason"], "rule_match", "{rec}");
    assert_eq!(rec["kind"], "http", "{rec}");
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    assert_eq!(closes[0]["local"], "198.18.2.30:80");
}

#[test]
fn nxdomain_is_resolution_failed() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.proxied_curl("http://nx.test/", &[]);
    let rec = assert_refused(&lab, &r, 502, "resolution_failed", "http://nx.test/");
    assert_eq!(rec["host"], "nx.test", "{rec}");
    let r = lab.raw_connect("nx.test:443");
    assert_refused(&lab, &r, 502, "resolution_failed", "CONNECT nx.test:443");
    assert!(
        lab.dns_queries().iter().any(|n| n == "nx.test"),
        "{:?}",
        lab.dns_queries()
    );
    lab.assert_nothing_reached_upstream("nxdomain");
}

#[test]
fn host_header_mismatch_is_refused() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.proxied_curl("http://allowed.test/", &["-H", "Host: other.test"]);
    assert_refused(&lab, &r, 403, "host_mismatch", "Host: other.test");
    // Also when the Host header names another allowed host.
    let r = lab.raw_request("GET http://allowed.test/ HTTP/1.1\r\nHost: a.wild.test\r\n\r\n");
    assert_refused(&lab, &r, 403, "host_mismatch", "Host: a.wild.test");
    lab.assert_nothing_reached_upstream("host mismatch");
}

#[test]
fn unknown_client_is_refused() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.proxied_curl("http://allowed.test/", &["--interface", lab::STRANGER_IP]);
    let rec = assert_refused(&lab, &r, 403, "unknown_client", "stranger http");
    assert_client_ip(&rec, lab::STRANGER_IP);
    let r = lab.raw_request_from(
        lab::STRANGER_IP,
        "CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n",
    );
    let rec = assert_refused(&lab, &r, 403, "unknown_client", "stranger CONNECT");
    assert_client_ip(&rec, lab::STRANGER_IP);
    lab.assert_nothing_reached_upstream("unknown client");
    assert!(lab.dns_queries().is_empty(), "{:?}", lab.dns_queries());
}

#[test]
fn wildcard_matches_strict_subdomains_only() {
    let lab = Lab::start(DEFAULT_POLICY);
    let r = lab.raw_connect("wild.test:443");
    assert_refused(&lab, &r, 403, "no_matching_rule", "CONNECT wild.test:443");
    let r = lab.raw_connect("notwild.test:443");
    assert_refused(
        &lab,
        &r,
        403,
        "no_matching_rule",
        "CONNECT notwild.test:443",
    );
    lab.assert_nothing_reached_upstream("wildcard apex");

    let r = lab.proxied_curl("https://a.wild.test/", &[]);
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(
        r.body.contains("upstream=198.18.2.11 host=a.wild.test"),
        "{r:?}"
    );
    let rec = allow_record(&lab, "tcp", "a.wild.test", 443, r.local_port);
    assert_eq!(rec["ip"], lab::WILD_A_IP, "{rec}");
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    assert_eq!(closes[0]["local"], "198.18.2.11:443");
}
