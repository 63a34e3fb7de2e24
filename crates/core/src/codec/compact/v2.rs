//! `compact2` blocks (docs/format.md §6.3): the changes of a block split into
//! three classes by what the previous delta did to each word (its
//! [context](super::context)), each class coded on its own.
//!
//! - class 0, the **rest**: words the previous delta did not change; positions
//!   are Rice-coded gaps over the block's indices, as in `compact`;
//! - class 1: words the previous delta moved by one ulp;
//! - class 2: words it moved by two or more;
//!
//! classes 1 and 2 code positions as Rice-coded gaps over the class's own
//! members (the words of that class, in index order), which are 10–40 times
//! denser in changes than the rest. Values are a sign bit (for classes 1 and
//! 2: whether the step goes against the member's last step) or, when few
//! signs are set, the list of the entries whose bit is set; and a magnitude
//! that is 1 unless the entry is on the class's escape list (Rice-coded
//! ranks, each with an Exp-Golomb code of `|step| − 2`). A class whose
//! escapes are ~10% of its entries spends ~0.5 bit per entry on magnitudes,
//! where `compact`'s order-0 Exp-Golomb code spends 1.
//!
//! A block's stream is a prologue (counts, parameters and region lengths, in
//! bytes) and one byte-aligned region per non-empty class. Decoding fills a
//! [`Decoded`] with the block's changes in ascending index order (the three
//! classes merged, any index named twice refused); the apply then resolves
//! and writes them like any other block's (see `apply`).

use super::context::{BIG, Member, NEG, index, member};
use super::{Block, MAX_POS_K, MAX_VAL_K};
use crate::codec::bits::BitReader;
use crate::dtype::{to_key, word_mask};
use crate::error::Result;
use crate::format::{BlockEntry, ValueCoding};

/// Classes of a block.
pub const CLASSES: usize = 3;

/// A class's coding, read from the prologue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ClassHead {
    /// Entries.
    pub(crate) n: u64,
    /// Rice parameter of the position gaps.
    pub(crate) k: u32,
    /// Escapes (entries with |step| ≥ 2), their ranks' Rice parameter and
    /// the Exp-Golomb order of `|step| − 2`.
    pub(crate) esc: u64,
    pub(crate) ke: u32,
    pub(crate) ve: u32,
    /// `None`: one sign bit per entry; `Some(t)`: a list of the `t` entries
    /// whose sign bit is set, ranks Rice-coded with parameter `ko`.
    pub(crate) list: Option<u64>,
    pub(crate) ko: u32,
    /// Bytes of the class's region.
    pub(crate) len: usize,
}

/// A block's prologue: the classes and where the first region starts.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Prologue {
    pub(crate) class: [ClassHead; CLASSES],
    pub(crate) body: usize,
}

/// A block's changes, decoded: ascending block indices and, per change, the
/// masked step (step-coded blocks) or the new word (raw-coded blocks).
#[derive(Default)]
pub struct Decoded {
    /// Block indices, ascending.
    pub index: Vec<u32>,
    /// Masked steps, or new words.
    pub value: Vec<u64>,
}

/// Scratch the decoder reuses across blocks: each class's entries before the
/// merge, and the members of classes 1 and 2.
#[derive(Default)]
pub(crate) struct Scratch {
    class_index: [Vec<u32>; CLASSES],
    class_value: [Vec<u64>; CLASSES],
    members: [Vec<Member>; 2],
    esc_rank: Vec<u64>,
    esc_mag: Vec<u64>,
    list_rank: Vec<u64>,
}

thread_local! {
    /// Per-thread decode scratch and output, reused across blocks.
    pub(crate) static DECODE: std::cell::RefCell<(Scratch, Decoded)> =
        std::cell::RefCell::new((Scratch::default(), Decoded::default()));
}

// ---------------------------------------------------------------------------
// Prologue

/// Reads a LEB128 varint of at most 10 bytes at `*at`.
fn varint(s: &[u8], at: &mut usize) -> std::result::Result<u64, &'static str> {
    let mut v = 0u64;
    for i in 0..10 {
        let b = *s.get(*at).ok_or("prologue truncated")?;
        *at += 1;
        if i == 9 && b > 1 {
            return Err("varint overflows 64 bits");
        }
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 10 bytes")
}

