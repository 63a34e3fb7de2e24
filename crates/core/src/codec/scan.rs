//! The streaming bytewise diff of two equally long buffers, and the plain
//! compare it is measured against.

use crate::dtype::{read_word, word_mask};
#[cfg(any(target_arch = "x86_64", test))]
use crate::platform::Level;
use crate::platform::{Platform, dispatched};

/// Bytes per piece: the unit the scan hands to its caller. Small, so that the
/// caller's per-change work on one piece overlaps the memory traffic of the
/// next (the hardware prefetchers keep streaming through a short pause, not a
/// long one); not smaller, because each piece has a fixed cost. Measured with
/// `examples/codec_instr.rs` at 1% density: 512 B 0.50x the compare, 1 KiB
/// 0.59x, 2–4 KiB 0.70x, 16 KiB 0.57x, 64 KiB 0.61x (one thread).
pub const PIECE: usize = 4 * 1024;

#[inline(always)]
fn lane(s: &[u8], j: usize) -> u64 {
    u64::from_le_bytes(s[j * 8..j * 8 + 8].try_into().expect("8 bytes"))
}

/// The diff, batched: for each piece of up to [`PIECE`] bytes, calls
/// `f(first_word, changed, base_piece, new_piece)` where `changed` lists, in
/// ascending order, the indices (relative to the piece) of the `wb`-byte words
/// that differ. Pieces without changes are skipped.
///
/// Callers do their per-change work in their own loop over `changed`, while the
/// words are still in cache; the scan itself stays branch-light (see
/// `scan_u16`). `base.len()` must equal `new.len()` and be a multiple of `wb`
/// (1, 2, 4 or 8).
#[inline(always)]
pub fn for_each_change_piece(
    wb: usize,
    base: &[u8],
    new: &[u8],
    f: impl FnMut(usize, &[u16], &[u8], &[u8]),
) {
    for_each_change_piece_on(Platform::detect(), wb, base, new, f)
}

/// [`for_each_change_piece`] on `platform` (the AVX2 scan where it has it).
#[inline(always)]
pub(crate) fn for_each_change_piece_on(
    platform: Platform,
    wb: usize,
    base: &[u8],
    new: &[u8],
    mut f: impl FnMut(usize, &[u16], &[u8], &[u8]),
) {
    assert_eq!(base.len(), new.len(), "diffed buffers differ in length");
    assert!(matches!(wb, 1 | 2 | 4 | 8), "word width {wb}");
    // At most one index per word of a piece, plus slack for unconditional writes.
    let mut idx = [0u16; PIECE + 8];
    for (p, (pa, pb)) in base.chunks(PIECE).zip(new.chunks(PIECE)).enumerate() {
        let len = if wb == 2 {
            changed_u16_on(platform, pa, pb, &mut idx)
        } else {
            changed_lanes(wb, pa, pb, &mut idx)
        };
        if len > 0 {
            f(p * (PIECE / wb), &idx[..len], pa, pb);
        }
    }
}

/// Calls `f(word_index, old_word, new_word)` for every `wb`-byte word whose bytes
/// differ between `base` and `new`, in ascending index order.
#[inline(always)]
pub fn for_each_change(wb: usize, base: &[u8], new: &[u8], mut f: impl FnMut(usize, u64, u64)) {
    for_each_change_piece(wb, base, new, |first, changed, pa, pb| {
        for &i in changed {
            let i = i as usize;
            f(first + i, read_word(pa, wb, i), read_word(pb, wb, i));
        }
    })
}

