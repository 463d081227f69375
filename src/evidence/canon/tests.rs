//! The hand-written canonical form is byte for byte `Prepared::of`'s, with
//! the chain's fields in the same places, for every shape of record.

use std::net::SocketAddr;
use std::sync::Arc;

use super::record;
use crate::config::Carry;
use crate::evidence::chain::{Prepared, GENESIS};
use crate::evidence::said::{Answer, Said};
use crate::evidence::{Event, GrantFacts, Kind, Mode, Record};
use crate::policy::{Layer, Reason, ServiceFacts, Verdict};

/// The hand-written form equals the reference, and so do their lines
/// once chained.
fn same(r: &Record) {
    let want = Prepared::of(r).expect("the reference serialises");
    let got = record(r).expect("the hand-written form serialises");
    assert_eq!(
        String::from_utf8_lossy(got.body()),
        String::from_utf8_lossy(want.body())
    );
    assert_eq!(got, want, "chain offsets differ");
    for (seq, prev) in [(0, GENESIS), (u64::MAX, "ab\"c")] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert_eq!(
            got.seal_into(seq, prev, &mut a),
            want.seal_into(seq, prev, &mut b)
        );
        assert_eq!(a, b);
    }
}

/// Every field set, written out with no `..`: a field added to `Record`
/// fails to compile here until this test (and the writer) has it.
fn full(client: SocketAddr, text: &str) -> Record {
    let s = |x: &str| format!("{x}{text}");
    Record {
        id: s("r1-6b0d-7"),
        reference: Some(s("0011223344556677")),
        ts: s("2026-12-01T02:03:04.000005Z"),
        kind: Kind::Http,
        event: Event::Close,
        org: Some(Arc::from(s("acme"))),
        client: Some(client),
        mode: Mode::Socks5,
        host: Some(s("a.example.com")),
        port: Some(65535),
        sni: Some(s("a.example.com")),
        ip: Some("198.18.7.7".parse().unwrap()),
        synthetic: Some("2001:db8::7".parse().unwrap()),
        decision: "allow",
        reason: Reason::RuleMatch,
        rule: Some(Arc::from(s("acme/allow/0"))),
        policy: Arc::from(s("p0")),
        baseline: Some(Arc::from(s("b0"))),
        layer: Some(Layer::Grant),
        would_deny: Some(Reason::NoMatchingRule),
        method: Some(s("GET")),
        path: Some(s("/x?q=\"1\"&\u{7}\u{2028}é")),
        detail: Some(s("line\nbreak\ttab\\")),
        conn: Some(s("r1-6b0d-6")),
        bytes_up: Some(u64::MAX),
        bytes_down: Some(0),
        duration_ms: Some(12),
        qtype: Some(s("AAAA").into()),
        answers: Some(vec![s("198.18.0.1"), s("2001:db8::2")].into()),
        upstream: Some(false),
        intercepted: Some(true),
        status: Some(204),
        credential: Some(s("cred-1")),
        tunnel: Some(Carry::TlsOrHttp),
        service: Some(ServiceFacts {
            name: s("git"),
            repo: Some(s("o/r")),
            refs: vec![s("update refs/heads/main")],
            operation: Some(s("push")),
            model: Some(s("m")),
        }),
        proto: Some(s("udp")),
        count: Some(3),
        reasons: Some([(s("sni_mismatch"), 1), (s("a"), 2)].into()),
        hosts: Some([(s("z.test"), 1), (s("other"), u64::MAX)].into()),
        window: Some([s("t0"), s("t1")]),
        differs: Some(vec![s("+ rule"), s("- rule")]),
        grant: Some(Box::new(grant(&s))),
        decider: Some(Said {
            decision: Answer::Ask,
            error: Some(s("timeout after 500ms")),
            ttl: Some(s("5m")),
        }),
        owed: None,
    }
}

fn grant(s: &dyn Fn(&str) -> String) -> GrantFacts {
    GrantFacts {
        approval: Some(s("ap-1")),
        approver: s("alice"),
        ended_by: Some(s("policy")),
        expires: Some(s("2026-12-01T03:00:00Z")),
        granted_at: s("2026-12-01T02:00:00Z"),
        id: s("g-1"),
        max_uses: Some(u32::MAX),
        method: Some(s("POST")),
        path: Some(s("/api/*")),
        reason: Some(s("ticket 7")),
        target: s("api.example.com"),
        uses: 0,
    }
}

