//! The list work of a `compact2` apply (docs/format.md §6.3), with AVX-512
//! forms: splitting a block's context members into classes 1 and 2, picking
//! the members that changed again, and merging two ascending member lists
//! into the next context. Each runs once per member or change and per block,
//! beside the apply's random writes; the vector forms take 16 members per
//! step where the portable loops take one.
//!
//! Every function has a portable form that defines it; the AVX-512 forms
//! are tested against them on random and edge-case lists.

#[cfg(test)]
use super::context::block_checksum_portable;
use super::context::{BIG, Member, member_hash};
#[cfg(target_arch = "x86_64")]
use super::context::{block_checksum_avx512, fold8, hash8};
#[cfg(target_arch = "x86_64")]
use crate::platform::HasAvx512;
use crate::platform::Platform;
#[cfg(target_arch = "x86_64")]
use crate::platform::prefetch;

/// Splits `members` by their `big` bit: the positions `j` (in `members`) of
/// those without it into `small`, of those with it into `big`, each
/// ascending. Both hold at least `members.len() + 16` entries; returns how
/// many each got. Also zeroes `again` (one flag per member, see
/// `v2::Record`) on the way: the split streams through the members once per
/// block anyway, and a separate `memset` was a pass of its own.
pub(crate) fn split(
    platform: Platform,
    members: &[Member],
    (small, big): (&mut [u32], &mut [u32]),
    again: &mut [u8],
) -> (usize, usize) {
    debug_assert!(small.len() >= members.len() + 16 && big.len() >= members.len() + 16);
    debug_assert_eq!(again.len(), members.len());
    #[cfg(target_arch = "x86_64")]
    if let Some(proof) = platform.avx512() {
        return split_avx512(proof, members, (small, big), again);
    }
    let _ = platform;
    again.fill(0);
    split_portable(members, 0, small, big)
}

/// [`split`] one member at a time; `members[0]` is member `first`.
fn split_portable(
    members: &[Member],
    first: usize,
    small: &mut [u32],
    big: &mut [u32],
) -> (usize, usize) {
    let (mut a, mut b) = (0usize, 0usize);
    for (j, &m) in members.iter().enumerate() {
        let is_big = (m & BIG) as usize;
        let j = (first + j) as u32;
        // Both slots written, one kept: no branch on the coin-toss bit.
        small[a] = j;
        big[b] = j;
        a += 1 - is_big;
        b += is_big;
    }
    (a, b)
}

/// Writes into `kept` each member whose `again` entry is non-zero, with its
/// code replaced by that entry's low two bits (see `v2::Record`), in order;
/// `kept` holds at least `members.len() + 16` entries. Returns how many.
pub(crate) fn survivors(
    platform: Platform,
    members: &[Member],
    again: &[u8],
    kept: &mut [Member],
) -> usize {
    debug_assert!(again.len() == members.len() && kept.len() >= members.len() + 16);
    #[cfg(target_arch = "x86_64")]
    if let Some(proof) = platform.avx512() {
        return survivors_avx512(proof, members, again, kept);
    }
    let _ = platform;
    survivors_portable(members, again, kept)
}

fn survivors_portable(members: &[Member], again: &[u8], kept: &mut [Member]) -> usize {
    let mut s = 0usize;
    for (&m, &f) in members.iter().zip(again) {
        kept[s] = (m & !3) | (f as u32 & 3);
        s += (f != 0) as usize;
    }
    s
}

/// Merges the ascending lists `a` and `b` into `out` (cleared first): all
/// their members, ascending. Returns whether two of them share an index (a
/// word named twice), and `out`'s checksum as block `block` of the tensor
/// with context seed `seed` ([`super::context::block_checksum`]), summed as
/// the members are written rather than by a pass of its own.
pub(crate) fn merge(
    platform: Platform,
    a: &[Member],
    b: &[Member],
    out: &mut Vec<Member>,
    (seed, block): (u64, u64),
) -> (bool, u64) {
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if let Some(proof) = platform.avx512() {
        return merge_avx512(proof, a, b, out, (seed, block));
    }
    let _ = platform;
    out.resize(a.len() + b.len(), 0);
    merge_two_ends(a, b, out, (seed, block))
}

