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
//! classes merged, any index named twice refused). The apply reads the
//! classes' entries directly, interleaved by stretches of the block
//! (`Interleave`), and resolves and writes them like any other block's
//! (see `apply`).

use super::context::{BIG, Member, NEG, index, member};
use super::{BATCH, Block, Group, MAX_POS_K, MAX_VAL_K};
use crate::codec::bits::{BitReader, FastWriter, put_rice, window};
use crate::dtype::{to_key, word_mask};
use crate::error::Result;
use crate::format::{BlockEntry, ValueCoding};
use crate::platform::{Platform, prefetch_l2};

pub use super::v2_head::CLASSES;
pub(crate) use super::v2_head::{ClassHead, Prologue};
use super::v2_head::{Escapes, assemble, best_of_three, choose_values, put_eg, rice_guess_k};
use super::v2_table as tb;

/// A block's changes, decoded: ascending block indices and, per change, the
/// masked step (step-coded blocks) or the new word (raw-coded blocks).
#[derive(Default)]
pub struct Decoded {
    /// Block indices, ascending.
    pub index: Vec<u32>,
    /// Masked steps, or new words.
    pub value: Vec<u64>,
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
}

// ---------------------------------------------------------------------------
// Bit-level reading of a region

/// A cursor over one region's bits.
struct Cursor<'a> {
    s: &'a [u8],
    at: u64,
}

impl<'a> Cursor<'a> {
    /// The 64 bits from the cursor on (see [`window`]).
    #[inline(always)]
    fn window(&self) -> Option<u64> {
        window(self.s, self.at)
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
        // From one window when the whole code is in its (at least 57)
        // valid bits: `z` zeros, a one, `z + k` bits.
        if let Some(w) = self.window() {
            let z = w.trailing_zeros();
            if 2 * z + k < 56 {
                let width = z + k;
                let rest = (w >> (z + 1)) & ((1u64 << width) - 1);
                self.at += (z + 1 + width) as u64;
                return Ok(((1u64 << width) | rest) - (1u64 << k));
            }
        }
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

/// Reads codes of a list of `count` ranks below `limit` through table `t`
/// (see [`tb`]), appending their ranks (counted from `*next`) to `ranks`
/// and, for escapes, their magnitudes to `mags`, while at least
/// [`tb::MAX`] are left and each lookup reads whole codes whose ranks are
/// within the class. The caller reads on code by code, which refuses what
/// a lookup stopped at. Both lists have room for [`tb::MAX`] more than
/// `count`.
///
/// Each window's bits are looked up [`tb::BITS`] at a time from a register:
/// the chain from one lookup to the next is a mask, a load and a shift.
#[inline(always)]
fn by_table(
    cur: &mut Cursor<'_>,
    t: &tb::Table,
    (count, limit): (u64, u64),
    (next, ranks, mut mags): (&mut u64, &mut Vec<u64>, Option<&mut Vec<u64>>),
) {
    let (s, mut at) = (cur.s, cur.at);
    let mut read = ranks.len() as u64;
    'windows: while count - read >= tb::MAX as u64 {
        let Some(mut w) = window(s, at) else { break };
        let mut used = 0u64;
        while used + tb::BITS as u64 <= 57 {
            let e = t[(w & ((1 << tb::BITS) - 1)) as usize];
            // Ranks ascend: the last one read is the largest.
            if tb::count(e) == 0 || *next + tb::span(e) > limit || count - read < tb::MAX as u64 {
                at += used;
                break 'windows;
            }
            // All `MAX` written, `count` kept: no branch on how many.
            let n = *next;
            ranks.extend_from_slice(&[n + tb::at(e, 0), n + tb::at(e, 1), n + tb::at(e, 2)]);
            read += tb::count(e);
            ranks.truncate(read as usize);
            if let Some(m) = mags.as_deref_mut() {
                m.extend_from_slice(&[tb::x(e, 0) + 2, tb::x(e, 1) + 2, tb::x(e, 2) + 2]);
                m.truncate(read as usize);
            }
            *next += tb::span(e);
            used += tb::used(e);
            w >>= tb::used(e);
        }
        at += used;
    }
    cur.at = at;
}

/// Reads a list of `count` strictly ascending ranks below `limit`
/// (Rice-coded gaps, parameter `k`): through a table while it reads whole
/// codes (see [`by_table`]), else one code at a time.
#[inline(always)]
fn read_ranks(
    cur: &mut Cursor<'_>,
    (count, k, limit): (u64, u32, u64),
    ranks: &mut Vec<u64>,
) -> std::result::Result<(), &'static str> {
    ranks.clear();
    ranks.reserve(count as usize + tb::MAX);
    let mut next = 0u64;
    let table = tb::table(k, None);
    while (ranks.len() as u64) < count {
        if let Some(t) = table {
            by_table(cur, t, (count, limit), (&mut next, ranks, None));
            if ranks.len() as u64 == count {
                break;
            }
        }
        let g = cur.rice(k, limit >> k)?;
        let r = next + g;
        if r >= limit {
            return Err("listed entry beyond the class");
        }
        ranks.push(r);
        next = r + 1;
    }
    Ok(())
}

/// Reads class head `h`'s escapes and listed signs from `cur` into `s`,
/// compiled with BMI where the CPU has it (the lists are read one code
/// after another: counting zeros and shifting by a register are on their
/// critical path).
fn read_lists(
    cur: &mut Cursor<'_>,
    h: &ClassHead,
    top: u32,
    s: &mut ClassBufs,
) -> std::result::Result<(), &'static str> {
    #[cfg(target_arch = "x86_64")]
    if Platform::detect().has(crate::platform::Level::Avx2) {
        // SAFETY: `Platform::detect()` found every feature `read_lists_bmi`
        // is compiled with (AVX2 implies BMI1, BMI2 and LZCNT here, as for
        // the apply's `run_v2_avx2`); the function is otherwise safe code.
        return unsafe { read_lists_bmi(cur, h, top, s) };
    }
    read_lists_on(cur, h, top, s)
}

/// [`read_lists`] compiled with BMI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi1,bmi2,lzcnt")]
fn read_lists_bmi(
    cur: &mut Cursor<'_>,
    h: &ClassHead,
    top: u32,
    s: &mut ClassBufs,
) -> std::result::Result<(), &'static str> {
    read_lists_on(cur, h, top, s)
}

#[inline(always)]
fn read_lists_on(
    cur: &mut Cursor<'_>,
    h: &ClassHead,
    top: u32,
    s: &mut ClassBufs,
) -> std::result::Result<(), &'static str> {
    // The lists are read into locals and put back at the end: pushing
    // through `s` stored each list's length to memory per code.
    let take = std::mem::take::<Vec<u64>>;
    let (mut esc_rank, mut esc_mag, mut list_rank) = (
        take(&mut s.esc_rank),
        take(&mut s.esc_mag),
        take(&mut s.list_rank),
    );
    let escapes = (h.esc, h.ke, h.ve, h.n, top);
    let r = read_escapes(cur, escapes, (&mut esc_rank, &mut esc_mag)).and_then(|()| {
        list_rank.clear();
        match h.list {
            Some(t) => read_ranks(cur, (t, h.ko, h.n), &mut list_rank),
            None => Ok(()),
        }
    });
    // Each list ends in a sentinel past every rank (see [`ClassBufs`]).
    esc_rank.push(u64::MAX);
    esc_mag.push(1);
    list_rank.push(u64::MAX);
    (s.esc_rank, s.esc_mag, s.list_rank) = (esc_rank, esc_mag, list_rank);
    r
}

