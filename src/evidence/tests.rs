//! The writer and the verifier together: a chain written by [`Evidence`]
//! verifies, and every kind of tampering with it is found at the right line.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::chain::Prepared;
use super::verify::{verify_with, Options};
use super::*;
use crate::config::EvidenceConfig;
use crate::policy::{Reason, Verdict};

fn config(root: &Path) -> EvidenceConfig {
    let mut c = EvidenceConfig::for_dir(&root.join("evidence"));
    c.checkpoint_every = 5;
    c
}

fn record(i: u32, allow: bool) -> Record {
    let verdict = Verdict {
        org: None,
        reason: if allow {
            Reason::RuleMatch
        } else {
            Reason::NoMatchingRule
        },
        rule: Some(Arc::from("acme/allow/0")),
        would_deny: None,
    };
    let client: SocketAddr = format!("198.18.1.2:{}", 10000 + i).parse().unwrap();
    let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &Arc::from("p"));
    r.host = Some(format!("h{i}.test"));
    r.port = Some(443);
    r
}

/// A sealed store of `n` deny decisions with a checkpoint every
/// `checkpoint_every` records and segments of about `rotate_size` bytes:
/// the scratch root, the evidence directory and the public key. Record
/// `i` is of org `orgs[i % orgs.len()]`, for host `ORG-i.test` (of no org
/// when `orgs` is empty).
pub(super) async fn sealed_store(
    name: &str,
    checkpoint_every: u64,
    rotate_size: u64,
    n: u16,
    orgs: &[&str],
) -> (PathBuf, PathBuf, ed25519_dalek::VerifyingKey) {
    let root = crate::testing::scratch(name);
    let mut cfg = EvidenceConfig::for_dir(&root.join("evidence"));
    cfg.checkpoint_every = checkpoint_every;
    cfg.rotate_size = rotate_size;
    let ev = Evidence::start(&cfg).unwrap();
    let verdict = Verdict {
        org: None,
        reason: Reason::NoMatchingRule,
        rule: None,
        would_deny: None,
    };
    for i in 0..n {
        let client = format!("198.18.1.2:{}", 1000 + i).parse().unwrap();
        let mut r = Record::decision(Kind::Tcp, Mode::Explicit, client, &verdict, &Arc::from("p"));
        if let Some(org) = orgs.get(usize::from(i) % orgs.len().max(1)) {
            r.org = Some((*org).into());
            r.host = Some(format!("{org}-{i}.test"));
        }
        ev.write(&mut r).await.unwrap();
    }
    assert!(ev.seal().await);
    let k = key::load(&cfg.key).unwrap().verifying_key();
    (root, cfg.dir, k)
}

/// Write `n` decision records (and a close record for every allow).
async fn fill(ev: &Evidence, n: u32) {
    for i in 0..n {
        let mut r = record(i, i % 3 != 0);
        ev.write(&mut r).await.unwrap();
        if r.decision_str() == "allow" {
            let mut c = r.close(1, 2, 3);
            ev.submit(&mut c);
        }
    }
}

async fn sealed_chain(cfg: &EvidenceConfig, n: u32) {
    let ev = Evidence::start(cfg).unwrap();
    fill(&ev, n).await;
    assert!(ev.seal().await);
}

