//! What a client is told when its connection or request does not go
//! through, in this one place: a typed [`Unserved`], which knows the side at
//! fault, maps to the reason code on record, the HTTP status, the RFC 9209
//! `Proxy-Status` header, the one-line body and the SOCKS5 reply. Every
//! mode (explicit, SOCKS5, intercepted requests) answers through it; a
//! transparent connection is reset whatever the failure.
//!
//! Failures after an allow keep `decision: allow` on record (the policy
//! allowed; the upstream failed), and follow RFC 9209 §2.3:
//!
//! | failure | status | `Proxy-Status` error |
//! |---|---|---|
//! | a denial | by reason, see "What a denied client sees" in `docs/decisions.md` | |
//! | a request head over the configured limits (`bad_request`) | 431 | `http_request_error` |
//! | a volume budget spent (`volume_exceeded`) | 429, with `Retry-After` when the window frees enough | `http_request_denied` |
//! | connect timed out | 504 | `connection_timeout` |
//! | connect refused | 502 | `connection_refused` |
//! | connect failed otherwise | 502 | `destination_unavailable` |
//! | request forwarded, no complete response head (closed, reset, timed out) | 502 | `http_response_incomplete` |

use http::StatusCode;

use super::dial::DialError;
use super::http::client::NoResponse;
use super::http::{text_response, Body};
use crate::policy::Reason;
use crate::proto::socks5::Reply;

/// Which side a failure is at fault: the client (what it asked for, or
/// how), the upstream (unreachable, broken), or Palisade itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Upstream,
    Internal,
}

/// Why a connection or request did not go through.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unserved {
    /// Refused: by policy, verification, identity, a limit, or because
    /// evidence could not be written. The reason code says which.
    #[error("denied: {0}")]
    Denied(Reason),
    /// A request head over `max_request_head_bytes` or `max_headers`:
    /// `bad_request`, answered 431.
    #[error("denied: request head too large")]
    HeadTooLarge,
    /// A volume budget of its rule or org is spent: `volume_exceeded`,
    /// answered 429 with `Retry-After` (the time until the window frees
    /// enough, when known).
    #[error("denied: volume budget spent")]
    OverVolume(Option<std::time::Duration>),
    /// Allowed, but no checked address could be reached.
    #[error("{0}")]
    Unreachable(DialError),
    /// Allowed and forwarded, but no complete response came back: the
    /// upstream closed, reset or stayed silent before the response head
    /// was read. (hyper cannot tell whether part of a head had arrived, so
    /// RFC 9209's `connection_terminated` is not told apart.)
    #[error("no complete response from the upstream: {0}")]
    NoResponse(#[from] NoResponse),
}

impl Unserved {
    /// A failure whose record could not be written is told as
    /// `evidence_unavailable`, whatever it was.
    pub(crate) fn recorded(self, written: bool) -> Unserved {
        if written {
            self
        } else {
            Unserved::Denied(Reason::EvidenceUnavailable)
        }
    }

    /// The reason code on record: a failure after an allow keeps the allow.
    pub(crate) fn reason(&self) -> Reason {
        match self {
            Unserved::Denied(reason) => *reason,
            Unserved::HeadTooLarge => Reason::BadRequest,
            Unserved::OverVolume(_) => Reason::VolumeExceeded,
            Unserved::Unreachable(_) | Unserved::NoResponse(_) => Reason::RuleMatch,
        }
    }

