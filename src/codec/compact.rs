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
//! block from the data. `docs/format.md` specifies the bit layout.

use rayon::prelude::*;

use super::bits::{BitReader, FastWriter};
use super::scan::{PIECE, for_each_change_piece};
use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{
    KeyKind, from_key, load, read_word, step_magnitude, store, to_key, word_mask, write_word,
};
use crate::error::{Error, Result};
use crate::format::{BlockEntry, ValueCoding};

/// Words per block written by this crate (readers accept any value ≥ 1 recorded
/// in `block_words`). Blocks bound encoder memory and are the unit of parallelism.
pub const BLOCK_WORDS: u64 = 1 << 22;

/// Suffix of a compact payload tensor: `<name>.compact`.
pub const SUFFIX: &str = ".compact";

/// Largest Rice parameter a reader accepts.
pub const MAX_POS_K: u8 = 40;
/// Largest Exp-Golomb order a reader accepts.
pub const MAX_VAL_K: u8 = 32;

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

/// What a decoded entry says about the new word.
#[derive(Clone, Copy, Debug)]
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
            Value::Step(s) => from_key(
                kind,
                wb,
                to_key(kind, wb, old).wrapping_add(s) & word_mask(wb),
            ),
        }
    }
}

/// Diffs `base` against `new` and encodes the changes.
pub fn encode_tensor(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    base: &[u8],
    new: &[u8],
) -> EncodedTensor {
    let block_bytes = BLOCK_WORDS as usize * wb;
    let parts: Vec<(BlockEntry, Vec<u8>, u64)> = base
        .par_chunks(block_bytes)
        .zip(new.par_chunks(block_bytes))
        .enumerate()
        .map(|(b, (old, new))| encode_block(kind, wb, seed, b as u64 * BLOCK_WORDS, old, new))
        .collect();
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

fn encode_block(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
) -> (BlockEntry, Vec<u8>, u64) {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let Scratch { gaps, steps } = &mut *scratch;
        gaps.clear();
        steps.clear();
        let scratch = (gaps, steps);
        let vector = wb == 2 && super::vector::available();
        if super::cpu::wide() {
            // SAFETY: `cpu::wide()` confirmed every feature `encode_block_wide`
            // is compiled with; the function is otherwise safe code.
            #[cfg(target_arch = "x86_64")]
            return unsafe { encode_block_wide(kind, wb, seed, first, base, new, scratch, vector) };
        }
        crate::with_word_width!(wb, W => encode_block_w::<W>(kind, seed, first, base, new, scratch, vector))
    })
}

