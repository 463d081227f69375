//! `cargo +nightly fuzz run client_hello`: arbitrary bytes never panic, and
//! `Done` never claims more bytes than were given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use palisade::proto::client_hello::{parse, Parse};

fuzz_target!(|data: &[u8]| {
    if let Parse::Done { len, .. } = parse(data) {
        assert!(len <= data.len(), "len {len} > input {}", data.len());
    }
});