/// The portable form of [`merge`]'s work, for CPUs without AVX-512 (Arm
/// hosts among them): merges `a` and `b` into `out` (their length together)
/// from both ends at once, the first half of `out` front to back and the
/// rest back to front, and sums the checksum and checks neighbours as it
/// writes. A one-ended merge is one chain (each step's loads wait on the
/// step before); the two ends are two chains that run side by side, and
/// the checksum's multiplies and the neighbour checks stay off both.
///
/// The two halves meet where a stable merge (`a`'s member first of two
/// equal ones) puts them: the front takes `a`'s on a tie, the back `b`'s.
fn merge_two_ends(
    a: &[Member],
    b: &[Member],
    out: &mut [Member],
    (seed, block): (u64, u64),
) -> (bool, u64) {
    let n = a.len() + b.len();
    debug_assert_eq!(out.len(), n);
    if n == 0 {
        return (false, 0);
    }
    let half = n / 2;
    let (front, back) = out.split_at_mut(half);
    // Past a list's end (front) or before its start (back) a sentinel no
    // member reaches: members are compared as `i64`.
    let at = |l: &[Member], k: usize| l.get(k).map_or(i64::MAX, |&m| m as i64);
    let before = |l: &[Member], k: usize| {
        k.checked_sub(1)
            .and_then(|k| l.get(k))
            .map_or(-1, |&m| m as i64)
    };
    let (mut i, mut j) = (0usize, 0usize);
    let (mut ie, mut je) = (a.len(), b.len());
    let (mut dup, mut sum) = (false, 0u64);
    // The last member each end wrote (its neighbour check), none yet.
    let (mut prev_f, mut prev_b) = (-1i64, -1i64);
    let mut step_back = |k: usize, dup: &mut bool, sum: &mut u64| {
        let (x, y) = (before(a, ie), before(b, je));
        let take_a = x > y;
        let m = if take_a { x } else { y };
        ie -= take_a as usize;
        je -= !take_a as usize;
        back[k] = m as Member;
        *dup |= prev_b >= 0 && prev_b >> 2 == m >> 2;
        prev_b = m;
        *sum = sum.wrapping_add(member_hash(seed, block, m as Member));
    };
    let rest = n - half;
    for (k, slot) in front.iter_mut().enumerate() {
        let (x, y) = (at(a, i), at(b, j));
        let take_a = x <= y;
        let m = if take_a { x } else { y };
        i += take_a as usize;
        j += !take_a as usize;
        *slot = m as Member;
        dup |= prev_f >= 0 && prev_f >> 2 == m >> 2;
        prev_f = m;
        sum = sum.wrapping_add(member_hash(seed, block, m as Member));
        step_back(rest - 1 - k, &mut dup, &mut sum);
    }
    if rest > half {
        step_back(0, &mut dup, &mut sum);
    }
    // The seam: the front's last and the back's first.
    if half > 0 {
        dup |= out[half - 1] >> 2 == out[half] >> 2;
    }
    (dup, sum)
}

/// Whether two neighbours of an ascending member list share an index.
#[cfg(target_arch = "x86_64")]
fn shares_an_index(out: &[Member]) -> bool {
    out.windows(2)
        .fold(false, |d, w| d | (w[0] >> 2 == w[1] >> 2))
}

/// A merge one member per round, no branch on the data: the AVX-512
/// merge's last members (the portable form is [`merge_two_ends`]).
#[cfg(target_arch = "x86_64")]
fn merge_portable(a: &[Member], b: &[Member], out: &mut [Member]) {
    debug_assert_eq!(out.len(), a.len() + b.len());
    let (mut i, mut j, mut o) = (0usize, 0usize, 0usize);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        let take_a = x <= y;
        out[o] = if take_a { x } else { y };
        o += 1;
        i += take_a as usize;
        j += !take_a as usize;
    }
    let rest = a.len() - i;
    out[o..o + rest].copy_from_slice(&a[i..]);
    out[o + rest..].copy_from_slice(&b[j..]);
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// How far ahead (in members) the vector loops that stream through a block's
/// context members prefetch them. The members of a block come from memory
/// (the previous version wrote them), and the hardware's stream prefetcher
/// stops at each 4 KiB page: 2 KiB ahead keeps the misses overlapped.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 512;

