//! `palisade evidence query` and `palisade evidence export --format ocsf`:
//! read decision and close records, filter them, print them as JSON Lines,
//! a table, or OCSF 1.x events.
//!
//! Records are read typed ([`read_records`]: a [`Record`] and its chain
//! link, [`Stored`]); chain bookkeeping lines (headers, checkpoints, the
//! seal) are skipped. On one chain neither command checks it: run
//! `palisade evidence verify` first (it reads lines as raw JSON, since it
//! hashes them). On a fleet ([`super::fleet`]) the CLI verifies every chain
//! first and [`print`](fn@print)s the records merged by time, each with its replica.

use std::borrow::Cow;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::segment;
use super::select::Selection;
use super::{Event, Kind, Record};

/// A decision or close record as a segment holds it: the record, and the
/// chain fields the writer added (absent from a file that is not a chain).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Stored {
    #[serde(flatten)]
    pub record: Record,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
}

/// Evidence that could not be read as records.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// A decision or close line that is not a record this version knows.
    #[error("{}:{line}: not a decision or close record: {source}", path.display())]
    Record {
        path: PathBuf,
        line: u64,
        source: serde_json::Error,
    },
}

impl From<ReadError> for io::Error {
    fn from(e: ReadError) -> io::Error {
        match e {
            ReadError::Io { source, .. } => source,
            e @ ReadError::Record { .. } => io::Error::new(io::ErrorKind::InvalidData, e),
        }
    }
}

/// The one field that tells a record from chain bookkeeping.
#[derive(Deserialize)]
struct EventOnly<'a> {
    #[serde(borrow)]
    event: Option<Cow<'a, str>>,
}

/// The segment files under `path` (or `path` itself, a single file), in
/// chain order.
fn files(path: &Path) -> io::Result<Vec<PathBuf>> {
    if std::fs::metadata(path)?.is_file() {
        Ok(vec![path.to_path_buf()])
    } else {
        segment::list(path)
    }
}

/// The complete lines of a list of files, one file in memory at a time; a
/// torn last line is left out.
struct Lines {
    files: std::vec::IntoIter<PathBuf>,
    file: PathBuf,
    data: Vec<u8>,
    /// Where the next line starts in `data`.
    pos: usize,
    /// Number of the line at `pos`, from 1.
    line: u64,
}

/// One complete line, where it is.
struct Line<'a> {
    file: &'a Path,
    number: u64,
    bytes: &'a [u8],
}

impl Lines {
    fn next_line(&mut self) -> Option<Result<Line<'_>, ReadError>> {
        loop {
            if let Some(len) = self.data[self.pos..].iter().position(|b| *b == b'\n') {
                let start = self.pos;
                self.pos += len + 1;
                self.line += 1;
                return Some(Ok(Line {
                    file: &self.file,
                    number: self.line - 1,
                    bytes: &self.data[start..start + len],
                }));
            }
            self.file = self.files.next()?;
            (self.pos, self.line) = (0, 1);
            self.data = match std::fs::read(&self.file) {
                Ok(data) => data,
                Err(source) => {
                    self.data.clear();
                    return Some(Err(ReadError::Io {
                        path: self.file.clone(),
                        source,
                    }));
                }
            };
        }
    }
}

/// `f` over every complete line under `path` (file, line number, bytes), in
/// chain order, yielding what it returns.
fn map_lines<T>(
    path: &Path,
    f: impl FnMut(&Path, u64, &[u8]) -> Option<Result<T, ReadError>>,
) -> impl Iterator<Item = Result<T, ReadError>> {
    let list = files(path).map_err(|source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    });
    map_lines_of(list, f)
}

/// `f` over every complete line of the files `list` (or the error of
/// listing them), as [`map_lines`].
fn map_lines_of<T>(
    list: Result<Vec<PathBuf>, ReadError>,
    mut f: impl FnMut(&Path, u64, &[u8]) -> Option<Result<T, ReadError>>,
) -> impl Iterator<Item = Result<T, ReadError>> {
    let mut failed = None;
    let list = list.unwrap_or_else(|e| {
        failed = Some(Err(e));
        Vec::new()
    });
    let mut lines = Lines {
        files: list.into_iter(),
        file: PathBuf::new(),
        data: Vec::new(),
        pos: 0,
        line: 1,
    };
    let each = std::iter::from_fn(move || loop {
        match lines.next_line()? {
            Ok(line) => {
                if let Some(x) = f(line.file, line.number, line.bytes) {
                    return Some(x);
                }
            }
            Err(e) => return Some(Err(e)),
        }
    });
    failed.into_iter().chain(each)
}

