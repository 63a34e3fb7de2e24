//! The `compact` encoder for changes the caller has already found: a trainer
//! that compared two versions on its GPU hands over the changed positions and
//! their new words, and the old words are read from the base at those
//! positions only. Nothing scans the tensor: the work is O(changes).
//!
//! Every block is staged whole and its parameters chosen from all of its
//! changes (the exact choice the scanning encoder falls back to), so the
//! blocks decode exactly as the scanning encoder's do, and are never larger.

use rayon::prelude::*;

use super::encode::{Stats, write_staged};
use super::{BLOCK_WORDS, Ctx, EncodedTensor};
use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{KeyKind, load, step_magnitude, to_key, word_mask};
use crate::error::{Error, Result};
use crate::format::BlockEntry;
use crate::platform::prefetch_l2;

/// How many changes ahead the old words are prefetched (into L2, as the
/// apply pipelines do): the changes are scattered, so each old word is a
/// cache miss the hardware prefetcher does not foresee.
const AHEAD: usize = 64;

/// The changed word indices of one tensor, strictly ascending, in the width
/// the caller holds them (a GPU's `nonzero` gives 64-bit indices; 32 bits
/// halve the transfer for tensors under 2^32 words).
#[derive(Clone, Copy, Debug)]
pub enum PositionSlice<'a> {
    /// 32-bit indices.
    U32(&'a [u32]),
    /// 64-bit indices.
    U64(&'a [u64]),
}

impl PositionSlice<'_> {
    /// How many.
    pub fn len(&self) -> usize {
        match self {
            PositionSlice::U32(p) => p.len(),
            PositionSlice::U64(p) => p.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline(always)]
    fn at(&self, j: usize) -> u64 {
        match self {
            PositionSlice::U32(p) => u64::from(p[j]),
            PositionSlice::U64(p) => p[j],
        }
    }

    /// The first index whose position is not below `p`, by binary search
    /// (meaningful on an ascending list; the blocks check that it is).
    fn first_from(&self, p: u64) -> usize {
        match self {
            PositionSlice::U32(s) => s.partition_point(|&x| u64::from(x) < p),
            PositionSlice::U64(s) => s.partition_point(|&x| x < p),
        }
    }
}

/// Encodes the changes of one tensor given as `positions` (strictly
/// ascending word indices) and `new` (their new words, `wb` bytes each, in
/// the same order); the old words are read from `base`, the tensor's bytes
/// before. Returns the same [`EncodedTensor`] as the scanning encoder for the
/// tensor with those words changed.
///
/// Fails with [`Error::Tensor`] (naming `name`) when the positions are not
/// strictly ascending or not inside the tensor, or `new` has another length;
/// and with [`Error::BaseMismatch`] when a listed word equals its old one in
/// `base`: the caller found the changes against some other state than `base`.
pub fn encode_tensor_changes(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    name: &str,
    base: &[u8],
    positions: PositionSlice<'_>,
    new: &[u8],
) -> Result<EncodedTensor> {
    let bad = |reason: String| Error::Tensor {
        tensor: name.to_string(),
        reason,
    };
    let n = positions.len();
    if n.checked_mul(wb) != Some(new.len()) {
        return Err(bad(format!(
            "{n} changed positions but {} bytes of new words ({wb} bytes each expected)",
            new.len()
        )));
    }
    let words = (base.len() / wb) as u64;
    let blocks = words.div_ceil(BLOCK_WORDS) as usize;
    let bounds: Vec<usize> = (0..=blocks)
        .map(|b| positions.first_from(b as u64 * BLOCK_WORDS))
        .collect();
    let last = n.checked_sub(1).map(|j| positions.at(j));
    if let Some(p) = last
        .filter(|&p| p >= words)
        .or_else(|| (bounds[blocks] != n).then(|| positions.at(bounds[blocks])))
    {
        return Err(bad(format!(
            "changed position {p} is outside the tensor's {words} words"
        )));
    }
    let block_bytes = BLOCK_WORDS as usize * wb;
    let parts: Vec<(BlockEntry, Vec<u8>, u64)> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let first = b as u64 * BLOCK_WORDS;
            let (lo, hi) = (bounds[b], bounds[b + 1]);
            let block = &base[b * block_bytes..((b + 1) * block_bytes).min(base.len())];
            let ctx = Ctx { kind, seed, first };
            crate::with_word_width!(wb, W => encode_block::<W>(
                ctx,
                block,
                (positions, lo, hi),
                &new[lo * wb..hi * wb],
            ))
            .map_err(bad)
        })
        .collect::<Result<_>>()
        .map_err(|e| match e {
            Error::Tensor { reason, .. } if reason.starts_with(UNCHANGED) => {
                Error::BaseMismatch(format!("tensor `{name}`: {reason}"))
            }
            e => e,
        })?;
    Ok(EncodedTensor::from_blocks(parts))
}

const UNCHANGED: &str = "listed as changed but";

/// One block: the changes `lo..hi` of `positions` (all inside the block,
/// ascending, each different from its old word), staged and written.
fn encode_block<const W: usize>(
    ctx: Ctx,
    block: &[u8],
    (positions, lo, hi): (PositionSlice<'_>, usize, usize),
    new: &[u8],
) -> std::result::Result<(BlockEntry, Vec<u8>, u64), String> {
    let block_words = (block.len() / W) as u64;
    let mask = word_mask(W);
    let mut stats = Stats::default();
    let (mut gaps, mut steps) = (Vec::with_capacity(hi - lo), Vec::with_capacity(hi - lo));
    let (mut next, mut dig) = (0u64, 0u64);
    for start in (lo..hi).step_by(LANES) {
        let mut batch = ChangeBatch::default();
        for j in start..(start + LANES).min(hi) {
            if j + AHEAD < hi {
                let ahead = positions.at(j + AHEAD).wrapping_sub(ctx.first) as usize;
                prefetch_l2(block, ahead.saturating_mul(W));
            }
            let p = positions.at(j);
            let i = p.wrapping_sub(ctx.first);
            if i < next || i >= block_words {
                return Err(format!(
                    "changed positions are not strictly ascending inside the tensor (position {p} at \
                     index {j})"
                ));
            }
            let (old, nw) = (load::<W>(block, i as usize), load::<W>(new, j - lo));
            if old == nw {
                return Err(format!(
                    "{UNCHANGED} its word there ({old:#x}) is the base's: the changes were \
                     found against another state (position {p})"
                ));
            }
            let s = to_key(ctx.kind, W, nw).wrapping_sub(to_key(ctx.kind, W, old)) & mask;
            stats.add(i - next, step_magnitude(W, s));
            gaps.push(i - next);
            steps.push(s);
            next = i + 1;
            let k = j - start;
            (batch.index[k], batch.old[k], batch.new[k]) = (p, old, nw);
        }
        dig = dig.wrapping_add(ctx.seed.change_sum(&batch));
    }
    let (entry, bytes) = write_staged::<W>(&stats, &gaps, &steps, |j, _| load::<W>(new, j));
    Ok((entry, bytes, dig))
}
