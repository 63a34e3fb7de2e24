//! Tensors that live elsewhere: positions out, old words in, new words out.

use super::trl::TrlRun;
use super::work::{check_change, count_error};
use crate::codec::compact::{self, Block, Context, TensorContext, Value};
use crate::codec::parse::{Job, Local, Payload, open, weightcast_jobs};
use crate::digest::{ChangeBatch, LANES, TensorSeed};
use crate::dtype::{Dtype, byte_len, key_kind, parse_dtype, read_word, word_bytes};
use crate::error::{Error, Result};
use crate::format::Header;

/// A verified, parsed weightcast delta, for callers whose tensors live where
/// weightcast cannot write them (a GPU): [`Delta::changed_positions`] tells
/// which words a tensor's delta changes; the caller gathers their old values
/// there and [`Delta::resolve`] turns them into the new values, checking the
/// digest change as [`apply_in_place`](crate::codec::apply_in_place) does.
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
        Delta::parse_ctx(bytes, None)
    }

    /// [`Delta::parse`] with a context (docs/format.md §6.3): the changes of
    /// the delta that produced the tensors' state (see
    /// [`apply_delta_ctx`](crate::codec::apply_delta_ctx)); a `compact2`
    /// delta made with context is refused ([`Error::WrongContext`]) unless it
    /// is the one it was made against. [`Context::of_delta`] makes the
    /// context for the next delta.
    pub fn parse_ctx(bytes: &'a [u8], context: Option<&'a Context>) -> Result<Delta<'a>> {
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
        let jobs = weightcast_jobs(&header, &st, context, |name| {
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
                context,
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
                        context: context.map(|c| c.block(b)),
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
    /// [`apply_in_place`](crate::codec::apply_in_place) does: the sum of the
    /// digest changes must equal `digest − base_digest` ([`Error::WrongBase`]
    /// otherwise), so every old word must be the base's.
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

impl Context {
    /// The context a delta makes for the next one (its changes, see
    /// docs/format.md §6.3), decoded from the delta itself: no tensor is
    /// read or written, so a reader that restarts after applying `delta`
    /// rebuilds its context from the object. `context` is the one `delta`
    /// was made against (as for [`Delta::parse_ctx`]). `None` for deltas
    /// that are not `compact2` (the next delta is then made without
    /// context).
    pub fn of_delta(delta: &[u8], context: Option<&Context>) -> Result<Option<Context>> {
        let d = Delta::parse_ctx(delta, context)?;
        let h = d.header();
        if h.encoding != crate::format::Encoding::Compact2 {
            return Ok(None);
        }
        let mut tensors = std::collections::BTreeMap::new();
        for (job, dtype, words) in &d.jobs {
            let Payload::Compact { block_words, .. } = &job.payload else {
                continue;
            };
            let wb = word_bytes(*dtype);
            let chunk = (*block_words).min(*words as u64).max(1);
            let mut blocks: Vec<Vec<compact::context::Member>> =
                vec![Vec::new(); (*words as u64).div_ceil(chunk) as usize];
            d.entries(&job.name, |i, v| {
                let b = (i / chunk) as usize;
                blocks[b].push(compact::entry_member(i % chunk, v, wb));
                Ok(())
            })?;
            tensors.insert(
                job.name.clone(),
                TensorContext {
                    block_words: *block_words,
                    blocks,
                },
            );
        }
        let base = h.base_digest.expect("deltas have a base digest");
        Ok(Some(Context::new(
            h.model_version,
            (base, h.digest),
            tensors,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