/// Every decision and close record under `path` (a directory of segments, or
/// one file), in chain order. Lines that are not JSON objects, and chain
/// bookkeeping, are skipped; a decision or close line that does not read
/// as a [`Record`] is an error (a record from another version, or an edit).
pub(crate) fn read_records(path: &Path) -> impl Iterator<Item = Result<Stored, ReadError>> {
    read_events(path, &[Event::Decision, Event::Close])
}

/// The records under `path` whose `event` is one of `events` (e.g. the
/// enforcement check's `failed` and `verified`), in chain order, read as
/// [`read_records`] reads decisions.
pub(crate) fn read_events(
    path: &Path,
    events: &'static [Event],
) -> impl Iterator<Item = Result<Stored, ReadError>> {
    map_lines(path, move |file, line, bytes| {
        event_of(events, file, line, bytes)
    })
}

/// The records of the segments under `dir` that may hold records written
/// at or after `since` ([`segment::since`]: the rest are not read at all),
/// whose `event` is one of `events`, as [`read_events`] reads them. What
/// a restart reads: a bounded window, not the whole store.
pub(crate) fn read_events_since(
    dir: &Path,
    since: std::time::SystemTime,
    events: &'static [Event],
) -> impl Iterator<Item = Result<Stored, ReadError>> {
    let list = segment::list(dir)
        .map(|list| segment::since(list, since))
        .map_err(|source| ReadError::Io {
            path: dir.to_path_buf(),
            source,
        });
    map_lines_of(list, move |file, line, bytes| {
        event_of(events, file, line, bytes)
    })
}

/// The line `bytes` read as a record if its `event` is one of `events`.
fn event_of(
    events: &[Event],
    file: &Path,
    line: u64,
    bytes: &[u8],
) -> Option<Result<Stored, ReadError>> {
    let event = serde_json::from_slice::<EventOnly<'_>>(bytes).ok()?.event?;
    if !events.iter().any(|e| e.as_str() == event) {
        return None;
    }
    Some(
        serde_json::from_slice::<Stored>(bytes).map_err(|source| ReadError::Record {
            path: file.to_path_buf(),
            line,
            source,
        }),
    )
}

/// The decision records under `path` that `selection` selects, in the
/// order written.
pub(crate) fn decisions(path: &Path, selection: &Selection) -> Result<Vec<Record>, ReadError> {
    let mut out = Vec::new();
    for stored in read_records(path) {
        let record = stored?.record;
        if record.event == Event::Decision && selection.matches(&record) {
            out.push(record);
        }
    }
    Ok(out)
}

const TABLE_COLUMNS: [&str; 10] = [
    "ts", "event", "kind", "org", "client", "host", "port", "decision", "reason", "rule",
];

/// One table row: the columns above, tab-separated (`-` where unknown).
pub(crate) fn table_row(r: &Record) -> String {
    let cells: [Option<String>; 10] = [
        Some(r.ts.clone()),
        Some(r.event.as_str().into()),
        Some(r.kind.as_str().into()),
        r.org.as_deref().map(str::to_string),
        r.client.map(|c| c.to_string()),
        r.host.clone(),
        r.port.map(|p| p.to_string()),
        Some(r.decision_str().into()),
        Some(r.reason.as_str().into()),
        r.rule.as_deref().map(str::to_string),
    ];
    cells
        .iter()
        .map(|c| {
            c.as_deref()
                .map_or("-".into(), |s| s.replace(['\t', '\n'], " "))
        })
        .collect::<Vec<_>>()
        .join("\t")
}

pub(crate) fn table_header() -> String {
    TABLE_COLUMNS.join("\t")
}

/// What `query`/`export` print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    /// Each record whole, keys sorted (the form a segment stores it in).
    JsonLines,
    /// Tab-separated columns ([`table_header`]).
    Table,
    /// OCSF 1.x events ([`to_ocsf`]).
    Ocsf,
}

