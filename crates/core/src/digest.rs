//! Additive (homomorphic) element digests: integrity whose per-delta cost is
//! proportional to the changed elements, not to the model.
//!
//! A tensor's digest is the wrapping sum, modulo 2^64, of one 64-bit hash per
//! diff word:
//!
//! ```text
//! D(t) = Σ_i  h(seed_t, i, w_i)            (mod 2^64)
//! h(seed, i, w) = V(w) · A(seed, i)
//! V(w) = fmix64( w ^ 0x9e3779b97f4a7c15 )
//! A(seed, i) = fmix64( i ^ seed ) | 1
//! ```
//!
//! where `fmix64` is MurmurHash3's 64-bit finalizer, `i` the word index and `w`
//! the word's little-endian bits zero-extended to 64 bits. With AVX-512, full
//! passes and per-change updates compute every term eight lanes at a time
//! (five 64-bit multiplies per eight words; a full pass over a 2 GB bf16 model
//! went from 0.91 s to 0.20 s on two Zen 4 cores, `weightcast bench codec
//! --elements 1000000000 --steps 1 --reps 5 --encodings compact` with and
//! without `WEIGHTCAST_SIMD=off`; gathering `V` from the table instead was
//! slower, 0.26 s). `V` depends on the word alone, so the portable full pass
//! reads it for words of up to two bytes from a 64 K-entry table built at
//! compile time.
//! `A` is an odd (hence invertible) pseudo-random multiplier per
//! position, so a change of word `i` from `a` to `b` moves the digest by
//! `(V(b) − V(a)) · A(i)`, which is never zero: one position hash and one
//! multiply per changed word. The seed binds the
//! tensor's name, dtype and shape (see [`TensorSeed::new`]), so equal bytes under
//! another name or shape give another digest. A file's digest is the wrapping sum
//! of its tensors' digests.
//!
//! Because the digest is a sum, changing word `i` from `a` to `b` changes it by
//! `h(i, b) - h(i, a)`: a publisher and a subscriber both update it in
//! O(changed elements), and a subscriber that reads the *old* word from its own
//! buffer while applying detects that its bytes at those positions are not the
//! ones the delta was made from. `docs/format.md` states exactly what this
//! guarantees and what it does not.

use rayon::prelude::*;

use crate::dtype::{Dtype, read_word, word_bytes};
#[cfg(target_arch = "x86_64")]
use crate::platform::HasAvx512;
use crate::platform::{Level, Platform, dispatched};

/// A 64-bit additive digest. Displayed and serialized as 16 lowercase hex digits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Digest(pub u64);

impl Digest {
    /// Adds the contribution of another digest (wrapping).
    #[inline]
    pub fn wrapping_add(self, other: Digest) -> Digest {
        Digest(self.0.wrapping_add(other.0))
    }

    /// Removes the contribution of another digest (wrapping).
    #[inline]
    pub fn wrapping_sub(self, other: Digest) -> Digest {
        Digest(self.0.wrapping_sub(other.0))
    }

