//! Rotating what identifies a client or is added to its requests, by
//! reload: an org token replaced in the config closes the tunnel opened
//! with the old token (`policy_revoked`, within the revocation bound), the
//! old token is refused 407 and the new one serves; a credential's secret
//! replaced in its file (signalled, or seen by the 2 s poll alone) is what
//! the next request carries, inside an intercepted connection that stays
//! open. The upstream's request log and the banner fixture's echo are the
//! witnesses.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::assert_refused;
use crate::lab::{self, Closed, Lab, RawConn, BANNER, BANNER_PORT};
use crate::reload::{edit_config, served_hash};
use crate::socks5::new_token;

const SECS5: Duration = Duration::from_secs(5);
/// Longer than `revoke_grace` (1 s by default) plus the reload itself.
const CLOSED_WITHIN: Duration = Duration::from_secs(4);

fn reloads_ok(lab: &Lab) -> f64 {
    crate::metrics::scalar_from_scrape(lab, "palisade_policy_reloads_total{result=\"ok\"}")
}

/// SIGHUP, and wait until the reload it asked for is counted `ok`.
fn reload(lab: &Lab) {
    let before = reloads_ok(lab);
    lab.signal_proxy("-HUP");
    lab::wait_until("the reload counted ok", SECS5, || reloads_ok(lab) > before);
}

/// A token org reaching allowed.test on port 80 and, carried opaque, on
/// the banner port.
fn token_policy(tokens_line: &str) -> String {
    format!(
        "[[org]]\nname = \"tok\"\nidentity = \"token\"\n{tokens_line}\n\n\
         [[org.allow]]\nhost = \"allowed.test\"\nports = [80]\n\n\
         [[org.allow]]\nid = \"banner\"\nhost = \"allowed.test\"\nports = [{BANNER_PORT}]\n\
         tunnel = \"opaque\"\n"
    )
}