fn pinned(cfg: &EvidenceConfig) -> Options {
    let key = key::load(&cfg.key).unwrap();
    Options {
        key: Some(key.verifying_key()),
        allow_unsealed: false,
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    segment::list(dir).unwrap()
}

fn lines(p: &Path) -> Vec<String> {
    fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

fn write_lines(p: &Path, l: &[String]) {
    fs::write(p, l.join("\n") + "\n").unwrap();
}

/// Re-link lines `from..` after an edit, as a forger would.
fn rechain(l: &mut [String], from: usize) {
    relink(l, from, None);
}

/// Re-link lines `from..` after an edit and re-sign every checkpoint's
/// `sig`, as the holder of the key would.
fn rechain_signed(l: &mut [String], from: usize, key: &ed25519_dalek::SigningKey) {
    relink(l, from, Some(key));
}

fn relink(l: &mut [String], from: usize, key: Option<&ed25519_dalek::SigningKey>) {
    for i in from..l.len() {
        let Value::Object(mut m) = serde_json::from_str(&l[i]).unwrap() else {
            panic!()
        };
        if i > 0 {
            let prev: Value = serde_json::from_str(&l[i - 1]).unwrap();
            m.insert("prev".into(), prev["hash"].clone());
        }
        if let Some(key) =
            key.filter(|_| matches!(m["event"].as_str(), Some("checkpoint" | "seal")))
        {
            m.remove("hash");
            chain::sign(&mut m, key);
        }
        let seq = m["seq"].as_u64().unwrap();
        let prev = m["prev"].as_str().unwrap().to_string();
        let (_, line) = chain::seal_line(&mut m, seq, &prev);
        l[i] = String::from_utf8(line).unwrap().trim_end().to_string();
    }
}

fn expect_err(dir: &Path, opts: &Options, file: &Path, line: u64, what: &str) {
    let e = verify_with(dir, opts).expect_err(what);
    assert_eq!(e.file, file.display().to_string(), "{what}: {e}");
    assert_eq!(e.line, line, "{what}: {e}");
}

#[tokio::test]
async fn written_chain_verifies_with_summary() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    sealed_chain(&cfg, 30).await;
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.sealed);
    assert_eq!(s.allow, 20);
    assert_eq!(s.deny, 10);
    assert_eq!(s.closes, 20);
    assert!(s.checkpoints >= 10, "{s}");
    assert_eq!(s.orgs.get("unknown"), Some(&(20, 10)));
    assert!(s.first_ts.is_some() && s.last_ts.is_some());
    // Every line is canonical JSON with the CONTRACT fields and chain fields.
    for l in lines(&segments(&cfg.dir)[0]) {
        let v: Value = serde_json::from_str(&l).unwrap();
        for k in CONTRACT_FIELDS.iter().chain(&["seq", "prev", "hash"]) {
            assert!(v.get(k).is_some(), "{k} missing in {l}");
        }
    }
    // A different pinned key fails at the first checkpoint.
    let other = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
    let opts = Options {
        key: Some(other.verifying_key()),
        allow_unsealed: false,
    };
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert!(e.message.contains("signature"), "{e}");
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn every_single_byte_edit_is_found_at_its_line() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    sealed_chain(&cfg, 6).await;
    let seg = segments(&cfg.dir)[0].clone();
    let orig = lines(&seg);
    let opts = pinned(&cfg);
    // Line 3 is a decision record, line 1 the header; the seal is last.
    for idx in [0usize, 2, orig.len() - 1] {
        let bytes = orig[idx].as_bytes().to_vec();
        for pos in 0..bytes.len() {
            let mut b = bytes.clone();
            b[pos] = match b[pos] {
                b'0'..=b'8' | b'a'..=b'y' | b'A'..=b'Y' => b[pos] + 1,
                b'9' => b'0',
                b'z' | b'Z' => b'a',
                _ => b'x',
            };
            let mut l = orig.clone();
            l[idx] = String::from_utf8_lossy(&b).into_owned();
            write_lines(&seg, &l);
            let e = verify_with(&cfg.dir, &opts)
                .expect_err(&format!("edit of byte {pos} in line {}", idx + 1));
            assert_eq!(e.line, idx as u64 + 1, "byte {pos}: {e}");
        }
    }
    write_lines(&seg, &orig);
    verify_with(&cfg.dir, &opts).unwrap();
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn deletion_insertion_swap_and_forged_signature_are_found() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    sealed_chain(&cfg, 12).await;
    let seg = segments(&cfg.dir)[0].clone();
    let orig = lines(&seg);
    let opts = pinned(&cfg);

    let mut l = orig.clone();
    l.remove(4);
    write_lines(&seg, &l);
    expect_err(&cfg.dir, &opts, &seg, 5, "deleted record");

    let mut l = orig.clone();
    l.insert(4, orig[2].clone());
    write_lines(&seg, &l);
    expect_err(&cfg.dir, &opts, &seg, 5, "inserted record");

    let mut l = orig.clone();
    l.swap(3, 4);
    write_lines(&seg, &l);
    expect_err(&cfg.dir, &opts, &seg, 4, "swapped records");

    // Dropping the tail and the seal: the end is no longer sealed.
    let mut l = orig.clone();
    l.truncate(l.len() - 3);
    write_lines(&seg, &l);
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert!(e.message.contains("not sealed"), "{e}");

    // An edit re-chained by a forger breaks the next checkpoint's signature.
    let mut l = orig.clone();
    l[2] = l[2].replace("h1.test", "h9.test");
    rechain(&mut l, 2);
    write_lines(&seg, &l);
    let ckpt = l
        .iter()
        .position(|x| x.contains("\"event\":\"checkpoint\""))
        .unwrap();
    expect_err(&cfg.dir, &opts, &seg, ckpt as u64 + 1, "re-chained edit");

    // A checkpoint whose signature is replaced by another key's.
    let mut l = orig.clone();
    let Value::Object(mut m) = serde_json::from_str(&l[ckpt]).unwrap() else {
        panic!()
    };
    chain::sign(&mut m, &ed25519_dalek::SigningKey::from_bytes(&[5; 32]));
    l[ckpt] = serde_json::to_string(&m).unwrap();
    rechain(&mut l, ckpt);
    write_lines(&seg, &l);
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert_eq!(e.line, ckpt as u64 + 1, "{e}");
    assert!(e.message.contains("signature"), "{e}");
    // Without a pinned key the embedded key still catches it.
    assert!(verify_with(&cfg.dir, &Options::default()).is_err());

    write_lines(&seg, &orig);
    verify_with(&cfg.dir, &opts).unwrap();
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn rotation_retention_and_dropped_segments() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.rotate_size = 3000;
    sealed_chain(&cfg, 40).await;
    let segs = segments(&cfg.dir);
    assert!(segs.len() >= 4, "{segs:?}");
    let opts = pinned(&cfg);
    let s = verify_with(&cfg.dir, &opts).unwrap();
    assert_eq!(s.files, segs.len());

    // Drop a segment in the middle.
    let gone = segs[1].clone();
    let saved = fs::read(&gone).unwrap();
    fs::remove_file(&gone).unwrap();
    expect_err(&cfg.dir, &opts, &segs[2], 1, "dropped middle segment");
    fs::write(&gone, &saved).unwrap();
    // Swap two segments' contents (names no longer match headers).
    let a = fs::read(&segs[1]).unwrap();
    let b = fs::read(&segs[2]).unwrap();
    fs::write(&segs[1], &b).unwrap();
    fs::write(&segs[2], &a).unwrap();
    expect_err(&cfg.dir, &opts, &segs[1], 1, "swapped segments");
    fs::write(&segs[1], &a).unwrap();
    fs::write(&segs[2], &b).unwrap();
    // Drop the first segment: nothing accounts for it.
    fs::remove_file(&segs[0]).unwrap();
    expect_err(&cfg.dir, &opts, &segs[1], 1, "dropped first segment");
    let _ = fs::remove_dir_all(&root);

    // With a retention cap, removal is recorded and the rest verifies.
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.rotate_size = 3000;
    cfg.retain_size = Some(9000);
    // No floor: every closed segment may go (see the test of the floor).
    cfg.retain_min_age = Duration::ZERO;
    sealed_chain(&cfg, 60).await;
    let segs = segments(&cfg.dir);
    let total: u64 = segs.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert!(total <= 9000 + 3000 + 2000, "total {total}");
    let first = lines(&segs[0]);
    assert!(!first[0].contains("\"seq\":0,"), "nothing was removed");
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.sealed);
    let all: String = segs.iter().flat_map(|p| lines(p)).collect();
    assert!(all.contains("\"removed\":[{"), "no removal recorded");
    // verify lists what was removed, with its seq and time span.
    let before = s.removed.last().map(|r| r.last_seq + 1);
    assert_eq!(
        before,
        Some(s.first_seq),
        "the segment just before is listed: {s}"
    );
    assert!(s
        .removed
        .iter()
        .all(|r| !r.first_ts.is_empty() && r.first_ts <= r.last_ts));
    let shown = s.to_string();
    assert!(shown.contains("removed by retention: "), "{shown}");
    assert!(
        shown.contains(&format!("{}: seq ", s.removed[0].segment)),
        "{shown}"
    );
    let since = humantime::parse_rfc3339_weak(&s.removed[0].last_ts).ok();
    let cut = verify::retention_cut(&cfg.dir, since, None).unwrap();
    assert!(cut.contains("shipped copy"), "{cut}");
    let after = humantime::parse_rfc3339_weak(s.last_ts.as_deref().unwrap()).ok();
    assert_eq!(
        verify::retention_cut(&cfg.dir, after, None),
        None,
        "nothing removed after the end"
    );
    // An unrecorded removal of the oldest remaining segment is found.
    fs::remove_file(&segs[0]).unwrap();
    expect_err(&cfg.dir, &pinned(&cfg), &segs[1], 1, "unrecorded removal");
    let _ = fs::remove_dir_all(&root);
}

/// Records of `org`, `n` of them (allows, each with its close).
async fn fill_org(ev: &Evidence, org: Option<&str>, n: u32) {
    for i in 0..n {
        let mut r = record(i, true);
        r.org = org.map(Arc::from);
        ev.write(&mut r).await.unwrap();
        let mut c = r.close(1, 2, 3);
        ev.submit(&mut c);
    }
}

