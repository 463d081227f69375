//! The live decision tail: `GET /v1/decisions` on the admin listener
//! streams decision records (denial summaries among them) as NDJSON, from
//! the moment of the request, each once it is written to the evidence
//! ([`crate::evidence::tap`]).
//!
//! - It needs `Authorization: Bearer TOKEN` whose SHA-256 is in `[admin]
//!   tail_tokens` (records carry client addresses and names): otherwise 401
//!   and nothing is streamed.
//! - Filters are query parameters, each optional: `org`, `decision`
//!   (`allow`/`deny`), `reason` (a reason code), `host` (a glob: `*` any
//!   run of characters, `?` one), `kind` and `mode`: a
//!   [`Selection`], as every reader of the evidence takes. One that does not
//!   parse, one given more than once, or an unknown parameter, is a 400
//!   naming it.
//! - At most [`MAX_TAILS`] tails at once; one more is a 503.
//! - A reader slower than the records costs the proxy nothing: the tap
//!   never waits. A tail more than [`crate::evidence::tap::TAP_BUFFER`]
//!   records behind loses the oldest and gets a `{"gap": N}` line counting
//!   the records it did not see (matching its filters or not); one that
//!   stops reading altogether is cut by the admin listener's write-stall
//!   limit.
//! - On shutdown every tail ends its body cleanly (the last chunk), so the
//!   drain closes its connection.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use tokio::sync::{broadcast, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::TokenDigest;
use crate::evidence::select::{self, Selection, KINDS, MODES};
use crate::evidence::{Event, Record};
use crate::serve::http::{channel, full, Body, BodyError};

/// Tails served at once.
pub(crate) const MAX_TAILS: usize = 8;

/// Chunks (one record each) waiting for the connection to take them.
const TAIL_CHUNKS: usize = 16;

/// Who may tail, and how many tails are open.
pub(crate) struct Tails {
    tokens: Vec<TokenDigest>,
    open: Arc<Semaphore>,
}

impl Tails {
    pub(crate) fn new(tokens: Vec<TokenDigest>) -> Tails {
        Tails {
            tokens,
            open: Arc::new(Semaphore::new(MAX_TAILS)),
        }
    }

    /// Whether the request's bearer token is one of ours.
    fn authorized<B>(&self, req: &Request<B>) -> bool {
        let Some(value) = req.headers().get(http::header::AUTHORIZATION) else {
            return false;
        };
        let Some(token) = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
        else {
            return false;
        };
        let presented = TokenDigest::of(token.as_bytes());
        // Every digest compared, in constant time each.
        self.tokens
            .iter()
            .fold(false, |ok, d| d.ct_eq(&presented) | ok)
    }
}

/// The filter parameters, each taken at most once.
const FILTERS: [&str; 6] = ["org", "decision", "reason", "host", "kind", "mode"];

/// The selection a tail's query string asks for, or the line naming the
/// filter that does not parse. A filter given twice (in any spelling:
/// `o%72g` is `org`) is refused, never resolved by taking one of its
/// values.
pub(crate) fn parse_filter(query: Option<&str>) -> Result<Selection, String> {
    let mut f = Selection::default();
    let mut seen = [false; FILTERS.len()];
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if let Some(i) = FILTERS.iter().position(|k| *k == key) {
            if std::mem::replace(&mut seen[i], true) {
                return Err(format!(
                    "filter {key} given more than once: each filter takes one value"
                ));
            }
        }
        let value = value.trim();
        let bad = |why: String| format!("filter {key}={value:?}: {why}");
        match key.as_ref() {
            "org" if !value.is_empty() => f.org = Some(value.to_string()),
            "org" => return Err(bad("expected an org name".into())),
            "decision" => f.decision = Some(select::parse_decision(value).map_err(bad)?),
            "reason" => f.reason = Some(select::parse_reason(value).map_err(bad)?),
            "host" => f.host = Some(select::parse_host(value).map_err(bad)?),
            "kind" if KINDS.contains(&value) => f.kind = Some(value.to_string()),
            "kind" => return Err(bad("expected tcp, http, dns or bypass".into())),
            "mode" if MODES.contains(&value) => f.mode = Some(value.to_string()),
            "mode" => return Err(bad("expected explicit, transparent, dns or socks5".into())),
            _ => return Err(format!("unknown filter {key:?} ({})", FILTERS.join(", "))),
        }
    }
    Ok(f)
}

