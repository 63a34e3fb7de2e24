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

/// Where an apply writes one block's members for the next context
/// ([`crate::codec::compact::apply_block_members`]): the tensor's context
/// seed, given; the members, ascending, and their checksum as that block
/// ([`block_checksum`]), written. A `compact2` apply sums the checksum as it
/// writes the members, while they are in registers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NextMembers {
    /// The tensor's context seed ([`tensor_seed`]).
    pub seed: u64,
    /// The block's members, ascending.
    pub members: Vec<Member>,
    /// Their [`block_checksum`] under `seed`, as the block they belong to.
    pub checksum: u64,
}

impl NextMembers {
    /// Room for the members of blocks of the tensor with context seed `seed`.
    pub fn new(seed: u64) -> NextMembers {
        NextMembers {
            seed,
            ..NextMembers::default()
        }
    }
}

/// One tensor's context: its block length and, per block, its members
/// (ascending index). Dropped, it hands its larger member lists to a
/// bounded pool that the next context's lists are taken from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorContext {
    /// Words per block (the delta's `block_words`).
    pub block_words: u64,
    /// Members of each block, ascending.
    pub blocks: Vec<Vec<Member>>,
}

impl Drop for TensorContext {
    fn drop(&mut self) {
        for b in self.blocks.drain(..) {
            pool::give(b);
        }
    }
}

/// Member lists of dropped contexts, for the lists of the next ones.
///
/// A version's context is as large as its changes (4 bytes per change), and
/// each version's replaces the last. Freed and allocated again, every list
/// came back as fresh pages from the kernel, each faulted in and zeroed on
/// first touch: 6% of a `compact2` encode and 4% of an apply at 16%
/// density. The pool keeps the lists of dropped contexts instead (those of
/// at least [`pool::MIN_MEMBERS`] members, up to [`pool::MAX_BYTES`] in
/// all), and the encoder and the apply take the next context's lists from
/// it. Peak memory does not grow (an encode or apply holds the old and the
/// new context either way); between versions the resident memory stays at
/// that peak instead of falling back to one context.
pub(crate) mod pool {
    use super::Member;
    use std::sync::Mutex;

    /// Smaller lists are left to the allocator (they come from its heap,
    /// not from fresh pages).
    pub(crate) const MIN_MEMBERS: usize = 16 << 10;
    /// Bytes of capacity the pool holds at most.
    pub(crate) const MAX_BYTES: usize = 1 << 30;
    /// Lists the pool holds at most (a take searches them all).
    pub(crate) const MAX_LISTS: usize = 1024;

    /// Free lists and the bytes of capacity they hold, within limits.
    pub(crate) struct Pool {
        lists: Vec<Vec<Member>>,
        bytes: usize,
        max_bytes: usize,
        max_lists: usize,
    }

    impl Pool {
        pub(crate) const fn new(max_bytes: usize, max_lists: usize) -> Pool {
            Pool {
                lists: Vec::new(),
                bytes: 0,
                max_bytes,
                max_lists,
            }
        }

        /// The smallest list with room for `want` members, emptied.
        pub(crate) fn take(&mut self, want: usize) -> Option<Vec<Member>> {
            let (i, _) = (self.lists.iter().enumerate())
                .filter(|(_, l)| l.capacity() >= want)
                .min_by_key(|(_, l)| l.capacity())?;
            let mut l = self.lists.swap_remove(i);
            self.bytes -= l.capacity() * 4;
            l.clear();
            Some(l)
        }

        /// Keeps `list`, or hands it back when it is small or the pool is
        /// full (to be freed by the caller, outside any lock).
        pub(crate) fn give(&mut self, list: Vec<Member>) -> Option<Vec<Member>> {
            let bytes = list.capacity() * 4;
            if list.capacity() < MIN_MEMBERS
                || self.bytes + bytes > self.max_bytes
                || self.lists.len() >= self.max_lists
            {
                return Some(list);
            }
            self.bytes += bytes;
            self.lists.push(list);
            None
        }

