//! AVX-512 kernels for the hottest case, 2-byte words (BF16, F16): the
//! encoder of a compact block's direct part, scan and entries fused, and the
//! apply's resolution of a group of step-coded changes.
//!
//! The scan compares 32 words per vector and *compresses* the changed lanes
//! (AVX-512 VBMI2) into three contiguous arrays: block index, old word, new
//! word. The entry kernel then reads eight changes per vector with plain loads
//! (no gathers) and computes, lane by lane, exactly what the scalar
//! `compact::emit_step` computes for one change (gap, step, Rice code,
//! Exp-Golomb code, digest change). Changes left over at the end of a region
//! (fewer than eight) are carried into the next one, so every group but the
//! block's last is full. Eight finished entries are merged in the vector into
//! as few codes of at most 56 bits as they fit in (one, two, four or eight:
//! `merge8`), which shortens the serial chain of appends to the bit stream. An
//! entry longer than 56 bits is written by the caller's scalar code, so both
//! paths write the same bits; `compact`'s tests compare them on every kind of
//! block.
//!
//! Both kernels are private; [`encode_direct`] and `resolve_steps` are
//! their safe entry points and run them only on a [`Platform`] with
//! [`Level::Avx512Vbmi2`] (answering `None` elsewhere, where the callers take
//! their scalar code).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m512i, _mm_loadu_si128, _mm_storeu_si128, _mm256_add_epi32, _mm256_cvtepu16_epi32,
    _mm256_loadu_si256, _mm256_storeu_si256, _mm512_add_epi32, _mm512_add_epi64,
    _mm512_alignr_epi64, _mm512_and_si512, _mm512_castsi512_si128, _mm512_castsi512_si256,
    _mm512_cmpgt_epu64_mask, _mm512_cmpneq_epi16_mask, _mm512_cvtepu16_epi32,
    _mm512_cvtepu16_epi64, _mm512_cvtepu32_epi64, _mm512_extracti64x4_epi64, _mm512_loadu_si512,
    _mm512_lzcnt_epi64, _mm512_maskz_compress_epi16, _mm512_maskz_loadu_epi16,
    _mm512_maskz_mov_epi64, _mm512_or_si512, _mm512_reduce_add_epi64, _mm512_set1_epi32,
    _mm512_set1_epi64, _mm512_setzero_si512, _mm512_sllv_epi64, _mm512_srl_epi64,
    _mm512_srli_epi64, _mm512_storeu_si512, _mm512_sub_epi64, _mm512_xor_si512,
};

use super::{Ctx, Group};
use crate::codec::bits::FastWriter;
use crate::digest::ChangeBatch;
#[cfg(target_arch = "x86_64")]
use crate::dtype::KeyKind;
use crate::platform::Platform;
#[cfg(target_arch = "x86_64")]
use crate::platform::{HasAvx512, Level, dispatched};

/// What [`encode_direct`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Direct {
    /// Changes encoded.
    pub changes: u64,
    /// The index the next gap counts from (one past the last change).
    pub next: u64,
    /// Wrapping sum of the changes' digest changes.
    pub digest: u64,
    /// Value bits written.
    pub value_bits: u64,
}

/// The part of a block [`encode_direct`] encodes: `base` → `new` (2-byte
/// words), the first of them at block index `start`, gaps counted from block
/// index `next`.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    /// The index the first gap counts from.
    pub next: u64,
    /// Block index of the first word of `base`.
    pub start: u64,
    /// Old words.
    pub base: &'a [u8],
    /// New words.
    pub new: &'a [u8],
}

/// Words scanned per round: the scan fills the arrays from one region, then
/// the kernel drains them. Small, so the entries' work overlaps the memory
/// traffic of the next region (the size of `scan::PIECE`, for the same reason).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const REGION: usize = 2048;

/// The changes of one region plus the carried ones, with slack for full-vector
/// stores past the end.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) struct Records {
    pub(super) index: [u32; REGION + 8 + 32],
    pub(super) old: [u16; REGION + 8 + 32],
    pub(super) new: [u16; REGION + 8 + 32],
}