#[cfg(target_arch = "x86_64")]
fn split_avx512(
    proof: HasAvx512,
    members: &[Member],
    (small, big): (&mut [u32], &mut [u32]),
    again: &mut [u8],
) -> (usize, usize) {
    // SAFETY: `proof` exists only where detection found AVX-512 F (and DQ),
    // every feature `split_avx512_body` is compiled with; the body's own
    // memory accesses are bounds-checked (see there).
    unsafe { split_avx512_body(proof, members, (small, big), again) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn split_avx512_body(
    _: HasAvx512,
    members: &[Member],
    (small, big): (&mut [u32], &mut [u32]),
    again: &mut [u8],
) -> (usize, usize) {
    let (mut a, mut b) = (0usize, 0usize);
    let full = members.len() / 16 * 16;
    let mut iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let sixteen = _mm512_set1_epi32(16);
    let one = _mm512_set1_epi32(BIG as i32);
    for at in (0..full).step_by(16) {
        prefetch(members, at + AHEAD);
        let chunk: &[u32; 16] = members[at..at + 16].try_into().expect("16 members");
        // SAFETY: `chunk` is 16 initialized u32s (64 bytes); an unaligned
        // load reads exactly those.
        let m = unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) };
        let is_big = _mm512_test_epi32_mask(m, one);
        let to_small = _mm512_maskz_compress_epi32(!is_big, iota);
        let to_big = _mm512_maskz_compress_epi32(is_big, iota);
        // Each store writes 16 lanes (the compressed ones first, then
        // zeros): `a + 16 ≤ at + 16 ≤ members.len() + 16 ≤ small.len()`, and
        // likewise for `big`; the lanes past the count are overwritten by the
        // next store or left as scratch.
        let dst_small: &mut [u32; 16] = (&mut small[a..a + 16]).try_into().expect("16 slots");
        let dst_big: &mut [u32; 16] = (&mut big[b..b + 16]).try_into().expect("16 slots");
        let flags: &mut [u8; 16] = (&mut again[at..at + 16]).try_into().expect("16 flags");
        // SAFETY: each destination is 16 writable u32s (64 bytes), and
        // `flags` 16 writable bytes.
        unsafe {
            _mm512_storeu_si512(dst_small.as_mut_ptr().cast(), to_small);
            _mm512_storeu_si512(dst_big.as_mut_ptr().cast(), to_big);
            _mm_storeu_si128(flags.as_mut_ptr().cast(), _mm_setzero_si128());
        }
        let nb = is_big.count_ones() as usize;
        a += 16 - nb;
        b += nb;
        iota = _mm512_add_epi32(iota, sixteen);
    }
    // The last few, one at a time.
    again[full..].fill(0);
    let (c, d) = split_portable(&members[full..], full, &mut small[a..], &mut big[b..]);
    (a + c, b + d)
}

#[cfg(target_arch = "x86_64")]
fn survivors_avx512(
    proof: HasAvx512,
    members: &[Member],
    again: &[u8],
    kept: &mut [Member],
) -> usize {
    // SAFETY: as for `split_avx512`: the proof stands for every feature the
    // body is compiled with, and its accesses are bounds-checked.
    unsafe { survivors_avx512_body(proof, members, again, kept) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn survivors_avx512_body(
    _: HasAvx512,
    members: &[Member],
    again: &[u8],
    kept: &mut [Member],
) -> usize {
    let mut s = 0usize;
    let full = members.len() / 16 * 16;
    let not_code = _mm512_set1_epi32(!3);
    let code = _mm512_set1_epi32(3);
    for at in (0..full).step_by(16) {
        prefetch(members, at + AHEAD);
        let chunk: &[u32; 16] = members[at..at + 16].try_into().expect("16 members");
        let flags: &[u8; 16] = again[at..at + 16].try_into().expect("16 flags");
        // SAFETY: 16 initialized u32s (64 bytes) and 16 initialized bytes;
        // the unaligned loads read exactly those.
        let (m, f) = unsafe {
            (
                _mm512_loadu_si512(chunk.as_ptr().cast()),
                _mm512_cvtepu8_epi32(_mm_loadu_si128(flags.as_ptr().cast())),
            )
        };
        let keep = _mm512_test_epi32_mask(f, f);
        let new = _mm512_or_si512(_mm512_and_si512(m, not_code), _mm512_and_si512(f, code));
        let packed = _mm512_maskz_compress_epi32(keep, new);
        // `s + 16 ≤ at + 16 ≤ members.len() + 16 ≤ kept.len()`.
        let dst: &mut [u32; 16] = (&mut kept[s..s + 16]).try_into().expect("16 slots");
        // SAFETY: 16 writable u32s (64 bytes).
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().cast(), packed) };
        s += keep.count_ones() as usize;
    }
    s + survivors_portable(&members[full..], &again[full..], &mut kept[s..])
}

