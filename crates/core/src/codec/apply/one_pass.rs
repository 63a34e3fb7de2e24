//! One pass with undo: [`apply_delta`] on a `TensorSet`.

use std::collections::BTreeMap;

use rayon::prelude::*;
use safetensors::SafeTensors;
use serde::Serialize;

use super::trl::trl_undo;
use super::work::{Tally, Work, count_error};
use crate::codec::compact::{self, BlockUndo, Context, NextMembers, TensorContext};
use crate::codec::header::metadata_map;
use crate::codec::parse::{Job, Local, Payload, check_payload, foreign_trl_jobs, weightcast_jobs};
use crate::digest::{Digest, TensorSeed};
use crate::dtype::{Dtype, key_kind, word_bytes};
use crate::error::{Error, Result};
use crate::format::{Encoding, Header, Kind, keys};
use crate::tensors::TensorSet;

/// What an apply did.
#[derive(Clone, Debug, Serialize)]
pub struct ApplyReport {
    /// Version produced. For foreign TRL files, TRL's `model_version` key (its
    /// step, weightcast's version + 1), absent when the file has none.
    pub model_version: Option<u64>,
    /// Version the delta applied to (absent in foreign TRL files).
    pub base_version: Option<u64>,
    /// Encoding of the delta.
    pub encoding: Encoding,
    /// Changed words written.
    pub changed: u64,
    /// Names of the tensors that changed.
    pub changed_tensors: Vec<String>,
    /// Whether the result was checked against the publisher's digests. False
    /// only for foreign TRL files, which carry none.
    pub verified: bool,
}

/// Applies a delta object to `state`, verifying it; all-or-nothing.
///
/// Accepts weightcast deltas (`compact`, `trl`) and TRL `sparse_weight_patch`
/// files written by other tools (applied with full structural checks; `verified`
/// is false because they carry no digests).
pub fn apply_delta(state: &mut TensorSet, bytes: &[u8]) -> Result<ApplyReport> {
    apply_delta_with(state, bytes, None, false).map(|(r, _)| r)
}

/// [`apply_delta`] with a context (docs/format.md §6.3): `context` holds the
/// changes of the delta that produced `state` (what the previous call
/// returned; `None` after an anchor). A `compact2` delta made with context
/// is refused with [`Error::WrongContext`] unless `context` is the one it
/// was made against; any other delta does not use it. Returns also the
/// context for the next delta: this delta's changes for a `compact2` delta,
/// `None` for other encodings (after which the next delta is written
/// without context).
pub fn apply_delta_ctx(
    state: &mut TensorSet,
    bytes: &[u8],
    context: Option<&Context>,
) -> Result<(ApplyReport, Option<Context>)> {
    apply_delta_with(state, bytes, context, true)
}

fn apply_delta_with(
    state: &mut TensorSet,
    bytes: &[u8],
    context: Option<&Context>,
    want_context: bool,
) -> Result<(ApplyReport, Option<Context>)> {
    let (n, map) = metadata_map(bytes)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Container(e.to_string()))?;
    if !state.has_digests() {
        state.compute_digests();
    }
    let header = Header::from_metadata(&map)?;
    let (jobs, header) = match header {
        Some(h) if h.kind == Kind::Delta => {
            check_payload(&h, &bytes[8 + n..])?;
            if h.tensor_count != state.len() as u64 {
                return Err(Error::BaseMismatch(format!(
                    "tensor count differs: the delta's file has {} tensors, the local one {}",
                    h.tensor_count,
                    state.len()
                )));
            }
            let base = h.base_digest.expect("deltas have a base digest");
            if base != state.digest() {
                return Err(Error::WrongBase {
                    scope: "file".into(),
                    expected: base.to_string(),
                    actual: state.digest().to_string(),
                });
            }
            let local = |name: &str| {
                state.position(name).map(|idx| {
                    let t = &state.tensors()[idx];
                    Local {
                        idx,
                        dtype: t.dtype,
                        shape: &t.shape,
                        words: t.words(),
                        digest: Some(t.digest),
                    }
                })
            };
            (weightcast_jobs(&h, &st, context, local)?, Some(h))
        }
        Some(h) => {
            return Err(Error::metadata(
                keys::KIND,
                format!("object is an {:?}, not a delta", h.kind),
            ));
        }
        None => match (
            map.get("format").map(String::as_str),
            map.get("sparse").map(String::as_str),
        ) {
            (Some("sparse_weight_patch"), Some("True")) => {
                (foreign_trl_jobs(state, &map, &st)?, None)
            }
            _ => {
                return Err(Error::metadata(
                    keys::FORMAT,
                    "neither a weightcast delta nor a TRL sparse_weight_patch delta",
                ));
            }
        },
    };

    // One pass: decode, write in place, keep what undoes it; if anything fails
    // to decode or verify, every written word is put back.
    let want_context =
        want_context && header.as_ref().map(|h| h.encoding) == Some(Encoding::Compact2);
    // The metadata the delta carries is read before anything is written: a
    // malformed one refuses the delta whole.
    let carried = match (&header, map.get(keys::METADATA)) {
        (Some(_), Some(m)) => Some(carried_metadata(m)?),
        _ => None,
    };
    let (changed, new_digests, members) = apply_jobs(
        state,
        &jobs,
        header.as_ref().map(|h| h.digest),
        want_context,
    )?;
    let before = state.digest();
    for (j, d) in jobs.iter().zip(new_digests) {
        state.set_digest(j.idx, d);
    }
    if let Some(m) = carried {
        state.set_metadata(m);
    }
    let encoding = header.as_ref().map_or(Encoding::Trl, |h| h.encoding);
    let next = match (&header, want_context) {
        (Some(h), true) => {
            let mut checksum = 0u64;
            let tensors = jobs
                .iter()
                .zip(members)
                .filter_map(|(j, (m, sum))| {
                    let Payload::Compact { block_words, .. } = &j.payload else {
                        return None;
                    };
                    checksum = checksum.wrapping_add(sum);
                    Some((
                        j.name.clone(),
                        TensorContext {
                            block_words: *block_words,
                            blocks: m,
                        },
                    ))
                })
                .collect();
            // The checksum was summed block by block as the members were
            // written (`apply_job`), not in a second pass over them.
            Some(Context::with_checksum(
                h.model_version,
                (before, state.digest()),
                tensors,
                checksum,
            ))
        }
        _ => None,
    };
    let report = ApplyReport {
        model_version: header
            .as_ref()
            .map(|h| h.model_version)
            .or_else(|| map.get("model_version").and_then(|v| v.parse().ok())),
        base_version: header.as_ref().and_then(|h| h.base_version),
        encoding,
        changed,
        changed_tensors: jobs.iter().map(|j| j.name.clone()).collect(),
        verified: header.is_some(),
    };
    Ok((report, next))
}

