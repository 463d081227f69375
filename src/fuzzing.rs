//! The properties the fuzz targets check, as plain functions over bytes, so
//! `cargo fuzz` (nightly, coverage-guided, `fuzz/`) and the stable bounded
//! fuzz run in the test suite (`tests/fuzz_smoke.rs`) check the same thing.
//! Each panics only when a property is broken.

use crate::proto::guard::{Limits, Step};
use crate::proto::http_stream::HttpGuard;
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

/// What a scripted tunnel pump over an [`HttpGuard`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pumped {
    /// Client bytes forwarded upstream (all of them once `Opaque`).
    pub forwarded: usize,
    /// The last answer that was not `Forward`.
    pub end: Step,
    pub requests: u64,
    pub first_host: Option<String>,
}

/// A sans-IO tunnel pump, as the proxy's runs it: the client's bytes arrive
/// in `client` pieces and the guard is asked about the held bytes until it
/// stops forwarding; the upstream's bytes (in `server` pieces) pass the
/// first time it answers `Wait`, or once the client's bytes are all in.
/// Panics if the guard breaks the [`crate::proto::guard`] protocol: a
/// `Forward` of nothing or of more than is held, or another answer when
/// asked again about the same bytes.
pub fn pump_http(guard: &mut HttpGuard, client: &[&[u8]], server: &[&[u8]]) -> Pumped {
    let total = client.iter().map(|c| c.len()).sum();
    let mut pieces = client.iter();
    let mut held = Vec::new();
    let mut forwarded = 0;
    let mut served = false;
    let end = loop {
        let step = guard.client(&held);
        if let Step::Forward(n) = step {
            assert!(n > 0 && n <= held.len(), "Forward({n}) of {}", held.len());
            forwarded += n;
            held.drain(..n);
            continue;
        }
        assert_eq!(guard.client(&held), step, "asked again");
        match step {
            Step::Opaque => {
                forwarded = total;
                break step;
            }
            Step::Deny(_) => break step,
            Step::Wait if !served => {}
            _ => match pieces.next() {
                Some(piece) => {
                    held.extend_from_slice(piece);
                    continue;
                }
                None if served => break step,
                None => {}
            },
        }
        for s in server {
            guard.server(s);
        }
        served = true;
    };
    Pumped {
        forwarded,
        end,
        requests: guard.requests(),
        first_host: guard.first_host().map(str::to_owned),
    }
}

/// The HTTP tunnel verifier: the client's bytes (before the first `00 00`;
/// the upstream's after it) fed whole, byte by byte or in pieces of a few
/// sizes, give the same forwarded length, final answer and requests; it
/// never forwards more than it was given and never panics.
pub fn http_stream(data: &[u8]) {
    let (client, server) = match data.windows(2).position(|w| w == [0, 0]) {
        Some(i) => (
            data.get(..i).unwrap_or_default(),
            data.get(i + 2..).unwrap_or_default(),
        ),
        None => (data, &[][..]),
    };
    let run = |client: Vec<&[u8]>, server: Vec<&[u8]>| {
        let limits = Limits {
            max_head_bytes: 1024,
            max_headers: 16,
        };
        let mut guard = HttpGuard::new(Host::Name("a.test".into()), 80, limits);
        pump_http(&mut guard, &client, &server)
    };
    let whole = run(vec![client], vec![server]);
    assert!(whole.forwarded <= client.len());
    for size in [1, 2, 3, 7, 64] {
        let pieces = run(
            client.chunks(size).collect(),
            server.chunks(size + 1).collect(),
        );
        assert_eq!(pieces, whole, "pieces of {size}");
    }
}