/// Reads a class's `count` escapes: strictly ascending entry ranks below
/// `limit` (Rice-coded gaps, parameter `ke`), each followed by its step's
/// magnitude less 2 (Exp-Golomb, order `ve`), the magnitude at most
/// 2^`top`. As many escapes as fit whole in one window's 57 valid bits are
/// read from it (usually two or three): the loop's critical path is then
/// shift, count, shift, count per escape, with no load. An escape that
/// does not fit at the start of a window is read by [`Cursor::rice`] and
/// [`Cursor::eg`]. Either way the same checks, in the same order.
#[inline(always)]
fn read_escapes(
    cur: &mut Cursor<'_>,
    (count, ke, ve, limit, top): (u64, u32, u32, u64, u32),
    (ranks, mags): (&mut Vec<u64>, &mut Vec<u64>),
) -> std::result::Result<(), &'static str> {
    ranks.clear();
    mags.clear();
    ranks.reserve(count as usize + tb::MAX);
    mags.reserve(count as usize + tb::MAX);
    // A table's magnitudes go up to 257: words of 16 bits or more.
    let table = tb::table(ke, Some(ve)).filter(|_| top >= 9);
    let q_limit = limit >> ke;
    let low = (1u64 << ke) - 1;
    let mut next = 0u64;
    let mut read = 0u64;
    // The magnitude from its code, after the rank's own check.
    let magnitude = |x: u64| -> std::result::Result<u64, &'static str> {
        let m = x.checked_add(2).ok_or("step larger than the word")?;
        if m > 1u64 << top {
            return Err("step larger than the word");
        }
        Ok(m)
    };
    while read < count {
        if let Some(t) = table {
            by_table(cur, t, (count, limit), (&mut next, ranks, Some(&mut *mags)));
            read = ranks.len() as u64;
            if read == count {
                break;
            }
        }
        let mut used = 0u32;
        if let Some(w0) = cur.window() {
            while read < count {
                // From bit `used` of the window: `tz` zeros, a one and `ke`
                // bits; then `z` zeros, a one and `z + ve` bits, all within
                // the window's 57 valid bits.
                let w = w0 >> used;
                let tz = w.trailing_zeros();
                let rice = tz + 1 + ke;
                if tz as u64 > q_limit || used + rice > 55 {
                    break;
                }
                let rest = w >> rice;
                let z = rest.trailing_zeros();
                let width = z + ve;
                let total = rice + z + 1 + width;
                if used + total > 57 {
                    break;
                }
                let g = ((tz as u64) << ke) | ((w >> (tz + 1)) & low);
                let x =
                    ((1u64 << width) | ((rest >> (z + 1)) & ((1u64 << width) - 1))) - (1u64 << ve);
                let r = next + g;
                if r >= limit {
                    // Refused below, after the same reading.
                    break;
                }
                let m = magnitude(x)?;
                ranks.push(r);
                mags.push(m);
                next = r + 1;
                used += total;
                read += 1;
            }
            cur.at += used as u64;
        }
        if used == 0 && read < count {
            let r = next + cur.rice(ke, q_limit)?;
            if r >= limit {
                return Err("listed entry beyond the class");
            }
            let m = magnitude(cur.eg(ve)?)?;
            ranks.push(r);
            mags.push(m);
            next = r + 1;
            read += 1;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Decoding

/// A block's decoding plan: its prologue, checked against the block and its
/// context, where each class's region starts, and the members of classes 1
/// and 2 (indices into the context's members, ascending).
pub(crate) struct Plan {
    pub(crate) p: Prologue,
    start: [usize; CLASSES],
    pub(crate) raw: bool,
}

/// Scratch the decoder reuses across blocks.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Indices into the context's members of classes 1 and 2, each
    /// ascending (`class_len` of each; the lists keep their length, what
    /// they hold past it is stale).
    class_order: [Vec<u32>; 2],
    class_len: [usize; 2],
    /// Each class's escapes and listed signs, read when its reader is made.
    bufs: [ClassBufs; CLASSES],
    /// What the block's entries did (see [`Record`]).
    pub(crate) record: Record,
    /// [`decode`]'s per-class entries before the merge.
    class_index: [Vec<u32>; CLASSES],
    class_value: [Vec<u64>; CLASSES],
}

/// One class's escapes' ranks and magnitudes and its listed signs' ranks,
/// each list followed by a sentinel (rank `u64::MAX`, magnitude 1), so that
/// the decoder reads the next one without a check for the end.
#[derive(Default)]
struct ClassBufs {
    esc_rank: Vec<u64>,
    esc_mag: Vec<u64>,
    list_rank: Vec<u64>,
}

/// The order the apply decodes a block's classes in: groups of up to
/// [`BATCH`](super::BATCH) entries, taken from each class in turn while the
/// class's last entry read is below a bound that advances
/// [`Interleave::SPAN`] words at a time. The three classes' changes to one
/// stretch of the block are applied together, while its cache lines are
/// held, rather than in three passes over the block. [`for_each_applied`]
/// follows the same order.
pub(crate) struct Interleave {
    bound: u64,
    last: [u64; CLASSES],
    c: usize,
}

impl Interleave {
    /// Words per stretch: 64 KiB of 2-byte words, well inside the
    /// second-level cache.
    const SPAN: u64 = 1 << 15;

    pub(crate) fn new() -> Interleave {
        Interleave {
            bound: Self::SPAN,
            last: [0; CLASSES],
            c: 0,
        }
    }

    /// The class whose next group comes next (`remaining`: each class's
    /// entries not yet read), or `None` when none are left.
    pub(crate) fn next(&mut self, remaining: [u64; CLASSES]) -> Option<usize> {
        if remaining.iter().all(|&r| r == 0) {
            return None;
        }
        loop {
            let c = self.c;
            if remaining[c] > 0 && self.last[c] < self.bound {
                return Some(c);
            }
            self.c += 1;
            if self.c == CLASSES {
                self.c = 0;
                self.bound += Self::SPAN;
            }
        }
    }

    /// Class `c`'s group ended at block index `last`.
    pub(crate) fn took(&mut self, c: usize, last: u64) {
        self.last[c] = last;
    }
}

/// What a block's entries did, as far as the next context and the check of
/// [`finish`] need: class 0's changes as members (ascending), and per
/// context member, whether it changed again (`0`: no; else its new code
/// `| 4`): `again`'s first entries, one per member (past them it is stale).
#[derive(Default)]
pub(crate) struct Record {
    pub(crate) c0: Vec<Member>,
    pub(crate) again: Vec<u8>,
    /// [`finish`]'s scratch: the members that changed again.
    kept: Vec<Member>,
}

thread_local! {
    /// Per-thread decode scratch and output, reused across blocks.
    static DECODE: std::cell::RefCell<(Scratch, Decoded)> =
        std::cell::RefCell::new((Scratch::default(), Decoded::default()));
}

/// Runs `f` with this thread's decode scratch, or with a fresh one when the
/// thread's is in use: a callback of [`super::decode_block`] may decode
/// another `compact2` block on the same thread.
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut Scratch, &mut Decoded) -> T) -> T {
    DECODE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut guard) => {
            let (s, d) = &mut *guard;
            f(s, d)
        }
        Err(_) => f(&mut Scratch::default(), &mut Decoded::default()),
    })
}

impl Plan {
    /// Checks `block`'s prologue against the block and `members` (its
    /// context), sorts the members of classes 1 and 2 into `s`, and readies
    /// `s.record` for the block (see [`Record::reset`]).
    pub(crate) fn new(block: &Block<'_>, members: &[Member], s: &mut Scratch) -> Result<Plan> {
        Self::new_raw(block, members, s).map_err(|what| block.error(what))
    }

