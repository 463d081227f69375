//! Opt-in TLS interception: real curl, trusting the org CA exported with
//! `palisade ca export`, through an intercepted host; request rules,
//! HTTP/2, Host vs SNI, credential injection, upstream verification, and a
//! non-intercepted host passing through untouched.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::lab::{
    self, ca_pem, dump, palisade_bin, read_jsonl, run_with_timeout, scratch_dir, HttpResp, Lab,
    CMD_TIMEOUT, PROXY_URL,
};
use crate::record_id;

/// The secret Palisade adds; it must never show up in evidence or logs.
const SECRET: &str = "s3cr3t-tok-8c1f2a9e77";
/// The secret of the credential scoped to `/scoped/`.
const SCOPED_SECRET: &str = "sc0ped-tok-41d7e0b2";

fn policy(secret_file: &Path, scoped_file: &Path) -> String {
    format!(
        r#"
[[org]]
name = "acme"
clients = ["198.18.1.0/24"]

[[org.allow]]
id = "registry"
host = "allowed.test"
ports = [443]
intercept = true
methods = ["GET", "HEAD", "POST"]
deny_paths = ["/upload", "/api/internal*"]

[[org.allow]]
id = "untrusted"
host = "untrusted.test"
ports = [443]
intercept = true

[[org.allow]]
id = "plain"
host = "*.wild.test"
ports = [443]

[[org.credential]]
id = "registry-token"
host = "allowed.test"
header = "Authorization"
prefix = "Bearer "
secret_file = {secret_file:?}

[[org.credential]]
id = "scoped-token"
host = "allowed.test"
header = "X-Scoped-Token"
paths = ["/scoped/"]
secret_file = {scoped_file:?}

[[org.credential]]
id = "v1-token"
host = "allowed.test"
header = "X-V1-Token"
paths = ["/api/v1/*"]
secret_file = {scoped_file:?}
"#
    )
}

pub(crate) struct Setup {
    pub(crate) lab: Lab,
    pub(crate) org_ca: PathBuf,
}

pub(crate) fn start() -> Setup {
    start_with(&[])
}

/// [`start`], with extra `[proxy]` lines (other listeners).
fn start_with(proxy_options: &[&str]) -> Setup {
    let dir = scratch_dir("intercept");
    let secret = dir.join("registry.token");
    fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let scoped = dir.join("scoped.token");
    fs::write(&scoped, format!("{SCOPED_SECRET}\n")).unwrap();
    let ca_dir = dir.join("ca");
    let mut builder = Lab::builder();
    for line in proxy_options {
        builder = builder.proxy_option(line);
    }
    let lab = builder
        .policy(&policy(&secret, &scoped))
        .intercept_config(&format!(
            "ca_dir = {:?}\nupstream_ca = {:?}\ncert_cache = 8",
            ca_dir.display().to_string(),
            ca_pem().display().to_string()
        ))
        .untrusted_upstream()
        .start();
    // What an operator runs to build the sandbox image's trust store.
    let out = run_with_timeout(
        Command::new(palisade_bin())
            .args(["ca", "export", "--org", "acme", "-c"])
            .arg(&lab.config_path),
        None,
        CMD_TIMEOUT,
    );
    assert!(out.success(), "ca export: {}", out.describe());
    assert!(
        out.stdout.starts_with("-----BEGIN CERTIFICATE-----"),
        "{}",
        out.describe()
    );
    assert_eq!(
        out.stdout,
        fs::read_to_string(ca_dir.join("acme.pem")).unwrap(),
        "export prints the CA the running instance created"
    );
    let org_ca = dir.join("acme-ca.pem");
    fs::write(&org_ca, &out.stdout).unwrap();
    Setup { lab, org_ca }
}

