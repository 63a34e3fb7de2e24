//! AVX-512 kernel for the compact encoder's hottest loop: step-coded entries
//! of 2-byte words (BF16, F16), eight changes per vector.
//!
//! For each group of eight changed words the kernel computes, lane by lane,
//! exactly what the scalar `emit_step` computes for one (gap, step, Rice code,
//! Exp-Golomb code, digest change); only the appending of the eight finished
//! codes to the bit stream stays serial. A group in which any entry would not
//! take the scalar fast path (an entry longer than 56 bits) is left to the
//! scalar code, so both paths write the same bits; `compact`'s tests compare
//! them on every kind of block.
//!
//! Used only when [`available`] says the CPU has the instructions.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512i, _mm_cvtsi64_si128, _mm_loadu_si128, _mm512_add_epi64, _mm512_alignr_epi64,
    _mm512_and_si512, _mm512_cmpgt_epu64_mask, _mm512_cvtepu16_epi64, _mm512_i64gather_epi64,
    _mm512_lzcnt_epi64, _mm512_or_si512, _mm512_reduce_add_epi64, _mm512_set1_epi64,
    _mm512_setzero_si512, _mm512_slli_epi64, _mm512_sllv_epi64, _mm512_srl_epi64,
    _mm512_srli_epi64, _mm512_storeu_si512, _mm512_sub_epi64, _mm512_xor_si512,
};

use super::bits::FastWriter;

/// Whether the CPU runs the kernel (AVX-512 F, DQ for the 64-bit multiply of
/// the digest, CD for the leading-zero count; cached by the standard library's
/// detection macro).
#[inline]
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::digest::wide512() && std::arch::is_x86_feature_detected!("avx512cd")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What [`write_steps_w2`] did.
pub struct Run {
    /// Changes consumed from the front of `changed` (a multiple of 8).
    pub done: usize,
    /// The index the next gap counts from.
    pub next: u64,
    /// Wrapping sum of the consumed changes' digest changes.
    pub digest: u64,
    /// Value bits written.
    pub value_bits: u64,
}

