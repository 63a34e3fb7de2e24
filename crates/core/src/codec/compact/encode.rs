//! The `compact` encoder: one pass over each block's words (see
//! [`encode_block_w`]), blocks in parallel.

use rayon::prelude::*;

use super::vector::{self, Part};
use super::{BLOCK_WORDS, Ctx, EncodedTensor, MAX_POS_K};
use crate::codec::bits::FastWriter;
use crate::codec::scan::{PIECE, for_each_change_piece_on};
use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{KeyKind, load, step_magnitude, to_key, word_mask};
use crate::format::{BlockEntry, ValueCoding};
#[cfg(any(target_arch = "x86_64", test))]
use crate::platform::Level;
use crate::platform::{Platform, dispatched};

/// Diffs `base` against `new` and encodes the changes.
pub fn encode_tensor(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    base: &[u8],
    new: &[u8],
) -> EncodedTensor {
    encode_tensor_on(Platform::detect(), kind, wb, seed, (base, new))
}

/// [`encode_tensor`] on `platform`.
fn encode_tensor_on(
    platform: Platform,
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    (base, new): (&[u8], &[u8]),
) -> EncodedTensor {
    let block_bytes = BLOCK_WORDS as usize * wb;
    let parts: Vec<(BlockEntry, Vec<u8>, u64)> = base
        .par_chunks(block_bytes)
        .zip(new.par_chunks(block_bytes))
        .enumerate()
        .map(|(b, (old, new))| {
            let ctx = Ctx {
                kind,
                seed,
                first: b as u64 * BLOCK_WORDS,
            };
            encode_block(
                Input {
                    platform,
                    ctx,
                    base: old,
                    new,
                },
                wb,
            )
        })
        .collect();
    EncodedTensor::from_blocks(parts)
}

/// One block to encode: its words before and after, what they are, and the
/// platform to encode on.
#[derive(Clone, Copy)]
struct Input<'a> {
    platform: Platform,
    ctx: Ctx,
    base: &'a [u8],
    new: &'a [u8],
}

fn encode_block(input: Input<'_>, wb: usize) -> (BlockEntry, Vec<u8>, u64) {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let scratch = &mut *scratch;
        scratch.gaps.clear();
        scratch.steps.clear();
        #[cfg(target_arch = "x86_64")]
        if input.platform.has(Level::Avx2) {
            dispatched!(Encode, Level::Avx2);
            // SAFETY: `platform.has(Level::Avx2)`: detection found every
            // feature `encode_block_avx2` is compiled with; the function is
            // otherwise safe code.
            return unsafe { encode_block_avx2(input, wb, scratch) };
        }
        dispatched!(Encode, Level::Portable);
        crate::with_word_width!(wb, W => encode_block_w::<W>(input, scratch))
    })
}

/// [`encode_block_w`] compiled for [`Level::Avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
fn encode_block_avx2(
    input: Input<'_>,
    wb: usize,
    scratch: &mut Scratch,
) -> (BlockEntry, Vec<u8>, u64) {
    crate::with_word_width!(wb, W => encode_block_w::<W>(input, scratch))
}

/// Per-thread gap and step arrays, reused across blocks so encoding does not pay
/// fresh-page faults for every block.
#[derive(Default)]
struct Scratch {
    gaps: Vec<u64>,
    steps: Vec<u64>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Words of a block whose changes are staged before the code parameters are
/// chosen from them; the rest of the block is written straight from the scan.
/// Staging is the slower (scalar) path, so the sample is kept small: 2^16
/// words hold ~1000 changes at 1.5% density, plenty for the parameters, and
/// the delta of `examples/codec_instr` at 1.83% density came out byte for byte
/// the same as with 2^18, encoded ~5% faster.
const SAMPLE_WORDS: usize = 1 << 16;
/// Staging also ends after this many changes (dense blocks).
const SAMPLE_CHANGES: usize = 8192;

/// Where [`encode_block_w`] is in its block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Staging the first changes (gaps, steps, statistics).
    Sample,
    /// Parameters chosen; entries go straight into the bit stream.
    Direct,
    /// The sample chose raw values: stage the whole block, choose exactly.
    StageAll,
}

