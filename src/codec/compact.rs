//! The `compact` delta encoding: per block of words, one bit stream holding, for
//! each changed word in ascending order, its Rice-coded position gap followed by
//! its value, either as a signed Exp-Golomb-coded step of the ordered key
//! ("ulp steps", needs the base) or as the raw new word.
//!
//! Positions of changed weights at RL densities are close to a Bernoulli
//! process, whose gaps are geometric; Golomb–Rice codes are the optimal prefix
//! codes for those and land within a few hundredths of a bit of the entropy.
//! Value steps are mostly ±1 ulp, which the order-0 Exp-Golomb code spends two
//! bits on (one for the magnitude, one for the sign). Parameters are chosen per
//! block from the data. `docs/format.md` specifies the bit layout.

use rayon::prelude::*;

use super::bits::{BitReader, BitWriter};
use super::scan::for_each_change_piece;
use crate::digest::TensorSeed;
use crate::dtype::{
    KeyKind, from_key, load, read_word, step_magnitude, store, to_key, word_mask, write_word,
};
use crate::error::{Error, Result};
use crate::format::{BlockEntry, ValueCoding};

/// Words per block written by this crate (readers accept any value ≥ 1 recorded
/// in `block_words`). Blocks bound encoder memory and are the unit of parallelism.
pub const BLOCK_WORDS: u64 = 1 << 22;

/// Suffix of a compact payload tensor: `<name>.compact`.
pub const SUFFIX: &str = ".compact";

/// Largest Rice parameter a reader accepts.
pub const MAX_POS_K: u8 = 40;
/// Largest Exp-Golomb order a reader accepts.
pub const MAX_VAL_K: u8 = 32;

/// A compact-encoded tensor.
pub struct EncodedTensor {
    /// Changed words.
    pub changed: u64,
    /// Wrapping digest change (new − old contributions).
    pub digest_change: u64,
    /// Block directory.
    pub blocks: Vec<BlockEntry>,
    /// Concatenated block streams.
    pub payload: Vec<u8>,
}

/// What a decoded entry says about the new word.
#[derive(Clone, Copy, Debug)]
pub enum Value {
    /// Add this (already masked, two's-complement) step to the old word's key.
    Step(u64),
    /// The new word itself.
    Raw(u64),
}

impl Value {
    /// The new word given the old one.
    #[inline]
    pub fn resolve(self, kind: KeyKind, wb: usize, old: u64) -> u64 {
        match self {
            Value::Raw(v) => v,
            Value::Step(s) => from_key(
                kind,
                wb,
                to_key(kind, wb, old).wrapping_add(s) & word_mask(wb),
            ),
        }
    }
}

/// Diffs `base` against `new` and encodes the changes.
pub fn encode_tensor(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    base: &[u8],
    new: &[u8],
) -> EncodedTensor {
    let block_bytes = BLOCK_WORDS as usize * wb;
    let parts: Vec<(BlockEntry, Vec<u8>, u64)> = base
        .par_chunks(block_bytes)
        .zip(new.par_chunks(block_bytes))
        .enumerate()
        .map(|(b, (old, new))| encode_block(kind, wb, seed, b as u64 * BLOCK_WORDS, old, new))
        .collect();
    let mut out = EncodedTensor {
        changed: 0,
        digest_change: 0,
        blocks: Vec::with_capacity(parts.len()),
        payload: Vec::with_capacity(parts.iter().map(|p| p.1.len()).sum()),
    };
    for (entry, bytes, dig) in parts {
        out.changed += entry.changes;
        out.digest_change = out.digest_change.wrapping_add(dig);
        out.payload.extend_from_slice(&bytes);
        out.blocks.push(entry);
    }
    out
}

fn encode_block(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
) -> (BlockEntry, Vec<u8>, u64) {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let Scratch { gaps, steps } = &mut *scratch;
        gaps.clear();
        steps.clear();
        if super::cpu::wide() {
            // SAFETY: `cpu::wide()` confirmed every feature `encode_block_wide`
            // is compiled with; the function is otherwise safe code.
            #[cfg(target_arch = "x86_64")]
            return unsafe { encode_block_wide(kind, wb, seed, first, base, new, gaps, steps) };
        }
        crate::with_word_width!(wb, W => encode_block_w::<W>(kind, seed, first, base, new, gaps, steps))
    })
}

/// [`encode_block_w`] compiled for the wide feature set (see [`super::cpu`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
#[allow(clippy::too_many_arguments)]
fn encode_block_wide(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
    gaps: &mut Vec<u64>,
    steps: &mut Vec<u64>,
) -> (BlockEntry, Vec<u8>, u64) {
    crate::with_word_width!(wb, W => encode_block_w::<W>(kind, seed, first, base, new, gaps, steps))
}