    /// Parses 16 hex digits.
    pub fn parse(s: &str) -> Option<Digest> {
        if s.len() != 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(s, 16).ok().map(Digest)
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl serde::Serialize for Digest {
    /// As in headers: 16 lowercase hex digits.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The per-tensor key of the element hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSeed(pub u64);

/// The constant xored into a word before its first mix.
pub const VALUE_KEY: u64 = 0x9e37_79b9_7f4a_7c15;

/// `V(w)` for every `w < 2^16`, computed at compile time.
static SMALL_VALUES: [u64; 1 << 16] = {
    let mut t = [0u64; 1 << 16];
    let mut w = 0;
    while w < 1 << 16 {
        t[w] = fmix64(w as u64 ^ VALUE_KEY);
        w += 1;
    }
    t
};

/// `V(w)`: table lookup for words below 2^16, computed otherwise.
#[inline(always)]
pub fn value_hash(w: u64) -> u64 {
    if w < 1 << 16 {
        SMALL_VALUES[w as usize]
    } else {
        fmix64(w ^ VALUE_KEY)
    }
}

impl TensorSeed {
    /// Derives the seed from the tensor's identity:
    /// `blake3("weightcast/digest/v1\0" ‖ name ‖ "\0" ‖ dtype ‖ "\0" ‖ ndim:u64le ‖ dims:u64le…)`,
    /// first 8 bytes read as a little-endian u64.
    pub fn new(name: &str, dtype: Dtype, shape: &[usize]) -> TensorSeed {
        let mut h = blake3::Hasher::new();
        h.update(b"weightcast/digest/v1\0");
        h.update(name.as_bytes());
        h.update(b"\0");
        h.update(dtype.to_string().as_bytes());
        h.update(b"\0");
        h.update(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            h.update(&(d as u64).to_le_bytes());
        }
        let out = h.finalize();
        let b = out.as_bytes();
        TensorSeed(u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")))
    }

    /// The hash of word `w` at index `i`.
    #[inline(always)]
    pub fn hash(&self, i: u64, w: u64) -> u64 {
        value_hash(w).wrapping_mul(self.position(i))
    }

    /// `A(seed, i)`: the odd multiplier of position `i`.
    #[inline(always)]
    pub fn position(&self, i: u64) -> u64 {
        fmix64(i ^ self.0) | 1
    }

    /// The digest change when word `i` goes from `old` to `new`.
    #[inline(always)]
    pub fn change(&self, i: u64, old: u64, new: u64) -> u64 {
        fmix64(new ^ VALUE_KEY)
            .wrapping_sub(fmix64(old ^ VALUE_KEY))
            .wrapping_mul(self.position(i))
    }
}

/// Lanes of one [`ChangeBatch`].
pub const LANES: usize = 16;

/// Up to [`LANES`] word changes whose digest contributions are summed at once
/// (eight per AVX-512 vector where the CPU has it). Unused lanes stay all
/// zero: an unchanged word contributes `(V(0) − V(0))·A(0) = 0`.
#[derive(Clone, Copy, Default)]
pub struct ChangeBatch {
    /// Word indices.
    pub index: [u64; LANES],
    /// Old words.
    pub old: [u64; LANES],
    /// New words.
    pub new: [u64; LANES],
}

impl TensorSeed {
    /// `Σ change(index[j], old[j], new[j])` over the batch's lanes (wrapping):
    /// the same value as the scalar loop, computed with AVX-512 when the CPU
    /// has it.
    #[inline]
    pub fn change_sum(&self, b: &ChangeBatch) -> u64 {
        self.change_sum_on(Platform::detect(), b)
    }

    /// [`TensorSeed::change_sum`] on `platform` (AVX-512 where it has it).
    #[inline]
    pub(crate) fn change_sum_on(&self, platform: Platform, b: &ChangeBatch) -> u64 {
        #[cfg(target_arch = "x86_64")]
        if platform.has(Level::Avx512) {
            dispatched!(ChangeSum, Level::Avx512);
            // SAFETY: `platform.has(Level::Avx512)`: detection found every
            // feature `change_sum_avx512` is compiled with (AVX-512 F, DQ);
            // it reads only its arguments. Exercised by
            // `vector_and_scalar_change_sums_agree`.
            return unsafe { change_sum_avx512(self.0, b) };
        }
        let _ = platform;
        dispatched!(ChangeSum, Level::Portable);
        self.change_sum_scalar(b)
    }

    // Inlined into the apply kernels (AVX2 `target_feature` functions), where
    // it vectorizes: out of line it is scalar SSE2 code and the apply costs
    // 16% more instructions (a release build's codegen units decide where it
    // lands otherwise; docs/benchmarks.md, "Build time").
    #[inline]
    fn change_sum_scalar(&self, b: &ChangeBatch) -> u64 {
        (0..LANES).fold(0u64, |acc, j| {
            acc.wrapping_add(self.change(b.index[j], b.old[j], b.new[j]))
        })
    }
}

/// [`TensorSeed::change_sum`] on two 8-lane vectors per field.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
fn change_sum_avx512(seed: u64, b: &ChangeBatch) -> u64 {
    use std::arch::x86_64::{_mm512_add_epi64, _mm512_loadu_si512, _mm512_reduce_add_epi64};
    let load = |a: &[u64; LANES], h: usize| {
        // SAFETY: `a[8 * h..8 * h + 8]` is in bounds (h is 0 or 1, LANES is
        // 16): the unaligned load reads exactly those 64 bytes.
        unsafe { _mm512_loadu_si512(a[8 * h..].as_ptr().cast()) }
    };
    let lo = change_x8_avx512(seed, load(&b.index, 0), load(&b.old, 0), load(&b.new, 0));
    let hi = change_x8_avx512(seed, load(&b.index, 1), load(&b.old, 1), load(&b.new, 1));
    _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi)) as u64
}

/// Eight lanes of [`TensorSeed::change`] for the AVX-512 kernels of other
/// modules (the `compact` encoder's and apply's); `proof` shows the CPU has
/// AVX-512 F and DQ. Inlined into those kernels, which are compiled with a
/// superset of the features, so the lanes stay in registers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn change_x8(
    proof: HasAvx512,
    seed: u64,
    index: std::arch::x86_64::__m512i,
    old: std::arch::x86_64::__m512i,
    new: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    let _ = proof;
    // SAFETY: a `HasAvx512` exists only where detection found AVX-512 F and
    // DQ, every feature `change_x8_avx512` is compiled with; it is otherwise
    // safe code. Exercised through the vector encoder and group-kernel
    // agreement tests in `codec::compact` (on CPUs that have the features).
    unsafe { change_x8_avx512(seed, index, old, new) }
}

/// Eight lanes of [`TensorSeed::change`]: `(V(new) − V(old))·A(seed, index)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
fn change_x8_avx512(
    seed: u64,
    index: std::arch::x86_64::__m512i,
    old: std::arch::x86_64::__m512i,
    new: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::{
        _mm512_mullo_epi64, _mm512_set1_epi64, _mm512_sub_epi64, _mm512_xor_si512,
    };
    let key = _mm512_set1_epi64(VALUE_KEY as i64);
    let vn = fmix64_x8(_mm512_xor_si512(new, key));
    let vo = fmix64_x8(_mm512_xor_si512(old, key));
    _mm512_mullo_epi64(_mm512_sub_epi64(vn, vo), position_x8(seed, index))
}

/// Eight lanes of [`fmix64`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
fn fmix64_x8(k: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::{
        _mm512_mullo_epi64, _mm512_set1_epi64, _mm512_srli_epi64, _mm512_xor_si512,
    };
    let c1 = _mm512_set1_epi64(0xff51_afd7_ed55_8ccd_u64 as i64);
    let c2 = _mm512_set1_epi64(0xc4ce_b9fe_1a85_ec53_u64 as i64);
    let k = _mm512_xor_si512(k, _mm512_srli_epi64::<33>(k));
    let k = _mm512_mullo_epi64(k, c1);
    let k = _mm512_xor_si512(k, _mm512_srli_epi64::<33>(k));
    let k = _mm512_mullo_epi64(k, c2);
    _mm512_xor_si512(k, _mm512_srli_epi64::<33>(k))
}

/// Eight lanes of [`TensorSeed::position`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
fn position_x8(seed: u64, index: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::{_mm512_or_si512, _mm512_set1_epi64, _mm512_xor_si512};
    _mm512_or_si512(
        fmix64_x8(_mm512_xor_si512(index, _mm512_set1_epi64(seed as i64))),
        _mm512_set1_epi64(1),
    )
}

/// `Σ h(seed, first + k, w_k)` over the `W`-byte words of `data` (a whole
/// number of them), eight at a time: `V` is computed, not looked up, so the
/// pass needs no table in cache, and the words are zero-extended to 64-bit
/// lanes straight from memory.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
fn words_sum_avx512<const W: usize>(seed: TensorSeed, data: &[u8], first: u64) -> u64 {
    use std::arch::x86_64::{
        __m512i, _mm_loadl_epi64, _mm_loadu_si128, _mm256_loadu_si256, _mm512_add_epi64,
        _mm512_cvtepu8_epi64, _mm512_cvtepu16_epi64, _mm512_cvtepu32_epi64, _mm512_loadu_si512,
        _mm512_mullo_epi64, _mm512_reduce_add_epi64, _mm512_set1_epi64, _mm512_setr_epi64,
        _mm512_setzero_si512, _mm512_xor_si512,
    };
    debug_assert_eq!(data.len() % W, 0);
    let key = _mm512_set1_epi64(VALUE_KEY as i64);
    let mut index = _mm512_add_epi64(
        _mm512_set1_epi64(first as i64),
        _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7),
    );
    let mut acc = _mm512_setzero_si512();
    let mut vectors = data.chunks_exact(8 * W);
    for v in &mut vectors {
        let p = v.as_ptr();
        // SAFETY: `v` is exactly 8·W bytes, and each load reads exactly 8·W
        // bytes from its start (unaligned loads).
        let words: __m512i = unsafe {
            match W {
                1 => _mm512_cvtepu8_epi64(_mm_loadl_epi64(p.cast())),
                2 => _mm512_cvtepu16_epi64(_mm_loadu_si128(p.cast())),
                4 => _mm512_cvtepu32_epi64(_mm256_loadu_si256(p.cast())),
                _ => _mm512_loadu_si512(p.cast()),
            }
        };
        let value = fmix64_x8(_mm512_xor_si512(words, key));
        acc = _mm512_add_epi64(acc, _mm512_mullo_epi64(value, position_x8(seed.0, index)));
        index = _mm512_add_epi64(index, _mm512_set1_epi64(8));
    }
    let done = (data.len() / (8 * W) * 8) as u64;
    let tail = vectors.remainder();
    let sum = _mm512_reduce_add_epi64(acc) as u64;
    (0..tail.len() / W).fold(sum, |acc, k| {
        acc.wrapping_add(seed.hash(first + done + k as u64, read_word(tail, W, k)))
    })
}

