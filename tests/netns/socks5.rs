//! The SOCKS5 listener and credential identity: curl through SOCKS5 with
//! remote name resolution, a raw SOCKS5 client reaching a TCP service,
//! malformed and unsupported requests answered and recorded while the
//! listener keeps serving, and orgs behind one source address told apart
//! by their tokens on both the explicit and the SOCKS5 listener.

use crate::lab::{self, dump, Lab, BANNER, BANNER_PORT};
use crate::{assert_client_ip, assert_refused, record_id, record_ref};
use serde_json::Value;

const SOCKS_ADDR: &str = "198.18.1.1:1080";

/// The default policy plus the banner port on allowed.test and on the
/// cidr host.
fn policy() -> String {
    format!(
        "{}
[[org.allow]]
id = \"banner-cidr\"
cidr = \"{}/32\"
ports = [{BANNER_PORT}]
",
        lab::banner_policy(),
        lab::CIDR_IP
    )
}

fn socks_lab(policy: &str) -> Lab {
    Lab::builder()
        .policy(policy)
        .proxy_option(&format!("socks5 = [{SOCKS_ADDR:?}]"))
        .proxy_option("detect_timeout = \"300ms\"")
        .start()
}

/// Run the raw SOCKS5 client (tests/fixtures/socks5.py) from CLIENT_IP.
fn socks(lab: &Lab, args: &[&str]) -> Value {
    let script = lab::fixtures_dir().join("socks5.py").display().to_string();
    let mut full = vec![
        script.as_str(),
        "--proxy",
        SOCKS_ADDR,
        "--source",
        lab::CLIENT_IP,
    ];
    full.extend_from_slice(args);
    let out = lab.client_exec("python3", &full);
    assert!(out.success(), "socks5.py {args:?}: {}", out.describe());
    serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("socks5.py output {:?}: {e}", out.stdout))
}

/// The socks5 decision record for `host` with this decision and reason.
fn socks_record(lab: &Lab, host: &str, decision: &str, reason: &str) -> Value {
    let rec = lab.wait_evidence(&format!("socks5 {decision}/{reason} for {host}"), |v| {
        v["mode"] == "socks5"
            && v["event"] == "decision"
            && v["host"] == host
            && v["decision"] == decision
            && v["reason"] == reason
    });
    assert_eq!(rec["kind"], "tcp", "{rec}");
    assert_client_ip(&rec, lab::CLIENT_IP);
    rec
}

fn socks_denials_with(lab: &Lab, reason: &str, detail: &str) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| {
            v["mode"] == "socks5"
                && v["reason"] == reason
                && v["decision"] == "deny"
                && v["detail"].as_str().is_some_and(|d| d.contains(detail))
        })
        .collect()
}

/// What reached the upstream since log line `before`, once a positive
/// marker has: an allowed request for `marker` through the SOCKS5
/// listener, sent after every refusal was answered. A refused target would
/// have been dialled before its reply, so by the time the marker is logged
/// (and every upstream connection logged closed) it would be in the log
/// too. The marker's own connection is left out.
fn upstream_after_marker(lab: &Lab, before: usize, marker: &str) -> Vec<Value> {
    let proxy = format!("socks5h://{SOCKS_ADDR}");
    let url = format!("http://allowed.test{marker}");
    let m = lab.client_curl(&["-x", &proxy, &url]);
    assert_eq!(
        m.status,
        200,
        "marker {marker}: {m:#?}\n{}",
        lab.proxy_output()
    );
    let seen = lab.wait_upstream(marker, |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {marker} ")))
    });
    lab.upstream_settled();
    lab.upstream_log()
        .into_iter()
        .skip(before)
        .filter(|v| v["id"] != seen["id"])
        .collect()
}