/// Encodes every change of `part` as step-coded entries with Rice parameter
/// `k` and Exp-Golomb order `vk` (`params`), appending to `w`, when
/// `platform` has [`Level::Avx512Vbmi2`]; `None` (nothing written) otherwise.
///
/// `ctx` gives the key kind (sign-magnitude floats or identity, see
/// `dtype::to_key`), the tensor's digest seed and the block's first word in
/// the tensor. `slow(w, gap, step)` writes an entry longer than 56 bits (the
/// scalar encoder's general path), so both paths write the same bits.
pub fn encode_direct(
    platform: Platform,
    ctx: Ctx,
    params: (u32, u32),
    part: Part<'_>,
    w: &mut FastWriter,
    slow: &mut impl FnMut(&mut FastWriter, u64, u64),
) -> Option<Direct> {
    #[cfg(target_arch = "x86_64")]
    if let (true, Some(proof)) = (platform.has(Level::Avx512Vbmi2), platform.avx512()) {
        dispatched!(EncodeFused, Level::Avx512Vbmi2);
        let kernel = (
            proof,
            ctx.kind == KeyKind::SignMagnitude,
            ctx.seed.0,
            params,
        );
        // SAFETY: `platform.has(Level::Avx512Vbmi2)`: detection found every
        // feature `encode_direct_w2` is compiled with; it is otherwise safe
        // code (its loads and stores are bounds-checked or justified where
        // they are made). Equal output to the scalar encoder is tested by
        // `vector_and_scalar_encoders_agree`.
        return Some(unsafe { encode_direct_w2(kernel, ctx.first, part, w, slow) });
    }
    let _ = (platform, ctx, params, part, w, slow);
    None
}

/// [`encode_direct`]'s kernel. `kernel` is the AVX-512 proof, whether keys
/// are sign-magnitude, the digest seed and `(k, vk)`; `block_first` the
/// block's first word in the tensor.
#[cfg(target_arch = "x86_64")]
#[target_feature(
    enable = "avx512f,avx512bw,avx512dq,avx512cd,avx512vbmi2,avx2,bmi1,bmi2,lzcnt,popcnt"
)]
fn encode_direct_w2(
    (proof, sign_magnitude, seed, (k, vk)): (HasAvx512, bool, u64, (u32, u32)),
    block_first: u64,
    Part {
        next,
        start,
        base,
        new,
    }: Part<'_>,
    w: &mut FastWriter,
    slow: &mut impl FnMut(&mut FastWriter, u64, u64),
) -> Direct {
    assert_eq!(base.len(), new.len(), "encoded buffers differ in length");
    assert!(base.len().is_multiple_of(2), "odd length for 2-byte words");
    assert!(
        start + (base.len() / 2) as u64 <= u32::MAX as u64,
        "block too long for 32-bit indices"
    );
    let mut rec = Records {
        index: [0; REGION + 8 + 32],
        old: [0; REGION + 8 + 32],
        new: [0; REGION + 8 + 32],
    };
    let kernel = Kernel::new(proof, sign_magnitude, seed, (k, vk), block_first);
    let mut st = State {
        next,
        digest: _mm512_setzero_si512(),
        value_bits: _mm512_setzero_si512(),
        changes: 0,
    };
    let mut len = 0usize;
    for (r, (pa, pb)) in base
        .chunks(2 * REGION)
        .zip(new.chunks(2 * REGION))
        .enumerate()
    {
        len = scan_region(pa, pb, start as u32 + (r * REGION) as u32, &mut rec, len);
        len = kernel.drain(&mut rec, len, false, w, &mut st, slow);
    }
    kernel.drain(&mut rec, len, true, w, &mut st, slow);
    Direct {
        changes: st.changes,
        next: st.next,
        digest: _mm512_reduce_add_epi64(st.digest) as u64,
        value_bits: _mm512_reduce_add_epi64(st.value_bits) as u64,
    }
}