/// A CONNECT tunnel to the banner port presenting `tok:token`: its
/// status, and the connection (echoing, if 200).
fn token_tunnel(lab: &Lab, token: &str) -> (u16, RawConn) {
    let auth = data_encoding::BASE64.encode(format!("tok:{token}").as_bytes());
    let target = format!("allowed.test:{BANNER_PORT}");
    let mut c = lab.client_conn();
    c.send(
        format!(
            "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let status = c.read_head(SECS5).0;
    if status == 200 {
        assert!(
            c.read_until(BANNER.as_bytes(), SECS5).is_some(),
            "no banner"
        );
        let line = format!("{token}-echo\n");
        c.send(line.as_bytes()).unwrap();
        assert!(c.read_until(line.as_bytes(), SECS5).is_some(), "no echo");
    }
    (status, c)
}

fn curl_with(lab: &Lab, token: &str) -> lab::HttpResp {
    let proxy = format!("http://tok:{token}@{}", lab::PROXY_ADDR);
    lab.client_curl(&["-x", &proxy, "http://allowed.test/rotation"])
}

#[test]
fn a_token_rotated_by_reload_closes_its_tunnel_and_only_the_new_token_serves() {
    let (old, old_line) = new_token("tok");
    let (new, new_line) = new_token("tok");
    let lab = Lab::start(&token_policy(&old_line));
    let before = served_hash(&lab);
    let (status, mut tunnel) = token_tunnel(&lab, &old);
    assert_eq!(status, 200, "{}", lab.proxy_output());
    let decision = lab.wait_evidence("the tunnel's decision", |v| {
        v["event"] == "decision"
            && v["kind"] == "tcp"
            && v["org"] == "tok"
            && v["port"] == BANNER_PORT
            && v["decision"] == "allow"
    });
    let id = crate::record_id(&decision).unwrap();
    assert_eq!(curl_with(&lab, &new).status, 407, "not yet the new token");

    // The token replaced, nothing else: a change, served under a new hash.
    edit_config(&lab, |t| t.replace(&old_line, &new_line));
    reload(&lab);
    let after = served_hash(&lab);

    // The tunnel opened with the old token is closed and recorded.
    let closed = tunnel.wait_closed(CLOSED_WITHIN);
    eprintln!("the old token's tunnel after the reload was counted: {closed:?}");
    assert!(
        matches!(closed, Closed::After(_)),
        "the tunnel opened with the replaced token is still open {CLOSED_WITHIN:?} after the reload\n{}",
        lab.proxy_output()
    );
    assert_ne!(
        after, before,
        "a token rotation left the policy hash as it was"
    );
    let revoked = lab.wait_evidence("the tunnel's revocation", |v| {
        v["event"] == "decision" && v["conn"] == id.as_str() && v["kind"] == "tcp"
    });
    assert_eq!(
        (&revoked["decision"], &revoked["reason"], &revoked["policy"]),
        (
            &Value::from("deny"),
            &Value::from("policy_revoked"),
            &Value::from(after.as_str())
        ),
        "{revoked}"
    );
    assert!(
        revoked["detail"]
            .as_str()
            .is_some_and(|d| d.contains("no longer of org tok")),
        "{revoked}"
    );
    assert_eq!(
        crate::metrics::scalar_from_scrape(
            &lab,
            "palisade_connections_revoked_total{mode=\"explicit\",org=\"tok\"}"
        ),
        1.0
    );

    // The old token is refused on new connections; the new one serves.
    let r = curl_with(&lab, &old);
    let rec = assert_refused(&lab, &r, 407, "auth_failed", "the replaced token");
    assert_eq!(rec["policy"], after.as_str(), "{rec}");
    assert_eq!(
        token_tunnel(&lab, &old).0,
        407,
        "CONNECT with the replaced token"
    );
    let r = curl_with(&lab, &new);
    assert_eq!(r.status, 200, "{r:#?}\n{}", lab.proxy_output());
    let (status, _tunnel) = token_tunnel(&lab, &new);
    assert_eq!(status, 200, "CONNECT with the new token");

    // Neither token, nor its digest, is in the policy text kept beside the
    // evidence.
    let text = std::fs::read_to_string(
        lab.evidence_dir
            .join("policies")
            .join(format!("{after}.json")),
    )
    .unwrap();
    for (token, line) in [(&old, &old_line), (&new, &new_line)] {
        let digest = line.split('"').nth(1).unwrap();
        assert!(
            !text.contains(token.as_str()) && !text.contains(&digest["sha256:".len()..]),
            "{text}"
        );
    }
}

/// The file of the credential `registry-token` of [`crate::intercept`]'s
/// policy (its first `secret_file`).
fn registry_secret_file(lab: &Lab) -> PathBuf {
    let config = std::fs::read_to_string(&lab.config_path).unwrap();
    let line = config
        .lines()
        .find_map(|l| l.strip_prefix("secret_file = "))
        .expect("a secret_file line");
    PathBuf::from(line.trim_matches('"'))
}

/// Replace the secret in `path` as an operator or a mounted Kubernetes
/// Secret would: a new file renamed over the old.
fn rotate(path: &PathBuf, secret: &str) {
    let tmp = path.with_extension("rotating");
    std::fs::write(&tmp, format!("{secret}\n")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The `Authorization` values the upstream saw on the request for `path`.
fn authorization_of(lab: &Lab, path: &str) -> Vec<String> {
    let up = lab.wait_upstream(&format!("GET {path}"), |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {path} ")))
    });
    up["headers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|h| h[0] == "authorization")
        .filter_map(|h| h[1].as_str().map(str::to_string))
        .collect()
}

#[test]
fn a_credential_secret_rotated_in_its_file_is_what_the_next_request_carries() {
    const SIGNALLED: &str = "r0tated-by-hup-6b1d";
    const POLLED: &str = "r0tated-by-poll-93ae";
    let setup = crate::intercept::start();
    let lab = &setup.lab;
    let file = registry_secret_file(lab);
    let first_secret = std::fs::read_to_string(&file).unwrap().trim().to_string();
    let hash = served_hash(lab);

    // One intercepted connection across the rotation: its first request
    // carries the old secret, its next the new one.
    let (first, second) =
        crate::revoke::keep_alive_across(&setup, ("/rotate-1", "/rotate-2"), || {
            rotate(&file, SIGNALLED);
            reload(lab);
        });
    assert_eq!(first, "first 200");
    assert_eq!(second, "second 200", "{}", lab.proxy_output());
    assert_eq!(
        authorization_of(lab, "/rotate-1"),
        [format!("Bearer {first_secret}")]
    );
    assert_eq!(
        authorization_of(lab, "/rotate-2"),
        [format!("Bearer {SIGNALLED}")],
        "the request after the reload carried the old secret"
    );
    assert_eq!(served_hash(lab), hash, "no secret in the policy hash");

    // Rotated again with no signal: the poll sees the file, and a new
    // connection's request carries it.
    rotate(&file, POLLED);
    let mut n = 0;
    lab::wait_until("the polled secret served", Duration::from_secs(10), || {
        n += 1;
        let path = format!("/rotate-poll-{n}");
        let ca = setup.org_ca.display().to_string();
        let r = lab.client_curl(&[
            "-x",
            lab::PROXY_URL,
            "--cacert",
            &ca,
            &format!("https://allowed.test{path}"),
        ]);
        assert_eq!(r.status, 200, "{r:#?}");
        authorization_of(lab, &path) == [format!("Bearer {POLLED}")]
    });

    // No secret in evidence or Palisade's log.
    let evidence = lab::dump(&lab.evidence());
    let log = lab.proxy_output();
    for secret in [first_secret.as_str(), SIGNALLED, POLLED] {
        assert!(
            !evidence.contains(secret) && !log.contains(secret),
            "{secret} leaked"
        );
    }
}
