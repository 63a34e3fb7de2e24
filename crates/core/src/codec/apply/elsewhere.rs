//! Tensors that live elsewhere: positions out, old words in, new words out.

use super::trl::TrlRun;
use rayon::prelude::*;

use super::work::{check_expect, count_error};
use crate::codec::compact::{self, Block, Context, TensorContext, Value};
use crate::codec::parse::{Expect, Job, Local, Payload, open, weightcast_jobs};
use crate::digest::{ChangeBatch, Digest, LANES, TensorSeed};
use crate::dtype::{
    Dtype, KeyKind, byte_len, key_kind, load, parse_dtype, read_word, store, word_bytes,
};
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

/// Entries per part of a TRL payload's changes (resolved in parallel).
const TRL_PART: usize = 1 << 16;

/// A tensor's changes as [`Delta::changes`] decoded them: where they are
/// ([`Changes::positions`], to gather the old words wherever the tensor
/// lives) and how each new word follows from its old one.
#[derive(Debug)]
pub struct Changes {
    /// The tensor.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Changed word indices, ascending.
    pub positions: Positions,
    /// The changes by block (TRL: by stretch), in order.
    parts: Vec<Part>,
    seed: TensorSeed,
    expect: Option<Expect>,
}

/// One block's (or stretch's) decoded changes.
#[derive(Debug)]
struct Part {
    /// Positions, until they are moved into [`Changes::positions`].
    pos: Vec<u64>,
    /// Steps of the key, or new words (`raw`): the tensor's word width
    /// each, little-endian.
    values: Vec<u8>,
    /// Entries.
    len: usize,
    raw: bool,
    /// A raw word equal to the old one is refused (compact blocks list
    /// changed words only).
    must_change: bool,
}

impl Part {
    fn new(pos: Vec<u64>, values: Vec<u8>, raw: bool, must_change: bool) -> Part {
        Part {
            len: pos.len(),
            pos,
            values,
            raw,
            must_change,
        }
    }
}

/// The parts' positions as one array (each part's moved out), converted to
/// `u32` in parallel when the tensor is narrow enough.
fn concat_positions(parts: &mut [Part], narrow: bool, n: usize) -> Positions {
    fn fill<T: Send + Copy + Default>(
        parts: &mut [Part],
        n: usize,
        conv: impl Fn(u64) -> T + Sync,
    ) -> Vec<T> {
        let mut out = vec![T::default(); n];
        let mut rest = &mut out[..];
        let mut pieces = Vec::with_capacity(parts.len());
        for p in parts.iter_mut() {
            let (head, tail) = rest.split_at_mut(p.pos.len());
            pieces.push((head, std::mem::take(&mut p.pos)));
            rest = tail;
        }
        pieces.into_par_iter().for_each(|(dst, src)| {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = conv(s);
            }
        });
        out
    }
    if narrow {
        Positions::U32(fill(parts, n, |i| i as u32))
    } else {
        Positions::U64(fill(parts, n, |i| i))
    }
}

fn positions_differ(tensor: &str, j: usize) -> Error {
    Error::tensor(
        tensor,
        format!(
            "the positions differ from the delta's at entry {j}: pass what changed_positions \
             returned"
        ),
    )
}

impl Changes {
    /// Number of changes.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// The tensor's digests before and after the delta (from its header).
    pub fn digests(&self) -> Option<(Digest, Digest)> {
        self.expect.map(|x| (x.base, x.digest))
    }

    /// Bytes per word.
    pub fn word_bytes(&self) -> usize {
        word_bytes(self.dtype)
    }

    /// Bytes of the old (and of the new) words: `len × word_bytes`.
    pub fn new_bytes(&self) -> usize {
        self.len() * self.word_bytes()
    }

    /// Bytes held: positions, decoded values.
    pub fn held_bytes(&self) -> usize {
        let pw = match self.positions {
            Positions::U32(_) => 4,
            Positions::U64(_) => 8,
        };
        self.len() * (pw + self.word_bytes())
    }