/// Per-thread gap and step arrays, reused across blocks so encoding does not pay
/// fresh-page faults for every block.
#[derive(Default)]
struct Scratch {
    gaps: Vec<u64>,
    steps: Vec<u64>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

#[inline(always)]
fn encode_block_w<const W: usize>(
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
    gaps: &mut Vec<u64>,
    steps: &mut Vec<u64>,
) -> (BlockEntry, Vec<u8>, u64) {
    let wb = W;
    let mask = word_mask(W);
    let sign = 1u64 << (W * 8 - 1);
    let mut stats = Stats::default();
    let mut next = 0u64; // first index the next gap counts from
    let mut dig = 0u64;
    for_each_change_piece(W, base, new, |piece_first, changed, pa, pb| {
        // Per piece: one tight loop over its changes, with the running state in
        // locals (the closure's captures would go through memory).
        let (mut nx, mut dg) = (next, dig);
        let (mut gsum, mut ones, mut twos) = (0u64, 0u64, 0u64);
        gaps.reserve(changed.len());
        steps.reserve(changed.len());
        for &c in changed {
            let (old, nw) = (load::<W>(pa, c as usize), load::<W>(pb, c as usize));
            let i = (piece_first + c as usize) as u64;
            let g = i - nx;
            nx = i + 1;
            let s = to_key(kind, W, nw).wrapping_sub(to_key(kind, W, old)) & mask;
            let m = step_magnitude(W, s);
            gsum += g;
            ones += u64::from(m == 1);
            twos += u64::from(m == 2);
            if m > 2 {
                stats.add_rare(m);
            }
            dg = dg.wrapping_add(seed.change(first + i, old, nw));
            gaps.push(g);
            steps.push(s);
        }
        stats.n += changed.len() as u64;
        stats.gap_sum += gsum;
        stats.ones += ones;
        stats.twos += twos;
        next = nx;
        dig = dg;
    });
    let n = gaps.len() as u64;
    if n == 0 {
        let e = BlockEntry {
            changes: 0,
            pos_k: 0,
            values: ValueCoding::Raw,
            val_k: 0,
            bytes: 0,
        };
        return (e, Vec::new(), 0);
    }
    let (pos_k, pos_bits) = stats.choose_rice_k();
    let (val_k, step_bits) = stats.choose_eg_k();
    let raw_bits = n * wb as u64 * 8;
    let values = if step_bits < raw_bits {
        ValueCoding::Step
    } else {
        ValueCoding::Raw
    };
    let val_bits = if values == ValueCoding::Step {
        step_bits
    } else {
        raw_bits
    };
    let mut w = BitWriter::with_capacity(((pos_bits + val_bits) / 8 + 16) as usize);
    let low = (1u64 << pos_k) - 1;
    let k = pos_k as u32;
    let mut at = 0u64; // word index of the current change, for raw values
    for j in 0..gaps.len() {
        let g = gaps[j];
        // One change is usually one write: [Rice gap][value], LSB first.
        let q = g >> pos_k;
        let (code, len) = if q + 1 + k as u64 <= 64 {
            let q = q as u32;
            let head = 1u64 << q;
            let tail = if k == 0 { 0 } else { (g & low) << (q + 1) };
            (head | tail, q + 1 + k)
        } else {
            w.put_unary(q);
            w.put(g & low, k);
            (0, 0)
        };
        let (vcode, vlen) = match values {
            ValueCoding::Raw => {
                // Raw mode is rare (large jumps); read the new word back.
                at += g;
                let word = load::<W>(new, at as usize);
                at += 1;
                (word, wb as u32 * 8)
            }
            ValueCoding::Step => {
                let s = steps[j];
                let m = step_magnitude(wb, s);
                let y = (m - 1) + (1u64 << val_k);
                let nb = 64 - y.leading_zeros();
                let z = nb - 1 - val_k as u32;
                let rest = y & ((1u64 << (nb - 1)) - 1);
                let sign = u64::from(s & sign != 0);
                let vlen = z + nb + 1;
                if vlen <= 64 {
                    ((1u64 << z) | (rest << (z + 1)) | (sign << (z + nb)), vlen)
                } else {
                    w.put(code, len);
                    w.put_unary(z as u64);
                    w.put(rest, nb - 1);
                    w.put(sign, 1);
                    continue;
                }
            }
        };
        if len + vlen <= 64 {
            w.put(code | (vcode << len), len + vlen);
        } else {
            w.put(code, len);
            w.put(vcode, vlen);
        }
    }
    let bytes = w.finish();
    let e = BlockEntry {
        changes: n,
        pos_k,
        values,
        val_k,
        bytes: bytes.len() as u64,
    };
    (e, bytes, dig)
}

/// Bits of the order-`k` Exp-Golomb code of `m - 1`, plus the sign bit.
#[inline]
fn eg_bits(m: u64, k: u8) -> u64 {
    let y = (m - 1) + (1u64 << k);
    let nb = 64 - y.leading_zeros() as u64;
    2 * nb - k as u64
}

/// Magnitudes below this are counted exactly when choosing the value code.
const SMALL: usize = 256;

/// Statistics gathered during the scan, from which the block's code parameters
/// are chosen without another pass over its changes. The common cases (gap sum,
/// ±1 and ±2 steps) are plain counters the hot loop keeps in registers; only the
/// rare larger steps go to a histogram.
struct Stats {
    /// Number of changes.
    n: u64,
    /// Sum of the gaps.
    gap_sum: u64,
    /// Steps of magnitude 1 and 2.
    ones: u64,
    twos: u64,
    /// Magnitudes 3..[`SMALL`], exactly.
    small: [u64; SMALL],
    /// Larger magnitudes by bit length.
    large: [u64; 65],
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            n: 0,
            gap_sum: 0,
            ones: 0,
            twos: 0,
            small: [0; SMALL],
            large: [0; 65],
        }
    }
}

