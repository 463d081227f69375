//! `palisade evidence query` and `palisade evidence export --format ocsf`:
//! read decision and close records, filter them, print them as JSON Lines,
//! a table, or OCSF 1.x events.
//!
//! Neither checks the chain: run `palisade evidence verify` first.

use std::io::{self, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::segment::{self, split_lines};

/// Filters of `palisade evidence query`; `None` matches everything.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub org: Option<String>,
    pub decision: Option<String>,
    pub reason: Option<String>,
    pub since: Option<SystemTime>,
    pub until: Option<SystemTime>,
    /// Exact name, or `*.example.com` for names strictly below it.
    pub host: Option<String>,
}

fn ts_of(m: &Map<String, Value>) -> Option<SystemTime> {
    humantime::parse_rfc3339(m.get("ts")?.as_str()?).ok()
}

impl Filter {
    pub fn matches(&self, m: &Map<String, Value>) -> bool {
        let s = |k: &str| m.get(k).and_then(Value::as_str);
        if !matches!(s("event"), Some("decision" | "close")) {
            return false;
        }
        if let Some(o) = &self.org {
            if s("org").unwrap_or("unknown") != o {
                return false;
            }
        }
        if self
            .decision
            .as_deref()
            .is_some_and(|d| s("decision") != Some(d))
            || self
                .reason
                .as_deref()
                .is_some_and(|r| s("reason") != Some(r))
        {
            return false;
        }
        if let Some(h) = &self.host {
            let host = s("host").unwrap_or_default();
            let ok = match h.strip_prefix("*.") {
                Some(suffix) => host
                    .strip_suffix(suffix)
                    .is_some_and(|rest| rest.ends_with('.') && rest.len() > 1),
                None => host.eq_ignore_ascii_case(h),
            };
            if !ok {
                return false;
            }
        }
        if self.since.is_some() || self.until.is_some() {
            let Some(t) = ts_of(m) else { return false };
            if self.since.is_some_and(|s| t < s) || self.until.is_some_and(|u| t > u) {
                return false;
            }
        }
        true
    }
}

/// Call `f` for every record (complete line that parses) under `path`, in
/// chain order.
pub fn for_each_record(
    path: &Path,
    mut f: impl FnMut(&Map<String, Value>) -> io::Result<()>,
) -> io::Result<()> {
    let list = if std::fs::metadata(path)?.is_file() {
        vec![path.to_path_buf()]
    } else {
        segment::list(path)?
    };
    for file in list {
        let data = std::fs::read(&file)?;
        let (lines, _torn) = split_lines(&data);
        for line in lines {
            if let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(line) {
                f(&m)?;
            }
        }
    }
    Ok(())
}

const TABLE_COLUMNS: [&str; 10] = [
    "ts", "event", "kind", "org", "client", "host", "port", "decision", "reason", "rule",
];

