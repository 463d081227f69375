//! `cargo +nightly fuzz run target`: arbitrary UTF-8 never panics, and every
//! accepted host normalises to itself again from its Display form.
#![no_main]

use libfuzzer_sys::fuzz_target;
use palisade::proto::target::{
    normalize_host, parse_authority, parse_explain_target, ExplainTarget, Host,
};

fn round_trip(host: &Host) {
    let shown = host.to_string();
    assert_eq!(
        normalize_host(&shown).as_ref(),
        Ok(host),
        "{host:?} displayed as {shown:?}"
    );
}

fuzz_target!(|data: &[u8]| {
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
});
