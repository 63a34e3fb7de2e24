//! Verify first, then write: buffers the caller owns.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;
use serde::Serialize;

use super::work::{Tally, Work, check_change};
use crate::codec::compact::{self, Block, BlockUndo, Context, Kept, NextMembers, TensorContext};
use crate::codec::parse::{Local, Payload, open, weightcast_jobs};
use crate::digest::{Digest, TensorSeed};
use crate::dtype::{Dtype, byte_len, word_bytes};
use crate::error::{Error, Result};
use crate::format::Encoding;

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
/// [`apply_delta`](crate::codec::apply_delta)).
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
    in_place(targets, (deltas, &[]), opts.keep_bytes, Then::Write).map(|(reports, ..)| reports)
}

/// [`apply_in_place_all`] with contexts (docs/format.md §6.3): `contexts[d]`
/// is the context of the file `deltas[d]` applies to (missing or `None`:
/// none; see [`apply_delta_ctx`](crate::codec::apply_delta_ctx)). Returns
/// also each file's context for the next delta (`Some` for `compact2`
/// deltas).
#[allow(clippy::type_complexity)]
pub fn apply_in_place_all_ctx(
    targets: &mut [Target<'_>],
    deltas: &[&[u8]],
    contexts: &[Option<&Context>],
    opts: &InPlaceOptions,
) -> Result<(Vec<InPlaceReport>, Vec<Option<Context>>)> {
    in_place(targets, (deltas, contexts), opts.keep_bytes, Then::Write)
        .map(|(reports, _, next)| (reports, next))
}

/// The verified, decoded changes of one version, made by
/// [`prepare_in_place_all`] and written by [`Prepared::commit`]: per changed
/// tensor, each block's changes (a position and the new word, `4 + wb`
/// bytes per change) and the reports the apply will give.
pub struct Prepared {
    reports: Vec<InPlaceReport>,
    tensors: Vec<PreparedTensor>,
    /// Each delta's context for the next delta (`compact2` deltas).
    contexts: Vec<Option<Context>>,
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
        self.commit_ctx(targets).map(|(reports, _)| reports)
    }

    /// [`Prepared::commit`], returning also each file's context for the next
    /// delta (see [`prepare_in_place_all_ctx`]).
    #[allow(clippy::type_complexity)]
    pub fn commit_ctx(
        self,
        targets: &mut [Target<'_>],
    ) -> Result<(Vec<InPlaceReport>, Vec<Option<Context>>)> {
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
        Ok((self.reports, self.contexts))
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
    prepare_in_place_all_ctx(targets, deltas, &[])
}

/// [`prepare_in_place_all`] with contexts, as [`apply_in_place_all_ctx`];
/// [`Prepared::commit_ctx`] returns the contexts for the next delta.
pub fn prepare_in_place_all_ctx(
    targets: &mut [Target<'_>],
    deltas: &[&[u8]],
    contexts: &[Option<&Context>],
) -> Result<Prepared> {
    in_place(targets, (deltas, contexts), usize::MAX, Then::Keep).map(
        |(reports, tensors, contexts)| Prepared {
            reports,
            tensors,
            contexts,
        },
    )
}

/// What [`in_place`] does after verifying.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Write (the verify-then-write apply).
    Write,
    /// Keep every decoded change for [`Prepared::commit`].
    Keep,
}

#[allow(clippy::type_complexity)]
fn in_place(
    targets: &mut [Target<'_>],
    (deltas, contexts): (&[&[u8]], &[Option<&Context>]),
    keep_bytes: usize,
    then: Then,
) -> Result<(
    Vec<InPlaceReport>,
    Vec<PreparedTensor>,
    Vec<Option<Context>>,
)> {
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
        let context = contexts.get(d).copied().flatten();
        let js = weightcast_jobs(header, st, context, |name| {
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
    // Each compact2 delta's context for the next delta: its jobs' members.
    let mut next: Vec<Option<Context>> = opened
        .iter()
        .map(|(h, _)| {
            (h.encoding == crate::format::Encoding::Compact2).then(|| {
                Context::new(
                    h.model_version,
                    (h.base_digest.expect("deltas have a base digest"), h.digest),
                    Default::default(),
                )
            })
        })
        .collect();
    for ((j, v), &d) in jobs.iter().zip(&mut verified).zip(&owner) {
        if let (Some(c), Payload::Compact { block_words, .. }) = (&mut next[d], &j.payload) {
            c.tensors.insert(
                j.name.clone(),
                TensorContext {
                    block_words: *block_words,
                    blocks: std::mem::take(&mut v.members),
                },
            );
            // Summed block by block as the members were written.
            c.id.checksum = c.id.checksum.wrapping_add(v.checksum);
        }
    }
    if then == Then::Write {
        return Ok((reports, Vec::new(), next));
    }
    let prepared = work
        .iter()
        .zip(verified)
        .map(|(w, v)| keep_all(w, v))
        .collect::<Result<Vec<_>>>()?;
    Ok((reports, prepared, next))
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
    /// `compact2`: per block, its members for the next context, and their
    /// checksum (see [`compact::context::block_checksum`]).
    members: Vec<Vec<compact::context::Member>>,
    checksum: u64,
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
            let seed = compact::context::tensor_seed(&w.job.name);
            let per_block = w.blocks(|b, block, ctx, blk| {
                debug_assert_eq!(b, block.index);
                let mut kept = keep_room(block, budget);
                let mut m = NextMembers::new(seed);
                let record = block.context.is_some().then_some(&mut m);
                // The checksum is summed as the members are written.
                let r = compact::verify_block(block, ctx, blk, kept.as_mut(), record);
                (r, (kept, (m.members, m.checksum)))
            });
            let (tally, rest) = Tally::blocks(per_block, blocks);
            let (kept, members): (Vec<_>, Vec<_>) = rest.into_iter().unzip();
            let (members, sums): (Vec<_>, Vec<u64>) = members.into_iter().unzip();
            Verified {
                tally,
                kept,
                members,
                checksum: sums.into_iter().fold(0, u64::wrapping_add),
            }
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