    /// The side at fault.
    pub(crate) fn side(&self) -> Side {
        match self {
            Unserved::Denied(reason) => side_of(*reason),
            Unserved::HeadTooLarge | Unserved::OverVolume(_) => Side::Client,
            Unserved::Unreachable(_) | Unserved::NoResponse(_) => Side::Upstream,
        }
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Unserved::Denied(reason) => status(*reason),
            Unserved::OverVolume(_) => status(Reason::VolumeExceeded),
            Unserved::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Unserved::Unreachable(DialError::Timeout { .. }) => StatusCode::GATEWAY_TIMEOUT,
            Unserved::Unreachable(_) | Unserved::NoResponse(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The RFC 9209 error type.
    pub(crate) fn proxy_error(&self) -> &'static str {
        match self {
            Unserved::Denied(reason) => proxy_error(*reason),
            Unserved::OverVolume(_) => proxy_error(Reason::VolumeExceeded),
            Unserved::HeadTooLarge => proxy_error(Reason::BadRequest),
            Unserved::Unreachable(DialError::Timeout { .. }) => "connection_timeout",
            Unserved::Unreachable(DialError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::ConnectionRefused =>
            {
                "connection_refused"
            }
            Unserved::Unreachable(_) => "destination_unavailable",
            Unserved::NoResponse(_) => "http_response_incomplete",
        }
    }

    /// The SOCKS5 reply (RFC 1928 §6).
    pub(crate) fn socks_reply(&self) -> Reply {
        match self {
            Unserved::Denied(reason) => socks_reply(*reason),
            Unserved::OverVolume(_) => socks_reply(Reason::VolumeExceeded),
            Unserved::HeadTooLarge => socks_reply(Reason::BadRequest),
            Unserved::Unreachable(DialError::Io { source, .. }) => match source.kind() {
                std::io::ErrorKind::ConnectionRefused => Reply::ConnectionRefused,
                std::io::ErrorKind::NetworkUnreachable => Reply::NetworkUnreachable,
                _ => Reply::HostUnreachable,
            },
            Unserved::Unreachable(DialError::Timeout { .. } | DialError::NoAddress) => {
                Reply::HostUnreachable
            }
            Unserved::NoResponse(_) => Reply::GeneralFailure,
        }
    }

    /// The `Proxy-Status` header value, naming the reason code and record.
    pub(crate) fn proxy_status(&self, record: &str) -> String {
        format!(
            "palisade; error={}; details=\"{}; record={record}\"",
            self.proxy_error(),
            self.reason()
        )
    }

    /// The one-line body. A denial shows `detail` (what the client may
    /// learn); a failure after an allow shows its own cause.
    pub(crate) fn body(&self, record: &str, detail: Option<&str>) -> String {
        let (what, detail) = match self {
            Unserved::Denied(_) | Unserved::HeadTooLarge | Unserved::OverVolume(_) => (
                format!("denied: {}", self.reason()),
                detail.map(str::to_string),
            ),
            Unserved::Unreachable(e) => ("upstream unreachable".to_string(), Some(e.to_string())),
            Unserved::NoResponse(e) => ("upstream failed".to_string(), Some(e.to_string())),
        };
        let mut text = format!("palisade: {what} (evidence record {record})");
        if let Some(detail) = detail {
            // Keep the body one line whatever the detail holds.
            let clean: String = detail
                .chars()
                .filter(|c| !c.is_control())
                .take(200)
                .collect();
            text.push_str(&format!(": {clean}"));
        }
        text.push('\n');
        text
    }

    /// The HTTP response.
    pub(crate) fn response(&self, record: &str, detail: Option<&str>) -> http::Response<Body> {
        let mut status = self.proxy_status(record);
        if let (Unserved::Denied(Reason::ApprovalPending), Some(d)) = (self, detail) {
            // The approval's reference and the destination, in the
            // header too: quotes and control characters left out.
            let clean: String = d
                .chars()
                .filter(|c| !c.is_control() && *c != '"' && *c != '\\')
                .take(200)
                .collect();
            status = format!(
                "palisade; error={}; details=\"{}; record={record}; {clean}\"",
                self.proxy_error(),
                self.reason()
            );
        }
        let mut resp = text_response(self.status(), &status, self.body(record, detail));
        if let Unserved::OverVolume(Some(after)) = self {
            // Whole seconds, rounded up: never sooner than the window frees.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            resp.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(secs.max(1)),
            );
        }
        if resp.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
            resp.headers_mut().insert(
                http::header::PROXY_AUTHENTICATE,
                http::HeaderValue::from_static("Basic realm=\"palisade\""),
            );
        }
        resp
    }

