//! The apply path: a delta's jobs (one per changed tensor, built by
//! `codec::parse`) run against the words they change, for three callers:
//!
//! - [`apply_delta`](super::apply_delta) on a [`TensorSet`]: one pass that
//!   writes as it decodes and keeps what it needs to undo (step-coded blocks
//!   nothing, raw-coded blocks and TRL payloads the overwritten words), then
//!   compares every digest with the publisher's and undoes everything on a
//!   mismatch;
//! - [`apply_in_place`] on buffers the caller owns (an engine's tensors, a
//!   memory-mapped file): **verify first, then write**. Pass 1 decodes every
//!   changed tensor against the current bytes without writing and checks that
//!   the sum of the digest changes equals `digest − base_digest` from the
//!   header (so every element the delta changes holds exactly its base
//!   value); only when every tensor passes does pass 2 write, from what pass 1
//!   kept where that fitted a bounded buffer, by decoding again elsewhere;
//! - [`Delta`]: the same decoders for tensors that live elsewhere (a GPU):
//!   [`Delta::changed_positions`], then [`Delta::resolve`] given the old words
//!   the caller gathered at those positions.
//!
//! All three share the block decoders and the resolution of a change (old
//! word in, new word and digest change out) of `codec::compact`, and one TRL
//! loop here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;
use serde::Serialize;

use super::compact::{self, Block, BlockUndo, Ctx, Kept, Value};
use super::parse::{Job, Local, Payload, open, weightcast_jobs};
use super::trl::Indices;
use crate::digest::{ChangeBatch, Digest, LANES, TensorSeed};
use crate::dtype::{Dtype, byte_len, key_kind, load, parse_dtype, read_word, store, word_bytes};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header};
use crate::platform::prefetch_l2;
use crate::tensors::TensorSet;

/// How far ahead the TRL loop prefetches each target's line into L2 (the
/// same distance as the `compact` pipeline's).
const AHEAD: usize = 256;

/// A job with the words it changes.
struct Work<'j, 'a, 'd> {
    job: &'j Job<'a>,
    data: &'d mut [u8],
    dtype: Dtype,
    seed: TensorSeed,
}

impl Work<'_, '_, '_> {
    /// The job's compact blocks: each block's context and words, with
    /// `f(block, ctx, words)` run on every block in parallel (none for a
    /// TRL job).
    fn blocks<T: Send>(
        &mut self,
        f: impl Fn(usize, &Block<'_>, Ctx, &mut [u8]) -> T + Sync + Send,
    ) -> Vec<T> {
        let job = self.job;
        let Payload::Compact {
            block_words,
            blocks,
            streams,
        } = &job.payload
        else {
            return Vec::new();
        };
        if self.data.is_empty() {
            return Vec::new();
        }
        let block_words = *block_words;
        let wb = word_bytes(self.dtype);
        let words = (self.data.len() / wb) as u64;
        let chunk_words = block_words.min(words);
        let (name, kind, seed) = (job.name.as_str(), key_kind(self.dtype), self.seed);
        self.data
            .par_chunks_mut(chunk_words as usize * wb)
            .zip(blocks.par_iter().zip(streams.par_iter()))
            .enumerate()
            .map(|(b, (blk, (entry, stream)))| {
                let block = Block {
                    tensor: name,
                    index: b,
                    entry,
                    stream,
                    wb,
                    words: (blk.len() / wb) as u64,
                };
                let ctx = Ctx {
                    kind,
                    seed,
                    first: b as u64 * chunk_words,
                };
                f(b, &block, ctx, blk)
            })
            .collect()
    }
}

impl Work<'_, '_, '_> {
    /// One [`TrlRun::pass`] over this job's words.
    fn trl<const CHECK: bool, const WRITE: bool>(
        &mut self,
        (indices, values): (Indices<'_>, &[u8]),
        undo: Option<&mut Vec<u8>>,
    ) -> Result<(u64, u64)> {
        let job = self.job;
        let run = TrlRun {
            name: &job.name,
            indices,
            values,
            seed: self.seed,
        };
        crate::with_word_width!(word_bytes(self.dtype), W => {
            run.pass::<W, CHECK, WRITE>(self.data, undo)
        })
    }
}

/// Changed words and digest change so far, and the first error.
#[derive(Default)]
struct Tally {
    changed: u64,
    dig: u64,
    err: Option<Error>,
}

impl Tally {
    fn add(&mut self, r: Result<(u64, u64)>) {
        match r {
            Ok((changed, dig)) => {
                self.changed += changed;
                self.dig = self.dig.wrapping_add(dig);
            }
            Err(e) => {
                self.err.get_or_insert(e);
            }
        }
    }

    /// The tally of a tensor's blocks (each block's result and what else it
    /// left, which is returned in block order).
    fn blocks<T>(
        per_block: Vec<(Result<u64>, T)>,
        blocks: &[crate::format::BlockEntry],
    ) -> (Tally, Vec<T>) {
        let mut t = Tally::default();
        let rest = per_block
            .into_iter()
            .zip(blocks)
            .map(|((r, rest), e)| {
                t.add(r.map(|d| (e.changes, d)));
                rest
            })
            .collect();
        (t, rest)
    }
}

// ---------------------------------------------------------------------------
// One pass with undo: `apply_delta` on a `TensorSet`.

/// What applying one tensor in one pass did: enough to verify it or to undo it.
#[derive(Default)]
struct Outcome {
    tally: Tally,
    /// TRL: the overwritten old words.
    undo: Vec<u8>,
    /// Compact: what each block wrote.
    block_undo: Vec<BlockUndo>,
}

