//! `apply_delta` on untrusted bytes, seeded with trl deltas and foreign TRL sparse_weight_patch files (I32 and I64 indices).
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_apply`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_apply(data);
});