#[test]
fn a_fully_populated_record_is_the_reference() {
    for client in [
        "[2001:db8::1]:4444",
        "0.0.0.0:0",
        "255.255.255.255:65535",
        "9.10.99.100:1",
    ] {
        same(&full(client.parse().unwrap(), ""));
    }
    let scoped = SocketAddr::V6(std::net::SocketAddrV6::new(
        "fe80::1".parse().unwrap(),
        80,
        7,
        3,
    ));
    same(&full(scoped, "\"\\\u{0}é"));
}

fn decision(kind: Kind, mode: Mode, reason: Reason) -> Record {
    let verdict = Verdict {
        org: None,
        reason,
        rule: reason.is_allow().then(|| Arc::from("acme/allow/0")),
        would_deny: None,
    };
    let client = "198.18.1.2:40000".parse().unwrap();
    let mut r = Record::decision(kind, mode, client, &verdict, &Arc::from("p"));
    r.id = "gw-6b0d1-41".into();
    r.reference = Some("0123456789abcdef".into());
    r.ts = "2026-12-05T18:00:00.123456Z".into();
    r.org = Some(Arc::from("acme"));
    r
}

/// One record of each shape the gateway writes.
fn every_kind() -> Vec<Record> {
    let mut out = Vec::new();
    let mut tcp = decision(Kind::Tcp, Mode::Explicit, Reason::RuleMatch);
    tcp.host = Some("allowed.bench".into());
    tcp.port = Some(443);
    tcp.ip = Some("127.0.0.1".parse().unwrap());
    tcp.tunnel = Some(Carry::Tls);
    tcp.layer = Some(Layer::Org);
    tcp.baseline = Some(Arc::from("b".repeat(64)));
    out.push(tcp.clone());
    out.push(tcp.close(100, 2000, 3));
    let mut denied = decision(Kind::Tcp, Mode::Transparent, Reason::NoMatchingRule);
    denied.host = Some("evil.test".into());
    denied.sni = Some("evil.test".into());
    denied.detail = Some("no rule".into());
    out.push(denied.clone());
    let mut http = decision(Kind::Http, Mode::Explicit, Reason::RuleMatch);
    http.method = Some("GET".into());
    http.path = Some("/x".into());
    http.intercepted = Some(true);
    http.credential = Some("cred".into());
    out.push(http.clone());
    let mut http_close = http.close(1, 2, 3);
    http_close.status = Some(200);
    out.push(http_close);
    let mut dns = decision(Kind::Dns, Mode::Dns, Reason::RuleMatch);
    dns.host = Some("allowed.bench".into());
    dns.qtype = Some("A".into());
    dns.answers = Some(vec!["127.0.0.1".into(), "::1".into()].into());
    dns.upstream = Some(false);
    out.push(dns);
    let t0 = std::time::UNIX_EPOCH + std::time::Duration::from_micros(1_700_000_000_123_456);
    let mut summary = denied.summary(17, t0, t0 + std::time::Duration::from_secs(1));
    summary.reasons = Some(
        [
            ("no_matching_rule".to_string(), 16),
            ("sni_mismatch".to_string(), 1),
        ]
        .into(),
    );
    summary.hosts = Some([("evil.test".to_string(), 15), ("other".to_string(), 2)].into());
    out.push(summary);
    let mut bypass = decision(Kind::Bypass, Mode::Transparent, Reason::NoMatchingRule);
    bypass.proto = Some("udp".into());
    bypass.ip = Some("198.18.9.9".parse().unwrap());
    bypass.port = Some(53);
    bypass.count = Some(4);
    out.push(bypass);
    let mut enforcement = decision(Kind::Enforcement, Mode::Transparent, Reason::NoMatchingRule);
    enforcement.event = Event::Failed;
    enforcement.client = None;
    enforcement.differs = Some(vec!["- table inet palisade".into()]);
    out.push(enforcement);
    let mut decider = decision(Kind::Tcp, Mode::Socks5, Reason::RuleMatch);
    decider.decider = Some(Said {
        decision: Answer::Allow,
        error: None,
        ttl: Some("10m".into()),
    });
    out.push(decider);
    let mut granted = decision(Kind::Grant, Mode::Explicit, Reason::RuleMatch);
    granted.event = Event::Granted;
    granted.grant = Some(Box::new(GrantFacts {
        approval: None,
        approver: "alice".into(),
        ended_by: None,
        expires: None,
        granted_at: "2026-12-05T18:00:00Z".into(),
        id: "g-1".into(),
        max_uses: None,
        method: None,
        path: None,
        reason: None,
        target: "api.example.com".into(),
        uses: 0,
    }));
    out.push(granted);
    let mut service = http.clone();
    service.service = Some(ServiceFacts {
        name: "git".into(),
        repo: Some("o/r".into()),
        ..ServiceFacts::default()
    });
    out.push(service);
    let mut synthetic = decision(Kind::Tcp, Mode::Transparent, Reason::RuleMatch);
    synthetic.synthetic = Some("198.19.128.4".parse().unwrap());
    synthetic.ip = Some("2001:db8::5".parse().unwrap());
    out.push(synthetic);
    let mut report = decision(Kind::Tcp, Mode::Explicit, Reason::ReportOnly);
    report.would_deny = Some(Reason::NoMatchingRule);
    out.push(report);
    let mut bare = decision(Kind::Tcp, Mode::Explicit, Reason::NoMatchingRule);
    bare.org = None;
    bare.reference = None;
    bare.rule = None;
    out.push(bare);
    out
}

