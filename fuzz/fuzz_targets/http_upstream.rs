//! `cargo +nightly fuzz run http_upstream`: see `palisade::fuzzing::http_upstream` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::http_upstream(data));