/// curl through the proxy trusting only `ca`.
fn curl(lab: &Lab, ca: &Path, url: &str, extra: &[&str]) -> HttpResp {
    let ca = ca.display().to_string();
    let mut args: Vec<&str> = vec!["-x", PROXY_URL, "--cacert", &ca];
    args.extend_from_slice(extra);
    args.push(url);
    lab.client_curl(&args)
}

fn headers_of(v: &serde_json::Value, name: &str) -> Vec<String> {
    v["headers"]
        .as_array()
        .map(|hs| {
            hs.iter()
                .filter(|h| h[0] == name)
                .filter_map(|h| h[1].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn intercepted_requests_are_decided_one_by_one_and_get_the_credential() {
    let Setup { lab, org_ca } = start();

    // GET, HTTP/1.1: allowed, the upstream answers, the credential is added.
    let get = curl(
        &lab,
        &org_ca,
        "https://allowed.test/simple/requests/",
        &["--http1.1"],
    );
    assert_eq!(get.status, 200, "{get:#?}\n{}", lab.proxy_output());
    assert!(
        get.body.contains("hello from upstream=198.18.2.10"),
        "{get:#?}"
    );
    let up = lab.wait_upstream("GET /simple/requests/", |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with("GET /simple/requests/ "))
    });
    assert_eq!(up["sni"], "allowed.test", "{up}");
    assert_eq!(
        headers_of(&up, "authorization"),
        vec![format!("Bearer {SECRET}")],
        "the upstream got the injected header: {up}"
    );
    let rec = lab.wait_evidence("http allow GET", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["method"] == "GET"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["rule"], "registry", "{rec}");
    assert_eq!(rec["path"], "/simple/requests/", "{rec}");
    assert_eq!(rec["credential"], "registry-token", "{rec}");
    assert_eq!(rec["sni"], "allowed.test", "{rec}");
    let id = record_id(&rec).unwrap();
    let close = lab.wait_evidence("http close with status", |v| {
        v["event"] == "close" && v["conn"] == id.as_str()
    });
    assert_eq!(close["status"], 200, "{close}");
    assert!(close["bytes_down"].as_u64().unwrap_or(0) > 0, "{close}");
    let tcp = lab.wait_evidence("tcp intercepted", |v| {
        v["kind"] == "tcp" && v["event"] == "decision" && v["intercepted"] == true
    });
    assert_eq!(tcp["host"], "allowed.test", "{tcp}");

    // A client-supplied Authorization is replaced, never forwarded.
    let own = curl(
        &lab,
        &org_ca,
        "https://allowed.test/own-header",
        &["-H", "Authorization: Bearer client-own-value"],
    );
    assert_eq!(own.status, 200, "{own:#?}");
    let up = lab.wait_upstream("GET /own-header", |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with("GET /own-header "))
    });
    assert_eq!(
        headers_of(&up, "authorization"),
        vec![format!("Bearer {SECRET}")],
        "{up}"
    );

    // POST to a denied path: 403 naming the reason, recorded, never sent.
    let before = lab.upstream_log().len();
    let post = curl(
        &lab,
        &org_ca,
        "https://allowed.test/upload/pkg.tar.gz",
        &["-X", "POST", "--data", "payload"],
    );
    let rec = crate::assert_refused(&lab, &post, 403, "path_not_allowed", "POST /upload");
    assert_eq!(rec["kind"], "http", "{rec}");
    assert_eq!(rec["method"], "POST", "{rec}");
    assert_eq!(rec["rule"], "registry", "{rec}");
    // A method outside `methods`.
    let del = curl(
        &lab,
        &org_ca,
        "https://allowed.test/simple/x",
        &["-X", "DELETE"],
    );
    crate::assert_refused(&lab, &del, 403, "method_not_allowed", "DELETE");
    // Dot segments cannot walk a path rule.
    let dots = curl(
        &lab,
        &org_ca,
        "https://allowed.test/simple/%2e%2e/upload",
        &["--path-as-is"],
    );
    crate::assert_refused(&lab, &dots, 403, "path_not_allowed", "dot segments");
    upstream_quiet(&lab, &org_ca, "/marker-after-denials");
    let after: Vec<_> = lab.upstream_log().into_iter().skip(before).collect();
    assert!(
        after.iter().all(|v| v["request_line"]
            .as_str()
            .is_none_or(|l| !l.contains("/upload"))),
        "a denied request reached the upstream: {}",
        dump(&after)
    );

    // HTTP/2 with the client, whatever the upstream speaks.
    let h2 = curl(
        &lab,
        &org_ca,
        "https://allowed.test/h2",
        &["--http2", "-w", " %{http_version}"],
    );
    assert_eq!(h2.status, 200, "{h2:#?}\n{}", lab.proxy_output());
    // The upstream's own response head came through, without a
    // Proxy-Status of Palisade's.
    assert_eq!(
        h2.header("content-type"),
        Some("text/plain"),
        "no upstream response head captured: {h2:#?}"
    );
    assert!(h2.header("proxy-status").is_none(), "{h2:#?}");
    let v = lab.client_exec(
        "curl",
        &[
            "-q",
            "-sS",
            "--max-time",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version}",
            "-x",
            PROXY_URL,
            "--cacert",
            &org_ca.display().to_string(),
            "--http2",
            "https://allowed.test/h2-version",
        ],
    );
    assert_eq!(v.stdout.trim(), "2", "{}", v.describe());
    let h2_rec = lab.wait_evidence("http /h2", |v| {
        v["path"] == "/h2" && v["event"] == "decision"
    });
    assert_eq!(h2_rec["decision"], "allow", "{h2_rec}");

    // Host differs from the SNI: denied inside the connection.
    let mism = curl(
        &lab,
        &org_ca,
        "https://allowed.test/",
        &["--http1.1", "-H", "Host: other.test"],
    );
    crate::assert_refused(&lab, &mism, 403, "host_mismatch", "Host other.test");

    // The secret is nowhere in evidence, Palisade's logs or metrics.
    let mut haystack = String::new();
    for e in fs::read_dir(&lab.evidence_dir).unwrap().flatten() {
        haystack.push_str(&fs::read_to_string(e.path()).unwrap_or_default());
    }
    haystack.push_str(&lab.proxy_output());
    let metrics = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/metrics", lab::ADMIN_ADDR)],
    );
    haystack.push_str(&metrics.stdout);
    assert!(haystack.len() > 1000, "nothing to search");
    assert!(!haystack.contains(SECRET), "the secret leaked");
    assert!(
        metrics
            .stdout
            .contains("palisade_intercepted_requests_total{decision=\"deny\",org=\"acme\",reason=\"path_not_allowed\"} 2"),
        "{}",
        metrics.stdout
    );
    assert!(metrics
        .stdout
        .contains("palisade_intercept_cert_cache_total{result=\"hit\"}"));

    // `explain` shows the request-level decision.
    // (in the proxy namespace, where the lab's resolver is reachable)
    let config = lab.config_path.display().to_string();
    let x = lab.proxy_ns_exec(
        palisade_bin(),
        &[
            "explain",
            "--client",
            "198.18.1.2",
            "--method",
            "POST",
            "-c",
            &config,
            "https://allowed.test/upload/x",
        ],
    );
    assert!(x.success(), "{}", x.describe());
    assert!(
        x.stdout.contains("intercepted request: POST /upload/x"),
        "{}",
        x.stdout
    );
    assert!(x.stdout.contains("path_not_allowed"), "{}", x.stdout);
}