    /// A complete HTTP/1.1 response for paths that answer without hyper
    /// (connection caps), closing the connection.
    pub(crate) fn raw_response(&self, record: &str) -> String {
        let status = self.status();
        let body = self.body(record, None);
        format!(
            "HTTP/1.1 {} {}\r\nProxy-Status: {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            self.proxy_status(record),
            body.len(),
            body
        )
    }
}

fn side_of(reason: Reason) -> Side {
    match reason {
        Reason::ResolutionFailed | Reason::UpstreamTlsError => Side::Upstream,
        Reason::EvidenceUnavailable | Reason::EnforcementMissing => Side::Internal,
        Reason::RuleMatch
        | Reason::ReportOnly
        | Reason::UnknownClient
        | Reason::NoMatchingRule
        | Reason::ExplicitDeny
        | Reason::PortNotAllowed
        | Reason::DeniedAddress
        | Reason::SniMismatch
        | Reason::HostMismatch
        | Reason::BadRequest
        | Reason::LimitExceeded
        | Reason::SpecialName
        | Reason::QtypeNotAllowed
        | Reason::AuthRequired
        | Reason::AuthFailed
        | Reason::MethodNotAllowed
        | Reason::PathNotAllowed
        | Reason::ServiceDenied
        | Reason::ProtocolMismatch
        | Reason::SniMissing
        | Reason::EchNotAllowed
        | Reason::UpgradeNotAllowed
        | Reason::PolicyRevoked
        | Reason::NameBudgetExceeded
        | Reason::VolumeExceeded
        | Reason::SyntheticUnbound
        | Reason::ApprovalPending
        | Reason::GrantExpired => Side::Client,
    }
}

fn status(reason: Reason) -> StatusCode {
    match reason {
        Reason::BadRequest => StatusCode::BAD_REQUEST,
        Reason::ResolutionFailed | Reason::UpstreamTlsError => StatusCode::BAD_GATEWAY,
        Reason::EvidenceUnavailable | Reason::LimitExceeded | Reason::EnforcementMissing => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        Reason::AuthRequired | Reason::AuthFailed => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        Reason::VolumeExceeded => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::FORBIDDEN,
    }
}

fn proxy_error(reason: Reason) -> &'static str {
    match reason {
        Reason::DeniedAddress => "destination_ip_prohibited",
        Reason::BadRequest => "http_request_error",
        Reason::ResolutionFailed => "dns_error",
        Reason::UpstreamTlsError => "tls_certificate_error",
        Reason::EvidenceUnavailable => "proxy_internal_error",
        Reason::LimitExceeded => "connection_limit_reached",
        _ => "http_request_denied",
    }
}