    fn new_raw(
        block: &Block<'_>,
        members: &[Member],
        s: &mut Scratch,
    ) -> std::result::Result<Plan, &'static str> {
        if block.words > 1 << 32 {
            return Err("compact2 blocks have at most 2^32 words");
        }
        // Classes 1 and 2: the members without and with the `big` bit. The
        // lists keep their length (what they hold past the members is
        // stale), so that only growing them writes zeros.
        s.class_len = [0, 0];
        s.record.reset(members.len(), block.entry.changes);
        if block.entry.changes > 0 && !members.is_empty() {
            let [small, big] = &mut s.class_order;
            for order in [&mut *small, &mut *big] {
                if order.len() < members.len() + 16 {
                    order.resize(members.len() + 16, 0);
                }
            }
            let again = &mut s.record.again[..members.len()];
            let (a, b) = super::merge::split(Platform::detect(), members, (small, big), again);
            s.class_len = [a, b];
        } else {
            s.record.again[..members.len()].fill(0);
        }
        let space = [block.words, s.class_len[0] as u64, s.class_len[1] as u64];
        let p = Prologue::parse_raw(block.stream, block.entry, block.wb, space)?;
        let mut start = [0usize; CLASSES];
        let mut at = p.body;
        for (c, h) in p.class.iter().enumerate() {
            start[c] = at;
            at += h.len;
        }
        Ok(Plan {
            p,
            start,
            raw: block.entry.values == ValueCoding::Raw,
        })
    }

    /// A reader of class `c`'s entries: reads its escapes and listed signs
    /// into `s`, then hands out the entries one by one.
    pub(crate) fn reader<'r>(
        &self,
        c: usize,
        block: &Block<'r>,
        members: &'r [Member],
        s: &'r mut Scratch,
    ) -> std::result::Result<ClassReader<'r>, &'static str> {
        let orders = (&s.class_order, s.class_len);
        self.reader_in(c, block, members, orders, &mut s.bufs[c])
    }

    /// Readers of the three classes at once (see [`Interleave`]).
    pub(crate) fn readers<'r>(
        &self,
        block: &Block<'r>,
        members: &'r [Member],
        s: &'r mut Scratch,
    ) -> std::result::Result<[ClassReader<'r>; CLASSES], &'static str> {
        let orders = (&s.class_order, s.class_len);
        let [b0, b1, b2] = &mut s.bufs;
        Ok([
            self.reader_in(0, block, members, orders, b0)?,
            self.reader_in(1, block, members, orders, b1)?,
            self.reader_in(2, block, members, orders, b2)?,
        ])
    }

    /// [`Plan::reader`] over the classes' member orders (`order`, with the
    /// lengths in use) and class `c`'s buffers.
    fn reader_in<'r>(
        &self,
        c: usize,
        block: &Block<'r>,
        members: &'r [Member],
        (order, [small, big]): (&'r [Vec<u32>; 2], [usize; 2]),
        s: &'r mut ClassBufs,
    ) -> std::result::Result<ClassReader<'r>, &'static str> {
        let h = self.p.class[c];
        let region = &block.stream[self.start[c]..self.start[c] + h.len];
        let mut cur = Cursor { s: region, at: 0 };
        let class_members = match c {
            0 => ClassMembers::default(),
            1 => ClassMembers {
                order: &order[0][..small],
            },
            _ => ClassMembers {
                order: &order[1][..big],
            },
        };
        let space = if c == 0 {
            block.words
        } else {
            class_members.order.len() as u64
        };
        let top = block.wb as u32 * 8 - 1;
        if h.n > 0 && !self.raw {
            read_lists(&mut cur, &h, top, s)?;
        } else {
            s.esc_rank.clear();
            s.esc_mag.clear();
            s.list_rank.clear();
            s.esc_rank.push(u64::MAX);
            s.esc_mag.push(1);
            s.list_rank.push(u64::MAX);
        }
        Ok(ClassReader {
            next_esc: s.esc_rank[0],
            next_list: s.list_rank[0],
            cur,
            c,
            h,
            q_limit: space >> h.k,
            space,
            raw: self.raw,
            bits: 8 * block.wb as u32,
            mask: word_mask(block.wb),
            r: 0,
            next: 0,
            e: 0,
            l: 0,
            esc_rank: &s.esc_rank,
            esc_mag: &s.esc_mag,
            listed: &s.list_rank,
            class_members,
            members,
        })
    }
}

/// Hands out one class's entries in order (see [`Plan::reader`]).
pub(crate) struct ClassReader<'r> {
    cur: Cursor<'r>,
    c: usize,
    h: ClassHead,
    q_limit: u64,
    space: u64,
    raw: bool,
    bits: u32,
    mask: u64,
    /// Entries read, and the position (class 0) or rank the next gap
    /// counts from.
    r: u64,
    next: u64,
    /// Escapes and listed signs consumed, and the rank of the next one.
    e: usize,
    l: usize,
    next_esc: u64,
    next_list: u64,
    esc_rank: &'r [u64],
    esc_mag: &'r [u64],
    listed: &'r [u64],
    class_members: ClassMembers<'r>,
    members: &'r [Member],
}

/// The members of a class, by rank: `order[p]`.
#[derive(Clone, Copy, Default)]
struct ClassMembers<'r> {
    order: &'r [u32],
}

impl ClassMembers<'_> {
    /// The member index of rank `p` (`p` < the class's size).
    #[inline(always)]
    fn get(&self, p: u64) -> u32 {
        self.order[p as usize]
    }
}

/// One decoded entry: block index, value (masked step or new word) and,
/// for classes 1 and 2, the index of its context member.
pub(crate) type Entry = (u32, u64, u32);