/// [`encode_block_w`] compiled for the wide feature set (see [`super::cpu`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
#[allow(clippy::too_many_arguments)]
fn encode_block_wide(
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
    scratch: (&mut Vec<u64>, &mut Vec<u64>),
    vector: bool,
) -> (BlockEntry, Vec<u8>, u64) {
    crate::with_word_width!(wb, W => encode_block_w::<W>(kind, seed, first, base, new, scratch, vector))
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
#[inline(always)]
fn encode_block_w<const W: usize>(
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    base: &[u8],
    new: &[u8],
    (gaps, steps): (&mut Vec<u64>, &mut Vec<u64>),
    vector: bool,
) -> (BlockEntry, Vec<u8>, u64) {
    let block_words = (base.len() / W) as u64;
    let mut stats = Stats::default();
    let mut next = 0u64; // first index the next gap counts from
    let mut dig = 0u64;
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
        for_each_change_piece(W, &base[off..end], &new[off..end], |_, changed, pa, pb| {
            let state = (&mut next, &mut dig);
            let at = (piece_first, changed, pa, pb);
            stage_piece::<W>(kind, seed, first, &mut stats, state, gaps, steps, at);
        });
        off = end;
        let scanned = off / W;
        if gaps.is_empty() || (scanned < SAMPLE_WORDS && gaps.len() < SAMPLE_CHANGES) {
            continue;
        }
        let (pk, pos_bits) = stats.choose_rice_k();
        let (vk, step_bits) = stats.choose_eg_k();
        if step_bits >= stats.n * W as u64 * 8 {
            phase = Phase::StageAll;
            break;
        }
        (pos_k, val_k, sample_vbits) = (pk, vk, step_bits);
        // Room for the whole block at the sample's rate, plus a margin.
        let est = (pos_bits + step_bits) / 8 * block_words / scanned as u64;
        w.reserve((est + est / 8) as usize);
        for (&g, &st) in gaps.iter().zip(steps.iter()) {
            emit_step::<W>(&mut w, pos_k as u32, val_k as u32, g, st, 0);
        }
        phase = Phase::Direct;
    }
    let (rest_a, rest_b, rest_first) = (&base[off..], &new[off..], off / W);
    match phase {
        Phase::Direct if vector => {
            // `vector::available()` is false off x86-64.
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("the AVX-512 encoder chosen off x86-64");
            #[cfg(target_arch = "x86_64")]
            {
                let mut slow = |w: &mut FastWriter, g: u64, s: u64| {
                    emit_step::<W>(w, pos_k as u32, val_k as u32, g, s, 0);
                };
                // SAFETY: `vector` is true only where `vector::available()`
                // confirmed the CPU's features (see `encode_block`). Equal
                // output to the scalar arm is tested by
                // `vector_and_scalar_encoders_agree`.
                let r = unsafe {
                    super::vector::encode_direct_w2(
                        kind == KeyKind::SignMagnitude,
                        seed.0,
                        (pos_k as u32, val_k as u32),
                        &mut w,
                        next,
                        first,
                        rest_first as u64,
                        rest_a,
                        rest_b,
                        &mut slow,
                    )
                };
                (direct_n, next, direct_vbits) = (r.changes, r.next, r.value_bits);
                dig = dig.wrapping_add(r.digest);
            }
        }
        Phase::Direct => {
            for_each_change_piece(W, rest_a, rest_b, |piece_first, changed, pa, pb| {
                let at = (rest_first + piece_first, changed, pa, pb);
                let (nx, dg, vb) =
                    write_piece::<W>(kind, seed, first, (pos_k, val_k), &mut w, (next, dig), at);
                (next, dig) = (nx, dg);
                direct_vbits += vb;
                direct_n += changed.len() as u64;
            });
        }
        Phase::StageAll => {
            for_each_change_piece(W, rest_a, rest_b, |piece_first, changed, pa, pb| {
                let state = (&mut next, &mut dig);
                let at = (rest_first + piece_first, changed, pa, pb);
                stage_piece::<W>(kind, seed, first, &mut stats, state, gaps, steps, at);
            });
        }
        Phase::Sample => {}
    }
    if phase == Phase::Direct {
        let n = stats.n + direct_n;
        let gap_sum = next - n;
        let best = (0..=MAX_POS_K)
            .map(|k| rice_estimate(n, gap_sum, k))
            .fold(f64::INFINITY, f64::min);
        let total = w.bit_len() as f64;
        let pos_loss = rice_estimate(n, gap_sum, pos_k) - best;
        // The sample's value bits per change, applied to the direct part.
        let expect = sample_vbits as f64 * direct_n as f64 / stats.n as f64;
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
            return (e, bytes, dig);
        }
        // The block is not uniform enough for the sample: stage all of it.
        gaps.clear();
        steps.clear();
        stats = Stats::default();
        (next, dig) = (0, 0);
        for_each_change_piece(W, base, new, |piece_first, changed, pa, pb| {
            let state = (&mut next, &mut dig);
            let at = (piece_first, changed, pa, pb);
            stage_piece::<W>(kind, seed, first, &mut stats, state, gaps, steps, at);
        });
    }
    let bytes = write_staged::<W>(&stats, gaps, steps, new);
    (bytes.0, bytes.1, dig)
}

