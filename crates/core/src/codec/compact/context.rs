//! What both sides of a `compact2` delta hold besides the base: the changes
//! of the delta that produced the base (docs/format.md §6.3).
//!
//! A tensor's context is, per block, the sorted list of the block indices the
//! previous delta changed, each with the direction and size class of its step
//! (its **members**, packed in a `u32`: [`Member`]). It is O(changed): 4 bytes
//! per element the previous version changed, nothing per unchanged element.
//! Both sides build it the same way from the same two states: the publisher
//! from the changes it encodes, a subscriber from the changes it applies (or,
//! after a restart, by decoding the last delta again, [`crate::codec::Context::of_delta`]).

use crate::digest::Digest;
use crate::dtype::word_mask;

/// One member of a block's context: `index << 2 | neg << 1 | big`, where
/// `index` is the block index of a word the previous delta changed, `neg` its
/// step's sign (1: the ordered key went down) and `big` whether its step's
/// magnitude was 2 or more.
pub type Member = u32;

/// `big` bit of a [`Member`].
pub const BIG: u32 = 1;
/// `neg` bit of a [`Member`].
pub const NEG: u32 = 2;

/// Largest block a context can describe (indices are kept in 30 bits).
pub const MAX_BLOCK_WORDS: u64 = 1 << 30;

/// The member for a change at block index `i` by the masked step `s` of a
/// `wb`-byte word (`s ≠ 0`).
#[inline(always)]
pub fn member(i: u64, s: u64, wb: usize) -> Member {
    let top = wb as u32 * 8 - 1;
    let neg = ((s >> top) & 1) as u32;
    // |s| = 1 is s = 1 or s = −1 (all ones).
    let big = u32::from(s != 1 && s != word_mask(wb));
    ((i as u32) << 2) | (neg << 1) | big
}

/// The block index of a member.
#[inline(always)]
pub fn index(m: Member) -> u32 {
    m >> 2
}

/// The checksum of a tensor's context: `Σ g(seed ^ (block << 32 | member))`
/// over its members (wrapping), `g(x) = h ^ (h >> 29)` with
/// `h = x · 0x9E3779B97F4A7C15 mod 2^64`; a file's is the sum of its
/// tensors'. Both sides compute it as they build the context; a delta
/// records the publisher's, and a reader refuses a context whose checksum
/// differs. (It guards against a reader holding the wrong members, not
/// against an adversary.)
#[inline(always)]
pub fn member_hash(seed: u64, block: u64, m: Member) -> u64 {
    let h = (seed ^ (block << 32) ^ m as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 29)
}

/// One tensor's context: its block length and, per block, its members
/// (ascending index).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorContext {
    /// Words per block (the delta's `block_words`).
    pub block_words: u64,
    /// Members of each block, ascending.
    pub blocks: Vec<Vec<Member>>,
}

impl TensorContext {
    /// Members held.
    pub fn len(&self) -> usize {
        self.blocks.iter().map(Vec::len).sum()
    }

    /// Whether it holds no member.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.len() * 4 + self.blocks.len() * std::mem::size_of::<Vec<Member>>()
    }

    /// The members of block `b` (none past the end).
    pub fn block(&self, b: usize) -> &[Member] {
        self.blocks.get(b).map_or(&[], Vec::as_slice)
    }

    /// Its checksum (see [`member_hash`]).
    pub fn checksum(&self, seed: u64) -> u64 {
        let mut sum = 0u64;
        for (b, ms) in self.blocks.iter().enumerate() {
            for &m in ms {
                sum = sum.wrapping_add(member_hash(seed, b as u64, m));
            }
        }
        sum
    }
}

/// Where a context stands in the version chain: the changes from the state
/// with digest `from` to the state with digest `to` (version `version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextId {
    /// The version whose changes these are.
    pub version: u64,
    /// File digest before those changes.
    pub from: Digest,
    /// File digest after them (the base of the delta that uses the context).
    pub to: Digest,
    /// Checksum of the members (see [`member_hash`]).
    pub checksum: u64,
}

/// The seed of a tensor's context checksum: the first 8 bytes of
/// `BLAKE3("weightcast/context/v1\0" ‖ name)`.
pub fn tensor_seed(name: &str) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"weightcast/context/v1\0");
    h.update(name.as_bytes());
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

/// A file's context: what a `compact2` delta against this file's state is
/// coded against (docs/format.md §6.3). Built by [`crate::codec::encode_delta_ctx`]
/// (publisher) and [`crate::codec::apply_delta_ctx`] or
/// [`Context::of_delta`](crate::codec::Context::of_delta) (subscriber), from
/// the delta that produced the state; empty after an anchor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Context {
    /// Where it stands in the version chain.
    pub id: ContextId,
    /// Per changed tensor (by name), its members. A tensor without an entry
    /// has none.
    pub tensors: std::collections::BTreeMap<String, TensorContext>,
}

impl Context {
    /// A context from its tensors, its checksum computed.
    pub fn new(
        version: u64,
        (from, to): (Digest, Digest),
        tensors: std::collections::BTreeMap<String, TensorContext>,
    ) -> Context {
        let checksum = tensors
            .iter()
            .fold(0u64, |a, (n, t)| a.wrapping_add(t.checksum(tensor_seed(n))));
        Context {
            id: ContextId {
                version,
                from,
                to,
                checksum,
            },
            tensors,
        }
    }

    /// Members held (one per element the context's delta changed).
    pub fn len(&self) -> usize {
        self.tensors.values().map(TensorContext::len).sum()
    }

    /// Whether it holds no member.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes its members take (4 per member, plus a little per block).
    pub fn bytes(&self) -> usize {
        self.tensors.values().map(TensorContext::bytes).sum()
    }

    /// The checksum recomputed from the members (what `id.checksum` must be).
    pub fn recompute_checksum(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, (n, t)| a.wrapping_add(t.checksum(tensor_seed(n))))
    }
}
