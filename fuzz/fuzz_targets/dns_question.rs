//! `cargo +nightly fuzz run dns_question`: see `palisade::fuzzing::dns_question` for the property.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| palisade::fuzzing::dns_question(data));