fn byte(s: &[u8], at: &mut usize) -> std::result::Result<u32, &'static str> {
    let b = *s.get(*at).ok_or("prologue truncated")?;
    *at += 1;
    Ok(b as u32)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Prologue {
    /// Parses and checks a block's prologue: parameters in range, counts
    /// that add up to the entry's `changes` and fit what each class can hold
    /// (`space[c]`: the block's words for class 0, the class's members for 1
    /// and 2), and regions that fill the stream exactly, each long enough for
    /// its counts (a lying count is refused before anything is allocated).
    fn parse_raw(
        s: &[u8],
        e: &BlockEntry,
        wb: usize,
        space: [u64; CLASSES],
    ) -> std::result::Result<Prologue, &'static str> {
        if e.pos_k != 0 || e.val_k != 0 {
            return Err("compact2 blocks have pos_k and val_k 0");
        }
        let raw = e.values == ValueCoding::Raw;
        let mut p = Prologue::default();
        if e.changes == 0 {
            return if s.is_empty() {
                Ok(p)
            } else {
                Err("a block without changes has no bytes")
            };
        }
        let mut at = 0usize;
        let mut total = 0u64;
        for (c, h) in p.class.iter_mut().enumerate() {
            h.n = varint(s, &mut at)?;
            if h.n == 0 {
                continue;
            }
            if h.n > space[c] {
                return Err(if c == 0 {
                    "more changes than words"
                } else {
                    "more changes than the context has members of the class"
                });
            }
            total = total.saturating_add(h.n);
            h.k = byte(s, &mut at)?;
            if h.k > MAX_POS_K as u32 {
                return Err("coding parameter out of range");
            }
            if !raw {
                h.esc = varint(s, &mut at)?;
                if h.esc > h.n {
                    return Err("more escapes than entries");
                }
                if h.esc > 0 {
                    (h.ke, h.ve) = (byte(s, &mut at)?, byte(s, &mut at)?);
                    if h.ke > MAX_POS_K as u32 || h.ve > MAX_VAL_K as u32 {
                        return Err("coding parameter out of range");
                    }
                }
                let l = varint(s, &mut at)?;
                if l > 0 {
                    let t = l - 1;
                    if t > h.n {
                        return Err("more listed signs than entries");
                    }
                    h.list = Some(t);
                    if t > 0 {
                        h.ko = byte(s, &mut at)?;
                        if h.ko > MAX_POS_K as u32 {
                            return Err("coding parameter out of range");
                        }
                    }
                }
            }
            let len = varint(s, &mut at)?;
            h.len = usize::try_from(len).map_err(|_| "region longer than the stream")?;
            // The fewest bits the counts need.
            let sign = if raw {
                8 * wb as u64
            } else {
                u64::from(h.list.is_none())
            };
            let need =
                h.n.saturating_mul(h.k as u64 + 1 + sign)
                    .saturating_add(h.esc.saturating_mul(h.ke as u64 + 2 + h.ve as u64))
                    .saturating_add(h.list.unwrap_or(0).saturating_mul(h.ko as u64 + 1));
            if need > (h.len as u64).saturating_mul(8) {
                return Err("stream too short for the claimed number of changes");
            }
        }
        if total != e.changes {
            return Err("the classes' counts do not add up to the block's changes");
        }
        p.body = at;
        let regions = p
            .class
            .iter()
            .try_fold(0usize, |a, h| a.checked_add(h.len))
            .ok_or("region longer than the stream")?;
        if at.checked_add(regions) != Some(s.len()) {
            return Err("regions do not fill the block's stream");
        }
        Ok(p)
    }

    /// Writes the prologue (see [`Prologue::parse`]).
    pub(crate) fn write(&self, raw: bool, out: &mut Vec<u8>) {
        for h in &self.class {
            put_varint(out, h.n);
            if h.n == 0 {
                continue;
            }
            out.push(h.k as u8);
            if !raw {
                put_varint(out, h.esc);
                if h.esc > 0 {
                    out.push(h.ke as u8);
                    out.push(h.ve as u8);
                }
                match h.list {
                    None => put_varint(out, 0),
                    Some(t) => {
                        put_varint(out, t + 1);
                        if t > 0 {
                            out.push(h.ko as u8);
                        }
                    }
                }
            }
            put_varint(out, h.len as u64);
        }
    }
}

// ---------------------------------------------------------------------------
// Bit-level reading of a region

/// A cursor over one region's bits.
struct Cursor<'a> {
    s: &'a [u8],
    at: u64,
}

impl<'a> Cursor<'a> {
    /// The 64 bits from the cursor on (at least 57 valid), when the 8 bytes
    /// holding the cursor's bit are all in the region.
    #[inline(always)]
    fn window(&self) -> Option<u64> {
        let byte = (self.at >> 3) as usize;
        let chunk = self.s.get(byte..byte + 8)?;
        Some(u64::from_le_bytes(chunk.try_into().expect("8 bytes")) >> (self.at & 7))
    }

    /// A reader positioned at the cursor (the slow path).
    fn reader(&self) -> BitReader<'a> {
        let mut r = BitReader::new(self.s.get((self.at >> 3) as usize..).unwrap_or(&[]));
        r.get((self.at & 7) as u32);
        r
    }

    fn consumed(&mut self, r: &BitReader<'_>) {
        self.at = self.s.len() as u64 * 8 - r.remaining_bits();
    }

    /// A Rice-coded value with parameter `k` whose quotient is at most
    /// `q_limit`.
    #[inline(always)]
    fn rice(&mut self, k: u32, q_limit: u64) -> std::result::Result<u64, &'static str> {
        if let Some(w) = self.window() {
            let tz = w.trailing_zeros();
            if (tz as u64) <= q_limit && tz + k <= 55 {
                self.at += (tz + 1 + k) as u64;
                return Ok(((tz as u64) << k) | ((w >> (tz + 1)) & ((1u64 << k) - 1)));
            }
        }
        self.rice_slow(k, q_limit)
    }

    #[cold]
    #[inline(never)]
    fn rice_slow(&mut self, k: u32, q_limit: u64) -> std::result::Result<u64, &'static str> {
        let mut r = self.reader();
        let q = r.unary(q_limit).ok_or("truncated or invalid position")?;
        let low = r.get(k).ok_or("truncated position")?;
        self.consumed(&r);
        Ok((q << k) | low)
    }

    /// `n` ≤ 64 bits.
    #[inline(always)]
    fn bits(&mut self, n: u32) -> std::result::Result<u64, &'static str> {
        if n <= 56
            && let Some(w) = self.window()
        {
            self.at += n as u64;
            return Ok(w & ((1u64 << n) - 1));
        }
        let mut r = self.reader();
        let v = r.get(n).ok_or("truncated value")?;
        self.consumed(&r);
        Ok(v)
    }

    /// An Exp-Golomb-coded value of order `k` (docs/format.md §6.3).
    fn eg(&mut self, k: u32) -> std::result::Result<u64, &'static str> {
        let mut r = self.reader();
        let z = r.unary(64).ok_or("truncated or invalid step")?;
        let width = z + k as u64;
        if width > 62 {
            return Err("step too large");
        }
        let rest = r.get(width as u32).ok_or("truncated step")?;
        self.consumed(&r);
        Ok(((1u64 << width) | rest) - (1u64 << k))
    }

    /// Whether the region ends here: fewer than 8 bits left, all zero.
    fn clean_end(&self) -> bool {
        let total = self.s.len() as u64 * 8;
        self.at <= total
            && total - self.at < 8
            && (self.at == total || self.s[self.s.len() - 1] >> (self.at & 7) == 0)
    }
}

