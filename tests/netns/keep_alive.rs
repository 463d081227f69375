//! Keep-alive absolute-form requests on the explicit listener, through
//! real sockets, behind the counting upstream of [`crate::pool`]:
//!
//! (a) many requests on one client connection are each decided and
//!     recorded (one decision and one close record per request), a
//!     refused one among them answered and the connection kept;
//! (b) pipelined requests, sent in one write, are answered in order;
//! (c) a head over the configured bound on the second request of a
//!     connection is answered 431 and recorded, as the first would be;
//!     one beyond the HTTP layer's buffer too;
//! (d) a client that sends its first request fast and then trickles the
//!     second head is cut at `header_read_timeout`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::lab::{dump, Closed, Lab};
use crate::pool::{get, lab_with, url, PORT};
use crate::{assert_refused, record_id};

const SECS10: Duration = Duration::from_secs(10);

/// A keep-alive GET of `path`, as the client writes it.
fn get_head(path: &str) -> String {
    format!(
        "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\n\r\n",
        url(path)
    )
}

/// The decision record of the request for `path`.
fn decision_of(lab: &Lab, path: &str) -> serde_json::Value {
    lab.wait_evidence(&format!("decision of {path}"), |v| {
        v["event"] == "decision" && v["kind"] == "http" && v["path"] == path
    })
}

#[test]
fn many_keep_alive_requests_on_one_connection_are_each_decided_and_recorded() {
    let (lab, up) = lab_with(&[]);
    let mut c = lab.client_conn();
    let n = 40;
    for i in 0..n {
        get(&lab, &mut c, &format!("/ka/{i}"));
        if i == n / 2 {
            // A refused request in the middle: answered, recorded, and
            // the connection serves the next one.
            c.send(b"GET http://denied.test/x HTTP/1.1\r\nHost: denied.test\r\n\r\n")
                .expect("send");
            let resp = c.read_response(SECS10);
            assert_refused(
                &lab,
                &resp,
                403,
                "no_matching_rule",
                "denied GET mid-connection",
            );
        }
    }
    // One client connection: each request rode the one upstream connection.
    assert_eq!(up.opens(), 1, "{}", dump(&up.log()));
    let mut ids = BTreeSet::new();
    for i in 0..n {
        let path = format!("/ka/{i}");
        let decision = decision_of(&lab, &path);
        assert_eq!(decision["decision"], "allow", "{decision}");
        assert_eq!(decision["org"], "acme", "{decision}");
        let id = record_id(&decision).expect("id");
        assert!(ids.insert(id.clone()), "{path}: record {id} twice");
        let close = lab.wait_evidence(&format!("close of {path}"), |v| {
            v["event"] == "close" && v["conn"].as_str() == Some(id.as_str())
        });
        assert_eq!(
            close["bytes_up"],
            get_head(&path).len() as u64,
            "{path}: {close}"
        );
    }
    let http_decisions = |lab: &Lab| {
        lab.evidence()
            .into_iter()
            .filter(|v| v["event"] == "decision" && v["kind"] == "http")
            .count()
    };
    assert_eq!(http_decisions(&lab), n + 1, "one decision per request");
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let (lab, up) = lab_with(&[]);
    let mut c = lab.client_conn();
    let paths: Vec<String> = (0..8).map(|i| format!("/pipe/{i}")).collect();
    let all: String = paths.iter().map(|p| get_head(p)).collect();
    c.send(all.as_bytes()).expect("send");
    for path in &paths {
        let resp = c.read_response(SECS10);
        assert_eq!(resp.status, 200, "{path}: {resp:?}\n{}", lab.proxy_output());
        assert!(
            resp.body.contains(&format!("path={path}\n")),
            "{path}: got {resp:?}"
        );
    }
    for path in &paths {
        decision_of(&lab, path);
    }
    // The upstream saw them one after another, on one connection.
    let first = up.conn_of(&paths[0]);
    for path in &paths {
        assert_eq!(up.conn_of(path), first, "{}", dump(&up.log()));
    }
}

#[test]
fn a_head_over_the_bound_on_a_later_request_is_answered_431_and_recorded() {
    let (lab, up) = lab_with(&["max_request_head_bytes = 4096"]);
    let mut c = lab.client_conn();
    get(&lab, &mut c, "/bound/1");
    // Over the configured bound, within the HTTP layer's buffer.
    let pad = "a".repeat(5000);
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nX-Pad: {pad}\r\n\r\n",
        url("/bound/over")
    );
    c.send(req.as_bytes()).expect("send");
    let resp = c.read_response(SECS10);
    assert_refused(&lab, &resp, 431, "bad_request", "5000-byte second head");
    // The connection goes on.
    get(&lab, &mut c, "/bound/2");
    // Far over it, beyond the HTTP layer's buffer.
    let pad = "b".repeat(80_000);
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: allowed.test:{PORT}\r\nX-Pad: {pad}\r\n\r\n",
        url("/bound/far")
    );
    let _ = c.send(req.as_bytes());
    let resp = c.read_response(SECS10);
    assert_eq!(resp.status, 431, "{resp:?}\n{}", lab.proxy_output());
    // Refused and recorded too (whichever parser stopped it, the detail
    // says why).
    crate::lab::wait_until("two bad_request refusals", SECS10, || {
        lab.evidence()
            .iter()
            .filter(|v| v["decision"] == "deny" && v["reason"] == "bad_request")
            .count()
            == 2
    });
    let log = up.log();
    assert!(
        !log.iter().any(|v| v["path"]
            .as_str()
            .is_some_and(|p| p.contains("over") || p.contains("far"))),
        "a refused head reached the upstream: {}",
        dump(&log)
    );
}

#[test]
fn a_second_head_trickled_slowly_is_cut_at_the_header_timeout() {
    let (lab, _up) = lab_with(&["header_read_timeout = \"1s\""]);
    let mut c = lab.client_conn();
    get(&lab, &mut c, "/slow/1");
    // The second head, one header line every 300 ms, never ending.
    let start = Instant::now();
    let mut cut = false;
    c.send(format!("GET {} HTTP/1.1\r\n", url("/slow/2")).as_bytes())
        .expect("send");
    for i in 0..30 {
        std::thread::sleep(Duration::from_millis(300));
        if c.send(format!("X-Slow-{i}: {i}\r\n").as_bytes()).is_err() {
            cut = true;
            break;
        }
    }
    let closed = if cut {
        Closed::After(start.elapsed())
    } else {
        c.wait_closed(Duration::from_secs(5))
    };
    match closed {
        Closed::After(d) => assert!(
            d >= Duration::from_millis(700) && d < Duration::from_secs(5),
            "closed after {d:?}, want about header_read_timeout (1s)"
        ),
        Closed::StillOpen => panic!(
            "a trickled second head still open long after header_read_timeout (1s)\n{}",
            lab.proxy_output()
        ),
    }
    lab.wait_evidence("the timed-out head's record", |v| {
        v["reason"] == "bad_request"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("read header from client timeout"))
    });
}