/// Appends the changes of one region (`pa`, `pb`: up to [`REGION`] words,
/// the first at block index `first`) after the `len` records already held;
/// returns the new count.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,avx2,bmi1,bmi2,lzcnt,popcnt")]
pub(super) fn scan_region(
    pa: &[u8],
    pb: &[u8],
    first: u32,
    rec: &mut Records,
    mut len: usize,
) -> usize {
    assert!(pa.len() == pb.len() && pa.len() <= 2 * REGION && len < 8);
    const IOTA: [u16; 32] = {
        let mut a = [0u16; 32];
        let mut j = 0;
        while j < 32 {
            a[j] = j as u16;
            j += 1;
        }
        a
    };
    // SAFETY: reads the 64 bytes of `IOTA`.
    let iota = unsafe { _mm512_loadu_si512(IOTA.as_ptr().cast()) };
    let mut at = 0usize;
    while at < pa.len() {
        let bytes = (pa.len() - at).min(64);
        let (a, b) = if bytes == 64 {
            // SAFETY: bytes `at..at + 64` of both slices are in bounds (checked
            // just above); `loadu` has no alignment requirement.
            unsafe {
                (
                    _mm512_loadu_si512(pa[at..at + 64].as_ptr().cast()),
                    _mm512_loadu_si512(pb[at..at + 64].as_ptr().cast()),
                )
            }
        } else {
            // The region's tail: a masked load reads only the selected words
            // (`bytes / 2` of them, all in bounds) and suppresses faults on the
            // rest.
            let m = (1u32 << (bytes / 2)) - 1;
            // SAFETY: as above, for the masked words only.
            unsafe {
                (
                    _mm512_maskz_loadu_epi16(m, pa[at..].as_ptr().cast()),
                    _mm512_maskz_loadu_epi16(m, pb[at..].as_ptr().cast()),
                )
            }
        };
        // Masked-off tail lanes are zero in both, hence equal: never changed.
        let m = _mm512_cmpneq_epi16_mask(a, b);
        let (old, new) = (
            _mm512_maskz_compress_epi16(m, a),
            _mm512_maskz_compress_epi16(m, b),
        );
        // Offsets of the changed words in this chunk, then block indices.
        let offsets = _mm512_maskz_compress_epi16(m, iota);
        let first = _mm512_set1_epi32((first + at as u32 / 2) as i32);
        // Usually at most 8 of the 32 words changed: narrow stores of 8
        // records, which keep the store queue short (the scan's loads wait
        // behind it); the rest only when there are more.
        // SAFETY: every store writes within the named subslice (16, 32 or 64
        // bytes at `len`); the arrays have room for 32 records past any `len`
        // ≤ REGION + 7. Records past the compressed count are scratch.
        unsafe {
            _mm_storeu_si128(
                rec.old[len..len + 8].as_mut_ptr().cast(),
                _mm512_castsi512_si128(old),
            );
            _mm_storeu_si128(
                rec.new[len..len + 8].as_mut_ptr().cast(),
                _mm512_castsi512_si128(new),
            );
            _mm256_storeu_si256(
                rec.index[len..len + 8].as_mut_ptr().cast(),
                _mm256_add_epi32(
                    _mm256_cvtepu16_epi32(_mm512_castsi512_si128(offsets)),
                    _mm512_castsi512_si256(first),
                ),
            );
        }
        if m.count_ones() > 8 {
            // SAFETY: as above.
            unsafe {
                _mm512_storeu_si512(rec.old[len..len + 32].as_mut_ptr().cast(), old);
                _mm512_storeu_si512(rec.new[len..len + 32].as_mut_ptr().cast(), new);
                _mm512_storeu_si512(
                    rec.index[len..len + 16].as_mut_ptr().cast(),
                    _mm512_add_epi32(
                        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(offsets)),
                        first,
                    ),
                );
                _mm512_storeu_si512(
                    rec.index[len + 16..len + 32].as_mut_ptr().cast(),
                    _mm512_add_epi32(
                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(offsets)),
                        first,
                    ),
                );
            }
        }
        len += m.count_ones() as usize;
        at += 64;
    }
    len
}

/// Running totals of [`encode_direct_w2`].
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct State {
    next: u64,
    digest: __m512i,
    value_bits: __m512i,
    changes: u64,
}

/// The per-call constants of the entry kernel.
#[cfg(target_arch = "x86_64")]
struct Kernel {
    proof: HasAvx512,
    sign_magnitude: bool,
    seed: u64,
    block_first: __m512i,
    k: u32,
    low_mask: __m512i,
    k1: __m512i,
    vk_one: __m512i,
    vk_plus_one: __m512i,
}