impl ClassReader<'_> {
    /// Entries not yet read.
    #[inline(always)]
    pub(crate) fn remaining(&self) -> u64 {
        self.h.n - self.r
    }

    /// The next entry.
    #[inline(always)]
    pub(crate) fn next_entry(&mut self) -> std::result::Result<Entry, &'static str> {
        let k = self.h.k;
        let bit_per_entry = !self.raw && self.h.list.is_none();
        // Gap and sign bit from one window where they fit.
        let (g, mut neg) = match self.cur.window() {
            Some(w)
                if (w.trailing_zeros() as u64) <= self.q_limit && w.trailing_zeros() + k <= 54 =>
            {
                let tz = w.trailing_zeros();
                let g = ((tz as u64) << k) | ((w >> (tz + 1)) & ((1u64 << k) - 1));
                let used = tz + 1 + k;
                let sign = u64::from(bit_per_entry);
                self.cur.at += used as u64 + sign;
                (g, (w >> used) & sign)
            }
            _ => {
                let g = self.cur.rice(k, self.q_limit)?;
                (g, if bit_per_entry { self.cur.bits(1)? } else { 0 })
            }
        };
        let p = self.next + g;
        if p >= self.space {
            return Err(if self.c == 0 {
                "position beyond the block"
            } else {
                "rank beyond the class's members"
            });
        }
        self.next = p + 1;
        let r = self.r;
        self.r += 1;
        let (i, j, last_neg) = if self.c == 0 {
            (p as u32, 0, 0)
        } else {
            let j = self.class_members.get(p);
            let m = self.members[j as usize];
            (index(m), j, ((m & NEG) >> 1) as u64)
        };
        if self.raw {
            return Ok((i, self.cur.bits(self.bits)?, j));
        }
        if r == self.next_list {
            neg = 1;
            self.l += 1;
            self.next_list = self.listed[self.l];
        }
        let mut m = 1u64;
        if r == self.next_esc {
            m = self.esc_mag[self.e];
            self.e += 1;
            self.next_esc = self.esc_rank[self.e];
        }
        neg ^= last_neg;
        Ok((
            i,
            ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & self.mask,
            j,
        ))
    }

    /// Reads the next `g.count` entries into `g` (block indices and values,
    /// as [`ClassReader::next_entry`] hands them out), prefetching each
    /// entry's word of `blk` (`W`-byte words) and noting it in `rec`. On an
    /// error, `g.count` is set to the entries read before it.
    #[inline(always)]
    pub(crate) fn fill<const W: usize>(
        &mut self,
        g: &mut Group,
        blk: &[u8],
        rec: &mut Record,
    ) -> std::result::Result<(), &'static str> {
        debug_assert_eq!(self.bits, 8 * W as u32);
        match (self.raw, self.c == 0, self.h.list.is_none()) {
            (true, _, _) => self.fill_any::<W>(g, blk, rec),
            (false, true, true) => self.fill_steps::<W, true, true>(g, blk, rec),
            (false, true, false) => self.fill_steps::<W, true, false>(g, blk, rec),
            (false, false, true) => self.fill_steps::<W, false, true>(g, blk, rec),
            (false, false, false) => self.fill_steps::<W, false, false>(g, blk, rec),
        }
    }

    /// [`ClassReader::fill`] one entry at a time (raw-coded blocks).
    fn fill_any<const W: usize>(
        &mut self,
        g: &mut Group,
        blk: &[u8],
        rec: &mut Record,
    ) -> std::result::Result<(), &'static str> {
        for j in 0..g.count.min(BATCH) {
            let e = match self.next_entry() {
                Ok(e) => e,
                Err(what) => {
                    g.count = j;
                    return Err(what);
                }
            };
            prefetch_l2(blk, e.0 as usize * W);
            (g.index[j], g.step[j]) = (e.0 as u64, e.1);
            rec.note(self.c, e, self.raw, W);
        }
        Ok(())
    }

    /// [`ClassReader::fill`] for a step-coded class: class 0 (`C0`) or a
    /// class of members, one sign bit per entry (`BIT`) or a list. The
    /// same reading as [`ClassReader::next_entry`], with the reader's state
    /// in locals.
    ///
    /// The bit position is a plain local, put in a [`Cursor`] only on the
    /// slow path: a cursor borrowed by the (not inlined) slow path lived on
    /// the stack, and the loop's critical path, position to window to
    /// position, went through a store and a load per entry.
    // `j` indexes the group's arrays and class 0's members alike.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    fn fill_steps<const W: usize, const C0: bool, const BIT: bool>(
        &mut self,
        g: &mut Group,
        blk: &[u8],
        rec: &mut Record,
    ) -> std::result::Result<(), &'static str> {
        let (k, q_limit, mask) = (self.h.k, self.q_limit, self.mask);
        let (order, members) = (self.class_members.order, self.members);
        // A class of members ranks `order`'s entries: its space is that
        // list's length, stated so, so that the check `p < space` is the
        // only bounds check on `order[p]`.
        let space = if C0 { self.space } else { order.len() as u64 };
        debug_assert_eq!(space, self.space);
        let (esc_rank, esc_mag, listed) = (self.esc_rank, self.esc_mag, self.listed);
        let s = self.cur.s;
        let mut at = self.cur.at;
        let (mut next, mut r, mut e, mut l) = (self.next, self.r, self.e, self.l);
        let (mut next_esc, mut next_list) = (self.next_esc, self.next_list);
        let sign = u64::from(BIT);
        let low = (1u64 << k) - 1;
        let count = g.count.min(BATCH);
        // As long as `members` (`Record::reset`), stated so, so that the
        // check on `members[jm]` covers `again[jm]`.
        let again = &mut rec.again[..if C0 { 0 } else { members.len() }];
        // Class 0's members are gathered in a group-sized array and appended
        // whole (a fixed-size copy, the unused part cut after): no capacity
        // check and length update per entry, and no call to zero the room.
        let c0_n = rec.c0.len();
        let mut c0 = [0 as Member; BATCH];
        let mut result = Ok(());
        let mut done = count;
        for j in 0..count {
            // Gap and sign bit from one window where they fit.
            let fast = window(s, at).filter(|w| {
                let tz = w.trailing_zeros();
                (tz as u64) <= q_limit && tz + k <= 54
            });
            let (gap, mut neg) = match fast {
                Some(w) => {
                    let tz = w.trailing_zeros();
                    let used = tz + 1 + k;
                    at += used as u64 + sign;
                    (
                        ((tz as u64) << k) | ((w >> (tz + 1)) & low),
                        (w >> used) & sign,
                    )
                }
                None => {
                    let mut cur = Cursor { s, at };
                    let x = cur
                        .rice(k, q_limit)
                        .and_then(|g| Ok((g, if BIT { cur.bits(1)? } else { 0 })));
                    at = cur.at;
                    match x {
                        Ok(x) => x,
                        Err(what) => {
                            done = j;
                            result = Err(what);
                            break;
                        }
                    }
                }
            };
            let p = next + gap;
            if p >= space {
                done = j;
                result = Err(if C0 {
                    "position beyond the block"
                } else {
                    "rank beyond the class's members"
                });
                break;
            }
            next = p + 1;
            let (i, jm, last_neg) = if C0 {
                (p as u32, 0, 0)
            } else {
                let jm = order[p as usize];
                let m = members[jm as usize];
                (index(m), jm, ((m & NEG) >> 1) as u64)
            };
            // Without branches: whether an entry is listed or escaped is
            // data, about as often one way as the other in some classes.
            // (The lists end in a sentinel rank no entry has, so `l` and
            // `e` stay within them.)
            if !BIT {
                let hit = r == next_list;
                neg |= u64::from(hit);
                l += usize::from(hit);
                next_list = listed[l];
            }
            let hit = r == next_esc;
            let m = std::hint::select_unpredictable(hit, esc_mag[e], 1);
            e += usize::from(hit);
            next_esc = esc_rank[e];
            r += 1;
            neg ^= last_neg;
            let v = ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & mask;
            prefetch_l2(blk, i as usize * W);
            (g.index[j], g.step[j]) = (i as u64, v);
            // `member(0, v, W)`: the step is ±1 exactly when `m` is 1.
            let code = ((((v >> (8 * W - 1)) & 1) as u32) << 1) | u32::from(m != 1);
            debug_assert_eq!(code, member(0, v, W));
            if C0 {
                c0[j] = (i << 2) | code;
            } else {
                again[jm as usize] = (code | 4) as u8;
            }
        }
        if C0 {
            rec.c0.extend_from_slice(&c0);
            rec.c0.truncate(c0_n + done);
        }
        g.count = g.count.min(done);
        self.cur.at = at;
        (self.next, self.r, self.e, self.l) = (next, r, e, l);
        (self.next_esc, self.next_list) = (next_esc, next_list);
        result
    }

    /// After the last entry: whether the region ends cleanly.
    pub(crate) fn end(&self) -> std::result::Result<(), &'static str> {
        if self.cur.clean_end() {
            Ok(())
        } else {
            Err("trailing bytes after the last change")
        }
    }
}

/// The context code of an entry's change: its step's sign and size; a raw
/// value counts as a large step up.
#[inline(always)]
pub(crate) fn code(value: u64, raw: bool, wb: usize) -> u32 {
    if raw { BIG } else { member(0, value, wb) }
}

impl Record {
    /// Sized for a block against `members` members: `again` holds at least
    /// one flag per member, left as they were. [`Plan::new`] zeroes the
    /// first `members`, in the class split where there is one (no pass of
    /// its own). `again` keeps its greatest length, so that only growing it
    /// writes zeros (cutting it to a small block's members and growing it
    /// back for the next large one zeroed the difference each time).
    fn reset(&mut self, members: usize, changes: u64) {
        self.c0.clear();
        self.c0.reserve(changes.min(1 << 24) as usize);
        if self.again.len() < members {
            self.again.resize(members, 0);
        }
    }

    /// Notes entry `(i, value, j)` of class `c`.
    #[inline(always)]
    pub(crate) fn note(&mut self, c: usize, (i, v, j): Entry, raw: bool, wb: usize) {
        let code = code(v, raw, wb);
        if c == 0 {
            self.c0.push((i << 2) | code);
        } else {
            self.again[j as usize] = (code | 4) as u8;
        }
    }
}