/// Stages the changes of one piece: gaps, steps, statistics, digest change.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn stage_piece<const W: usize>(
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    stats: &mut Stats,
    (next, dig): (&mut u64, &mut u64),
    gaps: &mut Vec<u64>,
    steps: &mut Vec<u64>,
    (piece_first, changed, pa, pb): (usize, &[u16], &[u8], &[u8]),
) {
    // One tight loop over the piece's changes, with the running state in locals.
    let (mut nx, mut dg) = (*next, *dig);
    let (mut gsum, mut ones, mut twos) = (0u64, 0u64, 0u64);
    gaps.reserve(changed.len());
    steps.reserve(changed.len());
    for chunk in changed.chunks(LANES) {
        let walk = (kind, seed, first, piece_first);
        let d = walk_changes::<W>(walk, &mut nx, chunk, pa, pb, |g, s| {
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
    *next = nx;
    *dig = dg;
}

/// Walks up to [`LANES`] changes of a piece (`chunk`: indices into it,
/// ascending), calling `f(gap, step)` for each: the gap counted from `*next`
/// (which moves past the change) and the masked step of the ordered key.
/// Returns the chunk's digest change. `walk` is the tensor's key kind and seed,
/// the block's first word in the tensor and the piece's first word in the block.
#[inline(always)]
fn walk_changes<const W: usize>(
    (kind, seed, first, piece_first): (KeyKind, TensorSeed, u64, usize),
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
            to_key(kind, W, nw).wrapping_sub(to_key(kind, W, old)) & mask,
        );
        *next = i + 1;
        (batch.index[j], batch.old[j], batch.new[j]) = (first + i, old, nw);
    }
    seed.change_sum(&batch)
}

/// Writes the changes of one piece straight into the stream (parameters
/// fixed); returns the new `(next, digest)` and the value bits written. `at`
/// is the piece's first word in the block, its changes and its words.
#[inline(always)]
fn write_piece<const W: usize>(
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    (pos_k, val_k): (u8, u8),
    w: &mut FastWriter,
    (mut nx, mut dg): (u64, u64),
    (piece_first, changed, pa, pb): (usize, &[u16], &[u8], &[u8]),
) -> (u64, u64, u64) {
    let room = changed.len() * 8;
    w.reserve(room);
    let mut vb = 0u64;
    for chunk in changed.chunks(LANES) {
        let walk = (kind, seed, first, piece_first);
        let d = walk_changes::<W>(walk, &mut nx, chunk, pa, pb, |g, s| {
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

/// Encodes staged changes with parameters chosen from all of them.
fn write_staged<const W: usize>(
    stats: &Stats,
    gaps: &[u64],
    steps: &[u64],
    new: &[u8],
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
            for &g in gaps {
                at += g;
                w.put_unary(g >> k);
                w.put(g & ((1u64 << k) - 1), k);
                w.put(load::<W>(new, at as usize), W as u32 * 8);
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
struct Stats {
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
    #[cfg(test)]
    fn add(&mut self, gap: u64, magnitude: u64) {
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

/// Splits a payload into per-block streams, checking the directory against the
/// tensor (`words` words) and the payload's real length.
pub fn split_blocks<'a>(
    tensor: &str,
    words: u64,
    block_words: u64,
    blocks: &[BlockEntry],
    payload: &'a [u8],
) -> Result<Vec<&'a [u8]>> {
    if block_words == 0 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.block_words"),
            "must be at least 1",
        ));
    }
    if words.div_ceil(block_words) != blocks.len() as u64 {
        return Err(Error::metadata(
            format!("tensors.{tensor}.blocks"),
            format!(
                "{} blocks listed, {words} words in blocks of {block_words} need {}",
                blocks.len(),
                words.div_ceil(block_words)
            ),
        ));
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut at = 0usize;
    for (b, e) in blocks.iter().enumerate() {
        let end = usize::try_from(e.bytes)
            .ok()
            .and_then(|n| at.checked_add(n))
            .filter(|&end| end <= payload.len())
            .ok_or_else(|| {
                Error::tensor(
                    tensor,
                    format!("block {b} claims more bytes than the payload holds"),
                )
            })?;
        out.push(&payload[at..end]);
        at = end;
    }
    if at != payload.len() {
        return Err(Error::tensor(
            tensor,
            format!("payload has {} bytes, blocks describe {at}", payload.len()),
        ));
    }
    Ok(out)
}

/// Decodes one block, calling `f(index_in_block, value)` for each entry, and
/// checks that the stream holds exactly what the entry claims. With `limit`,
/// stops after that many entries (used to undo a partial apply).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn decode_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    wb: usize,
    block_len: u64,
    limit: Option<u64>,
    mut f: impl FnMut(u64, Value) -> Result<()>,
) -> Result<()> {
    let bad = |what: &str| Error::tensor(tensor, format!("block {b}: {what}"));
    if e.pos_k > MAX_POS_K || e.val_k > MAX_VAL_K {
        return Err(bad("coding parameter out of range"));
    }
    if e.changes > block_len {
        return Err(bad("more changes than words"));
    }
    // Every entry takes at least pos_k + 2 bits: reject lying counts up front.
    let min_bits = e.changes.saturating_mul(e.pos_k as u64 + 2);
    if min_bits > stream.len() as u64 * 8 {
        return Err(bad("stream too short for the claimed number of changes"));
    }
    let bits = wb as u32 * 8;
    let half = 1u64 << (bits - 1);
    let mask = word_mask(wb);
    let mut r = BitReader::new(stream);
    let mut next = 0u64;
    let q_limit = block_len >> e.pos_k;
    let count = limit.map_or(e.changes, |l| l.min(e.changes));
    let k = e.pos_k as u32;
    let low_mask = (1u64 << k) - 1;
    for _ in 0..count {
        // Fast path: the whole Rice code is buffered.
        r.ensure();
        let (acc, avail) = r.peek();
        let tz = acc.trailing_zeros();
        let gap = if tz < 64 && tz + 1 + k <= avail && (tz as u64) <= q_limit {
            r.consume(tz + 1 + k);
            ((tz as u64) << k) | ((acc >> tz >> 1) & low_mask)
        } else {
            let q = r
                .unary(q_limit)
                .ok_or_else(|| bad("truncated or invalid position"))?;
            let low = r.get(k).ok_or_else(|| bad("truncated position"))?;
            (q << k) | low
        };
        let idx = next + gap;
        if idx >= block_len {
            return Err(bad("position beyond the block"));
        }
        next = idx + 1;
        let v = match e.values {
            ValueCoding::Raw => Value::Raw(r.get(bits).ok_or_else(|| bad("truncated value"))?),
            ValueCoding::Step => {
                r.ensure();
                let (acc, avail) = r.peek();
                let z = acc.trailing_zeros();
                let width = z + e.val_k as u32;
                let (y, neg) = if z < 64 && width <= 63 && z + width + 2 <= avail {
                    let rest = (acc >> z >> 1) & ((1u64 << width) - 1);
                    let neg = (acc >> (z + 1 + width)) & 1 == 1;
                    r.consume(z + width + 2);
                    ((1u64 << width) | rest, neg)
                } else {
                    let z = r
                        .unary(64)
                        .ok_or_else(|| bad("truncated or invalid step"))?;
                    let width = z + e.val_k as u64;
                    if width > 63 {
                        return Err(bad("step too large"));
                    }
                    let rest = r.get(width as u32).ok_or_else(|| bad("truncated step"))?;
                    let neg = r.get(1).ok_or_else(|| bad("truncated sign"))? == 1;
                    ((1u64 << width) | rest, neg)
                };
                let m = y - (1u64 << e.val_k) + 1;
                if m > half {
                    return Err(bad("step larger than the word"));
                }
                // Branch-free negate: the sign is a coin flip.
                let flip = u64::from(neg).wrapping_neg();
                Value::Step(((m ^ flip).wrapping_add(u64::from(neg))) & mask)
            }
        };
        f(idx, v)?;
    }
    if limit.is_none() && !r.at_clean_end() {
        return Err(bad("trailing bytes after the last change"));
    }
    Ok(())
}

/// What [`undo_block`] needs to restore a block after [`apply_block`].
#[derive(Default)]
pub struct BlockUndo {
    /// Entries written to the tensor: always a prefix of the block's entries.
    pub applied: u64,
    /// Raw-coded blocks only: the overwritten old words, in entry order.
    /// Step-coded blocks keep none: a step is inverted exactly, the old word
    /// being `unkey((key(new) − step) mod 2^(8·wb))` (`key` is a bijection), so
    /// the stream and the tensor are all the undo needs.
    pub old_words: Vec<u8>,
}

/// Applies one block in place: writes every new word and returns the digest
/// change. On error, `undo` describes what was written so far (see
/// [`undo_block`]).
#[allow(clippy::too_many_arguments)]
pub fn apply_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut BlockUndo,
) -> Result<u64> {
    if super::cpu::wide() {
        // SAFETY: `cpu::wide()` confirmed every feature `apply_block_wide` is
        // compiled with; the function is otherwise safe code.
        #[cfg(target_arch = "x86_64")]
        return unsafe { apply_block_wide(tensor, b, e, stream, kind, wb, seed, first, blk, undo) };
    }
    crate::with_word_width!(wb, W => apply_block_w::<W>(tensor, b, e, stream, kind, seed, first, blk, undo))
}

/// [`apply_block_w`] compiled for the wide feature set (see [`super::cpu`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
#[allow(clippy::too_many_arguments)]
fn apply_block_wide(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    wb: usize,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut BlockUndo,
) -> Result<u64> {
    crate::with_word_width!(wb, W => apply_block_w::<W>(tensor, b, e, stream, kind, seed, first, blk, undo))
}

/// Entries decoded ahead before the tensor is touched: the old words of a
/// batch are loaded back to back, so their cache misses overlap. Also the
/// group size of step-coded blocks' pipeline.
const BATCH: usize = LANES;

/// Groups of [`BATCH`] entries held by the step-coded pipeline: a group is
/// written `SLOTS - 1` groups (240 entries) after it was decoded and its
/// lines prefetched into the second-level cache, far enough ahead for the
/// memory latency (see `cpu::prefetch_l2`).
const SLOTS: usize = 16;

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn apply_block_w<const W: usize>(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut BlockUndo,
) -> Result<u64> {
    if e.values == ValueCoding::Step {
        return apply_steps_w::<W>(tensor, b, e, stream, kind, seed, first, blk, undo);
    }
    let mut dig = 0u64;
    let len = (blk.len() / W) as u64;
    // Reserve from what the stream can really hold (each entry takes at least
    // pos_k + 2 bits), not from the header's claim.
    let possible = (stream.len() as u64 * 8) / (e.pos_k as u64 + 2);
    let BlockUndo { applied, old_words } = undo;
    old_words.reserve(e.changes.min(len).min(possible) as usize * W);
    let mut pending = [(0u64, Value::Raw(0)); BATCH];
    let mut count = 0usize;
    let mut flush = |batch: &[(u64, Value)]| -> Result<()> {
        let mut olds = [0u64; BATCH];
        for (o, &(i, _)) in olds.iter_mut().zip(batch) {
            *o = load::<W>(blk, i as usize);
        }
        for (&old, &(i, v)) in olds.iter().zip(batch) {
            let new = v.resolve(kind, W, old);
            if new == old {
                return Err(unchanged_error(tensor, b, first + i));
            }
            old_words.extend_from_slice(&old.to_le_bytes()[..W]);
            store::<W>(blk, i as usize, new);
            *applied += 1;
            dig = dig.wrapping_add(seed.change(first + i, old, new));
        }
        Ok(())
    };
    decode_block(tensor, b, e, stream, W, len, None, |i, v| {
        pending[count] = (i, v);
        count += 1;
        if count == BATCH {
            flush(&pending)?;
            count = 0;
        }
        Ok(())
    })?;
    flush(&pending[..count])?;
    Ok(dig)
}

/// One entry of a step-coded block: the gap, the masked step and the bits it
/// took, decoded from the stream at bit `at`.
///
/// The fast path reads the 8 bytes holding bit `at` as one little-endian word
/// (at least 57 valid bits) and decodes an entry of up to 56 bits from it with
/// two trailing-zero counts: no refill state, no branch on the data except the
/// length checks, which a well-formed stream passes. Everything else (a long
/// gap or step, the last 8 bytes of the stream, any malformed code) goes to
/// [`step_entry_slow`], which decodes exactly as [`decode_block`] does.
#[inline(always)]
fn step_entry<const W: usize>(
    stream: &[u8],
    at: u64,
    (k, vk): (u32, u32),
    q_limit: u64,
) -> std::result::Result<(u64, u64, u32), &'static str> {
    let byte = (at >> 3) as usize;
    if let Some(chunk) = stream.get(byte..byte + 8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes")) >> (at & 7);
        let tz = word.trailing_zeros();
        let glen = tz + 1 + k;
        if glen <= 54 {
            let vw = word >> glen;
            let z = vw.trailing_zeros();
            let width = z + vk;
            let used = glen + z + 1 + width + 1;
            if used <= 56 {
                let gap = ((tz as u64) << k) | ((word >> (tz + 1)) & ((1u64 << k) - 1));
                let rest = (vw >> (z + 1)) & ((1u64 << width) - 1);
                let neg = (vw >> (z + 1 + width)) & 1;
                let m = ((1u64 << width) | rest) - (1u64 << vk) + 1;
                if m <= 1u64 << (W * 8 - 1) {
                    let s = ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & word_mask(W);
                    return Ok((gap, s, used));
                }
                return Err("step larger than the word");
            }
        }
    }
    step_entry_slow::<W>(stream, at, (k, vk), q_limit)
}

#[cold]
#[inline(never)]
fn step_entry_slow<const W: usize>(
    stream: &[u8],
    at: u64,
    (k, vk): (u32, u32),
    q_limit: u64,
) -> std::result::Result<(u64, u64, u32), &'static str> {
    // The same reads and messages as `decode_block`.
    let mut r = BitReader::new(stream.get((at >> 3) as usize..).unwrap_or(&[]));
    let start = r.remaining_bits();
    r.get((at & 7) as u32)
        .ok_or("truncated or invalid position")?;
    let q = r.unary(q_limit).ok_or("truncated or invalid position")?;
    let gap = (q << k) | r.get(k).ok_or("truncated position")?;
    let z = r.unary(64).ok_or("truncated or invalid step")?;
    let width = z + vk as u64;
    if width > 63 {
        return Err("step too large");
    }
    let rest = r.get(width as u32).ok_or("truncated step")?;
    let neg = r.get(1).ok_or("truncated sign")?;
    let m = ((1u64 << width) | rest) - (1u64 << vk) + 1;
    if m > 1u64 << (W * 8 - 1) {
        return Err("step larger than the word");
    }
    let s = ((m ^ neg.wrapping_neg()).wrapping_add(neg)) & word_mask(W);
    let used = start - r.remaining_bits() - (at & 7);
    Ok((gap, s, used as u32))
}

/// [`apply_block_w`] for step-coded blocks: decodes a batch of entries, then
/// writes them. Steps never leave a word unchanged (1 ≤ |s| ≤ 2^(8·wb−1), and
/// keys are a bijection), so no entry needs that check, and nothing is logged:
/// [`undo_block`] inverts the steps.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn apply_steps_w<const W: usize>(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    blk: &mut [u8],
    undo: &mut BlockUndo,
) -> Result<u64> {
    let bad = |what: &str| Error::tensor(tensor, format!("block {b}: {what}"));
    let len = (blk.len() / W) as u64;
    if e.pos_k > MAX_POS_K || e.val_k > MAX_VAL_K {
        return Err(bad("coding parameter out of range"));
    }
    if e.changes > len {
        return Err(bad("more changes than words"));
    }
    let min_bits = e.changes.saturating_mul(e.pos_k as u64 + 2);
    if min_bits > stream.len() as u64 * 8 {
        return Err(bad("stream too short for the claimed number of changes"));
    }
    let params = (e.pos_k as u32, e.val_k as u32);
    let q_limit = len >> e.pos_k;
    let vector = W == 2 && super::vector::available();
    let mut dig = 0u64;
    let mut at = 0u64; // bit position in the stream
    let mut next = 0u64;
    // Software pipeline, a group of BATCH entries at a time: each entry's
    // cache line is prefetched (into the second-level cache) as soon as it is
    // decoded, and its group is written SLOTS − 1 groups later, by when the
    // lines have arrived; so the memory system always has many misses in
    // flight while the (serial) decoding goes on.
    let mut slots = [Group::default(); SLOTS];
    let groups = e.changes.div_ceil(BATCH as u64);
    let mut written = 0u64;
    let mut result = Ok(());
    for n in 0..groups {
        let g = &mut slots[n as usize % SLOTS];
        g.count = (e.changes - n * BATCH as u64).min(BATCH as u64) as usize;
        if let Err(what) =
            decode_group::<W>(stream, (params, q_limit), blk, (&mut at, &mut next), g)
        {
            result = Err(bad(what));
            break;
        }
        if n >= SLOTS as u64 - 1 {
            let g = &slots[(n as usize + 1) % SLOTS];
            dig = dig.wrapping_add(write_group::<W>(kind, seed, first, vector, blk, g));
            written += g.count as u64;
        }
    }
    undo.applied = written;
    result?;
    // Drain the pipeline in entry order.
    for n in groups.saturating_sub(SLOTS as u64 - 1)..groups {
        let g = &slots[n as usize % SLOTS];
        dig = dig.wrapping_add(write_group::<W>(kind, seed, first, vector, blk, g));
    }
    undo.applied = e.changes;
    // Fewer than 8 bits may remain, all zero padding.
    let total = stream.len() as u64 * 8;
    let clean = total - at < 8 && (at == total || stream[stream.len() - 1] >> (at & 7) == 0);
    if !clean {
        return Err(bad("trailing bytes after the last change"));
    }
    Ok(dig)
}