#[test]
fn every_kind_of_record_is_the_reference() {
    for r in every_kind() {
        same(&r);
    }
}

/// Every enum the record writes by name is named as serde names it.
#[test]
fn every_reason_mode_and_carry_is_the_reference() {
    for reason in Reason::ALL {
        let mut r = decision(Kind::Tcp, Mode::Explicit, reason);
        r.would_deny = Some(reason);
        same(&r);
    }
    for (kind, mode, event) in [
        (Kind::Tcp, Mode::Explicit, Event::Decision),
        (Kind::Http, Mode::Transparent, Event::Close),
        (Kind::Dns, Mode::Dns, Event::Failed),
        (Kind::Bypass, Mode::Socks5, Event::Verified),
        (Kind::Enforcement, Mode::Explicit, Event::Granted),
        (Kind::Grant, Mode::Explicit, Event::Expired),
        (Kind::Grant, Mode::Explicit, Event::Revoked),
        (Kind::Grant, Mode::Explicit, Event::UsedUp),
    ] {
        let mut r = decision(kind, mode, Reason::RuleMatch);
        r.event = event;
        same(&r);
    }
    for carry in [Carry::Tls, Carry::Http, Carry::TlsOrHttp, Carry::Opaque] {
        let mut r = decision(Kind::Tcp, Mode::Explicit, Reason::RuleMatch);
        r.tunnel = Some(carry);
        same(&r);
    }
    for layer in [Layer::Baseline, Layer::Org, Layer::Grant] {
        let mut r = decision(Kind::Tcp, Mode::Explicit, Reason::RuleMatch);
        r.layer = Some(layer);
        same(&r);
    }
}

/// Strings that need escaping (quotes, backslashes, every control byte,
/// DEL, non-ASCII, line separators) in every string field, map key and
/// list, drawn by a fixed pseudo-random sequence: bounded, repeatable.
#[test]
fn strings_needing_escapes_in_every_field_are_the_reference() {
    let mut pool: Vec<char> = (0u8..0x20).map(char::from).collect();
    pool.extend([
        '"',
        '\\',
        '/',
        '\u{7f}',
        'é',
        '\u{2028}',
        '\u{2029}',
        '\u{1f600}',
        'a',
        'Z',
        '-',
        ' ',
    ]);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..300 {
        let len = (next() % 9) as usize;
        let text: String = (0..len)
            .map(|_| pool[(next() % pool.len() as u64) as usize])
            .collect();
        let client = if next() % 2 == 0 {
            "198.18.1.2:40000"
        } else {
            "[2001:db8::1]:4444"
        };
        same(&full(client.parse().unwrap(), &text));
    }
}
