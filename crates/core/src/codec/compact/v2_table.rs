//! Table-driven reading of a `compact2` class's escapes and listed signs
//! (docs/format.md §6.3).
//!
//! An escape is a Rice-coded gap (`rice_ke`) and an Exp-Golomb-coded
//! magnitude (`eg_ve`); a listed sign is a Rice-coded gap alone. Read one
//! code after another, each code's length comes from two zero counts and
//! the shifts between them: a chain of about eight dependent steps per
//! code. At high densities the lists are long and their codes short (with
//! `ke = 0` and `ve = 1`, a step of 2 right after the last escape is 3
//! bits), so a table that maps the next [`BITS`] bits to the codes that end
//! within them (up to [`MAX`]) reads two or three codes per lookup, with a
//! chain of a mask, a load and a shift. Tables exist for small parameters
//! (`k` ≤ 1, `ve` ≤ 3), where codes are that short; each is built on first
//! use and kept (16 KiB each).
//!
//! A table holds only what the codes say; the caller checks the ranks
//! against its class and reads code by code where a lookup has no whole
//! code (see `v2::read_escapes`).

use std::sync::OnceLock;

/// Bits a lookup looks at.
pub(super) const BITS: u32 = 11;
/// Codes one lookup reads at most.
pub(super) const MAX: usize = 3;
/// Largest Rice parameter (of the ranks' gaps) with a table: from `k = 2`
/// on, gaps are long enough that a lookup reads about one code (measured:
/// tables up to `k = 3` made the apply no faster than up to `k = 1`).
const MAX_K: u32 = 1;
/// Largest Exp-Golomb order with a table.
const MAX_VE: u32 = 3;

/// What the next [`BITS`] bits of a list hold, packed in a `u64`: the codes
/// that end within them (at most [`MAX`], each rank offset and magnitude
/// code under 256).
///
/// | bits | field |
/// |---|---|
/// | 0–1 | codes read (0: the first code does not end within the bits) |
/// | 2–5 | their bits |
/// | 6 + 16·i .. 14 + 16·i | code `i`'s rank, counted from the list's next rank |
/// | 14 + 16·i .. 22 + 16·i | code `i`'s Exp-Golomb value (`|step| − 2`; 0 for a listed sign) |
/// | 54–62 | how far the list's next rank moves: the last rank read + 1 |
///
/// Past the codes read, the fields are zero.
pub(super) type Entry = u64;

/// Codes read.
#[inline(always)]
pub(super) fn count(e: Entry) -> u64 {
    e & 3
}

/// Their bits.
#[inline(always)]
pub(super) fn used(e: Entry) -> u64 {
    (e >> 2) & 15
}

/// Code `i`'s rank, counted from the list's next rank.
#[inline(always)]
pub(super) fn at(e: Entry, i: usize) -> u64 {
    (e >> (6 + 16 * i)) & 255
}

/// Code `i`'s Exp-Golomb value.
#[inline(always)]
pub(super) fn x(e: Entry, i: usize) -> u64 {
    (e >> (14 + 16 * i)) & 255
}

/// How far the list's next rank moves.
#[inline(always)]
pub(super) fn span(e: Entry) -> u64 {
    e >> 54
}

/// One table: an [`Entry`] per value of the next [`BITS`] bits.
pub(super) type Table = [Entry; 1 << BITS];

/// Tables by `k` and, for escapes, `ve` (`None`: a list of ranks alone).
const SLOTS: usize = ((MAX_K + 1) * (MAX_VE + 2)) as usize;
static TABLES: [OnceLock<Box<Table>>; SLOTS] = [const { OnceLock::new() }; SLOTS];

/// The table for gaps coded with `rice_k`, each followed by an `eg_ve`
/// value when `ve` is given; `None` where the parameters are too large for
/// a lookup to read more than one code.
pub(super) fn table(k: u32, ve: Option<u32>) -> Option<&'static Table> {
    if k > MAX_K || ve.is_some_and(|v| v > MAX_VE) {
        return None;
    }
    let slot = (k * (MAX_VE + 2) + ve.map_or(0, |v| v + 1)) as usize;
    Some(TABLES[slot].get_or_init(|| build(k, ve)))
}

/// Zeros from bit `pos` of `bits` within the first [`BITS`]: `None` when
/// no one follows them there.
fn zeros(bits: u64, pos: u32) -> Option<u32> {
    let z = (bits >> pos).trailing_zeros();
    (pos + z < BITS).then_some(z)
}

