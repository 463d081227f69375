//! TLS inspection of CONNECT tunnels: the ClientHello's SNI must match.

use crate::lab::{self, ca_pem, dump, Lab, DEFAULT_POLICY};
use crate::record_id;

fn s_client(lab: &Lab, servername: &str) -> lab::CmdOutput {
    let ca = ca_pem().display().to_string();
    lab.client_exec(
        "openssl",
        &[
            "s_client",
            "-proxy",
            lab::PROXY_ADDR,
            "-connect",
            "allowed.test:443",
            "-servername",
            servername,
            "-CAfile",
            &ca,
            "-verify_hostname",
            "allowed.test",
            "-verify_return_error",
        ],
    )
}

#[test]
fn sni_mismatch_closes_tunnel_before_anything_is_forwarded() {
    let lab = Lab::start(DEFAULT_POLICY);
    let bad = s_client(&lab, "other.test");
    assert!(
        !bad.success(),
        "handshake with SNI other.test succeeded:\n{}",
        bad.describe()
    );
    // openssl prints "Verify return code: 0" even without a handshake; what
    // shows the tunnel was closed is that no certificate ever arrived.
    assert!(
        bad.stdout.contains("no peer certificate available"),
        "{}",
        bad.describe()
    );
    let rec = lab.wait_evidence("deny sni_mismatch", |v| {
        v["decision"] == "deny" && v["reason"] == "sni_mismatch"
    });
    assert_eq!(rec["host"], "allowed.test", "{rec}");
    assert_eq!(rec["sni"], "other.test", "{rec}");
    assert_eq!(rec["kind"], "tcp", "{rec}");
    assert!(record_id(&rec).is_some(), "{rec}");
    // A TCP connection to upstream may have been opened, but not one byte of
    // the ClientHello may have reached it.
    let closes = lab.upstream_settled();
    for c in &closes {
        assert_eq!(
            c["bytes_received"],
            0,
            "bytes forwarded upstream: {}",
            dump(&closes)
        );
    }
    assert!(lab.canary_log().is_empty(), "{}", dump(&lab.canary_log()));

    // Contrast: the matching SNI goes through and verifies.
    let good = s_client(&lab, "allowed.test");
    assert!(
        good.success(),
        "{}\n{}",
        good.describe(),
        lab.proxy_output()
    );
    assert!(
        good.stdout.contains("Verify return code: 0 (ok)"),
        "{}",
        good.describe()
    );
    let closes = lab.upstream_settled();
    assert!(
        closes
            .iter()
            .any(|c| c["sni"] == "allowed.test" && c["bytes_received"].as_u64().unwrap_or(0) > 0),
        "{}",
        dump(&closes)
    );
    let allow = lab.wait_evidence("allow with sni allowed.test", |v| {
        v["decision"] == "allow" && v["sni"] == "allowed.test" && v["event"] == "decision"
    });
    assert_eq!(allow["reason"], "rule_match", "{allow}");
}
