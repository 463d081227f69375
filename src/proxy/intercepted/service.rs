//! Service rules on the live intercepted path: the pure decision
//! ([`crate::policy::service`]) over a request that the rule's method and
//! path rules allowed, reading as much of its body as the decision needs
//! first (a push's command section, a whole GraphQL or model-API body,
//! bounded), before any credential is added and any byte goes upstream.
//! What was read goes upstream first, then the rest of the body as it
//! comes ([`Prefixed`]): a pack is streamed, never held.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};

use crate::config::ServiceRules;
use crate::policy::request::NormalPath;
use crate::policy::service::{self, BodyStep, ServiceFacts, ServiceRequest, Step};

/// What the service rules made of a request.
pub(crate) enum Outcome {
    /// Allowed: what it was, and the body bytes read so far (sent first).
    Pass(Option<ServiceFacts>, Bytes),
    /// Refused `service_denied`: why, and what it was.
    Refuse(String, Option<ServiceFacts>),
}

/// Decide `parts` (allowed by the rule's request rules, `path` its
/// normalised path) by the rule's service rules, reading from `body` what
/// the decision needs, within `timeout`.
pub(crate) async fn decide(
    rules: &ServiceRules,
    parts: &http::request::Parts,
    path: &NormalPath,
    body: Option<&mut Incoming>,
    timeout: Duration,
) -> Outcome {
    let text = |name: header::HeaderName| {
        let mut all = parts.headers.get_all(name).iter();
        match (all.next(), all.next()) {
            (None, _) => Ok(None),
            (Some(v), None) => v.to_str().map(Some).map_err(|_| ()),
            // Repeated: which one the server reads is not known.
            (Some(_), Some(_)) => Err(()),
        }
    };
    let (Ok(content_type), Ok(content_encoding)) =
        (text(header::CONTENT_TYPE), text(header::CONTENT_ENCODING))
    else {
        return Outcome::Refuse(
            "a repeated or non-ASCII Content-Type or Content-Encoding".into(),
            None,
        );
    };
    let req = ServiceRequest {
        method: parts.method.as_str(),
        path,
        query: parts.uri.query(),
        content_type,
        content_encoding,
    };
    let check = match service::check(rules, &req) {
        Step::Allow(facts) => return Outcome::Pass(facts, Bytes::new()),
        Step::Refuse(why, facts) => return Outcome::Refuse(why, facts),
        Step::Body(check) => check,
    };
    let Some(body) = body else {
        return Outcome::Refuse("request body gone".into(), Some(check.facts));
    };
    let mut buf = BytesMut::new();
    let read = async {
        loop {
            let complete = body.is_end_stream();
            match service::check_body(rules, &check, &buf, complete) {
                BodyStep::Allow(facts) => return Ok(facts),
                BodyStep::Refuse(why, facts) => return Err((why, facts)),
                BodyStep::NeedMore if complete => {
                    return Err(("request body ended early".into(), check.facts.clone()))
                }
                BodyStep::NeedMore => {}
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                    }
                }
                None => {
                    // The end: decide on what came.
                    return match service::check_body(rules, &check, &buf, true) {
                        BodyStep::Allow(facts) => Ok(facts),
                        BodyStep::Refuse(why, facts) => Err((why, facts)),
                        BodyStep::NeedMore => {
                            Err(("request body ended early".into(), check.facts.clone()))
                        }
                    };
                }
                Some(Err(e)) => {
                    return Err((format!("request body failed: {e}"), check.facts.clone()))
                }
            }
        }
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(facts)) => Outcome::Pass(Some(facts), buf.freeze()),
        Ok(Err((why, facts))) => Outcome::Refuse(why, Some(facts)),
        Err(_) => Outcome::Refuse(
            "the request body needed for the service check did not arrive in time".into(),
            Some(check.facts),
        ),
    }
}

/// A request body whose first bytes were already read: `head`, then the
/// rest of `rest` as it comes.
pub(crate) struct Prefixed {
    head: Option<Bytes>,
    rest: Incoming,
}

impl Prefixed {
    pub(crate) fn new(head: Bytes, rest: Incoming) -> Prefixed {
        Prefixed {
            head: (!head.is_empty()).then_some(head),
            rest,
        }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + head);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint
    }
}
