//! One pass with undo: `apply_delta` on a `TensorSet`.

use rayon::prelude::*;

use super::trl::trl_undo;
use super::work::{Tally, Work, count_error};
use crate::codec::compact::{self, BlockUndo};
use crate::codec::parse::{Job, Payload};
use crate::digest::{Digest, TensorSeed};
use crate::dtype::{Dtype, key_kind, word_bytes};
use crate::error::{Error, Result};
use crate::tensors::TensorSet;

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
pub(in crate::codec) fn apply_jobs(
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