/// MurmurHash3's 64-bit finalizer (a bijection on u64).
#[inline(always)]
pub const fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// Whether full digest passes run the AVX-512 loop on this machine (see
/// [`crate::platform`]).
pub fn full_pass_vector() -> bool {
    Platform::detect().has(Level::Avx512)
}

/// Words per parallel chunk of a full digest pass.
const CHUNK_WORDS: usize = 1 << 20;

/// Digest of a whole tensor (a full pass; used for anchors and initial loads).
pub fn tensor_digest(seed: TensorSeed, dtype: Dtype, data: &[u8]) -> Digest {
    let wb = word_bytes(dtype);
    let words = data.len() / wb;
    let chunks = words.div_ceil(CHUNK_WORDS);
    let platform = Platform::detect();
    let sum = (0..chunks)
        .into_par_iter()
        .map(|c| {
            let lo = c * CHUNK_WORDS;
            let hi = (lo + CHUNK_WORDS).min(words);
            words_sum(platform, seed, wb, &data[lo * wb..hi * wb], lo as u64)
        })
        .reduce(|| 0u64, u64::wrapping_add);
    Digest(sum)
}

/// The digest of tensor `name` (`dtype`, `shape`) holding `data`: a full,
/// parallel pass, for callers that hold tensors outside a
/// [`TensorSet`](crate::tensors::TensorSet) (an engine's, a memory-mapped
/// file's) and want to check one against a header's `digest` or
/// `base_digest` entry. Fails when `data` is not the size `dtype` and
/// `shape` give.
pub fn tensor_digest_of(
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    data: &[u8],
) -> crate::Result<Digest> {
    match crate::dtype::byte_len(dtype, shape) {
        Some(n) if n == data.len() => Ok(tensor_digest(
            TensorSeed::new(name, dtype, shape),
            dtype,
            data,
        )),
        want => Err(crate::Error::tensor(
            name,
            format!(
                "{} bytes given, {dtype} {shape:?} holds {}",
                data.len(),
                want.map_or("an unrepresentable number of".to_string(), |n| n
                    .to_string())
            ),
        )),
    }
}

