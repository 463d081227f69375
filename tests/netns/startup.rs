//! Start-up with a large, old evidence store: Palisade reads only what can
//! hold a live grant (the last `MAX_TTL` + 1 h of segments) and a bounded
//! tail, not the whole store; a signal during the start stops it at once.
//!
//! The store is made from records of a real run (a decision, a grant given
//! uses only), copied with their `seq` and `ts` rewritten into 80 segments
//! of 4 MiB dated three days to 30 hours ago (320 MiB). The last of them,
//! spanning the replay window's start, also holds two grants given uses
//! only: one 30 hours ago (past `MAX_TTL`: ended at start, recorded
//! `expired` by `ttl`) and one two hours ago (held). How much Palisade read
//! is its `rchar` (`/proc/PID/io`) once it answers: a count, not a timing.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use crate::jit::{admin, json, lab_asking_with, ALICE};
use crate::lab;

const SEGMENTS: u64 = 80;
const SEGMENT_BYTES: usize = 4 << 20;
/// The oldest segment's age, and the newest one's.
const OLDEST: Duration = Duration::from_secs(72 * 3600);
const NEWEST: Duration = Duration::from_secs(30 * 3600);
/// How long a TERM during the start may take to end the process.
const TERM_WITHIN: Duration = Duration::from_secs(3);
const OLD_GRANT: &str = "g-0dd00001";
const RECENT_GRANT: &str = "g-0dd00002";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// The segment files of `dir`, in chain order.
fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".jsonl"))
        .collect();
    v.sort();
    v
}

/// Palisade's `rchar`: bytes it read through read(2) and the like.
fn rchar(pid: u32) -> u64 {
    let io = fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rchar in {io}"))
}

/// A record line of the run with `seq`, `ts` and, for a grant, its id
/// and time set.
fn rewrite(template: &Value, seq: u64, at: SystemTime, grant: Option<&str>) -> String {
    let mut v = template.clone();
    v["seq"] = seq.into();
    v["ts"] = rfc3339(at).into();
    if let Some(id) = grant {
        v["grant"]["id"] = id.into();
        v["grant"]["granted_at"] = humantime::format_rfc3339_seconds(at).to_string().into();
        v["grant"]["uses"] = 0.into();
        v["rule"] = format!("grant:{id}").into();
    }
    let mut line = serde_json::to_string(&v).unwrap();
    line.push('\n');
    line
}

/// Replace the segments of `dir` with `SEGMENTS` old ones made of the
/// run's `header`, `decision` and `granted` lines; the store's size.
fn old_store(dir: &Path, header: &Value, decision: &Value, granted: &Value) -> u64 {
    for p in segments(dir) {
        fs::remove_file(p).unwrap();
    }
    let now = SystemTime::now();
    let step = (OLDEST - NEWEST) / (SEGMENTS - 1) as u32;
    // The decision line with placeholders for its seq and ts, filled by
    // plain text (fast enough for 320 MiB in a debug build).
    let mut d = decision.clone();
    d["seq"] = 999_999_999_999u64.into();
    d["ts"] = "@TS@".into();
    let text = serde_json::to_string(&d).unwrap();
    let (before_seq, rest) = text.split_once("999999999999").unwrap();
    let (between, after_ts) = rest.split_once("@TS@").unwrap();
    let mut seq = 0u64;
    let mut total = 0u64;
    for i in 0..SEGMENTS {
        let start = now - OLDEST + step * i as u32;
        let name = format!("palisade-{seq:020}.jsonl");
        let mut out = rewrite(header, seq, start, None);
        seq += 1;
        let mut n = 0u64;
        while out.len() < SEGMENT_BYTES {
            let at = rfc3339(start + Duration::from_millis(n * 10));
            out.push_str(&format!("{before_seq}{seq}{between}{at}{after_ts}\n"));
            seq += 1;
            n += 1;
        }
        if i == SEGMENTS - 1 {
            let old = now - NEWEST + Duration::from_secs(60);
            out.push_str(&rewrite(granted, seq, old, Some(OLD_GRANT)));
            let recent = now - Duration::from_secs(2 * 3600);
            out.push_str(&rewrite(granted, seq + 1, recent, Some(RECENT_GRANT)));
            seq += 2;
        }
        total += out.len() as u64;
        fs::write(dir.join(name), out).unwrap();
    }
    total
}

