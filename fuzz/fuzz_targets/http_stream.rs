//! `cargo +nightly fuzz run http_stream`: see `palisade::fuzzing::http_stream` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::http_stream(data));
