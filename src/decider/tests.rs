//! The decider's answers judged (pure), and consultations through a real
//! socket to a small server on loopback that answers as told.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

fn said(decision: Answer, ttl: Option<&str>) -> Said {
    Said {
        decision,
        ttl: ttl.map(str::to_string),
        error: None,
    }
}

#[test]
fn answers_are_judged_strictly() {
    assert_eq!(
        judge(200, br#"{"decision":"allow","ttl":"10m"}"#),
        said(Answer::Allow, Some("10m"))
    );
    assert_eq!(
        judge(200, br#"{"decision":"allow","ttl":"10m"}"#).ttl(),
        Some(Duration::from_secs(600))
    );
    assert_eq!(
        judge(200, br#"{"decision":"allow"}"#),
        said(Answer::Allow, None)
    );
    assert_eq!(
        judge(200, br#"{"decision":"deny"}"#),
        said(Answer::Deny, None)
    );
    assert_eq!(
        judge(200, br#"{"decision":"ask"}"#),
        said(Answer::Ask, None)
    );
    for (status, body, wants) in [
        (500, &br#"{"decision":"allow"}"#[..], "status 500"),
        (200, b"allow", "not a decider answer"),
        (200, br#"{"decision":"yes"}"#, "not a decider answer"),
        (
            200,
            br#"{"decision":"allow","extra":1}"#,
            "not a decider answer",
        ),
        (
            200,
            br#"{"decision":"allow","ttl":"25h"}"#,
            "within 1s to 24h",
        ),
        (
            200,
            br#"{"decision":"allow","ttl":"0s"}"#,
            "within 1s to 24h",
        ),
        (200, br#"{"decision":"allow","ttl":"long"}"#, "ttl \"long\""),
        (
            200,
            br#"{"decision":"deny","ttl":"1m"}"#,
            "other than allow",
        ),
        (200, b"", "not a decider answer"),
    ] {
        let s = judge(status, body);
        assert_eq!(s.decision, Answer::Deny, "{body:?}");
        assert_eq!(s.ttl(), None);
        let error = s.error.unwrap_or_default();
        assert!(error.contains(wants), "{body:?}: {error}");
    }
    // As the record carries it.
    let json = serde_json::to_string(&Said::failed("timeout after 500ms".into())).unwrap();
    assert_eq!(json, r#"{"decision":"deny","error":"timeout after 500ms"}"#);
}

/// How the test server answers.
#[derive(Clone, Copy)]
enum Serve {
    /// 200 with this body.
    Body(&'static str),
    /// Nothing for this long, then `{"decision":"allow"}`.
    Slow(Duration),
    /// 200 with a body of this many bytes.
    Long(usize),
}

/// A server on loopback answering every connection as `serve`; the
/// questions it received come back through the channel.
async fn server(serve: Serve) -> (String, tokio::sync::mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                // The head and the body: read until the JSON closes.
                while !got.ends_with(b"}") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = tx.send(String::from_utf8_lossy(&got).into_owned()).await;
                let body = match serve {
                    Serve::Body(b) => b.to_string(),
                    Serve::Slow(d) => {
                        tokio::time::sleep(d).await;
                        r#"{"decision":"allow"}"#.to_string()
                    }
                    Serve::Long(n) => format!(r#"{{"decision":"deny","pad":"{}"}}"#, "x".repeat(n)),
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(body.as_bytes()).await;
            });
        }
    });
    (format!("http://{addr}/decide"), rx)
}

fn decider(url: &str, timeout: Duration, max_in_flight: usize) -> Decider {
    Decider::new(&DeciderConfig {
        url: url.to_string(),
        timeout,
        max_in_flight,
    })
}

fn question() -> Question<'static> {
    Question {
        org: "acme",
        client: "198.18.1.2".into(),
        host: "new.example.com",
        port: Some(443),
        mode: "explicit",
        method: None,
        path: None,
    }
}

#[tokio::test]
async fn a_consultation_posts_the_miss_and_reads_the_answer() {
    let (url, mut asked) = server(Serve::Body(r#"{"decision":"allow","ttl":"10m"}"#)).await;
    let d = decider(&url, Duration::from_secs(5), 4);
    assert_eq!(
        d.consult(&question()).await,
        said(Answer::Allow, Some("10m"))
    );
    let request = asked.recv().await.unwrap();
    assert!(
        request.starts_with("POST /decide HTTP/1.1\r\n"),
        "{request}"
    );
    assert!(
        request.ends_with(
            r#"{"org":"acme","client":"198.18.1.2","host":"new.example.com","port":443,"mode":"explicit"}"#
        ),
        "{request}"
    );
}

#[tokio::test]
async fn slow_long_and_absent_deciders_are_denials_with_their_error() {
    let (slow, _a) = server(Serve::Slow(Duration::from_secs(5))).await;
    let s = decider(&slow, Duration::from_millis(200), 4)
        .consult(&question())
        .await;
    assert_eq!(s.decision, Answer::Deny);
    assert_eq!(s.error.as_deref(), Some("timeout after 200ms"));

    let (long, _b) = server(Serve::Long(MAX_ANSWER_BYTES)).await;
    let s = decider(&long, Duration::from_secs(5), 4)
        .consult(&question())
        .await;
    assert_eq!(s.decision, Answer::Deny);
    assert!(s.error.unwrap().contains("length limit"));

    // Nothing listens there (bound, then closed).
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    let s = decider(&format!("http://{addr}/"), Duration::from_secs(5), 4)
        .consult(&question())
        .await;
    assert_eq!(s.decision, Answer::Deny);
    assert!(s.error.unwrap().starts_with("connect "));
}

#[tokio::test]
async fn consultations_past_the_bound_are_denied_without_asking() {
    let (slow, mut asked) = server(Serve::Slow(Duration::from_millis(600))).await;
    let d = std::sync::Arc::new(decider(&slow, Duration::from_secs(5), 2));
    let q = question();
    // A flood of 20 at once: two are asked, the rest denied at once.
    let flood: Vec<_> = (0..20)
        .map(|_| {
            let d = d.clone();
            let q = q.clone();
            tokio::spawn(async move { d.consult(&q).await })
        })
        .collect();
    let mut allowed = 0;
    let mut busy = 0;
    for t in flood {
        let s = t.await.unwrap();
        match (s.decision, s.error.as_deref()) {
            (Answer::Allow, None) => allowed += 1,
            (Answer::Deny, Some("busy: 2 consultations in flight")) => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((allowed, busy), (2, 18));
    let mut questions = 0;
    while asked.try_recv().is_ok() {
        questions += 1;
    }
    assert_eq!(questions, 2);
}