#[cfg(target_arch = "x86_64")]
impl Kernel {
    #[target_feature(enable = "avx512f")]
    fn new(
        proof: HasAvx512,
        sign_magnitude: bool,
        seed: u64,
        (k, vk): (u32, u32),
        block_first: u64,
    ) -> Kernel {
        let set1 = |x: u64| _mm512_set1_epi64(x as i64);
        Kernel {
            proof,
            sign_magnitude,
            seed,
            block_first: set1(block_first),
            k,
            low_mask: set1((1u64 << k) - 1),
            k1: set1(k as u64 + 1),
            vk_one: set1(1u64 << vk),
            vk_plus_one: set1(vk as u64 + 1),
        }
    }

    /// Encodes the first `len` records in groups of eight, and moves those
    /// left over (fewer than eight) to the front; returns their count. With
    /// `last`, encodes those too (as one partial group) and returns 0.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512cd,avx2,bmi1,bmi2,lzcnt,popcnt")]
    fn drain(
        &self,
        rec: &mut Records,
        len: usize,
        last: bool,
        w: &mut FastWriter,
        st: &mut State,
        slow: &mut impl FnMut(&mut FastWriter, u64, u64),
    ) -> usize {
        let end = if last { len } else { len & !7 };
        if last && !len.is_multiple_of(8) {
            // Unused lanes: equal old and new words add nothing to the digest;
            // their entries are not written.
            rec.old[len..end.next_multiple_of(8)].fill(0);
            rec.new[len..end.next_multiple_of(8)].fill(0);
        }
        w.reserve(8 * end);
        // The running totals in locals (registers), not behind `st`.
        let mut local = *st;
        let mut g = 0;
        while g < end {
            let count = (end - g).min(8);
            self.group(rec, (g, count), 8 * (end - g), w, &mut local, slow);
            g += count;
        }
        *st = local;
        // Carry the rest to the front.
        rec.index.copy_within(end..len, 0);
        rec.old.copy_within(end..len, 0);
        rec.new.copy_within(end..len, 0);
        len - end
    }