fn socks_reply(reason: Reason) -> Reply {
    match reason {
        Reason::RuleMatch | Reason::ReportOnly => Reply::Succeeded,
        Reason::ResolutionFailed => Reply::HostUnreachable,
        Reason::BadRequest | Reason::EvidenceUnavailable | Reason::LimitExceeded => {
            Reply::GeneralFailure
        }
        _ => Reply::NotAllowed,
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn every_reason_maps() {
        for r in Reason::ALL.into_iter().filter(|r| !r.is_allow()) {
            let f = Unserved::Denied(r);
            let s = f.status();
            assert!(s.is_client_error() || s.is_server_error(), "{r}");
            let b = f.body("id-1", Some("x\ny"));
            assert!(b.contains(r.as_str()) && b.contains("id-1") && b.ends_with("xy\n"));
            assert_eq!(f.reason(), r);
        }
        let status = |r| Unserved::Denied(r).status();
        assert_eq!(status(Reason::NoMatchingRule), StatusCode::FORBIDDEN);
        assert_eq!(status(Reason::ResolutionFailed), StatusCode::BAD_GATEWAY);
        assert_eq!(
            status(Reason::AuthFailed),
            StatusCode::PROXY_AUTHENTICATION_REQUIRED
        );
        let raw = Unserved::Denied(Reason::LimitExceeded).raw_response("r7");
        assert!(raw.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(
            raw.contains("error=connection_limit_reached; details=\"limit_exceeded; record=r7\"")
        );
    }

    #[test]
    fn an_approval_pending_names_its_approval_in_the_header() {
        let f = Unserved::Denied(Reason::ApprovalPending);
        let resp = f.response("r9", Some("approval a-1 pending for \"x.test\":443"));
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        let h = resp.headers()["proxy-status"].to_str().unwrap().to_string();
        assert!(
            h.contains(
                "details=\"approval_pending; record=r9; approval a-1 pending for x.test:443\""
            ),
            "{h}"
        );
    }

    #[test]
    fn every_denial_has_a_failure_reply() {
        for r in Reason::ALL {
            let code = socks_reply(r);
            assert_eq!(code == Reply::Succeeded, r.is_allow(), "{r}");
        }
        let reply = |r| Unserved::Denied(r).socks_reply();
        assert_eq!(reply(Reason::ExplicitDeny), Reply::NotAllowed);
        assert_eq!(reply(Reason::AuthFailed), Reply::NotAllowed);
        assert_eq!(reply(Reason::ResolutionFailed), Reply::HostUnreachable);
    }

    /// Failures after an allow: one mapping whatever the mode, the allow
    /// kept on record, the upstream at fault.
    #[test]
    fn upstream_failures_follow_rfc_9209() {
        let addr: SocketAddr = "198.18.2.10:443".parse().unwrap();
        let io_err = |kind| {
            Unserved::Unreachable(DialError::Io {
                addr,
                source: io::Error::from(kind),
            })
        };
        let cases = [
            (
                Unserved::Unreachable(DialError::Timeout { addr }),
                504,
                "connection_timeout",
                Reply::HostUnreachable,
            ),
            (
                io_err(io::ErrorKind::ConnectionRefused),
                502,
                "connection_refused",
                Reply::ConnectionRefused,
            ),
            (
                io_err(io::ErrorKind::NetworkUnreachable),
                502,
                "destination_unavailable",
                Reply::NetworkUnreachable,
            ),
            (
                Unserved::NoResponse(NoResponse::NotSent("upstream connection closed".into())),
                502,
                "http_response_incomplete",
                Reply::GeneralFailure,
            ),
        ];
        for (f, status, error, reply) in cases {
            assert_eq!(f.status().as_u16(), status, "{f}");
            assert_eq!(f.proxy_error(), error, "{f}");
            assert_eq!(f.socks_reply(), reply, "{f}");
            assert_eq!(f.reason(), Reason::RuleMatch, "{f}");
            assert_eq!(f.side(), Side::Upstream, "{f}");
            assert!(f
                .proxy_status("r1")
                .ends_with("details=\"rule_match; record=r1\""));
        }
        // Unrecorded, anything is told as evidence_unavailable.
        let f = Unserved::NoResponse(NoResponse::Timeout).recorded(false);
        assert_eq!(f.reason(), Reason::EvidenceUnavailable);
        assert_eq!(f.side(), Side::Internal);
        assert_eq!(f.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn auth_failures_carry_a_challenge() {
        let resp = Unserved::Denied(Reason::AuthRequired).response("r2", None);
        assert_eq!(resp.status(), StatusCode::PROXY_AUTHENTICATION_REQUIRED);
        assert_eq!(
            resp.headers()[http::header::PROXY_AUTHENTICATE],
            "Basic realm=\"palisade\""
        );
        let resp = Unserved::Denied(Reason::NoMatchingRule).response("r3", None);
        assert!(resp
            .headers()
            .get(http::header::PROXY_AUTHENTICATE)
            .is_none());
    }
}
