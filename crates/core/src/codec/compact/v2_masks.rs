//! The `compact2` block encoder for 2-byte words on AVX-512 (VBMI2 and
//! VPOPCNTDQ), with the context as bit masks and each class as a compact
//! list.
//!
//! `v2`'s staged encoder walks the sorted members beside the changes and
//! stages each change (index, gap, step: 20 bytes) in its class's arrays.
//! This one:
//!
//! - scans a region of 2,048 words as `compact`'s fused encoder does: the
//!   changed words are compressed into records (block index, old word, new
//!   word);
//! - makes the context's members of the region three masks per 32 words
//!   (class 1, class 2, last sign); held in registers with each class's
//!   rank at the start of every 32 words (prefix sums of their popcounts),
//!   they give sixteen changes' classes, ranks and last signs at once
//!   (permutes, shifts and popcounts, no branch);
//! - in the same pass over the records, sixteen at a time, computes the
//!   digest change and the next context's members, and compresses, per
//!   class, the changes' positions or ranks tagged with their sign bit and
//!   whether they are escapes (4 bytes) into the class's list, and the
//!   escapes' magnitudes (2 bytes) into its escape list;
//! - prefetches the next region while it works on this one's changes (a
//!   region is one 4 KiB page of each buffer, where the hardware's
//!   prefetcher stops);
//! - chooses each class's parameters from counts (the staged encoder's
//!   sums, in closed form; the Rice parameter among the guess and its two
//!   neighbours by one vectorized pass over the list), and writes each
//!   region from the lists, eight entries per vector merged into fewer
//!   appends, with the writer's state in registers.
//!
//! The bytes are those of `v2::encode`, which the tests check on every kind
//! of block; a block whose values cost less raw is handed back to it.

// The encoder is AVX-512 code: on other CPUs only its entry points are
// used (`scan_block` never scans there and `encode_scanned` hands every
// block back), and the rest is compiled but unused.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m256i, __m512i, _mm512_add_epi32, _mm512_add_epi64, _mm512_castsi512_si256,
    _mm512_cvtepu16_epi32, _mm512_cvtepu16_epi64, _mm512_loadu_si512, _mm512_or_si512,
    _mm512_reduce_add_epi64, _mm512_set1_epi32, _mm512_set1_epi64, _mm512_setzero_si512,
    _mm512_slli_epi32, _mm512_storeu_si512,
};

use super::MAX_POS_K;
use super::v2_head::{
    CLASSES, ClassHead, Escapes, assemble, best_of_three, choose_values, eg_code, put_eg,
    rice_guess_k,
};
use crate::codec::bits::{FastWriter, put_rice, rice_code};
use crate::format::{BlockEntry, ValueCoding};

// Regions of the fused scan (2,048 words): a region's records and the
// context's tables stay in L1.
use super::vector::{REGION, Records};
/// Slack past a class list's or the next context's entries for full-vector
/// stores.
const SLACK: usize = 64;

/// An entry's sign bit, in its word of a class list.
const SIGN_BIT: u32 = 1 << 31;
/// An entry that is an escape (`|step| ≥ 2`), in its word of a class list.
const BIG_BIT: u32 = 1 << 30;
/// An entry's position or rank, in its word of a class list (a block has at
/// most 2^30 words, `scan_block`).
const AT_MASK: u32 = BIG_BIT - 1;

/// One class's entries: each a word of its position (class 0) or rank, its
/// sign bit ([`SIGN_BIT`]) and whether it is an escape ([`BIG_BIT`]); and
/// the escapes' magnitudes. One list and one compress per class and per
/// sixteen changes where separate lists of signs and of the escapes' entry
/// ranks took three more: the writer finds those ranks from the bits.
#[derive(Default)]
pub(crate) struct ClassList {
    pub(crate) at: Vec<u32>,
    pub(crate) n: usize,
    /// The escapes' `|step| − 2` (`esc_n` of them), in entry order.
    pub(crate) esc_mag: Vec<u16>,
    pub(crate) esc_n: usize,
}

impl ClassList {
    fn clear(&mut self) {
        self.n = 0;
        self.esc_n = 0;
    }

    /// Room for `more` entries and escapes past `n` and `esc_n` (the class
    /// loop writes in place).
    fn room(&mut self, more: usize) {
        let want = self.n + more;
        if self.at.len() < want {
            let len = want.max(2 * self.at.len());
            self.at.resize(len, 0);
        }
        let want = self.esc_n + more;
        if self.esc_mag.len() < want {
            let len = want.max(2 * self.esc_mag.len());
            self.esc_mag.resize(len, 0);
        }
    }

    /// The entries, tagged ([`SIGN_BIT`], [`BIG_BIT`]).
    fn entries(&self) -> &[u32] {
        &self.at[..self.n]
    }
}

/// A class list's buffers as raw pointers and its counts, for
/// [`classify`]'s loop: it writes at most the room [`ClassList::room`] made.
#[cfg(target_arch = "x86_64")]
struct Out {
    at: *mut u32,
    esc_mag: *mut u16,
    n: usize,
    esc_n: usize,
}

#[cfg(target_arch = "x86_64")]
impl Out {
    fn of(c: &mut ClassList) -> Out {
        Out {
            at: c.at.as_mut_ptr(),
            esc_mag: c.esc_mag.as_mut_ptr(),
            n: c.n,
            esc_n: c.esc_n,
        }
    }
}

/// Shows that the CPU has the features [`scan_block`] checks: made only
/// there, it lets [`encode_scanned`] run code compiled with BMI2.
#[derive(Clone, Copy)]
pub(crate) struct Scanned(());

/// Per-thread scratch of the encoder.
#[derive(Default)]
pub(crate) struct MaskScratch {
    pub(crate) class: [ClassList; CLASSES],
    /// The block's members for the next context (full-vector stores write
    /// past its length, into its capacity). Taken whole by the encoder as
    /// the block's list of the next context, and replaced by one from the
    /// context [`pool`](super::context::pool).
    pub(crate) next: Vec<u32>,
    /// Each class's region as written (kept between blocks: their room is
    /// made, and zeroed, once).
    regions: [Vec<u8>; CLASSES],
    /// A class's set signs' entry ranks, where they are coded as a list.
    list: Vec<u32>,
}

/// The context's members of one region: bit masks per 32 words (class 1,
/// class 2, the last step's sign).
struct Tables {
    m1: [u32; WORDS32],
    m2: [u32; WORDS32],
    p: [u32; WORDS32],
    /// Each word's member as a byte (`4 | neg << 1 | big`, 0 where none),
    /// zero between regions: one store per member, made into the masks 64
    /// words per vector.
    codes: [u8; REGION],
}

/// Cache lines of the next region fetched right after a region's scan, and
/// per sixteen of its changes classified (tuned on the bench's 2.8%
/// density; 16–64 and 2–16 measure alike).
#[cfg(target_arch = "x86_64")]
const AHEAD_BURST: usize = 24;
/// Changes in a region from which the next one is prefetched (one word in
/// 16). Below, the region's work is short and the software prefetches only
/// compete with the scan's own loads, which the hardware streams: on a host
/// with 13 GB/s to one core they made the encoder 1.4x slower at 0.46% and
/// 2.8% density and 3–6% faster at 8.4% and 26% (docs/benchmarks.md,
/// sixteenth round).
#[cfg(target_arch = "x86_64")]
const AHEAD_FROM: usize = REGION / 16;
#[cfg(target_arch = "x86_64")]
const AHEAD_PER_16: usize = 8;

