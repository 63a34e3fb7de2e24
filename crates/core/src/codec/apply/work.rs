//! What every apply strategy shares: a job with the words it changes
//! ([`Work`]), the tally of a pass, and the checks of a pass's result
//! against the header.

use rayon::prelude::*;

use super::trl::TrlRun;
use crate::codec::compact::{Block, Ctx};
use crate::codec::parse::{Expect, Job, Payload};
use crate::codec::trl::Indices;
use crate::digest::{Digest, TensorSeed};
use crate::dtype::{Dtype, key_kind, word_bytes};
use crate::error::{Error, Result};

/// A job with the words it changes.
pub(super) struct Work<'j, 'a, 'd> {
    pub(super) job: &'j Job<'a>,
    pub(super) data: &'d mut [u8],
    pub(super) dtype: Dtype,
    pub(super) seed: TensorSeed,
}

impl Work<'_, '_, '_> {
    /// The job's compact blocks: each block's context and words, with
    /// `f(block, ctx, words)` run on every block in parallel (none for a
    /// TRL job).
    pub(super) fn blocks<T: Send>(
        &mut self,
        f: impl Fn(usize, &Block<'_>, Ctx, &mut [u8]) -> T + Sync + Send,
    ) -> Vec<T> {
        let job = self.job;
        let Payload::Compact {
            block_words,
            blocks,
            streams,
            context,
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
                    context: context.map(|c| c.block(b)),
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
    pub(super) fn trl<const CHECK: bool, const WRITE: bool>(
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
pub(super) struct Tally {
    pub(super) changed: u64,
    pub(super) dig: u64,
    pub(super) err: Option<Error>,
}

impl Tally {
    pub(super) fn add(&mut self, r: Result<(u64, u64)>) {
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
    pub(super) fn blocks<T>(
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

/// The header's change count against what the payload held.
pub(super) fn count_error(name: &str, want: u64, got: u64) -> Error {
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
pub(super) fn check_change(job: &Job<'_>, changed: u64, dig: u64) -> Result<()> {
    check_expect(&job.name, job.expect, changed, dig)
}

/// [`check_change`] for a tensor `name` whose header said `expect`.
pub(super) fn check_expect(
    name: &str,
    expect: Option<Expect>,
    changed: u64,
    dig: u64,
) -> Result<()> {
    let Some(x) = expect else {
        return Ok(());
    };
    if changed != x.changed {
        return Err(count_error(name, x.changed, changed));
    }
    let want = x.digest.wrapping_sub(x.base).0;
    if dig != want {
        return Err(Error::WrongBase {
            scope: format!("tensor {name} (at the positions the delta changes)"),
            expected: x.base.to_string(),
            actual: x
                .base
                .wrapping_add(Digest(want.wrapping_sub(dig)))
                .to_string(),
        });
    }
    Ok(())
}