        /// Lists and bytes held.
        #[cfg(test)]
        pub(crate) fn held(&self) -> (usize, usize) {
            (self.lists.len(), self.bytes)
        }
    }

    /// The process's pool.
    static FREE: Mutex<Pool> = Mutex::new(Pool::new(MAX_BYTES, MAX_LISTS));

    fn free() -> std::sync::MutexGuard<'static, Pool> {
        // A panic while holding the lock left whole lists or none: the
        // pool is still sound.
        FREE.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty list with room for at least `want` members: the pool's
    /// smallest that has it, else a new one.
    pub(crate) fn take(want: usize) -> Vec<Member> {
        let pooled = if want >= MIN_MEMBERS {
            free().take(want)
        } else {
            None
        };
        pooled.unwrap_or_else(|| Vec::with_capacity(want))
    }

    /// A copy of `members` in a list from the pool.
    pub(crate) fn copy_of(members: &[Member]) -> Vec<Member> {
        let mut l = take(members.len());
        l.extend_from_slice(members);
        l
    }

    /// Keeps `list` for a later [`take`], or frees it when it is small or
    /// the pool is full.
    pub(crate) fn give(list: Vec<Member>) {
        if list.capacity() >= MIN_MEMBERS {
            // (A list refused is freed here, once the lock is released.)
            let refused = free().give(list);
            drop(refused);
        }
    }
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

/// The checksum of one block's members (see [`member_hash`]): what the
/// apply computes for each block as it writes the block's members, while
/// they are in cache, and sums with [`Context::with_checksum`].
pub fn block_checksum(seed: u64, block: u64, members: &[Member]) -> u64 {
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
        return block_checksum_avx512(proof, seed, block, members);
    }
    let _ = platform;
    block_checksum_portable(seed, block, members)
}

pub(crate) fn block_checksum_portable(seed: u64, block: u64, members: &[Member]) -> u64 {
    members
        .iter()
        .fold(0u64, |a, &m| a.wrapping_add(member_hash(seed, block, m)))
}

/// [`block_checksum`] where the CPU has AVX-512 (F and DQ), as `proof`
/// shows.
#[cfg(target_arch = "x86_64")]
pub(crate) fn block_checksum_avx512(
    proof: crate::platform::HasAvx512,
    seed: u64,
    block: u64,
    members: &[Member],
) -> u64 {
    // SAFETY: the proof exists only where detection found AVX-512 F and DQ,
    // every feature `checksum_avx512` is compiled with; its memory accesses
    // are bounds-checked (see there).
    unsafe { checksum_avx512(proof, seed, block, members) }
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
    let mut acc = _mm512_setzero_si512();
    for at in (0..full).step_by(8) {
        let chunk: &[u32; 8] = members[at..at + 8].try_into().expect("8 members");
        // SAFETY: 8 initialized u32s (32 bytes); the unaligned load reads
        // exactly those.
        let m = unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) };
        acc = _mm512_add_epi64(acc, hash8(base, m));
    }
    fold8(acc).wrapping_add(block_checksum_portable(seed, block, &members[full..]))
}

/// [`member_hash`] of 8 members at once: `base` is `seed ^ (block << 32)` in
/// every lane; lane `l` of the result is the hash of member `l`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) fn hash8(
    base: std::arch::x86_64::__m512i,
    m: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let k = _mm512_set1_epi64(0x9E37_79B9_7F4A_7C15u64 as i64);
    let h = _mm512_mullo_epi64(_mm512_xor_si512(base, _mm512_cvtepu32_epi64(m)), k);
    _mm512_xor_si512(h, _mm512_srli_epi64::<29>(h))
}