    /// Writes into `new` the new word of every change given the old words
    /// at [`Changes::positions`] (`old`: `word_bytes` each, little-endian,
    /// in position order), in parallel. Verifies as
    /// [`apply_in_place`](crate::codec::apply_in_place) does before anyone
    /// writes the tensor: the sum of the digest changes must equal `digest −
    /// base_digest` ([`Error::WrongBase`] otherwise), so every old word must
    /// be the base's. `new` holds partial results on error.
    pub fn resolve(&self, old: &[u8], new: &mut [u8]) -> Result<()> {
        let (wb, n) = (self.word_bytes(), self.len());
        for (what, len) in [("old", old.len()), ("new", new.len())] {
            if len != n * wb {
                return Err(Error::tensor(
                    &self.name,
                    format!(
                        "{len} bytes of {what} values; {n} positions of {wb}-byte words need {}",
                        n * wb
                    ),
                ));
            }
        }
        let kind = key_kind(self.dtype);
        // Each part's slices of the old and new words, and its first entry.
        let mut pieces = Vec::with_capacity(self.parts.len());
        let (mut o, mut w, mut first) = (old, &mut new[..], 0usize);
        for p in &self.parts {
            let k = p.len * wb;
            let (oh, ot) = o.split_at(k);
            let (wh, wt) = std::mem::take(&mut w).split_at_mut(k);
            pieces.push((p, oh, wh, first));
            (o, w, first) = (ot, wt, first + p.len);
        }
        let sums: Vec<u64> = pieces
            .into_par_iter()
            .map(|(p, old, new, first)| {
                crate::with_word_width!(wb, W => self.resolve_part::<W>(p, kind, old, new, first))
            })
            .collect::<Result<_>>()?;
        let dig = sums.into_iter().fold(0u64, u64::wrapping_add);
        check_expect(&self.name, self.expect, n as u64, dig)
    }