/// Decodes the next `g.count` entries of a step-coded stream into `g`,
/// prefetching each one's word of `blk`. `pos` is the bit position in the
/// stream and the index the next gap counts from; both move on.
///
/// The bit position and the index are the loop's own locals, written back
/// once per group: the bit position is on the loop's critical path, and
/// sharing it with the pipeline had put it in memory (a stack spill per
/// entry, seen with `perf annotate`).
#[inline(always)]
fn decode_group<const W: usize>(
    stream: &[u8],
    (params, q_limit): ((u32, u32), u64),
    blk: &[u8],
    pos: (&mut u64, &mut u64),
    g: &mut Group,
) -> std::result::Result<(), &'static str> {
    let len = (blk.len() / W) as u64;
    let (mut at, mut next) = (*pos.0, *pos.1);
    let mut result = Ok(());
    for j in 0..g.count.min(BATCH) {
        let (gap, s, used) = match step_entry::<W>(stream, at, params, q_limit) {
            Ok(x) => x,
            Err(what) => {
                result = Err(what);
                break;
            }
        };
        at += used as u64;
        let i = next + gap;
        if i >= len {
            result = Err("position beyond the block");
            break;
        }
        next = i + 1;
        super::cpu::prefetch_l2(blk, i as usize * W);
        (g.index[j], g.step[j]) = (i, s);
    }
    (*pos.0, *pos.1) = (at, next);
    result
}

