//! `cargo +nightly fuzz run client_hello`: see `palisade::fuzzing::client_hello` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::client_hello(data));