/// After a block's entries (noted in `rec`): checks that no class-0 change is
/// a member that changed again (a word changed twice), and with `out`,
/// writes the block's members for the next context (class 0's changes and
/// the members that changed again, ascending).
///
/// With `out`, also returns the members' checksum as block `block` of the
/// tensor with context seed `seed` (`out`'s `(seed, block)`), summed as they
/// are written.
pub(crate) fn finish(
    members: &[Member],
    rec: &mut Record,
    out: Option<(&mut Vec<Member>, (u64, u64))>,
) -> std::result::Result<u64, &'static str> {
    let again = &rec.again[..members.len()];
    let platform = Platform::detect();
    if rec.kept.len() < members.len() + 16 {
        rec.kept.resize(members.len() + 16, 0);
    }
    let s = super::merge::survivors(platform, members, again, &mut rec.kept);
    let mut scratch = Vec::new();
    let (out, at) = match out {
        Some((out, at)) => {
            let want = rec.c0.len() + s;
            if out.capacity() < want {
                *out = super::context::pool::take(want);
            }
            (out, at)
        }
        None => {
            scratch = super::context::pool::take(rec.c0.len() + s);
            (&mut scratch, (0, 0))
        }
    };
    let (dup, sum) = super::merge::merge(platform, &rec.c0, &rec.kept[..s], out, at);
    if dup {
        out.clear();
    }
    // `out` may borrow `scratch`: the test is made again once it is given
    // back.
    super::context::pool::give(scratch);
    if dup {
        return Err("a word changed twice (a class-0 position is a member that changed again)");
    }
    Ok(sum)
}

/// The straightforward merge [`finish`] must agree with.
#[cfg(test)]
fn finish_reference(
    members: &[Member],
    rec: &Record,
    out: Option<&mut Vec<Member>>,
) -> std::result::Result<(), &'static str> {
    let mut all = rec.c0.clone();
    for (&m, &f) in members.iter().zip(&rec.again) {
        if f != 0 {
            all.push((m & !3) | (f as u32 & 3));
        }
    }
    all.sort_by_key(|&m| m >> 2);
    if all.windows(2).any(|w| w[0] >> 2 == w[1] >> 2) {
        return Err("a word changed twice (a class-0 position is a member that changed again)");
    }
    if let Some(out) = out {
        *out = all;
    }
    Ok(())
}

/// Decodes a `compact2` block into `out`, in ascending index order, given
/// the block's context members (`members`, ascending; empty without
/// context). Every malformed case is an error naming the block. (The apply
/// reads the classes interleaved instead, see [`Interleave`].)
pub(crate) fn decode(
    block: &Block<'_>,
    members: &[Member],
    scratch: &mut Scratch,
    out: &mut Decoded,
) -> Result<()> {
    decode_raw(block, members, scratch, out).map_err(|what| block.error(what))
}