/// Changed-word indices of one piece for BF16/F16, nearly branch-free.
///
/// Weight changes fall at random positions, so a branch per lane or per word
/// mispredicts several times per change. Instead every 128 bytes (64 words)
/// become a u64 mask of changed words (SWAR, vectorized by the compiler), and
/// the set bits' indices are appended with unconditional writes.
#[inline(always)]
fn changed_u16(pa: &[u8], pb: &[u8], idx: &mut [u16; PIECE + 8]) -> usize {
    const LANES: usize = 16;
    const BYTES: usize = LANES * 8;
    const LOW: u64 = 0x7fff_7fff_7fff_7fff;
    const HIGH: u64 = 0x8000_8000_8000_8000;
    let full = pa.len() - pa.len() % BYTES;
    let mut len = 0usize;
    for (c, (a, b)) in pa[..full]
        .chunks_exact(BYTES)
        .zip(pb[..full].chunks_exact(BYTES))
        .enumerate()
    {
        let mut mask = 0u64;
        for j in 0..LANES {
            let d = lane(a, j) ^ lane(b, j);
            // Top bit of each 16-bit field set iff the field is non-zero.
            let m = ((((d & LOW).wrapping_add(LOW)) | d) & HIGH) >> 15;
            // Bits 0, 16, 32, 48 → 0, 1, 2, 3: the lane's four words in order.
            let m = (m | (m >> 15) | (m >> 30) | (m >> 45)) & 0xf;
            mask |= m << (4 * j);
        }
        let count = mask.count_ones() as usize;
        let first = (c * 64) as u16;
        // Usually 0–2 changes per 64 words: four unconditional writes cover them
        // without a data-dependent branch; entries past `count` are overwritten
        // by the next chunk.
        let mut m = mask;
        for k in 0..4 {
            idx[len + k] = first.wrapping_add(m.trailing_zeros() as u16);
            m &= m.wrapping_sub(1);
        }
        if count > 4 {
            let mut k = 4;
            while m != 0 {
                idx[len + k] = first + m.trailing_zeros() as u16;
                m &= m - 1;
                k += 1;
            }
        }
        len += count;
    }
    for i in full / 2..pa.len() / 2 {
        if read_word(pa, 2, i) != read_word(pb, 2, i) {
            idx[len] = i as u16;
            len += 1;
        }
    }
    len
}

/// [`changed_u16`] for [`Level::Avx2`], with explicit
/// AVX2: per 64 words, four 16-lane compares, two saturating packs to bytes, a
/// lane fix-up and two byte-mask extractions give the 64-bit mask of *equal*
/// words in ≈20 instructions (the SWAR form takes ≈100). Index extraction is
/// the same as the portable one's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
fn changed_u16_avx2(pa: &[u8], pb: &[u8], idx: &mut [u16; PIECE + 8]) -> usize {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi16, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_packs_epi16,
        _mm256_permute4x64_epi64,
    };
    const BYTES: usize = 128;
    assert_eq!(pa.len(), pb.len());
    let full = pa.len() - pa.len() % BYTES;
    let mut len = 0usize;
    for (c, (a, b)) in pa[..full]
        .chunks_exact(BYTES)
        .zip(pb[..full].chunks_exact(BYTES))
        .enumerate()
    {
        let a = a.as_ptr() as *const __m256i;
        let b = b.as_ptr() as *const __m256i;
        // SAFETY: `a` and `b` point to 128 readable bytes (chunks_exact(128));
        // the four loads read bytes 0..32, 32..64, 64..96 and 96..128 of each,
        // and `loadu` has no alignment requirement. The CPU has AVX2: this
        // function is only called by `changed_u16_on` after checking it.
        let (a0, a1, a2, a3, b0, b1, b2, b3) = unsafe {
            (
                _mm256_loadu_si256(a),
                _mm256_loadu_si256(a.add(1)),
                _mm256_loadu_si256(a.add(2)),
                _mm256_loadu_si256(a.add(3)),
                _mm256_loadu_si256(b),
                _mm256_loadu_si256(b.add(1)),
                _mm256_loadu_si256(b.add(2)),
                _mm256_loadu_si256(b.add(3)),
            )
        };
        // 0xffff per equal word; packs keeps it as 0xff per byte, but
        // interleaves the 128-bit halves (x.lo, y.lo, x.hi, y.hi), which the
        // 64-bit-lane permute puts back in order (x.lo, x.hi, y.lo, y.hi).
        let e01 = _mm256_packs_epi16(_mm256_cmpeq_epi16(a0, b0), _mm256_cmpeq_epi16(a1, b1));
        let e23 = _mm256_packs_epi16(_mm256_cmpeq_epi16(a2, b2), _mm256_cmpeq_epi16(a3, b3));
        let e01 = _mm256_permute4x64_epi64::<0b11_01_10_00>(e01);
        let e23 = _mm256_permute4x64_epi64::<0b11_01_10_00>(e23);
        let lo = _mm256_movemask_epi8(e01) as u32 as u64;
        let hi = _mm256_movemask_epi8(e23) as u32 as u64;
        let mask = !(lo | (hi << 32));
        let count = mask.count_ones() as usize;
        let first = (c * 64) as u16;
        let mut m = mask;
        for k in 0..4 {
            idx[len + k] = first.wrapping_add(m.trailing_zeros() as u16);
            m &= m.wrapping_sub(1);
        }
        if count > 4 {
            let mut k = 4;
            while m != 0 {
                idx[len + k] = first + m.trailing_zeros() as u16;
                m &= m - 1;
                k += 1;
            }
        }
        len += count;
    }
    for i in full / 2..pa.len() / 2 {
        if read_word(pa, 2, i) != read_word(pb, 2, i) {
            idx[len] = i as u16;
            len += 1;
        }
    }
    len
}

