//! `cargo +nightly fuzz run pktline`: see `palisade::fuzzing::pktline` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::pktline(data));