/// Encodes one block in one pass over its words.
///
/// The changes of the first [`SAMPLE_WORDS`] words are staged with their
/// statistics, the Rice and Exp-Golomb parameters chosen from them, and from
/// there on each change is written into the bit stream as the scan finds it:
/// no per-change arrays and no second pass. The format records the parameters
/// per block, so any choice decodes; to keep the size near the optimum anyway,
/// the block is encoded again with parameters chosen from all of its changes
/// (a second scan) when the whole block's figures show that the sampled choice
/// costs more than about 1% (gap sum and count are exact at the end; the value
/// bits are compared with the sample's rate). Blocks no longer than the sample
/// are chosen exactly, as before.
///
/// For 2-byte words the direct part runs the fused AVX-512 encoder
/// ([`vector::encode_direct`]) where the platform has it.
#[inline(always)]
fn encode_block_w<const W: usize>(
    Input {
        platform,
        ctx,
        base,
        new,
    }: Input<'_>,
    Scratch { gaps, steps }: &mut Scratch,
) -> (BlockEntry, Vec<u8>, u64) {
    let block_words = (base.len() / W) as u64;
    let mut st = Staged {
        stats: Stats::default(),
        gaps,
        steps,
        next: 0, // first index the next gap counts from
        dig: 0,
    };
    let mut phase = Phase::Sample;
    let mut w = FastWriter::default();
    let (mut pos_k, mut val_k) = (0u8, 0u8);
    // Value bits per change in the sample, and the direct part's count and bits.
    let mut sample_vbits = 0u64;
    let (mut direct_n, mut direct_vbits) = (0u64, 0u64);
    // The sample, a piece at a time, until it holds enough.
    let mut off = 0usize; // bytes scanned
    while phase == Phase::Sample && off < base.len() {
        let end = (off + PIECE).min(base.len());
        let piece_first = off / W;
        for_each_change_piece_on(
            platform,
            W,
            &base[off..end],
            &new[off..end],
            |_, changed, pa, pb| {
                stage_piece::<W>(ctx, &mut st, (piece_first, changed, pa, pb));
            },
        );
        off = end;
        let scanned = off / W;
        if st.gaps.is_empty() || (scanned < SAMPLE_WORDS && st.gaps.len() < SAMPLE_CHANGES) {
            continue;
        }
        let (pk, pos_bits) = st.stats.choose_rice_k();
        let (vk, step_bits) = st.stats.choose_eg_k();
        if step_bits >= st.stats.n * W as u64 * 8 {
            phase = Phase::StageAll;
            break;
        }
        (pos_k, val_k, sample_vbits) = (pk, vk, step_bits);
        // Room for the whole block at the sample's rate, plus a margin.
        let est = (pos_bits + step_bits) / 8 * block_words / scanned as u64;
        w.reserve((est + est / 8) as usize);
        for (&g, &s) in st.gaps.iter().zip(st.steps.iter()) {
            emit_step::<W>(&mut w, pos_k as u32, val_k as u32, g, s, 0);
        }
        phase = Phase::Direct;
    }
    let (rest_a, rest_b, rest_first) = (&base[off..], &new[off..], off / W);
    match phase {
        Phase::Direct => {
            let mut slow = |w: &mut FastWriter, g: u64, s: u64| {
                emit_step::<W>(w, pos_k as u32, val_k as u32, g, s, 0);
            };
            let part = Part {
                next: st.next,
                start: rest_first as u64,
                base: rest_a,
                new: rest_b,
            };
            let params = (pos_k as u32, val_k as u32);
            let fused = if W == 2 {
                vector::encode_direct(platform, ctx, params, part, &mut w, &mut slow)
            } else {
                None
            };
            if let Some(r) = fused {
                (direct_n, st.next, direct_vbits) = (r.changes, r.next, r.value_bits);
                st.dig = st.dig.wrapping_add(r.digest);
            } else {
                dispatched!(EncodeFused, Level::Portable);
                let (mut next, mut dig) = (st.next, st.dig);
                for_each_change_piece_on(
                    platform,
                    W,
                    rest_a,
                    rest_b,
                    |piece_first, changed, pa, pb| {
                        let at = (rest_first + piece_first, changed, pa, pb);
                        let (nx, dg, vb) =
                            write_piece::<W>(ctx, (pos_k, val_k), &mut w, (next, dig), at);
                        (next, dig) = (nx, dg);
                        direct_vbits += vb;
                        direct_n += changed.len() as u64;
                    },
                );
                (st.next, st.dig) = (next, dig);
            }
        }
        Phase::StageAll => {
            for_each_change_piece_on(
                platform,
                W,
                rest_a,
                rest_b,
                |piece_first, changed, pa, pb| {
                    stage_piece::<W>(ctx, &mut st, (rest_first + piece_first, changed, pa, pb));
                },
            );
        }
        Phase::Sample => {}
    }
    if phase == Phase::Direct {
        let n = st.stats.n + direct_n;
        let gap_sum = st.next - n;
        let best = (0..=MAX_POS_K)
            .map(|k| rice_estimate(n, gap_sum, k))
            .fold(f64::INFINITY, f64::min);
        let total = w.bit_len() as f64;
        let pos_loss = rice_estimate(n, gap_sum, pos_k) - best;
        // The sample's value bits per change, applied to the direct part.
        let expect = sample_vbits as f64 * direct_n as f64 / st.stats.n as f64;
        let drift = direct_vbits as f64 - expect;
        let values_off = drift > 0.05 * expect + 64.0 || (val_k > 0 && -drift > 0.05 * expect);
        if pos_loss <= 0.01 * total + 64.0 && !values_off {
            let bytes = w.finish();
            let e = BlockEntry {
                changes: n,
                pos_k,
                values: ValueCoding::Step,
                val_k,
                bytes: bytes.len() as u64,
            };
            return (e, bytes, st.dig);
        }
        // The block is not uniform enough for the sample: stage all of it.
        st.gaps.clear();
        st.steps.clear();
        (st.stats, st.next, st.dig) = (Stats::default(), 0, 0);
        for_each_change_piece_on(platform, W, base, new, |piece_first, changed, pa, pb| {
            stage_piece::<W>(ctx, &mut st, (piece_first, changed, pa, pb));
        });
    }
    let bytes = write_staged::<W>(&st.stats, st.gaps, st.steps, |_, at| load::<W>(new, at));
    (bytes.0, bytes.1, st.dig)
}