/// Encodes groups of eight changes of a piece of 2-byte words as step-coded
/// entries, from the front of `changed` (indices into the piece, ascending),
/// and stops before the first group it cannot take (fewer than eight left, an
/// entry of more than 56 bits, or a word too near the piece's end for an
/// 8-byte gather). `next` is the index the first gap counts from, `block_first`
/// the block's first word in the tensor (for the digest) and `piece_first`
/// the piece's first word in the block. `sign_magnitude` selects the float key
/// (see `dtype::to_key`); otherwise the key is the word itself. The writer must
/// have 8 bytes reserved per change.
///
/// # Safety
/// The CPU must have the features [`available`] checks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512cd")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn write_steps_w2(
    sign_magnitude: bool,
    seed: u64,
    (k, vk): (u32, u32),
    w: &mut FastWriter,
    next: u64,
    block_first: u64,
    piece_first: u64,
    changed: &[u16],
    pa: &[u8],
    pb: &[u8],
) -> Run {
    let set1 = |x: u64| _mm512_set1_epi64(x as i64);
    let (ones, w16, top) = (set1(1), set1(0xffff), set1(0x8000));
    let k_count = _mm_cvtsi64_si128(k as i64);
    let low_mask = set1((1u64 << k) - 1);
    let k1 = set1(k as u64 + 1);
    let vk_one = set1(1u64 << vk);
    let vk_plus_one = set1(vk as u64 + 1);
    let fifty_six = set1(56);
    let sixty_four = set1(64);
    let mut next = next;
    let mut digest = _mm512_setzero_si512();
    let mut value_bits = _mm512_setzero_si512();
    let mut done = 0usize;
    let (mut codes, mut lens) = ([0u64; 8], [0u64; 8]);
    while done + 8 <= changed.len() {
        let c = &changed[done..done + 8];
        // The gathers read 8 bytes at each word: all of them must lie in the
        // piece (indices ascend, so the last one decides).
        if 2 * c[7] as usize + 8 > pa.len() || pa.len() != pb.len() {
            break;
        }
        // SAFETY: `c` is 8 u16 = 16 readable bytes; unaligned load.
        let cv = _mm512_cvtepu16_epi64(unsafe { _mm_loadu_si128(c.as_ptr().cast()) });
        let i = _mm512_add_epi64(cv, set1(piece_first));
        // Gap: i − (previous i + 1), the first lane's counted from `next`.
        let prev = _mm512_alignr_epi64::<7>(_mm512_add_epi64(i, ones), set1(next));
        let g = _mm512_sub_epi64(i, prev);
        let off = _mm512_slli_epi64::<1>(cv);
        // SAFETY: every lane reads bytes 2c..2c+8 of `pa` / `pb`, in bounds by
        // the check above (both have the same length); gathers need no
        // alignment.
        let (old, new) = unsafe {
            (
                _mm512_and_si512(_mm512_i64gather_epi64::<1>(off, pa.as_ptr().cast()), w16),
                _mm512_and_si512(_mm512_i64gather_epi64::<1>(off, pb.as_ptr().cast()), w16),
            )
        };
        // Step of the ordered key, mod 2^16 (see `dtype::to_key`): a
        // sign-magnitude key flips every bit of negatives and only the sign
        // bit of the rest.
        let key = |x: __m512i| {
            if sign_magnitude {
                let neg = _mm512_srli_epi64::<15>(x);
                let flip = _mm512_or_si512(
                    _mm512_and_si512(_mm512_sub_epi64(_mm512_setzero_si512(), neg), w16),
                    top,
                );
                _mm512_xor_si512(x, flip)
            } else {
                x
            }
        };
        let s = _mm512_and_si512(_mm512_sub_epi64(key(new), key(old)), w16);
        // Magnitude and sign of the two's-complement step.
        let sn = _mm512_srli_epi64::<15>(s);
        let m = _mm512_and_si512(
            _mm512_add_epi64(
                _mm512_xor_si512(
                    s,
                    _mm512_and_si512(_mm512_sub_epi64(_mm512_setzero_si512(), sn), w16),
                ),
                sn,
            ),
            w16,
        );
        // Rice code of the gap, as `emit_step`: (1 << q) | low << (q + 1).
        let q = _mm512_srl_epi64(g, k_count);
        let code = _mm512_or_si512(
            _mm512_sllv_epi64(ones, q),
            _mm512_sllv_epi64(_mm512_and_si512(g, low_mask), _mm512_add_epi64(q, ones)),
        );
        let len = _mm512_add_epi64(q, k1);
        // Signed Exp-Golomb code of the magnitude, as `emit_step`.
        let y = _mm512_add_epi64(_mm512_sub_epi64(m, ones), vk_one);
        let nb = _mm512_sub_epi64(sixty_four, _mm512_lzcnt_epi64(y));
        let z = _mm512_sub_epi64(nb, vk_plus_one);
        let vlen = _mm512_add_epi64(_mm512_add_epi64(z, nb), ones);
        let rest = _mm512_xor_si512(y, _mm512_sllv_epi64(ones, _mm512_sub_epi64(nb, ones)));
        let vcode = _mm512_or_si512(
            _mm512_or_si512(
                _mm512_sllv_epi64(ones, z),
                _mm512_sllv_epi64(rest, _mm512_add_epi64(z, ones)),
            ),
            _mm512_sllv_epi64(sn, _mm512_add_epi64(z, nb)),
        );
        let total = _mm512_add_epi64(len, vlen);
        // Longer entries take the scalar path (`emit_long`). A lane with
        // q ≥ 64, whose vector shifts gave 0, fails here too, before anything
        // is written.
        if _mm512_cmpgt_epu64_mask(total, fifty_six) != 0 {
            break;
        }
        let entry = _mm512_or_si512(code, _mm512_sllv_epi64(vcode, len));
        digest = _mm512_add_epi64(
            digest,
            crate::digest::change_x8(seed, _mm512_add_epi64(i, set1(block_first)), old, new),
        );
        value_bits = _mm512_add_epi64(value_bits, vlen);
        // SAFETY: each store writes exactly the 64 bytes of an [u64; 8].
        unsafe {
            _mm512_storeu_si512(codes.as_mut_ptr().cast(), entry);
            _mm512_storeu_si512(lens.as_mut_ptr().cast(), total);
        }
        for (&code, &len) in codes.iter().zip(&lens) {
            w.put56(code, len as u32);
        }
        next = piece_first + c[7] as u64 + 1;
        done += 8;
    }
    Run {
        done,
        next,
        digest: _mm512_reduce_add_epi64(digest) as u64,
        value_bits: _mm512_reduce_add_epi64(value_bits) as u64,
    }
}