#[tokio::test]
async fn an_allow_reserves_room_for_its_close_until_the_close_is_written() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let ev = Evidence::start(&cfg).unwrap();
    let store = ev.live().store();
    let acme: store::Owner = Some(Arc::from("acme"));
    assert!(store.free().is_some(), "free space measured at start");
    // A denial and a DNS answer owe no close.
    let mut deny = record(0, false);
    deny.org = acme.clone();
    ev.write(&mut deny).await.unwrap();
    let mut dns = record(1, true);
    dns.org = acme.clone();
    dns.kind = Kind::Dns;
    ev.write(&mut dns).await.unwrap();
    assert!(deny.owed.is_none() && dns.owed.is_none());
    assert_eq!(store.reserved(&acme), 0);
    // An allow reserves its close once written.
    let mut allow = record(2, true);
    allow.org = acme.clone();
    allow.path = Some(format!("/{}", "p".repeat(300)));
    ev.write(&mut allow).await.unwrap();
    let reserved = store.reserved(&acme);
    assert!(reserved > 0 && allow.owed.is_some());
    // The longest close it can have: every total at its widest, a status
    // and a detail of a response that did not come.
    let mut close = allow.close(u64::MAX, u64::MAX, u64::MAX);
    close.status = Some(504);
    close.detail = Some(
        "the upstream closed the connection before a complete response head (after 0 bytes)".into(),
    );
    assert!(close.owed.is_some(), "the close carries the reservation");
    ev.submit(&mut close);
    assert!(close.owed.is_none(), "handed to the writer");
    drop(allow.owed.take());
    assert!(ev.seal().await);
    assert_eq!(store.reserved(&acme), 0, "given back once written");
    let written = segments(&cfg.dir)
        .iter()
        .flat_map(|p| lines(p))
        .find(|l| l.contains("\"event\":\"close\""))
        .expect("the close was written");
    // The line and its newline.
    let close_bytes = written.len() as u64 + 1;
    assert!(
        close_bytes <= reserved,
        "reserved {reserved} for a close of {close_bytes} bytes"
    );
    drop(ev);
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn retention_never_removes_a_segment_younger_than_the_floor_and_a_full_store_names_who_filled_it(
) {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.rotate_size = 3000;
    cfg.retain_size = Some(9000);
    // The default floor, an hour: nothing written now may go. (Free space
    // is not what this test is about: any will do.)
    cfg.min_free = crate::config::MinFree::Bytes(1);
    let ev = Evidence::start(&cfg).unwrap();
    ev.live().store().count_payers(|| 2);
    fill_org(&ev, None, 2).await;
    let store = ev.live().store();
    assert!(!store.is_full());
    fill_org(&ev, Some("acme"), 60).await;
    assert!(
        store.is_full(),
        "over retain_size, all younger than the floor"
    );
    assert!(store.over_share(&Some(Arc::from("acme"))));
    assert!(
        !store.over_share(&None),
        "the clients of no org are within their share"
    );
    assert!(ev.seal().await);
    drop(ev);
    let segs = segments(&cfg.dir);
    let total: u64 = segs.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert!(total > 9000 + 3000, "kept over retain_size: {total}");
    assert!(
        lines(&segs[0])[0].contains("\"seq\":0,"),
        "the first segment stays"
    );
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.removed.is_empty() && !s.to_string().contains("removed by"));

    // Started again on the same segments, still young: full at once, and
    // the records already there count in the shares.
    let ev = Evidence::start(&cfg).unwrap();
    ev.live().store().count_payers(|| 2);
    assert!(ev.live().store().is_full());
    assert!(ev.live().store().over_share(&Some(Arc::from("acme"))));
    assert!(!ev.live().store().over_share(&None));
    let shares = ev.live().store().shares();
    let acme = shares
        .iter()
        .find(|s| s.0.as_deref() == Some("acme"))
        .unwrap();
    let none = shares.iter().find(|s| s.0.is_none()).unwrap();
    assert!(acme.1 > 20 * none.1 && none.1 > 0, "{shares:?}");
    assert!(ev.seal().await);
    drop(ev);

    // Once the segments are old enough (here: a floor of zero at the next
    // start), retention removes them again, recorded, and the store is
    // no longer full.
    cfg.retain_min_age = Duration::ZERO;
    let ev = Evidence::start(&cfg).unwrap();
    assert!(!ev.live().store().is_full());
    assert!(ev.seal().await);
    drop(ev);
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(!s.removed.is_empty(), "{s}");

    // Less free space than min_free: full too, whatever retain_size says.
    cfg.retain_size = None;
    cfg.min_free = crate::config::MinFree::Bytes(u64::MAX);
    let ev = Evidence::start(&cfg).unwrap();
    assert!(ev.live().store().is_full());
    drop(ev);
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn crash_torn_tail_and_restart() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let ev = Evidence::start(&cfg).unwrap();
    fill(&ev, 7).await;
    ev.abandon();
    drop(ev);
    let opts = pinned(&cfg);
    let seg = segments(&cfg.dir)[0].clone();

    // Unsealed end: refused, or accepted with the unsigned count.
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert!(e.message.contains("not sealed"), "{e}");
    let loose = Options {
        allow_unsealed: true,
        ..opts.clone()
    };
    let s = verify_with(&cfg.dir, &loose).unwrap();
    assert!(!s.sealed);
    assert!(s.unsigned_tail > 0, "{s}");

    // A torn last line (crash mid-write).
    let intact = lines(&seg).len();
    let mut f = fs::OpenOptions::new().append(true).open(&seg).unwrap();
    std::io::Write::write_all(&mut f, b"{\"id\":\"torn").unwrap();
    drop(f);
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert!(
        e.message.contains(&format!(
            "truncated tail at {}:{}",
            seg.display(),
            intact + 1
        )),
        "{e}"
    );
    assert!(
        e.message.contains(&format!("{intact} records intact")),
        "{e}"
    );
    let s = verify_with(&cfg.dir, &loose).unwrap();
    assert!(s.torn_tail.is_some());

    // Restart: the new header records the unsealed, torn predecessor.
    let ev = Evidence::start(&cfg).unwrap();
    fill(&ev, 3).await;
    assert!(ev.seal().await);
    let segs = segments(&cfg.dir);
    assert_eq!(segs.len(), 2);
    let header: Value = serde_json::from_str(&lines(&segs[1])[0]).unwrap();
    assert_eq!(header["start"], "recover");
    assert_eq!(header["predecessor"]["end"], "crash");
    assert_eq!(header["predecessor"]["torn_line"], intact as u64 + 1);
    let s = verify_with(&cfg.dir, &opts).unwrap();
    assert!(s.sealed, "{s}");
    assert!(s.notes.iter().any(|n| n.contains("torn line")), "{s}");

    // Cutting into the last complete record is not the recorded tear.
    let mut l = fs::read(&seg).unwrap();
    l.truncate(l.len() - "{\"id\":\"torn".len() - 5);
    fs::write(&seg, &l).unwrap();
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert!(e.message.contains("does not record"), "{e}");
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn time_checkpoints_bound_unsigned_records() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.checkpoint_every = 1000;
    cfg.checkpoint_interval = Duration::from_millis(100);
    let ev = Evidence::start(&cfg).unwrap();
    fill(&ev, 4).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let loose = Options {
        allow_unsealed: true,
        ..pinned(&cfg)
    };
    let s = verify_with(&cfg.dir, &loose).unwrap();
    assert_eq!(s.unsigned_tail, 0, "{s}");
    assert!(s.checkpoints >= 1);
    assert!(ev.seal().await);
    // Writes after the seal fail.
    assert!(ev.write(&mut record(1, true)).await.is_err());
    assert!(!ev.is_healthy());
    let _ = fs::remove_dir_all(&root);
}