    /// Encodes the `count` (1–8) records at `g`; lanes past `count` must have
    /// equal old and new words. `room` is what the writer must keep reserved
    /// for this group and the rest after a slow entry.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512cd,avx2,bmi1,bmi2,lzcnt,popcnt")]
    #[inline]
    fn group(
        &self,
        rec: &Records,
        (g, count): (usize, usize),
        room: usize,
        w: &mut FastWriter,
        st: &mut State,
        slow: &mut impl FnMut(&mut FastWriter, u64, u64),
    ) {
        let set1 = |x: u64| _mm512_set1_epi64(x as i64);
        let (ones, w16) = (set1(1), set1(0xffff));
        let zero = _mm512_setzero_si512();
        // SAFETY: 8 u32 and 8 u16 at `g` are in bounds (the slices check it);
        // unaligned loads.
        let (i, old, new) = unsafe {
            (
                _mm512_cvtepu32_epi64(_mm256_loadu_si256(rec.index[g..g + 8].as_ptr().cast())),
                _mm512_cvtepu16_epi64(_mm_loadu_si128(rec.old[g..g + 8].as_ptr().cast())),
                _mm512_cvtepu16_epi64(_mm_loadu_si128(rec.new[g..g + 8].as_ptr().cast())),
            )
        };
        // Gap: i − (previous i + 1), the first lane's counted from `next`.
        let prev = _mm512_alignr_epi64::<7>(_mm512_add_epi64(i, ones), set1(st.next));
        let gap = _mm512_sub_epi64(i, prev);
        // Step of the ordered key, mod 2^16 (see `dtype::to_key`): a
        // sign-magnitude key flips every bit of negatives and only the sign
        // bit of the rest.
        let key = |x: __m512i| {
            if self.sign_magnitude {
                _mm512_xor_si512(x, sign_flip(_mm512_srli_epi64::<15>(x)))
            } else {
                x
            }
        };
        let s = _mm512_and_si512(_mm512_sub_epi64(key(new), key(old)), w16);
        // Magnitude and sign of the two's-complement step.
        let sn = _mm512_srli_epi64::<15>(s);
        let m = _mm512_and_si512(
            _mm512_add_epi64(
                _mm512_xor_si512(s, _mm512_and_si512(_mm512_sub_epi64(zero, sn), w16)),
                sn,
            ),
            w16,
        );
        // Rice code of the gap, as `emit_step`: (1 << q) | low << (q + 1).
        let q = _mm512_srl_epi64(gap, std::arch::x86_64::_mm_cvtsi64_si128(self.k as i64));
        let code = _mm512_or_si512(
            _mm512_sllv_epi64(ones, q),
            _mm512_sllv_epi64(
                _mm512_and_si512(gap, self.low_mask),
                _mm512_add_epi64(q, ones),
            ),
        );
        let len = _mm512_add_epi64(q, self.k1);
        // Signed Exp-Golomb code of the magnitude, as `emit_step`.
        let y = _mm512_add_epi64(_mm512_sub_epi64(m, ones), self.vk_one);
        let nb = _mm512_sub_epi64(set1(64), _mm512_lzcnt_epi64(y));
        let z = _mm512_sub_epi64(nb, self.vk_plus_one);
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
        let entry = _mm512_or_si512(code, _mm512_sllv_epi64(vcode, len));
        let used = ((1u32 << count) - 1) as u8;
        st.digest = _mm512_add_epi64(
            st.digest,
            crate::digest::change_x8(
                self.proof,
                self.seed,
                _mm512_add_epi64(i, self.block_first),
                old,
                new,
            ),
        );
        st.value_bits = _mm512_add_epi64(st.value_bits, _mm512_maskz_mov_epi64(used, vlen));
        st.changes += count as u64;
        st.next = rec.index[g + count - 1] as u64 + 1;
        // Longer entries take the scalar path. A lane with q ≥ 64, whose vector
        // shifts gave 0, is longer than 56 bits too.
        let fifty_six = set1(56);
        let long = _mm512_cmpgt_epu64_mask(total, fifty_six) & used;
        if count == 8 && long == 0 {
            let (c, l, step) = merge8(entry, total);
            for j in (0..8).step_by(step) {
                w.put56(c[j], l[j] as u32);
            }
            return;
        }
        let (c, l) = spill(entry, total);
        let (gs, ss) = spill(gap, s);
        for j in 0..count {
            if long >> j & 1 == 0 {
                w.put56(c[j], l[j] as u32);
            } else {
                slow(w, gs[j], ss[j]);
                w.reserve(room);
            }
        }
    }
}

/// What the 16-bit sign-magnitude key (`dtype::to_key`) XORs a word with,
/// per lane: every bit (0xffff) where `negative` is 1, only the sign bit
/// (0x8000) where it is 0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn sign_flip(negative: __m512i) -> __m512i {
    let all = _mm512_and_si512(
        _mm512_sub_epi64(_mm512_setzero_si512(), negative),
        _mm512_set1_epi64(0xffff),
    );
    _mm512_or_si512(all, _mm512_set1_epi64(0x8000))
}

/// One level of [`merge8`]: lane `j·2S` takes lane `j·2S + S` above its
/// bits (`codes`, lengths `lens`), for `S` = 1, 2, 4.
macro_rules! merge_level {
    ($name:ident, $s:literal, $up:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        #[inline]
        fn $name(codes: __m512i, lens: __m512i) -> (__m512i, __m512i) {
            let zero = _mm512_setzero_si512();
            // Each lane's length moved up by S lanes: the shift of the lane
            // S above.
            let shift = _mm512_alignr_epi64::<$up>(lens, zero);
            (
                _mm512_or_si512(
                    codes,
                    _mm512_alignr_epi64::<$s>(zero, _mm512_sllv_epi64(codes, shift)),
                ),
                _mm512_add_epi64(lens, _mm512_alignr_epi64::<$s>(zero, lens)),
            )
        }
    };
}
merge_level!(merge_pairs, 1, 7);
merge_level!(merge_quads, 2, 6);
merge_level!(merge_eights, 4, 4);