/// Prefetches the next region's words, a cache line at a time, while the
/// current one's changes are worked on. A region is a 4 KiB page of each
/// buffer, where the hardware's prefetcher stops: without this, each
/// region's scan waits on memory while the changes' work leaves it idle.
#[cfg(target_arch = "x86_64")]
struct Ahead<'a> {
    base: &'a [u8],
    new: &'a [u8],
    /// Twice the byte offset of the next line to fetch; bit 6 picks `new`.
    at: usize,
    end: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ahead<'_> {
    /// Starts on the region whose first word is `word`; with `on` false,
    /// fetches nothing until the next start.
    fn start(&mut self, word: usize, on: bool) {
        self.at = 4 * word;
        self.end = if on {
            2 * (2 * word + 2 * REGION).min(self.base.len())
        } else {
            0
        };
    }

    /// Prefetches the next line, if any.
    #[inline(always)]
    fn pump(&mut self) {
        if self.at < self.end {
            let src = if self.at & 64 == 0 {
                self.base
            } else {
                self.new
            };
            let off = (self.at / 2) & !63;
            // SAFETY: `off` < `src.len()` (`at < end`); a prefetch neither
            // faults nor changes memory.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    src.as_ptr().add(off).cast(),
                )
            };
            self.at += 64;
        }
    }
}

/// 32-word groups of a region: its masks' words.
const WORDS32: usize = REGION / 32;

/// Encodes one block (`base` → `new`, 2-byte words, block index 0 at
/// `ctx.first`) against its context `members` into `s` when `platform` has
/// [`crate::platform::Level::Avx512Vbmi2`]: the class lists and the next
/// context; returns the digest change, the block's changes and the next
/// context's [`super::context::block_checksum`] (`check` is the block's
/// `seed ^ block << 32`). `None` elsewhere.
pub(crate) fn scan_block(
    platform: crate::platform::Platform,
    ctx: super::Ctx,
    (base, new): (&[u8], &[u8]),
    (members, check): (&[super::context::Member], u64),
    s: &mut MaskScratch,
) -> Option<(u64, u64, u64, Scanned)> {
    #[cfg(target_arch = "x86_64")]
    if let (true, true, Some(proof)) = (
        platform.has(crate::platform::Level::Avx512Vbmi2),
        std::arch::is_x86_feature_detected!("avx512vpopcntdq")
            && std::arch::is_x86_feature_detected!("avx512vl"),
        platform.avx512(),
    ) {
        // SAFETY: `platform.has(Level::Avx512Vbmi2)` and the two checks
        // beside it: the CPU has every feature `scan_block_w2` is compiled
        // with (BMI2 and POPCNT are part of the AVX2 level below VBMI2,
        // VPOPCNTDQ and VL were checked just above); it is otherwise safe
        // code whose loads and stores are bounds-checked or justified where
        // they are made.
        // Its output equals the staged encoder's:
        // `masks_and_staged_encoders_agree`, `random_blocks_agree`.
        let (digest, changes, sum) =
            unsafe { scan_block_w2(proof, ctx, (base, new), (members, check), s) };
        return Some((digest, changes, sum, Scanned(())));
    }
    let _ = (platform, ctx, base, new, members, check, s);
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(
    enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512vbmi2,avx512vpopcntdq,avx2,bmi1,bmi2,lzcnt,popcnt"
)]
fn scan_block_w2(
    proof: crate::platform::HasAvx512,
    ctx: super::Ctx,
    (base, new): (&[u8], &[u8]),
    (members, check): (&[super::context::Member], u64),
    s: &mut MaskScratch,
) -> (u64, u64, u64) {
    assert_eq!(base.len(), new.len(), "encoded buffers differ in length");
    assert!(base.len().is_multiple_of(2), "odd length for 2-byte words");
    assert!(base.len() / 2 <= 1 << 30, "block too long");
    for c in &mut s.class {
        c.clear();
    }
    s.next.clear();
    // Room for as many members as the block had and a quarter more (the
    // next context's list is usually about as long), or for a change in 16
    // words without a context.
    let want = (members.len() + members.len() / 4).max(base.len() / 32) + SLACK;
    if s.next.capacity() < want {
        s.next = super::context::pool::take(want);
    }
    let sm = ctx.kind == crate::dtype::KeyKind::SignMagnitude;
    let mut rec = Box::new(Records {
        index: [0; REGION + 8 + 32],
        old: [0; REGION + 8 + 32],
        new: [0; REGION + 8 + 32],
    });
    let mut tab = Box::new(Tables {
        m1: [0; WORDS32],
        m2: [0; WORDS32],
        p: [0; WORDS32],
        codes: [0; REGION],
    });
    // The digest change and the next context's checksum, eight lanes each.
    let mut sums = [_mm512_setzero_si512(); 2];
    let check = _mm512_set1_epi64(check as i64);
    let mut p = 0usize;
    let mut changes = 0u64;
    // Each class's members before the region.
    let mut ranks = [0u32; 2];
    let mut ahead = Ahead {
        base,
        new,
        at: 0,
        end: 0,
    };
    for (r, (pa, pb)) in base
        .chunks(2 * REGION)
        .zip(new.chunks(2 * REGION))
        .enumerate()
    {
        let first = r * REGION;
        let len = pa.len() / 2;
        // The context's masks of the region: each member's code byte stored
        // (no chain through memory from one member to the next), then the
        // codes made into masks 64 words at a time.
        let end = (first + len) as u32;
        let start = p;
        p += store_codes(
            &members[p..],
            (first as u32, end),
            &mut tab.codes,
            &mut ahead,
        );
        if p == start {
            tab.m1 = [0; WORDS32];
            tab.m2 = [0; WORDS32];
            tab.p = [0; WORDS32];
        } else {
            masks_of_codes(&mut tab);
        }
        let n = super::vector::scan_region(pa, pb, first as u32, &mut rec, 0);
        // After a busy region (`AHEAD_FROM`), the next region's words start
        // coming in while this one's changes are worked on: a burst now,
        // then a line per member of the next region's context and eight per
        // sixteen changes here.
        ahead.start(first + len, n >= AHEAD_FROM);
        for _ in 0..AHEAD_BURST {
            ahead.pump();
        }
        changes += n as u64;
        classify(
            proof,
            (sm, ctx.seed.0, ctx.first, check),
            (first as u32, n),
            (&rec, &tab),
            &mut ranks,
            (s, &mut sums),
            &mut ahead,
        );
    }
    let [digest, sum] = sums;
    (
        _mm512_reduce_add_epi64(digest) as u64,
        changes,
        _mm512_reduce_add_epi64(sum) as u64,
    )
}

/// Members ahead of the one coded whose cache line is fetched (2 KiB: the
/// context comes from memory, and the hardware's prefetcher stops at each
/// 4 KiB page).
#[cfg(target_arch = "x86_64")]
const MEMBERS_AHEAD: usize = 512;

/// Stores the code byte (`4 | neg << 1 | big`) of each of the ascending
/// `members` below block index `end` at its word's offset from `first` in
/// `codes`, and returns how many it stored. Four at a time where the
/// fourth is below `end` (so the others are), with a line of the next
/// region fetched per four.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn store_codes(
    members: &[super::context::Member],
    (first, end): (u32, u32),
    codes: &mut [u8; REGION],
    ahead: &mut Ahead,
) -> usize {
    use super::context::{BIG, NEG, index};
    let mut put = |m: super::context::Member| {
        codes[(index(m) - first) as usize] = 4 | (m & (BIG | NEG)) as u8;
    };
    let mut p = 0;
    while p + 4 <= members.len() && index(members[p + 3]) < end {
        crate::platform::prefetch(members, p + MEMBERS_AHEAD);
        for &m in &members[p..p + 4] {
            put(m);
        }
        ahead.pump();
        p += 4;
    }
    while p < members.len() && index(members[p]) < end {
        put(members[p]);
        p += 1;
    }
    p
}

