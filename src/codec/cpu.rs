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
//! AVX-512 paths are detected where they are used: `digest::wide512` (the
//! digest sums) and `codec::vector::available` (the fused encoder and the
//! apply's group writes, which add AVX-512 BW, CD and VBMI2 to it). All of
//! them also need [`simd_allowed`] (`WEIGHTCAST_SIMD=off` turns them off).
//!
//! Calling a `#[target_feature]` function is `unsafe` only because executing
//! instructions the CPU lacks is undefined behaviour; every call site checks
//! [`wide`] (or the AVX-512 detection) first, which is the whole proof
//! obligation.

/// The feature list the wide variants are compiled with.
#[cfg(target_arch = "x86_64")]
pub const FEATURES: &str = "avx2,bmi1,bmi2,lzcnt,popcnt";

/// Whether the runtime-dispatched SIMD paths (AVX2, AVX-512) may run at all.
/// `WEIGHTCAST_SIMD=off` in the environment turns every one of them off, so
/// the portable code runs everywhere: the test script runs the round-trip
/// suites that way, and an operator can rule the vector paths out when
/// diagnosing. Read once per process.
pub fn simd_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var_os("WEIGHTCAST_SIMD").is_none_or(|v| v != "off"))
}

/// Whether the CPU runs the wide variants (cached by the standard library's
/// detection macro), and [`simd_allowed`].
#[inline]
pub fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        simd_allowed()
            && std::arch::is_x86_feature_detected!("avx2")
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

/// Hints the CPU to bring the cache line holding `data[at]` into L1 soon
/// (PREFETCHT0).
///
/// A hint only: it never faults, never changes memory, and does nothing when
/// `at` is out of range or on targets without a prefetch instruction.
#[inline(always)]
pub fn prefetch(data: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_T0 }>(data, at);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at);
}

/// Like [`prefetch`], but asks for the line in the second-level cache only
/// (PREFETCHT1). Such a request holds no first-level miss buffer while the
/// line comes from memory, so many more can be in flight: the apply pipeline
/// issues it hundreds of entries ahead. On the development machine (Zen 4),
/// `cargo run --release --example prefetch_probe -- 0.017` (a plain
/// read-modify-write of 1.7% of a 256 MB buffer's words, ascending) took
/// 9.96 ns per word with PREFETCHT0 32 words ahead and 6.82 ns with
/// PREFETCHT1 256 ahead.
#[inline(always)]
pub fn prefetch_l2(data: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    hint::<{ std::arch::x86_64::_MM_HINT_T1 }>(data, at);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at);
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn hint<const H: i32>(data: &[u8], at: usize) {
    if let Some(b) = data.get(at) {
        // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 CPU has (it is
        // in the target's baseline feature set), and the pointer comes from a
        // live reference. A prefetch is a hint: it reads nothing
        // architecturally and cannot fault. Exercised by every codec test
        // that applies a step-coded block (and `prefetch_is_only_a_hint`).
        unsafe { std::arch::x86_64::_mm_prefetch::<H>((b as *const u8).cast()) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefetch_is_only_a_hint() {
        let data: Vec<u8> = (0..200u8).collect();
        for at in [0, 63, 64, 199, 200, usize::MAX] {
            super::prefetch(&data, at);
            super::prefetch_l2(&data, at);
        }
        super::prefetch(&[], 0);
        super::prefetch_l2(&[], 0);
        assert!(data.iter().copied().eq(0..200u8));
    }
}