/// The first line of `path` matching `pred`, parsed.
fn find_line(path: &Path, pred: impl Fn(&Value) -> bool) -> Option<Value> {
    fs::read_to_string(path)
        .ok()?
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| pred(v))
}

/// A store of 320 MiB of records days old: a TERM sent while Palisade
/// starts on it ends the process within 3 s; started again, it answers
/// having read under a tenth of the store (replay reads the segment
/// spanning the window and the chain's tail, nothing older); the grant
/// given uses only 30 hours ago is dropped with its end recorded `ttl`,
/// the one given two hours ago is held.
#[test]
fn a_large_old_store_is_not_read_at_start_and_a_term_during_start_stops_it() {
    let mut lab = lab_asking_with(|b| b);
    let grant = r#"{"org":"acme","target":"other.test","port":80,"max_uses":2}"#;
    let (code, body) = admin(&lab, "POST", "/v1/grants", Some(ALICE), Some(grant));
    assert_eq!(code, 201, "{body}");
    let r = lab.proxied_curl("http://allowed.test/startup-template", &[]);
    assert_eq!(r.status, 200, "{r:?}");
    lab.wait_evidence("the template decision", |v| {
        v["event"] == "decision" && v["decision"] == "allow"
    });
    lab.signal_proxy("-TERM");
    assert!(lab.wait_proxy_exit(Duration::from_secs(15)).is_some());
    let dir = lab.evidence_dir.clone();
    let first = segments(&dir)[0].clone();
    let header = find_line(&first, |_| true).unwrap();
    let decision = find_line(&first, |v| v["event"] == "decision").unwrap();
    let granted = find_line(&first, |v| v["event"] == "granted").unwrap();
    let size = old_store(&dir, &header, &decision, &granted);
    println!("store: {} segments, {size} bytes", SEGMENTS);

    // A TERM while it starts: it stops, not once it has read the store.
    lab.kill_proxy_hard(); // reaps the process that exited
    lab.spawn_proxy();
    std::thread::sleep(Duration::from_millis(300));
    lab.signal_proxy("-TERM");
    let sent = Instant::now();
    let exit = lab.wait_proxy_exit(TERM_WITHIN + Duration::from_secs(60));
    let took = sent.elapsed();
    println!("TERM during start-up: exit {exit:?} after {took:?}");
    assert!(
        exit.is_some() && took < TERM_WITHIN,
        "a TERM during start-up took {took:?} (exit {exit:?}) on a {size}-byte store\n{}",
        lab.proxy_output()
    );

    let started = Instant::now();
    lab.restart_proxy();
    let read = rchar(lab.proxy_pid());
    println!(
        "start-up on a {size}-byte store: ready in {:?}, rchar {read} ({:.2}% of the store)",
        started.elapsed(),
        read as f64 * 100.0 / size as f64
    );
    assert!(
        read < size / 10,
        "start-up read {read} bytes of a {size}-byte store"
    );

    let (code, body) = admin(&lab, "GET", "/v1/grants", Some(ALICE), None);
    assert_eq!(code, 200, "{body}");
    let ids: Vec<String> = json(&body)["grants"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g["id"].as_str().map(str::to_string))
        .collect();
    assert!(ids.iter().any(|i| i == RECENT_GRANT), "{body}");
    assert!(
        !ids.iter().any(|i| i == OLD_GRANT),
        "a grant given uses only 30 h ago is still held: {body}"
    );
    let newest = segments(&dir).pop().unwrap();
    let mut ended = None;
    lab::wait_until("the old grant's end on record", SECS5, || {
        ended = find_line(&newest, |v| {
            v["event"] == "expired" && v["grant"]["id"] == OLD_GRANT
        });
        ended.is_some()
    });
    let ended = ended.unwrap();
    assert_eq!(ended["grant"]["ended_by"], "ttl", "{ended}");
}

const SECS5: Duration = Duration::from_secs(5);