/// Decoded step-coded entries waiting to be written: block indices
/// (ascending) and masked steps of the first `count` lanes.
#[derive(Clone, Copy, Default)]
struct Group {
    index: [u64; BATCH],
    step: [u64; BATCH],
    count: usize,
}

/// Writes a group's new words (old key + step) and returns its digest change.
#[inline(always)]
fn write_group<const W: usize>(
    kind: KeyKind,
    seed: TensorSeed,
    first: u64,
    vector: bool,
    blk: &mut [u8],
    g: &Group,
) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if vector {
        // SAFETY: `vector` is true only where `vector::available()` confirmed
        // the CPU's features. Equal results to the loop below are tested by
        // `vector_and_scalar_group_writes_agree`.
        return unsafe {
            super::vector::apply_steps_w2(
                kind == KeyKind::SignMagnitude,
                seed.0,
                first,
                blk,
                (&g.index, &g.step, g.count),
            )
        };
    }
    let _ = vector;
    let mask = word_mask(W);
    let mut batch = ChangeBatch::default();
    for j in 0..g.count {
        let i = g.index[j] as usize;
        let old = load::<W>(blk, i);
        let new = from_key(kind, W, to_key(kind, W, old).wrapping_add(g.step[j]) & mask);
        store::<W>(blk, i, new);
        (batch.index[j], batch.old[j], batch.new[j]) = (first + i as u64, old, new);
    }
    seed.change_sum(&batch)
}