/// The wrapping sum of 8 u64 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) fn fold8(acc: std::arch::x86_64::__m512i) -> u64 {
    let mut lanes = [0u64; 8];
    // SAFETY: `lanes` is 8 writable u64s (64 bytes).
    unsafe { std::arch::x86_64::_mm512_storeu_si512(lanes.as_mut_ptr().cast(), acc) };
    lanes.iter().fold(0u64, |a, &x| a.wrapping_add(x))
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
        Context::with_checksum(version, (from, to), tensors, checksum)
    }

    /// A context from its tensors and their checksum, computed already (the
    /// sum of their blocks' [`block_checksum`]s, each block's with its
    /// tensor's [`tensor_seed`]).
    pub fn with_checksum(
        version: u64,
        (from, to): (Digest, Digest),
        tensors: std::collections::BTreeMap<String, TensorContext>,
        checksum: u64,
    ) -> Context {
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

/// Magic of a saved context as [`Context::to_bytes`] writes it (members
/// Rice-coded).
const SAVED_MAGIC: &[u8; 8] = b"WCCTX\x002\x00";

/// Magic of the first saved form (members as u32 LE), still read.
const SAVED_MAGIC_V1: &[u8; 8] = b"WCCTX\x001\x00";

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

/// Appends `v` as a LEB128 varint.
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 varint of at most 10 bytes from the front of `data`.
fn take_varint(data: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&b, rest) = data.split_first()?;
        *data = rest;
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// One block's members in the saved form: Rice-coded index gaps (parameter
/// `k`, each gap counted from one past the previous index), each followed by
/// the member's two flag bits; the stream's bytes.
fn encode_saved_block(members: &[Member]) -> (u32, Vec<u8>) {
    let sum = members.last().map_or(0, |&m| index(m) as u64 + 1) - members.len() as u64;
    // The decoder takes parameters up to 30 (gaps stay below 2^30).
    let k = crate::codec::bits::rice_guess(members.len() as u64, sum, 30);
    let mut w = crate::codec::bits::FastWriter::default();
    w.reserve(members.len() * 2 + 16);
    let mut next = 0u32;
    for &m in members {
        let g = (index(m) - next) as u64;
        crate::codec::bits::put_rice(&mut w, g, k, ((m & 3) as u64, 2));
        next = index(m) + 1;
    }
    (k, w.finish())
}

/// Decodes [`encode_saved_block`]'s stream of `count` members of a block of
/// `block_words` words; `None` for any stream that is not exactly that.
fn decode_saved_block(stream: &[u8], count: u64, k: u32, block_words: u64) -> Option<Vec<Member>> {
    let mut r = crate::codec::bits::BitReader::new(stream);
    let mut out = Vec::with_capacity(count as usize);
    let mut next = 0u64;
    let mask = (1u64 << k) - 1;
    for _ in 0..count {
        r.ensure();
        let (acc, n) = r.peek();
        let q = acc.trailing_zeros();
        let (g, flags) = if acc != 0 && q + k + 3 <= n {
            // The whole member is buffered: one read.
            r.consume(q + k + 3);
            let g = ((q as u64) << k) | ((acc >> (q + 1)) & mask);
            (g, ((acc >> (q + 1 + k)) & 3) as u32)
        } else {
            let q = r.unary(block_words >> k)?;
            ((q << k) | r.get(k)?, r.get(2)? as u32)
        };
        let i = next.checked_add(g).filter(|&i| i < block_words)?;
        out.push(((i as u32) << 2) | flags);
        next = i + 1;
    }
    r.at_clean_end().then_some(out)
}

impl Context {
    /// The context as bytes, to keep beside a state between runs (a
    /// publisher's `--state`, a subscriber's output directory): the magic
    /// `WCCTX\02\0`, a u64 LE header length, a JSON header, then per tensor
    /// and block the member count (LEB128); for a block with members, its
    /// Rice parameter (one byte), its stream's length in bytes (LEB128) and
    /// the stream: per member its index gap, Rice-coded, and its two flag
    /// bits (about 9 bits per member at 1–3% density, against the 32 of a
    /// plain list). Not a wire format: only the process that wrote it reads
    /// it back.
    pub fn to_bytes(&self) -> Vec<u8> {
        use rayon::prelude::*;
        let header = self.saved_header();
        let json = serde_json::to_vec(&header).expect("a context header serializes");
        let mut out = Vec::with_capacity(16 + json.len() + self.len() * 5 / 4);
        out.extend_from_slice(SAVED_MAGIC);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for t in self.tensors.values() {
            let coded: Vec<(u32, Vec<u8>)> =
                t.blocks.par_iter().map(|b| encode_saved_block(b)).collect();
            for (b, (k, stream)) in t.blocks.iter().zip(coded) {
                put_varint(&mut out, b.len() as u64);
                if !b.is_empty() {
                    out.push(k as u8);
                    put_varint(&mut out, stream.len() as u64);
                    out.extend_from_slice(&stream);
                }
            }
        }
        out
    }

    #[cfg(test)]
    fn saved_header_len(&self) -> usize {
        16 + serde_json::to_vec(&self.saved_header())
            .expect("serializes")
            .len()
    }

    fn saved_header(&self) -> SavedHeader {
        SavedHeader {
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
        }
    }

    /// A context [`Context::to_bytes`] wrote (or the first saved form, its
    /// members as u32 LE), checked whole: the sizes add up to the bytes
    /// given, each block's members ascend strictly and lie inside the
    /// block, and the members' checksum is the recorded one. A file that
    /// fails any check is refused (`Error::Metadata` naming what failed):
    /// its holder then works without it.
    pub fn from_bytes(bytes: &[u8]) -> crate::error::Result<Context> {
        use crate::error::Error;
        use rayon::prelude::*;
        let bad = |why: String| Error::metadata("saved context", why);
        let v1 = match bytes.get(..8) {
            Some(m) if m == SAVED_MAGIC => false,
            Some(m) if m == SAVED_MAGIC_V1 => true,
            _ => return Err(bad("not a saved context (magic)".into())),
        };
        if bytes.len() < 16 {
            return Err(bad("shorter than its header".into()));
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
        let mut tensors = std::collections::BTreeMap::new();
        for (name, block_words, nblocks, members) in h.tensors {
            if block_words == 0 || block_words > MAX_BLOCK_WORDS {
                return Err(bad(format!("tensor `{name}`: block length {block_words}")));
            }
            let blocks = if v1 {
                read_v1_blocks(&mut data, nblocks, members)
            } else {
                // The block directory (counts, parameters, stream slices),
                // then the streams decoded in parallel.
                let mut dir = Vec::new();
                let mut total = 0u64;
                for _ in 0..nblocks {
                    let count = take_varint(&mut data).filter(|&c| c <= block_words);
                    let Some(count) = count else {
                        dir.clear();
                        total = u64::MAX;
                        break;
                    };
                    total = total.saturating_add(count);
                    if count == 0 {
                        dir.push((0, 0, &[][..]));
                        continue;
                    }
                    let Some((&k, rest)) = data.split_first() else {
                        total = u64::MAX;
                        break;
                    };
                    data = rest;
                    let len = take_varint(&mut data).filter(|&l| l <= data.len() as u64);
                    // Every member takes at least k + 3 bits: a count the
                    // stream cannot hold is refused before any allocation.
                    let fits = |l: u64| count.saturating_mul(k as u64 + 3) <= l.saturating_mul(8);
                    let Some(len) = len.filter(|&l| k <= 30 && fits(l)) else {
                        total = u64::MAX;
                        break;
                    };
                    let (stream, rest) = data.split_at(len as usize);
                    data = rest;
                    dir.push((count, k as u32, stream));
                }
                if total != members {
                    None
                } else {
                    dir.par_iter()
                        .map(|&(count, k, stream)| {
                            decode_saved_block(stream, count, k, block_words)
                        })
                        .collect::<Option<Vec<Vec<Member>>>>()
                }
            };
            let blocks =
                blocks.ok_or_else(|| bad(format!("tensor `{name}`: members do not decode")))?;
            let in_range = blocks.iter().all(|ms| {
                ms.windows(2).all(|w| index(w[0]) < index(w[1]))
                    && ms.last().is_none_or(|&m| (index(m) as u64) < block_words)
            });
            if !in_range {
                return Err(bad(format!(
                    "tensor `{name}`: members out of order or range"
                )));
            }
            let t = TensorContext {
                block_words,
                blocks,
            };
            if tensors.insert(name.clone(), t).is_some() {
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

/// The first saved form's blocks of one tensor: `nblocks` member counts,
/// then `members` members, u32 LE; `None` where they do not add up.
fn read_v1_blocks(data: &mut &[u8], nblocks: u64, members: u64) -> Option<Vec<Vec<Member>>> {
    let mut next = |count: u64| -> Option<Vec<u32>> {
        let len = count.checked_mul(4).filter(|&l| l <= data.len() as u64)? as usize;
        let (head, rest) = data.split_at(len);
        *data = rest;
        Some(
            head.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        )
    };
    let counts = next(nblocks)?;
    if counts.iter().map(|&c| c as u64).sum::<u64>() != members {
        return None;
    }
    let mut all = next(members)?.into_iter();
    Some(
        counts
            .into_iter()
            .map(|c| all.by_ref().take(c as usize).collect())
            .collect(),
    )
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

    /// The first saved form, as the earlier binaries wrote it.
    fn to_bytes_v1(c: &Context) -> Vec<u8> {
        let json = serde_json::to_vec(&c.saved_header()).unwrap();
        let mut out = SAVED_MAGIC_V1.to_vec();
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for t in c.tensors.values() {
            for b in &t.blocks {
                out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            }
            for m in t.blocks.iter().flatten() {
                out.extend_from_slice(&m.to_le_bytes());
            }
        }
        out
    }

    /// A context of `n` random members per block of 4,096 words (a few
    /// flags of each kind), in three blocks.
    fn random(n: usize, seed: u64) -> Context {
        let mut x = seed | 1;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let blocks = (0..3)
            .map(|_| {
                let mut idx: Vec<u32> = (0..n).map(|_| (rnd() % 4096) as u32).collect();
                idx.sort_unstable();
                idx.dedup();
                idx.iter().map(|&i| i << 2 | (rnd() % 4) as u32).collect()
            })
            .collect();
        let t = TensorContext {
            block_words: 4096,
            blocks,
        };
        Context::new(4, (Digest(7), Digest(8)), [("w".to_string(), t)].into())
    }

    #[test]
    fn a_saved_context_reads_back_and_every_damage_is_refused() {
        for c in [sample(), random(80, 3), random(4000, 5)] {
            let bytes = c.to_bytes();
            assert_eq!(Context::from_bytes(&bytes).unwrap(), c);
            // Any truncation, and any flipped byte after the header, is
            // refused.
            for cut in 0..bytes.len() {
                assert!(Context::from_bytes(&bytes[..cut]).is_err(), "cut at {cut}");
            }
            let json = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
            for at in 16 + json..bytes.len() {
                let mut b = bytes.clone();
                b[at] ^= 0x10;
                assert!(Context::from_bytes(&b).is_err(), "flip at {at}");
            }
            let mut longer = bytes.clone();
            longer.extend_from_slice(&[0; 4]);
            assert!(Context::from_bytes(&longer).is_err());
            // The first saved form still reads, to the same context.
            assert_eq!(Context::from_bytes(&to_bytes_v1(&c)).unwrap(), c);
        }
        // An empty context (after an anchor) too.
        let empty = Context::new(3, (Digest(5), Digest(6)), Default::default());
        assert_eq!(Context::from_bytes(&empty.to_bytes()).unwrap(), empty);
    }

    #[test]
    fn a_saved_context_takes_about_nine_bits_per_member_at_two_percent() {
        // 80 members in 4,096 words: 2% density.
        let c = random(80, 11);
        let bits = 8.0 * (c.to_bytes().len() - c.saved_header_len()) as f64 / c.len() as f64;
        assert!((7.0..10.5).contains(&bits), "{bits} bits per member");
        assert!(to_bytes_v1(&c).len() > 3 * c.to_bytes().len() / 2);
    }

    #[test]
    fn a_count_the_stream_cannot_hold_is_refused_before_allocating() {
        // One member claimed per bit of a 1-byte stream: 3 bits each at least.
        let c = random(1, 13);
        let mut bytes = c.to_bytes();
        let json = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        // The first block: count varint (1 member), k, length 1, 1 byte.
        let at = 16 + json;
        assert_eq!(bytes[at], 1);
        bytes[at] = 0x7f; // 127 members in the same stream
        assert!(Context::from_bytes(&bytes).is_err());
    }
}

#[cfg(test)]
mod pool_tests {
    use super::pool::{self, MIN_MEMBERS, Pool};
    use super::*;

    #[test]
    fn the_pool_keeps_large_lists_within_its_limits_and_hands_out_the_best_fit() {
        let mut p = Pool::new(10 * MIN_MEMBERS * 4, 3);
        // Small lists are refused, so are lists past the byte limit.
        assert!(p.give(Vec::with_capacity(MIN_MEMBERS - 1)).is_some());
        assert!(p.give(Vec::with_capacity(11 * MIN_MEMBERS)).is_some());
        assert_eq!(p.held(), (0, 0));
        let mut a = Vec::with_capacity(4 * MIN_MEMBERS);
        a.extend_from_slice(&[1, 2, 3]);
        let (pa, ca) = (a.as_ptr(), a.capacity());
        let b = Vec::with_capacity(2 * MIN_MEMBERS);
        let (pb, cb) = (b.as_ptr(), b.capacity());
        assert!(p.give(a).is_none() && p.give(b).is_none());
        assert_eq!(p.held(), (2, (ca + cb) * 4));
        // Full by bytes: 4 + 2 + 5 > 10 lists' worth.
        assert!(p.give(Vec::with_capacity(5 * MIN_MEMBERS)).is_some());
        // Nothing holds room for more than the largest.
        assert!(p.take(ca + 1).is_none());
        // The smallest that fits, emptied; then the other one.
        let t = p.take(MIN_MEMBERS).expect("a list");
        assert_eq!((t.as_ptr(), t.len()), (pb, 0));
        let t = p.take(MIN_MEMBERS).expect("a list");
        assert_eq!((t.as_ptr(), t.len()), (pa, 0), "emptied");
        assert_eq!(p.held(), (0, 0));
        assert!(p.take(1).is_none());
        // Full by count.
        for _ in 0..3 {
            assert!(p.give(Vec::with_capacity(MIN_MEMBERS)).is_none());
        }
        assert!(p.give(Vec::with_capacity(MIN_MEMBERS)).is_some());
    }

    #[test]
    fn a_dropped_context_hands_its_lists_to_the_next_one() {
        // The process's pool, shared with the tests running beside this
        // one: a list of an unusual size is found again unless another
        // take got it first, so the test only asserts what holds either
        // way, and that the list came back at least once in a few tries.
        let want = 7 * MIN_MEMBERS + 13;
        let mut found = false;
        for _ in 0..20 {
            let mut l = pool::take(want);
            assert!(l.is_empty() && l.capacity() >= want);
            l.extend((0..100u32).map(|i| i << 2));
            let at = l.as_ptr();
            drop(TensorContext {
                block_words: 1 << 22,
                blocks: vec![l, vec![4, 8]],
            });
            let again = pool::take(want);
            assert!(again.is_empty() && again.capacity() >= want);
            found |= again.as_ptr() == at;
            pool::give(again);
            if found {
                break;
            }
        }
        assert!(found, "a dropped context's list is taken again");
        // A copy through the pool is a copy.
        let m = [1u32, 5, 9];
        assert_eq!(pool::copy_of(&m), m);
    }
}
