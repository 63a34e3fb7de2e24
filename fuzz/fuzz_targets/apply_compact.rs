//! `apply_delta` on untrusted bytes, seeded with compact deltas (corpus: compact deltas of the tiny generator model, including multi-block ones).
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_apply`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_apply(data);
});
