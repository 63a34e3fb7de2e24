//! `read_latest` on an untrusted `latest.json`, through an in-memory store.
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_latest`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_latest(data);
});