/// Makes the region's code bytes into its masks (class 1: a code without
/// `big`; class 2: with it; last sign: `neg`), 64 words per vector, and
/// zeroes the codes for the next region.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn masks_of_codes(tab: &mut Tables) {
    use super::context::{BIG, NEG};
    use std::arch::x86_64::{_mm512_set1_epi8, _mm512_test_epi8_mask};
    let (big, neg) = (_mm512_set1_epi8(BIG as i8), _mm512_set1_epi8(NEG as i8));
    for q in 0..REGION / 64 {
        let at = &mut tab.codes[64 * q..64 * q + 64];
        // SAFETY: `at` is 64 bytes: the load and the store cover exactly it.
        let v = unsafe { _mm512_loadu_si512(at.as_ptr().cast()) };
        unsafe { _mm512_storeu_si512(at.as_mut_ptr().cast(), _mm512_setzero_si512()) };
        let any = _mm512_test_epi8_mask(v, v);
        let b = _mm512_test_epi8_mask(v, big);
        let s = _mm512_test_epi8_mask(v, neg);
        for (t, x) in [(&mut tab.m1, any & !b), (&mut tab.m2, b), (&mut tab.p, s)] {
            t[2 * q] = x as u32;
            t[2 * q + 1] = (x >> 32) as u32;
        }
    }
}

/// Puts each of a region's `n` records in its class's lists (block index
/// of the region's first word: `first`), sixteen at a time, and returns
/// their digest change (eight lanes); appends their members to the next
/// context (`s.next`).
///
/// Each change's class, rank and last sign come from the region's masks,
/// looked up by permutes of the tables held in registers; the ranks at each
/// 32 words' first are prefix sums of the masks' popcounts from `ranks`
/// (each class's members before the region, advanced past it on return).
/// Each class's positions or ranks, tagged with their signs and escape
/// bits, are compressed into its list, and its escapes' magnitudes into
/// another.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(
    enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512vbmi2,avx512vpopcntdq,avx2,bmi1,bmi2,lzcnt,popcnt"
)]
fn classify(
    proof: crate::platform::HasAvx512,
    (sm, seed, block_first, check): (bool, u64, u64, __m512i),
    (first, n): (u32, usize),
    (rec, tab): (&Records, &Tables),
    ranks: &mut [u32; 2],
    (s, sums): (&mut MaskScratch, &mut [__m512i; 2]),
    ahead: &mut Ahead,
) {
    use std::arch::x86_64::{
        _mm256_castsi256_si128, _mm256_extracti128_si256, _mm256_maskz_compress_epi16,
        _mm256_maskz_loadu_epi16, _mm256_storeu_si256, _mm512_abs_epi32, _mm512_alignr_epi32,
        _mm512_and_si512, _mm512_andnot_si512, _mm512_cmpeq_epi32_mask, _mm512_cmpneq_epi32_mask,
        _mm512_cvtepi32_epi16, _mm512_cvtepu32_epi64, _mm512_cvtsi512_si32,
        _mm512_extracti64x4_epi64, _mm512_mask_blend_epi32, _mm512_mask_mov_epi32,
        _mm512_maskz_compress_epi32, _mm512_maskz_mov_epi32, _mm512_maskz_mov_epi64,
        _mm512_permutex2var_epi32, _mm512_permutexvar_epi32, _mm512_popcnt_epi32,
        _mm512_sllv_epi32, _mm512_srai_epi32, _mm512_srli_epi32, _mm512_srlv_epi32,
        _mm512_sub_epi32, _mm512_test_epi32_mask, _mm512_xor_si512,
    };
    let class = &mut s.class;
    for c in class.iter_mut() {
        c.room(n + 16);
    }
    // (`reserve` keeps the members, and grows at least twofold.)
    s.next.reserve(n + SLACK);
    let next_n = s.next.len();
    let set1 = _mm512_set1_epi32;
    let zero = _mm512_setzero_si512();
    let table = |a: &[u32; WORDS32]| -> [__m512i; 4] {
        // SAFETY: `a` holds 64 words: each load reads 16 of them in bounds.
        std::array::from_fn(|q| unsafe {
            _mm512_loadu_si512(a[16 * q..16 * q + 16].as_ptr().cast())
        })
    };
    // Each class's rank at each 32 words' first: the exclusive prefix sums
    // of the masks' popcounts, from the members before the region.
    let prefix = |t: &[__m512i; 4], rank: &mut u32| -> [__m512i; 4] {
        let mut carry = set1(*rank as i32);
        let r = std::array::from_fn(|q| {
            let c = _mm512_popcnt_epi32(t[q]);
            let mut x = _mm512_add_epi32(c, _mm512_alignr_epi32::<15>(c, zero));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32::<14>(x, zero));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32::<12>(x, zero));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32::<8>(x, zero));
            let at = _mm512_add_epi32(carry, _mm512_sub_epi32(x, c));
            carry = _mm512_add_epi32(carry, _mm512_permutexvar_epi32(set1(15), x));
            at
        });
        *rank = _mm512_cvtsi512_si32(carry) as u32;
        r
    };
    let (t1, t2, tp) = (table(&tab.m1), table(&tab.m2), table(&tab.p));
    let [rank1, rank2] = ranks;
    let (tr1, tr2) = (prefix(&t1, rank1), prefix(&t2, rank2));
    let (one, ones, low) = (set1(1), set1(-1), set1(0xffff));
    let key32 = |x: __m512i| -> __m512i {
        if sm {
            // x ^ (0x8000 | (0x7fff if negative)).
            let neg = _mm512_sub_epi32(zero, _mm512_srli_epi32::<15>(x));
            _mm512_xor_si512(
                x,
                _mm512_or_si512(set1(0x8000), _mm512_and_si512(neg, set1(0x7fff))),
            )
        } else {
            x
        }
    };
    let bf = _mm512_set1_epi64(block_first as i64);
    let [mut digest, mut sum] = *sums;
    // Each class's lists as raw ends and counts, and the next context's
    // end, held in locals for the region: through `s`, every store could
    // alias the lists' pointers and counts, which were loaded back and
    // bounds-checked per class and per sixteen changes.
    let mut out = class.each_mut().map(Out::of);
    let next_at = s.next.as_mut_ptr();
    // The prefetcher's state likewise (its pumps are 8 per sixteen changes,
    // each a compare when it is off).
    let mut pump = Ahead {
        base: ahead.base,
        new: ahead.new,
        at: ahead.at,
        end: ahead.end,
    };
    let mut j = 0usize;
    while j < n {
        let valid: u16 = if n - j >= 16 {
            u16::MAX
        } else {
            (1u16 << (n - j)) - 1
        };
        // SAFETY: the arrays hold `REGION + 40` words and `j < n ≤
        // REGION`: the 16 entries at `j` are in bounds. Index lanes past `n`
        // are scratch, masked off by `valid`; the old and new words there
        // load as 0 (no digest change).
        let (i, a16, b16) = unsafe {
            (
                _mm512_loadu_si512(rec.index[j..j + 16].as_ptr().cast()),
                _mm256_maskz_loadu_epi16(valid, rec.old[j..j + 16].as_ptr().cast()),
                _mm256_maskz_loadu_epi16(valid, rec.new[j..j + 16].as_ptr().cast()),
            )
        };
        let (a, b) = (_mm512_cvtepu16_epi32(a16), _mm512_cvtepu16_epi32(b16));
        // The digest, eight lanes at a time.
        let idx =
            |h: __m512i| _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(h)), bf);
        let w64 = |x: __m256i| {
            (
                _mm512_cvtepu16_epi64(_mm256_castsi256_si128(x)),
                _mm512_cvtepu16_epi64(_mm256_extracti128_si256::<1>(x)),
            )
        };
        let ((a_lo, a_hi), (b_lo, b_hi)) = (w64(a16), w64(b16));
        digest = _mm512_add_epi64(
            digest,
            crate::digest::change_x8(proof, seed, idx(i), a_lo, b_lo),
        );
        if valid >> 8 != 0 {
            let i_hi = _mm512_alignr_epi32::<8>(zero, i);
            digest = _mm512_add_epi64(
                digest,
                crate::digest::change_x8(proof, seed, idx(i_hi), a_hi, b_hi),
            );
        }
        let step = _mm512_and_si512(_mm512_sub_epi32(key32(b), key32(a)), low);
        let big = _mm512_cmpneq_epi32_mask(step, one) & _mm512_cmpneq_epi32_mask(step, low) & valid;
        // The next context's members: index << 2 | neg << 1 | big.
        let member = _mm512_or_si512(
            _mm512_or_si512(
                _mm512_slli_epi32::<2>(i),
                _mm512_slli_epi32::<1>(_mm512_srli_epi32::<15>(step)),
            ),
            _mm512_maskz_mov_epi32(big, one),
        );
        let k = next_n + j;
        // SAFETY: `s.next` has capacity for `n + SLACK` members past its
        // length `next_n` (reserved above), and `j < n`: the 16 at `k` lie
        // within its allocation. They are written, not read; the length is
        // set past them only once the region's members are all written
        // (below).
        unsafe { _mm512_storeu_si512(next_at.add(k).cast(), member) };
        // Their checksum, while they are in a register.
        use super::context::hash8;
        let (lo, hi) = (
            hash8(check, _mm512_castsi512_si256(member)),
            hash8(check, _mm512_extracti64x4_epi64::<1>(member)),
        );
        sum = _mm512_add_epi64(sum, _mm512_maskz_mov_epi64(valid as u8, lo));
        sum = _mm512_add_epi64(sum, _mm512_maskz_mov_epi64((valid >> 8) as u8, hi));
        let off = _mm512_sub_epi32(i, set1(first as i32));
        let w = _mm512_srli_epi32::<5>(off);
        let bit = _mm512_and_si512(off, set1(31));
        let upper = _mm512_test_epi32_mask(w, set1(32));
        let look = |t: &[__m512i; 4]| {
            _mm512_mask_blend_epi32(
                upper,
                _mm512_permutex2var_epi32(t[0], w, t[1]),
                _mm512_permutex2var_epi32(t[2], w, t[3]),
            )
        };
        let (m1, m2) = (look(&t1), look(&t2));
        let is1 = valid & _mm512_test_epi32_mask(_mm512_srlv_epi32(m1, bit), one);
        let is2 = valid & _mm512_test_epi32_mask(_mm512_srlv_epi32(m2, bit), one);
        let last = _mm512_and_si512(_mm512_srlv_epi32(look(&tp), bit), one);
        let below = _mm512_sllv_epi32(ones, bit);
        let r1 = _mm512_add_epi32(
            look(&tr1),
            _mm512_popcnt_epi32(_mm512_andnot_si512(below, m1)),
        );
        let r2 = _mm512_add_epi32(
            look(&tr2),
            _mm512_popcnt_epi32(_mm512_andnot_si512(below, m2)),
        );
        let at = _mm512_mask_mov_epi32(_mm512_mask_mov_epi32(i, is1, r1), is2, r2);
        // A class-1 or 2 entry's sign is whether the step goes the other way
        // than the member's last; a step of 2^15 is its own negation, and
        // the staged encoder writes the top bit of the step negated: 1.
        let half = _mm512_cmpeq_epi32_mask(step, set1(0x8000));
        let sign = _mm512_xor_si512(
            _mm512_srli_epi32::<15>(step),
            _mm512_maskz_mov_epi32(!half, last),
        );
        let k0 = valid & !is1 & !is2;
        // Each change's word for its class's list: position or rank, sign
        // bit and whether it is an escape.
        let tagged = _mm512_or_si512(
            _mm512_or_si512(at, _mm512_slli_epi32::<31>(sign)),
            _mm512_maskz_mov_epi32(big, set1(BIG_BIT as i32)),
        );
        // An escape's `|step| − 2` (a step of 2^15 is 2^15 from either side).
        let mag = _mm512_cvtepi32_epi16(_mm512_sub_epi32(
            _mm512_abs_epi32(_mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(step))),
            set1(2),
        ));
        for (c, k) in out.iter_mut().zip([k0, is1, is2]) {
            let at_c = _mm512_maskz_compress_epi32(k, tagged);
            let e = k & big;
            let mag_c = _mm256_maskz_compress_epi16(e, mag);
            // SAFETY: `room(n + 16)` left 16 entries and escapes past any
            // count this region reaches (`Out::of`: the pointers are the
            // lists' starts, the counts theirs); each store writes 16 of
            // them there (64 and 32 bytes).
            unsafe {
                _mm512_storeu_si512(c.at.add(c.n).cast(), at_c);
                _mm256_storeu_si256(c.esc_mag.add(c.esc_n).cast(), mag_c);
            }
            c.n += k.count_ones() as usize;
            c.esc_n += e.count_ones() as usize;
        }
        if pump.at < pump.end {
            for _ in 0..AHEAD_PER_16 {
                pump.pump();
            }
        }
        j += 16;
    }
    for (c, o) in class.iter_mut().zip(out) {
        (c.n, c.esc_n) = (o.n, o.esc_n);
    }
    ahead.at = pump.at;
    // SAFETY: the capacity is at least `next_n + n` (reserved above), and
    // the loop stored 16 members at `next_n + j` for `j = 0, 16, …` while
    // `j < n`: every member below `next_n + n` is written.
    unsafe { s.next.set_len(next_n + n) };
    *sums = [digest, sum];
}