/// Applies `jobs` to `state` in one pass, checks every count and digest
/// against the header (`want_file`: its file digest, for weightcast deltas)
/// and, on any failure, restores every word written. Returns the changed
/// words and each job's new tensor digest.
pub(super) fn apply_jobs(
    state: &mut TensorSet,
    jobs: &[Job<'_>],
    want_file: Option<Digest>,
) -> Result<(u64, Vec<Digest>)> {
    let info: Vec<(Dtype, TensorSeed, Digest)> = jobs
        .iter()
        .map(|j| {
            let t = &state.tensors()[j.idx];
            (t.dtype, t.seed, t.digest)
        })
        .collect();
    let file_before = state.digest();
    let mut slices: Vec<Option<&mut [u8]>> = state.all_data_mut().into_iter().map(Some).collect();
    let mut work: Vec<Work> = jobs
        .iter()
        .zip(&info)
        .map(|(job, &(dtype, seed, _))| Work {
            job,
            data: slices[job.idx].take().expect("one job per tensor"),
            dtype,
            seed,
        })
        .collect();
    let mut outcomes: Vec<Outcome> = work.par_iter_mut().map(apply_job).collect();
    // The file digest after: unchanged tensors keep theirs, changed ones move.
    let mut file_after = file_before;
    let mut failure: Option<Error> = None;
    let mut new_digests = Vec::with_capacity(jobs.len());
    let mut changed = 0u64;
    for ((j, o), inf) in jobs.iter().zip(&mut outcomes).zip(&info) {
        let o = &mut o.tally;
        let d = inf.2.wrapping_add(Digest(o.dig));
        changed += o.changed;
        file_after = file_after.wrapping_sub(inf.2).wrapping_add(d);
        new_digests.push(d);
        if failure.is_some() {
            continue;
        }
        if let Some(e) = o.err.take() {
            failure = Some(e);
        } else if let Some(x) = j.expect {
            if o.changed != x.changed {
                failure = Some(count_error(&j.name, x.changed, o.changed));
            } else if d != x.digest {
                failure = Some(Error::Integrity {
                    scope: format!("tensor {}", j.name),
                    expected: x.digest.to_string(),
                    actual: d.to_string(),
                });
            }
        }
    }
    if failure.is_none()
        && let Some(want) = want_file
        && file_after != want
    {
        failure = Some(Error::Integrity {
            scope: "file".into(),
            expected: want.to_string(),
            actual: file_after.to_string(),
        });
    }
    if let Some(e) = failure {
        work.par_iter_mut()
            .zip(outcomes.par_iter())
            .for_each(|(w, o)| undo_job(w, o));
        return Err(e);
    }
    Ok((changed, new_digests))
}

fn apply_job(w: &mut Work<'_, '_, '_>) -> Outcome {
    match &w.job.payload {
        Payload::Trl { indices, values } => {
            let wb = word_bytes(w.dtype);
            let mut out = Outcome::default();
            out.undo.reserve(indices.len().min(w.data.len() / wb) * wb);
            let r = w.trl::<true, true>((*indices, values), Some(&mut out.undo));
            out.tally.add(r);
            out
        }
        Payload::Compact { blocks, .. } => {
            let per_block = w.blocks(|_, block, ctx, blk| {
                let mut undo = BlockUndo::default();
                let r = compact::apply_block(block, ctx, blk, &mut undo);
                (r, undo)
            });
            let (tally, block_undo) = Tally::blocks(per_block, blocks);
            Outcome {
                tally,
                undo: Vec::new(),
                block_undo,
            }
        }
    }
}

fn undo_job(w: &mut Work<'_, '_, '_>, o: &Outcome) {
    match &w.job.payload {
        Payload::Trl { indices, .. } => {
            let wb = word_bytes(w.dtype);
            crate::with_word_width!(wb, W => trl_undo::<W>(*indices, w.data, &o.undo));
        }
        Payload::Compact { .. } => {
            let kind = key_kind(w.dtype);
            w.blocks(|b, block, _, blk| compact::undo_block(block, kind, blk, &o.block_undo[b]));
        }
    }
}

// ---------------------------------------------------------------------------
// Verify first, then write: buffers the caller owns.

/// A tensor the caller owns, to be patched in place by [`apply_in_place`]:
/// its name, dtype and shape as in the checkpoint, and its bytes
/// (little-endian, C order; `data.len()` must be what `dtype` and `shape`
/// give).
pub struct Target<'a> {
    /// The tensor's name (the delta names tensors by it).
    pub name: &'a str,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: &'a [usize],
    /// Its bytes, written in place.
    pub data: &'a mut [u8],
}

/// How [`apply_in_place_with`] works.
#[derive(Clone, Debug)]
pub struct InPlaceOptions {
    /// Bytes the verify pass may spend keeping decoded changes (a block
    /// index and the new word, `4 + wb` bytes per change) so that the write
    /// pass only scatters them; blocks beyond it are decoded again in the
    /// write pass. 0 decodes every block twice.
    pub keep_bytes: usize,
}

impl Default for InPlaceOptions {
    /// 256 MiB: every change of a 1.5%-dense 2.7-billion-element bf16 model.
    fn default() -> Self {
        InPlaceOptions {
            keep_bytes: 256 << 20,
        }
    }
}