/// A block's staged changes (gaps, steps and their statistics), the index
/// the next gap counts from and the digest change so far.
struct Staged<'s> {
    stats: Stats,
    gaps: &'s mut Vec<u64>,
    steps: &'s mut Vec<u64>,
    next: u64,
    dig: u64,
}

/// A piece of a block as the scan hands it over: its first word in the
/// block, the indices of its changed words (relative to the piece) and its
/// old and new bytes.
type Piece<'a> = (usize, &'a [u16], &'a [u8], &'a [u8]);

/// Stages the changes of one piece: gaps, steps, statistics, digest change.
#[inline(always)]
fn stage_piece<const W: usize>(
    ctx: Ctx,
    st: &mut Staged<'_>,
    (piece_first, changed, pa, pb): Piece<'_>,
) {
    // One tight loop over the piece's changes, with the running state in locals.
    let (mut nx, mut dg) = (st.next, st.dig);
    let (mut gsum, mut ones, mut twos) = (0u64, 0u64, 0u64);
    let Staged {
        stats, gaps, steps, ..
    } = st;
    gaps.reserve(changed.len());
    steps.reserve(changed.len());
    for chunk in changed.chunks(LANES) {
        let d = walk_changes::<W>((ctx, piece_first), &mut nx, chunk, pa, pb, |g, s| {
            let m = step_magnitude(W, s);
            gsum += g;
            ones += u64::from(m == 1);
            twos += u64::from(m == 2);
            if m > 2 {
                stats.add_rare(m);
            }
            gaps.push(g);
            steps.push(s);
        });
        dg = dg.wrapping_add(d);
    }
    stats.n += changed.len() as u64;
    stats.gap_sum += gsum;
    stats.ones += ones;
    stats.twos += twos;
    st.next = nx;
    st.dig = dg;
}

