//! `[otel]`: the OTLP export's collector, service name and headers,
//! located in the file. The environment (`OTEL_EXPORTER_OTLP_*`) is read
//! at start-up (`crate::otel`), not here: `check` judges the file.

use toml::Spanned;

use crate::config::error::Errors;
use crate::config::model::{OtelConfig, DEFAULT_OTEL_SERVICE_NAME};
use crate::config::raw::RawOtel;

/// The longest `service_name` (it is sent with every export).
const MAX_SERVICE_NAME: usize = 255;

pub(super) fn validate_otel(raw: RawOtel, errors: &mut Errors<'_>) -> Option<OtelConfig> {
    let RawOtel {
        endpoint,
        service_name,
        headers,
    } = raw;
    let endpoint = match endpoint {
        Some(e) => Some(endpoint_of(&e, errors)?),
        None => None,
    };
    let service_name = match service_name {
        Some(s) => {
            let name = s.get_ref().trim();
            if name.is_empty() || name.len() > MAX_SERVICE_NAME {
                errors.at(
                    s.span(),
                    format!("otel.service_name must be 1 to {MAX_SERVICE_NAME} characters"),
                );
                return None;
            }
            name.to_owned()
        }
        None => DEFAULT_OTEL_SERVICE_NAME.to_owned(),
    };
    let mut valid = Vec::new();
    for (name, value) in headers.unwrap_or_default() {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            errors.at(
                value.span(),
                format!("otel.headers: {name:?} is not an HTTP header name"),
            );
            continue;
        }
        if http::HeaderValue::from_str(value.get_ref()).is_err() {
            errors.at(
                value.span(),
                format!("otel.headers.{name}: not a valid HTTP header value (control characters or non-ASCII)"),
            );
            continue;
        }
        valid.push((name, value.into_inner()));
    }
    Some(OtelConfig {
        endpoint,
        service_name,
        headers: valid,
    })
}

/// A collector URL: `http://HOST[:PORT][/PATH]`, nothing after the path.
fn endpoint_of(value: &Spanned<String>, errors: &mut Errors<'_>) -> Option<String> {
    let text = value.get_ref().trim();
    match endpoint_problem(text) {
        None => Some(text.trim_end_matches('/').to_owned()),
        Some(why) => {
            errors.at(
                value.span(),
                format!("otel.endpoint {text:?} is not a collector URL: {why}"),
            );
            None
        }
    }
}

/// Why `text` is not an `http://` collector URL, if it is not one (shared
/// with the environment's endpoints, `crate::otel`).
pub(crate) fn endpoint_problem(text: &str) -> Option<&'static str> {
    let Ok(uri) = text.parse::<http::Uri>() else {
        return Some("it does not parse as a URL");
    };
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Some(
                "https is not supported (one TLS stack, for the proxy): send to a collector on the gateway or a local agent over http",
            )
        }
        _ => return Some("it needs the scheme http://"),
    }
    match uri.authority() {
        Some(a) if !a.host().is_empty() && a.as_str().find('@').is_none() => {}
        _ => return Some("it needs a host (and no user info)"),
    }
    if uri.query().is_some() {
        return Some("it must not have a query");
    }
    None
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{first_error_in, parse, BASE};

    #[test]
    fn unset_exports_nothing_and_an_empty_table_takes_the_defaults() {
        assert_eq!(parse(BASE).unwrap().otel, None);
        let o = parse(&format!("[otel]\n{BASE}")).unwrap().otel.unwrap();
        assert_eq!(o.endpoint, None);
        assert_eq!(o.service_name, "palisade");
        assert!(o.headers.is_empty());
        let o = parse(&format!(
            "[otel]\nendpoint = \"http://127.0.0.1:4318/\"\nservice_name = \"gw-eu\"\nheaders = {{ authorization = \"Bearer x\" }}\n{BASE}"
        ))
        .unwrap()
        .otel
        .unwrap();
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:4318"));
        assert_eq!(o.service_name, "gw-eu");
        assert_eq!(o.headers, [("authorization".into(), "Bearer x".into())]);
    }

    #[test]
    fn bad_values_are_located_errors() {
        let cases = [
            (
                "endpoint = \"127.0.0.1:4318\"\n",
                "t.toml:2:12: otel.endpoint \"127.0.0.1:4318\" is not a collector URL: it needs the scheme http://",
            ),
            (
                "endpoint = \"not a url\"\n",
                "t.toml:2:12: otel.endpoint \"not a url\" is not a collector URL: it does not parse as a URL",
            ),
            (
                "endpoint = \"http://u@h:4318\"\n",
                "t.toml:2:12: otel.endpoint \"http://u@h:4318\" is not a collector URL: it needs a host (and no user info)",
            ),
            (
                "endpoint = \"http://h:4318/?a=b\"\n",
                "t.toml:2:12: otel.endpoint \"http://h:4318/?a=b\" is not a collector URL: it must not have a query",
            ),
            (
                "service_name = \"\"\n",
                "t.toml:2:16: otel.service_name must be 1 to 255 characters",
            ),
            (
                "headers = { \"bad name\" = \"v\" }\n",
                "t.toml:2:26: otel.headers: \"bad name\" is not an HTTP header name",
            ),
            (
                "headers = { x = \"a\\nb\" }\n",
                "t.toml:2:17: otel.headers.x: not a valid HTTP header value (control characters or non-ASCII)",
            ),
            ("colour = \"red\"\n", "unknown field `colour`"),
        ];
        for (extra, want) in cases {
            let got = first_error_in("otel", extra);
            assert!(got.contains(want), "{extra:?}: got {got:?}, want {want:?}");
        }
        assert!(first_error_in("otel", "endpoint = \"https://c:4318\"\n")
            .contains("https is not supported"));
    }
}
