//! Policy reload under traffic: SIGHUP and file changes swap the policy for
//! the proxy and the DNS shim, open tunnels keep running, an invalid file
//! keeps the old policy, the policy text of every hash is kept beside the
//! evidence, a reload can turn interception on (with its CA and
//! credentials), and a setting only a restart can apply refuses the reload.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{
    self, ca_pem, palisade_bin, run_with_timeout, scratch_dir, Lab, RawConn, BANNER, BANNER_PORT,
    CMD_TIMEOUT, DEFAULT_POLICY, PROXY_URL,
};

const SECS5: Duration = Duration::from_secs(5);

fn policy() -> String {
    lab::banner_policy()
}

fn lab() -> Lab {
    Lab::builder()
        .policy(&policy())
        .dns_listen(&["198.18.1.1:53"])
        .start()
}

fn banner_tunnel(lab: &Lab) -> RawConn {
    let mut c = lab.client_conn();
    assert_eq!(c.connect(&format!("allowed.test:{BANNER_PORT}")), 200);
    assert!(
        c.read_until(BANNER.as_bytes(), SECS5).is_some(),
        "no banner"
    );
    c
}

fn echo(c: &mut RawConn, line: &str) -> bool {
    c.send(line.as_bytes()).is_ok() && c.read_until(line.as_bytes(), SECS5).is_some()
}

pub(crate) fn served_hash(lab: &Lab) -> String {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    let v: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.describe()));
    v["hash"].as_str().unwrap().to_string()
}

pub(crate) fn edit_config(lab: &Lab, f: impl FnOnce(String) -> String) {
    let text = std::fs::read_to_string(&lab.config_path).unwrap();
    let tmp = lab.config_path.with_extension("new");
    std::fs::write(&tmp, f(text)).unwrap();
    // Replace atomically, as an editor or a ConfigMap update would.
    std::fs::rename(&tmp, &lab.config_path).unwrap();
}

#[test]
fn sighup_swaps_policy_for_proxy_and_dns_and_keeps_tunnels() {
    let lab = lab();
    let before = served_hash(&lab);
    let mut tunnel = banner_tunnel(&lab);
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    assert_eq!(lab.dig(&["other.test", "A"]).status, "REFUSED");
    assert_eq!(lab.proxied_curl("http://a.wild.test/", &[]).status, 200);

    // Allow other.test, deny *.wild.test.
    edit_config(&lab, |t| {
        format!("{t}\n[[org.allow]]\nid = \"other\"\nhost = \"other.test\"\n\n[[org.deny]]\nid = \"no-wild\"\nhost = \"*.wild.test\"\n")
    });
    lab.signal_proxy("-HUP");
    lab::wait_until("new policy served", SECS5, || served_hash(&lab) != before);
    let after = served_hash(&lab);

    assert!(
        echo(&mut tunnel, "still-open\n"),
        "open tunnel dropped by the reload"
    );
    let r = lab.proxied_curl("http://other.test/", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let r = lab.proxied_curl("http://a.wild.test/", &[]);
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("explicit_deny"), "{r:?}");
    let d = lab.dig(&["other.test", "A"]);
    assert_eq!(d.status, "NOERROR", "{}", d.output);

    // Records name the policy that decided them, and its text is stored.
    let allow = lab.wait_evidence("other.test allowed under the new policy", |v| {
        v["host"] == "other.test" && v["decision"] == "allow" && v["event"] == "decision"
    });
    assert_eq!(allow["policy"], after.as_str(), "{allow}");
    assert_eq!(allow["rule"], "other", "{allow}");
    let old_deny = lab.wait_evidence("other.test denied before", |v| {
        v["host"] == "other.test" && v["decision"] == "deny" && v["kind"] == "http"
    });
    assert_eq!(old_deny["policy"], before.as_str(), "{old_deny}");
    for hash in [&before, &after] {
        let stored = lab
            .evidence_dir
            .join("policies")
            .join(format!("{hash}.json"));
        assert!(
            stored.is_file(),
            "no stored policy text {}",
            stored.display()
        );
    }
    assert_eq!(
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"ok\"}"),
        1.0
    );
    drop(tunnel);
}

#[test]
fn invalid_reload_keeps_the_old_policy() {
    let lab = lab();
    let before = served_hash(&lab);
    edit_config(&lab, |t| format!("{t}\n[[org.allow]]\nhost = \"*.com\"\n"));
    lab.signal_proxy("-HUP");
    lab::wait_until("reload error counted", SECS5, || {
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"error\"}")
            >= 1.0
    });
    assert_eq!(served_hash(&lab), before);
    assert_eq!(lab.proxied_curl("http://allowed.test/", &[]).status, 200);
    assert_eq!(lab.admin_status("/readyz"), 200);
    let log = lab.proxy_output();
    let located = format!("{}:", lab.config_path.display());
    assert!(
        log.lines()
            .any(|l| l.contains(&located) && l.contains("top-level domain")),
        "no FILE:LINE:COL error in the log:\n{log}"
    );
}