/// Wait until every request sent before now has been served or refused:
/// an allowed `marker` request reaches the upstream (a positive marker,
/// not a sleep), then every upstream connection that was opened is logged
/// closed, with the request it carried.
fn upstream_quiet(lab: &Lab, ca: &Path, marker: &str) -> Vec<serde_json::Value> {
    let m = curl(lab, ca, &format!("https://allowed.test{marker}"), &[]);
    assert_eq!(m.status, 200, "marker {marker}: {m:#?}");
    lab.wait_upstream(marker, |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {marker} ")))
    });
    lab.upstream_settled()
}

/// `denied` then an allowed `marker`, in that order on one connection
/// (HTTP/1.1, or HTTP/2 with `h2`), exactly as sent (`--path-as-is`).
/// Returns curl's "status new-connections" line per request. Palisade
/// handles the two in order, and its HTTP/1.1 upstream connection carries
/// one exchange at a time, so once the marker has reached the upstream and
/// every upstream connection is logged closed, anything sent for `denied`
/// would be in the upstream's log: its absence there is the proof.
fn denied_then_marker(lab: &Lab, ca: &Path, denied: &str, marker: &str, h2: bool) -> Vec<String> {
    let ca = ca.display().to_string();
    let (denied_url, marker_url) = (
        format!("https://allowed.test{denied}"),
        format!("https://allowed.test{marker}"),
    );
    let out = lab.client_exec(
        "curl",
        &[
            "-q",
            "-sS",
            "--max-time",
            "10",
            "-x",
            PROXY_URL,
            "--cacert",
            &ca,
            if h2 { "--http2" } else { "--http1.1" },
            "--path-as-is",
            "-o",
            "/dev/null",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{num_connects}\n",
            &denied_url,
            &marker_url,
        ],
    );
    lab.wait_upstream(marker, |v| {
        v["event"] == "close"
            && v["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {marker} ")))
    });
    out.stdout.lines().map(str::to_string).collect()
}

