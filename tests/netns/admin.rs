//! The admin listener on SIGTERM: drained like the proxy. A request in
//! flight finishes, an idle keep-alive connection closes at once, new
//! connections are refused, and the process exits 0 within the drain
//! timeout; a request that never completes is cut when the drain ends.

use std::time::{Duration, Instant};

use crate::lab::{Closed, Lab, RawConn, ADMIN_ADDR};

const DRAIN: Duration = Duration::from_secs(4);

fn lab() -> Lab {
    Lab::builder()
        .proxy_option(&format!("drain_timeout = \"{}s\"", DRAIN.as_secs()))
        .start()
}

/// An admin connection from the sandbox, with half a request sent: in
/// flight (its head incomplete) when the signal comes.
fn half_request(lab: &Lab) -> RawConn {
    let mut conn = lab.client_conn_to(ADMIN_ADDR);
    conn.send(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n")
        .expect("send half a head");
    conn
}

/// Wait until a new admin connection is refused (bounded); how long it took.
fn refused_within(lab: &Lab, timeout: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if lab.try_client_conn_to(ADMIN_ADDR).is_err() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn sigterm_lets_an_admin_request_in_flight_finish_refuses_new_ones_and_exits_zero() {
    let mut lab = lab();
    // An idle keep-alive connection, one request served.
    let mut idle = lab.client_conn_to(ADMIN_ADDR);
    idle.send(b"GET /readyz HTTP/1.1\r\nHost: admin\r\n\r\n")
        .unwrap();
    let ready = idle.read_response(Duration::from_secs(5));
    assert_eq!(ready.status, 200, "{ready:?}\n{}", lab.proxy_output());
    let mut busy = half_request(&lab);
    // Let the admin listener read the half head before the signal.
    std::thread::sleep(Duration::from_millis(300));

    lab.signal_proxy("-TERM");
    let signalled = Instant::now();
    let refused = refused_within(&lab, Duration::from_secs(2));
    assert!(
        refused.is_some(),
        "admin still accepting 2s after SIGTERM\n{}",
        lab.proxy_output()
    );
    assert!(
        matches!(idle.wait_closed(Duration::from_secs(2)), Closed::After(_)),
        "idle admin connection still open after SIGTERM"
    );
    // The request in flight holds the drain: the process waits for it.
    assert!(
        lab.wait_proxy_exit(Duration::from_millis(300)).is_none(),
        "palisade exited with an admin request in flight\n{}",
        lab.proxy_output()
    );
    busy.send(b"\r\n").expect("finish the head");
    let resp = busy.read_response(Duration::from_secs(3));
    assert_eq!(resp.status, 200, "{resp:?}\n{}", lab.proxy_output());
    assert_eq!(resp.body, "ok\n");
    assert!(
        matches!(busy.wait_closed(Duration::from_secs(2)), Closed::After(_)),
        "admin connection kept open after its response during the drain"
    );

    let st = lab.wait_proxy_exit(DRAIN).unwrap_or_else(|| {
        panic!(
            "palisade still running after the drain\n{}",
            lab.proxy_output()
        )
    });
    assert_eq!(st.code(), Some(0), "exit: {st}\n{}", lab.proxy_output());
    assert!(
        signalled.elapsed() < DRAIN,
        "exit took {:?}, the drain timeout is {DRAIN:?}",
        signalled.elapsed()
    );
}

#[test]
fn an_admin_request_that_never_completes_is_cut_when_the_drain_ends() {
    let mut lab = lab();
    let mut stuck = half_request(&lab);
    std::thread::sleep(Duration::from_millis(300));
    lab.signal_proxy("-TERM");
    let signalled = Instant::now();
    let st = lab
        .wait_proxy_exit(DRAIN + Duration::from_secs(3))
        .unwrap_or_else(|| {
            panic!(
                "palisade still running {:?} after SIGTERM\n{}",
                DRAIN + Duration::from_secs(3),
                lab.proxy_output()
            )
        });
    assert_eq!(st.code(), Some(0), "exit: {st}\n{}", lab.proxy_output());
    // Not before the drain timeout: the request was waited for.
    assert!(
        signalled.elapsed() >= DRAIN - Duration::from_millis(500),
        "exited after {:?}, before the drain timeout {DRAIN:?}",
        signalled.elapsed()
    );
    assert!(matches!(
        stuck.wait_closed(Duration::from_secs(1)),
        Closed::After(_)
    ));
}