#[cfg(target_arch = "x86_64")]
fn merge_avx512(
    proof: HasAvx512,
    a: &[Member],
    b: &[Member],
    out: &mut Vec<Member>,
    sum: (u64, u64),
) -> (bool, u64) {
    // SAFETY: as for `split_avx512`.
    unsafe { merge_avx512_body(proof, a, b, out, sum) }
}

/// Sorts a bitonic vector of 16 u32s ascending: compare-exchanges at
/// distances 8, 4, 2 and 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn sort_bitonic16(mut v: __m512i) -> __m512i {
    // Per distance d: the partner of lane l is l ^ d; lanes with bit d clear
    // keep the smaller of the pair.
    let steps: [(__m512i, u16); 4] = [
        (
            _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7),
            0x00ff,
        ),
        (
            _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11),
            0x0f0f,
        ),
        (
            _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13),
            0x3333,
        ),
        (
            _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14),
            0x5555,
        ),
    ];
    for (partner, low) in steps {
        let p = _mm512_permutexvar_epi32(partner, v);
        let (lo, hi) = (_mm512_min_epu32(v, p), _mm512_max_epu32(v, p));
        v = _mm512_mask_blend_epi32(low, hi, lo);
    }
    v
}

/// The 16 smallest and the 16 largest of two ascending vectors, each
/// ascending.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn merge16(a: __m512i, b: __m512i) -> (__m512i, __m512i) {
    let reverse = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // `a` followed by `b` reversed is bitonic: one compare-exchange at
    // distance 16 leaves two bitonic halves, the lower below the upper.
    let br = _mm512_permutexvar_epi32(reverse, b);
    let (lo, hi) = (_mm512_min_epu32(a, br), _mm512_max_epu32(a, br));
    (sort_bitonic16(lo), sort_bitonic16(hi))
}

/// Lists shorter than this together are merged by one chain (see
/// [`merge_avx512_body`]).
#[cfg(target_arch = "x86_64")]
const TWO_CHAINS_FROM: usize = 1024;