/// `denied` and then an allowed `marker` on one connection (HTTP/2 with
/// `h2`): the first refused 403 and recorded `path_not_allowed` by rule
/// `registry`, with no credential and a detail holding every one of
/// `detail`; the marker served on the same connection.
fn refused_then_marker(
    lab: &Lab,
    ca: &Path,
    denied: &str,
    marker: &str,
    h2: bool,
    detail: &[&str],
) {
    let got = denied_then_marker(lab, ca, denied, marker, h2);
    assert_eq!(
        got,
        ["403 1", "200 0"],
        "{denied} h2={h2}\n{}",
        lab.proxy_output()
    );
    let rec = lab.wait_evidence(&format!("deny {denied} h2={h2}"), |v| {
        v["kind"] == "http"
            && v["event"] == "decision"
            && v["detail"]
                .as_str()
                .is_some_and(|d| d.contains(&format!("GET {denied} refused")))
    });
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "path_not_allowed", "{rec}");
    assert_eq!(rec["rule"], "registry", "{rec}");
    assert!(
        rec["credential"].is_null(),
        "no credential for a refusal: {rec}"
    );
    let said = rec["detail"].as_str().unwrap_or("");
    assert!(detail.iter().all(|d| said.contains(d)), "{rec}");
}

/// [`refused_then_marker`] for each of `denied`, over HTTP/1.1 and then
/// HTTP/2, the markers `{marker}-1`, `-2`, ...; returns how many were sent.
fn each_refused(lab: &Lab, ca: &Path, denied: &[&str], marker: &str, detail: &[&str]) -> usize {
    let mut n = 0;
    for denied in denied {
        for h2 in [false, true] {
            n += 1;
            refused_then_marker(lab, ca, denied, &format!("{marker}-{n}"), h2, detail);
        }
    }
    n
}