/// Walks up to [`LANES`] changes of a piece (`chunk`: indices into it,
/// ascending), calling `f(gap, step)` for each: the gap counted from `*next`
/// (which moves past the change) and the masked step of the ordered key.
/// Returns the chunk's digest change. `walk` is the block's context and the
/// piece's first word in the block.
#[inline(always)]
fn walk_changes<const W: usize>(
    (ctx, piece_first): (Ctx, usize),
    next: &mut u64,
    chunk: &[u16],
    pa: &[u8],
    pb: &[u8],
    mut f: impl FnMut(u64, u64),
) -> u64 {
    let mask = word_mask(W);
    let mut batch = ChangeBatch::default();
    for (j, &c) in chunk.iter().enumerate() {
        let (old, nw) = (load::<W>(pa, c as usize), load::<W>(pb, c as usize));
        let i = (piece_first + c as usize) as u64;
        f(
            i - *next,
            to_key(ctx.kind, W, nw).wrapping_sub(to_key(ctx.kind, W, old)) & mask,
        );
        *next = i + 1;
        (batch.index[j], batch.old[j], batch.new[j]) = (ctx.first + i, old, nw);
    }
    ctx.seed.change_sum(&batch)
}

/// Writes the changes of one piece straight into the stream (parameters
/// fixed); returns the new `(next, digest)` and the value bits written. `at`
/// is the piece's first word in the block, its changes and its words.
#[inline(always)]
fn write_piece<const W: usize>(
    ctx: Ctx,
    (pos_k, val_k): (u8, u8),
    w: &mut FastWriter,
    (mut nx, mut dg): (u64, u64),
    (piece_first, changed, pa, pb): Piece<'_>,
) -> (u64, u64, u64) {
    let room = changed.len() * 8;
    w.reserve(room);
    let mut vb = 0u64;
    for chunk in changed.chunks(LANES) {
        let d = walk_changes::<W>((ctx, piece_first), &mut nx, chunk, pa, pb, |g, s| {
            vb += emit_step::<W>(w, pos_k as u32, val_k as u32, g, s, room) as u64;
        });
        dg = dg.wrapping_add(d);
    }
    (nx, dg, vb)
}

/// Writes one step-coded entry (Rice gap, then the signed Exp-Golomb step) and
/// returns the value's bit count. The usual entry is one [`FastWriter::put56`];
/// longer ones take the slow path, which then reserves `room` bytes again for
/// the caller's remaining entries.
#[inline(always)]
fn emit_step<const W: usize>(
    w: &mut FastWriter,
    k: u32,
    val_k: u32,
    g: u64,
    s: u64,
    room: usize,
) -> u32 {
    let top = W as u32 * 8 - 1;
    let neg = (s >> top) & 1;
    let m = step_magnitude(W, s);
    let q = g >> k;
    let y = (m - 1) + (1u64 << val_k);
    let nb = 64 - y.leading_zeros();
    let z = nb - 1 - val_k;
    let vlen = z + nb + 1;
    let rest = y ^ (1u64 << (nb - 1));
    if q + 1 + k as u64 + vlen as u64 <= 56 {
        let len = q as u32 + 1 + k;
        let code = (1u64 << q) | ((g & ((1u64 << k) - 1)) << (q + 1));
        let vcode = (1u64 << z) | (rest << (z + 1)) | (neg << (z + nb));
        w.put56(code | (vcode << len), len + vlen);
    } else {
        emit_long(w, k, g, (z, rest, nb - 1, neg), room);
    }
    vlen
}

/// The general form of an entry (long gaps or large steps).
#[cold]
#[inline(never)]
fn emit_long(
    w: &mut FastWriter,
    k: u32,
    g: u64,
    (z, rest, rest_bits, neg): (u32, u64, u32, u64),
    room: usize,
) {
    w.put_unary(g >> k);
    w.put(g & ((1u64 << k) - 1), k);
    w.put_unary(z as u64);
    w.put(rest, rest_bits);
    w.put(neg, 1);
    w.reserve(room);
}