/// Where the merge of `a` and `b` (ties: `a`'s member first) puts its first
/// `k` members: `a[..i]` and `b[..k − i]`; returns `i` (`k` ≤ the lengths'
/// sum). A binary search on the merge path: `a[m]` is among the first `k`
/// when fewer than `k − m` of `b`'s members lie below it, that is, when
/// `a[m] ≤ b[k − m − 1]`.
#[cfg(target_arch = "x86_64")]
fn merge_split(a: &[Member], b: &[Member], k: usize) -> usize {
    debug_assert!(k <= a.len() + b.len());
    let (mut lo, mut hi) = (k.saturating_sub(b.len()), k.min(a.len()));
    while lo < hi {
        let m = (lo + hi) / 2;
        // `m < hi ≤ k` and `m ≥ lo ≥ k − b.len()`: `k − m − 1` indexes `b`.
        if a[m] <= b[k - m - 1] {
            lo = m + 1;
        } else {
            hi = m;
        }
    }
    lo
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
/// [`merge`]'s AVX-512 form: appends to `out` (empty) and returns whether two
/// members share an index, and their checksum.
///
/// Long lists are merged by two chains at once ([`Chain`]): the merge path is
/// split at its middle ([`merge_split`]), and each step advances both halves.
/// A chain's step depends on the one before (its sort network takes the
/// 16 members the last step held back), so one chain leaves the core idle
/// part of the time; two independent chains fill it. Measured on a block's
/// lists at 2.8% density (53K and 23K members, in cache): 0.46 ns per
/// member against 0.55 for one chain; in the apply, 0.3–0.5 ms less of 27
/// (docs/benchmarks.md). The seam between the halves is checked for a
/// shared index like every other neighbour pair.
fn merge_avx512_body(
    proof: HasAvx512,
    a: &[Member],
    b: &[Member],
    out: &mut Vec<Member>,
    (seed, block): (u64, u64),
) -> (bool, u64) {
    debug_assert!(out.is_empty());
    if a.len() < 16 || b.len() < 16 {
        out.resize(a.len() + b.len(), 0);
        return merge_two_ends(a, b, out, (seed, block));
    }
    let n = a.len() + b.len();
    out.reserve(n);
    let base = _mm512_set1_epi64((seed ^ (block << 32)) as i64);
    let room = &mut out.spare_capacity_mut()[..n];
    // Macros, not methods or closures: the steps are this function's code,
    // compiled with its target features, and both chains' steps form one
    // loop body with their state in registers (a closure or method that is
    // not inlined passes the chain through memory, and a step then waits on
    // that round trip).
    //
    // Writes `v`'s 16 members and adds their hashes.
    macro_rules! put {
        ($c:expr, $v:expr) => {{
            let v = $v;
            for (d, x) in $c.out[$c.o..$c.o + 16].iter_mut().zip(lanes16(v)) {
                d.write(x);
            }
            $c.o += 16;
            let low = hash8(base, _mm512_castsi512_si256(v));
            let high = hash8(base, _mm512_extracti64x4_epi64::<1>(v));
            $c.acc = _mm512_add_epi64($c.acc, _mm512_add_epi64(low, high));
        }};
    }
    // The chain, its first 16 members written.
    macro_rules! start {
        ($lists:expr, $out:expr) => {{
            let (a, b) = $lists;
            let (lo, hi) = merge16(load16(a, 0), load16(b, 0));
            // Lane 0 of the first vector has no lower neighbour.
            let near = _mm512_mask_mov_epi32(near_below(lo, lo), 1, _mm512_set1_epi32(-1));
            let mut c = Chain::new((a, b), $out, (hi, lo), (_mm512_setzero_si512(), near));
            put!(c, lo);
            c
        }};
    }
    // Writes the next 16 members: the next vector comes from the list with
    // the smaller head, so the 16 smallest of `hi` and it are below every
    // member still in the lists.
    macro_rules! step {
        ($c:expr) => {{
            let next = if $c.a[$c.i] <= $c.b[$c.j] {
                $c.i += 16;
                load16($c.a, $c.i - 16)
            } else {
                $c.j += 16;
                load16($c.b, $c.j - 16)
            };
            let (lo, h) = merge16($c.hi, next);
            $c.hi = h;
            put!($c, lo);
            $c.near = _mm512_min_epu32($c.near, near_below(lo, $c.prev));
            $c.prev = lo;
        }};
    }
    let k = n / 2;
    let i = merge_split(a, b, k);
    let (lower, upper) = ((&a[..i], &b[..k - i]), (&a[i..], &b[k - i..]));
    let two = n >= TWO_CHAINS_FROM
        && [lower.0, lower.1, upper.0, upper.1]
            .iter()
            .all(|l| l.len() >= 16);
    let (dup, sum) = if two {
        let (r0, r1) = room.split_at_mut(k);
        let mut c0 = start!(lower, r0);
        let mut c1 = start!(upper, r1);
        while c0.more() && c1.more() {
            step!(c0);
            step!(c1);
        }
        while c0.more() {
            step!(c0);
        }
        while c1.more() {
            step!(c1);
        }
        let (d0, s0) = c0.finish(proof, (seed, block));
        let (d1, s1) = c1.finish(proof, (seed, block));
        // The seam: the lower half's last member and the upper's first.
        // SAFETY: both halves are written whole (`Chain::finish`).
        let (x, y) = unsafe { (r0[k - 1].assume_init(), r1[0].assume_init()) };
        (d0 || d1 || x >> 2 == y >> 2, s0.wrapping_add(s1))
    } else {
        let mut c = start!((a, b), room);
        while c.more() {
            step!(c);
        }
        c.finish(proof, (seed, block))
    };
    // SAFETY: the chains wrote every one of the `n` members (each fills its
    // whole region, see `Chain::finish`), within the capacity reserved.
    unsafe { out.set_len(n) };
    (dup, sum)
}

/// One merge of two ascending lists (each at least 16 long) into a region
/// of exactly their length, 16 members per step with a bitonic network; the
/// members are hashed into the checksum and checked against their lower
/// neighbours as they are written, so that no second pass reads them back.
#[cfg(target_arch = "x86_64")]
struct Chain<'l, 'o> {
    a: &'l [Member],
    b: &'l [Member],
    i: usize,
    j: usize,
    /// 16 members not yet written, none below any written one; everything
    /// else not written is `a[i..]` and `b[j..]`.
    hi: __m512i,
    /// The last vector written, the hashes so far (8 lanes) and, per lane,
    /// the least of each member xor its lower neighbour ([`near_below`]).
    prev: __m512i,
    acc: __m512i,
    near: __m512i,
    out: &'o mut [std::mem::MaybeUninit<Member>],
    o: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'l, 'o> Chain<'l, 'o> {
    /// A chain over `a` and `b` (each at least 16 long) into `out` (their
    /// length), with `hi` held, `lo` to be written first, and the hashes and
    /// least neighbour xors (see [`Chain`]) starting at `acc` and `near`.
    fn new(
        (a, b): (&'l [Member], &'l [Member]),
        out: &'o mut [std::mem::MaybeUninit<Member>],
        (hi, lo): (__m512i, __m512i),
        (acc, near): (__m512i, __m512i),
    ) -> Chain<'l, 'o> {
        debug_assert!(a.len() >= 16 && b.len() >= 16 && out.len() == a.len() + b.len());
        Chain {
            a,
            b,
            i: 16,
            j: 16,
            hi,
            prev: lo,
            acc,
            near,
            out,
            o: 0,
        }
    }

    /// Whether a step can be taken: 16 left in both lists.
    #[inline(always)]
    fn more(&self) -> bool {
        self.i + 16 <= self.a.len() && self.j + 16 <= self.b.len()
    }

    /// Writes the rest, `hi` and what is left of both lists, and returns
    /// whether two of the region's members share an index and their
    /// checksum. Every member of the region is then written.
    ///
    /// The step loop ended because one list has fewer than 16 left: they
    /// join `hi` on the stack (`both`, at most 32), and each of those goes
    /// into the region after the members of the other list below it, copied
    /// in bulk. (The other list's rest can be most of a block's members,
    /// where one list's last few lie near the block's end: merged one member
    /// at a time, into room zeroed first, it cost a `memset` and a scalar
    /// pass per block.)
    #[target_feature(enable = "avx512f,avx512dq")]
    fn finish(self, proof: HasAvx512, (seed, block): (u64, u64)) -> (bool, u64) {
        let held = lanes16(self.hi);
        let (short, long) = if self.a.len() - self.i < 16 {
            (&self.a[self.i..], &self.b[self.j..])
        } else {
            (&self.b[self.j..], &self.a[self.i..])
        };
        let mut both = [0u32; 32];
        let both = &mut both[..16 + short.len()];
        merge_portable(&held, short, both);
        let (out, from) = (self.out, self.o);
        let mut o = from;
        let mut put = |s: &[Member]| {
            for (d, &x) in out[o..o + s.len()].iter_mut().zip(s) {
                d.write(x);
            }
            o += s.len();
        };
        let mut rest = long;
        for x in both.iter() {
            // As `merge_portable`: a member of `both` before an equal one.
            let k = rest.partition_point(|y| y < x);
            put(&rest[..k]);
            put(std::slice::from_ref(x));
            rest = &rest[k..];
        }
        put(rest);
        assert_eq!(o, out.len(), "a chain writes its whole region");
        // SAFETY: members `..o` of the region are written: the steps wrote
        // `..from` and the loop above `from..o`, and `o` is its length.
        let written: &[Member] = unsafe { &*(out as *const [_] as *const [Member]) };
        // The rest, with the last member before it.
        let tail = &written[from..];
        let sum = fold8(self.acc).wrapping_add(block_checksum_avx512(proof, seed, block, tail));
        let tail_dup = shares_an_index_avx512_body(proof, &written[from - 1..]);
        let dup = _mm512_cmplt_epu32_mask(self.near, _mm512_set1_epi32(4)) != 0;
        (dup || tail_dup, sum)
    }
}

/// 16 members from `s[at..]`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn load16(s: &[Member], at: usize) -> __m512i {
    let chunk: &[u32; 16] = s[at..at + 16].try_into().expect("16 members");
    // SAFETY: 16 initialized u32s (64 bytes); the unaligned load reads
    // exactly those.
    unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) }
}

