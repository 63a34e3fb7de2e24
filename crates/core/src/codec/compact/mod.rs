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
//! block from the data. `docs/format.md` §6.1 specifies the bit layout:
//!
//! ```text
//! entry = unary(gap >> pos_k) ‖ low pos_k bits of gap ‖ value
//! value = raw:  the new word, 8·wb bits
//!         step: unary(nb − 1 − val_k) ‖ low nb − 1 bits of y ‖ sign bit,
//!               y = (|s| − 1) + 2^val_k, nb = bit length of y
//! ```
//!
//! The module is split by direction:
//!
//! - `encode`: the one-pass block encoder (sampled
//!   parameters, direct writing, the exact re-encode of non-uniform blocks);
//! - `decode`: the block directory ([`split_blocks`]) and the
//!   one definition of how an entry is decoded ([`decode_block`] and the
//!   apply pipeline both go through it);
//! - `apply`: decoded entries resolved against the words they
//!   change and handed to a sink that writes them ([`apply_block`], with
//!   [`undo_block`]) or only checks them (the verify pass of
//!   [`crate::codec::apply_in_place`]);
//! - `vector`: the AVX-512 kernels of the hottest case, 2-byte words (the
//!   encoder's fused scan and entries, the apply's resolution of a group),
//!   over the types this file defines ([`Ctx`], `Group`);
//! - `v2` and `v2_head`: `compact2` blocks (the classes' prologue and
//!   parameter codes in `v2_head`, shared by both encoders; the decoder and
//!   the staged encoder in `v2`);
//! - `v2_masks`: `compact2`'s encoder for 2-byte words on AVX-512 (the
//!   context's members as bit masks per region, each change's class and
//!   rank looked up sixteen at a time, each class kept as a compact list);
//!   `v2`'s staged encoder is the reference it matches byte for byte and
//!   the path everywhere else;
//! - `merge`: the member-list work of a `compact2` block (its context split
//!   into classes, the members that changed again, the next context merged,
//!   the checksum's sums), sixteen members at a time on AVX-512.

mod apply;
mod changes;
pub mod context;
mod decode;
mod encode;
mod merge;
pub mod v2;
mod v2_head;
mod v2_masks;
mod v2_table;
pub mod vector;

pub use apply::{BlockUndo, apply_block, apply_block_members, undo_block};
pub(crate) use apply::{Kept, entry_member, verify_block, write_kept};
pub use changes::{PositionSlice, encode_tensor_changes};
pub use context::{Context, ContextId, NextMembers, TensorContext};
pub use decode::{decode_block, split_blocks};
pub use encode::encode_tensor;
pub use v2_masks::set_enabled as set_mask_encoder;

use crate::digest::{LANES, TensorSeed};
use crate::dtype::{KeyKind, from_key, to_key, word_mask};
use crate::error::Error;
use crate::format::BlockEntry;

/// Words per block written by this crate (readers accept any value ≥ 1 recorded
/// in `block_words`). Blocks bound encoder memory and are the unit of parallelism.
pub const BLOCK_WORDS: u64 = 1 << 22;

/// Suffix of a compact payload tensor: `<name>.compact`.
pub const SUFFIX: &str = ".compact";

/// Largest Rice parameter a reader accepts.
pub const MAX_POS_K: u8 = 40;
/// Largest Exp-Golomb order a reader accepts.
pub const MAX_VAL_K: u8 = 32;

/// Entries handled together: the apply decodes and resolves a group of this
/// many at a time (digest changes summed in one [`crate::digest::ChangeBatch`]).
const BATCH: usize = LANES;

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

impl EncodedTensor {
    /// A tensor's blocks in order (directory entry, stream, digest change)
    /// put together.
    pub(crate) fn from_blocks(parts: Vec<(BlockEntry, Vec<u8>, u64)>) -> EncodedTensor {
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
}

/// What a decoded entry says about the new word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
            Value::Step(s) => step_word(kind, wb, old, s),
        }
    }
}

/// `unkey((key(old) + step) mod 2^(8·wb))`: the word a step leads to.
#[inline(always)]
fn step_word(kind: KeyKind, wb: usize, old: u64, step: u64) -> u64 {
    from_key(
        kind,
        wb,
        to_key(kind, wb, old).wrapping_add(step) & word_mask(wb),
    )
}

/// What the codec needs to know about a block's words besides their bytes.
#[derive(Clone, Copy, Debug)]
pub struct Ctx {
    /// How the words map to ordered keys (steps are key differences).
    pub kind: KeyKind,
    /// The tensor's digest seed.
    pub seed: TensorSeed,
    /// The block's first word in the tensor: digest positions count from
    /// the tensor's start.
    pub first: u64,
}

/// One block of a compact payload, as the decoder sees it.
#[derive(Clone, Copy, Debug)]
pub struct Block<'a> {
    /// The tensor's name (errors name it).
    pub tensor: &'a str,
    /// The block's number in the tensor.
    pub index: usize,
    /// Its directory entry.
    pub entry: &'a BlockEntry,
    /// Its bit stream.
    pub stream: &'a [u8],
    /// Word width in bytes (1, 2, 4 or 8).
    pub wb: usize,
    /// Words in the block.
    pub words: u64,
    /// `None` for a `compact` block; for a `compact2` block (docs/format.md
    /// §6.3), the block's context members (empty when the delta was made
    /// without context).
    pub context: Option<&'a [context::Member]>,
}