/// Encodes staged changes with parameters chosen from all of them;
/// `new_word(j, at)` is the new word of the `j`-th change, at word `at` of the
/// block (read only for raw values).
pub(super) fn write_staged<const W: usize>(
    stats: &Stats,
    gaps: &[u64],
    steps: &[u64],
    new_word: impl Fn(usize, usize) -> u64,
) -> (BlockEntry, Vec<u8>) {
    let n = gaps.len() as u64;
    if n == 0 {
        let e = BlockEntry {
            changes: 0,
            pos_k: 0,
            values: ValueCoding::Raw,
            val_k: 0,
            bytes: 0,
        };
        return (e, Vec::new());
    }
    let (pos_k, pos_bits) = stats.choose_rice_k();
    let (val_k, step_bits) = stats.choose_eg_k();
    let raw_bits = n * W as u64 * 8;
    let values = if step_bits < raw_bits {
        ValueCoding::Step
    } else {
        ValueCoding::Raw
    };
    let mut w = FastWriter::default();
    let (k, vk) = (pos_k as u32, val_k as u32);
    match values {
        ValueCoding::Step => {
            w.reserve(((pos_bits + step_bits) / 8) as usize);
            for (&g, &st) in gaps.iter().zip(steps) {
                emit_step::<W>(&mut w, k, vk, g, st, 8);
            }
        }
        ValueCoding::Raw => {
            // Raw mode is rare (large jumps); read the new words back.
            let mut at = 0u64;
            for (j, &g) in gaps.iter().enumerate() {
                at += g;
                w.put_unary(g >> k);
                w.put(g & ((1u64 << k) - 1), k);
                w.put(new_word(j, at as usize), W as u32 * 8);
                at += 1;
            }
        }
    }
    let bytes = w.finish();
    let e = BlockEntry {
        changes: n,
        pos_k,
        values,
        val_k,
        bytes: bytes.len() as u64,
    };
    (e, bytes)
}

/// The estimate of a Rice code's length that [`Stats::choose_rice_k`] minimizes.
fn rice_estimate(n: u64, gap_sum: u64, k: u8) -> f64 {
    let (n, p) = (n as f64, (1u64 << k) as f64);
    n * (k as f64 + 1.0) + gap_sum as f64 / p - n * (1.0 - 1.0 / p) / 2.0
}

/// Bits of the order-`k` Exp-Golomb code of `m - 1`, plus the sign bit.
#[inline]
fn eg_bits(m: u64, k: u8) -> u64 {
    let y = (m - 1) + (1u64 << k);
    let nb = 64 - y.leading_zeros() as u64;
    2 * nb - k as u64
}

/// Magnitudes below this are counted exactly when choosing the value code.
const SMALL: usize = 256;

/// Statistics gathered during the scan, from which the block's code parameters
/// are chosen without another pass over its changes. The common cases (gap sum,
/// ±1 and ±2 steps) are plain counters the hot loop keeps in registers; only the
/// rare larger steps go to a histogram.
pub(super) struct Stats {
    /// Number of changes.
    n: u64,
    /// Sum of the gaps.
    gap_sum: u64,
    /// Steps of magnitude 1 and 2.
    ones: u64,
    twos: u64,
    /// Magnitudes 3..[`SMALL`], exactly.
    small: [u64; SMALL],
    /// Larger magnitudes by bit length.
    large: [u64; 65],
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            n: 0,
            gap_sum: 0,
            ones: 0,
            twos: 0,
            small: [0; SMALL],
            large: [0; 65],
        }
    }
}

impl Stats {
    /// Records a magnitude of 3 or more.
    #[inline]
    fn add_rare(&mut self, magnitude: u64) {
        if (magnitude as usize) < SMALL {
            self.small[magnitude as usize] += 1;
        } else {
            self.large[(64 - magnitude.leading_zeros()) as usize] += 1;
        }
    }

    /// Records one change (the hot loop inlines the counters instead).
    #[inline]
    pub(super) fn add(&mut self, gap: u64, magnitude: u64) {
        self.n += 1;
        self.gap_sum += gap;
        match magnitude {
            1 => self.ones += 1,
            2 => self.twos += 1,
            m => self.add_rare(m),
        }
    }