/// Print the matching records of `records`, each with the replica whose
/// chain holds it, or none when reading one chain (then the output is
/// exactly what a single directory has always given). Returns how many
/// matched. With a replica: JSON Lines gain a `replica` field, the table a
/// first `replica` column, OCSF events `unmapped.replica`.
pub(crate) fn print(
    records: impl Iterator<Item = Result<(Option<Arc<str>>, Stored), ReadError>>,
    fleet: bool,
    filter: &Selection,
    output: Output,
    out: &mut impl Write,
) -> io::Result<u64> {
    let mut n = 0;
    if output == Output::Table {
        if fleet {
            write!(out, "replica\t")?;
        }
        writeln!(out, "{}", table_header())?;
    }
    for item in records {
        let (replica, stored) = item?;
        if !filter.matches(&stored.record) {
            continue;
        }
        n += 1;
        match output {
            Output::Table => {
                if fleet {
                    let name = replica.as_deref().unwrap_or("-");
                    write!(out, "{}\t", name.replace(['\t', '\n'], " "))?;
                }
                writeln!(out, "{}", table_row(&stored.record))?;
            }
            Output::JsonLines => {
                // Through a Value: its map sorts the keys.
                let mut v = serde_json::to_value(&stored)?;
                if let (Some(r), Value::Object(m)) = (&replica, &mut v) {
                    m.insert("replica".into(), r.as_ref().into());
                }
                serde_json::to_writer(&mut *out, &v)?;
                out.write_all(b"\n")?;
            }
            Output::Ocsf => {
                let mut e = to_ocsf(&stored);
                if let Some(r) = &replica {
                    if let Some(Value::Object(u)) = e.get_mut("unmapped") {
                        u.insert("replica".into(), r.as_ref().into());
                    }
                }
                serde_json::to_writer(&mut *out, &e)?;
                out.write_all(b"\n")?;
            }
        }
    }
    Ok(n)
}

/// Print the matching records under `path` (one chain); returns how many
/// matched. JSON Lines hold each record whole, keys sorted (the form a
/// segment stores it in).
#[cfg(test)]
pub(crate) fn query(
    path: &Path,
    filter: &Selection,
    table: bool,
    out: &mut impl Write,
) -> io::Result<u64> {
    let output = if table {
        Output::Table
    } else {
        Output::JsonLines
    };
    print(
        read_records(path).map(|r| r.map(|s| (None, s))),
        false,
        filter,
        output,
        out,
    )
}

/// The OCSF version the export targets.
pub(crate) const OCSF_VERSION: &str = "1.3.0";

fn endpoint_of_addr(addr: std::net::SocketAddr) -> Value {
    json!({"ip": addr.ip().to_string(), "port": addr.port()})
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

/// Map one decision or close record to an OCSF event.
pub(crate) fn to_ocsf(stored: &Stored) -> Value {
    let r = &stored.record;
    let allowed = r.decision_str() == "allow";
    let (class_uid, class_name, activity_id, activity_name) = ocsf_class(r);
    let time_ms = humantime::parse_rfc3339(&r.ts)
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    let correlation = r.conn.as_deref().unwrap_or(&r.id);
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
    e.insert("status_code".into(), r.reason.as_str().into());
    if let Some(d) = &r.detail {
        e.insert("status_detail".into(), d.as_str().into());
    }
    e.insert(
        "metadata".into(),
        json!({
            "version": OCSF_VERSION,
            "uid": r.id,
            "original_time": r.ts,
            "profiles": ["security_control"],
            "product": {"name": "Palisade", "vendor_name": "Palisade", "version": env!("CARGO_PKG_VERSION")},
            "tenant_uid": r.org,
            "correlation_uid": correlation,
        }),
    );
    ocsf_verdict(&mut e, r, allowed);
    ocsf_endpoints(&mut e, r, correlation);
    ocsf_kind(&mut e, r, allowed);
    e.insert("unmapped".into(), ocsf_unmapped(stored));
    Value::Object(e)
}

/// The OCSF class and activity of `r`: (class_uid, class_name,
/// activity_id, activity_name).
fn ocsf_class(r: &Record) -> (u64, &'static str, u64, String) {
    let allowed = r.decision_str() == "allow";
    let is_close = r.event == Event::Close;
    match r.kind {
        Kind::Http => {
            let a = http_method_activity(r.method.as_deref());
            (
                4002,
                "HTTP Activity",
                a,
                r.method.as_deref().unwrap_or("Other").to_string(),
            )
        }
        Kind::Dns => (4003, "DNS Activity", 6, "Traffic".to_string()),
        Kind::Tcp if is_close => (4001, "Network Activity", 2, "Close".to_string()),
        Kind::Tcp if allowed => (4001, "Network Activity", 1, "Open".to_string()),
        Kind::Tcp | Kind::Bypass => (4001, "Network Activity", 5, "Refuse".to_string()),
        Kind::Enforcement | Kind::Grant => {
            (4001, "Network Activity", 99, r.event.as_str().to_string())
        }
    }
}

/// The security_control profile: the proxy's verdict, the policy and rule.
fn ocsf_verdict(e: &mut Map<String, Value>, r: &Record, allowed: bool) {
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
        json!({"uid": r.policy, "name": "palisade policy", "desc": r.reason}),
    );
    if let Some(rule) = &r.rule {
        e.insert("firewall_rule".into(), json!({"uid": rule, "name": rule}));
    }
}