/// `decision` follows `reason` whatever happened to the record before it
/// was written: it is derived, never set.
#[tokio::test]
async fn decision_is_derived_from_reason_when_written() {
    let root = crate::testing::scratch("evtest");
    let ev = Evidence::start(&config(&root)).unwrap();
    let mut allow_then_denied = record(0, true);
    allow_then_denied.reason = Reason::SniMismatch;
    let mut deny_then_reported = record(1, false);
    deny_then_reported.reason = Reason::ReportOnly;
    for (r, want) in [
        (&mut allow_then_denied, "deny"),
        (&mut deny_then_reported, "allow"),
    ] {
        assert_eq!(r.decision_str(), want);
        let line = ev.stamp(r).unwrap();
        let fields: Value = serde_json::from_slice(line.body()).unwrap();
        assert_eq!(fields["decision"], want, "{fields:?}");
    }
    assert!(ev.seal().await);
}

/// Every record carries the reference its client is shown: opaque, the
/// same after a restart under the same key, and what `query --ref` finds.
#[tokio::test]
async fn references_are_stored_stable_and_found() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let first = {
        let ev = Evidence::start(&cfg).unwrap();
        let mut r = record(1, false);
        ev.write(&mut r).await.unwrap();
        assert!(ev.seal().await);
        r
    };
    let shown = first.shown().to_string();
    assert!(reference::is_ref(&shown), "{shown}");
    assert!(!shown.contains(&first.id));
    let again = reference::RefKey::from_seed(&key::load(&cfg.key).unwrap().to_bytes());
    assert_eq!(again.of(&first.id), shown);
    // A second instance on the same dir keeps the key, and references differ.
    let ev = Evidence::start(&cfg).unwrap();
    let mut r = record(2, false);
    ev.write(&mut r).await.unwrap();
    assert!(ev.seal().await);
    assert_ne!(r.shown(), shown);
    assert!(verify_with(&cfg.dir, &pinned(&cfg)).is_ok());
    let all: Vec<Record> = query::read_records(&cfg.dir)
        .map(|s| s.unwrap().record)
        .collect();
    let filter = crate::evidence::select::Selection {
        record: Some(shown.clone()),
        ..Default::default()
    };
    let found: Vec<&Record> = all.iter().filter(|r| filter.matches(r)).collect();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].id, first.id);
    assert_eq!(found[0].reference.as_deref(), Some(shown.as_str()));
    let _ = fs::remove_dir_all(&root);
}

/// A record with every field set, every optional one present.
fn full_record() -> Record {
    Record {
        id: "r1-6b0d-7".into(),
        reference: Some("0011223344556677".into()),
        ts: "2026-12-01T02:03:04.000005Z".into(),
        kind: Kind::Http,
        event: Event::Close,
        org: Some(Arc::from("acme")),
        client: Some("[2001:db8::1]:4444".parse().unwrap()),
        mode: Mode::Socks5,
        host: Some("a.example.com".into()),
        port: Some(443),
        sni: Some("a.example.com".into()),
        ip: Some("198.18.7.7".parse().unwrap()),
        decision: "allow",
        reason: Reason::RuleMatch,
        rule: Some(Arc::from("acme/allow/0")),
        policy: Arc::from("p0"),
        baseline: Some(Arc::from("b0")),
        layer: Some(crate::policy::Layer::Org),
        would_deny: Some(Reason::NoMatchingRule),
        method: Some("GET".into()),
        path: Some("/x?q=\"1\"&\u{7}\u{2028}é".into()),
        detail: Some("line\nbreak\ttab\\".into()),
        conn: Some("r1-6b0d-6".into()),
        bytes_up: Some(u64::MAX),
        bytes_down: Some(0),
        duration_ms: Some(12),
        qtype: Some("AAAA".into()),
        answers: Some(vec!["198.18.0.1".into(), "2001:db8::2".into()].into()),
        upstream: Some(false),
        intercepted: Some(true),
        status: Some(204),
        credential: Some("cred-1".into()),
        tunnel: Some(crate::config::Carry::TlsOrHttp),
        service: None,
        proto: Some("udp".into()),
        count: Some(3),
        reasons: Some([("sni_mismatch".to_string(), 1), ("a".to_string(), 2)].into()),
        hosts: Some([("z.test".to_string(), 1), ("other".to_string(), 2)].into()),
        window: Some(["t0".into(), "t1".into()]),
        grant: None,
        decider: None,
        owed: None,
        differs: None,
        synthetic: Some("198.19.128.4".parse().unwrap()),
    }
}

/// The record serialised once, straight to canonical form, is the line the
/// `serde_json::Value` path made before: old and new files chain alike.
#[test]
fn one_serialisation_gives_the_canonical_line() {
    for r in [
        full_record(),
        record(3, true),
        record(4, false).close(1, 2, 3),
    ] {
        let Value::Object(mut m) = serde_json::to_value(&r).unwrap() else {
            panic!()
        };
        let (want_hash, want) = chain::seal_line(&mut m, 41, chain::GENESIS);
        let mut line = Vec::new();
        let hash = Prepared::of(&r)
            .unwrap()
            .seal_into(41, chain::GENESIS, &mut line);
        assert_eq!(
            String::from_utf8(line).unwrap(),
            String::from_utf8(want).unwrap()
        );
        assert_eq!(hash, want_hash);
    }
}