/// Reads a list of `count` strictly ascending ranks below `limit`
/// (Rice-coded gaps, parameter `k`), with `f(cursor)` reading what follows
/// each rank.
fn read_ranks(
    cur: &mut Cursor<'_>,
    (count, k, limit): (u64, u32, u64),
    ranks: &mut Vec<u64>,
    mut f: impl FnMut(&mut Cursor<'_>) -> std::result::Result<(), &'static str>,
) -> std::result::Result<(), &'static str> {
    ranks.clear();
    ranks.reserve(count as usize);
    let mut next = 0u64;
    for _ in 0..count {
        let g = cur.rice(k, limit >> k)?;
        let r = next + g;
        if r >= limit {
            return Err("listed entry beyond the class");
        }
        ranks.push(r);
        next = r + 1;
        f(cur)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Decoding

/// Decodes a `compact2` block into `out` (ascending indices), given the
/// block's context members (`members`, ascending; empty without context).
/// Every malformed case is an error naming the block.
pub(crate) fn decode(
    block: &Block<'_>,
    members: &[Member],
    scratch: &mut Scratch,
    out: &mut Decoded,
) -> Result<()> {
    crate::with_word_width!(block.wb, W => decode_w::<W>(block, members, scratch, out))
        .map_err(|what| block.error(what))
}

fn decode_w<const W: usize>(
    block: &Block<'_>,
    members: &[Member],
    scratch: &mut Scratch,
    out: &mut Decoded,
) -> std::result::Result<(), &'static str> {
    out.index.clear();
    out.value.clear();
    let raw = block.entry.values == ValueCoding::Raw;
    // The members of classes 1 and 2, when the prologue needs them.
    let big = members.iter().filter(|&&m| m & BIG != 0).count() as u64;
    let space = [block.words, members.len() as u64 - big, big];
    let p = Prologue::parse_raw(block.stream, block.entry, block.wb, space)?;
    if block.words > 1 << 32 {
        return Err("compact2 blocks have at most 2^32 words");
    }
    if p.class[1].n + p.class[2].n > 0 {
        for (c, list) in scratch.members.iter_mut().enumerate() {
            list.clear();
            let want = if c == 0 { 0 } else { BIG };
            list.extend(members.iter().filter(|&&m| m & BIG == want));
        }
    }
    let mut at = p.body;
    for c in 0..CLASSES {
        let h = p.class[c];
        let region = &block.stream[at..at + h.len];
        at += h.len;
        let (idx, val) = (&mut scratch.class_index[c], &mut scratch.class_value[c]);
        idx.clear();
        val.clear();
        if h.n == 0 {
            continue;
        }
        idx.reserve(h.n as usize);
        val.reserve(h.n as usize);
        let mut cur = Cursor { s: region, at: 0 };
        let list: &[Member] = if c == 0 { &[] } else { &scratch.members[c - 1] };
        let space = space[c];
        if raw {
            let mut next = 0u64;
            for _ in 0..h.n {
                let g = cur.rice(h.k, space >> h.k)?;
                let r = next + g;
                if r >= space {
                    return Err("position beyond the block");
                }
                next = r + 1;
                let v = cur.bits(8 * W as u32)?;
                idx.push(if c == 0 {
                    r as u32
                } else {
                    index(list[r as usize])
                });
                val.push(v);
            }
        } else {
            // Escapes, then listed signs, then the entries.
            let (ranks, mags) = (&mut scratch.esc_rank, &mut scratch.esc_mag);
            mags.clear();
            read_ranks(&mut cur, (h.esc, h.ke, h.n), ranks, |cur| {
                let x = cur.eg(h.ve)?;
                let m = x.checked_add(2).ok_or("step larger than the word")?;
                if m > 1u64 << (W * 8 - 1) {
                    return Err("step larger than the word");
                }
                mags.push(m);
                Ok(())
            })?;
            let listed = &mut scratch.list_rank;
            listed.clear();
            if let Some(t) = h.list {
                read_ranks(&mut cur, (t, h.ko, h.n), listed, |_| Ok(()))?;
            }
            entries::<W>(
                &mut cur,
                (c, h, space),
                list,
                (ranks, mags, listed),
                (idx, val),
            )?;
        }
        if !cur.clean_end() {
            return Err("trailing bytes after the last change");
        }
    }
    merge(scratch, out)
}

/// The entries of one step-coded class: positions (class 0) or member ranks,
/// sign bits (or the listed ranks), magnitudes from the escapes.
#[inline(always)]
fn entries<const W: usize>(
    cur: &mut Cursor<'_>,
    (c, h, space): (usize, ClassHead, u64),
    list: &[Member],
    (esc_rank, esc_mag, listed): (&[u64], &[u64], &[u64]),
    (idx, val): (&mut Vec<u32>, &mut Vec<u64>),
) -> std::result::Result<(), &'static str> {
    let mask = word_mask(W);
    let (k, q_limit) = (h.k, space >> h.k);
    let bit_per_entry = h.list.is_none();
    let (mut next, mut e, mut l) = (0u64, 0usize, 0usize);
    // Sentinels past the last escape and listed rank.
    let esc_at = |e: usize| esc_rank.get(e).copied().unwrap_or(u64::MAX);
    let list_at = |l: usize| listed.get(l).copied().unwrap_or(u64::MAX);
    let (mut next_esc, mut next_list) = (esc_at(0), list_at(0));
    for r in 0..h.n {
        // Gap and sign bit from one window where they fit.
        let (g, mut neg) = match cur.window() {
            Some(w) if (w.trailing_zeros() as u64) <= q_limit && w.trailing_zeros() + k <= 54 => {
                let tz = w.trailing_zeros();
                let g = ((tz as u64) << k) | ((w >> (tz + 1)) & ((1u64 << k) - 1));
                let used = tz + 1 + k;
                if bit_per_entry {
                    cur.at += used as u64 + 1;
                    (g, (w >> used) & 1)
                } else {
                    cur.at += used as u64;
                    (g, 0)
                }
            }
            _ => {
                let g = cur.rice(k, q_limit)?;
                (g, if bit_per_entry { cur.bits(1)? } else { 0 })
            }
        };
        let p = next + g;
        if p >= space {
            return Err(if c == 0 {
                "position beyond the block"
            } else {
                "rank beyond the class's members"
            });
        }
        next = p + 1;
        if r == next_list {
            neg = 1;
            l += 1;
            next_list = list_at(l);
        }
        let mut m = 1u64;
        if r == next_esc {
            m = esc_mag[e];
            e += 1;
            next_esc = esc_at(e);
        }
        let i = if c == 0 {
            p as u32
        } else {
            let mb = list[p as usize];
            neg ^= ((mb & NEG) >> 1) as u64;
            index(mb)
        };
        idx.push(i);
        val.push(((m ^ neg.wrapping_neg()).wrapping_add(neg)) & mask);
    }
    Ok(())
}