/// Eight codes (`entry`, lengths `total`, each at most 56 bits) merged
/// into fewer codes of at most 56 bits, for fewer appends to the bit stream:
/// lane 2j takes lane 2j+1 above its bits, then lane 4j lane 4j+2, then lane
/// 0 lane 4. Returns the codes, their lengths and the stride of the ones to
/// write (lanes 0, `step`, 2·`step`…): 8 where all eight fit in one code, 4
/// where each merged four does, 2 where each pair does, else 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn merge8(entry: __m512i, total: __m512i) -> ([u64; 8], [u64; 8], usize) {
    let fifty_six = _mm512_set1_epi64(56);
    let (pair, pair_len) = merge_pairs(entry, total);
    let (quad, quad_len) = merge_quads(pair, pair_len);
    let (oct, oct_len) = merge_eights(quad, quad_len);
    let (codes, lens, step) = if _mm512_cmpgt_epu64_mask(oct_len, fifty_six) & 0x01 == 0 {
        (oct, oct_len, 8)
    } else if _mm512_cmpgt_epu64_mask(quad_len, fifty_six) & 0x11 == 0 {
        (quad, quad_len, 4)
    } else if _mm512_cmpgt_epu64_mask(pair_len, fifty_six) & 0x55 == 0 {
        (pair, pair_len, 2)
    } else {
        (entry, total, 1)
    };
    let (c, l) = spill(codes, lens);
    (c, l, step)
}

/// Eight codes merged as [`merge8`] merges them, into codes of `STEP`
/// (2, 4 or 8) entries: the caller knows each lane's length is at most
/// 56 / `STEP`, so every merged code fits in 56 bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn merge_by<const STEP: usize>(entry: __m512i, total: __m512i) -> ([u64; 8], [u64; 8]) {
    let (mut codes, mut lens) = merge_pairs(entry, total);
    if STEP >= 4 {
        (codes, lens) = merge_quads(codes, lens);
    }
    if STEP >= 8 {
        (codes, lens) = merge_eights(codes, lens);
    }
    spill(codes, lens)
}

/// Two vectors' lanes as arrays.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn spill(a: __m512i, b: __m512i) -> ([u64; 8], [u64; 8]) {
    let (mut x, mut y) = ([0u64; 8], [0u64; 8]);
    // SAFETY: each store writes exactly the 64 bytes of an [u64; 8].
    unsafe {
        _mm512_storeu_si512(x.as_mut_ptr().cast(), a);
        _mm512_storeu_si512(y.as_mut_ptr().cast(), b);
    }
    (x, y)
}

/// Resolves a group of step-coded changes of 2-byte words when `platform`
/// has [`Level::Avx512Vbmi2`] (`None` otherwise): for each of the first
/// `g.count` lanes, `batch.old[j]` becomes word `g.index[j]` of `blk` and
/// `batch.new[j]` the word `unkey(key(old) + g.step[j])` (mod 2^16; see
/// `dtype::to_key`), lanes past the count zero (`batch.index` is left as it
/// is); returns the digest change of those writes (made by the caller). Indices must be in range; the loads are
/// bounds-checked.
///
/// The key arithmetic and the digest run eight lanes per vector; the words
/// are read with scalar loads (an AVX-512 gather could read past the block's
/// end). `compact`'s scalar group resolution is the reference, and
/// `vector_and_scalar_group_writes_agree` compares the two.
pub(crate) fn resolve_steps(
    platform: Platform,
    ctx: Ctx,
    blk: &[u8],
    g: &Group,
    batch: &mut ChangeBatch,
) -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    if let (true, Some(proof)) = (platform.has(Level::Avx512Vbmi2), platform.avx512()) {
        dispatched!(Group, Level::Avx512Vbmi2);
        let sign_magnitude = ctx.kind == KeyKind::SignMagnitude;
        // SAFETY: `platform.has(Level::Avx512Vbmi2)`: detection found every
        // feature `resolve_steps_w2` is compiled with; it is otherwise safe
        // code (bounds-checked loads, array stores justified inside).
        return Some(unsafe {
            resolve_steps_w2(
                (proof, sign_magnitude, ctx.seed.0),
                ctx.first,
                blk,
                g,
                batch,
            )
        });
    }
    let _ = (platform, ctx, blk, g, batch);
    None
}

