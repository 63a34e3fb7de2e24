//! Applying `compact` blocks: entries decoded (see `decode`), resolved
//! against the words they change (old word in, new word and digest change
//! out), and handed to a [`Sink`] that either writes them ([`apply_block`],
//! keeping what [`undo_block`] needs) or only checks them ([`verify_block`],
//! the first pass of `codec::apply_in_place`, which may keep the resolved
//! changes for [`write_kept`]).

use super::context::{Member, NextMembers, block_checksum};
use super::decode::{Coding, clean_end, step_entry};
use super::v2;
use super::vector;
use super::{BATCH, Block, Ctx, Group, Value, decode_block, step_word};
use crate::digest::ChangeBatch;
use crate::dtype::{KeyKind, from_key, load, read_word, store, to_key, word_mask, write_word};
use crate::error::{Error, Result};
use crate::format::ValueCoding;
#[cfg(any(target_arch = "x86_64", test))]
use crate::platform::Level;
use crate::platform::{Platform, dispatched, prefetch_l2};

/// Groups of [`BATCH`] entries held by the step-coded pipeline: a group is
/// resolved `SLOTS - 1` groups (240 entries) after it was decoded and its
/// lines prefetched into the second-level cache, far enough ahead for the
/// memory latency (see `platform::prefetch_l2`).
const SLOTS: usize = 16;

/// How far ahead [`write_kept`] prefetches: as far as the pipeline.
const AHEAD: usize = SLOTS * BATCH;

/// How much of a block's stream [`prefetch_stream`] asks for: a quarter of
/// the second-level cache. (Streams are a few tens of KiB at the densities
/// RL steps have; a denser block's stream is read on by the hardware's
/// stream prefetcher.)
const STREAM_AHEAD: usize = 256 << 10;

/// Asks for the first [`STREAM_AHEAD`] bytes of a block's stream in the
/// second-level cache before it is decoded. The decoder reads its codes one
/// after another, each read's position coming from the last: a miss on the
/// stream stalls that chain, and a `compact2` block reads four places of
/// its stream in turn (the lists, then its classes' regions interleaved),
/// which the hardware's prefetcher follows less well than one. Measured
/// with both forms in one process (`compact2_bench`, 2.8% density, one
/// thread, either order): 0.5 ms less of 27 for `compact2`, 0.3–0.7 of 22
/// for `compact` (docs/benchmarks.md, nineteenth round).
fn prefetch_stream(stream: &[u8]) {
    for at in (0..stream.len().min(STREAM_AHEAD)).step_by(64) {
        prefetch_l2(stream, at);
    }
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

/// A verified block's changes kept for the write pass: block indices (the
/// block has at most 2^32 words) and new words, `wb` bytes each.
#[derive(Default)]
pub(crate) struct Kept {
    index: Vec<u32>,
    new: Vec<u8>,
}

impl Kept {
    /// Room for `changes` changes of `wb`-byte words.
    pub(crate) fn with_capacity(changes: usize, wb: usize) -> Kept {
        Kept {
            index: Vec::with_capacity(changes),
            new: Vec::with_capacity(changes * wb),
        }
    }

    /// Changes kept.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.index.len() * 4 + self.new.len()
    }
}

/// Where a block's resolved changes go, in entry order.
trait Sink {
    /// Word `i` of `blk` goes from `old` to `new`.
    fn lane<const W: usize>(&mut self, blk: &mut [u8], i: usize, old: u64, new: u64);
    /// `count` more entries were handed over.
    fn taken(&mut self, count: usize);
}

/// Writes the new words, counting them and (`LOG`: for raw-coded blocks)
/// logging the old ones.
struct Write<'u, const LOG: bool> {
    undo: &'u mut BlockUndo,
}

impl<const LOG: bool> Sink for Write<'_, LOG> {
    #[inline(always)]
    fn lane<const W: usize>(&mut self, blk: &mut [u8], i: usize, old: u64, new: u64) {
        if LOG {
            self.undo
                .old_words
                .extend_from_slice(&old.to_le_bytes()[..W]);
        }
        store::<W>(blk, i, new);
    }

    #[inline(always)]
    fn taken(&mut self, count: usize) {
        self.undo.applied += count as u64;
    }
}