/// The `__metadata__` a delta carries for the version it produces
/// ([`keys::METADATA`]): a JSON object of strings, `weightcast.*` keys left
/// out.
pub fn carried_metadata(json: &str) -> Result<BTreeMap<String, String>> {
    let m: BTreeMap<String, String> = serde_json::from_str(json).map_err(|e| {
        Error::metadata(keys::METADATA, format!("not a JSON object of strings: {e}"))
    })?;
    Ok(m.into_iter()
        .filter(|(k, _)| !k.starts_with("weightcast."))
        .collect())
}

/// A job's blocks' members for the next context, and their checksum.
type JobMembers = (Vec<Vec<compact::context::Member>>, u64);

/// What applying one tensor in one pass did: enough to verify it or to undo it.
#[derive(Default)]
struct Outcome {
    tally: Tally,
    /// TRL: the overwritten old words.
    undo: Vec<u8>,
    /// Compact: what each block wrote.
    block_undo: Vec<BlockUndo>,
    /// Compact, when asked: each block's members for the next context, and
    /// their checksum (see [`compact::context::block_checksum`]).
    members: Vec<Vec<compact::context::Member>>,
    checksum: u64,
}

/// Applies `jobs` to `state` in one pass, checks every count and digest
/// against the header (`want_file`: its file digest, for weightcast deltas)
/// and, on any failure, restores every word written. Returns the changed
/// words, each job's new tensor digest and (`members`: when asked) each
/// job's blocks' members for the next context.
#[allow(clippy::type_complexity)]
fn apply_jobs(
    state: &mut TensorSet,
    jobs: &[Job<'_>],
    want_file: Option<Digest>,
    members: bool,
) -> Result<(u64, Vec<Digest>, Vec<JobMembers>)> {
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
    let mut outcomes: Vec<Outcome> = work.par_iter_mut().map(|w| apply_job(w, members)).collect();
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
    let members = outcomes
        .into_iter()
        .map(|o| (o.members, o.checksum))
        .collect();
    Ok((changed, new_digests, members))
}

fn apply_job(w: &mut Work<'_, '_, '_>, members: bool) -> Outcome {
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
            let seed = compact::context::tensor_seed(&w.job.name);
            let per_block = w.blocks(|b, block, ctx, blk| {
                debug_assert_eq!(b, block.index);
                let mut undo = BlockUndo::default();
                let mut m = NextMembers::new(seed);
                let r = if members {
                    // The checksum is summed as the members are written.
                    compact::apply_block_members(block, ctx, blk, &mut undo, &mut m)
                } else {
                    compact::apply_block(block, ctx, blk, &mut undo)
                };
                (r, (undo, (m.members, m.checksum)))
            });
            let (tally, rest) = Tally::blocks(per_block, blocks);
            let (block_undo, members): (Vec<_>, Vec<_>) = rest.into_iter().unzip();
            let (members, sums): (Vec<_>, Vec<u64>) = members.into_iter().unzip();
            Outcome {
                tally,
                undo: Vec::new(),
                block_undo,
                members,
                checksum: sums.into_iter().fold(0, u64::wrapping_add),
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