/// What [`apply_in_place`] did.
#[derive(Clone, Debug, Serialize)]
pub struct InPlaceReport {
    /// Version produced.
    pub model_version: u64,
    /// Version the delta applied to.
    pub base_version: Option<u64>,
    /// Encoding of the delta.
    pub encoding: Encoding,
    /// Changed words written.
    pub changed: u64,
    /// Names of the tensors that changed.
    pub changed_tensors: Vec<String>,
    /// Per changed tensor: what changed and how its digest moved.
    pub tensors: Vec<TensorChange>,
    /// Changes the write pass took from what the verify pass kept (the others
    /// were decoded again).
    pub kept: u64,
}

/// One changed tensor of an [`InPlaceReport`].
#[derive(Clone, Debug, Serialize)]
pub struct TensorChange {
    /// The tensor.
    pub name: String,
    /// Changed words.
    pub changed: u64,
    /// Its digest before, per the delta.
    pub base_digest: Digest,
    /// Its digest after, per the delta.
    pub digest: Digest,
    /// `digest − base_digest`: what a caller tracking the tensor's full
    /// digest adds to it.
    pub digest_change: Digest,
}

/// [`apply_in_place_with`] with the default options.
pub fn apply_in_place(targets: &mut [Target<'_>], delta: &[u8]) -> Result<InPlaceReport> {
    apply_in_place_with(targets, delta, &InPlaceOptions::default())
}

/// Applies a weightcast delta (`compact` or `trl`) to tensors the caller owns,
/// verifying first, then writing; all or nothing.
///
/// Checks, before anything is written: the payload's BLAKE3; that every
/// tensor the delta changes is among `targets` with the delta's dtype and
/// shape and the right size; that the header's per-tensor digest changes add
/// up to its file digest change; and, per tensor, that decoding the delta
/// against the target's current words succeeds and moves the digest by
/// exactly `digest − base_digest`. Digests are additive (docs/format.md §3),
/// so the last check proves that every element the delta changes holds its
/// base value ([`Error::WrongBase`] otherwise, naming the tensor). Elements
/// the delta does not change are **not** checked: a target that differs from
/// the base elsewhere is accepted and keeps its difference;
/// [`tensor_digest_of`](crate::digest::tensor_digest_of) checks a whole
/// tensor against a header's digest at the cost of a pass over it.
///
/// Targets the delta does not name are untouched; so is everything when it
/// fails. Foreign TRL files carry no digests and are refused (use
/// [`apply_delta`](super::apply_delta)).
pub fn apply_in_place_with(
    targets: &mut [Target<'_>],
    delta: &[u8],
    opts: &InPlaceOptions,
) -> Result<InPlaceReport> {
    let mut reports = apply_in_place_all(targets, &[delta], opts)?;
    Ok(reports.pop().expect("one report per delta"))
}

/// [`apply_in_place_with`] over the delta objects of one version at once (a
/// sharded checkpoint has one per tensor file): every delta is verified
/// against `targets` before anything is written, so the whole version is
/// applied or nothing is. Returns one report per delta, in order. A tensor
/// changed by two of the deltas is refused (the tensor files of a version
/// hold distinct tensors).
pub fn apply_in_place_all(
    targets: &mut [Target<'_>],
    deltas: &[&[u8]],
    opts: &InPlaceOptions,
) -> Result<Vec<InPlaceReport>> {
    in_place(targets, deltas, opts.keep_bytes, Then::Write).map(|(reports, _)| reports)
}

/// The verified, decoded changes of one version, made by
/// [`prepare_in_place_all`] and written by [`Prepared::commit`]: per changed
/// tensor, each block's changes (a position and the new word, `4 + wb`
/// bytes per change) and the reports the apply will give.
pub struct Prepared {
    reports: Vec<InPlaceReport>,
    tensors: Vec<PreparedTensor>,
}

/// One tensor of a [`Prepared`].
struct PreparedTensor {
    name: String,
    dtype: Dtype,
    /// The target's length in bytes when it was verified.
    len: usize,
    /// Bytes per block (the last block may be shorter).
    chunk_bytes: usize,
    kept: Vec<Kept>,
}

impl Prepared {
    /// Changed words it will write.
    pub fn changed(&self) -> u64 {
        self.reports.iter().map(|r| r.changed).sum()
    }

    /// Bytes it holds (the decoded changes).
    pub fn held_bytes(&self) -> usize {
        self.tensors
            .iter()
            .flat_map(|t| &t.kept)
            .map(|k| k.bytes())
            .sum()
    }

    /// Names of the tensors it writes.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    /// Writes the prepared changes into `targets` (the same tensors, holding
    /// the same bytes as when they were verified: nothing re-reads them),
    /// one scatter per block, in parallel. Fails, writing nothing, only
    /// when a tensor it changes is missing from `targets`, given twice, or
    /// has another dtype or size.
    pub fn commit(self, targets: &mut [Target<'_>]) -> Result<Vec<InPlaceReport>> {
        let mut by_name = HashMap::with_capacity(targets.len());
        for (i, t) in targets.iter().enumerate() {
            if by_name.insert(t.name, i).is_some() {
                return Err(Error::tensor(t.name, "given twice among the targets"));
            }
        }
        let dtypes: Vec<Dtype> = targets.iter().map(|t| t.dtype).collect();
        let mut slices: Vec<Option<&mut [u8]>> =
            targets.iter_mut().map(|t| Some(&mut *t.data)).collect();
        let mut jobs = Vec::with_capacity(self.tensors.len());
        for p in &self.tensors {
            let i = *by_name.get(p.name.as_str()).ok_or_else(|| {
                Error::BadRequest(format!(
                    "tensor `{}` was prepared but is not among the targets of the commit",
                    p.name
                ))
            })?;
            if dtypes[i] != p.dtype {
                return Err(Error::BadRequest(format!(
                    "tensor `{}` is {}, it was {} when prepared",
                    p.name, dtypes[i], p.dtype
                )));
            }
            let data = slices[i].take().expect("names are distinct");
            if data.len() != p.len {
                return Err(Error::BadRequest(format!(
                    "tensor `{}` is {} bytes, it was {} when prepared",
                    p.name,
                    data.len(),
                    p.len
                )));
            }
            jobs.push((data, p));
        }
        jobs.into_par_iter().for_each(|(data, p)| {
            let wb = word_bytes(p.dtype);
            data.par_chunks_mut(p.chunk_bytes.max(1))
                .zip(p.kept.par_iter())
                .for_each(|(blk, k)| compact::write_kept(blk, wb, k));
        });
        Ok(self.reports)
    }
}

/// Verifies a version's deltas against `targets` exactly as
/// [`apply_in_place_all`] does (the payload's BLAKE3, the structure, every
/// changed element's base through the additive digests) and decodes every
/// change, **writing nothing**; [`Prepared::commit`] writes them later.
/// An engine prepares while it still serves (its tensors do not change
/// while it serves) and pauses only for the commit: one scatter of the
/// changed words, no decoding, no verification. The caller guarantees that
/// nothing writes the tensors between the two calls.
///
/// Holds `4 + wb` bytes per change (1.2% of a bf16 model at 1.5%
/// density). Refuses, with [`Error::Unsupported`], what it cannot hold
/// decoded: TRL-encoded deltas and blocks over 2^32 words (apply those with
/// [`apply_in_place_all`]).
pub fn prepare_in_place_all(targets: &mut [Target<'_>], deltas: &[&[u8]]) -> Result<Prepared> {
    in_place(targets, deltas, usize::MAX, Then::Keep)
        .map(|(reports, tensors)| Prepared { reports, tensors })
}

/// What [`in_place`] does after verifying.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Write (the verify-then-write apply).
    Write,
    /// Keep every decoded change for [`Prepared::commit`].
    Keep,
}

fn in_place(
    targets: &mut [Target<'_>],
    deltas: &[&[u8]],
    keep_bytes: usize,
    then: Then,
) -> Result<(Vec<InPlaceReport>, Vec<PreparedTensor>)> {
    let opened = deltas.iter().map(|d| open(d)).collect::<Result<Vec<_>>>()?;
    let mut by_name = HashMap::with_capacity(targets.len());
    for (i, t) in targets.iter().enumerate() {
        if by_name.insert(t.name, i).is_some() {
            return Err(Error::tensor(t.name, "given twice among the targets"));
        }
    }
    let mut claimed = vec![false; targets.len()];
    for (header, _) in &opened {
        for name in header.tensors.keys() {
            if let Some(&i) = by_name.get(name.as_str()) {
                let t = &targets[i];
                check_size(t.name, t.dtype, t.shape, t.data.len())?;
                if std::mem::replace(&mut claimed[i], true) {
                    return Err(Error::tensor(
                        t.name,
                        "changed by two delta objects of one version",
                    ));
                }
            }
        }
    }
    // Every delta's jobs, flattened; `owner[k]` is the delta of job `k`.
    let mut jobs = Vec::new();
    let mut owner = Vec::new();
    for (d, (header, st)) in opened.iter().enumerate() {
        let js = weightcast_jobs(header, st, |name| {
            by_name.get(name).map(|&i| {
                let t = &targets[i];
                Local {
                    idx: i,
                    dtype: t.dtype,
                    shape: t.shape,
                    words: t.data.len() / word_bytes(t.dtype),
                    digest: None,
                }
            })
        })?;
        owner.extend(std::iter::repeat_n(d, js.len()));
        jobs.extend(js);
    }
    let seeds: Vec<(Dtype, TensorSeed)> = jobs
        .iter()
        .map(|j| {
            let t = &targets[j.idx];
            (t.dtype, TensorSeed::new(t.name, t.dtype, t.shape))
        })
        .collect();
    let mut slices: Vec<Option<&mut [u8]>> =
        targets.iter_mut().map(|t| Some(&mut *t.data)).collect();
    let mut work: Vec<Work> = jobs
        .iter()
        .zip(seeds)
        .map(|(job, (dtype, seed))| Work {
            job,
            data: slices[job.idx].take().expect("one job per target"),
            dtype,
            seed,
        })
        .collect();

    // Pass 1: verify everything, write nothing.
    let budget = AtomicUsize::new(keep_bytes);
    let mut verified: Vec<Verified> = work
        .par_iter_mut()
        .map(|w| verify_job(w, &budget))
        .collect();
    for (j, v) in jobs.iter().zip(&mut verified) {
        if let Some(e) = v.tally.err.take() {
            return Err(e);
        }
        check_change(j, v.tally.changed, v.tally.dig)?;
    }

    // Pass 2: write. It decodes what pass 1 decoded, from the same bytes (the
    // targets are borrowed exclusively), so it cannot fail.
    if then == Then::Write {
        work.par_iter_mut()
            .zip(verified.par_iter())
            .map(|(w, v)| write_job(w, v))
            .collect::<Result<()>>()?;
    }

    let reports = opened
        .iter()
        .enumerate()
        .map(|(d, (h, _))| {
            let mine = || {
                jobs.iter()
                    .zip(&verified)
                    .zip(&owner)
                    .filter(move |(_, o)| **o == d)
                    .map(|(jv, _)| jv)
            };
            let tensors: Vec<TensorChange> = mine()
                .map(|(j, v)| {
                    let x = j.expect.expect("weightcast jobs carry digests");
                    TensorChange {
                        name: j.name.clone(),
                        changed: v.tally.changed,
                        base_digest: x.base,
                        digest: x.digest,
                        digest_change: x.digest.wrapping_sub(x.base),
                    }
                })
                .collect();
            InPlaceReport {
                model_version: h.model_version,
                base_version: h.base_version,
                encoding: h.encoding,
                changed: tensors.iter().map(|t| t.changed).sum(),
                changed_tensors: tensors.iter().map(|t| t.name.clone()).collect(),
                tensors,
                kept: mine()
                    .flat_map(|(_, v)| v.kept.iter().flatten())
                    .map(|k| k.len() as u64)
                    .sum(),
            }
        })
        .collect();
    if then == Then::Write {
        return Ok((reports, Vec::new()));
    }
    let prepared = work
        .iter()
        .zip(verified)
        .map(|(w, v)| keep_all(w, v))
        .collect::<Result<Vec<_>>>()?;
    Ok((reports, prepared))
}

/// A verified job's kept changes, every block's, as a [`PreparedTensor`].
fn keep_all(w: &Work<'_, '_, '_>, v: Verified) -> Result<PreparedTensor> {
    let unsupported = |reason: &str| Error::Unsupported {
        encoding: "prepare",
        tensor: w.job.name.clone(),
        reason: reason.to_string(),
    };
    let Payload::Compact {
        block_words,
        blocks,
        ..
    } = &w.job.payload
    else {
        return Err(unsupported(
            "a TRL-encoded delta is applied in one call (apply_in_place_all)",
        ));
    };
    let wb = word_bytes(w.dtype);
    let words = (w.data.len() / wb) as u64;
    let kept = v
        .kept
        .into_iter()
        .zip(blocks)
        .map(|(k, e)| match k {
            Some(k) if k.len() as u64 == e.changes => Ok(k),
            _ => Err(unsupported(
                "a block too large to hold decoded (over 2^32 words)",
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(PreparedTensor {
        name: w.job.name.clone(),
        dtype: w.dtype,
        len: w.data.len(),
        chunk_bytes: (*block_words).min(words) as usize * wb,
        kept,
    })
}

/// What pass 1 found for one tensor.
#[derive(Default)]
struct Verified {
    tally: Tally,
    /// Compact: per block, its changes when they were kept.
    kept: Vec<Option<Kept>>,
}

/// Takes room for a block's changes from the shared budget: the claimed count,
/// bounded by what the block and its stream can really hold.
fn keep_room(block: &Block<'_>, budget: &AtomicUsize) -> Option<Kept> {
    if block.words > 1 << 32 {
        return None;
    }
    let possible = block.stream.len() as u64 * 8 / (block.entry.pos_k as u64 + 2);
    let n = block.entry.changes.min(block.words).min(possible) as usize;
    let bytes = n.checked_mul(4 + block.wb)?;
    budget
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
            left.checked_sub(bytes)
        })
        .ok()?;
    Some(Kept::with_capacity(n, block.wb))
}

fn verify_job(w: &mut Work<'_, '_, '_>, budget: &AtomicUsize) -> Verified {
    match &w.job.payload {
        Payload::Trl { indices, values } => {
            let mut out = Verified::default();
            out.tally
                .add(w.trl::<true, false>((*indices, values), None));
            out
        }
        Payload::Compact { blocks, .. } => {
            let per_block = w.blocks(|_, block, ctx, blk| {
                let mut kept = keep_room(block, budget);
                let r = compact::verify_block(block, ctx, blk, kept.as_mut());
                (r, kept)
            });
            let (tally, kept) = Tally::blocks(per_block, blocks);
            Verified { tally, kept }
        }
    }
}

fn write_job(w: &mut Work<'_, '_, '_>, v: &Verified) -> Result<()> {
    let wb = word_bytes(w.dtype);
    match &w.job.payload {
        Payload::Trl { indices, values } => {
            w.trl::<false, true>((*indices, values), None).map(|_| ())
        }
        Payload::Compact { .. } => w
            .blocks(|b, block, ctx, blk| match v.kept.get(b) {
                Some(Some(k)) if k.len() as u64 == block.entry.changes => {
                    compact::write_kept(blk, wb, k);
                    Ok(())
                }
                _ => compact::apply_block(block, ctx, blk, &mut BlockUndo::default()).map(|_| ()),
            })
            .into_iter()
            .collect(),
    }
}

// ---------------------------------------------------------------------------
// TRL payloads: positions given up front, absolute values.

/// A TRL payload of one tensor.
#[derive(Clone, Copy)]
struct TrlRun<'r> {
    name: &'r str,
    indices: Indices<'r>,
    values: &'r [u8],
    seed: TensorSeed,
}

impl TrlRun<'_> {
    /// Calls `f(j, position)` for each position after checking it (strictly
    /// ascending, below `words`); stops at the first bad one.
    fn positions(&self, words: usize, mut f: impl FnMut(usize, usize)) -> Result<()> {
        let (mut prev, mut j, mut err) = (-1i64, 0usize, None);
        self.indices.visit(|i| {
            if i <= prev {
                err = Some(Error::tensor(
                    self.name,
                    format!("index {j} ({i}) is not strictly ascending"),
                ));
            } else if i >= words as i64 {
                err = Some(Error::tensor(
                    self.name,
                    format!("index {i} is beyond {words} elements"),
                ));
            } else {
                prev = i;
                f(j, i as usize);
                j += 1;
            }
            err.is_none()
        });
        err.map_or(Ok(()), Err)
    }

    fn check_len<const W: usize>(&self) -> Result<usize> {
        let n = self.indices.len();
        if self.values.len() != n * W {
            return Err(Error::tensor(
                self.name,
                format!(
                    "{n} indices but {} value bytes ({W} per value)",
                    self.values.len()
                ),
            ));
        }
        Ok(n)
    }

    /// One pass over the payload against `data`, each target's line
    /// prefetched [`AHEAD`] positions before its turn. `CHECK`: read the old
    /// words and sum the digest change (and log the old words into `undo`);
    /// `WRITE`: write the new words. Returns the changes and the digest
    /// change. On error, what was written is logged (with `undo`).
    fn pass<const W: usize, const CHECK: bool, const WRITE: bool>(
        &self,
        data: &mut [u8],
        mut undo: Option<&mut Vec<u8>>,
    ) -> Result<(u64, u64)> {
        let n = self.check_len::<W>()?;
        let mut dig = 0u64;
        let mut batch = ChangeBatch::default();
        let mut fill = 0usize;
        let mut turn = |data: &mut [u8], j: usize, i: usize| {
            let new = load::<W>(self.values, j);
            if CHECK {
                let old = load::<W>(data, i);
                if let Some(u) = undo.as_deref_mut() {
                    u.extend_from_slice(&old.to_le_bytes()[..W]);
                }
                (batch.index[fill], batch.old[fill], batch.new[fill]) = (i as u64, old, new);
                fill += 1;
                if fill == LANES {
                    dig = dig.wrapping_add(self.seed.change_sum(&batch));
                    fill = 0;
                }
            }
            if WRITE {
                store::<W>(data, i, new);
            }
        };
        let mut ring = [0usize; AHEAD];
        let words = data.len() / W;
        let r = self.positions(words, |j, i| {
            prefetch_l2(data, i * W);
            if j >= AHEAD {
                turn(data, j - AHEAD, ring[j % AHEAD]);
            }
            ring[j % AHEAD] = i;
        });
        if r.is_ok() {
            for j in n.saturating_sub(AHEAD)..n {
                turn(data, j, ring[j % AHEAD]);
            }
        }
        if CHECK {
            batch.index[fill..].fill(0);
            batch.old[fill..].fill(0);
            batch.new[fill..].fill(0);
            dig = dig.wrapping_add(self.seed.change_sum(&batch));
        }
        r.map(|()| (n as u64, dig))
    }
}

/// Restores the old words a TRL pass logged.
fn trl_undo<const W: usize>(indices: Indices<'_>, data: &mut [u8], undo: &[u8]) {
    let (m, mut j) = (undo.len() / W, 0usize);
    indices.visit(|i| {
        if j < m {
            store::<W>(data, i as usize, load::<W>(undo, j));
            j += 1;
        }
        j < m
    });
}

// ---------------------------------------------------------------------------
// Tensors that live elsewhere: positions out, old words in, new words out.

/// A verified, parsed weightcast delta, for callers whose tensors live where
/// weightcast cannot write them (a GPU): [`Delta::changed_positions`] tells
/// which words a tensor's delta changes; the caller gathers their old values
/// there and [`Delta::resolve`] turns them into the new values, checking the
/// digest change as [`apply_in_place`] does.
pub struct Delta<'a> {
    header: Header,
    /// Each changed tensor's job and, from the header, dtype and words.
    jobs: Vec<(Job<'a>, Dtype, usize)>,
}

/// The word indices a tensor's delta changes, ascending: `u32` when the
/// tensor has at most 2^32 words. A word is an element for dtypes of whole
/// bytes and a byte for packed ones (docs/format.md §2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Positions {
    /// Indices of a tensor of at most 2^32 words.
    U32(Vec<u32>),
    /// Indices of a larger tensor.
    U64(Vec<u64>),
}

impl Positions {
    fn new(words: usize, v: Vec<u64>) -> Positions {
        if words as u64 <= 1 << 32 {
            Positions::U32(v.into_iter().map(|i| i as u32).collect())
        } else {
            Positions::U64(v)
        }
    }

    /// Number of positions.
    pub fn len(&self) -> usize {
        match self {
            Positions::U32(v) => v.len(),
            Positions::U64(v) => v.len(),
        }
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Position `j`.
    pub fn get(&self, j: usize) -> Option<u64> {
        match self {
            Positions::U32(v) => v.get(j).map(|&i| i as u64),
            Positions::U64(v) => v.get(j).copied(),
        }
    }
}

impl<'a> Delta<'a> {
    /// Parses a weightcast delta: the container, the header (a `delta`, whose
    /// digests add up), the payload's BLAKE3 and every changed tensor's
    /// payload structure. Foreign TRL files, which carry no digests, are
    /// refused.
    pub fn parse(bytes: &'a [u8]) -> Result<Delta<'a>> {
        let (header, st) = open(bytes)?;
        // The header's entries as the local tensors: checks payload structure.
        let mut described = Vec::with_capacity(header.tensors.len());
        for (name, e) in &header.tensors {
            let dtype = parse_dtype(&e.dtype)
                .map_err(|_| Error::metadata(format!("tensors.{name}.dtype"), "unknown dtype"))?;
            let shape = e
                .shape
                .iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<Vec<usize>>>()
                .filter(|s| byte_len(dtype, s).is_some())
                .ok_or_else(|| {
                    Error::metadata(
                        format!("tensors.{name}.shape"),
                        "too large for this machine",
                    )
                })?;
            let words = byte_len(dtype, &shape).unwrap_or(0) / word_bytes(dtype);
            described.push((name.as_str(), dtype, shape, words));
        }
        let jobs = weightcast_jobs(&header, &st, |name| {
            described.iter().position(|d| d.0 == name).map(|idx| Local {
                idx,
                dtype: described[idx].1,
                shape: &described[idx].2,
                words: described[idx].3,
                digest: None,
            })
        })?
        .into_iter()
        .map(|j| {
            let (dtype, words) = (described[j.idx].1, described[j.idx].3);
            (j, dtype, words)
        })
        .collect();
        Ok(Delta { header, jobs })
    }

    /// The delta's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    fn find(&self, tensor: &str) -> Result<(&Job<'a>, Dtype, usize)> {
        self.jobs
            .iter()
            .find(|(j, ..)| j.name == tensor)
            .map(|(j, d, w)| (j, *d, *w))
            .ok_or_else(|| Error::tensor(tensor, "not changed by this delta"))
    }

    /// Decodes every entry of `tensor`'s payload, calling `f(position,
    /// value)` in order; checks the count against the header.
    fn entries(
        &self,
        tensor: &str,
        mut f: impl FnMut(u64, Value) -> Result<()>,
    ) -> Result<(Dtype, usize)> {
        let (job, dtype, words) = self.find(tensor)?;
        let wb = word_bytes(dtype);
        let mut n = 0u64;
        match &job.payload {
            Payload::Trl { indices, values } => {
                let run = TrlRun {
                    name: tensor,
                    indices: *indices,
                    values,
                    seed: TensorSeed(0),
                };
                crate::with_word_width!(wb, W => run.check_len::<W>())?;
                let mut err = Ok(());
                run.positions(words, |j, i| {
                    if err.is_ok() {
                        err = f(i as u64, Value::Raw(read_word(values, wb, j)));
                    }
                })?;
                err?;
                n = indices.len() as u64;
            }
            Payload::Compact {
                block_words,
                blocks,
                streams,
            } => {
                let chunk = (*block_words).min(words as u64);
                for (b, (entry, stream)) in blocks.iter().zip(streams).enumerate() {
                    let first = b as u64 * chunk;
                    let block = Block {
                        tensor,
                        index: b,
                        entry,
                        stream,
                        wb,
                        words: chunk.min(words as u64 - first),
                    };
                    compact::decode_block(&block, None, |i, v| f(first + i, v))?;
                    n += entry.changes;
                }
            }
        }
        let want = job.expect.expect("weightcast jobs carry digests").changed;
        if n != want {
            return Err(count_error(tensor, want, n));
        }
        Ok((dtype, words))
    }

    /// The word indices `tensor`'s delta changes, ascending (the payload is
    /// decoded and checked as an apply checks it).
    pub fn changed_positions(&self, tensor: &str) -> Result<Positions> {
        let mut out = Vec::new();
        let (_, words) = self.entries(tensor, |i, _| {
            out.push(i);
            Ok(())
        })?;
        Ok(Positions::new(words, out))
    }

    /// The new words of `tensor` at `positions` (what
    /// [`Delta::changed_positions`] returned), given the old words there
    /// (`old_values`: `wb` bytes each, little-endian, in position order), as
    /// `wb`-byte little-endian words in the same order. Verifies as
    /// [`apply_in_place`] does: the sum of the digest changes must equal
    /// `digest − base_digest` ([`Error::WrongBase`] otherwise), so every old
    /// word must be the base's.
    pub fn resolve(
        &self,
        tensor: &str,
        positions: &Positions,
        old_values: &[u8],
    ) -> Result<Vec<u8>> {
        let (job, dtype, _) = self.find(tensor)?;
        let (wb, kind) = (word_bytes(dtype), key_kind(dtype));
        let n = positions.len();
        if old_values.len() != n * wb {
            return Err(Error::tensor(
                tensor,
                format!(
                    "{} bytes of old values; {n} positions of {wb}-byte words need {}",
                    old_values.len(),
                    n * wb
                ),
            ));
        }
        let seed = TensorSeed::new(tensor, dtype, &self.shape_of(tensor));
        let mismatch = |j: usize| {
            Error::tensor(
                tensor,
                format!(
                    "the positions differ from the delta's at entry {j}: pass what \
                     changed_positions returned"
                ),
            )
        };
        let mut news = Vec::with_capacity(n * wb);
        let (mut j, mut dig) = (0usize, 0u64);
        let mut batch = ChangeBatch::default();
        let raw_blocks = matches!(&job.payload, Payload::Compact { .. });
        self.entries(tensor, |i, v| {
            if positions.get(j) != Some(i) {
                return Err(mismatch(j));
            }
            let old = read_word(old_values, wb, j);
            let new = v.resolve(kind, wb, old);
            if raw_blocks && matches!(v, Value::Raw(_)) && new == old {
                return Err(Error::tensor(
                    tensor,
                    format!("lists element {i} as changed but it is not"),
                ));
            }
            news.extend_from_slice(&new.to_le_bytes()[..wb]);
            let lane = j % LANES;
            (batch.index[lane], batch.old[lane], batch.new[lane]) = (i, old, new);
            if lane == LANES - 1 {
                dig = dig.wrapping_add(seed.change_sum(&batch));
                batch = ChangeBatch::default();
            }
            j += 1;
            Ok(())
        })?;
        if j != n {
            return Err(mismatch(j));
        }
        dig = dig.wrapping_add(seed.change_sum(&batch));
        check_change(job, n as u64, dig)?;
        Ok(news)
    }

    fn shape_of(&self, tensor: &str) -> Vec<usize> {
        self.header.tensors[tensor]
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect()
    }
}

// ---------------------------------------------------------------------------
// Checks shared by the three.

/// A target's size against its dtype and shape.
fn check_size(name: &str, dtype: Dtype, shape: &[usize], len: usize) -> Result<()> {
    match byte_len(dtype, shape) {
        Some(n) if n == len => Ok(()),
        want => Err(Error::tensor(
            name,
            format!(
                "the target holds {len} bytes, {dtype} {shape:?} needs {}",
                want.map_or("more than this machine can address".into(), |n| n
                    .to_string())
            ),
        )),
    }
}

/// The header's change count against what the payload held.
fn count_error(name: &str, want: u64, got: u64) -> Error {
    Error::tensor(
        name,
        format!("header says {want} changes, payload holds {got}"),
    )
}

/// A verify pass's result against the header: the count, and the digest
/// change (`digest − base_digest`). A wrong digest change means the words
/// at the changed positions are not the base's: [`Error::WrongBase`], with
/// the digest those words imply (the base's, corrected by what they
/// contributed instead).
fn check_change(job: &Job<'_>, changed: u64, dig: u64) -> Result<()> {
    let Some(x) = job.expect else {
        return Ok(());
    };
    if changed != x.changed {
        return Err(count_error(&job.name, x.changed, changed));
    }
    let want = x.digest.wrapping_sub(x.base).0;
    if dig != want {
        return Err(Error::WrongBase {
            scope: format!("tensor {} (at the positions the delta changes)", job.name),
            expected: x.base.to_string(),
            actual: x
                .base
                .wrapping_add(Digest(want.wrapping_sub(dig)))
                .to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets<'a>(set: &'a TensorSet, bufs: &'a mut [Vec<u8>]) -> Vec<Target<'a>> {
        set.tensors()
            .iter()
            .zip(bufs.iter_mut())
            .map(|(t, b)| Target {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                data: b,
            })
            .collect()
    }

    /// `set`'s tensors split in two files (even and odd positions).
    fn halves(set: &TensorSet) -> [TensorSet; 2] {
        [0, 1].map(|h| {
            TensorSet::from_tensors(
                set.tensors()
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % 2 == h)
                    .map(|(i, t)| {
                        (
                            t.name.clone(),
                            t.dtype,
                            t.shape.clone(),
                            set.data(i).to_vec(),
                        )
                    }),
            )
            .unwrap()
        })
    }

    #[test]
    fn all_deltas_of_a_version_are_verified_before_any_is_written() {
        use crate::codec::{DeltaOptions, encode_delta};
        use crate::generator::{Generator, GeneratorConfig};
        let mut g = Generator::new(GeneratorConfig::tiny(3));
        let v0 = g.snapshot();
        g.step();
        let v1 = g.snapshot();
        let opts = DeltaOptions::new(Encoding::Compact, 1, 0);
        let (b, n) = (halves(&v0), halves(&v1));
        let deltas: Vec<Vec<u8>> = (0..2)
            .map(|h| {
                let mut new = n[h].clone();
                encode_delta(&b[h], &mut new, &opts).unwrap().0
            })
            .collect();
        let refs: Vec<&[u8]> = deltas.iter().map(Vec::as_slice).collect();
        let mut bufs: Vec<Vec<u8>> = (0..v0.len()).map(|i| v0.data(i).to_vec()).collect();
        // A changed element of the second file's first changed tensor moved
        // off its base: the first file must not be written either.
        let second = &n[1];
        let (ti, pos) = (0..second.len())
            .find_map(|i| {
                let name = &second.tensors()[i].name;
                let k = v0.position(name).unwrap();
                (0..v0.data(k).len())
                    .find(|&p| v0.data(k)[p] != second.data(i)[p])
                    .map(|p| (k, p))
            })
            .expect("the step changed something in the second file");
        bufs[ti][pos] ^= 0x55;
        let before = bufs.clone();
        {
            let mut t = targets(&v0, &mut bufs);
            let err = apply_in_place_all(&mut t, &refs, &InPlaceOptions::default()).unwrap_err();
            assert!(matches!(err, Error::WrongBase { .. }), "{err}");
        }
        assert_eq!(
            bufs, before,
            "nothing written when one delta of the version fails"
        );
        bufs[ti][pos] ^= 0x55;
        {
            let mut t = targets(&v0, &mut bufs);
            let reports = apply_in_place_all(&mut t, &refs, &InPlaceOptions::default()).unwrap();
            assert_eq!(reports.len(), 2);
            assert!(
                reports
                    .iter()
                    .all(|r| r.model_version == 1 && r.changed > 0)
            );
            // The same delta twice changes each tensor twice: refused.
            let twice = [refs[0], refs[0]];
            let err = apply_in_place_all(&mut t, &twice, &InPlaceOptions::default()).unwrap_err();
            assert!(err.to_string().contains("two delta objects"), "{err}");
        }
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(&b[..], v1.data(i), "tensor {}", v1.tensors()[i].name);
        }
    }

    #[test]
    fn positions_pick_their_width() {
        let p = Positions::new(10, vec![1, 5]);
        assert_eq!(p, Positions::U32(vec![1, 5]));
        assert_eq!((p.len(), p.get(1), p.get(2)), (2, Some(5), None));
        let big = Positions::new((1 << 32) + 1, vec![1 << 32]);
        assert_eq!(big.get(0), Some(1 << 32));
        assert!(Positions::U64(vec![]).is_empty());
    }
}
