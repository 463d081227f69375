//! Bounds and edge cases of the explicit proxy: head size and count limits,
//! slow clients, connection caps, idle tunnels, drain on SIGTERM, malformed
//! requests, name spellings, keep-alive and server-speaks-first tunnels.

use crate::lab::{self, dump, Closed, Lab, RawConn, BANNER, BANNER_PORT};
use crate::{assert_client_ip, assert_refused, record_id};
use serde_json::Value;
use std::thread;
use std::time::{Duration, Instant};

/// The default policy plus a rule for the banner port, a name resolving to
/// a denied and a good address, and an internationalised name.
fn policy() -> String {
    format!(
        "{}
[[org.allow]]
host = \"mixed.test\"

[[org.allow]]
host = \"bücher.test\"
",
        lab::banner_policy()
    )
}

fn lab_with(options: &[&str]) -> Lab {
    let mut b = Lab::builder().policy(&policy());
    for o in options {
        b = b.proxy_option(o);
    }
    b.start()
}

const SECS5: Duration = Duration::from_secs(5);

fn get(host: &str) -> String {
    format!("GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n")
}

/// The decision record of the connection from CLIENT_IP:`local_port`.
fn decision_of(lab: &Lab, local_port: u16, decision: &str) -> Value {
    let client = format!("{}:{local_port}", lab::CLIENT_IP);
    lab.wait_evidence(&format!("{decision} decision for {client}"), |v| {
        v["event"] == "decision" && v["client"] == client.as_str() && v["decision"] == decision
    })
}