#[cold]
#[inline(never)]
fn unchanged_error(tensor: &str, b: usize, at: u64) -> Error {
    Error::tensor(
        tensor,
        format!("block {b} lists element {at} as changed but it is not"),
    )
}

/// Restores the words [`apply_block`] overwrote, as recorded in `undo`
/// (positions and steps are decoded again; they do not depend on the base).
#[allow(clippy::too_many_arguments)]
pub fn undo_block(
    tensor: &str,
    b: usize,
    e: &BlockEntry,
    stream: &[u8],
    kind: KeyKind,
    wb: usize,
    blk: &mut [u8],
    undo: &BlockUndo,
) {
    let len = (blk.len() / wb) as u64;
    let mask = word_mask(wb);
    let mut j = 0usize;
    // These entries decoded successfully once, so decoding them again cannot fail.
    let _ = decode_block(tensor, b, e, stream, wb, len, Some(undo.applied), |i, v| {
        let old = match v {
            Value::Raw(_) => read_word(&undo.old_words, wb, j),
            Value::Step(s) => {
                let cur = read_word(blk, wb, i as usize);
                from_key(kind, wb, to_key(kind, wb, cur).wrapping_sub(s) & mask)
            }
        };
        write_word(blk, wb, i as usize, old);
        j += 1;
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A BF16 block of `words` words and a copy with changes at the positions
    /// `pick` selects (±1..±3 ulp, some large jumps).
    fn bf16_pair(words: usize, pick: impl Fn(usize) -> bool) -> (Vec<u8>, Vec<u8>) {
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

    /// Encodes one block, applies it to a copy of the base, checks the result
    /// and the digest change, then undoes it and checks the base is back.
    fn round_trip_block(base: &[u8], new: &[u8]) -> BlockEntry {
        let seed = TensorSeed(12345);
        let kind = KeyKind::SignMagnitude;
        let enc = encode_tensor(kind, 2, seed, base, new);
        assert_eq!(enc.blocks.len(), 1);
        let e = enc.blocks[0].clone();
        let mut blk = base.to_vec();
        let mut undo = BlockUndo::default();
        let dig = apply_block(
            "t",
            0,
            &e,
            &enc.payload,
            kind,
            2,
            seed,
            0,
            &mut blk,
            &mut undo,
        )
        .expect("apply");
        assert!(blk == new, "applied block differs");
        assert_eq!(dig, enc.digest_change);
        assert_eq!(undo.applied, e.changes);
        undo_block("t", 0, &e, &enc.payload, kind, 2, &mut blk, &undo);
        assert!(blk == base, "undo did not restore the block");
        e
    }

    #[test]
    fn direct_writing_matches_the_exact_choice_on_uniform_blocks() {
        // Four times the sample: most of the block is written straight from the scan.
        let words = 4 * SAMPLE_WORDS;
        let (base, new) = bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 7) % 57 == 0);
        let e = round_trip_block(&base, &new);
        // The exact choice over the whole block, for comparison.
        let (mut gaps, mut steps, mut stats) = (Vec::new(), Vec::new(), Stats::default());
        let (mut next, mut dig) = (0, 0);
        for_each_change_piece(2, &base, &new, |pf, ch, pa, pb| {
            stage_piece::<2>(
                KeyKind::SignMagnitude,
                TensorSeed(12345),
                0,
                &mut stats,
                (&mut next, &mut dig),
                &mut gaps,
                &mut steps,
                (pf, ch, pa, pb),
            )
        });
        let (exact, _) = write_staged::<2>(&stats, &gaps, &steps, &new);
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
        round_trip_block(&base, &new);
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

    #[test]
    fn a_failure_deep_in_a_block_is_undone_exactly() {
        // Hundreds of entries, so the failure comes several pipelined batches
        // in: written batches, the decoded-but-unwritten one and the failing
        // one must together undo to exactly the base.
        let (base, new) = bf16_pair(40_000, |i| i % 37 == 5);
        let (seed, kind) = (TensorSeed(7), KeyKind::SignMagnitude);
        let enc = encode_tensor(kind, 2, seed, &base, &new);
        let e = enc.blocks[0].clone();
        assert!(e.changes > 20 * BATCH as u64);
        // Applies `e` (with `stream`) to a copy of the base; it must fail, and
        // undoing what it wrote must give the base back exactly.
        let fails_cleanly = |e: &BlockEntry, stream: &[u8]| {
            let mut blk = base.clone();
            let mut undo = BlockUndo::default();
            let r = apply_block("t", 0, e, stream, kind, 2, seed, 0, &mut blk, &mut undo);
            assert!(r.is_err(), "a damaged block must not apply");
            undo_block("t", 0, e, stream, kind, 2, &mut blk, &undo);
            assert!(blk == base, "undo after a failure");
            undo.applied
        };
        for cut in [1usize, 2, 3, 5, 9, 40] {
            // Lose the stream's tail: decoding fails near the end.
            let stream = &enc.payload[..enc.payload.len() - cut];
            let short = BlockEntry {
                bytes: stream.len() as u64,
                ..e.clone()
            };
            let applied = fails_cleanly(&short, stream);
            assert!(
                applied > 2 * BATCH as u64 && applied < e.changes,
                "cut {cut}"
            );
        }
        // A claimed count one too high fails only after every real entry was
        // decoded, in group `changes / BATCH`: the groups before it are
        // written, but for the last two (decoded, waiting in the pipeline).
        let more = BlockEntry {
            changes: e.changes + 1,
            ..e.clone()
        };
        let failing = e.changes / BATCH as u64;
        let written = (failing + 1 - SLOTS as u64) * BATCH as u64;
        assert_eq!(fails_cleanly(&more, &enc.payload), written);
        assert!(written >= e.changes - (SLOTS * BATCH) as u64);
    }

    /// Group writes with and without AVX-512: same words, same digest, for
    /// both key kinds, every group size, steps of every size and sign
    /// (crossing zero and wrapping), and words at the block's very end.
    #[test]
    fn vector_and_scalar_group_writes_agree() {
        let words = 600usize;
        let (base, _) = bf16_pair(words, |_| false);
        let mut base = base;
        // Special words: ±0, the extremes, around the sign.
        for (j, w) in [0u16, 0x8000, 0x7fff, 0xffff, 1, 0x8001]
            .into_iter()
            .enumerate()
        {
            base[2 * j..2 * j + 2].copy_from_slice(&w.to_le_bytes());
        }
        let vector = super::super::vector::available();
        eprintln!("AVX-512 apply available: {vector}");
        let mut x = 0x1234_5678_9abc_def1u64;
        for kind in [KeyKind::SignMagnitude, KeyKind::Identity] {
            for count in 0..=BATCH {
                for round in 0..20u64 {
                    let mut g = Group {
                        count,
                        // Stale lanes past `count` must not matter.
                        index: [7; BATCH],
                        step: [0xdead; BATCH],
                    };
                    let mut i = if round % 2 == 0 { 0 } else { words - count };
                    for j in 0..count {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let step = match x % 5 {
                            0 => 1,
                            1 => 0xffff,
                            2 => 1 + (x >> 40) % 300,
                            3 => 0x8000,
                            _ => (x >> 20) & 0xffff,
                        }
                        .max(1);
                        (g.index[j], g.step[j]) = (i as u64, step);
                        i += 1 + (round as usize % 3) * ((x >> 60) as usize % 2);
                        i = i.min(words - (count - j - 1));
                    }
                    let run = |vector: bool| {
                        let mut blk = base.clone();
                        let d =
                            write_group::<2>(kind, TensorSeed(3), 1 << 33, vector, &mut blk, &g);
                        (d, blk)
                    };
                    let scalar = run(false);
                    if count > 0 {
                        assert!(scalar.1 != base, "the scalar write changed nothing");
                    }
                    if vector {
                        assert!(run(true) == scalar, "{kind:?} count {count} round {round}");
                    }
                }
            }
        }
    }

    /// The direct part of a block through the scalar path: `(changes, next,
    /// digest, value bits)` and the bytes.
    fn direct_scalar(
        kind: KeyKind,
        params: (u8, u8),
        (next, first, start): (u64, u64, usize),
        base: &[u8],
        new: &[u8],
    ) -> ((u64, u64, u64, u64), Vec<u8>) {
        let mut w = FastWriter::default();
        let (mut nx, mut dg, mut vb, mut n) = (next, 0u64, 0u64, 0u64);
        for_each_change_piece(2, base, new, |pf, changed, pa, pb| {
            let at = (start + pf, changed, pa, pb);
            let r = write_piece::<2>(kind, TensorSeed(99), first, params, &mut w, (nx, dg), at);
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
        let vector = super::super::vector::available();
        eprintln!("AVX-512 encoder available: {vector}");
        for (c, (base, new)) in cases.iter().enumerate() {
            // Shorter cuts too: a last region of under 32 words, a single word.
            for len in [words, 2048 + 5, 1] {
                let (base, new) = (&base[..2 * len], &new[..2 * len]);
                for kind in [KeyKind::SignMagnitude, KeyKind::Identity] {
                    for params in [(0u8, 0u8), (2, 0), (6, 0), (6, 3), (13, 1), (40, 0)] {
                        for at in [(0u64, 0u64, 0usize), (1000, 1 << 30, 3_000_000)] {
                            let scalar = direct_scalar(kind, params, at, base, new);
                            #[cfg(target_arch = "x86_64")]
                            if vector {
                                let mut w = FastWriter::default();
                                let (k, vk) = (params.0 as u32, params.1 as u32);
                                let mut slow = |w: &mut FastWriter, g: u64, s: u64| {
                                    emit_step::<2>(w, k, vk, g, s, 0);
                                };
                                // SAFETY: the CPU's features were checked above.
                                let r = unsafe {
                                    super::super::vector::encode_direct_w2(
                                        kind == KeyKind::SignMagnitude,
                                        99,
                                        (k, vk),
                                        &mut w,
                                        at.0,
                                        at.1,
                                        at.2 as u64,
                                        base,
                                        new,
                                        &mut slow,
                                    )
                                };
                                let got = ((r.changes, r.next, r.digest, r.value_bits), w.finish());
                                assert!(
                                    scalar == got,
                                    "case {c} len {len} {kind:?} {params:?} {at:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Whole blocks, sample and direct part, encode to the same bytes with
    /// and without the AVX-512 encoder.
    #[test]
    fn vector_and_scalar_blocks_agree() {
        let words = SAMPLE_WORDS + 3 * 2048 + 11;
        let (base, new) = bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 7) % 61 == 0);
        let vector = super::super::vector::available();
        let run = |vector: bool| {
            let (mut gaps, mut steps) = (Vec::new(), Vec::new());
            let scratch = (&mut gaps, &mut steps);
            encode_block_w::<2>(
                KeyKind::SignMagnitude,
                TensorSeed(5),
                7,
                &base,
                &new,
                scratch,
                vector,
            )
        };
        let scalar = run(false);
        assert!(matches!(scalar.0.values, ValueCoding::Step));
        assert!(scalar.0.changes > 1000);
        if vector {
            let v = run(true);
            assert_eq!(scalar.0, v.0);
            assert!(scalar.1 == v.1 && scalar.2 == v.2);
        }
        eprintln!("AVX-512 encoder available: {vector}");
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
