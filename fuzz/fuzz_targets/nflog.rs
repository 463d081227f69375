//! `cargo +nightly fuzz run nflog`: see `palisade::fuzzing::nflog` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::nflog(data));