    /// The Rice parameter for the gaps and an upper bound of the bits it costs.
    /// Chosen by the estimate `n·(k+1) + S/2^k − n·(1 − 2^−k)/2` (`S` the gap
    /// sum; the last term is the mean rounding loss of `⌊g/2^k⌋` for spread-out
    /// gaps); the returned bound `n·(k+1) + ⌊S/2^k⌋` is never below the truth.
    fn choose_rice_k(&self) -> (u8, u64) {
        let k = (0..=MAX_POS_K)
            .min_by(|&a, &b| {
                rice_estimate(self.n, self.gap_sum, a).total_cmp(&rice_estimate(
                    self.n,
                    self.gap_sum,
                    b,
                ))
            })
            .expect("non-empty range");
        (k, self.n * (k as u64 + 1) + (self.gap_sum >> k))
    }

    /// The Exp-Golomb order for step magnitudes and the bits it costs. Exact for
    /// magnitudes below [`SMALL`]; larger ones are counted at their bit length's
    /// upper bound.
    fn choose_eg_k(&self) -> (u8, u64) {
        (0..=20u8)
            .map(|k| {
                let s: u64 = (3..SMALL)
                    .filter(|&m| self.small[m] > 0)
                    .map(|m| self.small[m] * eg_bits(m as u64, k))
                    .sum::<u64>()
                    + self.ones * eg_bits(1, k)
                    + self.twos * eg_bits(2, k);
                let l: u64 = (0..65)
                    .filter(|&b| self.large[b] > 0)
                    .map(|b| {
                        self.large[b]
                            * eg_bits(if b == 64 { 1u64 << 63 } else { (1u64 << b) - 1 }, k)
                    })
                    .sum();
                (k, s + l)
            })
            .min_by_key(|&(_, bits)| bits)
            .expect("non-empty range")
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{bf16_pair, round_trip_block};
    use super::*;
    use crate::platform::expect::{platforms, require};

    #[test]
    fn rice_k_follows_the_mean_gap() {
        let mut st = Stats::default();
        for i in 0..1000 {
            st.add(40 + (i % 50), 1);
        }
        let (k, bits) = st.choose_rice_k();
        assert!((4..=6).contains(&k), "{k}");
        let exact: u64 = (0..1000u64)
            .map(|i| ((40 + (i % 50)) >> k) + 1 + k as u64)
            .sum();
        assert!(bits >= exact && bits - exact <= 1000, "{bits} vs {exact}");
        let mut z = Stats::default();
        for _ in 0..4 {
            z.add(0, 1);
        }
        assert_eq!(z.choose_rice_k(), (0, 4));
    }

    /// The exact choice over a whole block: every change staged, then written.
    fn staged_exactly(base: &[u8], new: &[u8]) -> BlockEntry {
        let (mut gaps, mut steps) = (Vec::new(), Vec::new());
        let mut st = Staged {
            stats: Stats::default(),
            gaps: &mut gaps,
            steps: &mut steps,
            next: 0,
            dig: 0,
        };
        let ctx = Ctx {
            kind: KeyKind::SignMagnitude,
            seed: TensorSeed(12345),
            first: 0,
        };
        for_each_change_piece_on(Platform::detect(), 2, base, new, |pf, ch, pa, pb| {
            stage_piece::<2>(ctx, &mut st, (pf, ch, pa, pb))
        });
        write_staged::<2>(&st.stats, st.gaps, st.steps, |_, at| load::<2>(new, at)).0
    }

    #[test]
    fn direct_writing_matches_the_exact_choice_on_uniform_blocks() {
        // Four times the sample: most of the block is written straight from the scan.
        let words = 4 * SAMPLE_WORDS;
        let (base, new) = bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 7) % 57 == 0);
        let e = round_trip_block(&base, &new);
        let exact = staged_exactly(&base, &new);
        assert_eq!(e.changes, exact.changes);
        assert!(
            e.bytes as f64 <= exact.bytes as f64 * 1.01,
            "{} vs exact {}",
            e.bytes,
            exact.bytes
        );
    }

    #[test]
    fn non_uniform_blocks_fall_back_to_the_exact_choice() {
        let words = 4 * SAMPLE_WORDS;
        // Sparse in the sample, dense afterwards: the sampled Rice parameter
        // would waste bits, so the block is re-encoded exactly.
        let (base, new) = bf16_pair(words, |i| {
            let h = (i.wrapping_mul(2_654_435_761) >> 7) % 1000;
            if i < SAMPLE_WORDS { h == 0 } else { h < 100 }
        });
        let e = round_trip_block(&base, &new);
        assert_eq!(e, staged_exactly(&base, &new));
        // Value sizes change after the sample: large steps only later.
        let (b2, mut n2) = bf16_pair(words, |i| i % 61 == 0);
        for i in (2 * SAMPLE_WORDS..words).step_by(61) {
            let w = u16::from_le_bytes([b2[2 * i], b2[2 * i + 1]]) ^ 0x0040;
            n2[2 * i..2 * i + 2].copy_from_slice(&w.to_le_bytes());
        }
        round_trip_block(&b2, &n2);
        // Raw values chosen from the sample.
        let (b3, mut n3) = bf16_pair(words, |_| false);
        for i in (0..words).step_by(13) {
            n3[2 * i + 1] ^= 0x80;
        }
        let e = round_trip_block(&b3, &n3);
        assert_eq!(e.values, ValueCoding::Raw);
    }

    /// The direct part of a block through the scalar path: `(changes, next,
    /// digest, value bits)` and the bytes.
    fn direct_scalar(
        ctx: Ctx,
        params: (u8, u8),
        (next, start): (u64, usize),
        base: &[u8],
        new: &[u8],
    ) -> ((u64, u64, u64, u64), Vec<u8>) {
        let mut w = FastWriter::default();
        let (mut nx, mut dg, mut vb, mut n) = (next, 0u64, 0u64, 0u64);
        for_each_change_piece_on(Platform::portable(), 2, base, new, |pf, changed, pa, pb| {
            let at = (start + pf, changed, pa, pb);
            let r = write_piece::<2>(ctx, params, &mut w, (nx, dg), at);
            (nx, dg) = (r.0, r.1);
            vb += r.2;
            n += changed.len() as u64;
        });
        ((n, nx, dg, vb), w.finish())
    }

    /// Every kind of entry the AVX-512 encoder meets or must leave to the
    /// scalar code: unit and larger steps, sign crossings, long gaps (entries
    /// over 56 bits), dense runs, sparse stretches whose changes are carried
    /// across regions, changes at the very end, partial last groups, both key
    /// kinds, and block offsets.
    #[test]
    fn vector_and_scalar_encoders_agree() {
        let words = 3 * 2048 + 37; // several regions and a ragged tail
        let mut cases: Vec<(Vec<u8>, Vec<u8>)> = vec![
            bf16_pair(words, |i| i % 67 == 3),
            bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 9) % 41 == 0),
            bf16_pair(words, |i| i % 3 != 0),
            bf16_pair(words, |i| i % 1500 == 7 || i >= words - 9),
            bf16_pair(words, |i| i == words - 1 || i < 5),
            bf16_pair(words, |i| i % 2048 == 2047 || i == 2048),
            bf16_pair(words, |_| true),
            bf16_pair(words, |_| false),
            // Exactly 8, then 9, changes in the scan's 32-word chunks.
            bf16_pair(words, |i| i % 32 < 8),
            bf16_pair(words, |i| i % 32 < 9),
        ];
        // Around zero: steps cross the sign (key order), and huge steps.
        let base: Vec<u8> = (0..words)
            .flat_map(|i| ((i % 4) as u16 | if i % 8 < 4 { 0 } else { 0x8000 }).to_le_bytes())
            .collect();
        let mut new = base.clone();
        for i in (0..words).step_by(5) {
            let w = u16::from_le_bytes([base[2 * i], base[2 * i + 1]]);
            let v = match i % 4 {
                0 => w ^ 0x8000,
                1 => w.wrapping_add(0x4000),
                2 => !w,
                _ => w ^ 0x8003,
            };
            let v = if v == w { v ^ 1 } else { v };
            new[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
        }
        cases.push((base, new));
        // The scalar reference on every case first (it must see changes), then
        // the vector encoder against it.
        let mut runs = Vec::new();
        for (c, (base, new)) in cases.iter().enumerate() {
            // Shorter cuts too: a last region of under 32 words, a single word.
            for len in [words, 2048 + 5, 1] {
                let (base, new) = (&base[..2 * len], &new[..2 * len]);
                for kind in [KeyKind::SignMagnitude, KeyKind::Identity] {
                    for params in [(0u8, 0u8), (2, 0), (6, 0), (6, 3), (13, 1), (40, 0)] {
                        for (next, first, start) in
                            [(0u64, 0u64, 0usize), (1000, 1 << 30, 3_000_000)]
                        {
                            let ctx = Ctx {
                                kind,
                                seed: TensorSeed(99),
                                first,
                            };
                            let scalar = direct_scalar(ctx, params, (next, start), base, new);
                            runs.push((c, len, ctx, params, (next, start), base, new, scalar));
                        }
                    }
                }
            }
        }
        assert!(runs.iter().any(|r| r.7.0.0 > 1000));
        if !require(Level::Avx512Vbmi2, "vector_and_scalar_encoders_agree") {
            return;
        }
        for (c, len, ctx, params, (next, start), base, new, scalar) in runs {
            let mut w = FastWriter::default();
            let (k, vk) = (params.0 as u32, params.1 as u32);
            let mut slow = |w: &mut FastWriter, g: u64, s: u64| {
                emit_step::<2>(w, k, vk, g, s, 0);
            };
            let part = Part {
                next,
                start: start as u64,
                base,
                new,
            };
            let r = vector::encode_direct(Platform::cpu(), ctx, (k, vk), part, &mut w, &mut slow)
                .expect("the CPU has the vector encoder");
            let got = ((r.changes, r.next, r.digest, r.value_bits), w.finish());
            assert!(
                scalar == got,
                "case {c} len {len} {:?} {params:?} {next} {start}",
                ctx.kind
            );
        }
    }

    /// Whole blocks, sample and direct part, encode to the same bytes on
    /// every platform the CPU has (portable, AVX2, AVX-512), for the four word
    /// widths.
    #[test]
    fn platforms_encode_the_same_blocks() {
        let words = SAMPLE_WORDS + 3 * 2048 + 11;
        let (base2, new2) = bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 7) % 61 == 0);
        let widen = |v: &[u8], wb: usize| -> Vec<u8> {
            v.chunks(2)
                .flat_map(|c| {
                    let mut w = vec![0u8; wb];
                    w[..2.min(wb)].copy_from_slice(&c[..2.min(wb)]);
                    w
                })
                .collect()
        };
        let run = |platform: Platform, wb: usize| {
            let (base, new) = (widen(&base2, wb), widen(&new2, wb));
            let ctx = Ctx {
                kind: KeyKind::SignMagnitude,
                seed: TensorSeed(5),
                first: 7,
            };
            let input = Input {
                platform,
                ctx,
                base: &base,
                new: &new,
            };
            encode_block(input, wb)
        };
        let portable: Vec<_> = [1, 2, 4, 8]
            .map(|wb| run(Platform::portable(), wb))
            .to_vec();
        assert!(matches!(portable[1].0.values, ValueCoding::Step));
        assert!(portable[1].0.changes > 1000);
        let test = "platforms_encode_the_same_blocks";
        for p in platforms(test, &[Level::Avx2, Level::Avx512Vbmi2]) {
            let level = p.level();
            for (wb, want) in [1, 2, 4, 8].into_iter().zip(&portable) {
                let got = run(p, wb);
                assert_eq!(got.0, want.0, "{level}, {wb} B");
                assert!(got.1 == want.1 && got.2 == want.2, "{level}, {wb} B");
            }
        }
    }

    #[test]
    fn eg_k_prefers_zero_for_unit_steps() {
        let mut st = Stats::default();
        for m in [1u64, 1, 1, 2] {
            st.add(0, m);
        }
        let (k, bits) = st.choose_eg_k();
        assert_eq!(k, 0);
        assert_eq!(bits, 2 + 2 + 2 + 4);
    }
}
