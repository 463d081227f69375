//! `cargo +nightly fuzz run config`: see `palisade::fuzzing::config` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::config(data));