/// Bits of the Rice codes of the gaps of the ascending `at` with
/// parameters `k − 1`, `k` and `k + 1`, in one pass (vectorized by the
/// compiler). The gaps of an ascending list sum to less than its last
/// entry, below 2^30 (a block's length): the sums fit 32 bits.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,bmi1,bmi2"))]
fn rice_costs(at: &[u32], k: u32) -> [u64; 3] {
    let km = k.saturating_sub(1);
    let Some(&g0) = at.first() else {
        return [0; 3];
    };
    let g0 = g0 & AT_MASK;
    let (mut lo, mut mid, mut hi) = (g0 >> km, g0 >> k, g0 >> (k + 1));
    for (&a, &b) in at[1..].iter().zip(at) {
        let g = (a & AT_MASK).wrapping_sub(b & AT_MASK).wrapping_sub(1);
        lo = lo.wrapping_add(g >> km);
        mid = mid.wrapping_add(g >> k);
        hi = hi.wrapping_add(g >> (k + 1));
    }
    let n = at.len() as u64;
    [
        lo as u64 + n * (km as u64 + 1),
        mid as u64 + n * (k as u64 + 1),
        hi as u64 + n * (k as u64 + 2),
    ]
}

/// For [`SIGN_BIT`] and [`BIG_BIT`]: how many of the tagged entries `at`
/// have it, and their gap sum as an ascending list of entry ranks (the last
/// one's rank + 1 − the count). Counts sixteen entries per step in vector
/// lanes, and finds the last ones by a search from the end.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn tag_counts(at: &[u32]) -> [(u64, u64); 2] {
    use std::arch::x86_64::{
        _mm512_and_si512, _mm512_maskz_loadu_epi32, _mm512_reduce_add_epi32, _mm512_srli_epi32,
    };
    let one = _mm512_set1_epi32(1);
    let (mut sign, mut big) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for q in (0..at.len()).step_by(16) {
        let valid = (u32::from(u16::MAX) >> (16 - (at.len() - q).min(16))) as u16;
        // SAFETY: the lanes of `valid` are entries below `at.len()`, in
        // bounds; the others are not read (and are 0).
        let x = unsafe { _mm512_maskz_loadu_epi32(valid, at[q..].as_ptr().cast()) };
        // Lane sums below 2^30 (a class has fewer entries than its block
        // has words).
        sign = _mm512_add_epi32(sign, _mm512_srli_epi32::<31>(x));
        big = _mm512_add_epi32(big, _mm512_and_si512(_mm512_srli_epi32::<30>(x), one));
    }
    let t = [sign, big].map(|v| _mm512_reduce_add_epi32(v) as u32 as u64);
    [(0, SIGN_BIT), (1, BIG_BIT)].map(|(c, bit)| match at.iter().rposition(|&a| a & bit != 0) {
        Some(j) => (t[c], j as u64 + 1 - t[c]),
        None => (0, 0),
    })
}