#[test]
fn a_changed_file_is_picked_up_without_a_signal() {
    let lab = lab();
    let before = served_hash(&lab);
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    edit_config(&lab, |t| {
        format!("{t}\n[[org.allow]]\nhost = \"other.test\"\n")
    });
    lab::wait_until("file change picked up", Duration::from_secs(10), || {
        served_hash(&lab) != before
    });
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 200);
}

/// The secret a reload adds to requests to allowed.test.
const SECRET: &str = "r3load-tok-5e0c91d2";

#[test]
fn a_reload_turns_interception_on_with_its_ca_and_credential() {
    let dir = scratch_dir("reload-intercept");
    let secret = dir.join("registry.token");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let ca_dir = dir.join("ca");
    let lab = Lab::builder()
        .policy(DEFAULT_POLICY)
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .start();
    let lab_ca = ca_pem().display().to_string();
    let curl = |ca: &str, path: &str| {
        lab.client_curl(&[
            "-x",
            PROXY_URL,
            "--cacert",
            ca,
            &format!("https://allowed.test{path}"),
        ])
    };

    // Before: allowed.test passes through untouched (the upstream's own
    // certificate), and no org CA exists.
    let before = served_hash(&lab);
    let r = curl(&lab_ca, "/before");
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        !ca_dir.join("acme.pem").exists(),
        "no CA before interception"
    );

    // Reload: the rule intercepts and a credential is added for the host.
    edit_config(&lab, |t| {
        let t = t.replace(
            "host = \"allowed.test\"\nports = [80, 443]\n",
            "host = \"allowed.test\"\nports = [80, 443]\nintercept = true\n",
        );
        format!(
            "{t}\n[[org.credential]]\nid = \"registry-token\"\nhost = \"allowed.test\"\n\
             header = \"Authorization\"\nprefix = \"Bearer \"\nsecret_file = {:?}\n",
            secret.display().to_string()
        )
    });
    lab.signal_proxy("-HUP");
    lab::wait_until("intercepting policy served", SECS5, || {
        served_hash(&lab) != before
    });
    assert!(
        ca_dir.join("acme.pem").is_file(),
        "the reload created the org CA"
    );

    // What an operator then exports for the sandbox's trust store.
    let out = run_with_timeout(
        Command::new(palisade_bin())
            .args(["ca", "export", "--org", "acme", "-c"])
            .arg(&lab.config_path),
        None,
        CMD_TIMEOUT,
    );
    assert!(out.success(), "ca export: {}", out.describe());
    let org_ca = dir.join("acme-ca.pem");
    std::fs::write(&org_ca, &out.stdout).unwrap();
    let org_ca = org_ca.display().to_string();

    // Intercepted: served through a leaf from the org CA, the credential
    // added, the connection recorded as intercepted.
    let r = curl(&org_ca, "/after");
    assert_eq!(r.status, 200, "{r:?}\n{}", lab.proxy_output());
    assert!(r.body.contains("hello from upstream="), "{r:?}");
    let up = lab.wait_upstream("GET /after", |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with("GET /after "))
    });
    let auth: Vec<&str> = up["headers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|h| h[0] == "authorization")
        .filter_map(|h| h[1].as_str())
        .collect();
    assert_eq!(auth, [format!("Bearer {SECRET}")], "{up}");
    let after = served_hash(&lab);
    let tcp = lab.wait_evidence("intercepted tcp decision", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["intercepted"] == true
    });
    assert_eq!(tcp["host"], "allowed.test", "{tcp}");
    assert_eq!(tcp["policy"], after.as_str(), "{tcp}");
    let http = lab.wait_evidence("intercepted request", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == "/after"
    });
    assert_eq!(http["decision"], "allow", "{http}");
    assert_eq!(http["credential"], "registry-token", "{http}");
    let untouched = lab.wait_evidence("tunnel before the reload", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["policy"] == before.as_str()
    });
    assert!(untouched["intercepted"].is_null(), "{untouched}");
    let log = lab.proxy_output();
    assert!(!log.contains(SECRET), "the secret leaked into the log");
    // The upstream's own certificate is no longer what the client sees.
    let r = curl(&lab_ca, "/lab-ca");
    assert_ne!(r.exit, Some(0), "{r:#?}");
}

#[test]
fn a_setting_only_a_restart_can_apply_refuses_the_reload() {
    let lab = lab();
    let before = served_hash(&lab);
    // A new rule together with a limit that sizes a pool: all or nothing.
    edit_config(&lab, |t| {
        let t = t.replacen("[proxy]\n", "[proxy]\nmax_connections = 77\n", 1);
        format!("{t}\n[[org.allow]]\nhost = \"other.test\"\n")
    });
    lab.signal_proxy("-HUP");
    lab::wait_until("reload error counted", SECS5, || {
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"error\"}")
            >= 1.0
    });
    assert_eq!(served_hash(&lab), before);
    assert_eq!(lab.proxied_curl("http://other.test/", &[]).status, 403);
    let log = lab.proxy_output();
    assert!(
        log.lines().any(|l| l.contains("proxy.max_connections")
            && l.contains("cannot change without a restart")),
        "the refusal names the key:\n{log}"
    );
    assert_eq!(
        crate::metrics::scalar_from_scrape(&lab, "palisade_policy_reloads_total{result=\"ok\"}"),
        0.0
    );
}
