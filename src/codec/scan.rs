//! The streaming bytewise diff of two equally long buffers, and the plain
//! compare it is measured against.

use crate::dtype::{read_word, word_mask};

/// Bytes compared per step before looking at individual words.
const CHUNK: usize = 32;

#[inline(always)]
fn lane(s: &[u8], j: usize) -> u64 {
    u64::from_le_bytes(s[j * 8..j * 8 + 8].try_into().expect("8 bytes"))
}

/// Calls `f(word_index, old_word, new_word)` for every `wb`-byte word whose bytes
/// differ between `base` and `new`, in ascending index order.
///
/// Compares 64 bytes at a time as eight u64 lanes and only looks at words inside
/// lanes that differ, so the cost on unchanged data is that of a plain compare.
/// `base.len()` must equal `new.len()` and be a multiple of `wb` (1, 2, 4 or 8).
#[inline(always)]
pub fn for_each_change(wb: usize, base: &[u8], new: &[u8], f: impl FnMut(usize, u64, u64)) {
    assert_eq!(base.len(), new.len(), "diffed buffers differ in length");
    match wb {
        1 => scan::<1>(base, new, f),
        2 => scan_u16(base, new, f),
        4 => scan::<4>(base, new, f),
        8 => scan::<8>(base, new, f),
        _ => unreachable!("word width {wb}"),
    }
}

/// The hot case (BF16/F16), nearly branch-free.
///
/// Weight changes fall at random positions, so a branch per lane or per word
/// mispredicts several times per change. Instead, per 16 KiB piece (L1-sized):
/// phase 1 turns every 128 bytes (64 words) into a u64 mask of changed words and
/// appends the set bits' indices to a small buffer with unconditional writes;
/// phase 2 visits the buffered indices, whose words are still in cache, in a
/// loop of known length.
#[inline(always)]
fn scan_u16(base: &[u8], new: &[u8], mut f: impl FnMut(usize, u64, u64)) {
    const LANES: usize = 16;
    const BYTES: usize = LANES * 8;
    const PIECE: usize = 16 * 1024;
    const LOW: u64 = 0x7fff_7fff_7fff_7fff;
    const HIGH: u64 = 0x8000_8000_8000_8000;
    // At most one index per word of a piece, plus slack for unconditional writes.
    let mut idx = [0u16; PIECE / 2 + 8];
    let full = base.len() - base.len() % BYTES;
    for (p, (pa, pb)) in base[..full]
        .chunks(PIECE)
        .zip(new[..full].chunks(PIECE))
        .enumerate()
    {
        let mut len = 0usize;
        for (c, (a, b)) in pa
            .chunks_exact(BYTES)
            .zip(pb.chunks_exact(BYTES))
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
            // Usually 0–2 changes per 64 words: four unconditional writes cover
            // them without a data-dependent branch; indices past `count` are
            // overwritten by the next chunk.
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
        let offset = p * (PIECE / 2);
        for &i in &idx[..len] {
            let at = 2 * i as usize;
            let x = u16::from_le_bytes([pa[at], pa[at + 1]]);
            let y = u16::from_le_bytes([pb[at], pb[at + 1]]);
            f(offset + i as usize, x as u64, y as u64);
        }
    }
    for i in full / 2..base.len() / 2 {
        let (o, n) = (read_word(base, 2, i), read_word(new, 2, i));
        if o != n {
            f(i, o, n);
        }
    }
}

#[inline(always)]
fn scan<const W: usize>(base: &[u8], new: &[u8], mut f: impl FnMut(usize, u64, u64)) {
    let bits = (W * 8) as u32;
    let wmask = word_mask(W);
    let full = base.len() - base.len() % CHUNK;
    for (c, (a, b)) in base[..full]
        .chunks_exact(CHUNK)
        .zip(new[..full].chunks_exact(CHUNK))
        .enumerate()
    {
        let mut any = 0u64;
        for j in 0..CHUNK / 8 {
            any |= lane(a, j) ^ lane(b, j);
        }
        if any == 0 {
            continue;
        }
        for j in 0..CHUNK / 8 {
            let (x, y) = (lane(a, j), lane(b, j));
            let mut d = x ^ y;
            while d != 0 {
                let w = d.trailing_zeros() / bits;
                let sh = w * bits;
                f(
                    (c * CHUNK + j * 8) / W + w as usize,
                    (x >> sh) & wmask,
                    (y >> sh) & wmask,
                );
                // Clear this word's bits (for W = 8 the mask is every bit).
                d &= !(wmask << sh);
            }
        }
    }
    for i in full / W..base.len() / W {
        let (o, n) = (read_word(base, W, i), read_word(new, W, i));
        if o != n {
            f(i, o, n);
        }
    }
}

/// Changed words found by [`collect_changes`], as parallel arrays.
#[derive(Default, Debug)]
pub struct Changes {
    /// Word indices, ascending.
    pub index: Vec<u64>,
    /// Old words.
    pub old: Vec<u64>,
    /// New words.
    pub new: Vec<u64>,
}

impl Changes {
    /// Empties the arrays, keeping their capacity.
    pub fn clear(&mut self) {
        self.index.clear();
        self.old.clear();
        self.new.clear();
    }

    /// Number of changes.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}

/// Appends every changed word of `base`/`new` to `out`. The per-change work of
/// callers then runs in their own tight loop over the arrays.
pub fn collect_changes(wb: usize, base: &[u8], new: &[u8], out: &mut Changes) {
    for_each_change(wb, base, new, |i, o, n| {
        out.index.push(i as u64);
        out.old.push(o);
        out.new.push(n);
    });
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
    assert_eq!(base.len(), new.len(), "compared buffers differ in length");
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
