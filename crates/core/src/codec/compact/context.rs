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
        self.blocks.iter().enumerate().fold(0u64, |a, (b, ms)| {
            a.wrapping_add(block_checksum(seed, b as u64, ms))
        })
    }
}

/// The checksum of one block's members (see [`member_hash`]).
fn block_checksum(seed: u64, block: u64, members: &[Member]) -> u64 {
    block_checksum_on(crate::platform::Platform::detect(), seed, block, members)
}

/// [`block_checksum`] on `platform`: eight members at a time where it has
/// AVX-512 (DQ, for the 64-bit multiply); the fold is the definition.
fn block_checksum_on(
    platform: crate::platform::Platform,
    seed: u64,
    block: u64,
    members: &[Member],
) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if let Some(proof) = platform.avx512() {
        // SAFETY: the proof exists only where detection found AVX-512 F and
        // DQ, every feature `checksum_avx512` is compiled with; its memory
        // accesses are bounds-checked (see there).
        return unsafe { checksum_avx512(proof, seed, block, members) };
    }
    let _ = platform;
    block_checksum_portable(seed, block, members)
}

fn block_checksum_portable(seed: u64, block: u64, members: &[Member]) -> u64 {
    members
        .iter()
        .fold(0u64, |a, &m| a.wrapping_add(member_hash(seed, block, m)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
fn checksum_avx512(
    _: crate::platform::HasAvx512,
    seed: u64,
    block: u64,
    members: &[Member],
) -> u64 {
    use std::arch::x86_64::*;
    let full = members.len() / 8 * 8;
    let base = _mm512_set1_epi64((seed ^ (block << 32)) as i64);
    let k = _mm512_set1_epi64(0x9E37_79B9_7F4A_7C15u64 as i64);
    let mut acc = _mm512_setzero_si512();
    for at in (0..full).step_by(8) {
        let chunk: &[u32; 8] = members[at..at + 8].try_into().expect("8 members");
        // SAFETY: 8 initialized u32s (32 bytes); the unaligned load reads
        // exactly those.
        let m = unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) };
        let h = _mm512_mullo_epi64(_mm512_xor_si512(base, _mm512_cvtepu32_epi64(m)), k);
        acc = _mm512_add_epi64(acc, _mm512_xor_si512(h, _mm512_srli_epi64::<29>(h)));
    }
    let mut lanes = [0u64; 8];
    // SAFETY: `lanes` is 8 writable u64s (64 bytes).
    unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), acc) };
    lanes.iter().fold(
        block_checksum_portable(seed, block, &members[full..]),
        |a, &x| a.wrapping_add(x),
    )
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
        let checksum = checksum_of(&tensors);
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
        checksum_of(&self.tensors)
    }
}

/// The checksum of a context's tensors (see [`member_hash`]), every block
/// in parallel: it is made once per version, on its path.
fn checksum_of(tensors: &std::collections::BTreeMap<String, TensorContext>) -> u64 {
    use rayon::prelude::*;
    let blocks: Vec<(u64, u64, &[Member])> = tensors
        .iter()
        .flat_map(|(n, t)| {
            let seed = tensor_seed(n);
            t.blocks
                .iter()
                .enumerate()
                .map(move |(b, ms)| (seed, b as u64, ms.as_slice()))
        })
        .collect();
    blocks
        .par_iter()
        .map(|&(seed, b, ms)| block_checksum(seed, b, ms))
        .reduce(|| 0, u64::wrapping_add)
}

/// Magic of a saved context ([`Context::to_bytes`]).
const SAVED_MAGIC: &[u8; 8] = b"WCCTX\x001\x00";

/// The header of a saved context.
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedHeader {
    version: u64,
    from: String,
    to: String,
    checksum: String,
    /// Per tensor: name, block length, block count, members.
    tensors: Vec<(String, u64, u64, u64)>,
}