/// [`resolve_steps`]' kernel.
#[cfg(target_arch = "x86_64")]
#[target_feature(
    enable = "avx512f,avx512bw,avx512dq,avx512cd,avx512vbmi2,avx2,bmi1,bmi2,lzcnt,popcnt"
)]
fn resolve_steps_w2(
    (proof, sign_magnitude, seed): (HasAvx512, bool, u64),
    block_first: u64,
    blk: &[u8],
    g: &Group,
    batch: &mut ChangeBatch,
) -> u64 {
    let (index, step) = (&g.index, &g.step);
    let count = g.count.min(16);
    let (olds, news) = (&mut batch.old, &mut batch.new);
    *olds = [0; 16];
    for j in 0..count {
        let i = index[j] as usize;
        olds[j] = u16::from_le_bytes([blk[2 * i], blk[2 * i + 1]]) as u64;
    }
    let set1 = |x: u64| _mm512_set1_epi64(x as i64);
    let w16 = set1(0xffff);
    let zero = _mm512_setzero_si512();
    let mut digest = zero;
    for h in 0..2 {
        // Unused lanes: old 0 and step 0 give new 0, which adds nothing to
        // the digest.
        let used = (((1u32 << count) - 1) >> (8 * h)) as u8;
        // SAFETY: each load reads 8 u64 of a 16-element array at 8·h.
        let (i, old, s) = unsafe {
            (
                _mm512_loadu_si512(index[8 * h..8 * h + 8].as_ptr().cast()),
                _mm512_loadu_si512(olds[8 * h..8 * h + 8].as_ptr().cast()),
                _mm512_maskz_mov_epi64(
                    used,
                    _mm512_loadu_si512(step[8 * h..8 * h + 8].as_ptr().cast()),
                ),
            )
        };
        let new = if sign_magnitude {
            let flip = sign_flip(_mm512_srli_epi64::<15>(old));
            let key = _mm512_and_si512(_mm512_add_epi64(_mm512_xor_si512(old, flip), s), w16);
            // unkey: keys below 2^15 were negatives, the rest positives.
            let low = _mm512_xor_si512(_mm512_srli_epi64::<15>(key), set1(1));
            _mm512_xor_si512(key, sign_flip(low))
        } else {
            _mm512_and_si512(_mm512_add_epi64(old, s), w16)
        };
        let new = _mm512_maskz_mov_epi64(used, new);
        digest = _mm512_add_epi64(
            digest,
            crate::digest::change_x8(
                proof,
                seed,
                _mm512_add_epi64(i, set1(block_first)),
                old,
                new,
            ),
        );
        // SAFETY: writes 8 u64 of a 16-element array at 8·h.
        unsafe { _mm512_storeu_si512(news[8 * h..8 * h + 8].as_mut_ptr().cast(), new) };
    }
    _mm512_reduce_add_epi64(digest) as u64
}

/// The fused encoder's scan alone over `base` → `new` (2-byte words): the
/// changes it records (for benchmarks: `WEIGHTCAST_PHASE=scan`).
#[doc(hidden)]
pub fn scan_only(base: &[u8], new: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if Platform::cpu().has(Level::Avx512Vbmi2) {
        // SAFETY: as `encode_direct`'s.
        return unsafe { scan_only_w2(base, new) };
    }
    let _ = (base, new);
    0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,avx2,bmi1,bmi2,lzcnt,popcnt")]
fn scan_only_w2(base: &[u8], new: &[u8]) -> u64 {
    let mut rec = Records {
        index: [0; REGION + 8 + 32],
        old: [0; REGION + 8 + 32],
        new: [0; REGION + 8 + 32],
    };
    let mut total = 0u64;
    for (r, (pa, pb)) in base
        .chunks(2 * REGION)
        .zip(new.chunks(2 * REGION))
        .enumerate()
    {
        let len = scan_region(pa, pb, (r * REGION) as u32, &mut rec, 0);
        total += len as u64;
        std::hint::black_box(&rec);
    }
    total
}
