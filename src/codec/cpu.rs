//! Runtime CPU dispatch for the hot loops.
//!
//! The codec's inner loops are plain, safe Rust. On x86-64 the same code is also
//! compiled a second time with AVX2, BMI1/2, LZCNT and POPCNT enabled (one
//! `#[target_feature]` wrapper per loop), which lets the compiler use 256-bit
//! vectors for the scan and single-instruction bit counts for the bit streams.
//! The wrapper is chosen at run time when [`wide`] says the CPU has every one of
//! those features. The benchmark's baseline compare gets the same treatment, so
//! ratios stay apples to apples.
//!
//! Calling a `#[target_feature]` function is `unsafe` only because executing
//! instructions the CPU lacks is undefined behaviour; every call site checks
//! [`wide`] first, which is the whole proof obligation.

/// The feature list the wide variants are compiled with.
#[cfg(target_arch = "x86_64")]
pub const FEATURES: &str = "avx2,bmi1,bmi2,lzcnt,popcnt";

/// Whether the CPU runs the wide variants (cached by the standard library's
/// detection macro).
#[inline]
pub fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("bmi1")
            && std::arch::is_x86_feature_detected!("bmi2")
            && std::arch::is_x86_feature_detected!("lzcnt")
            && std::arch::is_x86_feature_detected!("popcnt")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
