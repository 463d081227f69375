//! The explicit listener reads a connection's first request head itself: a
//! CONNECT is answered and becomes its tunnel without the HTTP layer, and
//! anything else (or a refused CONNECT) continues through the HTTP layer
//! with the bytes already read. What a client sent early must reach where
//! it would have gone before.

use std::time::Duration;

use crate::lab::{Lab, DEFAULT_POLICY};

const WAIT: Duration = Duration::from_secs(5);

/// A blank line before the head, and a request sent in the same write as
/// the CONNECT head: the tunnel carries it to the upstream, once.
#[test]
fn bytes_sent_with_the_connect_head_reach_the_tunnel() {
    let lab = Lab::start(DEFAULT_POLICY);
    let mut c = lab.client_conn();
    c.send(
        b"\r\nCONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n\
          GET /early-bytes HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\n",
    )
    .unwrap();
    let (status, _) = c.read_head(WAIT);
    assert_eq!(status, 200, "CONNECT\n{}", lab.proxy_output());
    let resp = c.read_response(WAIT);
    assert_eq!(
        resp.status, 200,
        "the early GET through the tunnel: {resp:?}"
    );
    lab.wait_upstream("the early GET", |v| {
        v["request_line"]
            .as_str()
            .is_some_and(|l| l.starts_with("GET /early-bytes "))
    });
    lab.wait_evidence("the tunnel's allow", |v| {
        v["event"] == "decision" && v["decision"] == "allow" && v["port"] == 80
    });
    // And the tunnel goes on carrying what follows.
    c.send(b"GET /later HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        .unwrap();
    assert_eq!(c.read_response(WAIT).status, 200, "a later GET");
    let early: Vec<_> = lab
        .upstream_settled()
        .into_iter()
        .filter(|v| {
            v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with("GET /early-bytes "))
        })
        .collect();
    assert!(!early.is_empty(), "the early GET reached the upstream");
}

/// A first CONNECT refused: its answer (with `Proxy-Status`), then the
/// connection serves the next request as HTTP, as it always has.
#[test]
fn a_refused_first_connect_leaves_the_connection_serving_http() {
    let lab = Lab::start(DEFAULT_POLICY);
    let mut c = lab.client_conn();
    for host in ["blocked.wild.test", "unlisted.test"] {
        c.send(format!("CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n").as_bytes())
            .unwrap();
        let refused = c.read_response(WAIT);
        assert_eq!(refused.status, 403, "{host}: {refused:?}");
        assert!(
            refused.header("proxy-status").is_some(),
            "Proxy-Status on the refusal of {host}: {refused:?}"
        );
    }
    c.send(b"GET http://allowed.test/after-refusals HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        .unwrap();
    assert_eq!(
        c.read_response(WAIT).status,
        200,
        "forwarded after refusals"
    );
    lab.wait_upstream("the forwarded GET", |v| {
        v["request_line"]
            .as_str()
            .is_some_and(|l| l.starts_with("GET /after-refusals "))
    });
    for host in ["blocked.wild.test", "unlisted.test"] {
        lab.wait_evidence(&format!("the refusal of {host}"), |v| {
            v["decision"] == "deny" && v["host"] == host
        });
    }
}
