//! `registrations` and `fleet` with one untrusted `subscribers/<id>.json`, through an in-memory store.
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_registration`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_registration(data);
});
