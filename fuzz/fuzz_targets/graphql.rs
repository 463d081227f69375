//! `cargo +nightly fuzz run graphql`: see `palisade::fuzzing::graphql` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::graphql(data));