/// Writes nothing; keeps the changes when given room.
struct Check<'k> {
    kept: Option<&'k mut Kept>,
}

impl Sink for Check<'_> {
    #[inline(always)]
    fn lane<const W: usize>(&mut self, _: &mut [u8], i: usize, _: u64, new: u64) {
        if let Some(k) = self.kept.as_deref_mut() {
            k.index.push(i as u32);
            k.new.extend_from_slice(&new.to_le_bytes()[..W]);
        }
    }

    #[inline(always)]
    fn taken(&mut self, _: usize) {}
}

/// A block to run through a sink: the block, what its words are, and the
/// platform to run on.
#[derive(Clone, Copy)]
struct Run<'r, 'a> {
    platform: Platform,
    block: &'r Block<'a>,
    ctx: Ctx,
}

/// Applies one block in place: writes every new word and returns the digest
/// change. On error, `undo` describes what was written so far (see
/// [`undo_block`]). `blk` holds the block's words (`block.words` of them).
pub fn apply_block(
    block: &Block<'_>,
    ctx: Ctx,
    blk: &mut [u8],
    undo: &mut BlockUndo,
) -> Result<u64> {
    apply_block_on(Platform::detect(), block, ctx, blk, undo, None)
}

/// [`apply_block`], also filling `next` with the block's members for the
/// next delta's context (see [`super::context`]): one per change, ascending,
/// and their checksum as block `block.index` under `next.seed`. The members
/// are left empty when the apply fails.
pub fn apply_block_members(
    block: &Block<'_>,
    ctx: Ctx,
    blk: &mut [u8],
    undo: &mut BlockUndo,
    next: &mut NextMembers,
) -> Result<u64> {
    next.members.clear();
    next.checksum = 0;
    let r = apply_block_on(Platform::detect(), block, ctx, blk, undo, Some(&mut *next));
    if r.is_ok() && block.context.is_none() {
        // A `compact` block: its entries again.
        decode_block(block, None, |i, v| {
            next.members.push(entry_member(i, v, block.wb));
            Ok(())
        })?;
        next.checksum = block_checksum(next.seed, block.index as u64, &next.members);
    }
    if r.is_err() {
        next.members.clear();
        next.checksum = 0;
    }
    r
}

/// The context member of a decoded entry: its step's sign and size; a raw
/// value counts as a large step up.
#[inline(always)]
pub(crate) fn entry_member(i: u64, v: Value, wb: usize) -> Member {
    match v {
        Value::Step(s) => super::context::member(i, s, wb),
        Value::Raw(_) => ((i as u32) << 2) | super::context::BIG,
    }
}

/// [`apply_block`] on `platform`; a `compact2` block also fills `record`
/// with its members.
fn apply_block_on(
    platform: Platform,
    block: &Block<'_>,
    ctx: Ctx,
    blk: &mut [u8],
    undo: &mut BlockUndo,
    record: Option<&mut NextMembers>,
) -> Result<u64> {
    if let Some(members) = block.context {
        let run = Run {
            platform,
            block,
            ctx,
        };
        return if block.entry.values == ValueCoding::Step {
            run_v2(run, (members, record), blk, &mut Write::<false> { undo })
        } else {
            run_v2(run, (members, record), blk, &mut Write::<true> { undo })
        };
    }
    if block.entry.values == ValueCoding::Step {
        let run = Run {
            platform,
            block,
            ctx,
        };
        return run_block_on(run, blk, &mut Write::<false> { undo });
    }
    // Reserve from what the stream can really hold (each entry takes at
    // least pos_k + 2 bits), not from the header's claim.
    let possible = (block.stream.len() as u64 * 8) / (block.entry.pos_k as u64 + 2);
    let n = block.entry.changes.min(block.words).min(possible) as usize;
    undo.old_words.reserve(n * block.wb);
    let run = Run {
        platform,
        block,
        ctx,
    };
    run_block_on(run, blk, &mut Write::<true> { undo })
}