/// Merges the three classes' entries (each ascending) into `out`, refusing
/// an index that appears twice.
fn merge(scratch: &Scratch, out: &mut Decoded) -> std::result::Result<(), &'static str> {
    let [a, b, c] = &scratch.class_index;
    let [va, vb, vc] = &scratch.class_value;
    let n = a.len() + b.len() + c.len();
    out.index.reserve(n);
    out.value.reserve(n);
    let (mut i, mut j, mut l) = (0usize, 0usize, 0usize);
    let head = |v: &Vec<u32>, x: usize| v.get(x).map_or(u64::MAX, |&p| p as u64);
    let mut last = None::<u64>;
    for _ in 0..n {
        let (ha, hb, hc) = (head(a, i), head(b, j), head(c, l));
        let (p, v) = if ha <= hb && ha <= hc {
            i += 1;
            (ha, va[i - 1])
        } else if hb <= hc {
            j += 1;
            (hb, vb[j - 1])
        } else {
            l += 1;
            (hc, vc[l - 1])
        };
        if last.is_some_and(|q| q >= p) {
            return Err("a position is changed twice");
        }
        last = Some(p);
        out.index.push(p as u32);
        out.value.push(v);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Encoding

/// One class's staged entries: gaps (positions or member ranks), magnitudes
/// and sign bits (relative to the member's last sign for classes 1 and 2).
#[derive(Default)]
pub(crate) struct Staged {
    gaps: Vec<u64>,
    mags: Vec<u64>,
    signs: Vec<u8>,
    /// Raw-coded blocks: the new words.
    raws: Vec<u64>,
}

/// Per-thread encoder scratch: the block's changes, then each class's.
#[derive(Default)]
pub(crate) struct EncodeScratch {
    pub(crate) index: Vec<u32>,
    pub(crate) old: Vec<u64>,
    pub(crate) new: Vec<u64>,
    class: [Staged; CLASSES],
}

thread_local! {
    pub(crate) static ENCODE: std::cell::RefCell<EncodeScratch> =
        std::cell::RefCell::new(EncodeScratch::default());
}

/// Bits of the Rice code of `gaps` with parameter `k`.
fn rice_cost(gaps: &[u64], k: u32) -> u64 {
    gaps.iter().map(|&g| g >> k).sum::<u64>() + gaps.len() as u64 * (k as u64 + 1)
}

/// The best Rice parameter for `gaps` and its cost: the estimate from the
/// gap sum, then its neighbours counted exactly.
fn best_rice(gaps: &[u64]) -> (u32, u64) {
    if gaps.is_empty() {
        return (0, 0);
    }
    let n = gaps.len() as f64;
    let mean = gaps.iter().sum::<u64>() as f64 / n;
    let guess = if mean < 1.0 {
        0
    } else {
        (mean.log2().floor() as i64).clamp(0, MAX_POS_K as i64) as u32
    };
    (guess.saturating_sub(1)..=(guess + 1).min(MAX_POS_K as u32))
        .map(|k| (k, rice_cost(gaps, k)))
        .min_by_key(|&(_, c)| c)
        .expect("non-empty range")
}

/// Bits of the order-`k` Exp-Golomb code of `x`.
#[inline]
fn eg_len(x: u64, k: u32) -> u64 {
    let y = x as u128 + (1u128 << k);
    let nb = 128 - y.leading_zeros() as u64;
    2 * nb - 1 - k as u64
}

/// The best Exp-Golomb order for the values `xs` and its cost: values below
/// 64 counted exactly, larger ones at their bit length's upper bound.
fn best_eg(xs: impl Iterator<Item = u64>) -> (u32, u64) {
    let (mut small, mut large) = ([0u64; 64], [0u64; 65]);
    for x in xs {
        if x < 64 {
            small[x as usize] += 1;
        } else {
            large[64 - x.leading_zeros() as usize] += 1;
        }
    }
    (0..=20u32)
        .map(|k| {
            let s: u64 = (0..64)
                .filter(|&x| small[x] > 0)
                .map(|x| small[x] * eg_len(x as u64, k))
                .sum();
            let l: u64 = (7..65)
                .filter(|&b| large[b] > 0)
                .map(|b| large[b] * eg_len(u64::MAX >> (64 - b), k))
                .sum();
            (k, s + l)
        })
        .min_by_key(|&(_, b)| b)
        .expect("non-empty range")
}

fn put_eg(w: &mut crate::codec::bits::BitWriter, x: u64, k: u32) {
    let y = x as u128 + (1u128 << k);
    let nb = 128 - y.leading_zeros();
    w.put_unary((nb - 1 - k) as u64);
    let rest = (y - (1u128 << (nb - 1))) as u64;
    w.put(rest, nb - 1);
}

fn put_rice(w: &mut crate::codec::bits::BitWriter, g: u64, k: u32) {
    w.put_unary(g >> k);
    w.put(g & ((1u64 << k) - 1), k);
}

/// Gaps between the ascending `ranks`.
fn rank_gaps(ranks: impl Iterator<Item = u64>) -> Vec<u64> {
    let mut next = 0u64;
    ranks
        .map(|r| {
            let g = r - next;
            next = r + 1;
            g
        })
        .collect()
}

/// Encodes a block's changes (`s.index`, `s.old`, `s.new`: ascending block
/// indices, old and new words) against the block's context `members`;
/// returns the entry (`bytes` and `values` set) and the stream.
pub(crate) fn encode(
    kind: crate::dtype::KeyKind,
    wb: usize,
    members: &[Member],
    s: &mut EncodeScratch,
) -> (BlockEntry, Vec<u8>) {
    let mask = word_mask(wb);
    let n = s.index.len();
    for st in &mut s.class {
        st.gaps.clear();
        st.mags.clear();
        st.signs.clear();
        st.raws.clear();
    }
    // Classify each change against the members (both ascending): class 0
    // gaps count block indices, classes 1 and 2 gaps count their members.
    let (mut p, mut rank) = (0usize, [0u64; 2]);
    let mut next = [0u64; CLASSES];
    let top = wb as u32 * 8 - 1;
    let mut raw_bits_extra = 0u64;
    for j in 0..n {
        let i = s.index[j];
        while p < members.len() && index(members[p]) < i {
            rank[(members[p] & BIG) as usize] += 1;
            p += 1;
        }
        let (c, pos, last_neg) = if p < members.len() && index(members[p]) == i {
            let m = members[p];
            let c = 1 + (m & BIG) as usize;
            let r = rank[c - 1];
            rank[c - 1] += 1;
            p += 1;
            (c, r, ((m & NEG) >> 1) as u64)
        } else {
            (0, i as u64, 0)
        };
        let st = &mut s.class[c];
        st.gaps.push(pos - next[c]);
        next[c] = pos + 1;
        let step = to_key(kind, wb, s.new[j]).wrapping_sub(to_key(kind, wb, s.old[j])) & mask;
        let neg = (step >> top) & 1;
        let m = crate::dtype::step_magnitude(wb, step);
        st.mags.push(m);
        st.signs.push((neg ^ last_neg) as u8);
        st.raws.push(s.new[j]);
        raw_bits_extra += 8 * wb as u64;
    }
    // Parameters per class, and the step coding's cost against raw words.
    let mut heads = [ClassHead::default(); CLASSES];
    let (mut step_bits, mut raw_bits) = (0u64, raw_bits_extra);
    let mut esc_params: [(Vec<u64>, u32, u32); CLASSES] = Default::default();
    let mut sign_params: [(Vec<u64>, u32); CLASSES] = Default::default();
    for c in 0..CLASSES {
        let st = &s.class[c];
        let h = &mut heads[c];
        h.n = st.gaps.len() as u64;
        if h.n == 0 {
            continue;
        }
        let (k, pos_bits) = best_rice(&st.gaps);
        h.k = k;
        raw_bits += pos_bits;
        // Escapes.
        let esc_ranks: Vec<u64> = (0..st.mags.len() as u64)
            .filter(|&r| st.mags[r as usize] >= 2)
            .collect();
        let esc_gaps = rank_gaps(esc_ranks.iter().copied());
        let (ke, esc_pos_bits) = best_rice(&esc_gaps);
        let (ve, esc_val_bits) = best_eg(esc_ranks.iter().map(|&r| st.mags[r as usize] - 2));
        h.esc = esc_ranks.len() as u64;
        (h.ke, h.ve) = (ke, ve);
        // Signs: a bit each, or the list of the set ones.
        let set: Vec<u64> = (0..h.n).filter(|&r| st.signs[r as usize] != 0).collect();
        let set_gaps = rank_gaps(set.iter().copied());
        let (ko, list_bits) = best_rice(&set_gaps);
        // The list costs its prologue bytes too.
        let list_total = list_bits + 16;
        let sign_bits = if list_total < h.n {
            h.list = Some(set.len() as u64);
            h.ko = ko;
            list_total
        } else {
            h.list = None;
            h.n
        };
        step_bits += pos_bits + esc_pos_bits + esc_val_bits + sign_bits;
        esc_params[c] = (esc_gaps, ke, ve);
        sign_params[c] = (set_gaps, ko);
    }
    let raw = raw_bits < step_bits;
    // The regions.
    let mut regions = Vec::with_capacity(CLASSES);
    for c in 0..CLASSES {
        let st = &s.class[c];
        let h = &mut heads[c];
        if h.n == 0 {
            regions.push(Vec::new());
            continue;
        }
        let mut w = crate::codec::bits::BitWriter::with_capacity(
            (if raw { raw_bits } else { step_bits } / 8) as usize / CLASSES + 16,
        );
        if raw {
            h.esc = 0;
            h.list = None;
            for (&g, &v) in st.gaps.iter().zip(&st.raws) {
                put_rice(&mut w, g, h.k);
                w.put(v, 8 * wb as u32);
            }
        } else {
            let (esc_gaps, ke, ve) = &esc_params[c];
            let mut e = 0usize;
            for &m in &st.mags {
                if m >= 2 {
                    put_rice(&mut w, esc_gaps[e], *ke);
                    put_eg(&mut w, m - 2, *ve);
                    e += 1;
                }
            }
            if h.list.is_some() {
                let (set_gaps, ko) = &sign_params[c];
                for &g in set_gaps {
                    put_rice(&mut w, g, *ko);
                }
            }
            for (&g, &sg) in st.gaps.iter().zip(&st.signs) {
                put_rice(&mut w, g, h.k);
                if h.list.is_none() {
                    w.put(sg as u64, 1);
                }
            }
        }
        let bytes = w.finish();
        h.len = bytes.len();
        regions.push(bytes);
    }
    let mut out = Vec::new();
    if n > 0 {
        let p = Prologue {
            class: heads,
            body: 0,
        };
        p.write(raw, &mut out);
        for r in regions {
            out.extend_from_slice(&r);
        }
    }
    let e = BlockEntry {
        changes: n as u64,
        pos_k: 0,
        values: if raw {
            ValueCoding::Raw
        } else {
            ValueCoding::Step
        },
        val_k: 0,
        bytes: out.len() as u64,
    };
    (e, out)
}

/// The members a decoded block's changes make (for the next delta's
/// context): the steps' signs and sizes; raw values count as large steps up.
pub(crate) fn members_of_decoded(block: &Block<'_>, dec: &Decoded, out: &mut Vec<Member>) {
    out.clear();
    if block.entry.values == ValueCoding::Raw {
        out.extend(dec.index.iter().map(|&i| (i << 2) | BIG));
    } else {
        let wb = block.wb;
        out.extend(
            dec.index
                .iter()
                .zip(&dec.value)
                .map(|(&i, &s)| member(i as u64, s, wb)),
        );
    }
}

/// The members a block's changes make (for the next delta's context): one
/// per change, ascending.
pub(crate) fn members_of(
    kind: crate::dtype::KeyKind,
    wb: usize,
    (s, raw): (&EncodeScratch, bool),
    out: &mut Vec<Member>,
) {
    let mask = word_mask(wb);
    out.clear();
    if raw {
        // As a reader sees them: raw values count as large steps up.
        out.extend(s.index.iter().map(|&i| (i << 2) | BIG));
        return;
    }
    out.extend(
        s.index
            .iter()
            .zip(s.old.iter().zip(&s.new))
            .map(|(&i, (&a, &b))| {
                let step = to_key(kind, wb, b).wrapping_sub(to_key(kind, wb, a)) & mask;
                member(i as u64, step, wb)
            }),
    );
}

/// Diffs one block (`base` → `new`, `W`-byte words) into `s`: the changed
/// block indices, old and new words, ascending; returns the digest change
/// (`ctx.first`: the block's first word in the tensor).
fn stage<const W: usize>(
    platform: crate::platform::Platform,
    ctx: super::Ctx,
    base: &[u8],
    new: &[u8],
    s: &mut EncodeScratch,
) -> u64 {
    use crate::digest::{ChangeBatch, LANES};
    use crate::dtype::load;
    s.index.clear();
    s.old.clear();
    s.new.clear();
    let mut dig = 0u64;
    crate::codec::scan::for_each_change_piece_on(
        platform,
        W,
        base,
        new,
        |first, changed, pa, pb| {
            for chunk in changed.chunks(LANES) {
                let mut batch = ChangeBatch::default();
                for (j, &c) in chunk.iter().enumerate() {
                    let (a, b) = (load::<W>(pa, c as usize), load::<W>(pb, c as usize));
                    let i = (first + c as usize) as u64;
                    s.index.push(i as u32);
                    s.old.push(a);
                    s.new.push(b);
                    (batch.index[j], batch.old[j], batch.new[j]) = (ctx.first + i, a, b);
                }
                dig = dig.wrapping_add(ctx.seed.change_sum_on(platform, &batch));
            }
        },
    );
    dig
}

/// A `compact2`-encoded tensor and the context its changes make for the
/// next delta.
pub struct Encoded2 {
    /// The payload, as `compact`'s.
    pub tensor: super::EncodedTensor,
    /// The tensor's context for the next delta (its changes).
    pub next: super::context::TensorContext,
}

/// Diffs `base` against `new` (`wb`-byte words) and encodes the changes as
/// `compact2` blocks against `context` (the tensor's context; `None`: no
/// context, every change in class 0).
pub fn encode_tensor(
    kind: crate::dtype::KeyKind,
    wb: usize,
    seed: crate::digest::TensorSeed,
    (base, new): (&[u8], &[u8]),
    context: Option<&super::context::TensorContext>,
) -> Encoded2 {
    use rayon::prelude::*;
    let platform = crate::platform::Platform::detect();
    let block_words = super::BLOCK_WORDS;
    let block_bytes = block_words as usize * wb;
    let parts: Vec<(BlockEntry, Vec<u8>, u64, Vec<Member>)> = base
        .par_chunks(block_bytes.max(1))
        .zip(new.par_chunks(block_bytes.max(1)))
        .enumerate()
        .map(|(b, (old, new))| {
            let ctx = super::Ctx {
                kind,
                seed,
                first: b as u64 * block_words,
            };
            let members = context
                .filter(|c| c.block_words == block_words)
                .map_or(&[][..], |c| c.block(b));
            ENCODE.with(|cell| {
                let s = &mut *cell.borrow_mut();
                let dig = crate::with_word_width!(wb, W => stage::<W>(platform, ctx, old, new, s));
                let (e, bytes) = encode(kind, wb, members, s);
                let mut next = Vec::new();
                members_of(kind, wb, (s, e.values == ValueCoding::Raw), &mut next);
                (e, bytes, dig, next)
            })
        })
        .collect();
    let mut tensor = super::EncodedTensor {
        changed: 0,
        digest_change: 0,
        blocks: Vec::with_capacity(parts.len()),
        payload: Vec::with_capacity(parts.iter().map(|p| p.1.len()).sum()),
    };
    let mut next = super::context::TensorContext {
        block_words,
        blocks: Vec::with_capacity(parts.len()),
    };
    for (entry, bytes, dig, members) in parts {
        tensor.changed += entry.changes;
        tensor.digest_change = tensor.digest_change.wrapping_add(dig);
        tensor.payload.extend_from_slice(&bytes);
        tensor.blocks.push(entry);
        next.blocks.push(members);
    }
    Encoded2 { tensor, next }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::context::TensorContext;
    use super::super::testutil::bf16_pair;
    use super::super::{BlockUndo, Ctx, apply_block, undo_block};
    use super::*;
    use crate::digest::TensorSeed;
    use crate::dtype::KeyKind;

    /// Applies an encoded tensor's only block (with `members`) to a copy of
    /// `base`: the words and the digest change, or the error.
    fn apply_one(
        enc: &Encoded2,
        base: &[u8],
        wb: usize,
        members: &[Member],
    ) -> Result<(Vec<u8>, u64)> {
        let block = Block {
            tensor: "t",
            index: 0,
            entry: &enc.tensor.blocks[0],
            stream: &enc.tensor.payload,
            wb,
            words: (base.len() / wb) as u64,
            context: Some(members),
        };
        let ctx = Ctx {
            kind: KeyKind::SignMagnitude,
            seed: TensorSeed(77),
            first: 0,
        };
        let mut blk = base.to_vec();
        let mut undo = BlockUndo::default();
        match apply_block(&block, ctx, &mut blk, &mut undo) {
            Ok(d) => {
                // The undo restores the base exactly.
                let mut back = blk.clone();
                undo_block(&block, ctx.kind, &mut back, &undo);
                assert!(back == base, "undo");
                Ok((blk, d))
            }
            Err(e) => {
                undo_block(&block, ctx.kind, &mut blk, &undo);
                assert!(blk == base, "undo after a failure");
                Err(e)
            }
        }
    }

    fn enc(base: &[u8], new: &[u8], wb: usize, ctx: Option<&TensorContext>) -> Encoded2 {
        encode_tensor(KeyKind::SignMagnitude, wb, TensorSeed(77), (base, new), ctx)
    }

    /// Three versions a → b → c of one BF16 block, where c changes many of
    /// the words b changed (as real traces do).
    fn chain(words: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let h = move |i: usize, k: u64| {
            (i as u64 ^ seed.wrapping_mul(k))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(29)
                .wrapping_mul(0xbf58_476d_1ce4_e5b9)
                >> 40
        };
        let (a, b) = bf16_pair(words, |i| h(i, 1) % 61 == 0);
        let (_, c0) = bf16_pair(words, |i| h(i, 3) % 97 == 0);
        // c: b, plus b's changes again at a third of them, plus c0's.
        let mut c = b.clone();
        for i in 0..words {
            let changed_before = a[2 * i..2 * i + 2] != b[2 * i..2 * i + 2];
            let again = changed_before && h(i, 5) % 3 == 0;
            if again || c0[2 * i..2 * i + 2] != a[2 * i..2 * i + 2] {
                let w = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
                let step = if h(i, 7) % 9 == 0 { 3 } else { 1 };
                let w = if h(i, 11) % 2 == 0 {
                    w.wrapping_add(step)
                } else {
                    w.wrapping_sub(step)
                };
                c[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
        (a, b, c)
    }

    #[test]
    fn round_trips_with_and_without_context() {
        let words = 50_000;
        let (a, b, c) = chain(words, 1);
        // Without context: every change in class 0.
        let e1 = enc(&a, &b, 2, None);
        let (got, dig) = apply_one(&e1, &a, 2, &[]).expect("apply");
        assert!(got == b);
        assert_eq!(dig, e1.tensor.digest_change);
        assert_eq!(e1.next.len() as u64, e1.tensor.changed);
        // With the context of a → b.
        let e2 = enc(&b, &c, 2, Some(&e1.next));
        let (got, dig) = apply_one(&e2, &b, 2, e1.next.block(0)).expect("apply");
        assert!(got == c);
        assert_eq!(dig, e2.tensor.digest_change);
        // The context pays: smaller than without it.
        let plain = enc(&b, &c, 2, None);
        assert!(
            e2.tensor.payload.len() < plain.tensor.payload.len(),
            "{} vs {}",
            e2.tensor.payload.len(),
            plain.tensor.payload.len()
        );
        // And smaller than compact's.
        let v1 = super::super::encode_tensor(KeyKind::SignMagnitude, 2, TensorSeed(77), &b, &c);
        assert!(e2.tensor.payload.len() < v1.payload.len());
        // A delta made with context does not decode without it.
        assert!(apply_one(&e2, &b, 2, &[]).is_err());
    }

    #[test]
    fn raw_values_when_steps_cost_more() {
        let words = 4096;
        let (a, _) = bf16_pair(words, |_| false);
        let mut b = a.clone();
        for i in (0..words).step_by(7) {
            b[2 * i + 1] ^= 0x80; // sign flips: huge steps
        }
        let e = enc(&a, &b, 2, None);
        assert_eq!(e.tensor.blocks[0].values, ValueCoding::Raw);
        let (got, _) = apply_one(&e, &a, 2, &[]).expect("apply");
        assert!(got == b);
        // The next delta, against the raw block's context.
        let mut c = b.clone();
        for i in (0..words).step_by(14) {
            c[2 * i] ^= 1;
        }
        let e2 = enc(&b, &c, 2, Some(&e.next));
        let (got, _) = apply_one(&e2, &b, 2, e.next.block(0)).expect("apply");
        assert!(got == c);
    }

    proptest! {
        /// Any two versions round-trip, with any context (members drawn from
        /// the block), for every word width.
        #[test]
        fn any_change_round_trips(
            wb in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
            words in 1usize..600,
            seed in any::<u64>(),
            density in 0u64..100,
            ctx_density in 0u64..100,
        ) {
            let mut x = seed | 1;
            let mut rnd = move || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let base: Vec<u8> = (0..words * wb).map(|_| rnd() as u8).collect();
            let mut new = base.clone();
            for i in 0..words {
                if rnd() % 100 < density {
                    let r = rnd();
                    let j = i * wb + (r as usize >> 8) % wb;
                    new[j] ^= (r as u8) | 1;
                }
            }
            let mut members: Vec<Member> = Vec::new();
            for i in 0..words as u32 {
                let r = rnd();
                if r % 100 < ctx_density {
                    members.push((i << 2) | ((r >> 32) as u32 & 3));
                }
            }
            let ctx = TensorContext { block_words: super::super::BLOCK_WORDS, blocks: vec![members.clone()] };
            let e = enc(&base, &new, wb, Some(&ctx));
            let (got, dig) = apply_one(&e, &base, wb, &members).expect("apply");
            prop_assert!(got == new);
            prop_assert_eq!(dig, e.tensor.digest_change);
        }

        /// Arbitrary streams, entries and members: the decoder answers, never
        /// panics, and what it accepts is ascending and inside the block.
        #[test]
        fn arbitrary_streams_never_panic(
            stream in proptest::collection::vec(any::<u8>(), 0..80),
            changes in 0u64..40,
            raw in any::<bool>(),
            wb in prop_oneof![Just(1usize), Just(2), Just(8)],
            words in 1u64..300,
            members in proptest::collection::btree_set(0u32..300, 0..50),
            codes in any::<u64>(),
        ) {
            let members: Vec<Member> = members
                .into_iter()
                .filter(|&i| (i as u64) < words)
                .enumerate()
                .map(|(j, i)| (i << 2) | ((codes >> (j % 32 * 2)) as u32 & 3))
                .collect();
            let entry = BlockEntry {
                changes,
                pos_k: 0,
                values: if raw { ValueCoding::Raw } else { ValueCoding::Step },
                val_k: 0,
                bytes: stream.len() as u64,
            };
            let block = Block { tensor: "t", index: 0, entry: &entry, stream: &stream, wb, words, context: Some(&members) };
            let (mut s, mut out) = (Scratch::default(), Decoded::default());
            if decode(&block, &members, &mut s, &mut out).is_ok() {
                prop_assert_eq!(out.index.len() as u64, changes);
                prop_assert!(out.index.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(out.index.iter().all(|&i| (i as u64) < words));
            }
        }
    }

    #[test]
    fn prologue_refusals() {
        let words = 2000;
        let (a, b) = bf16_pair(words, |i| i % 13 == 0);
        let e = enc(&a, &b, 2, None);
        let entry = e.tensor.blocks[0].clone();
        let run = |entry: &BlockEntry, stream: &[u8], members: &[Member]| {
            let block = Block {
                tensor: "t",
                index: 0,
                entry,
                stream,
                wb: 2,
                words: words as u64,
                context: Some(members),
            };
            let (mut s, mut out) = (Scratch::default(), Decoded::default());
            decode(&block, members, &mut s, &mut out).map_err(|e| e.to_string())
        };
        assert!(run(&entry, &e.tensor.payload, &[]).is_ok());
        let err = |entry: &BlockEntry, stream: &[u8]| run(entry, stream, &[]).unwrap_err();
        // A count that does not add up.
        let more = BlockEntry {
            changes: entry.changes + 1,
            ..entry.clone()
        };
        assert!(
            err(&more, &e.tensor.payload).contains("add up"),
            "{}",
            err(&more, &e.tensor.payload)
        );
        // pos_k / val_k must be 0.
        let k = BlockEntry {
            pos_k: 3,
            ..entry.clone()
        };
        assert!(err(&k, &e.tensor.payload).contains("pos_k"));
        // Truncated stream, trailing bytes.
        let cut = &e.tensor.payload[..e.tensor.payload.len() - 1];
        assert!(err(&entry, cut).contains("fill"));
        let mut long = e.tensor.payload.clone();
        long.push(0);
        assert!(err(&entry, &long).contains("fill"));
        // Class 1 entries without members.
        let mut s2 = e.tensor.payload.clone();
        // First byte is class 0's count varint: move one change to class 1 by
        // rewriting the prologue (count 1 in class 1 needs a member).
        s2[0] = s2[0].wrapping_sub(1);
        assert!(run(&entry, &s2, &[]).is_err());
    }
}
