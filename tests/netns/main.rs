//! Network integration tests for Palisade.
//!
//! Every test builds its own set of network namespaces (see `lab.rs`), runs
//! Palisade in the middle one and drives it from the client namespace with
//! curl, openssl s_client and a raw HTTP client.  Each test checks both the
//! client's outcome and the upstream/evidence side.  Requires root; run via
//! `.ci/run` or `cargo test --test netns` as root.

mod abuse;
mod addresses;
mod admin;
mod adopt;
mod baseline;
mod bounds;
mod bypass;
mod cli;
mod conn_budgets;
mod connect_head;
mod decider;
mod dns;
mod dns_budget;
mod dns_burst;
mod dns_cache;
mod dns_flood;
mod dns_wire;
mod enforcement;
mod evidence;
mod fleet;
mod full_store;
mod guide;
mod infra;
mod intercept;
mod jit;
mod jit_intercept;
mod keep_alive;
mod lab;
mod lifecycle;
mod metrics;
mod names;
mod nodelay;
mod noisy;
mod org_export;
mod otel;
mod own_addresses;
mod policy;
mod pool;
mod probe;
mod probe_volume;
mod relay;
mod reload;
mod report;
mod retention;
mod revoke;
mod revoke_streams;
mod rotation;
mod service;
mod socks5;
mod splice;
mod startup;
mod synthetic;
mod timed;
mod tls;
mod transparent;
mod transparent_v6;
mod tunnel;
mod volume;
mod websocket;
mod witness;

use lab::{HttpResp, Lab};
use serde_json::Value;

/// Evidence record id as a string (accepts string or numeric ids).
pub fn record_id(v: &Value) -> Option<String> {
    match &v["id"] {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The reference a client is shown for a record (its `ref` field).
pub fn record_ref(v: &Value) -> Option<String> {
    v["ref"]
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A refused request: status, reason code and evidence id in the body, a
/// Proxy-Status header, and a matching `deny` decision record (returned).
pub fn assert_refused(lab: &Lab, resp: &HttpResp, status: u16, reason: &str, ctx: &str) -> Value {
    assert_eq!(
        resp.status,
        status,
        "{ctx}: expected HTTP {status} ({reason}), got {resp:#?}\n{}",
        lab.proxy_output()
    );
    assert!(
        resp.body.contains(reason),
        "{ctx}: body does not name reason {reason:?}: {:?}",
        resp.body
    );
    let ps = resp
        .header("proxy-status")
        .unwrap_or_else(|| panic!("{ctx}: no Proxy-Status header in {:?}", resp.headers));
    assert!(!ps.trim().is_empty(), "{ctx}: empty Proxy-Status header");
    let body = resp.body.clone();
    let rec = lab.wait_evidence(&format!("{ctx}: deny/{reason} with id in body"), |v| {
        v["decision"] == "deny"
            && v["reason"] == reason
            // Delimited: record "X-1" must not match a body naming "X-10".
            && record_ref(v).is_some_and(|r| body.contains(&format!("record {r})")))
    });
    // The client sees the opaque reference, never the counting id.
    let id = record_id(&rec).unwrap_or_default();
    assert!(
        !body.contains(&id) && !ps.contains(&id),
        "{ctx}: the record id {id} is shown to the client: {body:?} {ps:?}"
    );
    assert_eq!(rec["event"], "decision", "{ctx}: {rec}");
    assert_eq!(rec["mode"], "explicit", "{ctx}: {rec}");
    assert!(
        rec["ts"].is_string() || rec["ts"].is_number(),
        "{ctx}: ts missing: {rec}"
    );
    rec
}

/// The `client` field of a record is "ip:port" from the given address.
pub fn assert_client_ip(rec: &Value, ip: &str) {
    let client = rec["client"].as_str().unwrap_or_default();
    let (host, port) = client
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("client is not ip:port: {rec}"));
    assert_eq!(host, ip, "client address in {rec}");
    assert!(
        port.parse::<u16>().is_ok_and(|p| p != 0),
        "client port in {rec}"
    );
}

/// Does `text` contain "<path>:<line>:<col>:"?  Returns the line number.
pub fn find_path_line_col(text: &str, path: &str) -> Option<u32> {
    let mut rest = text;
    while let Some(i) = rest.find(path) {
        let after = &rest[i + path.len()..];
        if let Some(tail) = after.strip_prefix(':') {
            let line: String = tail.chars().take_while(|c| c.is_ascii_digit()).collect();
            let tail2 = &tail[line.len()..];
            if !line.is_empty() {
                if let Some(tail3) = tail2.strip_prefix(':') {
                    let col: String = tail3.chars().take_while(|c| c.is_ascii_digit()).collect();
                    if !col.is_empty() && tail3[col.len()..].starts_with(':') {
                        return line.parse().ok();
                    }
                }
            }
        }
        rest = &rest[i + path.len()..];
    }
    None
}

#[test]
fn helper_find_path_line_col() {
    assert_eq!(
        find_path_line_col("error: /a/b.toml:3:7: unknown", "/a/b.toml"),
        Some(3)
    );
    assert_eq!(
        find_path_line_col("/a/b.toml: 3:7: unknown", "/a/b.toml"),
        None
    );
    assert_eq!(find_path_line_col("/a/b.toml:3: x", "/a/b.toml"), None);
    assert_eq!(
        find_path_line_col("/x /a/b.toml:12:1: y", "/a/b.toml"),
        Some(12)
    );
}
