//! Connection budgets: a connection counts for the org it is decided for,
//! and a stranger's address can exhaust only its own pre-authentication
//! budget (`max_connections_per_client`), never an org's.

use crate::lab::{self, Lab};
use crate::metrics::scalar_from_scrape;
use crate::socks5::new_token;

/// Hold N idle connections to the explicit listener from the stranger's
/// address; print how many the proxy kept open and how many it refused.
const HOLD: &str = r#"
import socket, sys, time
P = ("198.18.1.1", 3128)
held = []
for _ in range(int(sys.argv[1])):
    held.append(socket.create_connection(P, timeout=5, source_address=(sys.argv[2], 0)))
time.sleep(1.5)
kept = 0
for s in held:
    s.setblocking(False)
    try:
        s.recv(1)
    except BlockingIOError:
        kept += 1
    except OSError:
        pass
print("kept %d refused %d" % (kept, len(held) - kept), flush=True)
time.sleep(float(sys.argv[3]))
"#;

#[test]
fn a_stranger_holding_idle_connections_leaves_token_clients_served() {
    let (token, token_line) = new_token("tok");
    let policy = format!(
        "[[org]]\nname = \"tok\"\nidentity = \"token\"\n{token_line}\n\
         [[org.allow]]\nhost = \"allowed.test\"\n"
    );
    // Before, clients of no org at accept (strangers and every token
    // client) shared one bucket the size of max_connections_per_org.
    let lab = Lab::builder()
        .policy(&policy)
        .proxy_option("max_connections_per_client = 40")
        .proxy_option("max_connections_per_org = 50")
        .proxy_option("header_read_timeout = \"60s\"")
        .start();
    let (mut stranger, line) = lab.spawn_client_script(HOLD, &["120", lab::STRANGER_IP, "10"]);
    assert_eq!(line, "kept 40 refused 80", "{}", lab.proxy_output());

    // A token client on another address is served, again and again, while
    // the stranger holds its whole budget.
    let proxy = format!("http://tok:{token}@{}", lab::PROXY_ADDR);
    for i in 0..5 {
        let r = lab.client_curl(&["-x", &proxy, "http://allowed.test/"]);
        assert_eq!(
            r.status,
            200,
            "token request {i}: {r:#?}\n{}",
            lab.proxy_output()
        );
    }
    let allow = lab.wait_evidence("token client allowed", |v| {
        v["org"] == "tok" && v["decision"] == "allow"
    });
    assert!(
        allow["client"]
            .as_str()
            .unwrap()
            .starts_with(lab::CLIENT_IP),
        "{allow}"
    );
    // The stranger's refusals name its own budget and no org.
    let refused = lab.wait_evidence("stranger over its budget", |v| {
        v["reason"] == "limit_exceeded"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains("max_connections_per_client"))
    });
    assert!(refused["org"].is_null(), "{refused}");
    assert!(
        refused["client"]
            .as_str()
            .unwrap()
            .starts_with(lab::STRANGER_IP),
        "{refused}"
    );
    // 80 refusals in a burst: the first 50 (the default rate's burst) are
    // written one by one, the rest folded into a summary naming the
    // stranger, counted, and never lost.
    let summary = lab.wait_evidence("summary of the stranger's refusals", |v| {
        v["count"].is_u64()
            && v["client"]
                .as_str()
                .is_some_and(|c| c.starts_with(lab::STRANGER_IP))
    });
    assert_eq!(summary["reason"], "limit_exceeded", "{summary}");
    assert!(summary["org"].is_null(), "{summary}");
    let n = summary["count"].as_u64().unwrap();
    assert_eq!(summary["reasons"]["limit_exceeded"], n, "{summary}");
    let suppressed =
        scalar_from_scrape(&lab, "palisade_evidence_suppressed_total{org=\"unknown\"}");
    assert!(
        suppressed >= n as f64 && suppressed <= 30.0,
        "{suppressed} vs {n}"
    );
    let _ = stranger.kill();
    let _ = stranger.wait();
}