/// Path normalisation on the live path: an encoded unreserved character
/// does not walk around `deny_paths` (and gets no credential), `..;` is
/// refused, and a credential's `paths` scope matches the normalised path.
#[test]
fn paths_are_normalised_before_rules_and_credential_scopes() {
    let Setup { lab, org_ca } = start();

    let cases = [
        (
            "/api/%69nternal",
            false,
            "deny_paths \"/api/internal*\" matches /api/internal",
        ),
        (
            "/api/%69nternal/keys",
            true,
            "deny_paths \"/api/internal*\"",
        ),
        ("/simple/..;/upload", false, "dot segment \"..;\""),
        ("/simple/..;jsessionid=1/upload", true, "dot segment"),
        ("/simple/x;jsessionid=1", false, "path parameter"),
    ];
    for (n, (denied, h2, why)) in cases.into_iter().enumerate() {
        let marker = format!("/marker-{n}");
        refused_then_marker(&lab, &org_ca, denied, &marker, h2, &[why]);
    }
    let decoded = lab
        .evidence()
        .into_iter()
        .find(|v| v["kind"] == "http" && v["reason"] == "path_not_allowed")
        .unwrap();
    assert_eq!(
        decoded["path"], "/api/internal",
        "recorded as decided: {decoded}"
    );

    // The body and Proxy-Status name the reason, as for any refusal.
    let one = curl(&lab, &org_ca, "https://allowed.test/api/%69nternal", &[]);
    crate::assert_refused(&lab, &one, 403, "path_not_allowed", "/api/%69nternal");

    // A credential scoped to /scoped/ is added on the normalised path, and
    // the upstream gets the path the rules matched.
    let scoped = curl(
        &lab,
        &org_ca,
        "https://allowed.test/%73coped/x",
        &["--http1.1"],
    );
    assert_eq!(scoped.status, 200, "{scoped:#?}");
    let unscoped = curl(&lab, &org_ca, "https://allowed.test/not-scoped/x", &[]);
    assert_eq!(unscoped.status, 200, "{unscoped:#?}");

    let closes = upstream_quiet(&lab, &org_ca, "/marker-end");
    let served = |path: &str| {
        closes
            .iter()
            .find(|c| {
                c["request_line"]
                    .as_str()
                    .is_some_and(|l| l.starts_with(&format!("GET {path} ")))
            })
            .unwrap_or_else(|| panic!("{path} not served: {}", dump(&closes)))
    };
    let up = served("/scoped/x");
    assert_eq!(
        headers_of(up, "x-scoped-token"),
        vec![SCOPED_SECRET],
        "{up}"
    );
    assert_eq!(
        headers_of(up, "authorization"),
        vec![format!("Bearer {SECRET}")],
        "{up}"
    );
    let up = served("/not-scoped/x");
    assert!(headers_of(up, "x-scoped-token").is_empty(), "{up}");
    let rec = lab.wait_evidence("allow /scoped/x", |v| {
        v["kind"] == "http" && v["event"] == "decision" && v["path"] == "/scoped/x"
    });
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["credential"], "registry-token,scoped-token", "{rec}");
    assert_eq!(rec["detail"], "path normalised from /%73coped/x", "{rec}");

    // Nothing refused reached the upstream, in any spelling.
    let lines: Vec<&str> = closes
        .iter()
        .filter_map(|c| c["request_line"].as_str())
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| !l.contains("nternal") && !l.contains("upload") && !l.contains(';')),
        "a refused request reached the upstream: {lines:?}"
    );

    // `explain` takes the same decision.
    let config = lab.config_path.display().to_string();
    let x = lab.proxy_ns_exec(
        palisade_bin(),
        &[
            "explain",
            "--client",
            "198.18.1.2",
            "-c",
            &config,
            "https://allowed.test/api/%69nternal",
        ],
    );
    assert!(x.success(), "{}", x.describe());
    assert!(
        x.stdout.contains("path:     /api/internal (normalised)"),
        "{}",
        x.stdout
    );
    assert!(
        x.stdout.contains("reason:   path_not_allowed"),
        "{}",
        x.stdout
    );
}