/// One table row: the columns above, tab-separated.
pub fn table_row(m: &Map<String, Value>) -> String {
    TABLE_COLUMNS
        .iter()
        .map(|k| match m.get(*k) {
            None | Some(Value::Null) => "-".to_string(),
            Some(Value::String(s)) => s.replace(['\t', '\n'], " "),
            Some(v) => v.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\t")
}

pub fn table_header() -> String {
    TABLE_COLUMNS.join("\t")
}

/// Print the matching records; returns how many matched.
pub fn query(path: &Path, filter: &Filter, table: bool, out: &mut impl Write) -> io::Result<u64> {
    let mut n = 0;
    if table {
        writeln!(out, "{}", table_header())?;
    }
    for_each_record(path, |m| {
        if filter.matches(m) {
            n += 1;
            if table {
                writeln!(out, "{}", table_row(m))?;
            } else {
                serde_json::to_writer(&mut *out, m)?;
                out.write_all(b"\n")?;
            }
        }
        Ok(())
    })?;
    Ok(n)
}

/// The OCSF version the export targets.
pub const OCSF_VERSION: &str = "1.3.0";

fn endpoint_of_addr(addr: &str) -> Value {
    // "ip:port" or "[v6]:port"
    match addr.parse::<std::net::SocketAddr>() {
        Ok(sa) => json!({"ip": sa.ip().to_string(), "port": sa.port()}),
        Err(_) => json!({"ip": addr}),
    }
}

fn http_method_activity(method: Option<&str>) -> u64 {
    match method.map(|m| m.to_ascii_uppercase()).as_deref() {
        Some("CONNECT") => 1,
        Some("DELETE") => 2,
        Some("GET") => 3,
        Some("HEAD") => 4,
        Some("OPTIONS") => 5,
        Some("POST") => 6,
        Some("PUT") => 7,
        Some("TRACE") => 8,
        Some("PATCH") => 9,
        _ => 99,
    }
}

/// Map one decision or close record to an OCSF event; `None` for chain
/// bookkeeping records (headers, checkpoints).
pub fn to_ocsf(m: &Map<String, Value>) -> Option<Value> {
    let s = |k: &str| m.get(k).and_then(Value::as_str);
    let event = s("event")?;
    if !matches!(event, "decision" | "close") {
        return None;
    }
    let allowed = s("decision") == Some("allow");
    let is_close = event == "close";
    let kind = s("kind").unwrap_or("tcp");
    let (class_uid, class_name, activity_id, activity_name) = match kind {
        "http" => {
            let a = http_method_activity(s("method"));
            (
                4002,
                "HTTP Activity",
                a,
                s("method").unwrap_or("Other").to_string(),
            )
        }
        "dns" => (4003, "DNS Activity", 6, "Traffic".to_string()),
        _ if is_close => (4001, "Network Activity", 2, "Close".to_string()),
        _ if allowed => (4001, "Network Activity", 1, "Open".to_string()),
        _ => (4001, "Network Activity", 5, "Refuse".to_string()),
    };
    let time_ms = ts_of(m)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    let mut e = Map::new();
    e.insert("category_uid".into(), 4.into());
    e.insert("category_name".into(), "Network Activity".into());
    e.insert("class_uid".into(), class_uid.into());
    e.insert("class_name".into(), class_name.into());
    e.insert("activity_id".into(), activity_id.into());
    e.insert("activity_name".into(), activity_name.into());
    e.insert("type_uid".into(), (class_uid * 100 + activity_id).into());
    e.insert("severity_id".into(), (if allowed { 1 } else { 2 }).into());
    e.insert(
        "severity".into(),
        (if allowed { "Informational" } else { "Low" }).into(),
    );
    e.insert("time".into(), time_ms.into());
    e.insert("status_id".into(), (if allowed { 1 } else { 2 }).into());
    e.insert(
        "status".into(),
        (if allowed { "Success" } else { "Failure" }).into(),
    );
    if let Some(r) = s("reason") {
        e.insert("status_code".into(), r.into());
    }
    if let Some(d) = s("detail") {
        e.insert("status_detail".into(), d.into());
    }
    e.insert(
        "metadata".into(),
        json!({
            "version": OCSF_VERSION,
            "uid": s("id"),
            "original_time": s("ts"),
            "profiles": ["security_control"],
            "product": {"name": "Palisade", "vendor_name": "Palisade", "version": env!("CARGO_PKG_VERSION")},
            "tenant_uid": s("org"),
            "correlation_uid": s("conn").or(s("id")),
        }),
    );
    // security_control profile: the proxy's verdict.
    e.insert("action_id".into(), (if allowed { 1 } else { 2 }).into());
    e.insert(
        "action".into(),
        (if allowed { "Allowed" } else { "Denied" }).into(),
    );
    e.insert(
        "disposition_id".into(),
        (if allowed { 1 } else { 2 }).into(),
    );
    e.insert(
        "disposition".into(),
        (if allowed { "Allowed" } else { "Blocked" }).into(),
    );
    e.insert(
        "policy".into(),
        json!({"uid": s("policy"), "name": "palisade policy", "desc": s("reason")}),
    );
    if let Some(rule) = s("rule") {
        e.insert("firewall_rule".into(), json!({"uid": rule, "name": rule}));
    }
    if let Some(c) = s("client") {
        e.insert("src_endpoint".into(), endpoint_of_addr(c));
    }
    let mut dst = Map::new();
    if let Some(h) = s("host") {
        dst.insert("hostname".into(), h.into());
    }
    if let Some(ip) = s("ip") {
        dst.insert("ip".into(), ip.into());
    }
    if let Some(p) = m.get("port").and_then(Value::as_u64) {
        dst.insert("port".into(), p.into());
    }
    if !dst.is_empty() {
        e.insert("dst_endpoint".into(), Value::Object(dst));
    }
    e.insert(
        "connection_info".into(),
        json!({"protocol_name": if kind == "dns" { "udp" } else { "tcp" }, "direction_id": 2, "direction": "Outbound", "uid": s("conn").or(s("id"))}),
    );
    if is_close {
        e.insert(
            "traffic".into(),
            json!({"bytes_out": m.get("bytes_up"), "bytes_in": m.get("bytes_down")}),
        );
        if let Some(d) = m.get("duration_ms") {
            e.insert("duration".into(), d.clone());
        }
    }
    match kind {
        "http" => {
            let url = json!({
                "hostname": s("host"),
                "port": m.get("port"),
                "path": s("path"),
                "scheme": "http",
            });
            e.insert(
                "http_request".into(),
                json!({"http_method": s("method"), "url": url}),
            );
        }
        "dns" => {
            e.insert(
                "query".into(),
                json!({"hostname": s("host"), "type": s("qtype"), "class": "IN"}),
            );
            if let Some(Value::Array(a)) = m.get("answers") {
                let answers: Vec<Value> = a
                    .iter()
                    .filter_map(Value::as_str)
                    .map(|r| json!({"rdata": r, "type": s("qtype"), "class": "IN"}))
                    .collect();
                e.insert("answers".into(), Value::Array(answers));
            }
            let (rcode_id, rcode) = if allowed {
                (0, "NoError")
            } else {
                (5, "Refused")
            };
            e.insert("rcode_id".into(), rcode_id.into());
            e.insert("rcode".into(), rcode.into());
        }
        _ => {
            if let Some(sni) = s("sni") {
                e.insert("tls".into(), json!({"sni": sni}));
            }
        }
    }
    let mut unmapped = Map::new();
    for k in ["mode", "seq", "hash", "event"] {
        if let Some(v) = m.get(k) {
            unmapped.insert(k.into(), v.clone());
        }
    }
    e.insert("unmapped".into(), Value::Object(unmapped));
    Some(Value::Object(e))
}

/// Print every decision and close record under `path` as OCSF JSON Lines.
pub fn export_ocsf(path: &Path, filter: &Filter, out: &mut impl Write) -> io::Result<u64> {
    let mut n = 0;
    for_each_record(path, |m| {
        if filter.matches(m) {
            if let Some(e) = to_ocsf(m) {
                n += 1;
                serde_json::to_writer(&mut *out, &e)?;
                out.write_all(b"\n")?;
            }
        }
        Ok(())
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Required attributes, written down from the OCSF 1.3 schema: the
    /// base event's required set (plus metadata's own required `product` and
    /// `version`), the class's `at_least_one` constraint, and the
    /// security_control profile the events claim (`action_id`,
    /// `disposition_id`).
    const BASE_REQUIRED: [&str; 7] = [
        "activity_id",
        "category_uid",
        "class_uid",
        "metadata",
        "severity_id",
        "time",
        "type_uid",
    ];
    const METADATA_REQUIRED: [&str; 2] = ["product", "version"];
    const SECURITY_CONTROL: [&str; 2] = ["action_id", "disposition_id"];

    fn check(e: &Value, class: u64, at_least_one: &[&str], also: &[&str]) {
        let o = e.as_object().unwrap();
        for k in BASE_REQUIRED.iter().chain(&SECURITY_CONTROL).chain(also) {
            assert!(o.get(*k).is_some_and(|v| !v.is_null()), "{k} missing: {e}");
        }
        for k in METADATA_REQUIRED {
            assert!(!e["metadata"][k].is_null(), "metadata.{k} missing: {e}");
        }
        assert!(
            at_least_one.iter().any(|k| o.contains_key(*k)),
            "none of {at_least_one:?}: {e}"
        );
        assert_eq!(e["class_uid"], class);
        assert_eq!(e["category_uid"], 4);
        assert_eq!(
            e["type_uid"].as_u64().unwrap(),
            class * 100 + e["activity_id"].as_u64().unwrap()
        );
        assert!(e["time"].as_u64().unwrap() > 1_600_000_000_000);
        assert!(e["metadata"]["profiles"]
            .as_array()
            .unwrap()
            .contains(&"security_control".into()));
    }

    fn rec(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn base(kind: &str, decision: &str) -> Value {
        json!({"id": "x-1", "ts": "2026-01-02T03:04:05.123456Z", "kind": kind, "event": "decision",
               "org": "acme", "client": "198.18.1.2:40000", "mode": "explicit", "host": "a.test",
               "port": 443, "sni": null, "ip": "198.18.2.10", "decision": decision,
               "reason": if decision == "allow" { "rule_match" } else { "no_matching_rule" },
               "rule": "acme/allow/0", "policy": "p0", "seq": 3, "prev": "0", "hash": "h"})
    }

    #[test]
    fn tcp_maps_to_network_activity() {
        let e = to_ocsf(&rec(base("tcp", "allow"))).unwrap();
        check(&e, 4001, &["src_endpoint", "dst_endpoint"], &[]);
        assert_eq!(e["activity_id"], 1);
        assert_eq!(e["disposition_id"], 1);
        assert_eq!(e["src_endpoint"]["ip"], "198.18.1.2");
        assert_eq!(e["src_endpoint"]["port"], 40000);
        assert_eq!(e["dst_endpoint"]["hostname"], "a.test");
        assert_eq!(e["dst_endpoint"]["ip"], "198.18.2.10");
        assert_eq!(e["policy"]["uid"], "p0");
        assert_eq!(e["firewall_rule"]["uid"], "acme/allow/0");
        assert_eq!(e["time"], 1767323045123u64);

        let d = to_ocsf(&rec(base("tcp", "deny"))).unwrap();
        check(&d, 4001, &["src_endpoint", "dst_endpoint"], &[]);
        assert_eq!(d["activity_id"], 5);
        assert_eq!(d["disposition_id"], 2);
        assert_eq!(d["action_id"], 2);
        assert_eq!(d["status_code"], "no_matching_rule");

        let mut c = base("tcp", "allow");
        c["event"] = "close".into();
        c["conn"] = "x-0".into();
        c["bytes_up"] = 10.into();
        c["bytes_down"] = 20.into();
        let c = to_ocsf(&rec(c)).unwrap();
        check(&c, 4001, &["src_endpoint", "dst_endpoint"], &["traffic"]);
        assert_eq!(c["activity_id"], 2);
        assert_eq!(c["traffic"]["bytes_in"], 20);
    }

    #[test]
    fn http_maps_to_http_activity() {
        let mut r = base("http", "allow");
        r["method"] = "POST".into();
        r["path"] = "/x".into();
        let e = to_ocsf(&rec(r)).unwrap();
        check(
            &e,
            4002,
            &["http_request", "http_response"],
            &["http_request"],
        );
        assert_eq!(e["activity_id"], 6);
        assert_eq!(e["http_request"]["http_method"], "POST");
        assert_eq!(e["http_request"]["url"]["path"], "/x");
    }

    #[test]
    fn dns_maps_to_dns_activity() {
        let mut r = base("dns", "allow");
        r["mode"] = "dns".into();
        r["qtype"] = "A".into();
        r["answers"] = json!(["198.18.2.10"]);
        let e = to_ocsf(&rec(r)).unwrap();
        check(&e, 4003, &["src_endpoint", "dst_endpoint"], &["query"]);
        assert_eq!(e["query"]["hostname"], "a.test");
        assert_eq!(e["answers"][0]["rdata"], "198.18.2.10");
        let d = to_ocsf(&rec(base("dns", "deny"))).unwrap();
        assert_eq!(d["rcode"], "Refused");
        assert_eq!(d["disposition_id"], 2);
    }

    #[test]
    fn chain_records_are_not_exported_and_filters_apply() {
        let h = rec(json!({"event": "checkpoint", "ts": "2026-01-02T03:04:05Z"}));
        assert!(to_ocsf(&h).is_none());
        let r = rec(base("tcp", "deny"));
        let f = |f: Filter| f.matches(&r);
        assert!(f(Filter::default()));
        assert!(f(Filter {
            host: Some("*.test".into()),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            host: Some("*.a.test".into()),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            decision: Some("allow".into()),
            ..Filter::default()
        }));
        assert!(f(Filter {
            org: Some("acme".into()),
            reason: Some("no_matching_rule".into()),
            since: humantime::parse_rfc3339("2026-01-02T03:04:05Z").ok(),
            until: humantime::parse_rfc3339("2026-01-02T03:04:06Z").ok(),
            ..Filter::default()
        }));
        assert!(!f(Filter {
            since: humantime::parse_rfc3339("2026-01-02T03:04:06Z").ok(),
            ..Filter::default()
        }));
        assert!(!Filter::default().matches(&h));
    }
}