/// Decodes one block against its words without writing them: the same checks
/// and digest change as [`apply_block`], from the words `blk` holds now.
/// With `kept`, also keeps each change's block index and new word for
/// [`write_kept`] (the block must have at most 2^32 words).
pub(crate) fn verify_block(
    block: &Block<'_>,
    ctx: Ctx,
    blk: &mut [u8],
    kept: Option<&mut Kept>,
    record: Option<&mut NextMembers>,
) -> Result<u64> {
    debug_assert!(kept.is_none() || block.words <= 1 << 32);
    let run = Run {
        platform: Platform::detect(),
        block,
        ctx,
    };
    if let Some(members) = block.context {
        return run_v2(run, (members, record), blk, &mut Check { kept });
    }
    run_block_on(run, blk, &mut Check { kept })
}

/// A `compact2` block through `sink`, a group of [`BATCH`] entries at a
/// time, the classes interleaved by stretches of the block
/// (`v2::Interleave`): each group's lines are prefetched as
/// it is decoded and it is resolved `SLOTS − 1` groups later, as for
/// `compact` blocks. Then the check that no word changed twice and (with
/// `record`) the block's members for the next context.
fn run_v2<S: Sink>(
    run: Run<'_, '_>,
    (members, record): (&[Member], Option<&mut NextMembers>),
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    let block = run.block;
    if blk.len() as u64 != block.words.saturating_mul(block.wb as u64) {
        return Err(block.error(&format!(
            "{} words given, the block has {}",
            blk.len() / block.wb,
            block.words
        )));
    }
    prefetch_stream(block.stream);
    v2::with_scratch(|scratch, _| {
        let plan = v2::Plan::new(block, members, scratch)?;
        let mut rec = std::mem::take(&mut scratch.record);
        #[cfg(target_arch = "x86_64")]
        let r = if run.platform.has(Level::Avx2) {
            dispatched!(Apply, Level::Avx2);
            // SAFETY: `platform.has(Level::Avx2)`: detection found every
            // feature `run_v2_avx2` is compiled with; it is otherwise safe
            // code.
            unsafe { run_v2_avx2(run, (&plan, members, scratch, &mut rec), blk, sink) }
        } else {
            dispatched!(Apply, Level::Portable);
            crate::with_word_width!(block.wb, W => {
                run_v2_w::<W, S>(run, (&plan, members, scratch, &mut rec), blk, sink)
            })
        };
        #[cfg(not(target_arch = "x86_64"))]
        let r = crate::with_word_width!(block.wb, W => {
            run_v2_w::<W, S>(run, (&plan, members, scratch, &mut rec), blk, sink)
        });
        let r = r.and_then(|dig| {
            let at = block.index as u64;
            match record {
                Some(n) => v2::finish(members, &mut rec, Some((&mut n.members, (n.seed, at))))
                    .map(|sum| n.checksum = sum),
                None => v2::finish(members, &mut rec, None).map(|_| ()),
            }
            .map(|()| dig)
            .map_err(|what| block.error(what))
        });
        scratch.record = rec;
        r
    })
}

/// What [`run_v2_w`] decodes with: the block's plan, its context members,
/// the decoder's scratch and the record of what the entries did.
type V2Parts<'p> = (
    &'p v2::Plan,
    &'p [Member],
    &'p mut v2::Scratch,
    &'p mut v2::Record,
);

/// [`run_v2_w`] compiled for [`Level::Avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
fn run_v2_avx2<S: Sink>(
    run: Run<'_, '_>,
    parts: V2Parts<'_>,
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    crate::with_word_width!(run.block.wb, W => run_v2_w::<W, S>(run, parts, blk, sink))
}

