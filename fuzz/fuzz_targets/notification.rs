//! `Key::verify` and the notification body parse on untrusted headers and body (the subscriber's `POST /v1/notify`).
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_notification`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_notification(data);
});