/// Reads the codes of each value of the bits one after another, as the
/// format defines them (§6.3's `rice_k` and `eg_k`).
fn build(k: u32, ve: Option<u32>) -> Box<Table> {
    let mut t = Box::new([0; 1 << BITS]);
    for (bits, e) in t.iter_mut().enumerate() {
        let bits = bits as u64;
        let (mut pos, mut next, mut n) = (0u32, 0u64, 0u64);
        for i in 0..MAX {
            let Some(tz) = zeros(bits, pos) else { break };
            let mut p = pos + tz + 1 + k;
            if p > BITS {
                break;
            }
            let gap = ((tz as u64) << k) | ((bits >> (pos + tz + 1)) & ((1 << k) - 1));
            let mut x = 0;
            if let Some(ve) = ve {
                let Some(z) = zeros(bits, p) else { break };
                let width = z + ve;
                if p + z + 1 + width > BITS {
                    break;
                }
                let rest = (bits >> (p + z + 1)) & ((1 << width) - 1);
                x = ((1 << width) | rest) - (1 << ve);
                p += z + 1 + width;
            }
            let at = next + gap;
            if at > 255 || x > 255 {
                break;
            }
            *e |= (at << (6 + 16 * i)) | (x << (14 + 16 * i));
            n += 1;
            next = at + 1;
            pos = p;
        }
        *e |= n | ((pos as u64) << 2) | (next << 54);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::bits::{FastWriter, put_rice};
    use crate::codec::compact::v2_head::put_eg;

    /// Every table against codes written by the writer's own functions:
    /// for random gap and magnitude lists, the lookup of the first bits
    /// written gives the codes the writer wrote, as many as end within
    /// them (and are under 256), and their bits.
    #[test]
    fn lookups_read_what_the_writer_wrote() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut seen = [0usize; MAX + 1];
        for k in 0..=MAX_K {
            for ve in std::iter::once(None).chain((0..=MAX_VE).map(Some)) {
                let t = table(k, ve).expect("small parameters have a table");
                for _ in 0..3000 {
                    // Mostly short codes, sometimes long ones.
                    let codes: Vec<(u64, u64)> = (0..6)
                        .map(|_| {
                            let r = next();
                            let big = r % 8 == 0;
                            let g = if big { (r >> 8) & 0x3ff } else { (r >> 8) & 3 };
                            let x = if big {
                                (r >> 20) & 0x3ff
                            } else {
                                (r >> 20) & 3
                            };
                            (g, if ve.is_some() { x } else { 0 })
                        })
                        .collect();
                    let mut w = FastWriter::default();
                    let mut ends = vec![];
                    for &(g, x) in &codes {
                        put_rice(&mut w, g, k, (0, 0));
                        if let Some(ve) = ve {
                            put_eg(&mut w, x, ve);
                        }
                        ends.push(w.bit_len());
                    }
                    let bytes = w.finish();
                    let mut b = [0u8; 8];
                    let n = bytes.len().min(8);
                    b[..n].copy_from_slice(&bytes[..n]);
                    let e = t[(u64::from_le_bytes(b) & ((1 << BITS) - 1)) as usize];
                    let (mut want, mut moved) = (0usize, 0u64);
                    for (i, &(g, xv)) in codes.iter().enumerate().take(MAX) {
                        let a = moved + g;
                        if ends[i] > BITS as u64 || a > 255 || xv > 255 {
                            break;
                        }
                        assert_eq!(at(e, i), a, "k {k} ve {ve:?} code {i}");
                        assert_eq!(x(e, i), xv, "k {k} ve {ve:?} code {i}");
                        moved = a + 1;
                        want += 1;
                    }
                    assert_eq!(count(e) as usize, want, "k {k} ve {ve:?}: {codes:?}");
                    assert_eq!(span(e), moved);
                    assert_eq!(used(e), if want > 0 { ends[want - 1] } else { 0 });
                    for i in want..MAX {
                        assert_eq!((at(e, i), x(e, i)), (0, 0));
                    }
                    seen[want] += 1;
                }
            }
        }
        // Every count happened.
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
        assert!(table(MAX_K + 1, None).is_none());
        assert!(table(0, Some(MAX_VE + 1)).is_none());
    }
}