/// A class's head (without its region's length), the bits its values cost
/// beyond the positions (step-coded, and raw) and the bits of its
/// positions' Rice codes.
#[cfg(target_arch = "x86_64")]
fn choose(c: &ClassList, _: Scanned) -> (ClassHead, u64, u64, u64) {
    let n = c.n as u64;
    let mut h = ClassHead {
        n,
        ..ClassHead::default()
    };
    if n == 0 {
        return (h, 0, 0, 0);
    }
    let at = c.entries();
    let end = (at[c.n - 1] & AT_MASK) as u64 + 1;
    let k = rice_guess_k(n, end - n).min(MAX_POS_K as u32 - 1);
    // The staged encoder's choice (`best_of_three`).
    // SAFETY: a `Scanned` exists only where `scan_block` found AVX2, BMI1
    // and BMI2 (and more), every feature `rice_costs` is compiled with; it
    // is otherwise safe code.
    let costs = unsafe { rice_costs(at, k) };
    let pos_bits;
    (h.k, pos_bits) = best_of_three(k, costs);
    // SAFETY: as for `rice_costs` (AVX-512 F, POPCNT and LZCNT are among
    // the features `scan_block` found).
    let [(t, set_sum), escapes] = unsafe { tag_counts(at) };
    let mut esc = Escapes::default();
    (esc.n, esc.gap_sum) = escapes;
    debug_assert_eq!(esc.n, c.esc_n as u64);
    esc.add_all(&c.esc_mag[..c.esc_n]);
    let step_bits = choose_values(&mut h, &esc, (t, set_sum));
    (h, step_bits, n * 16, pos_bits)
}

/// Writes the gaps of the ascending `at` (tagged entries, or plain ranks
/// below 2^30) with Rice parameter `k`, each code followed by the entry's
/// sign bit ([`SIGN_BIT`]) where `signed`: the codes are
/// `put_rice`'s, and take `bits` (without the signs). Eight entries at a
/// time are coded in a vector and merged into fewer appends. A code is
/// about `k + 2` bits (plus the sign): the merging is fixed for the class
/// (pairs, fours or eights: `entries_by`), and a group with a longer code
/// takes `vector::merge8`'s choice, or the general path past 56 bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,bmi1,bmi2,lzcnt,popcnt")]
fn entries(w: &mut FastWriter, (at, signed): (&[u32], bool), (k, bits): (u32, u64)) {
    // Room for a quotient up to 2 in each merged code.
    match k + u32::from(signed) + 3 {
        0..=7 => entries_by::<8>(w, (at, signed), (k, bits)),
        8..=14 => entries_by::<4>(w, (at, signed), (k, bits)),
        15..=28 => entries_by::<2>(w, (at, signed), (k, bits)),
        _ => entries_by::<1>(w, (at, signed), (k, bits)),
    }
}

/// [`entries`], merging `STEP` entries per append where each code has at
/// most 56 / `STEP` bits (`STEP` = 1: `vector::merge8`'s choice).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,bmi1,bmi2,lzcnt,popcnt")]
fn entries_by<const STEP: usize>(
    w: &mut FastWriter,
    (at, signed): (&[u32], bool),
    (k, bits): (u32, u64),
) {
    use std::arch::x86_64::{
        _mm_cvtsi64_si128, _mm256_loadu_si256, _mm512_alignr_epi64, _mm512_and_si512,
        _mm512_cmpgt_epu64_mask, _mm512_cvtepu32_epi64, _mm512_sllv_epi64, _mm512_srl_epi64,
        _mm512_srli_epi64, _mm512_sub_epi64,
    };
    let extra = u32::from(signed);
    let low = (1u64 << k) - 1;
    let (buf, wpos, wacc, wn) = w.parts();
    let (mut pos, mut acc, mut n) = (*wpos, *wacc, *wn);
    // The codes take `bits` (their Rice codes, `rice_costs`'s count for
    // `k`) and a sign bit each where signed; each append stores 8 bytes at
    // the position it starts from.
    let need = pos + (bits + u64::from(extra) * at.len() as u64).div_ceil(8) as usize + 16;
    if buf.len() < need {
        buf.resize(need.max(2 * buf.len()), 0);
    }
    // Appends `bits` ≤ 56 bits (`v` has no higher bits).
    macro_rules! put {
        ($v:expr, $bits:expr) => {{
            acc |= ($v) << n;
            n += $bits;
            buf[pos..pos + 8].copy_from_slice(&acc.to_le_bytes());
            let whole = n >> 3;
            pos += whole as usize;
            acc >>= whole * 8;
            n &= 7;
        }};
    }
    // One tagged entry `a`, its gap counted from `next`.
    macro_rules! one {
        ($a:expr, $next:expr) => {{
            let g = ($a & AT_MASK) as u64 - $next;
            let tail = (($a >> 31) as u64) & extra as u64;
            if let Some((code, len)) = rice_code(g, k, 56 - extra) {
                put!(code | (tail << len), len + extra);
            } else {
                // A long gap (rare): the unary part 48 zeros at a time (its
                // bits are in `bits`, so the room is there).
                let mut z = g >> k;
                while z >= 48 {
                    put!(0u64, 48);
                    z -= 48;
                }
                put!(1u64 << z, z as u32 + 1);
                if k > 0 {
                    put!(g & low, k);
                }
                put!(tail, extra);
            }
        }};
    }
    let set1 = |x: u64| _mm512_set1_epi64(x as i64);
    let (ones, low_v, k1, extra_v) = (set1(1), set1(low), set1(k as u64 + 1), set1(extra as u64));
    let at_mask = set1(AT_MASK as u64);
    let kx = _mm_cvtsi64_si128(k as i64);
    let mut next = 0u64;
    let mut j = 0usize;
    while j + 8 <= at.len() {
        let a8 = &at[j..j + 8];
        // SAFETY: `a8` holds 8 u32 (32 bytes): the load reads exactly them.
        let tagged = unsafe { _mm512_cvtepu32_epi64(_mm256_loadu_si256(a8.as_ptr().cast())) };
        let (a, s) = (
            _mm512_and_si512(tagged, at_mask),
            _mm512_srli_epi64::<31>(tagged),
        );
        // Gap: at − (previous at + 1), the first lane's counted from `next`.
        let prev = _mm512_alignr_epi64::<7>(_mm512_add_epi64(a, ones), set1(next));
        let g = _mm512_sub_epi64(a, prev);
        let q = _mm512_srl_epi64(g, kx);
        let len = _mm512_add_epi64(q, k1);
        let code = _mm512_or_si512(
            _mm512_or_si512(
                _mm512_sllv_epi64(ones, q),
                _mm512_sllv_epi64(_mm512_and_si512(g, low_v), _mm512_add_epi64(q, ones)),
            ),
            _mm512_sllv_epi64(_mm512_and_si512(s, extra_v), len),
        );
        let total = _mm512_add_epi64(len, extra_v);
        // A lane with q ≥ 64, whose shifts gave 0, is longer than 56 too.
        if STEP > 1 && _mm512_cmpgt_epu64_mask(total, set1((56 / STEP) as u64)) == 0 {
            let (cs, ls) = super::vector::merge_by::<STEP>(code, total);
            for l in (0..8).step_by(STEP) {
                put!(cs[l], ls[l] as u32);
            }
        } else if _mm512_cmpgt_epu64_mask(total, set1(56)) == 0 {
            let (cs, ls, step) = super::vector::merge8(code, total);
            for l in (0..8).step_by(step) {
                put!(cs[l], ls[l] as u32);
            }
        } else {
            for l in 0..8 {
                let prev = if l == 0 {
                    next
                } else {
                    (a8[l - 1] & AT_MASK) as u64 + 1
                };
                one!(a8[l], prev);
            }
        }
        next = (a8[7] & AT_MASK) as u64 + 1;
        j += 8;
    }
    for &a in &at[j..] {
        one!(a, next);
        next = (a & AT_MASK) as u64 + 1;
    }
    (*wpos, *wacc, *wn) = (pos, acc, n);
}

