//! `cargo +nightly fuzz run target`: see `palisade::fuzzing::target` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::target(data));