impl Stats {
    /// Records a magnitude of 3 or more.
    #[inline]
    fn add_rare(&mut self, magnitude: u64) {
        if (magnitude as usize) < SMALL {
            self.small[magnitude as usize] += 1;
        } else {
            self.large[(64 - magnitude.leading_zeros()) as usize] += 1;
        }
    }

    /// Records one change (the hot loop inlines the counters instead).
    #[cfg(test)]
    fn add(&mut self, gap: u64, magnitude: u64) {
        self.n += 1;
        self.gap_sum += gap;
        match magnitude {
            1 => self.ones += 1,
            2 => self.twos += 1,
            m => self.add_rare(m),
        }
    }

    /// The Rice parameter for the gaps and an upper bound of the bits it costs.
    /// Chosen by the estimate `n·(k+1) + S/2^k − n·(1 − 2^−k)/2` (`S` the gap
    /// sum; the last term is the mean rounding loss of `⌊g/2^k⌋` for spread-out
    /// gaps); the returned bound `n·(k+1) + ⌊S/2^k⌋` is never below the truth.
    fn choose_rice_k(&self) -> (u8, u64) {
        let n = self.n as f64;
        let k = (0..=MAX_POS_K)
            .min_by(|&a, &b| {
                let est = |k: u8| {
                    let p = (1u64 << k) as f64;
                    n * (k as f64 + 1.0) + self.gap_sum as f64 / p - n * (1.0 - 1.0 / p) / 2.0
                };
                est(a).total_cmp(&est(b))
            })
            .expect("non-empty range");
        (k, self.n * (k as u64 + 1) + (self.gap_sum >> k))
    }

    /// The Exp-Golomb order for step magnitudes and the bits it costs. Exact for
    /// magnitudes below [`SMALL`]; larger ones are counted at their bit length's
    /// upper bound.
    fn choose_eg_k(&self) -> (u8, u64) {
        (0..=20u8)
            .map(|k| {
                let s: u64 = (3..SMALL)
                    .filter(|&m| self.small[m] > 0)
                    .map(|m| self.small[m] * eg_bits(m as u64, k))
                    .sum::<u64>()
                    + self.ones * eg_bits(1, k)
                    + self.twos * eg_bits(2, k);
                let l: u64 = (0..65)
                    .filter(|&b| self.large[b] > 0)
                    .map(|b| {
                        self.large[b]
                            * eg_bits(if b == 64 { 1u64 << 63 } else { (1u64 << b) - 1 }, k)
                    })
                    .sum();
                (k, s + l)
            })
            .min_by_key(|&(_, bits)| bits)
            .expect("non-empty range")
    }
}