/// Writes into `list` the entry ranks (positions in `at`) of the tagged
/// entries that have `bit`, ascending, sixteen entries per compress, and
/// returns how many. `list` is grown to `at.len() + 16` first.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,popcnt")]
fn ranks_with(at: &[u32], bit: u32, list: &mut Vec<u32>) -> usize {
    use std::arch::x86_64::{
        _mm512_add_epi32, _mm512_maskz_compress_epi32, _mm512_maskz_loadu_epi32, _mm512_set_epi32,
        _mm512_test_epi32_mask,
    };
    if list.len() < at.len() + 16 {
        list.resize(at.len() + 16, 0);
    }
    let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    let b = _mm512_set1_epi32(bit as i32);
    let mut t = 0usize;
    for q in (0..at.len()).step_by(16) {
        let valid = (u32::from(u16::MAX) >> (16 - (at.len() - q).min(16))) as u16;
        // SAFETY: the lanes of `valid` are entries below `at.len()`, in
        // bounds; the others are not read.
        let x = unsafe { _mm512_maskz_loadu_epi32(valid, at[q..].as_ptr().cast()) };
        let k = _mm512_test_epi32_mask(x, b);
        let j = _mm512_add_epi32(iota, _mm512_set1_epi32(q as i32));
        // SAFETY: `t` ≤ the entries below `q` ≤ `at.len()`, and `list`
        // holds `at.len() + 16`: the 16 lanes at `t` are in bounds.
        unsafe {
            _mm512_storeu_si512(
                list[t..t + 16].as_mut_ptr().cast(),
                _mm512_maskz_compress_epi32(k, j),
            )
        };
        t += k.count_ones() as usize;
    }
    t
}

/// Writes a step-coded class region (its positions' Rice codes take
/// `pos_bits`) at the start of `out`, and returns its length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512cd,avx2,bmi1,bmi2,lzcnt,popcnt")]
fn write_region(
    c: &ClassList,
    (h, pos_bits): (&ClassHead, u64),
    (out, list): (&mut Vec<u8>, &mut Vec<u32>),
) -> usize {
    let mut w = FastWriter::over(std::mem::take(out));
    w.reserve(c.n * 2 + 64);
    // Each escape's two codes (`put_rice`'s and `put_eg`'s) as one append
    // where they fit in 56 bits; their entry ranks found from the entries'
    // bits into `list`.
    let e_n = ranks_with(c.entries(), BIG_BIT, list);
    let (esc_at, esc_mag) = (&list[..e_n], &c.esc_mag[..c.esc_n]);
    debug_assert_eq!(esc_at.len(), esc_mag.len());
    w.reserve(8 * esc_at.len());
    let (ke, ve) = (h.ke, h.ve);
    // One escape, its gap `g` and `|step| − 2` `x`, with `left` escapes
    // (this one among them) to write.
    let escape = |w: &mut FastWriter, (g, x): (u64, u16), left: usize| {
        if let Some((eg, elen)) = eg_code(x as u64, ve, 56)
            && let Some((rice, rlen)) = rice_code(g, ke, 56 - elen)
        {
            w.put56(rice | (eg << rlen), rlen + elen);
        } else {
            put_rice(w, g, ke, (0, 0));
            put_eg(w, x as u64, ve);
            w.reserve(8 * left);
        }
    };
    let mut next = 0u64;
    // Eight at a time where every one's two codes fit 56 bits (merged into
    // fewer appends); the rest one at a time.
    let mut e = 0usize;
    if ke < 56 && ve <= 40 {
        use std::arch::x86_64::{
            _mm_cvtsi64_si128, _mm_loadu_si128, _mm256_loadu_si256, _mm512_add_epi64,
            _mm512_alignr_epi64, _mm512_and_si512, _mm512_cmpgt_epu64_mask, _mm512_cvtepu32_epi64,
            _mm512_lzcnt_epi64, _mm512_sllv_epi64, _mm512_srl_epi64, _mm512_sub_epi64,
            _mm512_xor_si512,
        };
        let set1 = |x: u64| _mm512_set1_epi64(x as i64);
        let ones = set1(1);
        let (kx, low) = (_mm_cvtsi64_si128(ke as i64), set1((1u64 << ke) - 1));
        let (ke1, unit, ve1) = (set1(ke as u64 + 1), set1(1u64 << ve), set1(ve as u64 + 1));
        while e + 8 <= esc_at.len() {
            let (r8, x8) = (&esc_at[e..e + 8], &esc_mag[e..e + 8]);
            // SAFETY: `r8` holds 8 u32 (32 bytes) and `x8` 8 u16 (16
            // bytes): each load reads exactly them.
            let (r, x) = unsafe {
                (
                    _mm512_cvtepu32_epi64(_mm256_loadu_si256(r8.as_ptr().cast())),
                    _mm512_cvtepu16_epi64(_mm_loadu_si128(x8.as_ptr().cast())),
                )
            };
            // The entry-rank gaps' Rice codes (`rice_code`).
            let prev = _mm512_alignr_epi64::<7>(_mm512_add_epi64(r, ones), set1(next));
            let g = _mm512_sub_epi64(r, prev);
            let q = _mm512_srl_epi64(g, kx);
            let rlen = _mm512_add_epi64(q, ke1);
            let rcode = _mm512_or_si512(
                _mm512_sllv_epi64(ones, q),
                _mm512_sllv_epi64(_mm512_and_si512(g, low), _mm512_add_epi64(q, ones)),
            );
            // The magnitudes' Exp-Golomb codes (`eg_code`): `y = x + 2^ve`
            // of `nb` bits, `z = nb − 1 − ve` zeros, a one, `y`'s low
            // `nb − 1` bits.
            let y = _mm512_add_epi64(x, unit);
            let nb = _mm512_sub_epi64(set1(64), _mm512_lzcnt_epi64(y));
            let z = _mm512_sub_epi64(nb, ve1);
            let elen = _mm512_add_epi64(z, nb);
            let top = _mm512_sllv_epi64(ones, _mm512_sub_epi64(nb, ones));
            let ecode = _mm512_or_si512(
                _mm512_sllv_epi64(ones, z),
                _mm512_sllv_epi64(_mm512_xor_si512(y, top), _mm512_add_epi64(z, ones)),
            );
            let total = _mm512_add_epi64(rlen, elen);
            // A lane with q ≥ 64 (its shifts gave 0) is longer than 56 too.
            if _mm512_cmpgt_epu64_mask(total, set1(56)) == 0 {
                let code = _mm512_or_si512(rcode, _mm512_sllv_epi64(ecode, rlen));
                let (cs, ls, step) = super::vector::merge8(code, total);
                for l in (0..8).step_by(step) {
                    w.put56(cs[l], ls[l] as u32);
                }
                next = r8[7] as u64 + 1;
            } else {
                for (l, (&r, &x)) in r8.iter().zip(x8).enumerate() {
                    escape(&mut w, (r as u64 - next, x), esc_at.len() - e - l);
                    next = r as u64 + 1;
                }
            }
            e += 8;
        }
    }
    for (l, (&r, &x)) in esc_at.iter().zip(esc_mag).enumerate().skip(e) {
        escape(&mut w, (r as u64 - next, x), esc_at.len() - l);
        next = r as u64 + 1;
    }
    if h.list.is_some() {
        // The set signs' entry ranks, coded as the entries are.
        let t = ranks_with(c.entries(), SIGN_BIT, list);
        // Their gaps sum to `last + 1 − t`: a bound on the codes' bits.
        let bits = match t.checked_sub(1) {
            Some(l) => {
                let sum = list[l] as u64 - l as u64;
                t as u64 * (h.ko as u64 + 1) + (sum >> h.ko)
            }
            None => 0,
        };
        entries(&mut w, (&list[..t], false), (h.ko, bits));
    }
    entries(&mut w, (c.entries(), h.list.is_none()), (h.k, pos_bits));
    let (buf, len) = w.finish_over();
    *out = buf;
    len
}