fn decode_raw(
    block: &Block<'_>,
    members: &[Member],
    s: &mut Scratch,
    out: &mut Decoded,
) -> std::result::Result<(), &'static str> {
    out.index.clear();
    out.value.clear();
    let plan = Plan::new_raw(block, members, s)?;
    let mut idx = std::mem::take(&mut s.class_index);
    let mut val = std::mem::take(&mut s.class_value);
    let mut rec = std::mem::take(&mut s.record);
    let mut result = Ok(());
    for c in 0..CLASSES {
        idx[c].clear();
        val[c].clear();
        let mut rd = match plan.reader(c, block, members, s) {
            Ok(rd) => rd,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        idx[c].reserve(rd.remaining() as usize);
        val[c].reserve(rd.remaining() as usize);
        while rd.remaining() > 0 {
            match rd.next_entry() {
                Ok(e) => {
                    idx[c].push(e.0);
                    val[c].push(e.1);
                    rec.note(c, e, plan.raw, block.wb);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            result = rd.end();
        }
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() {
        result = finish(members, &mut rec, None).map(|_| ());
    }
    if result.is_ok() {
        merge(&idx, &val, out);
    }
    s.class_index = idx;
    s.class_value = val;
    s.record = rec;
    result
}

/// Calls `f(index, value)` for the first `limit` entries of a block in the
/// order the apply writes them (the classes' groups as [`Interleave`] takes
/// them), stopping at the first malformed entry (the undo of an apply that
/// failed after writing some).
pub(crate) fn for_each_applied(
    block: &Block<'_>,
    members: &[Member],
    limit: u64,
    mut f: impl FnMut(u32, u64),
) {
    with_scratch(|s, _| {
        let Ok(plan) = Plan::new_raw(block, members, s) else {
            return;
        };
        let Ok(mut rd) = plan.readers(block, members, s) else {
            return;
        };
        let mut left = limit;
        let mut order = Interleave::new();
        while let Some(c) = order.next(rd.each_ref().map(|r| r.remaining())) {
            let count = rd[c].remaining().min(super::BATCH as u64);
            let mut last = 0;
            for _ in 0..count {
                if left == 0 {
                    return;
                }
                let Ok((i, v, _)) = rd[c].next_entry() else {
                    return;
                };
                f(i, v);
                left -= 1;
                last = i;
            }
            order.took(c, last as u64);
        }
    })
}

/// Merges the three classes' entries (each ascending, all distinct) into
/// `out`.
fn merge(idx: &[Vec<u32>; CLASSES], val: &[Vec<u64>; CLASSES], out: &mut Decoded) {
    let n = idx.iter().map(Vec::len).sum();
    out.index.reserve(n);
    out.value.reserve(n);
    let mut at = [0usize; CLASSES];
    let head = |c: usize, at: &[usize; CLASSES]| idx[c].get(at[c]).map_or(u64::MAX, |&p| p as u64);
    for _ in 0..n {
        let (h0, h1, h2) = (head(0, &at), head(1, &at), head(2, &at));
        let c = if h0 <= h1 && h0 <= h2 {
            0
        } else if h1 <= h2 {
            1
        } else {
            2
        };
        out.index.push(idx[c][at[c]]);
        out.value.push(val[c][at[c]]);
        at[c] += 1;
    }
}

// ---------------------------------------------------------------------------
// Encoding

/// One class's staged entries: block indices, gaps (positions or member
/// ranks) and steps with the sign relative to the member's last step
/// (classes 1 and 2; class 0: the step itself).
///
/// The vectors keep their length across blocks (what they hold past `n` is
/// stale): the staging loop writes entry `n` in place, with no capacity
/// check or length update per push, and only growing them writes zeros.
#[derive(Default)]
pub(crate) struct Staged {
    /// Entries staged.
    n: usize,
    /// The position or rank the next entry's gap counts from.
    next: u32,
    idx: Vec<u32>,
    gap: Vec<u32>,
    step: Vec<u64>,
}

impl Staged {
    /// Empty, for a new block.
    fn clear(&mut self) {
        (self.n, self.next) = (0, 0);
    }

    /// Room for `more` entries past `n`.
    #[inline(always)]
    fn room(&mut self, more: usize) {
        let want = self.n + more;
        if self.idx.len() < want {
            let len = want.max(2 * self.idx.len());
            self.idx.resize(len, 0);
            self.gap.resize(len, 0);
            self.step.resize(len, 0);
        }
    }

    /// Stages an entry at position or rank `at` (above the previous one's).
    #[inline(always)]
    fn put(&mut self, i: u32, at: u32, step: u64) {
        let k = self.n;
        self.idx[k] = i;
        self.gap[k] = at - self.next;
        self.step[k] = step;
        self.next = at + 1;
        self.n = k + 1;
    }

    fn idx(&self) -> &[u32] {
        &self.idx[..self.n]
    }

    fn gaps(&self) -> &[u32] {
        &self.gap[..self.n]
    }

    fn steps(&self) -> &[u64] {
        &self.step[..self.n]
    }

    /// The sum of the gaps: the last position or rank plus one, less the
    /// entries.
    fn gap_sum(&self) -> u64 {
        if self.n == 0 {
            0
        } else {
            self.next as u64 - self.n as u64
        }
    }
}

/// Per-thread encoder scratch: each class's entries, and the block's
/// members for the next context (the first `next_n` of `next`, which keeps
/// its length as [`Staged`]'s vectors do).
#[derive(Default)]
pub(crate) struct EncodeScratch {
    class: [Staged; CLASSES],
    next: Vec<Member>,
    next_n: usize,
}

impl EncodeScratch {
    /// The block's members for the next context.
    pub(crate) fn next(&self) -> &[Member] {
        &self.next[..self.next_n]
    }
}

thread_local! {
    pub(crate) static ENCODE: std::cell::RefCell<EncodeScratch> =
        std::cell::RefCell::new(EncodeScratch::default());
}

/// Bits of the Rice codes of `gaps` with parameters `k − 1`, `k`, `k + 1`
/// (one pass).
fn rice_costs(gaps: &[u32], k: u32) -> [u64; 3] {
    let km = k.saturating_sub(1);
    let (mut a, mut b, mut c) = (0u64, 0u64, 0u64);
    for &g in gaps {
        a += (g >> km) as u64;
        b += (g >> k) as u64;
        c += (g >> (k + 1)) as u64;
    }
    let n = gaps.len() as u64;
    [
        a + n * (km as u64 + 1),
        b + n * (k as u64 + 1),
        c + n * (k as u64 + 2),
    ]
}

/// The best Rice parameter for `gaps` (summing to `sum`) and its cost: the
/// estimate's choice and its neighbours, counted exactly.
fn best_rice(gaps: &[u32], sum: u64) -> (u32, u64) {
    if gaps.is_empty() {
        return (0, 0);
    }
    let k = rice_guess_k(gaps.len() as u64, sum).min(MAX_POS_K as u32 - 1);
    best_of_three(k, rice_costs(gaps, k))
}

/// A class's coding choices beyond its prologue head: the escapes' rank
/// gaps and the listed signs' rank gaps.
struct Choice {
    head: ClassHead,
    /// Bits of the class's step-coded region, and of its raw-coded one.
    step_bits: u64,
    raw_bits: u64,
}

/// Chooses a class's parameters from its staged entries (`wb`-byte words).
fn choose(st: &Staged, wb: usize) -> Choice {
    let n = st.n as u64;
    let mut h = ClassHead {
        n,
        ..ClassHead::default()
    };
    if n == 0 {
        return Choice {
            head: h,
            step_bits: 0,
            raw_bits: 0,
        };
    }
    let (k, pos_bits) = best_rice(st.gaps(), st.gap_sum());
    h.k = k;
    // Escapes, signs: counts, rank-gap sums, magnitudes.
    let top = wb as u32 * 8 - 1;
    let mut esc = Escapes::default();
    let mut esc_next = 0u64;
    let (mut set, mut set_sum, mut set_next) = (0u64, 0u64, 0u64);
    for (r, &s) in st.steps().iter().enumerate() {
        let r = r as u64;
        let m = crate::dtype::step_magnitude(wb, s);
        // Escapes are rare (a predictable branch); signs are a coin toss,
        // counted without a branch.
        if m >= 2 {
            esc.n += 1;
            esc.gap_sum += r - esc_next;
            esc_next = r + 1;
            esc.add(m - 2);
        }
        let bit = (s >> top) & 1;
        set += bit;
        set_sum += (r - set_next) & bit.wrapping_neg();
        set_next += (r + 1 - set_next) & bit.wrapping_neg();
    }
    let step_bits = pos_bits + choose_values(&mut h, &esc, (set, set_sum));
    Choice {
        head: h,
        step_bits,
        raw_bits: pos_bits + n * 8 * wb as u64,
    }
}

/// Writes a class's region.
fn write_class(st: &Staged, h: &ClassHead, raw: bool, (wb, new): (usize, &[u8])) -> Vec<u8> {
    let mut w = FastWriter::default();
    w.reserve(st.n * 4 + 64);
    if raw {
        let bits = 8 * wb as u32;
        for (&g, &i) in st.gaps().iter().zip(st.idx()) {
            put_rice(&mut w, g as u64, h.k, (0, 0));
            w.put(crate::dtype::read_word(new, wb, i as usize), bits);
        }
        return w.finish();
    }
    let top = wb as u32 * 8 - 1;
    if h.esc > 0 {
        let mut next = 0u64;
        for (r, &s) in st.steps().iter().enumerate() {
            let m = crate::dtype::step_magnitude(wb, s);
            if m >= 2 {
                put_rice(&mut w, r as u64 - next, h.ke, (0, 0));
                put_eg(&mut w, m - 2, h.ve);
                next = r as u64 + 1;
            }
        }
    }
    if h.list.is_some() {
        let mut next = 0u64;
        for (r, &s) in st.steps().iter().enumerate() {
            if (s >> top) & 1 != 0 {
                put_rice(&mut w, r as u64 - next, h.ko, (0, 0));
                next = r as u64 + 1;
            }
        }
        for &g in st.gaps() {
            put_rice(&mut w, g as u64, h.k, (0, 0));
        }
    } else {
        for (&g, &s) in st.gaps().iter().zip(st.steps()) {
            put_rice(&mut w, g as u64, h.k, ((s >> top) & 1, 1));
        }
    }
    w.finish()
}

/// Encodes a block's staged changes (see [`stage`]); returns the entry
/// (`bytes` and `values` set) and the stream. For a raw-coded block, the
/// next context's members are rewritten (raw values count as large steps
/// up).
pub(crate) fn encode(wb: usize, new: &[u8], s: &mut EncodeScratch) -> (BlockEntry, Vec<u8>) {
    let choices = [0, 1, 2].map(|c| choose(&s.class[c], wb));
    let n: u64 = choices.iter().map(|c| c.head.n).sum();
    let step_bits: u64 = choices.iter().map(|c| c.step_bits).sum();
    let raw_bits: u64 = choices.iter().map(|c| c.raw_bits).sum();
    let raw = raw_bits < step_bits;
    let mut heads = choices.map(|c| c.head);
    let mut out = Vec::new();
    if n > 0 {
        let regions: Vec<Vec<u8>> = (0..CLASSES)
            .map(|c| {
                if raw {
                    heads[c].esc = 0;
                    heads[c].list = None;
                }
                if heads[c].n == 0 {
                    Vec::new()
                } else {
                    write_class(&s.class[c], &heads[c], raw, (wb, new))
                }
            })
            .collect();
        out = assemble(heads, &regions, raw);
    }
    if raw {
        for m in &mut s.next[..s.next_n] {
            *m = (*m & !3) | BIG;
        }
    }
    let e = BlockEntry {
        changes: n,
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

/// Diffs one block (`base` → `new`, `W`-byte words) against its context
/// `members` into `s`: each change classified and staged in its class, and
/// the block's members for the next context; returns the digest change
/// (`ctx.first`: the block's first word in the tensor).
fn stage<const W: usize>(
    platform: crate::platform::Platform,
    ctx: super::Ctx,
    (base, new): (&[u8], &[u8]),
    members: &[Member],
    s: &mut EncodeScratch,
) -> u64 {
    use crate::digest::{ChangeBatch, LANES};
    use crate::dtype::load;
    for st in &mut s.class {
        st.clear();
    }
    let mut next_n = 0usize;
    let mask = word_mask(W);
    let top = W as u32 * 8 - 1;
    let mut dig = 0u64;
    // Where the members stand: the next one not below the change, and how
    // many of each class came before it (kept in registers: an array indexed
    // by the class would chain every change through a store and a load).
    let (mut p, mut rank_small, mut rank_big) = (0usize, 0u32, 0u32);
    let [s0, s1, s2] = &mut s.class;
    let mut class = [s0, s1, s2];
    let out = &mut s.next;
    crate::codec::scan::for_each_change_piece_on(
        platform,
        W,
        base,
        new,
        |first, changed, pa, pb| {
            // Room for the piece's changes in every class and in the next
            // context: the loop below writes in place.
            for st in class.iter_mut() {
                st.room(changed.len());
            }
            if out.len() < next_n + changed.len() {
                let len = (next_n + changed.len()).max(2 * out.len());
                out.resize(len, 0);
            }
            for chunk in changed.chunks(LANES) {
                let mut batch = ChangeBatch::default();
                for (j, &c) in chunk.iter().enumerate() {
                    let (a, b) = (load::<W>(pa, c as usize), load::<W>(pb, c as usize));
                    let i = (first + c as usize) as u32;
                    (batch.index[j], batch.old[j], batch.new[j]) = (ctx.first + i as u64, a, b);
                    let step = to_key(ctx.kind, W, b).wrapping_sub(to_key(ctx.kind, W, a)) & mask;
                    out[next_n] = member(i as u64, step, W);
                    next_n += 1;
                    while p < members.len() && index(members[p]) < i {
                        let big = members[p] & BIG;
                        rank_small += 1 - big;
                        rank_big += big;
                        p += 1;
                    }
                    let (cl, at, flip) = match members.get(p) {
                        Some(&m) if index(m) == i => {
                            let big = m & BIG;
                            let r = if big == 1 { rank_big } else { rank_small };
                            rank_small += 1 - big;
                            rank_big += big;
                            p += 1;
                            (1 + big as usize, r, ((m & NEG) >> 1) as u64)
                        }
                        _ => (0, i, 0),
                    };
                    // The step with the sign relative to the member's last.
                    let rel = ((step ^ flip.wrapping_neg()).wrapping_add(flip)) & mask;
                    debug_assert_eq!(
                        crate::dtype::step_magnitude(W, rel),
                        crate::dtype::step_magnitude(W, step)
                    );
                    let _ = top;
                    class[cl].put(i, at, rel);
                }
                dig = dig.wrapping_add(ctx.seed.change_sum_on(platform, &batch));
            }
        },
    );
    s.next_n = next_n;
    dig
}

/// A `compact2`-encoded tensor and the context its changes make for the
/// next delta.
pub struct Encoded2 {
    /// The payload, as `compact`'s.
    pub tensor: super::EncodedTensor,
    /// The tensor's context for the next delta (its changes).
    pub next: super::context::TensorContext,
    /// Its checksum (the sum of its blocks' [`super::context::block_checksum`]s
    /// under the seed given to [`encode_tensor`]).
    pub checksum: u64,
}

/// One block as [`encode_tensor`] encodes it: entry, stream, digest change,
/// next members and their checksum.
type BlockPart = (BlockEntry, Vec<u8>, u64, Vec<Member>, u64);

/// Diffs `base` against `new` (`wb`-byte words) and encodes the changes as
/// `compact2` blocks against `context` (the tensor's context; `None`: no
/// context, every change in class 0). The next context's checksum is summed
/// under `ctx_seed` (the tensor's [`super::context::tensor_seed`]) as its
/// members are made.
pub fn encode_tensor(
    kind: crate::dtype::KeyKind,
    wb: usize,
    seed: crate::digest::TensorSeed,
    (base, new): (&[u8], &[u8]),
    (context, ctx_seed): (Option<&super::context::TensorContext>, u64),
) -> Encoded2 {
    let block_words = super::BLOCK_WORDS;
    let platform = crate::platform::Platform::detect();
    let masks = wb == 2 && super::v2_masks::enabled();
    let parts: Vec<BlockPart> = for_blocks(
        kind,
        wb,
        seed,
        (base, new),
        context,
        |ctx, (old, new), members| {
            let block = ctx.first / block_words;
            if masks
                && let Some(part) = super::v2_masks::MASKS.with(|cell| {
                    let s = &mut *cell.borrow_mut();
                    let check = ctx_seed ^ (block << 32);
                    let (dig, _, sum, proof) = super::v2_masks::scan_block(
                        platform,
                        ctx,
                        (old, new),
                        (members, check),
                        s,
                    )?;
                    let (e, bytes) = super::v2_masks::encode_scanned(s, proof)?;
                    // The list itself, not a copy (the next block takes
                    // another from the pool).
                    Some((e, bytes, dig, std::mem::take(&mut s.next), sum))
                })
            {
                return part;
            }
            with_staged(platform, wb, ctx, (old, new), members, |s, dig, new| {
                let (e, bytes) = encode(wb, new, s);
                let next = super::context::pool::copy_of(s.next());
                let sum = super::context::block_checksum(ctx_seed, block, &next);
                (e, bytes, dig, next, sum)
            })
        },
    );
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
    let mut checksum = 0u64;
    for (entry, bytes, dig, members, sum) in parts {
        checksum = checksum.wrapping_add(sum);
        tensor.changed += entry.changes;
        tensor.digest_change = tensor.digest_change.wrapping_add(dig);
        tensor.payload.extend_from_slice(&bytes);
        tensor.blocks.push(entry);
        next.blocks.push(members);
    }
    Encoded2 {
        tensor,
        next,
        checksum,
    }
}

/// Maps every block of `base` → `new` (`wb`-byte words, in parallel) with
/// `f`, given the block's [`super::Ctx`], its words and its members in
/// `context`.
fn for_blocks<T: Send>(
    kind: crate::dtype::KeyKind,
    wb: usize,
    seed: crate::digest::TensorSeed,
    (base, new): (&[u8], &[u8]),
    context: Option<&super::context::TensorContext>,
    f: impl Fn(super::Ctx, (&[u8], &[u8]), &[Member]) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let block_words = super::BLOCK_WORDS;
    let block_bytes = (block_words as usize * wb).max(1);
    base.par_chunks(block_bytes)
        .zip(new.par_chunks(block_bytes))
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
            f(ctx, (old, new), members)
        })
        .collect()
}

/// Stages one block (`wb`-byte words) against its `members` in this
/// thread's scratch, and maps the staging (the scratch, the digest change
/// and the block's new words) with `then`.
fn with_staged<T>(
    platform: Platform,
    wb: usize,
    ctx: super::Ctx,
    (old, new): (&[u8], &[u8]),
    members: &[Member],
    then: impl FnOnce(&mut EncodeScratch, u64, &[u8]) -> T,
) -> T {
    ENCODE.with(|cell| {
        let s = &mut *cell.borrow_mut();
        let dig = crate::with_word_width!(wb, W => {
            stage::<W>(platform, ctx, (old, new), members, s)
        });
        then(s, dig, new)
    })
}

/// Stages every block of `base` → `new` (`wb`-byte words, in parallel)
/// against its members in `context`, and maps each block's staging (the
/// scratch, the digest change and the block's new words) with `then`.
fn stage_blocks<T: Send>(
    kind: crate::dtype::KeyKind,
    wb: usize,
    seed: crate::digest::TensorSeed,
    (base, new): (&[u8], &[u8]),
    context: Option<&super::context::TensorContext>,
    then: impl Fn(&mut EncodeScratch, u64, &[u8]) -> T + Sync,
) -> Vec<T> {
    let platform = crate::platform::Platform::detect();
    for_blocks(
        kind,
        wb,
        seed,
        (base, new),
        context,
        |ctx, (old, new), members| with_staged(platform, wb, ctx, (old, new), members, &then),
    )
}

/// One block through the staged encoder: entry, stream, digest change and
/// next members (the reference of `v2_masks`' tests).
#[cfg(test)]
pub(super) fn staged_block(
    ctx: super::Ctx,
    (old, new): (&[u8], &[u8]),
    members: &[Member],
) -> (BlockEntry, Vec<u8>, u64, Vec<Member>) {
    let platform = crate::platform::Platform::detect();
    with_staged(platform, 2, ctx, (old, new), members, |s, dig, new| {
        let (e, bytes) = encode(2, new, s);
        (e, bytes, dig, s.next().to_vec())
    })
}

/// Stages every block of `base` → `new` as [`encode_tensor`] does and
/// writes nothing: the staging alone, for benchmarks (`examples/compact2_bench`,
/// `WEIGHTCAST_PHASE=stage`). Returns the changes staged.
#[doc(hidden)]
pub fn stage_only(
    kind: crate::dtype::KeyKind,
    wb: usize,
    seed: crate::digest::TensorSeed,
    (base, new): (&[u8], &[u8]),
    context: Option<&super::context::TensorContext>,
) -> u64 {
    stage_blocks(kind, wb, seed, (base, new), context, |s, _, _| {
        s.class.iter().map(|c| c.n as u64).sum::<u64>()
    })
    .into_iter()
    .sum()
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
        let e = encode_tensor(
            KeyKind::SignMagnitude,
            wb,
            TensorSeed(77),
            (base, new),
            (ctx, 5),
        );
        let mut want = 0u64;
        for (b, ms) in e.next.blocks.iter().enumerate() {
            want = want.wrapping_add(super::super::context::block_checksum(5, b as u64, ms));
        }
        assert_eq!(e.checksum, want, "the next context's checksum");
        e
    }

    /// Three versions a → b → c of one BF16 block, where c changes many of
    /// the words b changed (as real traces do).
    fn chain(words: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let spec = super::super::testutil::Chain {
            first: 61,
            again: 3,
            fresh: 97,
            step: |h, _| if h % 9 == 0 { 3 } else { 1 },
            down: 2,
            neg: false,
        };
        super::super::testutil::chain(words, seed, &spec)
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

    /// A callback of `decode_block` that decodes a `compact2` block itself
    /// (the thread's scratch is then in use) gets a scratch of its own: the
    /// same entries, no panic.
    #[test]
    fn a_decode_inside_a_decode_callback() {
        let (a, b, c) = chain(20_000, 3);
        let e1 = enc(&a, &b, 2, None);
        let e2 = enc(&b, &c, 2, Some(&e1.next));
        let block = Block {
            tensor: "t",
            index: 0,
            entry: &e2.tensor.blocks[0],
            stream: &e2.tensor.payload,
            wb: 2,
            words: (b.len() / 2) as u64,
            context: Some(e1.next.block(0)),
        };
        let all = |block: &Block<'_>| {
            let mut v = Vec::new();
            super::super::decode_block(block, None, |i, x| {
                v.push((i, x));
                Ok(())
            })
            .unwrap();
            v
        };
        let outer = all(&block);
        assert!(!outer.is_empty());
        let mut inner = Vec::new();
        super::super::decode_block(&block, Some(1), |_, _| {
            inner = all(&block);
            Ok(())
        })
        .unwrap();
        assert!(inner == outer);
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

    /// A block long enough that the apply interleaves its classes
    /// (`Interleave`), failing at class 1's last entry (its last members
    /// left out of the context, so that entry's rank is past the class): the
    /// undo restores the base exactly, for step-coded and raw-coded values.
    /// Both need `for_each_applied` to follow the apply's order: the entries
    /// written before the failure are the first of that order, and a raw
    /// block's old words were logged in it.
    #[test]
    fn interleaved_failures_are_undone_exactly() {
        let words = 9 * Interleave::SPAN as usize + 123;
        for raw in [false, true] {
            let (a, b, mut c) = chain(words, 11);
            if raw {
                // Sign flips of many words: steps cost more than raw values.
                for i in (0..words).step_by(5) {
                    c[2 * i + 1] ^= 0x80;
                }
            }
            let e1 = enc(&a, &b, 2, None);
            let e2 = enc(&b, &c, 2, Some(&e1.next));
            let raw_coded = e2.tensor.blocks[0].values == ValueCoding::Raw;
            assert_eq!(raw_coded, raw);
            let members = e1.next.block(0);
            let changed = |m: Member| {
                let i = index(m) as usize;
                b[2 * i..2 * i + 2] != c[2 * i..2 * i + 2]
            };
            // Class 1's last member that changed again, and the class-1
            // members from it on, left out.
            let last = *members
                .iter()
                .rev()
                .find(|&&m| m & BIG == 0 && changed(m))
                .expect("a class-1 member changed again");
            assert!(
                index(last) as u64 > 4 * Interleave::SPAN,
                "late in the block"
            );
            let cut: Vec<Member> = members
                .iter()
                .copied()
                .filter(|&m| m & BIG != 0 || index(m) < index(last))
                .collect();
            let err = apply_one(&e2, &b, 2, &cut).expect_err("a rank past the class");
            assert!(err.to_string().contains("rank beyond"), "{err}");
            // The whole context applies.
            let (got, _) = apply_one(&e2, &b, 2, members).expect("apply");
            assert!(got == c);
        }
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

        /// [`finish`] against the plain merge: any class-0 changes, members
        /// and flags, with and without indices in both.
        #[test]
        fn finish_agrees_with_the_plain_merge(
            a in proptest::collection::btree_set(0u32..400, 0..120),
            b in proptest::collection::btree_set(0u32..400, 0..120),
            codes in proptest::collection::vec(0u8..8, 120),
            disjoint in any::<bool>(),
        ) {
            let a: Vec<Member> = a
                .into_iter()
                .filter(|i| !disjoint || !b.contains(i))
                .enumerate()
                .map(|(k, i)| (i << 2) | (codes[k] as u32 & 3))
                .collect();
            let b: Vec<Member> = b.iter().enumerate().map(|(k, &i)| (i << 2) | (codes[119 - k] as u32 & 3)).collect();
            let mut rec = Record {
                c0: a,
                again: (0..b.len()).map(|k| if codes[k] & 4 != 0 { codes[k] } else { 0 }).collect(),
                ..Record::default()
            };
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let r = finish(&b, &mut rec, Some((&mut got, (77, 5))));
            prop_assert_eq!(r.map(|_| ()), finish_reference(&b, &rec, Some(&mut want)));
            prop_assert_eq!(finish(&b, &mut rec, None).is_ok(), r.is_ok());
            if let Ok(sum) = r {
                prop_assert_eq!(sum, super::super::context::block_checksum(77, 5, &want));
                prop_assert_eq!(got, want);
            }
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

    /// One class-0 change at a member's position, wherever it falls among
    /// the other changes, with every pattern of flags on a few members:
    /// refused when that member changed again (its word would change twice),
    /// accepted as the plain merge when it did not (the word changes once);
    /// the same lists without it merge as the plain merge does.
    #[test]
    fn one_shared_position_anywhere_is_found() {
        for members in 1..7u32 {
            for flags in 0..1u32 << members {
                let b: Vec<Member> = (0..members).map(|k| (2 * k + 1) << 2).collect();
                let again: Vec<u8> = (0..members)
                    .map(|k| {
                        if flags >> k & 1 == 1 {
                            4 | (k as u8 & 3)
                        } else {
                            0
                        }
                    })
                    .collect();
                for shared in 0..members {
                    for around in 0..1u32 << (members + 1) {
                        // Class-0 changes at even positions (chosen by `around`)
                        // and at member `shared`'s.
                        let mut c0: Vec<Member> = (0..=members)
                            .filter(|k| around >> k & 1 == 1)
                            .map(|k| (2 * k) << 2)
                            .collect();
                        let mut clean = Record {
                            c0: c0.clone(),
                            again: again.clone(),
                            ..Record::default()
                        };
                        c0.push((2 * shared + 1) << 2 | 2);
                        c0.sort_unstable_by_key(|&m| m >> 2);
                        let mut rec = Record {
                            c0,
                            again: again.clone(),
                            ..Record::default()
                        };
                        let twice = flags >> shared & 1 == 1;
                        let (mut out, mut want) = (Vec::new(), Vec::new());
                        let r = finish(&b, &mut rec, Some((&mut out, (1, 2))));
                        assert_eq!(r.is_err(), twice, "{members} {flags} {shared} {around}");
                        assert_eq!(finish(&b, &mut rec, None).is_err(), twice);
                        if !twice {
                            finish_reference(&b, &rec, Some(&mut want)).unwrap();
                            assert_eq!(out, want);
                        }
                        let (mut got, mut want) = (Vec::new(), Vec::new());
                        let sum = finish(&b, &mut clean, Some((&mut got, (1, 2)))).unwrap();
                        finish_reference(&b, &clean, Some(&mut want)).unwrap();
                        assert_eq!(got, want);
                        assert_eq!(sum, super::super::context::block_checksum(1, 2, &want));
                    }
                }
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