/// Digest contribution of `words` (whole words of `dtype`), the first of
/// which is word number `first` of its tensor: summing the contributions of
/// consecutive pieces gives [`tensor_digest`]. Sequential; callers that hold a
/// piece anyway (a decoder writing chunk by chunk) add it up in parallel.
pub fn words_digest(seed: TensorSeed, dtype: Dtype, words: &[u8], first: u64) -> Digest {
    Digest(words_sum(
        Platform::detect(),
        seed,
        word_bytes(dtype),
        words,
        first,
    ))
}

/// `Σ h(seed, first + k, w_k)` over the `wb`-byte words of `words`, on
/// `platform`: the AVX-512 loop where it has it, else the table loop.
fn words_sum(platform: Platform, seed: TensorSeed, wb: usize, words: &[u8], first: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if platform.has(Level::Avx512) {
        dispatched!(FullPass, Level::Avx512);
        // SAFETY: `platform.has(Level::Avx512)`: detection found every
        // feature `words_sum_avx512` is compiled with (AVX-512 F, DQ); it
        // reads only `words`. Exercised by `vector_and_scalar_full_passes_agree`.
        return crate::with_word_width!(wb, W => unsafe {
            words_sum_avx512::<W>(seed, words, first)
        });
    }
    let _ = platform;
    dispatched!(FullPass, Level::Portable);
    words_sum_scalar(seed, wb, words, first)
}