/// Splits a payload into per-block streams, checking the directory against the
/// tensor (`words` words) and the payload's real length.
pub fn split_blocks<'a>(
    tensor: &str,
    words: u64,
    block_words: u64,
    blocks: &[BlockEntry],
    payload: &'a [u8],
) -> Result<Vec<&'a [u8]>> {
    if block_words == 0 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.block_words"),
            "must be at least 1",
        ));
    }
    if words.div_ceil(block_words) != blocks.len() as u64 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.blocks"),
            format!(
                "{} blocks listed, {words} words in blocks of {block_words} need {}",
                blocks.len(),
                words.div_ceil(block_words)
            ),
        ));
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0usize;
    for (b, e) in blocks.iter().enumerate() {
        let end = usize::try_from(e.bytes)
            .ok()
            .and_then(|n| at.checked_add(n))
            .filter(|&end| end <= payload.len())
            .ok_or_else(|| {
                Error::tensor(
                    tensor,
                    format!("block {b} claims more bytes than the payload holds"),
                )
            })?;
        out.push(&payload[at..end]);
        at = end;
    }
    if at != payload.len() {
        return Err(Error::tensor(
            tensor,
            format!("payload has {} bytes, blocks describe {at}", payload.len()),
        ));
    }
    Ok(out)
}

/// Decodes one block, calling `f(index_in_block, value)` for each entry, and
/// checks that the stream holds exactly what the entry claims. With `limit`,
/// stops after that many entries (used to undo a partial apply).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn decode_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    wb: usize,
    block_len: u64,
    limit: Option<u64>,
    mut f: impl FnMut(u64, Value) -> Result<()>,
) -> Result<()> {
    let bad = |what: &str| Error::tensor(tensor, format!("block {b}: {what}"));
    if e.pos_k > MAX_POS_K || e.val_k > MAX_VAL_K {
        return Err(bad("coding parameter out of range"));
    }
    if e.changes > block_len {
        return Err(bad("more changes than words"));
    }
    // Every entry takes at least pos_k + 2 bits: reject lying counts up front.
    let min_bits = e.changes.saturating_mul(e.pos_k as u64 + 2);
    if min_bits > stream.len() as u64 * 8 {
        return Err(bad("stream too short for the claimed number of changes"));
    }
    let bits = wb as u32 * 8;
    let half = 1u64 << (bits - 1);
    let mask = word_mask(wb);
    let mut r = BitReader::new(stream);
    let mut next = 0u64;
    let q_limit = block_len >> e.pos_k;
    let count = limit.map_or(e.changes, |l| l.min(e.changes));
    let k = e.pos_k as u32;
    let low_mask = (1u64 << k) - 1;
    for _ in 0..count {
        // Fast path: the whole Rice code is buffered.
        r.ensure();
        let (acc, avail) = r.peek();
        let tz = acc.trailing_zeros();
        let gap = if tz < 64 && tz + 1 + k <= avail && (tz as u64) <= q_limit {
            r.consume(tz + 1 + k);
            ((tz as u64) << k) | ((acc >> tz >> 1) & low_mask)
        } else {
            let q = r
                .unary(q_limit)
                .ok_or_else(|| bad("truncated or invalid position"))?;
            let low = r.get(k).ok_or_else(|| bad("truncated position"))?;
            (q << k) | low
        };
        let idx = next + gap;
        if idx >= block_len {
            return Err(bad("position beyond the block"));
        }
        next = idx + 1;
        let v = match e.values {
            ValueCoding::Raw => Value::Raw(r.get(bits).ok_or_else(|| bad("truncated value"))?),
            ValueCoding::Step => {
                r.ensure();
                let (acc, avail) = r.peek();
                let z = acc.trailing_zeros();
                let width = z + e.val_k as u32;
                let (y, neg) = if z < 64 && width <= 63 && z + width + 2 <= avail {
                    let rest = (acc >> z >> 1) & ((1u64 << width) - 1);
                    let neg = (acc >> (z + 1 + width)) & 1 == 1;
                    r.consume(z + width + 2);
                    ((1u64 << width) | rest, neg)
                } else {
                    let z = r
                        .unary(64)
                        .ok_or_else(|| bad("truncated or invalid step"))?;
                    let width = z + e.val_k as u64;
                    if width > 63 {
                        return Err(bad("step too large"));
                    }
                    let rest = r.get(width as u32).ok_or_else(|| bad("truncated step"))?;
                    let neg = r.get(1).ok_or_else(|| bad("truncated sign"))? == 1;
                    ((1u64 << width) | rest, neg)
                };
                let m = y - (1u64 << e.val_k) + 1;
                if m > half {
                    return Err(bad("step larger than the word"));
                }
                // Branch-free negate: the sign is a coin flip.
                let flip = u64::from(neg).wrapping_neg();
                Value::Step(((m ^ flip).wrapping_add(u64::from(neg))) & mask)
            }
        };
        f(idx, v)?;
    }
    if limit.is_none() && !r.at_clean_end() {
        return Err(bad("trailing bytes after the last change"));
    }
    Ok(())
}