/// Encodes a block [`scan_block`] scanned from `s`: its entry and stream,
/// or `None` when its values cost less raw (the staged encoder writes
/// those).
#[cfg(target_arch = "x86_64")]
pub(crate) fn encode_scanned(s: &mut MaskScratch, proof: Scanned) -> Option<(BlockEntry, Vec<u8>)> {
    let chosen = [0, 1, 2].map(|c| choose(&s.class[c], proof));
    let step: u64 = chosen.iter().map(|c| c.1).sum();
    let raw: u64 = chosen.iter().map(|c| c.2).sum();
    if raw < step {
        return None;
    }
    let heads = chosen.map(|c| c.0);
    let n: u64 = heads.iter().map(|h| h.n).sum();
    let mut out = Vec::new();
    if n > 0 {
        let mut len = [0usize; CLASSES];
        for c in 0..CLASSES {
            if heads[c].n > 0 {
                // SAFETY: a `Scanned` exists only where `scan_block` found
                // the VBMI2 level (AVX-512 F, BW, CD, DQ over AVX2, BMI1,
                // BMI2, LZCNT and POPCNT), every feature `write_region` is compiled
                // with; it is otherwise safe code whose loads are justified
                // where they are made.
                len[c] = unsafe {
                    write_region(
                        &s.class[c],
                        (&heads[c], chosen[c].3),
                        (&mut s.regions[c], &mut s.list),
                    )
                };
            }
        }
        let regions: [&[u8]; CLASSES] = std::array::from_fn(|c| &s.regions[c][..len[c]]);
        out = assemble(heads, &regions, false);
    }
    let e = BlockEntry {
        changes: n,
        pos_k: 0,
        values: ValueCoding::Step,
        val_k: 0,
        bytes: out.len() as u64,
    };
    Some((e, out))
}

/// [`scan_block`] never scans on other CPUs.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn encode_scanned(_: &mut MaskScratch, _: Scanned) -> Option<(BlockEntry, Vec<u8>)> {
    None
}

thread_local! {
    pub(crate) static MASKS: std::cell::RefCell<MaskScratch> =
        std::cell::RefCell::new(MaskScratch::default());
}

