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
use super::scan::for_each_change;
use crate::digest::TensorSeed;
use crate::dtype::{KeyKind, from_key, to_key, word_mask};
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
    let mask = word_mask(wb);
    let mut gaps: Vec<u64> = Vec::new();
    let mut steps: Vec<u64> = Vec::new();
    let mut news: Vec<u64> = Vec::new();
    let mut next = 0u64; // first index the next gap counts from
    let mut dig = 0u64;
    for_each_change(wb, base, new, |i, old, nw| {
        let i = i as u64;
        gaps.push(i - next);
        next = i + 1;
        steps.push(to_key(kind, wb, nw).wrapping_sub(to_key(kind, wb, old)) & mask);
        news.push(nw);
        dig = dig.wrapping_add(seed.change(first + i, old, nw));
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
    let pos_k = choose_rice_k(&gaps);
    let sign = 1u64 << (wb * 8 - 1);
    let magnitude = |s: u64| {
        if s & sign != 0 {
            s.wrapping_neg() & mask
        } else {
            s
        }
    };
    let (val_k, step_bits) = choose_eg_k(steps.iter().map(|&s| magnitude(s)));
    let raw_bits = n * wb as u64 * 8;
    let values = if step_bits < raw_bits {
        ValueCoding::Step
    } else {
        ValueCoding::Raw
    };
    let pos_bits: u64 = gaps.iter().map(|g| (g >> pos_k) + 1 + pos_k as u64).sum();
    let val_bits = if values == ValueCoding::Step {
        step_bits
    } else {
        raw_bits
    };
    let mut w = BitWriter::with_capacity(((pos_bits + val_bits) / 8 + 16) as usize);
    let low = (1u64 << pos_k) - 1;
    for j in 0..gaps.len() {
        let g = gaps[j];
        w.put_unary(g >> pos_k);
        w.put(g & low, pos_k as u32);
        match values {
            ValueCoding::Raw => w.put(news[j], wb as u32 * 8),
            ValueCoding::Step => {
                let s = steps[j];
                let m = magnitude(s);
                let y = (m - 1) + (1u64 << val_k);
                let nb = 64 - y.leading_zeros();
                w.put_unary((nb - 1 - val_k as u32) as u64);
                w.put(y & ((1u64 << (nb - 1)) - 1), nb - 1);
                w.put(u64::from(s & sign != 0), 1);
            }
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

/// The Rice parameter with the fewest bits for these gaps (exact cost over a few
/// candidates around the one the mean suggests).
fn choose_rice_k(gaps: &[u64]) -> u8 {
    let n = gaps.len() as u64;
    let mean = gaps.iter().sum::<u64>() / n.max(1);
    let guess = (64 - mean.leading_zeros()) as i32 - 1;
    let lo = (guess - 2).max(0) as u8;
    let hi = (guess + 1).clamp(0, MAX_POS_K as i32) as u8;
    (lo..=hi)
        .min_by_key(|&k| gaps.iter().map(|g| g >> k).sum::<u64>() + n * (k as u64 + 1))
        .unwrap_or(0)
}

/// Bits of the order-`k` Exp-Golomb code of `m - 1`, plus the sign bit.
#[inline]
fn eg_bits(m: u64, k: u8) -> u64 {
    let y = (m - 1) + (1u64 << k);
    let nb = 64 - y.leading_zeros() as u64;
    2 * nb - k as u64
}

/// The Exp-Golomb order for step magnitudes (all ≥ 1) and the bits it costs.
/// Exact for magnitudes below 256 (nearly all of them); larger ones are counted
/// by bit length at their upper bound.
fn choose_eg_k(mags: impl Iterator<Item = u64>) -> (u8, u64) {
    const SMALL: usize = 256;
    let mut small = [0u64; SMALL];
    let mut large = [0u64; 65];
    for m in mags {
        if (m as usize) < SMALL {
            small[m as usize] += 1;
        } else {
            large[(64 - m.leading_zeros()) as usize] += 1;
        }
    }
    (0..=20u8)
        .map(|k| {
            let s: u64 = (1..SMALL).map(|m| small[m] * eg_bits(m as u64, k)).sum();
            let l: u64 = (0..65)
                .filter(|&b| large[b] > 0)
                .map(|b| large[b] * eg_bits(if b == 64 { 1u64 << 63 } else { (1u64 << b) - 1 }, k))
                .sum();
            (k, s + l)
        })
        .min_by_key(|&(_, bits)| bits)
        .expect("non-empty range")
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
/// checks that the stream holds exactly what the entry claims.
pub fn decode_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    wb: usize,
    block_len: u64,
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
    for _ in 0..e.changes {
        let q = r
            .unary(q_limit)
            .ok_or_else(|| bad("truncated or invalid position"))?;
        let low = r
            .get(e.pos_k as u32)
            .ok_or_else(|| bad("truncated position"))?;
        let idx = next + ((q << e.pos_k) | low);
        if idx >= block_len {
            return Err(bad("position beyond the block"));
        }
        next = idx + 1;
        let v = match e.values {
            ValueCoding::Raw => Value::Raw(r.get(bits).ok_or_else(|| bad("truncated value"))?),
            ValueCoding::Step => {
                let z = r
                    .unary(64)
                    .ok_or_else(|| bad("truncated or invalid step"))?;
                let width = z + e.val_k as u64;
                if width > 63 {
                    return Err(bad("step too large"));
                }
                let rest = r.get(width as u32).ok_or_else(|| bad("truncated step"))?;
                let y = (1u64 << width) | rest;
                let m = y - (1u64 << e.val_k) + 1;
                if m > half {
                    return Err(bad("step larger than the word"));
                }
                let neg = r.get(1).ok_or_else(|| bad("truncated sign"))? == 1;
                Value::Step(if neg { m.wrapping_neg() & mask } else { m })
            }
        };
        f(idx, v)?;
    }
    if !r.at_clean_end() {
        return Err(bad("trailing bytes after the last change"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rice_k_follows_the_mean_gap() {
        let gaps: Vec<u64> = (0..1000).map(|i| 40 + (i % 50)).collect();
        let k = choose_rice_k(&gaps);
        assert!((4..=6).contains(&k), "{k}");
        assert_eq!(choose_rice_k(&[0, 0, 0, 0]), 0);
    }

    #[test]
    fn eg_k_prefers_zero_for_unit_steps() {
        let (k, bits) = choose_eg_k([1u64, 1, 1, 2].into_iter());
        assert_eq!(k, 0);
        assert_eq!(bits, 2 + 2 + 2 + 4);
    }
}