/// `deny_paths` ignore ASCII case (after decoding, so `%49` is `I`): no
/// spelling of `/api/internal` reaches the upstream, over HTTP/1.1 or
/// HTTP/2; credential scopes stay exact, so `/API/v1/x` (which the rule
/// allows) gets no `/api/v1/*` credential while `/api/v1/x` does.
#[test]
fn deny_paths_ignore_case_and_credential_scopes_do_not() {
    let Setup { lab, org_ca } = start();
    let cases = [
        "/api/%49nternal/keys",
        "/API/internal/keys",
        "/api/INTERNAL/keys",
    ];
    each_refused(
        &lab,
        &org_ca,
        &cases,
        "/case-marker",
        &["deny_paths \"/api/internal*\"", "ignoring case"],
    );
    let one = curl(&lab, &org_ca, "https://allowed.test/API/internal/keys", &[]);
    crate::assert_refused(&lab, &one, 403, "path_not_allowed", "/API/internal/keys");

    for path in ["/API/v1/x", "/api/v1/x"] {
        let r = curl(&lab, &org_ca, &format!("https://allowed.test{path}"), &[]);
        assert_eq!(r.status, 200, "{path}: {r:#?}");
    }
    let closes = upstream_quiet(&lab, &org_ca, "/case-marker-end");
    let served = |path: &str| {
        closes
            .iter()
            .find(|c| {
                c["request_line"]
                    .as_str()
                    .is_some_and(|l| l.starts_with(&format!("GET {path} ")))
            })
            .unwrap_or_else(|| panic!("{path} not served: {}", dump(&closes)))
    };
    let exact = served("/api/v1/x");
    assert_eq!(
        headers_of(exact, "x-v1-token"),
        vec![SCOPED_SECRET],
        "{exact}"
    );
    let folded = served("/API/v1/x");
    assert!(
        headers_of(folded, "x-v1-token").is_empty(),
        "a case change gained a credential: {folded}"
    );
    assert_eq!(
        headers_of(folded, "authorization"),
        vec![format!("Bearer {SECRET}")],
        "the unscoped credential still applies: {folded}"
    );
    // The upstream's own log: no spelling of the denied path arrived.
    let lines: Vec<&str> = closes
        .iter()
        .filter_map(|c| c["request_line"].as_str())
        .collect();
    assert!(
        lines
            .iter()
            .all(|l| !l.to_ascii_lowercase().contains("nternal")),
        "a denied spelling reached the upstream: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("GET /case-marker-6 ")),
        "{lines:?}"
    );
}

/// `deny_paths` and letters outside ASCII: a dotless `ı` (U+0131, which
/// upper-cases to `I`) or a fullwidth `Ｉ` (U+FF29, which NFKC makes `I`)
/// in place of the `i` of `/api/internal` is refused before anything is
/// forwarded, with the credential or without, over HTTP/1.1 and HTTP/2; a
/// non-ASCII path no folding could make a denied one still passes.
#[test]
fn deny_paths_are_not_walked_around_by_letters_outside_ascii() {
    let Setup { lab, org_ca } = start();
    let cases = [
        "/api/%C4%B1nternal/keys",
        "/api/%EF%BC%A9nternal/keys",
        "/api/%EF%BD%89%EF%BD%8E%EF%BD%94%EF%BD%85%EF%BD%92%EF%BD%8E%EF%BD%81%EF%BD%8C/keys",
    ];
    let n = each_refused(
        &lab,
        &org_ca,
        &cases,
        "/fold-marker",
        &["deny_paths \"/api/internal*\" could match", "non-ASCII"],
    );
    // A non-ASCII path where no reading completes a deny: served, with
    // the credential.
    let fine = "/api/caf%C3%A9";
    let r = curl(
        &lab,
        &org_ca,
        &format!("https://allowed.test{fine}"),
        &["--path-as-is"],
    );
    assert_eq!(r.status, 200, "{r:#?}");
    let closes = upstream_quiet(&lab, &org_ca, "/fold-marker-end");
    let lines: Vec<&str> = closes
        .iter()
        .filter_map(|c| c["request_line"].as_str())
        .collect();
    eprintln!(
        "intercept: {} non-ASCII spellings of /api/internal refused, none forwarded; upstream saw {lines:?}",
        n
    );
    assert!(
        lines
            .iter()
            .all(|l| !l.contains("nternal") && !l.contains("%EF%BD")),
        "a folded spelling reached the upstream: {lines:?}"
    );
    let served = closes
        .iter()
        .find(|c| {
            c["request_line"]
                .as_str()
                .is_some_and(|l| l.starts_with(&format!("GET {fine} ")))
        })
        .unwrap_or_else(|| panic!("{fine} not served: {}", dump(&closes)));
    assert_eq!(
        headers_of(served, "authorization"),
        vec![format!("Bearer {SECRET}")],
        "{served}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("GET /fold-marker-6 ")),
        "{lines:?}"
    );
}

