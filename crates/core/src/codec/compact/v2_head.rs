//! What `compact2`'s two encoders share (docs/format.md §6.3): the
//! classes' prologue and the codes of their parameters. `v2` reads
//! prologues and writes them from its staged encoder, `v2_masks` from its
//! lists.

use super::MAX_POS_K;
use crate::codec::bits::FastWriter;

/// Classes of a block.
pub const CLASSES: usize = 3;

/// A class's coding, read from the prologue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ClassHead {
    /// Entries.
    pub(crate) n: u64,
    /// Rice parameter of the position gaps.
    pub(crate) k: u32,
    /// Escapes (entries with |step| ≥ 2), their ranks' Rice parameter and
    /// the Exp-Golomb order of `|step| − 2`.
    pub(crate) esc: u64,
    pub(crate) ke: u32,
    pub(crate) ve: u32,
    /// `None`: one sign bit per entry; `Some(t)`: a list of the `t` entries
    /// whose sign bit is set, ranks Rice-coded with parameter `ko`.
    pub(crate) list: Option<u64>,
    pub(crate) ko: u32,
    /// Bytes of the class's region.
    pub(crate) len: usize,
}

/// A block's prologue: the classes and where the first region starts.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Prologue {
    pub(crate) class: [ClassHead; CLASSES],
    pub(crate) body: usize,
}

pub(super) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Prologue {
    /// Writes the prologue (see [`Prologue::parse`]).
    pub(crate) fn write(&self, raw: bool, out: &mut Vec<u8>) {
        for h in &self.class {
            put_varint(out, h.n);
            if h.n == 0 {
                continue;
            }
            out.push(h.k as u8);
            if !raw {
                put_varint(out, h.esc);
                if h.esc > 0 {
                    out.push(h.ke as u8);
                    out.push(h.ve as u8);
                }
                match h.list {
                    None => put_varint(out, 0),
                    Some(t) => {
                        put_varint(out, t + 1);
                        if t > 0 {
                            out.push(h.ko as u8);
                        }
                    }
                }
            }
            put_varint(out, h.len as u64);
        }
    }
}

/// [`crate::codec::bits::rice_guess`] up to `MAX_POS_K`.
pub(super) fn rice_guess_k(n: u64, sum: u64) -> u32 {
    crate::codec::bits::rice_guess(n, sum, MAX_POS_K as u32)
}

/// A class's positions' Rice parameter: the guess `k` (below `MAX_POS_K`)
/// or a neighbour, whichever codes the gaps in the fewest bits (`costs`:
/// the bits with `k − 1`, `k` and `k + 1`; the first of equals), and those
/// bits. Both encoders choose by this rule, so their bytes agree.
pub(super) fn best_of_three(k: u32, costs: [u64; 3]) -> (u32, u64) {
    [k.saturating_sub(1), k, k + 1]
        .into_iter()
        .zip(costs)
        .min_by_key(|&(_, b)| b)
        .expect("three")
}

/// Bits of the order-`k` Exp-Golomb code of `x`.
#[inline]
fn eg_len(x: u64, k: u32) -> u64 {
    let y = x as u128 + (1u128 << k);
    let nb = 128 - y.leading_zeros() as u64;
    2 * nb - 1 - k as u64
}

/// The best Exp-Golomb order for the values counted in `small` (values
/// below 64) and `large` (by bit length) and its cost; large values are
/// counted at their bit length's upper bound.
fn best_eg(small: &[u64; 64], large: &[u64; 65]) -> (u32, u64) {
    (0..=20u32)
        .map(|k| {
            let s: u64 = (0..64)
                .filter(|&x| small[x] > 0)
                .map(|x| small[x] * eg_len(x as u64, k))
                .sum();
            let l: u64 = (7..65)
                .filter(|&b| large[b] > 0)
                .map(|b| large[b] * eg_len(u64::MAX >> (64 - b), k))
                .sum();
            (k, s + l)
        })
        .min_by_key(|&(_, b)| b)
        .expect("non-empty range")
}

/// The order-`k` Exp-Golomb code of `x` (from the lowest bit: `z` zeros, a
/// one, the `z + k` bits of `x + 2^k` below its top bit) and its length,
/// when that length is at most `room` bits (`room` ≤ 56).
#[inline(always)]
pub(super) fn eg_code(x: u64, k: u32, room: u32) -> Option<(u64, u32)> {
    if k > 40 || x >> 40 != 0 {
        return None;
    }
    let y = x + (1u64 << k);
    let nb = 64 - y.leading_zeros();
    let z = nb - 1 - k;
    if z + nb > room {
        return None;
    }
    Some(((1u64 << z) | ((y ^ (1u64 << (nb - 1))) << (z + 1)), z + nb))
}