/// Applies one block in place: writes every new word, appends each overwritten
/// old word to `undo`, and returns the digest change. On error, what was written
/// so far is recorded in `undo` (see [`undo_block`]).
#[allow(clippy::too_many_arguments)]
pub fn apply_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<u64> {
    if super::cpu::wide() {
        // SAFETY: `cpu::wide()` confirmed every feature `apply_block_wide` is
        // compiled with; the function is otherwise safe code.
        #[cfg(target_arch = "x86_64")]
        return unsafe { apply_block_wide(tensor, b, e, stream, kind, wb, seed, first, blk, undo) };
    }
    crate::with_word_width!(wb, W => apply_block_w::<W>(tensor, b, e, stream, kind, seed, first, blk, undo))
}

/// [`apply_block_w`] compiled for the wide feature set (see [`super::cpu`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
#[allow(clippy::too_many_arguments)]
fn apply_block_wide(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<u64> {
    crate::with_word_width!(wb, W => apply_block_w::<W>(tensor, b, e, stream, kind, seed, first, blk, undo))
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn apply_block_w<const W: usize>(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut Vec<u8>,
) -> Result<u64> {
    let mut dig = 0u64;
    let len = (blk.len() / W) as u64;
    // Reserve from what the stream can really hold (each entry takes at least
    // pos_k + 2 bits), not from the header's claim.
    let possible = (stream.len() as u64 * 8) / (e.pos_k as u64 + 2);
    undo.reserve(e.changes.min(len).min(possible) as usize * W);
    // Decode ahead in batches, then touch the tensor: the old words of a batch
    // are loaded back to back, so their cache misses overlap instead of each
    // change waiting for its own (at low density every change is a miss).
    // Applied entries stay a prefix of the decoded ones, as `undo_block` needs.
    const BATCH: usize = 32;
    let mut pending = [(0u64, Value::Raw(0)); BATCH];
    let mut count = 0usize;
    let mut flush = |batch: &[(u64, Value)]| -> Result<()> {
        let mut olds = [0u64; BATCH];
        for (o, &(i, _)) in olds.iter_mut().zip(batch) {
            *o = load::<W>(blk, i as usize);
        }
        for (&old, &(i, v)) in olds.iter().zip(batch) {
            let new = v.resolve(kind, W, old);
            if new == old {
                return Err(unchanged_error(tensor, b, first + i));
            }
            undo.extend_from_slice(&old.to_le_bytes()[..W]);
            store::<W>(blk, i as usize, new);
            dig = dig.wrapping_add(seed.change(first + i, old, new));
        }
        Ok(())
    };
    decode_block(tensor, b, e, stream, W, len, None, |i, v| {
        pending[count] = (i, v);
        count += 1;
        if count == BATCH {
            flush(&pending)?;
            count = 0;
        }
        Ok(())
    })?;
    flush(&pending[..count])?;
    Ok(dig)
}

#[cold]
#[inline(never)]
fn unchanged_error(tensor: &str, b: usize, at: u64) -> Error {
    Error::tensor(
        tensor,
        format!("block {b} lists element {at} as changed but it is not"),
    )
}

/// Restores the old words [`apply_block`] recorded in `undo` (positions are
/// decoded again; they do not depend on the base).
pub fn undo_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    wb: usize,
    blk: &mut [u8],
    undo: &[u8],
) {
    let n = (undo.len() / wb) as u64;
    let len = (blk.len() / wb) as u64;
    let mut j = 0usize;
    // These entries decoded successfully once, so decoding them again cannot fail.
    let _ = decode_block(tensor, b, e, stream, wb, len, Some(n), |i, _| {
        write_word(blk, wb, i as usize, read_word(undo, wb, j));
        j += 1;
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rice_k_follows_the_mean_gap() {
        let mut st = Stats::default();
        for i in 0..1000 {
            st.add(40 + (i % 50), 1);
        }
        let (k, bits) = st.choose_rice_k();
        assert!((4..=6).contains(&k), "{k}");
        let exact: u64 = (0..1000u64)
            .map(|i| ((40 + (i % 50)) >> k) + 1 + k as u64)
            .sum();
        assert!(bits >= exact && bits - exact <= 1000, "{bits} vs {exact}");
        let mut z = Stats::default();
        for _ in 0..4 {
            z.add(0, 1);
        }
        assert_eq!(z.choose_rice_k(), (0, 4));
    }

    #[test]
    fn eg_k_prefers_zero_for_unit_steps() {
        let mut st = Stats::default();
        for m in [1u64, 1, 1, 2] {
            st.add(0, m);
        }
        let (k, bits) = st.choose_eg_k();
        assert_eq!(k, 0);
        assert_eq!(bits, 2 + 2 + 2 + 4);
    }
}
