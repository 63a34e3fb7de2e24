//! `Manifest::parse` on untrusted bytes (a commit manifest read from the bucket).
//! The harness and its invariants are in `fuzz/src/lib.rs` (`check_manifest`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    weightcast_fuzz::check_manifest(data);
});
