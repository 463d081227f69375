//! One place that maps a reason (or a failure after an allow) to what the
//! client sees: HTTP status, an RFC 9209 `Proxy-Status` header, and a short
//! text body naming the reason code and the evidence record id.

use http::StatusCode;

use crate::policy::Reason;

/// Status code for a denial.
pub fn status(reason: Reason) -> StatusCode {
    match reason {
        Reason::BadRequest => StatusCode::BAD_REQUEST,
        Reason::ResolutionFailed | Reason::UpstreamTlsError => StatusCode::BAD_GATEWAY,
        Reason::EvidenceUnavailable | Reason::LimitExceeded => StatusCode::SERVICE_UNAVAILABLE,
        Reason::AuthRequired | Reason::AuthFailed => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        _ => StatusCode::FORBIDDEN,
    }
}

/// RFC 9209 proxy error type for a denial.
pub fn proxy_error(reason: Reason) -> &'static str {
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

/// The `Proxy-Status` header value.
pub fn proxy_status(error: &str, reason: &str, record: Option<&str>) -> String {
    match record {
        Some(id) => format!("palisade; error={error}; details=\"{reason}; record={id}\""),
        None => format!("palisade; error={error}; details=\"{reason}\""),
    }
}

/// The response body.
pub fn body(reason: &str, record: Option<&str>, detail: Option<&str>) -> String {
    let mut text = format!("palisade: denied: {reason}");
    if let Some(id) = record {
        text.push_str(&format!(" (evidence record {id})"));
    }
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

/// A complete HTTP/1.1 response for paths that answer without hyper
/// (connection caps), closing the connection.
pub fn raw_response(reason: Reason, record: Option<&str>) -> String {
    let status = status(reason);
    let body = body(reason.as_str(), record, None);
    format!(
        "HTTP/1.1 {} {}\r\nProxy-Status: {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        proxy_status(proxy_error(reason), reason.as_str(), record),
        body.len(),
        body
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_maps() {
        for r in Reason::ALL.into_iter().filter(|r| !r.is_allow()) {
            let s = status(r);
            assert!(s.is_client_error() || s.is_server_error(), "{r}");
            let b = body(r.as_str(), Some("id-1"), Some("x\ny"));
            assert!(b.contains(r.as_str()) && b.contains("id-1") && b.ends_with("xy\n"));
        }
        assert_eq!(status(Reason::NoMatchingRule), StatusCode::FORBIDDEN);
        assert_eq!(status(Reason::ResolutionFailed), StatusCode::BAD_GATEWAY);
        assert_eq!(
            status(Reason::AuthFailed),
            StatusCode::PROXY_AUTHENTICATION_REQUIRED
        );
        let raw = raw_response(Reason::LimitExceeded, Some("r7"));
        assert!(raw.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(
            raw.contains("error=connection_limit_reached; details=\"limit_exceeded; record=r7\"")
        );
    }
}