#[inline(always)]
fn run_v2_w<const W: usize, S: Sink>(
    Run {
        platform,
        block,
        ctx,
    }: Run<'_, '_>,
    (plan, members, scratch, rec): V2Parts<'_>,
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    let raw = plan.raw;
    let mut slots = [Group::default(); SLOTS];
    let mut batch = ChangeBatch::default();
    let mut dig = 0u64;
    let mut n = 0usize; // groups decoded
    let mut result: std::result::Result<(), &'static str> = Ok(());
    match plan.readers(block, members, scratch) {
        Err(what) => result = Err(what),
        Ok(mut rd) => {
            let mut order = v2::Interleave::new();
            while let Some(c) = order.next(rd.each_ref().map(|r| r.remaining())) {
                let g = &mut slots[n % SLOTS];
                g.count = rd[c].remaining().min(BATCH as u64) as usize;
                if let Err(what) = rd[c].fill::<W>(g, blk, rec) {
                    result = Err(what);
                    break;
                }
                order.took(c, g.index[g.count - 1]);
                if n >= SLOTS - 1 {
                    // Resolves the group decoded SLOTS − 1 groups before this one.
                    let g = &slots[(n + 1) % SLOTS];
                    let d = resolve_v2::<W, S>(
                        (platform, block, ctx),
                        raw,
                        blk,
                        g,
                        (&mut batch, sink),
                    )?;
                    dig = dig.wrapping_add(d);
                }
                n += 1;
            }
            if result.is_ok() {
                result = rd.iter().try_for_each(|r| r.end());
            }
        }
    }
    if let Err(what) = result {
        return Err(block.error(what));
    }
    // Drain the pipeline in entry order.
    for m in n.saturating_sub(SLOTS - 1)..n {
        let g = &slots[m % SLOTS];
        let d = resolve_v2::<W, S>((platform, block, ctx), raw, blk, g, (&mut batch, sink))?;
        dig = dig.wrapping_add(d);
    }
    Ok(dig)
}

