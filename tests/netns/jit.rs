//! Just-in-time access through real sockets: a miss of an `ask` org is
//! refused `approval_pending` naming its approval, which the approvers'
//! API lists (to a token of that org only; 401 without one); answered
//! allow with a short TTL, the client's retry passes under the grant; at
//! the TTL's end its live tunnel is closed and recorded `grant_expired`,
//! and the next attempt is refused again. `max_uses = 1` lets exactly one
//! connection through, and a revoke closes a live one. Timings of the
//! run (approval to allowed retry, expiry to closed tunnel) are printed.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::lab::{self, Closed, Lab, RawConn, DEFAULT_POLICY};

const SECS5: Duration = Duration::from_secs(5);
pub(crate) const ALICE: &str = "alice-approver-secret";
const MALLORY: &str = "mallory-approver-secret";

pub(crate) fn digest(token: &str) -> String {
    palisade::config::TokenDigest::of(token.as_bytes()).to_string()
}

fn lab_asking() -> Lab {
    lab_asking_with(|b| b)
}

pub(crate) fn lab_asking_with(extra: impl FnOnce(lab::LabBuilder) -> lab::LabBuilder) -> Lab {
    let policy = DEFAULT_POLICY.replacen(
        "clients = [\"198.18.1.0/24\"]\n",
        "clients = [\"198.18.1.0/24\"]\non_miss = \"ask\"\n",
        1,
    );
    let other = "\n[[org]]\nname = \"beta\"\nclients = [\"198.18.9.0/24\"]\non_miss = \"ask\"\n";
    extra(Lab::builder())
        .policy(&format!("{policy}{other}"))
        .admin_config(&format!(
            "approver_tokens = [{{ name = \"alice\", token = \"{}\", orgs = [\"acme\"] }}, {{ name = \"mallory\", token = \"{}\", orgs = [\"beta\"] }}]\n",
            digest(ALICE),
            digest(MALLORY)
        ))
        .start()
}

/// An admin request with `token` (none: no Authorization): status, body.
pub(crate) fn admin(
    lab: &Lab,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let url = format!("http://{}{path}", lab::ADMIN_ADDR);
    let auth = token.map(|t| format!("Authorization: Bearer {t}"));
    let mut args = vec!["-sS", "-o", "-", "-w", "\n%{http_code}", "-X", method];
    if let Some(a) = &auth {
        args.extend(["-H", a.as_str()]);
    }
    if let Some(b) = body {
        args.extend(["-H", "Content-Type: application/json", "--data", b]);
    }
    args.push(&url);
    let out = lab.proxy_ns_exec("curl", &args);
    let (text, code) = out.stdout.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), text.to_string())
}

pub(crate) fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// CONNECT to `target`: the status and the Proxy-Status header.
fn connect(lab: &Lab, target: &str) -> (u16, String, RawConn) {
    let mut c = lab.client_conn();
    let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n");
    c.send(req.as_bytes()).unwrap();
    let (status, headers) = c.read_head(SECS5);
    let ps = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("proxy-status"))
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    (status, ps, c)
}

/// A request through an open tunnel to the HTTP upstream.
fn get_through(c: &mut RawConn, path: &str) -> u16 {
    let req = format!("GET {path} HTTP/1.1\r\nHost: other.test\r\nConnection: keep-alive\r\n\r\n");
    c.send(req.as_bytes()).unwrap();
    c.read_response(SECS5).status
}

