//! `cargo +nightly fuzz run http_head`: see `palisade::fuzzing::http_head` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::http_head(data));