fn ids_in(dir: &Path) -> Vec<String> {
    segments(dir)
        .iter()
        .flat_map(|p| lines(p))
        .map(|l| {
            let v: Value = serde_json::from_str(&l).unwrap();
            v["id"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

/// Many tasks on two worker threads write at once: every acknowledged
/// record is in the file when its write returns, each exactly once, records
/// share writes (group commit), and the chain verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_share_writes_and_every_ack_is_on_disk() {
    for durability in [
        crate::config::Durability::Os,
        crate::config::Durability::Fsync,
    ] {
        let root = crate::testing::scratch("evtest");
        let mut cfg = config(&root);
        cfg.durability = durability;
        cfg.checkpoint_every = 50;
        let ev = Arc::new(Evidence::start(&cfg).unwrap());
        let seg = ev.first_segment().to_path_buf();
        const TASKS: u32 = 64;
        const EACH: u32 = 8;
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let ev = ev.clone();
            let seg = seg.clone();
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                for i in 0..EACH {
                    let mut r = record(t * EACH + i, true);
                    ev.write(&mut r).await.unwrap();
                    let on_disk = fs::read_to_string(&seg).unwrap();
                    assert!(
                        on_disk.contains(&format!("\"id\":\"{}\"", r.id)),
                        "{} acknowledged but not in the file",
                        r.id
                    );
                    ids.push(r.id.clone());
                    ev.submit(&mut r.close(1, 2, 3));
                }
                ids
            }));
        }
        let mut acked = Vec::new();
        for t in tasks {
            acked.extend(t.await.unwrap());
        }
        let batches = ev.log.batches();
        assert!(ev.seal().await);
        let written = ids_in(&cfg.dir);
        for id in &acked {
            assert_eq!(written.iter().filter(|w| *w == id).count(), 1, "{id}");
        }
        let records = (TASKS * EACH * 2) as u64;
        assert!(
            batches < records,
            "{durability:?}: {batches} writes for {records} records"
        );
        let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
        assert_eq!(s.allow, (TASKS * EACH) as u64);
        assert_eq!(s.closes, (TASKS * EACH) as u64);
        assert!(s.sealed);
        let _ = fs::remove_dir_all(&root);
    }
}

/// Tunnels that decide in the same tick of a one-worker runtime (the
/// proxy pinned to one core) share one write: 64 writes, each acknowledged
/// only once its record is in the file, take a few writes, not 64. With the
/// store failing, every one of them is refused and none is in the chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn decisions_of_one_tick_share_a_write_on_one_worker() {
    const TUNNELS: u32 = 64;
    /// Spawned from a task on the worker, so that all are ready in the
    /// same tick; each checks that its record is in the file when its
    /// write returns.
    async fn burst(ev: &Arc<Evidence>, seg: &Path, from: u32) -> Vec<(String, bool)> {
        let ev = ev.clone();
        let seg = seg.to_path_buf();
        tokio::spawn(async move {
            let tasks: Vec<_> = (from..from + TUNNELS)
                .map(|i| {
                    let ev = ev.clone();
                    let seg = seg.clone();
                    tokio::spawn(async move {
                        let mut r = record(i, true);
                        let ok = ev.write(&mut r).await.is_ok();
                        if ok {
                            let on_disk = fs::read_to_string(&seg).unwrap();
                            assert!(
                                on_disk.contains(&format!("\"id\":\"{}\"", r.id)),
                                "{} acknowledged but not in the file",
                                r.id
                            );
                        }
                        (r.id, ok)
                    })
                })
                .collect();
            let mut done = Vec::new();
            for t in tasks {
                done.push(t.await.unwrap());
            }
            done
        })
        .await
        .unwrap()
    }
    let (root, cfg, ev, before) = riding_log();
    let ev = Arc::new(ev);
    let seg = ev.first_segment().to_path_buf();
    let done = burst(&ev, &seg, 0).await;
    assert!(
        done.iter().all(|(_, ok)| *ok),
        "a write failed on a healthy store"
    );
    let writes = ev.log.batches() - before;
    // A tick ends at the latest after the runtime's event interval (61
    // polls), so a burst of 64 may span two or three.
    assert!(
        writes <= 4,
        "{writes} writes for {TUNNELS} decisions of one tick"
    );

    ev.log.fail_next_write();
    let refused = burst(&ev, &seg, 1000).await;
    assert!(
        refused.iter().all(|(_, ok)| !*ok),
        "a decision acknowledged from a failing store"
    );
    assert!(ev.seal().await);
    let written = ids_in(&cfg.dir);
    for (id, _) in &refused {
        assert!(!written.contains(id), "{id} refused but in the chain");
    }
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert_eq!(s.allow, u64::from(TUNNELS));
    let _ = fs::remove_dir_all(&root);
}

/// Writers that arrive while a batch is being written wait and go out
/// together: one write for all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_waiting_on_a_busy_log_go_out_in_one_write() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.checkpoint_interval = Duration::from_secs(3600);
    let ev = Arc::new(Evidence::start(&cfg).unwrap());
    ev.pause_writer(true);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let ev = ev.clone();
        tasks.push(tokio::spawn(async move {
            ev.write(&mut record(i, true)).await.is_ok()
        }));
    }
    while ev.queued() < 32 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = ev.log.batches();
    ev.pause_writer(false);
    for t in tasks {
        assert!(t.await.unwrap());
    }
    assert_eq!(ev.log.batches() - before, 1);
    assert!(ev.seal().await);
    verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    let _ = fs::remove_dir_all(&root);
}

/// A write that fails (half of it reached the disk) fails every waiter of
/// its batch, makes the log unhealthy, is cut off the file, and keeps the
/// submitted records; writing recovers by itself with an `outage` record
/// and the chain verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_fails_its_whole_batch_and_recovers() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let ev = Arc::new(Evidence::start(&cfg).unwrap());
    fill(&ev, 4).await;
    let errors_before = ev.live().write_errors();
    ev.pause_writer(true);
    let mut tasks = Vec::new();
    for i in 0..16 {
        let ev = ev.clone();
        tasks.push(tokio::spawn(async move {
            let mut r = record(100 + i, true);
            let ok = ev.write(&mut r).await.is_ok();
            (r.id, ok)
        }));
    }
    let mut kept = record(200, false);
    ev.submit(&mut kept);
    while ev.queued() < 17 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ev.log.fail_next_write();
    ev.pause_writer(false);
    let mut failed = Vec::new();
    for t in tasks {
        let (id, ok) = t.await.unwrap();
        assert!(!ok, "{id} acknowledged from a failed write");
        failed.push(id);
    }
    assert!(!ev.is_healthy());
    assert!(ev.live().write_errors() > errors_before);
    // The duties thread retries by itself.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ev.is_healthy() {
        assert!(std::time::Instant::now() < deadline, "never recovered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ev.write(&mut record(301, true)).await.unwrap();
    assert!(ev.seal().await);
    let written = ids_in(&cfg.dir);
    for id in &failed {
        assert!(!written.contains(id), "{id} failed but is in the chain");
    }
    assert!(
        written.contains(&kept.id),
        "the submitted record was dropped"
    );
    let all: String = segments(&cfg.dir).iter().flat_map(|p| lines(p)).collect();
    assert!(all.contains("\"failed_writes\":16"), "{all}");
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.sealed);
    let _ = fs::remove_dir_all(&root);
}