impl Block<'_> {
    /// An error about this block: `tensor `t`: block b: what`.
    fn error(&self, what: &str) -> Error {
        Error::tensor(self.tensor, format!("block {}: {what}", self.index))
    }
}

/// Decoded entries waiting to be resolved: block indices (ascending) and
/// masked steps (raw-coded blocks: the new words) of the first `count` lanes.
#[derive(Clone, Copy, Default)]
pub(crate) struct Group {
    pub(crate) index: [u64; BATCH],
    pub(crate) step: [u64; BATCH],
    pub(crate) count: usize,
}

/// Helpers the encode, decode and apply tests share.
#[cfg(test)]
mod testutil {
    use super::*;

    /// A BF16 block of `words` words and a copy with changes at the positions
    /// `pick` selects (±1..±3 ulp, some large jumps).
    pub(crate) fn bf16_pair(words: usize, pick: impl Fn(usize) -> bool) -> (Vec<u8>, Vec<u8>) {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let base: Vec<u8> = (0..words)
            .flat_map(|_| ((rnd() as u16 & 0x7fff) | 0x3c00).to_le_bytes())
            .collect();
        let mut new = base.clone();
        for i in (0..words).filter(|&i| pick(i)) {
            let r = rnd();
            let old = u16::from_le_bytes([base[2 * i], base[2 * i + 1]]);
            let step = if r % 97 == 0 { 300 } else { 1 + (r >> 8) % 3 } as u16;
            let w = if r & 1 == 0 {
                old.wrapping_add(step)
            } else {
                old.wrapping_sub(step)
            };
            new[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
        }
        (base, new)
    }

    /// How [`chain`] makes three versions a → b → c of a BF16 block: one
    /// word in `first` changes a → b; one in `again` of those changes again
    /// b → c, and one in `fresh` of all; `step` gives a b → c step's size
    /// from two hashes of the word, and one in `down` of those steps goes
    /// down (2: half); with `neg`, every third word is negative.
    pub(crate) struct Chain {
        pub(crate) first: u64,
        pub(crate) again: u64,
        pub(crate) fresh: u64,
        pub(crate) step: fn(u64, u64) -> u16,
        pub(crate) down: u64,
        pub(crate) neg: bool,
    }

    /// Three versions of one BF16 block, where c changes many of the words
    /// b changed (as real traces do), made as `spec` says.
    pub(crate) fn chain(words: usize, seed: u64, spec: &Chain) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let h = move |i: usize, k: u64| {
            (i as u64 ^ seed.wrapping_mul(k))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(29)
                .wrapping_mul(0xbf58_476d_1ce4_e5b9)
                >> 40
        };
        let (mut a, mut b) = bf16_pair(words, |i| h(i, 1) % spec.first == 0);
        if spec.neg {
            for i in (0..words).filter(|i| i % 3 == 0) {
                a[2 * i + 1] |= 0x80;
                b[2 * i + 1] |= 0x80;
            }
        }
        let mut c = b.clone();
        for i in 0..words {
            let changed_before = a[2 * i..2 * i + 2] != b[2 * i..2 * i + 2];
            let again = changed_before && h(i, 5) % spec.again == 0;
            if again || h(i, 3) % spec.fresh == 0 {
                let w = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
                let step = (spec.step)(h(i, 7), h(i, 13));
                let w = if h(i, 11) % spec.down == 1 {
                    w.wrapping_sub(step)
                } else {
                    w.wrapping_add(step)
                };
                c[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
        (a, b, c)
    }

    /// The one block of a BF16 payload encoded with [`encode_tensor`].
    pub(crate) fn only_block<'a>(enc: &'a EncodedTensor, words: usize) -> Block<'a> {
        assert_eq!(enc.blocks.len(), 1);
        Block {
            tensor: "t",
            index: 0,
            entry: &enc.blocks[0],
            stream: &enc.payload,
            wb: 2,
            words: words as u64,
            context: None,
        }
    }

    /// Encodes one block, applies it to a copy of the base, checks the result
    /// and the digest change, then undoes it and checks the base is back.
    pub(crate) fn round_trip_block(base: &[u8], new: &[u8]) -> BlockEntry {
        let ctx = Ctx {
            kind: KeyKind::SignMagnitude,
            seed: TensorSeed(12345),
            first: 0,
        };
        let enc = encode_tensor(ctx.kind, 2, ctx.seed, base, new);
        let block = only_block(&enc, base.len() / 2);
        let mut blk = base.to_vec();
        let mut undo = BlockUndo::default();
        let dig = apply_block(&block, ctx, &mut blk, &mut undo).expect("apply");
        assert!(blk == new, "applied block differs");
        assert_eq!(dig, enc.digest_change);
        assert_eq!(undo.applied, block.entry.changes);
        undo_block(&block, ctx.kind, &mut blk, &undo);
        assert!(blk == base, "undo did not restore the block");
        block.entry.clone()
    }
}
