//! The decider: an HTTP endpoint (`[decider] url`) asked about a miss.
//!
//! Consulted only where a decision would be `no_matching_rule` (the miss
//! hook, `crate::jit`), so it never sees, and never overrides, an
//! explicit deny, the baseline, an always-denied address, Palisade's own
//! listeners, a name budget or a volume budget: those are decided before
//! a miss exists, and an allow it gives is still held to the address
//! checks like any allow rule.
//!
//! One consultation is one `POST` of a JSON [`Question`] over a fresh
//! connection, `Connection: close`, within `timeout` (connecting
//! included), and one bounded JSON answer ([`MAX_ANSWER_BYTES`]):
//!
//! | answer | becomes |
//! |---|---|
//! | `{"decision":"allow","ttl":"10m"}` | allowed by a grant for the target and port (approver `decider`) for the `ttl` (at most [`MAX_TTL`]) |
//! | `{"decision":"allow"}` | allowed by a grant of one use: this decision only |
//! | `{"decision":"deny"}` | `no_matching_rule`, as without a decider |
//! | `{"decision":"ask"}` | an approval, as `on_miss = "ask"` |
//! | an error, a status other than 200, a body that is not such JSON or too long, a `ttl` over the maximum, the timeout | denied (`on_error = "deny"`), the error recorded |
//! | more than `max_in_flight` consultations at once | denied without asking, recorded `busy` and counted |
//!
//! Whatever it said is the record's `decider` field ([`Said`]).
//!
//! Its own traffic is Palisade's, not an org's: it leaves from the
//! process directly, never through the proxy's listeners, so no org's
//! policy decides it and no connection record is written for it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::config::DeciderConfig;
pub(crate) use crate::evidence::said::{Answer, Said};

/// The longest answer body read; a longer one is an error.
pub(crate) const MAX_ANSWER_BYTES: usize = 4096;

/// The longest `ttl` an answer may give (a longer one is an error, and a
/// deny): the decider cannot make a grant wider in time than an approver.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// What is asked: one miss, as the decider sees it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Question<'a> {
    pub(crate) org: &'a str,
    /// The client's address.
    pub(crate) client: String,
    /// The normalised target name, or the canonical IP text.
    pub(crate) host: &'a str,
    /// `None`: a DNS question (the name on any port).
    pub(crate) port: Option<u16>,
    /// `explicit`, `transparent`, `socks5` or `dns`.
    pub(crate) mode: &'a str,
    /// Under interception: the request's method and path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) method: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) path: Option<&'a str>,
}

/// The answer's JSON, strictly: nothing else in it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    decision: Answer,
    #[serde(default)]
    ttl: Option<String>,
}

/// Judge one answer (pure): its status and body.
pub(crate) fn judge(status: u16, body: &[u8]) -> Said {
    if status != 200 {
        return Said::failed(format!("status {status}"));
    }
    let wire: Wire = match serde_json::from_slice(body) {
        Ok(w) => w,
        Err(e) => return Said::failed(format!("not a decider answer: {e}")),
    };
    match (wire.decision, wire.ttl) {
        (Answer::Allow, Some(ttl)) => match humantime::parse_duration(ttl.trim()) {
            Ok(d) if !d.is_zero() && d <= MAX_TTL => Said {
                decision: Answer::Allow,
                ttl: Some(ttl.trim().to_string()),
                error: None,
            },
            Ok(_) => Said::failed(format!("ttl {ttl:?} is not within 1s to 24h")),
            Err(e) => Said::failed(format!("ttl {ttl:?}: {e}")),
        },
        (Answer::Allow, None) => Said {
            decision: Answer::Allow,
            ttl: None,
            error: None,
        },
        (decision, None) => Said {
            decision,
            ttl: None,
            error: None,
        },
        (_, Some(_)) => Said::failed("ttl given with an answer other than allow".into()),
    }
}

/// The decider of a running instance.
#[derive(Debug)]
pub(crate) struct Decider {
    authority: String,
    path: String,
    timeout: Duration,
    permits: Arc<Semaphore>,
    max_in_flight: usize,
}

impl Decider {
    /// The decider `config` describes (its URL validated at load).
    pub(crate) fn new(config: &DeciderConfig) -> Decider {
        let rest = config
            .url
            .strip_prefix("http://")
            .unwrap_or(config.url.as_str());
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let authority = if authority.contains(']') || authority.rsplit_once(':').is_some() {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Decider {
            authority,
            path: path.to_string(),
            timeout: config.timeout,
            permits: Arc::new(Semaphore::new(config.max_in_flight)),
            max_in_flight: config.max_in_flight,
        }
    }

    /// Ask about `question`: what it said, or the deny that stands for an
    /// error, a timeout, or more consultations than `max_in_flight`.
    pub(crate) async fn consult(&self, question: &Question<'_>) -> Said {
        let Ok(_permit) = self.permits.clone().try_acquire_owned() else {
            return Said::failed(format!(
                "busy: {} consultations in flight",
                self.max_in_flight
            ));
        };
        match tokio::time::timeout(self.timeout, self.ask(question)).await {
            Ok(Ok(said)) => said,
            Ok(Err(e)) => Said::failed(e),
            Err(_) => Said::failed(format!(
                "timeout after {}",
                humantime::format_duration(self.timeout)
            )),
        }
    }

    async fn ask(&self, question: &Question<'_>) -> Result<Said, String> {
        let body = serde_json::to_vec(question).map_err(|e| e.to_string())?;
        let stream = tokio::net::TcpStream::connect(&self.authority)
            .await
            .map_err(|e| format!("connect {}: {e}", self.authority))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        // The connection lives as long as this consultation: dropped with it.
        let driving = async move {
            let _ = conn.await;
        };
        let request = http::Request::post(&self.path)
            .header(http::header::HOST, &self.authority)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::CONNECTION, "close")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let status = response.status().as_u16();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| format!("answer: {e}"))?
                .to_bytes();
            Ok(judge(status, &body))
        };
        // Both polled here, so a timeout drops the connection with them;
        // a connection done first has handed its bytes to the body.
        tokio::pin!(exchange, driving);
        tokio::select! {
            biased;
            said = &mut exchange => said,
            () = &mut driving => exchange.await,
        }
    }
}

#[cfg(test)]
mod tests;