/// Pairs of an allow and its close in the riding tests.
const N: u32 = 200;

/// A log whose only writes are its records' (no checkpoint by time), and
/// its writes so far.
fn riding_log() -> (PathBuf, EvidenceConfig, Evidence, u64) {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.checkpoint_interval = Duration::from_secs(3600);
    let ev = Evidence::start(&cfg).unwrap();
    let before = ev.log.batches();
    (root, cfg, ev, before)
}

/// A submitted record costs no write of its own: allows and their closes,
/// one after the other as tunnels at c=1 go, take about one write per
/// allow (the close rides the next allow's batch), where writing each
/// record on a free log took two. A record left alone is written within
/// `RIDE_LAG` by the duties thread.
#[tokio::test]
async fn submitted_records_ride_the_next_batch() {
    let (root, cfg, ev, before) = riding_log();
    fill_org(&ev, None, N).await;
    let batches = ev.log.batches() - before;
    // The duties thread may write a few closes alone when it is due
    // between two allows (every `RIDE_LAG` at most).
    assert!(
        batches <= u64::from(N + N / 4),
        "{batches} writes for {N} allows and {N} closes"
    );
    let mut alone = record(N, false);
    ev.submit(&mut alone);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !fs::read_to_string(ev.first_segment())
        .unwrap()
        .contains(&alone.id)
    {
        assert!(std::time::Instant::now() < deadline, "never written");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(ev.seal().await);
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert_eq!(s.closes, u64::from(N));
    let _ = fs::remove_dir_all(&root);
}

/// A decision whose caller found the log held by the duties thread (a
/// look between its writes) is still written: the duties thread, which
/// leaves a batch someone waits on to that caller, wakes the caller when
/// it lets go. It used to let go silently, and the caller, asleep on its
/// batch, waited until another decision came to lead it: with none, for
/// ever (a tunnel at a quiet time never got its answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_that_found_the_log_held_is_written_without_another_coming() {
    let (root, _cfg, ev, _) = riding_log();
    let ev = Arc::new(ev);
    for round in 0..20 {
        // A close rides: the duties thread looks again within `RIDE_LAG`.
        ev.submit(&mut record(1000 + round, true).close(1, 2, 3));
        let held = ev.log.hold();
        let writer = {
            let ev = ev.clone();
            tokio::spawn(async move { ev.write(&mut record(round, true)).await })
        };
        // The decision is appended and its caller, finding the log held,
        // goes to sleep on its batch.
        let appended = std::time::Instant::now();
        while ev.queued() < 2 {
            assert!(
                appended.elapsed() < Duration::from_secs(5),
                "never appended"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        // Let go as the duties thread's look did: without leading.
        drop(held);
        let written = tokio::time::timeout(Duration::from_secs(2), writer).await;
        assert!(
            matches!(written, Ok(Ok(Ok(())))),
            "round {round}: the decision was not written: {written:?}"
        );
    }
    assert!(ev.seal().await);
    let _ = fs::remove_dir_all(&root);
}

/// Riding costs no wake-up per record, and the duties thread writes only
/// what waited its whole `RIDE_LAG`: 200 allows and closes paced as tunnels
/// at c=1 go (the next allow a millisecond or two after a close) wake it
/// once, and every close rides the next allow's batch, but where the test
/// itself stalled for `RIDE_LAG` between two closes (a loaded machine). A
/// round every `RIDE_LAG` woke the duties thread each round and wrote the
/// pending close each time.
#[tokio::test]
async fn records_ride_without_a_wake_up_or_a_write_per_round() {
    let (root, cfg, ev, before) = riding_log();
    let mut submitted = Vec::new();
    for i in 0..N {
        let mut r = record(i, true);
        ev.write(&mut r).await.unwrap();
        submitted.push(std::time::Instant::now());
        ev.submit(&mut r.close(1, 2, 3));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let alone = ev.log.batches() - before - u64::from(N);
    let (wakes, writes) = ev.log.ride_rounds();
    submitted.push(std::time::Instant::now());
    // A close can wait its whole lag only between two closes that far
    // apart.
    let stalls = submitted
        .windows(2)
        .filter(|w| w[1] - w[0] >= super::writer::RIDE_LAG)
        .count() as u64;
    assert!(
        alone <= stalls && writes <= stalls,
        "{alone} writes of closes alone ({writes} by the duties thread) with {stalls} stalls"
    );
    // The duties thread, once woken, looks by itself while closes ride,
    // and sleeps only when a look finds none: in the instant between a
    // write taking the last close along and the next close's submit, which
    // a loaded machine (the test's thread descheduled right there) can
    // stretch now and then. A wake-up per round, as before riding went
    // without one, would be N.
    let windows = u64::from(N) / 20;
    assert!(
        wakes <= 1 + stalls + windows,
        "{wakes} wake-ups with {stalls} stalls, for {N} closes"
    );
    assert!(ev.seal().await);
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert_eq!(s.closes, u64::from(N));
    let _ = fs::remove_dir_all(&root);
}

/// Record ids name the replica, and every segment header carries it.
#[tokio::test]
async fn the_replica_is_in_ids_and_headers() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.replica = "eu-1.b".into();
    cfg.rotate_size = 2000;
    let ev = Evidence::start(&cfg).unwrap();
    let mut r = record(1, true);
    ev.write(&mut r).await.unwrap();
    assert!(r.id.starts_with("eu-1.b-"), "{}", r.id);
    fill(&ev, 10).await;
    assert_eq!(ev.live().replica(), "eu-1.b");
    assert!(ev.seal().await);
    let segs = segments(&cfg.dir);
    assert!(segs.len() >= 2);
    for seg in &segs {
        let header: Value = serde_json::from_str(&lines(seg)[0]).unwrap();
        assert_eq!(header["event"], "segment_start");
        assert_eq!(header["replica"], "eu-1.b", "{header}");
    }
    for id in ids_in(&cfg.dir) {
        assert!(id.starts_with("eu-1.b-"), "{id}");
    }
    verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    let _ = fs::remove_dir_all(&root);
}

/// `fsync`: a `write` returns only after its batch is synced; submitted
/// records reach the file with the next batch and the disk with the next
/// sync, which the duties thread makes shortly if no `write` comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_syncs_what_is_waited_on_and_soon_the_rest() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.durability = crate::config::Durability::Fsync;
    cfg.checkpoint_every = 1000;
    cfg.checkpoint_interval = Duration::from_secs(3600);
    let ev = Evidence::start(&cfg).unwrap();
    let (before, _) = ev.log.syncs();
    ev.write(&mut record(1, true)).await.unwrap();
    let (after_write, unsynced) = ev.log.syncs();
    assert_eq!(after_write, before + 1);
    assert!(!unsynced);
    let mut close = record(2, false);
    ev.submit(&mut close);
    // It rides the next batch: the duties thread's, as no `write` comes.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !fs::read_to_string(ev.first_segment())
        .unwrap()
        .contains(&close.id)
    {
        assert!(std::time::Instant::now() < deadline, "never written");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (after_submit, unsynced) = ev.log.syncs();
    // Written, not synced yet (unless the duties thread was already quick).
    assert!(unsynced || after_submit > after_write);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ev.log.syncs().1 {
        assert!(std::time::Instant::now() < deadline, "never synced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ev.log.syncs().0 > after_write);
    assert!(ev.seal().await);
    verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    let _ = fs::remove_dir_all(&root);
}

#[tokio::test]
async fn the_tap_sees_each_record_once_written_with_its_chain_fields() {
    let dir = tempfile::tempdir().unwrap();
    let ev = Evidence::open(&dir.path().join("ev")).unwrap();
    // Nobody listens: nothing is copied, nothing kept.
    fill(&ev, 2).await;
    let mut rx = ev.live().tap().subscribe();
    fill(&ev, 3).await;
    // Records only (decisions, and closes once written), in chain order.
    let mut seqs = Vec::new();
    let mut decisions = 0;
    while let Ok(line) = rx.try_recv() {
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert!(v["event"] == "decision" || v["event"] == "close", "{v}");
        decisions += usize::from(v["event"] == "decision");
        assert!(!line.ends_with(b"\n"));
        seqs.push(v["seq"].as_u64().unwrap());
    }
    assert_eq!(decisions, 3, "every awaited record is on the tap");
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    // What the tap saw is what the file holds.
    let on_disk = query::read_records(&dir.path().join("ev"))
        .map(|r| r.unwrap().seq.unwrap())
        .collect::<Vec<_>>();
    assert!(
        seqs.iter().all(|s| on_disk.contains(s)),
        "{seqs:?} {on_disk:?}"
    );
}

/// Every record of `dir` in chain order, parsed.
fn all_records(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    let mut v = Vec::new();
    segment::for_each_record(&segments(dir), 0, |m| {
        v.push(m.clone());
        true
    });
    v
}

/// Each checkpoint commits to the RFC 6962 tree of every record before
/// it, across rotations and restarts: its `tree_size`, its `root` and its
/// note, signed with the evidence key under the replica's origin.
#[tokio::test]
async fn checkpoints_commit_to_the_merkle_tree_of_every_record_before_them() {
    let root = crate::testing::scratch("evtest");
    let mut cfg = config(&root);
    cfg.replica = "gw a".into();
    cfg.rotate_size = 3000;
    sealed_chain(&cfg, 20).await;
    // A second run continues the same tree from the header it writes.
    sealed_chain(&cfg, 7).await;
    let key = key::load(&cfg.key).unwrap().verifying_key();
    let recs = all_records(&cfg.dir);
    let leaves: Vec<merkle::Hash> = recs
        .iter()
        .map(|m| merkle::record_leaf(m["hash"].as_str().unwrap()))
        .collect();
    let mut checked = 0;
    for (i, m) in recs.iter().enumerate() {
        match m["event"].as_str().unwrap() {
            "checkpoint" | "seal" => {
                assert_eq!(m["tree_size"], i as u64, "{m:?}");
                let want = data_encoding::HEXLOWER.encode(&merkle::root(&leaves[..i]));
                assert_eq!(m["root"], want);
                let c = note::open_checkpoint(m["note"].as_str().unwrap(), &key).unwrap();
                assert_eq!(c.origin, "palisade/gw%20a");
                assert_eq!(
                    (c.size, data_encoding::HEXLOWER.encode(&c.root)),
                    (i as u64, want)
                );
                checked += 1;
            }
            "segment_start" => {
                let (base, f) = merkle::frontier_of_json(&m["tree"]).unwrap();
                assert_eq!((base, f.size()), (0, i as u64));
                assert_eq!(f.root(), merkle::root(&leaves[..i]));
            }
            _ => {}
        }
    }
    assert!(checked >= 6, "{checked}");
    assert!(segments(&cfg.dir).len() >= 3);
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert_eq!(s.merkle_checkpoints, checked);
    assert_eq!(s.formats, vec![chain::FORMAT.to_string()]);
    assert!(
        s.to_string().contains("checkpoint roots match the records"),
        "{s}"
    );
    let _ = fs::remove_dir_all(&root);
}

/// The key holder rewrites a record, re-links the chain and re-signs
/// every checkpoint: the first checkpoint whose root no longer matches
/// the records is named. A truncated or edited note, or one for another
/// tree size, fails too.
#[tokio::test]
async fn a_rewritten_past_fails_at_the_first_inconsistent_checkpoint() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    sealed_chain(&cfg, 12).await;
    let sk = key::load(&cfg.key).unwrap();
    let opts = pinned(&cfg);
    let seg = segments(&cfg.dir)[0].clone();
    let orig = lines(&seg);
    let first_ckpt = orig
        .iter()
        .position(|l| l.contains("\"event\":\"checkpoint\""))
        .unwrap();

    let mut l = orig.clone();
    l[2] = l[2].replace("h1.test", "h9.test");
    assert_ne!(l[2], orig[2]);
    rechain_signed(&mut l, 2, &sk);
    write_lines(&seg, &l);
    let e = verify_with(&cfg.dir, &opts).unwrap_err();
    assert_eq!(e.line, first_ckpt as u64 + 1, "{e}");
    assert!(e.message.contains("inconsistent checkpoint"), "{e}");

    type Edit = fn(&mut serde_json::Map<String, Value>);
    let cases: [(&str, Edit); 4] = [
        ("truncated note", |m| {
            let n = m["note"].as_str().unwrap();
            m["note"] = n[..n.len() - 10].into();
        }),
        ("edited note", |m| {
            let n = m["note"]
                .as_str()
                .unwrap()
                .replacen("palisade/", "palisadE/", 1);
            m["note"] = n.into();
        }),
        ("note of another tree size", |m| {
            m["tree_size"] = (m["tree_size"].as_u64().unwrap() + 1).into();
        }),
        ("no note", |m| {
            m.remove("note");
        }),
    ];
    for (what, edit) in cases {
        let mut l = orig.clone();
        let Value::Object(mut m) = serde_json::from_str(&l[first_ckpt]).unwrap() else {
            panic!()
        };
        edit(&mut m);
        l[first_ckpt] = Value::Object(m).to_string();
        rechain_signed(&mut l, first_ckpt, &sk);
        write_lines(&seg, &l);
        let e = verify_with(&cfg.dir, &opts).unwrap_err();
        assert_eq!(e.line, first_ckpt as u64 + 1, "{what}: {e}");
        assert!(
            e.message.contains("note") || e.message.contains("tree_size"),
            "{what}: {e}"
        );
    }
    let _ = fs::remove_dir_all(&root);
}

/// A store written before the Merkle tree (format `/1`: no `tree` in
/// headers, no `tree_size`, `root`, `note` in checkpoints) still
/// verifies; the next start rebuilds the tree from its records and its
/// checkpoints commit to every record since the first.
#[tokio::test]
async fn an_old_store_verifies_and_is_continued_with_the_tree() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    sealed_chain(&cfg, 9).await;
    let sk = key::load(&cfg.key).unwrap();
    let seg = segments(&cfg.dir)[0].clone();
    let mut l: Vec<String> = lines(&seg)
        .iter()
        .map(|line| {
            let Value::Object(mut m) = serde_json::from_str(line).unwrap() else {
                panic!()
            };
            for k in ["tree", "tree_size", "root", "note"] {
                m.remove(k);
            }
            if m["event"] == "segment_start" {
                m["format"] = "palisade-evidence/1".into();
            }
            Value::Object(m).to_string()
        })
        .collect();
    rechain_signed(&mut l, 0, &sk);
    write_lines(&seg, &l);
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert_eq!(s.merkle_checkpoints, 0);
    assert_eq!(s.formats, vec!["palisade-evidence/1".to_string()]);
    assert!(
        s.to_string().contains("no checkpoint with a tree root"),
        "{s}"
    );

    sealed_chain(&cfg, 4).await;
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.merkle_checkpoints >= 1, "{s}");
    let header = &all_records(&cfg.dir)[l.len()];
    assert_eq!(header["tree"]["base"], 0);
    assert_eq!(header["tree"]["size"], l.len() as u64);
    let _ = fs::remove_dir_all(&root);
}

/// Replace the signing key file of `cfg` with the seed `seed`.
fn set_key(cfg: &EvidenceConfig, seed: u8) -> ed25519_dalek::SigningKey {
    use std::os::unix::fs::PermissionsExt;
    let k = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]);
    fs::write(
        &cfg.key,
        format!("{}\n", data_encoding::HEXLOWER.encode(&[seed; 32])),
    )
    .unwrap();
    fs::set_permissions(&cfg.key, fs::Permissions::from_mode(0o600)).unwrap();
    k
}

