//! The shim's answer cache seen from outside: one org's cached answer is
//! never another org's (each gets its own filtering, TTLs as first seen,
//! counted down only while its own answer is kept, and its own record), every query is still recorded, and a reload that denies
//! a cached name refuses it at once.

use std::time::Duration;

use serde_json::Value;

use crate::lab::{self, Dig, Lab, CLIENT2_IP, CLIENT_IP, SHIM_IP};

const SECS5: Duration = Duration::from_secs(5);

/// beta first, acme last: a line appended to the file lands in acme.
const POLICY: &str = r#"
[[org]]
name = "beta"
clients = ["198.18.4.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "private.test"
[[org.allow]]
cidr = "169.254.169.254/32"
ports = [80]

[[org]]
name = "acme"
clients = ["198.18.1.0/24"]
[[org.allow]]
host = "allowed.test"
[[org.allow]]
host = "private.test"
"#;

fn dig2(lab: &Lab, args: &[&str]) -> Dig {
    let server = format!("@{SHIM_IP}");
    let mut full = vec![server.as_str()];
    full.extend_from_slice(args);
    lab.dig_in(&lab.ns_client2.clone(), &full)
}

/// TTLs of the answer section, in order.
fn ttls(d: &Dig) -> Vec<u32> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in d.output.lines() {
        if line.starts_with(";; ANSWER SECTION:") {
            inside = true;
            continue;
        }
        if inside {
            if line.trim().is_empty() || line.starts_with(';') {
                break;
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            out.push(f[1].parse().unwrap_or(u32::MAX));
        }
    }
    out
}

/// Decision records of `host` so far, in order.
fn records(lab: &Lab, host: &str) -> Vec<Value> {
    lab.evidence()
        .into_iter()
        .filter(|v| v["kind"] == "dns" && v["event"] == "decision" && v["host"] == host)
        .collect()
}

fn served_hash(lab: &Lab) -> String {
    let out = lab.proxy_ns_exec(
        "curl",
        &["-sS", &format!("http://{}/policy", lab::ADMIN_ADDR)],
    );
    let v: Value =
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.describe()));
    v["hash"].as_str().unwrap_or_default().to_string()
}

#[test]
fn dns_cache_is_per_org_recorded_per_query_and_dropped_by_a_reload() {
    let lab = Lab::builder()
        .policy(POLICY)
        .dns_listen(&["198.18.1.1:53"])
        .second_client()
        .start();

    // acme: the metadata address is stripped, nothing left (NODATA + EDE);
    // asked again, from its cache, the same.
    for _ in 0..2 {
        let d = lab.dig(&["private.test", "A"]);
        assert_eq!(d.status, "NOERROR", "{}", d.output);
        assert!(d.answers.is_empty(), "acme: {}", d.output);
        assert!(
            d.ede.as_deref().unwrap_or("").contains("denied_address"),
            "{}",
            d.output
        );
    }
    // beta's cidr rule lets that address through: its answer is its own,
    // not acme's kept one.
    for _ in 0..2 {
        let d = dig2(&lab, &["private.test", "A"]);
        assert_eq!(d.of("A"), ["169.254.169.254"], "beta: {}", d.output);
    }
    let d = lab.dig(&["private.test", "A"]);
    assert!(d.answers.is_empty(), "acme again: {}", d.output);

    // allowed.test: acme twice, then beta later: beta's TTL is the first
    // sighting's, not counted down.
    let first = lab.dig(&["allowed.test", "A"]);
    let asked = std::time::Instant::now();
    assert_eq!(first.of("A"), [lab::ALLOWED_IP], "{}", first.output);
    // Kept for acme: counted down by the (whole) seconds since, at most.
    let again = lab.dig(&["allowed.test", "A"]);
    let spent = asked.elapsed().as_secs() as u32 + 1;
    let (a, f) = (ttls(&again), ttls(&first));
    assert_eq!(a.len(), f.len(), "{}", again.output);
    for (a, f) in a.iter().zip(&f) {
        assert!(a <= f && a + spent >= *f, "{a} / {f}: {}", again.output);
    }
    std::thread::sleep(Duration::from_millis(2100));
    let beta = dig2(&lab, &["allowed.test", "A"]);
    assert_eq!(beta.of("A"), [lab::ALLOWED_IP], "{}", beta.output);
    assert_eq!(ttls(&beta), ttls(&first), "beta: {}", beta.output);

    // Every query has its own record, with its own org and client.
    lab::wait_until("5 private.test records", SECS5, || {
        records(&lab, "private.test").len() == 5
    });
    lab::wait_until("3 allowed.test records", SECS5, || {
        records(&lab, "allowed.test").len() == 3
    });
    let private = records(&lab, "private.test");
    let orgs: Vec<&str> = private
        .iter()
        .map(|r| r["org"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(orgs, ["acme", "acme", "beta", "beta", "acme"]);
    for r in &private {
        let (reason, client) = if r["org"] == "acme" {
            ("denied_address", CLIENT_IP)
        } else {
            ("rule_match", CLIENT2_IP)
        };
        assert_eq!(r["reason"], reason, "{r}");
        assert_eq!(r["upstream"], true, "{r}");
        crate::assert_client_ip(r, client);
    }
    let allowed = records(&lab, "allowed.test");
    assert_eq!(allowed[0]["org"], "acme");
    // The cached answer's record is the full path's, but for what is per record.
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(m) = v.as_object_mut() {
            for k in ["id", "ts", "ref", "seq", "prev", "hash", "client"] {
                m.remove(k);
            }
        }
        v
    };
    assert_eq!(strip(&allowed[1]), strip(&allowed[0]));
    assert_ne!(allowed[1]["id"], allowed[0]["id"]);
    assert_eq!(allowed[2]["org"], "beta", "{}", allowed[2]);
    // The upstream was asked once per org at most (the resolver's cache).
    let upstream = lab
        .dns_log()
        .iter()
        .filter(|v| v["name"] == "allowed.test")
        .count();
    assert!(upstream <= 2, "{upstream} upstream queries");

    // A reload that denies the cached name: refused at once.
    let before = served_hash(&lab);
    let text = std::fs::read_to_string(&lab.config_path).unwrap();
    let tmp = lab.config_path.with_extension("new");
    std::fs::write(
        &tmp,
        format!("{text}\n[[org.deny]]\nid = \"no-allowed\"\nhost = \"allowed.test\"\n"),
    )
    .unwrap();
    std::fs::rename(&tmp, &lab.config_path).unwrap();
    lab.signal_proxy("-HUP");
    lab::wait_until("new policy served", SECS5, || served_hash(&lab) != before);
    let d = lab.dig(&["allowed.test", "A"]);
    assert_eq!(d.status, "REFUSED", "{}", d.output);
    assert!(d.answers.is_empty(), "{}", d.output);
    let id = d.record_id().expect("record reference in the EDE");
    let rec = lab.wait_evidence("the refusal", |v| {
        crate::record_ref(v).as_deref() == Some(id.as_str())
    });
    assert_eq!(rec["reason"], "explicit_deny", "{rec}");
    assert_eq!(rec["rule"], "no-allowed", "{rec}");
    assert_ne!(rec["policy"], allowed[0]["policy"], "{rec}");
    // beta keeps its name.
    let d = dig2(&lab, &["allowed.test", "A"]);
    assert_eq!(d.of("A"), [lab::ALLOWED_IP], "{}", d.output);
}
