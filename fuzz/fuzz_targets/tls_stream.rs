//! `cargo +nightly fuzz run tls_stream`: see `palisade::fuzzing::tls_stream` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::tls_stream(data));