/// The changed-word indices of one 2-byte piece on `platform`.
#[inline(always)]
fn changed_u16_on(platform: Platform, pa: &[u8], pb: &[u8], idx: &mut [u16; PIECE + 8]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if platform.has(Level::Avx2) {
        dispatched!(Scan, Level::Avx2);
        // SAFETY: `platform.has(Level::Avx2)`: detection found every feature
        // the function is compiled with; it is otherwise safe code.
        // Exercised by `avx2_and_portable_scans_agree`.
        return unsafe { changed_u16_avx2(pa, pb, idx) };
    }
    let _ = platform;
    dispatched!(Scan, Level::Portable);
    changed_u16(pa, pb, idx)
}

/// Changed-word indices of one piece for the other widths: compares eight bytes
/// at a time and looks at individual words only inside lanes that differ.
fn changed_lanes(wb: usize, pa: &[u8], pb: &[u8], idx: &mut [u16; PIECE + 8]) -> usize {
    let bits = (wb * 8) as u32;
    let wmask = word_mask(wb);
    let full = pa.len() - pa.len() % 8;
    let mut len = 0usize;
    for (j, (a, b)) in pa[..full]
        .chunks_exact(8)
        .zip(pb[..full].chunks_exact(8))
        .enumerate()
    {
        let mut d = lane(a, 0) ^ lane(b, 0);
        while d != 0 {
            let w = d.trailing_zeros() / bits;
            idx[len] = (j * 8 / wb) as u16 + w as u16;
            len += 1;
            // Clear this word's bits (for 8-byte words the mask is every bit).
            d &= !(wmask << (w * bits));
        }
    }
    for i in full / wb..pa.len() / wb {
        if read_word(pa, wb, i) != read_word(pb, wb, i) {
            idx[len] = i as u16;
            len += 1;
        }
    }
    len
}

/// The baseline: counts differing `wb`-byte words with a plain branch-free
/// compare of the two buffers, the least work any diff must do, running at
/// memory bandwidth. Benchmarks report codec speed as a ratio to this, measured
/// on the same buffers in the same run.
///
/// Per 8-byte lane `d = x ^ y`, a word is non-zero iff the top bit of
/// `((d & L) + L) | d` is set in its field, with `L` = the field's low bits
/// (`0x7f…`) repeated; a popcount of those top bits counts the changed words.
pub fn count_changed_plain(wb: usize, base: &[u8], new: &[u8]) -> u64 {
    count_changed_on(Platform::detect(), wb, base, new)
}

