//! Start-up, readiness and shutdown of `palisade run`.

use crate::lab::{self, Lab, DEFAULT_POLICY};
use std::time::Duration;

#[test]
fn health_and_ready_endpoints() {
    let lab = Lab::start(DEFAULT_POLICY);
    assert_eq!(lab.admin_status("/healthz"), 200, "{}", lab.proxy_output());
    assert_eq!(lab.admin_status("/readyz"), 200, "{}", lab.proxy_output());
    // The admin listener is not reachable as a proxy target.
    let r = lab.raw_connect("198.18.1.1:9711");
    assert_eq!(r.status, 403, "{r:?}");
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let mut lab = Lab::start(DEFAULT_POLICY);
    let ok = lab.proxied_curl("http://allowed.test/", &[]);
    assert_eq!(ok.status, 200, "{ok:?}\n{}", lab.proxy_output());
    lab.signal_proxy("-TERM");
    let st = lab
        .wait_proxy_exit(Duration::from_secs(5))
        .unwrap_or_else(|| {
            panic!(
                "palisade still running 5s after SIGTERM\n{}",
                lab.proxy_output()
            )
        });
    assert_eq!(
        st.code(),
        Some(0),
        "exit after SIGTERM: {st}\n{}",
        lab.proxy_output()
    );
    // Nothing listens any more.
    assert_eq!(lab.admin_status("/healthz"), 0);
    let after = lab.proxied_curl("http://allowed.test/", &[]);
    assert_eq!(after.exit, Some(7), "proxy still accepting: {after:?}");
}

#[test]
fn startup_failure_exits_nonzero_with_reason() {
    let mut lab = Lab::builder()
        .proxy_listen(&["198.18.9.9:3128"])
        .without_proxy()
        .start();
    lab.spawn_proxy();
    let st = lab
        .wait_proxy_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("palisade kept running with an unbindable listener"));
    assert!(!st.success(), "exit status {st}");
    let out = lab.proxy_output();
    assert!(
        out.lines().any(|l| l.contains("198.18.9.9:3128")),
        "reason does not name the listener:\n{out}"
    );
    assert_eq!(lab::CLIENT_IP, "198.18.1.2");
}