#[tokio::test]
async fn a_key_changes_only_through_a_signed_rotation_record() {
    let root = crate::testing::scratch("evrot");
    let cfg = config(&root);
    fs::create_dir_all(&root).unwrap();
    let old = set_key(&cfg, 20);
    let next = ed25519_dalek::SigningKey::from_bytes(&[21; 32]);
    {
        let ev = Evidence::start(&cfg).unwrap();
        fill(&ev, 7).await;
        ev.rotate_key(next.clone()).unwrap();
        fill(&ev, 7).await;
        assert!(ev.seal().await);
    }
    // Restarted with the new key in the config: the chain goes on.
    set_key(&cfg, 21);
    sealed_chain(&cfg, 4).await;
    let with = |k: &ed25519_dalek::SigningKey| Options {
        key: Some(k.verifying_key()),
        allow_unsealed: false,
    };
    // Given the old key, verify follows the signed rotation.
    let s = verify_with(&cfg.dir, &with(&old)).unwrap();
    assert!(s.notes.iter().any(|n| n.contains("key rotated to")), "{s}");
    let rotation = segments(&cfg.dir)
        .iter()
        .flat_map(|p| lines(p))
        .find(|l| l.contains("\"key_rotation\""))
        .unwrap();
    let v: Value = serde_json::from_str(&rotation).unwrap();
    assert_eq!(v["key"], key::public_hex(&old));
    assert_eq!(v["next_key"], key::public_hex(&next));
    // Without a pinned key the first header's key is followed the same way.
    verify_with(&cfg.dir, &Options::default()).unwrap();
    // The new key alone does not verify the checkpoints before it.
    assert!(verify_with(&cfg.dir, &with(&next)).is_err());
    // A key changed with no rotation record (restart with a third key).
    set_key(&cfg, 22);
    sealed_chain(&cfg, 3).await;
    let e = verify_with(&cfg.dir, &with(&old)).unwrap_err();
    assert!(e.message.contains("unannounced key change"), "{e}");
    let _ = fs::remove_dir_all(&root);
}