fn words_sum_scalar(seed: TensorSeed, wb: usize, words: &[u8], first: u64) -> u64 {
    let mut acc = 0u64;
    match wb {
        2 => {
            // The hot case (BF16/F16): a monomorphic loop over the value table.
            for (k, c) in words.chunks_exact(2).enumerate() {
                let w = u16::from_le_bytes([c[0], c[1]]) as usize;
                acc =
                    acc.wrapping_add(SMALL_VALUES[w].wrapping_mul(seed.position(first + k as u64)));
            }
        }
        _ => {
            for k in 0..words.len() / wb {
                acc = acc.wrapping_add(seed.hash(first + k as u64, read_word(words, wb, k)));
            }
        }
    }
    acc
}

/// Inputs from which [`blake3_update`] hashes on every core (BLAKE3's
/// `update_rayon`, which its authors advise above about 128 KiB). A delta's
/// payload is checked this way before it is applied: on this thread it is
/// serial work beside an apply that the cores share (a 3.2 MB payload:
/// 0.31 ms on one thread, 0.21 ms on two; the apply about 12 ms on two).
pub const BLAKE3_PARALLEL_FROM: usize = 128 << 10;

/// Feeds `data` to `hasher`: on every core (rayon) from
/// [`BLAKE3_PARALLEL_FROM`] bytes where rayon has more than one thread, on
/// this thread otherwise (`update_rayon` on one thread took 0.43 ms where
/// `update` took 0.31). The hash is the same either way.
pub fn blake3_update(hasher: &mut blake3::Hasher, data: &[u8]) {
    if data.len() >= BLAKE3_PARALLEL_FROM && rayon::current_num_threads() > 1 {
        hasher.update_rayon(data);
    } else {
        hasher.update(data);
    }
}

