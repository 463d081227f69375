//! The properties the fuzz targets check, as plain functions over bytes, so
//! `cargo fuzz` (nightly, coverage-guided, `fuzz/`) and the stable bounded
//! fuzz run in the test suite (`tests/fuzz_smoke.rs`) check the same thing.
//! Each panics only when a property is broken.

use crate::proto::target::{
    normalize_host, parse_authority, parse_explain_target, ExplainTarget, Host,
};
use crate::proto::{client_hello, http_head};

/// A ClientHello parse never claims more bytes than it was given.
pub fn client_hello(data: &[u8]) {
    if let client_hello::Parse::Done { len, .. } = client_hello::parse(data) {
        assert!(len <= data.len(), "len {len} > input {}", data.len());
    }
}

/// A request-head parse never claims more bytes than it was given, and a
/// head it accepts is within the bound.
pub fn http_head(data: &[u8]) {
    if let http_head::Parse::Done { len, .. } = http_head::parse(data) {
        assert!(len <= data.len() && len <= http_head::MAX_HEAD_LEN);
    }
}

fn round_trip(host: &Host) {
    let shown = host.to_string();
    assert_eq!(
        normalize_host(&shown).as_ref(),
        Ok(host),
        "{host:?} displayed as {shown:?}"
    );
}

/// Every accepted host normalises to itself again from its Display form;
/// accepted ports are never 0.
pub fn target(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(host) = normalize_host(s) {
        round_trip(&host);
    }
    if let Ok((host, port)) = parse_authority(s, Some(443)) {
        assert_ne!(port, 0);
        round_trip(&host);
    }
    match parse_explain_target(s) {
        Ok(ExplainTarget::Tcp { host, port, .. }) => {
            assert_ne!(port, 0);
            round_trip(&host);
        }
        Ok(ExplainTarget::Dns { name, .. }) => round_trip(&name),
        Err(_) => {}
    }
}

/// Config text either loads or yields located errors; a loaded config
/// compiles into a policy.
pub fn config(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match crate::config::from_str(s, std::path::Path::new("fuzz.toml")) {
        Ok(c) => {
            let _ = crate::policy::Policy::new(&c);
        }
        Err(errors) => {
            assert!(!errors.0.is_empty());
            for e in &errors.0 {
                assert!(e.line >= 1 && e.col >= 1, "{e}");
            }
        }
    }
}