impl Context {
    /// The context as bytes, to keep beside a state between runs (a
    /// publisher's `--state`, a subscriber's output directory): the magic
    /// `WCCTX\01\0`, a u64 LE header length, a JSON header, then per tensor
    /// its per-block member counts and its members, u32 LE. Not a wire
    /// format: only the process that wrote it reads it back.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = SavedHeader {
            version: self.id.version,
            from: self.id.from.to_string(),
            to: self.id.to.to_string(),
            checksum: format!("{:016x}", self.id.checksum),
            tensors: self
                .tensors
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        t.block_words,
                        t.blocks.len() as u64,
                        t.len() as u64,
                    )
                })
                .collect(),
        };
        let json = serde_json::to_vec(&header).expect("a context header serializes");
        let words: usize = self
            .tensors
            .values()
            .map(|t| t.blocks.len() + t.len())
            .sum();
        let mut out = Vec::with_capacity(16 + json.len() + 4 * words);
        out.extend_from_slice(SAVED_MAGIC);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for t in self.tensors.values() {
            for b in &t.blocks {
                out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            }
            for b in &t.blocks {
                for m in b {
                    out.extend_from_slice(&m.to_le_bytes());
                }
            }
        }
        out
    }

    /// A context [`Context::to_bytes`] wrote, checked whole: the sizes add
    /// up to the bytes given, each block's members ascend strictly and lie
    /// inside the block, and the members' checksum is the recorded one. A
    /// file that fails any check is refused (`Error::Metadata` naming what
    /// failed): its holder then works without it.
    pub fn from_bytes(bytes: &[u8]) -> crate::error::Result<Context> {
        use crate::error::Error;
        let bad = |why: String| Error::metadata("saved context", why);
        if bytes.len() < 16 || &bytes[..8] != SAVED_MAGIC {
            return Err(bad("not a saved context (magic)".into()));
        }
        let n = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let body = bytes
            .get(16..)
            .filter(|b| (b.len() as u64) >= n)
            .ok_or_else(|| bad(format!("header of {n} bytes past the end")))?;
        let (json, mut data) = body.split_at(n as usize);
        let h: SavedHeader =
            serde_json::from_slice(json).map_err(|e| bad(format!("header: {e}")))?;
        let digest = |s: &str| Digest::parse(s).ok_or_else(|| bad(format!("digest `{s}`")));
        let checksum = u64::from_str_radix(&h.checksum, 16)
            .map_err(|_| bad(format!("checksum `{}`", h.checksum)))?;
        let mut next = |count: u64| -> crate::error::Result<Vec<u32>> {
            let len = count
                .checked_mul(4)
                .filter(|&l| l <= data.len() as u64)
                .ok_or_else(|| bad("counts past the end".into()))? as usize;
            let (head, rest) = data.split_at(len);
            data = rest;
            Ok(head
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect())
        };
        let mut tensors = std::collections::BTreeMap::new();
        for (name, block_words, nblocks, members) in h.tensors {
            if block_words == 0 || block_words > MAX_BLOCK_WORDS {
                return Err(bad(format!("tensor `{name}`: block length {block_words}")));
            }
            let counts = next(nblocks)?;
            if counts.iter().map(|&c| c as u64).sum::<u64>() != members {
                return Err(bad(format!("tensor `{name}`: member counts")));
            }
            let mut all = next(members)?.into_iter();
            let mut blocks = Vec::with_capacity(counts.len());
            for c in counts {
                let ms: Vec<Member> = all.by_ref().take(c as usize).collect();
                let ascending = ms.windows(2).all(|w| index(w[0]) < index(w[1]));
                if !ascending || ms.last().is_some_and(|&m| index(m) as u64 >= block_words) {
                    return Err(bad(format!(
                        "tensor `{name}`: members out of order or range"
                    )));
                }
                blocks.push(ms);
            }
            if tensors
                .insert(
                    name.clone(),
                    TensorContext {
                        block_words,
                        blocks,
                    },
                )
                .is_some()
            {
                return Err(bad(format!("tensor `{name}` twice")));
            }
        }
        if !data.is_empty() {
            return Err(bad(format!("{} bytes after the members", data.len())));
        }
        let c = Context {
            id: ContextId {
                version: h.version,
                from: digest(&h.from)?,
                to: digest(&h.to)?,
                checksum,
            },
            tensors,
        };
        if c.recompute_checksum() != checksum {
            return Err(bad("members do not match the checksum".into()));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod checksum_tests {
    use super::*;
    use crate::platform::Level;
    use crate::platform::expect::platforms;

    #[test]
    fn the_vector_checksum_is_the_fold() {
        let mut x = 0x9e37_79b9u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 100, 1000] {
            let members: Vec<Member> = (0..n).map(|_| rnd() as u32).collect();
            for (seed, block) in [
                (0u64, 0u64),
                (0x1234_5678_9abc_def0, 3),
                (u64::MAX, 1 << 31),
            ] {
                let want = block_checksum_portable(seed, block, &members);
                let by_hand = members
                    .iter()
                    .map(|&m| member_hash(seed, block, m))
                    .fold(0, u64::wrapping_add);
                assert_eq!(want, by_hand);
                for p in platforms("checksum", &[Level::Portable, Level::Avx512]) {
                    assert_eq!(
                        block_checksum_on(p, seed, block, &members),
                        want,
                        "{p:?} {n}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod saved_tests {
    use super::*;

    fn sample() -> Context {
        let t = TensorContext {
            block_words: 100,
            blocks: vec![
                vec![member(3, 1, 2), member(7, 0xfffe, 2)],
                vec![],
                vec![member(99, 5, 2)],
            ],
        };
        Context::new(
            9,
            (Digest(1), Digest(2)),
            [("a".to_string(), t.clone()), ("b.w".to_string(), t)].into(),
        )
    }

    #[test]
    fn a_saved_context_reads_back_and_every_damage_is_refused() {
        let c = sample();
        let bytes = c.to_bytes();
        assert_eq!(Context::from_bytes(&bytes).unwrap(), c);
        // Any truncation, and any flipped byte of the members, is refused.
        for cut in 0..bytes.len() {
            assert!(Context::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let members_at = bytes.len() - 4 * 3;
        for at in members_at..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            assert!(Context::from_bytes(&b).is_err(), "flip at {at}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 4]);
        assert!(Context::from_bytes(&longer).is_err());
        // An empty context (after an anchor) too.
        let empty = Context::new(3, (Digest(5), Digest(6)), Default::default());
        assert_eq!(Context::from_bytes(&empty.to_bytes()).unwrap(), empty);
    }
}