    fn resolve_part<const W: usize>(
        &self,
        p: &Part,
        kind: KeyKind,
        old: &[u8],
        new: &mut [u8],
        first: usize,
    ) -> Result<u64> {
        let (mut dig, mut batch) = (0u64, ChangeBatch::default());
        for k in 0..p.len {
            let (j, v) = (first + k, load::<W>(&p.values, k));
            let i = match &self.positions {
                Positions::U32(v) => v[j] as u64,
                Positions::U64(v) => v[j],
            };
            let a = load::<W>(old, k);
            let b = if p.raw {
                v
            } else {
                Value::Step(v).resolve(kind, W, a)
            };
            if p.raw && p.must_change && a == b {
                return Err(Error::tensor(
                    &self.name,
                    format!("lists element {i} as changed but it is not"),
                ));
            }
            store::<W>(new, k, b);
            let lane = k % LANES;
            (batch.index[lane], batch.old[lane], batch.new[lane]) = (i, a, b);
            if lane == LANES - 1 {
                dig = dig.wrapping_add(self.seed.change_sum(&batch));
                batch = ChangeBatch::default();
            }
        }
        Ok(dig.wrapping_add(self.seed.change_sum(&batch)))
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

    /// Every change of `tensor`, decoded once (blocks in parallel) and
    /// checked as an apply checks the payload: the positions to gather
    /// wherever the tensor lives, and what [`Changes::resolve`] needs to
    /// turn the old words there into the new ones.
    pub fn changes(&self, tensor: &str) -> Result<Changes> {
        let (job, dtype, words) = self.find(tensor)?;
        let wb = word_bytes(dtype);
        let narrow = words as u64 <= 1 << 32;
        let mut parts: Vec<Part> = match &job.payload {
            Payload::Trl { indices, values } => {
                let run = TrlRun {
                    name: tensor,
                    indices: *indices,
                    values,
                    seed: TensorSeed(0),
                };
                crate::with_word_width!(wb, W => run.check_len::<W>())?;
                let mut pos = Vec::with_capacity(indices.len());
                run.positions(words, |_, i| pos.push(i as u64))?;
                // One part per stretch of entries, so resolving runs in parallel.
                pos.chunks(TRL_PART)
                    .zip(values.chunks(TRL_PART * wb))
                    .map(|(p, v)| Part::new(p.to_vec(), v.to_vec(), true, false))
                    .collect()
            }
            Payload::Compact {
                block_words,
                blocks,
                streams,
                context,
            } => {
                let chunk = (*block_words).min(words as u64);
                (0..blocks.len())
                    .into_par_iter()
                    .map(|b| -> Result<Part> {
                        let (entry, first) = (&blocks[b], b as u64 * chunk);
                        let block = Block {
                            tensor,
                            index: b,
                            entry,
                            stream: streams[b],
                            wb,
                            words: chunk.min(words as u64 - first),
                            context: context.map(|c| c.block(b)),
                        };
                        let cap = usize::try_from(entry.changes)
                            .unwrap_or(0)
                            .min(block.words as usize);
                        let (mut pos, mut vals) =
                            (Vec::with_capacity(cap), Vec::with_capacity(cap * wb));
                        let mut raw = false;
                        compact::decode_block(&block, None, |i, v| {
                            pos.push(first + i);
                            let v = match v {
                                Value::Raw(w) => {
                                    raw = true;
                                    w
                                }
                                Value::Step(s) => s,
                            };
                            vals.extend_from_slice(&v.to_le_bytes()[..wb]);
                            Ok(())
                        })?;
                        Ok(Part::new(pos, vals, raw, true))
                    })
                    .collect::<Result<_>>()?
            }
        };
        let n: usize = parts.iter().map(|p| p.len).sum();
        let expect = job.expect.expect("weightcast jobs carry digests");
        if n as u64 != expect.changed {
            return Err(count_error(tensor, expect.changed, n as u64));
        }
        let positions = concat_positions(&mut parts, narrow, n);
        Ok(Changes {
            name: tensor.to_string(),
            dtype,
            positions,
            parts,
            seed: TensorSeed::new(tensor, dtype, &self.shape_of(tensor)),
            expect: job.expect,
        })
    }

    /// The word indices `tensor`'s delta changes, ascending (the payload is
    /// decoded and checked as an apply checks it).
    pub fn changed_positions(&self, tensor: &str) -> Result<Positions> {
        Ok(self.changes(tensor)?.positions)
    }

    /// The new words of `tensor` at `positions` (what
    /// [`Delta::changed_positions`] returned), given the old words there
    /// (`old_values`: `wb` bytes each, little-endian, in position order), as
    /// `wb`-byte little-endian words in the same order. Verifies as
    /// [`apply_in_place`](crate::codec::apply_in_place) does: the sum of the
    /// digest changes must equal `digest − base_digest` ([`Error::WrongBase`]
    /// otherwise), so every old word must be the base's.
    /// [`Delta::changes`] and [`Changes::resolve`] do the same in one decode.
    pub fn resolve(
        &self,
        tensor: &str,
        positions: &Positions,
        old_values: &[u8],
    ) -> Result<Vec<u8>> {
        let changes = self.changes(tensor)?;
        let n = positions.len().min(changes.positions.len());
        if let Some(j) = (0..n).find(|&j| positions.get(j) != changes.positions.get(j)) {
            return Err(positions_differ(tensor, j));
        }
        if positions.len() != changes.positions.len() {
            return Err(positions_differ(tensor, n));
        }
        let mut news = vec![0u8; changes.new_bytes()];
        changes.resolve(old_values, &mut news)?;
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
        // Other encodings make no context: known from the header alone,
        // without hashing or decoding the payload.
        if let (_, Some(h)) = crate::codec::inspect(delta)?
            && h.encoding != crate::format::Encoding::Compact2
        {
            return Ok(None);
        }
        let d = Delta::parse_ctx(delta, context)?;
        let h = d.header();
        if h.encoding != crate::format::Encoding::Compact2 {
            return Ok(None);
        }
        // Each tensor's changes (blocks and tensors in parallel), block by
        // block as members.
        let tensors = d
            .jobs
            .par_iter()
            .filter_map(|(job, dtype, words)| match &job.payload {
                Payload::Compact { block_words, .. } => Some((job, *dtype, *words, *block_words)),
                Payload::Trl { .. } => None,
            })
            .map(|(job, dtype, words, block_words)| {
                let c = d.changes(&job.name)?;
                let (wb, chunk) = (word_bytes(dtype), block_words.min(words as u64).max(1));
                let mut first = 0usize;
                let blocks = c
                    .parts
                    .iter()
                    .map(|p| {
                        let members = (0..p.len)
                            .map(|k| {
                                let v = read_word(&p.values, wb, k);
                                let i = c.positions.get(first + k).unwrap_or(0);
                                let v = if p.raw { Value::Raw(v) } else { Value::Step(v) };
                                compact::entry_member(i % chunk, v, wb)
                            })
                            .collect();
                        first += p.len;
                        members
                    })
                    .collect();
                Ok((
                    job.name.clone(),
                    TensorContext {
                        block_words,
                        blocks,
                    },
                ))
            })
            .collect::<Result<std::collections::BTreeMap<_, _>>>()?;
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
        let part = |pos: Vec<u64>| Part::new(pos.clone(), vec![0; 2 * pos.len()], false, true);
        let p = concat_positions(&mut [part(vec![1]), part(vec![]), part(vec![5])], true, 2);
        assert_eq!(p, Positions::U32(vec![1, 5]));
        assert_eq!((p.len(), p.get(1), p.get(2)), (2, Some(5), None));
        let big = concat_positions(&mut [part(vec![1 << 32])], false, 1);
        assert_eq!(big.get(0), Some(1 << 32));
        assert!(Positions::U64(vec![]).is_empty());
    }
}