/// `blake3::hash(data)`, through [`blake3_update`].
pub fn blake3_of(data: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    blake3_update(&mut h, data);
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blake3_of_is_blake3_on_both_sides_of_the_parallel_bound() {
        let data: Vec<u8> = (0..3 * BLAKE3_PARALLEL_FROM + 77)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for n in [
            0,
            1,
            BLAKE3_PARALLEL_FROM - 1,
            BLAKE3_PARALLEL_FROM,
            BLAKE3_PARALLEL_FROM + 1,
            data.len(),
        ] {
            assert_eq!(blake3_of(&data[..n]), blake3::hash(&data[..n]), "{n} bytes");
        }
        // In pieces, as the encoder feeds a payload.
        let mut h = blake3::Hasher::new();
        for piece in data.chunks(BLAKE3_PARALLEL_FROM + 5) {
            blake3_update(&mut h, piece);
        }
        assert_eq!(h.finalize(), blake3::hash(&data));
    }

    #[test]
    fn digest_is_additive_under_word_changes() {
        let seed = TensorSeed::new("w", Dtype::BF16, &[4]);
        let mut data = vec![1u8, 0, 2, 0, 3, 0, 4, 0];
        let d0 = tensor_digest(seed, Dtype::BF16, &data);
        data[2] = 9;
        let d1 = tensor_digest(seed, Dtype::BF16, &data);
        let step = seed.change(1, 2, 9);
        assert_eq!(d0.0.wrapping_add(step), d1.0);
        assert_ne!(d0, d1);
    }

    #[test]
    fn seed_binds_identity() {
        let a = TensorSeed::new("w", Dtype::BF16, &[4]);
        assert_ne!(a, TensorSeed::new("v", Dtype::BF16, &[4]));
        assert_ne!(a, TensorSeed::new("w", Dtype::F16, &[4]));
        assert_ne!(a, TensorSeed::new("w", Dtype::BF16, &[2, 2]));
    }

    #[test]
    fn swapped_words_change_the_digest() {
        let seed = TensorSeed::new("w", Dtype::U8, &[2]);
        assert_ne!(
            tensor_digest(seed, Dtype::U8, &[1, 2]),
            tensor_digest(seed, Dtype::U8, &[2, 1])
        );
    }

    #[test]
    fn changes_never_cancel_alone() {
        let seed = TensorSeed::new("w", Dtype::BF16, &[8]);
        for i in 0..64u64 {
            for (a, b) in [(0u64, 1u64), (0x3f80, 0x3f81), (0xffff, 0x7fff)] {
                assert_ne!(seed.change(i, a, b), 0);
                assert_eq!(
                    seed.change(i, a, b),
                    seed.hash(i, b).wrapping_sub(seed.hash(i, a))
                );
            }
        }
    }

    #[test]
    fn vector_and_scalar_change_sums_agree() {
        let seed = TensorSeed::new("w", Dtype::BF16, &[1 << 20]);
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut batches = Vec::new();
        for fill in [0, 1, 7, 8, 9, 15, 16] {
            let mut b = ChangeBatch::default();
            for j in 0..fill {
                x = fmix64(x.wrapping_add(j as u64));
                b.index[j] = x >> 20;
                b.old[j] = x & 0xffff;
                b.new[j] = (x >> 16) & 0xffff;
            }
            let expect = (0..fill).fold(0u64, |a, j| {
                a.wrapping_add(seed.change(b.index[j], b.old[j], b.new[j]))
            });
            assert_eq!(seed.change_sum_scalar(&b), expect);
            assert_eq!(seed.change_sum_on(Platform::portable(), &b), expect);
            assert_eq!(seed.change_sum(&b), expect, "{fill} lanes");
            batches.push((b, expect));
        }
        if !crate::platform::expect::require(Level::Avx512, "vector_and_scalar_change_sums_agree") {
            return;
        }
        for (b, expect) in &batches {
            assert_eq!(seed.change_sum_on(Platform::cpu(), b), *expect);
        }
    }

    #[test]
    fn vector_and_scalar_full_passes_agree() {
        let mut x = 0x0fed_cba9_8765_4321u64;
        let data: Vec<u8> = (0..8 * 41 + 8)
            .map(|_| {
                x = fmix64(x.wrapping_add(1));
                x as u8
            })
            .collect();
        // Every length up to five vectors and a ragged tail, from word 0 and
        // from later words (the position lanes start at `first`), and at
        // indices beyond 2^32 (the lanes are 64-bit): (wb, first, words, sum).
        let mut cases = Vec::new();
        for wb in [1, 2, 4, 8] {
            let seed = TensorSeed(x ^ wb as u64);
            for lo in [0, 1, 7, 8, 33] {
                for hi in lo..=41 {
                    let words = &data[lo * wb..hi * wb];
                    let expect = (0..hi - lo).fold(0u64, |a, k| {
                        a.wrapping_add(seed.hash((lo + k) as u64, read_word(words, wb, k)))
                    });
                    cases.push((seed, wb, lo as u64, words, expect));
                }
            }
            let far = 5u64 << 32;
            let words = &data[..16 * wb];
            let expect = (0..16).fold(0u64, |a, k| {
                a.wrapping_add(seed.hash(far + k as u64, read_word(words, wb, k)))
            });
            cases.push((seed, wb, far, words, expect));
        }
        for &(seed, wb, first, words, expect) in &cases {
            let got = words_sum(Platform::portable(), seed, wb, words, first);
            assert_eq!(got, expect, "portable, {wb} B from {first}");
        }
        if !crate::platform::expect::require(Level::Avx512, "vector_and_scalar_full_passes_agree") {
            return;
        }
        for &(seed, wb, first, words, expect) in &cases {
            let got = words_sum(Platform::cpu(), seed, wb, words, first);
            assert_eq!(got, expect, "AVX-512, {wb} B from {first}");
        }
    }

    #[test]
    fn value_table_matches_the_definition() {
        for w in [0u64, 1, 0xffff, 0x1_0000, u64::MAX] {
            assert_eq!(value_hash(w), fmix64(w ^ VALUE_KEY));
        }
    }

    #[test]
    fn hex_round_trip() {
        let d = Digest(0x0123_4567_89ab_cdef);
        assert_eq!(d.to_string(), "0123456789abcdef");
        assert_eq!(Digest::parse(&d.to_string()), Some(d));
        assert_eq!(Digest::parse("xyz"), None);
        assert_eq!(Digest::parse("+123456789abcdef"), None);
    }
}