/// Whether a tail passes `r` on: a decision record `filter` selects.
fn passes(filter: &Selection, r: &Record) -> bool {
    r.event == Event::Decision && filter.matches(r)
}

fn status(code: StatusCode, text: String) -> Response<Body> {
    let mut resp = Response::new(full(format!("{text}\n")));
    *resp.status_mut() = code;
    resp
}

/// Answer `GET /v1/decisions`: 401, 400, 503, or a stream that starts
/// with the records written after this call.
pub(crate) fn respond<B>(
    tails: &Tails,
    tap: &crate::evidence::tap::Tap,
    shutdown: &CancellationToken,
    req: &Request<B>,
) -> Response<Body> {
    if !tails.authorized(req) {
        let mut resp = status(
            StatusCode::UNAUTHORIZED,
            "a tail needs Authorization: Bearer TOKEN, a token listed in [admin] tail_tokens"
                .into(),
        );
        resp.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        return resp;
    }
    let filter = match parse_filter(req.uri().query()) {
        Ok(f) => f,
        Err(e) => return status(StatusCode::BAD_REQUEST, e),
    };
    let Ok(permit) = tails.open.clone().try_acquire_owned() else {
        return status(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_TAILS} tails are open already"),
        );
    };
    // Subscribed before the answer: nothing written after the request is missed.
    let rx = tap.subscribe();
    let (tx, body) = channel(TAIL_CHUNKS);
    tokio::spawn(stream(rx, filter, tx, shutdown.clone(), permit));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-ndjson"),
    );
    resp
}