/// [`count_changed_plain`] on `platform`.
fn count_changed_on(platform: Platform, wb: usize, base: &[u8], new: &[u8]) -> u64 {
    assert_eq!(base.len(), new.len(), "compared buffers differ in length");
    // The baseline gets the same instruction set as the scan it is compared with.
    #[cfg(target_arch = "x86_64")]
    if platform.has(Level::Avx2) {
        dispatched!(Compare, Level::Avx2);
        // SAFETY: `platform.has(Level::Avx2)`: detection found every feature
        // the function is compiled with; it is otherwise safe code.
        return unsafe { count_changed_avx2(wb, base, new) };
    }
    let _ = platform;
    dispatched!(Compare, Level::Portable);
    count_changed_portable(wb, base, new)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
fn count_changed_avx2(wb: usize, base: &[u8], new: &[u8]) -> u64 {
    count_changed_portable(wb, base, new)
}

#[inline(always)]
fn count_changed_portable(wb: usize, base: &[u8], new: &[u8]) -> u64 {
    let (low, high) = match wb {
        1 => (0x7f7f_7f7f_7f7f_7f7fu64, 0x8080_8080_8080_8080u64),
        2 => (0x7fff_7fff_7fff_7fff, 0x8000_8000_8000_8000),
        4 => (0x7fff_ffff_7fff_ffff, 0x8000_0000_8000_0000),
        _ => (0x7fff_ffff_ffff_ffff, 0x8000_0000_0000_0000),
    };
    let full = base.len() - base.len() % 8;
    let mut n: u64 = base[..full]
        .chunks_exact(8)
        .zip(new[..full].chunks_exact(8))
        .map(|(x, y)| {
            let d = u64::from_le_bytes(x.try_into().expect("8 bytes"))
                ^ u64::from_le_bytes(y.try_into().expect("8 bytes"));
            ((((d & low).wrapping_add(low)) | d) & high).count_ones() as u64
        })
        .sum();
    for i in full / wb..base.len() / wb {
        n += u64::from(read_word(base, wb, i) != read_word(new, wb, i));
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn many_pieces_and_dense_chunks() {
        // 100 KiB: several 16 KiB pieces; a dense stretch puts more than four
        // changes in one 64-word chunk; a tail that is not a whole chunk.
        let base: Vec<u8> = (0..100_003u32 * 2).map(|i| (i * 7 % 251) as u8).collect();
        let base = &base[..base.len() / 2 * 2];
        let mut new = base.to_vec();
        let mut expect = Vec::new();
        for w in (0..base.len() / 2)
            .filter(|w| w % 997 == 3 || (40_000..40_050).contains(w) || *w == base.len() / 2 - 1)
        {
            new[2 * w] ^= 0x5a;
            expect.push(w);
        }
        let mut got = Vec::new();
        for_each_change(2, base, &new, |i, o, n| {
            assert_eq!(o, read_word(base, 2, i));
            assert_eq!(n, read_word(&new, 2, i));
            got.push(i)
        });
        assert_eq!(got, expect);
        assert_eq!(count_changed_plain(2, base, &new), expect.len() as u64);
    }

    /// The AVX2 scan and compare against the portable ones, on pieces with
    /// changes in every bit position, dense chunks and ragged tails.
    #[test]
    fn avx2_and_portable_scans_agree() {
        let base: Vec<u8> = (0..40_002u32).map(|i| (i * 31 % 253) as u8).collect();
        let mut new = base.clone();
        for k in (0..new.len()).step_by(37) {
            new[k] ^= 1 << (k % 8);
        }
        for b in &mut new[20_000..20_300] {
            *b ^= 0x40;
        }
        let pieces: Vec<(&[u8], &[u8])> = base
            .chunks(PIECE)
            .zip(new.chunks(PIECE))
            .chain([(&base[..130], &new[..130]), (&base[..2], &new[..2])])
            .collect();
        let portable: Vec<Vec<u16>> = pieces
            .iter()
            .map(|(a, b)| {
                let mut idx = [0u16; PIECE + 8];
                let n = changed_u16_on(Platform::portable(), a, b, &mut idx);
                idx[..n].to_vec()
            })
            .collect();
        let expect: Vec<u64> = [1, 2, 4, 8]
            .map(|wb| count_changed_portable(wb, &base, &new))
            .to_vec();
        assert!(portable.iter().any(|v| v.len() > 4));
        if !crate::platform::expect::require(Level::Avx2, "avx2_and_portable_scans_agree") {
            return;
        }
        for ((a, b), want) in pieces.iter().zip(&portable) {
            let mut idx = [0u16; PIECE + 8];
            let n = changed_u16_on(Platform::cpu(), a, b, &mut idx);
            assert_eq!(&idx[..n], want.as_slice());
        }
        for (wb, want) in [1, 2, 4, 8].into_iter().zip(expect) {
            assert_eq!(count_changed_on(Platform::cpu(), wb, &base, &new), want);
        }
    }

    proptest! {
        #[test]
        fn finds_exactly_the_changed_words(
            wb in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            base in proptest::collection::vec(any::<u8>(), 0..600),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..40),
        ) {
            let len = base.len() / wb * wb;
            let base = &base[..len];
            let mut new = base.to_vec();
            for (at, v) in flips {
                if len > 0 { new[at % len] = v; }
            }
            let mut got = Vec::new();
            for_each_change(wb, base, &new, |i, o, n| got.push((i, o, n)));
            let expect: Vec<_> = (0..len / wb)
                .filter_map(|i| {
                    let (o, n) = (read_word(base, wb, i), read_word(&new, wb, i));
                    (o != n).then_some((i, o, n))
                })
                .collect();
            prop_assert_eq!(&got, &expect);
            prop_assert_eq!(count_changed_plain(wb, base, &new), expect.len() as u64);
        }
    }
}