/// The close record of decision `rec`.
fn close_of(lab: &Lab, rec: &Value) -> Value {
    let id = record_id(rec).expect("record id");
    let close = lab.wait_evidence(&format!("close for {id}"), |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    for f in ["bytes_up", "bytes_down", "duration_ms"] {
        assert!(close[f].is_u64(), "close field {f} not a count: {close}");
    }
    close
}

/// CONNECT to the banner port through a held connection; returns it once
/// the banner has arrived (after the detect timeout).
fn banner_tunnel(lab: &Lab) -> RawConn {
    let mut c = lab.client_conn();
    let st = c.connect(&format!("allowed.test:{BANNER_PORT}"));
    assert_eq!(st, 200, "CONNECT to banner port\n{}", lab.proxy_output());
    let got = c.read_until(BANNER.as_bytes(), SECS5);
    assert!(got.is_some(), "no banner through the tunnel");
    c
}

/// Send `line` and expect it echoed back through the tunnel.
fn echo(c: &mut RawConn, line: &str) -> bool {
    c.send(line.as_bytes()).is_ok() && c.read_until(line.as_bytes(), SECS5).is_some()
}

// ---------------------------------------------------------------------------
// 1. Head limits

#[test]
fn request_head_over_limit_gets_431() {
    let lab = lab_with(&["max_request_head_bytes = 4096", "max_headers = 20"]);
    // Over the limit but within hyper's read buffer (at least 8 KiB):
    // Palisade's own exact check answers.
    let pad = "a".repeat(5000);
    let r = lab.raw_request(&format!(
        "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nX-Pad: {pad}\r\n\r\n"
    ));
    let rec = assert_refused(&lab, &r, 431, "bad_request", "5000-byte head");
    assert_eq!(rec["kind"], "http", "{rec}");
    assert_client_ip(&rec, lab::CLIENT_IP);
    let r = lab.raw_request(&format!(
        "CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\nX-Pad: {pad}\r\n\r\n"
    ));
    let rec = assert_refused(&lab, &r, 431, "bad_request", "5000-byte CONNECT head");
    assert_eq!(rec["kind"], "tcp", "{rec}");
    lab.assert_nothing_reached_upstream("head over limit");
    assert!(lab.dns_queries().is_empty(), "{:?}", lab.dns_queries());

    // Contrast: a head under both limits goes through.
    let headers: String = (0..15).map(|i| format!("X-H{i}: {i}\r\n")).collect();
    let r = lab.raw_request(&format!(
        "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n{headers}X-Pad: {}\r\n\r\n",
        "b".repeat(3000)
    ));
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
}

#[test]
fn request_head_far_over_limit_gets_431_with_record() {
    let lab = lab_with(&["max_request_head_bytes = 4096"]);
    // Beyond hyper's read buffer too.
    let pad = "a".repeat(20_000);
    let r = lab.raw_request(&format!(
        "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nX-Pad: {pad}\r\n\r\n"
    ));
    assert_refused(&lab, &r, 431, "bad_request", "20000-byte head");
    lab.assert_nothing_reached_upstream("head far over limit");
}

#[test]
fn too_many_headers_get_431_with_record() {
    let lab = lab_with(&["max_headers = 20"]);
    let headers: String = (0..25).map(|i| format!("X-H{i}: {i}\r\n")).collect();
    let r = lab.raw_request(&format!(
        "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n{headers}\r\n"
    ));
    assert_refused(&lab, &r, 431, "bad_request", "26 headers");
    lab.assert_nothing_reached_upstream("too many headers");
}

// ---------------------------------------------------------------------------
// 2. Slow clients

fn assert_cut_off(lab: &Lab, closed: Closed, what: &str) {
    match closed {
        Closed::After(d) => assert!(
            d >= Duration::from_millis(700) && d < SECS5,
            "{what}: closed after {d:?}, want about header_read_timeout (1s)"
        ),
        Closed::StillOpen => panic!(
            "{what}: connection still open 5s after it stalled (header_read_timeout = 1s)\n{}",
            lab.proxy_output()
        ),
    }
}

#[test]
fn slow_request_heads_are_cut_off() {
    let lab = lab_with(&["header_read_timeout = \"1s\""]);
    let partial = b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n";

    // A partial head, then nothing.
    let mut c = lab.client_conn();
    c.send(partial).unwrap();
    assert_cut_off(&lab, c.wait_closed(SECS5), "stalled partial head");

    // A partial head trickled one header line every 300 ms.
    let mut c = lab.client_conn();
    let start = Instant::now();
    c.send(partial).unwrap();
    let mut closed = Closed::StillOpen;
    for _ in 0..20 {
        // bounded: 20 x 300 ms
        if let Closed::After(_) = c.wait_closed(Duration::from_millis(300)) {
            closed = Closed::After(start.elapsed());
            break;
        }
        if c.send(b"X-Slow: 1\r\n").is_err() {
            closed = Closed::After(start.elapsed());
            break;
        }
    }
    assert_cut_off(&lab, closed, "trickled head");

    // A connection that never sends a byte.
    let mut c = lab.client_conn();
    assert_cut_off(&lab, c.wait_closed(SECS5), "silent client");

    lab.assert_nothing_reached_upstream("slow heads");
    assert!(lab.dns_queries().is_empty(), "{:?}", lab.dns_queries());
}

// ---------------------------------------------------------------------------
// 3. Connection caps

/// A connection over a cap is answered at once; read it without sending.
fn over_limit_response(lab: &Lab) -> lab::HttpResp {
    let mut c = lab.client_conn();
    c.read_response(SECS5)
}

#[test]
fn per_org_connection_cap() {
    let lab = lab_with(&["max_connections_per_org = 2"]);
    let mut held = vec![banner_tunnel(&lab), banner_tunnel(&lab)];

    let r = over_limit_response(&lab);
    let rec = assert_refused(&lab, &r, 503, "limit_exceeded", "third acme connection");
    assert_eq!(rec["org"], "acme", "{rec}");
    assert_client_ip(&rec, lab::CLIENT_IP);
    assert!(
        r.header("proxy-status")
            .is_some_and(|p| p.contains("connection_limit_reached")),
        "{r:?}"
    );
    // A client sending its request at once (like curl) sees the same.
    let r = lab.raw_request(&get("allowed.test"));
    assert_refused(&lab, &r, 503, "limit_exceeded", "third acme request");

    // Clients of no org have a bucket of their own.
    let r = lab.raw_request_from(lab::STRANGER_IP, &get("allowed.test"));
    assert_refused(
        &lab,
        &r,
        403,
        "unknown_client",
        "stranger while acme is full",
    );

    // Only the two tunnels reached the upstream.
    let opens: Vec<Value> = lab
        .upstream_log()
        .into_iter()
        .filter(|v| v["event"] == "open")
        .collect();
    assert_eq!(opens.len(), 2, "{}", dump(&opens));

    // Closing one frees its slot (released asynchronously: retry, bounded).
    let first = held.remove(0);
    let first_port = first.local_port();
    first.close();
    let mut admitted = None;
    for _ in 0..50 {
        let r = lab.raw_request(&get("allowed.test"));
        if r.status == 200 {
            admitted = Some(r);
            break;
        }
        assert_eq!(r.status, 503, "{r:?}");
        thread::sleep(Duration::from_millis(100));
    }
    let r = admitted.unwrap_or_else(|| panic!("no slot freed\n{}", lab.proxy_output()));
    assert!(r.body.contains("upstream=198.18.2.10"), "{r:?}");
    let rec = decision_of(&lab, first_port, "allow");
    close_of(&lab, &rec);
    // The other tunnel still works.
    assert!(echo(&mut held[0], "still here\n"), "held tunnel broke");
}

#[test]
fn global_connection_cap() {
    let lab = lab_with(&["max_connections = 1"]);
    let held = banner_tunnel(&lab);
    let r = lab.raw_request_from(lab::STRANGER_IP, &get("allowed.test"));
    let rec = assert_refused(&lab, &r, 503, "limit_exceeded", "stranger over global cap");
    assert!(rec["org"].is_null(), "{rec}");
    assert_client_ip(&rec, lab::STRANGER_IP);
    held.close();
    let mut last = None;
    for _ in 0..50 {
        let r = lab.raw_request_from(lab::STRANGER_IP, &get("allowed.test"));
        if r.status != 503 {
            last = Some(r);
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let r = last.unwrap_or_else(|| panic!("global slot never freed\n{}", lab.proxy_output()));
    assert_refused(&lab, &r, 403, "unknown_client", "stranger after release");
}

// ---------------------------------------------------------------------------
// 4. Tunnel idle timeout

#[test]
fn idle_tunnel_is_closed_but_busy_one_is_not() {
    let lab = lab_with(&["idle_timeout = \"1s\""]);
    let mut c = banner_tunnel(&lab);
    let port = c.local_port();
    // Traffic every 400 ms for well over the idle timeout keeps it open.
    for i in 0..6 {
        assert!(
            echo(&mut c, "ping\n"),
            "tunnel closed while busy (round {i})"
        );
        thread::sleep(Duration::from_millis(400));
    }
    // Silence both ways: closed by the proxy.
    match c.wait_closed(SECS5) {
        Closed::After(d) => assert!(d < Duration::from_secs(4), "closed after {d:?}"),
        Closed::StillOpen => panic!("idle tunnel still open after 5s\n{}", lab.proxy_output()),
    }
    let rec = decision_of(&lab, port, "allow");
    assert_eq!(rec["port"], BANNER_PORT, "{rec}");
    let close = close_of(&lab, &rec);
    assert_eq!(close["bytes_up"], 30, "{close}");
    assert_eq!(close["bytes_down"], (BANNER.len() + 30) as u64, "{close}");
    assert!(close["duration_ms"].as_u64().unwrap() >= 2400, "{close}");
    // The upstream saw the proxy hang up (not its own 30 s timeout).
    let up = lab.wait_upstream("banner close", |v| {
        v["event"] == "close" && v["local"] == format!("{}:{BANNER_PORT}", lab::ALLOWED_IP)
    });
    assert!(up["error"].is_null(), "{up}");
    assert_eq!(up["bytes_received"], 30, "{up}");
}

// ---------------------------------------------------------------------------
// 5. Drain on SIGTERM

/// Poll (bounded) until a new connection to the proxy is refused.
fn wait_not_accepting(lab: &Lab) {
    for _ in 0..40 {
        match lab.try_client_conn() {
            Err(_) => return,
            Ok(c) => c.close(),
        }
        thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "proxy still accepting 2s after SIGTERM\n{}",
        lab.proxy_output()
    );
}

#[test]
fn drain_keeps_open_tunnel_until_client_closes() {
    let mut lab = lab_with(&["drain_timeout = \"6s\""]);
    let mut c = banner_tunnel(&lab);
    let port = c.local_port();
    assert!(echo(&mut c, "before\n"));
    lab.signal_proxy("-TERM");
    wait_not_accepting(&lab);
    let r = lab.proxied_curl("http://allowed.test/", &[]);
    assert_eq!(r.exit, Some(7), "new request during drain: {r:?}");
    // The open tunnel still carries traffic.
    thread::sleep(Duration::from_millis(500));
    assert!(echo(&mut c, "after\n"), "tunnel broken during drain");
    assert!(
        lab.wait_proxy_exit(Duration::from_millis(100)).is_none(),
        "exited with a tunnel open"
    );
    c.close();
    let closed_at = Instant::now();
    let st = lab
        .wait_proxy_exit(Duration::from_secs(8))
        .unwrap_or_else(|| panic!("still running after drain\n{}", lab.proxy_output()));
    assert_eq!(st.code(), Some(0), "{st}\n{}", lab.proxy_output());
    assert!(
        closed_at.elapsed() < Duration::from_secs(3),
        "exit took {:?} after the last tunnel closed (drain_timeout 6s)",
        closed_at.elapsed()
    );
    let rec = decision_of(&lab, port, "allow");
    let close = close_of(&lab, &rec);
    assert_eq!(close["bytes_up"], 13, "{close}");
}

#[test]
fn drain_timeout_closes_remaining_tunnels() {
    let mut lab = lab_with(&["drain_timeout = \"2s\""]);
    let mut c = banner_tunnel(&lab);
    let port = c.local_port();
    let sent = Instant::now();
    lab.signal_proxy("-TERM");
    wait_not_accepting(&lab);
    assert!(echo(&mut c, "during\n"), "tunnel broken during drain");
    match c.wait_closed(Duration::from_secs(8)) {
        Closed::After(_) => {
            let t = sent.elapsed();
            assert!(
                t >= Duration::from_millis(1500) && t < Duration::from_secs(5),
                "tunnel closed {t:?} after SIGTERM (drain_timeout 2s)"
            );
        }
        Closed::StillOpen => panic!("tunnel outlived the drain\n{}", lab.proxy_output()),
    }
    let st = lab
        .wait_proxy_exit(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running after drain\n{}", lab.proxy_output()));
    assert_eq!(st.code(), Some(0), "{st}\n{}", lab.proxy_output());
    let rec = decision_of(&lab, port, "allow");
    let close = close_of(&lab, &rec);
    assert_eq!(close["bytes_up"], 7, "{close}");
}

// ---------------------------------------------------------------------------
// 6. Malformed requests

#[test]
fn bad_requests_get_400_with_record() {
    let lab = lab_with(&[]);
    let cases: &[(&str, &str, &str)] = &[
        (
            "CONNECT a..b:443",
            "CONNECT a..b:443 HTTP/1.1\r\nHost: a..b:443\r\n\r\n",
            "tcp",
        ),
        (
            "CONNECT without port",
            "CONNECT host-without-port HTTP/1.1\r\nHost: host-without-port\r\n\r\n",
            "tcp",
        ),
        (
            "origin-form",
            "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            "http",
        ),
        (
            "https absolute-form",
            "GET https://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
            "http",
        ),
        (
            "Upgrade",
            "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
            "http",
        ),
        (
            "two Host headers",
            "GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\nHost: allowed.test\r\n\r\n",
            "http",
        ),
    ];
    for (what, req, kind) in cases {
        let r = lab.raw_request(req);
        let rec = assert_refused(&lab, &r, 400, "bad_request", what);
        assert_eq!(rec["kind"], *kind, "{what}: {rec}");
        assert_eq!(rec["org"], "acme", "{what}: {rec}");
        assert_client_ip(&rec, lab::CLIENT_IP);
    }
    lab.assert_nothing_reached_upstream("bad requests");
    assert!(lab.dns_queries().is_empty(), "{:?}", lab.dns_queries());
}

#[test]
fn unparseable_connect_target_gets_400_with_record() {
    let lab = lab_with(&[]);
    // The HTTP parser itself refuses this request line: a bare 400, but the
    // refusal is still recorded.
    let r = lab.raw_request("CONNECT [::1 HTTP/1.1\r\nHost: [::1\r\n\r\n");
    assert_eq!(r.status, 400, "{r:?}");
    let rec = lab.wait_evidence("bad_request for an unparseable request", |v| {
        v["decision"] == "deny"
            && v["reason"] == "bad_request"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("request not parsed"))
    });
    assert_eq!(rec["mode"], "explicit", "{rec}");
    lab.assert_nothing_reached_upstream("CONNECT [::1");
}

/// docs/decisions.md, "Explicit-proxy details": a body with both
/// Transfer-Encoding and Content-Length is framed by Transfer-Encoding only
/// and the connection closed after the response.
#[test]
fn transfer_encoding_with_content_length_is_never_forwarded_ambiguously() {
    let lab = lab_with(&[]);
    for (what, headers) in [
        (
            "TE then CL",
            "Transfer-Encoding: chunked\r\nContent-Length: 5",
        ),
        (
            "CL then TE",
            "Content-Length: 5\r\nTransfer-Encoding: chunked",
        ),
    ] {
        // An empty chunked body, then a smuggled second request that must
        // not be forwarded.
        let r = lab.raw_request(&format!(
            "POST http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n{headers}\r\n\r\n0\r\n\r\nGET http://allowed.test/smuggled HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
        ));
        assert_eq!(r.status, 200, "{what}: {r:?}");
    }
    let log = lab.upstream_settled();
    let lines: Vec<&str> = log
        .iter()
        .filter_map(|v| v["request_line"].as_str())
        .collect();
    assert_eq!(
        lines,
        vec!["POST / HTTP/1.1", "POST / HTTP/1.1"],
        "{}",
        dump(&log)
    );
}

// ---------------------------------------------------------------------------
// 7. Name spellings

#[test]
fn name_spellings_are_normalised() {
    let lab = lab_with(&[]);
    // Upper case and a trailing dot, from curl.
    let r = lab.proxied_curl("http://ALLOWED.test./", &[]);
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(r.body.contains("upstream=198.18.2.10"), "{r:?}");
    let rec = decision_of(&lab, r.local_port.expect("local port"), "allow");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");

    // Same through CONNECT.
    let mut c = lab.client_conn();
    assert_eq!(c.connect(&format!("ALLOWED.TEST.:{BANNER_PORT}")), 200);
    assert!(
        c.read_until(BANNER.as_bytes(), SECS5).is_some(),
        "no banner"
    );
    let rec = decision_of(&lab, c.local_port(), "allow");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    c.close();

    // An internationalised name spelled as upper-case punycode.
    let r = lab.raw_request(&get("XN--BCHER-KVA.TEST"));
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    let rec = lab.wait_evidence("allow xn--bcher-kva.test", |v| {
        v["decision"] == "allow" && v["host"] == "xn--bcher-kva.test"
    });
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    assert!(
        lab.dns_queries().iter().any(|n| n == "xn--bcher-kva.test"),
        "{:?}",
        lab.dns_queries()
    );
    // The same name in Unicode, upper case and fullwidth: a request target
    // must be ASCII (RFC 9112), so the proxy may refuse it as malformed, but
    // if it takes it, it must be the allowed name.
    for spelled in ["BÜCHER.test", "ｂüｃｈｅｒ.test"] {
        let r = lab.raw_request(&get(spelled));
        match r.status {
            200 => {
                assert!(r.body.contains("upstream=198.18.2.10"), "{spelled}: {r:?}");
            }
            400 => {}
            _ => panic!("{spelled}: {r:?}"),
        }
    }
    assert!(
        lab.evidence()
            .iter()
            .all(|v| v["decision"] != "allow" || v["ip"] == lab::ALLOWED_IP),
        "{}",
        dump(&lab.evidence())
    );
}

#[test]
fn userinfo_never_changes_the_host_dialled() {
    let lab = lab_with(&[]);
    // An allowed name as userinfo does not allow the real host.
    let r =
        lab.raw_request("GET http://allowed.test@other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n");
    let rec = assert_refused(&lab, &r, 403, "no_matching_rule", "allowed.test@other.test");
    assert_eq!(rec["host"], "other.test", "{rec}");
    lab.assert_nothing_reached_upstream("userinfo to other.test");
    // And a denied name as userinfo does not deny the real one.
    let r = lab.raw_request(
        "GET http://other.test:80@allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    );
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(r.body.contains("upstream=198.18.2.10"), "{r:?}");
    let rec = lab.wait_evidence("allow allowed.test with userinfo", |v| {
        v["decision"] == "allow" && v["host"] == "allowed.test"
    });
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 1, "{}", dump(&closes));
    assert_eq!(closes[0]["local"], "198.18.2.10:80", "{}", closes[0]);
    assert_eq!(
        closes[0]["request_line"], "GET /x HTTP/1.1",
        "{}",
        closes[0]
    );
    let q = lab.dns_queries();
    assert!(!q.iter().any(|n| n == "other.test"), "{q:?}");
}

#[test]
fn mixed_answer_dials_only_the_good_address() {
    let lab = lab_with(&[]);
    let r = lab.proxied_curl("http://mixed.test/", &[]);
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(r.body.contains("upstream=198.18.2.10"), "{r:?}");
    let rec = decision_of(&lab, r.local_port.expect("port"), "allow");
    assert_eq!(rec["host"], "mixed.test", "{rec}");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    // Through CONNECT as well.
    let mut c = lab.client_conn();
    assert_eq!(c.connect("mixed.test:80"), 200);
    c.send(
        get("mixed.test")
            .replace("http://mixed.test/", "/")
            .as_bytes(),
    )
    .unwrap();
    let resp = c.read_response(SECS5);
    assert_eq!(resp.status, 200, "{resp:?}");
    assert!(resp.body.contains("upstream=198.18.2.10"), "{resp:?}");
    let rec = decision_of(&lab, c.local_port(), "allow");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    // The proxy's own loopback was never dialled.
    lab.assert_canary_untouched("mixed answer");
}

// ---------------------------------------------------------------------------
// 8. Keep-alive

#[test]
fn each_request_on_a_kept_alive_connection_is_decided() {
    let lab = lab_with(&[]);
    let mut c = lab.client_conn();
    let port = c.local_port();
    let client = format!("{}:{port}", lab::CLIENT_IP);
    for (i, (host, status)) in [
        ("allowed.test", 200),
        ("other.test", 403),
        ("allowed.test", 200),
    ]
    .into_iter()
    .enumerate()
    {
        c.send(get(host).as_bytes())
            .unwrap_or_else(|e| panic!("request {i} ({host}): connection gone: {e}"));
        let r = c.read_response(SECS5);
        assert_eq!(r.status, status, "request {i} ({host}): {r:?}");
        if status == 403 {
            assert!(r.body.contains("no_matching_rule"), "{r:?}");
        }
    }
    let recs: Vec<Value> = lab
        .evidence()
        .into_iter()
        .filter(|v| v["event"] == "decision" && v["client"] == client.as_str())
        .collect();
    let summary: Vec<(String, String)> = recs
        .iter()
        .map(|v| {
            (
                v["host"].as_str().unwrap_or("").to_owned(),
                v["decision"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("allowed.test".to_owned(), "allow".to_owned()),
            ("other.test".to_owned(), "deny".to_owned()),
            ("allowed.test".to_owned(), "allow".to_owned()),
        ],
        "{}",
        dump(&recs)
    );
    assert!(recs.iter().all(|v| v["kind"] == "http"), "{}", dump(&recs));
    let closes = lab.upstream_settled();
    assert_eq!(closes.len(), 2, "{}", dump(&closes));
    assert!(
        closes.iter().all(|v| v["local"] == "198.18.2.10:80"),
        "{}",
        dump(&closes)
    );
}

// ---------------------------------------------------------------------------
// 9. Server speaks first

#[test]
fn server_speaks_first_through_connect() {
    let lab = lab_with(&[]);
    let mut c = lab.client_conn();
    let port = c.local_port();
    assert_eq!(c.connect(&format!("allowed.test:{BANNER_PORT}")), 200);
    let start = Instant::now();
    let got = c.read_until(BANNER.as_bytes(), SECS5);
    let waited = start.elapsed();
    assert_eq!(
        got.as_deref(),
        Some(BANNER.as_bytes()),
        "banner through tunnel\n{}",
        lab.proxy_output()
    );
    // Held until the detect timeout (1 s) showed the client is silent.
    assert!(
        waited >= Duration::from_millis(700) && waited < Duration::from_secs(4),
        "banner after {waited:?}"
    );
    assert!(echo(&mut c, "hello\n"), "no echo");
    let rec = decision_of(&lab, port, "allow");
    assert_eq!(rec["kind"], "tcp", "{rec}");
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["port"], BANNER_PORT, "{rec}");
    assert_eq!(rec["rule"], "banner", "{rec}");
    assert!(rec["sni"].is_null(), "{rec}");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    c.close();
    let close = close_of(&lab, &rec);
    assert_eq!(close["bytes_up"], 6, "{close}");
    assert_eq!(close["bytes_down"], (BANNER.len() + 6) as u64, "{close}");
    let up = lab.wait_upstream("banner connection closed", |v| {
        v["event"] == "close" && v["local"] == format!("{}:{BANNER_PORT}", lab::ALLOWED_IP)
    });
    assert_eq!(up["bytes_received"], 6, "{up}");
}