#[test]
fn curl_socks5_hostname_allowed_denied_and_sni_checked() {
    let lab = socks_lab(&policy());
    let ca = lab::ca_pem().display().to_string();
    let proxy = format!("socks5h://{SOCKS_ADDR}");

    // Allowed: the name travels to Palisade (socks5h), which resolves and checks it.
    let ok = lab.client_curl(&["-x", &proxy, "--cacert", &ca, "https://allowed.test/"]);
    assert_eq!(ok.status, 200, "{ok:#?}\n{}", lab.proxy_output());
    let rec = socks_record(&lab, "allowed.test", "allow", "rule_match");
    assert_eq!(rec["sni"], "allowed.test", "{rec}");
    assert_eq!(rec["ip"], lab::ALLOWED_IP, "{rec}");
    assert_eq!(rec["org"], "acme", "{rec}");
    let id = record_id(&rec).unwrap();
    let close = lab.wait_evidence("close of the socks5 tunnel", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert!(close["bytes_down"].as_u64().unwrap_or(0) > 0, "{close}");
    lab.wait_upstream("allowed.test reached", |v| {
        v["event"] == "close" && v["sni"] == "allowed.test"
    });

    // Denied by name, and by an explicit deny: curl fails, nothing is dialled.
    let before = lab.upstream_log().len();
    let denied = lab.client_curl(&["-x", &proxy, "http://other.test/"]);
    assert_ne!(denied.exit, Some(0), "{denied:#?}");
    assert_eq!(denied.status, 0, "{denied:#?}");
    socks_record(&lab, "other.test", "deny", "no_matching_rule");
    let blocked = lab.client_curl(&["-x", &proxy, "http://blocked.wild.test/"]);
    assert_ne!(blocked.exit, Some(0), "{blocked:#?}");
    let rec = socks_record(&lab, "blocked.wild.test", "deny", "explicit_deny");
    assert!(rec["rule"].is_string(), "{rec}");
    // A name spelling an address is that address, not a name.
    let spelled = lab.client_curl(&["-x", &proxy, "http://0x7f000001:3128/"]);
    assert_ne!(spelled.exit, Some(0), "{spelled:#?}");
    socks_record(&lab, "127.0.0.1", "deny", "denied_address");

    let after = upstream_after_marker(&lab, before, "/marker-after-socks-denials");
    assert!(
        after.is_empty(),
        "denied targets were dialled:\n{}",
        dump(&after)
    );

    // Tunnel to an allowed name, ClientHello for another: sni_mismatch.
    // The upstream was dialled (as for CONNECT, before the reply) but no
    // byte reaches it.
    let mismatch = lab.client_curl(&[
        "-x",
        &proxy,
        "--cacert",
        &ca,
        "--connect-to",
        "allowed.test:443:a.wild.test:443",
        "https://allowed.test/",
    ]);
    assert_ne!(mismatch.status, 200, "{mismatch:#?}");
    let rec = socks_record(&lab, "a.wild.test", "deny", "sni_mismatch");
    assert_eq!(rec["sni"], "allowed.test", "{rec}");
    let closed = lab.wait_upstream("the mismatched tunnel's upstream side closed", |v| {
        v["event"] == "close" && v["local"] == format!("{}:443", lab::WILD_A_IP)
    });
    assert_eq!(closed["bytes_received"], 0, "{closed}");
    assert!(closed["sni"].is_null(), "{closed}");

    // Metrics carry mode="socks5".
    let scrape = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    let line = scrape
        .stdout
        .lines()
        .find(|l| {
            l.starts_with("palisade_connections_total{")
                && l.contains("mode=\"socks5\"")
                && l.contains("org=\"acme\"")
                && l.contains("reason=\"rule_match\"")
        })
        .unwrap_or_else(|| panic!("no socks5 series:\n{}", scrape.stdout));
    assert!(!line.ends_with(" 0"), "{line}");
}

#[test]
fn raw_socks5_client_reaches_an_allowed_tcp_service_only() {
    let lab = socks_lab(&policy());
    let banner_target = format!("allowed.test:{BANNER_PORT}");
    // Domain name, IPv4 and IPv6 (IPv4-mapped) destinations to the banner
    // (server-speaks-first, then echo) service.
    for target in [
        banner_target.clone(),
        format!("{}:{BANNER_PORT}", lab::CIDR_IP),
        format!("[::ffff:{}]:{BANNER_PORT}", lab::CIDR_IP),
    ] {
        let out = socks(
            &lab,
            &[
                "--target", &target, "--send", "ping-1\n", "--expect", "ping-1\n",
            ],
        );
        assert_eq!(out["method"], 0, "{target}: {out}");
        assert_eq!(out["reply"], 0, "{target}: {out}\n{}", lab.proxy_output());
        let data = out["data"].as_str().unwrap_or_default();
        assert!(
            data.starts_with(BANNER) && data.ends_with("ping-1\n"),
            "{target}: {out}"
        );
    }
    socks_record(&lab, "allowed.test", "allow", "rule_match");
    let rec = socks_record(&lab, lab::CIDR_IP, "allow", "rule_match");
    assert_eq!(rec["rule"], "banner-cidr", "{rec}");

    // Refused elsewhere, each with "not allowed by ruleset" (2) and a record.
    let before = lab.upstream_log().len();
    for (target, host, reason) in [
        (
            format!("other.test:{BANNER_PORT}"),
            "other.test",
            "no_matching_rule",
        ),
        (
            format!("{}:{BANNER_PORT}", lab::UNLISTED_IP),
            lab::UNLISTED_IP,
            "no_matching_rule",
        ),
        (
            "allowed.test:8080".to_string(),
            "allowed.test",
            "port_not_allowed",
        ),
        ("127.0.0.1:80".to_string(), "127.0.0.1", "denied_address"),
        // Palisade's own SOCKS5 listener is never dialled.
        (SOCKS_ADDR.to_string(), "198.18.1.1", "denied_address"),
    ] {
        let out = socks(&lab, &["--target", &target, "--send", "x"]);
        assert_eq!(out["reply"], 2, "{target}: {out}");
        socks_record(&lab, host, "deny", reason);
    }
    // An unresolvable allowed name: host unreachable (4).
    let out = socks(&lab, &["--target", "nx.test:80"]);
    assert_eq!(out["reply"], 4, "{out}");
    socks_record(&lab, "nx.test", "deny", "resolution_failed");
    let after = upstream_after_marker(&lab, before, "/marker-after-socks-refusals");
    assert!(
        after.is_empty(),
        "refused targets reached upstream:\n{}",
        dump(&after)
    );
    assert!(lab.canary_log().is_empty(), "{}", dump(&lab.canary_log()));
}

#[test]
fn malformed_and_unsupported_socks5_is_answered_recorded_and_survived() {
    let lab = socks_lab(&policy());
    let v4_req = |cmd: &str| format!("05{cmd}0001c612020a08ae");
    // (chunks sent, reply expected as a hex prefix, detail in the record)
    let cases: Vec<(Vec<String>, &str, &str, &str)> = vec![
        // SOCKS4 greeting: no acceptable method.
        (
            vec!["040100500a000001".into()],
            "05ff",
            "bad_request",
            "greeting",
        ),
        // A greeting offering no method at all.
        (vec!["0500".into()], "05ff", "bad_request", "no method"),
        // HTTP to the SOCKS port.
        (
            vec![hex(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")],
            "05ff",
            "bad_request",
            "greeting",
        ),
        // Only GSSAPI offered.
        (
            vec!["050101".into()],
            "05ff",
            "bad_request",
            "no supported method",
        ),
        // Unknown command: 07.
        (
            vec!["050100".into(), v4_req("09")],
            "0500050700",
            "bad_request",
            "unknown command",
        ),
        // Unknown address type: 08.
        (
            vec!["050100".into(), "050100090102".into()],
            "0500050800",
            "bad_request",
            "address type",
        ),
        // Reserved byte set: general failure.
        (
            vec!["050100".into(), "05010101c612020a08ae".into()],
            "0500050100",
            "bad_request",
            "reserved",
        ),
        // Empty domain name.
        (
            vec!["050100".into(), "0501000300".into()],
            "0500050100",
            "bad_request",
            "empty domain",
        ),
        // BIND and UDP ASSOCIATE: command not supported (07), recorded.
        (
            vec!["050100".into(), v4_req("02")],
            "0500050700",
            "bad_request",
            "BIND is not supported",
        ),
        (
            vec!["050100".into(), "05030001000000000000".into()],
            "0500050700",
            "bad_request",
            "UDP ASSOCIATE is not supported",
        ),
        // RFC 1929 with a wrong sub-negotiation version.
        (
            vec!["050102".into(), "0201610162".into()],
            "050201",
            "bad_request",
            "authentication",
        ),
    ];
    for (chunks, want, reason, detail) in &cases {
        let mut args = vec!["--raw"];
        args.extend(chunks.iter().map(String::as_str));
        let out = socks(&lab, &args);
        let raw = out["raw"].as_str().unwrap_or_default();
        assert!(raw.starts_with(want), "{chunks:?}: got {out}, want {want}");
        assert_eq!(out["closed"], true, "{chunks:?}: left open: {out}");
        let recs = socks_denials_with(&lab, reason, detail);
        assert!(
            !recs.is_empty(),
            "{chunks:?}: no {reason} record with {detail:?}:\n{}",
            dump(&lab.evidence())
        );
    }
    let udp = socks_denials_with(&lab, "bad_request", "UDP ASSOCIATE");
    assert_eq!(udp[0]["host"], "0.0.0.0", "{}", udp[0]);

    // Garbage of every byte value, and a greeting cut short at close.
    let all: Vec<u8> = (0..=255u8).rev().collect();
    let out = socks(&lab, &["--raw", &hex(&all)]);
    assert_eq!(out["raw"], "05ff", "{out}");
    let out = socks(&lab, &["--timeout", "1.5", "--raw", "0503"]);
    assert_eq!(out["closed"], false, "a valid prefix waits for more: {out}");

    // The listener still serves, and Palisade did not panic.
    let out = socks(
        &lab,
        &[
            "--target",
            &format!("allowed.test:{BANNER_PORT}"),
            "--send",
            "still-here\n",
            "--expect",
            "still-here\n",
        ],
    );
    assert_eq!(out["reply"], 0, "{out}\n{}", lab.proxy_output());
    assert!(
        !lab.proxy_output().contains("panicked"),
        "{}",
        lab.proxy_output()
    );
}

fn hex(bytes: &[u8]) -> String {
    data_encoding::HEXLOWER.encode(bytes)
}

/// A fresh token from `palisade token new`, and its config line.
pub(crate) fn new_token(org: &str) -> (String, String) {
    let out = lab::run_with_timeout(
        std::process::Command::new(lab::palisade_bin()).args(["token", "new", "--org", org]),
        None,
        lab::CMD_TIMEOUT,
    );
    assert!(out.success(), "{}", out.describe());
    let token = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("token: "))
        .expect("token line")
        .to_string();
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("tokens = [\"sha256:"))
        .expect("tokens line")
        .to_string();
    assert!(!line.contains(&token), "{line}");
    (token, line)
}

#[test]
fn tokens_tell_orgs_behind_one_address_apart() {
    let (red, red_line) = new_token("red");
    let (blue, blue_line) = new_token("blue");
    // Two orgs share the client network; neither is chosen by address alone.
    let policy = format!(
        "[[org]]\nname = \"red\"\nidentity = \"address+token\"\nclients = [\"198.18.1.0/24\"]\n{red_line}\n\
         [[org.allow]]\nhost = \"allowed.test\"\n\n\
         [[org]]\nname = \"blue\"\nidentity = \"address+token\"\nclients = [\"198.18.1.0/24\"]\n{blue_line}\n\
         [[org.allow]]\nhost = \"other.test\"\n"
    );
    let lab = socks_lab(&policy);
    let ca = lab::ca_pem().display().to_string();
    let http_proxy = |user: &str, token: &str| format!("http://{user}:{token}@{}", lab::PROXY_ADDR);

    // Each org reaches its own names, by absolute-form request and CONNECT.
    let r = lab.client_curl(&["-x", &http_proxy("red", &red), "http://allowed.test/"]);
    assert_eq!(r.status, 200, "{r:#?}\n{}", lab.proxy_output());
    let r = lab.client_curl(&["-x", &http_proxy("blue", &blue), "http://other.test/"]);
    assert_eq!(r.status, 200, "{r:#?}");
    let r = lab.client_curl(&[
        "-x",
        &http_proxy("red", &red),
        "--cacert",
        &ca,
        "https://allowed.test/",
    ]);
    assert_eq!(r.status, 200, "{r:#?}");
    for (org, host) in [("red", "allowed.test"), ("blue", "other.test")] {
        lab.wait_evidence(&format!("{org} allowed {host}"), |v| {
            v["org"] == org && v["host"] == host && v["decision"] == "allow"
        });
    }
    // Blue's token does not open red's names.
    let r = lab.client_curl(&["-x", &http_proxy("blue", &blue), "http://allowed.test/"]);
    let rec = assert_refused(&lab, &r, 403, "no_matching_rule", "blue to red's name");
    assert_eq!(rec["org"], "blue", "{rec}");

    // SOCKS5 with username/password: the same orgs, the same decisions.
    let socks_proxy = |user: &str, token: &str| format!("socks5h://{user}:{token}@{SOCKS_ADDR}");
    let r = lab.client_curl(&["-x", &socks_proxy("red", &red), "http://allowed.test/"]);
    assert_eq!(r.status, 200, "{r:#?}\n{}", lab.proxy_output());
    lab.wait_evidence("red over socks5", |v| {
        v["mode"] == "socks5" && v["org"] == "red" && v["decision"] == "allow"
    });
    let r = lab.client_curl(&["-x", &socks_proxy("blue", &blue), "http://allowed.test/"]);
    assert_ne!(r.exit, Some(0), "{r:#?}");
    lab.wait_evidence("blue denied over socks5", |v| {
        v["mode"] == "socks5" && v["org"] == "blue" && v["reason"] == "no_matching_rule"
    });

    // No credentials: 407 auth_required with a challenge.
    let r = lab.client_curl(&["-x", lab::PROXY_URL, "http://allowed.test/"]);
    let rec = assert_refused(&lab, &r, 407, "auth_required", "no credentials");
    assert_eq!(
        r.header("proxy-authenticate"),
        Some("Basic realm=\"palisade\""),
        "{r:#?}"
    );
    assert!(rec["org"].is_null(), "{rec}");

    // Wrong token, another org's token, an org that does not exist: the
    // same 407 auth_failed; only the record reference differs.
    let mut bodies = Vec::new();
    for (user, token) in [
        ("red", "wrong-token"),
        ("red", blue.as_str()),
        ("nosuch", "x"),
    ] {
        let r = lab.client_curl(&["-x", &http_proxy(user, token), "http://allowed.test/"]);
        let rec = assert_refused(&lab, &r, 407, "auth_failed", &format!("{user} bad token"));
        assert!(rec["org"].is_null(), "{rec}");
        assert!(r.header("proxy-authenticate").is_some(), "{r:#?}");
        let shown = record_ref(&rec).unwrap();
        bodies.push(r.body.replace(&shown, "REF"));
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]), "{bodies:#?}");
    assert!(
        !bodies[0].contains("red") && !bodies[0].contains("nosuch"),
        "{bodies:?}"
    );
    // CONNECT is authenticated too.
    let r = lab.client_curl(&[
        "-x",
        &http_proxy("red", "wrong-token"),
        "--cacert",
        &ca,
        "https://allowed.test/",
    ]);
    assert_eq!(r.connect_status, 407, "{r:#?}");

    // SOCKS5 with a wrong token: RFC 1929 failure, recorded.
    let out = socks(
        &lab,
        &[
            "--user",
            "red",
            "--password",
            "wrong-token",
            "--target",
            "allowed.test:80",
        ],
    );
    assert_eq!(
        (out["method"].clone(), out["auth"].clone()),
        (2.into(), 1.into()),
        "{out}"
    );
    // Without credentials on SOCKS5: no acceptable method.
    let out = socks(&lab, &["--target", "allowed.test:80"]);
    assert_eq!(out["method"], 255, "{out}");
    lab.wait_evidence("socks5 auth_failed", |v| {
        v["mode"] == "socks5" && v["reason"] == "auth_failed" && v["org"].is_null()
    });
    lab.wait_evidence("socks5 auth_required", |v| {
        v["mode"] == "socks5" && v["reason"] == "auth_required"
    });

    // No token, right or wrong, is in the evidence or the logs.
    let mut all = String::new();
    for entry in std::fs::read_dir(&lab.evidence_dir).unwrap() {
        all.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap_or_default());
    }
    all.push_str(&lab.proxy_output());
    for secret in [red.as_str(), blue.as_str(), "wrong-token"] {
        assert!(!all.contains(secret), "{secret} leaked");
    }
}