static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether `compact2`'s encoder takes this path for 2-byte words (where the
/// CPU has the features; the default) or always stages (for benchmarks that
/// compare the two, `examples/compact2_bench`).
#[doc(hidden)]
pub fn set_enabled(on: bool) {
    ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn enabled() -> bool {
    ENABLED.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::context::{BIG, Member, NEG, member};
    use super::super::testutil::bf16_pair;
    use super::super::v2::staged_block;
    use super::super::{BlockEntry, Ctx};
    use super::*;
    use crate::digest::TensorSeed;
    use crate::dtype::{KeyKind, to_key, word_mask};
    use crate::platform::expect::require;
    use crate::platform::{Level, Platform};

    type Part = (BlockEntry, Vec<u8>, u64, Vec<Member>);

    /// The mask encoder's block, or `None` where it hands the block back
    /// (raw values).
    fn masked(ctx: Ctx, (old, new): (&[u8], &[u8]), members: &[Member]) -> Option<Part> {
        let mut s = MaskScratch::default();
        let check = 0x1234_5678_9abc_def0u64 ^ (ctx.first << 32);
        let (dig, n, sum, proof) =
            scan_block(Platform::cpu(), ctx, (old, new), (members, check), &mut s)
                .expect("the CPU has the features");
        assert_eq!(n as usize, s.next.len());
        let want = super::super::context::block_checksum(0x1234_5678_9abc_def0, ctx.first, &s.next);
        assert_eq!(sum, want, "the next context's checksum");
        let (e, bytes) = encode_scanned(&mut s, proof)?;
        Some((e, bytes, dig, s.next.clone()))
    }

    /// The members a change `old` → `new` leaves (the next context).
    fn members_of(kind: KeyKind, old: &[u8], new: &[u8]) -> Vec<Member> {
        let w = |v: &[u8], i: usize| u16::from_le_bytes([v[2 * i], v[2 * i + 1]]) as u64;
        (0..old.len() / 2)
            .filter(|&i| w(old, i) != w(new, i))
            .map(|i| {
                let s = to_key(kind, 2, w(new, i)).wrapping_sub(to_key(kind, 2, w(old, i)))
                    & word_mask(2);
                member(i as u64, s, 2)
            })
            .collect()
    }

    /// Checks one case both ways; returns whether the mask encoder took it.
    fn check(case: &str, kind: KeyKind, (old, new): (&[u8], &[u8]), members: &[Member]) -> bool {
        for first in [0u64, 3 << 22] {
            let ctx = Ctx {
                kind,
                seed: TensorSeed(77),
                first,
            };
            let staged = staged_block(ctx, (old, new), members);
            match masked(ctx, (old, new), members) {
                Some(got) => {
                    assert!(
                        got.0 == staged.0,
                        "{case}: entry {:?} vs {:?}",
                        got.0,
                        staged.0
                    );
                    assert!(got.1 == staged.1, "{case}: stream differs ({:?})", staged.0);
                    assert_eq!(got.2, staged.2, "{case}: digest change");
                    assert!(got.3 == staged.3, "{case}: next members");
                }
                None => {
                    assert_eq!(
                        staged.0.values,
                        ValueCoding::Raw,
                        "{case}: handed back a step block"
                    );
                    return false;
                }
            }
        }
        true
    }

    /// Three versions where the third changes many of the words the second
    /// changed, by steps of 1, 3..203 and 2^15; with `neg`, a third of the
    /// words negative.
    fn chain(words: usize, seed: u64, neg: bool, down: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let spec = super::super::testutil::Chain {
            first: 37,
            again: 2,
            fresh: 71,
            step: |h, h2| match h % 23 {
                0 => 0x8000,
                1..=3 => 3 + (h2 % 200) as u16,
                _ => 1,
            },
            down,
            neg,
        };
        super::super::testutil::chain(words, seed, &spec)
    }

    /// Blocks of every shape against their staged encoding: with and
    /// without context, both key kinds, ragged lengths (regions and 64-word
    /// chunks cut short), steps of 2^15 at members whose last step was
    /// negative, escapes in every class, sign lists and sign bits, no
    /// changes, and dense blocks (which code raw and are handed back).
    #[test]
    fn masks_and_staged_encoders_agree() {
        if !require(Level::Avx512Vbmi2, "masks_and_staged_encoders_agree") {
            return;
        }
        let mut taken = 0;
        for words in [3 * 2048 + 37, 2048, 64, 63, 1, 5000] {
            // Steps up and down alike, and (one in 16 down) mostly up: the
            // signs then cost less as a list of the set ones.
            for (seed, neg, down) in [(1u64, false, 2), (2, true, 2), (3, true, 2), (4, false, 16)]
            {
                let (a, b, c) = chain(words, seed, neg, down);
                for kind in [KeyKind::SignMagnitude, KeyKind::Identity] {
                    let ctx = members_of(kind, &a, &b);
                    let case = format!("{words} words, seed {seed}, {kind:?}");
                    taken += check(&format!("{case}, context"), kind, (&b, &c), &ctx) as usize;
                    taken += check(&format!("{case}, none"), kind, (&b, &c), &[]) as usize;
                    // The context's members, all flipped to the other class and
                    // sign: the classes and signs change, the changes do not.
                    let flipped: Vec<Member> = ctx.iter().map(|m| m ^ BIG ^ NEG).collect();
                    taken += check(&format!("{case}, flipped"), kind, (&b, &c), &flipped) as usize;
                }
            }
        }
        // Long gaps after dense runs: Rice codes past 56 bits, several in a
        // row, in class 0 and (with every changed word a member) class 1.
        let words = 3 * 2048 + 5;
        let (b, _) = bf16_pair(words, |_| false);
        let mut c = b.clone();
        let picked = |i: usize| i < 1500 || i == 3000 || i == 4500 || i == words - 1;
        for i in (0..words).filter(|&i| picked(i)) {
            c[2 * i] ^= 1;
        }
        assert!(check("long gaps", KeyKind::SignMagnitude, (&b, &c), &[]));
        let ones: Vec<Member> = (0..words as u32)
            .filter(|&i| picked(i as usize) || i % 2 == 0)
            .map(|i| i << 2)
            .collect();
        assert!(check(
            "long rank gaps",
            KeyKind::SignMagnitude,
            (&b, &c),
            &ones
        ));
        let (b, c) = bf16_pair(words, |i| i % 3 != 0);
        check("dense", KeyKind::SignMagnitude, (&b, &c), &[]);
        let (b, c) = bf16_pair(words, |_| false);
        assert!(check("unchanged", KeyKind::SignMagnitude, (&b, &c), &[]));
        let all: Vec<Member> = (0..words as u32).map(|i| i << 2 | (i & 3)).collect();
        assert!(check(
            "unchanged, every word a member",
            KeyKind::SignMagnitude,
            (&b, &c),
            &all
        ));
        assert!(taken > 100, "the mask encoder took {taken} cases");
    }

    /// The entry writer against `put_rice` one entry at a time: Rice
    /// parameters 0–20, with and without sign bits, gaps whose codes straddle each
    /// merge's bound (56 / 8, 56 / 4, 56 / 2 bits) and pass 56 bits, lists
    /// of every length around a group of eight.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn entries_match_put_rice() {
        if !require(Level::Avx512Vbmi2, "entries_match_put_rice") {
            return;
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut checked = 0;
        for k in 0..=20u32 {
            for signs in [false, true] {
                for n in [0usize, 1, 7, 8, 9, 31, 64, 203] {
                    let mut c = ClassList::default();
                    c.room(n + 16);
                    let mut next = 0u64;
                    for j in 0..n {
                        let r = rnd();
                        // Quotients 0–6 mostly, now and then past 56 bits
                        // (positions stay below 2^30).
                        let q = if r % 61 == 0 && k <= 12 {
                            40 + r % 30
                        } else {
                            (r >> 8) % if k >= 18 { 3 } else { 7 }
                        };
                        let g = (q << k) | ((r >> 16) & ((1 << k) - 1));
                        assert!(next + g <= AT_MASK as u64);
                        // Sign and escape bits set at random: the escape's
                        // is never written, the sign's only where signed.
                        let tags = (((r >> 40) as u32 & 1) * SIGN_BIT)
                            | (((r >> 41) as u32 & 1) * BIG_BIT);
                        c.at[j] = (next + g) as u32 | tags;
                        next += g + 1;
                    }
                    c.n = n;
                    // Three bits first, so the codes start mid-byte.
                    let (mut want, mut got) = (FastWriter::default(), FastWriter::default());
                    for w in [&mut want, &mut got] {
                        w.reserve(8);
                        w.put56(5, 3);
                    }
                    let mut prev = 0u64;
                    for &a in c.entries() {
                        let extra = u32::from(signs);
                        let tail = (a >> 31) as u64 * extra as u64;
                        put_rice(&mut want, (a & AT_MASK) as u64 - prev, k, (tail, extra));
                        prev = (a & AT_MASK) as u64 + 1;
                    }
                    // The bits of the codes: `rice_costs`'s count for `k`.
                    // SAFETY: `require` found the VBMI2 level, every feature
                    // `rice_costs` and `entries` are compiled with.
                    let bits = (0..3)
                        .map(|d| (k + d).saturating_sub(1))
                        .zip(unsafe { rice_costs(c.entries(), k) })
                        .find(|&(kk, _)| kk == k)
                        .expect("k among the three")
                        .1;
                    unsafe { entries(&mut got, (c.entries(), signs), (k, bits)) };
                    assert!(
                        got.finish() == want.finish(),
                        "k {k}, signs {signs}, {n} entries"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 21 * 2 * 8);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random blocks, changes and contexts (any members, any classes
        /// and signs, steps skewed up or down) encode as the staged encoder
        /// does.
        #[test]
        fn random_blocks_agree(
            words in 1usize..5000,
            seed in any::<u64>(),
            density in 1u64..60,
            mdensity in 1u64..60,
            up in 0u64..=100,
            identity in any::<bool>(),
        ) {
            if !Platform::cpu().has(Level::Avx512Vbmi2) {
                return Ok(());
            }
            let mut x = seed | 1;
            let mut rnd = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let base: Vec<u8> = (0..words).flat_map(|_| (rnd() as u16).to_le_bytes()).collect();
            let mut new = base.clone();
            let mut members = Vec::new();
            for i in 0..words {
                if rnd() % 100 < mdensity {
                    members.push(((i as u32) << 2) | (rnd() & 3) as u32);
                }
                if rnd() % 100 < density {
                    let r = rnd();
                    let step: u16 = match r % 8 {
                        0 => (r >> 8) as u16 | 1,
                        1 => 0x8000,
                        2 | 3 => 2 + (r >> 8) as u16 % 5,
                        _ => 1,
                    };
                    let w = u16::from_le_bytes([base[2 * i], base[2 * i + 1]]);
                    // `up` in 100 go up: skewed, the signs cost less as a list.
                    let w = if (r >> 40) % 100 < up { w.wrapping_add(step) } else { w.wrapping_sub(step) };
                    new[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
                }
            }
            let kind = if identity { KeyKind::Identity } else { KeyKind::SignMagnitude };
            check("random", kind, (&base, &new), &members);
        }
    }
}