/// The same request decision holds through SOCKS5 and the transparent
/// gateway: an encoded denied path is refused (and never forwarded, and
/// gets no credential) whichever way the client came.
#[test]
fn encoded_paths_are_refused_through_socks5_and_the_gateway_too() {
    const SOCKS: &str = "198.18.1.1:1080";
    let Setup { lab, org_ca } = start_with(&[
        &format!("socks5 = [{SOCKS:?}]"),
        &format!("transparent = [{:?}]", crate::transparent::TRANSPARENT),
    ]);
    crate::transparent::load_gateway(&lab);
    let out = lab.proxy_ns_exec(
        "nft",
        &[
            "insert", "rule", "inet", "palisade", "input", "iifname", "\"p0\"", "tcp", "dport",
            "1080", "accept",
        ],
    );
    assert!(out.success(), "nft insert: {}", out.describe());
    let ca = org_ca.display().to_string();
    let resolve = format!("allowed.test:443:{}", lab::ALLOWED_IP);
    let url = "https://allowed.test/api/%69nternal";
    for (mode, args) in [
        (
            "socks5",
            vec!["--socks5-hostname", SOCKS, "--cacert", &ca, url],
        ),
        (
            "transparent",
            vec!["--resolve", &resolve, "--cacert", &ca, url],
        ),
    ] {
        let resp = lab.client_curl(&args);
        assert_eq!(resp.status, 403, "{mode}: {resp:?}\n{}", lab.proxy_output());
        let rec = lab.wait_evidence(&format!("{mode}: deny the encoded path"), |v| {
            v["kind"] == "http" && v["mode"] == mode && v["decision"] == "deny"
        });
        assert_eq!(rec["reason"], "path_not_allowed", "{mode}: {rec}");
        assert_eq!(rec["path"], "/api/internal", "{mode}: {rec}");
        assert!(rec["credential"].is_null(), "{mode}: {rec}");
    }
    // Both refusals are recorded (the positive marker): the upstream never
    // received the path, in any spelling.
    let reached: Vec<_> = lab
        .upstream_log()
        .into_iter()
        .filter(|v| {
            v["request_line"]
                .as_str()
                .is_some_and(|l| l.contains("nternal"))
        })
        .collect();
    assert!(reached.is_empty(), "{}", dump(&reached));
}