/// Writes `x` in order-`k` Exp-Golomb code.
pub(super) fn put_eg(w: &mut FastWriter, x: u64, k: u32) {
    if let Some((code, len)) = eg_code(x, k, 56) {
        w.reserve(8);
        w.put56(code, len);
        return;
    }
    let y = x as u128 + (1u128 << k);
    let nb = 128 - y.leading_zeros();
    w.put_unary((nb - 1 - k) as u64);
    let rest = (y - (1u128 << (nb - 1))) as u64;
    w.put(rest, nb - 1);
}

/// A block's stream: the prologue of `heads` (each class's region length
/// set from `regions`), then the regions in class order.
pub(super) fn assemble<R: AsRef<[u8]>>(
    mut heads: [ClassHead; CLASSES],
    regions: &[R],
    raw: bool,
) -> Vec<u8> {
    for (h, r) in heads.iter_mut().zip(regions) {
        h.len = r.as_ref().len();
    }
    let p = Prologue {
        class: heads,
        body: 0,
    };
    let mut out = Vec::with_capacity(32 + regions.iter().map(|r| r.as_ref().len()).sum::<usize>());
    p.write(raw, &mut out);
    for r in regions {
        out.extend_from_slice(r.as_ref());
    }
    out
}

/// What a class's values cost to choose its value coding from: the
/// escapes (count, sum of their entry-rank gaps, and `|step| − 2` counted
/// by [`Escapes::add`]) and the set signs (count, sum of their entry-rank
/// gaps).
pub(super) struct Escapes {
    pub(super) n: u64,
    pub(super) gap_sum: u64,
    small: [u64; 64],
    large: [u64; 65],
}

impl Default for Escapes {
    fn default() -> Self {
        Escapes {
            n: 0,
            gap_sum: 0,
            small: [0; 64],
            large: [0; 65],
        }
    }
}

impl Escapes {
    /// [`Escapes::add`] for each of `xs`, four at a time into four tables
    /// summed at the end: one table counted every escape in turn, and each
    /// count waited for the one before it through memory (most escapes are
    /// the same few values).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn add_all(&mut self, xs: &[u16]) {
        let mut small = [[0u64; 64]; 4];
        let mut quads = xs.chunks_exact(4);
        for q in &mut quads {
            for (t, &x) in small.iter_mut().zip(q) {
                if x < 64 {
                    t[x as usize] += 1;
                } else {
                    self.add(x as u64);
                }
            }
        }
        for &x in quads.remainder() {
            self.add(x as u64);
        }
        for (i, s) in self.small.iter_mut().enumerate() {
            *s += small.iter().map(|t| t[i]).sum::<u64>();
        }
    }

    /// Counts an escape's `|step| − 2` (values below 64 exactly, larger ones
    /// by bit length).
    #[inline(always)]
    pub(super) fn add(&mut self, x: u64) {
        if x < 64 {
            self.small[x as usize] += 1;
        } else {
            self.large[64 - x.leading_zeros() as usize] += 1;
        }
    }
}

/// Sets `h`'s escape and sign coding (`h.n` entries) from `esc` and the
/// `set` signs whose entry-rank gaps sum to `set_sum`, and returns the bits
/// the values cost step-coded (beyond the positions). Both encoders choose
/// here, so they write the same bytes.
pub(super) fn choose_values(h: &mut ClassHead, esc: &Escapes, (set, set_sum): (u64, u64)) -> u64 {
    let mut bits = 0u64;
    h.esc = esc.n;
    if esc.n > 0 {
        h.ke = rice_guess_k(esc.n, esc.gap_sum);
        let (ve, val_bits) = best_eg(&esc.small, &esc.large);
        h.ve = ve;
        bits += esc.n * (h.ke as u64 + 1) + (esc.gap_sum >> h.ke) + val_bits;
    }
    // The list costs two prologue bytes more than a bit per entry.
    let ko = rice_guess_k(set, set_sum);
    let list_bits = set * (ko as u64 + 1) + (set_sum >> ko) + 16;
    if list_bits < h.n {
        h.list = Some(set);
        h.ko = ko;
        bits += list_bits;
    } else {
        bits += h.n;
    }
    bits
}