/// Copy matching records to the body until the client goes, the tap
/// closes or shutdown comes (then the body ends: the drain can close).
async fn stream(
    mut rx: broadcast::Receiver<Bytes>,
    filter: Selection,
    mut tx: http_body_util::channel::Sender<Bytes, BodyError>,
    shutdown: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    loop {
        let line = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = rx.recv() => match r {
                Ok(line) => {
                    let keep = serde_json::from_slice::<Record>(&line)
                        .is_ok_and(|r| passes(&filter, &r));
                    if !keep {
                        continue;
                    }
                    let mut chunk = BytesMut::with_capacity(line.len() + 1);
                    chunk.extend_from_slice(&line);
                    chunk.extend_from_slice(b"\n");
                    chunk.freeze()
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    Bytes::from(format!("{{\"gap\": {n}}}\n"))
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            sent = tx.send_data(line) => if sent.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Reason;

    #[test]
    fn filters_parse_or_name_the_one_that_does_not() {
        let f = parse_filter(Some(
            "org=acme&decision=deny&reason=no_matching_rule&host=*.wild.test&kind=http&mode=explicit",
        ))
        .unwrap();
        assert_eq!(f.org.as_deref(), Some("acme"));
        assert_eq!(f.decision, Some("deny"));
        assert_eq!(f.reason, Some(Reason::NoMatchingRule));
        assert_eq!(f.host.as_deref(), Some("*.wild.test"));
        assert_eq!(parse_filter(None).unwrap(), Selection::default());
        for (q, named) in [
            ("decision=maybe", "filter decision=\"maybe\""),
            ("reason=nope", "filter reason=\"nope\""),
            ("kind=udp", "filter kind=\"udp\""),
            ("mode=x", "filter mode=\"x\""),
            ("host=a%20b", "filter host=\"a b\""),
            ("org=", "filter org=\"\""),
            ("colour=red", "unknown filter \"colour\""),
            // Repeats are refused, whatever the values and the spelling.
            ("org=acme&org=beta", "filter org given more than once"),
            ("org=acme&o%72g=beta", "filter org given more than once"),
            ("decision=deny&decision=deny", "filter decision given more"),
            (
                "reason=rule_match&reason=auth_failed",
                "filter reason given more",
            ),
            ("host=a.test&host=b.test", "filter host given more"),
            ("kind=http&kind=tcp", "filter kind given more"),
            ("mode=dns&mode=dns", "filter mode given more"),
        ] {
            let e = parse_filter(Some(q)).unwrap_err();
            assert!(e.starts_with(named), "{q}: {e}");
        }
    }

    /// An HTTP request's denial, with the fields of `json` over it.
    fn rec(json: &str) -> Record {
        let http = r#"{"kind": "http", "host": "other.test", "port": 80}"#;
        crate::testing::record(&[http, json])
    }

    #[test]
    fn a_filter_passes_decisions_that_match_every_field() {
        let f = parse_filter(Some("org=acme&decision=deny&host=*.test")).unwrap();
        assert!(passes(&f, &rec("{}")));
        assert!(!passes(&f, &rec(r#"{"org": "beta"}"#)));
        assert!(!passes(
            &f,
            &rec(r#"{"reason": "rule_match", "decision": "allow"}"#)
        ));
        assert!(!passes(&f, &rec(r#"{"host": "other.example"}"#)));
        assert!(!passes(&f, &rec(r#"{"event": "close"}"#)));
        // A summary: by the hosts it names.
        assert!(passes(
            &f,
            &rec(r#"{"host": null, "count": 9, "hosts": {"a.test": 9}}"#)
        ));
        let unknown = parse_filter(Some("org=unknown")).unwrap();
        assert!(passes(
            &unknown,
            &rec(r#"{"org": null, "reason": "unknown_client"}"#)
        ));
    }

    #[test]
    fn only_a_listed_bearer_token_is_authorized() {
        let tails = Tails::new(vec![TokenDigest::of(b"good")]);
        let req = |h: Option<&str>| {
            let mut b = Request::builder().uri("/v1/decisions");
            if let Some(h) = h {
                b = b.header("authorization", h);
            }
            b.body(()).unwrap()
        };
        assert!(tails.authorized(&req(Some("Bearer good"))));
        assert!(!tails.authorized(&req(Some("Bearer bad"))));
        assert!(!tails.authorized(&req(Some("Basic good"))));
        assert!(!tails.authorized(&req(None)));
        assert!(!Tails::new(Vec::new()).authorized(&req(Some("Bearer good"))));
    }

    #[tokio::test]
    async fn a_tail_streams_what_is_written_after_it_then_ends_on_shutdown() {
        use http_body_util::BodyExt;
        let tap = crate::evidence::tap::Tap::default();
        let tails = Tails::new(vec![TokenDigest::of(b"t")]);
        let shutdown = CancellationToken::new();
        let req = Request::builder()
            .uri("/v1/decisions?decision=deny")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap();
        let bad = Request::builder()
            .uri("/v1/decisions?decision=x")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap();
        assert_eq!(respond(&tails, &tap, &shutdown, &bad).status(), 400);
        let mut body = respond(&tails, &tap, &shutdown, &req).into_body();
        let line = |r: &str| serde_json::to_vec(&rec(r)).unwrap();
        tap.publish(&line(
            r#"{"reason": "rule_match", "decision": "allow", "host": "ok.test"}"#,
        ));
        tap.publish(&line("{}"));
        let frame = body.frame().await.unwrap().unwrap().into_data().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&frame).unwrap();
        assert_eq!(v["host"], "other.test");
        assert!(frame.ends_with(b"\n"));
        // Far behind: a gap line, then the stream goes on.
        for _ in 0..crate::evidence::tap::TAP_BUFFER + TAIL_CHUNKS * 2 + 10 {
            tap.publish(&line("{}"));
        }
        let mut gap = None;
        for _ in 0..TAIL_CHUNKS * 4 {
            let f = body.frame().await.unwrap().unwrap().into_data().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&f).unwrap();
            if let Some(n) = v.get("gap") {
                gap = n.as_u64();
                break;
            }
        }
        assert!(gap.is_some_and(|n| n > 0), "{gap:?}");
        shutdown.cancel();
        // Drain what was queued; then the body ends.
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while let Some(f) = body.frame().await {
                f.unwrap();
            }
        })
        .await;
        assert!(ended.is_ok());
    }

    #[test]
    fn tails_over_the_cap_are_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let tap = crate::evidence::tap::Tap::default();
            let tails = Tails::new(vec![TokenDigest::of(b"t")]);
            let shutdown = CancellationToken::new();
            let req = || {
                Request::builder()
                    .uri("/v1/decisions")
                    .header("authorization", "Bearer t")
                    .body(())
                    .unwrap()
            };
            let open: Vec<_> = (0..MAX_TAILS)
                .map(|_| respond(&tails, &tap, &shutdown, &req()))
                .collect();
            assert!(open.iter().all(|r| r.status() == 200));
            assert_eq!(respond(&tails, &tap, &shutdown, &req()).status(), 503);
            shutdown.cancel();
        });
    }
}