#[test]
fn untrusted_upstream_is_denied_and_unmarked_hosts_pass_through() {
    let Setup { lab, org_ca } = start();

    // The upstream's certificate does not verify: a deny, never a downgrade.
    let bad = curl(&lab, &org_ca, "https://untrusted.test/", &[]);
    crate::assert_refused(&lab, &bad, 502, "upstream_tls_error", "untrusted upstream");
    let log = read_jsonl(&lab.dir.join("untrusted.log"));
    assert!(
        log.iter().all(|v| v["request_line"].is_null()),
        "a request reached the untrusted upstream: {}",
        dump(&log)
    );

    // A host the org did not mark passes through byte for byte: the client
    // sees the real upstream certificate (from the lab CA, not the org CA).
    let with_org_ca = curl(&lab, &org_ca, "https://a.wild.test/", &[]);
    assert_ne!(with_org_ca.exit, Some(0), "{with_org_ca:#?}");
    let plain = curl(&lab, &ca_pem(), "https://a.wild.test/", &[]);
    assert_eq!(plain.status, 200, "{plain:#?}");
    let closes = lab.upstream_settled();
    // Two tunnels: the refused handshake (org CA) and the good one.
    crate::lab::wait_until("two pass-through close records", CMD_TIMEOUT, || {
        lab.evidence()
            .iter()
            .filter(|v| v["event"] == "close" && v["host"] == "a.wild.test")
            .count()
            >= 2
    });
    let tcp_close = lab
        .evidence()
        .into_iter()
        .rfind(|v| v["event"] == "close" && v["host"] == "a.wild.test")
        .unwrap();
    assert!(tcp_close["intercepted"].is_null(), "{tcp_close}");
    let served = closes
        .iter()
        .rfind(|c| c["sni"] == "a.wild.test" && c["request_line"].is_string())
        .unwrap_or_else(|| panic!("{}", dump(&closes)));
    // The request arrived exactly as curl sent it: nothing added or removed.
    let names: Vec<&str> = served["headers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|h| h[0].as_str())
        .collect();
    assert_eq!(names, ["host", "user-agent", "accept"], "{served}");
    // Everything the upstream received came through the tunnel (the client
    // may still send its close_notify after the upstream logged its count).
    let got = served["bytes_received"].as_u64().unwrap();
    let sent = tcp_close["bytes_up"].as_u64().unwrap();
    assert!(got > 0 && got <= sent, "{served} {tcp_close}");
}

/// Intercepted vs pass-through, same run: N sequential HTTPS requests
/// (a fresh curl, TCP and TLS per request) each way. Prints the numbers.
#[test]
fn intercept_cost_against_pass_through() {
    const N: usize = 100;
    let Setup { lab, org_ca } = start();
    let run = |ca: &Path, url: &str| -> (Vec<f64>, f64) {
        let script = format!(
            "for i in $(seq {N}); do curl -q -s -o /dev/null --max-time 10 -x {PROXY_URL} \
             --cacert {} -w '%{{http_code}} %{{time_total}}\\n' {url}; done",
            ca.display()
        );
        let started = Instant::now();
        let out = lab.client_exec("bash", &["-c", &script]);
        let wall = started.elapsed().as_secs_f64();
        let mut times = Vec::new();
        for line in out.stdout.lines() {
            let (code, t) = line.split_once(' ').unwrap_or(("", ""));
            assert_eq!(code, "200", "{}", out.describe());
            times.push(t.parse::<f64>().unwrap_or(f64::NAN));
        }
        assert_eq!(times.len(), N, "{}", out.describe());
        times.sort_by(|a, b| a.total_cmp(b));
        (times, wall)
    };
    let (pass, pass_wall) = run(&ca_pem(), "https://a.wild.test/");
    let (icpt, icpt_wall) = run(&org_ca, "https://allowed.test/bench");
    let pct = |v: &[f64], p: f64| v[((v.len() as f64 - 1.0) * p) as usize] * 1000.0;
    eprintln!(
        "intercept bench (N={N}, sequential, new connection each):\n  \
         pass-through: {:.1} req/s, latency p50 {:.2} ms p95 {:.2} ms\n  \
         intercepted:  {:.1} req/s, latency p50 {:.2} ms p95 {:.2} ms\n  \
         ratio (intercepted/pass-through): throughput {:.2}, p50 latency {:.2}",
        N as f64 / pass_wall,
        pct(&pass, 0.5),
        pct(&pass, 0.95),
        N as f64 / icpt_wall,
        pct(&icpt, 0.5),
        pct(&icpt, 0.95),
        pass_wall / icpt_wall,
        pct(&icpt, 0.5) / pct(&pass, 0.5),
    );
}