/// Where it came from and went, and the bytes of a close.
fn ocsf_endpoints(e: &mut Map<String, Value>, r: &Record, correlation: &str) {
    let is_close = r.event == Event::Close;
    if let Some(c) = r.client {
        e.insert("src_endpoint".into(), endpoint_of_addr(c));
    }
    let mut dst = Map::new();
    if let Some(h) = &r.host {
        dst.insert("hostname".into(), h.as_str().into());
    }
    if let Some(ip) = r.ip {
        dst.insert("ip".into(), ip.to_string().into());
    }
    if let Some(p) = r.port {
        dst.insert("port".into(), p.into());
    }
    if !dst.is_empty() {
        e.insert("dst_endpoint".into(), Value::Object(dst));
    }
    e.insert(
        "connection_info".into(),
        json!({"protocol_name": r.proto.as_deref().unwrap_or(if r.kind == Kind::Dns { "udp" } else { "tcp" }), "direction_id": 2, "direction": "Outbound", "uid": correlation}),
    );
    if is_close {
        e.insert(
            "traffic".into(),
            json!({"bytes_out": r.bytes_up, "bytes_in": r.bytes_down}),
        );
        if let Some(d) = r.duration_ms {
            e.insert("duration".into(), d.into());
        }
    }
}

/// The fields of `r`'s kind: the HTTP request, the DNS query and
/// answers, the SNI, a bypass count, a message.
fn ocsf_kind(e: &mut Map<String, Value>, r: &Record, allowed: bool) {
    match r.kind {
        Kind::Http => {
            let url = json!({
                "hostname": r.host,
                "port": r.port,
                "path": r.path,
                "scheme": "http",
            });
            e.insert(
                "http_request".into(),
                json!({"http_method": r.method, "url": url}),
            );
        }
        Kind::Dns => {
            e.insert(
                "query".into(),
                json!({"hostname": r.host, "type": r.qtype, "class": "IN"}),
            );
            if let Some(a) = &r.answers {
                let answers: Vec<Value> = a
                    .iter()
                    .map(|x| json!({"rdata": x, "type": r.qtype, "class": "IN"}))
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
        Kind::Tcp => {
            if let Some(sni) = &r.sni {
                e.insert("tls".into(), json!({"sni": sni}));
            }
        }
        Kind::Bypass => {
            e.insert("count".into(), r.count.into());
        }
        Kind::Enforcement | Kind::Grant => {
            e.insert("message".into(), r.detail.clone().into());
        }
    }
}

/// What OCSF has no field for: mode, chain position, event.
fn ocsf_unmapped(stored: &Stored) -> Value {
    let r = &stored.record;
    let mut unmapped = Map::new();
    unmapped.insert("mode".into(), r.mode.as_str().into());
    if let Some(seq) = stored.seq {
        unmapped.insert("seq".into(), seq.into());
    }
    if let Some(h) = &stored.hash {
        unmapped.insert("hash".into(), h.as_str().into());
    }
    unmapped.insert("event".into(), r.event.as_str().into());
    Value::Object(unmapped)
}

/// Print every matching decision and close record under `path` as OCSF
/// JSON Lines.
#[cfg(test)]
pub(crate) fn export_ocsf(
    path: &Path,
    filter: &Selection,
    out: &mut impl Write,
) -> io::Result<u64> {
    print(
        read_records(path).map(|r| r.map(|s| (None, s))),
        false,
        filter,
        Output::Ocsf,
        out,
    )
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

    fn rec(v: Value) -> Stored {
        serde_json::from_value(v).unwrap()
    }

    fn base(kind: &str, decision: &str) -> Value {
        json!({"id": "x-1", "ts": "2026-01-02T03:04:05.123456Z", "kind": kind, "event": "decision",
               "org": "acme", "client": "198.18.1.2:40000", "mode": "explicit", "host": "a.test",
               "port": 443, "sni": null, "ip": "198.18.2.10", "decision": decision,
               "reason": if decision == "allow" { "rule_match" } else { "no_matching_rule" },
               "rule": "acme/allow/0", "policy": "p0", "seq": 3, "prev": "0", "hash": "h"})
    }

    #[test]
    fn bypass_records_read_back_and_map_to_refused_network_activity() {
        let mut b = base("bypass", "deny");
        b["mode"] = "transparent".into();
        b["reason"] = "protocol_mismatch".into();
        b["proto"] = "udp".into();
        b["count"] = 3.into();
        let stored = rec(b);
        assert_eq!(stored.record.kind, Kind::Bypass);
        assert_eq!(stored.record.proto.as_deref(), Some("udp"));
        let filter = Selection {
            reason: Some(crate::policy::Reason::ProtocolMismatch),
            ..Selection::default()
        };
        assert!(filter.matches(&stored.record));
        let e = to_ocsf(&stored);
        check(&e, 4001, &["src_endpoint", "dst_endpoint"], &[]);
        assert_eq!(e["activity_id"], 5, "refused");
        assert_eq!(e["connection_info"]["protocol_name"], "udp");
        assert_eq!(e["count"], 3);
    }

    #[test]
    fn tcp_maps_to_network_activity() {
        let e = to_ocsf(&rec(base("tcp", "allow")));
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

        let d = to_ocsf(&rec(base("tcp", "deny")));
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
        let c = to_ocsf(&rec(c));
        check(&c, 4001, &["src_endpoint", "dst_endpoint"], &["traffic"]);
        assert_eq!(c["activity_id"], 2);
        assert_eq!(c["traffic"]["bytes_in"], 20);
    }

    #[test]
    fn http_maps_to_http_activity() {
        let mut r = base("http", "allow");
        r["method"] = "POST".into();
        r["path"] = "/x".into();
        let e = to_ocsf(&rec(r));
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
        let e = to_ocsf(&rec(r));
        check(&e, 4003, &["src_endpoint", "dst_endpoint"], &["query"]);
        assert_eq!(e["query"]["hostname"], "a.test");
        assert_eq!(e["answers"][0]["rdata"], "198.18.2.10");
        let d = to_ocsf(&rec(base("dns", "deny")));
        assert_eq!(d["rcode"], "Refused");
        assert_eq!(d["disposition_id"], 2);
    }

    /// A file of `lines`, one JSON value each, in a fresh directory.
    fn file_of(lines: &[Value]) -> std::path::PathBuf {
        let dir = crate::testing::scratch("query");
        let path = dir.join("palisade-00000000000000000000.jsonl");
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn chain_records_are_not_exported_and_filters_apply() {
        let h = json!({"event": "checkpoint", "ts": "2026-01-02T03:04:05Z"});
        let file = file_of(&[h, base("tcp", "deny")]);
        let mut out = Vec::new();
        assert_eq!(
            export_ocsf(&file, &Selection::default(), &mut out).unwrap(),
            1
        );
        assert_eq!(String::from_utf8(out).unwrap().lines().count(), 1);
        let r = rec(base("tcp", "deny"));
        let f = |f: Selection| f.matches(&r.record);
        assert!(f(Selection::default()));
        assert!(f(Selection {
            host: Some("*.test".into()),
            ..Selection::default()
        }));
        assert!(!f(Selection {
            host: Some("*.a.test".into()),
            ..Selection::default()
        }));
        assert!(!f(Selection {
            decision: Some("allow"),
            ..Selection::default()
        }));
        assert!(f(Selection {
            org: Some("acme".into()),
            reason: Some(crate::policy::Reason::NoMatchingRule),
            since: humantime::parse_rfc3339("2026-01-02T03:04:05Z").ok(),
            until: humantime::parse_rfc3339("2026-01-02T03:04:06Z").ok(),
            ..Selection::default()
        }));
        assert!(!f(Selection {
            since: humantime::parse_rfc3339("2026-01-02T03:04:06Z").ok(),
            ..Selection::default()
        }));
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
    }

    /// Read back typed, a record is the record written: the query's JSON
    /// Lines are the stored lines byte for byte, and the table shows it.
    #[test]
    fn records_read_back_typed() {
        let mut close = base("tcp", "allow");
        close["event"] = "close".into();
        close["conn"] = "x-0".into();
        close["bytes_up"] = 10.into();
        close["bytes_down"] = 20.into();
        close["duration_ms"] = 5.into();
        close["tunnel"] = "tls-or-http".into();
        let mut dns = base("dns", "deny");
        dns["mode"] = "dns".into();
        dns["qtype"] = "TXT".into();
        dns["would_deny"] = "explicit_deny".into();
        dns["client"] = "[2001:db8::1]:5353".into();
        let lines = [base("tcp", "allow"), close, dns];
        let file = file_of(&lines);
        let read: Vec<Stored> = read_records(&file).map(Result::unwrap).collect();
        assert_eq!(read.len(), 3);
        assert_eq!(read[1].record.tunnel, Some(crate::config::Carry::TlsOrHttp));
        assert_eq!(
            read[2].record.would_deny,
            Some(crate::policy::Reason::ExplicitDeny)
        );
        assert_eq!(read[0].seq, Some(3));
        let mut out = Vec::new();
        assert_eq!(
            query(&file, &Selection::default(), false, &mut out).unwrap(),
            3
        );
        let want: String = lines.iter().map(|l| format!("{l}\n")).collect();
        assert_eq!(String::from_utf8(out).unwrap(), want);
        let mut table = Vec::new();
        query(&file, &Selection::default(), true, &mut table).unwrap();
        let table = String::from_utf8(table).unwrap();
        assert_eq!(
            table.lines().nth(3).unwrap(),
            "2026-01-02T03:04:05.123456Z\tdecision\tdns\tacme\t[2001:db8::1]:5353\ta.test\t443\tdeny\tno_matching_rule\tacme/allow/0"
        );
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
    }

    /// A decision line this version cannot read is an error naming it, not
    /// a record silently left out; junk that is not JSON is skipped.
    #[test]
    fn unreadable_records_are_errors() {
        let mut bad = base("tcp", "deny");
        bad["reason"] = "no_such_reason".into();
        let file = file_of(&[base("tcp", "allow"), json!("junk"), bad]);
        let read: Vec<_> = read_records(&file).collect();
        assert_eq!(read.len(), 2);
        let err = read[1].as_ref().unwrap_err().to_string();
        assert!(
            err.contains(".jsonl:3:") && err.contains("no_such_reason"),
            "{err}"
        );
        assert!(query(&file, &Selection::default(), false, &mut Vec::new()).is_err());
        assert!(read_records(&file.with_extension("gone"))
            .next()
            .unwrap()
            .is_err());
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
    }

    /// Reasons read back by the names they are written with.
    #[test]
    fn reasons_read_back_by_name() {
        use crate::policy::Reason;
        for r in Reason::ALL {
            let back: Reason = serde_json::from_value(json!(r.as_str())).unwrap();
            assert_eq!(back, r);
            assert_eq!(serde_json::to_value(r).unwrap(), json!(r.as_str()));
        }
        assert!(serde_json::from_value::<Reason>(json!("RuleMatch")).is_err());
    }

    /// What the writer stores reads back as the record it was given, with
    /// every field it wrote (nothing dropped as unknown).
    #[tokio::test]
    async fn written_records_read_back_whole() {
        let file = file_of(&[]);
        let dir = file.parent().unwrap().join("evidence");
        let ev = crate::evidence::Evidence::open(&dir).unwrap();
        let verdict = crate::policy::Verdict {
            org: None,
            reason: crate::policy::Reason::ReportOnly,
            rule: Some("acme/allow/0".into()),
            would_deny: Some(crate::policy::Reason::SniMismatch),
        };
        let client = "198.18.1.2:40000".parse().unwrap();
        let mut r = Record::decision(
            Kind::Http,
            super::super::Mode::Explicit,
            client,
            &verdict,
            &"p".into(),
        );
        r.host = Some("a.test".into());
        r.method = Some("GET".into());
        r.path = Some("/x".into());
        r.intercepted = Some(true);
        r.status = Some(200);
        r.credential = Some("c1".into());
        r.tunnel = Some(crate::config::Carry::Http);
        ev.write(&mut r).await.unwrap();
        let mut c = r.close(1, 2, 3);
        ev.submit(&mut c);
        assert!(ev.seal().await);
        let read: Vec<Stored> = read_records(&dir).map(Result::unwrap).collect();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0].record.id, r.id);
        assert_eq!(read[1].record.conn.as_deref(), Some(r.id.as_str()));
        let raw: Vec<Value> = std::fs::read_to_string(&segment::list(&dir).unwrap()[0])
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|v: &Value| matches!(v["event"].as_str(), Some("decision" | "close")))
            .collect();
        for (stored, raw) in read.iter().zip(&raw) {
            assert_eq!(&serde_json::to_value(stored).unwrap(), raw);
        }
        let _ = std::fs::remove_dir_all(file.parent().unwrap());
    }
}