/// `write_now` writes on the caller's thread, one `write(2)` per record,
/// with what rode along, and the chain verifies; while the writer is
/// paused (as a leader at work would be) it does nothing and stamps
/// nothing, so the caller can wait with `write` instead; after the seal it
/// refuses.
#[tokio::test]
async fn a_record_written_now_is_written_at_once_or_left_untouched() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let ev = Evidence::start(&cfg).unwrap();
    let before = ev.log.batches();
    let mut riding = record(0, false);
    ev.submit(&mut riding);
    let mut ids = Vec::new();
    for i in 1..=3 {
        let mut r = record(i, true);
        assert!(matches!(ev.write_now(&mut r), Some(Ok(()))));
        assert!(!r.id.is_empty() && r.reference.is_some());
        ids.push(r.id);
    }
    assert_eq!(ev.log.batches() - before, 3, "one write per record");
    assert_eq!(ev.queued(), 0, "the submitted record rode the first");
    let text = fs::read_to_string(ev.first_segment()).unwrap();
    assert!(text.contains(&riding.id) && ids.iter().all(|id| text.contains(id)));

    ev.pause_writer(true);
    let mut waits = record(4, true);
    assert!(ev.write_now(&mut waits).is_none());
    assert!(waits.id.is_empty(), "nothing stamped");
    assert_eq!(ev.queued(), 0, "nothing appended");
    ev.pause_writer(false);
    assert!(matches!(ev.write_now(&mut waits), Some(Ok(()))));

    assert!(ev.seal().await);
    assert!(ev
        .write_now(&mut record(5, true))
        .is_none_or(|r| r.is_err()));
    let s = verify_with(&cfg.dir, &pinned(&cfg)).unwrap();
    assert!(s.sealed);
    assert_eq!(s.allow, 4);
    let _ = fs::remove_dir_all(&root);
}

/// A failed `write_now` answers as a failed `write` does: an error, and
/// the place in the queue given back.
#[tokio::test]
async fn a_failed_write_now_is_an_error_and_gives_its_place_back() {
    let root = crate::testing::scratch("evtest");
    let cfg = config(&root);
    let ev = Evidence::start(&cfg).unwrap();
    let free = ev.log.slots.available_permits();
    ev.fail_next_write();
    assert!(matches!(ev.write_now(&mut record(0, true)), Some(Err(_))));
    assert_eq!(ev.log.slots.available_permits(), free);
    let _ = fs::remove_dir_all(&root);
}