/// The 16 lanes of `v`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn lanes16(v: __m512i) -> [u32; 16] {
    let mut l = [0u32; 16];
    // SAFETY: 16 writable u32s (64 bytes).
    unsafe { _mm512_storeu_si512(l.as_mut_ptr().cast(), v) };
    l
}

/// Per lane of `v`, its member xor the lane below's (`prev`'s last for
/// lane 0): below 4 exactly where the two share an index. The steps keep
/// the least of these per lane rather than a mask of equal lanes (a compare
/// and a move from the mask register per step).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn near_below(v: __m512i, prev: __m512i) -> __m512i {
    _mm512_xor_si512(v, _mm512_alignr_epi32::<15>(v, prev))
}

/// [`shares_an_index`] 16 neighbour pairs at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn shares_an_index_avx512_body(_: HasAvx512, out: &[Member]) -> bool {
    let n = out.len();
    let mut hit = 0u16;
    let mut at = 0usize;
    // Pairs (at + l, at + l + 1) for lanes l < 16, while both vectors fit.
    while at + 17 <= n {
        let x: &[u32; 16] = out[at..at + 16].try_into().expect("16 members");
        let y: &[u32; 16] = out[at + 1..at + 17].try_into().expect("16 members");
        // SAFETY: 16 initialized u32s (64 bytes) each; the unaligned loads
        // read exactly those.
        let (x, y) = unsafe {
            (
                _mm512_loadu_si512(x.as_ptr().cast()),
                _mm512_loadu_si512(y.as_ptr().cast()),
            )
        };
        hit |= _mm512_cmpeq_epi32_mask(_mm512_srli_epi32::<2>(x), _mm512_srli_epi32::<2>(y));
        at += 16;
    }
    hit != 0 || shares_an_index(&out[at..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::Level;
    use crate::platform::expect::platforms;
    use proptest::prelude::*;

    /// A context seed for the checksums.
    const SEED: u64 = 0x0123_4567_89ab_cdef;

    /// Ascending members with distinct indices, from `gaps` (index gaps) and
    /// codes.
    fn list(gaps: &[(u32, u8)], start: u32) -> Vec<Member> {
        let mut at = start;
        gaps.iter()
            .map(|&(g, c)| {
                at += 1 + g;
                (at << 2) | (c as u32 & 3)
            })
            .collect()
    }

    fn check(a: &[Member], b: &[Member], again: &[u8]) {
        let mut want = [a, b].concat();
        want.sort_unstable();
        let want_dup = want.windows(2).any(|w| w[0] >> 2 == w[1] >> 2);
        for p in platforms("merge", &[Level::Portable, Level::Avx512]) {
            let mut out = Vec::new();
            let want_sum = block_checksum_portable(SEED, 3, &want);
            assert_eq!(
                merge(p, a, b, &mut out, (SEED, 3)),
                (want_dup, want_sum),
                "{p:?}"
            );
            assert_eq!(out, want, "{p:?}");
            assert_eq!(
                merge(p, b, a, &mut out, (SEED, 3)),
                (want_dup, want_sum),
                "{p:?}"
            );
            assert_eq!(out, want, "{p:?}");
            // Split and survivors against the definitions.
            let n = a.len();
            let (mut small, mut big) = (vec![7u32; n + 16], vec![7u32; n + 16]);
            let mut zeroed = vec![9u8; n];
            let (s, g) = split(p, a, (&mut small, &mut big), &mut zeroed);
            assert!(zeroed.iter().all(|&f| f == 0), "{p:?}");
            let want_small: Vec<u32> = (0..n as u32)
                .filter(|&j| a[j as usize] & BIG == 0)
                .collect();
            let want_big: Vec<u32> = (0..n as u32)
                .filter(|&j| a[j as usize] & BIG != 0)
                .collect();
            assert_eq!(&small[..s], &want_small[..], "{p:?}");
            assert_eq!(&big[..g], &want_big[..], "{p:?}");
            let mut kept = vec![7u32; n + 16];
            let k = survivors(p, a, &again[..n], &mut kept);
            let want_kept: Vec<u32> = a
                .iter()
                .zip(again)
                .filter(|(_, f)| **f != 0)
                .map(|(&m, &f)| (m & !3) | (f as u32 & 3))
                .collect();
            assert_eq!(&kept[..k], &want_kept[..], "{p:?}");
        }
    }

    /// Two long interleaved lists with one index shared, at every position
    /// in turn: the first merged vector, the vector loop and the rest.
    #[test]
    fn a_shared_index_anywhere_is_found() {
        let a: Vec<Member> = (0..100u32).map(|k| (2 * k) << 2).collect();
        let b: Vec<Member> = (0..100u32).map(|k| ((2 * k + 1) << 2) | 1).collect();
        for p in platforms("merge", &[Level::Portable, Level::Avx512]) {
            let mut out = Vec::new();
            assert!(!merge(p, &a, &b, &mut out, (SEED, 0)).0, "{p:?}");
            for k in 0..b.len() {
                let mut d = b.clone();
                // b's k-th member onto a's index just below it.
                d[k] = (a[k] & !3) | 3;
                assert!(
                    merge(p, &a, &d, &mut out, (SEED, 0)).0,
                    "{p:?}: shared at {k}"
                );
                assert!(
                    merge(p, &d, &a, &mut out, (SEED, 0)).0,
                    "{p:?}: shared at {k}"
                );
            }
        }
    }

    #[test]
    fn edge_lists() {
        let again: Vec<u8> = (0..200).map(|k| [0u8, 4, 5, 6, 7][k % 5]).collect();
        for (na, nb) in [
            (0, 0),
            (0, 40),
            (15, 16),
            (16, 16),
            (17, 15),
            (16, 100),
            (100, 16),
            (33, 47),
            (160, 3),
        ] {
            let a = list(
                &(0..na)
                    .map(|k| ((k * 7 % 5) as u32, k as u8))
                    .collect::<Vec<_>>(),
                0,
            );
            let b = list(
                &(0..nb)
                    .map(|k| ((k * 3 % 4) as u32 + 1, k as u8))
                    .collect::<Vec<_>>(),
                1000,
            );
            check(&a, &b, &again);
            // Interleaved ranges, and one shared index.
            let c = list(&(0..nb).map(|k| ((k % 3) as u32, 1)).collect::<Vec<_>>(), 1);
            check(&a, &c, &again);
            if na > 0 && nb > 0 {
                let mut d = c.clone();
                let at = nb / 2;
                d[at] = (a[na / 2] & !3) | 2;
                d.sort_unstable();
                if d.windows(2).all(|w| w[0] >> 2 != w[1] >> 2) {
                    check(&a, &d, &again);
                }
            }
        }
    }

    /// Lists long enough for two chains: the merge path split at every
    /// kind of place (inside either list, at a tie of equal members, one
    /// half's list shorter than a vector), and a shared index on both sides
    /// of the seam and on it.
    #[test]
    fn two_chains_agree_with_the_definition() {
        let again: Vec<u8> = (0..5000).map(|k| [0u8, 4, 5, 6, 7][k % 5]).collect();
        let mut seed = 0x9e37_79b9u32;
        let mut rnd = |m: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed % m
        };
        let mut gaps = |n: usize, m: u32| -> Vec<(u32, u8)> {
            (0..n).map(|_| (rnd(m + 1), rnd(4) as u8)).collect()
        };
        for (na, nb, ma, mb) in [
            (700, 700, 3, 3),
            (1500, 600, 2, 5),
            (600, 1500, 5, 2),
            (2000, 20, 1, 100),
            (20, 2000, 100, 1),
            (1000, 1000, 0, 0),
        ] {
            let a = list(&gaps(na, ma), 0);
            let b = list(&gaps(nb, mb), 1);
            check(&a, &b, &again);
            // Disjoint ranges: the seam inside one list.
            let c = list(&gaps(nb, mb), a.last().map_or(0, |&m| m >> 2) + 1);
            check(&a, &c, &again);
            // Equal members in both lists (ties go to the first list).
            check(&a, &a, &again);
        }
        // Even indices against odd ones, one of `b`'s moved onto the index of
        // `a`'s next member: near the middle, the pair lies across the seam
        // (the merged positions 999 and 1000 of 2000) for one of them.
        let a: Vec<Member> = (0..1000u32).map(|t| (2 * t) << 2 | (t & 3)).collect();
        let b: Vec<Member> = (0..1000u32).map(|t| (2 * t + 1) << 2 | 1).collect();
        check(&a, &b, &again);
        for t in (0..40).chain(480..520).chain(960..999) {
            let mut d = b.clone();
            d[t] = (2 * t as u32 + 2) << 2 | ((a[t + 1] + 1) & 3);
            check(&a, &d, &again);
        }
    }

    proptest! {
        #[test]
        fn merges_splits_and_survivors_agree_with_their_definitions(
            ga in prop::collection::vec((0u32..6, any::<u8>()), 0..300),
            gb in prop::collection::vec((0u32..6, any::<u8>()), 0..300),
            again in prop::collection::vec(prop::sample::select(vec![0u8, 4, 5, 6, 7]), 300),
            shift in 0u32..50,
            share in any::<bool>(),
        ) {
            let a = list(&ga, 0);
            let mut b = list(&gb, shift);
            // Some lists share an index: b's first member moved onto one of a's.
            if share && !a.is_empty() && !b.is_empty() {
                b[0] = (a[a.len() / 2] & !3) | 1;
                b.sort_unstable();
                b.dedup();
            }
            check(&a, &b, &again);
        }
    }
}