/// Resolves a group of a `compact2` block: raw-coded or step-coded.
#[inline(always)]
fn resolve_v2<const W: usize, S: Sink>(
    (platform, block, ctx): (Platform, &Block<'_>, Ctx),
    raw: bool,
    blk: &mut [u8],
    g: &Group,
    (batch, sink): (&mut ChangeBatch, &mut S),
) -> Result<u64> {
    if raw {
        resolve_raw::<W, S>(platform, block, ctx, blk, g, sink)
    } else {
        Ok(resolve_group::<W, S>(platform, ctx, blk, g, (batch, sink)))
    }
}

/// Resolves a raw-coded group (old word read here, new word given), checks
/// every entry changes its word, and hands the group on.
#[inline(always)]
fn resolve_raw<const W: usize, S: Sink>(
    platform: Platform,
    block: &Block<'_>,
    ctx: Ctx,
    blk: &mut [u8],
    g: &Group,
    sink: &mut S,
) -> Result<u64> {
    let mut batch = ChangeBatch::default();
    for j in 0..g.count {
        let (i, new) = (g.index[j], g.step[j]);
        let old = load::<W>(blk, i as usize);
        if new == old {
            return Err(unchanged_error(block, ctx.first + i));
        }
        (batch.index[j], batch.old[j], batch.new[j]) = (ctx.first + i, old, new);
    }
    for j in 0..g.count {
        sink.lane::<W>(blk, g.index[j] as usize, batch.old[j], batch.new[j]);
    }
    sink.taken(g.count);
    Ok(ctx.seed.change_sum_on(platform, &batch))
}

/// Writes what [`verify_block`] kept: a scatter of the new words, each
/// target's line prefetched into L2 [`AHEAD`] changes before it is written.
pub(crate) fn write_kept(blk: &mut [u8], wb: usize, kept: &Kept) {
    crate::with_word_width!(wb, W => {
        for (j, &i) in kept.index.iter().enumerate() {
            if let Some(&a) = kept.index.get(j + AHEAD) {
                prefetch_l2(blk, a as usize * W);
            }
            store::<W>(blk, i as usize, load::<W>(&kept.new, j));
        }
    })
}

/// Runs a block through `sink` on `platform`: the code compiled for
/// [`Level::Avx2`] where it has it, the portable code otherwise.
fn run_block_on<S: Sink>(run: Run<'_, '_>, blk: &mut [u8], sink: &mut S) -> Result<u64> {
    let block = run.block;
    if blk.len() as u64 != block.words.saturating_mul(block.wb as u64) {
        return Err(block.error(&format!(
            "{} words given, the block has {}",
            blk.len() / block.wb,
            block.words
        )));
    }
    prefetch_stream(block.stream);
    #[cfg(target_arch = "x86_64")]
    if run.platform.has(Level::Avx2) {
        dispatched!(Apply, Level::Avx2);
        // SAFETY: `platform.has(Level::Avx2)`: detection found every feature
        // `run_block_avx2` is compiled with; it is otherwise safe code.
        return unsafe { run_block_avx2(run, blk, sink) };
    }
    dispatched!(Apply, Level::Portable);
    crate::with_word_width!(block.wb, W => run_block::<W, S>(run, blk, sink))
}

/// [`run_block`] compiled for [`Level::Avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
fn run_block_avx2<S: Sink>(run: Run<'_, '_>, blk: &mut [u8], sink: &mut S) -> Result<u64> {
    crate::with_word_width!(run.block.wb, W => run_block::<W, S>(run, blk, sink))
}

#[inline(always)]
fn run_block<const W: usize, S: Sink>(
    run: Run<'_, '_>,
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    if run.block.entry.values == ValueCoding::Step {
        run_steps::<W, S>(run, blk, sink)
    } else {
        run_raw::<W, S>(run, blk, sink)
    }
}

/// Raw-coded blocks (rare: large jumps), a batch at a time: the old words of
/// a batch are loaded back to back, so their cache misses overlap.
fn run_raw<const W: usize, S: Sink>(
    Run {
        platform,
        block,
        ctx,
    }: Run<'_, '_>,
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    let mut dig = 0u64;
    let mut g = Group::default();
    // Resolves a batch (old word read here, new word from the stream), checks
    // every entry changes its word, and hands the batch on.
    let mut flush = |g: &Group, blk: &mut [u8]| -> Result<u64> {
        resolve_raw::<W, S>(platform, block, ctx, blk, g, sink)
    };
    decode_block(block, None, |i, v| {
        let (Value::Raw(x) | Value::Step(x)) = v;
        (g.index[g.count], g.step[g.count]) = (i, x);
        g.count += 1;
        if g.count == BATCH {
            dig = dig.wrapping_add(flush(&g, blk)?);
            g.count = 0;
        }
        Ok(())
    })?;
    Ok(dig.wrapping_add(flush(&g, blk)?))
}

/// Step-coded blocks: decodes a group of entries, then resolves and hands on
/// the group decoded `SLOTS − 1` groups earlier. Steps never leave a word
/// unchanged (1 ≤ |s| ≤ 2^(8·wb−1), and keys are a bijection), so no entry
/// needs that check, and nothing is logged: [`undo_block`] inverts the steps.
#[inline(always)]
fn run_steps<const W: usize, S: Sink>(
    Run {
        platform,
        block,
        ctx,
    }: Run<'_, '_>,
    blk: &mut [u8],
    sink: &mut S,
) -> Result<u64> {
    let c = Coding::check(block)?;
    let changes = block.entry.changes;
    let mut dig = 0u64;
    let mut at = 0u64; // bit position in the stream
    let mut next = 0u64;
    // Software pipeline, a group of BATCH entries at a time: each entry's
    // cache line is prefetched (into the second-level cache) as soon as it is
    // decoded, and its group is resolved SLOTS − 1 groups later, by when the
    // lines have arrived; so the memory system always has many misses in
    // flight while the (serial) decoding goes on.
    let mut slots = [Group::default(); SLOTS];
    let mut batch = ChangeBatch::default();
    let groups = changes.div_ceil(BATCH as u64);
    let mut result = Ok(());
    for n in 0..groups {
        let g = &mut slots[n as usize % SLOTS];
        g.count = (changes - n * BATCH as u64).min(BATCH as u64) as usize;
        if let Err(what) = decode_group::<W>(block, &c, blk, (&mut at, &mut next), g) {
            result = Err(block.error(what));
            break;
        }
        if n >= SLOTS as u64 - 1 {
            let g = &slots[(n as usize + 1) % SLOTS];
            dig = dig.wrapping_add(resolve_group::<W, S>(
                platform,
                ctx,
                blk,
                g,
                (&mut batch, sink),
            ));
        }
    }
    result?;
    // Drain the pipeline in entry order.
    for n in groups.saturating_sub(SLOTS as u64 - 1)..groups {
        let g = &slots[n as usize % SLOTS];
        dig = dig.wrapping_add(resolve_group::<W, S>(
            platform,
            ctx,
            blk,
            g,
            (&mut batch, sink),
        ));
    }
    if !clean_end(block.stream, at) {
        return Err(block.error("trailing bytes after the last change"));
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
    block: &Block<'_>,
    c: &Coding,
    blk: &[u8],
    pos: (&mut u64, &mut u64),
    g: &mut Group,
) -> std::result::Result<(), &'static str> {
    // Locals, so that nothing on the entry loop's path is read from memory.
    let (stream, words, c) = (block.stream, block.words, *c);
    let (mut at, mut next) = (*pos.0, *pos.1);
    let mut result = Ok(());
    for j in 0..g.count.min(BATCH) {
        let (gap, s, used) = match step_entry::<W>(stream, at, &c) {
            Ok(x) => x,
            Err(what) => {
                result = Err(what);
                break;
            }
        };
        at += used as u64;
        let i = next + gap;
        if i >= words {
            result = Err("position beyond the block");
            break;
        }
        next = i + 1;
        prefetch_l2(blk, i as usize * W);
        (g.index[j], g.step[j]) = (i, s);
    }
    (*pos.0, *pos.1) = (at, next);
    result
}

/// Resolves a step-coded group and hands it to `sink`: for each lane, the old
/// word read from `blk` and the new word `unkey(key(old) + step)`; returns
/// the digest change. `batch` is scratch (its lanes past the group's count
/// must be zero, as the pipeline keeps them). The AVX-512 kernel for 2-byte
/// words where the platform has it; the scalar loop is the reference it is
/// tested against.
#[inline(always)]
fn resolve_group<const W: usize, S: Sink>(
    platform: Platform,
    ctx: Ctx,
    blk: &mut [u8],
    g: &Group,
    (batch, sink): (&mut ChangeBatch, &mut S),
) -> u64 {
    if W == 2
        && let Some(d) = vector::resolve_steps(platform, ctx, blk, g, batch)
    {
        for j in 0..g.count {
            sink.lane::<W>(blk, g.index[j] as usize, batch.old[j], batch.new[j]);
        }
        sink.taken(g.count);
        return d;
    }
    dispatched!(Group, Level::Portable);
    for j in 0..g.count {
        let i = g.index[j];
        let old = load::<W>(blk, i as usize);
        let new = step_word(ctx.kind, W, old, g.step[j]);
        sink.lane::<W>(blk, i as usize, old, new);
        (batch.index[j], batch.old[j], batch.new[j]) = (ctx.first + i, old, new);
    }
    sink.taken(g.count);
    if g.count < BATCH {
        // Only a block's last group is short; unused lanes must add nothing.
        batch.index[g.count..].fill(0);
        batch.old[g.count..].fill(0);
        batch.new[g.count..].fill(0);
    }
    ctx.seed.change_sum_on(platform, batch)
}

#[cold]
#[inline(never)]
fn unchanged_error(block: &Block<'_>, at: u64) -> Error {
    Error::tensor(
        block.tensor,
        format!(
            "block {} lists element {at} as changed but it is not",
            block.index
        ),
    )
}

/// Restores the words [`apply_block`] overwrote, as recorded in `undo`
/// (positions and steps are decoded again; they do not depend on the base).
pub fn undo_block(block: &Block<'_>, kind: KeyKind, blk: &mut [u8], undo: &BlockUndo) {
    let wb = block.wb;
    let mask = word_mask(wb);
    let mut j = 0usize;
    if let Some(members) = block.context {
        // A `compact2` block: its entries in the order they were written.
        if block.entry.values == ValueCoding::Raw {
            // The old words logged, restored last written first: a block that
            // named a word twice (class 0 and a member's class, refused only
            // once every class was applied) gets the base's word back, not
            // the first new one.
            let mut written = Vec::new();
            v2::for_each_applied(block, members, undo.applied, |i, _| written.push(i));
            for (j, &i) in written.iter().enumerate().rev() {
                write_word(blk, wb, i as usize, read_word(&undo.old_words, wb, j));
            }
            return;
        }
        // Steps are undone by subtracting them, in any order.
        v2::for_each_applied(block, members, undo.applied, |i, v| {
            let cur = read_word(blk, wb, i as usize);
            let old = from_key(kind, wb, to_key(kind, wb, cur).wrapping_sub(v) & mask);
            write_word(blk, wb, i as usize, old);
        });
        return;
    }
    // These entries decoded successfully once, so decoding them again cannot fail.
    let _ = decode_block(block, Some(undo.applied), |i, v| {
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
    use super::super::testutil::{bf16_pair, only_block};
    use super::super::{encode_tensor, step_word};
    use super::*;
    use crate::digest::TensorSeed;
    use crate::format::BlockEntry;
    use crate::platform::expect::{platforms, require};

    #[test]
    fn a_failure_deep_in_a_block_is_undone_exactly() {
        // Hundreds of entries, so the failure comes several pipelined batches
        // in: written batches, the decoded-but-unwritten one and the failing
        // one must together undo to exactly the base.
        let (base, new) = bf16_pair(40_000, |i| i % 37 == 5);
        let ctx = Ctx {
            kind: KeyKind::SignMagnitude,
            seed: TensorSeed(7),
            first: 0,
        };
        let enc = encode_tensor(ctx.kind, 2, ctx.seed, &base, &new);
        let e = enc.blocks[0].clone();
        assert!(e.changes > 20 * BATCH as u64);
        // Applies `e` (with `stream`) to a copy of the base; it must fail, and
        // undoing what it wrote must give the base back exactly.
        let fails_cleanly = |e: &BlockEntry, stream: &[u8]| {
            let block = Block {
                entry: e,
                stream,
                ..only_block(&enc, 40_000)
            };
            let mut blk = base.clone();
            let mut undo = BlockUndo::default();
            let r = apply_block(&block, ctx, &mut blk, &mut undo);
            assert!(r.is_err(), "a damaged block must not apply");
            undo_block(&block, ctx.kind, &mut blk, &undo);
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

    /// Verifying a block writes nothing and computes what applying it does;
    /// what it kept, written, gives the applied block. Raw and step blocks,
    /// every word width.
    #[test]
    fn verify_then_write_equals_apply() {
        for wb in [1usize, 2, 4, 8] {
            let words = 20_000usize;
            let base: Vec<u8> = (0..words * wb).map(|i| (i * 131 % 251) as u8).collect();
            let mut steps = base.clone();
            let mut raws = base.clone();
            for i in (0..words).step_by(29) {
                let old = read_word(&base, wb, i);
                write_word(
                    &mut steps,
                    wb,
                    i,
                    step_word(KeyKind::SignMagnitude, wb, old, 1),
                );
                write_word(&mut raws, wb, i, !old & word_mask(wb));
            }
            for new in [steps, raws] {
                let ctx = Ctx {
                    kind: KeyKind::SignMagnitude,
                    seed: TensorSeed(11),
                    first: 3,
                };
                let enc = encode_tensor(ctx.kind, wb, ctx.seed, &base, &new);
                let block = Block {
                    wb,
                    ..only_block(&enc, words)
                };
                let mut applied = base.clone();
                let want = apply_block(&block, ctx, &mut applied, &mut BlockUndo::default())
                    .expect("apply");
                assert!(applied == new);
                let mut checked = base.clone();
                let mut kept = Kept::with_capacity(block.entry.changes as usize, wb);
                let got =
                    verify_block(&block, ctx, &mut checked, Some(&mut kept), None).expect("verify");
                assert_eq!(got, want, "{wb} B {:?}", block.entry.values);
                assert!(checked == base, "verify wrote");
                assert_eq!(kept.len() as u64, block.entry.changes);
                write_kept(&mut checked, wb, &kept);
                assert!(checked == new);
            }
        }
    }

    /// Whole blocks through the portable, AVX2 and (where present) AVX-512
    /// builds of the apply: same words, same digest, same failures.
    #[test]
    fn platforms_apply_the_same_blocks() {
        let words = 50_000usize;
        let (base, new) = bf16_pair(words, |i| (i.wrapping_mul(2_654_435_761) >> 7) % 53 == 0);
        let ctx = Ctx {
            kind: KeyKind::SignMagnitude,
            seed: TensorSeed(21),
            first: 1 << 22,
        };
        let enc = encode_tensor(ctx.kind, 2, ctx.seed, &base, &new);
        let short = BlockEntry {
            bytes: enc.blocks[0].bytes - 3,
            ..enc.blocks[0].clone()
        };
        let run = |platform: Platform, e: &BlockEntry| {
            let block = Block {
                entry: e,
                stream: &enc.payload[..e.bytes as usize],
                ..only_block(&enc, words)
            };
            let mut blk = base.clone();
            let mut undo = BlockUndo::default();
            let r = apply_block_on(platform, &block, ctx, &mut blk, &mut undo, None);
            (r.map_err(|e| e.to_string()), undo.applied, blk)
        };
        let want = [
            run(Platform::portable(), &enc.blocks[0]),
            run(Platform::portable(), &short),
        ];
        assert!(want[0].2 == new && want[1].0.is_err());
        let test = "platforms_apply_the_same_blocks";
        for p in platforms(test, &[Level::Avx2, Level::Avx512Vbmi2]) {
            let level = p.level();
            assert!(run(p, &enc.blocks[0]) == want[0], "{level}");
            assert!(run(p, &short) == want[1], "{level}, damaged");
        }
    }

    /// Group resolution with and without AVX-512: same words, same digest,
    /// for both key kinds, every group size, steps of every size and sign
    /// (crossing zero and wrapping), and words at the block's very end.
    #[test]
    fn vector_and_scalar_group_writes_agree() {
        let words = 600usize;
        let (mut base, _) = bf16_pair(words, |_| false);
        // Special words: ±0, the extremes, around the sign.
        for (j, w) in [0u16, 0x8000, 0x7fff, 0xffff, 1, 0x8001]
            .into_iter()
            .enumerate()
        {
            base[2 * j..2 * j + 2].copy_from_slice(&w.to_le_bytes());
        }
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut cases = Vec::new();
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
                    let ctx = Ctx {
                        kind,
                        seed: TensorSeed(3),
                        first: 1 << 33,
                    };
                    // The scalar reference, checked lane by lane: each new word
                    // from its own old word.
                    let mut blk = base.clone();
                    let mut undo = BlockUndo::default();
                    let mut sink = Write::<false> { undo: &mut undo };
                    let mut batch = ChangeBatch::default();
                    let d = resolve_group::<2, _>(
                        Platform::portable(),
                        ctx,
                        &mut blk,
                        &g,
                        (&mut batch, &mut sink),
                    );
                    assert_eq!(undo.applied, count as u64);
                    for j in 0..count {
                        let old = load::<2>(&base, g.index[j] as usize);
                        let new = step_word(kind, 2, old, g.step[j]);
                        assert_ne!(new, old, "a step changes its word");
                        assert_eq!(load::<2>(&blk, g.index[j] as usize), new);
                    }
                    let lanes = (0..count).fold(0u64, |a, j| {
                        let old = load::<2>(&base, g.index[j] as usize);
                        let new = step_word(kind, 2, old, g.step[j]);
                        a.wrapping_add(ctx.seed.change(ctx.first + g.index[j], old, new))
                    });
                    assert_eq!(d, lanes);
                    cases.push((ctx, g, d, blk));
                }
            }
        }
        if !require(Level::Avx512Vbmi2, "vector_and_scalar_group_writes_agree") {
            return;
        }
        for (ctx, g, d, want) in cases {
            let mut batch = ChangeBatch::default();
            let got = vector::resolve_steps(Platform::cpu(), ctx, &base, &g, &mut batch)
                .expect("the CPU has the group kernel");
            let mut blk = base.clone();
            for j in 0..g.count {
                store::<2>(&mut blk, g.index[j] as usize, batch.new[j]);
            }
            assert!(got == d && blk == want, "{:?} count {}", ctx.kind, g.count);
        }
    }
}