/// The one pending approval of `token` for `destination`.
fn pending(lab: &Lab, token: &str, destination: &str) -> Option<Value> {
    let (code, body) = admin(lab, "GET", "/v1/approvals", Some(token), None);
    assert_eq!(code, 200, "{body}");
    json(&body)["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["destination"] == destination)
        .cloned()
}

#[test]
fn a_miss_waits_for_an_approver_and_its_grant_ends_on_time() {
    let lab = lab_asking();
    let target = "other.test:80";
    let (status, ps, _) = connect(&lab, target);
    assert_eq!(status, 403, "a miss of an ask org is refused");
    assert!(
        ps.contains("approval_pending") && ps.contains("approval a-") && ps.contains(target),
        "Proxy-Status names the approval and the destination: {ps}"
    );
    // Identical misses share one approval.
    let (again, _, _) = connect(&lab, target);
    assert_eq!(again, 403);
    let approval = pending(&lab, ALICE, target).expect("the approval is listed");
    assert_eq!(approval["count"], 2, "{approval}");
    assert_eq!(approval["org"], "acme");
    let id = approval["id"].as_str().unwrap().to_string();
    assert!(ps.contains(&id), "{ps} names {id}");

    // Without a token: 401 and nothing of what is pending; another org's
    // token sees nothing and cannot answer it.
    let (code, body) = admin(&lab, "GET", "/v1/approvals", None, None);
    assert_eq!(code, 401);
    assert!(
        !body.contains("other.test") && !body.contains(&id),
        "{body}"
    );
    let (code, _) = admin(&lab, "GET", "/v1/approvals", Some("not-a-token"), None);
    assert_eq!(code, 401);
    assert!(
        pending(&lab, MALLORY, target).is_none(),
        "beta's token sees acme's approval"
    );
    let allow = r#"{"decision":"allow","ttl":"3s"}"#;
    let path = format!("/v1/approvals/{id}");
    let (code, body) = admin(&lab, "POST", &path, Some(MALLORY), Some(allow));
    assert_eq!(code, 404, "another org's token answered: {body}");
    // Wider than asked, or unbounded, is refused.
    let wider = r#"{"decision":"allow","ttl":"3s","port":443}"#;
    let (code, body) = admin(&lab, "POST", &path, Some(ALICE), Some(wider));
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("nothing wider"), "{body}");
    let (code, body) = admin(
        &lab,
        "POST",
        &path,
        Some(ALICE),
        Some(r#"{"decision":"allow","ttl":"48h"}"#),
    );
    assert_eq!(code, 400, "{body}");
    let (code, body) = admin(
        &lab,
        "POST",
        &path,
        Some(ALICE),
        Some(r#"{"decision":"allow","max_uses":0}"#),
    );
    assert_eq!(code, 400, "{body}");

    // Alice allows it for 3 s; the retry passes.
    let answered = Instant::now();
    let (code, body) = admin(&lab, "POST", &path, Some(ALICE), Some(allow));
    assert_eq!(code, 200, "{body}");
    let grant = json(&body)["grant"].clone();
    let grant_id = grant["id"].as_str().unwrap().to_string();
    let (code, body) = admin(&lab, "POST", &path, Some(ALICE), Some(allow));
    assert_eq!(code, 409, "answered twice: {body}");
    let (status, _, mut tunnel) = connect(&lab, target);
    assert_eq!(status, 200, "the retry under the grant");
    let to_allowed = answered.elapsed();
    assert_eq!(get_through(&mut tunnel, "/jit-1"), 200);
    let allow_rec = lab.wait_evidence("the granted decision", |v| {
        v["event"] == "decision" && v["host"] == "other.test" && v["decision"] == "allow"
    });
    assert_eq!(allow_rec["rule"], format!("grant:{grant_id}"));
    assert_eq!(allow_rec["layer"], "grant");
    let granted = lab.wait_evidence("the grant record", |v| {
        v["kind"] == "grant" && v["event"] == "granted"
    });
    assert_eq!(granted["grant"]["approver"], "alice");
    assert_eq!(granted["grant"]["approval"], id.as_str());

    // At the TTL's end the tunnel is closed, recorded grant_expired.
    assert!(grant["expires"].is_string(), "{grant}");
    let closed = tunnel.wait_closed(Duration::from_secs(10));
    // Measured from before the answer was sent: an upper bound.
    let ended = answered + Duration::from_secs(3);
    assert!(
        matches!(closed, Closed::After(_)),
        "the tunnel outlived its grant"
    );
    assert!(
        Instant::now() >= ended,
        "the tunnel closed before its grant ended"
    );
    let late = ended.elapsed();
    assert!(
        late < Duration::from_secs(2),
        "closed {late:?} after the grant ended"
    );
    let allow_id = allow_rec["id"].as_str().unwrap();
    let cut = lab.wait_evidence("grant_expired", |v| {
        v["conn"] == allow_id && v["event"] == "decision"
    });
    assert_eq!(cut["reason"], "grant_expired");
    lab.wait_evidence("the grant's end", |v| {
        v["kind"] == "grant" && v["event"] == "expired"
    });
    let (status, ps, _) = connect(&lab, target);
    assert_eq!(status, 403, "refused again once the grant ended");
    assert!(ps.contains("approval_pending"), "{ps}");
    eprintln!(
        "jit timings: approval to allowed retry {to_allowed:?}; grant end to closed tunnel {late:?}"
    );
}

#[test]
fn one_use_allows_one_connection_and_a_revoke_closes_a_live_one() {
    let lab = lab_asking();
    let direct = |port: u16, extra: &str| {
        format!(r#"{{"org":"acme","target":"other.test","port":{port}{extra}}}"#)
    };
    // An always-denied target is refused.
    let (code, body) = admin(
        &lab,
        "POST",
        "/v1/grants",
        Some(ALICE),
        Some(r#"{"org":"acme","target":"169.254.169.254","port":80,"ttl":"1m"}"#),
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("always denied"), "{body}");
    // Another org's grant is not this token's to give.
    let (code, _) = admin(
        &lab,
        "POST",
        "/v1/grants",
        Some(MALLORY),
        Some(&direct(80, r#","max_uses":1"#)),
    );
    assert_eq!(code, 400);

    let (code, body) = admin(
        &lab,
        "POST",
        "/v1/grants",
        Some(ALICE),
        Some(&direct(80, r#","max_uses":1"#)),
    );
    assert_eq!(code, 201, "{body}");
    let (first, _, mut one) = connect(&lab, "other.test:80");
    assert_eq!(first, 200);
    assert_eq!(get_through(&mut one, "/jit-once"), 200);
    let (second, ps, _) = connect(&lab, "other.test:80");
    assert_eq!(second, 403, "a used-up grant allows no second connection");
    assert!(ps.contains("approval_pending"), "{ps}");
    lab.wait_evidence("used_up", |v| {
        v["kind"] == "grant" && v["event"] == "used_up"
    });

    // A grant with a TTL, revoked while its tunnel is live.
    let (code, body) = admin(
        &lab,
        "POST",
        "/v1/grants",
        Some(ALICE),
        Some(&direct(80, r#","ttl":"10m""#)),
    );
    assert_eq!(code, 201, "{body}");
    let gid = json(&body)["id"].as_str().unwrap().to_string();
    let (status, _, mut live) = connect(&lab, "other.test:80");
    assert_eq!(status, 200);
    assert_eq!(get_through(&mut live, "/jit-live"), 200);
    // The CLI lists the grant and the approval the refused second connection made.
    let token_file = lab::scratch_dir("jit-cli").join("alice.token");
    std::fs::write(&token_file, ALICE).unwrap();
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend([
            "--admin",
            lab::ADMIN_ADDR,
            "--token-file",
            token_file.to_str().unwrap(),
        ]);
        lab.proxy_ns_exec(lab::palisade_bin(), &all)
    };
    let out = cli(&["grants"]);
    assert!(
        out.success() && out.stdout.contains(&gid),
        "{}",
        out.describe()
    );
    let out = cli(&["approvals"]);
    assert!(
        out.success() && out.stdout.contains("other.test:80"),
        "{}",
        out.describe()
    );
    let (code, _) = admin(
        &lab,
        "DELETE",
        &format!("/v1/grants/{gid}"),
        Some(MALLORY),
        None,
    );
    assert_eq!(code, 404, "another org's token revoked acme's grant");
    let (code, body) = admin(
        &lab,
        "DELETE",
        &format!("/v1/grants/{gid}"),
        Some(ALICE),
        None,
    );
    assert_eq!(code, 200, "{body}");
    assert!(
        matches!(live.wait_closed(Duration::from_secs(3)), Closed::After(_)),
        "a revoked grant's tunnel stays open"
    );
    let revoked = lab.wait_evidence("revoked", |v| {
        v["kind"] == "grant" && v["event"] == "revoked"
    });
    assert_eq!(revoked["grant"]["ended_by"], "alice");
    lab.wait_evidence("grant_expired after revoke", |v| {
        v["reason"] == "grant_expired"
    });
}

/// Headless Chromium, through chromedriver's WebDriver API
/// (tests/fixtures/ui_driver.py), signs in to `/ui/approvals` with the
/// approver token, sees the pending approval (destination and org), and
/// allows it for 10 minutes; the client's retry then passes and the grant
/// is recorded. A name carrying markup is refused before it can become an
/// approval: the page holds neither its text nor an element made from it.
#[test]
fn the_approvals_page_in_a_browser_answers_a_miss_and_shows_markup_inert() {
    let lab = lab_asking_with(|b| b.dns_listen(&["198.18.1.1:53"]));
    let target = "other.test:80";
    let (status, ps, _) = connect(&lab, target);
    assert_eq!(status, 403, "a miss of an ask org is refused");
    assert!(ps.contains("approval_pending"), "{ps}");
    // A name carrying markup and a quote never becomes an approval: the
    // proxy refuses it as a bad request (CONNECT and DNS alike), so nothing
    // of it can reach the page.
    let marked = "x<b>y\"z.test";
    let (status, _, _) = connect(&lab, &format!("{marked}:80"));
    assert_eq!(status, 400, "the marked CONNECT target");
    let _ = lab.dig(&[marked, "A"]);
    lab.wait_evidence("the marked DNS query refused", |v| {
        v["kind"] == "dns" && v["reason"] == "bad_request"
    });
    let (code, body) = admin(&lab, "GET", "/v1/approvals", Some(ALICE), None);
    assert_eq!(code, 200, "{body}");
    assert!(
        !body.contains("<b>"),
        "the marked name made an approval: {body}"
    );

    let dir = lab::scratch_dir("jit-ui");
    let token_file = dir.join("alice.token");
    std::fs::write(&token_file, ALICE).unwrap();
    let script = lab::fixtures_dir().join("ui_driver.py");
    let out = lab.proxy_ns_exec(
        "timeout",
        &[
            "90",
            "python3",
            script.to_str().unwrap(),
            &format!("http://{}", lab::ADMIN_ADDR),
            token_file.to_str().unwrap(),
            target,
            "10m",
            dir.to_str().unwrap(),
        ],
    );
    assert!(out.success(), "ui_driver: {}", out.describe());
    let seen = json(out.stdout.trim());
    let rows = seen["rows"].as_array().unwrap();
    assert!(
        rows.iter()
            .any(|r| r["destination"] == target && r["org"] == "acme"),
        "the page lists the approval: {seen}"
    );
    assert!(!seen["text"].as_str().unwrap().contains("<b>"), "{seen}");
    assert_eq!(
        seen["elements"]["b"], 0,
        "an element made from the name: {seen}"
    );
    assert_eq!(seen["elements"]["script"], 0, "{seen}");
    assert!(
        seen["message"].as_str().unwrap().contains("answered."),
        "{seen}"
    );

    let (status, _, mut tunnel) = connect(&lab, target);
    assert_eq!(status, 200, "the retry after the page's answer");
    assert_eq!(get_through(&mut tunnel, "/jit-ui"), 200);
    let granted = lab.wait_evidence("the grant record", |v| {
        v["kind"] == "grant" && v["event"] == "granted"
    });
    assert_eq!(granted["grant"]["approver"], "alice");
    // The 10-minute choice: expires ~600 s after it was granted.
    let at = |k: &str| {
        humantime::parse_rfc3339_weak(granted["grant"][k].as_str().unwrap_or_default())
            .or_else(|_| humantime::parse_rfc3339(granted["grant"][k].as_str().unwrap_or_default()))
            .unwrap_or_else(|e| panic!("{k}: {e}: {granted}"))
    };
    let ttl = at("expires").duration_since(at("granted_at")).unwrap();
    assert!(
        (Duration::from_secs(595)..=Duration::from_secs(605)).contains(&ttl),
        "ttl {ttl:?}: {granted}"
    );
}

/// Grants outlive a restart of the gateway only while unexpired: after a
/// crash and restart, a 10-minute grant still allows its destination
/// (decided under `grant:ID`), and a 2-second grant whose time ran out
/// while the gateway was down is dropped and recorded `expired`.
#[test]
fn a_restart_keeps_an_unexpired_grant_and_drops_an_expired_one() {
    let mut lab = lab_asking();
    let give = |lab: &Lab, port: u16, ttl: &str| {
        let body = format!(r#"{{"org":"acme","target":"other.test","port":{port},"ttl":"{ttl}"}}"#);
        let (code, body) = admin(lab, "POST", "/v1/grants", Some(ALICE), Some(&body));
        assert_eq!(code, 201, "{body}");
        json(&body)["id"].as_str().unwrap().to_string()
    };
    let kept = give(&lab, 80, "10m");
    let short = give(&lab, 8080, "2s");
    // A 201 means on record: the crash comes at once, with no wait, and
    // the record is already in the store.
    lab.kill_proxy_hard();
    let given = lab
        .evidence()
        .into_iter()
        .find(|v| {
            v["kind"] == "grant" && v["event"] == "granted" && v["grant"]["id"] == short.as_str()
        })
        .expect("a grant answered 201 is on record before the answer");
    std::thread::sleep(Duration::from_secs(3));
    lab.restart_proxy();

    let (code, body) = admin(&lab, "GET", "/v1/grants", Some(ALICE), None);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(&kept), "the unexpired grant was lost: {body}");
    assert!(
        !body.contains(&short),
        "the expired grant came back: {body}"
    );
    let ended = lab.wait_evidence("the expired grant recorded", |v| {
        v["kind"] == "grant" && v["event"] == "expired" && v["grant"]["id"] == short.as_str()
    });
    // Recorded by the restarted gateway (its record ids carry a new run prefix).
    let run = |v: &Value| {
        v["id"]
            .as_str()
            .unwrap()
            .rsplit_once('-')
            .unwrap()
            .0
            .to_string()
    };
    assert_ne!(
        run(&ended),
        run(&given),
        "expired before the crash: {ended}"
    );

    let (status, ps, mut tunnel) = connect(&lab, "other.test:80");
    assert_eq!(status, 200, "the kept grant allows after the restart: {ps}");
    assert_eq!(get_through(&mut tunnel, "/jit-restart"), 200);
    let allowed = lab.wait_evidence("the decision under the kept grant", |v| {
        v["event"] == "decision" && v["host"] == "other.test" && v["decision"] == "allow"
    });
    assert_eq!(allowed["rule"], format!("grant:{kept}"));
    let (status, ps, _) = connect(&lab, "other.test:8080");
    assert_eq!(status, 403, "the expired grant allows nothing: {ps}");
    assert!(ps.contains("approval_pending"), "{ps}");
}

/// A grant's use is spent only by a connection it actually allowed: with
/// `max_uses = 1` on a name that resolves only into always-denied
/// addresses, the refused attempt leaves the use unspent (the grant is
/// listed with 0 uses, nothing is recorded `used_up`), and a grant of the
/// same kind on a reachable name is then spent by the one connection it
/// lets through.
#[test]
fn a_denied_attempt_does_not_use_up_a_single_use_grant() {
    let lab = lab_asking();
    let give = |target: &str| {
        let body = format!(r#"{{"org":"acme","target":"{target}","port":80,"max_uses":1}}"#);
        let (code, body) = admin(&lab, "POST", "/v1/grants", Some(ALICE), Some(&body));
        assert_eq!(code, 201, "{body}");
        json(&body)["id"].as_str().unwrap().to_string()
    };
    let gid = give("private.test");
    let (status, ps, _) = connect(&lab, "private.test:80");
    assert_eq!(status, 403, "an always-denied address opened: {ps}");
    let refused = lab.wait_evidence("the refused attempt", |v| {
        v["event"] == "decision" && v["host"] == "private.test"
    });
    assert_eq!(refused["decision"], "deny", "{refused}");
    let (code, body) = admin(&lab, "GET", "/v1/grants", Some(ALICE), None);
    assert_eq!(code, 200, "{body}");
    let listed = json(&body)["grants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == gid.as_str())
        .cloned();
    let listed = listed.unwrap_or_else(|| panic!("the refused attempt used up {gid}: {body}"));
    assert_eq!(listed["uses"], 0, "{listed}");
    // The reachable one: one use, spent by its one connection.
    let other = give("other.test");
    let (first, _, mut c) = connect(&lab, "other.test:80");
    assert_eq!(first, 200);
    assert_eq!(get_through(&mut c, "/jit-spent"), 200);
    lab.wait_evidence("used_up", |v| {
        v["kind"] == "grant" && v["event"] == "used_up" && v["grant"]["id"] == other.as_str()
    });
    let used_up: Vec<Value> = lab
        .evidence()
        .into_iter()
        .filter(|v| v["kind"] == "grant" && v["event"] == "used_up")
        .collect();
    assert_eq!(used_up.len(), 1, "{}", lab::dump(&used_up));
}

/// `palisade draft` proposes a rule from a grant for review, never
/// silently: the grant (id, approver, reason, uses) becomes a commented
/// `[[org.allow]]`, and the connection it allowed is not drafted into an
/// active rule.
#[test]
fn draft_proposes_a_commented_rule_from_a_grant() {
    let lab = lab_asking();
    let body = r#"{"org":"acme","target":"other.test","port":80,"ttl":"10m","reason":"the build needs it"}"#;
    let (code, body) = admin(&lab, "POST", "/v1/grants", Some(ALICE), Some(body));
    assert_eq!(code, 201, "{body}");
    let gid = json(&body)["id"].as_str().unwrap().to_string();
    let (status, _, mut c) = connect(&lab, "other.test:80");
    assert_eq!(status, 200);
    assert_eq!(get_through(&mut c, "/jit-draft"), 200);
    lab.wait_evidence("the granted decision", |v| {
        v["event"] == "decision" && v["rule"] == format!("grant:{gid}")
    });
    let out = lab.proxy_ns_exec(
        lab::palisade_bin(),
        &[
            "draft",
            "--evidence",
            lab.evidence_dir.to_str().unwrap(),
            "--org",
            "acme",
            "-c",
            lab.config_path.to_str().unwrap(),
            "--allow-unsealed",
        ],
    );
    assert!(out.success(), "{}", out.describe());
    let head = format!(
        "# from grant {gid} (approver alice, reason \"the build needs it\", 1 use, granted "
    );
    let at = out
        .stdout
        .find(&head)
        .unwrap_or_else(|| panic!("no proposal from {gid}: {}", out.describe()));
    let proposal: Vec<&str> = out.stdout[at..].lines().take(4).collect();
    assert_eq!(
        &proposal[1..],
        [
            "# [[org.allow]]",
            "# host = \"other.test\"",
            "# ports = [80]"
        ],
        "{}",
        out.describe()
    );
    assert!(
        !out.stdout
            .lines()
            .any(|l| l.starts_with("host = \"other.test\"")),
        "a grant drafted silently into an active rule: {}",
        out.describe()
    );
    assert!(
        out.stderr.contains("1 grant(s) proposed"),
        "{}",
        out.describe()
    );
}

/// A grant may carry a method and a path: it then allows only the
/// requests Palisade sees (plain `http://`) with that method under that
/// path; another method, another path, and a tunnel (which cannot be
/// checked) stay misses. A miss of a request raises an approval carrying
/// its method and path; an answer dropping or changing them is wider than
/// asked and refused; the grant answering it opens exactly that, and its
/// record and listing carry the scope.
#[test]
fn a_method_and_path_grant_allows_matching_requests_only() {
    let lab = lab_asking();
    let grant = |extra: &str| {
        let body =
            format!(r#"{{"org":"acme","target":"other.test","port":80,"ttl":"10m"{extra}}}"#);
        admin(&lab, "POST", "/v1/grants", Some(ALICE), Some(&body))
    };
    for bad in [
        r#","path":"api""#,
        r#","path":"/a/../b""#,
        r#","method":"G T""#,
    ] {
        let (code, body) = grant(bad);
        assert_eq!(code, 400, "{bad}: {body}");
    }
    let (code, body) = grant(r#","method":"GET","path":"/api/""#);
    assert_eq!(code, 201, "{body}");
    let gid = json(&body)["id"].as_str().unwrap().to_string();
    assert_eq!(json(&body)["method"], "GET", "{body}");

    let ok = lab.proxied_curl("http://other.test/api/x", &[]);
    assert_eq!(ok.status, 200, "GET under the granted path: {}", ok.stderr);
    let rec = lab.wait_evidence("the granted request", |v| {
        v["event"] == "decision" && v["rule"] == format!("grant:{gid}")
    });
    assert_eq!(rec["method"], "GET", "{rec}");
    let refused = |url: &str, extra: &[&str], what: &str| {
        let r = lab.proxied_curl(url, extra);
        assert_eq!(r.status, 403, "{what} passed under a GET /api/ grant");
        let ps = r
            .headers
            .iter()
            .find(|(k, _)| k == "proxy-status")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert!(ps.contains("approval_pending"), "{what}: {ps}");
    };
    refused("http://other.test/other", &[], "another path");
    refused(
        "http://other.test/api/x",
        &["--data", "x"],
        "another method",
    );
    let (status, ps, _) = connect(&lab, "other.test:80");
    assert_eq!(status, 403, "a tunnel under a method/path grant: {ps}");
    // acme intercepts nothing, so has no CA: the grant cannot be honoured
    // inside a tunnel, and the refusal says why.
    assert!(ps.contains("no_matching_rule"), "{ps}");
    let why = lab.wait_evidence("the tunnel's refusal", |v| {
        v["kind"] == "tcp" && v["host"] == "other.test" && v["reason"] == "no_matching_rule"
    });
    let detail = why["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(&format!("grant:{gid} allows only requests (GET /api/)"))
            && detail.contains("no interception CA"),
        "{why}"
    );

    // The POST's approval carries its method and path.
    let approval = pending(&lab, ALICE, "other.test:80 POST /api/x").expect("the POST's approval");
    assert_eq!(approval["method"], "POST", "{approval}");
    assert_eq!(approval["path"], "/api/x", "{approval}");
    let path = format!("/v1/approvals/{}", approval["id"].as_str().unwrap());
    for wider in [
        r#"{"decision":"allow","ttl":"1m","path":null}"#,
        r#"{"decision":"allow","ttl":"1m","method":"GET"}"#,
        r#"{"decision":"allow","ttl":"1m","path":"/"}"#,
    ] {
        let (code, body) = admin(&lab, "POST", &path, Some(ALICE), Some(wider));
        assert_eq!(code, 400, "{wider}: {body}");
        assert!(body.contains("nothing wider"), "{body}");
    }
    let (code, body) = admin(
        &lab,
        "POST",
        &path,
        Some(ALICE),
        Some(r#"{"decision":"allow","ttl":"1m"}"#),
    );
    assert_eq!(code, 200, "{body}");
    let answered = json(&body)["grant"].clone();
    assert_eq!(
        (answered["method"].as_str(), answered["path"].as_str()),
        (Some("POST"), Some("/api/x")),
        "{answered}"
    );
    let post = lab.proxied_curl("http://other.test/api/x", &["--data", "x"]);
    assert_eq!(
        post.status, 200,
        "the POST under its grant: {}",
        post.stderr
    );
    let granted = lab.wait_evidence("the POST grant's record", |v| {
        v["kind"] == "grant" && v["event"] == "granted" && v["grant"]["method"] == "POST"
    });
    assert_eq!(granted["grant"]["path"], "/api/x", "{granted}");

    // The CLI lists the scope.
    let token_file = lab::scratch_dir("jit-req").join("alice.token");
    std::fs::write(&token_file, ALICE).unwrap();
    let out = lab.proxy_ns_exec(
        lab::palisade_bin(),
        &[
            "grants",
            "--admin",
            lab::ADMIN_ADDR,
            "--token-file",
            token_file.to_str().unwrap(),
        ],
    );
    assert!(
        out.success() && out.stdout.contains("other.test:80 GET /api/"),
        "{}",
        out.describe()
    );
}

/// A DNS miss of an `ask` org: the denial's EDE text names the approval
/// and the name; the approval (the name on any port) is listed; answered
/// allow, the name resolves.
#[test]
fn a_dns_miss_asks_and_its_grant_lets_the_name_resolve() {
    let shim = format!("{}:53", lab::SHIM_IP);
    let lab = lab_asking_with(|b| b.dns_listen(&[shim.as_str()]));
    let d = lab.dig(&["other.test", "A"]);
    let ede = d.ede.clone().unwrap_or_default();
    assert!(
        ede.contains("approval_pending")
            && ede.contains("approval a-")
            && ede.contains("other.test"),
        "EDE names the approval and the name: {}",
        d.output
    );
    assert!(d.of("A").is_empty(), "a pending name resolved");
    let approval = pending(&lab, ALICE, "other.test (any port, asked by DNS)")
        .expect("the DNS miss's approval");
    let id = approval["id"].as_str().unwrap();
    assert!(ede.contains(id), "{ede:?} names {id}");
    let (code, body) = admin(
        &lab,
        "POST",
        &format!("/v1/approvals/{id}"),
        Some(ALICE),
        Some(r#"{"decision":"allow","ttl":"1m"}"#),
    );
    assert_eq!(code, 200, "{body}");
    assert!(json(&body)["grant"]["port"].is_null(), "{body}");
    let d = lab.dig(&["other.test", "A"]);
    assert!(
        !d.of("A").is_empty(),
        "the granted name does not resolve: {d:?}"
    );
}
